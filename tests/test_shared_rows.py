"""Consecutive small devices share their dictionary entries (docs/format.md, "Dictionary rows"):
each device keeps its own row, whose starts point at its group's entries; every reader (the
documented numpy lines, verify, subset, the resident loader, an append) gets the same values."""

from __future__ import annotations

import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

import birdzarr
from birdzarr.demo import _synthetic
from birdzarr.format import _v2
from birdzarr.format._rows import SHARED_ROW_WINDOWS, RowCoder, shared_groups

pytestmark = pytest.mark.slow  # conversions of a few hundred devices: seconds


def _gimu(windows: np.ndarray) -> pa.Array:
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)


def _write(source: pathlib.Path, ids: np.ndarray, sizes: np.ndarray, windows: np.ndarray, files: int,
           name: str = "part") -> None:
    source.mkdir(parents=True)
    owner = np.repeat(ids, sizes)
    starts = np.r_[0, np.cumsum(sizes)]
    bounds = np.linspace(0, len(ids), files + 1).astype(int)
    for number in range(files):
        lo, hi = starts[bounds[number]], starts[bounds[number + 1]]
        pq.write_table(pa.table({"device_id": pa.array(owner[lo:hi], pa.int32()),
                                 "label": pa.array(np.zeros(hi - lo, np.int32)),
                                 "gimu": _gimu(windows[lo:hi])}), source / f"{name}-{number}.parquet")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """300 devices of 3-30 windows with two of 2,500 among them (too large to share), in 3
    partition files; the windows of one calibrated device, so neighbours share values."""
    root = tmp_path_factory.mktemp("shared")
    rng = np.random.default_rng(5)
    sizes = rng.integers(3, 31, size=300)
    sizes[[40, 200]] = 2_500
    ids = np.arange(1, len(sizes) + 1) * 5
    windows = _synthetic.curated_windows(int(sizes.sum()), seed=5)
    _write(root / "parts", ids, sizes, windows, 3)
    return {"root": root, "source": root / "parts", "ids": ids, "sizes": sizes, "windows": windows}


def _entries_one_row_a_device(ids: np.ndarray, sizes: np.ndarray, windows: np.ndarray) -> int:
    coder = RowCoder()
    coder.code_runs(np.repeat(ids, sizes), windows)
    return len(coder.new_rows().values)


def test_shared_groups_gather_consecutive_small_devices_up_to_the_limit() -> None:
    devices = [1, 2, 3, 4, 5, 6, 7, 8]
    counts = [1000, 1000, 48, 3000, 10, 10, 0, 2048]
    # 3,000 windows and an empty device end a group; a group of one (8) keeps its own row
    assert shared_groups(devices, counts) == [[1, 2, 3], [5, 6]]
    assert shared_groups(devices, counts, alone={2}) == [[5, 6]]
    assert shared_groups(devices, [10] * 8, alone={3}) == [[1, 2], [4, 5, 6, 7, 8]]
    assert shared_groups([1, 2, 3], [SHARED_ROW_WINDOWS - 1, 1, 1]) == [[1, 2]]
    assert shared_groups([1, 2], [5, 5]) == [[1, 2]] and shared_groups([1], [5]) == []


@pytest.mark.parametrize("shuffle", [False, True], ids=["device order", "shuffled"])
def test_small_devices_share_entries_and_every_reader_gets_the_windows(
    source: dict, tmp_path: pathlib.Path, shuffle: bool
) -> None:
    ids, sizes, windows = source["ids"], source["sizes"], source["windows"]
    options = {"shuffle": True, "seed": 3} if shuffle else {}
    store = birdzarr.convert(source["source"], tmp_path / "s.zarr", chunk_windows=1024, workers=1,
                             progress=False, **options)
    z = zarr.open_group(str(tmp_path / "s.zarr"), mode="r", zarr_format=3)
    start, device = z[_v2.START][:], z[_v2.DEVICE][:]
    # a row a device (ascending id in both orders here), rows of a group starting at the same entries
    assert np.array_equal(device, ids)
    groups = shared_groups(ids.tolist(), sizes.tolist())
    assert len(groups) == 4 and sum(len(g) for g in groups) == 298
    row_of = {d: r for r, d in enumerate(device.tolist())}
    for group in groups:
        rows = [row_of[d] for d in group]
        assert (start[rows] == start[rows[0]]).all()
    # shuffled: the rows then merge where they share values (``_shuffle._merge_rows``), and these
    # devices, one calibrated device cut up, all do: one set of entries
    assert len(np.unique(start[:, 0])) == (1 if shuffle else len(ids) - 298 + len(groups))
    assert z[_v2.VALUES].shape[0] < _entries_one_row_a_device(ids, sizes, windows) / 5
    # the documented lines, the store's reader, verify
    n = len(store)
    documented = _v2.decode_reference(z[_v2.CODES][:n], z[_v2.ROW][:n], z[_v2.GPS][:n],
                                      z[_v2.VALUES][:], start)
    assert np.array_equal(documented.view(np.uint32), store.windows[:].view(np.uint32))
    owner = np.repeat(ids, sizes)
    if shuffle:
        stored = store.window_devices[:]
        for d in (ids[0], ids[40], ids[299]):
            mine = np.sort(store.windows[:][stored == d].view(np.uint32).reshape(-1, 80), axis=0)
            expected = np.sort(windows[owner == d].view(np.uint32).reshape(-1, 80), axis=0)
            assert np.array_equal(mine, expected)
    else:
        assert np.array_equal(store.windows[:].view(np.uint32), windows.view(np.uint32))
    result = birdzarr.verify(store, progress=False)
    assert result.ok, result.format()


