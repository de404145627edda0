"""Append runs on convert's engine: the same tasks (Parquet segments, CSV parts) on this thread,
threads or forked worker processes (``PROCESS_MIN_BYTES`` decides, as for convert) or a Dask
cluster, and every engine stores the same bytes. Appending new devices equals one conversion of
all the input; an extended device continues its committed dictionary row (format 2) and is
checked for duplicates against its committed windows; a CSV burst split between seasons is
continued on every engine. (The engine itself: tests/test_engine.py.)"""

from __future__ import annotations

import contextlib
import pathlib
import shutil

import numpy as np
import pytest
import zarr

import birdzarr
from birdzarr._errors import BadInputError, DuplicateWindowsWarning
from birdzarr.convert import _segments, append
from birdzarr.convert._append import AppendResult, append_detailed
from birdzarr.demo import _synthetic
from birdzarr.maintenance._verify import verify
from birdzarr.store._tail import leftovers
from tests.store_files import assert_same_store, store_files

CHUNK = 100  # small, and no store here ends on a chunk boundary: appends start inside a chunk

# name -> (workers, PROCESS_MIN_BYTES): this thread, two threads, two forked worker processes
ENGINES = {"this thread": (1, 1 << 62), "threads": (2, 1 << 62), "processes": (2, 0)}


