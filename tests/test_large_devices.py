"""A device much larger than the others is converted as parts (``_segments.split_large``): window
ranges cut at its row groups, which different tasks read; its summary is merged here (the parts'
CRC-32C joined by ``crc32c_combine``) and its repeated windows counted over all its parts. The
store is the same bytes on every engine (this thread, threads, worker processes, Dask) and equals
what a reading of the source gives; ``verify`` passes with and without ``--source``.

The part size is ``_segments.PART_WINDOWS`` (2**20 windows); the conversions here set it to a few
thousand through the module constant (the plan is made in the converting process, before any task
runs, so every engine sees it), the plan functions through their ``part_windows`` keyword."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import sys
from typing import Any

import google_crc32c
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

import birdzarr
from birdzarr.cli import main as cli_main
from birdzarr.convert import _segments, _shuffle, _shuffle_processes
from birdzarr.convert._device_coder import DeviceCoder
from birdzarr.convert._duplicates import DeviceKeys, PartKeys, repeated_in_parts
from birdzarr.convert._sources import DeviceSource, find_inputs
from birdzarr.convert._summary import crc32c_combine
from birdzarr.demo import _synthetic
from birdzarr.format._spec import TIMESTAMP_UNKNOWN, Curation
from birdzarr.storage._location import resolve
from tests.store_files import assert_same_store

pytest_plugins = ["dask_support"]  # its fixture: cluster_client (the Dask tests)

LARGE = 7  # the large device's id
SMALL = {2: 900, 3: 40, 9: 1200, 12: 3000}  # the others: windows each
LARGE_WINDOWS, LARGE_GROUP = 20_000, 1_500  # 14 row groups (the last of 500)
PART = 4_000  # the part size the conversions here plan with
CHUNK = 1024
REPEATS = slice(15_000, 15_010)  # windows of the large device's part 4 that repeat ...
REPEATED = slice(100, 110)  # ... these of its part 0 (time and values)


def _write(path: pathlib.Path, windows: np.ndarray, *, row_group: int, labels: np.ndarray | None = None,
           times: np.ndarray | None = None, padding: int = 0) -> None:
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    offsets = pa.array(np.arange(0, len(windows) * 80 + 1, 80, dtype=np.int32))
    columns = {"gimu": pa.ListArray.from_arrays(offsets, flat)}
    if labels is not None:
        columns["label"] = pa.array(labels, pa.int32())
    if times is not None:
        columns["timestamp"] = pa.array(times, pa.int64())
    table = pa.table(columns)
    if padding:  # a footer entry birdzarr does not read: the file holds at least ``padding`` bytes
        table = table.replace_schema_metadata({"padding": "0" * (padding // 2 + 1)})
    pq.write_table(table, path, row_group_size=row_group)


def _large_device() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    windows = _synthetic.curated_windows(LARGE_WINDOWS, seed=LARGE)
    labels = np.repeat(np.array([-1, 0, 3, 1], np.int32), LARGE_WINDOWS // 4)
    times = 1_700_000_000 + 30 * np.arange(LARGE_WINDOWS, dtype=np.int64)
    times[[5, 19_000]] = [1_600_000_000, 1_800_000_000]  # the earliest in part 0, the latest in part 4
    windows[REPEATS], times[REPEATS] = windows[REPEATED], times[REPEATED]
    return windows, labels, times


def _source(directory: pathlib.Path, *, padded: bool) -> pathlib.Path:
    """The small devices (row groups of 1,000) and the large one (of ``LARGE_GROUP``), with labels
    and times; ``padded``: one small file padded to PROCESS_MIN_BYTES (worker processes convert)."""
    directory.mkdir()
    windows, labels, times = _large_device()
    _write(directory / f"{LARGE}.parquet", windows, row_group=LARGE_GROUP, labels=labels, times=times)
    for device, size in SMALL.items():
        _write(directory / f"{device}.parquet", _synthetic.curated_windows(size, seed=device), row_group=1000,
               padding=_segments.PROCESS_MIN_BYTES if padded and device == 3 else 0)
    return directory


class _Sources(dict[str, pathlib.Path]):
    """The plain source, and the padded one made when first asked for (64 MB: slow tests only)."""

    def __init__(self, root: pathlib.Path) -> None:
        super().__init__(plain=_source(root / "plain", padded=False))
        self.root = root

    def __missing__(self, key: str) -> pathlib.Path:
        assert key == "padded"
        self[key] = _source(self.root / key, padded=True)
        return self[key]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    return _Sources(tmp_path_factory.mktemp("large-devices"))


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_segments, "PART_WINDOWS", PART)


def _plan(source: pathlib.Path, *, workers: int, part_windows: int = PART) -> list[_segments.Segment]:
    devices = find_inputs(resolve(str(source))).devices
    counts = _segments.count_devices(devices, curation=Curation(), on_bad_rows="error")
    members, sizes = _segments.split_large(devices, counts, on_bad_rows="error", part_windows=part_windows)
    return _segments.plan_segments(members, sizes, workers=workers, chunk_windows=CHUNK)


# -- the checksum of parts -----------------------------------------------------------------------
def test_crc32c_combine_gives_google_crc32c_of_the_joined_bytes() -> None:
    rng = random.Random(33)
    sizes = [(0, 0), (0, 1), (1, 0), (0, 320), (320, 0), (1, 1), (3, 320 * 7)]
    sizes += [(rng.randrange(4000), rng.randrange(4000)) for _ in range(40)]
    for first, second in sizes:
        a, b = os.urandom(first), os.urandom(second)
        joined = crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
        assert joined == google_crc32c.value(a + b), (first, second)
    # many parts, some empty, folded left to right
    pieces = [os.urandom(rng.choice([0, 1, 80, 320, 5000])) for _ in range(12)]
    crc = 0
    for piece in pieces:
        crc = crc32c_combine(crc, google_crc32c.value(piece), len(piece))
    assert crc == google_crc32c.value(b"".join(pieces))


def test_repeats_across_parts_count_as_repeats_inside_one_device() -> None:
    hashes = np.array([5, 1, 5, 2, 9, 1, 7], np.uint64)

    def keys(part: np.ndarray) -> PartKeys:
        found = DeviceKeys()
        found.hashes.append(part)
        return PartKeys.of(found)

    whole = len(hashes) - len(np.unique(hashes))
    assert repeated_in_parts([keys(hashes[:3]), keys(hashes[3:5]), keys(hashes[5:])]) == whole == 2
    assert repeated_in_parts([keys(hashes), PartKeys.of(DeviceKeys())]) == 2
    assert repeated_in_parts([PartKeys.of(DeviceKeys())]) == 0


def test_repeats_across_parts_are_counted_range_by_range_without_joining_the_parts() -> None:
    # three parts of 650,000 windows (2^18, 2^18, 125,000), repeats inside and across parts,
    # one part's hashes mostly in the low range: counted exactly, with at most a few MB more held
    # than the parts' hashes, whatever their number (joining and sorting them all held 3 copies
    # more, 8 bytes a window each: 16 MB here)
    import tracemalloc

    part = 2**18
    rng = np.random.default_rng(33)
    hashes = rng.integers(0, 2**63, 2 * part + 125_000, dtype=np.uint64)
    hashes[100:200] = hashes[300]  # inside part 1
    hashes[part + 10:part + 5_010] = hashes[:5_000]  # part 2 repeats part 1
    hashes[-3_000:] = hashes[part:part + 3_000]  # part 3 repeats part 2 (and so part 1)
    hashes[2 * part:2 * part + 100_000] %= np.uint64(2**40)  # part 3 mostly below part 1
    whole = len(hashes) - len(np.unique(hashes))
    parts = []
    for start, stop in [(0, part), (part, 2 * part), (2 * part, len(hashes))]:
        found = DeviceKeys()
        found.hashes.append(hashes[start:stop])
        parts.append(PartKeys.of(found))
    del hashes
    tracemalloc.start()
    try:
        counted = repeated_in_parts(parts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counted == whole == 100 + 5_000 + 3_000
    assert peak < 6_000_000


# -- the plan ------------------------------------------------------------------------------------
def test_parts_are_cut_at_the_first_row_group_boundary_at_or_after_each_multiple() -> None:
    assert _segments.part_cuts([1500] * 13 + [500], 4000) == [4500, 9000, 12000, 16500]
    assert _segments.part_cuts([1000] * 4, 1000) == [1000, 2000, 3000]
    assert _segments.part_cuts([1000] * 4, 4000) == []  # not more than a part: whole
    assert _segments.part_cuts([10_000], 1000) == []  # one row group: never cut inside it
    assert _segments.part_cuts([100, 0, 3000, 100], 1000) == [3100]  # one cut for 1000, 2000 and 3000
    assert _segments.part_cuts([], 1000) == []


def test_the_plan_puts_a_large_devices_parts_in_different_tasks(sources: dict[str, pathlib.Path]) -> None:
    plan = _plan(sources["plain"], workers=2)
    placed = [(segment, device, first, count) for segment in plan for device, first, count in segment.devices]
    parts = [(segment, device, first, count) for segment, device, first, count in placed
             if device.device_id == LARGE]
    assert [device.part.index for _, device, _, _ in parts if device.part] == [0, 1, 2, 3, 4]
    assert [count for _, _, _, count in parts] == [4500, 4500, 3000, 4500, 3500]
    # segments of at least 8 chunks: the large device's parts in two tasks
    assert [(segment.start, segment.stop) for segment in plan] == [(0, 9940), (9940, 20940), (20940, 25140)]
    assert [plan.index(segment) for segment, _, _, _ in parts] == [0, 0, 1, 1, 1]
    # each part reads only its row groups, every group once, in order; part 0 names the file's notes
    groups = [g for _, device, _, _ in parts if device.part for f, gs, _ in device.part.files for g in gs]
    assert groups == list(range(14))
    assert [noted for _, device, _, _ in parts if device.part for _, _, noted in device.part.files] == [
        True, False, False, False, False]
    # consecutive window ranges, the small devices whole
    assert [first for _, _, first, _ in parts] == [940, 5440, 9940, 12940, 17440]
    assert all(device.part is None for _, device, _, _ in placed if device.device_id != LARGE)
    # the parts do not depend on the workers: one worker plans them too, in one segment
    (alone,) = _plan(sources["plain"], workers=1)
    assert [count for device, _, count in alone.devices if device.device_id == LARGE] == [
        4500, 4500, 3000, 4500, 3500]


def test_only_devices_whose_offsets_the_footers_give_are_split(sources: dict[str, pathlib.Path]) -> None:
    devices = find_inputs(resolve(str(sources["plain"]))).devices
    counts = _segments.count_devices(devices, curation=Curation(), on_bad_rows="error")
    # on_bad_rows="skip": a bad row would move every later window
    assert _segments.split_large(devices, counts, on_bad_rows="skip", part_windows=PART) == (devices, counts)
    # CSV and partition-file devices stay whole whatever their size
    file = resolve(str(sources["plain"] / "part-0.parquet"))
    csv = DeviceSource(5, "csv", [resolve(str(sources["plain"] / "5_0.csv"))])
    partitioned = DeviceSource(6, "parquet", [file], partition_rows=50_000)
    assert _segments.split_large([csv, partitioned], [50_000, 50_000], on_bad_rows="error",
                                 part_windows=PART) == ([csv, partitioned], [50_000, 50_000])
    # the default part size (2**20 windows) leaves this source whole
    members, _ = _segments.split_large(devices, counts, on_bad_rows="error")
    assert members == devices


# -- the store -----------------------------------------------------------------------------------
def _reference(source: pathlib.Path) -> dict[int, np.ndarray]:
    """Each device's windows, read with pyarrow alone."""
    out = {}
    for path in sorted(source.glob("*.parquet"), key=lambda p: int(p.stem)):
        column = pq.read_table(path, columns=["gimu"]).column(0).combine_chunks()
        out[int(path.stem)] = np.asarray(column.flatten(), np.float32).reshape(-1, 20, 4)
    return out


