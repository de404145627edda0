"""Conversion on a real Dask cluster (scheduler and worker processes) equals a local conversion."""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import birdzarr
from birdzarr.cli import main as cli_main
from birdzarr.demo import _synthetic

pytestmark = pytest.mark.slow

distributed = pytest.importorskip("distributed")
pytest_plugins = ["dask_support"]  # its fixture: cluster_client


def _files(root: pathlib.Path) -> dict[str, bytes]:
    out = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = pathlib.Path(directory) / name
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def assert_identical(local: pathlib.Path, remote: pathlib.Path) -> None:
    """Every chunk and array metadata file byte for byte; the root attributes but for timings."""
    a, b = _files(local), _files(remote)
    assert sorted(a) == sorted(b)
    chunks = [k for k in a if k != "zarr.json"]
    assert len(chunks) > 4
    for key in chunks:
        assert a[key] == b[key], key
    meta_a = json.loads(a["zarr.json"])["attributes"]
    meta_b = json.loads(b["zarr.json"])["attributes"]
    (key,) = [k for k in meta_a if isinstance(meta_a[k], dict) and "committed" in meta_a[k]]
    attrs_a, attrs_b = meta_a[key], meta_b[key]
    # the device table: in the root attributes, or a group of its own (compared file by file above)
    assert attrs_a.get("devices") == attrs_b.get("devices")
    assert attrs_a["report"].get("devices") == attrs_b["report"].get("devices")
    assert attrs_a["committed"]["n_windows"] == attrs_b["committed"]["n_windows"]
    for name in ("layout", "curation", "source_kind", "window_rule", "format_version"):
        assert attrs_a[name] == attrs_b[name], name
    assert "dask" in attrs_b["report"] and "dask" not in attrs_a["report"]


@pytest.mark.parametrize("chunk_windows", [1024, 4096])
def test_parquet_on_cluster_equals_local(cluster_client, tmp_path: pathlib.Path,  # type: ignore[no-untyped-def]
                                         chunk_windows: int) -> None:
    src = tmp_path / "src"
    _synthetic.make_parquet_dir(src, n_devices=9, total_windows=20_000, seed=4)
    _synthetic.write_parquet(np.empty((0, 20, 4), np.float32), src / "9000.parquet")  # an empty device
    options = {"chunk_windows": chunk_windows, "progress": False}
    local = birdzarr.convert(src, tmp_path / "local.zarr", **options)  # type: ignore[arg-type]
    remote = birdzarr.convert(src, tmp_path / "dask.zarr", client=cluster_client, **options)  # type: ignore[arg-type]
    assert remote.format_version == 2
    assert len(remote) == len(local) == 20_000
    assert_identical(tmp_path / "local.zarr", tmp_path / "dask.zarr")
    np.testing.assert_array_equal(remote.windows[:], local.windows[:])


