"""A store whose metadata is damaged (a root or array zarr.json truncated, empty, binary, valid
JSON of the wrong shape, or missing) is refused by every command with the same one line and exit
2, and by ``open_store`` with ``NotAStoreError``; nothing in the store is changed."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Callable

import pytest

import birdzarr
from birdzarr._errors import NotAStoreError
from birdzarr.cli import main
from birdzarr.maintenance._repair import repair

RESTORE = "restore that file from a copy of the store, or convert the store again from its sources."


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[:30])  # as `head -c 30` leaves it


def _not_a_group(store: pathlib.Path) -> str:
    return (f"{store} is not a Zarr v3 group (its zarr.json is not a group's metadata). If it was a "
            f"birdzarr store, its zarr.json is damaged: {RESTORE}")


def _not_json(store: pathlib.Path, name: str | None) -> str:
    if name is None:
        return f"{store}/zarr.json is not valid JSON: the store's root metadata is damaged; {RESTORE}"
    return f"{store}/{name}/zarr.json is not valid JSON: the metadata of array '{name}' is damaged; {RESTORE}"


def _missing(store: pathlib.Path, name: str) -> str:
    return (f"{store}: array '{name}' is missing (no {name}/zarr.json): the store is damaged; restore "
            "the array from a copy of the store, or convert the store again from its sources.")


def _windows(store: pathlib.Path) -> str:
    """The array holding the windows' values: ``gimu`` (format 1), ``gimu_codes`` (format 2; the
    test runs on the default format). A removed one is recognised by its dictionaries left behind."""
    return "gimu_codes" if (store / "dict_values").exists() else "gimu"


# (id, damage, expected line)
DAMAGES: list[tuple[str, Callable[[pathlib.Path], None], Callable[[pathlib.Path], str]]] = [
    ("root-list", lambda s: (s / "zarr.json").write_text("[]"), _not_a_group),
    ("root-string", lambda s: (s / "zarr.json").write_text('"x"'), _not_a_group),
    ("root-empty-object", lambda s: (s / "zarr.json").write_text("{}"), _not_a_group),
    ("root-attributes-list", lambda s: (s / "zarr.json").write_text(
        '{"zarr_format": 3, "node_type": "group", "attributes": []}'), _not_a_group),
    ("root-truncated", lambda s: _truncate(s / "zarr.json"), lambda s: _not_json(s, None)),
    ("root-empty", lambda s: (s / "zarr.json").write_bytes(b""), lambda s: _not_json(s, None)),
    ("root-binary", lambda s: (s / "zarr.json").write_bytes(b"\xff\xfe\x00"), lambda s: _not_json(s, None)),
    ("gimu-truncated", lambda s: _truncate(s / _windows(s) / "zarr.json"),
     lambda s: _not_json(s, _windows(s))),
    ("label-binary", lambda s: (s / "label" / "zarr.json").write_bytes(b"\xff\xfe\x00"),
     lambda s: _not_json(s, "label")),
    ("gimu-list", lambda s: (s / _windows(s) / "zarr.json").write_text("[]"),
     lambda s: f"{s}/{_windows(s)}/zarr.json is not the metadata of a Zarr v3 array (a JSON list, not an "
               f"object): the metadata of array '{_windows(s)}' is damaged; {RESTORE}"),
    ("timestamp-no-chunk-grid", lambda s: (s / "timestamp" / "zarr.json").write_text(
        '{"zarr_format": 3, "node_type": "array", "shape": [30000]}'),
     lambda s: f"{s}/timestamp/zarr.json is not the metadata of a Zarr v3 array ('chunk_grid' is "
               f"missing): the metadata of array 'timestamp' is damaged; {RESTORE}"),
    ("gimu-removed", lambda s: shutil.rmtree(s / _windows(s)), lambda s: _missing(s, _windows(s))),
    ("label-zarr-json-removed", lambda s: (s / "label" / "zarr.json").unlink(),
     lambda s: _missing(s, "label")),
]


def _commands(store: pathlib.Path, tmp_path: pathlib.Path, source: pathlib.Path) -> dict[str, list[str]]:
    return {
        "info": ["info", str(store)],
        "stats": ["stats", str(store)],
        "verify": ["verify", str(store), "--quiet"],
        "repair": ["repair", str(store)],
        "plot": ["plot", str(store), "--window", "0", "--out", str(tmp_path / "w.png")],
        "copy": ["copy", str(store), str(tmp_path / "out.zarr"), "--quiet"],
        "append": ["append", str(store), str(source), "--quiet"],
    }


def _tree(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize(("damage", "expected"), [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES])
def test_damaged_metadata_is_one_line_and_exit_2_in_every_command(
    store_copy: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
    parquet_source: tuple[pathlib.Path, dict],
    damage: Callable[[pathlib.Path], None], expected: Callable[[pathlib.Path], str],
) -> None:
    damage(store_copy)
    before = _tree(store_copy)
    with pytest.raises(NotAStoreError) as caught:
        birdzarr.open_store(store_copy)
    assert str(caught.value) == expected(store_copy)
    for command, argv in _commands(store_copy, tmp_path, parquet_source[0]).items():
        capsys.readouterr()
        assert main(argv) == 2, command
        err = capsys.readouterr().err
        assert err == f"birdzarr {command}: error: {expected(store_copy)}\n", command
        assert _tree(store_copy) == before, command  # nothing changed, repair included
    assert not (tmp_path / "out.zarr").exists()  # copy refused before writing anything
    # repair's Python API raises what open_store raises
    with pytest.raises(NotAStoreError) as caught:
        repair(store_copy)
    assert str(caught.value) == expected(store_copy)
    assert not (store_copy / ".birdzarr.lock").exists()  # refused before taking the lock
