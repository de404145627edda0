"""birdzarr reads format-1 stores (tests/data/format1/, written by the last birdzarr that wrote
format 1) exactly: the windows, devices, times and labels recorded when they were written, and
those a format-2 conversion of the same source gives."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest

import birdzarr
from tests.format1_support import EXPECTED, NAMES, format1_copy, format1_source, rows


def _sha(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


@pytest.mark.parametrize("name", NAMES)
def test_a_format_1_store_reads_as_it_was_written(name: str, tmp_path: pathlib.Path) -> None:
    store = birdzarr.open_store(format1_copy(name, tmp_path))
    expected = EXPECTED[name]
    assert store.format_version == 1
    assert (len(store), len(store.devices), store.chunk_windows, store.shuffled) == (
        expected["windows"], expected["devices"], expected["chunk_windows"], expected["shuffled"])
    assert store.meta["layout"] == expected["layout"]
    assert {"windows": _sha(store.windows[:]), "device": _sha(store.window_devices[:]),
            "timestamp": _sha(store.timestamps[:]), "label": _sha(store.labels[:])} == expected["sha256"]
    result = birdzarr.verify(store.location.path)
    assert result.ok, result.problems
    assert result.chunks_checked > 0


@pytest.mark.parametrize("name", NAMES)
def test_a_format_1_store_holds_the_windows_format_2_writes_from_its_source(
    name: str, tmp_path: pathlib.Path
) -> None:
    old = birdzarr.open_store(format1_copy(name, tmp_path))
    source = format1_source(name, tmp_path)
    new = birdzarr.convert(source, tmp_path / "v2.zarr", progress=False, shuffle=old.shuffled,
                           chunk_windows=old.chunk_windows)
    assert new.format_version == 2
    for got, want in zip(rows(old), rows(new), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    if not old.shuffled and name != "appended.zarr":  # the same order, window by window
        assert np.array_equal(old.windows[:].view(np.uint32), new.windows[:].view(np.uint32))
        assert np.array_equal(old.window_devices[:], new.window_devices[:])


def test_the_raw_fixture_has_a_chunk_stored_raw_and_one_coded() -> None:
    """raw.zarr is what it claims: its first chunk holds more distinct imu_x values than a dict16
    dictionary can (stored as float32), its second a dictionary."""
    from numcodecs import Blosc

    from birdzarr.format._codec import parse_dict16
    from tests.format1_support import FORMAT1

    modes = []
    for chunk in ("0", "1"):
        data = (FORMAT1 / "raw.zarr" / "gimu" / "c" / chunk / "0" / "0").read_bytes()
        modes.append(parse_dict16(Blosc().decode(data[:-4])).raw is not None)  # the crc32c after it
    assert modes == [True, False]


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_append_refuses_a_format_1_store_in_one_line_naming_the_convert_command(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """birdzarr writes format 2 only: appending to a format-1 store (which would write format-1
    chunks into it) is refused before anything is read or written, naming the store's sources."""
    from birdzarr.cli import main

    path = format1_copy("appended.zarr", tmp_path)
    before = _files(path)
    more = format1_source("appended.zarr", tmp_path)
    store = birdzarr.open_store(path)
    sources = [store.meta["report"]["source"], store.meta["report"]["appends"][0]["source"]]
    expected = (f"{path} is a format-1 store, which birdzarr reads but no longer writes, so append cannot "
                f"change it: write a format-2 store from its source with `birdzarr convert {sources[0]} "
                f"{sources[1]} NEW_STORE` and use that one.")
    with pytest.raises(birdzarr.FormatVersionError) as caught:
        birdzarr.append(path, more, progress=False)
    assert str(caught.value) == expected
    capsys.readouterr()
    assert main(["append", str(path), str(more), "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"birdzarr append: error: {expected}\n")
    assert _files(path) == before


def test_repair_with_a_source_refuses_a_shuffled_format_1_store_naming_convert_shuffle(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from birdzarr.cli import main

    path = format1_copy("gdict16.zarr", tmp_path)
    before = _files(path)
    source = format1_source("gdict16.zarr", tmp_path)
    recorded = birdzarr.open_store(path).meta["report"]["source"]
    assert main(["repair", str(path), "--source", str(source)]) == 2
    out, err = capsys.readouterr()
    assert err == (f"birdzarr repair: error: {path} is a format-1 store, which birdzarr reads but no longer "
                   "writes, so repair --source cannot change it: write a format-2 store from its source "
                   f"with `birdzarr convert {recorded} NEW_STORE --shuffle` and use that one.\n")
    assert _files(path) == before


def test_repair_without_a_source_still_tidies_a_format_1_store(tmp_path: pathlib.Path) -> None:
    """Removing what an interrupted writer left writes nothing in format 1: it still runs, and
    the committed windows read as before."""
    path = format1_copy("dict16.zarr", tmp_path)
    stray = path / "gimu" / "c" / "9" / "0" / "0"  # a chunk past the committed windows
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"left by a killed writer")
    result = birdzarr.repair(path)
    assert not stray.exists() and result.actions
    assert _sha(birdzarr.open_store(path).windows[:]) == EXPECTED["dict16.zarr"]["sha256"]["windows"]
