"""What the device table and the conversion report say about one device, built from its blocks.

One implementation for every way a store is written: the local writer (new store or append),
the Dask write tasks and the shuffle's first pass all feed a device's blocks, in store order,
to a ``Summarizer`` and record the ``DeviceSummary`` it finishes with.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import google_crc32c
import numpy as np

from birdzarr.convert._blocks import WindowBlock
from birdzarr.format._device_columns import DeviceColumns
from birdzarr.format._digest import RowDigest, _with_labels, window_hashes
from birdzarr.format._spec import TIMESTAMP_UNKNOWN, WINDOW_VALUES, DeviceEntry, DeviceRange, DeviceReport

WINDOW_BYTES = WINDOW_VALUES * 4  # a window's float32 bytes, as the checksum reads them


class WindowChecksum:
    """CRC-32C (Castagnoli) of windows' little-endian float32 bytes, fed in order.

    Hardware CRC-32C runs at several GB/s, over ten times BLAKE2b, which cost a fifth of the
    conversion's CPU; the checksums guard against damage, not against an adversary.
    """

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes | memoryview | np.ndarray) -> None:
        """Feed bytes, or a C-contiguous array's bytes: google_crc32c reads an array's buffer
        in place (a memoryview it refuses, and ``bytes()`` of a block is a 5 MB copy)."""
        if isinstance(data, memoryview):
            data = bytes(data)
        elif isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).view(np.uint8)
        self._crc = google_crc32c.extend(self._crc, data)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


CASTAGNOLI = 0x82F63B78  # CRC-32C's polynomial, bit-reversed (as zlib writes CRC-32's 0xedb88320)


def _gf2_times(matrix: list[int], vector: int) -> int:
    """The 32x32 GF(2) matrix ``matrix`` (one column a bit, lowest first) times ``vector``."""
    total, at = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[at]
        vector >>= 1
        at += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, column) for column in matrix]


def crc32c_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc1`` (of ``A``), ``crc2`` (of ``B``) and ``length2``
    (``B``'s bytes), without ``A`` or ``B``: zlib's ``crc32_combine`` (the GF(2) matrix method:
    ``crc1`` run through ``length2`` zero bytes by squaring the one-zero-bit operator, then
    ``crc2`` added) for the Castagnoli polynomial. What joins the checksums of a device's parts
    (``merge_parts``); 32 x 32 x log2(length2) bit steps, microseconds a call."""
    if length2 <= 0:
        return crc1
    odd = [CASTAGNOLI] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)  # one zero byte the first time, then 4, 16, ...
        if length2 & 1:
            crc1 = _gf2_times(even, crc1)
        length2 >>= 1
        if not length2:
            break
        odd = _gf2_square(even)
        if length2 & 1:
            crc1 = _gf2_times(odd, crc1)
        length2 >>= 1
        if not length2:
            break
    return crc1 ^ crc2


def extend_checksum(crc: int, windows: np.ndarray) -> int:
    """``crc`` (a ``WindowChecksum`` value, 0 to start) extended by ``windows``' little-endian
    float32 bytes, without copying contiguous windows: what ``WindowChecksum.update`` does, as a
    function of plain integers for callers that keep many checksums at once (``verify``)."""
    return int(google_crc32c.extend(crc, np.ascontiguousarray(windows, dtype="<f4").view(np.uint8)))


@dataclass(frozen=True)
class DeviceRuns:
    """Positions grouped by device: ``order`` is a stable argsort of the device ids (each
    device's positions stay ascending, the order its checksum is fed in); run ``k`` is device
    ``ids[k]`` at ``order[starts[k]:stops[k]]``."""

    order: np.ndarray
    ids: np.ndarray
    starts: np.ndarray
    stops: np.ndarray

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        """``(device id, start, stop)`` of each run, in ascending device id."""
        return zip(self.ids.tolist(), self.starts.tolist(), self.stops.tolist(), strict=True)


def device_runs(devices: np.ndarray) -> DeviceRuns:
    """Group positions by device id with one stable sort (one mask per device costs
    ``devices x positions``: 1.4x slower for a whole ``verify`` of a shuffled store)."""
    order = np.argsort(devices, kind="stable")
    by_device = devices[order]
    if not len(order):
        return DeviceRuns(order, by_device, order, order)
    starts = np.flatnonzero(np.concatenate(([True], by_device[1:] != by_device[:-1])))
    return DeviceRuns(order, by_device[starts], starts, np.append(starts[1:], len(order)))


def checksum_hasher() -> WindowChecksum:
    """The checksum of a run of curated windows (see ``WindowChecksum``)."""
    return WindowChecksum()


def label_counts(labels: np.ndarray) -> tuple[list[int], list[int]]:
    """The distinct labels (ascending) and their counts; one label (all Parquet input, most
    blocks of CSV input) is counted without sorting."""
    if len(labels) and labels.min() == labels.max():
        return [int(labels[0])], [len(labels)]
    values, counts = np.unique(labels, return_counts=True)
    return values.tolist(), counts.tolist()