def _array(store_path: pathlib.Path, name: str) -> np.ndarray:
    array = zarr.open_array(str(store_path / name), mode="r")
    return np.asarray(array[...])


def _check_against_source(store_path: pathlib.Path, source: pathlib.Path) -> None:
    store = birdzarr.open_store(store_path)
    truth = _reference(source)
    np.testing.assert_array_equal(store.windows[:], np.concatenate(list(truth.values())))
    windows, labels, times = _large_device()
    entry = store.device(LARGE)
    start = sum(n for d, n in SMALL.items() if d < LARGE)
    assert entry.n_windows == LARGE_WINDOWS
    assert [(r.start, r.stop) for r in entry.ranges] == [(start, start + LARGE_WINDOWS)]
    assert entry.ranges[0].checksum == f"{google_crc32c.value(windows.astype('<f4').tobytes()):08x}"
    assert entry.label_counts == {-1: 5000, 0: 5000, 1: 5000, 3: 5000}
    assert (entry.first_time, entry.last_time) == (1_600_000_000, 1_800_000_000)
    assert entry.sources == [f"{LARGE}.parquet"]
    assert store.device(9).first_time == TIMESTAMP_UNKNOWN
    for device, count in SMALL.items():
        small = store.device(device)
        assert small.n_windows == count
        assert small.ranges[0].checksum == f"{google_crc32c.value(truth[device].tobytes()):08x}"
    keys = np.concatenate([windows.reshape(LARGE_WINDOWS, -1).view(np.uint32),
                           times.view(np.uint32).reshape(-1, 2)], axis=1)
    assert len(keys) - len(np.unique(keys, axis=0)) == 10
    assert store.meta["report"]["duplicate_windows"] == {str(LARGE): 10}
    report = store.meta["report"]["devices"][str(LARGE)]
    assert (report["rows_read"], report["windows_written"]) == (LARGE_WINDOWS, LARGE_WINDOWS)
    # format 2: a row of the large device for each part (a row closes where a part ends)
    owners = _array(store_path, "dict_device")
    assert int((owners == LARGE).sum()) == 5
    rows = _array(store_path, "gimu_row")[start:start + LARGE_WINDOWS]
    assert np.flatnonzero(np.diff(rows.astype(np.int64))).tolist() == [4499, 8999, 11999, 16499]
    assert cli_main(["verify", str(store_path), "--quiet"]) == 0
    assert cli_main(["verify", str(store_path), "--source", str(source), "--quiet"]) == 0


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::birdzarr.DuplicateWindowsWarning")
def test_a_split_device_gives_the_same_store_on_this_thread_threads_and_worker_processes(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path, small_parts: None,
) -> None:
    one = birdzarr.convert(sources["plain"], tmp_path / "one.zarr", workers=1, chunk_windows=CHUNK,
                           progress=False)
    assert "segments" not in one.meta["report"] and "worker_processes" not in one.meta["report"]
    birdzarr.convert(sources["plain"], tmp_path / "threads.zarr", workers=2, chunk_windows=CHUNK,
                     progress=False)
    processes = birdzarr.convert(sources["padded"], tmp_path / "processes.zarr", workers=2,
                                 chunk_windows=CHUNK, progress=False)
    report = processes.meta["report"]
    assert report["worker_processes"] == 2 and report["segments"] == len(_plan(sources["padded"], workers=2))
    _check_against_source(tmp_path / "one.zarr", sources["plain"])
    assert_same_store(tmp_path / "one.zarr", tmp_path / "threads.zarr")
    assert_same_store(tmp_path / "one.zarr", tmp_path / "processes.zarr")
    _check_against_source(tmp_path / "processes.zarr", sources["padded"])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::birdzarr.DuplicateWindowsWarning")
