"""The ``--shuffle`` writer stores consecutive dictionary rows that share values merged
(``_shuffle.seed_rows``, ``_merge_rows``): their devices share the sorted union of the rows'
entries, each pass-1 code mapped to its value's place in it, so that the store holds the small
table (issue 33: streaming at 100,000 devices)."""

from __future__ import annotations

import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

import birdzarr
from birdzarr.convert import _segments, _shuffle
from birdzarr.convert._device_coder import DeviceValues
from birdzarr.demo import _synthetic
from birdzarr.format import _rows, _v2
from birdzarr.format._rows import RowCoder
from tests.store_files import assert_same_store

BIG = _rows.SHARED_ROW_WINDOWS + 1  # a device of this many windows has a row of its own


def u(*values: int) -> np.ndarray:
    return np.array(values, np.uint32)


def _entries(rows: _v2.Dictionaries) -> list[tuple[list[int], list[list[int]]]]:
    """Each distinct set of entries (per coded channel) and the devices whose rows start there."""
    values = rows.values.view(np.uint32)
    ends = rows.start + rows.sizes()
    found: dict[tuple[int, ...], tuple[list[int], list[list[int]]]] = {}
    for device, a, b in zip(rows.device.tolist(), rows.start.tolist(), ends.tolist(), strict=True):
        held = found.setdefault(tuple(a), ([], [values[x:y].tolist() for x, y in zip(a, b, strict=True)]))
        held[0].append(device)
    return list(found.values())


def test_rows_that_share_values_are_seeded_as_one_sorted_union() -> None:
    """Devices 1 and 2 (own rows: too many windows to share a group) have 6 of device 2's 8 entries
    in common: one set of entries, the sorted union, and device 2's codes mapped into it (device
    1's too: the union is sorted). Device 3 shares nothing: its own row, its codes as they are."""
    dictionaries = DeviceValues.of_devices([(1, [u(1, 2, 3, 4), u(5, 6), u(7), u(0)]),
                                            (2, [u(2, 3, 4, 9), u(5, 6), u(7, 8), u(0)]),
                                            (3, [u(20, 21, 22, 23), u(24, 25), u(26), u(0)])], 4)
    coder = RowCoder()
    seeded = _shuffle.seed_rows(coder, dictionaries, [BIG, BIG, BIG])
    assert seeded.left_out == []
    assert [None if c is None else c.tolist() for c in seeded.row_codes] == [
        [0, 1, 2, 3, 1, 2, 3, 4, 0, 1, 2, 3], [0, 1, 0, 1, 0, 1], [0, 0, 1, 0]]
    rows = coder.new_rows()
    assert rows.device.tolist() == [1, 2, 3]
    assert _entries(rows) == [([1, 2], [[1, 2, 3, 4, 9], [5, 6], [7, 8]]),
                              ([3], [[20, 21, 22, 23], [24, 25], [26]])]


def test_small_devices_groups_merge_and_a_left_out_device_ends_a_run() -> None:
    """Rows of small devices' groups merge as rows of one device do (every member's row starts at
    the union); a device left out (more than 65,535 values in a channel: its rows open in pass 2)
    ends a run, so device 5, sharing device 1's values, keeps its own row. The writer's coder
    (pass 2 codes windows where a device is left out) codes a member's values into the union."""
    many = np.arange(100, 100 + _v2.MAX_ENTRIES + 1, dtype=np.uint32)
    dictionaries = DeviceValues.of_devices([(1, [u(1, 2), u(5), u(7), u(0)]),
                                            (2, [u(1, 3), u(5), u(7), u(0)]),
                                            (3, [u(1, 2, 3), u(5, 6), u(7), u(0)]),
                                            (4, [many, u(5), u(7), u(0)]),
                                            (5, [u(1, 2), u(5), u(7), u(0)])], 4)
    counts = [5, 5, BIG, BIG, BIG]
    assert _rows.shared_groups([1, 2, 3, 4, 5], counts, alone={4}) == [[1, 2]]
    coder = RowCoder()
    seeded = _shuffle.seed_rows(coder, dictionaries, counts, np.array([1, 2, 3, 4, 5], np.int64))
    assert seeded.left_out == [4]
    codes = seeded.row_codes[0]
    assert codes is not None and codes[:7].tolist() == [0, 1, 0, 2, 0, 1, 2] and codes[-2:].tolist() == [0, 1]
    assert _entries(coder.new_rows()) == [([1, 2, 3], [[1, 2, 3], [5, 6], [7]]), ([5], [[1, 2], [5], [7]])]
    window = np.zeros((1, _v2.WINDOW_LENGTH, _v2.N_CHANNELS), np.uint32)
    window[..., :3] = [3, 6, 7]
    got, row = coder.code(2, window.view(np.float32))
    assert got[0, 0].tolist() == [2, 1, 0] and row.tolist() == [1]



