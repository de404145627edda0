"""Format 2 writers code a slab of many devices' blocks at once (``SlabWriter.code_pending``:
one ``RowCoder.code_runs``): the store is the one coded device by device with ``RowCoder.code``,
on every path (one thread, threads, worker processes)."""

from __future__ import annotations

import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

import birdzarr
from birdzarr.convert import _segments, _slabs
from birdzarr.demo import _synthetic
from birdzarr.format import _v2
from birdzarr.format._rows import RowCoder, shared_groups
from birdzarr.format._spec import DEVICE


def _gimu(windows: np.ndarray) -> pa.Array:
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)


def chunk_files(path: pathlib.Path) -> dict[str, bytes]:
    """Every file of the store but the root zarr.json (whose report holds times)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*")
            if p.is_file() and p.relative_to(path) != pathlib.Path("zarr.json")}


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_many_small_devices_are_coded_as_device_by_device_on_every_path(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2,000 devices of 3-12 windows and three of 2,500 (rows continued from slab to slab), in
    # 1,024-window slabs of 256-window chunks: many slabs, devices across slabs and chunks; a
    # slab's blocks coded ~100 windows at a time (several code_runs a slab, a large block alone)
    rng = np.random.default_rng(8)
    sizes = rng.integers(3, 13, size=2_003)
    sizes[[10, 1_000, 2_002]] = 2_500
    ids = np.arange(1, len(sizes) + 1) * 3
    windows = _synthetic.curated_windows(int(sizes.sum()), seed=8)
    owner = np.repeat(ids, sizes)
    source = tmp_path / "parts"
    source.mkdir()
    starts = np.r_[0, np.cumsum(sizes)]
    for number, (lo, hi) in enumerate(((0, 700), (700, 1_400), (1_400, len(sizes)))):
        a, b = starts[lo], starts[hi]
        pq.write_table(pa.table({"device_id": pa.array(owner[a:b], pa.int32()),
                                 "label": pa.array(np.zeros(b - a, np.int32)),
                                 "gimu": _gimu(windows[a:b])}), source / f"part-{number}.parquet")
    monkeypatch.setattr(_slabs, "SLAB_WINDOWS", 1_024)
    monkeypatch.setattr(_slabs, "CODE_BATCH", 100)
    options = {"chunk_windows": 256, "progress": False}
    birdzarr.convert(source, tmp_path / "one", workers=1, **options)
    birdzarr.convert(source, tmp_path / "threads", workers=2, **options)
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)
    processes = birdzarr.convert(source, tmp_path / "processes", workers=2, **options)
    assert processes.meta["report"]["worker_processes"] == 2
    expected = chunk_files(tmp_path / "one")
    assert chunk_files(tmp_path / "threads") == expected
    assert chunk_files(tmp_path / "processes") == expected

    # the reference: the source's windows coded device after device, one RowCoder.code each,
    # consecutive small devices sharing their entries (every path cuts its work between groups)
    z = zarr.open_group(str(tmp_path / "one"), mode="r")
    assert np.array_equal(z[DEVICE][:], owner)
    reference = RowCoder()
    groups = shared_groups(ids.tolist(), sizes.tolist())
    assert len(groups) == 9 and min(len(g) for g in groups) > 1
    reference.share(groups)
    codes, rows = [], []
    for device, lo, hi in zip(ids.tolist(), starts[:-1].tolist(), starts[1:].tolist(), strict=True):
        device_codes, device_rows = reference.code(device, windows[lo:hi])
        reference.close_device(device)
        codes.append(device_codes)
        rows.append(device_rows)
    assert np.array_equal(z[_v2.CODES][:], np.concatenate(codes))
    assert np.array_equal(z[_v2.ROW][:], np.concatenate(rows))
    dictionaries = reference.new_rows()
    assert np.array_equal(z[_v2.VALUES][:].view(np.uint32), dictionaries.values.view(np.uint32))
    assert np.array_equal(z[_v2.START][:], dictionaries.start)
    assert np.array_equal(z[_v2.DEVICE][:], dictionaries.device)
    assert np.array_equal(processes.windows[:].view(np.uint32), windows.view(np.uint32))
