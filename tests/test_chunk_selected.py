"""Reading only the selected windows of a chunk (ChunkReader.read_windows, which the streaming
loader's pools use): a version-2 chunk looks up only the selected windows' codes, packed at the
start of the buffer; the values are bit for bit the documented decode's (and the version-1
store's); a damaged code among the selected windows is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import birdzarr
from birdzarr._errors import CorruptChunkError
from birdzarr.format import _v2
from birdzarr.format._spec import N_CHANNELS, WINDOW_LENGTH
from tests.format1_support import format1_copy

pytest_plugins = ["format2_support"]  # its fixtures: v2_pair, v2_shuffled_pair

Pair = tuple[birdzarr.Store, birdzarr.Store]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def buffer(store: birdzarr.Store) -> np.ndarray:
    """A chunk buffer filled with a NaN payload no decode writes, to see what was written."""
    out = np.empty((store.chunk_windows, WINDOW_LENGTH, N_CHANNELS), np.float32)
    out.view(np.uint32)[...] = 0x7FC0DEAD
    return out


def selections(n: int) -> list[np.ndarray | None]:
    rng = np.random.default_rng(7)
    return [None, np.arange(n), np.flatnonzero(rng.random(n) < 0.1), np.array([0, n - 1]),
            np.array([n // 2]), np.arange(0, n, 3), np.arange(0)]


@pytest.mark.parametrize("chunk", [0, 13, 29])  # 29: the last chunk, partial (304 windows)
def test_a_version2_chunk_decodes_only_its_selected_windows_packed(v2_shuffled_pair: Pair,
                                                                   chunk: int) -> None:
    v1, v2 = v2_shuffled_pair
    reader = v2.reader
    first, stop = reader.chunk_span(chunk)
    expected = v1.windows[first:stop]
    codes, row, gps = reader.read_coded(chunk)
    dictionaries = reader.dictionaries()
    for selected in selections(stop - first):
        out = buffer(v2)
        rows = reader.read_windows(chunk, selected, out)
        wanted = np.arange(stop - first) if selected is None else selected
        assert np.array_equal(rows, np.arange(len(wanted)))  # packed, in stored order
        assert np.array_equal(bits(out[rows]), bits(expected[wanted]))
        documented = _v2.decode_reference(codes[wanted], row[wanted], gps[wanted], dictionaries.values,
                                          dictionaries.start)
        assert np.array_equal(bits(out[rows]), bits(documented))
        assert (out.view(np.uint32)[len(wanted):] == 0x7FC0DEAD).all()  # nothing else decoded


@pytest.mark.parametrize("name", ["gdict16.zarr", "dict16.zarr"])
def test_a_version1_chunk_decodes_whole_and_says_where_the_selected_windows_are(
        name: str, tmp_path: Path) -> None:
    v1 = birdzarr.open_store(format1_copy(name, tmp_path))
    first, stop = v1.reader.chunk_span(1)
    for selected in selections(stop - first):
        out = buffer(v1)
        rows = v1.reader.read_windows(1, selected, out)
        wanted = np.arange(stop - first) if selected is None else selected
        assert np.array_equal(rows, wanted)
        assert np.array_equal(bits(out[rows]), bits(v1.windows[first + wanted]))


def test_a_damaged_code_among_the_selected_windows_is_refused(v2_shuffled_pair: Pair, tmp_path: Path) -> None:
    import zarr

    path = tmp_path / "s.zarr"
    shutil.copytree(v2_shuffled_pair[1].location.path, path)
    codes = zarr.open_array(str(path / _v2.CODES), mode="r+", zarr_format=3)
    row = np.asarray(zarr.open_array(str(path / _v2.ROW), mode="r", zarr_format=3)[:])
    start = np.asarray(zarr.open_array(str(path / _v2.START), mode="r", zarr_format=3)[:])
    sizes = _v2.entry_counts(start, zarr.open_array(str(path / _v2.VALUES), mode="r", zarr_format=3).shape[0])
    window = 2 * 1024 + 100
    codes[window, 3, 2] = sizes[row[window], 2]  # one past its dictionary's last entry
    store = birdzarr.open_store(path)
    with pytest.raises(CorruptChunkError) as refused:
        store.reader.read_windows(2, np.array([5, 100, 700]), buffer(store))
    assert str(refused.value) == (
        f"{store.url}: chunk 'gimu_codes/c/2/0/0' cannot be decoded (a gimu code is past the end "
        "of its dictionary). The store is damaged; run `birdzarr verify`.")
