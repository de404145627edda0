"""One dictionary per channel shared by consecutive chunks of a resident dict16 selection, or by
consecutive dictionary rows of a resident version-2 selection (``share_rows``).

A dict16 chunk stores each channel's distinct values and a 16-bit code per value. Consecutive
chunks of a device-ordered store hold the same device's values, so their dictionaries overlap
almost entirely. Resident mode merges them: consecutive chunks form a group while, in every
channel, the union of their dictionaries has at most 65,536 values (codes stay 16-bit), and
their codes are recoded into the group's union, sorted by bit pattern.

Why: every value of a batch is a lookup in the table of all dictionaries. On the loader
benchmark's 2.5 M-window store the table shrinks from 15.2 MB (306 chunks) to 6.0 MB (9
groups), and a batch's lookups, in ascending row order, stay within one group's union (a few
hundred KB, held by the CPU's L2 cache) for many windows at a time: the host decode of a batch
took 3.84 against 4.39 ms with every chunk's dictionary apart, measured when birdzarr still
wrote dict16 stores (the two versions alternated). The recode costs one pass over the codes
while loading.

A version-2 store holds one dictionary row per device, and small devices' shared rows each hold
the union of up to 2,048 windows' values: the held table grows with the devices (3.57 M entries
at 100,000 devices against 1.51 M at 186, for the same 1 M windows). ``share_rows`` merges the
rows with the same greedy grouping (``format._share.share_groups``, which the ``--shuffle``
writer also uses to store its rows merged: such a store's rows share one union already, and
nothing is merged here), with one more rule: a row joins only if at least half its entries are
in the group already (estimated first on a hashed sample of its entries, so that rows with
nothing in common, devices calibrated one by one, are never sorted).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from birdzarr.format import _share
from birdzarr.format._share import MIN_SHARED, share_groups
from birdzarr.format._spec import N_CHANNELS
from birdzarr.format._v2 import sorted_distinct

MAX_ENTRIES = 2**16  # values of one channel a 16-bit code can address


@dataclass(frozen=True)
class SharedTable:
    """Every group's unions laid end to end (group after group, channel after channel), and
    where each chunk's group's union of each channel starts in them."""

    values: np.ndarray  # float32
    offsets: np.ndarray  # int64 (chunks, channels)
    groups: int


def share_dictionaries(dictionaries: Sequence[Sequence[np.ndarray]], codes: np.ndarray,
                       starts: np.ndarray, columns: Sequence[slice], *, threads: int = 1) -> SharedTable:
    """Merge consecutive chunks' dictionaries and recode ``codes`` into them, in place.

    ``dictionaries[i]`` are chunk ``i``'s float32 dictionaries, one per channel; ``codes`` are
    the uint16 codes of every chunk, a row a window (chunk ``i``'s in rows
    ``starts[i]:starts[i + 1]``), channel ``c``'s in ``columns[c]``. Afterwards
    ``values[offsets[i, c] + code]`` is the value that chunk ``i``'s ``code`` of channel ``c``
    stood for in its own dictionary. The recode runs on ``threads`` threads, a chunk at a time
    (numpy's take releases the GIL)."""
    # Nothing per chunk is kept beyond its dictionaries, which the caller holds already: sorted
    # copies are made again where needed, so the merge needs no memory but the unions.
    groups = [(first, stop, _share.sorted_bits(dictionaries[first]) if unions is None else unions)
              for first, stop, unions in share_groups(dictionaries, MAX_ENTRIES)]
    values: list[np.ndarray] = []
    offsets = np.zeros((len(dictionaries), N_CHANNELS), dtype=np.int64)
    at = 0
    for first, stop, unions in groups:
        for c, union in enumerate(unions):
            offsets[first:stop, c] = at
            values.append(union.view(np.float32))
            at += len(union)
    unions_of = [unions for first, stop, unions in groups for _ in range(first, stop)]  # by chunk

    def recode(i: int) -> None:
        for c, own in enumerate(dictionaries[i]):
            bits = _share.bits(own)
            order = np.argsort(bits)
            # the chunk's own code -> its value's place in the union (keys in ascending order:
            # numpy's search then narrows from the last one)
            remap = np.empty(len(order), dtype=np.uint16)
            remap[order] = np.searchsorted(unions_of[i][c], bits[order])
            rows = codes[starts[i] : starts[i + 1], columns[c]]
            np.take(remap, rows, out=rows)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(recode, range(len(dictionaries))))
    table = np.concatenate(values) if values else np.empty(0, dtype=np.float32)
    return SharedTable(table, offsets, len(groups))


