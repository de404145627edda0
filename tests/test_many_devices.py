"""A store of many small devices (5,000 devices of 2-3 windows, from partition files): `verify`,
`verify --source`, `Store.device` for every device and `info` give exact answers, and the
per-device work reads each chunk once rather than once a device (issue 33, "100K devices at the
cost of 186")."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from format2_support import rewrite_device_table

import birdzarr
from birdzarr._errors import DeviceNotFoundError
from birdzarr.cli import main
from birdzarr.demo import _synthetic
from birdzarr.maintenance import _verify
from birdzarr.maintenance._verify import VerifyResult, verify
from birdzarr.storage._location import resolve
from tests.store_files import assert_same_store

N_DEVICES = 5000
N_FILES = 5
CHUNK = 1024  # about 12 chunks: many devices a chunk, some devices across two

# converting and comparing 5,000 devices takes seconds (each device's source is read on its own)
pytestmark = pytest.mark.slow


def _gimu(windows: np.ndarray) -> pa.Array:
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(33)
    ids = np.arange(1, N_DEVICES + 1) * 7  # not 1..N: ids and positions differ
    sizes = rng.integers(2, 4, size=N_DEVICES)  # 2 or 3 windows each
    total = int(sizes.sum())
    windows = _synthetic.curated_windows(total, seed=3)
    owner = np.repeat(ids, sizes)
    labels = rng.integers(0, 3, size=total).astype(np.int32)
    source = root / "parts"
    source.mkdir()
    bounds = np.linspace(0, N_DEVICES, N_FILES + 1).astype(int)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for number in range(N_FILES):
        lo, hi = starts[bounds[number]], starts[bounds[number + 1]]
        pq.write_table(pa.table({
            "device_id": pa.array(owner[lo:hi], pa.int32()),
            "label": pa.array(labels[lo:hi], pa.int32()),
            "gimu": _gimu(windows[lo:hi]),
        }), source / f"part-{number}.parquet")
    store = root / "many.zarr"
    birdzarr.convert(str(source), str(store), chunk_windows=CHUNK, workers=1, progress=False)
    return {"source": source, "store": store, "ids": ids, "sizes": sizes, "starts": starts,
            "windows": windows, "labels": labels, "total": total}


def _unknown_row(store: pathlib.Path, device: int) -> str:
    """Format 2's problem for a device gone from the table: its dictionary row names it."""
    return (f"{store}: the dictionaries: 'dict_device' names device ids [{device}] that are not in "
            "the device table")


def test_every_device_is_found_with_its_exact_entry(many: dict) -> None:
    store = birdzarr.open_store(many["store"])
    ids, sizes, starts, labels = many["ids"], many["sizes"], many["starts"], many["labels"]
    assert len(store) == many["total"]
    assert len(store.device_table) == N_DEVICES
    for position, device in enumerate(ids.tolist()):
        entry = store.device(device)
        assert entry.device_id == device
        assert entry.n_windows == sizes[position]
        start, stop = int(starts[position]), int(starts[position + 1])
        assert [(r.start, r.stop) for r in entry.ranges] == [(start, stop)]
        values, counts = np.unique(labels[start:stop], return_counts=True)
        assert entry.label_counts == dict(zip(values.tolist(), counts.tolist(), strict=True))
    # the same entry by a string id, and ids between, below and above the table's are refused
    assert store.device(str(ids[1234])) is store.device(int(ids[1234]))  # type: ignore[arg-type]
    for missing in (0, 8, int(ids[-1]) + 7, 2**70):
        with pytest.raises(DeviceNotFoundError, match=f"device {missing} is not in"):
            store.device(missing)
    assert np.array_equal(store.device_windows(int(ids[-1])), many["windows"][starts[-2]:])


