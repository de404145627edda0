"""Conversion on several workers: every stored byte is the same whatever the number of workers and
whichever engine runs the tasks (this thread, threads, worker processes for input of at least
``PROCESS_MIN_BYTES``: real files that large, padded); the usable core count follows CPU affinity
and the cgroup quota. (The runner's own order, failure and bound: tests/test_engine.py.)"""

from __future__ import annotations

import importlib
import os
import pathlib
import threading
from typing import Any

import numpy as np
import pytest

import birdzarr
from birdzarr._errors import BadInputError, DuplicateWindowsWarning
from birdzarr.convert import _cpus, _segments, _shuffle, _shuffle_processes
from birdzarr.demo import _synthetic
from birdzarr.maintenance._verify import verify
from birdzarr.store._summary import format_summary, summary
from tests.store_files import assert_same_store


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Five devices; two span several row groups (parallel tasks inside one file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = tmp_path_factory.mktemp("pq-parallel")
    sizes = {3: 9000, 8: 40, 15: 7000, 16: 1, 40: 3000}
    for device, size in sizes.items():
        windows = _synthetic.curated_windows(size, seed=device)
        flat = pa.array(windows.reshape(-1), type=pa.float32())
        offsets = pa.array(np.arange(0, size * 80 + 1, 80, dtype=np.int32))
        table = pa.table({"gimu": pa.ListArray.from_arrays(offsets, flat)})
        pq.write_table(table, directory / f"{device}.parquet", row_group_size=2500)
    return directory


def padded_parquet(source: pathlib.Path, into: pathlib.Path, at_least: int) -> pathlib.Path:
    """``source``'s Parquet files, the same windows, each with a key-value metadata entry in its
    footer (which birdzarr does not read) so that together they hold at least ``at_least`` bytes."""
    import pyarrow.parquet as pq

    into.mkdir()
    files = sorted(source.glob("*.parquet"))
    # the schema's metadata is stored twice (the key-value entry and the serialised Arrow schema)
    pad = "0" * (at_least // len(files) // 2 + 1)
    for file in files:
        table = pq.read_table(file)
        pq.write_table(table.replace_schema_metadata({"padding": pad}), into / file.name,
                       row_group_size=2500)
    assert sum(f.stat().st_size for f in into.iterdir()) >= at_least
    return into


def padded_csv(source: pathlib.Path, into: pathlib.Path, at_least: int) -> pathlib.Path:
    """``source``'s CSV files with trailing zeros on every value field (``1.910000...0``: the same
    values, and a field that is not a number stays one), at least ``at_least`` bytes in all."""
    into.mkdir()
    files = sorted(source.iterdir())
    lines = [path.read_text().splitlines() for path in files]
    size = sum(path.stat().st_size for path in files)
    zeros = "0" * (-(-(at_least - size) // (4 * sum(map(len, lines)))) + 1)
    for path, rows in zip(files, lines, strict=True):
        fields = (row.split(",") for row in rows)
        text = "".join(",".join(f[:4] + [v + zeros for v in f[4:]]) + "\n" for f in fields)
        (into / path.name).write_text(text)
    assert sum(p.stat().st_size for p in into.iterdir()) >= at_least
    return into


@pytest.fixture(scope="module")
def parquet_dir_large(parquet_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``parquet_dir``'s windows in files of PROCESS_MIN_BYTES: converted in worker processes."""
    into = tmp_path_factory.mktemp("pq-large") / "src"
    return padded_parquet(parquet_dir, into, _segments.PROCESS_MIN_BYTES)


@pytest.fixture(scope="module")
def parquet_dir_48mb(parquet_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``parquet_dir``'s windows in files of 48 MB: converted on threads, and shuffled through
    four buckets (their number follows the input's size: ``_shuffle.bucket_count``)."""
    return padded_parquet(parquet_dir, tmp_path_factory.mktemp("pq-48mb") / "src", 48 << 20)


@pytest.mark.slow
def test_parquet_store_is_byte_identical_for_any_worker_count(
    parquet_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    stores = []
    for workers in (1, 2, 3):
        dest = tmp_path / f"w{workers}.zarr"
        store = birdzarr.convert(parquet_dir, dest, workers=workers,
                                 chunk_windows=1024, progress=False)
        assert len(store) == 9000 + 40 + 7000 + 1 + 3000
        assert store.meta["report"]["workers"] == workers
        assert store.meta["report"]["cpu_seconds"] > 0
        noun = "worker" if workers == 1 else "workers"
        assert f"cores ({workers} {noun})" in format_summary(summary(store))
        stores.append(dest)
    for other in stores[1:]:
        assert_same_store(stores[0], other)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_windows", [64, 100])
def test_parquet_store_converted_in_worker_processes_is_byte_identical(
    parquet_dir_large: pathlib.Path, tmp_path: pathlib.Path, chunk_windows: int,
) -> None:
    # segments of at least 8 chunks and ~1/8 of the windows: 3 (9,000), 8 and 15 (7,040), 16 and
    # 40 (3,001); chunks written by this process from the windows of two segments, a padded last chunk
    one = birdzarr.convert(parquet_dir_large, tmp_path / "one.zarr", workers=1, chunk_windows=chunk_windows,
                           progress=False)
    assert "segments" not in one.meta["report"]
    processes = birdzarr.convert(parquet_dir_large, tmp_path / "processes.zarr", workers=2,
                                 chunk_windows=chunk_windows, progress=False)
    report = processes.meta["report"]
    assert (report["segments"], report["worker_processes"]) == (3, 2)
    assert report["cpu_seconds"] > 0  # the worker processes' CPU is counted
    assert_same_store(tmp_path / "one.zarr", tmp_path / "processes.zarr")


def _parquet_devices(directory: pathlib.Path, sizes: dict[int, int], *, large: bool = False) -> pathlib.Path:
    """``{device}.parquet`` of ``sizes[device]`` generated windows each (seeded by the device);
    ``large``: padded to PROCESS_MIN_BYTES (worker processes convert them)."""
    directory.mkdir()
    for device, size in sizes.items():
        windows = _synthetic.curated_windows(size, seed=device)
        _synthetic.write_parquet(windows, directory / f"{device}.parquet")
    if not large:
        return directory
    padded = padded_parquet(directory, directory.with_name(directory.name + "-large"),
                            _segments.PROCESS_MIN_BYTES)
    for file in directory.iterdir():
        file.unlink()
    for file in padded.iterdir():
        file.rename(directory / file.name)
    padded.rmdir()
    return directory


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_worker_processes_count_repeated_windows_as_threads_do(tmp_path: pathlib.Path) -> None:
    windows = _synthetic.curated_windows(500, seed=1)
    for workers in (1, 2):
        src = _parquet_devices(tmp_path / f"src{workers}", {9: 300}, large=workers == 2)
        twice = np.concatenate([windows, windows[:30]])  # 30 windows twice
        _synthetic.write_parquet(twice, src / "7.parquet")
        with pytest.warns(DuplicateWindowsWarning, match=r"30 window\(s\) repeat .* device\(s\) 7 \(30\)"):
            store = birdzarr.convert(src, tmp_path / f"w{workers}.zarr", workers=workers, chunk_windows=16,
                                     progress=False)
        assert store.meta["report"]["duplicate_windows"] == {"7": 30}
        assert ("segments" in store.meta["report"]) == (workers == 2)


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_fewer_segments_than_workers_read_ahead_and_encode_on_threads_of_their_own(
    tmp_path: pathlib.Path
) -> None:
    """The engine follows the input's size and the workers only: one segment (the minimum segment
    is 8 chunks) runs in one worker process, which reads ahead and encodes on threads of its
    own; the same store as one worker's. (Devices too large to share dictionary entries:
    ``_rows.shared_groups``, whose groups a segment never splits.)"""
    src = _parquet_devices(tmp_path / "src", {1: 1100, 2: 1100}, large=True)
    one = birdzarr.convert(src, tmp_path / "one.zarr", workers=1, chunk_windows=256, progress=False)
    assert "segments" not in one.meta["report"] and one.meta["report"]["workers"] == 1
    report = birdzarr.convert(src, tmp_path / "s.zarr", workers=2, chunk_windows=256,
                              progress=False).meta["report"]
    assert (report["segments"], report["worker_processes"], report["workers"]) == (1, 2, 2)
    assert_same_store(tmp_path / "one.zarr", tmp_path / "s.zarr")
    report = birdzarr.convert(src, tmp_path / "p.zarr", workers=2, chunk_windows=16,  # a segment a device
                              progress=False).meta["report"]
    assert (report["segments"], report["worker_processes"]) == (2, 2)


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_a_bad_row_in_a_worker_process_fails_the_conversion_cleanly(tmp_path: pathlib.Path) -> None:
    src = _parquet_devices(tmp_path / "src", {1: 400, 3: 400}, large=True)
    windows = _synthetic.curated_windows(400, seed=2)
    windows[123, 4, 1] = np.nan
    _synthetic.write_parquet(windows, src / "2.parquet")
    dest = tmp_path / "s.zarr"
    with pytest.raises(BadInputError, match=r"2\.parquet, row group 0, row 123: the window"):
        birdzarr.convert(src, dest, workers=2, chunk_windows=128, progress=False)
    assert not dest.exists()


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_input_that_changes_under_the_worker_processes_is_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _parquet_devices(tmp_path / "src", {4: 300, 5: 300}, large=True)
    counted = _segments.footer_count

    def one_more_for_4(device: Any, *args: Any) -> int | None:
        # device 4's footers, read before the workers start, count one window more than reading gives
        count = counted(device, *args)
        return None if count is None else count + (device.device_id == 4)

    monkeypatch.setattr(_segments, "footer_count", one_more_for_4)
    dest = tmp_path / "s.zarr"
    with pytest.raises(BadInputError, match=r"device 4: counted 301 windows before the conversion "
                                            r"\(from its Parquet footers, or by reading it\), but "
                                            r"reading gave 300; did the input change"):
        birdzarr.convert(src, dest, workers=2, progress=False)
    assert not dest.exists()


@pytest.fixture(scope="module")
def csv_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Four devices of 1-4 parts; bursts continue across parts, one part is a single burst,
    one line is malformed and one part is empty."""
    directory = tmp_path_factory.mktemp("csv-parallel")
    for device, parts in ((5, 3), (9, 1), (21, 4), (30, 2)):
        raw = _synthetic.raw_device(device, 300, seed=device, labelled=True)
        cuts = np.linspace(0, len(raw.time), parts + 1).astype(int)
        if device == 21:  # a part holding 7 rows of one burst: it continues both neighbours
            cuts[2] = cuts[1] + 7
        for part in range(parts):
            _synthetic.write_csv(raw, directory / f"{device}_{part}.csv", cuts[part], cuts[part + 1])
    with open(directory / "30_1.csv", "a", encoding="utf-8") as handle:
        handle.write("30,2013-01-01 00:00:00,0,-1,not-a-number,0,0,1\n")
    (directory / "30_2.csv").write_text("")
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("processes", [False, True])
def test_csv_store_is_byte_identical_for_any_worker_count(
    csv_dir: pathlib.Path, tmp_path: pathlib.Path, processes: bool
) -> None:
    """Threads (small input) or worker processes (input of PROCESS_MIN_BYTES: the same values
    padded with trailing zeros) read the parts; the same store with any number of workers."""
    source = padded_csv(csv_dir, tmp_path / "large", _segments.PROCESS_MIN_BYTES) if processes else csv_dir
    stores = []
    for workers in (1, 2, 3):
        dest = tmp_path / f"w{workers}.zarr"
        store = birdzarr.convert(source, dest, workers=workers, chunk_windows=256, on_bad_rows="skip",
                                 progress=False)
        assert ("worker_processes" in store.meta["report"]) == (processes and workers > 1)
        stores.append(dest)
    for other in stores[1:]:
        assert_same_store(stores[0], other)
    report = birdzarr.open_store(stores[0]).meta["report"]["devices"]["30"]
    assert report["bad_lines"] == 1 and report["bad_files"] == 1


def test_csv_parts_give_the_windows_of_one_file(tmp_path: pathlib.Path) -> None:
    """Cutting a device's rows into parts anywhere (mid-burst, mid-window, a part inside one
    burst) changes nothing: the parts are joined back in order."""
    raw = _synthetic.raw_device(77, 200, seed=3, labelled=True)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cut.mkdir()
    _synthetic.write_csv(raw, whole / "77_0.csv")
    cuts = [0, 5, 13, 30, 31, 700, len(raw.time)]
    for part, (start, stop) in enumerate(zip(cuts, cuts[1:], strict=False)):
        _synthetic.write_csv(raw, cut / f"77_{part}.csv", start, stop)
    one = birdzarr.convert(whole, tmp_path / "one.zarr", workers=2, progress=False)
    many = birdzarr.convert(cut, tmp_path / "many.zarr", workers=2, progress=False)
    assert np.array_equal(one.windows[:].view(np.uint32), many.windows[:].view(np.uint32))
    assert np.array_equal(one.labels[:], many.labels[:])
    assert np.array_equal(one.timestamps[:], many.timestamps[:])
    left = one.meta["report"]["devices"]["77"]
    right = many.meta["report"]["devices"]["77"]
    assert left["windows_written"] == right["windows_written"]
    assert left["dropped"] == right["dropped"]


# -- usable cores --------------------------------------------------------------------------------
def test_cgroup_cpu_limit(tmp_path: pathlib.Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    missing = str(tmp_path / "missing")
    cpu_max.write_text("max 100000\n")
    assert _cpus.cgroup_cpu_limit(str(cpu_max), missing, missing) is None
    cpu_max.write_text("250000 100000\n")  # 2.5 cores: 3 workers, the quota throttles the rest
    assert _cpus.cgroup_cpu_limit(str(cpu_max), missing, missing) == 3
    cpu_max.write_text("50000 100000\n")
    assert _cpus.cgroup_cpu_limit(str(cpu_max), missing, missing) == 1
    quota, period = tmp_path / "quota", tmp_path / "period"
    quota.write_text("-1\n")
    period.write_text("100000\n")
    assert _cpus.cgroup_cpu_limit(missing, str(quota), str(period)) is None
    quota.write_text("400000\n")
    assert _cpus.cgroup_cpu_limit(missing, str(quota), str(period)) == 4


def test_usable_cpus_follows_affinity_and_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(_cpus, "cgroup_cpu_limit", lambda: None)
    assert _cpus.usable_cpus() == 6
    monkeypatch.setattr(_cpus, "cgroup_cpu_limit", lambda: 2)
    assert _cpus.usable_cpus() == 2
    assert _cpus.resolve_workers(None) == 2
    assert _cpus.resolve_workers(5) == 5
    with pytest.raises(ValueError):
        _cpus.resolve_workers(-1)


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_shuffled_store_is_byte_identical_and_groups_each_chunk_by_device(
    parquet_dir_48mb: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    # 4 buckets (48 MB of input): pass 2 runs them on 2 or 3 threads at once, one run with 1 worker
    stores = []
    for workers in (1, 2, 3):
        dest = tmp_path / f"s{workers}.zarr"
        birdzarr.convert(parquet_dir_48mb, dest, workers=workers, shuffle=True, seed=5,
                         chunk_windows=4096, progress=False, shuffle_tmp=str(tmp_path))
        # pass 2 in this thread (one worker) keeps no dictionaries or buffers past the conversion
        assert getattr(_shuffle_processes._LOCAL, "state", None) is None
        stores.append(dest)
    assert_same_store(stores[0], stores[1])
    assert_same_store(stores[0], stores[2])
    assert birdzarr.open_store(stores[1]).meta["layout"]["shuffle_buckets"] >= 4
    # the converter groups the windows of each chunk's part of a bucket by device: a few runs of
    # one device each, not one run a window
    in_chunk = birdzarr.open_store(stores[0]).window_devices[:4096]
    runs = 1 + np.count_nonzero(np.diff(in_chunk))
    assert len(np.unique(in_chunk)) >= 4 and runs <= 2 * len(np.unique(in_chunk))


@pytest.mark.slow
def test_shuffled_store_in_worker_processes_is_byte_identical(
    parquet_dir_large: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """Pass 1 by groups of devices and pass 2 by runs of buckets in worker processes: the store
    of one worker in this thread, every chunk, device table and all."""
    stores = {}
    for workers in (1, 2):
        dest = tmp_path / f"s{workers}.zarr"
        store = birdzarr.convert(parquet_dir_large, dest, workers=workers, shuffle=True, seed=5,
                                 chunk_windows=2048, progress=False,
                                 shuffle_tmp=str(tmp_path))
        stores[workers] = store
    assert "worker_processes" not in stores[1].meta["report"]
    assert stores[2].meta["report"]["worker_processes"] == 2
    # 6 buckets (64 MB of input) in 4 runs, some of two: chunks two buckets share inside a run and
    # between runs
    buckets = stores[2].meta["layout"]["shuffle_buckets"]
    assert buckets == stores[1].meta["layout"]["shuffle_buckets"] == 6
    assert [len(r) for r in _shuffle_processes.plan_bucket_runs(buckets, workers=2)] == [2, 1, 1, 2]
    for store in stores.values():  # each pass's share of the time and CPU, both passes counted
        report = store.meta["report"]
        walls, cpus = report["shuffle"]["pass_seconds"], report["shuffle"]["pass_cpu_seconds"]
        assert len(walls) == len(cpus) == 2 and min(walls) > 0 and min(cpus) > 0
        assert sum(walls) == pytest.approx(report["seconds"], abs=0.01)
        assert sum(cpus) == pytest.approx(report["cpu_seconds"], abs=0.01)
        assert f"; shuffle pass 1 {walls[0]:.1f} s, pass 2 {walls[1]:.1f} s" in format_summary(summary(store))
    assert_same_store(tmp_path / "s1.zarr", tmp_path / "s2.zarr")
    assert verify(stores[2].url).ok
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("birdzarr-shuffle-")] == []


class _RecordingBar:
    """Stands in for the progress bar: what each pass counted, pass by pass."""

    def __init__(self, **kwargs: object) -> None:
        self.passes: list[tuple[str, int]] = [(str(kwargs.get("desc")), 0)]
        self.postfix = ""

    def __enter__(self) -> _RecordingBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        name, done = self.passes[-1]
        self.passes[-1] = (name, done + n)

    @property
    def n(self) -> int:
        return self.passes[-1][1]

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": 1.0}  # so that each pass shows its MB/s

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.passes.append((desc, 0))

    def reset(self, total: int | None = None) -> None:
        assert self.passes[-1][1] == 0, "reset right after the new pass's name"
        assert self.postfix == "", "pass 1's MB/s cleared before pass 2 starts"

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_the_progress_bar_counts_every_window_once_in_each_shuffle_pass(
    parquet_dir_large: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Pass 1 counts the windows read and spilled (in worker processes: group by group; in this
    thread: block by block), pass 2 the windows written, each pass all of them once. (The bar
    stands in for tqdm's, whose output shows a pass's count only every 0.1 s.)"""
    bars: list[_RecordingBar] = []

    def recording_bar(enabled: bool, **kwargs: object) -> _RecordingBar:
        bars.append(_RecordingBar(**kwargs))
        return bars[-1]

    monkeypatch.setattr(importlib.import_module("birdzarr.convert"), "progress_bar", recording_bar)
    store = birdzarr.convert(parquet_dir_large, tmp_path / "s.zarr", workers=workers, shuffle=True, seed=5,
                             chunk_windows=2048, progress=True, shuffle_tmp=str(tmp_path))
    assert ("worker_processes" in store.meta["report"]) == (workers > 1)
    n = len(store)
    assert bars[0].passes == [("convert parquet", n), ("convert parquet: write shuffled", n)]


@pytest.mark.parametrize(("buckets", "workers"), [(1, 2), (7, 2), (8, 2), (31, 2), (3, 16), (190, 16)])
def test_bucket_runs_take_every_bucket_once_in_order(buckets: int, workers: int) -> None:
    runs = _shuffle_processes.plan_bucket_runs(buckets, workers=workers)
    assert [k for run in runs for k in run] == list(range(buckets))
    assert len(runs) == min(buckets, _shuffle_processes.RUNS_PER_WORKER * workers)
    assert max(map(len, runs)) - min(map(len, runs)) <= 1


@pytest.mark.slow
def test_a_shuffle_whose_spill_is_damaged_fails_cleanly(
    parquet_dir_48mb: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket that cannot be read in pass 2 (its spill file cut short between the passes)
    stops the conversion with that error, while the next bucket is loading beside it: no hang,
    no store, no spill left behind. (The damage is done where the spill files close.)"""
    close = _shuffle.SpillBuckets.close

    def close_then_damage(self: _shuffle.SpillBuckets) -> None:
        close(self)
        with open(self.paths[1], "r+b") as handle:
            handle.truncate(os.path.getsize(self.paths[1]) // 2)

    monkeypatch.setattr(_shuffle.SpillBuckets, "close", close_then_damage)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            birdzarr.convert(parquet_dir_48mb, tmp_path / "s.zarr", workers=2, shuffle=True, seed=5,
                             chunk_windows=4096, progress=False, shuffle_tmp=str(spill_dir))
        except BaseException as exc:  # noqa: BLE001 (the test inspects it)
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=120)  # a guard against a hang only: the conversion ends in a second
    assert not thread.is_alive(), "the conversion hung after a failed bucket load"
    assert len(outcome) == 1 and not isinstance(outcome[0], AssertionError), outcome
    assert not (tmp_path / "s.zarr").exists()
    assert list(spill_dir.iterdir()) == []