@dataclass(frozen=True)
class SharedRows:
    """Dictionary rows merged into groups (``share_rows``): the held table, where each row's
    dictionaries start in it, and how the codes of the rows whose dictionaries moved change."""

    values: np.ndarray  # float32 (entries held): group after group, channel after channel
    start: np.ndarray  # int64 (R, channels): where each row's (group's) dictionaries start in ``values``
    # uint16: the new code of each old code, row after row (``remap_start``), then the identity
    # (``max_entries`` codes) that every row whose codes stay as they are points at
    remap: np.ndarray
    remap_start: np.ndarray  # int64 (R, channels): new code = remap[remap_start[row, c] + old code]
    recoded: np.ndarray  # bool (R,): rows whose codes change
    groups: int


def share_rows(values: np.ndarray, start: np.ndarray, sizes: np.ndarray, max_entries: int
               ) -> SharedRows | None:
    """Merge consecutive dictionary rows the way ``share_dictionaries`` merges chunks:
    consecutive rows form a group while, in every channel, the union of their entries (float32
    bit patterns: NaN payloads and -0.0 survive) holds at most ``max_entries``, and while each row
    after the first has at least ``MIN_SHARED`` of its entries in the group already (rows with
    little in common, such as devices calibrated one by one, stay apart: merging them would
    shrink nothing and cost a recode). Row ``r``'s channel ``c`` holds
    ``values[start[r, c] : start[r, c] + sizes[r, c]]`` (a version-2 store's arrays: ``values``
    may hold rows not given). Consecutive rows that start at the same entries (small devices
    sharing a row's entries) count as one. A group's union of a channel is its first row's
    entries in their order, then the others' new values (sorted by bit pattern): the first row's
    codes, and those of a row alone, stay as they are. None where no row joins another, or where
    rows share entries other than as consecutive rows in every channel (no birdzarr writer does
    that): the caller holds the rows as they are.

    Memory: the held entries (``values``: at most those of the rows given, 4 B each), ``remap``
    (2 B an entry of the rows after a group's first: at most half as many new entries as they
    hold, so the two together stay within the rows' 4 B an entry), while building, the sorted
    unions of the groups of several (one group's, at most ``max_entries`` a channel, once
    ``values`` is being written: its pages are taken as they are written)."""
    n_rows = len(start)
    opens = np.ones(n_rows, dtype=bool)
    opens[1:] = (start[1:] != start[:-1]).any(axis=1)
    unit_start, unit_sizes = start[opens], sizes[opens]  # rows sharing entries counted once
    flat = unit_start.reshape(-1)
    if len(sorted_distinct(flat)) < len(flat):  # entries shared otherwise: not merged
        return None
    rows = [[values[a : a + n] for a, n in zip(first, count, strict=True)]
            for first, count in zip(unit_start.tolist(), unit_sizes.tolist(), strict=True)]
    groups = share_groups(rows, max_entries, MIN_SHARED)
    if len(groups) == len(rows):
        return None
    channels = unit_start.shape[1]
    union_sizes = [[len(u) for u in unions] if unions is not None else [len(d) for d in rows[first]]
                   for first, _, unions in groups]
    table = np.empty(sum(map(sum, union_sizes)), dtype=np.float32)
    later = sum(int(unit_sizes[first + 1 : stop].sum()) for first, stop, _ in groups)
    remap = np.empty(later + max_entries, dtype=np.uint16)
    remap[later:] = np.arange(max_entries, dtype=np.uint16)
    new_start = np.empty(unit_start.shape, dtype=np.int64)
    remap_start = np.full(unit_start.shape, later, dtype=np.int64)
    recoded = np.zeros(len(rows), dtype=bool)
    at = remap_at = 0
    for g, (first, stop, unions) in enumerate(groups):
        for c in range(channels):
            new_start[first:stop, c] = at
            own = _share.bits(rows[first][c])
            table[at : at + len(own)] = own.view(np.float32)
            if unions is not None:  # a group of several: the others' new values after the first's
                union = unions[c]
                in_first = np.zeros(len(union), dtype=bool)
                at_sorted = np.searchsorted(union, own)
                in_first[at_sorted] = True
                table[at + len(own) : at + len(union)] = union[~in_first].view(np.float32)
                place = np.empty(len(union), dtype=np.uint16)  # sorted position -> position held
                place[at_sorted] = np.arange(len(own), dtype=np.uint16)
                place[~in_first] = np.arange(len(own), len(union), dtype=np.uint16)
                for u in range(first + 1, stop):
                    bits = _share.bits(rows[u][c])
                    # keys in their own order: sorting them first (as share_dictionaries does)
                    # cost more than it saved (a union of a few thousand entries stays in cache)
                    remap[remap_at : remap_at + len(bits)] = place[np.searchsorted(union, bits)]
                    remap_start[u, c] = remap_at
                    remap_at += len(bits)
            at += union_sizes[g][c]
        if unions is not None:
            recoded[first + 1 : stop] = True
            groups[g] = (first, stop, None)  # its sorted unions: no longer needed
    unit_of_row = np.cumsum(opens) - 1
    return SharedRows(table, new_start[unit_of_row], remap, remap_start[unit_of_row], recoded[unit_of_row],
                      len(groups))