def _source(root: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """40 small devices and two of own rows cutting one calibrated sequence (they share values),
    then one device calibrated apart (it shares none), in two partition files; every window and
    its device."""
    sizes = np.r_[np.full(20, 12), BIG, np.full(20, 12), BIG, 300]
    owner = np.repeat(np.arange(1, len(sizes) + 1), sizes)
    windows = _synthetic.curated_windows(len(owner), seed=4)
    apart = owner == len(sizes)
    windows[apart, :, :3] = windows[apart, :, :3] * np.float32(1.07) + np.float32(0.01)
    root.mkdir()
    half = int(np.searchsorted(owner, 22))
    for number, (lo, hi) in enumerate([(0, half), (half, len(owner))]):
        flat = pa.array(windows[lo:hi].reshape(-1), type=pa.float32())
        gimu = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)
        pq.write_table(pa.table({"device_id": pa.array(owner[lo:hi], pa.int32()), "gimu": gimu}),
                       root / f"part-{number}.parquet")
    return windows, owner


def _sorted_rows(windows: np.ndarray, devices: np.ndarray) -> np.ndarray:
    """Each window's bit patterns and device as one opaque row, sorted (order-free comparison)."""
    bits = windows.view(np.uint32).reshape(len(windows), -1)
    rows = np.ascontiguousarray(np.c_[bits, devices.astype(np.uint32)])
    return np.sort(rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel())


def test_a_shuffled_store_holds_merged_rows_the_same_bytes_on_every_executor(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker, two threads and two worker processes write the same bytes; the devices that
    share values share one set of entries (the device calibrated apart keeps its own), every
    window decodes to its source values, and ``verify`` and ``verify --source`` pass."""
    windows, owner = _source(tmp_path / "src")
    options = {"shuffle": True, "seed": 2, "chunk_windows": 1024, "progress": False}
    birdzarr.convert(tmp_path / "src", tmp_path / "one.zarr", workers=1, **options)
    birdzarr.convert(tmp_path / "src", tmp_path / "threads.zarr", workers=2, **options)
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)
    store = birdzarr.convert(tmp_path / "src", tmp_path / "processes.zarr", workers=2, **options)
    assert store.meta["report"]["worker_processes"] == 2
    assert_same_store(tmp_path / "one.zarr", tmp_path / "threads.zarr")
    assert_same_store(tmp_path / "one.zarr", tmp_path / "processes.zarr")
    z = zarr.open_group(str(tmp_path / "one.zarr"), mode="r", zarr_format=3)
    start = np.asarray(z[_v2.START][:])
    assert z[_v2.DEVICE][:].tolist() == list(range(1, 44))
    assert len(np.unique(start, axis=0)) == 2
    assert (start[:42] == start[0]).all() and (start[42] != start[0]).all()
    stored = _sorted_rows(store.windows[:], store.window_devices[:])
    assert np.array_equal(stored, _sorted_rows(windows, owner))
    assert birdzarr.verify(store, progress=False).ok
    assert birdzarr.verify(store, source=tmp_path / "src", progress=False).ok
