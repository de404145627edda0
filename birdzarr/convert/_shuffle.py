"""Global seeded pre-shuffle at conversion, with memory bounded by one bucket (an external shuffle).

Pass 1 reads every device as usual and sends each window to one of K bucket files, the bucket
a counter-based hash of ``(seed, device, the window's place among the device's windows)``
(``draw_buckets``: so devices can be spilled apart, in any order, and many devices' windows are
drawn in one vectorised pass). Pass 2 loads one bucket at a time, permutes
it with a generator seeded with ``(seed, bucket)`` and appends it to the store. A uniform bucket
per window followed by a uniform permutation inside each bucket is a uniform permutation of all
windows, and the same input and seed give the same store. Each chunk of the store is therefore a
uniform sample of all windows; inside it, the windows are then grouped by device, which decodes
faster (docs/format.md, shuffled stores) and changes no chunk's membership. The passes run as
tasks on any engine (``_shuffle_processes.write_shuffled_on``): pass 1 by groups of devices
(``Spiller``; a large device's parts in different groups, each part's windows numbered from its
place in the device: ``Spiller.device``'s ``first``), pass 2 by runs of buckets (``BucketLoader``).

Pass 1 spills each window as codes into its device's dictionaries (``DeviceCoder``: a device's
distinct values per channel, found as its windows pass in order). Small devices of partition
files are read, summarised, coded and spilled together (``Spiller.runs``: pieces of many
devices); where every device's windows are known before reading (partition files), the devices
of one dictionary row that a run holds are coded into one sorted dictionary, the row's entries
where the run holds the whole row. After it, the sorted dictionaries seed format 2's dictionary
rows (``seed_rows``: a row that is one sorted dictionary as it is, the others' sorted unions;
consecutive rows that share values merged into one sorted union, ``_merge_rows``), and pass 2
turns the codes back into values for the writer and, where every device was seeded, into the
codes of those rows (a value's place in its row's sorted entries), which the writer then stores
as they are.

Where the bytes go: the bucket files live in a fresh ``birdzarr-shuffle-*`` directory under
``tmp_dir`` (default: the system temporary directory, ``$TMPDIR``), hold every window once as
uint16 codes compressed with lz4 (about 3x smaller than float32), and are removed when the
conversion ends, whether it succeeds or fails.
"""

from __future__ import annotations

import collections
import math
import os
import queue
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

import numpy as np
from numcodecs import Blosc

from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._device_coder import (
    BlockValues,
    DeviceCoder,
    DeviceValues,
    DeviceValuesBuilder,
    _sorted_codes,
    block_values,
    run_codes,
)
from birdzarr.convert._duplicates import PartKeys, repeated_in_runs
from birdzarr.convert._parquet import PartitionRuns
from birdzarr.convert._sources import file_name
from birdzarr.convert._summary import DeviceSummary, Summarizer, summarize_run_columns
from birdzarr.format import _v2
from birdzarr.format._device_columns import DeviceColumns
from birdzarr.format._digest import fmix64, window_hashes
from birdzarr.format._rows import RowCoder, shared_groups
from birdzarr.format._share import MIN_SHARED, share_groups
from birdzarr.format._spec import (
    N_CHANNELS,
    WINDOW_LENGTH,
    DeviceReport,
)

BUCKET_WINDOWS = 131_072  # target windows per bucket (pass 2 holds one at a time: docs/conversion.md)
MAX_BUCKETS = 512  # open files in pass 1
# Blocks (or device ends) pass 1 has queued per worker while their values are being found
FINDING_PER_WORKER = 2
# Pass 1 keeps a device's windows per bucket until a piece is this large (or the device ends):
# pieces of a block's share of 96 buckets (~170 windows at 25 M windows) made the per-piece
# encoding overhead the conversion's main cost. All buckets together hold at most this many
# windows (~44 MB of uint16 codes); the spill files, and so the store, are the same.
PASS1_BUFFER_WINDOWS = 2**18
# A piece: windows, device id, bytes per code, bytes of the codes blob, bytes of the metadata blob,
# the part of a split device it belongs to (-1: a whole device, or many)
_FRAME = struct.Struct("<QqQQQq")
# Bit shuffle before lz4: on the codes of the benchmark's devices (first-seen order) it stores
# 1.27x less than byte shuffle (95 against 119 MB of spill for 1 M windows) at the same
# conversion time (4 alternating runs)
_CODES_CODEC = Blosc(cname="lz4", clevel=5, shuffle=Blosc.BITSHUFFLE)
_META_CODEC = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
_META = np.dtype([("label", "<i4"), ("timestamp", "<i8"), ("device", "<i8")])
T = TypeVar("T")
# draw_buckets' keys: the seed's stream, and the Weyl step between a device's windows (splitmix64's)
_BUCKET_STREAM = 0xB0C4E7_5EED_D2A3
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def draw_buckets(seed: int, devices: np.ndarray, counts: np.ndarray, first: np.ndarray | int,
                 buckets: int) -> np.ndarray:
    """The buckets (int64, uniform in ``0..buckets-1``) of ``counts[k]`` consecutive windows of
    device ``devices[k]``, the first of them its window number ``first[k]`` (its place among the
    device's windows, from 0), device after device. A window's bucket is a hash of (seed, device,
    window number) alone: splitmix64's sequence ``fmix64(base + (i + 1) * golden)`` from a base
    hashed from the seed and the device, its high 32 bits scaled to ``buckets`` (multiply and
    shift). So it does not depend on how the device's windows are cut into blocks or runs, nor on
    which worker or engine draws it, and many devices are drawn in one vectorised pass."""
    counts = np.asarray(counts, np.int64)
    with np.errstate(over="ignore"):
        key = fmix64(np.array([(seed ^ _BUCKET_STREAM) & 0xFFFFFFFFFFFFFFFF], np.uint64))
        base = fmix64(fmix64(np.asarray(devices, np.int64).view(np.uint64) + key) ^ key)
        step = np.arange(int(counts.sum()), dtype=np.int64)
        step -= np.repeat(np.cumsum(counts) - counts, counts)  # each window's place in its count
        step += np.repeat(np.asarray(first, np.int64) + 1, counts) if np.ndim(first) else int(first) + 1
        mixed = fmix64(np.repeat(base, counts) + step.view(np.uint64) * _GOLDEN)
    return ((mixed >> np.uint64(32)) * np.uint64(buckets) >> np.uint64(32)).view(np.int64)


