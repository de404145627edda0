"""What may be written where, and replacing an existing store without a moment where it is lost.

**Destinations** (``check_destination``, for ``convert`` and ``copy``): birdzarr writes only
to a new or empty location, over an unfinished store of its own, or, with ``overwrite``, over a
committed birdzarr store. Anything else (a directory of notes, a source tree, someone else's
Zarr group, a store with other files beside its arrays) is refused with a message naming what
is there, overwrite or not. The destination may never be, contain, or sit inside the source.

**Replacing** (``overwrite=True`` over a committed store): the new store is converted into a
sibling ``DEST.birdzarr-new-TOKEN`` while DEST's writer lock is held, and put in place only
after it has committed, so bad input or a kill during the conversion leaves DEST as it was.

- Local disk: one ``renameat2(RENAME_EXCHANGE)`` swaps the two directories atomically (Linux,
  on ext4, XFS, Btrfs, tmpfs and most local file systems): at every instant DEST is the old or
  the new committed store, and DEST's lock lives in the old store's directory until the swap,
  so no other writer can slip in. Where the file system has no exchange (NFS, Lustre, macOS),
  DEST's directory stays in place, keeping its lock, and its entries are moved: the old root
  ``zarr.json`` first (un-committing it), then the old arrays out, the new arrays in, the new
  root last. Readers then see the old store, "not a store", or the new store; a kill in between
  leaves DEST un-committed and both stores' parts beside it (``birdzarr repair DEST`` says
  where).
- Object stores (no rename): after the new store has committed under the sibling prefix, DEST's
  root is deleted (un-committed), its objects deleted, the new objects copied in server-side,
  and the new root copied last. Bad input never touches DEST; a kill during that copy leaves
  DEST un-committed and the complete new store under ``DEST.birdzarr-new-TOKEN``.

It needs room for both stores until the swap.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Literal

from birdzarr._errors import DestinationError, StoreExistsError
from birdzarr.format import _device_table as device_table
from birdzarr.format import _v2
from birdzarr.format._spec import ATTRS_KEY, DEVICE, GIMU, LABEL, TIMESTAMP
from birdzarr.storage._location import Location, resolve
from birdzarr.storage._lock import LOCK_NAME, StoreLock

NEW_INFIX = ".birdzarr-new-"
OLD_INFIX = ".birdzarr-old-"
ROOT = "zarr.json"
_ARRAYS = (GIMU, *_v2.ARRAYS, DEVICE, TIMESTAMP, LABEL)  # format 1's and format 2's
# stats: the exploration cache (explore/_stats.py); device_table: format 2's per-commit groups
_NODES = frozenset({*_ARRAYS, device_table.GROUP, "stats"})
_LISTED = 8

State = Literal["absent", "empty", "unfinished", "store"]


# -- what is at DEST ---------------------------------------------------------------------------


def _name(entry: str) -> str:
    return entry.rstrip("/").rsplit("/", 1)[-1]


def _is_lock_file(name: str) -> bool:
    return name == LOCK_NAME or name.startswith(LOCK_NAME + ".")  # the lock and its temp files


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in sorted(names)[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _overlap(src: Location, dst: Location) -> str | None:
    """How DEST and SRC overlap ("is", "contains", "sits inside"), or None."""
    if src.is_local != dst.is_local or (not dst.is_local and src.protocol != dst.protocol):
        return None
    if dst.is_local:
        a, b = os.path.realpath(src.path), os.path.realpath(dst.path)
        sep = os.sep
    else:
        a, b = src.path.rstrip("/"), dst.path.rstrip("/")
        sep = "/"
    if a == b:
        return "is"
    if a.startswith(b.rstrip(sep) + sep):
        return "contains"
    if b.startswith(a.rstrip(sep) + sep):
        return "sits inside"
    return None


def check_not_overlapping(src: Location, dst: Location) -> None:
    """DEST may never be, contain, or sit inside SRC (it would be deleted or read while written)."""
    how = _overlap(src, dst)
    if how is not None:
        raise DestinationError(
            f"{dst.display} {how} the source {src.display}; writing there could destroy or "
            "re-read the input. "
            "Choose a destination outside the source."
        )


def _file_above(dst: Location) -> str | None:
    """The nearest existing ancestor of a local DEST, if it is a file (DEST cannot be created)."""
    path = os.path.abspath(dst.path)
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return None
        if os.path.lexists(parent):
            return parent if not os.path.isdir(parent) else None
        path = parent


def inspect_destination(dst: Location) -> tuple[State, list[str]]:
    """What DEST holds: ``(state, foreign entries)``. ``foreign`` lists what is not a birdzarr
    store's (non-empty only when the state cannot be replaced)."""
    fs = dst.fs
    if dst.is_local:
        above = _file_above(dst)
        if above is not None:
            raise DestinationError(
                f"{dst.display}: cannot create it, {above} is a file. Choose a destination "
                "under a directory."
            )
        if os.path.lexists(dst.path) and not os.path.isdir(dst.path):
            raise StoreExistsError(
                f"{dst.display} is a file ({os.path.getsize(dst.path):,} bytes), not a store; a "
                "store is a directory. Choose another destination (birdzarr never replaces a file)."
            )
    elif fs.isfile(dst.path):
        raise StoreExistsError(
            f"{dst.display} is an object (a file), not a store prefix; choose another destination."
        )
    with contextlib.suppress(Exception):
        fs.invalidate_cache(dst.path)  # a listing cached before another writer changed DEST
    try:
        entries = fs.ls(dst.path, detail=True)
    except FileNotFoundError:
        return "absent", []
    names = {_name(str(e["name"])): e.get("type") for e in entries}
    names = {n: t for n, t in names.items() if n and not _is_lock_file(n)}
    if not names:
        return ("unfinished" if _has_lock(dst) else "empty"), []
    foreign = [n + ("/" if t == "directory" else "") for n, t in names.items()
               if n != ROOT and n not in _NODES and not n.endswith(".partial")]
    if ROOT in names and not fs.exists(dst.join(ROOT)):
        del names[ROOT]  # listed, but gone since (eventual listings)
    if ROOT in names:
        meta = _birdzarr_attrs(dst)
        if meta is None:
            return "unfinished", [ROOT + " (a Zarr group or array that is not a birdzarr store)", *foreign]
        return ("store" if meta.get("committed") else "unfinished"), foreign
    if foreign or not any(fs.exists(dst.join(n, ROOT)) for n in names if n in _ARRAYS):
        return "unfinished", foreign or sorted(names)
    return "unfinished", []  # arrays without the root: an interrupted `birdzarr copy` (resumable)


