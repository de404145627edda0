"""Converting to format 2: every path writes the same bytes (one process, threads, worker processes,
the shuffle on threads and in processes), the windows decode with the documented lines to exactly the
source's windows, appends follow the append rule, and a failed append leaves the committed dictionary
as it was."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import numpy as np
import pytest
import zarr

import birdzarr
from birdzarr.convert import _segments
from birdzarr.demo import _synthetic
from birdzarr.format import _v2

CORE = {"bytes", "transpose", "blosc", "zstd", "gzip", "crc32c", "sharding_indexed"}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("pq")
    _synthetic.make_parquet_dir(directory, n_devices=6, total_windows=9_000, seed=3)
    return directory


def parquet_windows(source: pathlib.Path) -> dict[int, np.ndarray]:
    """Each device's windows as its Parquet file holds them ({device}.parquet, one list column)."""
    import pyarrow.parquet as pq

    return {int(p.stem): np.asarray(pq.read_table(p).column("gimu").combine_chunks().flatten(),
                                    np.float32).reshape(-1, 20, 4) for p in source.glob("*.parquet")}


def in_device_order(source: pathlib.Path) -> np.ndarray:
    truth = parquet_windows(source)
    return np.concatenate([truth[d] for d in sorted(truth)])


def sorted_windows(windows: np.ndarray) -> np.ndarray:
    """The windows in an order of their bytes alone (to compare a shuffled store with its source)."""
    keys = np.ascontiguousarray(windows).reshape(len(windows), -1).view(np.uint32)
    return windows[np.lexsort(keys.T[::-1])]


