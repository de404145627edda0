"""Parquet partition files (many devices a file, a ``device_id`` column), hive ``device_id=K/``
folders and several sources: the same store as the equivalent per-device files, and never a
window attributed to the wrong device."""

from __future__ import annotations

import gc
import json
import pathlib
import re
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from format2_support import read_details

import birdzarr
from birdzarr import BadInputError
from birdzarr.cli import main
from birdzarr.convert import _parquet, _segments
from birdzarr.convert._summary import column_summaries
from birdzarr.convert._writer import StoreWriter
from birdzarr.demo import _synthetic
from birdzarr.format import _device_table as device_table
from birdzarr.format._device_columns import DeviceColumns
from birdzarr.format._spec import TIMESTAMP_UNKNOWN as _TIME_UNKNOWN
from birdzarr.format._spec import DeviceEntry, DeviceRange, DeviceReport

SIZES = {3: 700, 8: 45, 15: 1300, 16: 1, 40: 380, 1000: 260}


def _gimu(windows: np.ndarray) -> pa.Array:
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_same_windows_store(a: pathlib.Path, b: pathlib.Path) -> None:
    """Every chunk and array metadata file byte-identical; the device tables equal but for the
    file names (``sources``) each device came from: a format-2 store's device table details
    (``device_table/<g>/details``) are compared as entries but for their sources."""
    files_a, files_b = _files(a), _files(b)
    assert sorted(files_a) == sorted(files_b)
    assert _entries_but_sources(a) == _entries_but_sources(b)
    for name, content in files_a.items():
        if not re.fullmatch(r"device_table/\d+/details/.*", name) and name != "zarr.json":
            assert content == files_b[name], name
    left, right = birdzarr.open_store(a), birdzarr.open_store(b)
    for column in left.devices.columns:
        if column != "sources":
            assert left.devices[column].tolist() == right.devices[column].tolist(), column