@dataclass
class _Piece:
    """Windows spilled together: codes ``(channels, n, samples)`` into each window's device's
    dictionaries (``DeviceCoder``), labels, times and devices (``_META``). ``device_id`` is the
    one device of them all, or -1 for a piece of many small devices (``Spiller.runs``); ``part``
    the part of a split device whose own dictionaries the codes point into (``SpilledPart``),
    or -1."""

    device_id: int
    codes: np.ndarray
    meta: np.ndarray
    part: int = -1


def _submit(pool: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any) -> Future[T]:
    """``fn(*args)`` on ``pool``, or at once in the calling thread where there is none
    (``workers=1``): the callers wait on a future either way."""
    if pool is not None:
        return pool.submit(fn, *args)
    done: Future[T] = Future()
    done.set_result(fn(*args))
    return done


def bucket_count(estimated_windows: int) -> int:
    """Buckets for an input of about this many windows (an over-estimate only costs files)."""
    return max(1, min(MAX_BUCKETS, math.ceil(estimated_windows / BUCKET_WINDOWS)))


class SpillBuckets:
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

    def reading(self) -> SpillFiles:
        """The files, closed, to be read back."""
        return SpillFiles([[path] for path in self.paths], self.windows)


@dataclass
class SpillFiles:
    """Each bucket's spill files, in the order their pieces are read, and its windows."""

    paths: list[list[str]]
    windows: np.ndarray

    def pieces(self, bucket: int) -> Iterator[_Piece]:
        """The bucket's pieces in the order they were written; each file is deleted once read
        (pass 2 frees the disk as it goes)."""
        for path in self.paths[bucket]:
            yield from _read_pieces(path)


def _read_pieces(path: str) -> Iterator[_Piece]:
    with open(path, "rb") as handle:
        data = memoryview(handle.read())
    os.remove(path)
    at = 0
    while at < len(data):
        n, device_id, code_bytes, codes_size, meta_size, part = _FRAME.unpack_from(data, at)
        at += _FRAME.size
        codes = np.frombuffer(_CODES_CODEC.decode(data[at : at + codes_size]), f"<u{code_bytes}")
        at += codes_size
        meta = np.frombuffer(_META_CODEC.decode(data[at : at + meta_size]), dtype=_META)
        at += meta_size
        yield _Piece(device_id, codes.reshape(N_CHANNELS, n, WINDOW_LENGTH), meta, part)  # views


def encode_piece(piece: _Piece) -> bytes:
    """One spilled piece: a frame header, the codes (lz4), the metadata (lz4)."""
    codes = _CODES_CODEC.encode(np.ascontiguousarray(piece.codes))
    packed = _META_CODEC.encode(piece.meta)
    code_bytes = piece.codes.dtype.itemsize
    return (_FRAME.pack(len(piece.meta), piece.device_id, code_bytes, len(codes), len(packed), piece.part)
            + codes + packed)


@dataclass(frozen=True)
class SeededRows:
    """What ``seed_rows`` opened: the devices left out (their rows open as pass 2 codes them),
    and per coded channel each pass-1 code's code in its row, indexed as the dictionaries
    (``DeviceValues``: ``starts[c][k] + code``), what pass 2 hands the writer; None for a channel
    where every pass-1 code already is its row code (each row one part, sorted)."""

    left_out: list[int]
    row_codes: list[np.ndarray | None]  # per coded channel: uint16, or None (the codes as they are)


_SEED_BATCH = 1 << 19  # dictionary entries sorted at once by seed_rows (bounded memory: ~40 MB)


