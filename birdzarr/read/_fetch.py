"""Chunk prefetching inside one reader (one DataLoader worker, or the main process).

Given the chunks each upcoming batch needs, fetch and decode them on a small thread pool ahead
of use (decoding releases the GIL), keep each decoded chunk only until the last batch that needs
it, and never hold more than ``prefetch`` chunks beyond the current batch. Memory is therefore
``(chunks of the current group + prefetch) x chunk size``, whatever the data set's size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

ChunkData = dict[str, np.ndarray]


class BufferPool:
    """Recycled chunk buffers of one shape (thread-safe); holds only buffers given back.

    Fresh multi-megabyte arrays cost a page fault per 4 KiB page on first touch (much slower than
    decoding on some virtual machines); reusing a few buffers keeps the hot path fault-free. It
    never holds more buffers than were in use at once, so the memory bound is unchanged.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type, tuple[tuple[int, ...], np.dtype]]:
        return (BufferPool, (self.shape, self.dtype))  # pickled (spawned workers) empty, lock-free

    def get(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(self.shape, dtype=self.dtype)

    def put(self, array: np.ndarray | None) -> None:
        """Give back a buffer from :meth:`get` (or a view of one); anything else is ignored."""
        base = array if array is None or array.base is None else array.base
        if base is not None and base.shape == self.shape and base.dtype == self.dtype:
            with self._lock:
                self._free.append(base)


def prefetched(
    load: Callable[[int], ChunkData],
    steps: Sequence[np.ndarray],
    *,
    prefetch: int,
    release: Callable[[ChunkData], None] | None = None,
) -> Iterator[dict[int, ChunkData]]:
    """For each step (the chunks one batch needs), yield those chunks' data, loaded ahead.

    ``release`` is called with a chunk's data after the step that used it last, once the consumer
    has asked for the next step (so it may recycle the buffers).
    """
    first_use: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for step, chunks in enumerate(steps):
        for chunk in chunks.tolist():
            first_use.setdefault(chunk, step)
            last_use[chunk] = step
    order = sorted(first_use, key=first_use.__getitem__)
    pool = ThreadPoolExecutor(max_workers=max(1, prefetch), thread_name_prefix="birdzarr-fetch")
    loaded: dict[int, Future[ChunkData]] = {}
    submitted = 0
    try:
        for step, chunks in enumerate(steps):
            # everything this step needs, then up to `prefetch` chunks first used later
            while submitted < len(order) and (
                first_use[order[submitted]] <= step or sum(first_use[c] > step for c in loaded) < prefetch
            ):
                chunk = order[submitted]
                loaded[chunk] = pool.submit(load, chunk)
                submitted += 1
            yield {chunk: loaded[chunk].result() for chunk in chunks.tolist()}
            for chunk in chunks.tolist():
                if last_use[chunk] == step:
                    done = loaded.pop(chunk, None)
                    if release is not None and done is not None:
                        release(done.result())
    finally:
        for future in loaded.values():
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