@dataclass
class DeviceSummary:
    """One device's row of the device table and its part of the conversion report.

    Dask write tasks return these to the driver, so they stay plain picklable data.
    """

    entry: DeviceEntry
    report: DeviceReport
    # CSV: the rows of the device's unfinished last burst (``_csv.DeviceEnd.unfinished``), which an
    # append continues; None when the blocks did not say (Parquet, or no end block)
    tail: Any = None


class Summarizer:
    """Accumulates a device's summary from its blocks, fed in store order.

    ``start`` is the device's first global window when its windows are stored as one run: the
    entry then gets that range with the checksum of its windows. ``None`` when they are
    scattered (a shuffled store): no range, and the entry gets the order-free digest of its rows
    instead (``scattered_digest``), the same whatever order the shuffle stores them in.
    """

    def __init__(self, device_id: int, sources: list[str], start: int | None) -> None:
        self.entry = DeviceEntry(device_id=device_id, sources=sources)
        self.report = DeviceReport()
        self.start = start
        self._hasher = checksum_hasher() if start is not None else None
        self._digest = RowDigest() if start is None else None
        self.tail: Any = None

    def add(self, block: WindowBlock) -> None:
        self.report.merge(block.report)  # an empty block still reports what was read and dropped
        unfinished = getattr(block, "unfinished", None)  # a CSV device's end (``_csv.DeviceEnd``)
        if unfinished is not None:
            self.tail = unfinished
        if not len(block):
            return
        entry = self.entry
        if self._hasher is not None:
            self._hasher.update(np.ascontiguousarray(block.windows, dtype="<f4"))
        if self._digest is not None:
            self._digest.update_hashed(block.window_hashes(), block.labels)
        for label, count in zip(*label_counts(block.labels), strict=True):
            entry.label_counts[label] = entry.label_counts.get(label, 0) + count
        known = block.timestamps[block.timestamps != TIMESTAMP_UNKNOWN]
        if len(known):
            low, high = int(known.min()), int(known.max())
            entry.first_time = low if entry.first_time == TIMESTAMP_UNKNOWN else min(entry.first_time, low)
            entry.last_time = high if entry.last_time == TIMESTAMP_UNKNOWN else max(entry.last_time, high)
        entry.n_windows += len(block)

    def finish(self) -> DeviceSummary:
        """The summary, once every block has been added (call once)."""
        if self.start is not None and self._hasher is not None and self.entry.n_windows:
            stop = self.start + self.entry.n_windows
            self.entry.ranges.append(DeviceRange(self.start, stop, self._hasher.hexdigest()))
        if self._digest is not None:
            self.entry.scattered_digest = self._digest.hexdigest()
        return DeviceSummary(self.entry, self.report, self.tail)


def merge_entries(old: DeviceEntry, new: DeviceEntry) -> DeviceEntry:
    """One device's entry from two of its entries, ``new``'s windows after ``old``'s (an append's
    windows of a committed device, a split device's parts): windows and label counts added, the
    widest time span, ranges and sources one after the other."""
    bounds = (old.first_time, old.last_time, new.first_time, new.last_time)
    times = [t for t in bounds if t != TIMESTAMP_UNKNOWN]
    labels = dict(old.label_counts)
    for label, count in new.label_counts.items():
        labels[label] = labels.get(label, 0) + count
    return DeviceEntry(
        device_id=old.device_id,
        n_windows=old.n_windows + new.n_windows,
        ranges=[*old.ranges, *new.ranges],
        first_time=min(times) if times else TIMESTAMP_UNKNOWN,
        last_time=max(times) if times else TIMESTAMP_UNKNOWN,
        sources=[*old.sources, *new.sources],
        label_counts=labels,
    )


def merge_parts(parts: list[DeviceSummary], sources: list[str]) -> DeviceSummary:
    """One device's summary from the summaries of its parts (``Summarizer`` s of consecutive
    window ranges of it, in store order; ``_segments.split_large``): what one ``Summarizer``
    fed every part's blocks in turn gives. The entries merged (``merge_entries``), their ranges
    joined into one whose checksum is the parts' joined (``crc32c_combine``); the reports merged
    in part order. ``sources``: the device's files."""
    entry = functools.reduce(merge_entries, [part.entry for part in parts])
    report = DeviceReport()
    for part in parts:
        report.merge(part.report)
    crc, start, stop = 0, None, None
    for piece in entry.ranges:  # none where a part has no windows
        if stop is not None and piece.start != stop:
            raise ValueError(f"device {entry.device_id}: parts do not follow each other "
                             f"({stop:,} then {piece.start:,})")
        start = piece.start if start is None else start
        stop = piece.stop
        crc = crc32c_combine(crc, int(piece.checksum, 16), (piece.stop - piece.start) * WINDOW_BYTES)
    joined = [] if start is None or stop is None else [DeviceRange(start, stop, f"{crc:08x}")]
    return DeviceSummary(replace(entry, ranges=joined, sources=list(sources)), report)