def seed_rows(coder: RowCoder, dictionaries: DeviceValues, counts: Sequence[int],
              devices: np.ndarray | None = None) -> SeededRows:
    """Format 2: open every device's row with its values from pass 1, sorted by bit pattern
    (the row then holds every value its windows use and never grows), in ascending device id.
    Consecutive small devices (``_rows.shared_groups`` of the ids ``devices`` and their window
    ``counts``) share their entries: the sorted union of their values. Consecutive rows that
    share values are then merged as resident mode merges them (``_merge_rows``): their devices
    share the sorted union of the rows' entries, so that the store holds the small table and
    every reader's lookups stay in the caches. Devices with more than 65,535 distinct values in
    a channel are left out: their rows open as pass 2 codes them (the overflow rule).

    ``dictionaries`` are pass 1's parts: each a device (``devices`` None: the parts' ids are the
    devices), or consecutive devices of one group coded together (``Spiller.runs``: the part's
    id its first device); every part must lie in one row. A row of one part whose entries are
    sorted (``run_codes``) is seeded with them as they are, its codes unchanged; the others'
    entries (parts of a row, or a device coded alone, in first-seen order) become keys
    ``row << 32 | value``, factorised sorted a batch of whole rows at a time (``_row_ranks``), so
    a value's code in its row is its rank among the distinct keys of that row.

    Memory (this process): besides the dictionaries, every row's sorted entries (what the coder
    then holds: at most 4 B a pass-1 entry), the row codes (2 B a pass-1 entry a channel), and
    while merging, the merged rows' unions (no more entries than their rows) and a sample of 1 in
    32 of a group's entries."""
    parts = dictionaries.ids
    ids = parts if devices is None else np.asarray(devices, np.int64)
    n_parts = len(parts)
    sizes = np.stack([np.diff(dictionaries.starts[c]) for c in range(_v2.N_CODED)]).max(axis=0, initial=0)
    over = sizes > _v2.MAX_ENTRIES  # a part of a group holds at most 40,960 values a channel: one device
    groups = shared_groups(ids.tolist(), counts, alone=set(parts[over].tolist()))
    row_of = np.arange(len(ids))  # each device's row: the index of its first device
    for group in groups:
        k = int(np.searchsorted(ids, group[0]))
        row_of[k : k + len(group)] = k
    head = np.searchsorted(ids, parts)  # each part's first device
    if len(ids) and not np.array_equal(row_of, row_of[head][np.searchsorted(parts, ids, "right") - 1]):
        raise RuntimeError("pass 1 coded devices of two dictionary rows together (their window counts "
                           "differ from the partition files' rows)")
    part_row = row_of[head]
    rows = np.flatnonzero(np.r_[True, part_row[1:] != part_row[:-1]]) if n_parts else np.empty(0, np.intp)
    ends = np.append(rows[1:], n_parts).astype(np.intp)  # each row's parts: rows[r] to ends[r]
    seeded = ~over[rows]
    row_codes: list[np.ndarray | None] = []
    unions: list[list[np.ndarray | None]] = [[None] * len(rows) for _ in range(_v2.N_CODED)]
    for c in range(_v2.N_CODED):
        values, starts = dictionaries.values[c], dictionaries.starts[c]
        # rows to sort: several parts, or a part not in ascending order (a device coded alone)
        mixed = np.zeros(n_parts, bool)
        falls = np.flatnonzero(values[1:] <= values[:-1]) + 1
        where = np.searchsorted(starts, falls, "right") - 1
        mixed[where[falls > starts[where]]] = True
        sort = seeded & ((ends - rows > 1) | mixed[rows])
        codes = None
        if sort.any():
            codes = np.zeros(len(values), np.uint16)  # a left-out device's wrap: pass 2 codes its windows
        first = 0
        while first < len(rows):  # a batch of whole rows
            last = int(np.searchsorted(starts[ends], starts[rows[first]] + _SEED_BATCH, "right"))
            last = max(last, first + 1)
            lo, hi = int(starts[rows[first]]), int(starts[ends[last - 1]])
            row_lo = starts[rows[first:last]] - lo  # each row's entries in the batch
            row_hi = starts[ends[first:last]] - lo
            if codes is not None:  # a sorted row's codes are its part's: their place in it
                part_lo = starts[rows[first] : ends[last - 1] + 1]
                codes[lo:hi] = np.arange(hi - lo) - np.repeat(part_lo[:-1] - lo, np.diff(part_lo))
            picked = np.flatnonzero(sort[first:last])
            for r in np.flatnonzero(~sort[first:last] & seeded[first:last]).tolist():
                unions[c][first + r] = values[lo + row_lo[r] : lo + row_hi[r]]
            if len(picked):
                assert codes is not None
                lengths = row_hi[picked] - row_lo[picked]
                offsets = np.cumsum(lengths) - lengths
                take = np.repeat(row_lo[picked] - offsets, lengths) + np.arange(int(lengths.sum()))
                rank, entries, before = _row_ranks(values[lo:hi][take], lengths)
                codes[lo:hi][take] = rank
                after = np.append(before[1:], len(entries))
                for r, a, b in zip(picked.tolist(), before.tolist(), after.tolist(), strict=True):
                    unions[c][first + r] = entries[a:b]
            first = last
        row_codes.append(codes)
    members = {group[0]: group for group in groups}

    def devices_of(r: int) -> list[int]:  # the devices of row r
        return members.get(int(parts[rows[r]]), [int(parts[rows[r]])])

    # a merged run of rows: its rows' devices share one set of entries, seeded under its first device
    merged = _merge_rows(unions, seeded, dictionaries.starts, rows, ends, row_codes)
    joined = {first: [d for r in range(first, stop) for d in devices_of(r)] for first, stop in merged}
    in_joined = {d for group in joined.values() for d in group}
    coder.share([group for group in groups if group[0] not in in_joined] + list(joined.values()))
    inside = {r for first, stop in merged for r in range(first + 1, stop)}
    none = np.empty(0, np.uint32)
    for r in np.flatnonzero(seeded).tolist():
        if r in inside:
            continue
        device = int(parts[rows[r]])
        found = [unions[c][r] for c in range(_v2.N_CODED)]
        coder.seed(device, [none if e is None else e for e in found], joined.get(r, members.get(device, ())))
    return SeededRows(parts[over].tolist(), row_codes)