def _entries_but_sources(store: pathlib.Path) -> list[dict[str, object]]:
    return [{k: v for k, v in entry.items() if k != "sources"} for entry in read_details(store)["devices"]]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """The same windows as per-device files and as three partition files whose rows mix the
    devices (not grouped), a device split over all three, row groups of 97 rows."""
    root = tmp_path_factory.mktemp("layouts")
    truth = {d: _synthetic.curated_windows(n, seed=d) for d, n in SIZES.items()}
    rng = np.random.default_rng(5)
    # each device's windows dealt to the three files in runs, in order; rows shuffled across
    # devices inside a file (a device's own rows keep their order)
    per_file: list[list[tuple[int, int]]] = [[], [], []]
    for device, windows in truth.items():
        for index in range(len(windows)):
            per_file[min(2, index * 3 // len(windows))].append((device, index))
    order: dict[int, list[int]] = {d: [] for d in truth}
    partitions = root / "partitions"
    partitions.mkdir()
    for number, rows in enumerate(per_file):
        owners = [d for d, _ in rows]
        rng.shuffle(owners)
        queues = {d: iter([i for e, i in rows if e == d]) for d in truth}
        mixed = [(d, next(queues[d])) for d in owners]
        for device, index in mixed:
            order[device].append(index)
        table = pa.table({
            "device_id": pa.array([d for d, _ in mixed], pa.int32()),
            "gimu": _gimu(np.stack([truth[d][i] for d, i in mixed])),
        })
        pq.write_table(table, partitions / f"part-{number}.parquet", row_group_size=97)
    per_device = root / "per_device"
    per_device.mkdir()
    for device, windows in truth.items():
        pq.write_table(pa.table({"gimu": _gimu(windows[order[device]])}), per_device / f"{device}.parquet")
    return {"partitions": partitions, "per_device": per_device}


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_partition_files_give_the_per_device_store(
    layouts: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    monkeypatch.setattr(_parquet._GROUPS, "max_bytes", 1)  # the cache keeps only the last group
    birdzarr.convert(layouts["per_device"], tmp_path / "one.zarr", chunk_windows=256, workers=workers,
                     progress=False)
    parts = birdzarr.convert(layouts["partitions"], tmp_path / "parts.zarr", chunk_windows=256,
                             workers=workers, progress=False)
    assert len(parts) == sum(SIZES.values())
    assert parts.devices["device_id"].tolist() == sorted(SIZES)
    assert parts.device(15).sources == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert parts.device(16).sources == ["part-0.parquet"]
    assert_same_windows_store(tmp_path / "one.zarr", tmp_path / "parts.zarr")


@pytest.mark.slow
def test_partition_files_in_worker_processes(
    layouts: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)
    monkeypatch.setattr(_segments, "MIN_SEGMENT_CHUNKS", 0)
    monkeypatch.setattr(_segments, "SEGMENTS_PER_WORKER", 100)
    birdzarr.convert(layouts["per_device"], tmp_path / "one.zarr", chunk_windows=256, workers=1,
                     progress=False)
    parts = birdzarr.convert(layouts["partitions"], tmp_path / "parts.zarr", chunk_windows=256, workers=2,
                             progress=False)
    assert parts.meta["report"]["worker_processes"] == 2
    assert_same_windows_store(tmp_path / "one.zarr", tmp_path / "parts.zarr")


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_shuffled_partition_store_holds_the_per_device_windows(
    layouts: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    stores = [birdzarr.convert(layouts[name], tmp_path / f"{name}.zarr", shuffle=True, seed=3,
                               chunk_windows=512, workers=1, progress=False)
              for name in ("per_device", "partitions")]
    for device in SIZES:
        windows = []
        for store in stores:
            index = np.sort(store.device_indices(device))
            windows.append(store.windows[index].view(np.uint32))
        rows = [sorted(map(bytes, w)) for w in windows]
        assert len(windows[0]) == SIZES[device] and rows[0] == rows[1], device
    # the same spill buckets (this input is small: one): the same store
    assert stores[0].meta["layout"]["shuffle_buckets"] == stores[1].meta["layout"]["shuffle_buckets"]
    assert_same_windows_store(tmp_path / "per_device.zarr", tmp_path / "partitions.zarr")


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_device_named_file_with_other_devices_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    windows = _synthetic.curated_windows(30, seed=1)
    ids = pa.array([7] * 20 + [9] * 10, pa.int64())
    pq.write_table(pa.table({"gimu": _gimu(windows), "device_id": ids}), source / "7.parquet")
    assert main(["convert", str(source), str(tmp_path / "s.zarr"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "7.parquet, row group 0, row 20: device_id is 9" in err
    assert "name (or folder) says device 7" in err and "partition file" in err
    assert not (tmp_path / "s.zarr").exists()
    # the same rows named as a partition file: two devices, by the column
    (source / "7.parquet").rename(source / "part-0.parquet")
    store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    assert store.devices["device_id"].tolist() == [7, 9]
    assert np.array_equal(store.device_windows(9), windows[20:])
    # a device-named file whose column agrees is that device's file
    shutil.rmtree(source)
    source.mkdir()
    pq.write_table(pa.table({"gimu": _gimu(windows), "device_id": pa.array([7] * 30)}), source / "7.parquet")
    assert birdzarr.convert(source, tmp_path / "t.zarr", progress=False).devices["device_id"].tolist() == [7]


def test_layouts_mix_but_a_device_comes_one_way(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    windows = _synthetic.curated_windows(10, seed=2)
    _synthetic.write_parquet(windows, source / "5.parquet")
    table = pa.table({"device_id": pa.array([6] * 10), "gimu": _gimu(windows)})
    pq.write_table(table, source / "batch-a.parquet")
    store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    assert store.devices["device_id"].tolist() == [5, 6]
    table = pa.table({"device_id": pa.array([5] * 10), "gimu": _gimu(windows)})
    pq.write_table(table, source / "batch-b.parquet")
    with pytest.raises(BadInputError, match=r"device 5 is in '.*5.parquet' and also in the partition file "
                                            r"'.*batch-b.parquet'.*not both"):
        birdzarr.convert(source, tmp_path / "t.zarr", progress=False)


def test_partition_files_need_a_device_id_column(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    windows = _synthetic.curated_windows(4, seed=3)
    pq.write_table(pa.table({"gimu": _gimu(windows)}), source / "part-0.parquet")
    with pytest.raises(BadInputError, match=r"part-0.parquet: cannot tell the device: name per-device files "
                                            r"\{device\}.parquet .* has no device_id column"):
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    ids = pa.array([1, None, 1, 2], pa.int64())
    pq.write_table(pa.table({"gimu": _gimu(windows), "device_id": ids}), source / "part-0.parquet")
    with pytest.raises(BadInputError, match="row group 0: 1 rows have no device_id"):
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    ids = pa.array([1, -4, 1, 2], pa.int64())
    pq.write_table(pa.table({"gimu": _gimu(windows), "device_id": ids}), source / "part-0.parquet")
    with pytest.raises(BadInputError, match="device_id -4 is not a device id"):
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    ids = pa.array(["1", "1", "1", "2"])
    pq.write_table(pa.table({"gimu": _gimu(windows), "device_id": ids}), source / "part-0.parquet")
    with pytest.raises(BadInputError, match="column 'device_id' has type string; device ids are integers"):
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_hive_folders_are_devices(layouts: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    hive = tmp_path / "hive"
    for file in sorted(layouts["per_device"].iterdir()):
        folder = hive / f"device_id={file.stem}"
        folder.mkdir(parents=True)
        table = pq.read_table(file)
        half = len(table) // 2
        # two files a folder, read in name order (numbers as numbers: part-2 before part-10)
        pq.write_table(table.slice(0, half), folder / "part-2.parquet")
        pq.write_table(table.slice(half), folder / "part-10.parquet")
    birdzarr.convert(layouts["per_device"], tmp_path / "one.zarr", chunk_windows=256, progress=False)
    store = birdzarr.convert(hive, tmp_path / "hive.zarr", chunk_windows=256, progress=False)
    assert store.device(15).sources == ["part-2.parquet", "part-10.parquet"]
    assert_same_windows_store(tmp_path / "one.zarr", tmp_path / "hive.zarr")
    (hive / "device_id=3" / "notes.txt").write_text("x")
    with pytest.raises(BadInputError, match="1 entry is not an input file: 'device_id=3/notes.txt'"):
        birdzarr.convert(hive, tmp_path / "again.zarr", progress=False)


# -- several sources ---------------------------------------------------------------------------------


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_several_csv_sources_equal_one_directory(tmp_path: pathlib.Path) -> None:
    whole = tmp_path / "whole"
    _synthetic.make_csv_dir(whole, n_devices=3, bursts_per_device=30, parts=4, seed=2)
    seasons = [tmp_path / "s1", tmp_path / "s2"]
    for season in seasons:
        season.mkdir()
    for file in whole.iterdir():  # parts 0 and 2 in one season, 1 and 3 (and part 10) in the other
        part = int(file.stem.split("_")[1])
        shutil.copy(file, seasons[part % 2] / file.name)
    birdzarr.convert(whole, tmp_path / "one.zarr", chunk_windows=128, progress=False)
    store = birdzarr.convert([str(s) for s in seasons], tmp_path / "two.zarr", chunk_windows=128,
                             progress=False)
    for device in store.devices["device_id"].tolist():
        assert store.device(device).sources == [f"{device}_{p}.csv" for p in range(4)]
    assert_same_windows_store(tmp_path / "one.zarr", tmp_path / "two.zarr")
    assert main(["convert", str(seasons[0]), str(seasons[1]), str(tmp_path / "cli.zarr"), "--quiet",
                 "--chunk-windows", "128"]) == 0
    assert_same_windows_store(tmp_path / "one.zarr", tmp_path / "cli.zarr")
    report = birdzarr.open_store(tmp_path / "cli.zarr").meta["report"]
    assert report["source"] == f"{seasons[0]}, {seasons[1]}"


def test_several_sources_refuse_a_device_twice(tmp_path: pathlib.Path) -> None:
    seasons = [tmp_path / "s1", tmp_path / "s2"]
    windows = _synthetic.curated_windows(5, seed=1)
    for season in seasons:
        season.mkdir()
        _synthetic.write_parquet(windows, season / "5.parquet")
    with pytest.raises(BadInputError, match=r"'.*s1/5.parquet' and '.*s2/5.parquet' both hold device 5"):
        birdzarr.convert(seasons, tmp_path / "s.zarr", progress=False)
    (seasons[0] / "5_0.csv").write_text("5,2014-01-01 10:00:00,0,-1,0.1,0.2,0.3,1.0\n")
    (seasons[0] / "5.parquet").unlink()
    with pytest.raises(BadInputError, match="the sources hold both CSV and Parquet files"):
        birdzarr.convert(seasons, tmp_path / "s.zarr", progress=False)
    # the same CSV part in two sources
    (seasons[1] / "5.parquet").unlink()
    (seasons[1] / "5_0.csv").write_text("5,2014-01-01 10:00:00,0,-1,0.1,0.2,0.3,1.0\n")
    with pytest.raises(BadInputError, match=r"both name the same device and part \(0\) 5"):
        birdzarr.convert(seasons, tmp_path / "s.zarr", progress=False)
    with pytest.raises(birdzarr.ArgumentError, match="is given twice"):
        birdzarr.convert([seasons[0], seasons[0]], tmp_path / "s.zarr", progress=False)
    with pytest.raises(birdzarr.ArgumentError, match="empty list"):
        birdzarr.convert([], tmp_path / "s.zarr", progress=False)


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_partition_files_across_sources(layouts: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    seasons = [tmp_path / "s1", tmp_path / "s2"]
    for season in seasons:
        season.mkdir()
    for file in layouts["partitions"].iterdir():
        shutil.copy(file, seasons[file.stem == "part-2"] / file.name)
    birdzarr.convert(layouts["per_device"], tmp_path / "one.zarr", chunk_windows=256, progress=False)
    birdzarr.convert(seasons, tmp_path / "two.zarr", chunk_windows=256, progress=False)
    assert_same_windows_store(tmp_path / "one.zarr", tmp_path / "two.zarr")


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_bad_row_of_a_partition_file_is_its_own_devices(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    windows = _synthetic.curated_windows(6, seed=6)
    rows = [list(map(float, w.reshape(-1))) for w in windows]
    rows[3] = rows[3][:79]  # device 2's second row: 79 values
    table = pa.table({"device_id": pa.array([1, 2, 1, 2, 1, 2], pa.int64()),
                      "gimu": pa.array(rows, pa.list_(pa.float32()))})
    pq.write_table(table, source / "part-0.parquet")
    with pytest.raises(BadInputError, match=r"part-0.parquet, row group 0, row 3: the window has 79 values"):
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False, on_bad_rows="skip")
    assert np.array_equal(store.device_windows(1), windows[[0, 2, 4]])
    assert np.array_equal(store.device_windows(2), windows[[1, 5]])
    assert store.report[2].bad_lines == 1 and store.report[1].bad_lines == 0


def test_a_hive_folder_file_saying_another_device_is_refused(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "src" / "device_id=4"
    folder.mkdir(parents=True)
    windows = _synthetic.curated_windows(3, seed=7)
    table = pa.table({"gimu": _gimu(windows), "device_id": pa.array([4, 4, 5], pa.int16())})
    pq.write_table(table, folder / "data.parquet")
    message = r"data.parquet, row group 0, row 2: device_id is 5, but the .* says device 4"
    with pytest.raises(BadInputError, match=message):
        birdzarr.convert(tmp_path / "src", tmp_path / "s.zarr", progress=False)


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_partition_files_verify_and_append(layouts: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    whole = birdzarr.convert(layouts["partitions"], tmp_path / "whole.zarr", chunk_windows=256,
                             progress=False)
    assert birdzarr.verify(whole, source=layouts["partitions"]).ok
    seasons = [tmp_path / "s1", tmp_path / "s2"]
    for season in seasons:
        season.mkdir()
    for file in layouts["partitions"].iterdir():  # part-2 (a third of most devices) comes later
        shutil.copy(file, seasons[file.stem == "part-2"] / file.name)
    birdzarr.convert(seasons[0], tmp_path / "grown.zarr", chunk_windows=256, progress=False)
    grown = birdzarr.append(tmp_path / "grown.zarr", seasons[1], progress=False)
    assert len(grown) == len(whole)
    for device in SIZES:
        assert np.array_equal(grown.device_windows(device), whole.device_windows(device)), device


def _runs(**changes: object) -> DeviceColumns:
    """Four devices read together: two files for one, none for another's windows, labels mixed
    for one, times known for some, report notes for two, names that JSON escapes."""
    columns: dict[str, object] = dict(
        device_ids=np.array([3, 5, 9, 12]), counts=np.array([2, 0, 3, 1]), starts=np.array([0, 2, 2, 5]),
        checksums=np.array([1, 0, 0xFFFFFFFF, 16], np.uint32),
        first_times=np.array([10, _TIME_UNKNOWN, 5, _TIME_UNKNOWN]),
        last_times=np.array([20, _TIME_UNKNOWN, 7, _TIME_UNKNOWN]),
        label_device=np.array([0, 0, 2, 2, 3]), label_value=np.array([-1, 4, 1, 2, 7]),
        label_count=np.array([1, 1, 1, 2, 1]), names=['a"b.parquet', "\u00e9.parquet", "p"],
        name_at=np.array([0, 1, 1, 0, 2, 2]), name_bounds=np.array([0, 2, 3, 5, 6]),
        problems={1: ["note x", 'q"'], 3: ["z"]})
    columns.update(changes)
    return DeviceColumns(**columns)  # type: ignore[arg-type]


def test_devices_kept_as_columns_spell_the_table_their_entries_give() -> None:
    """The device table of devices recorded as columns (``DeviceColumns``), among devices recorded
    as objects: the details' JSON and the index arrays are the ones their entries and reports
    give, byte for byte, in ascending device id."""
    runs = [_runs(), _runs(device_ids=np.array([30, 31, 32, 40]))]
    objects = [DeviceEntry(device_id=4, n_windows=1, sources=["x"], label_counts={0: 1},
                           ranges=[DeviceRange(9, 10, "0000abcd")]), DeviceEntry(device_id=35)]
    reports = [(4, DeviceReport(rows_read=1, windows_written=1, dropped={"speed": 2})), (35, DeviceReport())]
    summaries = [s for r in runs for s in column_summaries(r)]
    entries = sorted(objects + [s.entry for s in summaries], key=lambda e: e.device_id)
    every_report = sorted(reports + [(s.entry.device_id, s.report) for s in summaries])
    assert [e.device_id for e in entries] == [3, 4, 5, 9, 12, 30, 31, 32, 35, 40]
    assert summaries[1].report.problems == ["note x", 'q"'] and summaries[1].entry.ranges == []
    assert summaries[2].entry.label_counts == {1: 1, 2: 2}
    assert summaries[0].entry.sources == ['a"b.parquet', "\u00e9.parquet"]
    expected = json.dumps({"devices": [e.to_json() for e in entries],
                           "report_devices": {str(d): r.to_json() for d, r in every_report},
                           "csv_tails": {"1": [2]}}, separators=(",", ":")).encode()
    assert device_table.details_json(objects, reports, {"1": [2]}, runs) == expected
    assert device_table.details_json(entries, every_report, {"1": [2]}) == expected
    got, want = device_table.columns(objects, runs), device_table.columns(entries)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tolist() == want[name].tolist(), name


def test_scattered_devices_kept_as_columns_spell_the_table_their_entries_give() -> None:
    """Devices of a shuffled store recorded as columns (``DeviceColumns`` with digests: no range,
    each entry's ``scattered_digest``), among scattered devices recorded as objects: the details'
    JSON and the index arrays (no ranges) are the ones their entries and reports give, byte for
    byte, in ascending device id; columns of the two kinds in one table spell each its own."""
    empty = np.empty(0, np.int64)
    digests = np.array([2**64 - 1, 0, 0x0123456789ABCDEF, 1], np.uint64)
    runs = [_runs(starts=empty, checksums=empty.astype(np.uint32), digests=digests),
            _runs(device_ids=np.array([30, 31, 32, 40]), starts=empty, checksums=empty.astype(np.uint32),
                  digests=digests[::-1].copy())]
    objects = [DeviceEntry(device_id=4, n_windows=1, sources=["x"], label_counts={0: 1},
                           scattered_digest="00000000deadbeef"), DeviceEntry(device_id=35)]
    reports = [(4, DeviceReport(rows_read=1, windows_written=1)), (35, DeviceReport())]
    summaries = [s for r in runs for s in column_summaries(r)]
    assert [s.entry.scattered_digest for s in summaries[:4]] == [
        "ffffffffffffffff", "0000000000000000", "0123456789abcdef", "0000000000000001"]
    assert all(s.entry.ranges == [] and s.entry.scattered_checksum is None for s in summaries)
    entries = sorted(objects + [s.entry for s in summaries], key=lambda e: e.device_id)
    every_report = sorted(reports + [(s.entry.device_id, s.report) for s in summaries])
    expected = json.dumps({"devices": [e.to_json() for e in entries],
                           "report_devices": {str(d): r.to_json() for d, r in every_report},
                           "csv_tails": None}, separators=(",", ":")).encode()
    assert device_table.details_json(objects, reports, None, runs) == expected
    got, want = device_table.columns(objects, runs), device_table.columns(entries)
    assert list(got) == list(want) and len(got["range_device"]) == 0
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].tolist() == want[name].tolist(), name
    ranged = _runs(device_ids=np.array([50, 51, 52, 53]))
    mixed = [*(e for e in entries), *(e for e, _ in ranged.objects())]
    mixed_reports = every_report + [(e.device_id, r) for e, r in ranged.objects()]
    assert device_table.details_json(objects, reports, None, [*runs, ranged]) == json.dumps(
        {"devices": [e.to_json() for e in mixed],
         "report_devices": {str(d): r.to_json() for d, r in mixed_reports}, "csv_tails": None},
        separators=(",", ":")).encode()
    with pytest.raises(ValueError, match="not joined"):
        DeviceColumns.joined([runs[0], ranged])


@pytest.mark.parametrize("shuffle", [False, True])
def test_devices_read_together_reach_the_commit_as_columns(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool
) -> None:
    """400 small devices of partition files, in device order or shuffled: the writer records
    them as columns, so the commit finds no entry, range or report object a device (the cyclic
    garbage collector walked ~6 such objects a device again and again: a second of a
    100,000-device conversion), and the store is the one reading each device alone gives."""
    source = tmp_path / "parts"
    source.mkdir()
    owner = np.repeat(np.arange(1, 401), 3)
    windows = _synthetic.curated_windows(len(owner), seed=4)
    for number, rows in enumerate(np.split(np.arange(len(owner)), [601])):  # device 201 in both
        table = pa.table({"device_id": pa.array(owner[rows], pa.int32()), "gimu": _gimu(windows[rows]),
                          "label": pa.array(rows % 3 - 1, pa.int32())})
        pq.write_table(table, source / f"part-{number}.parquet")
    alive: list[int] = []
    options: dict[str, object] = {"shuffle": True, "seed": 3} if shuffle else {}

    def held() -> int:
        gc.collect()
        return sum(isinstance(o, (DeviceEntry, DeviceRange, DeviceReport)) for o in gc.get_objects())

    def counting(self: StoreWriter, *args: object, **kwargs: object) -> object:
        alive.append(held() - before)  # objects other tests left alive are counted in ``before``
        return commit(self, *args, **kwargs)

    commit = StoreWriter.commit
    with monkeypatch.context() as patch:
        patch.setattr(_segments, "RUN_WINDOWS", 0)  # the reference: every device read alone
        birdzarr.convert(source, tmp_path / "alone.zarr", chunk_windows=256, workers=1, progress=False,
                         **options)
    monkeypatch.setattr(StoreWriter, "commit", counting)
    before = held()
    store = birdzarr.convert(source, tmp_path / "together.zarr", chunk_windows=256, workers=1, progress=False,
                             **options)
    assert alive == [0]
    assert store.device(201).sources == ["part-0.parquet", "part-1.parquet"]
    assert store.device(7).label_counts == {-1: 1, 0: 1, 1: 1}
    assert read_details(tmp_path / "alone.zarr") == read_details(tmp_path / "together.zarr")
    alone, together = _files(tmp_path / "alone.zarr"), _files(tmp_path / "together.zarr")
    assert sorted(alone) == sorted(together)
    assert [n for n in alone if n != "zarr.json" and alone[n] != together[n]] == []


def test_devices_of_one_partition_file_share_one_list_of_it(tmp_path: pathlib.Path) -> None:
    """find_inputs groups the devices of partition files as arrays: a device found in one file
    alone shares one list of that file with the others (no list a device), a device split over
    files lists them in natural order (part-2 before part-10), each with its rows counted."""
    from birdzarr.convert._sources import find_inputs
    from birdzarr.storage._location import resolve

    source = tmp_path / "parts"
    source.mkdir()
    holds = {"part-10.parquet": [5, 5, 7, 9, 9, 9], "part-2.parquet": [3, 4, 4, 7, 1]}
    for name, owner in holds.items():
        table = pa.table({"device_id": pa.array(owner, pa.int32()),
                          "gimu": _gimu(_synthetic.curated_windows(len(owner), seed=1))})
        pq.write_table(table, source / name, row_group_size=2)
    devices = find_inputs(resolve(str(source))).devices
    assert [(d.device_id, [f.display.rsplit("/", 1)[-1] for f in d.files], d.partition_rows)
            for d in devices] == [
        (1, ["part-2.parquet"], 1), (3, ["part-2.parquet"], 1), (4, ["part-2.parquet"], 2),
        (5, ["part-10.parquet"], 2), (7, ["part-2.parquet", "part-10.parquet"], 2),
        (9, ["part-10.parquet"], 3)]
    by_id = {d.device_id: d for d in devices}
    assert by_id[1].files is by_id[3].files is by_id[4].files
    assert by_id[5].files is by_id[9].files and by_id[7].files is not by_id[1].files


def test_the_format_package_imports_nothing_of_the_conversion() -> None:
    """Imports point one way: ``birdzarr.format`` (what a store is) never imports
    ``birdzarr.convert`` (what writes one), the device table's columns included."""
    import ast

    format_dir = pathlib.Path(device_table.__file__).parent
    found = []
    for module in sorted(format_dir.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{module.name}: {n}" for n in names if n.startswith("birdzarr.convert")]
    assert found == []