def test_csv_on_cluster_equals_local_via_cli(cluster_client, tmp_path: pathlib.Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """CSV: curation drops windows (counted by a first pass), labels and timestamps are kept."""
    src = tmp_path / "csv"
    _synthetic.make_csv_dir(src, n_devices=5, bursts_per_device=150, parts=2, seed=2)
    local = birdzarr.convert(src, tmp_path / "local.zarr", chunk_windows=256, progress=False)
    address = cluster_client.scheduler.address
    rc = cli_main(["convert", str(src), str(tmp_path / "dask.zarr"), "--chunk-windows", "256", "--quiet",
                   "--dask-scheduler", address])
    assert rc == 0
    remote = birdzarr.open_store(tmp_path / "dask.zarr")
    assert len(remote) == len(local) > 256 * 4
    assert_identical(tmp_path / "local.zarr", tmp_path / "dask.zarr")
    np.testing.assert_array_equal(remote.labels[:], local.labels[:])


def _bad_row_file(path: pathlib.Path) -> None:
    """Readable Parquet whose footer counts its rows, but one row has 79 values: fails while writing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [list(map(float, range(80)))] * 3000 + [list(map(float, range(79)))]
    pq.write_table(pa.table({"gimu": pa.array(rows, type=pa.list_(pa.float32()))}), path)


@pytest.mark.parametrize("damage", ["not parquet", "bad row"])
def test_failure_on_cluster_leaves_no_store(cluster_client, tmp_path: pathlib.Path, damage: str) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    _synthetic.make_parquet_dir(src, n_devices=4, total_windows=6_000, seed=1)
    if damage == "not parquet":
        (src / "7777.parquet").write_bytes(b"not parquet at all")  # fails while counting
    else:
        _bad_row_file(src / "7777.parquet")  # counted from the footer, fails while writing
    dest = tmp_path / "dask.zarr"
    with pytest.raises(birdzarr.BadInputError):
        birdzarr.convert(src, dest, chunk_windows=1024, progress=False, client=cluster_client)
    assert not dest.exists() or not any(dest.iterdir())


def test_repeated_windows_on_cluster_are_counted_as_locally(cluster_client, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """Each device is read once, by one task, which counts its repeated windows."""
    src = tmp_path / "src"
    src.mkdir()
    windows = _synthetic.curated_windows(5_000, seed=1)
    _synthetic.write_parquet(np.concatenate([windows, windows[100:140]]), src / "1.parquet")  # 40 twice
    _synthetic.write_parquet(_synthetic.curated_windows(2_000, seed=2), src / "2.parquet")
    reports = []
    for name, client in (("local", None), ("dask", cluster_client)):
        repeated = r"40 window\(s\) repeat .* device\(s\) 1 \(40\)"
        with pytest.warns(birdzarr.DuplicateWindowsWarning, match=repeated):
            store = birdzarr.convert(src, tmp_path / f"{name}.zarr", chunk_windows=512, progress=False,
                                     client=client)
        reports.append(store.meta["report"])
    assert reports[0]["duplicate_windows"] == reports[1]["duplicate_windows"] == {"1": 40}
    # each device a segment (the minimum is 8 chunks of 512): chunk 9 holds windows of both
    assert reports[1]["segments"] == 2
    assert_identical(tmp_path / "local.zarr", tmp_path / "dask.zarr")


def test_shuffle_on_cluster_equals_local(  # type: ignore[no-untyped-def]
    cluster_client, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pass 1 (spill groups) and pass 2 (runs of buckets, shared chunks) as tasks on the workers,
    spilling into a directory both workers reach: every chunk file the local converter's for
    the seed, in worker processes and on threads."""
    from birdzarr.convert import _segments, _shuffle

    src = tmp_path / "src"
    _synthetic.make_parquet_dir(src, n_devices=9, total_windows=20_000, seed=4)
    spill = tmp_path / "spill"
    spill.mkdir()
    # buckets of ~3,000 windows: 7 of them, chunks shared by buckets and by runs of buckets
    monkeypatch.setattr(_shuffle, "BUCKET_WINDOWS", 3000)
    options = {"chunk_windows": 2048, "progress": False, "shuffle": True, "seed": 11,
               "shuffle_tmp": str(spill)}
    local = birdzarr.convert(src, tmp_path / "local.zarr", workers=1, **options)  # type: ignore[arg-type]
    remote = birdzarr.convert(src, tmp_path / "dask.zarr", client=cluster_client, **options)  # type: ignore[arg-type]
    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)
    birdzarr.convert(src, tmp_path / "processes.zarr", workers=2, **options)  # type: ignore[arg-type]
    report = remote.meta["report"]
    assert report["dask"]["workers"] == 2
    assert report["shuffle"]["buckets"] == local.meta["report"]["shuffle"]["buckets"] > 2
    assert len(report["shuffle"]["pass_seconds"]) == 2
    assert remote.meta["layout"]["shuffled"] and len(remote) == len(local) == 20_000
    assert_identical(tmp_path / "local.zarr", tmp_path / "dask.zarr")
    assert_identical(tmp_path / "processes.zarr", tmp_path / "dask.zarr")
    np.testing.assert_array_equal(remote.windows[:], local.windows[:])
    assert list(spill.iterdir()) == []  # the spill is removed


