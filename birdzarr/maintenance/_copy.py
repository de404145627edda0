"""``birdzarr copy SRC DEST``: upload or download a whole store, resumable, verified, committed last.

Objects are copied concurrently (object stores answer in tens of milliseconds per request), every
object but the root ``zarr.json`` first. The root is what makes a birdzarr store a store (it holds
the commit), so it is written only after every other object has been verified: a copy that is
interrupted, or fails verification, is never mistaken for a complete store by a reader, and
running the same command again resumes it.

A copy never commits a damaged store as if it were good: the committed chunks the source's
metadata calls for are compared with its listing (a missing one is damage, as in ``verify``), and
every committed chunk of birdzarr's own codec chains, which end with a CRC-32C of the chunk's
bytes, is checked as it passes through memory, before it is written (one CRC pass over bytes
already read: under 0.01 s per 100 MB with google_crc32c's C extension). A chunk that fails is
not written; once every other object is copied the copy stops, uncommitted, with
``MissingChunkError`` (or ``CorruptChunkError``) naming the first damaged chunk and how many there
are. An object already at the destination with the source's size and MD5 is not read again, nor
CRC-checked: if this copy command wrote it, it was checked then, but identical bytes put there
another way (rsync, a birdzarr before this check) are not, so a chunk damaged alike at both ends
is not found by copy (``birdzarr verify`` finds it). Chunks past the committed count (an
interrupted writer's leftovers, which readers never see) are copied unchecked; objects of chains
without a CRC at their end (a sharded ``gimu``, zarr's own codecs) are checked for presence only.

Resuming skips an object already at the destination when its size and MD5 match the source's.
MD5s come for free from S3 listings (the ETag of a single-part upload) and are computed for local
and in-memory files; where neither side's MD5 is cheap (a multipart or KMS-encrypted ETag, an HTTP
server) the object is copied again. Verification at the end compares every destination object's
size and MD5 with the source's, reading the destination back only where its listing has no usable
ETag.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import google_crc32c

from birdzarr._checks import require_bool
from birdzarr._errors import (
    ArgumentError,
    ChecksumMismatchError,
    CorruptChunkError,
    MissingChunkError,
    StoreExistsError,
    TransferError,
    warn_renamed,
)
from birdzarr._progress import progress_bar
from birdzarr.format import _v2
from birdzarr.format._codec import CRC32C_RESIDUE, crc32c_intact
from birdzarr.storage._location import (
    Location,
    StoreLike,
    is_transient,
    redact,
    require_writable,
    resolve,
    with_retries,
)
from birdzarr.storage._lock import StoreLock, release_and_tidy

if TYPE_CHECKING:
    from birdzarr.store._handle import Store

ROOT = "zarr.json"
# The writer's lock belongs to the source's writer; a copy must not carry it to the destination.
_NOT_COPIED = frozenset({".birdzarr.lock"})
_PARTIAL_SUFFIX = ".birdzarr-partial"
# Whole objects up to this size are copied in memory; larger ones (shards) are streamed.
_IN_MEMORY_LIMIT = 64 * 2**20
_STREAM_BLOCK = 8 * 2**20
_MD5_ETAG = re.compile(r'^"?([0-9a-f]{32})"?$')
_FAILS_CRC = "fails its CRC-32C (its bytes were changed or truncated)"


@dataclass
class CopyResult:
    """What a copy did. ``skipped`` objects were already at the destination, identical."""

    objects: int = 0
    copied: int = 0
    skipped: int = 0
    deleted: int = 0
    bytes_total: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0

    def format(self) -> str:
        """What the copy did, in one line (``str(result)`` is the same)."""
        mb = self.bytes_copied / 1e6
        rate = mb / self.seconds if self.seconds else 0.0
        return (
            f"{self.objects} objects ({self.bytes_total / 1e6:,.1f} MB): {self.copied} copied "
            f"({mb:,.1f} MB, {rate:,.1f} MB/s), {self.skipped} already present and identical, "
            f"{self.deleted} stale removed; checksums verified; committed in {self.seconds:.1f} s"
        )

    def __str__(self) -> str:
        return self.format()

    def summary(self) -> str:
        """Deprecated spelling of ``format()``."""
        warn_renamed("CopyResult.summary()", "CopyResult.format() or str(result)")
        return self.format()


@dataclass(frozen=True)
class _Object:
    key: str  # relative to the store root, "/"-separated
    size: int
    etag_md5: str | None  # from the listing, when it is a plain MD5


def copy_store(
    source: StoreLike,
    dest: StoreLike,
    *,
    overwrite: bool = False,
    requests: int = 16,
    progress: bool = True,
    source_storage_options: dict[str, Any] | None = None,
    dest_storage_options: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CopyResult:
    """Copy the committed store at ``source`` to ``dest`` (any two URLs or paths); see module doc.

    ``dest`` may be empty, a partial copy (resumed) or the same store (verified, nothing copied).
    A different committed store there is replaced only with ``overwrite=True``: it is un-committed
    first, objects that are identical are kept, stale ones removed, and the new root written last.
    Anything else at ``dest`` (a file, a directory with other things in it) is refused, as is a
    ``dest`` that is, holds or sits inside ``source``. The copy holds ``dest``'s writer lock.

    ``requests``: objects transferred at once (requests in flight). ``source_storage_options`` /
    ``dest_storage_options``: fsspec options of each side (``storage_options``, the source's,
    is the deprecated spelling of ``source_storage_options``).
    """
    from birdzarr.convert._overwrite import check_destination
    from birdzarr.store._handle import open_store

    # before anything is read or written: overwrite="no" must not replace the store at dest
    overwrite = require_bool("overwrite", overwrite)
    progress = require_bool("progress", progress)
    if not isinstance(requests, int) or isinstance(requests, bool) or requests < 1:
        raise ArgumentError(f"requests must be a positive integer, got {requests!r}")
    if storage_options is not None:
        if source_storage_options is not None:
            raise ArgumentError("storage_options is the deprecated spelling of source_storage_options: "
                                "give one of them")
        warn_renamed("copy(storage_options=...)", "copy(source_storage_options=...)")
        source_storage_options = storage_options
    started = time.perf_counter()
    src = resolve(source, source_storage_options)
    dst = resolve(dest, dest_storage_options)
    require_writable(dst)
    opened = open_store(src)  # a committed birdzarr store of a supported version, or a clear error
    # DEST: not inside SRC (or holding it), not a file, nothing there but a store of ours
    check_destination(dst, overwrite=True, source=src)
    lock = StoreLock(dst, f"birdzarr copy {src.display}")
    lock.acquire()  # one writer at a time at DEST: no convert, append or other copy meanwhile
    try:
        return _copy_locked(src, dst, _committed_chunks(opened), overwrite=overwrite, requests=requests,
                            progress=progress, started=started)
    finally:
        release_and_tidy(lock, remove_root=True)


def _copy_locked(
    src: Location, dst: Location, committed: dict[str, bool], *, overwrite: bool, requests: int,
    progress: bool, started: float,
) -> CopyResult:
    root = with_retries(lambda: bytes(src.fs.cat_file(src.join(ROOT))), src.retry)
    wanted = {o.key: o for o in _listing(src) if o.key != ROOT and _basename(o.key) not in _NOT_COPIED}
    missing = {key for key in committed if key not in wanted}
    failing: set[str] = set()  # committed chunks read from the source that fail their CRC-32C
    present = {o.key: o for o in _listing(dst)}
    for leftover in [key for key in present if key.endswith(_PARTIAL_SUFFIX)]:
        dst.fs.rm_file(dst.join(leftover))  # written aside by a copy that was killed
        del present[leftover]
    result = CopyResult(objects=len(wanted) + 1, bytes_total=sum(o.size for o in wanted.values()) + len(root))

    if ROOT in present:
        current = with_retries(lambda: bytes(dst.fs.cat_file(dst.join(ROOT))), dst.retry)
        if current != root:
            if not overwrite:
                raise StoreExistsError(
                    f"{dst.display} already holds a different store. Pass --overwrite (Python: "
                    "overwrite=True) to replace it; identical objects are kept."
                )
            dst.fs.rm_file(dst.join(ROOT))  # un-commit first: readers now see no store there
        del present[ROOT]

    md5s: dict[str, str] = {}
    tally = threading.Lock()
    with progress_bar(progress, desc="copy", total=result.bytes_total, unit="B", unit_divisor=1024) as bar:

        def one(obj: _Object) -> None:
            have = present.get(obj.key)
            if have is not None and have.size == obj.size:
                theirs, ours = _cheap_md5(src, obj), _cheap_md5(dst, have)
                if theirs is not None and theirs == ours:
                    with tally:
                        md5s[obj.key] = theirs
                        result.skipped += 1
                        bar.update(obj.size)
                    return
            md5 = _transfer(src, dst, obj.key, obj.size, check_crc=committed.get(obj.key, False))
            with tally:
                bar.update(obj.size)
                if md5 is None:  # not written: a re-run reads it from the source again
                    failing.add(obj.key)
                    return
                md5s[obj.key] = md5
                result.copied += 1
                result.bytes_copied += obj.size

        _run_all(one, list(wanted.values()), requests)
        if missing or failing:
            _refuse_damaged(src, dst, missing, failing)
        stale = [key for key in present if key not in wanted and _basename(key) not in _NOT_COPIED]
        if overwrite and stale:
            dst.fs.rm([dst.join(key) for key in stale])
            result.deleted = len(stale)
        _verify(src, dst, wanted, md5s, requests)
        with_retries(lambda: dst.fs.pipe_file(dst.join(ROOT), root), dst.retry)
        if with_retries(lambda: bytes(dst.fs.cat_file(dst.join(ROOT))), dst.retry) != root:
            raise ChecksumMismatchError(f"{dst.display}/{ROOT} does not read back as written")
        bar.update(len(root))
    result.copied += 1
    result.bytes_copied += len(root)
    result.seconds = time.perf_counter() - started
    return result


def _listing(location: Location) -> list[_Object]:
    """Every object under the location with its size (and MD5, where the listing holds one)."""
    location.fs.invalidate_cache()
    try:
        found = location.fs.find(location.path, detail=True)
    except FileNotFoundError:
        return []
    prefix = location.path.rstrip("/") + "/"
    objects = []
    for path, info in found.items():
        if info.get("type") == "directory" or not path.startswith(prefix):
            continue
        etag = _MD5_ETAG.match(str(info.get("ETag", info.get("etag", ""))))
        objects.append(_Object(path[len(prefix):], int(info["size"]), etag.group(1) if etag else None))
    return objects


def _basename(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _hashable_locally(location: Location) -> bool:
    return location.is_local or location.protocol == "memory"


def _cheap_md5(location: Location, obj: _Object) -> str | None:
    """The object's MD5 if the listing gave it or reading it costs no network."""
    if obj.etag_md5 is not None:
        return obj.etag_md5
    if _hashable_locally(location):
        return _md5_of(location, obj.key)
    return None


