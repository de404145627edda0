"""Loading one pool of chunks into a reader's reused buffers, every chunk once, concurrently.

A reader (the main process, or one DataLoader worker) owns one ``PoolBuffers``: a float32
array of ``capacity`` chunks for the windows, plus label, device and timestamp arrays when the
dataset yields ``ldt``. Each chunk of a pool decodes straight into its slot of those arrays (on a
small thread pool: decoding releases the GIL, and remote fetches overlap), so a batch is then one
vectorised gather from memory the reader already owns. Nothing is handed back to a free list and
nothing grows with the store: memory is ``capacity x chunk_windows x (320 B + 16 B with ldt)``.

A reader whose batches of an epoch are all gathered has an idle buffer: ``prefetch`` starts
decoding its first pool of the next epoch there (plans are pure functions of the epoch), and
``load`` takes it if the next iteration asks for that pool, else cancels it. The fetch threads
are daemon threads: a DataLoader worker that exits (a non-persistent one, at the end of its
epoch) does not wait for a prefetch nobody will use.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from birdzarr.format._spec import DEVICE, GIMU, LABEL, N_CHANNELS, TIMESTAMP, WINDOW_LENGTH
from birdzarr.loader._sampling import Pool
from birdzarr.loader._selection import Selection
from birdzarr.store._chunks import ChunkReader

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


def _results(futures: list[Future[Any]]) -> list[Any]:
    """The futures' results in order; on the first failure the rest are cancelled (and the
    running ones waited for: they write into the buffers) before it is raised."""
    try:
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        wait(futures)
        raise


class PoolBuffers:
    """One reader's pool memory and its fetch threads (create after a DataLoader worker forks)."""

    def __init__(self, reader: ChunkReader, selection: Selection, *, with_ldt: bool, threads: int) -> None:
        self.reader = reader
        self.selection = selection
        self.with_ldt = with_ldt
        self.capacity = 0
        self.gimu = np.empty((0, WINDOW_LENGTH, N_CHANNELS), np.float32)
        self.ldt: dict[str, np.ndarray] = {}
        self._threads = _DaemonThreads(max(1, threads), "birdzarr-fetch")
        self._pending: tuple[Hashable, Pool, list[Future[np.ndarray]]] | None = None
        self.decoded = 0  # chunks decoded by this reader (tests count them)
        self.prefetched = 0  # pools taken from a prefetch (tests count them)
        self.discarded = 0  # prefetches not used

    def close(self) -> None:
        self._drop_pending()
        self._threads.shutdown()

    def _reserve(self, chunks: int) -> None:
        if chunks <= self.capacity:
            return
        rows = chunks * self.reader.chunk_windows
        self.gimu = np.empty((rows, WINDOW_LENGTH, N_CHANNELS), np.float32)
        if self.with_ldt:
            self.ldt = {name: np.empty(rows, dtype) for name, dtype in PER_WINDOW.items()}
        self.capacity = chunks

    def prefetch(self, key: Hashable, pool: Pool) -> None:
        """Start decoding ``pool`` into the (idle) buffers; ``load(pool, key)`` takes it."""
        self._drop_pending()
        self._reserve(len(pool.chunks))
        futures = [self._threads.submit(self._load_chunk, slot, chunk)
                   for slot, chunk in enumerate(pool.chunks.tolist())]
        self._pending = (key, pool, futures)

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
        pending = self._pending
        if pending is not None and key is not None and pending[0] == key and _same(pending[1], pool):
            self._pending = None
            self.prefetched += 1
            return self._loaded(pool, _results(pending[2]))
        self._drop_pending()
        self._reserve(len(pool.chunks))
        futures = [self._threads.submit(self._load_chunk, slot, chunk)
                   for slot, chunk in enumerate(pool.chunks.tolist())]
        return self._loaded(pool, _results(futures))

    def _loaded(self, pool: Pool, selected: list[np.ndarray]) -> LoadedPool:
        width = self.reader.chunk_windows
        rows = np.concatenate(
            [slot * width + chosen[lo:hi] for slot, (chosen, lo, hi)
             in enumerate(zip(selected, pool.lo.tolist(), pool.hi.tolist(), strict=True))]
        ) if selected else np.empty(0, np.int64)
        self.decoded += len(pool.chunks)
        return LoadedPool(rows.astype(np.int64, copy=False), self.gimu, self.ldt if self.with_ldt else None)

    def _load_chunk(self, slot: int, chunk: int) -> np.ndarray:
        """Decode one chunk into ``slot``; return the rows (within the chunk) of selected windows."""
        reader, width = self.reader, self.reader.chunk_windows
        start, stop = reader.chunk_span(chunk)
        reader.read(GIMU, chunk, out=self.gimu[slot * width : (slot + 1) * width])
        device_ids = None
        if self.with_ldt:
            for name in PER_WINDOW:
                values = reader.read(name, chunk)
                self.ldt[name][slot * width : slot * width + len(values)] = values
            device_ids = self.ldt[DEVICE][slot * width : slot * width + stop - start]
        mask = self.selection.read_mask(reader, chunk, device_ids)
        return np.arange(stop - start) if mask is None else np.flatnonzero(mask)


def _same(a: Pool, b: Pool) -> bool:
    return all(np.array_equal(x, y) for x, y in ((a.chunks, b.chunks), (a.lo, b.lo), (a.hi, b.hi)))
