"""Global seeded pre-shuffle at conversion, with memory bounded by one bucket (an external shuffle).

Pass 1 reads every device as usual and sends each window to one of K bucket files, the bucket
drawn uniformly by a generator seeded with ``seed``. Pass 2 loads one bucket at a time, permutes
it with a generator seeded with ``(seed, bucket)`` and appends it to the store. A uniform bucket
per window followed by a uniform permutation inside each bucket is a uniform permutation of all
windows, and the same input and seed give the same store. Each chunk of the store is therefore a
uniform sample of all windows; inside it, the windows are then grouped by device, which decodes
faster (docs/format.md, shuffled stores) and changes no chunk's membership.

Pass 1 spills each window as codes into its device's dictionaries (``DeviceCoder``: a device's
distinct values per channel, found as its windows pass in order). After it, every device's
sorted dictionaries form a ``DictionaryTable``, and pass 2 hands the writer codes into it, from
which gdict16 chunks are encoded without sorting (``_gdict_encode.py``).

Where the bytes go: the bucket files live in a fresh ``birdzarr-shuffle-*`` directory under
``tmp_dir`` (default: the system temporary directory, ``$TMPDIR``), hold every window once as
uint16 codes compressed with lz4 (about 3x smaller than float32), and are removed when the
conversion ends, whether it succeeds or fails.
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
from numcodecs import Blosc

from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._gdict_encode import DeviceCoder, DictionaryTable
from birdzarr.convert._summary import DeviceSummary, Summarizer, WindowChecksum, checksum_hasher
from birdzarr.convert._writer import StoreWriter
from birdzarr.format._spec import (
    GIMU,
    N_CHANNELS,
    WINDOW_LENGTH,
    DeviceReport,
)

BUCKET_WINDOWS = 131_072  # target windows per bucket (pass 2 holds about two: docs/conversion.md)
MAX_BUCKETS = 512  # open files in pass 1
# Pass 1 keeps a device's windows per bucket until a piece is this large (or the device ends):
# pieces of a block's share of 96 buckets (~170 windows at 25 M windows) made the per-piece
# encoding overhead the conversion's main cost. All buckets together hold at most this many
# windows (~44 MB of uint16 codes); the spill files, and so the store, are the same.
PASS1_BUFFER_WINDOWS = 2**18
# A piece: windows, device id, bytes per code, bytes of the codes blob, bytes of the metadata blob
_FRAME = struct.Struct("<QqQQQ")
# Bit shuffle before lz4: on the codes of the benchmark's devices (first-seen order) it stores
# 1.27x less than byte shuffle (95 against 119 MB of spill for 1 M windows) at the same
# conversion time (4 alternating runs)
_CODES_CODEC = Blosc(cname="lz4", clevel=5, shuffle=Blosc.BITSHUFFLE)
_META_CODEC = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
_META = np.dtype([("label", "<i4"), ("timestamp", "<i8")])


@dataclass
class _Piece:
    """Windows of one device spilled together: codes ``(channels, n, samples)`` into the
    device's dictionaries (``DeviceCoder``), labels and times (``_META``)."""

    device_id: int
    codes: np.ndarray
    meta: np.ndarray


def bucket_count(estimated_windows: int) -> int:
    """Buckets for an input of about this many windows (an over-estimate only costs files)."""
    return max(1, min(MAX_BUCKETS, math.ceil(estimated_windows / BUCKET_WINDOWS)))


