"""Loading one pool of chunks into a reader's reused buffers, every chunk once, concurrently.

A reader (the main process, or one DataLoader worker) owns one ``PoolBuffers``: a float32
array of ``capacity`` chunks for the windows, plus label, device and timestamp arrays when the
dataset yields ``ldt``. Each chunk of a pool decodes straight into its slot of those arrays (on a
small thread pool: decoding releases the GIL, and remote fetches overlap), so a batch is then one
vectorised gather from memory the reader already owns. Of a version-2 chunk only the pool's
piece of its selected windows is looked up, packed at the start of the slot
(``ChunkReader.read_windows``). Nothing is handed back to a free list and
nothing grows with the store: memory is ``capacity x chunk_windows x (320 B + 16 B with ldt)``.

A DataLoader worker's fetch threads are idle while it serves a pool: ``prefetch`` starts
decoding its next pool (or, while it serves its last pool of an epoch, its first pool of the
next epoch: plans are pure functions of the epoch) into the other of two banks of buffers, and
``load`` takes it if the iteration asks for that pool, else cancels it. The fetch threads are
daemon threads: a DataLoader worker that exits (a non-persistent one, at the end of its epoch)
does not wait for a prefetch nobody will use.

A pool decoded on the spot (an iteration's first pool, which no prefetch holds) would keep the
iteration's first batch waiting for every chunk of the pool: each batch is a sample of all of
them. ``start(pool, key, first)`` therefore decodes the windows of that first batch on their own
first, queued ahead of the pool's own decodes: of a version-2 chunk its blosc frames, then the
lookup of those windows alone (the lookup is about half of a chunk's CPU, docs/benchmarks.md),
so the first batch is served (``Loading.early``) while the pool decodes. The values are the
same (the same function decodes the same chunks); the pool's chunks are read twice, so this is
done only on a store on this machine's file system without a chunk cache (a remote store's first
pool is not fetched twice), and only for a reader with more than one pool that iteration (the
caller decides: its only pool would be all its epoch's chunks).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from birdzarr.format._spec import DEVICE, LABEL, N_CHANNELS, TIMESTAMP, WINDOW_LENGTH
from birdzarr.loader._sampling import Pool
from birdzarr.store._chunks import ChunkReader
from birdzarr.store._selection import Selection

PER_WINDOW = {LABEL: np.int32, DEVICE: np.int32, TIMESTAMP: np.int64}


@dataclass
class LoadedPool:
    """A pool in the buffers: ``rows[i]`` is the buffer row of the pool's window ``i``."""

    rows: np.ndarray
    gimu: np.ndarray
    ldt: dict[str, np.ndarray] | None


