"""Counting duplicate windows: windows of one device equal to another of its windows in time and
every value (a part exported twice under two names, rows repeated in an export).

They are kept (birdzarr does not guess which copy is wrong), counted in the report
(``report.duplicate_windows``: device id -> count) and announced with a
``birdzarr._errors.DuplicateWindowsWarning``. Each window is reduced to a 64-bit hash of
its timestamp and float32 bytes (8 bytes a window, for one device at a time); two distinct windows
collide with probability about 2**-64. Parquet input has no timestamps, so there equal values
alone count: a bird sitting perfectly still for a whole window would count too.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from birdzarr._errors import DuplicateWindowsWarning
from birdzarr.convert._blocks import WindowBlock


def distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` by a sort. numpy >= 2.3 finds plain ``np.unique`` with a hash
    table: on one device's 1.5 M distinct window hashes 14x slower than the sort (1.17 against
    0.08 s, ``python benchmarks/duplicates.py``), which made the duplicate check the slowest
    thread of a one-device conversion."""
    ordered = np.sort(values, axis=None)
    if len(ordered) < 2:
        return ordered
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


_IN_FLIGHT = 8  # blocks hashed ahead at most: the hasher holds no more than this many blocks


def block_keys(block: WindowBlock) -> tuple[np.ndarray, np.ndarray]:
    return block.window_hashes(), distinct(block.timestamps)


def repeated_windows(
    hashes: list[np.ndarray], times: list[np.ndarray], existing: Callable[[np.ndarray], np.ndarray] | None
) -> int:
    """Windows of one device whose hash another of its windows (or a committed one) has."""
    new = np.concatenate(hashes)
    kinds = distinct(new)
    if existing is not None:
        before = existing(distinct(np.concatenate(times)))
        if len(before):
            kinds = np.setdiff1d(kinds, distinct(before), assume_unique=True)
    return len(new) - len(kinds)