class _Buckets:
    """K append-only spill files of compressed pieces."""

    def __init__(self, directory: str, count: int) -> None:
        self.paths = [os.path.join(directory, f"bucket-{i:04d}.bin") for i in range(count)]
        self.files: list[BinaryIO] = [open(p, "wb") for p in self.paths]  # noqa: SIM115 (closed in close())
        self.windows = np.zeros(count, dtype=np.int64)
        self.bytes_written = 0

    def write(self, bucket: int, n_windows: int, piece: bytes) -> None:
        """Append a piece made by ``encode_piece`` (pieces of a bucket are kept in order)."""
        self.files[bucket].write(piece)
        self.windows[bucket] += n_windows
        self.bytes_written += len(piece)

    def close(self) -> None:
        for handle in self.files:
            handle.close()

    def pieces(self, bucket: int) -> Iterator[_Piece]:
        """The bucket's pieces in the order they were written; the file is deleted once read
        (pass 2 frees the disk as it goes)."""
        with open(self.paths[bucket], "rb") as handle:
            data = memoryview(handle.read())
        os.remove(self.paths[bucket])
        at = 0
        while at < len(data):
            n, device_id, code_bytes, codes_size, meta_size = _FRAME.unpack_from(data, at)
            at += _FRAME.size
            codes = np.frombuffer(_CODES_CODEC.decode(data[at : at + codes_size]), f"<u{code_bytes}")
            at += codes_size
            meta = np.frombuffer(_META_CODEC.decode(data[at : at + meta_size]), dtype=_META)
            at += meta_size
            yield _Piece(device_id, codes.reshape(N_CHANNELS, n, WINDOW_LENGTH), meta)  # views


def encode_piece(piece: _Piece) -> bytes:
    """One spilled piece: a frame header, the codes (lz4), the metadata (lz4)."""
    codes = _CODES_CODEC.encode(np.ascontiguousarray(piece.codes))
    packed = _META_CODEC.encode(piece.meta)
    code_bytes = piece.codes.dtype.itemsize
    return _FRAME.pack(len(piece.meta), piece.device_id, code_bytes, len(codes), len(packed)) + codes + packed


def write_shuffled(
    writer: StoreWriter,
    devices: Iterable[tuple[int, list[str], Iterator[WindowBlock]]],
    *,
    seed: int,
    buckets: int,
    tmp_dir: str | None = None,
    on_pass: Callable[[str, int], Any] | None = None,
) -> dict[str, Any]:
    """Write every device's windows to ``writer`` in one seeded global random order.

    Records every device with ``writer`` (no ranges; ``scattered_checksum`` set); returns facts
    for the conversion report (buckets, spill bytes). ``on_pass`` is told when the second pass
    starts, with the number of windows it writes.
    """
    directory = tempfile.mkdtemp(prefix="birdzarr-shuffle-", dir=tmp_dir)
    workers = max(1, writer.workers)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="birdzarr-spill") if workers > 1 else None
    try:
        spill = _Buckets(directory, buckets)
        spiller = _Spiller(spill, seed=seed, buckets=buckets, pool=pool, workers=workers)
        for device_id, sources, blocks in devices:
            spiller.device(device_id, sources, blocks)
        spiller.finish()
        spill.close()
        summaries, dictionaries = spiller.summaries, spiller.dictionaries
        if on_pass is not None:
            on_pass("write", sum(s.entry.n_windows for s in summaries.values()))
        table = DictionaryTable({d: [np.sort(k) for k in known] for d, known in dictionaries.items()},
                                N_CHANNELS)
        sink = writer.slabs.sink
        gimu_codec = sink.codecs[GIMU]
        coded = gimu_codec is not None and gimu_codec.kind == "gdict16"
        if coded:
            sink.code_encoder = table.encode  # gdict16 from the codes, without a sort
        hashers = {device_id: checksum_hasher() for device_id in summaries}
        load = _Loader(spill, table, dictionaries, hashers, seed=seed, coded=coded,
                       chunk_windows=writer.slabs.chunk_windows).load
        del spiller, dictionaries
        # the next bucket is read, decoded and hashed on a thread while this one is written
        loading = pool.submit(load, 0) if pool is not None and buckets else None
        for bucket in range(buckets):
            if loading is not None:
                block = loading.result()
                more = pool is not None and bucket + 1 < buckets
                loading = pool.submit(load, bucket + 1) if pool is not None and more else None
            else:
                block = load(bucket)
            writer.write_mixed(block)
            del block
        for device_id, summary in summaries.items():
            summary.entry.scattered_checksum = hashers[device_id].hexdigest()
            writer.record(summary)
        return {"buckets": buckets, "spill_bytes": spill.bytes_written}
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(directory, ignore_errors=True)


