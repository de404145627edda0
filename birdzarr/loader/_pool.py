"""Loading one pool of chunks into a reader's reused buffers, every chunk once, concurrently.

A reader (the main process, or one DataLoader worker) owns one ``PoolBuffers``: a float32
array of ``capacity`` chunks for the windows, plus label, device and timestamp arrays when the
dataset yields ``ldt``. Each chunk of a pool decodes straight into its slot of those arrays (on a
small thread pool: decoding releases the GIL, and remote fetches overlap), so a batch is then one
vectorised gather from memory the reader already owns. Nothing is handed back to a free list and
nothing grows with the store: memory is ``capacity x chunk_windows x (320 B + 16 B with ldt)``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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


class PoolBuffers:
    """One reader's pool memory and its fetch threads (create after a DataLoader worker forks)."""

    def __init__(self, reader: ChunkReader, selection: Selection, *, with_ldt: bool, threads: int) -> None:
        self.reader = reader
        self.selection = selection
        self.with_ldt = with_ldt
        self.capacity = 0
        self.gimu = np.empty((0, WINDOW_LENGTH, N_CHANNELS), np.float32)
        self.ldt: dict[str, np.ndarray] = {}
        self._threads = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="birdzarr-fetch")
        self.decoded = 0  # chunks decoded by this reader (tests count them)

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)

    def _reserve(self, chunks: int) -> None:
        if chunks <= self.capacity:
            return
        rows = chunks * self.reader.chunk_windows
        self.gimu = np.empty((rows, WINDOW_LENGTH, N_CHANNELS), np.float32)
        if self.with_ldt:
            self.ldt = {name: np.empty(rows, dtype) for name, dtype in PER_WINDOW.items()}
        self.capacity = chunks

    def load(self, pool: Pool) -> LoadedPool:
        """Fetch and decode every chunk of ``pool`` into the buffers (all in flight at once)."""
        self._reserve(len(pool.chunks))
        width = self.reader.chunk_windows
        selected = list(self._threads.map(self._load_chunk, range(len(pool.chunks)), pool.chunks.tolist()))
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
