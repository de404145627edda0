"""Store locations: URL forms, options pass-through, redaction, retries, read-only HTTP, the cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import birdzarr
from birdzarr._errors import MissingChunkError, ReadOnlyLocationError
from birdzarr.maintenance._copy import copy_store
from birdzarr.storage._cache import cache_for
from birdzarr.storage._location import (
    RetryPolicy,
    is_transient,
    redact,
    resolve,
    with_retries,
    zarr_store,
)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def test_paths_and_file_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve("x.zarr").path == str(tmp_path / "x.zarr")
    assert resolve("~/y.zarr/").path == str(tmp_path / "y.zarr")
    assert resolve(f"file://{tmp_path}/z.zarr").path == str(tmp_path / "z.zarr")
    assert resolve(tmp_path / "w.zarr").is_local
    assert resolve("memory://bucket/m.zarr").protocol == "memory"


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_s3_defaults_and_chains_keep_user_options() -> None:
    plain = resolve("s3://bucket/store.zarr", {"anon": True})
    assert plain.fs.max_concurrency == 1  # no HEAD before each GET
    assert plain.path == "bucket/store.zarr" and plain.protocol == "s3"
    mine = resolve("s3://bucket/store.zarr", {"anon": True, "max_concurrency": 4})
    assert mine.fs.max_concurrency == 4
    chained = resolve("simplecache::s3://bucket/store.zarr", {"s3": {"anon": True}})
    assert chained.protocol == "s3" and chained.fs.fs.max_concurrency == 1
    assert chained.storage_options["s3"]["anon"] is True
    assert chained.storage_options["s3"]["max_concurrency"] == 1
    # bounded waiting on an unreachable endpoint (docs/reliability.md), the user's settings win
    assert plain.fs.config_kwargs["connect_timeout"] == 3 and plain.fs.retries == 2
    assert plain.fs.config_kwargs["retries"]["mode"] == "standard"
    patient = resolve("s3://bucket/store.zarr", {"anon": True, "config_kwargs": {"connect_timeout": 30}})
    assert patient.fs.config_kwargs["connect_timeout"] == 30
    assert patient.fs.config_kwargs["read_timeout"] == 20


def test_redaction_of_urls_and_option_secrets() -> None:
    assert redact("https://user:pa55word@host/x.zarr") == "https://host/x.zarr"
    options = {"client_kwargs": {"aws_secret_access_key": "s3cr3t-nested"}, "token": "session-t0ken"}
    resolve("s3://bucket/a.zarr", options)
    text = redact("boto said: s3cr3t-nested and session-t0ken and bucket")
    assert "s3cr3t" not in text and "t0ken" not in text and "bucket" in text
    location = resolve("https://me:hunter22@example.invalid/s.zarr")
    assert "hunter22" not in repr(location) and "hunter22" not in location.display
    assert redact("the password hunter22 leaked") == "the password *** leaked"


class HttpStatusError(OSError):
    """Carries ``status`` as aiohttp's ClientResponseError does (the HTTP filesystem's errors)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def test_transient_errors_are_retried_and_answers_are_not() -> None:
    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError())
    assert is_transient(OSError(5, "EIO"))
    assert not is_transient(FileNotFoundError()) and not is_transient(PermissionError())
    assert not is_transient(ValueError()) and not is_transient(MissingChunkError("x"))
    assert not is_transient(HttpStatusError(403)) and is_transient(HttpStatusError(503))
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("peer reset")
        return "ok"

    assert with_retries(flaky, RetryPolicy(attempts=3, base_delay=0.001)) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(ConnectionResetError):
        with_retries(flaky, RetryPolicy(attempts=2, base_delay=0.001))
    with pytest.raises(FileNotFoundError):
        with_retries(Path("/nonexistent/birdzarr").read_bytes, RetryPolicy(attempts=5, base_delay=10))


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_memory_url_round_trip_and_copy(
    parquet_source: Any, small_store: birdzarr.Store, tmp_path: Path
) -> None:
    directory, truth = parquet_source
    store = birdzarr.convert(directory, "memory://birdzarr-tests/m.zarr", chunk_windows=4096, progress=False)
    for device, windows in list(truth.items())[:3]:
        assert np.array_equal(bits(store.device_windows(device)), bits(windows))
    copied = copy_store(small_store.location, "memory://birdzarr-tests/copy.zarr", progress=False)
    assert copied.copied == copied.objects
    again = copy_store(small_store.location, "memory://birdzarr-tests/copy.zarr", progress=False)
    assert again.copied == 1 and again.skipped == again.objects - 1  # only the root is rewritten
    down = copy_store("memory://birdzarr-tests/copy.zarr", tmp_path / "back.zarr", progress=False)
    assert np.array_equal(bits(birdzarr.open_store(tmp_path / "back.zarr").windows[:]),
                          bits(small_store.windows[:]))
    assert down.bytes_total == again.bytes_total


