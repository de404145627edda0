"""Store format version 2, the window layout: uint16 codes + dictionaries, core Zarr v3 codecs only.

The layout birdzarr writes (version 1's ``birdzarr.dict16`` and ``birdzarr.gdict16`` codecs are
read only): imu_x/y/z are uint16 codes into one dictionary row per device, held in ordinary
arrays; gps_speed stays float32. Pure numpy and zarr.json documents, no I/O: the encode, the
decode, the rules, and each array's metadata.

Arrays
------
``N`` windows, ``R`` dictionary rows, ``M`` dictionary entries. Every array uses only core Zarr v3
codecs (transpose, bytes, blosc, crc32c; ``array_metadata`` gives each one's zarr.json), so
TensorStore, zarrs, zarr.js and plain zarr-python read them without birdzarr.

=================  ========  ===========  ===================================================
array              dtype     shape        meaning
=================  ========  ===========  ===================================================
``gimu_codes``     uint16    (N, 20, 3)   imu_x, imu_y, imu_z of window ``w``: entry
                                          ``code[w, s, c]`` of row ``row[w]``'s channel c
``gps_speed``      float32   (N, 20)      gps_speed (channel 3) as it is, divided by gps_scale
``gimu_row``       uint32    (N,)         the dictionary row of window ``w``
``dict_values``    float32   (M,)         the entries of every row, row after row, channel
                                          after channel within a row
``dict_start``     int64     (R, 3)       first entry of row ``r``, channel ``c``
``dict_device``    int64     (R,)         the device whose windows row ``r`` codes
=================  ========  ===========  ===================================================

Decoding windows ``[a, b)`` bit for bit (all a reader needs; ``decode`` below is the same, faster)::

    codes = z["gimu_codes"][a:b]          # uint16 (n, 20, 3)
    row = z["gimu_row"][a:b]              # uint32 (n,)
    start = z["dict_start"][:]            # int64 (R, 3)
    values = z["dict_values"][:]          # float32 (M,)
    windows = np.empty((len(row), 20, 4), np.float32)
    windows[:, :, :3] = values[start[row][:, None, :] + codes]
    windows[:, :, 3] = z["gps_speed"][a:b]

Row ``r``, channel ``c`` owns the entries from ``start[r, c]`` up to the next start in row-major
order of ``dict_start`` (``M`` after the last); every code is below its dictionary's length
(``check`` verifies it). Entries are float32 bit patterns: NaN payloads and -0.0 survive. Curation
drops non-finite windows, but -0.0 passes it (``np.clip(-0.0, -2, 2)`` is -0.0, and a Parquet
source may hold any finite value).

The rules
---------
- **A row per device**: a device's IMU values are calibrated 12-bit counts (at most 4,096 distinct
  per channel), so one dictionary row serves all its windows in either store order; a shuffled
  chunk decodes with one lookup per value and carries no dictionary of its own. The row array
  costs ~1 byte a window in a shuffled store, next to nothing in device order.
- **gps_speed is not coded**: in real exports it is one continuous value per burst (6-8
  decimals), about one distinct value per 1-3 windows, so codes would not compress and the
  dictionary would hold every speed (measured: +27 bytes a window, 30% more store); as
  float32 with zstd and no shuffle, a burst's equal values cost 2.6 (device order) to 4.2
  (shuffled) bytes a window, and speeds that vary inside a window need no rule at all.
- **Overflow**: an IMU device-channel with more than 65,535 distinct values (not 12-bit counts:
  a source of other floats) splits the device into several rows, windows in order: a new row
  starts at the first window that would take some channel of the current row past 65,535 entries
  (``MAX_ENTRIES``). Nothing falls back to another layout; every value stays a code.
- **Many small devices**: still a row per device. At ~30 windows a device the dictionaries are
  most of the stored bytes; the cost is memory and locality for readers.
- **Append**: new windows of a device that has rows reuse its latest row when it already holds
  every value; otherwise they get a new row whose entries are the latest row's followed by the new
  values (the dictionary grows; every old code means the same value in the old and the new row,
  and no stored byte changes); when that would pass 65,535 entries, the new windows get rows of
  their own (the overflow rule). Rows are never rewritten: the dictionary arrays only grow, so a
  failed append that keeps the committed lengths leaves the previous state.
- **Entry order** is the encoder's choice, never the decoder's: ``sorted`` (bit patterns
  ascending, the default: a calibrated channel's codes follow its values, which bit-shuffles well)
  or ``first`` (first occurrence), measured smaller and no faster.
- **Device key**: ``dict_device`` records whatever integer the writer passes per window (the
  store's device index, or the device id); a window's device is ``dict_device[row[w]]``, so a
  separate per-window device array is redundant (the writer's choice).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

WINDOW_LENGTH = 20
N_CHANNELS = 4
N_CODED = 3  # imu_x, imu_y, imu_z are dictionary-coded; gps_speed (channel 3) is stored as float32
MAX_ENTRIES = 65535  # entries a (row, channel) dictionary may hold: codes are uint16

CODES = "gimu_codes"
GPS = "gps_speed"
ROW = "gimu_row"
VALUES = "dict_values"
START = "dict_start"
DEVICE = "dict_device"
ARRAYS = (CODES, GPS, ROW, VALUES, START, DEVICE)

SORTED = "sorted"
FIRST = "first"
# Entry order per coded channel (imu_x, imu_y, imu_z): chosen by benchmarks/format2.py.
ORDERS: tuple[str, ...] = (SORTED, SORTED, SORTED)


@dataclass(frozen=True)
class Dictionaries:
    """The dictionary arrays as stored (or the part an encode appends to them)."""

    values: np.ndarray  # float32 (M,)
    start: np.ndarray  # int64 (R, 4)
    device: np.ndarray  # int64 (R,)

    @classmethod
    def empty(cls) -> Dictionaries:
        return cls(np.empty(0, np.float32), np.empty((0, N_CODED), np.int64), np.empty(0, np.int64))

    @property
    def n_rows(self) -> int:
        return len(self.device)

    def sizes(self) -> np.ndarray:
        """Entries of each (row, channel) dictionary, int64 (R, 4)."""
        return entry_counts(self.start, len(self.values))

    def entries(self, row: int, channel: int) -> np.ndarray:
        """The float32 entries of one (row, channel) dictionary (a view)."""
        first = int(self.start[row, channel])
        return self.values[first : first + int(self.sizes()[row, channel])]

    def extend(self, part: Dictionaries) -> Dictionaries:
        """These arrays with ``part`` (an encode's new rows, whose starts count from the end of
        these values) appended: what the store holds after the append."""
        return Dictionaries(
            np.concatenate([self.values, part.values]),
            np.concatenate([self.start, part.start]),
            np.concatenate([self.device, part.device]),
        )


@dataclass(frozen=True)
class Encoded:
    """What one encode stores: the windows' codes, rows and gps_speed, and the rows to append to
    the dictionary arrays (``new.start`` is absolute: it already counts the earlier entries)."""

    codes: np.ndarray  # uint16 (n, 20, 3)
    row: np.ndarray  # uint32 (n,)
    gps: np.ndarray  # float32 (n, 20)
    new: Dictionaries


def entry_counts(start: np.ndarray, n_values: int) -> np.ndarray:
    """Entries of each (row, channel) dictionary: from its start to the next start in row-major
    order, ``n_values`` after the last."""
    flat = np.asarray(start, dtype=np.int64).reshape(-1)
    ends = np.append(flat[1:], np.int64(n_values))
    return (ends - flat).reshape(-1, N_CODED)


# -- decoding --------------------------------------------------------------------------------


def decode_reference(codes: np.ndarray, row: np.ndarray, gps: np.ndarray, values: np.ndarray,
                     start: np.ndarray) -> np.ndarray:
    """The documented numpy lines, verbatim."""
    windows = np.empty((len(row), 20, 4), np.float32)
    windows[:, :, :3] = values[start[row][:, None, :] + codes]
    windows[:, :, 3] = gps
    return windows


def decode(
    codes: np.ndarray, row: np.ndarray, gps: np.ndarray, values: np.ndarray, start: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Float32 windows (n, 20, 4) from their codes, rows and gps_speed: the same values as
    ``decode_reference``, into ``out`` where given (a float32 array of that shape). Codes may be
    any view (the channel-major chunk's transpose is fastest). Indices are not checked (``check``
    does, once per chunk read)."""
    n = len(row)
    if out is None:
        out = np.empty((n, WINDOW_LENGTH, N_CHANNELS), np.float32)
    # Measured against other ways on shuffled chunks (benchmarks/chunk_decode.py --variants
    # --cpu): np.take of start's rows (fancy indexing start[row] costs ~3x as much on its own),
    # the codes cast to int64 before the base is added in place (one dtype: no buffered cast),
    # and mode="wrap" (for in-range indices faster than "clip", as memory-safe for any other) take
    # 0.94x the CPU of the lookup without them; "raise", int32 indices with fancy indexing, larger
    # blocks and sorting a chunk's windows by row cost 1.0-1.25x.
    base = np.take(start, row, axis=0)  # (n, 3)
    index = np.empty((n, WINDOW_LENGTH), np.int64)
    looked_up = np.empty((n, WINDOW_LENGTH), np.float32)
    for c in range(N_CODED):
        np.copyto(index, codes[:, :, c])
        index += base[:, c : c + 1]
        # a contiguous take, then one copy into the strided channel: ~10% faster than a take
        # straight into the channel or a new array a channel
        np.take(values, index, out=looked_up, mode="wrap")
        out[:, :, c] = looked_up
    out[:, :, 3] = gps
    return out