def test_a_split_device_on_a_dask_cluster_gives_the_local_store(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path, small_parts: None, cluster_client: Any,
) -> None:
    remote = birdzarr.convert(sources["plain"], tmp_path / "dask.zarr", client=cluster_client,
                              chunk_windows=CHUNK, progress=False)
    assert remote.meta["report"]["segments"] == len(_plan(sources["plain"], workers=2))
    birdzarr.convert(sources["plain"], tmp_path / "one.zarr", workers=1, chunk_windows=CHUNK, progress=False)
    assert_same_store(tmp_path / "one.zarr", tmp_path / "dask.zarr")
    _check_against_source(tmp_path / "dask.zarr", sources["plain"])


@pytest.mark.filterwarnings("ignore::birdzarr.DuplicateWindowsWarning")
def test_a_split_device_stores_what_one_task_reading_it_whole_stores_but_its_rows(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path, small_parts: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows, device table and report as the device read whole; only format 2's rows differ (a
    row a part)."""
    split = birdzarr.convert(sources["plain"], tmp_path / "split.zarr", workers=2, chunk_windows=CHUNK,
                             progress=False)
    monkeypatch.setattr(_segments, "PART_WINDOWS", LARGE_WINDOWS)
    whole = birdzarr.convert(sources["plain"], tmp_path / "whole.zarr", workers=2, chunk_windows=CHUNK,
                             progress=False)
    np.testing.assert_array_equal(split.windows[:], whole.windows[:])
    for device in [LARGE, *SMALL]:
        assert split.device(device) == whole.device(device)
    for name in ("duplicate_windows", "devices"):
        assert split.meta["report"][name] == whole.meta["report"][name]
    assert int((_array(tmp_path / "whole.zarr", "dict_device") == LARGE).sum()) == 1


@pytest.mark.filterwarnings("ignore::birdzarr.IgnoredColumnsWarning")
def test_a_device_of_several_files_is_split_across_them_and_reports_each_file_once(
    tmp_path: pathlib.Path, small_parts: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``device_id=K/`` folder of three files (one empty), with a column birdzarr does not read:
    parts cross file boundaries; the device's entry and report, the ignored columns included
    (each file named once), are those of the device read whole."""
    folder = tmp_path / "src" / "device_id=5"
    folder.mkdir(parents=True)
    windows = _synthetic.curated_windows(9000, seed=5)
    files = (("a", windows[:3000], 700), ("b", windows[:0], 700), ("c", windows[3000:], 1000))
    for name, piece, group in files:
        flat = pa.array(piece.reshape(-1), type=pa.float32())
        offsets = pa.array(np.arange(0, len(piece) * 80 + 1, 80, dtype=np.int32))
        table = pa.table({"gimu": pa.ListArray.from_arrays(offsets, flat),
                          "other": np.zeros(len(piece), np.int8)})
        if len(piece):
            pq.write_table(table, folder / f"{name}.parquet", row_group_size=group)
        else:  # no row group at all (write_table would write one of no rows)
            pq.ParquetWriter(folder / f"{name}.parquet", table.schema).close()
    assert pq.ParquetFile(folder / "b.parquet").num_row_groups == 0
    _write(tmp_path / "src" / "2.parquet", _synthetic.curated_windows(500, seed=2), row_group=1000)
    (plan,) = _plan(tmp_path / "src", workers=1)
    assert [count for _, _, count in plan.devices] == [500, 4000, 4000, 1000]
    # part 0: a's five row groups, b (no rows), c's first; then c's next four, and its last
    assert [device.part.files for device, _, _ in plan.devices if device.part] == [
        ((0, (0, 1, 2, 3, 4), True), (1, (), True), (2, (0,), True)),
        ((2, (1, 2, 3, 4), False),), ((2, (5,), False),)]
    split = birdzarr.convert(tmp_path / "src", tmp_path / "split.zarr", workers=2, chunk_windows=512,
                             progress=False)
    monkeypatch.setattr(_segments, "PART_WINDOWS", 9000)
    whole = birdzarr.convert(tmp_path / "src", tmp_path / "whole.zarr", workers=2, chunk_windows=512,
                             progress=False)
    assert split.device(5) == whole.device(5)
    assert split.meta["report"]["devices"]["5"] == whole.meta["report"]["devices"]["5"]
    assert len(split.meta["report"]["devices"]["5"]["problems"]) == 3
    assert split.meta["report"]["ignored_columns"] == {"other": ["a.parquet", "b.parquet", "c.parquet"]}
    np.testing.assert_array_equal(split.windows[:], whole.windows[:])
    source = str(tmp_path / "src")
    assert cli_main(["verify", str(tmp_path / "split.zarr"), "--source", source, "--quiet"]) == 0