def test_a_subset_and_the_resident_loader_hold_shared_entries_once(
    source: dict, tmp_path: pathlib.Path
) -> None:
    pytest.importorskip("torch")
    ids = source["ids"]
    store = birdzarr.convert(source["source"], tmp_path / "s.zarr", chunk_windows=1024, workers=1,
                             progress=False)
    chosen = ids[100:160].tolist()  # a group's middle: its entries, not the whole store's
    sub = birdzarr.subset(store, tmp_path / "sub.zarr", devices=chosen, progress=False)
    mine = np.isin(store.window_devices[:], chosen)
    assert np.array_equal(sub.windows[:].view(np.uint32), store.windows[:][mine].view(np.uint32))
    z = zarr.open_group(str(tmp_path / "sub.zarr"), mode="r", zarr_format=3)
    source_rows = store.reader.dictionaries()
    kept = source_rows.kept(np.isin(source_rows.device, chosen))
    assert np.array_equal(z[_v2.VALUES][:].view(np.uint32), kept.values.view(np.uint32))
    assert len(kept.values) < len(source_rows.values) / 2
    assert birdzarr.verify(sub, progress=False).ok
    ds = birdzarr.WindowDataset(store.url, resident="cpu", devices=chosen, batch_size=128, seed=1,
                                progress=False, allow_device_order=True)
    seen = []
    for batch, x in enumerate(ds):
        idx = ds.batch_indices(batch)
        assert np.array_equal(x.numpy(), store.windows[idx])
        seen.append(idx)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.flatnonzero(mine))


def test_an_append_groups_new_small_devices_and_continues_extended_ones(
    source: dict, tmp_path: pathlib.Path
) -> None:
    ids, windows = source["ids"], source["windows"]
    dest = tmp_path / "s.zarr"
    birdzarr.convert(source["source"], dest, chunk_windows=1024, workers=1, progress=False)
    before = zarr.open_group(str(dest), mode="r", zarr_format=3)
    committed = (before[_v2.VALUES][:].view(np.uint32), before[_v2.START][:], before[_v2.DEVICE][:])
    # a season: 50 new small devices, and new windows (new values: another calibration) of a
    # device that shares a row and of a large one
    rng = np.random.default_rng(9)
    new_ids = np.r_[ids[[7, 40]], np.arange(2_000, 2_050)]
    new_sizes = np.r_[12, 30, rng.integers(3, 20, size=50)]
    new_windows = _synthetic.curated_windows(int(new_sizes.sum()), seed=11)
    _write(tmp_path / "season", new_ids, new_sizes, new_windows, 2, name="season")
    store = birdzarr.append(dest, tmp_path / "season", workers=1, progress=False)
    z = zarr.open_group(str(dest), mode="r", zarr_format=3)
    values, start, device = z[_v2.VALUES][:].view(np.uint32), z[_v2.START][:], z[_v2.DEVICE][:]
    # committed rows and entries unchanged; new rows after them
    assert np.array_equal(values[: len(committed[0])], committed[0])
    assert np.array_equal(start[: len(committed[1])], committed[1])
    assert np.array_equal(device[: len(committed[2])], committed[2])
    added_rows = start[len(committed[1]):]
    new_small = np.isin(device[len(committed[2]):], np.arange(2_000, 2_050))
    assert new_small.sum() == 50 and len(np.unique(added_rows[new_small][:, 0])) < 5
    # every window as given: the committed ones, then the season's in its device order
    n = len(windows)
    assert np.array_equal(store.windows[:n].view(np.uint32), windows.view(np.uint32))
    appended = store.windows[n:]
    assert len(appended) == len(new_windows)
    stored_devices = store.window_devices[n:]
    for d in new_ids.tolist():
        k = int(np.flatnonzero(new_ids == d)[0])
        lo = int(np.r_[0, np.cumsum(new_sizes)][k])
        assert np.array_equal(appended[stored_devices == d].view(np.uint32),
                              new_windows[lo : lo + new_sizes[k]].view(np.uint32))
    result = birdzarr.verify(store, progress=False)
    assert result.ok, result.format()
