"""gdict16 chunks encoded from codes into per-device dictionaries, without a sort.

``birdzarr.format._codec.encode_gdict16`` (the reference) finds a shuffled chunk's distinct
(device, value) pairs by sorting all of them: ~75,000 of 163,840 per channel in an 8192-window
chunk of 186 devices. The shuffle knows every value already as a code into its device's
dictionary (the device's sorted distinct values of that channel, by uint32 bit pattern, in a
``DictionaryTable``). A chunk's gdict16 dictionary of one device is then the device entries its
windows use, in the same order: marking the used entries and numbering them replaces the sort,
and the bytes are exactly the reference's (tests/test_gdict_encode.py).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from birdzarr.format._codec import (
    MAX_CODES,
    MODE_DICT,
    constant_rows,
    encode_gdict16,
    gdict16_dictionary,
    gdict16_header,
)

PAD_GROUP = -1  # the group of the windows that pad a store's last chunk (birdzarr/convert/_chunkwrite.py)


class DictionaryTable:
    """Every device's dictionary per channel: its sorted distinct float32 bit patterns, laid
    end to end in ascending device order. A window's code in a channel is the position of its
    value in its device's dictionary (``code_dtype``: uint16 where every dictionary has at most
    65,536 entries, else uint32).

    ``dictionaries`` maps each device id to one sorted, distinct uint32 array per channel (a
    superset of the values its windows hold). The padding group (``PAD_GROUP``) gets the fill
    value 0.0 as its code 0 (the smallest bit pattern), so a padded last chunk is coded like any
    other.
    """

    def __init__(self, dictionaries: Mapping[int, Sequence[np.ndarray]], n_channels: int) -> None:
        merged = dict(dictionaries)
        zero = np.zeros(1, dtype=np.uint32)
        pad = merged.get(PAD_GROUP)
        merged[PAD_GROUP] = [zero if pad is None else np.union1d(pad[c], zero) for c in range(n_channels)]
        self.device_ids = np.array(sorted(merged), dtype=np.int64)
        self.values: list[np.ndarray] = []  # per channel: uint32 bit patterns
        # (channel, device + 1): device k's entries are values[c][starts[c, k] : starts[c, k + 1]]
        self.starts = np.zeros((n_channels, len(self.device_ids) + 1), dtype=np.int64)
        for c in range(n_channels):
            parts = [np.asarray(merged[int(d)][c], dtype=np.uint32) for d in self.device_ids]
            self.starts[c, 1:] = np.cumsum([len(p) for p in parts])
            self.values.append(np.concatenate(parts))
        largest = int(np.diff(self.starts, axis=1).max(initial=0))
        self.code_dtype = np.dtype(np.uint16 if largest <= 2**16 else np.uint32)
        self._scratch = threading.local()

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values) + self.starts.nbytes

    def codes_of(self, device_id: int, channel: int, values: np.ndarray) -> np.ndarray:
        """The codes of ``values`` (bit patterns, each in the device's dictionary)."""
        start, stop = self._range(device_id, channel)
        return np.searchsorted(self.values[channel][start:stop], values).astype(self.code_dtype)

    def values_of(self, device_id: int, channel: int) -> np.ndarray:
        """The device's dictionary of ``channel`` (a view)."""
        start, stop = self._range(device_id, channel)
        return self.values[channel][start:stop]

    def _range(self, device_id: int, channel: int) -> tuple[int, int]:
        position = int(np.searchsorted(self.device_ids, device_id))
        if position == len(self.device_ids) or self.device_ids[position] != device_id:
            raise KeyError(f"device {device_id} has no dictionary")
        return int(self.starts[channel, position]), int(self.starts[channel, position + 1])

    def decode(self, codes: np.ndarray, groups: np.ndarray) -> np.ndarray:
        """Float32 windows ``(n, samples, channels)`` from codes ``(n, channels, samples)`` of
        windows of devices ``groups``."""
        n, n_channels, n_samples = codes.shape
        position = np.searchsorted(self.device_ids, groups)
        bits = np.empty((n, n_samples, n_channels), dtype=np.uint32)
        for c in range(n_channels):
            index = codes[:, c, :] + self.starts[c][position][:, None]
            np.take(self.values[c], index, out=bits[:, :, c])
        return bits.view(np.float32)

    def encode(self, codes: np.ndarray, groups: np.ndarray, n_windows: int | None = None) -> bytes:
        """The gdict16 body (before blosc) of a chunk: ``codes`` ``(windows, channels, samples)``
        of windows of devices ``groups``; with ``n_windows`` larger than ``len(codes)``, padded
        to that many windows as ``encode_gdict16`` sees a store's last chunk (value 0.0, group
        ``PAD_GROUP``)."""
        if n_windows is not None and n_windows > len(codes):
            padded = np.zeros((n_windows, *codes.shape[1:]), dtype=codes.dtype)  # code 0: value 0.0
            padded[: len(codes)] = codes
            codes = padded
            groups = np.concatenate([groups, np.full(n_windows - len(groups), PAD_GROUP, dtype=groups.dtype)])
        n_windows, n_channels, n_per_window = codes.shape
        labels, group = np.unique(groups, return_inverse=True)
        if n_windows == 0 or len(labels) > MAX_CODES:
            # the reference then codes the chunk as one group: rare enough to leave to it
            return encode_gdict16(self.decode(codes, groups), groups)
        n_groups = len(labels)
        # each group's device, and each window's, in the table (every label is one of its devices)
        group_position = np.searchsorted(self.device_ids, labels)
        position = group_position[group]
        scratch = self._buffers(n_windows * n_per_window)
        used, rank = scratch.used, scratch.rank
        sizes = np.zeros((n_channels, n_groups), dtype="<u4")
        out_codes = scratch.codes[: n_channels * n_windows * n_per_window].reshape(n_channels, n_windows, -1)
        halves: list[np.ndarray] = []
        for c in range(n_channels):
            channel = codes[:, c, :]
            offsets = self.starts[c][position]
            # a channel constant within each window (gps_speed) is looked up once a window
            per_window = n_per_window > 1 and constant_rows(channel)
            # each value's entry in the table (numpy indexes with intp: made once, contiguous)
            if per_window:
                keys = channel[:, 0] + offsets
            else:
                keys = scratch.keys[: n_windows * n_per_window].reshape(n_windows, n_per_window)
                np.add(channel, offsets[:, None], out=keys)
            used[keys] = True
            entries = np.flatnonzero(used[: len(self.values[c])])  # ascending: by device, then value
            used[entries] = False  # the scratch is clean again for the next channel
            counts = np.diff(np.searchsorted(entries, self.starts[c]))[group_position]
            if counts.max(initial=0) > MAX_CODES:  # raw floats: rare enough to leave to the reference
                return encode_gdict16(self.decode(codes, groups), groups)
            first = np.cumsum(counts) - counts  # each group's first entry among ``entries``
            # an entry's code: its place among the entries its device uses in this chunk
            rank[entries] = np.arange(len(entries), dtype=np.int32) - np.repeat(first.astype(np.int32),
                                                                                   counts)
            if per_window:
                out_codes[c] = rank[keys][:, None]
            else:
                np.take(rank, keys, out=out_codes[c], mode="clip")
            sizes[c] = counts
            halves += gdict16_dictionary(self.values[c][entries], counts)
        header = gdict16_header(MODE_DICT, n_windows, n_per_window, n_channels, n_groups)
        # joined straight from the arrays' buffers (the codes are this thread's scratch)
        return b"".join(part.data for part in (header, group.astype("<u2"), sizes, *halves, out_codes))

    def _buffers(self, n_values: int) -> Any:
        """This thread's scratch, reused from chunk to chunk (new memory costs a page fault per
        4 KiB, more than the work done in it): a used flag and a new code per table entry (of
        the largest channel), and a table index and an output code per value of a channel."""
        scratch = self._scratch
        if getattr(scratch, "used", None) is None:
            size = max(len(v) for v in self.values)
            scratch.used = np.zeros(size, dtype=bool)
            scratch.rank = np.zeros(size, dtype=np.uint16)
            scratch.keys = scratch.codes = np.empty(0)
        if len(scratch.keys) < n_values:
            scratch.keys = np.empty(n_values, dtype=np.intp)
            scratch.codes = np.empty(len(self.values) * n_values, dtype="<u2")
        return scratch



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