def check(codes: np.ndarray, row: np.ndarray, start: np.ndarray, n_values: int) -> None:
    """Raise ValueError unless every window's row exists and every code falls inside its
    (row, channel) dictionary."""
    sizes = entry_counts(start, n_values)
    if (sizes < 0).any():
        raise ValueError("dict_start is not ascending in row-major order")
    row = np.asarray(row)
    if len(row) and int(row.max()) >= len(sizes):
        raise ValueError(f"gimu_row refers to row {int(row.max())}; the dictionary has {len(sizes)} rows")
    if (codes >= sizes[row][:, None, :]).any():
        raise ValueError("a gimu code is past the end of its dictionary")


# -- encoding --------------------------------------------------------------------------------


def _constant_rows(bits: np.ndarray) -> bool:
    """Whether every window repeats its first value (one gps_speed a window)."""
    head = bits[:16]
    return bool((head == head[:, :1]).all()) and bool((bits == bits[:, :1]).all())


def _channel_values(bits: np.ndarray, c: int) -> tuple[np.ndarray, int]:
    """Channel ``c`` of (n, 20, 4) uint32 bit patterns as a flat array, and the values per window
    it keeps: 1 when the channel is constant within every window (coded once a window), else 20."""
    channel = bits[:, :, c]
    if len(channel) and _constant_rows(channel):
        return np.ascontiguousarray(channel[:, 0]), 1
    return channel.reshape(-1), WINDOW_LENGTH