def test_csv_shuffle_on_cluster_via_cli_equals_local(cluster_client, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    """birdzarr convert --shuffle --dask-scheduler: CSV read and curated by pass-1 tasks on the
    workers, the store of the local converter for the seed."""
    src = tmp_path / "csv"
    _synthetic.make_csv_dir(src, n_devices=5, bursts_per_device=150, parts=2, seed=2)
    spill = tmp_path / "spill"
    spill.mkdir()
    local = birdzarr.convert(src, tmp_path / "local.zarr", chunk_windows=256, progress=False, shuffle=True,
                             seed=3, workers=1)
    rc = cli_main(["convert", str(src), str(tmp_path / "dask.zarr"), "--chunk-windows", "256", "--quiet",
                   "--shuffle", "--seed", "3", "--shuffle-tmp", str(spill),
                   "--dask-scheduler", cluster_client.scheduler.address])
    assert rc == 0
    remote = birdzarr.open_store(tmp_path / "dask.zarr")
    assert remote.meta["layout"]["shuffled"] and len(remote) == len(local) > 256 * 4
    assert_identical(tmp_path / "local.zarr", tmp_path / "dask.zarr")
    assert list(spill.iterdir()) == []


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def _mapped_bytes() -> int:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _Mallinfo2
    return int(mallinfo2().hblkhd)  # bytes malloc holds in blocks mapped one by one


def mapped_again(nbytes: int) -> bool:
    """Whether an array of ``nbytes``, allocated and freed twice, is mapped from the kernel the
    second time too (glibc adjusting its thresholds itself takes it from the heap by then)."""
    np.ones(nbytes // 8)
    before = _mapped_bytes()
    array = np.ones(nbytes // 8)
    mapped = _mapped_bytes() - before >= nbytes
    del array
    return mapped


glibc = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33 or later")


@glibc
def test_a_task_on_a_dask_worker_takes_its_arrays_from_the_heap(cluster_client) -> None:  # type: ignore[no-untyped-def]
    """Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536, which pins glibc's mmap
    threshold at 128 KiB: every array above it was mapped fresh and its pages faulted in again
    (the shuffle's tasks spent 1.4-1.9x the CPU of forked workers). A task's arrays come from the
    heap; between tasks the worker has its environment's thresholds again."""
    from birdzarr.convert._engine import cluster_engine, run_all

    on_workers = cluster_client.run(os.environ.get, "MALLOC_TRIM_THRESHOLD_")
    assert set(on_workers.values()) == {"65536"}
    assert set(cluster_client.run(mapped_again, 8 << 20).values()) == {True}
    with cluster_engine(cluster_client) as engine:
        assert run_all(engine, mapped_again, [(8 << 20,)] * 4) == [False] * 4
    assert set(cluster_client.run(mapped_again, 8 << 20).values()) == {True}


@glibc
def test_task_malloc_holds_its_thresholds_until_the_last_task_ends() -> None:
    """In a process whose environment pins the thresholds (as a Dask worker's), tasks running at
    once share them: they are the environment's again only when the last one ends."""
    script = """if True:
        import sys
        sys.path.insert(0, sys.argv[1])
        from test_dask import mapped_again
        from birdzarr.convert._engine import TaskMalloc
        tasks = TaskMalloc()
        seen = [mapped_again(8 << 20)]
        tasks.__enter__()
        tasks.__enter__()
        seen.append(mapped_again(8 << 20))
        tasks.__exit__(None, None, None)
        seen.append(mapped_again(8 << 20))
        tasks.__exit__(None, None, None)
        seen.append(mapped_again(8 << 20))
        print(seen)
    """
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", script, str(pathlib.Path(__file__).parent)], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[True, False, False, True]"
