"""Slab buffering: blocks in, slabs of whole chunks out, written to a store's four arrays.

One implementation for the local writers (new store, append) and the Dask write tasks. Blocks
are buffered until a slab is full; a slab is cut at a chunk boundary, so no two slabs ever
write the same chunk (slabs in flight at once never conflict, and a Dask task writes exactly
the chunks it owns). A slab that starts on a chunk boundary goes through the fast path
(``_chunkwrite.ChunkSink``), any other (the first slab of an append that starts inside a
chunk) through zarr-python; both give the same bytes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._chunkwrite import ChunkSink
from birdzarr.format import _v2
from birdzarr.format._rows import RowCoder
from birdzarr.format._spec import DEVICE, LABEL, TIMESTAMP
from birdzarr.storage._location import Location

# the per-window arrays birdzarr writes, in the order they are grown and written (format 2's;
# its dictionary arrays are written at the commit: _writer.py)
ARRAYS_V2 = (_v2.CODES, _v2.GPS, _v2.ROW, DEVICE, TIMESTAMP, LABEL)
# Windows of a slab by default: 8 chunks of 8,192 windows, 2 of a shuffled store's 32,768. A
# slab is encoded only once it is full, so larger slabs leave the encoders idle longer at the
# start and end of a conversion (a --shuffle conversion with 8-chunk slabs took 1.1x as long).
SLAB_WINDOWS = 65_536
# Windows of blocks coded by one RowCoder.code_runs (SlabWriter.code_pending): a slab's in
# pieces, so its temporaries (the windows copied together, 64-bit keys a value) stay ~10 MB
# (a whole slab's at once raised a 186-device conversion's peak RSS by ~65 MB).
CODE_BATCH = 16_384
# Every committed chunk is written, even one equal to the fill value (an all-unlabelled label
# chunk): readers treat a missing chunk as damage, never as fill values.
EVERY_CHUNK: Any = {"write_empty_chunks": True}


def writable_arrays(group: Any) -> dict[str, Any]:
    """The per-window arrays of an existing format-2 store (an append's, a Dask task's), opened
    to write (a format-1 store is refused before: birdzarr writes format 2 only)."""
    return {name: group[name].with_config(EVERY_CHUNK) for name in ARRAYS_V2}


class SlabWriter:
    """Buffers blocks and writes them, from global window ``start`` on, as slabs of
    ``slab_chunks`` chunks (default: ``SLAB_WINDOWS`` windows, at least one chunk).

    ``in_flight``: slabs written on background threads while the caller reads on (their
    memory is the bound); 0 writes each slab in the calling thread before ``add`` returns.
    ``workers``: the threads encoding one slab's chunks (``ChunkSink``).
    ``coder``: codes every block (the arrays are format 2's ``ARRAYS_V2``) that comes without codes,
    in the order blocks are added (store order). One device's blocks (``devices`` None) wait
    uncoded in the buffer and are coded together, ``CODE_BATCH`` windows a ``RowCoder.code_runs``
    (``code_pending``: before a slab is taken, and before any block is coded on its own), so a
    slab of many small devices is coded without a Python pass a device; the codes and rows are
    those of coding block after block with ``RowCoder.code``. Memory: the uncoded blocks are the
    buffer's, at most one slab plus the last block added.
    """

    def __init__(self, location: Location, arrays: dict[str, Any], *, start: int,
                 slab_chunks: int | None = None, workers: int, in_flight: int,
                 coder: RowCoder | None) -> None:
        self.arrays = arrays
        if _v2.CODES not in arrays or coder is None:
            raise ValueError("a SlabWriter writes format 2's arrays, with a RowCoder")
        self.coder = coder
        self.sink = ChunkSink(location, arrays, workers=workers)
        self.chunk_windows = int(arrays[DEVICE].chunks[0])
        if slab_chunks is None:
            slab_chunks = SLAB_WINDOWS // self.chunk_windows
        self.slab_windows = self.chunk_windows * max(slab_chunks, 1)
        self.written = start  # windows handed to zarr so far: where the next slab starts
        self._buffer: list[tuple[int, WindowBlock]] = []
        self._buffered = 0
        self._in_flight = in_flight
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="birdzarr-write") if in_flight else None
        self._pending: list[Future[None]] = []
        # slab buffers free for reuse: at most ``in_flight + 1`` exist (being filled, in flight)
        self._free: collections.deque[dict[str, np.ndarray]] = collections.deque()
        # format 2: the last ``_uncoded`` buffered blocks wait for ``code_pending``, and the
        # devices in ``_closing`` are closed in the coder once they are coded
        self._uncoded = 0
        self._closing: set[int] = set()

    @property
    def end(self) -> int:
        """The global index of the next window added."""
        return self.written + self._buffered

    def add(self, device_id: int, block: WindowBlock) -> None:
        """Buffer a block of ``device_id`` (ignored when the block carries its own device ids);
        write every slab that is full."""
        if not len(block):
            return
        # the block waits uncoded for ``code_pending``, or is coded now
        waits = block.coded is None and block.devices is None and device_id not in self._closing
        if not waits:
            self.code_pending()  # store order: the blocks waiting before this one first
            if block.coded is None:
                block = self.code(device_id, block)
        self._buffer.append((device_id, block))
        self._buffered += len(block)
        if waits:
            self._uncoded += 1
        while self._buffered >= self._slab_room():
            self._flush(self._slab_room())

    def code(self, device_id: int, block: WindowBlock) -> WindowBlock:
        """``block`` with its format 2 codes and rows (``WindowBlock.coded``), from this writer's
        coder, after every block waiting in the buffer (blocks must be coded in store order)."""
        assert self.coder is not None
        self.code_pending()
        if block.devices is None:
            coded = self.coder.code(device_id, block.windows)
        else:
            coded = self.coder.code_mixed(block.devices, block.windows)
        return dataclasses.replace(block, coded=coded)

    def code_pending(self) -> None:
        """Format 2: code the buffered blocks still without codes, ``CODE_BATCH`` windows of
        blocks at a time in one ``RowCoder.code_runs`` (each block's windows are one run of its
        device), then close the devices ``close_device`` was told of meanwhile."""
        end = len(self._buffer)
        at = end - self._uncoded
        while at < end:
            stop, n = at + 1, len(self._buffer[at][1])
            while stop < end and n + len(self._buffer[stop][1]) <= CODE_BATCH:
                n += len(self._buffer[stop][1])
                stop += 1
            self._code_blocks(at, stop)
            at = stop
        self._uncoded = 0
        if self._closing:
            assert self.coder is not None
            self.coder.close_devices(np.fromiter(self._closing, np.int64, len(self._closing)))
            self._closing.clear()

    def close_device(self, device_id: int) -> None:
        """Format 2: ``device_id`` has no more windows; its coder state is dropped once its
        waiting blocks are coded (``RowCoder.close_device``)."""
        assert self.coder is not None
        if self._uncoded:
            self._closing.add(device_id)
        else:
            self.coder.close_device(device_id)

    def reserve(self, n: int) -> None:
        """Windows ``[end, end + n)`` are written by others (Dask tasks): grow the arrays to hold
        them once, and add after them."""
        assert not self._buffered and not self._pending, "reserve before adding anything"
        self._grow(self.written + n)
        self.written += n

    def drain(self) -> None:
        """Write everything buffered and wait for every slab in flight."""
        if self._buffered:
            self._flush(self._buffered)
        self._wait(0)

    def abandon(self) -> None:
        """Leaving on an error: write nothing more, only let slabs in flight finish."""
        self._buffer.clear()
        self._buffered = 0
        self._uncoded = 0
        self._closing.clear()
        for pending in self._pending:
            pending.cancel()
            with contextlib.suppress(BaseException):  # the original error is the one to raise
                pending.result()
        self._pending.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.sink.close()

    # -- inside ----------------------------------------------------------------------------------
    def _slab_room(self) -> int:
        """Windows to the next slab boundary: an append that starts inside a chunk first fills
        that chunk, so no two slabs in flight ever rewrite the same chunk."""
        return self.slab_windows - self.written % self.chunk_windows

    def _slab_buffers(self) -> dict[str, np.ndarray]:
        """Arrays for one slab: a written slab's, or new ones. Recycled because new memory
        costs more than the copy into it: the kernel zeroes every page on first touch (a 21 MB
        slab concatenated anew was 5% of a Parquet conversion's CPU samples, ``perf``)."""
        try:
            return self._free.pop()
        except IndexError:
            return {
                name: np.empty((self.slab_windows, *array.shape[1:]), dtype=array.dtype)
                for name, array in self.arrays.items()
            }

    def _code_blocks(self, start: int, stop: int) -> None:
        """Code the buffered blocks ``[start, stop)``: one ``RowCoder.code_runs``, or ``code``
        for one block (a large device's: the same codes and rows, without a copy)."""
        assert self.coder is not None
        waiting = self._buffer[start:stop]
        if len(waiting) == 1:
            device_id, block = waiting[0]
            self._buffer[start] = (device_id, dataclasses.replace(
                block, coded=self.coder.code(device_id, block.windows)))
            return
        devices = np.repeat(np.array([d for d, _ in waiting], np.int64), [len(b) for _, b in waiting])
        codes, rows = self.coder.code_runs(devices, np.concatenate([b.windows for _, b in waiting]))
        at = 0
        for i, (device_id, block) in enumerate(waiting, start=start):
            end = at + len(block)
            self._buffer[i] = (device_id, dataclasses.replace(block, coded=(codes[at:end], rows[at:end])))
            at = end

    def _take(self, n: int) -> dict[str, np.ndarray]:
        """Remove the first ``n`` buffered windows into slab buffers (their first ``n`` rows)."""
        self.code_pending()
        buffers = self._slab_buffers()
        at = 0
        while at < n:
            device_id, block = self._buffer[0]
            take = min(n - at, len(block))
            assert block.coded is not None  # code_pending coded every block
            codes, rows = block.coded
            buffers[_v2.CODES][at : at + take] = codes[:take]
            buffers[_v2.GPS][at : at + take] = block.windows[:take, :, 3]
            buffers[_v2.ROW][at : at + take] = rows[:take]
            buffers[TIMESTAMP][at : at + take] = block.timestamps[:take]
            buffers[LABEL][at : at + take] = block.labels[:take]
            devices = block.device_ids(device_id)
            buffers[DEVICE][at : at + take] = devices if isinstance(devices, int) else devices[:take]
            if take == len(block):
                self._buffer.pop(0)
            else:
                self._buffer[0] = (device_id, block.tail(take))
            at += take
        self._buffered -= n
        return buffers

    def _flush(self, n: int) -> None:
        buffers = self._take(n)
        start, stop = self.written, self.written + n
        if self._pool is not None:
            self._wait(self._in_flight - 1)
        self._grow(stop)
        self.written = stop
        if self._pool is None:
            self._write_and_free(start, stop, buffers)
            return
        self._pending.append(self._pool.submit(self._write_and_free, start, stop, buffers))

    def _grow(self, stop: int) -> None:
        """Arrays that end before ``stop`` are resized to it (a Dask task's are already sized)."""
        for array in self.arrays.values():
            if array.shape[0] < stop:
                array.resize((stop, *array.shape[1:]))

    def _write_and_free(self, start: int, stop: int, buffers: dict[str, np.ndarray]) -> None:
        self._write_slab(start, stop, {name: array[: stop - start] for name, array in buffers.items()})
        self._free.append(buffers)  # written: the next slab may fill them (deque: thread-safe)

    def _write_slab(self, start: int, stop: int, data: dict[str, np.ndarray]) -> None:
        if self.sink.can_write(start):
            self.sink.write(start, stop, data)  # whole chunks, no zarr overhead: _chunkwrite.py
            return
        for name, array in self.arrays.items():
            array[start:stop] = data[name]

    def _wait(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.pop(0).result()
