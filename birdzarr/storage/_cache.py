"""Opt-in local disk cache of remote chunks, with a size cap, so epoch 2 reads from local NVMe.

Layout: ``DIRECTORY/<namespace>/<chunk key>`` plus ``DIRECTORY/usage`` (bytes cached, all
namespaces) and ``DIRECTORY/lock``. The namespace is a hash of the store's URL (credentials
removed) and its commit (window count, generation, time), so a re-converted or appended store
never serves chunks of its previous version: a partial last chunk that an append rewrote gets a new
namespace. Attaching a store removes the namespaces of its earlier commits.

When the cap is reached the cache stops admitting chunks; nothing is evicted. The chunks already
cached keep serving hits and the rest are read from the store every epoch. A shuffled epoch reads
every chunk once, in an order unrelated to the previous epoch's, so least-recently-used eviction
would throw each chunk out just before its next use; keeping a fixed subset instead makes the
hit rate ``cap / store size``. To start over, delete the directory.

Several DataLoader workers (processes) share one directory safely: files are written aside and
renamed (a reader never sees half a chunk), and the usage counter is updated under an exclusive
``flock``, so the cap holds across processes. Put the directory on local disk, not on NFS.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

from birdzarr._checks import require_int
from birdzarr._errors import ArgumentError
from birdzarr.storage._location import Location, redact

DEFAULT_MAX_BYTES = 50 * 2**30  # open_store's and WindowDataset's cache_max_bytes

_USAGE = "usage"
_LOCK = "lock"
_SOURCE = "SOURCE.json"


class CommittedStore(Protocol):
    """What the cache needs of a store: where it is and its root attributes (the commit record).

    ``birdzarr.Store`` has both; the storage layer names no type of the layers above it.
    """

    @property
    def location(self) -> Location: ...

    @property
    def root(self) -> dict[str, Any]: ...  # the root attributes (no device table: format 2 keeps it apart)


class _CacheHolder(Protocol):
    cache: Any  # the chunk reader's hook (birdzarr.store._chunks.ChunkReader.cache)


class _ReadingStore(CommittedStore, Protocol):
    @property
    def reader(self) -> _CacheHolder: ...


class ChunkCache:
    """The cache of one store commit; picklable (DataLoader workers each use their copy)."""

    def __init__(
        self, directory: str | os.PathLike[str], max_bytes: int, namespace: str, source: str
    ) -> None:
        max_bytes = require_int("cache_max_bytes", max_bytes)
        if max_bytes < 0:
            raise ArgumentError(f"cache_max_bytes must be an integer of 0 or more, got {max_bytes}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_bytes = int(max_bytes)
        self.namespace = namespace
        self.root = os.path.join(self.directory, namespace)
        self.hits = 0
        self.misses = 0
        self.full = False  # once the cap is reached this process stops trying to admit chunks
        os.makedirs(self.root, exist_ok=True)
        with self._locked():
            self._forget_older_commits(source)
            _write_text(os.path.join(self.root, _SOURCE), source)
            self._set_usage(_disk_usage(self.directory))

    # -- the hook ChunkReader._fetch calls --------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.misses += 1
            return None
        self.hits += 1
        return data

    def put(self, key: str, data: bytes) -> None:
        if self.full:
            return
        path = self._path(key)
        with self._locked():
            if os.path.exists(path):
                return  # another worker cached it first
            usage = self._usage()
            if usage + len(data) > self.max_bytes:
                self.full = True
                return
            os.makedirs(os.path.dirname(path), exist_ok=True)
            partial = f"{path}.{uuid.uuid4().hex[:8]}.partial"
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, path)
            self._set_usage(usage + len(data))

    @property
    def used_bytes(self) -> int:
        return self._usage()

    # -- internals -------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(os.path.join(self.directory, _LOCK), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _usage(self) -> int:
        try:
            with open(os.path.join(self.directory, _USAGE)) as f:
                return int(f.read() or 0)
        except (FileNotFoundError, ValueError):
            return _disk_usage(self.directory)

    def _set_usage(self, value: int) -> None:
        _write_text(os.path.join(self.directory, _USAGE), str(value))

    def _forget_older_commits(self, source: str) -> None:
        url = json.loads(source)["url"]
        for entry in os.scandir(self.directory):
            if not entry.is_dir() or entry.name == self.namespace:
                continue
            try:
                with open(os.path.join(entry.path, _SOURCE)) as f:
                    other = json.load(f)
            except (FileNotFoundError, ValueError):
                continue
            if other.get("url") == url:
                shutil.rmtree(entry.path, ignore_errors=True)

    def __repr__(self) -> str:
        return (
            f"<ChunkCache {self.root}: {self.used_bytes / 1e6:,.1f} of {self.max_bytes / 1e6:,.1f} MB, "
            f"{self.hits} hits, {self.misses} misses{', full' if self.full else ''}>"
        )


def cache_for(store: CommittedStore, directory: str | os.PathLike[str], max_bytes: int) -> ChunkCache:
    """The cache for this store's current commit (see the module docstring for the layout)."""
    directory = check_cache_dir(directory)
    committed = store.root.get("committed") or {}
    identity = {"url": redact(store.location.url), "committed": committed}
    source = json.dumps(identity, sort_keys=True, default=str)
    namespace = hashlib.sha256(source.encode()).hexdigest()[:20]
    return ChunkCache(directory, max_bytes, namespace, source)


def attach_cache(store: _ReadingStore, directory: str | os.PathLike[str], max_bytes: int) -> ChunkCache:
    """Deprecated: open the store with the cache instead,
    ``birdzarr.open_store(url, cache_dir=directory, cache_max_bytes=max_bytes)``, and read its
    figures from ``store.cache``. Kept for one release; it warns with a ``DeprecationWarning``.

    Makes ``store``'s chunk reads go through a local cache; returns the cache (for its stats).
    """
    warnings.warn(
        "birdzarr.attach_cache(store, directory, max_bytes) is deprecated: open the store with the "
        "cache, birdzarr.open_store(url, cache_dir=directory, cache_max_bytes=max_bytes), and read "
        "its figures from store.cache",
        DeprecationWarning, stacklevel=2,
    )
    cache = cache_for(store, directory, max_bytes)
    store.reader.cache = cache
    return cache


def check_cache_dir(directory: Any) -> str | os.PathLike[str]:
    """``directory`` if it can be a cache directory (a local path, a directory if it exists)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a path, got {directory!r}")
    if "://" in os.fspath(directory):
        raise ArgumentError(f"cache_dir {os.fspath(directory)}: the chunk cache is a local directory; "
                            "give a path on local disk")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ArgumentError(f"cache_dir {os.fspath(directory)} is not a directory: give a directory "
                            "(it is made if missing)")
    return directory


def _disk_usage(directory: str) -> int:
    total = 0
    for base, _, files in os.walk(directory):
        for name in files:
            if name not in (_USAGE, _LOCK, _SOURCE) and not name.endswith(".partial"):
                with contextlib.suppress(FileNotFoundError):
                    total += os.path.getsize(os.path.join(base, name))
    return total


def _write_text(path: str, text: str) -> None:
    partial = f"{path}.{uuid.uuid4().hex[:8]}.partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)
