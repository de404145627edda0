"""The same code on a bucket: convert, info, open, copy, train against moto's real S3 HTTP endpoint.

Nothing is mocked below HTTP: s3fs/botocore talk to moto's server on loopback, directly or
through the fault-injecting proxy of s3_support.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_support import (  # noqa: F401  (moto, proxy are fixtures)
    ACCESS_KEY,
    SECRET_KEY,
    MotoEndpoint,
    moto,
    new_bucket,
    proxy,
    s3_env,
    s3_options,
)

import birdzarr
from birdzarr._errors import (
    ChunkFetchError,
    MissingChunkError,
    NotAStoreError,
    StoreExistsError,
    StoreNotFoundError,
    TransferError,
)
from birdzarr.format import _v2
from birdzarr.maintenance._copy import copy_store
from birdzarr.storage._location import RetryPolicy, resolve

pytestmark = [pytest.mark.slow, pytest.mark.s3]

CHUNK = 4096


# the objects a format-2 store's first three chunks of windows are read from: the three
# per-window arrays' chunks and the three dictionary arrays' one chunk each
FORMAT2_CHUNKS_OF_THREE = (
    [f"gimu_codes/c/{i}/0/0" for i in range(3)] + [f"gimu_row/c/{i}" for i in range(3)]
    + [f"gps_speed/c/{i}/0" for i in range(3)] + ["dict_values/c/0", "dict_start/c/0/0", "dict_device/c/0"]
)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture(scope="module")
def bucket(moto: MotoEndpoint) -> str:  # noqa: F811
    return new_bucket(moto)


@pytest.fixture(scope="module")
def s3_store(parquet_source: Any, moto: MotoEndpoint, bucket: str) -> birdzarr.Store:  # noqa: F811
    """parquet_source converted straight into the bucket, credentials in storage_options."""
    directory, _ = parquet_source
    return birdzarr.convert(
        directory, f"s3://{bucket}/small.zarr", chunk_windows=CHUNK, progress=False,
        storage_options=s3_options(moto.url),
    )


def test_convert_to_bucket_reads_back_exactly(s3_store: birdzarr.Store, parquet_source: Any) -> None:
    _, truth = parquet_source
    assert len(s3_store) == sum(len(w) for w in truth.values())
    for device, windows in truth.items():
        assert np.array_equal(bits(s3_store.device_windows(device)), bits(windows))
    # zarr-python on the same store: opened as v3 through the FsspecStore birdzarr builds, the
    # format-2 arrays read with core codecs and decoded with the documented lines
    stored = dict(s3_store.group.arrays())
    decoded = _v2.decode_reference(
        np.asarray(stored["gimu_codes"][:100]), np.asarray(stored["gimu_row"][:100]),
        np.asarray(stored["gps_speed"][:100]), np.asarray(stored["dict_values"][:]),
        np.asarray(stored["dict_start"][:]))
    assert np.array_equal(bits(decoded), bits(s3_store.windows[:100]))


def test_worker_processes_read_and_write_a_bucket(
    s3_store: birdzarr.Store, parquet_source: Any, moto: MotoEndpoint, bucket: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from birdzarr.convert import _segments

    monkeypatch.setattr(_segments, "PROCESS_MIN_BYTES", 0)
    monkeypatch.setattr(_segments, "MIN_SEGMENT_CHUNKS", 0)
    directory, _ = parquet_source
    options = s3_options(moto.url)
    fs = resolve(f"s3://{bucket}", options).fs
    for file in sorted(directory.iterdir()):  # the input in the bucket too: read by the processes
        fs.put_file(str(file), f"{bucket}/parquet-input/{file.name}")
    store = birdzarr.convert(f"s3://{bucket}/parquet-input", f"s3://{bucket}/processes.zarr",
                             chunk_windows=CHUNK, workers=2, progress=False, storage_options=options,
                             source_storage_options=options)
    assert store.meta["report"]["worker_processes"] == 2 and store.meta["report"]["segments"] > 2
    # every chunk object and array's metadata as written by threads; the root's attributes differ
    # only in the run's times, figures and source
    ours = sorted(fs.find(f"{bucket}/processes.zarr"))
    theirs = sorted(fs.find(f"{bucket}/small.zarr"))
    assert [k.split("/", 2)[2] for k in ours] == [k.split("/", 2)[2] for k in theirs]
    compared = 0
    for mine, other in zip(ours, theirs, strict=True):
        if not mine.endswith("processes.zarr/zarr.json"):
            assert fs.cat_file(mine) == fs.cat_file(other), mine
            compared += 1
    assert compared > 4 * (30_000 // CHUNK)
    assert store.meta["devices"] == s3_store.meta["devices"]


def test_credentials_never_stored_or_printed(
    s3_store: birdzarr.Store, moto: MotoEndpoint, bucket: str  # noqa: F811
) -> None:
    client = moto.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert any(k.endswith("small.zarr/zarr.json") for k in keys)
    for key in keys:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert SECRET_KEY.encode() not in body and ACCESS_KEY.encode() not in body, key
    assert SECRET_KEY not in json.dumps(s3_store.meta) and ACCESS_KEY not in json.dumps(s3_store.meta)
    texts = [repr(s3_store), repr(s3_store.location), s3_store.url]
    options = s3_options(moto.url)
    for bad in (f"s3://{bucket}/nothing-here.zarr", "s3://no-such-bucket-birdzarr/x.zarr"):
        with pytest.raises(birdzarr.BirdzarrError) as caught:
            birdzarr.open_store(bad, storage_options=options)
        texts.append(str(caught.value))
    # a URL with the secret in it (http user:password@) is redacted wherever it is shown
    location = resolve(f"http://{ACCESS_KEY}:{SECRET_KEY}@127.0.0.1:1/x.zarr")
    texts += [location.display, repr(location)]
    for text in texts:
        assert SECRET_KEY not in text and ACCESS_KEY not in text, text


def test_no_head_and_no_v2_probe_per_read(s3_store: birdzarr.Store, proxy: Any, bucket: str) -> None:  # noqa: F811
    store = birdzarr.open_store(f"s3://{bucket}/small.zarr", storage_options=s3_options(proxy.url))
    opened = [(r.method, r.path.rsplit("small.zarr/", 1)[-1]) for r in proxy.requests()]
    # the root and the nine arrays' metadata, one GET each: no HEAD, no .zgroup/.zarray probing
    arrays = ("gimu_codes", "gps_speed", "gimu_row", "dict_values", "dict_start", "dict_device",
              "device", "timestamp", "label")
    assert opened == [("GET", "zarr.json")] + [("GET", f"{a}/zarr.json") for a in arrays], opened
    proxy.clear()
    windows = store.windows[: 3 * CHUNK]
    assert np.array_equal(bits(windows), bits(s3_store.windows[: 3 * CHUNK]))
    log = proxy.requests()
    assert Counter(r.method for r in log) == {"GET": 12}
    # one GET per chunk (read concurrently, so in any order), the dictionaries' once
    assert sorted(r.path.rsplit("small.zarr/", 1)[-1] for r in log) == sorted(FORMAT2_CHUNKS_OF_THREE)
    assert store.reader.requests == 12 and store.reader.bytes_read == sum(r.body_bytes for r in log)


def test_transient_faults_are_retried(s3_store: birdzarr.Store, proxy: Any, bucket: str) -> None:  # noqa: F811
    options = s3_options(proxy.url, config_kwargs={"read_timeout": 0.5, "connect_timeout": 0.5})
    store = birdzarr.open_store(f"s3://{bucket}/small.zarr", storage_options=options)
    proxy.stall_seconds = 1.5
    for kind, count in (("503", 2), ("reset", 1), ("reset_mid_body", 1), ("stall", 1)):
        proxy.inject(kind, count, path_contains="/gimu_codes/c/")
    got = store.windows[: 2 * CHUNK]
    assert np.array_equal(bits(got), bits(s3_store.windows[: 2 * CHUNK]))
    faults = Counter(r.fault for r in proxy.requests() if r.fault)
    assert faults == {"503": 2, "reset": 1, "reset_mid_body": 1, "stall": 1}


@pytest.fixture
def no_library_retries(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """s3fs's and botocore's own retries off, so a test sees only birdzarr's (and runs fast)."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    return {"config_kwargs": {"retries": {"total_max_attempts": 1}}}