class _DaemonThreads:
    """A few daemon threads running submitted calls (a ThreadPoolExecutor's threads are joined
    at exit, so an exiting worker would first finish every queued decode)."""

    def __init__(self, n: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None]
        self._queue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(n)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            call, args, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call(*args))
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)

    def submit(self, call: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((call, args, future))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()


def _results(futures: list[Future[Any]], also: Sequence[Future[Any]] = ()) -> list[Any]:
    """The futures' results in order; on the first failure the rest (and ``also``) are
    cancelled (and the running ones waited for: they write into the buffers) before it is raised."""
    try:
        return [future.result() for future in futures]
    except BaseException:
        every = [*futures, *also]
        for future in every:
            future.cancel()
        wait(every)
        raise


class _Bank:
    """One pool's worth of buffers: float32 windows, and label, device, time with ldt."""

    def __init__(self, with_ldt: bool) -> None:
        self.with_ldt = with_ldt
        self.capacity = 0
        self.gimu = np.empty((0, WINDOW_LENGTH, N_CHANNELS), np.float32)
        self.ldt: dict[str, np.ndarray] = {}

    def reserve(self, chunks: int, chunk_windows: int) -> None:
        if chunks <= self.capacity:
            return
        rows = chunks * chunk_windows
        self.gimu = np.empty((rows, WINDOW_LENGTH, N_CHANNELS), np.float32)
        if self.with_ldt:
            self.ldt = {name: np.empty(rows, dtype) for name, dtype in PER_WINDOW.items()}
        self.capacity = chunks


EarlyBatch = tuple[np.ndarray, "dict[str, np.ndarray] | None"]  # windows (and ldt) of a first batch


class Loading:
    """A pool being loaded into one bank (``PoolBuffers.start``): ``early()`` gives the first
    batch's windows decoded on their own (None when none were), ``wait()`` the whole pool."""

    def __init__(self, buffers: PoolBuffers, pool: Pool, futures: list[Future[np.ndarray]], bank: int,
                 early: list[tuple[np.ndarray, Future[EarlyBatch]]] | None = None, first: int = 0) -> None:
        self._buffers = buffers
        self._pool = pool
        self._futures = futures
        self._bank = bank
        self._early = early  # (the batch's members in a chunk, their windows being decoded)
        self._first = first  # windows of the first batch
        self._loaded: LoadedPool | None = None

    @property
    def futures(self) -> list[Future[Any]]:
        return [*self._futures, *(future for _, future in self._early or [])]

    def early(self) -> EarlyBatch | None:
        """The first batch's windows ``(x, ldt)`` in the batch's order, decoded on their own, or
        None (a prefetched pool, no first batch asked for, a store not on this machine)."""
        if self._early is None:
            return None
        early, self._early = self._early, None
        parts = _results([future for _, future in early], also=self._futures)
        x = np.empty((self._first, WINDOW_LENGTH, N_CHANNELS), np.float32)
        ldt = ({name: np.empty(self._first, dtype) for name, dtype in PER_WINDOW.items()}
               if self._buffers.with_ldt else None)
        for (members, _), (windows, values) in zip(early, parts, strict=True):
            x[members] = windows
            if ldt is not None and values is not None:
                for name in PER_WINDOW:
                    ldt[name][members] = values[name]
        self._buffers.early_batches += 1
        return x, ldt

    def wait(self) -> LoadedPool:
        """The pool in its bank, once every chunk is decoded (the same object on later calls)."""
        if self._loaded is None:
            pieces = _results(self._futures)
            self._loaded = self._buffers._loaded(self._pool, pieces, self._bank)
            if self._buffers._loading is self:
                self._buffers._loading = None
        return self._loaded


class PoolBuffers:
    """One reader's pool memory and its fetch threads (create after a DataLoader worker forks).

    Two banks: a pool loaded on the spot goes to bank 0; a prefetch goes to the bank not holding
    the pool being served, and is served from there. In the training process (no prefetch) only
    bank 0 is ever allocated.
    """

    def __init__(self, reader: ChunkReader, selection: Selection, *, with_ldt: bool, threads: int) -> None:
        self.reader = reader
        self.selection = selection
        self.with_ldt = with_ldt
        self._banks = (_Bank(with_ldt), _Bank(with_ldt))
        self._serving = 0  # the bank of the pool handed out last
        self._threads = _DaemonThreads(max(1, threads), "birdzarr-fetch")
        self._pending: tuple[Hashable, Pool, list[Future[np.ndarray]], int] | None = None
        self.decoded = 0  # chunks decoded by this reader for pools it served (tests count them)
        self.prefetched = 0  # pools taken from a prefetch (tests count them)
        self.discarded = 0  # prefetches not used
        self.early_batches = 0  # first batches decoded on their own (tests count them)
        self._loading: Loading | None = None  # a pool being loaded on the spot, not yet waited for

    # bank 0: where every pool that was not prefetched is loaded
    @property
    def capacity(self) -> int:
        return self._banks[0].capacity

    @property
    def gimu(self) -> np.ndarray:
        return self._banks[0].gimu

    @property
    def ldt(self) -> dict[str, np.ndarray]:
        return self._banks[0].ldt

    @property
    def prefetch_capacity(self) -> int:
        """Chunks the second bank holds (0 until a prefetch has used it)."""
        return self._banks[1].capacity

    def close(self) -> None:
        self._drop_pending()
        self._settle()
        self._threads.shutdown()

    def _settle(self) -> None:
        """Cancel the decodes of a pool started on the spot and never waited for (an iteration
        dropped after its first batch): the running ones finish first, as they write into a bank."""
        if self._loading is not None:
            futures, self._loading = self._loading.futures, None
            for future in futures:
                future.cancel()
            wait(futures)

    def _submit(self, bank: int, pool: Pool) -> list[Future[np.ndarray]]:
        self._banks[bank].reserve(len(pool.chunks), self.reader.chunk_windows)
        return [self._threads.submit(self._load_chunk, bank, slot, chunk, lo, hi)
                for slot, (chunk, lo, hi) in enumerate(zip(pool.chunks.tolist(), pool.lo.tolist(),
                                                           pool.hi.tolist(), strict=True))]

    def prefetch(self, key: Hashable, pool: Pool) -> None:
        """Start decoding ``pool`` into the bank not being served; ``load(pool, key)`` takes it."""
        self._drop_pending()
        self._settle()
        bank = 1 - self._serving
        self._pending = (key, pool, self._submit(bank, pool), bank)

    def _drop_pending(self) -> None:
        """Cancel a prefetch nobody asked for (its running decodes finish first)."""
        if self._pending is not None:
            futures = self._pending[2]
            self._pending = None
            for future in futures:
                future.cancel()
            wait(futures)
            self.discarded += 1

    def load(self, pool: Pool, key: Hashable = None) -> LoadedPool:
        """Fetch and decode every chunk of ``pool`` into the buffers (all in flight at once), or
        take the prefetch started with this ``key`` for the same pool."""
        return self.start(pool, key).wait()

    def start(self, pool: Pool, key: Hashable = None, first: np.ndarray | None = None) -> Loading:
        """Take the prefetch started with this ``key`` for the same pool, or start decoding every
        chunk of ``pool`` into bank 0. In that case, given ``first`` (the pool positions of its
        first batch, in the batch's order) and a version-2 store on this machine, those windows
        are decoded on their own first (``Loading.early``), queued ahead of the pool's chunks."""
        self._settle()
        pending = self._pending
        if pending is not None and key is not None and pending[0] == key and _same(pending[1], pool):
            self._pending = None
            self.prefetched += 1
            return Loading(self, pool, pending[2], pending[3])
        self._drop_pending()
        early = None
        if (first is not None and len(first) and self.reader.format_version == 2
                and self.reader.location.is_local and self.reader.cache is None):
            early = self._submit_early(pool, np.asarray(first, dtype=np.int64))
        loading = Loading(self, pool, self._submit(0, pool), 0, early, 0 if first is None else len(first))
        self._loading = loading
        return loading

    def _submit_early(self, pool: Pool, first: np.ndarray) -> list[tuple[np.ndarray, Future[EarlyBatch]]]:
        """Queue the decode of the windows at pool positions ``first``, chunk by chunk."""
        bounds = np.concatenate(([0], np.cumsum(pool.hi - pool.lo)))
        piece = np.searchsorted(bounds, first, side="right") - 1
        ranks = pool.lo[piece] + first - bounds[piece]  # among the chunk's selected windows
        tasks = []
        for j in np.unique(piece).tolist():
            members = np.flatnonzero(piece == j)
            chunk = int(pool.chunks[j])
            mask = self.selection.chunk_mask(self.reader, chunk)
            positions = ranks[members] if mask is None else np.flatnonzero(mask)[ranks[members]]
            order = np.argsort(positions, kind="stable")  # read_windows takes ascending positions
            tasks.append((members[order], self._threads.submit(self._read_early, chunk, positions[order])))
        return tasks

    def _read_early(self, chunk: int, positions: np.ndarray) -> EarlyBatch:
        """Windows ``positions`` (ascending, within the chunk) of one chunk, and their ldt."""
        x = np.empty((len(positions), WINDOW_LENGTH, N_CHANNELS), np.float32)
        self.reader.read_windows(chunk, positions, x)
        ldt = None
        if self.with_ldt:
            ldt = {name: self.reader.read(name, chunk)[positions] for name in PER_WINDOW}
        return x, ldt

    def _loaded(self, pool: Pool, pieces: list[np.ndarray], bank: int) -> LoadedPool:
        width = self.reader.chunk_windows
        rows = np.concatenate(
            [slot * width + piece for slot, piece in enumerate(pieces)]
        ) if pieces else np.empty(0, np.int64)
        self.decoded += len(pool.chunks)
        self._serving = bank
        held = self._banks[bank]
        return LoadedPool(rows.astype(np.int64, copy=False), held.gimu, held.ldt if self.with_ldt else None)

    def _load_chunk(self, bank: int, slot: int, chunk: int, lo: int, hi: int) -> np.ndarray:
        """Decode the pool's piece of one chunk (its selected windows ``[lo, hi)``, ranks among
        the chunk's selected windows) into ``slot`` of ``bank``; return their rows within the
        slot, in stored order (a version-2 chunk: only they are looked up, packed at the slot's
        start; version 1: the whole chunk, each where it is)."""
        reader, width, held = self.reader, self.reader.chunk_windows, self._banks[bank]
        start, stop = reader.chunk_span(chunk)
        mask = self.selection.chunk_mask(reader, chunk)
        if mask is None:
            selected = None if (lo, hi) == (0, stop - start) else np.arange(lo, hi)
        else:
            selected = np.flatnonzero(mask)[lo:hi]
        rows = reader.read_windows(chunk, selected, held.gimu[slot * width : (slot + 1) * width])
        if self.with_ldt:
            for name in PER_WINDOW:
                values = reader.read(name, chunk)
                held.ldt[name][slot * width + rows] = values if selected is None else values[selected]
        return rows


def _same(a: Pool, b: Pool) -> bool:
    return all(np.array_equal(x, y) for x, y in ((a.chunks, b.chunks), (a.lo, b.lo), (a.hi, b.hi)))