# -- --shuffle: pass 1 reads a large device's parts in different tasks ----------------------------
SEED = 11


@pytest.fixture
def many_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """19 buckets for the plain source (~25,000 windows; the default: one)."""
    monkeypatch.setattr(_shuffle, "BUCKET_WINDOWS", 2000)


class _SpillSpy:
    """Each pass-1 task run in this process: its members as (device, part index or -1)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tasks: list[list[tuple[int, int]]] = []
        original = self.original = _shuffle_processes.spill_group

        def spill_group(members: list[_shuffle_processes.SpillMember], *args: Any, **kwargs: Any) -> Any:
            self.tasks.append([(m.device.device_id, -1 if m.device.part is None else m.device.part.index)
                               for m in members])
            return original(members, *args, **kwargs)

        monkeypatch.setattr(_shuffle_processes, "spill_group", spill_group)

    def parts_by_task(self) -> list[list[int]]:
        """The large device's parts each task read (tasks without any left out)."""
        found = [[part for device, part in task if device == LARGE] for task in self.tasks]
        return [parts for parts in found if parts]


def _shuffled(source: pathlib.Path, dest: pathlib.Path, monkeypatch: pytest.MonkeyPatch, *, part_windows: int,
              **kwargs: Any) -> birdzarr.Store:
    monkeypatch.setattr(_segments, "PART_WINDOWS", part_windows)
    return birdzarr.convert(source, dest, shuffle=True, seed=SEED, chunk_windows=CHUNK, progress=False,
                            **kwargs)


