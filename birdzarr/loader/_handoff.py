"""Handing finished batches from a DataLoader worker to the training process through reused
shared memory.

torch sends every tensor a worker yields through a fresh shared-memory segment. Allocating and
first touching 2.6 MB of fresh shared pages costs ~5 ms per 8192-window batch on the development
machine, more than fetching and decoding the batch's chunk (docs/benchmarks.md). A worker instead
keeps a few segments ("slots") and reuses one once the receiving process has dropped every tensor
made from it.

The protocol, per slot (an anonymous ``memfd``: a header of a lease flag and a retired flag,
then the data):

1. The worker takes a slot whose lease flag is clear, fills it, sets the flag and yields a handle
   to it. The first handle of a slot carries its file descriptor; later ones only its key.
2. The receiving process maps a slot once (kept in ``_RECEIVED`` by key), builds each batch's
   tensors on a fresh memoryview of the mapping and registers a finalizer on that memoryview.
   The tensors (and every view of them) keep it alive.
3. When the last of them is freed, the finalizer clears the lease flag.
4. A slot the worker no longer keeps is retired (the retired flag set, the worker's side
   unmapped); the receiver drops a retired mapping once it is not leased (a leased one may still
   have a batch on its way), checked whenever it receives or releases a batch.
5. At the end of an iteration the worker keeps its slots for its next one (``end_iteration``):
   a persistent DataLoader worker starts each later epoch on slots the receiver has already
   mapped, so its first batches fault in no new shared memory and hand over no file descriptor
   (retiring them every epoch made each epoch's first batches wait for both: 0.05-0.25 s each
   on the 2-core development machine at a load of 9).
6. The receiver also drops every mapping of a worker that has exited (its pid is in the key):
   a worker that is not persistent exits after its epoch, and a loop that stops mid-epoch
   (``break``) shuts the workers down with batches still queued, which are never received.

The worker reuses only slots whose flag is clear and creates a new slot otherwise, so a training
loop that keeps batches (``list(loader)``) is safe: it costs memory, as with torch's own
transport, never correctness. Free slots beyond ``keep`` are retired, so a worker holds at most
``keep`` idle slots, within an iteration and between iterations, and the receiver maps at most
those and the ones in use, per living worker. Linux only (``os.memfd_create``); elsewhere batches go through
torch's path.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import weakref

import numpy as np

HEADER = 64  # lease flag (uint32), retired flag (uint32), padding; keeps the data 64-byte aligned
AVAILABLE = hasattr(os, "memfd_create")
SlotKey = tuple[int, str, int]  # (the worker's pid, its ring's random token, the slot's serial number)


class Slot:
    """One reusable shared-memory segment of a worker."""

    def __init__(self, key: SlotKey, data_bytes: int) -> None:
        self.key = key
        self.size = HEADER + data_bytes
        fd = os.memfd_create("birdzarr-batch", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size)
        except OSError:
            os.close(fd)
            raise
        self.fd: int | None = fd  # until the first handle hands it over
        self._flags = np.frombuffer(self._map, dtype=np.uint32, count=2)
        self.data = np.frombuffer(self._map, dtype=np.uint8, offset=HEADER)

    @property
    def leased(self) -> bool:
        return bool(self._flags[0])

    def lease(self) -> None:
        self._flags[0] = 1

    def hand_over_fd(self) -> int | None:
        """The fd for the first handle of this slot (the caller duplicates it), else None."""
        fd, self.fd = self.fd, None
        return fd

    def retire(self) -> None:
        """Tell the receiver to drop its mapping once unused, and unmap this side."""
        self._flags[1] = 1
        if self.fd is not None and not self.leased:  # a leased slot's pending handle still needs it
            os.close(self.fd)
            self.fd = None
        del self._flags, self.data  # the arrays export the mapping; drop them before closing it
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
            self._map.close()


class SlotRing:
    """The slots of one worker: reuse a free one, else create one; keep at most ``keep`` free."""

    def __init__(self, data_bytes: int, *, keep: int) -> None:
        self.data_bytes = data_bytes
        self.keep = keep
        self._token = os.urandom(8).hex()
        self._serial = itertools.count()
        self._slots: list[Slot] = []

    def acquire(self) -> Slot:
        """A slot not leased to anyone (its contents are garbage until filled)."""
        free = [slot for slot in self._slots if not slot.leased]
        for extra in free[self.keep :]:
            self._slots.remove(extra)
            extra.retire()
        if free:
            return free[0]
        slot = Slot((os.getpid(), self._token, next(self._serial)), self.data_bytes)
        self._slots.append(slot)
        return slot

    def __len__(self) -> int:
        return len(self._slots)

    def end_iteration(self) -> None:
        """An iteration is over: keep the slots for the next iteration of this worker (already
        mapped by the receiver), retiring free slots beyond ``keep``. Slots still leased come
        back when the receiver frees their batches."""
        free = [slot for slot in self._slots if not slot.leased]
        for extra in free[self.keep :]:
            self._slots.remove(extra)
            extra.retire()

    def retire(self) -> None:
        for slot in self._slots:
            slot.retire()
        self._slots = []


# -- the receiving process -----------------------------------------------------------------------
_RECEIVED: dict[SlotKey, mmap.mmap] = {}
# the pin-memory thread may receive while the main thread frees; reentrant because a finalizer
# (which takes it) may run during a garbage collection triggered while it is held
_RECEIVED_LOCK = threading.RLock()


def _is_done(mapping: mmap.mmap) -> bool:
    """Retired by its worker and not leased: no batch of it is in use or still on its way."""
    return mapping[4:8] != b"\0\0\0\0" and mapping[:4] == b"\0\0\0\0"


def _has_exited(pid: int) -> bool:
    """Whether the process ``pid`` is gone (a zombie not yet reaped by DataLoader still counts
    as running; the next check after the reaping drops its slots)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # the pid now belongs to another user's process: the worker is gone
        return True
    return False


def _drop_finished() -> None:
    """Forget the mappings no batch can still need: retired and not leased, or of a worker
    that has exited (leases still in use keep their own reference to the mapping)."""
    with _RECEIVED_LOCK:
        exited = {pid for pid in {key[0] for key in _RECEIVED} if _has_exited(pid)}
        for key in [key for key, mapping in _RECEIVED.items() if key[0] in exited or _is_done(mapping)]:
            del _RECEIVED[key]


def _end_lease(mapping: mmap.mmap) -> None:
    mapping[:4] = b"\0\0\0\0"
    _drop_finished()


def receive(key: SlotKey, fd: int | None, size: int) -> memoryview:
    """In the receiving process: a memoryview of slot ``key``'s data whose death clears the
    slot's lease. ``fd`` (closed here) comes with the first handle of each slot."""
    with _RECEIVED_LOCK:
        if fd is not None:
            try:
                _RECEIVED[key] = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        mapping = _RECEIVED.get(key)
    if mapping is None:  # an invariant of the protocol: the first handle of a slot carries its fd
        raise RuntimeError(
            f"birdzarr: batch slot {key} is not mapped in this process: its first batch (which "
            f"carries the file descriptor) never arrived, or its DataLoader worker (pid {key[0]}) "
            "exited before its batches were received"
        )
    lease = memoryview(mapping)[HEADER:]
    weakref.finalize(lease, _end_lease, mapping)
    _drop_finished()
    return lease