def _previous_occurrence(values: np.ndarray) -> np.ndarray:
    """For each position, the last earlier position holding the same value (-1 if none)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    previous = np.full(len(values), -1, np.int64)
    same = ordered[1:] == ordered[:-1]
    previous[order[1:][same]] = order[:-1][same]
    return previous


def _split_device(channels: list[tuple[np.ndarray, int]], n_windows: int) -> np.ndarray:
    """Row number (0, 1, ...) of each of one device's windows: a new row starts at the first window
    that would take some channel of the current row past MAX_ENTRIES distinct values."""
    previous = [(_previous_occurrence(values), per) for values, per in channels]
    row = np.empty(n_windows, np.int64)
    first, number = 0, 0
    while first < n_windows:
        stop = n_windows
        for prev, per in previous:
            # distinct values of windows [first, first + k) = values there seen nowhere earlier in it
            fresh = np.cumsum(prev[first * per :] < first * per)[per - 1 :: per]
            stop = min(stop, first + int(np.searchsorted(fresh, MAX_ENTRIES, side="right")))
        if stop <= first:  # a window holds at most 20 distinct values a channel
            raise AssertionError("a single window overflows a dictionary")
        row[first:stop] = number
        first, number = stop, number + 1
    return row


def _unique(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(keys, return_index=True, return_inverse=True)``, except that the second array
    only ranks the distinct keys by first occurrence (all the encoder needs). pandas' hash
    factorisation (a dependency of birdzarr), then a sort of the distinct keys only: 4-5x faster
    than numpy's sort of every key, and the same result."""
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover
        return np.unique(keys, return_index=True, return_inverse=True)  # type: ignore[return-value]
    seen, found = pd.factorize(keys, sort=False)  # found: the distinct keys by first occurrence
    found = np.asarray(found, dtype=np.uint64)
    by_key = np.argsort(found)
    rank = np.empty(len(found), np.int64)
    rank[by_key] = np.arange(len(found))
    return found[by_key], by_key, rank[seen]


