"""Global seeded pre-shuffle at conversion, with memory bounded by one bucket (an external shuffle).

Pass 1 reads every device as usual and sends each window to one of K bucket files, the bucket
drawn uniformly by a generator seeded with ``seed``. Pass 2 loads one bucket at a time, permutes
it with a generator seeded with ``(seed, bucket)`` and appends it to the store. A uniform bucket
per window followed by a uniform permutation inside each bucket is a uniform permutation of all
windows, and the same input and seed give the same store.

Where the bytes go: the bucket files live in a fresh ``birdzarr-shuffle-*`` directory under
``tmp_dir`` (default: the system temporary directory, ``$TMPDIR``), hold every window once,
compressed with the store's own dict16 + lz4 chain (each spilled piece comes from one device,
so it compresses about 3x, like an unshuffled store), and are removed when the conversion ends,
whether it succeeds or fails.
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
from typing import Any, BinaryIO

import numpy as np
from numcodecs import Blosc

from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._summary import DeviceSummary, Summarizer, checksum_hasher
from birdzarr.convert._writer import StoreWriter
from birdzarr.format._codec import decode_dict16, encode_dict16
from birdzarr.format._spec import (
    N_CHANNELS,
    WINDOW_LENGTH,
    DeviceReport,
)

BUCKET_WINDOWS = 262_144  # target windows per bucket: ~84 MB of float32 in memory in pass 2
MAX_BUCKETS = 512  # open files in pass 1
# Pass 1 keeps a device's windows per bucket until a piece is this large (or the device ends):
# pieces of a block's share of 96 buckets (~170 windows at 25 M windows) made the per-piece
# encoding overhead the conversion's main cost. All buckets together hold at most this many
# windows (~88 MB); the spill files, and so the store, are the same.
PASS1_BUFFER_WINDOWS = 2**18
RECORD = np.dtype([
    ("window", "<f4", (WINDOW_LENGTH, N_CHANNELS)), ("device", "<i4"), ("label", "<i4"), ("timestamp", "<i8"),
])
_FRAME = struct.Struct("<QQQ")  # records, bytes of the windows blob, bytes of the metadata blob
_WINDOWS_CODEC = Blosc(cname="lz4", clevel=5, shuffle=Blosc.BITSHUFFLE)  # after dict16
_META_CODEC = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
_META = np.dtype([("device", "<i4"), ("label", "<i4"), ("timestamp", "<i8")])
_META_FIELDS = ("device", "label", "timestamp")
_RECORD_FIELDS = ("window", *_META_FIELDS)


def bucket_count(estimated_windows: int) -> int:
    """Buckets for an input of about this many windows (an over-estimate only costs files)."""
    return max(1, min(MAX_BUCKETS, math.ceil(estimated_windows / BUCKET_WINDOWS)))


class _Buckets:
    """K append-only spill files of compressed window records."""

    def __init__(self, directory: str, count: int) -> None:
        self.paths = [os.path.join(directory, f"bucket-{i:04d}.bin") for i in range(count)]
        self.files: list[BinaryIO] = [open(p, "wb") for p in self.paths]  # noqa: SIM115 (closed in close())
        self.bytes_written = 0

    def add(self, bucket: int, records: np.ndarray) -> None:
        self.write(bucket, encode_piece(records))

    def write(self, bucket: int, piece: bytes) -> None:
        """Append a piece made by ``encode_piece`` (pieces of a bucket are kept in order)."""
        self.files[bucket].write(piece)
        self.bytes_written += len(piece)

    def close(self) -> None:
        for handle in self.files:
            handle.close()

    def load(self, bucket: int) -> np.ndarray:
        parts = []
        with open(self.paths[bucket], "rb") as handle:
            while header := handle.read(_FRAME.size):
                n, windows_size, meta_size = _FRAME.unpack(header)
                part = np.empty(n, dtype=RECORD)
                raw = _WINDOWS_CODEC.decode(handle.read(windows_size))
                part["window"] = decode_dict16(raw, (n, WINDOW_LENGTH, N_CHANNELS))
                meta = np.frombuffer(_META_CODEC.decode(handle.read(meta_size)), dtype=_META)
                for name in _META_FIELDS:
                    part[name] = meta[name]
                parts.append(part)
        os.remove(self.paths[bucket])  # free the disk as pass 2 goes
        return np.concatenate(parts) if parts else np.empty(0, dtype=RECORD)


def encode_piece(records: np.ndarray) -> bytes:
    """One spilled piece: a frame header, the windows (dict16 + lz4), the metadata (lz4)."""
    windows = _WINDOWS_CODEC.encode(encode_dict16(np.ascontiguousarray(records["window"])))
    meta = np.empty(len(records), dtype=_META)
    for name in _META_FIELDS:
        meta[name] = records[name]
    packed = _META_CODEC.encode(meta.view(np.uint8))
    return _FRAME.pack(len(records), len(windows), len(packed)) + windows + packed


def _records(device_id: int, block: WindowBlock) -> np.ndarray:
    records = np.empty(len(block), dtype=RECORD)
    records["window"] = block.windows
    records["device"] = device_id
    records["label"] = block.labels
    records["timestamp"] = block.timestamps
    return records


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
        # pieces are encoded on the pool and written in the order they were cut, so each bucket
        # file is the same whatever the number of workers
        pieces: collections.deque[tuple[int, Future[bytes]]] = collections.deque()

        def spill_piece(bucket: int, records: np.ndarray) -> None:
            if pool is None:
                spill.add(bucket, records)
                return
            pieces.append((bucket, pool.submit(encode_piece, records)))
            while len(pieces) > 4 * workers:
                done_bucket, future = pieces.popleft()
                spill.write(done_bucket, future.result())

        draw = np.random.default_rng(seed)
        summaries: dict[int, DeviceSummary] = {}
        piece_windows = max(256, PASS1_BUFFER_WINDOWS // max(1, buckets))
        held: dict[int, list[np.ndarray]] = collections.defaultdict(list)  # bucket -> records
        held_windows = np.zeros(max(1, buckets), dtype=np.int64)

        def release(bucket: int) -> None:
            parts = held.pop(bucket)
            held_windows[bucket] = 0
            spill_piece(bucket, parts[0] if len(parts) == 1 else np.concatenate(parts))

        for device_id, sources, blocks in devices:
            summarizer = Summarizer(device_id, sources, start=None)  # scattered: no range
            for block in blocks:
                summarizer.add(block)
                if not len(block):
                    continue
                target = draw.integers(0, buckets, size=len(block))
                order = np.argsort(target, kind="stable")
                records = _records(device_id, block)
                bounds = np.searchsorted(target[order], np.arange(buckets + 1))
                for bucket in np.flatnonzero(np.diff(bounds)).tolist():
                    # each bucket's windows gathered straight from the block (a new array, not
                    # a view that would keep the whole block alive until the bucket is released;
                    # and no permuted copy of the whole block first)
                    held[bucket].append(records[order[bounds[bucket] : bounds[bucket + 1]]])
                    held_windows[bucket] += bounds[bucket + 1] - bounds[bucket]
                    if held_windows[bucket] >= piece_windows:
                        release(bucket)
            for bucket in sorted(held):  # a piece never mixes devices: it compresses as one
                release(bucket)
            summaries[device_id] = summarizer.finish()
        while pieces:
            done_bucket, future = pieces.popleft()
            spill.write(done_bucket, future.result())
        spill.close()
        spill_bytes = spill.bytes_written
        if on_pass is not None:
            on_pass("write", sum(s.entry.n_windows for s in summaries.values()))
        hashers = {device_id: checksum_hasher() for device_id in summaries}
        # the next bucket is read and decoded on a thread while this one is permuted and written
        loading = pool.submit(spill.load, 0) if pool is not None and buckets else None
        for bucket in range(buckets):
            if loading is not None:
                records = loading.result()
                more = pool is not None and bucket + 1 < buckets
                loading = pool.submit(spill.load, bucket + 1) if pool is not None and more else None
            else:
                records = spill.load(bucket)
            records = records[np.random.default_rng([seed, bucket]).permutation(len(records))]
            _hash_in_order(hashers, records)
            columns = {name: np.ascontiguousarray(records[name]) for name in _RECORD_FIELDS}
            block = WindowBlock(
                columns["window"], columns["timestamp"], columns["label"], DeviceReport(), columns["device"]
            )
            writer.write_mixed(block)
            del records, block
        for device_id, summary in summaries.items():
            summary.entry.scattered_checksum = hashers[device_id].hexdigest()
            writer.record(summary)
        return {"buckets": buckets, "spill_bytes": spill_bytes}
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(directory, ignore_errors=True)


def _hash_in_order(hashers: dict[int, Any], records: np.ndarray) -> None:
    """Feed each device's windows of this (already permuted) bucket in ascending store order."""
    by_device = np.argsort(records["device"], kind="stable")
    ids = records["device"][by_device]
    if not len(ids):
        return
    starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    for start, stop in zip(starts.tolist(), [*starts[1:].tolist(), len(ids)], strict=True):
        windows = np.ascontiguousarray(records["window"][by_device[start:stop]], dtype="<f4")
        hashers[int(ids[start])].update(windows)