def _merge_rows(unions: list[list[np.ndarray | None]], seeded: np.ndarray, starts: list[np.ndarray],
                rows: np.ndarray, ends: np.ndarray,
                row_codes: list[np.ndarray | None]) -> list[tuple[int, int]]:
    """Merge consecutive seeded rows that share values (``format._share.share_groups`` with
    ``MIN_SHARED``, as resident mode's ``share_rows``: a union of at most 65,535 entries a
    channel, each row after the first with at least half its entries in the group already), and
    rows with other rows between them never (a left-out device ends a run). A merged run's first
    row's ``unions`` become the run's sorted union (the other rows' are dropped), and each of its
    rows' codes (``row_codes``: a pass-1 code's code in its row, made where None, the pass-1
    codes as they are) its entry's place in the union. Returns the merged runs ``[first, stop)``
    of two rows or more.

    Why: at 100,000 devices of 10 windows the rows held 3.57 M entries (14 MB) against 1.51 M at
    186 devices for the same windows, and a shuffled chunk's lookups spread past the caches
    (docs/scaling.md); merged, both are one row of about 11,000 entries."""
    merged: list[tuple[int, int]] = []
    held = np.flatnonzero(seeded)
    for run in np.split(held, np.flatnonzero(np.diff(held) > 1) + 1) if len(held) else []:
        found = share_groups([[unions[c][r] for c in range(_v2.N_CODED)] for r in run.tolist()],
                             _v2.MAX_ENTRIES, MIN_SHARED)
        for first, stop, union in found:
            if union is None:
                continue
            first, stop = int(run[first]), int(run[0]) + stop
            for c in range(_v2.N_CODED):
                codes = row_codes[c]
                if codes is None:  # every row one sorted part: a pass-1 code is its place in the part
                    codes = row_codes[c] = _places(starts[c])
                for r in range(first, stop):
                    own = unions[c][r]
                    assert own is not None
                    place = np.searchsorted(union[c], own).astype(np.uint16)
                    lo, hi = int(starts[c][rows[r]]), int(starts[c][ends[r]])
                    codes[lo:hi] = place[codes[lo:hi]]
                    unions[c][r] = None
                unions[c][first] = union[c]
            merged.append((first, stop))
    return merged


def _places(starts: np.ndarray) -> np.ndarray:
    """Each entry's place in its part (uint16, as ``seed_rows`` codes a part's entries; a
    left-out device's wrap), for parts starting at ``starts`` (the last: the entries' end), a
    batch of ``_SEED_BATCH`` entries at a time (no 8-byte array of every entry)."""
    n = int(starts[-1])
    codes = np.empty(n, np.uint16)
    for lo in range(0, n, _SEED_BATCH):
        at = np.arange(lo, min(n, lo + _SEED_BATCH))
        codes[lo : lo + len(at)] = at - starts[np.searchsorted(starts, at, "right") - 1]
    return codes