def _parquet(path: pathlib.Path, windows: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    flat = pa.array(np.ascontiguousarray(windows, np.float32).reshape(-1), type=pa.float32())
    offsets = pa.array(np.arange(0, len(windows) * 80 + 1, 80, dtype=np.int32))
    pq.write_table(pa.table({"gimu": pa.ListArray.from_arrays(offsets, flat)}), path, row_group_size=300)


@pytest.fixture(scope="module")
def parquet_seasons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """'base': devices 1, 2 ({device}.parquet) and 7, 9 (``device_id=K/a.parquet``); 'more':
    new devices 11-13, a second file of 7 and 9, and 7's committed file again. Device 7's second
    file repeats its first 40 committed windows and adds 20 with values its row lacks (a new
    dictionary row); device 9's holds only
    values of its committed windows, in new windows (its committed row is reused). 'new': the
    new devices alone (ids above every committed one: appended, they sit where one conversion
    of base and new puts them)."""
    root = tmp_path_factory.mktemp("pq-seasons")
    windows = {d: _synthetic.curated_windows(n, seed=d) for d, n in {1: 730, 2: 45, 7: 300, 9: 120}.items()}
    for device in (1, 2):
        _parquet(root / "base" / f"{device}.parquet", windows[device])
    for device in (7, 9):
        _parquet(root / "base" / f"device_id={device}" / "a.parquet", windows[device])
    for device, n in {11: 900, 12: 1, 13: 410}.items():
        for season in ("more", "new"):
            _parquet(root / season / f"{device}.parquet", _synthetic.curated_windows(n, seed=device))
    fresh = _synthetic.curated_windows(20, seed=70) * np.float32(1.5)
    _parquet(root / "more" / "device_id=7" / "b.parquet", np.concatenate([windows[7][:40], fresh]))
    _parquet(root / "more" / "device_id=9" / "b.parquet", np.roll(windows[9][:80], 1, axis=1))
    shutil.copy(root / "base" / "device_id=7" / "a.parquet", root / "more" / "device_id=7" / "a.parquet")
    return {name: root / name for name in ("base", "more", "new")}


def _append_on(engine: str, monkeypatch: pytest.MonkeyPatch, store: pathlib.Path, source: pathlib.Path, *,
               repeats: bool) -> AppendResult:
    """``append_detailed`` on ``engine`` (``repeats``: the source repeats committed windows)."""
    workers, threshold = ENGINES[engine]
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", threshold)
    with pytest.warns(DuplicateWindowsWarning) if repeats else contextlib.nullcontext():
        return append_detailed(store, source, workers=workers, progress=False)


def _rows_of(store: pathlib.Path) -> dict[int, int]:
    """Format 2: dictionary rows a device."""
    devices = zarr.open_array(store / "dict_device", mode="r")[:]
    ids, counts = np.unique(devices, return_counts=True)
    return dict(zip(ids.tolist(), counts.tolist(), strict=True))


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_parquet_append_stores_the_same_bytes_on_every_engine(
    parquet_seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = tmp_path / "base.zarr"
    birdzarr.convert(parquet_seasons["base"], base, chunk_windows=CHUNK, workers=1, progress=False)
    assert len(birdzarr.open_store(base)) % CHUNK  # the append starts inside a chunk
    stores = {}
    for engine in ENGINES:
        dest = stores[engine] = tmp_path / f"{engine}.zarr"
        shutil.copytree(base, dest)
        result = _append_on(engine, monkeypatch, dest, parquet_seasons["more"], repeats=True)
        assert result.windows_added == 900 + 1 + 410 + 60 + 80
        assert (result.devices_added, result.devices_extended) == ([11, 12, 13], [7, 9])
        assert result.skipped_files == ["a.parquet"]  # 7's committed file
        assert result.duplicate_windows == {7: 40}  # the committed windows device 7 repeats
        report = result.store.meta["report"]["appends"][-1]
        # the engine convert would choose: forked processes only at or above the threshold
        assert report.get("worker_processes") == (2 if engine == "processes" else None)
        assert report["duplicate_windows"] == {"7": 40}
        assert verify(dest).ok
    for engine in ("threads", "processes"):
        assert_same_store(stores["this thread"], stores[engine])
    store = birdzarr.open_store(stores["processes"])
    for device in (7, 9):  # the committed windows, then the new file's
        entry = store.device(device)
        assert entry.sources == ["a.parquet", "b.parquet"] and len(entry.ranges) == 2
    new = np.concatenate([_synthetic.curated_windows(300, seed=7)[:40],
                          _synthetic.curated_windows(20, seed=70) * np.float32(1.5)])
    assert np.array_equal(store.device_windows(7)[300:], new)
    # 7 needed a new row for its new values; 9's committed row holds all of its
    assert _rows_of(base)[7] == 1 and _rows_of(base)[9] == 1
    assert _rows_of(stores["processes"])[7] == 2 and _rows_of(stores["processes"])[9] == 1


# the arrays whose files an append of new devices shares with one conversion
_ARRAYS = ("gimu_codes", "gps_speed", "gimu_row", "device", "timestamp", "label", "dict_values",
           "dict_start", "dict_device")


@pytest.mark.parametrize("engine", ["this thread", "processes"])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_appending_new_devices_stores_what_one_conversion_of_all_stores(
    parquet_seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    engine: str,
) -> None:
    """convert(base) + append(new) == convert([base, new]): every chunk of every array, its
    metadata, and each device's table entry (new devices, ids above the committed ones)."""
    appended, whole = tmp_path / "appended.zarr", tmp_path / "whole.zarr"
    birdzarr.convert(parquet_seasons["base"], appended, chunk_windows=CHUNK, progress=False)
    _append_on(engine, monkeypatch, appended, parquet_seasons["new"], repeats=False)
    birdzarr.convert([parquet_seasons["base"], parquet_seasons["new"]], whole, chunk_windows=CHUNK,
                     workers=1, progress=False)
    mine, theirs = store_files(appended), store_files(whole)
    for name in _ARRAYS:
        files = sorted(k for k in theirs if k.startswith(name + "/"))
        assert files and files == sorted(k for k in mine if k.startswith(name + "/")), name
        for key in files:
            assert mine[key] == theirs[key], key
    a, b = birdzarr.open_store(appended), birdzarr.open_store(whole)
    assert [e.to_json() for e in a.device_table] == [e.to_json() for e in b.device_table]
    for device in (11, 12, 13):
        assert a.report[device].to_json() == b.report[device].to_json()


@pytest.fixture(scope="module")
def csv_seasons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Four devices in three parts cut at arbitrary rows (bursts split between parts): 's1'
    parts 0-1, 's2' part 2 and a copy of device 0's part 0 as its part 5 (its windows repeat
    committed ones); 'copy' that copy alone."""
    root = tmp_path_factory.mktemp("csv-seasons")
    _synthetic.make_csv_dir(root / "all", n_devices=4, bursts_per_device=40, parts=3, seed=5)
    for path in sorted((root / "all").iterdir()):
        _, part = (int(x) for x in path.stem.split("_"))
        (root / ("s2" if part == 2 else "s1")).mkdir(exist_ok=True)
        shutil.copy(path, root / ("s2" if part == 2 else "s1") / path.name)
    first = sorted((root / "all").glob("*_0.csv"))[0]
    device = first.stem.split("_")[0]
    shutil.copy(first, root / "s2" / f"{device}_5.csv")
    (root / "copy").mkdir()
    shutil.copy(first, root / "copy" / f"{device}_0.csv")
    return {name: root / name for name in ("all", "s1", "s2", "copy")}


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_csv_append_continues_bursts_and_finds_duplicates_the_same_on_every_engine(
    csv_seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from birdzarr.convert._sources import discover
    from birdzarr.format._spec import Curation
    from birdzarr.storage._location import resolve

    base = tmp_path / "base.zarr"
    birdzarr.convert(csv_seasons["s1"], base, chunk_windows=CHUNK, workers=1, progress=False)
    # the copied part's windows, each formed within that part: all of them repeat committed ones
    (copied,) = discover(resolve(csv_seasons["copy"]))[1]
    repeats = sum(len(b) for b in copied.blocks(curation=Curation(), on_bad_rows="error"))
    stores = {}
    for engine in ENGINES:
        dest = stores[engine] = tmp_path / f"{engine}.zarr"
        shutil.copytree(base, dest)
        workers, threshold = ENGINES[engine]
        monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", threshold)
        with pytest.warns(DuplicateWindowsWarning):
            result = append_detailed(dest, csv_seasons["s2"], workers=workers, progress=False)
        assert result.duplicate_windows == {copied.device_id: repeats}
        report = result.store.meta["report"]["appends"][-1]
        assert report["continued_rows"]  # bursts split between the seasons continued
        assert report.get("worker_processes") == (2 if engine == "processes" else None)
    for engine in ("threads", "processes"):
        assert_same_store(stores["this thread"], stores[engine])


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_failed_append_on_worker_processes_leaves_the_previous_commit(
    parquet_seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(parquet_seasons["base"], dest, chunk_windows=CHUNK, progress=False)
    before = birdzarr.open_store(dest)
    windows, root = before.device_windows(1), (dest / "zarr.json").read_bytes()
    bad = tmp_path / "bad"
    shutil.copytree(parquet_seasons["new"], bad)
    (bad / "14.parquet").write_bytes(b"PAR1 not really")  # good new windows are written first
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)
    with pytest.raises(BadInputError, match="14.parquet: not a readable Parquet file"):
        append(dest, bad, workers=2, progress=False)
    assert (dest / "zarr.json").read_bytes() == root  # nothing committed
    assert not (dest / ".birdzarr.lock").exists()
    store = birdzarr.open_store(dest)
    assert leftovers(store.location, len(store)) == []  # cut back to the commit
    assert np.array_equal(store.device_windows(1), windows)
    assert verify(dest).ok
    append(dest, parquet_seasons["new"], workers=2, progress=False)  # and it appends again
    assert len(birdzarr.open_store(dest)) == len(before) + 900 + 1 + 410


@pytest.mark.parametrize("engine", ["this thread", "processes"])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_an_append_that_skips_committed_partition_files_reads_the_rest(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """Partition files (a device_id column): the whole export appended to a store of its first
    two files skips those (by name, per device) and appends the third, whose devices' rows in it
    are not known from the listing (it counted every file's): they are read to be counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    windows = _synthetic.curated_windows(600, seed=3)
    devices = np.random.default_rng(3).integers(1, 5, 600)
    devices[550:] = 5  # a device only the third file holds
    for name, rows in (("part-0", slice(0, 200)), ("part-1", slice(200, 400)), ("part-2", slice(400, 600))):
        flat = pa.array(windows[rows].reshape(-1), type=pa.float32())
        offsets = pa.array(np.arange(0, 200 * 80 + 1, 80, dtype=np.int32))
        table = pa.table({"device_id": pa.array(devices[rows]),
                          "gimu": pa.ListArray.from_arrays(offsets, flat)})
        for season in (["s1", "all"] if name != "part-2" else ["all"]):
            (tmp_path / season).mkdir(exist_ok=True)
            pq.write_table(table, tmp_path / season / f"{name}.parquet", row_group_size=64)
    dest = tmp_path / "s.zarr"
    birdzarr.convert(tmp_path / "s1", dest, chunk_windows=CHUNK, progress=False)
    result = _append_on(engine, monkeypatch, dest, tmp_path / "all", repeats=False)
    assert result.windows_added == 200 and result.devices_added == [5]
    assert result.skipped_files == ["part-0.parquet", "part-1.parquet"] * 4  # devices 1-4
    whole = birdzarr.convert(tmp_path / "all", tmp_path / "whole.zarr", chunk_windows=CHUNK, progress=False)
    for device in range(1, 6):
        assert np.array_equal(result.store.device_windows(device), whole.device_windows(device)), device


@pytest.mark.parametrize("engine", ["this thread", "processes"])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_chunk_shared_with_the_commit_is_replaced_whole(
    parquet_seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    engine: str,
) -> None:
    """The last committed chunk, which the first new windows complete, is written to a new file
    that replaces the old one (a reader of the commit reads the old file or the new one, never a
    file being written): every array's file of that chunk is a new inode, its committed windows
    unchanged."""
    dest = tmp_path / "s.zarr"
    birdzarr.convert(parquet_seasons["base"], dest, chunk_windows=CHUNK, progress=False)
    before = birdzarr.open_store(dest)
    chunk = len(before) // CHUNK
    files = {name: dest / name / "c" / "/".join([str(chunk), *filter(None, tail.split("/"))])
             for name, tail in {"gimu_codes": "0/0", "gps_speed": "0", "gimu_row": "", "device": "",
                                "timestamp": "", "label": ""}.items()}
    inodes = {name: path.stat().st_ino for name, path in files.items()}
    committed = before.windows[chunk * CHUNK:]
    _append_on(engine, monkeypatch, dest, parquet_seasons["new"], repeats=False)
    assert {name: path.stat().st_ino for name, path in files.items()}.keys() == inodes.keys()
    for name, path in files.items():
        assert path.stat().st_ino != inodes[name], name
    after = birdzarr.open_store(dest)
    assert np.array_equal(after.windows[chunk * CHUNK : len(before)], committed)


def test_client_must_be_a_dask_client(
    parquet_seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(parquet_seasons["base"], dest, chunk_windows=CHUNK, progress=False)
    with pytest.raises(TypeError, match=r"client must be a distributed.Client .*connect first"):
        append(dest, parquet_seasons["new"], client="tcp://127.0.0.1:8786", progress=False)


@pytest.mark.slow  # a LocalCluster starts in seconds
def test_an_append_on_a_dask_cluster_stores_the_same_bytes(
    parquet_seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    distributed = pytest.importorskip("distributed")
    base, local, remote = tmp_path / "base.zarr", tmp_path / "local.zarr", tmp_path / "remote.zarr"
    birdzarr.convert(parquet_seasons["base"], base, chunk_windows=CHUNK, progress=False)
    shutil.copytree(base, local)
    shutil.copytree(base, remote)
    with pytest.warns(DuplicateWindowsWarning):
        append(local, parquet_seasons["more"], workers=1, progress=False)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None,
                                  silence_logs=40) as cluster, distributed.Client(cluster) as client, \
            pytest.warns(DuplicateWindowsWarning):
        result = append_detailed(remote, parquet_seasons["more"], client=client, progress=False)
    assert result.store.meta["report"]["appends"][-1]["dask"]["workers"] == 2
    assert_same_store(local, remote)


def test_cli_append_on_a_scheduler_address_that_is_not_one(
    parquet_seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("distributed")
    from birdzarr.cli import main

    dest = tmp_path / "s.zarr"
    birdzarr.convert(parquet_seasons["base"], dest, chunk_windows=CHUNK, progress=False)
    root = (dest / "zarr.json").read_bytes()
    capsys.readouterr()
    assert main(["append", str(dest), str(parquet_seasons["new"]), "--dask-scheduler", "foo", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("birdzarr append: error: --dask-scheduler foo: not a scheduler address")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (dest / "zarr.json").read_bytes() == root
