"""The package's layers import one way: a module imports only its own layer and the ones below.

Imports under ``if TYPE_CHECKING:`` are annotations, not dependencies, and are not counted.
Function-level (lazy) imports are counted like any other.
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
    ("birdzarr.explore",),  # views and plots over anything with the store's read interface
    ("birdzarr.store",),  # the read-only handle and chunk reading
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


def _runtime_imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) of every birdzarr import outside ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_no_module_imports_a_higher_layer(path: pathlib.Path) -> None:
    module = _module_name(path)
    mine = _layer(module)
    tree = ast.parse(path.read_text(), filename=str(path))
    upward = [
        f"line {line}: {imported} (layer {_layer(imported)} > {mine})"
        for line, imported in _runtime_imports(tree, module, path.name == "__init__.py")
        if _layer(imported) > mine
    ]
    assert not upward, f"{module} imports a higher layer: " + "; ".join(upward)


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
