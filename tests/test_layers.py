"""The package's layers import one way: a module imports only its own layer and the ones below.

Every import counts: at module level, inside functions (lazy), under ``if TYPE_CHECKING:`` (an
annotation naming a higher layer is still a dependency on it) and ``importlib.import_module`` /
``__import__`` of a literal name.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import birdzarr

PACKAGE = pathlib.Path(birdzarr.__file__).parent

# lowest first; a module may import modules of its own layer and of every layer before it
LAYERS: list[tuple[str, ...]] = [
    ("birdzarr._checks", "birdzarr._errors", "birdzarr._progress", "birdzarr._version"),  # shared by all
    ("birdzarr.format",),  # the spec: names, device table, codecs, checksums
    ("birdzarr.storage",),  # locations, retries, fetchers, the chunk cache, the writer lock
    ("birdzarr.store",),  # the read-only handle and chunk reading
    ("birdzarr.explore",),  # summaries, views, plots, statistics over the handle's read interface
    ("birdzarr.convert",),  # CSV / Parquet -> store, append
    ("birdzarr.maintenance",),  # verify, repair, copy
    ("birdzarr.loader",),  # the torch dataset: sampling, pools, resident mode, hand-off
    ("birdzarr.demo",),  # generated data and the demo
    ("birdzarr",),  # the public API (birdzarr/__init__.py)
    ("birdzarr.cli",),  # the command line, on top of the public API
]


def _layer(module: str) -> int:
    best, found = -1, -1
    for number, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), number
    assert found >= 0, f"{module} is in no layer: add it to LAYERS"
    return found


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) of every birdzarr import, wherever it stands: module level,
    functions, ``if TYPE_CHECKING:`` blocks, and literal ``importlib.import_module``/``__import__``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("birdzarr")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if not name.startswith("birdzarr"):
                continue
            if name == "birdzarr":  # `from birdzarr import x`: x may be a subpackage
                found += [(node.lineno, f"birdzarr.{a.name}" if (PACKAGE / a.name).exists() or
                           (PACKAGE / f"{a.name}.py").exists() else "birdzarr") for a in node.names]
            else:
                found.append((node.lineno, name))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = ast.unparse(node.func)
            target = node.args[0].value
            if (called.endswith("import_module") or called == "__import__") and isinstance(target, str) \
                    and target.startswith("birdzarr"):
                found.append((node.lineno, target))
    return found


def _upward(source: str, module: str, is_package: bool = False) -> list[str]:
    mine = _layer(module)
    return [
        f"line {line}: {imported} (layer {_layer(imported)} > {mine})"
        for line, imported in _imports(ast.parse(source), module, is_package)
        if _layer(imported) > mine
    ]


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_no_module_imports_a_higher_layer(path: pathlib.Path) -> None:
    module = _module_name(path)
    upward = _upward(path.read_text(), module, path.name == "__init__.py")
    assert not upward, f"{module} imports a higher layer: " + "; ".join(upward)


@pytest.mark.parametrize("source", [
    "from birdzarr.explore._stats import StoreStats",
    "import birdzarr.explore",
    "from birdzarr import explore",
    "def f():\n    from birdzarr.explore._html import text_repr\n    return text_repr",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from birdzarr.explore._stats import StoreStats",
    "import typing\nif typing.TYPE_CHECKING:\n    import birdzarr.explore._plots",
    "import importlib\ndef f():\n    return importlib.import_module('birdzarr.explore._xarray')",
    "def f():\n    return __import__('birdzarr.explore')",
], ids=["top", "import", "from-package", "lazy", "type-checking", "typing.type-checking", "import_module",
        "__import__"])
def test_every_kind_of_upward_import_is_caught(source: str) -> None:
    """The check itself: store/ importing explore/ in any of these ways is refused."""
    upward = _upward(source, "birdzarr.store._handle")
    assert len(upward) == 1 and "birdzarr.explore" in upward[0], upward


def test_exploration_sits_above_the_handle() -> None:
    """The store handle satisfies exploration's read Protocol; ``import birdzarr`` attaches the
    exploration functions as methods, so ``store.plot_device(...)`` is the function."""
    from birdzarr import explore

    assert _layer("birdzarr.explore") > _layer("birdzarr.store")
    for name in ("to_xarray", "plot_window", "plot_device", "stats"):
        assert getattr(birdzarr.Store, name) is getattr(explore, name)
    assert birdzarr.Store.__repr__ is not object.__repr__


def test_a_store_satisfies_the_read_protocol(small_store: birdzarr.Store) -> None:
    from birdzarr.explore import ReadableStore

    assert isinstance(small_store, ReadableStore)
    assert repr(small_store).startswith(f"<birdzarr.Store {small_store.url}: ")
    assert "\n  format   birdzarr format v" in repr(small_store)  # the summary, attached from explore


def test_every_layer_exists_and_nothing_sits_flat_at_the_top() -> None:
    flat = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert flat == ["_checks.py", "_errors.py", "_progress.py", "_version.py"]
    for prefixes in LAYERS[1:-2]:
        assert (PACKAGE / prefixes[0].split(".")[1] / "__init__.py").exists(), prefixes


def test_the_public_api_is_complete() -> None:
    """Everything users and the docs call is exported, with every error class."""
    import inspect

    from birdzarr import _errors

    errors = {name for name, obj in vars(_errors).items() if inspect.isclass(obj)
              and issubclass(obj, (Exception, Warning)) and obj.__module__ == _errors.__name__}
    assert errors <= set(birdzarr.__all__), sorted(errors - set(birdzarr.__all__))
    for name in ("verify", "repair", "copy", "attach_cache", "StoreStats", "VerifyResult", "open_store",
                 "convert", "append", "WindowDataset", "Store", "generate_demo"):
        assert name in birdzarr.__all__, name
        assert getattr(birdzarr, name) is not None