_SLAB = 2**18  # values hashed at once, cut at a group boundary: a hash table that stays in the caches


def _unique_grouped(keys: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_unique(keys)`` for keys whose high half is ``group``: slabs of whole groups are
    factorised one by one (no key is in two slabs, so the slabs' sorted distinct keys follow one
    another), which keeps each hash table small where a device's values are nearly all distinct
    (many small devices: one table of millions of keys measured 5-10x slower)."""
    n = len(keys)
    order = None
    if n and not bool((group[1:] >= group[:-1]).all()):  # windows not device after device
        order = np.argsort(group, kind="stable")
        keys, group = keys[order], group[order]
    group_starts = np.flatnonzero(group[1:] != group[:-1]) + 1
    at = np.searchsorted(group_starts, np.arange(_SLAB, n, _SLAB))
    bounds = np.concatenate(([0], np.unique(group_starts[at[at < len(group_starts)]]), [n]))
    distinct, first, inverse = [], [], np.empty(n, np.int64)
    found = 0
    for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        slab_distinct, slab_first, slab_inverse = _unique(keys[begin:end])
        distinct.append(slab_distinct)
        first.append(slab_first + begin)  # still orders a group's keys by first occurrence
        inverse[begin:end] = slab_inverse.reshape(-1) + found
        found += len(slab_distinct)
    if order is not None:
        back = np.empty(n, np.int64)
        back[order] = inverse
        inverse = back
    if not distinct:
        return np.empty(0, np.uint64), np.empty(0, np.int64), inverse
    return np.concatenate(distinct), np.concatenate(first), inverse


def _code_channel(values: np.ndarray, group: np.ndarray, n_groups: int, order: str
                  ) -> tuple[tuple[np.ndarray, np.ndarray] | None, np.ndarray]:
    """Dictionary-code one channel whose values belong to ``group`` (0..n_groups-1, one per value).

    Returns the codes (uint16, one per value) and the entries (uint32 bit patterns, group after
    group), or None when a group has more than MAX_ENTRIES distinct values; and each group's
    count of distinct values."""
    keys = (group.astype(np.uint64) << np.uint64(32)) | values.astype(np.uint64)
    distinct, first_at, inverse = _unique_grouped(keys, group)
    owner = (distinct >> np.uint64(32)).astype(np.int64)
    counts = np.bincount(owner, minlength=n_groups)
    if counts.max(initial=0) > MAX_ENTRIES:
        return None, counts
    block = np.cumsum(counts) - counts
    if order == FIRST:  # within each group, entries by first occurrence
        placement = np.lexsort((first_at, owner))
        rank = np.empty(len(distinct), np.int64)
        rank[placement] = np.arange(len(distinct)) - block[owner[placement]]
        entries = np.empty(len(distinct), np.uint32)
        entries[block[owner] + rank] = distinct.astype(np.uint32)  # low 32 bits: the value
    else:
        rank = np.arange(len(distinct)) - block[owner]
        entries = distinct.astype(np.uint32)
    return (rank[inverse.reshape(-1)].astype(np.uint16), entries), counts


def _encode_fresh(bits: np.ndarray, device: np.ndarray, orders: tuple[str, ...], first_value: int
                  ) -> tuple[np.ndarray, np.ndarray, Dictionaries]:
    """Codes, rows (0..R-1 local) and dictionaries (starts from ``first_value``) of windows whose
    devices start new rows: a row per device, unless the overflow rule splits it. Codes the first
    ``len(orders)`` channels of ``bits``."""
    n, n_coded = len(bits), len(orders)
    devices, group = np.unique(device, return_inverse=True)
    group = group.reshape(-1).astype(np.int64)
    channels = [_channel_values(bits, c) for c in range(n_coded)]
    row_of_window, row_device = group, devices
    coded = [_code_channel(values, np.repeat(group, per), len(devices), orders[c])
             for c, (values, per) in enumerate(channels)]
    overflowing = np.flatnonzero(np.any([counts > MAX_ENTRIES for _, counts in coded], axis=0))
    if len(overflowing):  # the overflow rule: split those devices into rows, then code again
        split = np.zeros(n, np.int64)  # row number within the device
        for g in overflowing.tolist():
            where = np.flatnonzero(group == g)
            mine = [(values.reshape(n, per)[where].reshape(-1), per) for values, per in channels]
            split[where] = _split_device(mine, len(where))
        n_rows_of = np.ones(len(devices), np.int64)
        np.maximum.at(n_rows_of, group, split + 1)
        first_row = np.cumsum(n_rows_of) - n_rows_of
        row_of_window = first_row[group] + split
        row_device = np.repeat(devices, n_rows_of)
        coded = [_code_channel(values, np.repeat(row_of_window, per), len(row_device), orders[c])
                 for c, (values, per) in enumerate(channels)]
    n_rows = len(row_device)
    codes = np.empty((n, WINDOW_LENGTH, n_coded), np.uint16)
    counts = np.empty((n_rows, n_coded), np.int64)
    entries = []
    for c, ((result, counts[:, c]), (_, per)) in enumerate(zip(coded, channels, strict=True)):
        if result is None:
            raise AssertionError("a row passed MAX_ENTRIES after the split")
        codes[:, :, c] = result[0].reshape(n, per)  # per == 1 broadcasts over the window
        entries.append(result[1])
    flat = counts.reshape(-1)
    start = (np.cumsum(flat) - flat).reshape(n_rows, n_coded)
    table = np.empty(int(flat.sum()), np.uint32)
    for c in range(n_coded):  # channel c's entries, row after row, into each row's slot
        owner = np.repeat(np.arange(n_rows), counts[:, c])
        within = np.arange(len(owner)) - np.repeat(np.cumsum(counts[:, c]) - counts[:, c], counts[:, c])
        table[start[owner, c] + within] = entries[c]
    new = Dictionaries(table.view(np.float32), start + first_value, row_device.astype(np.int64))
    return codes, row_of_window.astype(np.int64), new


def _extend_row(bits: np.ndarray, old: list[np.ndarray], orders: tuple[str, ...]
                ) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """Codes of one device's new windows against its latest row's entries ``old`` (uint32 per
    channel) extended by the values they lack; None when an extension would pass MAX_ENTRIES.
    Returns the codes and the added entries per channel (all empty: the old row serves)."""
    n = len(bits)
    codes = np.empty((n, WINDOW_LENGTH, N_CODED), np.uint16)
    added = []
    for c in range(N_CODED):
        values, per = _channel_values(bits, c)
        order_first = orders[c] == FIRST
        if order_first:
            distinct, first_at, inverse = np.unique(values, return_index=True, return_inverse=True)
        else:
            distinct, inverse = np.unique(values, return_inverse=True)
        sorter = np.argsort(old[c], kind="stable")
        if len(old[c]):
            at = np.minimum(np.searchsorted(old[c], distinct, sorter=sorter), len(old[c]) - 1)
            known = old[c][sorter[at]] == distinct
        else:
            at, known = np.zeros(len(distinct), np.int64), np.zeros(len(distinct), bool)
        # the values the row lacks, in the channel's entry order, after the old entries
        rank = np.arange(int((~known).sum()))
        if order_first:
            rank = np.argsort(np.argsort(first_at[~known], kind="stable"), kind="stable")
        new_values = np.empty(len(rank), np.uint32)
        new_values[rank] = distinct[~known]
        if len(old[c]) + len(new_values) > MAX_ENTRIES:
            return None
        code_of = np.empty(len(distinct), np.int64)
        code_of[known] = sorter[at[known]]
        code_of[~known] = len(old[c]) + rank
        codes[:, :, c] = code_of[inverse.reshape(-1)].reshape(n, per).astype(np.uint16)
        added.append(new_values)
    return codes, added


def encode(
    windows: np.ndarray, device: np.ndarray, previous: Dictionaries | None = None,
    *, orders: tuple[str, ...] = ORDERS,
) -> Encoded:
    """Encode float32 windows (n, 20, 4) of the given devices (any integer key per window, the
    same key the store's rows record). ``previous``: the store's dictionary arrays when appending
    (new windows of a device that has rows follow the append rule), None for a new store."""
    windows = np.ascontiguousarray(windows)
    if windows.dtype != np.float32 or windows.ndim != 3 or windows.shape[1:] != (WINDOW_LENGTH, N_CHANNELS):
        raise ValueError(f"windows must be float32 (n, {WINDOW_LENGTH}, {N_CHANNELS}), got "
                         f"{windows.dtype} {windows.shape}")
    device = np.asarray(device, dtype=np.int64).reshape(-1)
    if len(device) != len(windows):
        raise ValueError(f"{len(device)} device keys for {len(windows)} windows")
    if len(orders) != N_CODED or any(o not in (SORTED, FIRST) for o in orders):
        raise ValueError(f"orders must be {N_CODED} of {SORTED!r}, {FIRST!r}")
    previous = Dictionaries.empty() if previous is None else previous
    bits = windows.view(np.uint32)
    n = len(windows)
    codes = np.empty((n, WINDOW_LENGTH, N_CODED), np.uint16)
    row = np.empty(n, np.int64)
    parts: list[Dictionaries] = []
    n_values, n_rows = len(previous.values), previous.n_rows

    def add(part: Dictionaries) -> int:
        """Append rows to the output; returns the first new row's number."""
        nonlocal n_values, n_rows
        parts.append(part)
        first_row = n_rows
        n_values += len(part.values)
        n_rows += part.n_rows
        return first_row

    fresh = ~np.isin(device, previous.device)
    if n_rows:
        latest = {int(d): r for r, d in enumerate(previous.device.tolist())}  # later rows win
        sizes = previous.sizes()
        bits_prev = previous.values.view(np.uint32)
        for key in np.unique(device[~fresh]).tolist():
            where = np.flatnonzero(device == key)
            r = latest[key]
            old = [bits_prev[previous.start[r, c] : previous.start[r, c] + sizes[r, c]]
                   for c in range(N_CODED)]
            extended = _extend_row(bits[where], old, orders)
            if extended is None:  # the overflow rule: rows of their own
                fresh[where] = True
                continue
            codes[where], added = extended
            if not any(len(a) for a in added):
                row[where] = r
                continue
            entries = [np.concatenate([old[c], added[c]]) for c in range(N_CODED)]
            counts = np.array([len(e) for e in entries], np.int64)
            start = n_values + np.cumsum(counts) - counts
            row[where] = add(Dictionaries(np.concatenate(entries).view(np.float32), start[None, :],
                                          np.array([key], np.int64)))
    if fresh.any():
        where = np.flatnonzero(fresh)
        fresh_codes, fresh_row, part = _encode_fresh(bits[where], device[where], orders, n_values)
        codes[where] = fresh_codes
        row[where] = add(part) + fresh_row
    new = Dictionaries(
        np.concatenate([p.values for p in parts]) if parts else np.empty(0, np.float32),
        np.concatenate([p.start for p in parts]) if parts else np.empty((0, N_CODED), np.int64),
        np.concatenate([p.device for p in parts]) if parts else np.empty(0, np.int64),
    )
    if n_rows >= 2**32 - 1:
        raise ValueError("more than 2**32 - 2 dictionary rows")
    return Encoded(codes, row.astype(np.uint32), np.ascontiguousarray(windows[:, :, 3]), new)


# -- zarr metadata ---------------------------------------------------------------------------

CRC32C = {"name": "crc32c"}


def _blosc(cname: str, clevel: int, shuffle: str, typesize: int) -> dict[str, Any]:
    return {"name": "blosc", "configuration": {"cname": cname, "clevel": clevel, "shuffle": shuffle,
                                               "typesize": typesize, "blocksize": 0}}


BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
# Codec chains: every name is a core Zarr v3 codec.
CODECS: dict[str, list[dict[str, Any]]] = {
    CODES: [{"name": "transpose", "configuration": {"order": [2, 0, 1]}}, BYTES,
            _blosc("lz4", 5, "bitshuffle", 2), CRC32C],
    # runs of equal floats (one speed a burst): zstd without shuffle finds them, bit-shuffle hides them
    GPS: [BYTES, _blosc("zstd", 3, "noshuffle", 4), CRC32C],
    ROW: [BYTES, _blosc("zstd", 3, "bitshuffle", 4), CRC32C],
    VALUES: [BYTES, _blosc("zstd", 3, "bitshuffle", 4), CRC32C],
    START: [BYTES, _blosc("zstd", 3, "shuffle", 8), CRC32C],
    DEVICE: [BYTES, _blosc("zstd", 3, "shuffle", 8), CRC32C],
}
CORE_CODECS = frozenset({"bytes", "transpose", "blosc", "zstd", "gzip", "crc32c", "sharding_indexed"})
DEFAULT_CHUNK_WINDOWS = 8192
VALUE_CHUNK = 2**20  # dictionary entries a chunk (4 MiB of float32)
ROW_CHUNK = 2**16  # dictionary rows a chunk

# Each array's zarr.json attributes (informative, as version 1's: docs/format.md spells them).
# The codes carry the units of the values they decode to; gps_speed's are version 1's fourth.
ATTRIBUTES: dict[str, dict[str, Any]] = {
    CODES: {"long_name": "imu_x, imu_y, imu_z of each window, as codes into dict_values",
            "channels": ["imu_x", "imu_y", "imu_z"], "units": ["g", "g", "g"]},
    GPS: {"long_name": "gps_speed of each window", "units": "m/s divided by gps_scale"},
    ROW: {"long_name": "the dictionary row of each window"},
    VALUES: {"long_name": "dictionary entries: imu_x, imu_y, imu_z values", "units": "g"},
    START: {"long_name": "first dict_values entry of row r, channel c",
            "channels": ["imu_x", "imu_y", "imu_z"]},
    DEVICE: {"long_name": "device (tracker) id whose windows the row codes"},
}


def array_metadata(n_windows: int, n_values: int, n_rows: int, *, chunk_windows: int = DEFAULT_CHUNK_WINDOWS
                   ) -> dict[str, dict[str, Any]]:
    """The zarr.json document of each array (by name) for the given lengths."""

    def meta(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str, fill: Any, dims: list[str],
             codecs: list[dict[str, Any]], attributes: dict[str, Any]) -> dict[str, Any]:
        return {
            "zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill, "codecs": codecs, "attributes": copy.deepcopy(attributes),
            "dimension_names": dims,
        }

    return {
        CODES: meta((n_windows, WINDOW_LENGTH, N_CODED), (chunk_windows, WINDOW_LENGTH, N_CODED),
                    "uint16", 0, ["window", "sample", "channel"], CODECS[CODES], ATTRIBUTES[CODES]),
        GPS: meta((n_windows, WINDOW_LENGTH), (chunk_windows, WINDOW_LENGTH), "float32", 0.0,
                  ["window", "sample"], CODECS[GPS], ATTRIBUTES[GPS]),
        ROW: meta((n_windows,), (chunk_windows,), "uint32", 2**32 - 1, ["window"], CODECS[ROW],
                  ATTRIBUTES[ROW]),
        VALUES: meta((n_values,), (VALUE_CHUNK,), "float32", 0.0, ["entry"], CODECS[VALUES],
                     ATTRIBUTES[VALUES]),
        START: meta((n_rows, N_CODED), (ROW_CHUNK, N_CODED), "int64", -1, ["row", "channel"],
                    CODECS[START], ATTRIBUTES[START]),
        DEVICE: meta((n_rows,), (ROW_CHUNK,), "int64", -1, ["row"], CODECS[DEVICE], ATTRIBUTES[DEVICE]),
    }
