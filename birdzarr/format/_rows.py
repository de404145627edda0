"""Dictionary rows built while windows stream in: how every writer codes format 2.

``birdzarr.format._v2.encode`` codes a whole array at once. A converter sees a device's windows a
block at a time (reader batches, slabs, a worker process's segment), so it keeps one open row per
device and codes each block against it (``RowCoder.code``):

- a value the row lacks is appended to its entries (first-seen order), so every earlier code keeps
  its meaning and nothing written is revisited;
- a row that would pass ``MAX_ENTRIES`` (65,535) entries in some channel is closed at the first
  window that would overflow it, and that window opens the device's next row (the overflow rule);
- a row read from a committed store (``previous``: an append) is *frozen*, its entries already
  stored: new windows that need values it lacks get a new row whose entries are the frozen row's
  followed by the new values (the append rule), so old codes and bytes never change.

The rows, codes and row numbers depend only on each device's windows in store order, never on how
they were cut into blocks, so every writer (threads, worker processes, Dask tasks) stores the same
bytes. Rows are numbered in the order they open, from ``first_row``; ``new_rows`` gives what the
dictionary arrays gain.

Memory: each open row keeps its entries (4 bytes each) plus a sorted copy for look-ups (12 bytes
an entry): at most 3 x 65,535 entries a row, ~50 KB for a calibrated 12-bit device. A closed row
keeps only its entries (``close_device``) until the writer stores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from birdzarr.format._v2 import FIRST, MAX_ENTRIES, N_CODED, WINDOW_LENGTH, Dictionaries, _extend_row

_ORDERS = (FIRST,) * N_CODED


@dataclass
class _Row:
    number: int
    device: int
    entries: list[np.ndarray]  # uint32 bit patterns per channel, in code order
    frozen: bool = False  # stored already (an append's previous rows): never grows
    seeded: bool = False  # opened by ``seed``: entries sorted by bit pattern until it grows
    _lookups: list[Any] = field(default_factory=list)  # per channel: a pandas Index of the entries

    def lookup(self, channel: int) -> Any:
        """A hash index of the channel's entries (``get_indexer``: a value's code, -1 if absent):
        8x faster here than sorting the block's values (``np.unique``) for 1.3 M values."""
        if not self._lookups:
            import pandas as pd

            self._lookups = [pd.Index(e) for e in self.entries]
        return self._lookups[channel]

    def grow(self, added: list[np.ndarray]) -> list[np.ndarray]:
        return [np.concatenate([e, a]) for e, a in zip(self.entries, added, strict=True)]


