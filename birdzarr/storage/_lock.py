"""One writer per store: the lock file ``.birdzarr.lock`` at the store's root.

On local disk the lock is created with ``O_CREAT | O_EXCL``, which the kernel makes atomic: of two
writers exactly one succeeds. The file holds who took it (host, pid, command, time, a random
token) so a refusal can name the holder. A lock whose holder ran on this host and whose process
no longer exists is *stale* (the writer was killed): the next writer takes it over, and
``birdzarr repair`` removes it.

On object stores the lock is created with an exclusive write (``fs.open(path, "xb")``: S3's
``If-None-Match: *`` conditional PUT with s3fs). Where the filesystem cannot do an exclusive
create, birdzarr falls back to check-then-write plus a read-back of its token, which narrows but
does not close the race, and says so with a ``birdzarr._errors.FallbackWarning``;
docs/reliability.md says what is guaranteed where. A lock on another host
is never judged stale automatically: only its own host can tell whether the process is alive.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
import sys
import time
import uuid
import warnings
from dataclasses import asdict, dataclass

from birdzarr._errors import FallbackWarning, StoreExistsError, StoreLockedError
from birdzarr.storage._location import Location, bucket_of, forget_listings, no_bucket_error, redact

LOCK_NAME = ".birdzarr.lock"


@dataclass(frozen=True)
class LockHolder:
    """What the lock file says about the writer that holds it."""

    host: str
    pid: int
    command: str
    started_at: str
    token: str

    def describe(self) -> str:
        return f"{self.command!r} (pid {self.pid} on {self.host}, since {self.started_at})"

    def is_stale(self) -> bool:
        """True if the holder ran on this host and its process is gone (it was killed)."""
        return self.host == socket.gethostname() and not _pid_alive(self.pid)

    @classmethod
    def parse(cls, raw: bytes) -> LockHolder | None:
        try:
            data = json.loads(raw)
            return cls(str(data["host"]), int(data["pid"]), str(data["command"]),
                       str(data["started_at"]), str(data["token"]))
        except (ValueError, KeyError, TypeError):
            return None  # an empty or torn lock file: its writer died while creating it


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False  # os.kill(0 or -1) would address process groups, not one process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _command_line() -> str:
    # argv may hold URLs with credentials; the lock file is readable by everyone who can list.
    return redact(" ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]]))[:500]


def lock_path(location: Location) -> str:
    return location.join(LOCK_NAME)


def read_holder(location: Location) -> LockHolder | None:
    """The current holder, or None if the store is not locked (a torn lock reads as a dead holder)."""
    try:
        raw = location.fs.cat_file(lock_path(location))
    except FileNotFoundError:
        return None
    holder = LockHolder.parse(raw)
    if holder is None:
        return LockHolder(host=socket.gethostname(), pid=-1, command="unknown (torn lock file)",
                          started_at="?", token="")
    return holder


class StoreLock:
    """The store's writer lock; use as a context manager or ``acquire()`` / ``release()``."""

    def __init__(self, location: Location, command: str | None = None) -> None:
        self.location = location
        self.holder = LockHolder(
            host=socket.gethostname(), pid=os.getpid(), command=command or _command_line(),
            started_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            token=uuid.uuid4().hex,
        )
        self.held = False
        self.took_over: LockHolder | None = None  # the stale holder replaced, if any

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def path(self) -> str:
        return lock_path(self.location)

    def acquire(self) -> StoreLock:
        """Take the lock or raise ``StoreLockedError`` naming the live holder."""
        self._make_root()
        for attempt in range(10):  # a stale lock is taken over, then creation is retried
            if self._create():
                self.held = True
                return self
            current = read_holder(self.location)
            if current is None:
                continue  # released between our attempt and the read: try again
            if not current.token and attempt < 5:
                time.sleep(0.1)  # torn: its writer may be between creating and filling it
                continue
            if not current.is_stale():
                raise StoreLockedError(
                    f"{self.location.display} is locked by {current.describe()}. Wait for it to "
                    "finish. If that process is gone (for instance it ran on another machine that "
                    f"was shut down), run `birdzarr repair {self.location.display} --break-lock`."
                )
            if break_lock(self.location, expected=current):
                self.took_over = current
        raise StoreLockedError(
            f"{self.location.display}: could not take the lock {LOCK_NAME} (another writer keeps "
            "taking it). Try again."
        )

    def release(self) -> None:
        """Remove the lock file if it is still ours (never someone else's)."""
        if not self.held:
            return
        self.held = False
        current = read_holder(self.location)
        if current is not None and current.token == self.holder.token:
            with contextlib.suppress(FileNotFoundError):
                self.location.fs.rm_file(self.path)

    def _make_root(self) -> None:
        fs, path = self.location.fs, self.location.path
        if fs.isfile(path):
            raise StoreExistsError(f"{self.location.display} is a file; choose another destination.")
        if self.location.is_local:
            os.makedirs(path, exist_ok=True)
        # object stores have no directories: the lock object's key is all there is

    def _payload(self) -> bytes:
        return json.dumps(asdict(self.holder)).encode()

    def _create(self) -> bool:
        """Create the lock file only if absent; True on success."""
        if self.location.is_local:
            # Written aside, then hard-linked into place: link() fails if the lock exists and
            # never exposes a half-written lock file (an O_EXCL create followed by a write did,
            # and a slow write then looked like a writer that died while creating it).
            aside = f"{self.path}.{self.holder.token}.tmp"
            with open(aside, "wb") as handle:
                handle.write(self._payload())
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(aside, self.path)
            except FileExistsError:
                return False
            finally:
                os.unlink(aside)
            return True
        fs = self.location.fs
        try:
            with fs.open(self.path, "xb") as handle:
                handle.write(self._payload())
        except FileExistsError:
            return False
        except FileNotFoundError:
            # an object store answers a write into a bucket that does not exist with 404
            bucket = bucket_of(self.location)
            if bucket is None:
                raise
            raise no_bucket_error(self.location, bucket) from None
        except (ValueError, NotImplementedError) as exc:
            # No exclusive create on this filesystem (fsspec rejects the mode): check, then
            # write. A race remains, so say so; any other error (TypeError included) is a real
            # failure and propagates.
            warnings.warn(
                f"{self.location.display}: this filesystem ({type(fs).__name__}) cannot create a "
                f"file exclusively ({type(exc).__name__}: {redact(str(exc))[:120]}), so the writer "
                "lock is best effort: two writers starting at the same moment may both proceed. "
                "Run one writer at a time there (docs/reliability.md#one-writer-the-lock).",
                FallbackWarning, stacklevel=3,
            )
            if fs.exists(self.path):
                return False
            fs.pipe_file(self.path, self._payload())
        # Read back: a server that ignores If-None-Match lets the last writer win; only the
        # writer whose token is there goes on.
        current = read_holder(self.location)
        return current is not None and current.token == self.holder.token