class _Spiller:
    """Pass 1: every window to a bucket drawn from ``seed``, as codes into its device's
    dictionaries, in pieces of one device; keeps the devices' summaries and dictionaries."""

    def __init__(self, spill: _Buckets, *, seed: int, buckets: int, pool: ThreadPoolExecutor | None,
                 workers: int) -> None:
        self.spill, self.buckets, self.pool, self.workers = spill, buckets, pool, workers
        self.draw = np.random.default_rng(seed)
        self.piece_windows = max(256, PASS1_BUFFER_WINDOWS // max(1, buckets))
        self.summaries: dict[int, DeviceSummary] = {}
        self.dictionaries: dict[int, list[np.ndarray]] = {}  # per device and channel, as first seen
        # pieces are encoded on the pool and written in the order they were cut, so each bucket
        # file is the same whatever the number of workers
        self._pending: collections.deque[tuple[int, int, Future[bytes]]] = collections.deque()

    def device(self, device_id: int, sources: list[str], blocks: Iterable[WindowBlock]) -> None:
        summarizer = Summarizer(device_id, sources, start=None)  # scattered: no range
        coder = DeviceCoder(N_CHANNELS)
        held: dict[int, list[tuple[np.ndarray, np.ndarray]]] = collections.defaultdict(list)
        held_windows = np.zeros(self.buckets, dtype=np.int64)
        for block in blocks:
            summarizer.add(block)
            if not len(block):
                continue
            target = self.draw.integers(0, self.buckets, size=len(block))
            order = np.argsort(target, kind="stable")
            codes = coder.codes(block.windows)
            meta = np.empty(len(block), dtype=_META)
            meta["label"], meta["timestamp"] = block.labels, block.timestamps
            bounds = np.searchsorted(target[order], np.arange(self.buckets + 1))
            for bucket in np.flatnonzero(np.diff(bounds)).tolist():
                # each bucket's windows gathered straight from the block (new arrays, not views
                # that would keep the whole block alive until the bucket is released)
                rows = order[bounds[bucket] : bounds[bucket + 1]]
                held[bucket].append((codes[:, rows, :], meta[rows]))
                held_windows[bucket] += len(rows)
                if held_windows[bucket] >= self.piece_windows:
                    self._release(device_id, bucket, held.pop(bucket))
                    held_windows[bucket] = 0
        for bucket in sorted(held):  # a piece never mixes devices
            self._release(device_id, bucket, held[bucket])
        self.summaries[device_id] = summarizer.finish()
        self.dictionaries[device_id] = coder.known

    def _release(self, device_id: int, bucket: int, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
        codes, meta = parts[0] if len(parts) == 1 else (
            np.concatenate([p[0] for p in parts], axis=1), np.concatenate([p[1] for p in parts])
        )
        piece = _Piece(device_id, codes, meta)
        if self.pool is None:
            self.spill.write(bucket, len(meta), encode_piece(piece))
            return
        self._pending.append((bucket, len(meta), self.pool.submit(encode_piece, piece)))
        self._write(keep=4 * self.workers)

    def _write(self, keep: int) -> None:
        while len(self._pending) > keep:
            bucket, n, future = self._pending.popleft()
            self.spill.write(bucket, n, future.result())

    def finish(self) -> None:
        """Write every piece still being encoded."""
        self._write(keep=0)


class _Loader:
    """Pass 2's reading of buckets, one at a time, in order.

    A bucket's pieces are decoded, in the order they were written, into buffers reused from
    bucket to bucket (new memory costs a page fault per 4 KiB); its codes are then permuted into
    new arrays (the writer keeps them until they are written), and each device's windows are
    fed to its checksum in store order."""

    def __init__(self, spill: _Buckets, table: DictionaryTable, dictionaries: dict[int, list[np.ndarray]],
                 hashers: dict[int, WindowChecksum], *, seed: int, coded: bool, chunk_windows: int) -> None:
        self.spill, self.hashers, self.seed, self.coded = spill, hashers, seed, coded
        self.chunk_windows = chunk_windows
        # the store position of each bucket's first window (a shuffled store is written from 0)
        self.starts = np.concatenate(([0], np.cumsum(spill.windows)[:-1])).astype(np.int64)
        # per device and channel, a code of pass 1 (order first seen) -> its value's bit
        # pattern, and its code in the table
        self.lookups = {
            d: [(known[c], table.codes_of(d, c, known[c])) for c in range(N_CHANNELS)]
            for d, known in dictionaries.items()
        }
        largest = int(spill.windows.max(initial=0))
        self.bits = np.empty((largest, WINDOW_LENGTH, N_CHANNELS), dtype=np.uint32)
        self.codes = np.empty((N_CHANNELS, largest, WINDOW_LENGTH), dtype=table.code_dtype) if coded else None
        self.devices = np.empty(largest, dtype=np.int32)
        self.meta = np.empty(largest, dtype=_META)

    def load(self, bucket: int) -> WindowBlock:
        """The bucket's windows permuted with a generator seeded with ``(seed, bucket)``: as
        codes into the table (``coded``) or as float32 windows."""
        n = int(self.spill.windows[bucket])
        at = 0
        for piece in self.spill.pieces(bucket):
            k = len(piece.meta)
            for c, (values, to_table) in enumerate(self.lookups[piece.device_id]):
                np.take(values, piece.codes[c], out=self.bits[at : at + k, :, c], mode="clip")
                if self.codes is not None:
                    np.take(to_table, piece.codes[c], out=self.codes[c, at : at + k], mode="clip")
            self.devices[at : at + k] = piece.device_id
            self.meta[at : at + k] = piece.meta
            at += k
        order = np.random.default_rng([self.seed, bucket]).permutation(n)  # store row -> spilled row
        # Inside each chunk the windows are grouped by device (ascending id, in random order within
        # a device): a chunk is still a uniform sample, and decoding looks each device's values up
        # in its own dictionary while it is in the caches (faster reading, 2% smaller: docs/format.md)
        chunk = (self.starts[bucket] + np.arange(n)) // self.chunk_windows
        devices = self.devices[:n][order]
        grouped = np.lexsort((devices, chunk))
        order, devices = order[grouped], devices[grouped]
        self._hash_in_order(order, devices)
        meta = self.meta[:n][order]
        if self.codes is None:
            windows = np.take(self.bits[:n], order, axis=0).view(np.float32)
            return WindowBlock(windows, meta["timestamp"], meta["label"], DeviceReport(), devices)
        codes = np.take(self.codes[:, :n], order, axis=1).transpose(1, 0, 2)  # (windows, channels, samples)
        # the windows exist only as codes: the writer encodes the chunks from them
        windows = np.broadcast_to(np.float32(np.nan), (n, WINDOW_LENGTH, N_CHANNELS))
        return WindowBlock(windows, meta["timestamp"], meta["label"], DeviceReport(), devices, codes)

    def _hash_in_order(self, order: np.ndarray, devices: np.ndarray) -> None:
        """Feed each device's windows of this bucket to its checksum in ascending store order
        (buckets are loaded one after another, in order)."""
        by_device = np.argsort(devices, kind="stable")
        ids = devices[by_device]
        rows = order[by_device]  # spilled rows, device by device, each in store order
        if not len(ids):
            return
        starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1]))).tolist()
        for start, stop in zip(starts, [*starts[1:], len(ids)], strict=True):
            self.hashers[int(ids[start])].update(np.take(self.bits, rows[start:stop], axis=0).view("<f4"))