def _has_lock(dst: Location) -> bool:
    return bool(dst.fs.exists(dst.join(LOCK_NAME)))


def _birdzarr_attrs(dst: Location) -> dict[str, Any] | None:
    try:
        raw = json.loads(dst.fs.cat_file(dst.join(ROOT)))
    except (FileNotFoundError, ValueError):
        return None
    meta = raw.get("attributes", {}).get(ATTRS_KEY) if isinstance(raw, dict) else None
    return meta if isinstance(meta, dict) else None


def check_destination(dst: Location, *, overwrite: bool, source: Location | None = None) -> State:
    """Refuse a destination birdzarr may not write (see module doc); returns what is there."""
    if source is not None:
        check_not_overlapping(source, dst)
    state, foreign = inspect_destination(dst)
    if foreign:
        raise StoreExistsError(
            f"{dst.display} already holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} "
            f"that {'is' if len(foreign) == 1 else 'are'} not part of a birdzarr store: "
            f"{_listed(foreign)}. birdzarr writes only to a new or empty location or over a store "
            "of its own, and never deletes anything else: choose another destination, or move "
            "those away first."
        )
    if state == "store" and not overwrite:
        raise StoreExistsError(
            f"{dst.display} already holds a birdzarr store. Pass --overwrite (Python: "
            "overwrite=True) to replace it (the old one stays readable until the new one has "
            "committed), or choose another destination."
        )
    return state


# -- replacing a committed store ---------------------------------------------------------------