def test_the_shuffle_plan_puts_a_large_devices_parts_in_different_pass_1_tasks(
    sources: dict[str, pathlib.Path], small_parts: None,
) -> None:
    devices = find_inputs(resolve(str(sources["plain"]))).devices
    members = _shuffle_processes.spill_plan(devices, on_bad_rows="error", width=2)
    parts = [m for m in members if m.device.device_id == LARGE]
    # the parts of the device order's plan, each numbering its windows from its place in the device
    assert [m.device.part.index for m in parts if m.device.part] == [0, 1, 2, 3, 4]
    assert [(m.first, m.windows) for m in parts] == [(0, 4500), (4500, 4500), (9000, 3000), (12000, 4500),
                                                    (16500, 3500)]
    large_bytes = (sources["plain"] / f"{LARGE}.parquet").stat().st_size
    assert [m.size for m in parts] == [large_bytes * m.windows // LARGE_WINDOWS for m in parts]
    # the others whole; their bytes found when the groups are cut
    assert all(m == _shuffle_processes.SpillMember(m.device, m.size) for m in members
               if m.device.device_id != LARGE)
    # two workers: 8 groups of about equal bytes (a part's share of its file's), the parts in
    # four of them (the device is 80% of the input)
    groups = _shuffle_processes.spill_groups(members, width=2)
    holding = [[m.device.part.index for m in group if m.device.part] for group in groups]
    assert [parts for parts in holding if parts] == [[0], [1], [2, 3], [4]]
    assert [m for group in groups for m in group] == members
    # not split: one worker (one task), on_bad_rows="skip", a device whose files hold less than
    # SPLIT_MIN_WINDOW_BYTES a window of the part size (its footers are not read), and the default
    # part size here
    def planned(on_bad_rows: str = "error", width: int = 2) -> list[DeviceSource]:
        plan = _shuffle_processes.spill_plan(devices, on_bad_rows=on_bad_rows, width=width)
        return [m.device for m in plan]

    assert planned(width=1) == devices
    assert planned("skip") == devices
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_segments, "PART_WINDOWS", large_bytes // _shuffle_processes.SPLIT_MIN_WINDOW_BYTES + 1)
        assert planned() == devices
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_segments, "PART_WINDOWS", 1 << 20)
        assert planned() == devices