def test_persistent_failure_names_store_and_key(
    s3_store: birdzarr.Store, proxy: Any, bucket: str, no_library_retries: dict[str, Any]  # noqa: F811
) -> None:
    options = s3_options(proxy.url, **no_library_retries)
    location = resolve(f"s3://{bucket}/small.zarr", options, retry=RetryPolicy(attempts=2, base_delay=0.01))
    store = birdzarr.open_store(location)
    proxy.inject("503", 1000, path_contains="/gimu_codes/c/2/")
    with pytest.raises(ChunkFetchError) as caught:
        store.windows[2 * CHUNK + 5]
    message = str(caught.value)
    assert f"s3://{bucket}/small.zarr" in message and "gimu_codes/c/2/0/0" in message
    assert SECRET_KEY not in message
    assert sum(r.fault == "503" for r in proxy.requests()) == 2  # our two attempts
    assert isinstance(caught.value, MissingChunkError)  # one except clause covers both


def test_missing_committed_chunk_raises_never_zeros(
    s3_store: birdzarr.Store, moto: MotoEndpoint, bucket: str  # noqa: F811
) -> None:
    options = s3_options(moto.url)
    damaged = f"s3://{bucket}/damaged.zarr"
    copy_store(s3_store.location, damaged, progress=False, dest_storage_options=options)
    moto.client().delete_object(Bucket=bucket, Key="damaged.zarr/gimu_codes/c/4/0/0")
    store = birdzarr.open_store(damaged, storage_options=options)
    assert np.array_equal(bits(store.windows[: 4 * CHUNK]), bits(s3_store.windows[: 4 * CHUNK]))
    missing = r"damaged\.zarr: committed chunk 'gimu_codes/c/4/0/0' is missing"
    with pytest.raises(MissingChunkError, match=missing):
        store.windows[4 * CHUNK : 5 * CHUNK]