def _md5_of(location: Location, key: str) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with location.fs.open(location.join(key), "rb", block_size=_STREAM_BLOCK) as f:
        while block := f.read(_STREAM_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _committed_chunks(store: Store) -> dict[str, bool]:
    """The key of every object the source's committed windows are stored in, each with whether
    it ends with a CRC-32C that copy can check (birdzarr's own chains with the crc32c codec).

    Keys are zarr's for each array's zarr.json, as parsed when the store was opened (the chunk
    grid, which is the shard grid when sharded, and the key encoding), so a missing object is found
    whatever the chain; along the window axis only the chunks below the committed count, the ones
    readers need.
    """
    from zarr.core.metadata.v3 import ArrayV3Metadata

    from birdzarr.maintenance._verify import dictionary_lengths, window_arrays

    per_window = window_arrays(store.format_version)
    # a version-2 store's dictionary arrays: their committed lengths, not the window count
    lengths: dict[str, int] = {}
    if store.format_version >= 2:
        n_values, n_rows = dictionary_lengths(store)
        lengths = {_v2.VALUES: n_values, _v2.START: n_rows, _v2.DEVICE: n_rows}
    found: dict[str, bool] = {}
    for name, layout in store.reader.layouts.items():  # every array of the store's version
        meta = ArrayV3Metadata.from_dict(layout.meta)
        grid = meta.shards or meta.chunks  # the objects' grid, as ChunkReader._read_with_zarr
        length = store.n_windows if name in per_window else lengths.get(name, meta.shape[0])
        shape = [length, *meta.shape[1:]]
        counts = [-(-size // step) for size, step in zip(shape, grid, strict=True)]
        # an object whose chain ends with crc32c ends with the CRC-32C of the bytes before it
        codecs = layout.meta.get("codecs") or [{}]
        checkable = codecs[-1].get("name") == "crc32c" or (layout.codec is not None and layout.codec.crc32c)
        for coords in itertools.product(*(range(n) for n in counts)):
            found[f"{name}/{meta.encode_chunk_key(coords)}"] = checkable
    found.update(_device_table_objects(store))
    return found


def _device_table_objects(store: Store) -> dict[str, bool]:
    """A format-2 store's committed device table group (``device_table/<generation>``): its
    zarr.json and every chunk of its index arrays (each ends with a CRC-32C), as for the arrays."""
    from zarr.core.metadata.v3 import ArrayV3Metadata

    from birdzarr.format import _device_table
    from birdzarr.store._chunks import read_array_meta
    from birdzarr.store._device_table import details_in_array, table_path

    where = table_path(store.root)
    if where is None:
        return {}
    found = {f"{where}/zarr.json": False}
    names = [*_device_table.COLUMNS, *(() if store.shuffled else _device_table.RANGES)]
    if details_in_array(store.location, where):  # else (an older store) in the group's attributes
        names.append(_device_table.DETAILS)
    # the check columns where the table has them (a table written before them has none)
    names += [name for name in _device_table.CHECKS
              if store.location.fs.exists(store.location.join(f"{where}/{name}/zarr.json"))]
    for name in names:
        document = read_array_meta(store.location, f"{where}/{name}")
        meta = ArrayV3Metadata.from_dict(document)
        checkable = (document.get("codecs") or [{}])[-1].get("name") == "crc32c"
        found[f"{where}/{name}/zarr.json"] = False
        counts = [-(-size // step) for size, step in zip(meta.shape, meta.chunks, strict=True)]
        for coords in itertools.product(*(range(n) for n in counts)):
            found[f"{where}/{name}/{meta.encode_chunk_key(coords)}"] = checkable
    return found


def _refuse_damaged(src: Location, dst: Location, missing: set[str], failing: set[str]) -> None:
    """Stop before the commit, naming the first damaged chunk and counting them all."""
    damaged = missing | failing
    first = min(damaged, key=lambda key: [int(p) if p.isdigit() else p for p in re.split(r"[/.]", key)])
    counts = f"{len(missing)} missing, {len(failing)} failing their CRC-32C"
    error, why = (MissingChunkError, "is missing") if first in missing else (CorruptChunkError, _FAILS_CRC)
    raise error(
        f"{redact(src.display)}: committed chunk '{first}' {why}; {len(damaged)} damaged chunk(s) "
        f"in all ({counts}), so the copy to {redact(dst.display)} was not committed. Run `birdzarr "
        f"verify {redact(src.display)}` to list the damage, restore those chunks from another copy or "
        "convert the store again, then run this copy again to finish it."
    )


def _transfer(src: Location, dst: Location, key: str, size: int, *, check_crc: bool = False) -> str | None:
    """Copy one object (with retries); returns the MD5 of the bytes written, or None when
    ``check_crc`` and the source's bytes fail their CRC-32C (then nothing is left at DEST)."""

    def attempt() -> str | None:
        if size > _IN_MEMORY_LIMIT:
            return _stream(src, dst, key, check_crc=check_crc)
        data = bytes(src.fs.cat_file(src.join(key)))
        if check_crc and not crc32c_intact(data):
            return None
        _write(dst, key, data)
        return hashlib.md5(data, usedforsecurity=False).hexdigest()

    try:
        return with_retries(attempt, dst.retry)
    except Exception as exc:
        if not is_transient(exc):
            raise
        raise TransferError(
            f"copying '{key}' from {src.display} to {dst.display} failed after {dst.retry.attempts} "
            f"attempts ({type(exc).__name__}: {redact(str(exc))[:300]}). What was copied is kept: run "
            "the same command again to resume."
        ) from None


def _write(dst: Location, key: str, data: bytes) -> None:
    path = dst.join(key)
    if not dst.is_local:
        dst.fs.pipe_file(path, data)  # one PUT: an object store never shows half an object
        return
    # On disk, write aside and rename, so a killed copy leaves no file that looks complete.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{uuid.uuid4().hex[:8]}{_PARTIAL_SUFFIX}"
    try:
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)


def _stream(src: Location, dst: Location, key: str, *, check_crc: bool = False) -> str | None:
    digest = hashlib.md5(usedforsecurity=False)
    crc = google_crc32c.Checksum()
    target = dst.join(key)
    partial = f"{target}.{uuid.uuid4().hex[:8]}{_PARTIAL_SUFFIX}" if dst.is_local else target
    if dst.is_local:
        os.makedirs(os.path.dirname(target), exist_ok=True)
    size = 0
    with (
        src.fs.open(src.join(key), "rb", block_size=_STREAM_BLOCK) as fin,
        dst.fs.open(partial, "wb") as fout,
    ):
        while block := fin.read(_STREAM_BLOCK):
            digest.update(block)
            if check_crc:
                crc.update(block)
            size += len(block)
            fout.write(block)
    if check_crc and (size < 4 or int.from_bytes(crc.digest(), "big") != CRC32C_RESIDUE):
        # written already (an object store takes a stream as it comes): remove it, so that a
        # re-run finds no "identical" object at DEST and reads the source again
        dst.fs.rm_file(partial)
        return None
    if dst.is_local:
        os.replace(partial, target)
    return digest.hexdigest()


def _run_all(work: Callable[[_Object], None], objects: list[_Object], requests: int) -> None:
    """``work(obj)`` for every object on a thread pool; the first error stops the rest."""
    if not objects:
        return
    pool = ThreadPoolExecutor(max_workers=max(1, requests), thread_name_prefix="birdzarr-copy")
    try:
        futures: list[Future[None]] = [pool.submit(work, obj) for obj in objects]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()
    finally:
        # On an error or Ctrl-C, queued objects are dropped; what was written stays for a resume.
        pool.shutdown(wait=True, cancel_futures=True)


def _verify(
    src: Location, dst: Location, wanted: dict[str, _Object], md5s: dict[str, str], requests: int
) -> None:
    """Every destination object has the source's size and MD5, or ChecksumMismatchError."""
    present = {o.key: o for o in _listing(dst)}
    bad: list[str] = []

    def check(obj: _Object) -> None:
        have = present.get(obj.key)
        if have is None or have.size != obj.size:
            bad.append(obj.key)
            return
        expected = obj.etag_md5 or md5s[obj.key]
        actual = _cheap_md5(dst, have)
        if actual is None:  # no MD5 in the listing (multipart, KMS): read it back
            actual = with_retries(lambda: _md5_of(dst, obj.key), dst.retry)
        if actual != expected:
            bad.append(obj.key)

    _run_all(check, list(wanted.values()), requests)
    if bad:
        shown = ", ".join(sorted(bad)[:5])
        raise ChecksumMismatchError(
            f"copy to {dst.display}: {len(bad)} objects differ from {redact(src.display)} "
            f"({shown}{', ...' if len(bad) > 5 else ''}). The copy is not committed; run the same "
            "command again to re-copy them."
        )