def test_a_split_devices_dictionaries_merge_into_those_of_the_device_coded_whole() -> None:
    rng = np.random.default_rng(3)
    windows = rng.integers(0, 50, size=(300, 20, 2)).astype(np.float32)  # values repeat across parts
    whole = DeviceCoder(2)
    whole_codes = whole.codes(windows)
    cuts = [0, 70, 71, 200, 300]
    coders = [DeviceCoder(2) for _ in cuts[1:]]
    part_codes = [coder.codes(windows[a:b]) for coder, a, b in zip(coders, cuts, cuts[1:], strict=False)]
    merged, moved = _shuffle.merge_part_dictionaries([coder.known for coder in coders])
    for c in range(2):
        np.testing.assert_array_equal(merged[c], whole.known[c])  # the same values, in the same order
        for k, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            np.testing.assert_array_equal(moved[k][c][part_codes[k][c]], whole_codes[c][a:b])
    assert _shuffle.merge_part_dictionaries([]) == ([], [])


@pytest.mark.filterwarnings("ignore::birdzarr.DuplicateWindowsWarning")
def test_a_split_device_gives_the_shuffled_store_of_the_device_read_whole_on_one_two_threads_and_processes(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    many_buckets: None,
) -> None:
    """Every chunk file and the device table are the bytes of the conversion that reads the large
    device whole: each part's windows draw their buckets from their numbers in the device, and
    its dictionaries, summary and repeat keys are merged into the device's."""
    whole = _shuffled(sources["plain"], tmp_path / "whole.zarr", monkeypatch, part_windows=LARGE_WINDOWS,
                      workers=1)
    assert whole.meta["report"]["shuffle"]["buckets"] == 19
    spy = _SpillSpy(monkeypatch)
    one = _shuffled(sources["plain"], tmp_path / "one.zarr", monkeypatch, part_windows=PART, workers=1)
    assert spy.parts_by_task() == [[-1]]  # one worker: one task, the device whole (nothing to even out)
    spy.tasks.clear()
    threads = _shuffled(sources["plain"], tmp_path / "threads.zarr", monkeypatch, part_windows=PART,
                        workers=2)
    assert spy.parts_by_task() == [[0], [1], [2, 3], [4]]  # the plan's groups (above)
    # worker processes at any input size (they run the same plan's tasks; the spy is not sent there)
    monkeypatch.setattr(_shuffle_processes, "spill_group", spy.original)
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)
    processes = _shuffled(sources["plain"], tmp_path / "processes.zarr", monkeypatch, part_windows=PART,
                          workers=2)
    assert processes.meta["report"]["worker_processes"] == 2
    for name in ("one", "threads", "processes"):
        assert_same_store(tmp_path / "whole.zarr", tmp_path / f"{name}.zarr")
    entry = threads.device(LARGE)
    assert (entry.n_windows, entry.ranges) == (LARGE_WINDOWS, [])
    assert entry.label_counts == {-1: 5000, 0: 5000, 1: 5000, 3: 5000}
    assert (entry.first_time, entry.last_time) == (1_600_000_000, 1_800_000_000)
    assert entry == one.device(LARGE)
    assert threads.meta["report"]["duplicate_windows"] == {str(LARGE): 10}
    assert int((_array(tmp_path / "threads.zarr", "dict_device") == LARGE).sum()) == 1  # one row: seeded
    store = str(tmp_path / "threads.zarr")
    assert cli_main(["verify", store, "--quiet"]) == 0
    assert cli_main(["verify", store, "--source", str(sources["plain"]), "--quiet"]) == 0