def test_verify_and_verify_source_check_every_device(many: dict) -> None:
    total = many["total"]
    chunks = -(-total // CHUNK)
    checked = verify(many["store"])
    assert checked.ok, checked.problems
    assert (checked.chunks_checked, checked.checksums_checked, checked.devices_compared) == (
        chunks, N_DEVICES, 0)
    compared = verify(many["store"], source=many["source"])
    assert compared.ok, compared.problems
    assert (compared.chunks_checked, compared.checksums_checked, compared.devices_compared) == (
        chunks, N_DEVICES, N_DEVICES)


def test_comparing_with_the_source_decodes_each_chunk_once(many: dict) -> None:
    """5,000 devices in ~12 chunks: the stored side of the comparison reads each chunk of the
    three compared arrays once (it read a chunk of each array once a device: 15,000 reads). On
    format 2 (the default) the windows' chunk is three objects (gimu_codes, gps_speed, gimu_row)
    and the three dictionary arrays (one chunk each here) are read once."""
    store = birdzarr.open_store(many["store"])
    source, devices = _verify._read_source(store, [resolve(str(many["source"]))])
    result = VerifyResult(url=store.url, n_windows=len(store), generation=0)
    before = store.reader.requests
    _verify._compare_with_source(store, source, devices, result)
    assert result.ok, result.problems
    assert result.devices_compared == N_DEVICES
    assert store.reader.requests - before == (3 + 2) * store.reader.n_chunks + 3


def test_verify_names_windows_of_a_device_missing_from_the_table(many: dict, tmp_path: pathlib.Path) -> None:
    copy = tmp_path / "copy.zarr"
    shutil.copytree(many["store"], copy)
    gone = rewrite_device_table(copy, lambda table: table.pop(2500))
    start, stop = gone["ranges"][0][:2]
    first = start // CHUNK * CHUNK
    last = min(first + CHUNK, many["total"]) - 1
    result = verify(copy)
    assert result.problems == [
        f"device table: its window counts add up to {many['total'] - (stop - start):,}, but "
        f"{many['total']:,} windows are committed",
        _unknown_row(copy, gone["device_id"]),
        f"windows {first:,}..{last:,}: device ids [{gone['device_id']}] are not in the device table",
    ]


def test_info_counts_every_device(many: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(many["store"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["devices"], info["windows"]) == (N_DEVICES, many["total"])
    assert info["report"]["rows_read"] == many["total"]
    assert main(["info", str(many["store"]), "--devices", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["device_id"] for r in rows] == many["ids"].tolist()
    assert [r["n_windows"] for r in rows] == many["sizes"].tolist()


@pytest.fixture(scope="module")
def shuffled(many: dict, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    store = tmp_path_factory.mktemp("shuffled") / "shuffled.zarr"
    birdzarr.convert(str(many["source"]), str(store), shuffle=True, seed=1, chunk_windows=CHUNK,
                     workers=1, progress=False)
    return store


def test_verify_checks_every_device_of_a_shuffled_store(many: dict, shuffled: pathlib.Path) -> None:
    """Each device's digest, summed over every chunk it is scattered over, is checked; a device
    whose windows lose their table entry is named with the chunks holding its windows."""
    result = verify(shuffled)
    assert result.ok, result.problems
    assert (result.chunks_checked, result.checksums_checked) == (-(-many["total"] // CHUNK), N_DEVICES)
    store = birdzarr.open_store(shuffled)
    device = int(many["ids"][4321])
    assert [e.device_id for e in store.device_table][4321] == device
    holding = np.flatnonzero(store.window_devices[:] == device)
    assert len(holding) == many["sizes"][4321]
    damaged = shuffled.parent / "damaged.zarr"
    shutil.copytree(shuffled, damaged)
    rewrite_device_table(damaged, lambda table: table.pop(4321))
    where = sorted({int(i) // CHUNK for i in holding})
    expected = [f"device table: its window counts add up to {many['total'] - len(holding):,}, but "
                f"{many['total']:,} windows are committed", _unknown_row(damaged, device)]
    expected += [f"windows {c * CHUNK:,}..{min((c + 1) * CHUNK, many['total']) - 1:,}: device ids "
                 f"[{device}] are not in the device table" for c in where]
    assert verify(damaged).problems == expected


def test_a_device_report_serialises_as_its_dataclass_fields() -> None:
    """The report's JSON is written for every device at every commit: built directly, it is
    still exactly ``dataclasses.asdict`` (same keys in the same order, copies of the containers)."""
    import dataclasses

    from birdzarr.format._spec import DeviceReport

    report = DeviceReport(rows_read=10, windows_written=7, dropped={"gap": 2, "short": 1},
                          mixed_label_windows=1, bad_lines=3, bad_files=1, problems=["a", "b"])
    raw = report.to_json()
    assert list(raw.items()) == list(dataclasses.asdict(report).items())
    raw["dropped"]["gap"] = 99
    raw["problems"].append("c")
    assert (report.dropped, report.problems) == ({"gap": 2, "short": 1}, ["a", "b"])
    assert DeviceReport.from_json(raw) != report
    assert DeviceReport.from_json(report.to_json()) == report


def test_verify_counts_windows_carrying_another_devices_id(many: dict, tmp_path: pathlib.Path) -> None:
    """Two neighbours' ids exchanged in the table: each range's windows carry the other's id."""
    copy = tmp_path / "swapped.zarr"
    shutil.copytree(many["store"], copy)
    def swap(table: list[dict]) -> None:
        table[100]["device_id"], table[101]["device_id"] = table[101]["device_id"], table[100]["device_id"]

    rewrite_device_table(copy, swap)
    ids, sizes, starts = many["ids"], many["sizes"], many["starts"]
    assert verify(copy).problems == [
        f"device {ids[101]}, windows [{starts[100]:,}, {starts[101]:,}): {sizes[100]:,} window(s) carry "
        "another device id in the 'device' array",
        f"device {ids[100]}, windows [{starts[101]:,}, {starts[102]:,}): {sizes[101]:,} window(s) carry "
        "another device id in the 'device' array",
    ]


def test_a_partition_files_footer_is_read_once_for_all_its_devices(
    many: dict, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5,000 devices in 5 partition files: the listing opens each file once (its device_id
    column), and the conversion each file once more, not once a device (the footer of a
    partition file is kept for its next devices, with the decoded groups); the store is the same."""
    from birdzarr.convert import _parquet

    opened: list[str] = []

    class Counted(pq.ParquetFile):
        def __init__(self, source: object, *args: object, **kwargs: object) -> None:
            opened.append(str(getattr(source, "path", source)))
            super().__init__(source, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", Counted)
    dest = tmp_path / "again.zarr"
    birdzarr.convert(str(many["source"]), str(dest), chunk_windows=CHUNK, workers=1, progress=False)
    assert len(opened) == 2 * N_FILES, len(opened)  # before: N_FILES + N_DEVICES
    assert not _parquet._FILES  # the conversion forgot them when it ended
    for name in ("gimu_codes", "gimu_row", "device", "label", "dict_values"):
        ours, theirs = sorted((dest / name).rglob("*")), sorted((many["store"] / name).rglob("*"))
        assert [p.relative_to(dest) for p in ours] == [p.relative_to(many["store"]) for p in theirs]
        for a, b in zip(ours, theirs, strict=True):
            assert a.is_dir() or a.read_bytes() == b.read_bytes(), a


# -- many small devices read together (``_parquet.read_runs``), on every engine -------------------
RUN = 64  # windows of devices read together in these tests (the default is 16,384)


def _mixed_parts(root: pathlib.Path, *, pad: int = 0, bad_row: bool = False) -> pathlib.Path:
    """About 300 devices of 1-40 windows and one of 300, in 4 partition files of row groups of 100
    rows: files 0 and 1 hold their devices' rows grouped, device after device; every 7th device is
    split over two files; file 2's rows are in random order (no device's rows grouped); a window
    of one device is repeated; labels and timestamps with nulls, and a column birdzarr does not
    read. ``pad``: bytes of that column in all (worker processes past ``PROCESS_MIN_BYTES``);
    ``bad_row``: one row of file 3 holds a NaN."""
    rng, filler = np.random.default_rng(19), np.random.default_rng(20)
    ids = np.arange(300) * 3 + 5
    sizes = rng.integers(1, 41, size=len(ids))
    sizes[150] = 300  # more than RUN: read on its own, between devices read together
    owner = np.repeat(ids, sizes)
    windows = _synthetic.curated_windows(len(owner), seed=19)
    windows[10] = windows[11]  # a repeated window (the first device has at least 12)
    sizes_before = np.concatenate([[0], np.cumsum(sizes)])
    assert sizes[0] >= 12 or owner[11] == owner[10]
    file_of = np.minimum(np.repeat(np.arange(len(ids)) * 4 // len(ids), sizes), 3)
    for k in range(0, len(ids), 7):  # split over this file and the next
        rows = np.arange(sizes_before[k], sizes_before[k + 1])
        file_of[rows[len(rows) // 2:]] = min(file_of[rows[0]] + 1, 3)
    labels = pa.array(rng.integers(0, 4, size=len(owner)), pa.int32(), mask=rng.random(len(owner)) < 0.1)
    seconds, unknown = np.arange(len(owner)) * 60 + 1_600_000_000, rng.random(len(owner)) < 0.1
    seconds[11], unknown[10:12] = seconds[10], False  # the same time and values
    times = pa.array(seconds, pa.int64(), mask=unknown)
    source = root / "parts"
    source.mkdir(parents=True)
    for number in range(4):
        rows = np.flatnonzero(file_of == number)
        if number == 2:
            rows = rng.permutation(rows)
        gimu = windows[rows].copy()
        if bad_row and number == 3:
            gimu[5, 3, 1] = np.nan
        # the padding is the unread column's: random bytes (incompressible), never read, where
        # footer metadata of that size would be parsed at every open of the file
        note = (pa.array(["x"] * len(rows)) if not pad else
                pa.array(list(filler.bytes(pad // 4 // len(rows) + 1) for _ in rows), pa.binary()))
        table = pa.table({"device_id": pa.array(owner[rows], pa.int32()), "label": labels.take(rows),
                          "timestamp": times.take(rows), "gimu": _gimu(gimu), "note": note})
        pq.write_table(table, source / f"part-{number}.parquet", row_group_size=100)
    assert sum(f.stat().st_size for f in source.iterdir()) >= pad
    return source


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return _mixed_parts(tmp_path_factory.mktemp("mixed"))


def _one_by_one(source: pathlib.Path, dest: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                on_bad_rows: str = "error") -> birdzarr.Store:
    """The reference: every device read by its own readers (no device is read with others)."""
    from birdzarr.convert import _segments

    with monkeypatch.context() as patch:
        patch.setattr(_segments, "RUN_WINDOWS", 0)
        return birdzarr.convert(str(source), str(dest), chunk_windows=256, workers=1, progress=False,
                                on_bad_rows=on_bad_rows)


@pytest.mark.parametrize("engine", ["this thread", "threads", "processes"])
def test_devices_read_together_store_what_reading_each_alone_stores(
    mixed: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """Small devices of partition files are read, summarised, checked for repeats and coded
    together: the store (every chunk, the device table, the report with its ignored-column notes
    and repeated windows) is byte-identical to reading each device alone, in this thread, on
    threads and in forked worker processes (input past ``PROCESS_MIN_BYTES``), with devices split
    over files, rows of a device not grouped, and one device larger than a run between them."""
    from birdzarr._errors import DuplicateWindowsWarning
    from birdzarr.convert import _segments

    source = mixed
    if engine == "processes":
        source = _mixed_parts(tmp_path / "large", pad=_segments.PROCESS_MIN_BYTES)
    with pytest.warns(DuplicateWindowsWarning):
        reference = _one_by_one(source, tmp_path / "alone.zarr", monkeypatch)
    assert reference.meta["report"]["duplicate_windows"] == {"5": 1}
    together = _count_runs(monkeypatch, _segments)
    with pytest.warns(DuplicateWindowsWarning):
        store = birdzarr.convert(str(source), str(tmp_path / "together.zarr"), chunk_windows=256,
                                 workers=1 if engine == "this thread" else 2, progress=False)
    assert ("worker_processes" in store.meta["report"]) == (engine == "processes")
    assert_same_store(tmp_path / "alone.zarr", tmp_path / "together.zarr")
    if engine != "processes":  # (a forked worker's calls are not counted here)
        assert sum(together) == 299 and max(together) > 5  # all but the large device, in runs
    notes = store.meta["report"]["devices"]["5"]["problems"]  # split over two files: each named
    assert notes == [f"{source / name}: columns not read (birdzarr reads gimu, device_id, label, "
                     'timestamp): ["note"]' for name in ("part-0.parquet", "part-1.parquet")]


def test_a_bad_row_among_devices_read_together_is_skipped_or_reported_as_alone(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row that is not 80 finite values: its devices are read one by one (the row group is not
    cut for many devices), so ``on_bad_rows="skip"`` stores and reports the same as reading every
    device alone, and the default refuses it with the same message."""
    from birdzarr._errors import BadInputError, DuplicateWindowsWarning
    from birdzarr.convert import _segments

    source = _mixed_parts(tmp_path, bad_row=True)
    with pytest.warns(DuplicateWindowsWarning):
        alone = _one_by_one(source, tmp_path / "alone.zarr", monkeypatch, on_bad_rows="skip")
    monkeypatch.setattr(_segments, "RUN_WINDOWS", RUN)
    with pytest.warns(DuplicateWindowsWarning):
        birdzarr.convert(str(source), str(tmp_path / "together.zarr"), chunk_windows=256, workers=1,
                         progress=False, on_bad_rows="skip")
    assert sum(device["bad_lines"] for device in alone.meta["report"]["devices"].values()) == 1
    assert_same_store(tmp_path / "alone.zarr", tmp_path / "together.zarr")
    with pytest.raises(BadInputError) as refused:
        birdzarr.convert(str(source), str(tmp_path / "refused.zarr"), workers=1, progress=False)
    with pytest.raises(BadInputError) as alone_refused, monkeypatch.context() as patch:
        patch.setattr(_segments, "RUN_WINDOWS", 0)
        birdzarr.convert(str(source), str(tmp_path / "refused.zarr"), workers=1, progress=False)
    assert str(refused.value) == str(alone_refused.value)
    assert "part-3.parquet, row group 0, row 5: the window holds a null, NaN or infinite value" in str(
        refused.value)


def test_the_rows_of_many_devices_are_laid_out_piece_by_piece_as_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``RowCoder.new_rows`` places the dictionary entries of many rows a piece of rows at a time
    (``_SCATTER`` entries, bounding its temporaries): the same arrays as placing them at once."""
    from birdzarr.format import _rows

    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 30, size=400)
    devices = np.repeat(np.arange(400) * 2 + 1, sizes)
    windows = _synthetic.curated_windows(len(devices), seed=7)
    coder = _rows.RowCoder()
    coder.code_runs(devices[:3000], windows[:3000])
    coder.code(int(devices[3000]), windows[3000:3010])  # a row of its own between the bulks
    coder.code_runs(devices[3010:], windows[3010:])
    whole = coder.new_rows()
    assert len(whole.values) > 1000
    for scatter in (1, 7, 1000):
        monkeypatch.setattr(_rows, "_SCATTER", scatter)
        pieces = coder.new_rows()
        assert pieces.values.tobytes() == whole.values.tobytes()
        assert np.array_equal(pieces.start, whole.start) and np.array_equal(pieces.device, whole.device)


def test_devices_counted_by_reading_are_read_together_too(
    mixed: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``on_bad_rows="skip"`` the footers do not give the counts: the devices are read once
    to count them, small devices of partition files together as in the conversion (each of the
    299 small devices read together twice), and the store is the same as reading each alone."""
    from birdzarr._errors import DuplicateWindowsWarning
    from birdzarr.convert import _segments

    with pytest.warns(DuplicateWindowsWarning):
        _one_by_one(mixed, tmp_path / "alone.zarr", monkeypatch, on_bad_rows="skip")
    together = _count_runs(monkeypatch, _segments)
    with pytest.warns(DuplicateWindowsWarning):
        birdzarr.convert(str(mixed), str(tmp_path / "together.zarr"), chunk_windows=256, workers=1,
                         progress=False, on_bad_rows="skip")
    assert sum(together) == 2 * 299
    assert_same_store(tmp_path / "alone.zarr", tmp_path / "together.zarr")


def _shuffled_alone(mixed: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                    engine: str) -> tuple[pathlib.Path, dict[str, Any], int, birdzarr.Store]:
    """A ``--shuffle`` case on ``engine`` (several buckets; for worker processes, input past
    ``PROCESS_MIN_BYTES``): its source, options and workers, and the reference store of spilling
    each device alone (``alone.zarr``)."""
    from birdzarr._errors import DuplicateWindowsWarning
    from birdzarr.convert import _segments, _shuffle

    monkeypatch.setattr(_shuffle, "BUCKET_WINDOWS", 1500)  # several buckets
    source = mixed
    if engine == "processes":
        source = _mixed_parts(tmp_path / "large", pad=_segments.PROCESS_MIN_BYTES)
    options: dict[str, Any] = {"chunk_windows": 256, "shuffle": True, "seed": 5, "progress": False}
    workers = 1 if engine == "this thread" else 2
    with pytest.warns(DuplicateWindowsWarning), monkeypatch.context() as patch:
        patch.setattr(_segments, "RUN_WINDOWS", 0)
        reference = birdzarr.convert(str(source), str(tmp_path / "alone.zarr"), workers=workers, **options)
    return source, options, workers, reference


@pytest.mark.parametrize("engine", ["this thread", "threads", "processes"])
def test_shuffled_devices_read_together_store_what_reading_each_alone_stores(
    mixed: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """``--shuffle``'s first pass reads, summarises, checks, codes and spills small devices of
    partition files together (pieces of many devices): the store (every chunk, the device table
    with its order-free digests, the report with its notes and repeated windows) is byte-identical
    to spilling each device alone, in this thread, on threads and in forked worker processes
    (input past ``PROCESS_MIN_BYTES``), with the same seed and buckets."""
    from birdzarr._errors import DuplicateWindowsWarning
    from birdzarr.convert import _shuffle_processes

    source, options, workers, reference = _shuffled_alone(mixed, tmp_path, monkeypatch, engine)
    assert reference.meta["report"]["duplicate_windows"] == {"5": 1}
    assert reference.meta["layout"]["shuffle_buckets"] > 2
    together = _count_runs(monkeypatch, _shuffle_processes)
    with pytest.warns(DuplicateWindowsWarning):
        store = birdzarr.convert(str(source), str(tmp_path / "together.zarr"), workers=workers, **options)
    assert ("worker_processes" in store.meta["report"]) == (engine == "processes")
    assert_same_store(tmp_path / "alone.zarr", tmp_path / "together.zarr")
    if engine != "processes":  # (a forked worker's calls are not counted here)
        assert sum(together) == 299 and max(together) > 2  # all but the large device, in runs
    entries = {e.device_id: e for e in store.device_table}
    assert all(e.scattered_digest is not None and not e.ranges for e in entries.values())


@pytest.mark.parametrize("engine", ["this thread", "threads", "processes"])
def test_shuffled_devices_of_one_row_are_coded_into_one_dictionary_as_alone(
    mixed: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """Partition files (windows known before reading): pass 1 codes the devices of one dictionary
    row (``shared_groups``) that a run holds into one dictionary, not one a device, so pass 1
    holds far fewer dictionaries and rows that a run holds whole are seeded as they are; rows cut
    between runs or tasks are merged. The store is byte-identical to spilling each device alone,
    in this thread, on threads and in worker processes."""
    from birdzarr._errors import DuplicateWindowsWarning
    from birdzarr.convert import _segments, _shuffle, _shuffle_processes
    from birdzarr.format import _rows

    monkeypatch.setattr(_rows, "SHARED_ROW_WINDOWS", 100)  # rows of a few devices: ~60 of them
    # rows not merged where they share values (``_shuffle._merge_rows``, which would recode them):
    # what is seen here is pass 1's codes of rows as they are (tests/test_shuffle_merged_rows.py)
    monkeypatch.setattr(_shuffle, "MIN_SHARED", 1.01)
    source, options, workers, _ = _shuffled_alone(mixed, tmp_path, monkeypatch, engine)
    seen: list[tuple[int, int, list[bool]]] = []
    seed_rows = _shuffle_processes.seed_rows

    def watched(coder: object, dictionaries: object, counts: list[int], devices: np.ndarray) -> object:
        seeded = seed_rows(coder, dictionaries, counts, devices)  # type: ignore[arg-type]
        seen.append((len(dictionaries.ids), len(devices),  # type: ignore[attr-defined]
                     [codes is None for codes in seeded.row_codes]))
        return seeded

    monkeypatch.setattr(_shuffle_processes, "seed_rows", watched)
    # runs of 450 windows end between rows; runs of 60 cut rows of up to 100 windows
    for run in [450, 60] if engine == "this thread" else [450]:
        monkeypatch.setattr(_segments, "RUN_WINDOWS", run)
        with pytest.warns(DuplicateWindowsWarning):
            birdzarr.convert(str(source), str(tmp_path / f"together{run}.zarr"), workers=workers, **options)
        assert_same_store(tmp_path / "alone.zarr", tmp_path / f"together{run}.zarr")
    assert [devices for _, devices, _ in seen] == [300] * len(seen)
    assert seen[0][0] < 100 and all(parts < 300 for parts, _, _ in seen)  # not one a device
    if engine == "this thread":  # every row whole in one run: pass 1's codes are the rows' own
        assert [as_they_are for _, _, as_they_are in seen] == [[True] * 3, [False] * 3]


def test_rows_are_known_before_reading_only_from_partition_files_without_skipped_rows(
    mixed: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """``row_keys``: each device's row (its group's first id) from the partition files' rows,
    the rows ``seed_rows`` opens after pass 1; None where a device's windows are not known before
    reading (``on_bad_rows="skip"`` may drop rows; a per-device file's windows are not listed)."""
    from birdzarr.convert._shuffle_processes import row_keys
    from birdzarr.convert._sources import find_inputs
    from birdzarr.format._rows import shared_groups

    devices = find_inputs(resolve(str(mixed))).devices
    keys = row_keys(devices, "error")
    assert keys is not None
    ids = [d.device_id for d in devices]
    groups = shared_groups(ids, [d.partition_rows for d in devices])
    assert len(groups) > 1
    expected = {d: d for d in ids} | {d: g[0] for g in groups for d in g}
    assert keys.tolist() == [expected[d] for d in ids]
    assert row_keys(devices, "skip") is None
    single = tmp_path / "alone"
    single.mkdir()
    shutil.copy(mixed / "part-0.parquet", single / "part-0.parquet")
    pq.write_table(pq.read_table(mixed / "part-1.parquet").drop_columns(["device_id"]),
                   single / "7777.parquet")
    assert row_keys(find_inputs(resolve(str(single))).devices, "error") is None


def _count_runs(monkeypatch: pytest.MonkeyPatch, reader: object) -> list[int]:
    """Runs of RUN windows, and the number of devices each ``read_runs`` call of ``reader`` read
    together (0: it fell back to reading them alone), appended as the conversion calls it."""
    from birdzarr.convert import _segments

    together: list[int] = []
    read_runs = reader.read_runs  # type: ignore[attr-defined]

    def counted(devices: list) -> object:
        found = read_runs(devices)
        together.append(0 if found is None else len(devices))
        return found

    monkeypatch.setattr(_segments, "RUN_WINDOWS", RUN)
    monkeypatch.setattr(reader, "read_runs", counted)
    return together


def test_each_windows_bucket_is_a_hash_of_the_seed_its_device_and_its_number(
    mixed: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--shuffle`` sends the ``i``-th window of a device (its input order, the device-ordered
    store's) to bucket ``draw_buckets(seed, device, i)``, whether the device is read with others
    (runs of small devices) or alone (the 300-window device): bucket ``b``'s stretch of the
    store holds exactly the windows drawn to ``b``."""
    from birdzarr._errors import DuplicateWindowsWarning
    from birdzarr.convert import _shuffle

    monkeypatch.setattr(_shuffle, "BUCKET_WINDOWS", 1500)  # several buckets
    options = {"chunk_windows": 256, "workers": 1, "progress": False}
    with pytest.warns(DuplicateWindowsWarning):
        plain = birdzarr.convert(str(mixed), str(tmp_path / "plain.zarr"), **options)
    with pytest.warns(DuplicateWindowsWarning):
        shuffled = birdzarr.convert(str(mixed), str(tmp_path / "s.zarr"), shuffle=True, seed=5, **options)
    buckets = shuffled.meta["layout"]["shuffle_buckets"]
    assert buckets > 2
    devices = plain.window_devices[:]
    cut = np.flatnonzero(np.r_[True, devices[1:] != devices[:-1]])
    assert len(cut) == len(np.unique(devices))  # device order: a device's windows in one stretch
    drawn = _shuffle.draw_buckets(5, devices[cut], np.diff(np.r_[cut, len(devices)]), 0, buckets)
    ends = np.r_[0, np.cumsum(np.bincount(drawn, minlength=buckets))]

    def rows(store: birdzarr.Store) -> np.ndarray:
        """Each window's values, device, label and time as one opaque row."""
        values = store.windows[:].reshape(len(store), -1).view(np.uint32).astype(np.int64)
        extra = np.stack([store.window_devices[:], store.labels[:], store.timestamps[:]], axis=1)
        out = np.ascontiguousarray(np.concatenate([values, extra.astype(np.int64)], axis=1))
        return out.view(np.dtype((np.void, 8 * out.shape[1]))).ravel()

    ours, theirs = rows(shuffled), rows(plain)
    for b in range(buckets):
        assert np.array_equal(np.sort(ours[ends[b] : ends[b + 1]]), np.sort(theirs[drawn == b]))


def test_the_shuffles_second_pass_starts_without_the_decoded_row_groups(
    mixed: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pass 1 keeps partition files' decoded row groups for the next devices (``_GROUPS``, up to
    ``GROUP_CACHE_BYTES``); once every device is read they are freed, before the rows are seeded
    and pass 2 loads its buckets (memory: they are not held beside the dictionaries)."""
    from birdzarr._errors import DuplicateWindowsWarning
    from birdzarr.convert import _parquet, _shuffle_processes

    held: list[int] = []
    seed_rows = _shuffle_processes.seed_rows

    def watched(*args: object, **kwargs: object) -> object:
        held.append(len(_parquet._GROUPS.entries))
        return seed_rows(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_shuffle_processes, "seed_rows", watched)
    kept: list[int] = []
    read_runs = _shuffle_processes.read_runs

    def reading(devices: list) -> object:
        found = read_runs(devices)
        kept.append(len(_parquet._GROUPS.entries))
        return found

    monkeypatch.setattr(_shuffle_processes, "read_runs", reading)
    with pytest.warns(DuplicateWindowsWarning):
        birdzarr.convert(str(mixed), str(tmp_path / "s.zarr"), chunk_windows=256, workers=1, progress=False,
                         shuffle=True, seed=5)
    assert kept and min(kept) > 0  # pass 1 keeps decoded groups for the next devices
    assert held == [0]


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_files_of_devices_read_together_are_named_once(
    mixed: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool
) -> None:
    """The devices of partition files share their files: the names their entries list
    (``sources``) are found once a file for a run of devices read together, not once a device
    (``_sources.source_names_of``), and are each device's files' names."""
    from birdzarr._errors import DuplicateWindowsWarning
    from birdzarr.convert import _sources

    named: list[str] = []
    file_name = _sources.file_name

    def counted(file: object) -> str:
        named.append(file_name(file))  # type: ignore[arg-type]
        return named[-1]

    monkeypatch.setattr(_sources, "file_name", counted)
    options = {"chunk_windows": 256, "workers": 1, "progress": False}
    with pytest.warns(DuplicateWindowsWarning):
        store = birdzarr.convert(str(mixed), str(tmp_path / "s.zarr"), shuffle=shuffle,
                                 **({"seed": 5} if shuffle else {}), **options)
    entries = store.device_table
    assert len(entries) == 300 and len(named) <= 8  # 4 files, in one run (once a device: 343)
    names = {f"part-{k}.parquet" for k in range(4)}
    assert all(e.sources and set(e.sources) <= names for e in entries)
    assert sum(len(e.sources) == 2 for e in entries) > 20  # devices split over two files name both