def break_lock(location: Location, *, expected: LockHolder | None = None) -> bool:
    """Remove the lock file; with ``expected``, only if it still names that holder.

    Locally the file is first renamed aside, so that of two writers breaking the same stale lock
    only one removes it, and a fresh lock taken meanwhile by a third is put back, not deleted.
    """
    path = lock_path(location)
    if not location.is_local:
        current = read_holder(location)
        if current is None or (expected is not None and current.token != expected.token):
            return False
        with contextlib.suppress(FileNotFoundError):
            location.fs.rm_file(path)
        return True
    # One breaker at a time (a mutex file created with link(), like the lock itself). Inside it
    # the lock file can only be removed by us: its writer is dead (stale) and other breakers
    # wait, so re-reading and removing it is safe. Moving a possibly live lock aside (the old
    # way) briefly freed the lock path and let two writers win a race.
    mutex = f"{path}.breaking"
    aside = f"{mutex}.{uuid.uuid4().hex}.tmp"
    with open(aside, "wb") as handle:
        handle.write(str(os.getpid()).encode())
    try:
        for _ in range(50):
            try:
                os.link(aside, mutex)
                break
            except FileExistsError:
                if _mutex_is_stale(mutex):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(mutex)
                else:
                    time.sleep(0.02)
        else:
            return False
    finally:
        os.unlink(aside)
    try:
        current = read_holder(location)
        if current is None or (expected is not None and expected.token and current.token != expected.token):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mutex)


def _mutex_is_stale(mutex: str) -> bool:
    """A breaker's mutex whose process is gone (killed while breaking a lock)."""
    try:
        with open(mutex, "rb") as handle:
            pid = int(handle.read() or b"-1")
    except (FileNotFoundError, ValueError):
        return False
    return pid != os.getpid() and not _pid_alive(pid)


def clear_except_lock(location: Location) -> None:
    """Delete everything in the store except the lock file (the writer holding it keeps it)."""
    fs = location.fs
    forget_listings(location)  # objects written through other instances (zarr's, workers')
    if not fs.exists(location.path):
        return
    for entry in fs.ls(location.path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name != LOCK_NAME:
            fs.rm(entry, recursive=True)


def release_and_tidy(lock: StoreLock, *, remove_root: bool) -> None:
    """Release the lock; with ``remove_root``, also remove the store's directory if now empty."""
    lock.release()
    if not remove_root:
        return
    fs, path = lock.location.fs, lock.location.path
    forget_listings(lock.location)
    with contextlib.suppress(FileNotFoundError, OSError):
        if fs.exists(path) and not fs.ls(path, detail=False):
            fs.rmdir(path)