@pytest.mark.filterwarnings("ignore::birdzarr.DuplicateWindowsWarning")
def test_the_parts_window_hashes_are_let_go_before_pass_2(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    many_buckets: None,
) -> None:
    """Once merged, a split device's part keys (8 bytes a window) are not held through pass 2,
    whose forked workers would map them too."""
    import weakref

    merge = _shuffle_processes.merge_spilled_parts
    held: list[weakref.ref[np.ndarray]] = []
    alive_at_pass_2: list[int] = []

    def merging(members: Any, spilled: Any) -> Any:
        held.extend(weakref.ref(piece.keys.hashes) for piece in spilled)
        return merge(members, spilled)

    def seeding(*args: Any, **kwargs: Any) -> Any:  # pass 1 is over: pass 2's rows are seeded
        alive_at_pass_2.append(sum(ref() is not None for ref in held))
        return seed(*args, **kwargs)

    seed = _shuffle_processes.seed_rows
    monkeypatch.setattr(_shuffle_processes, "merge_spilled_parts", merging)
    monkeypatch.setattr(_shuffle_processes, "seed_rows", seeding)
    store = _shuffled(sources["plain"], tmp_path / "threads.zarr", monkeypatch, part_windows=PART, workers=2)
    assert store.meta["report"]["duplicate_windows"] == {str(LARGE): 10}
    assert len(held) == 5 and alive_at_pass_2 == [0]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::birdzarr.DuplicateWindowsWarning")