def documented_decode(path: pathlib.Path) -> np.ndarray:
    """The windows as docs/format.md decodes them: zarr-python and numpy only."""
    z = zarr.open_group(str(path), mode="r")
    codes, row, gps = z[_v2.CODES][:], z[_v2.ROW][:], z[_v2.GPS][:]
    start, values = z[_v2.START][:], z[_v2.VALUES][:]
    windows = np.empty((len(row), 20, 4), np.float32)
    windows[:, :, :3] = values[start[row][:, None, :] + codes]
    windows[:, :, 3] = gps
    return windows


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def chunk_files(path: pathlib.Path) -> dict[str, bytes]:
    """Every file of the store but the root zarr.json (whose report holds times)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*")
            if p.is_file() and p.relative_to(path) != pathlib.Path("zarr.json")}


def every_path(source: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
               options: dict[str, Any]) -> birdzarr.Store:
    """Convert ``source`` in one process, on threads and in worker processes; every file but the
    root is the same on each path. Returns the worker-process store (in tmp_path / "processes";
    the others in "one" and "threads")."""
    birdzarr.convert(source, tmp_path / "one", workers=1, **options)
    birdzarr.convert(source, tmp_path / "threads", workers=2, **options)
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)
    processes = birdzarr.convert(source, tmp_path / "processes", workers=2, **options)
    assert processes.meta["report"]["worker_processes"] == 2 and processes.format_version == 2
    expected = chunk_files(tmp_path / "one")
    assert chunk_files(tmp_path / "threads") == expected
    assert chunk_files(tmp_path / "processes") == expected
    return processes


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_every_device_order_path_writes_the_same_bytes_and_the_source_windows(
    source: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 700-window chunks: chunks shared by segments and by devices
    processes = every_path(source, tmp_path, monkeypatch, {"chunk_windows": 700, "progress": False})
    v1 = in_device_order(source)
    assert same_bits(documented_decode(tmp_path / "processes"), v1)
    assert same_bits(processes.windows[:], v1)
    root = tmp_path / "one"
    # one row per device (calibrated 12-bit data), in store order; every codec a core one
    rows = zarr.open_group(str(root), mode="r")[_v2.DEVICE][:]
    assert rows.tolist() == [e.device_id for e in processes.device_table]
    names = sorted(p.parent.name for p in root.glob("*/zarr.json"))
    assert names == sorted([*_v2.ARRAYS, "device", "timestamp", "label", "device_table"])
    arrays = [p for p in root.rglob("zarr.json") if json.loads(p.read_text())["node_type"] == "array"]
    # the window and dictionary arrays; the device table's index, its range_checksum and details
    assert len(arrays) == 9 + 7 + 1 + 1
    for meta_path in arrays:
        assert {c["name"] for c in json.loads(meta_path.read_text())["codecs"]} <= CORE, meta_path
    # the root holds no per-device data: the device table is its own group, read when used
    attrs = json.loads((root / "zarr.json").read_text())["attributes"]["birdzarr"]
    assert "devices" not in attrs and "devices" not in attrs["report"]
    assert attrs["committed"]["device_table"] == "device_table/1" and attrs["committed"]["n_devices"] == 6
    committed = processes.meta["committed"]["dictionary"]
    assert committed == {"rows": len(rows), "values": int(zarr.open_group(str(root))[_v2.VALUES].shape[0])}


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_every_shuffle_path_writes_the_same_bytes_and_the_source_windows(
    source: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"chunk_windows": 1000, "progress": False, "shuffle": True, "seed": 8}
    processes = every_path(source, tmp_path, monkeypatch, options)
    decoded = documented_decode(tmp_path / "one")
    assert same_bits(decoded, processes.windows[:])
    assert same_bits(sorted_windows(decoded), sorted_windows(in_device_order(source)))
    # a shuffled store's rows hold each device's values sorted by bit pattern: one row per device
    z = zarr.open_group(str(tmp_path / "one"), mode="r")
    d = _v2.Dictionaries(z[_v2.VALUES][:], z[_v2.START][:], z[_v2.DEVICE][:])
    assert d.device.tolist() == sorted(e.device_id for e in processes.device_table)
    for r in range(d.n_rows):
        bits = d.entries(r, 0).view(np.uint32)
        assert (np.diff(bits.astype(np.int64)) > 0).all()


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_a_device_past_65535_values_a_channel_splits_into_rows_on_every_path(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    rng = np.random.default_rng(5)
    wide = _synthetic.curated_windows(4000, seed=1)
    wide[:, :, 2] = rng.uniform(-1, 1, (4000, 20)).astype(np.float32)  # 80,000 distinct imu_z values
    _synthetic.write_parquet(wide, str(source / "3.parquet"))
    _synthetic.write_parquet(_synthetic.curated_windows(500, seed=2), str(source / "4.parquet"))
    expected = np.concatenate([wide, _synthetic.curated_windows(500, seed=2)])
    for name, options in {"order": {}, "shuffle": {"shuffle": True, "seed": 1}}.items():
        birdzarr.convert(source, tmp_path / name, progress=False, workers=1, **options)  # type: ignore[arg-type]
        z = zarr.open_group(str(tmp_path / name), mode="r")
        assert z[_v2.DEVICE][:].tolist().count(3) == 2  # device 3 needed two rows
        decoded = documented_decode(tmp_path / name)
        if name == "order":
            assert same_bits(decoded, expected)
        assert same_bits(sorted_windows(decoded), sorted_windows(expected))
    # in worker processes too: pass 2 is then one run, whose task numbers the rows it opens
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)
    store = birdzarr.convert(source, tmp_path / "p", progress=False, workers=2, shuffle=True, seed=1)
    assert store.meta["report"]["worker_processes"] == 2
    assert chunk_files(tmp_path / "p") == chunk_files(tmp_path / "shuffle")


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_an_append_keeps_the_committed_rows_and_a_failed_one_leaves_them(tmp_path: pathlib.Path) -> None:
    raws = _synthetic.make_csv_dir(tmp_path / "all", n_devices=3, bursts_per_device=20, parts=2, seed=4)
    assert raws
    for name in ("base", "more"):
        (tmp_path / name).mkdir()
    for path in sorted((tmp_path / "all").iterdir()):
        part = int(path.stem.split("_")[1])
        (tmp_path / ("base" if part == 0 else "more") / path.name).write_bytes(path.read_bytes())
    options = {"chunk_windows": 100, "progress": False}
    dest = tmp_path / "s.zarr"
    birdzarr.convert(tmp_path / "base", dest, **options)
    before = documented_decode(dest)
    z = zarr.open_group(str(dest), mode="r")
    old_values, old_rows = z[_v2.VALUES][:], z[_v2.DEVICE][:]
    # a bad file among the new parts: the append fails, the store stays as committed
    bad = tmp_path / "bad"
    bad.mkdir()
    for path in (tmp_path / "more").iterdir():
        bad.joinpath(path.name).write_bytes(path.read_bytes())
    last = sorted(bad.iterdir())[-1]
    last.write_text(last.read_text() + "not,a,row\n")
    with pytest.raises(birdzarr.BirdzarrError):
        birdzarr.append(dest, bad, progress=False)
    assert same_bits(documented_decode(dest), before)
    z = zarr.open_group(str(dest), mode="r")
    assert z[_v2.VALUES].shape == old_values.shape and z[_v2.DEVICE].shape == old_rows.shape
    # the good append: the windows of one conversion of all the parts, the committed ones first
    # and unchanged, old rows and codes untouched
    store = birdzarr.append(dest, tmp_path / "more", progress=False)
    whole = birdzarr.convert(tmp_path / "all", tmp_path / "whole", **options).windows[:]  # type: ignore[arg-type]
    decoded = documented_decode(dest)
    assert same_bits(decoded, store.windows[:]) and same_bits(decoded[: len(before)], before)
    assert same_bits(sorted_windows(decoded), sorted_windows(whole))
    assert len(decoded) > len(before)
    z = zarr.open_group(str(dest), mode="r")
    values, rows = z[_v2.VALUES][:], z[_v2.DEVICE][:]
    assert same_bits(values[: len(old_values)], old_values)
    assert rows[: len(old_rows)].tolist() == old_rows.tolist()
    assert store.meta["committed"]["dictionary"] == {"rows": len(rows), "values": len(values)}
    # every appended window of a device codes against a row of that device
    devices = z["device"][:]
    assert (rows[z[_v2.ROW][:]] == devices).all()


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_command_line_writes_format_2_and_has_no_format_option(
    source: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """birdzarr writes format 2 only: --format-version, --codec and --compressor (format 1's) are
    not options any more, refused in one line (argparse's) before anything is written."""
    from birdzarr.cli import main

    dest = tmp_path / "s.zarr"
    for option in (["--format-version", "1"], ["--codec", "dict16"], ["--compressor", "zstd"]):
        with pytest.raises(SystemExit) as exited:
            main(["convert", str(source), str(dest), "--quiet", *option])
        assert exited.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == f"birdzarr: error: unrecognized arguments: {' '.join(option)}"
        assert "Traceback" not in "".join(err)
        assert not dest.exists()
    with pytest.raises(TypeError, match="format_version"):
        birdzarr.convert(source, dest, format_version=1, progress=False)  # type: ignore[call-arg]
    assert not dest.exists()
    assert main(["convert", str(source), str(dest), "--quiet"]) == 0
    assert birdzarr.open_store(dest).format_version == 2 and (dest / _v2.CODES / "zarr.json").exists()


def test_chunks_equal_to_the_fill_value_are_stored_too(tmp_path: pathlib.Path) -> None:
    """One device whose id and range start are 0: the device table's index chunks hold only
    zeros (the fill value) and must still be stored (a missing chunk is damage)."""
    source = tmp_path / "src"
    source.mkdir()
    _synthetic.write_parquet(_synthetic.curated_windows(50, seed=1), str(source / "0.parquet"))
    store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    for name in ("device_id", "range_start", "range_device"):
        assert (tmp_path / "s.zarr" / "device_table" / "1" / name / "c" / "0").exists(), name
    assert (tmp_path / "s.zarr" / _v2.DEVICE / "c" / "0").exists()  # dict_device = [0]
    assert store.device(0).n_windows == 50
    assert birdzarr.verify(tmp_path / "s.zarr").ok


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_device_table_is_read_when_used_and_each_commit_writes_its_own(tmp_path: pathlib.Path) -> None:
    _synthetic.make_csv_dir(tmp_path / "all", n_devices=3, bursts_per_device=12, parts=2, seed=9)
    for name in ("base", "more"):
        (tmp_path / name).mkdir()
    for path in sorted((tmp_path / "all").iterdir()):
        part = int(path.stem.split("_")[1])
        (tmp_path / ("base" if part == 0 else "more") / path.name).write_bytes(path.read_bytes())
    dest = tmp_path / "v2.zarr"
    birdzarr.convert(tmp_path / "base", dest, chunk_windows=64, progress=False)
    store = birdzarr.open_store(dest)
    # opening read the root alone; a device by id and the count come from the index arrays
    assert store.n_devices == 3 and store.device(store.device_table[1].device_id).n_windows > 0
    fresh = birdzarr.open_store(dest)
    assert fresh.n_devices == 3 and "meta" not in fresh.__dict__ and "device_table" not in fresh.__dict__
    # a commit killed after writing its table group: the group is a leftover, the store reads as committed
    shutil.copytree(dest / "device_table" / "1", dest / "device_table" / "2")
    assert birdzarr.open_store(dest).meta["committed"]["device_table"] == "device_table/1"
    appended = birdzarr.append(dest, tmp_path / "more", progress=False)
    whole = birdzarr.convert(tmp_path / "all", tmp_path / "whole.zarr", chunk_windows=64, progress=False)
    # the killed commit's group went; the table the append replaced stays until the next commit
    assert sorted(p.name for p in (dest / "device_table").iterdir()) == ["1", "2", "zarr.json"]
    assert appended.meta["committed"]["device_table"] == "device_table/2"
    # each device's windows, times and labels those of one conversion of all the parts
    for entry, one in zip(appended.device_table, whole.device_table, strict=True):
        assert (entry.device_id, entry.n_windows, entry.first_time, entry.last_time, entry.label_counts) == (
            one.device_id, one.n_windows, one.first_time, one.last_time, one.label_counts)
    assert appended.meta["csv_tails"] == whole.meta["csv_tails"]
    assert same_bits(sorted_windows(appended.windows[:]), sorted_windows(whole.windows[:]))