def staged_location(dest: Location, *, overwrite: bool, state: State | None = None) -> Location | None:
    """Where to convert instead of ``dest``: a sibling when overwriting a committed store; None
    when writing to ``dest`` directly loses nothing (absent, empty or unfinished)."""
    if not overwrite:
        return None
    if state is None:
        state = inspect_destination(dest)[0]
    if state != "store":
        return None
    token = NEW_INFIX + uuid.uuid4().hex[:12]
    if dest.is_local:
        return resolve(_real(dest) + token)
    return Location(url=dest.url.rstrip("/") + token, fs=dest.fs, path=dest.path.rstrip("/") + token,
                    storage_options=dest.storage_options, retry=dest.retry)


def _real(dest: Location) -> str:
    """DEST's real directory: behind a symlink, the swap happens where the data is."""
    return os.path.realpath(dest.path).rstrip(os.sep)


def sibling_leftovers(dest: Location) -> list[str]:
    """``DEST.birdzarr-new-*`` and ``DEST.birdzarr-old-*`` beside DEST (paths for dest.fs)."""
    base = _real(dest) if dest.is_local else dest.path.rstrip("/")
    found: list[str] = []
    for infix in (NEW_INFIX, OLD_INFIX):
        with contextlib.suppress(FileNotFoundError):
            found += [str(p).rstrip("/") for p in dest.fs.glob(_glob_escape(base + infix) + "*")]
    return sorted(set(found))


def _glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _remove(fs: Any, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if fs.isdir(path) or not fs.isfile(path):
            fs.rm(path, recursive=True)
        else:
            fs.rm_file(path)


@contextmanager
def replacing(dest: Location, staged: Location) -> Iterator[None]:
    """Hold ``dest``'s lock while the body converts into ``staged``; then swap it in. If the body
    raises, ``staged`` is removed and ``dest`` is untouched."""
    lock = StoreLock(dest, "birdzarr convert --overwrite (writing a replacement aside)")
    lock.acquire()  # no other writer may change DEST while its replacement is written
    try:
        # with the lock held, any other replacement in the making is a killed one's leftover
        for leftover in sibling_leftovers(dest):
            if leftover != staged.path.rstrip("/").rstrip(os.sep) and NEW_INFIX in leftover:
                _remove(dest.fs, leftover)
        try:
            yield
        except BaseException:
            _remove(staged.fs, staged.path)
            raise
        if dest.is_local:
            _swap_local(dest, staged)
        else:
            _swap_remote(dest, staged)
    finally:
        lock.release()  # a no-op once the lock file has moved away with the old store


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # this file system cannot exchange: take the slower path
    raise OSError(code, os.strerror(code), b)


def _swap_local(dest: Location, staged: Location) -> None:
    real, new = _real(dest), staged.path.rstrip(os.sep)
    if _exchange(new, real):
        shutil.rmtree(new, ignore_errors=True)  # the old store (with our lock file in it)
        return
    # No exchange here: keep DEST's directory (and the lock in it) and move its entries.
    old = real + OLD_INFIX + uuid.uuid4().hex[:12]
    os.mkdir(old)
    os.rename(os.path.join(real, ROOT), os.path.join(old, ROOT))  # un-commit first
    for name in os.listdir(real):
        if not _is_lock_file(name):
            os.rename(os.path.join(real, name), os.path.join(old, name))
    for name in os.listdir(new):
        if name != ROOT and not _is_lock_file(name):
            os.rename(os.path.join(new, name), os.path.join(real, name))
    os.rename(os.path.join(new, ROOT), os.path.join(real, ROOT))  # commit last
    shutil.rmtree(new, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def _swap_remote(dest: Location, staged: Location, workers: int = 16) -> None:
    fs = dest.fs
    base, new = dest.path.rstrip("/"), staged.path.rstrip("/")
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(posixpath.join(base, ROOT))  # un-commit: readers now see no store here
    old = [p for p in fs.find(base) if not _is_lock_file(_name(p))]
    if old:
        fs.rm(old)
    fs.invalidate_cache()
    objects = [p for p in fs.find(new) if not _is_lock_file(_name(p)) and p != posixpath.join(new, ROOT)]

    def copy(path: str) -> None:
        fs.copy(path, base + path[len(new):])  # server-side on S3 (CopyObject)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="birdzarr-swap") as pool:
        list(pool.map(copy, objects))
    fs.copy(posixpath.join(new, ROOT), posixpath.join(base, ROOT))  # the commit, last
    fs.rm(new, recursive=True)
    fs.invalidate_cache()