def test_a_split_device_gives_the_shuffled_store_of_the_device_read_whole_on_a_dask_cluster(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    many_buckets: None, cluster_client: Any,
) -> None:
    _shuffled(sources["plain"], tmp_path / "dask.zarr", monkeypatch, part_windows=PART, client=cluster_client)
    _shuffled(sources["plain"], tmp_path / "whole.zarr", monkeypatch, part_windows=LARGE_WINDOWS, workers=1)
    assert_same_store(tmp_path / "whole.zarr", tmp_path / "dask.zarr")


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
@pytest.mark.filterwarnings("ignore::birdzarr.DuplicateWindowsWarning")
def test_a_split_device_past_a_rows_entries_keeps_every_value_in_both_orders(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, many_buckets: None,
) -> None:
    """A large device whose channels hold far more than 65,535 distinct values (unrounded floats:
    each part's row overflows, and the shuffle does not seed it): split, it stores every value
    exactly in device order, and the shuffled store is the bytes of the device read whole."""
    source = tmp_path / "src"
    source.mkdir()
    wild = np.random.default_rng(3).standard_normal((12_000, 20, 4)).astype(np.float32)
    _write(source / "5.parquet", wild, row_group=2_000)  # 3 parts of 80,000 values a channel
    _write(source / "1.parquet", _synthetic.curated_windows(500, seed=1), row_group=1_000)
    expected = np.concatenate([_synthetic.curated_windows(500, seed=1), wild])
    monkeypatch.setattr(_segments, "PART_WINDOWS", 4_000)
    ordered = birdzarr.convert(source, tmp_path / "ordered.zarr", chunk_windows=CHUNK, progress=False,
                               workers=2)
    np.testing.assert_array_equal(ordered.windows[:].view(np.uint32), expected.view(np.uint32))
    # a row a part, each closed once more where it overflows
    assert int((_array(tmp_path / "ordered.zarr", "dict_device") == 5).sum()) == 6
    assert cli_main(["verify", str(tmp_path / "ordered.zarr"), "--source", str(source), "--quiet"]) == 0
    _shuffled(source, tmp_path / "whole.zarr", monkeypatch, part_windows=10**9, workers=1)
    spy = _SpillSpy(monkeypatch)
    split = _shuffled(source, tmp_path / "split.zarr", monkeypatch, part_windows=4_000, workers=2)
    assert sorted(index for task in spy.tasks for device, index in task if device == 5) == [0, 1, 2]
    assert_same_store(tmp_path / "whole.zarr", tmp_path / "split.zarr")
    assert split.device(5).n_windows == 12_000
    assert cli_main(["verify", str(tmp_path / "split.zarr"), "--source", str(source), "--quiet"]) == 0


def test_a_part_that_reads_another_count_than_its_footers_fails_the_conversion_in_both_orders(
    sources: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    small_parts: None,
) -> None:
    """A part's windows are numbered from its footers' count before any part is read (its store
    positions in device order, its bucket draws in ``--shuffle``): a part that reads another count
    (the file changed under the conversion) fails it in one line, and no store is left."""
    planned, bumped = _segments.split_large, _shuffle_processes.spill_plan

    def one_more_in_part_1(*args: Any, **kwargs: Any) -> tuple[list[DeviceSource], list[int]]:
        devices, sizes = planned(*args, **kwargs)
        k = next(k for k, d in enumerate(devices) if d.part is not None and d.part.index == 1)
        return devices, [size + (i == k) for i, size in enumerate(sizes)]

    def one_more_in_pass_1s_part_1(*args: Any, **kwargs: Any) -> list[_shuffle_processes.SpillMember]:
        members = bumped(*args, **kwargs)
        return [dataclasses.replace(m, windows=m.windows + 1)
                if m.device.part is not None and m.device.part.index == 1 else m for m in members]

    # the converter's own name for it (``birdzarr.convert`` is the function there)
    monkeypatch.setattr(sys.modules["birdzarr.convert"], "split_large", one_more_in_part_1)
    monkeypatch.setattr(_shuffle_processes, "spill_plan", one_more_in_pass_1s_part_1)
    # part 1: windows 4,500-9,000 (cut at the first row-group boundary at or after 4,000 and 8,000)
    message = (rf"device {LARGE}: counted 4,501 windows before the conversion \(from its Parquet "
               r"footers, or by reading it\), but reading gave 4,500; did the input change")
    for shuffle in (False, True):
        dest = tmp_path / f"{shuffle}.zarr"
        with pytest.raises(birdzarr.BadInputError, match=message):
            birdzarr.convert(sources["plain"], dest, workers=2, chunk_windows=CHUNK, progress=False,
                             **({"shuffle": True, "seed": SEED} if shuffle else {}))
        assert not dest.exists()