def test_copy_upload_download_and_resume(
    small_store: birdzarr.Store, moto: MotoEndpoint, tmp_path: Any  # noqa: F811
) -> None:
    bucket = new_bucket(moto)
    options = s3_options(moto.url)
    remote = f"s3://{bucket}/up.zarr"
    up = copy_store(small_store.location, remote, progress=False, dest_storage_options=options)
    assert up.copied == up.objects and up.skipped == 0
    down = copy_store(remote, tmp_path / "down.zarr", progress=False, source_storage_options=options)
    assert down.copied == down.objects
    local = birdzarr.open_store(tmp_path / "down.zarr")
    assert np.array_equal(bits(local.windows[:]), bits(small_store.windows[:]))
    assert local.meta["committed"] == small_store.meta["committed"]

    # An interrupted upload: the root (written last) and some chunks missing, one chunk torn.
    client = moto.client()
    client.delete_object(Bucket=bucket, Key="up.zarr/zarr.json")
    with pytest.raises((StoreNotFoundError, NotAStoreError)):  # not committed: not a store
        birdzarr.open_store(remote, storage_options=options)
    for i in (3, 7, 11):
        client.delete_object(Bucket=bucket, Key=f"up.zarr/gimu_codes/c/{i}/0/0")
    size = client.head_object(Bucket=bucket, Key="up.zarr/gimu_codes/c/5/0/0")["ContentLength"]
    client.put_object(Bucket=bucket, Key="up.zarr/gimu_codes/c/5/0/0", Body=b"\0" * size)
    resumed = copy_store(small_store.location, remote, progress=False, dest_storage_options=options)
    assert resumed.copied == 5 and resumed.skipped == resumed.objects - 5  # 3 missing + 1 torn + root
    again = birdzarr.open_store(remote, storage_options=options)
    assert np.array_equal(bits(again.windows[:]), bits(small_store.windows[:]))

    # A different store at the destination is replaced only on request.
    # (the local copy with its commit time changed stands for a newer store)
    root = json.loads((tmp_path / "down.zarr" / "zarr.json").read_text())
    root["attributes"]["birdzarr"]["committed"]["committed_at"] = "2000-01-01T00:00:00+00:00"
    (tmp_path / "down.zarr" / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(StoreExistsError, match="--overwrite"):
        copy_store(tmp_path / "down.zarr", remote, progress=False, dest_storage_options=options)
    replaced = copy_store(tmp_path / "down.zarr", remote, overwrite=True, progress=False,
                          dest_storage_options=options)
    assert replaced.copied == 1  # only the root differs


def test_copy_interrupted_by_faults_resumes(
    small_store: birdzarr.Store, moto: MotoEndpoint, proxy: Any, no_library_retries: dict[str, Any]  # noqa: F811
) -> None:
    bucket = new_bucket(moto)
    remote = f"s3://{bucket}/flaky.zarr"
    flaky = resolve(remote, s3_options(proxy.url, **no_library_retries), retry=RetryPolicy(attempts=2))
    proxy.inject("reset", 1000, method="PUT", path_contains="/gimu_codes/c/9/")
    with pytest.raises(TransferError, match=r"gimu_codes/c/9/0/0.*same command"):
        copy_store(small_store.location, flaky, requests=4, progress=False)
    with pytest.raises((StoreNotFoundError, NotAStoreError)):  # never committed
        birdzarr.open_store(remote, storage_options=s3_options(moto.url))
    resumed = copy_store(small_store.location, remote, progress=False,
                         dest_storage_options=s3_options(moto.url))
    assert resumed.skipped > 0 and resumed.copied < resumed.objects
    store = birdzarr.open_store(remote, storage_options=s3_options(moto.url))
    assert np.array_equal(bits(store.windows[:]), bits(small_store.windows[:]))


def test_cli_convert_info_copy_with_standard_aws_environment(
    parquet_source: Any, moto: MotoEndpoint, tmp_path: Any  # noqa: F811
) -> None:
    """The CLI takes no credentials: AWS_* variables (the standard chain) and AWS_ENDPOINT_URL."""
    directory, truth = parquet_source
    bucket = new_bucket(moto)
    env = s3_env(moto.url)
    url = f"s3://{bucket}/cli.zarr"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(Path(sys.executable).parent / "birdzarr"), *args], env=env,
                              capture_output=True, text=True, timeout=120)
        assert SECRET_KEY not in done.stdout + done.stderr and ACCESS_KEY not in done.stdout + done.stderr
        return done

    done = cli("convert", str(directory), url, "--chunk-windows", "8192", "--quiet")
    assert done.returncode == 0, done.stderr
    info = cli("info", url, "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["windows"] == sum(len(w) for w in truth.values())
    copied = cli("copy", url, str(tmp_path / "staged.zarr"), "--quiet")
    assert copied.returncode == 0, copied.stderr
    assert "checksums verified" in copied.stdout
    assert len(birdzarr.open_store(tmp_path / "staged.zarr")) == sum(len(w) for w in truth.values())
    missing = cli("info", f"s3://{bucket}/missing.zarr")
    assert missing.returncode == 2 and "no store at s3://" in missing.stderr


def test_local_cache_serves_the_second_epoch(s3_store: birdzarr.Store, bucket: str, moto: MotoEndpoint,  # noqa: F811
                                             tmp_path: Any) -> None:
    store = birdzarr.open_store(f"s3://{bucket}/small.zarr", storage_options=s3_options(moto.url),
                                cache_dir=tmp_path / "cache", cache_max_bytes=10**9)
    cache = store.cache
    assert cache is not None
    first = store.windows[:]
    fetched = store.reader.requests
    # each chunk of the three per-window arrays, and the three dictionary arrays' one chunk each
    window_chunks = 3 * store.reader.n_chunks
    assert fetched == window_chunks + 3 and cache.hits == 0
    second = store.windows[:]  # the reader keeps the dictionaries: only the window chunks again
    assert store.reader.requests == fetched and cache.hits == window_chunks
    assert np.array_equal(bits(first), bits(second))
    assert np.array_equal(bits(first), bits(s3_store.windows[:]))

    # A cap of three of the largest chunks: the chunks admitted until the next one would not fit
    # are kept (three, or four when smaller ones came first: reads run concurrently), and the rest
    # are read from the bucket every time, with no eviction.
    chunk_bytes = sorted(store.location.fs.du(store.location.join("gimu_codes"), total=False).values())[-1]
    capped_store = birdzarr.open_store(f"s3://{bucket}/small.zarr", storage_options=s3_options(moto.url),
                                       cache_dir=tmp_path / "capped", cache_max_bytes=3 * chunk_bytes)
    capped = capped_store.cache
    assert capped is not None
    for _ in range(2):
        assert np.array_equal(bits(capped_store.windows[:]), bits(first))
    kept = sum(len(files) for array in ("gimu_codes", "gimu_row", "gps_speed")
               for _, _, files in os.walk(os.path.join(capped.root, array)))
    assert capped.full and capped.used_bytes <= 3 * chunk_bytes and kept >= 3
    assert capped.hits == kept and capped_store.reader.requests == fetched + window_chunks - kept


@pytest.mark.filterwarnings("ignore:.*stored in device order")
def test_window_dataset_full_epoch_on_s3(s3_store: birdzarr.Store, bucket: str, moto: MotoEndpoint) -> None:  # noqa: F811
    dataset = birdzarr.WindowDataset(
        f"s3://{bucket}/small.zarr", batch_size=1000, shuffle=True, seed=3, requests=8,
        storage_options=s3_options(moto.url),
    )
    from torch.utils.data import DataLoader

    # two worker processes, each with its own S3 connections (nothing crosses the fork)
    batches = [np.asarray(b) for b in DataLoader(dataset, batch_size=None, num_workers=2)]
    got = np.concatenate(batches)
    truth = s3_store.windows[:]
    assert got.shape == truth.shape and len(batches) == -(-len(truth) // 1000)
    # every window exactly once: the same multiset of 80-value rows, in a shuffled order
    rows_got, rows_truth = bits(got).reshape(len(got), -1), bits(truth).reshape(len(truth), -1)
    order_got, order_truth = np.lexsort(rows_got.T[::-1]), np.lexsort(rows_truth.T[::-1])
    assert np.array_equal(rows_got[order_got], rows_truth[order_truth])
    assert not np.array_equal(rows_got, rows_truth)


def test_optional_obstore_fetcher(
    s3_store: birdzarr.Store, proxy: Any, bucket: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """BIRDZARR_S3_FETCHER=obstore: same bytes, one GET per chunk, throttling retried, and never
    used in a process forked after its runtime started (it would hang there)."""
    pytest.importorskip("obstore")
    from birdzarr.storage import _location as _storage

    monkeypatch.setenv(_storage.FETCHER_ENV, "obstore")
    monkeypatch.setattr(_storage, "_obstore_pid", None)
    store = birdzarr.open_store(f"s3://{bucket}/small.zarr", storage_options=s3_options(proxy.url))
    assert _storage._uses_obstore(store.location)
    proxy.clear()
    proxy.inject("503", 2, path_contains="/gimu_codes/c/1/")
    assert np.array_equal(bits(store.windows[: 3 * CHUNK]), bits(s3_store.windows[: 3 * CHUNK]))
    log = proxy.requests()  # 12 objects (FORMAT2_CHUNKS_OF_THREE), one of them after two 503s
    assert Counter(r.method for r in log) == {"GET": 14} and sum(r.fault == "503" for r in log) == 2, log
    assert _storage._obstore_pid == os.getpid()
    with pytest.raises(MissingChunkError, match="gimu_codes/c/99/0/0"):
        _storage.read_object(store.location, "gimu_codes/c/99/0/0")
    monkeypatch.setattr(_storage, "_obstore_pid", os.getpid() + 1)  # as seen in a forked child
    assert not _storage._uses_obstore(store.location)
    assert np.array_equal(bits(store.windows[:CHUNK]), bits(s3_store.windows[:CHUNK]))  # via s3fs


# -- conversions into a bucket in worker processes (input of 64 MB and more) ------------------------
def padded_csv_dir(directory: Path, *, min_bytes: int) -> int:
    """Four devices of CSV exports whose value fields carry trailing zeros (``1.910000...0``: the
    same values) so that the input is just over ``min_bytes`` with few windows; its size."""
    from birdzarr.demo import _synthetic

    _synthetic.make_csv_dir(directory, n_devices=4, bursts_per_device=40, seed=5)
    files = sorted(directory.iterdir())
    lines = [path.read_text().splitlines() for path in files]
    size = sum(path.stat().st_size for path in files)
    zeros = "0" * (-(-(min_bytes - size) // (4 * sum(map(len, lines)))) + 1)
    for path, rows in zip(files, lines, strict=True):
        fields = (row.split(",") for row in rows)
        path.write_text("".join(",".join(f[:4] + [v + zeros for v in f[4:]]) + "\n" for f in fields))
    return sum(path.stat().st_size for path in files)


@pytest.fixture(scope="module")
def csv_sources(tmp_path_factory: pytest.TempPathFactory, moto: MotoEndpoint, bucket: str  # noqa: F811
                ) -> dict[str, tuple[Path, str]]:
    """CSV sources under and just over the size at which a conversion starts worker processes,
    each on local disk and in the bucket: ``{"under"|"over": (directory, s3 URL)}``."""
    from birdzarr.convert._segments import PROCESS_MIN_BYTES
    from birdzarr.demo import _synthetic

    under, over = tmp_path_factory.mktemp("csv-under"), tmp_path_factory.mktemp("csv-over")
    _synthetic.make_csv_dir(under, n_devices=4, bursts_per_device=40, seed=5)
    assert padded_csv_dir(over, min_bytes=PROCESS_MIN_BYTES) >= PROCESS_MIN_BYTES
    fs = resolve(f"s3://{bucket}", s3_options(moto.url)).fs
    sources = {}
    for name, directory in (("under", under), ("over", over)):
        for file in sorted(directory.iterdir()):
            fs.put_file(str(file), f"{bucket}/csv-{name}/{file.name}")
        sources[name] = (directory, f"s3://{bucket}/csv-{name}")
    return sources


def _store_objects(store: birdzarr.Store) -> dict[str, bytes]:
    """Every object of the store but its root zarr.json (which holds the run's times and URLs)."""
    fs, root = store.location.fs, store.location.path.rstrip("/")
    fs.invalidate_cache()
    return {path[len(root) + 1:]: fs.cat_file(path) for path in fs.find(root)
            if path[len(root) + 1:] != "zarr.json"}


@pytest.mark.parametrize("size", ["under", "over"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "device-order"])
def test_conversion_into_a_bucket_equals_a_local_one_on_both_sides_of_64_mb(
    csv_sources: dict[str, tuple[Path, str]], moto: MotoEndpoint, bucket: str, tmp_path: Path,  # noqa: F811
    size: str, shuffle: bool,
) -> None:
    """docs/cloud.md's command (``convert SRC s3://... --shuffle --seed 1``) on input under and
    over 64 MB, where worker processes read the source and write the store: each process opens
    the bucket itself (an s3fs client inherited through fork fails: "This class is not
    fork-safe"). From a local and from an s3:// source, the store in the bucket is the local
    conversion's, object for object."""
    from birdzarr.convert._segments import PROCESS_MIN_BYTES

    directory, source_url = csv_sources[size]
    assert (sum(p.stat().st_size for p in directory.iterdir()) >= PROCESS_MIN_BYTES) == (size == "over")
    layout = ["--shuffle", "--seed", "1"] if shuffle else []
    local = birdzarr.convert(directory, tmp_path / "local.zarr", workers=2, progress=False,
                             shuffle=shuffle, seed=1 if shuffle else None)
    url = f"s3://{bucket}/{size}-{'shuffle' if shuffle else 'order'}"
    done = subprocess.run([str(Path(sys.executable).parent / "birdzarr"), "convert", str(directory),
                           f"{url}-cli.zarr", *layout, "--workers", "2", "--quiet"],
                          env=s3_env(moto.url), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    options = s3_options(moto.url)
    from_bucket = birdzarr.convert(source_url, f"{url}-api.zarr", workers=2, progress=False, shuffle=shuffle,
                                   seed=1 if shuffle else None, storage_options=options,
                                   source_storage_options=options)
    expected = _store_objects(local)
    for store in (birdzarr.open_store(f"{url}-cli.zarr", storage_options=options), from_bucket):
        processes = store.meta["report"].get("worker_processes")
        assert processes == (2 if size == "over" else None)  # one engine: CSV tasks too
        assert store.meta["devices"] == local.meta["devices"] and len(store) == len(local) > 200
        assert np.array_equal(bits(store.windows[:]), bits(local.windows[:]))
        for name in ("labels", "timestamps", "window_devices"):
            assert np.array_equal(getattr(store, name)[:], getattr(local, name)[:]), name
        assert _store_objects(store) == expected


def test_shuffle_over_64_mb_into_memory_keeps_every_chunk(csv_sources: dict[str, tuple[Path, str]],
                                                          tmp_path: Path) -> None:
    """memory:// is each process's own: a conversion into it stays in this process (worker
    processes' chunks would be lost there, and the store commit without them)."""
    directory = csv_sources["over"][0]
    local = birdzarr.convert(directory, tmp_path / "local.zarr", workers=2, shuffle=True, seed=1,
                             progress=False)
    memory = birdzarr.convert(directory, "memory://birdzarr-test/over.zarr", workers=2, shuffle=True,
                              seed=1, progress=False)
    assert "worker_processes" not in memory.meta["report"]
    assert np.array_equal(bits(memory.windows[:]), bits(local.windows[:]))
    assert memory.meta["devices"] == local.meta["devices"]

def test_failed_conversion_into_a_bucket_leaves_nothing_and_info_says_so(
    csv_sources: dict[str, tuple[Path, str]], moto: MotoEndpoint, bucket: str, tmp_path: Path,  # noqa: F811
) -> None:
    """A conversion that fails (a bad line in the last file, read by a worker process) removes
    everything it wrote, the five zarr.json objects included, so ``info`` finds no store rather
    than an unfinished one to re-run."""
    import shutil

    directory = tmp_path / "bad"
    shutil.copytree(csv_sources["over"][0], directory)
    last = sorted(directory.iterdir())[-1]
    with last.open("a") as handle:
        handle.write("not,a,line\n")
    env = s3_env(moto.url)
    url = f"s3://{bucket}/failed.zarr"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(Path(sys.executable).parent / "birdzarr"), *args], env=env,
                              capture_output=True, text=True, timeout=300)

    failed = cli("convert", str(directory), url, "--shuffle", "--seed", "1", "--workers", "2", "--quiet")
    assert failed.returncode == 2, failed.stderr
    assert failed.stderr.count("\n") == 1 and f"{last.name}, line " in failed.stderr, failed.stderr
    listed = moto.client().list_objects_v2(Bucket=bucket, Prefix="failed.zarr")
    assert listed.get("KeyCount", 0) == 0, [o["Key"] for o in listed.get("Contents", [])]
    info = cli("info", url)
    assert info.returncode == 2 and info.stderr == f"birdzarr info: error: no store at {url}\n", info.stderr


def test_missing_bucket_is_named_in_one_line(parquet_source: Any, moto: MotoEndpoint) -> None:  # noqa: F811
    directory, _ = parquet_source
    env = s3_env(moto.url)
    url = "s3://no-such-bucket-birdzarr/x.zarr"
    for args in (["convert", str(directory), url, "--quiet"], ["info", url]):
        done = subprocess.run([str(Path(sys.executable).parent / "birdzarr"), *args], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr == (
            f"birdzarr {args[0]}: error: {url}: the bucket 'no-such-bucket-birdzarr' does not exist (or "
            "these credentials cannot see it). Check its name, or create the bucket first "
            "(aws s3 mb s3://no-such-bucket-birdzarr).\n"
        )
    # A missing *source* bucket is named the same way (it read 'no such file or directory').
    source = "s3://no-such-source-birdzarr/raw"
    done = subprocess.run([str(Path(sys.executable).parent / "birdzarr"), "convert", source,
                           str(directory.parent / "from_missing.zarr"), "--quiet"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"birdzarr convert: error: {source}: the bucket 'no-such-source-birdzarr' does not exist (or "
        "these credentials cannot see it). Check its name, or create the bucket first "
        "(aws s3 mb s3://no-such-source-birdzarr).\n"
    )


class _ConnectionTrap:
    """A listening socket that counts connections and closes each: set as HTTPS_PROXY, it
    stands for every host outside the test (the public AWS endpoint), and fails fast."""

    def __init__(self) -> None:
        import socket
        import threading

        self.connections = 0
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            self.connections += 1
            connection.close()

    def close(self) -> None:
        self._socket.close()


def test_obstore_sends_requests_only_to_the_endpoint_s3fs_uses(
    s3_store: birdzarr.Store, proxy: Any, bucket: str, tmp_path: Path  # noqa: F811
) -> None:
    """``FSSPEC_S3_ENDPOINT_URL`` alone (no AWS_ENDPOINT_URL, no endpoint_url in storage_options)
    names the endpoint: with BIRDZARR_S3_FETCHER=obstore every request, the chunks' included,
    goes there and nowhere else."""
    pytest.importorskip("obstore")
    trap = _ConnectionTrap()
    env = {k: v for k, v in s3_env(proxy.url).items()
           if not k.startswith(("AWS_ENDPOINT_URL", "FSSPEC_")) and not k.lower().endswith("_proxy")}
    env.update({"FSSPEC_S3_ENDPOINT_URL": proxy.url, "BIRDZARR_S3_FETCHER": "obstore",
                "HTTPS_PROXY": trap.url, "https_proxy": trap.url})
    script = (
        "import sys, warnings, numpy as np, birdzarr\n"
        "from birdzarr.storage._location import _uses_obstore\n"
        "warnings.simplefilter('error')\n"
        f"store = birdzarr.open_store('s3://{bucket}/small.zarr')\n"
        "assert _uses_obstore(store.location)\n"
        f"np.save(sys.argv[1], store.windows[: 3 * {CHUNK}])\n"
    )
    proxy.clear()
    try:
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "w.npy")], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        trap.close()
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.array_equal(bits(np.load(tmp_path / "w.npy")), bits(s3_store.windows[: 3 * CHUNK]))
    chunks = sorted(r.path.rsplit("small.zarr/", 1)[-1] for r in proxy.requests() if "/c/" in r.path)
    assert chunks == sorted(FORMAT2_CHUNKS_OF_THREE) and trap.connections == 0


def test_obstore_endpoint_is_the_s3fs_clients_or_obstore_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """No endpoint named: AWS in the client's region, as s3fs. An AWS endpoint obstore would not
    reach the same way (FIPS here), or credentials from a profile: s3fs keeps fetching, with a
    FallbackWarning."""
    pytest.importorskip("obstore")
    from birdzarr._errors import FallbackWarning
    from birdzarr.storage import _location as _storage

    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/birdzarr-test-config")
    monkeypatch.setenv(_storage.FETCHER_ENV, "obstore")
    monkeypatch.setattr(_storage, "_obstore_pid", None)
    monkeypatch.setattr(_storage, "_fallbacks_warned", set())
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    aws = resolve("s3://bucket/x.zarr", {"key": "k-region", "secret": "s-region"})
    assert _storage._obstore_endpoint(aws) == ("https://s3.eu-west-1.amazonaws.com", "eu-west-1")
    assert _storage._uses_obstore(aws)
    monkeypatch.setenv("AWS_USE_FIPS_ENDPOINT", "true")
    fips = resolve("s3://bucket/x.zarr", {"key": "k-fips", "secret": "s-fips"})
    with pytest.warns(FallbackWarning, match=r"AWS endpoint https://s3-fips\.eu-west-1\.amazonaws\.com"):
        assert not _storage._uses_obstore(fips)
    # credentials from a profile: obstore would not find them (its requests would go unsigned)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.setenv("AWS_PROFILE", "lab")
    with pytest.warns(FallbackWarning, match="AWS_PROFILE is set, and obstore does not read ~/.aws profiles"):
        assert not _storage._uses_obstore(resolve("s3://bucket/x.zarr"))
