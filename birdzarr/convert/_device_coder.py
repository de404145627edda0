"""The shuffle's first pass codes each device's windows into its own dictionaries.

A device's windows pass in order, block after block: ``DeviceCoder`` keeps the device's
distinct values per channel (float32 bit patterns, in the order first seen) and gives each
window's values as codes into them, which pass 1 spills instead of floats (about 3x smaller)
and pass 2 turns back into values, or into format 2's dictionary rows (``_shuffle.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from birdzarr.format._codec import constant_rows


@dataclass(frozen=True)
class BlockValues:
    """A block's distinct values per channel, in the order first seen in the block, and each
    value's index among them: the costly part of coding a block (a hash per value), found by
    ``block_values`` without any state, so on any thread, blocks of one device at once."""

    n_windows: int
    n_samples: int
    # per channel: (index of each value among ``distinct``, the distinct bit patterns, True
    # where the channel is constant within every window and so was coded once a window)
    channels: list[tuple[np.ndarray, np.ndarray, bool]]


def block_values(windows: np.ndarray, size_hints: Sequence[int]) -> BlockValues:
    """The distinct values of float32 windows ``(n, samples, channels)`` per channel; a hash
    table per channel sized for ``size_hints[c]`` values (the device's entries so far) and more."""
    import pandas as pd  # only conversion needs it: `import birdzarr` (DataLoader workers) does not

    n, n_samples, n_channels = windows.shape
    bits = np.ascontiguousarray(windows.transpose(2, 0, 1)).view(np.uint32)
    channels: list[tuple[np.ndarray, np.ndarray, bool]] = []
    for c in range(n_channels):
        channel = bits[c]
        # a channel constant within each window (gps_speed) is coded once a window
        per_window = n_samples > 1 and constant_rows(channel)
        values = np.ascontiguousarray(channel[:, 0]) if per_window else channel.reshape(-1)
        # A hash table sized for a device's few thousand values stays in cache: measured 4.8x
        # faster than pandas' default size (one entry per value) on a 16,384-window block.
        # The table grows as needed; the codes do not depend on the hint.
        first_seen, distinct = pd.factorize(values, sort=False, size_hint=size_hints[c] + 4096)
        channels.append((first_seen, np.asarray(distinct, dtype=np.uint32), per_window))
    return BlockValues(n, n_samples, channels)


class DeviceCoder:
    """One device's distinct values per channel (float32 bit patterns, in the order first seen)
    and the codes of its windows into them: the shuffle's first pass sees a device's windows
    in order, block after block, and spills codes instead of floats.

    ``codes`` codes a block in the calling thread. A pipeline instead finds each block's
    ``block_values`` on other threads and hands them to ``codes_of`` in block order: the codes
    are the same either way."""

    def __init__(self, n_channels: int) -> None:
        self.known = [np.empty(0, dtype=np.uint32) for _ in range(n_channels)]
        self._index: list[Any] = [None] * n_channels  # a pandas Index of ``known``, once needed

    def size_hints(self) -> list[int]:
        """The device's entries so far per channel (``block_values``' hash table sizes)."""
        return [len(k) for k in self.known]

    def codes(self, windows: np.ndarray) -> np.ndarray:
        """Codes ``(channels, n, samples)`` of float32 windows ``(n, samples, channels)``: uint16
        while every dictionary of the device has at most 65,536 entries, uint32 beyond."""
        return self.codes_of(block_values(windows, self.size_hints()))

    def codes_of(self, block: BlockValues) -> np.ndarray:
        """The codes of the block whose values are ``block``; blocks must come in order."""
        import pandas as pd

        lookups: list[np.ndarray] = []
        for c, (_, distinct, _) in enumerate(block.channels):
            if not len(self.known[c]):  # the device's first block: its values in the order first seen
                lookup = np.arange(len(distinct))
                self.known[c] = distinct
                self._index[c] = None
            else:
                index = self._index[c]
                if index is None:
                    index = self._index[c] = pd.Index(self.known[c])
                lookup = index.get_indexer(distinct)
                new = lookup < 0
                if new.any():
                    lookup[new] = len(self.known[c]) + np.arange(int(new.sum()))
                    self.known[c] = np.concatenate([self.known[c], distinct[new]])
                    self._index[c] = None
            lookups.append(lookup)
        dtype = np.uint16 if max(len(k) for k in self.known) <= 2**16 else np.uint32
        n, n_samples = block.n_windows, block.n_samples
        out = np.empty((len(block.channels), n, n_samples), dtype=dtype)
        for c, (lookup, (first_seen, _, per_window)) in enumerate(zip(lookups, block.channels, strict=True)):
            codes = lookup.astype(dtype)
            if per_window:
                out[c] = codes[first_seen][:, None]
            else:
                np.take(codes, first_seen.reshape(n, n_samples), out=out[c], mode="clip")
        return out


@dataclass
class DeviceValues:
    """Devices' dictionaries (their distinct values per channel, into which pass 1's codes
    point) laid end to end a channel: a few arrays whatever the number of devices (pickled
    once for pass 2, and read there with one take a channel), not an array a device and channel.
    Device ``ids[k]``'s dictionary of channel ``c`` is ``values[c][starts[c][k]:starts[c][k + 1]]``."""

    ids: np.ndarray  # int64, ascending
    values: list[np.ndarray]  # per channel: uint32 bit patterns
    starts: list[np.ndarray]  # per channel: int64, len(ids) + 1

    @classmethod
    def of_devices(cls, known: list[tuple[int, list[np.ndarray]]], n_channels: int) -> DeviceValues:
        """From each device's dictionaries (``DeviceCoder.known``)."""
        ids = np.fromiter((d for d, _ in known), np.int64, len(known))
        values, starts = [], []
        for c in range(n_channels):
            parts = [k[c] for _, k in known]
            values.append(np.concatenate(parts).astype(np.uint32) if parts else np.empty(0, np.uint32))
            starts.append(np.concatenate(([0], np.cumsum([len(p) for p in parts], dtype=np.int64))))
        return cls(ids, values, starts).ascending()

    @classmethod
    def joined(cls, parts: list[DeviceValues], n_channels: int, *, consume: bool = False) -> DeviceValues:
        """All of ``parts``' devices (each device in one part). ``consume``: ``parts`` is emptied
        as they are copied, each part freed once copied (the dictionaries of a 100,000-device
        shuffle are ~220 MB: held once, not twice)."""
        if not parts:
            return cls.of_devices([], n_channels)
        if len(parts) == 1:  # no copy
            return (parts.pop() if consume else parts[0]).ascending()
        ids = np.concatenate([p.ids for p in parts])
        sizes = [[len(p.values[c]) for p in parts] for c in range(n_channels)]
        values = [np.empty(sum(sizes[c]), np.uint32) for c in range(n_channels)]
        starts = [np.empty(len(ids) + 1, np.int64) for _ in range(n_channels)]
        for c in range(n_channels):
            starts[c][0] = 0
        at, devices = [0] * n_channels, 0
        for k in range(len(parts)):
            part = parts[k]
            if consume:
                parts[k] = _EMPTY  # the caller's list no longer holds it
            for c in range(n_channels):
                values[c][at[c] : at[c] + sizes[c][k]] = part.values[c]
                starts[c][devices + 1 : devices + 1 + len(part.ids)] = part.starts[c][1:] + at[c]
                at[c] += sizes[c][k]
            devices += len(part.ids)
            del part
        if consume:
            parts.clear()
        return cls(ids, values, starts).ascending()

    def ascending(self) -> DeviceValues:
        """The same dictionaries, devices in ascending id."""
        if len(self.ids) < 2 or bool((self.ids[1:] > self.ids[:-1]).all()):
            return self
        order = np.argsort(self.ids, kind="stable")
        values, starts = [], []
        for c in range(len(self.values)):
            lengths = np.diff(self.starts[c])[order]
            first = self.starts[c][:-1][order]
            take = np.repeat(first - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
            take += np.arange(int(lengths.sum()))
            values.append(self.values[c][take])
            starts.append(np.concatenate(([0], np.cumsum(lengths))).astype(np.int64))
        return DeviceValues(self.ids[order], values, starts)

    def index(self, device: int) -> int:
        return int(np.searchsorted(self.ids, device))

    def of(self, k: int) -> list[np.ndarray]:
        """The ``k``-th device's dictionaries (views)."""
        return [v[s[k]: s[k + 1]] for v, s in zip(self.values, self.starts, strict=True)]


_EMPTY = DeviceValues(np.empty(0, np.int64), [], [])


class DeviceValuesBuilder:
    """Devices' dictionaries gathered part after part (pass 1's runs and devices, in order) into
    one array a channel that grows in place (``ndarray.resize``: ``realloc``, which moves a large
    block's pages without copying them), so that the dictionaries are held once: a join of the
    parts at the end held them twice (~220 MB more at 100,000 devices of 10 windows), and the
    parts, freed into the heap, were not handed back to the system."""

    def __init__(self, n_channels: int) -> None:
        self.n_channels = n_channels
        self._reset()

    def _reset(self) -> None:
        n_channels = self.n_channels
        self._ids: list[np.ndarray] = []
        self._values = [np.empty(0, np.uint32) for _ in range(n_channels)]
        self._used = [0] * n_channels
        self._starts: list[list[np.ndarray]] = [[np.zeros(1, np.int64)] for _ in range(n_channels)]

    def add(self, part: DeviceValues) -> None:
        """Append ``part``'s devices (their dictionaries are copied)."""
        self._ids.append(part.ids)
        for c in range(self.n_channels):
            new, at = part.values[c], self._used[c]
            need = at + len(new)
            if need > len(self._values[c]):  # 1.5x: few moves; pages never written are not resident
                self._values[c].resize(max(need, len(self._values[c]) * 3 // 2 + 4096), refcheck=False)
            self._values[c][at:need] = new
            self._starts[c].append(part.starts[c][1:] + at)
            self._used[c] = need

    def finish(self) -> DeviceValues:
        """Every device added, in ascending id (the builder is left empty)."""
        values = []
        for c in range(self.n_channels):
            self._values[c].resize(self._used[c], refcheck=False)
            values.append(self._values[c])
        ids = np.concatenate(self._ids) if self._ids else np.empty(0, np.int64)
        starts = [np.concatenate(s) for s in self._starts]
        self._reset()
        return DeviceValues(ids, values, starts).ascending()


# run_codes sorts the keys of devices of at most this many windows on average (their values are
# nearly all distinct: a hash table of them misses the caches); larger devices repeat their values,
# and hashing them is faster (3 devices of 5,376 windows: 45 ms hashed against 103 ms sorted; 1,613
# of 10: 135 against 72 ms)
SORTED_CODES_WINDOWS = 256


def run_codes(windows: np.ndarray, counts: np.ndarray,
              device_ids: np.ndarray) -> tuple[np.ndarray, DeviceValues]:
    """``DeviceCoder`` for many devices' windows at once: ``windows`` (float32 ``(n, samples,
    channels)``) are part after part, ``counts[k]`` windows of the ``k``-th, whose id is
    ``device_ids[k]``; a part is a device, or consecutive devices of one dictionary row coded
    together (``Spiller.runs``: one dictionary for them all, under the first one's id). Each
    part's distinct values per channel come from (part, bit pattern) keys for all of them, sorted
    (``_sorted_codes``) where the parts average at most ``SORTED_CODES_WINDOWS`` windows, else
    hashed (``pd.factorize``, sorted): every part's dictionary holds the values ``DeviceCoder``
    would find, sorted by bit pattern (so a part that is a whole row is that row's entries,
    ``seed_rows``). Returns the codes ``(channels, n, samples)`` of each window into its own
    part's dictionaries (uint16 while every dictionary has at most 65,536 entries, uint32
    beyond) and the parts' dictionaries (``device_ids``, ascending)."""
    import pandas as pd

    n, n_samples, n_channels = windows.shape
    n_devices = len(counts)
    run = np.repeat(np.arange(n_devices, dtype=np.uint64), counts)
    bits = np.ascontiguousarray(windows.transpose(2, 0, 1)).view(np.uint32)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]] = []
    for c in range(n_channels):
        channel = bits[c]
        per_window = n_samples > 1 and n > 0 and constant_rows(channel)
        values = channel[:, :1] if per_window else channel
        keys = (run[:, None] << np.uint64(32)) | values.astype(np.uint64)
        if n_devices and n <= SORTED_CODES_WINDOWS * n_devices:  # small devices: values nearly all distinct
            codes, distinct = _sorted_codes(keys.reshape(-1))
        else:  # large devices repeat their values: a hash of them, then a sort of the few distinct
            codes, distinct = pd.factorize(keys.reshape(-1), sort=True)
            distinct = np.asarray(distinct, dtype=np.uint64)
        edges = np.searchsorted(distinct >> np.uint64(32), np.arange(n_devices + 1, dtype=np.uint64))
        local = codes.reshape(values.shape) - edges[:-1][run.astype(np.intp)][:, None]
        found.append((local, (distinct & np.uint64(0xFFFFFFFF)).astype(np.uint32), edges, per_window))
    widest = max((int(np.diff(edges).max(initial=0)) for _, _, edges, _ in found), default=0)
    dtype = np.uint16 if widest <= 2**16 else np.uint32
    out = np.empty((n_channels, n, n_samples), dtype=dtype)
    for c, (local, _, _, _) in enumerate(found):
        out[c] = local  # one value a window broadcasts over its samples
    return out, DeviceValues(np.asarray(device_ids, np.int64), [f[1] for f in found],
                             [f[2].astype(np.int64) for f in found])


def _sorted_codes(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``pd.factorize(keys, sort=True)`` of uint64 keys: each key's rank among the distinct keys
    (int64) and the distinct keys, ascending. One stable argsort: 2.3x faster than the hash and
    sort of ``factorize`` on a run of small devices, whose values are nearly all distinct (16,384
    windows of 15-window devices: 20 against 46 ms a channel). Where the keys' high bits (the
    device's place in the run), their 32 low bits and a key's place fit in 64 bits, one sort of
    ``key << bits | place`` (numpy's vectorised sort; the places only undo it) instead
    (``run_codes`` of 1,613 10-window devices, 16,128 windows: 48 against 72 ms). Also the sort
    of ``_shuffle.seed_rows``, whose keys are ``row << 32 | value`` (``_shuffle._row_ranks``)."""
    n = len(keys)
    bits = max(1, (n - 1).bit_length())
    high = int(keys.max(initial=0) >> np.uint64(32)).bit_length()
    if high + 32 + bits <= 64:
        packed = keys << np.uint64(bits)
        packed |= np.arange(n, dtype=np.uint64)
        packed.sort()
        order = (packed & np.uint64((1 << bits) - 1)).astype(np.intp)
        ranked = packed >> np.uint64(bits)
    else:
        order = np.argsort(keys, kind="stable")
        ranked = keys[order]
    first = np.empty(len(ranked), dtype=bool)
    first[:1] = True
    np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
    number = np.cumsum(first)
    number -= 1
    codes = np.empty(len(keys), dtype=np.int64)
    codes[order] = number
    return codes, ranked[first]