def repeated_in_runs(hashes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``DeviceKeys.repeated`` of many devices at once: ``hashes`` (``window_hashes``) are device
    after device, ``counts[k]`` windows of the ``k``-th; one sort of (device, hash) for all."""
    run = np.repeat(np.arange(len(counts)), counts)
    order = np.lexsort((hashes, run))
    ordered, runs = hashes[order], run[order]
    again = (ordered[1:] == ordered[:-1]) & (runs[1:] == runs[:-1])
    return np.bincount(runs[1:][again], minlength=len(counts))


class DeviceKeys:
    """One device's duplicate-check keys, gathered block by block in the calling thread (a
    worker process reading a device whole: ``_segments.py``, ``_shuffle_processes.py``)."""

    def __init__(self) -> None:
        self.hashes: list[np.ndarray] = []
        self.times: list[np.ndarray] = []

    def add(self, block: WindowBlock) -> None:
        if len(block):
            hashes, times = block_keys(block)
            self.hashes.append(hashes)
            self.times.append(times)

    def repeated(self) -> int:
        """Windows of the device that repeat another of its windows."""
        return repeated_windows(self.hashes, self.times, None) if self.hashes else 0


@dataclass
class PartKeys:
    """What one part of a split device (``_segments.split_large``) sends back for the device's
    duplicate check: its windows and their distinct hashes (sorted; 8 bytes a distinct window).
    The client counts the device's repeated windows once every part is in
    (``repeated_in_parts``): a window repeated in another part counts as one repeated inside a
    part does."""

    windows: int
    hashes: np.ndarray

    @classmethod
    def of(cls, keys: DeviceKeys) -> PartKeys:
        if not keys.hashes:
            return cls(0, np.empty(0, np.uint64))
        every = np.concatenate(keys.hashes)
        return cls(len(every), distinct(every))


_MERGE_SLICE = 1 << 16  # a part's hashes in one slice of ``repeated_in_parts`` at most


def repeated_in_parts(parts: list[PartKeys]) -> int:
    """``DeviceKeys.repeated`` of a device from its parts' keys: its windows less its distinct
    hashes, the same count as one ``DeviceKeys`` fed the whole device.

    The parts' hashes (each sorted and distinct) are counted by value range, never joined into
    one array: the ranges start at every ``_MERGE_SLICE``-th hash of each part, so a range holds
    at most ``_MERGE_SLICE`` hashes of each part, and a hash lies in the same range in every
    part. Joining and sorting them all held three more copies of the device's hashes (8 bytes a
    window each: 67 MB more for 2.7 M windows, at the moment the last part came in)."""
    windows = sum(part.windows for part in parts)
    if not windows:
        return 0
    hashes = [part.hashes for part in parts if len(part.hashes)]
    if len(hashes) < 2:
        return windows - sum(len(one) for one in hashes)
    starts = np.sort(np.concatenate([one[_MERGE_SLICE::_MERGE_SLICE] for one in hashes]))
    cuts = [np.concatenate(([0], np.searchsorted(one, starts), [len(one)])) for one in hashes]
    found = 0
    for k in range(len(starts) + 1):
        piece = np.sort(np.concatenate([one[c[k]:c[k + 1]] for one, c in zip(hashes, cuts, strict=True)]))
        found += len(piece) - int(np.count_nonzero(piece[1:] == piece[:-1]))
    return windows - found


class DuplicateCounter:
    """Watches each device's blocks as they stream to the writer and counts repeated windows.

    The hashing and each device's count run on one thread of its own (numpy releases the GIL),
    beside the thread that hands blocks to the writer, which every block passes through: done in
    that thread they were 11-16% of its samples (py-spy, a 2-worker Parquet conversion)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._counting: list[tuple[int, Future[int]]] = []  # devices whose count is under way
        self._hasher: ThreadPoolExecutor | None = None

    @property
    def counts(self) -> dict[int, int]:
        """Repeated windows per device (devices without repeats left out), every count finished."""
        for device_id, repeated in self._counting:
            if count := repeated.result():
                self._counts[device_id] = self._counts.get(device_id, 0) + count
        self._counting = []
        return self._counts

    def __enter__(self) -> DuplicateCounter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._hasher is not None:
            if exc_type is None:
                _ = self.counts  # finish every count before the thread goes
            self._hasher.shutdown(wait=True, cancel_futures=True)
            self._hasher = None

    def watch(
        self, device_id: int, blocks: Iterator[WindowBlock],
        existing: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> Iterator[WindowBlock]:
        """Pass ``blocks`` through; when they end, count the device's duplicates. ``existing``
        maps the new windows' timestamps to the hashes of the device's committed windows that
        could match (an append compares with what the store holds)."""
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="birdzarr-duplicates")
        pending: collections.deque[Future[tuple[np.ndarray, np.ndarray]]] = collections.deque()
        hashes: list[np.ndarray] = []
        times: list[np.ndarray] = []

        def collect(keep: int) -> None:
            while len(pending) > keep:
                block_hashes, block_times = pending.popleft().result()
                hashes.append(block_hashes)
                times.append(block_times)

        for block in blocks:
            yield block
            # hashed once the consumer is done with the block, while the next one is read: a
            # consumer that hashes it too (a shuffle's digest) has then filled its cache, where
            # two threads at once would both compute it (WindowBlock.window_hashes)
            if len(block):
                pending.append(self._hasher.submit(block_keys, block))
                collect(_IN_FLIGHT)
        collect(0)
        if hashes:  # counted on the hasher's thread while the next device streams
            self._counting.append((device_id, self._hasher.submit(repeated_windows, hashes, times, existing)))

    def add(self, device_id: int, repeated: int) -> None:
        """Count ``repeated`` windows of ``device_id`` found elsewhere (a worker process)."""
        if repeated:
            self._counts[device_id] = self._counts.get(device_id, 0) + repeated

    def report(self) -> dict[str, int]:
        return {str(device): count for device, count in sorted(self.counts.items())}

    def warn(self, where: str) -> None:
        if not self.counts:
            return
        total = sum(self.counts.values())
        shown = ", ".join(f"{device} ({count:,})" for device, count in sorted(self.counts.items())[:10])
        more = f" and {len(self.counts) - 10} more" if len(self.counts) > 10 else ""
        warnings.warn(
            f"{where}: {total:,} window(s) repeat another window of the same device (same time and "
            f"values) in device(s) {shown}{more}. They were kept and are counted in the report "
            "(duplicate_windows). A part exported twice under two names, or repeated rows, does "
            "this: remove the copies from the source and convert again if they are not wanted.",
            DuplicateWindowsWarning, stacklevel=3,
        )