# A format-2 store's (the default) chunk n of the windows is three objects: gimu_codes, gps_speed and
# gimu_row; its reader reads the three dictionary arrays (one chunk each here) once and keeps them.
_OBJECTS = 3
_DICTIONARIES = 3


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_copy_skips_lock_and_resumes_a_torn_local_copy(small_store: birdzarr.Store, tmp_path: Path) -> None:
    dest = tmp_path / "copy.zarr"
    copy_store(small_store.location, dest, progress=False)
    (dest / "zarr.json").unlink()
    chunk = dest / "gimu_codes" / "c" / "2" / "0" / "0"
    chunk.write_bytes(b"\1" * chunk.stat().st_size)  # same size, different bytes
    (dest / "gimu_codes" / "c" / "3" / "0" / "0.1234abcd.birdzarr-partial").write_bytes(b"torn")
    resumed = copy_store(small_store.location, dest, progress=False)
    assert resumed.copied == 2  # the torn chunk and the root
    assert np.array_equal(bits(birdzarr.open_store(dest).windows[:]), bits(small_store.windows[:]))
    assert not list(dest.rglob("*partial*")) and not list(dest.rglob(".birdzarr.lock"))


def test_http_locations_are_read_only() -> None:
    location = resolve("https://example.invalid/data/s.zarr")
    assert location.read_only and not location.is_local
    with pytest.raises(ReadOnlyLocationError, match="cannot write"):
        zarr_store(location, read_only=False)
    with pytest.raises(ReadOnlyLocationError):
        birdzarr.convert("/nonexistent-source", location, progress=False)
    assert isinstance(ReadOnlyLocationError("x"), PermissionError)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_cache_cap_and_commit_namespaces(small_store: birdzarr.Store, tmp_path: Path) -> None:
    codes = Path(small_store.location.path, "gimu_codes")
    sizes = sorted(os.path.getsize(p) for p in codes.rglob("0") if p.is_file())
    cap = sizes[-1] * 2  # room for two or three read units (the dictionary values do not fit)
    store = birdzarr.open_store(small_store.location.url, cache_dir=tmp_path / "cache", cache_max_bytes=cap)
    cache = store.cache
    assert cache is not None
    n = store.reader.n_chunks
    truth = small_store.windows[:]
    assert np.array_equal(bits(store.windows[:]), bits(truth))
    assert cache.full and 0 < cache.used_bytes <= cap and cache.hits == 0
    assert np.array_equal(bits(store.windows[:]), bits(truth))
    cached = [p for p in Path(cache.root).rglob("*") if p.is_file() and p.name != "SOURCE.json"]
    assert cache.hits == len(cached)
    assert store.reader.requests == 2 * _OBJECTS * n + _DICTIONARIES - cache.hits
    # a new commit of the same URL gets a fresh namespace and the old one is removed
    store.root = {**store.root, "committed": {**store.root["committed"], "generation": 2}}
    newer = cache_for(store, tmp_path / "cache", max_bytes=cap)
    assert newer.namespace != cache.namespace and not os.path.exists(cache.root)
    assert newer.used_bytes == 0


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_open_store_reads_through_a_local_chunk_cache(small_store: birdzarr.Store, tmp_path: Path) -> None:
    """The chunk cache is an option of open_store (issue 34); attach_cache, which changed an
    opened handle, still works for one release and warns."""
    url = small_store.location.url
    store = birdzarr.open_store(url, cache_dir=tmp_path / "cache")
    cache = store.cache
    assert cache is not None and cache.max_bytes == 50 * 2**30
    n = store.reader.n_chunks
    first = store.windows[:]
    read = _OBJECTS * n + _DICTIONARIES
    assert store.reader.requests == read and cache.hits == 0 and cache.used_bytes > 0
    assert np.array_equal(bits(store.windows[:]), bits(first))
    assert store.reader.requests == read and cache.hits == _OBJECTS * n  # the dictionaries are kept
    assert np.array_equal(bits(first), bits(small_store.windows[:]))
    assert birdzarr.open_store(url).cache is None

    plain = birdzarr.open_store(url)
    with pytest.warns(DeprecationWarning, match=r"open_store\(url, cache_dir=directory"):
        attached = birdzarr.attach_cache(plain, tmp_path / "cache", max_bytes=10**9)
    assert plain.cache is attached and attached.namespace == cache.namespace

    refused = "^cache_max_bytes must be an integer of 0 or more, got -1$"
    with pytest.raises(birdzarr.ArgumentError, match=refused):
        birdzarr.open_store(url, cache_dir=tmp_path / "other", cache_max_bytes=-1)
    with pytest.raises(TypeError, match="^cache_max_bytes must be an integer, got 1.5$"):
        birdzarr.open_store(url, cache_dir=tmp_path / "other", cache_max_bytes=1.5)  # type: ignore[arg-type]
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(birdzarr.ArgumentError, match="a_file is not a directory"):
        birdzarr.open_store(url, cache_dir=tmp_path / "a_file")
    with pytest.raises(birdzarr.ArgumentError, match="the chunk cache is a local directory"):
        birdzarr.open_store(url, cache_dir="s3://bucket/cache")
    assert not (tmp_path / "other").exists()
