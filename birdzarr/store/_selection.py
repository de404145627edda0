"""Which committed windows an epoch draws from: device filters, seeded splits, labels and time.

A selection answers two questions: how many selected windows each chunk has (for planning) and
which windows of one chunk are selected (when the chunk is read). Device filters on a
device-ordered store use the device table's window ranges and read nothing. Everything that
looks at single windows (a device filter on a shuffled store, the per-window split, labels,
time) is decided once, when the dataset is made, by one pass over the per-window arrays of the
chunks that can hold selected windows, and kept as one bit per store window (packed: 1/8 byte a
window, 3.1 MB at 25 M windows), so reading a chunk later reads no extra array.

The split rule (docs/training.md#subsets-and-splits): a device is in ``val`` when a 64-bit hash
of ``(split_seed, device id)`` is below ``val_fraction * 2**64``; by window, when a hash of
``(split_seed, device id, the window's burst time and its 80 float32 values)`` is. Neither
depends on global indices, chunk layout or the other devices, so appending data or re-converting
(``--shuffle`` or not) never moves a window that was already assigned.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from birdzarr._errors import ArgumentError, DeviceNotFoundError
from birdzarr.format._digest import fmix64, window_hashes
from birdzarr.format._spec import (
    CHANNELS,
    DEVICE,
    GIMU,
    LABEL,
    LABEL_UNLABELLED,
    N_CHANNELS,
    TIMESTAMP,
    TIMESTAMP_UNKNOWN,
    WINDOW_LENGTH,
)
from birdzarr.format._v2 import sorted_distinct
from birdzarr.store._chunks import ChunkReader

SPLITS = ("train", "val")
SPLIT_BY = ("device", "window")
SPLIT_RULE = 2  # recorded in resume states: 2 = hashes of identities (1: permutations, indices)
TimeMask = Callable[[np.ndarray], np.ndarray]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_DEVICE_SALT = 0xD5E1CE5B117  # different salts: the device and window splits of one seed differ
_WINDOW_SALT = 0x3A1D0BB117


def _seed_key(split_seed: int, salt: int) -> np.uint64:
    with np.errstate(over="ignore"):
        seed = np.array([split_seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        return np.uint64(fmix64(np.uint64(salt) + seed * _GOLDEN)[0])


def _threshold(val_fraction: float) -> np.uint64:
    if not 0.0 < val_fraction < 1.0:
        raise ArgumentError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    return np.uint64(min(int(val_fraction * 2.0**64), 2**64 - 1))


def _device_keys(device_ids: np.ndarray, key: np.uint64) -> np.ndarray:
    with np.errstate(over="ignore"):
        return fmix64(np.asarray(device_ids, dtype=np.int64).astype(np.uint64) * _GOLDEN + key)


def device_in_val(device_ids: np.ndarray, *, val_fraction: float, split_seed: int) -> np.ndarray:
    """The device split: True where a device is in ``val``. A pure function of each id and the
    seed (``fmix64(id * 0x9E3779B97F4A7C15 + key) < val_fraction * 2**64``, key from the seed),
    so each device is in ``val`` with probability ``val_fraction``, whatever else the store holds."""
    threshold = _threshold(val_fraction)
    return _device_keys(device_ids, _seed_key(split_seed, _DEVICE_SALT)) < threshold


def window_in_val(
    device_ids: np.ndarray, windows: np.ndarray, timestamps: np.ndarray, *, val_fraction: float,
    split_seed: int,
) -> np.ndarray:
    """The window split: True where a window is in ``val``. A pure function of the seed, the
    window's device, its burst time and its float32 values (``format._digest.window_hashes``),
    never of where the window is stored: windows of one burst differ in their values, so they
    are split apart; identical windows of one device and time go to the same side."""
    threshold = _threshold(val_fraction)
    with np.errstate(over="ignore"):
        keys = _device_keys(device_ids, _seed_key(split_seed, _WINDOW_SALT))
        return fmix64(keys ^ window_hashes(windows, timestamps)) < threshold


def split_devices(
    device_ids: Iterable[int], *, val_fraction: float, split_seed: int
) -> tuple[set[int], set[int]]:
    """The device split of some ids: (train devices, val devices)."""
    ids = np.unique(np.fromiter((int(d) for d in device_ids), np.int64))
    in_val = device_in_val(ids, val_fraction=val_fraction, split_seed=split_seed)
    return set(ids[~in_val].tolist()), set(ids[in_val].tolist())


def unix_seconds(name: str, value: Any) -> int | None:
    """``start``/``stop`` as unix seconds: an integer or float (seconds, floored), a
    ``datetime`` (naive ones are UTC, as the store's times are), a ``numpy.datetime64`` or
    ``pandas.Timestamp``, or an ISO 8601 string (``"2012-06-01"``, UTC)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a datetime, an ISO 8601 string or unix seconds, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        if not np.isfinite(value):
            raise ArgumentError(f"{name} must be a finite time, got {value!r}")
        return int(np.floor(value))
    if isinstance(value, dt.datetime):  # pandas.Timestamp is one
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return int(np.floor(value.timestamp()))
    if isinstance(value, dt.date):
        return int(dt.datetime(value.year, value.month, value.day, tzinfo=dt.UTC).timestamp())
    if isinstance(value, (str, np.datetime64)):
        try:
            stamp = np.datetime64(value.rstrip("Zz") if isinstance(value, str) else value)
        except ValueError:
            raise ArgumentError(f"{name}={value!r} is not an ISO 8601 time (e.g. '2012-06-01' or "
                                "'2012-06-01T12:00:00')") from None
        if np.isnat(stamp):
            raise ArgumentError(f"{name} must be a time, got {value!r}")
        return int(stamp.astype("datetime64[s]").astype(np.int64))
    raise TypeError(f"{name} must be a datetime, an ISO 8601 string or unix seconds, got {value!r}")


@dataclass(frozen=True)
class _AppliedMask:
    """Where an unpicklable ``time_mask`` was: its selection is already made and kept."""

    name: str

    def __call__(self, times: np.ndarray) -> np.ndarray:
        raise RuntimeError(f"time_mask {self.name} did not pickle and was applied before; it cannot be "
                           "applied again in this process")


@dataclass(frozen=True)
class WindowFilter:
    """Filters on single windows: labels and burst time (all must hold)."""

    labelled_only: bool = False
    labels: tuple[int, ...] | None = None
    start: int | None = None  # unix seconds, inclusive
    stop: int | None = None  # unix seconds, exclusive
    time_mask: TimeMask | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled into a ``spawn``/``forkserver`` DataLoader worker: a ``time_mask`` that does
        not pickle (a lambda) becomes a stand-in, since the selection it made is already kept."""
        state = dict(self.__dict__)
        if self.time_mask is not None:
            import pickle

            try:
                pickle.dumps(self.time_mask)
            except (pickle.PicklingError, AttributeError, TypeError):
                state["time_mask"] = _AppliedMask(repr(self.time_mask))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    @property
    def active(self) -> bool:
        return (self.labelled_only or self.labels is not None or self.start is not None
                or self.stop is not None or self.time_mask is not None)

    @property
    def arrays(self) -> tuple[str, ...]:
        """The per-window arrays the filter reads."""
        by_label = self.labelled_only or self.labels is not None
        by_time = self.start is not None or self.stop is not None or self.time_mask is not None
        return (LABEL,) * by_label + (TIMESTAMP,) * by_time

    def mask(self, arrays: dict[str, np.ndarray]) -> np.ndarray | None:
        """The windows that pass (None: no filter)."""
        if not self.active:
            return None
        n = len(next(iter(arrays.values())))
        keep = np.ones(n, dtype=bool)
        if self.labelled_only:
            keep &= arrays[LABEL] != LABEL_UNLABELLED
        if self.labels is not None:
            keep &= np.isin(arrays[LABEL], np.array(self.labels, dtype=np.int64))
        times = arrays.get(TIMESTAMP)
        if self.start is not None or self.stop is not None:
            assert times is not None
            keep &= times != TIMESTAMP_UNKNOWN  # an unknown time is in no range
            if self.start is not None:
                keep &= times >= self.start
            if self.stop is not None:
                keep &= times < self.stop
        if self.time_mask is not None:
            assert times is not None
            chosen = np.asarray(self.time_mask(times.astype(np.int64, copy=False)))
            if chosen.dtype != np.bool_ or chosen.shape != times.shape:
                raise ArgumentError(
                    f"time_mask must return a boolean array of the shape it was given ({times.shape}), "
                    f"got {chosen.dtype} {chosen.shape}"
                )
            keep &= chosen
        return keep


@dataclass(frozen=True, eq=False)
class Selection:
    """Selected windows: an optional device set, held as window ranges (device-ordered store,
    nothing per window) or as one bit per store window (everything else)."""

    device_ids: np.ndarray | None  # the selected device ids, sorted int64; None: every device
    n_windows: int
    chunk_windows: int
    ranges: np.ndarray | None = None  # (k, 2) disjoint, sorted [start, stop) runs; None: no range filter
    bits: np.ndarray | None = None  # packed bits of every chunk, one after the other
    offsets: np.ndarray | None = None  # bits[offsets[c]:offsets[c + 1]] are chunk c's
    chunk_counts: np.ndarray | None = None  # selected windows per chunk, when known

    @functools.cached_property
    def devices(self) -> frozenset[int] | None:
        """The selected devices (None: every device), built when first asked for."""
        return None if self.device_ids is None else frozenset(self.device_ids.tolist())

    @property
    def n_chunks(self) -> int:
        return -(-self.n_windows // self.chunk_windows)

    def chunk_span(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_windows
        return start, min(start + self.chunk_windows, self.n_windows)

    def chunk_mask(
        self, reader: ChunkReader | None, chunk: int, device_ids: np.ndarray | None = None
    ) -> np.ndarray | None:
        """Selected windows of one chunk (None: all of them). Reads nothing."""
        start, stop = self.chunk_span(chunk)
        if self.bits is not None:
            assert self.offsets is not None
            packed = self.bits[self.offsets[chunk] : self.offsets[chunk + 1]]
            return np.unpackbits(packed, count=stop - start).view(bool)
        if self.ranges is not None:
            return _ranges_mask(self.ranges, start, stop)
        return None

    def selected_indices(self, reader: ChunkReader | None, chunk: int) -> np.ndarray:
        """Global indices of the selected windows of one chunk, in stored order."""
        start, stop = self.chunk_span(chunk)
        mask = self.chunk_mask(reader, chunk)
        return np.arange(start, stop) if mask is None else start + np.flatnonzero(mask)

    def counts(self, reader: ChunkReader | None = None) -> np.ndarray:
        """Selected windows per chunk (reads nothing)."""
        if self.chunk_counts is not None:
            return self.chunk_counts.copy()
        bounds = np.minimum(np.arange(self.n_chunks + 1, dtype=np.int64) * self.chunk_windows, self.n_windows)
        if self.ranges is None:
            return np.diff(bounds)
        return np.diff(_selected_below(self.ranges, bounds))

    def label_counts(self, reader: ChunkReader, *, threads: int = 4) -> dict[int, int]:
        """Windows per label among the selected ones (``-1``: unlabelled), ascending labels.
        Reads the ``label`` array of every chunk holding a selected window."""
        chunks = np.flatnonzero(self.counts() > 0).tolist()

        def count(chunk: int) -> tuple[np.ndarray, np.ndarray]:
            labels = reader.read(LABEL, chunk)
            mask = self.chunk_mask(reader, chunk)
            return np.unique(labels if mask is None else labels[mask], return_counts=True)

        totals: dict[int, int] = {}
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="birdzarr-labels") as pool:
            for values, counts in pool.map(count, chunks):
                for value, n in zip(values.tolist(), counts.tolist(), strict=True):
                    totals[int(value)] = totals.get(int(value), 0) + int(n)
        return dict(sorted(totals.items()))

    def channel_stats(self, reader: ChunkReader, *, threads: int = 4) -> SelectionStats:
        """Per-channel count, mean, std (population), min and max of the selected windows, from
        one pass over the chunks holding them (a version-2 chunk: only their codes looked up; one
        chunk per thread in memory; partial results merged with Chan et al.'s pairwise update,
        in float64)."""
        chunks = np.flatnonzero(self.counts() > 0).tolist()

        def one(chunk: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            mask = self.chunk_mask(reader, chunk)
            out = np.empty((reader.chunk_windows, WINDOW_LENGTH, N_CHANNELS), np.float32)
            # only the selected windows are looked up (format 2), in stored order
            rows = reader.read_windows(chunk, None if mask is None else np.flatnonzero(mask), out)
            values = out[rows].reshape(-1, N_CHANNELS).astype(np.float64)
            mean = values.mean(axis=0)
            return (len(values), mean, ((values - mean) ** 2).sum(axis=0), values.min(axis=0),
                    values.max(axis=0))

        n, mean, m2 = 0, np.zeros(N_CHANNELS), np.zeros(N_CHANNELS)
        low, high = np.full(N_CHANNELS, np.inf), np.full(N_CHANNELS, -np.inf)
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="birdzarr-stats") as pool:
            for k, chunk_mean, chunk_m2, chunk_min, chunk_max in pool.map(one, chunks):
                total = n + k
                delta = chunk_mean - mean
                mean = mean + delta * (k / total)
                m2 = m2 + chunk_m2 + delta**2 * (n * k / total)
                n = total
                low, high = np.minimum(low, chunk_min), np.maximum(high, chunk_max)
        windows = n // WINDOW_LENGTH
        return SelectionStats(CHANNELS, windows, n, mean, np.sqrt(m2 / max(n, 1)), low, high)

    def digest(self) -> str | None:
        """A CRC-32 of the per-window bits (None when there are none), for resume states."""
        if self.bits is None:
            return None
        import zlib

        return f"{zlib.crc32(self.bits.tobytes()):08x}"


@dataclass(frozen=True, eq=False)
class SelectionStats:
    """Per-channel statistics of the selected windows, in stored units (g for imu_x/y/z, m/s
    divided by the store's ``gps_scale`` for gps_speed): what the model is fed. ``std`` is the
    population standard deviation (``ddof=0``); ``count`` is values per channel (20 a window)."""

    channels: tuple[str, ...]
    n_windows: int
    count: int
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray

    def to_dataframe(self) -> Any:
        """One row per channel: count, mean, std, min, max (a pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame({"count": self.count, "mean": self.mean, "std": self.std, "min": self.min,
                             "max": self.max}, index=pd.Index(self.channels, name="channel"))


def _ranges_mask(ranges: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Which of ``[start, stop)`` the disjoint sorted ranges cover, without a loop over them."""
    first = int(np.searchsorted(ranges[:, 1], start, side="right"))
    last = int(np.searchsorted(ranges[:, 0], stop, side="left"))
    edges = np.zeros(stop - start + 1, dtype=np.int32)
    if first < last:
        part = ranges[first:last]
        edges[np.maximum(part[:, 0], start) - start] += 1  # starts are distinct (disjoint, non-empty)
        edges[np.minimum(part[:, 1], stop) - start] -= 1  # and so are stops
    return np.cumsum(edges[:-1]) > 0


def _selected_below(ranges: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Windows of the ranges below each position (ranges disjoint and sorted)."""
    if not len(ranges):
        return np.zeros(len(positions), dtype=np.int64)
    lengths = ranges[:, 1] - ranges[:, 0]
    before = np.concatenate([[0], np.cumsum(lengths)])
    j = np.searchsorted(ranges[:, 0], positions, side="right") - 1
    inside = np.clip(positions - ranges[np.maximum(j, 0), 0], 0, lengths[np.maximum(j, 0)])
    return np.where(j >= 0, before[np.maximum(j, 0)] + inside, 0)


def _merged_ranges(columns: dict[str, np.ndarray], chosen: np.ndarray) -> np.ndarray:
    """The chosen devices' window ranges (from the device table's index columns), sorted, empty
    ones dropped and touching ones merged."""
    keep = np.isin(columns["range_device"], chosen)
    keep &= columns["range_stop"] > columns["range_start"]
    runs = np.stack([columns["range_start"][keep], columns["range_stop"][keep]], axis=1).astype(np.int64)
    runs = runs[np.argsort(runs[:, 0], kind="stable")].reshape(-1, 2)
    if len(runs) < 2:
        return runs
    new = np.concatenate([[True], runs[1:, 0] > runs[:-1, 1]])
    starts = runs[new, 0]
    stops = np.maximum.reduceat(runs[:, 1], np.flatnonzero(new))
    return np.stack([starts, stops], axis=1)


# Device ids below this are tested for membership through a bool table indexed by id (1 byte an
# id, built once: at most 4 MiB); larger ids through np.isin per chunk.
_TABLE_IDS = 1 << 22


class DeviceMembership:
    """Whether each window's device is one of ``ids`` (sorted unique int64). Built once for all
    the chunks of a pass: ``np.isin`` builds its own id table at every call, which at 80,000
    chosen devices cost 0.4 ms a chunk (12x the lookup; 50 against 4 ms over a 1 M-window store)."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids
        self._table: np.ndarray | None = None
        if len(ids) and int(ids[0]) >= 0 and int(ids[-1]) < _TABLE_IDS:
            # one extra False entry at the end answers every id past the last chosen one
            self._table = np.zeros(int(ids[-1]) + 2, dtype=bool)
            self._table[ids] = True

    def __call__(self, device: np.ndarray) -> np.ndarray:
        if self._table is None:
            return np.isin(device, self.ids)
        last = len(self._table) - 1
        # ids < 0 go to -1, the same False entry at the end
        return self._table[np.clip(device, -1, last)]


@dataclass(frozen=True)
class _PerWindow:
    """What the one pass over the chunks decides per window."""

    devices: DeviceMembership | None  # the chosen devices (a shuffled store's device filter)
    window_split: tuple[str, float, int] | None  # (side, val_fraction, split_seed)
    filters: WindowFilter

    @property
    def arrays(self) -> tuple[str, ...]:
        names = list(self.filters.arrays)
        if self.devices is not None or self.window_split is not None:
            names.append(DEVICE)
        if self.window_split is not None:
            names += [GIMU, TIMESTAMP]
        return tuple(dict.fromkeys(names))

    def mask(self, reader: ChunkReader, chunk: int, within: np.ndarray | None) -> np.ndarray:
        arrays = {name: reader.read(name, chunk) for name in self.arrays}
        start, stop = reader.chunk_span(chunk)
        keep = np.ones(stop - start, dtype=bool) if within is None else within.copy()
        if self.devices is not None:
            keep &= self.devices(arrays[DEVICE])
        passed = self.filters.mask(arrays)
        if passed is not None:
            keep &= passed
        if self.window_split is not None:
            side, fraction, seed = self.window_split
            in_val = window_in_val(arrays[DEVICE], arrays[GIMU], arrays[TIMESTAMP], val_fraction=fraction,
                                   split_seed=seed)
            keep &= in_val if side == "val" else ~in_val
        return keep


def _materialise(reader: ChunkReader, per_window: _PerWindow, ranges: np.ndarray | None,
                 threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One pass over the chunks that can hold selected windows: packed bits, offsets, counts."""
    n_chunks, width = reader.n_chunks, reader.chunk_windows
    bounds = np.minimum(np.arange(n_chunks + 1, dtype=np.int64) * width, reader.n_windows)
    sizes = np.diff(bounds)
    offsets = np.concatenate([[0], np.cumsum(-(-sizes // 8))])
    bits = np.zeros(int(offsets[-1]), dtype=np.uint8)
    counts = np.zeros(n_chunks, dtype=np.int64)
    candidates = np.arange(n_chunks)
    if ranges is not None:
        candidates = np.flatnonzero(np.diff(_selected_below(ranges, bounds)) > 0)

    def one(chunk: int) -> int:
        start, stop = reader.chunk_span(chunk)
        within = None if ranges is None else _ranges_mask(ranges, start, stop)
        keep = per_window.mask(reader, chunk, within)
        bits[offsets[chunk] : offsets[chunk + 1]] = np.packbits(keep)
        return int(keep.sum())

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="birdzarr-select") as pool:
        for chunk, count in zip(candidates.tolist(), pool.map(one, candidates.tolist()), strict=True):
            counts[chunk] = count
    bits.flags.writeable = False
    return bits, offsets, counts


def _ids(devices: Iterable[int]) -> np.ndarray:
    """User-given device ids as a sorted unique int64 array (``int()`` of each: numpy integers,
    Python ints, a range, an array)."""
    return sorted_distinct(np.array([int(d) for d in devices], dtype=np.int64))


def make_selection(
    columns: dict[str, np.ndarray],
    *,
    reader: ChunkReader,
    shuffled_store: bool,
    devices: Iterable[int] | None,
    exclude_devices: Iterable[int] | None,
    split: str | None,
    split_by: str,
    val_fraction: float,
    split_seed: int,
    filters: WindowFilter | None = None,
    threads: int = 4,
) -> Selection:
    """Validate the user's subset options and turn them into a ``Selection`` (reading the
    per-window arrays once where a filter needs them). ``columns``: the device table's index
    columns (``Store.device_columns``: ids and ranges, no per-device objects)."""
    filters = filters or WindowFilter()
    # device ids as sorted unique int64 arrays, not Python sets: a store of 100,000 devices
    known = sorted_distinct(np.asarray(columns["device_id"], np.int64))
    chosen: np.ndarray | None = None
    if devices is not None:
        chosen = _ids(devices)
        missing = np.setdiff1d(chosen, known, assume_unique=True)
        if len(missing):
            listed = ", ".join(str(d) for d in missing[:10].tolist()) + (", ..." if len(missing) > 10 else "")
            raise DeviceNotFoundError(f"devices={listed} are not in the store ({len(known)} devices; "
                                      "`birdzarr info --devices` lists them)")
    if exclude_devices is not None:
        chosen = np.setdiff1d(known if chosen is None else chosen, _ids(exclude_devices), assume_unique=True)
    window_split = None
    if split is not None:
        if split not in SPLITS:
            raise ArgumentError(f"split must be one of {SPLITS} or None, got {split!r}")
        if split_by not in SPLIT_BY:
            raise ArgumentError(f"split_by must be one of {SPLIT_BY}, got {split_by!r}")
        _threshold(val_fraction)
        if split_by == "device":
            candidates = known if chosen is None else chosen
            in_val = device_in_val(candidates, val_fraction=val_fraction, split_seed=split_seed)
            chosen = candidates[in_val if split == "val" else ~in_val]
            if len(candidates) and not len(chosen):
                raise ArgumentError(
                    f"split={split!r} holds no device: split_seed={split_seed} with val_fraction="
                    f"{val_fraction} puts {'none' if split == 'val' else 'all'} of the {len(candidates)} "
                    "device(s) in 'val' (each device is in 'val' with probability val_fraction, from a "
                    "hash of its id). Choose another split_seed, or split_by='window' for a fraction "
                    "of windows (docs/training.md#subsets-and-splits)"
                )
        else:
            window_split = (split, float(val_fraction), int(split_seed))
    if chosen is not None and np.array_equal(chosen, known):
        chosen = None
    n_windows, width = reader.n_windows, reader.chunk_windows
    ranges = None
    if chosen is not None and not shuffled_store:
        ranges = _merged_ranges(columns, chosen)
    per_window = _PerWindow(DeviceMembership(chosen) if shuffled_store and chosen is not None else None,
                            window_split, filters)
    if not per_window.arrays:
        return Selection(chosen, n_windows, width, ranges=ranges)
    bits, offsets, counts = _materialise(reader, per_window, ranges, threads)
    return Selection(chosen, n_windows, width, bits=bits, offsets=offsets, chunk_counts=counts)
