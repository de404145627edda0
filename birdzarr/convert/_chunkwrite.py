"""The converter's fast write path: whole chunks encoded on a thread pool and stored as files.

zarr-python's generic write path (an event loop, a thread hop per codec, read-modify-write
checks) costs more than the encoding itself for 2.6 MB chunks of 320-byte windows. A slab that
starts on a chunk boundary is therefore encoded here with the codec chain declared in each
array's zarr.json (``birdzarr.format._codec.ChunkCodec``, byte-identical to zarr-python's) and
put under the array's chunk keys. Anything else (a slab that starts inside a chunk, as an append
can) goes through zarr-python. Each chunk's bytes depend only on its windows, so the store is
identical whatever the number of workers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from birdzarr.convert._cpus import resolve_workers
from birdzarr.format._codec import ChunkCodec
from birdzarr.storage._location import Location


@contextlib.contextmanager
def _blosc_single_threaded() -> Iterator[None]:
    """numcodecs' blosc uses its own thread pool when called from the main thread; the bytes are
    the same either way (tests/test_codec.py), only the cores used differ."""
    from numcodecs import blosc

    before = blosc.use_threads
    blosc.use_threads = False
    try:
        yield
    finally:
        blosc.use_threads = before


class ChunkSink:
    """Encodes and stores whole chunks of a store's arrays, ``workers`` chunks at a time."""

    def __init__(self, location: Location, arrays: dict[str, Any], *, workers: int | None = None) -> None:
        self.location = location
        self.workers = resolve_workers(workers)
        self.arrays = arrays
        self.codecs: dict[str, ChunkCodec | None] = {
            name: ChunkCodec.parse(array.metadata.to_dict()["codecs"], dtype=array.dtype)
            for name, array in arrays.items()
        }
        self.chunk_windows = {name: int(array.chunks[0]) for name, array in arrays.items()}
        # One pool for every slab (not one per slab): the slabs in flight at once share the
        # ``workers`` threads instead of starting ``workers`` more each.
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._made: set[str] = set()  # local chunk directories known to exist

    def close(self) -> None:
        """Stop the encoding threads (after the last ``write``)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:  # two slab threads may ask at once
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="birdzarr-encode")
            return self._pool

    def can_write(self, start: int) -> bool:
        return all(c is not None for c in self.codecs.values()) and all(
            start % c == 0 for c in self.chunk_windows.values()
        )

    def write(self, start: int, stop: int, data: dict[str, np.ndarray]) -> None:
        """Store windows ``[start, stop)``; ``start`` must be on a chunk boundary (see can_write)."""
        tasks = []
        for name, array in self.arrays.items():
            size = self.chunk_windows[name]
            for first in range(start, stop, size):
                tasks.append((name, array, first // size, data[name][first - start : first - start + size]))
        if self.workers == 1:  # in this thread, blosc single-threaded: one core
            with _blosc_single_threaded():
                for task in tasks:
                    self._put(*task)
            return
        pool = self._executor()
        for future in [pool.submit(self._put, *task) for task in tasks]:
            future.result()

    def _put(self, name: str, array: Any, index: int, values: np.ndarray) -> None:
        shape = (self.chunk_windows[name], *array.shape[1:])
        codec = self.codecs[name]
        assert codec is not None
        if codec.kind in ("standard", "plain"):  # rows gathered elsewhere (int64 rows): the array's type
            values = values.astype(array.dtype, copy=False)
        if values.shape[0] < shape[0]:
            # The last chunk is stored full size, padded with the fill value, as zarr does.
            padded = np.full(shape, array.fill_value, dtype=array.dtype)
            padded[: values.shape[0]] = values
            values = padded
        self._store(array, index, shape, codec.encode(np.ascontiguousarray(values)))

    def _store(self, array: Any, index: int, shape: tuple[int, ...], data: bytes) -> None:
        key = array.metadata.encode_chunk_key((index,) + (0,) * (len(shape) - 1))
        path = self.location.join(array.path, key)
        if not self.location.is_local:
            self.location.fs.pipe_file(path, data)
            return
        # Local files: a plain write (what fsspec's local pipe_file does, without its layers),
        # and each chunk directory made once (object stores have no directories)
        directory = os.path.dirname(path)
        if directory not in self._made:
            os.makedirs(directory, exist_ok=True)
            self._made.add(directory)
        with open(path, "wb") as handle:
            handle.write(data)
