"""Dictionary rows built while windows stream in: the one encoder of format 2.

``birdzarr.format._v2`` holds the layout and its decode; this module holds the rules a writer
follows (docs/format.md, "Dictionary rows"). A converter sees a device's windows a block at a time
(reader batches, slabs, a worker process's segment), so it keeps one open row per device and codes
each block against it (``RowCoder.code``):

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
dictionary arrays gain. A ``--shuffle`` conversion ``seed``s each device's row with its values
sorted by bit pattern before coding any window. ``encode`` codes a whole array in memory with a
``RowCoder`` (test stores, a store rewritten from windows): the converter's rows for the same
windows in the same order.

``RowCoder.code_runs`` codes many devices' blocks in one call (a slab of many small devices'
windows), exactly as ``code`` run by run, without a Python pass a device: the same 1 M windows
took 15.0 CPU s as 100,000 devices coded one ``code`` call each against 2.0 s as 186 devices, and
4.3 s against 1.6 s with ``code_runs`` on slabs of 65,536 windows (``python
benchmarks/many_devices.py --windows 1000000 --devices 186 100000 --files 100 --steps
code_devices code_slabs``, 2-core machine under load).

Memory: each open row keeps its entries (4 bytes each) plus a sorted copy for look-ups (12 bytes
an entry): at most 3 x 65,535 entries a row, ~50 KB for a calibrated 12-bit device. A closed row
keeps only its entries (``close_device``) until the writer stores them. Rows opened together by
``code_runs`` keep their entries in a few shared arrays (``_Bulk``), with no object a row.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from birdzarr.format._v2 import (
    MAX_ENTRIES,
    N_CHANNELS,
    N_CODED,
    WINDOW_LENGTH,
    Dictionaries,
)


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


@dataclass(eq=False)
class _Bulk:
    """Rows opened together by ``code_runs``, numbered ``first``, ``first + 1``, ...: their entries
    as a few arrays instead of an object a row (a slab of 100,000 small devices' rows). A row is
    made a ``_Row`` only when a later block of its device needs it (``row``); its entries then win
    over the bulk's (``parts``), as they may have grown."""

    first: int
    device: np.ndarray  # int64 (G,)
    counts: np.ndarray  # int64 (G, 3): entries a row and channel
    entries: list[np.ndarray]  # per channel: uint32, row after row, each in code order
    rows: dict[int, _Row] = field(default_factory=dict)  # the rows made _Row so far

    def row(self, g: int) -> _Row:
        found = self.rows.get(g)
        if found is None:
            offsets = self.counts[:g].sum(axis=0).tolist()
            ends = (self.counts[g] + offsets).tolist()
            found = _Row(self.first + g, int(self.device[g]),
                         [e[a:b] for e, a, b in zip(self.entries, offsets, ends, strict=True)])
            self.rows[g] = found
        return found

    def parts(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """The entry counts (G, 3) and each channel's entries, the grown rows' included."""
        counts = self.counts.copy()
        grown = sorted(g for g, row in self.rows.items()
                       if [len(e) for e in row.entries] != counts[g].tolist())
        if not grown:
            return counts, self.entries
        offsets = np.cumsum(self.counts, axis=0) - self.counts
        entries = []
        for c in range(N_CODED):
            pieces, at = [], 0
            for g in grown:
                pieces += [self.entries[c][at : offsets[g, c]], self.rows[g].entries[c]]
                at = int(offsets[g, c] + self.counts[g, c])
            entries.append(np.concatenate([*pieces, self.entries[c][at:]]))
        for g in grown:
            counts[g] = [len(e) for e in self.rows[g].entries]
        return counts, entries


def latest_rows(previous: Dictionaries,
                devices: set[int] | None = None) -> dict[int, tuple[int, list[np.ndarray]]]:
    """Each device's latest row of committed dictionaries (of ``devices`` only, if given): its
    number and entries (uint32 bit patterns per channel), what ``RowCoder.continuing`` takes."""
    sizes = previous.sizes()
    bits = previous.values.view(np.uint32)
    latest: dict[int, tuple[int, list[np.ndarray]]] = {}
    for r, device in enumerate(previous.device.tolist()):  # later rows of a device win
        if devices is None or device in devices:
            starts = previous.start[r]
            latest[int(device)] = (r, [bits[starts[c] : starts[c] + sizes[r, c]] for c in range(N_CODED)])
    return latest


@dataclass
class RowCoder:
    """Codes one store's windows into dictionary rows, device by device (module docstring)."""

    first_row: int = 0  # the number of the first row this coder opens
    first_value: int = 0  # the dictionary entry its first row starts at
    # each device's latest row: a _Row, or a (bulk, index) row not yet made a _Row
    _open: dict[int, _Row | tuple[_Bulk, int]] = field(default_factory=dict)
    _new: list[_Row | _Bulk] = field(default_factory=list)  # rows opened here, in order
    _n_new: int = 0  # rows in _new
    _seeded: _SeededIndex | None = None  # every seeded row at once (``code_mixed``'s fast path)
    _shares: _Shares | None = None  # devices whose rows share entries (``share``), None if none

    @classmethod
    def appending_to(cls, previous: Dictionaries) -> RowCoder:
        """A coder that continues a committed store's dictionaries: each device's latest row is
        reused (frozen) where it holds every value of the new windows."""
        return cls.continuing(latest_rows(previous), first_row=previous.n_rows,
                              first_value=len(previous.values))

    @classmethod
    def continuing(cls, latest: dict[int, tuple[int, list[np.ndarray]]], *, first_row: int,
                   first_value: int = 0) -> RowCoder:
        """A coder that opens rows from number ``first_row`` (entries from ``first_value``) and
        continues each device of ``latest`` (``latest_rows``: its committed row's number and
        entries) as ``appending_to`` does: a task coding some devices of an append."""
        coder = cls(first_row=first_row, first_value=first_value)
        for device, (number, entries) in latest.items():
            coder._open[device] = _Row(number, device, entries, frozen=True)
        return coder

    @property
    def n_rows(self) -> int:
        """Rows opened by this coder."""
        return self._n_new if self._shares is None else len(self._shares.rows)

    def share(self, groups: Iterable[Sequence[int]]) -> None:
        """Let each group of devices (``shared_groups``: consecutive small devices, before any of
        their windows) share one set of entries: the group's windows are coded into one
        dictionary, first-seen over the group's windows in store order (or seeded), and each
        device gets its own row that starts at those entries. A group is coded under its first
        device's id."""
        shares = self._shares if self._shares is not None else _Shares(self.first_row)
        for group in groups:
            members = [int(d) for d in group]
            if len(members) < 2:
                continue
            if self._n_new and not shares.rows:  # numbered as the coder's own rows so far: no more
                raise ValueError("groups are shared before any row opens")
            for d in members:
                if d in shares.key or d in self._open:
                    raise ValueError(f"device {d} already has a row or a group")
                shares.key[d] = members[0]
            shares.left[members[0]] = set(members)
        shares.lookup = None
        if shares.key:
            self._shares = shares

    def seed(self, device: int, entries: list[np.ndarray], members: Sequence[int] = ()) -> None:
        """Open ``device``'s row with the given entries (uint32 bit patterns per channel), before
        any of its windows: a shuffle knows every device's values before it writes any. With
        ``members`` (a group of ``share``, ``device`` its first), the group's entries: each member
        gets its row, in that order."""
        if self._shares is not None:
            for d in members or (device,):
                self._shares.store_row(int(d), self.first_row + self._n_new)
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
        if self._shares is None:
            return self._code(device, windows)
        codes, rows = self._code(self._shares.key.get(device, device), windows)
        return codes, self._shares.rows_of(np.full(len(rows), device, np.int64), rows)

    def _code(self, device: int, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``code`` of a row key (a device, or a group's first device), in the coder's own row
        numbers (``_Shares.rows_of`` makes them the devices')."""
        bits = np.ascontiguousarray(windows).view(np.uint32)
        n = len(bits)
        codes = np.empty((n, WINDOW_LENGTH, N_CODED), np.uint16)
        rows = np.empty(n, np.int64)
        at = 0
        while at < n:
            row = self._open_row(device)
            if row is None:
                row = self._start_row(device, [np.empty(0, np.uint32)] * N_CODED)
            taken = self._code_into(row, bits[at:], codes[at:], rows[at:])
            if taken < n - at:  # the row is full: the next window opens the device's next row
                self._start_row(device, [np.empty(0, np.uint32)] * N_CODED)
            at += taken
        return codes, rows

    def code_runs(self, devices: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``code`` for many devices' blocks at once: ``windows`` (float32 (n, 20, 4)) of
        ``devices`` (one id a window), coded exactly as ``code(device, run)`` for each run of
        equal consecutive ids in turn (same codes, rows, row numbers and entries).

        Devices without a row yet (the usual case: a slab of small devices in device order) are
        coded in one vectorised pass (``_first_seen_groups``: their entries by first occurrence),
        their rows kept as one ``_Bulk``; devices with a row (a frozen one of an append, a seeded
        one, one continued from an earlier block) and devices that would pass ``MAX_ENTRIES``
        (the overflow rule) device by device. Rows are then numbered in the order ``code`` would
        have opened them: by their first window. A device stays open after the call
        (``close_device`` or ``close_devices`` when it has no more windows)."""
        devices = np.asarray(devices, dtype=np.int64).reshape(-1)
        if len(devices) != len(windows):
            raise ValueError(f"{len(devices)} device ids for {len(windows)} windows")
        if self._shares is None:
            return self._code_runs(devices, windows)
        codes, rows = self._code_runs(self._shares.keys(devices), windows)
        return codes, self._shares.rows_of(devices, rows)

    def _code_runs(self, devices: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``code_runs`` of row keys, in the coder's own row numbers."""
        n = len(devices)
        codes = np.empty((n, WINDOW_LENGTH, N_CODED), np.uint16)
        rows = np.empty(n, np.int64)
        if not n:
            return codes, rows
        bits = np.ascontiguousarray(windows).view(np.uint32)
        before = len(self._new), self._n_new
        ids, inverse = np.unique(devices, return_inverse=True)
        inverse = inverse.reshape(-1)
        has_row = np.zeros(len(ids), bool)
        if self._open:
            has_row[:] = [d in self._open for d in ids.tolist()]
        old = has_row[inverse]
        if old.any():  # device by device, each device's windows in order (blocks do not matter)
            where = np.flatnonzero(old)
            order = where[np.argsort(inverse[where], kind="stable")]
            ordered = inverse[order]
            bounds = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1], True])
            for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
                mine = order[begin:end]
                codes[mine], rows[mine] = self._code(int(ids[ordered[begin]]), windows[mine])
        if not old.all():
            self._code_fresh_devices(np.flatnonzero(~old), devices, windows, bits, codes, rows)
        self._number_by_first_window(before, rows)
        return codes, rows

    def close_devices(self, devices: np.ndarray) -> None:
        """``close_device`` for each of ``devices``."""
        for device in np.asarray(devices).reshape(-1).tolist():
            self.close_device(device)

    def code_mixed(self, devices: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``code`` for windows of several devices (``devices``: one id a window); each device's
        windows are coded in the order they appear."""
        devices = np.asarray(devices, dtype=np.int64).reshape(-1)
        if self._shares is None:
            return self._code_mixed(devices, windows)
        codes, rows = self._code_mixed(self._shares.keys(devices), windows)
        return codes, self._shares.rows_of(devices, rows)

    def _code_mixed(self, devices: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``code_mixed`` of row keys, in the coder's own row numbers."""
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
            codes[where], rows[where] = self._code(int(ordered[begin]), windows[where])
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
            seeded = [row for row in self._new
                      if isinstance(row, _Row) and row.seeded and self._open.get(row.device) is row]
            if not seeded:
                return None
            self._seeded = _SeededIndex.of(seeded)
        return self._seeded if self._seeded.valid else None

    def close_device(self, device: int) -> None:
        """``device`` has no more windows: drop its look-up state (its entries stay); a group's
        once every member is closed."""
        key = device if self._shares is None else self._shares.close(device)
        if key is not None:
            self._open.pop(key, None)

    def new_rows(self) -> Dictionaries:
        """The rows opened here as dictionary arrays: entries row after row, channel after channel
        within a row; starts counted from ``first_value``."""
        if not self._new:
            return Dictionaries.empty()
        counts: list[np.ndarray] = []
        entries: list[list[np.ndarray]] = [[] for _ in range(N_CODED)]
        devices: list[np.ndarray] = []
        for part in self._new:
            if isinstance(part, _Row):
                counts.append(np.array([[len(e) for e in part.entries]], np.int64))
                part_entries, device = part.entries, np.array([part.device], np.int64)
            else:
                part_counts, part_entries = part.parts()
                counts.append(part_counts)
                device = part.device
            devices.append(device)
            for c in range(N_CODED):
                entries[c].append(part_entries[c])
        count = np.concatenate(counts)
        flat = count.reshape(-1)
        start = (np.cumsum(flat) - flat).reshape(count.shape)
        total = int(flat.sum())
        values = np.empty(total, np.uint32)
        # rows cut into pieces of about _SCATTER entries: the positions computed for a piece at a
        # time (8 bytes an entry: for all at once, 3 x 160 MB at 100,000 small devices)
        cuts = np.unique(np.searchsorted(start[:, 0], np.arange(0, total, _SCATTER), side="right") - 1)
        pieces = list(zip(cuts.tolist(), [*cuts[1:].tolist(), len(count)], strict=True))
        for c in range(N_CODED):  # channel c's entries, row after row, into each row's slot
            channel = np.concatenate(entries[c])
            before = np.cumsum(count[:, c]) - count[:, c]  # of channel c, in the earlier rows
            ends = np.append(before[1:], len(channel))
            for a, b in pieces:
                lo, hi = int(before[a]), int(ends[b - 1])
                slots = np.repeat(start[a:b, c] - before[a:b], count[a:b, c]) + np.arange(lo, hi)
                values[slots] = channel[lo:hi]
        own = Dictionaries(values.view(np.float32), start + self.first_value, np.concatenate(devices))
        return own if self._shares is None else self._shares.devices_rows(own)

    # -- inside ----------------------------------------------------------------------------------
    def _start_row(self, device: int, entries: list[np.ndarray]) -> _Row:
        row = _Row(self.first_row + self._n_new, device, entries)
        self._new.append(row)
        self._n_new += 1
        self._open[device] = row
        return row

    def _open_row(self, device: int) -> _Row | None:
        """``device``'s open row (made a ``_Row`` if it is a bulk's), None if it has none."""
        row = self._open.get(device)
        if isinstance(row, tuple):
            row = self._open[device] = row[0].row(row[1])
        return row

    def _code_fresh_devices(self, where: np.ndarray, devices: np.ndarray, windows: np.ndarray,
                            bits: np.ndarray, codes: np.ndarray, rows: np.ndarray) -> None:
        """``code_runs`` for the windows ``where`` of devices without a row: each device's windows
        form one row, its entries in first-seen order (``_first_seen_groups``), the rows opened
        in the order of the devices' first windows. A device that would pass ``MAX_ENTRIES`` in
        a channel is coded by ``code`` (the overflow rule)."""
        ids, first, inverse = np.unique(devices[where], return_index=True, return_inverse=True)
        by_first = np.argsort(first)
        rank = np.empty(len(ids), np.intp)
        rank[by_first] = np.arange(len(ids))
        group = rank[inverse.reshape(-1)]
        if not bool((group[1:] >= group[:-1]).all()):  # a device's windows together
            order = np.argsort(group, kind="stable")
            where, group = where[order], group[order]
        every = len(where) == len(bits) and bool((where[1:] > where[:-1]).all())
        found, counts, entries = _first_seen_groups(bits if every else bits[where], group, len(ids))
        codes[where] = found
        over = (counts > MAX_ENTRIES).any(axis=1)
        if over.any():  # those devices' entries leave the bulk
            entries = [e[np.repeat(~over, counts[:, c])] for c, e in enumerate(entries)]
        kept = np.flatnonzero(~over)
        number = np.full(len(ids), -1, np.int64)
        number[kept] = self.first_row + self._n_new + np.arange(len(kept))
        bulk = _Bulk(self.first_row + self._n_new, ids[by_first][kept], counts[kept], entries)
        self._new.append(bulk)
        self._n_new += len(kept)
        self._open.update(zip(bulk.device.tolist(), ((bulk, g) for g in range(len(kept))), strict=True))
        rows[where] = number[group]
        for g in np.flatnonzero(over).tolist():  # the overflow rule, device by device
            mine = where[group == g]
            codes[mine], rows[mine] = self._code(int(ids[by_first[g]]), windows[mine])

    def _number_by_first_window(self, before: tuple[int, int], rows: np.ndarray) -> None:
        """Renumber the rows opened since ``(len(self._new), self._n_new) == before`` (every one
        codes some of ``rows``' windows) in the order of their first window, as ``code`` opens
        them; ``rows`` is changed to match. A bulk stays one unless rows must go between its own
        (an append's new rows, the overflow rule): then it becomes a ``_Row`` a row."""
        parts, opened_before = before
        if self._n_new - opened_before < 2:
            return
        base = self.first_row + opened_before
        local = rows - base
        opened = local >= 0
        found, first = np.unique(local[opened], return_index=True)
        if len(found) != self._n_new - opened_before:  # pragma: no cover - every new row codes a window
            raise AssertionError("a row opened without a window")
        by_first = np.argsort(first, kind="stable")
        if bool((by_first[1:] > by_first[:-1]).all()):
            return  # already in that order
        new: list[_Row] = []
        for part in self._new[parts:]:
            if isinstance(part, _Row):
                new.append(part)
                continue
            for g in range(len(part.device)):
                row = part.row(g)
                new.append(row)
                ref = self._open.get(row.device)
                if isinstance(ref, tuple) and ref[0] is part and ref[1] == g:
                    self._open[row.device] = row
        number = np.empty(len(found), np.int64)
        number[by_first] = np.arange(len(found))
        rows[opened] = number[local[opened]] + base
        ordered = [new[i] for i in by_first.tolist()]
        for i, row in enumerate(ordered):
            row.number = base + i
        self._new[parts:] = ordered

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
        block's distinct values in first-seen order, found with numpy alone in one sort of the
        three channels' values (``_first_seen``). The same codes as the hash look-up, without its
        fixed cost (~0.3 ms a channel: two pandas indexes and a unique), which made a
        20,000-device conversion of 15-window devices spend half its CPU here."""
        n = len(bits)
        found = _first_seen(bits)
        if found is None:
            return self._code_prefix(row, bits, codes, rows)
        codes[:n], row.entries, row._lookups = found[0], found[1], []
        rows[:n] = row.number
        return n

    def _code_prefix(self, row: _Row, bits: np.ndarray, codes: np.ndarray, rows: np.ndarray) -> int:
        """The overflow rule: code the longest leading run of windows ``row`` can still hold
        (``_room``; the rule is rare: values that are not 12-bit counts); 0 when it holds none."""
        fits = _room(bits, row.entries)
        if fits == 0:
            if not any(len(e) for e in row.entries):  # pragma: no cover - 20 values a window
                raise AssertionError("one window overflows an empty row")
            return 0
        return self._code_into(row, bits[:fits], codes[:fits], rows[:fits])


def _room(bits: np.ndarray, entries: list[np.ndarray]) -> int:
    """How many leading windows of ``bits`` (uint32 (n, 20, 4)) a row holding ``entries`` (uint32
    per channel) can take without passing ``MAX_ENTRIES`` entries in any channel: the row gains a
    value at the window where it first occurs, unless the row holds it already."""
    n = len(bits)
    fits = n
    for c in range(N_CODED):
        values = bits[:, :, c].reshape(-1)
        distinct, first = np.unique(values, return_index=True)
        new = first[~np.isin(distinct, entries[c], assume_unique=True)]
        total = len(entries[c]) + np.cumsum(np.bincount(new // WINDOW_LENGTH, minlength=n))
        fits = min(fits, int(np.searchsorted(total, MAX_ENTRIES, side="right")))
    return fits


@dataclass(frozen=True)
class Encoded:
    """What ``encode`` stores: the windows' codes, rows and gps_speed, and the rows to append to
    the dictionary arrays (``new.start`` is absolute: it already counts the earlier entries)."""

    codes: np.ndarray  # uint16 (n, 20, 3)
    row: np.ndarray  # uint32 (n,)
    gps: np.ndarray  # float32 (n, 20)
    new: Dictionaries


def encode(windows: np.ndarray, device: np.ndarray, previous: Dictionaries | None = None) -> Encoded:
    """Code float32 windows (n, 20, 4) of the given devices (any integer key a window, the key the
    rows record) in one call: ``RowCoder.code_runs`` of a new coder, or of one appending to
    ``previous`` (the store's dictionary arrays: its devices follow the append rule). The rows a
    converter writes for the same windows in the same order (device order: entries first-seen, rows
    numbered by their first window; a device's windows need not lie together)."""
    windows = np.ascontiguousarray(windows)
    if windows.dtype != np.float32 or windows.ndim != 3 or windows.shape[1:] != (WINDOW_LENGTH, N_CHANNELS):
        raise ValueError(f"windows must be float32 (n, {WINDOW_LENGTH}, {N_CHANNELS}), got "
                         f"{windows.dtype} {windows.shape}")
    device = np.asarray(device, dtype=np.int64).reshape(-1)
    if len(device) != len(windows):
        raise ValueError(f"{len(device)} device keys for {len(windows)} windows")
    coder = RowCoder() if previous is None else RowCoder.appending_to(previous)
    codes, rows = coder.code_runs(device, windows)
    if coder.first_row + coder.n_rows >= 2**32 - 1:
        raise ValueError("more than 2**32 - 2 dictionary rows")
    return Encoded(codes, rows.astype(np.uint32), np.ascontiguousarray(windows[:, :, 3]), coder.new_rows())


SHARED_ROW_WINDOWS = 2048  # a group's windows: 40,960 values a channel, so a shared row never overflows


def shared_groups(devices: Sequence[int], counts: Sequence[int], *,
                  alone: Container[int] = ()) -> list[list[int]]:
    """The groups of consecutive devices (in store order) whose rows share their entries: devices
    of at most ``SHARED_ROW_WINDOWS`` windows each, gathered while the group holds at most
    ``SHARED_ROW_WINDOWS`` windows; a larger device, or one of ``alone`` (an append's devices that
    continue their committed rows), ends a group. Groups of one device are left out (own rows).
    A pure function of the devices and their counts, so every executor, and a plan cut only at
    group boundaries, gives the same groups."""
    groups: list[list[int]] = []
    group: list[int] = []
    held = 0
    for device, count in zip(devices, counts, strict=True):
        small = 0 < count <= SHARED_ROW_WINDOWS and device not in alone
        if not small or held + count > SHARED_ROW_WINDOWS:
            if len(group) > 1:
                groups.append(group)
            group, held = [], 0
        if small:
            group.append(int(device))
            held += int(count)
    if len(group) > 1:
        groups.append(group)
    return groups


@dataclass
class _Shares:
    """A coder's groups (``RowCoder.share``) and the devices' own rows: the coder codes a group
    under one key into one set of entries (its own rows), and each (device, own row) pair it
    codes becomes a row of the store, numbered in the order of its first window (or seeding),
    which is where the row opens; the store's row starts at its own row's entries.

    A pair is kept as one int, ``own << 32 | device`` (``_pair_keys``), not a tuple: the
    100,000 tuples of as many small devices, made and looked up a method call each, cost a
    conversion several times the CPU of the ints, made by numpy and looked up by
    comprehensions, most of it the garbage collector walking a heap the tuples fill (ints are
    not tracked)."""

    first_row: int
    key: dict[int, int] = field(default_factory=dict)  # member -> the group's key (first member)
    left: dict[int, set[int]] = field(default_factory=dict)  # key -> members not closed yet
    lookup: tuple[np.ndarray, np.ndarray] | None = None  # members sorted, and their keys
    number: dict[int, int] = field(default_factory=dict)  # (device, own row) pair -> row
    rows: list[int] = field(default_factory=list)  # the rows' (device, own row) pairs

    def keys(self, devices: np.ndarray) -> np.ndarray:
        """Each window's row key: its group's, or its device id."""
        if self.lookup is None:
            members = np.array(sorted(self.key), np.int64)
            self.lookup = members, np.array([self.key[d] for d in members.tolist()], np.int64)
        members, keys = self.lookup
        if not len(members):
            return devices
        at = np.minimum(np.searchsorted(members, devices), len(members) - 1)
        return np.where(members[at] == devices, keys[at], devices)

    def store_row(self, device: int, own: int) -> int:
        """The store's row of ``device``'s windows coded in the coder's row ``own``."""
        if not 0 <= device < 2**32:
            raise ValueError("devices of shared rows have ids 0 to 2**32 - 1")
        pair = own << 32 | device  # as _pair_keys, without arrays: one call a seeded row
        number = self.number.get(pair)
        if number is None:
            number = self.number[pair] = self.first_row + len(self.rows)
            self.rows.append(pair)
        return number

    def rows_of(self, devices: np.ndarray, own: np.ndarray) -> np.ndarray:
        """The store's rows of windows of ``devices`` coded in the coder's rows ``own`` (rows
        below ``first_row``, an append's committed ones, stay)."""
        if not len(own):
            return own
        cut = np.flatnonzero(np.r_[True, (devices[1:] != devices[:-1]) | (own[1:] != own[:-1])])
        pairs = _pair_keys(devices[cut], own[cut]).tolist()
        known = self.number.get
        numbers = [known(pair) for pair in pairs]
        if None in numbers:  # new pairs, numbered in the order of their first window
            first = self.first_row
            opened = dict.fromkeys([pair for pair, number in zip(pairs, numbers, strict=True)
                                    if number is None and pair >> 32 >= first])
            at = first + len(self.rows)
            self.number.update(zip(opened, range(at, at + len(opened)), strict=True))
            self.rows.extend(opened)
            numbers = [known(pair, pair >> 32) for pair in pairs]  # a committed row (below first_row) stays
        return np.repeat(np.array(numbers, np.int64), np.diff(np.r_[cut, len(own)]))

    def close(self, device: int) -> int | None:
        """The row key to close once ``device`` is closed (None while its group has members open)."""
        key = self.key.get(device)
        if key is None:
            return device
        left = self.left.get(key)
        if left is None:
            return None  # closed already
        left.discard(device)
        if left:
            return None
        del self.left[key]
        return key

    def devices_rows(self, own: Dictionaries) -> Dictionaries:
        """The store's rows from the coder's own (``own``: its rows from ``first_row``, their
        entries): each (device, own row) a row starting at its own row's entries."""
        pairs = np.array(self.rows, np.uint64)
        index = (pairs >> np.uint64(32)).astype(np.int64) - self.first_row
        device = (pairs & np.uint64(0xFFFFFFFF)).astype(np.int64)
        return Dictionaries(own.values, own.start[index], device)


def _pair_keys(devices: np.ndarray, own: np.ndarray) -> np.ndarray:
    """(device, own row) pairs as uint64 ``own << 32 | device`` (``_Shares``): a store's device
    ids are int32, non-negative, and its rows below 2**32."""
    if len(devices) and (int(devices.min()) < 0 or int(devices.max()) >= 2**32):
        raise ValueError("devices of shared rows have ids 0 to 2**32 - 1")
    return (own.astype(np.uint64) << np.uint64(32)) | devices.astype(np.uint64)


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


_CHANNEL_KEY = (np.arange(N_CODED, dtype=np.uint64) << np.uint64(32))[:, None, None]


def _first_seen(bits: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """Codes (uint16 (n, 20, 3)) and entries (uint32 per channel, first-seen order) of one row
    holding exactly the windows ``bits`` (uint32 (n, 20, 4)); None if a channel has more than
    ``MAX_ENTRIES`` distinct values. The channels' values, channel after channel, become keys
    ``channel << 32 | value`` and one hash factorisation (``pd.factorize``: codes by first
    occurrence) codes them all: channel c's values all follow channel c - 1's, so its distinct
    values are numbered after every earlier channel's, in first-seen order. Measured 1.5-4x
    faster than ``np.unique`` of the same keys (15 to 1,600 windows)."""
    import pandas as pd

    n = len(bits)
    keys = bits[:, :, :N_CODED].transpose(2, 0, 1).astype(np.uint64)
    keys |= _CHANNEL_KEY
    found, distinct = pd.factorize(keys.reshape(-1))
    counts = np.bincount((distinct >> np.uint64(32)).astype(np.intp), minlength=N_CODED)
    if int(counts.max()) > MAX_ENTRIES:
        return None
    offsets = np.cumsum(counts) - counts
    codes = (found.reshape(N_CODED, n, WINDOW_LENGTH) - offsets[:, None, None]).astype(np.uint16)
    entries = distinct.astype(np.uint32)
    return (codes.transpose(1, 2, 0),
            [entries[o : o + k] for o, k in zip(offsets.tolist(), counts.tolist(), strict=True)])


_SCATTER = 1 << 20  # dictionary entries placed at once by RowCoder.new_rows
_FACTORISED = 2**13  # values hashed at once, cut between devices: a hash table that stays in the caches


def _first_seen_groups(bits: np.ndarray, group: np.ndarray, n_groups: int
                       ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """``_first_seen`` for the windows ``bits`` (uint32 (n, 20, 4)) of ``n_groups`` rows at once:
    ``group`` (ascending, 0..n_groups-1, every one present) gives each window's row. Returns the
    codes (uint16 (n, 20, 3); meaningless for a row with more than ``MAX_ENTRIES`` entries in
    some channel), the entries a row and channel (int64 (n_groups, 3)), and each channel's
    entries, row after row, each row's in first-seen order.

    A channel's keys ``group << 32 | value`` in window order hold each row's values together, so
    one hash factorisation (codes by first occurrence) numbers the distinct values row after row,
    each row's in first-seen order; a value's code is its number less its row's first number.
    The keys are factorised ``_FACTORISED`` at a time, cut between rows (one table of millions of
    nearly distinct keys is several times slower)."""
    import pandas as pd

    n = len(bits)
    codes = np.empty((n, WINDOW_LENGTH, N_CODED), np.uint16)
    counts = np.empty((n_groups, N_CODED), np.int64)
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    at = np.searchsorted(starts, np.arange(_FACTORISED // WINDOW_LENGTH, n, _FACTORISED // WINDOW_LENGTH))
    bounds = [0, *np.unique(starts[at[at < len(starts)]]).tolist(), n]
    high = (group.astype(np.uint64) << np.uint64(32))[:, None]
    entries = []
    for c in range(N_CODED):
        found = np.empty((n, WINDOW_LENGTH), np.int64)
        distinct, seen = [], 0
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            part, part_distinct = pd.factorize((high[a:b] | bits[a:b, :, c]).reshape(-1))
            found[a:b] = part.reshape(b - a, WINDOW_LENGTH) + seen
            seen += len(part_distinct)
            distinct.append(part_distinct)
        keys = np.concatenate(distinct)
        counts[:, c] = np.bincount((keys >> np.uint64(32)).astype(np.intp), minlength=n_groups)
        found -= (np.cumsum(counts[:, c]) - counts[:, c])[group][:, None]
        codes[:, :, c] = found  # wraps past 65,535: that row is coded again by the caller
        entries.append(keys.astype(np.uint32))
    return codes, counts, entries