@dataclass
class RowCoder:
    """Codes one store's windows into dictionary rows, device by device (module docstring)."""

    first_row: int = 0  # the number of the first row this coder opens
    first_value: int = 0  # the dictionary entry its first row starts at
    _open: dict[int, _Row] = field(default_factory=dict)  # each device's latest row
    _new: list[_Row] = field(default_factory=list)  # rows opened here, in order
    _seeded: _SeededIndex | None = None  # every seeded row at once (``code_mixed``'s fast path)

    @classmethod
    def appending_to(cls, previous: Dictionaries) -> RowCoder:
        """A coder that continues a committed store's dictionaries: each device's latest row is
        reused (frozen) where it holds every value of the new windows."""
        coder = cls(first_row=previous.n_rows, first_value=len(previous.values))
        sizes = previous.sizes()
        bits = previous.values.view(np.uint32)
        for r, device in enumerate(previous.device.tolist()):  # later rows of a device win
            starts = previous.start[r]
            entries = [bits[starts[c] : starts[c] + sizes[r, c]] for c in range(N_CODED)]
            coder._open[int(device)] = _Row(r, int(device), entries, frozen=True)
        return coder

    @property
    def n_rows(self) -> int:
        """Rows opened by this coder."""
        return len(self._new)

    def seed(self, device: int, entries: list[np.ndarray]) -> None:
        """Open ``device``'s row with the given entries (uint32 bit patterns per channel), before
        any of its windows: a shuffle knows every device's values before it writes any."""
        if device in self._open:
            raise ValueError(f"device {device} already has a row")
        if any(len(e) > MAX_ENTRIES for e in entries):
            raise ValueError(f"a seeded row holds at most {MAX_ENTRIES} entries a channel")
        arrays = [np.asarray(e, np.uint32) for e in entries]
        row = self._start_row(device, arrays)
        row.seeded = all(bool((e[1:] > e[:-1]).all()) for e in arrays)  # the fast path needs them sorted
        self._seeded = None

    def code(self, device: int, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Codes (uint16 (n, 20, 3)) and row numbers (int64 (n,)) of ``device``'s next windows
        (float32 (n, 20, 4), in store order)."""
        bits = np.ascontiguousarray(windows).view(np.uint32)
        n = len(bits)
        codes = np.empty((n, WINDOW_LENGTH, N_CODED), np.uint16)
        rows = np.empty(n, np.int64)
        at = 0
        while at < n:
            row = self._open.get(device)
            if row is None:
                row = self._start_row(device, [np.empty(0, np.uint32)] * N_CODED)
            taken = self._code_into(row, bits[at:], codes[at:], rows[at:])
            if taken < n - at:  # the row is full: the next window opens the device's next row
                self._start_row(device, [np.empty(0, np.uint32)] * N_CODED)
            at += taken
        return codes, rows

    def code_mixed(self, devices: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``code`` for windows of several devices (``devices``: one id a window); each device's
        windows are coded in the order they appear."""
        devices = np.asarray(devices).reshape(-1)
        fast = self._code_seeded(devices, windows)
        if fast is not None:
            return fast
        codes = np.empty((len(devices), WINDOW_LENGTH, N_CODED), np.uint16)
        rows = np.empty(len(devices), np.int64)
        order = np.argsort(devices, kind="stable")
        ordered = devices[order]
        bounds = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1], True])
        for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            where = order[begin:end]
            codes[where], rows[where] = self.code(int(ordered[begin]), windows[where])
        return codes, rows

    def _code_seeded(self, devices: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``code_mixed`` in one vectorised pass where every window's device has a seeded row
        that already holds all its values (a shuffle's pass 2): each value's code is its position
        in its row's sorted entries, found by one binary search a channel over the (row, value)
        keys of every seeded row (a Python loop over 20,000 devices a block took most of a
        20,000-device shuffle's pass 2). None (the caller codes device by device) otherwise."""
        if not len(devices):
            return None
        index = self._seeded_index()
        if index is None:
            return None
        at = np.searchsorted(index.devices, devices)
        at = np.minimum(at, len(index.devices) - 1)
        if not (index.devices[at] == devices).all():
            return None  # a device without a seeded row
        rows = index.rows[at]
        bits = np.ascontiguousarray(windows).view(np.uint32)
        codes = np.empty((len(devices), WINDOW_LENGTH, N_CODED), np.uint16)
        high = (rows.astype(np.uint64) << np.uint64(32))[:, None]
        for c in range(N_CODED):
            keys = high | bits[:, :, c].astype(np.uint64)
            position = np.searchsorted(index.keys[c], keys)
            position = np.minimum(position, len(index.keys[c]) - 1)
            if not (index.keys[c][position] == keys).all():
                return None  # a value its row lacks: the rows grow, device by device
            codes[:, :, c] = position - index.first[c][at][:, None]
        return codes, rows

    def _seeded_index(self) -> _SeededIndex | None:
        """The (row, value) keys of every seeded row, built once after the seeding; None if no
        row is seeded, or a row grew since (its entries are no longer sorted)."""
        if self._seeded is None:
            seeded = [row for row in self._new if row.seeded and self._open.get(row.device) is row]
            if not seeded:
                return None
            self._seeded = _SeededIndex.of(seeded)
        return self._seeded if self._seeded.valid else None

    def close_device(self, device: int) -> None:
        """``device`` has no more windows: drop its look-up state (its entries stay)."""
        self._open.pop(device, None)

    def new_rows(self) -> Dictionaries:
        """The rows opened here as dictionary arrays: entries row after row, channel after channel
        within a row; starts counted from ``first_value``."""
        if not self._new:
            return Dictionaries.empty()
        counts = np.array([[len(e) for e in row.entries] for row in self._new], np.int64)
        flat = counts.reshape(-1)
        start = (np.cumsum(flat) - flat).reshape(counts.shape) + self.first_value
        values = np.concatenate([e for row in self._new for e in row.entries]).view(np.float32)
        return Dictionaries(values, start, np.array([row.device for row in self._new], np.int64))

    # -- inside ----------------------------------------------------------------------------------
    def _start_row(self, device: int, entries: list[np.ndarray]) -> _Row:
        row = _Row(self.first_row + len(self._new), device, entries)
        self._new.append(row)
        self._open[device] = row
        return row

    def _code_into(self, row: _Row, bits: np.ndarray, codes: np.ndarray, rows: np.ndarray) -> int:
        """Code as many leading windows of ``bits`` as ``row`` (grown, or replaced by its grown copy
        if frozen) can hold; returns how many (at least 1 unless the row is full)."""
        import pandas as pd

        n = len(bits)
        if not any(len(e) for e in row.entries) and not row.frozen:
            return self._code_fresh(row, bits, codes, rows)
        found, added = [], []
        for c in range(N_CODED):
            values = bits[:, :, c].reshape(-1)
            position = row.lookup(c).get_indexer(values)
            missing = position < 0
            new = pd.unique(values[missing]) if missing.any() else np.empty(0, np.uint32)
            if len(row.entries[c]) + len(new) > MAX_ENTRIES:
                return self._code_prefix(row, bits, codes, rows)
            if len(new):
                position[missing] = len(row.entries[c]) + pd.Index(new).get_indexer(values[missing])
            found.append(position)
            added.append(np.asarray(new, np.uint32))
        if any(len(a) for a in added):
            if row.frozen:  # the append rule: a new row, the stored one untouched
                row = self._start_row(row.device, row.grow(added))
            else:
                row.entries, row._lookups = row.grow(added), []
                if row.seeded:  # no longer sorted: the seeded index no longer holds it
                    row.seeded = False
                    if self._seeded is not None:
                        self._seeded.valid = False
        for c, position in enumerate(found):
            codes[:n, :, c] = position.reshape(n, WINDOW_LENGTH)
        rows[:n] = row.number
        return n

    def _code_fresh(self, row: _Row, bits: np.ndarray, codes: np.ndarray, rows: np.ndarray) -> int:
        """``_code_into`` for a row without entries (a device's first block): its entries are the
        block's distinct values in first-seen order, found with numpy alone. The same codes as the
        hash look-up, without its fixed cost (~0.3 ms a channel: two pandas indexes and a unique),
        which made a 20,000-device conversion of 15-window devices spend half its CPU here."""
        n = len(bits)
        entries, found = [], []
        for c in range(N_CODED):
            values = bits[:, :, c].reshape(-1)
            distinct, first, inverse = np.unique(values, return_index=True, return_inverse=True)
            if len(distinct) > MAX_ENTRIES:
                return self._code_prefix(row, bits, codes, rows)
            order = np.argsort(first, kind="stable")  # the distinct values by first occurrence
            rank = np.empty(len(distinct), np.int64)
            rank[order] = np.arange(len(distinct))
            entries.append(distinct[order])
            found.append(rank[inverse.reshape(-1)])
        row.entries, row._lookups = entries, []
        for c, position in enumerate(found):
            codes[:n, :, c] = position.reshape(n, WINDOW_LENGTH)
        rows[:n] = row.number
        return n

    def _code_prefix(self, row: _Row, bits: np.ndarray, codes: np.ndarray, rows: np.ndarray) -> int:
        """The overflow rule: code the longest leading run of windows ``row`` can still hold
        (found by bisection; the rule is rare: values that are not 12-bit counts)."""
        n = len(bits)
        extended = _extend_row(bits, row.entries, _ORDERS)
        if extended is None:  # some channel would overflow: the longest prefix that fits
            fits, too_many = 0, n
            while too_many - fits > 1:  # _extend_row fits prefixes monotonically
                middle = (fits + too_many) // 2
                if _extend_row(bits[:middle], row.entries, _ORDERS) is None:
                    too_many = middle
                else:
                    fits = middle
            if fits == 0:
                if not any(len(e) for e in row.entries):  # pragma: no cover - 20 values a window
                    raise AssertionError("one window overflows an empty row")
                return 0
            return self._code_into(row, bits[:fits], codes[:fits], rows[:fits])
        raise AssertionError("the bisection and the look-up disagree on a row's room")  # pragma: no cover


@dataclass
class _SeededIndex:
    """Every seeded row's entries as sorted uint64 keys ``row << 32 | value`` a channel (rows are
    numbered in seeding order and each row's entries are sorted, so the concatenation is sorted)."""

    devices: np.ndarray  # int64, ascending: the seeded devices
    rows: np.ndarray  # int64: each device's row number
    keys: list[np.ndarray]  # per channel
    first: list[np.ndarray]  # per channel: the position of each device's first key
    valid: bool = True

    @classmethod
    def of(cls, seeded: list[_Row]) -> _SeededIndex:
        by_device = sorted(seeded, key=lambda r: r.device)
        devices = np.array([r.device for r in by_device], np.int64)
        rows = np.array([r.number for r in by_device], np.int64)
        by_number = sorted(seeded, key=lambda r: r.number)
        keys, first = [], []
        for c in range(N_CODED):
            counts = np.array([len(r.entries[c]) for r in by_number], np.int64)
            offsets = (np.cumsum(counts) - counts).tolist()
            starts = dict(zip((r.number for r in by_number), offsets, strict=True))
            number = np.repeat(np.array([r.number for r in by_number], np.uint64), counts)
            values = np.concatenate([r.entries[c] for r in by_number]).astype(np.uint64)
            keys.append((number << np.uint64(32)) | values)
            first.append(np.array([starts[int(n)] for n in rows], np.int64))
        return cls(devices, rows, keys, first)