def column_summaries(runs: DeviceColumns) -> list[DeviceSummary]:
    """One ``DeviceSummary`` a device of ``runs``, as ``Summarizer`` gives them."""
    return [DeviceSummary(entry, report) for entry, report in runs.objects()]


def summarize_run_columns(device_ids: np.ndarray, starts: np.ndarray | None, counts: np.ndarray,
                          windows: np.ndarray, timestamps: np.ndarray, labels: np.ndarray, names: list[str],
                          name_at: np.ndarray, name_bounds: np.ndarray, problems: dict[int, list[str]],
                          hashes: np.ndarray | None = None) -> DeviceColumns:
    """The entries and reports ``Summarizer`` gives devices read together (from partition files),
    as columns (``DeviceColumns``), in one vectorised pass: ``windows`` and the per-window columns
    device after device, ``counts[k]`` windows of ``device_ids[k]``, each device's report its
    windows read and written and ``problems``. Times by ``reduceat``, label counts by one sort;
    stored as runs (the first global window of each ``starts[k]``): a checksum call a device;
    ``starts`` None, scattered (a shuffled store, ``Summarizer(start=None)``): each device's
    order-free digest by one wrapping ``reduceat`` of its rows' hashes (``hashes``: the windows'
    ``window_hashes``, found here where not given)."""
    bounds = np.concatenate(([0], np.cumsum(counts)))
    first_times, last_times = _times(counts, bounds, timestamps)
    label_device, label_value, label_count = _label_columns(counts, labels)
    ids, sizes = np.asarray(device_ids, np.int64), np.asarray(counts, np.int64)
    files, places = np.asarray(name_at, np.int64), np.asarray(name_bounds, np.int64)
    if starts is None:  # scattered: each device's rows' digest, no range
        digests = np.zeros(len(counts), np.uint64)
        held = np.flatnonzero(counts > 0)
        if len(held):
            found = window_hashes(windows, timestamps) if hashes is None else hashes
            with np.errstate(over="ignore"):  # the wrapping sum of their row hashes, as RowDigest adds them
                digests[held] = np.add.reduceat(_with_labels(found, labels), bounds[held], dtype=np.uint64)
        empty = np.empty(0, np.int64)
        return DeviceColumns(ids, sizes, empty, empty.astype(np.uint32), first_times, last_times,
                             label_device, label_value, label_count, names, files, places, problems, digests)
    data = np.ascontiguousarray(windows, dtype="<f4").view(np.uint8)  # what extend_checksum reads
    crc = google_crc32c.extend
    checksums = np.fromiter((crc(0, data[a:b]) if b > a else 0
                             for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)),
                            np.uint32, len(counts))
    return DeviceColumns(ids, sizes, np.asarray(starts, np.int64), checksums, first_times, last_times,
                         label_device, label_value, label_count, names, files, places, problems)


def _times(counts: np.ndarray, bounds: np.ndarray, timestamps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each run's first and last known time (``TIMESTAMP_UNKNOWN`` where none is known)."""
    held = np.flatnonzero(counts > 0)
    first_times = np.full(len(counts), TIMESTAMP_UNKNOWN, np.int64)
    last_times = np.full(len(counts), TIMESTAMP_UNKNOWN, np.int64)
    if len(held):
        at = bounds[held]
        unknown = timestamps == TIMESTAMP_UNKNOWN
        top = np.iinfo(np.int64).max
        low = np.minimum.reduceat(np.where(unknown, top, timestamps), at)
        first_times[held] = np.where(low == top, TIMESTAMP_UNKNOWN, low)
        last_times[held] = np.maximum.reduceat(timestamps, at)  # unknown is int64's minimum
    return first_times, last_times


def _label_columns(counts: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(run, label, windows) of each label in each run, by run then label: one label for all
    (Parquet without labels) at once, else by one sort."""
    held = np.flatnonzero(counts > 0)
    if not len(labels):
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    if labels.min() == labels.max():
        label = np.full(len(held), int(labels[0]), np.int64)
        return held.astype(np.int64), label, counts[held].astype(np.int64)
    run = np.repeat(np.arange(len(counts)), counts)
    order = np.lexsort((labels, run))
    keyed_run, keyed_label = run[order], labels[order]
    changes = (keyed_run[1:] != keyed_run[:-1]) | (keyed_label[1:] != keyed_label[:-1])
    edge = np.flatnonzero(np.r_[True, changes])
    sizes = np.diff(np.append(edge, len(order)))
    return keyed_run[edge].astype(np.int64), keyed_label[edge].astype(np.int64), sizes.astype(np.int64)