def _row_ranks(values: np.ndarray, row_len: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive rows' entries ``values`` (uint32; row ``r``: ``row_len[r]`` of them, the rows
    end to end): each entry's rank among its row's distinct values (int64), the rows'
    distinct values one row after another (uint32, each row's ascending), and where each row's
    start among them. One sorted factorisation of the keys ``row << 32 | value``
    (``_device_coder._sorted_codes``, ``run_codes``' sort)."""
    rel = np.repeat(np.arange(len(row_len), dtype=np.uint64), row_len)
    rank, distinct = _sorted_codes((rel << np.uint64(32)) | values)
    before = np.searchsorted(distinct >> np.uint64(32), np.arange(len(row_len), dtype=np.uint64))
    rank -= np.repeat(before, row_len)
    return rank, (distinct & np.uint64(0xFFFFFFFF)).astype(np.uint32), before.astype(np.int64)


def _by_bucket(codes: np.ndarray, meta: np.ndarray, target: np.ndarray,
               buckets: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """Windows (codes ``(channels, n, samples)`` and ``meta``) in the order of their buckets
    ``target`` (stable: each bucket keeps their order), gathered at once (one take, not a fancy
    index on the middle axis per bucket: 1.4x faster), and each non-empty bucket's
    ``(bucket, start, stop)`` in that order."""
    order = np.argsort(target, kind="stable")
    bounds = np.searchsorted(target[order], np.arange(buckets + 1))
    cuts = [(b, int(bounds[b]), int(bounds[b + 1])) for b in np.flatnonzero(np.diff(bounds)).tolist()]
    return np.take(codes, order, axis=1), meta[order], cuts


@dataclass
class SpilledPart:
    """What pass 1 leaves of one part of a split device (``_segments.split_large``): its summary
    (a ``Summarizer`` of the part's windows alone: no range, its own digest), its dictionaries
    (``DeviceCoder.known``: the part's distinct values per channel, in the order first seen in
    it), into which its pieces' codes point (``_Piece.part``), and its duplicate-check keys
    (``PartKeys``, set by the task that read it). The converting process merges a device's parts
    (``merge_part_dictionaries``; ``_summary.merge_parts``; ``repeated_in_parts``)."""

    device_id: int
    index: int
    summary: DeviceSummary
    known: list[np.ndarray]
    keys: PartKeys | None = None


def merge_part_dictionaries(parts: list[list[np.ndarray]]) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """A split device's dictionaries from its parts' (``parts[k][c]``: part ``k``'s distinct
    values of channel ``c`` in the order first seen in it, parts in device order): per channel
    the values in the order first seen in the whole device, which is what one ``DeviceCoder``
    fed every part in turn finds (a value's first sight is in the first part holding it, at its
    place there); and per part and channel each of its codes' code in them (uint32), what pass 2
    turns its pieces' codes into (``BucketLoader``)."""
    merged: list[np.ndarray] = []
    codes: list[list[np.ndarray]] = [[] for _ in parts]
    for c in range(len(parts[0]) if parts else 0):
        every = np.concatenate([part[c] for part in parts]).astype(np.uint32)
        _, first, inverse = np.unique(every, return_index=True, return_inverse=True)
        kept = np.sort(first)  # each distinct value's first place, in order of first sight
        merged.append(every[kept])
        code = np.searchsorted(kept, first).astype(np.uint32)[inverse.reshape(-1)]
        at = 0
        for k, part in enumerate(parts):
            codes[k].append(code[at : at + len(part[c])])
            at += len(part[c])
    return merged, codes


class _DeviceSpill:
    """One device's state in pass 1: its summary so far, its dictionaries and the windows it
    holds per bucket until a piece is large enough (or the device ends)."""

    def __init__(self, device_id: int, sources: list[str], buckets: int, seed: int, *, first: int = 0,
                 part: int = -1) -> None:
        self.device_id = device_id
        self.seed = seed
        self.part = part  # the part of a split device (``SpilledPart``), or -1: the whole device
        # the device's windows placed so far (from the part's first window number, ``first``):
        # the next one's number (draw_buckets)
        self.placed = first
        self.summarizer = Summarizer(device_id, sources, start=None)  # scattered: no range
        self.coder = DeviceCoder(N_CHANNELS)
        self.held: dict[int, list[tuple[np.ndarray, np.ndarray]]] = collections.defaultdict(list)
        self.held_windows = np.zeros(buckets, dtype=np.int64)


# a block of a device and its values being found; (device, None, None) marks the device's end
_Finding = tuple[_DeviceSpill, WindowBlock | None, Future[BlockValues] | None]


class Spiller:
    """Pass 1: every window to a bucket drawn from ``seed``, as codes into its device's
    dictionaries, in pieces of one device; keeps the devices' summaries and dictionaries.

    With a pool, each block's values (the hashing, most of coding a block) are found on the
    pool while later blocks, of this device or the next ones, are read: most devices are one
    block. Blocks are then coded and placed in order, and pieces compressed on the pool are
    appended by one thread in the order they were cut, so the spill is the same with any
    number of workers."""

    def __init__(self, spill: SpillBuckets, *, seed: int, buckets: int, pool: ThreadPoolExecutor | None,
                 file_writer: ThreadPoolExecutor | None, workers: int,
                 buffer_windows: int = PASS1_BUFFER_WINDOWS) -> None:
        self.spill, self.buckets, self.pool, self.workers = spill, buckets, pool, workers
        self.seed = seed
        self.piece_windows = max(256, buffer_windows // max(1, buckets))
        self.file_writer = file_writer
        # blocks being coded at once: none left waiting when everything runs in this thread
        self.finding_depth = 0 if pool is None else FINDING_PER_WORKER * workers
        self.summaries: dict[int, DeviceSummary] = {}  # devices read alone
        self.columns: list[DeviceColumns] = []  # devices read together (``runs``), as columns
        self.parts: list[SpilledPart] = []  # parts of split devices, with their own dictionaries
        # per device and channel, as first seen: devices read alone, then runs read together
        self._known: list[tuple[int, list[np.ndarray]]] = []
        self._dictionaries = DeviceValuesBuilder(N_CHANNELS)
        # blocks whose values are being found (block None: the device's end), in input order
        self._finding: collections.deque[_Finding] = collections.deque()
        self._pending: collections.deque[Future[None]] = collections.deque()  # pieces being written

    def device(self, device_id: int, sources: list[str], blocks: Iterable[WindowBlock], *, first: int = 0,
               part: int = -1) -> None:
        """A device read alone, or part ``part`` of a split device (``_segments.split_large``)
        whose first window is the device's window number ``first``: its windows draw the
        buckets the device's would (``draw_buckets``), and its codes point into dictionaries of
        its own, kept with its summary apart (``parts``) for the converting process to merge."""
        state = _DeviceSpill(device_id, sources, self.buckets, self.seed, first=first, part=part)
        for block in blocks:
            state.summarizer.add(block)
            if len(block):
                values = _submit(self.pool, block_values, block.windows, state.coder.size_hints())
                self._finding.append((state, block, values))
                self._advance(keep=self.finding_depth)
        self._finding.append((state, None, None))
        self._advance(keep=self.finding_depth)

    def runs(self, found: PartitionRuns, device_ids: list[int],
             rows: np.ndarray | None = None) -> dict[int, int]:
        """Consecutive small devices read together (``_parquet.read_runs``), spilled at once:
        summarised as columns (``summarize_run_columns``, kept in ``columns``), checked for
        repeats (``repeated_in_runs``) and coded (``run_codes``) in one vectorised pass each;
        each window's bucket drawn as ``device`` draws it (``draw_buckets``, all devices at
        once), and each bucket's windows (device after device, each device's in order: what
        ``device`` gives a bucket, device by device) cut as one piece of many devices. ``rows``:
        each device's dictionary row (the id of its group's first device, ``shared_groups``),
        known before it is read: consecutive devices of one row are coded into one dictionary (a
        part, under its first device's id; their row's sorted entries where the run holds the
        whole row), else each device into its own. Returns the devices' repeated windows (those
        with any)."""
        self._advance(keep=0)  # the devices before cut their pieces first: a bucket keeps device order
        counts = found.counts
        hashes = window_hashes(found.windows, found.timestamps)
        problems: dict[int, list[str]] = {}
        if found.notes:
            reports = found.reports
            problems = {k: reports[k].problems for k in found.noted_devices()}
        self.columns.append(summarize_run_columns(
            np.asarray(device_ids, np.int64), None, counts, found.windows, found.timestamps, found.labels,
            [file_name(f) for f in found.files], found.file_at, found.file_bounds, problems, hashes=hashes))
        repeated = repeated_in_runs(hashes, counts)
        ids = np.asarray(device_ids, np.int64)
        if rows is not None and len(ids):
            cut = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
            codes, dictionaries = run_codes(found.windows, np.add.reduceat(counts, cut), ids[cut])
        else:
            codes, dictionaries = run_codes(found.windows, counts, ids)
        self._flush_known()
        self._dictionaries.add(dictionaries)
        if len(found.windows):
            target = draw_buckets(self.seed, np.asarray(device_ids, np.int64), counts, 0, self.buckets)
            meta = np.empty(len(target), dtype=_META)
            meta["label"], meta["timestamp"], meta["device"] = found.labels, found.timestamps, found.devices
            codes, meta, cuts = _by_bucket(codes, meta, target, self.buckets)
            for bucket, start, stop in cuts:
                self._release(-1, bucket, [(codes[:, start:stop, :], meta[start:stop])])
        return {device_ids[k]: int(repeated[k]) for k in np.flatnonzero(repeated).tolist()}

    def _advance(self, keep: int) -> None:
        """Code and place found blocks, in order, until at most ``keep`` are left."""
        while len(self._finding) > keep:
            state, block, values = self._finding.popleft()
            if block is None or values is None:
                self._end(state)
            else:
                self._place(state, block, state.coder.codes_of(values.result()))

    def _place(self, state: _DeviceSpill, block: WindowBlock, codes: np.ndarray) -> None:
        """Send each window of the block (coded) to its bucket (``draw_buckets``)."""
        target = draw_buckets(state.seed, np.array([state.device_id], np.int64), np.array([len(block)]),
                              state.placed, self.buckets)
        state.placed += len(block)
        meta = np.empty(len(block), dtype=_META)
        meta["label"], meta["timestamp"], meta["device"] = block.labels, block.timestamps, state.device_id
        # each bucket's run is copied out (new arrays, not views that would keep the whole block
        # alive until the bucket is released)
        codes, meta, cuts = _by_bucket(codes, meta, target, self.buckets)
        for bucket, start, stop in cuts:
            state.held[bucket].append((codes[:, start:stop, :].copy(), meta[start:stop].copy()))
            state.held_windows[bucket] += stop - start
            if state.held_windows[bucket] >= self.piece_windows:
                self._release(state.device_id, bucket, state.held.pop(bucket), state.part)
                state.held_windows[bucket] = 0

    def _end(self, state: _DeviceSpill) -> None:
        for bucket in sorted(state.held):  # a piece never mixes devices
            self._release(state.device_id, bucket, state.held[bucket], state.part)
        state.held.clear()
        if state.part >= 0:
            self.parts.append(SpilledPart(state.device_id, state.part, state.summarizer.finish(),
                                          state.coder.known))
            return
        self.summaries[state.device_id] = state.summarizer.finish()
        self._known.append((state.device_id, state.coder.known))

    def _flush_known(self) -> None:
        if self._known:
            self._dictionaries.add(DeviceValues.of_devices(self._known, N_CHANNELS))
            self._known = []

    def dictionaries(self) -> DeviceValues:
        """Every device's dictionaries, once ``finish`` has run (once: they are handed over)."""
        self._flush_known()
        return self._dictionaries.finish()

    def _release(self, device_id: int, bucket: int, parts: list[tuple[np.ndarray, np.ndarray]],
                 part: int = -1) -> None:
        codes, meta = parts[0] if len(parts) == 1 else (
            np.concatenate([p[0] for p in parts], axis=1), np.concatenate([p[1] for p in parts])
        )
        # compressed on the pool; appended by the one file-writing thread, which takes pieces in
        # the order they were cut, so each bucket file is the same whatever the number of workers
        encoded = _submit(self.pool, encode_piece, _Piece(device_id, codes, meta, part))
        self._pending.append(_submit(self.file_writer, self._append, bucket, len(meta), encoded))
        self._wait(keep=4 * self.workers)

    def _append(self, bucket: int, n_windows: int, encoded: Future[bytes]) -> None:
        self.spill.write(bucket, n_windows, encoded.result())

    def _wait(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().result()

    def finish(self) -> None:
        """Place every block still being coded; write every piece still being compressed."""
        self._advance(keep=0)
        self._wait(keep=0)


def _grouped(chunk: np.ndarray, devices: np.ndarray) -> np.ndarray:
    """``np.lexsort((devices, chunk))``: windows by chunk (ascending), then device, ties in
    place order. Where the chunks' span, the ids (non-negative) and the places fit 63 bits,
    one sort of ``chunk << a | device << b | place`` (numpy's vectorised sort: 5-8x faster than
    lexsort on a bucket of 90,000 windows of 100,000 devices)."""
    n = len(chunk)
    if not n:
        return np.empty(0, np.intp)
    low = int(chunk[0])
    place_bits = max(1, (n - 1).bit_length())
    device_bits = max(1, int(devices.max()).bit_length())
    if int(devices.min()) < 0 or (int(chunk[-1]) - low).bit_length() + device_bits + place_bits > 63:
        return np.lexsort((devices, chunk))
    packed = (chunk - low).astype(np.int64) << (device_bits + place_bits)
    packed |= devices.astype(np.int64) << place_bits
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    packed &= (1 << place_bits) - 1
    return packed


class _Scratch:
    """One load's buffers, reused from bucket to bucket (new memory costs a page fault per
    4 KiB): a bucket's float32 values (as bit patterns), devices and metadata in the order they
    were spilled; with ``coded``, their format 2 codes too."""

    def __init__(self, windows: int, coded: bool) -> None:
        self.bits = np.empty((windows, WINDOW_LENGTH, N_CHANNELS), dtype=np.uint32)
        self.devices = np.empty(windows, dtype=np.int32)
        self.meta = np.empty(windows, dtype=_META)
        self.codes = np.empty((windows if coded else 0, WINDOW_LENGTH, _v2.N_CODED), dtype=np.uint16)


class BucketLoader:
    """Pass 2's reading of buckets, ``slots`` at once (each on its own thread or process).

    A bucket's pieces are decoded, in the order they were written, into one slot's buffers as
    float32 values. They are then permuted into new arrays (the writer keeps them until they are
    written). Loads are independent: any bucket, in any order, on any thread."""

    def __init__(self, spill: SpillFiles, dictionaries: DeviceValues, *, seed: int,
                 chunk_windows: int, slots: int = 1, first_row: int | None = None,
                 row_codes: list[np.ndarray | None] | None = None, devices: np.ndarray | None = None,
                 part_codes: dict[tuple[int, int], list[np.ndarray]] | None = None) -> None:
        self.spill, self.seed = spill, seed
        # the parts of split devices: (device, part) -> per channel, each of the part's codes'
        # code in its device's dictionaries (``merge_part_dictionaries``)
        self.part_codes = {} if part_codes is None else part_codes
        self._parts: dict[tuple[int, int], tuple[list[np.ndarray], list[np.ndarray | None]]] = {}
        self.chunk_windows = chunk_windows
        # the store position of each bucket's first window (a shuffled store is written from 0)
        self.starts = np.concatenate(([0], np.cumsum(spill.windows)[:-1])).astype(np.int64)
        # per device and channel, a code of pass 1 (order first seen) -> its value's bit pattern
        self.lookups = dictionaries
        largest = int(spill.windows.max(initial=0))
        self._free: queue.SimpleQueue[_Scratch] = queue.SimpleQueue()
        for _ in range(max(1, min(slots, len(spill.windows)))):
            self._free.put(_Scratch(largest, first_row is not None))
        # format 2, every device seeded: the ``k``-th of ``devices`` (ascending ids; the
        # dictionaries' parts where None) has row ``first_row + k``, and a window's codes are
        # its pass-1 codes through ``row_codes`` (``SeededRows``: their values' places in its
        # row's sorted entries; a channel's None: the pass-1 codes are those places): the bucket
        # is handed over coded (``WindowBlock.coded``), not searched for again by the writer's coder
        if first_row is None and row_codes is not None:
            raise ValueError("row_codes need first_row")
        self.first_row = first_row
        self.row_codes: list[np.ndarray | None] = (
            [None] * _v2.N_CODED if row_codes is None else list(row_codes))
        self.devices = dictionaries.ids if devices is None else devices

    def load(self, bucket: int) -> WindowBlock:
        """The bucket's windows permuted with a generator seeded with ``(seed, bucket)``, as
        float32 windows (at most ``slots`` at once)."""
        scratch = self._free.get()
        try:
            n, order, devices = self._decode(bucket, scratch)
            meta = scratch.meta[:n][order]
            windows = np.take(scratch.bits[:n], order, axis=0).view(np.float32)
            coded = None
            if self.first_row is not None:
                rows = self.first_row + np.searchsorted(self.devices, devices)
                coded = (np.take(scratch.codes[:n], order, axis=0), rows.astype(np.int64))
            return WindowBlock(windows, meta["timestamp"], meta["label"], DeviceReport(), devices,
                               coded=coded)
        finally:
            self._free.put(scratch)

    def _many(self, piece: _Piece, out: np.ndarray, codes: np.ndarray | None) -> None:
        """Decode a piece of many devices into ``out`` (and its row codes into ``codes``): every
        device's dictionaries laid end to end a channel, each code offset by its device's start,
        one take a channel."""
        ids, values, starts = self.lookups.ids, self.lookups.values, self.lookups.starts
        which = np.searchsorted(ids, piece.meta["device"], "right") - 1  # each window's part
        for c in range(N_CHANNELS):
            index = piece.codes[c].astype(np.int64)
            index += starts[c][which][:, None]
            np.take(values[c], index, out=out[:, :, c], mode="clip")
            if codes is not None and c < _v2.N_CODED:
                row_codes = self.row_codes[c]
                if row_codes is None:
                    codes[:, :, c] = piece.codes[c]
                else:
                    np.take(row_codes, index, out=codes[:, :, c], mode="clip")

    def _device_tables(self, device_id: int) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """A device's lookups from its pass-1 codes: per channel their values (bit patterns), and
        per coded channel their row codes (None: the codes are those), views of the plan's."""
        device = self.lookups.index(device_id)
        tables: list[np.ndarray | None] = [
            None if row_codes is None else row_codes[self.lookups.starts[c][device]:]
            for c, row_codes in enumerate(self.row_codes)]
        return self.lookups.of(device), tables

    def _part_tables(self, device_id: int, part: int) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """``_device_tables`` for the codes of a split device's part (into its own dictionaries),
        each table composed once with the part's codes in the device's dictionaries (``part_codes``),
        so a part's window costs the lookups a whole device's does."""
        found = self._parts.get((device_id, part))
        if found is None:
            moved = self.part_codes[(device_id, part)]
            lookups, device_tables = self._device_tables(device_id)
            values = [lookup[moved[c]] for c, lookup in enumerate(lookups)]
            tables: list[np.ndarray | None] = []
            if self.first_row is not None:  # the row codes are used: each below 65,536
                tables = [(moved[c] if table is None else table[moved[c]]).astype(np.uint16)
                          for c, table in enumerate(device_tables)]
            found = self._parts[(device_id, part)] = (values, tables)
        return found

    def _decode(self, bucket: int, scratch: _Scratch) -> tuple[int, np.ndarray, np.ndarray]:
        """Decode the bucket into ``scratch``; its windows' store order (as spilled rows) and devices."""
        n = int(self.spill.windows[bucket])
        at = 0
        for piece in self.spill.pieces(bucket):
            k = len(piece.meta)
            codes = scratch.codes[at : at + k] if self.first_row is not None else None
            if piece.device_id >= 0:
                lookups, tables = (self._device_tables(piece.device_id) if piece.part < 0 else
                                   self._part_tables(piece.device_id, piece.part))
                for c, lookup in enumerate(lookups):
                    np.take(lookup, piece.codes[c], out=scratch.bits[at : at + k, :, c], mode="clip")
                if codes is not None:
                    for c, table in enumerate(tables):
                        if table is None:
                            codes[:, :, c] = piece.codes[c]
                        else:
                            np.take(table, piece.codes[c], out=codes[:, :, c], mode="clip")
            else:
                self._many(piece, scratch.bits[at : at + k], codes)
            scratch.devices[at : at + k] = piece.meta["device"]
            scratch.meta[at : at + k] = piece.meta
            at += k
        order = np.random.default_rng([self.seed, bucket]).permutation(n)  # store row -> spilled row
        # Inside each chunk the windows are grouped by device (ascending id, in random order within
        # a device): a chunk is still a uniform sample, and decoding looks each device's values up
        # in its own dictionary while it is in the caches (faster reading, 2% smaller: docs/format.md)
        chunk = (self.starts[bucket] + np.arange(n)) // self.chunk_windows
        devices = scratch.devices[:n][order]
        grouped = _grouped(chunk, devices)
        return n, order[grouped], devices[grouped]
