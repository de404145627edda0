"""``birdzarr verify``: prove that a store still holds exactly what was written, and what its
sources say.

Checks, in one pass over the committed chunks (each chunk file is read once):

- every chunk of every array below the committed count exists and decodes (zarr would return
  fill values for a missing chunk; birdzarr's reader raises ``MissingChunkError``);
- every device range's checksum (CRC-32C of the little-endian float32 bytes of its windows,
  as written by the converter) matches; shuffled stores check each device's scattered digest
  (the order-free sum of its rows' hashes: ``birdzarr/format/_digest.py``) instead, or, in
  stores shuffled by earlier versions, its scattered checksum (its windows in ascending global
  index order);
- every window's ``device`` id is the one the device table says;
- the device table is consistent: ranges inside the committed windows, not overlapping, covering
  all of them, window counts adding up.

On a format-2 store the windows are decoded from ``gimu_codes``, ``gimu_row`` and ``gps_speed``
with the dictionaries (``dict_values``, ``dict_start``, ``dict_device``, every chunk read and
checked first); every code is checked against its row's dictionary and every window's row
against its ``device`` id. The device table is read from its group's index and check arrays
(``range_checksum``, ``scattered_digest``) where it has them, its entries' JSON only checked
chunk by chunk (CRC-32C), and parsed only with ``source`` or once the pass found a difference:
where an array then disagrees with the entries, the pass runs again with the entries (what the
array made it find is not damage of the windows), and says which array. A table written before
the check arrays is read from its entries, and its index arrays checked against them.
Damaged dictionaries stop every window from decoding: said once, not once a range or device.

With ``source``, the windows, times and labels are derived again from the source files (with the
store's recorded curation) and compared window by window. Uncommitted leftovers of an
interrupted writer are listed as notes: they are invisible to readers, and ``birdzarr repair``
removes them.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from birdzarr._checks import require_bool
from birdzarr._errors import (
    BadInputError,
    BirdzarrError,
    ChunkFetchError,
    CorruptChunkError,
    MissingChunkError,
)
from birdzarr.convert._summary import checksum_hasher, device_runs
from birdzarr.format import _v2
from birdzarr.format._codec import strip_crc32c
from birdzarr.format._digest import RowDigest, digest_hex, row_hashes
from birdzarr.format._spec import (
    DEVICE,
    GIMU,
    LABEL,
    N_CHANNELS,
    TIMESTAMP,
    WINDOW_LENGTH,
    DeviceEntry,
    DeviceRange,
)
from birdzarr.storage._location import Location, StoreLike, read_object, resolve
from birdzarr.storage._lock import read_holder
from birdzarr.storage._root import RESTORE_HINT
from birdzarr.store._handle import Store, open_store
from birdzarr.store._tail import describe_leftover, format2_leftovers, leftovers, short_arrays

if TYPE_CHECKING:
    from birdzarr.convert._sources import DeviceSource

_ARRAYS = (GIMU, DEVICE, TIMESTAMP, LABEL)
# format version 2: the windows are these three per-window arrays and the dictionaries
WINDOW_ARRAYS_V2 = (_v2.CODES, _v2.GPS, _v2.ROW)
DICTIONARY_ARRAYS = (_v2.VALUES, _v2.START, _v2.DEVICE)
_MAX_LISTED = 50  # problems listed one by one; beyond that they are counted
_PIECE = 8192  # windows compared at a time against the source
_VALUES = WINDOW_LENGTH * N_CHANNELS  # float32 values a window (spelled out: an empty piece has no -1)


@dataclass
class VerifyResult:
    """What verify checked and every difference it found (``ok`` is True when there are none)."""

    url: str
    n_windows: int
    generation: int
    chunks_checked: int = 0
    checksums_checked: int = 0
    devices_compared: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    more_problems: int = 0
    # a version-2 store's dictionaries are missing or damaged: no window decodes (said once)
    undecodable: bool = field(default=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.more_problems

    def problem(self, message: str) -> None:
        if len(self.problems) < _MAX_LISTED:
            self.problems.append(message)
        else:
            self.more_problems += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url, "ok": self.ok, "n_windows": self.n_windows, "generation": self.generation,
            "chunks_checked": self.chunks_checked, "checksums_checked": self.checksums_checked,
            "devices_compared": self.devices_compared, "problems": self.problems,
            "more_problems": self.more_problems, "notes": self.notes,
        }

    def format(self) -> str:
        """What was checked and every difference, as ``birdzarr verify`` prints it (``str(result)``
        is the same)."""
        checked = (f"{self.n_windows:,} committed windows (generation {self.generation}): "
                   f"{self.chunks_checked} chunks, {self.checksums_checked} checksums")
        if self.devices_compared:
            checked += f", {self.devices_compared} devices compared with the source"
        lines = [f"{self.url}: {'OK' if self.ok else 'FAILED'}, checked {checked}"]
        if not self.ok:
            lines.append(f"{len(self.problems) + self.more_problems} difference(s):")
            lines += [f"  - {p}" for p in self.problems]
            if self.more_problems:
                lines.append(f"  ... and {self.more_problems} more")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def verify(
    store: StoreLike,
    *,
    source: StoreLike | Sequence[StoreLike] | None = None,
    storage_options: dict[str, Any] | None = None,
    source_storage_options: dict[str, Any] | None = None,
    progress: bool = False,
) -> VerifyResult:
    """Check a committed store (and, with ``source``, compare it with its sources: one source or
    several, read as one directory holding all their files, as ``convert`` reads them)."""
    progress = require_bool("progress", progress)
    opened = open_store(store, storage_options=storage_options)
    # A source that cannot be read is a wrong argument, not damage in the store: refused (with
    # the converter's own error) before the pass over the chunks, never listed as a difference.
    sources = None
    if source is not None:
        given: list[StoreLike] = list(source) if isinstance(source, list | tuple) else [source]  # type: ignore[list-item]
        sources = _read_source(opened, [resolve(one, source_storage_options) for one in given])
    committed = opened.root.get("committed") or {}  # the root attributes hold it (no device table read)
    generation = int(committed.get("generation", 0))
    result = VerifyResult(url=opened.url, n_windows=len(opened), generation=generation)
    # the recorded checks from the index arrays alone; the source's comparison needs every field
    table = device_table_columns(opened, details=sources is not None)
    digests = _check_store(opened, table, result, progress=progress)
    if table.index_of is not None and not result.ok and _index_disagrees(opened):
        # what the arrays made the pass find is not damage of the windows: the pass again with the
        # entries says what is, as for a table without the check arrays
        result = VerifyResult(url=opened.url, n_windows=len(opened), generation=generation)
        table = device_table_columns(opened)
        digests = _check_store(opened, table, result, progress=progress)
    if sources is not None:
        _compare_with_source(opened, *sources, result, digests, table=table)
    for name, length in short_arrays(opened.location, len(opened), window_arrays(opened.format_version)):
        result.problem(f"array '{name}' has shape {length:,} along windows, but {len(opened):,} windows "
                       "are committed: readers of its Zarr array (zarr-python, TensorStore) see only "
                       f"{length:,}; `birdzarr repair` sets it back to the committed count")
    found = [item for item in leftovers(opened.location, len(opened), window_arrays(opened.format_version))
             if "stale lock" not in item]
    if opened.format_version >= 2:
        found += [describe_leftover(*item) for item in format2_leftovers(opened.location, committed)]
    result.notes += [f"uncommitted leftover: {item} (invisible to readers; `birdzarr repair` removes it)"
                     for item in found]
    holder = read_holder(opened.location)
    if holder is not None:
        state = "stale: its process is gone" if holder.is_stale() else "a writer may be running"
        result.notes.append(f"the store is locked by {holder.describe()} ({state})")
    return result


def _table_index(store: Store) -> tuple[np.ndarray, np.ndarray]:
    """The device table's ids sorted, and each one's position in ``device_table``: from the
    entries themselves (a format-2 store's index arrays are checked against them, not used)."""
    table = store.device_table
    ids = np.fromiter((e.device_id for e in table), dtype=np.int64, count=len(table))
    order = np.argsort(ids, kind="stable")
    return ids[order], order


def _check_table_arrays(store: Store, table: _Table, result: VerifyResult) -> None:
    """A format-2 store's device table index arrays (``device_table/<generation>/...``): every
    chunk present and intact, and their columns equal to the entries they index; the check
    arrays where the table has them. A table read from these arrays (``_Table.index_of``) was
    found whole by reading them: its details' chunks are checked present and intact instead
    (their CRC-32C, the JSON not parsed)."""
    from birdzarr.format import _device_table
    from birdzarr.store._device_table import details_in_array, table_path

    where = table_path(store.root)
    if where is None:
        return
    if table.index_of is not None:
        _check_details_chunks(store, where, result)
        return
    ids, order = table.sorted_ids()
    expected: dict[str, np.ndarray | None] = {
        "device_id": ids, "n_windows": table.n_windows[order], "first_time": table.first_time[order],
        "last_time": table.last_time[order],
        "scattered_digest": _device_table.hex_values([table.scattered_digest[k] for k in order.tolist()], 16)
        if len(table) else None}
    if not store.shuffled:
        owner = table.ids[table.range_entry]
        runs = np.lexsort((owner, table.range_stop, table.range_start))  # by start, stop, device
        expected.update(range_device=owner[runs], range_start=table.range_start[runs],
                        range_stop=table.range_stop[runs],
                        range_checksum=_device_table.hex_values(table.range_checksum[runs], 8))
    # the check arrays are read where the table has them (one written before them has none)
    checks = [name for name in _device_table.CHECKS
              if name in expected and _has_array(store.location, where, name)]
    for name in (*_device_table.COLUMNS, *(() if store.shuffled else _device_table.RANGES), *checks):
        try:
            chunks = ArrayChunks.open(store.location, f"{where}/{name}")
        except BirdzarrError as exc:
            result.problem(str(exc))
            continue
        parts, sound = [], True
        for index in range(chunks.n_chunks):
            try:
                parts.append(chunks.read(index))
            except ChunkFetchError:
                raise
            except MissingChunkError as exc:
                result.problem(str(exc))
                sound = False
        if not sound:
            continue
        column = np.concatenate(parts) if parts else np.empty(0, np.int64)
        want = expected[name]  # None: the entries hold what this array cannot
        if want is None or len(column) != len(want) or (column != want).any():
            held = f"{where}/{_device_table.DETAILS}" if details_in_array(store.location, where) else \
                f"{where}/zarr.json"
            result.problem(f"device table: its index array '{where}/{name}' disagrees with the entries it "
                           f"indexes (in '{held}'); {RESTORE_HINT}")


def _has_array(location: Location, where: str, name: str) -> bool:
    """Whether the table group at ``where`` holds the array ``name`` (its zarr.json)."""
    return bool(location.fs.exists(location.join(f"{where}/{name}/zarr.json")))


def _check_details_chunks(store: Store, where: str, result: VerifyResult) -> None:
    """Every chunk of the table's ``details`` array present and intact (its CRC-32C), read one at
    a time (4 MiB at most) and not decoded; a table whose group attributes hold its details has
    none."""
    from birdzarr.format import _device_table
    from birdzarr.format._codec import crc32c_intact
    from birdzarr.store._device_table import details_in_array

    if not details_in_array(store.location, where):
        return
    try:
        chunks = ArrayChunks.open(store.location, f"{where}/{_device_table.DETAILS}")
    except ChunkFetchError:
        raise
    except BirdzarrError as exc:
        result.problem(str(exc))
        return
    for index in range(chunks.n_chunks):
        key = chunks.key(index)
        try:
            data = read_object(store.location, key)
        except ChunkFetchError:
            raise
        except MissingChunkError as exc:
            result.problem(str(exc))
            continue
        if not crc32c_intact(data):
            result.problem(f"{store.location.display}: chunk '{key}' fails its CRC-32C: the device table's "
                           f"entries changed after they were written; {RESTORE_HINT}")


def _check_store(store: Store, table: _Table, result: VerifyResult, *, progress: bool) -> _Digests | None:
    """The table's checks and the pass over every chunk (``verify`` without its source)."""
    _check_table_arrays(store, table, result)
    ranges = _check_table(store, table, result)
    return _check_chunks(store, table, ranges, result, progress=progress)


def _index_disagrees(store: Store) -> bool:
    """Whether an index or check array of the table disagrees with the entries it indexes (the
    details' JSON, read here: after a pass that read the arrays alone found differences). False
    where the entries cannot be read: their damage was said (``_check_details_chunks``)."""
    try:
        entries = device_table_columns(store)
    except ChunkFetchError:
        raise
    except MissingChunkError:
        return False
    found = VerifyResult(url=store.url, n_windows=len(store), generation=0)
    _check_table_arrays(store, entries, found)
    return not found.ok


@dataclass
class _Ranges:
    """The device ranges inside the committed windows, by start (a stable sort of the table's
    order), and what the pass over the chunks finds for each."""

    device_id: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    checksum: np.ndarray  # bytes (UTF-8), as recorded
    sound: bool  # no two overlap: each chunk holds the ranges that meet it, found by binary search
    crc: list[int] = field(default_factory=list)  # CRC-32C of each one's windows so far
    wrong_device: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    unreadable: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))

    def __post_init__(self) -> None:
        self.crc = [0] * len(self.start)
        self.wrong_device = np.zeros(len(self.start), np.int64)
        self.unreadable = np.zeros(len(self.start), bool)

    def __len__(self) -> int:
        return len(self.start)


def _check_table(store: Store, table: _Table, result: VerifyResult) -> _Ranges | None:
    n = len(store)
    total = sum(table.n_windows.tolist())
    if total != n:
        result.problem(f"device table: its window counts add up to {total:,}, but {n:,} windows are "
                       "committed")
    if store.shuffled:
        return None
    start, stop, entry = table.range_start, table.range_stop, table.range_entry
    in_ranges = np.zeros(len(table), np.int64)
    np.add.at(in_ranges, entry, stop - start)
    outside = ~((start >= 0) & (start <= stop) & (stop <= n))
    miscounted = in_ranges != table.n_windows
    flagged = miscounted.copy()
    flagged[entry[outside]] = True
    for k in np.flatnonzero(flagged).tolist():  # in the table's order, as the entries are read
        device = int(table.ids[k])
        if miscounted[k]:
            result.problem(f"device {device}: n_windows is {int(table.n_windows[k]):,} but its ranges "
                           f"hold {int(in_ranges[k]):,} windows")
        a, b = np.searchsorted(entry, [k, k + 1])
        for r in range(int(a), int(b)):
            if outside[r]:
                result.problem(f"device {device}: range [{int(start[r])}, {int(stop[r])}) lies outside "
                               f"the {n:,} committed windows")
    kept = np.flatnonzero(~outside)
    kept = kept[np.argsort(start[kept], kind="stable")]
    ranges = _Ranges(table.ids[entry[kept]], start[kept], stop[kept], table.range_checksum[kept], sound=True)
    overlapping = np.flatnonzero(ranges.start[1:] < ranges.stop[:-1])
    for i in overlapping.tolist():
        result.problem(f"devices {int(ranges.device_id[i])} and {int(ranges.device_id[i + 1])}: ranges "
                       f"[{int(ranges.start[i])}, {int(ranges.stop[i])}) and [{int(ranges.start[i + 1])}, "
                       f"{int(ranges.stop[i + 1])}) overlap")
    ranges.sound = not len(overlapping)
    return ranges


def _parts(ranges: _Ranges, first: int, chunk_start: int, chunk_stop: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The parts of the ranges that lie in chunk ``[chunk_start, chunk_stop)``: each one's range,
    and its windows ``[lo, hi)`` counted from the chunk's start; and the first range not yet fully
    hashed. Ranges that do not overlap are found by binary search; overlapping ones (a damaged
    table) are walked in order from ``first``, stopping at one that goes on past the chunk."""
    if ranges.sound:
        a = int(np.searchsorted(ranges.stop, chunk_start, "right"))  # stops ascend where none overlap
        b = int(np.searchsorted(ranges.start, chunk_stop, "left"))
        which = np.arange(a, max(a, b))
        following = a
    else:
        found = []
        position = first
        starts, stops = ranges.start, ranges.stop
        while position < len(ranges) and starts[position] < chunk_stop:
            found.append(position)
            if stops[position] > chunk_stop:
                break  # continues in the next chunk
            position += 1
        which = np.array(found, dtype=np.int64)
        following = position
    lo = np.maximum(ranges.start[which], chunk_start) - chunk_start
    hi = np.minimum(ranges.stop[which], chunk_stop) - chunk_start
    some = hi > lo
    return which[some], lo[some], hi[some], following


def _check_chunks(store: Store, table: _Table, ranges: _Ranges | None, result: VerifyResult, *,
                  progress: bool) -> _Digests | None:
    """Read every committed chunk once and check it (module doc); a shuffled store's per-device
    digests, gathered in this pass, are returned for the comparison with the source."""
    import google_crc32c

    from birdzarr._progress import progress_bar

    reader = store.reader
    known = table.sorted_ids()[0]
    coded = store.format_version >= 2  # windows from codes, rows and gps_speed and the dictionaries
    dicts = load_dictionaries(store, result.problem, known=known) if coded else None
    result.undecodable = coded and dicts is None
    sizes = dicts.sizes() if dicts is not None else None  # each row's entries a channel, found once
    arrays = (*WINDOW_ARRAYS_V2, DEVICE, TIMESTAMP, LABEL) if coded else _ARRAYS
    # a shuffled store's devices are checked (and compared with the source) through digests
    # gathered in this one pass: each device's windows are scattered over every chunk
    digests = _Digests(known) if store.shuffled else None
    # stores shuffled by earlier versions: a CRC-32C of each device's windows in index order
    scattered = {int(table.ids[k]): checksum_hasher() for k in range(len(table))
                 if table.scattered_digest[k] is None and table.scattered_checksum[k] is not None
                 } if store.shuffled else {}
    first = 0  # index of the first range not yet fully hashed
    with progress_bar(progress, desc="verify", total=reader.n_chunks, unit=" chunks") as bar:
        for index in range(reader.n_chunks):
            chunk_start, chunk_stop = reader.chunk_span(index)
            data: dict[str, np.ndarray] = {}
            for name in arrays:
                try:
                    data[name] = reader.read(name, index)
                except MissingChunkError as exc:
                    result.problem(str(exc))
            result.chunks_checked += 1
            bar.update(1)
            if coded:
                decoded = _decode_checked(data, dicts, index, chunk_start, chunk_stop, result, sizes)
                if decoded is not None:
                    data[GIMU] = decoded
            windows, devices = data.get(GIMU), data.get(DEVICE)
            if devices is not None:
                unknown = _unknown_ids(devices, known)
                if len(unknown):
                    result.problem(f"windows {chunk_start:,}..{chunk_stop - 1:,}: device ids "
                                   f"{unknown[:5].tolist()} are not in the device table")
            if digests is not None:  # shuffled
                digests.add(data)
                if scattered:
                    _hash_scattered(windows, devices, scattered)
                continue
            assert ranges is not None
            which, lo, hi, first = _parts(ranges, first, chunk_start, chunk_stop)
            if windows is None:
                ranges.unreadable[which] = True
            else:
                rows = np.ascontiguousarray(windows, dtype="<f4").view(np.uint8).reshape(len(windows), -1)
                crc = ranges.crc
                for r, a, b in zip(which.tolist(), lo.tolist(), hi.tolist(), strict=True):
                    crc[r] = google_crc32c.extend(crc[r], rows[a:b])
            if devices is not None and len(which):
                _count_wrong_devices(devices, ranges, which, lo, hi)
    if digests is not None:
        _finish_scattered(table, scattered, digests, result)
        return digests
    assert ranges is not None
    undecodable = result.undecodable and bool(len(ranges))
    if undecodable:  # not one line a range: no window decodes without the dictionaries
        result.problem(f"the checksums of all {len(ranges):,} device ranges cannot be checked: the "
                       "dictionaries are missing or damaged (above)")
    stored_in = ", ".join(f"'{name}'" for name in WINDOW_ARRAYS_V2) if coded else f"'{GIMU}'"
    checked = ~ranges.unreadable
    if not undecodable:
        result.checksums_checked += int(checked.sum())
    differing = checked & (_hex8(np.array(ranges.crc, dtype=np.uint32)) != ranges.checksum)
    flagged = (ranges.wrong_device > 0) | (~undecodable & (ranges.unreadable | differing))
    for r in np.flatnonzero(flagged).tolist():
        start, stop = int(ranges.start[r]), int(ranges.stop[r])
        where = f"device {int(ranges.device_id[r])}, windows [{start:,}, {stop:,})"
        if ranges.wrong_device[r]:
            result.problem(f"{where}: {int(ranges.wrong_device[r]):,} window(s) carry another device id in "
                           "the 'device' array")
        if undecodable:
            continue
        if ranges.unreadable[r]:
            result.problem(f"{where}: checksum cannot be checked, a chunk is missing or damaged (above)")
        elif differing[r]:
            chunk, recorded = reader.chunk_windows, ranges.checksum[r].decode()
            result.problem(f"{where}: checksum {ranges.crc[r]:08x} differs from the {recorded} "
                           f"recorded at write time: the windows changed after they were written (chunks "
                           f"{start // chunk}..{(stop - 1) // chunk} of {stored_in})")
    return None


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _hex8(values: np.ndarray) -> np.ndarray:
    """Each value below 2**32 as 8 lowercase hex digits (``f"{v:08x}"`` as bytes, for all at once)."""
    return _hex(values.astype(np.uint32), 8)


def _hex(values: np.ndarray, digits: int) -> np.ndarray:
    """Each unsigned value as ``digits`` lowercase hex digits (bytes, for all at once)."""
    shifts = np.arange(4 * (digits - 1), -4, -4, dtype=values.dtype)
    nibbles = (values[:, None] >> shifts) & values.dtype.type(0xF)
    return _HEX_DIGITS[nibbles].view(f"S{digits}").reshape(-1)


def _decode_checked(data: dict[str, np.ndarray], dicts: _v2.Dictionaries | None, index: int,
                    chunk_start: int, chunk_stop: int, result: VerifyResult,
                    sizes: np.ndarray | None = None) -> np.ndarray | None:
    """A version-2 chunk's windows decoded, after its codes and rows are checked against the
    dictionaries and each window's row against its ``device`` id; None when they cannot be (a
    chunk or the dictionaries missing or damaged, reported already, or a code or row out of range,
    reported here)."""
    codes, row, gps = data.get(_v2.CODES), data.get(_v2.ROW), data.get(_v2.GPS)
    if dicts is None or codes is None or row is None:
        return None
    windows = f"windows {chunk_start:,}..{chunk_stop - 1:,}"
    wrong = check_coded(codes, row, dicts, chunk_start, sizes)
    if wrong is not None:
        result.problem(f"{windows} (chunks '{_v2.CODES}/c/{index}/0/0' and '{_v2.ROW}/c/{index}'): {wrong}")
        return None
    devices = data.get(DEVICE)
    if devices is not None:
        owner = dicts.device[row]
        other = owner != devices
        if other.any():
            at = int(np.flatnonzero(other)[0])
            result.problem(
                f"{windows} (chunk '{_v2.ROW}/c/{index}'): {int(other.sum()):,} window(s) are coded "
                f"with a dictionary row of another device (first: window {chunk_start + at:,} of device "
                f"{int(devices[at])}, row {int(row[at])}, which 'dict_device' gives to device "
                f"{int(owner[at])})")
    if gps is None:
        return None
    return _v2.decode(codes, row, gps, dicts.values, dicts.start)


def _count_wrong_devices(devices: np.ndarray, ranges: _Ranges, which: np.ndarray, lo: np.ndarray,
                         hi: np.ndarray) -> None:
    """Count, for each range part ``which, lo, hi`` of a chunk (non-empty), its windows whose
    ``device`` id is another device's: one comparison for all the parts."""
    sizes = hi - lo
    expected = np.repeat(ranges.device_id[which], sizes)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    if lo[0] == 0 and hi[-1] == len(devices) and (lo[1:] == hi[:-1]).all():  # the parts tile the chunk
        wrong = devices != expected
    else:
        positions = np.arange(int(sizes.sum())) + np.repeat(lo - offsets, sizes)
        wrong = devices[positions] != expected
    if wrong.any():
        np.add.at(ranges.wrong_device, which, np.add.reduceat(wrong, offsets))


def _unknown_ids(devices: np.ndarray, known: np.ndarray) -> np.ndarray:
    """The distinct ids in ``devices`` that are not in ``known`` (sorted), ascending."""
    ordered = np.sort(devices)  # np.unique's own way costs 3x as much on a shuffled chunk's ids
    ids = ordered[np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])].astype(np.int64)
    at = np.minimum(np.searchsorted(known, ids), max(len(known) - 1, 0))
    present = known[at] == ids if len(known) else np.zeros(len(ids), dtype=bool)
    return ids[~present]


def _hash_scattered(windows: np.ndarray | None, devices: np.ndarray | None, hashers: dict[int, Any]) -> None:
    """Feed each device's windows of a chunk to its CRC-32C, in index order (the scattered
    checksum of stores shuffled by earlier versions)."""
    if windows is None or devices is None:
        return  # the digests see the chunk is missing and say so
    runs = device_runs(devices)
    grouped = np.take(np.asarray(windows, dtype="<f4"), runs.order, axis=0)  # device by device
    for device, start, stop in runs:
        if device in hashers:
            hashers[device].update(grouped[start:stop])


def _finish_scattered(table: _Table, hashers: dict[int, Any], digests: _Digests,
                      result: VerifyResult) -> None:
    # each table entry's position among the sorted ids, where the digests keep its figures
    position = np.empty(len(table), dtype=np.int64)
    position[table.sorted_ids()[1]] = np.arange(len(table))
    counts, sums = digests.count_of[position].tolist(), digests.sum_of[position].tolist()
    if result.undecodable and len(table):  # not one line a device: no window decodes
        result.problem(f"the checksums of all {len(table):,} devices cannot be checked: the dictionaries "
                       "are missing or damaged (above)")
        return
    for device, n_windows, recorded, old, count, total in zip(
            table.ids.tolist(), table.n_windows.tolist(), table.scattered_digest, table.scattered_checksum,
            counts, sums, strict=True):
        if digests.broken:
            result.problem(f"device {device}: checksum cannot be checked, a chunk is missing "
                           "or damaged (above)")
            continue
        if count != n_windows:
            result.problem(f"device {device}: {count:,} windows carry its id, the device table says "
                           f"{n_windows:,}")
        if recorded is not None:
            result.checksums_checked += 1
            digest = digest_hex(total)
            if digest != recorded:
                result.problem(f"device {device}: scattered digest {digest} differs from the "
                               f"{recorded} recorded at write time: its windows, times or "
                               "labels changed after writing")
        elif old is not None:
            result.checksums_checked += 1
            crc = hashers[device].hexdigest()
            if crc != old:
                result.problem(f"device {device}: scattered checksum {crc} differs from the "
                               f"{old} recorded at write time: its windows changed "
                               "after writing")


# -- the device table as columns -------------------------------------------------------------------
# A 100,000-device table is 40 MB of JSON: parsed into dictionaries and then DeviceEntry objects it
# cost 3.5 CPU s and 600 MB, more than verify's pass over the chunks. verify reads a format-2
# table written as the writers write it as columns instead: pyarrow's JSON parser reads the whole
# document (every value checked, typed by a schema: no Python object a value), and the ranges,
# lists that mix numbers and a string (which that parser cannot type), and the label counts are
# taken from the text by patterns anchored at each entry, checked against the parsed entries.
# Anything else (another layout, a value of another type, a number past int64, damage) reads the
# table as before, through ``Store.device_table``, with its errors. Where the table group has its
# check arrays, verify without a source reads none of this text (``_Table.of_columns``): parsing
# it was 0.6-0.85 CPU s at 100,000 devices, the most of what verify cost a device.

class _Syntax(NamedTuple):
    """How a table's JSON is written: its text before the entries, and the patterns for them."""

    head: bytes  # the text before the entries' list
    devices: bytes  # the "devices" key and the list's opening bracket
    between: bytes  # the text between two entries
    entry_ranges: re.Pattern[bytes]  # an entry's id and its ranges' text
    range_item: re.Pattern[bytes]  # one range in that text
    entry_labels: re.Pattern[bytes]  # an entry's label counts' text
    in_attributes: bool  # the object is the attributes of the group's zarr.json


def _syntax(comma: bytes, colon: bytes, head: bytes, in_attributes: bool) -> _Syntax:
    def key(name: bytes) -> bytes:
        return b'"' + name + b'"' + colon

    return _Syntax(
        head=head, devices=key(b"devices") + b"[", between=b"}" + comma + b"{" + key(b"device_id"),
        entry_ranges=re.compile(rb"\{" + key(b"device_id") + rb"(-?[0-9]++)" + comma + key(b"n_windows")
                                + rb"-?[0-9]++" + comma + key(b"ranges") + rb"\[((?:\[[^\]]*+\](?:" + comma
                                + rb")?)*+)\]" + comma + key(b"first_time")),
        range_item=re.compile(rb"\[(-?[0-9]{1,19})" + comma + rb"(-?[0-9]{1,19})" + comma
                              + rb'"([0-9a-f]{8})"\]'),
        entry_labels=re.compile(key(b"label_counts") + rb"\{([^}]*+)\}" + comma + key(b"scattered_checksum")),
        in_attributes=in_attributes,
    )


# the group's zarr.json holding the entries in its attributes (json.dumps' separators), and the
# group's details array holding their JSON object (compact separators)
_IN_ATTRIBUTES = _syntax(b", ", b": ", b'{"zarr_format": 3, "node_type": "group", "attributes": '
                         b'{"birdzarr": {"devices": [', in_attributes=True)
_IN_ARRAY = _syntax(b",", b":", b'{"devices":[', in_attributes=False)


@dataclass
class _Table:
    """The device table's entries as columns, in the table's order (entry ``k`` is row ``k``);
    the ranges entry by entry (``range_entry``: the row of each range's entry). Read from a
    format-2 table's index and check arrays alone (``of_columns``: ``index_of`` names the group),
    it holds no sources and label counts (``sources``, ``entry`` need the entries' JSON)."""

    ids: np.ndarray
    n_windows: np.ndarray
    first_time: np.ndarray
    last_time: np.ndarray
    range_entry: np.ndarray
    range_start: np.ndarray
    range_stop: np.ndarray
    range_checksum: np.ndarray  # bytes (UTF-8), as recorded
    scattered_checksum: list[str | None]
    scattered_digest: list[str | None]
    # each entry's sources: a list, or of all entries at once: the distinct names, each entry's
    # names as their positions there, and where each entry's begin (``_names``); None: not read
    _sources: list[list[str]] | tuple[list[str], np.ndarray, np.ndarray] | None
    # each entry's label counts: a dict, or of all entries at once the text of their JSON objects
    # end to end and where each begins; None: not read
    _label_counts: list[dict[int, int]] | tuple[bytes, np.ndarray] | None
    index_of: str | None = None  # the table group whose arrays alone gave this table

    def __len__(self) -> int:
        return len(self.ids)

    def _named(self) -> list[list[str]] | tuple[list[str], np.ndarray, np.ndarray]:
        if self._sources is None:
            raise RuntimeError("the table was read without its entries' sources (device_table_columns "
                               "with details=False)")
        return self._sources

    def _labelled(self) -> list[dict[int, int]] | tuple[bytes, np.ndarray]:
        if self._label_counts is None:
            raise RuntimeError("the table was read without its entries' label counts "
                               "(device_table_columns with details=False)")
        return self._label_counts

    @classmethod
    def of_columns(cls, location: Location, where: str, shuffled: bool) -> _Table | None:
        """The table of the group ``where``'s index and check arrays (ascending id): the recorded
        range checksums, or a shuffled store's digests, without the entries' JSON. None where a
        check array is absent (a table written before them, or entries they cannot hold), an array
        cannot be read, or the arrays do not index one table: the entries are read then, and
        verify says what is wrong. Memory: the arrays (8 bytes a device and 32 a range) and the
        checksums' text (8 bytes a range; a digest a device as a str)."""
        from birdzarr.format import _device_table as spec

        names = [*spec.COLUMNS, *(("scattered_digest",) if shuffled else (*spec.RANGES, "range_checksum"))]
        try:
            found = {name: _index_array(location, f"{where}/{name}") for name in names}
        except ChunkFetchError:
            raise
        except (BirdzarrError, OSError, ValueError, KeyError, TypeError):
            return None
        ids = found["device_id"]
        n = len(ids)
        if any(len(found[name]) != n for name in spec.COLUMNS) or not bool((ids[1:] > ids[:-1]).all()):
            return None
        none: list[str | None] = [None] * n
        if shuffled:
            if len(found["scattered_digest"]) != n:
                return None
            empty = np.empty(0, np.int64)
            entry, start, stop, checksum = empty, empty, empty, np.empty(0, "S8")
            spelled = _hex(found["scattered_digest"].view(np.uint64), 16)
            digests: list[str | None] = spelled.astype(str).tolist()
        else:
            device, start, stop, crc = (found[name] for name in (*spec.RANGES, "range_checksum"))
            if not len(device) == len(start) == len(stop) == len(crc) or bool(((crc >> 32) != 0).any()):
                return None  # not one column a range, or a checksum past 32 bits
            entry = np.searchsorted(ids, device)
            if len(device) and not bool((ids[np.minimum(entry, max(n - 1, 0))] == device).all()):
                return None  # a range of a device that has no entry
            order = np.lexsort((stop, start, entry))  # entry by entry, by start
            entry, start, stop = entry[order], start[order], stop[order]
            checksum, digests = _hex8(crc[order]), none
        return cls(ids=ids, n_windows=found["n_windows"], first_time=found["first_time"],
                   last_time=found["last_time"], range_entry=entry, range_start=start, range_stop=stop,
                   range_checksum=checksum, scattered_checksum=list(none), scattered_digest=digests,
                   _sources=None, _label_counts=None, index_of=where)

    @classmethod
    def of_entries(cls, entries: list[DeviceEntry]) -> _Table:
        ranges = [(k, r) for k, e in enumerate(entries) for r in e.ranges]

        def column(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64) if values else np.empty(0, np.int64)

        return cls(
            ids=column([e.device_id for e in entries]), n_windows=column([e.n_windows for e in entries]),
            first_time=column([e.first_time for e in entries]),
            last_time=column([e.last_time for e in entries]),
            range_entry=column([k for k, _ in ranges]), range_start=column([r.start for _, r in ranges]),
            range_stop=column([r.stop for _, r in ranges]),
            range_checksum=np.array([r.checksum.encode() for _, r in ranges], dtype=bytes),
            scattered_checksum=[e.scattered_checksum for e in entries],
            scattered_digest=[e.scattered_digest for e in entries],
            _sources=[list(e.sources) for e in entries], _label_counts=[e.label_counts for e in entries],
        )

    @classmethod
    def of_text(cls, raw: bytes | bytearray, syntax: _Syntax) -> _Table | None:
        """The table of a format-2 table's JSON written as the writers write it (``syntax``);
        None for any other text (read then as JSON)."""
        if not raw.startswith(syntax.head) or not raw.isascii():
            return None
        # a second "devices" key would replace the first (json.loads keeps the last)
        if raw.count(syntax.devices) != 1:
            return None
        entries = _parsed_entries(raw, syntax)
        if entries is None:
            return None
        n = len(entries)
        columns = dict(zip((f.name for f in entries.type), entries.flatten(), strict=True))
        if any(columns[name].null_count for name in _TABLE_COLUMNS) or columns["sources"].values.null_count:
            return None  # a key missing (or null): Store.device_table says what is wrong
        ids, n_windows, first_time, last_time = (
            _numbers(columns[name], np.int64) for name in _TABLE_COLUMNS[:4])
        sources = _names(columns["sources"])
        scattered_checksum = columns["scattered_checksum"].to_pylist()
        scattered_digest = columns["scattered_digest"].to_pylist()
        del entries, columns  # the parser's memory, before the patterns' lists
        parts = []
        for part in _ranges_and_labels(raw, syntax):
            if part is None or len(part.label_sizes) != len(part.owners):
                return None
            parts.append(part)
        owners = np.concatenate([part.owners for part in parts])
        if len(owners) != n or not np.array_equal(owners, ids):
            return None  # the patterns did not find each entry's own ranges
        return cls(
            ids=ids, n_windows=n_windows, first_time=first_time, last_time=last_time,
            range_entry=np.repeat(np.arange(n), np.concatenate([part.counts for part in parts])),
            range_start=np.concatenate([part.starts for part in parts]),
            range_stop=np.concatenate([part.stops for part in parts]),
            range_checksum=np.concatenate([part.checksums for part in parts]),
            scattered_checksum=scattered_checksum, scattered_digest=scattered_digest,
            _sources=sources, _label_counts=(b"".join(part.labels for part in parts), np.concatenate(
                [[0], np.cumsum(np.concatenate([part.label_sizes for part in parts]))])),
        )

    def only_source(self, k: int) -> str | None:
        """Entry ``k``'s source file name where it names one file, else None."""
        held = self._named()
        if isinstance(held, tuple):
            names, which, offsets = held
            first = int(offsets[k])
            return names[which[first]] if int(offsets[k + 1]) - first == 1 else None
        found = held[k]
        return found[0] if len(found) == 1 else None

    def only_sources(self) -> tuple[list[str], np.ndarray]:
        """The entries' distinct source file names, and each entry's only one's place among them
        (-1 where it names none or several)."""
        held = self._named()
        if isinstance(held, tuple):
            names, which, offsets = held
            one = np.diff(offsets) == 1
            only = np.full(len(self), -1, np.int64)
            only[one] = which[offsets[:-1][one]]
            return names, only
        distinct: dict[str, int] = {}
        at = [distinct.setdefault(found[0], len(distinct)) if len(found) == 1 else -1
              for found in held]
        return list(distinct), np.array(at, np.int64).reshape(-1)

    def sources(self, k: int) -> list[str]:
        """Entry ``k``'s source file names."""
        held = self._named()
        if isinstance(held, tuple):
            names, which, offsets = held
            return [names[i] for i in which[offsets[k] : offsets[k + 1]].tolist()]
        return list(held[k])

    def entry(self, k: int) -> DeviceEntry:
        """Entry ``k`` as ``Store.device_table`` gives it."""
        labelled = self._labelled()
        if isinstance(labelled, tuple):
            text, where = labelled
            found = json.loads(b"{" + text[int(where[k]) : int(where[k + 1])] + b"}")
            counts = {int(a): int(b) for a, b in found.items()}
        else:
            counts = labelled[k]
        a, b = np.searchsorted(self.range_entry, [k, k + 1])
        return DeviceEntry(
            device_id=int(self.ids[k]), n_windows=int(self.n_windows[k]),
            ranges=[DeviceRange(int(s), int(e), c.decode()) for s, e, c in zip(
                self.range_start[a:b].tolist(), self.range_stop[a:b].tolist(),
                self.range_checksum[a:b].tolist(), strict=True)],
            first_time=int(self.first_time[k]), last_time=int(self.last_time[k]), sources=self.sources(k),
            label_counts=dict(counts), scattered_checksum=self.scattered_checksum[k],
            scattered_digest=self.scattered_digest[k],
        )

    def sorted_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids sorted, and each one's row."""
        order = np.argsort(self.ids, kind="stable")
        return self.ids[order], order


_TABLE_COLUMNS = ("device_id", "n_windows", "first_time", "last_time", "sources")
_SLICE = 4 << 20  # bytes of the entries' text matched at a time (bounds the patterns' lists)


class _Slice(NamedTuple):
    """The ranges and label counts of a slice of the entries, from their text (``_ranges_and_labels``)."""

    owners: np.ndarray  # each entry's id, as its ranges' pattern found it
    counts: np.ndarray  # each entry's number of ranges
    starts: np.ndarray
    stops: np.ndarray
    checksums: np.ndarray  # str
    labels: bytes  # each entry's label counts, the text of their JSON objects end to end
    label_sizes: np.ndarray  # each one's length


def _ranges_and_labels(raw: bytes | bytearray, syntax: _Syntax) -> Iterator[_Slice | None]:
    """The entries' ranges and label counts, a slice of whole entries at a time (the patterns'
    lists stay small); None where a range has another shape or a number is past int64 (the
    table is then read as JSON)."""
    position = len(syntax.head) - 1
    while True:
        cut = raw.find(syntax.between, position + _SLICE)
        end = len(raw) if cut < 0 else cut + 1
        ranges = syntax.entry_ranges.findall(raw, position, end)
        texts = [text for _, text in ranges]
        counts = np.fromiter((text.count(b"[") for text in texts), np.int64, len(texts))
        found = syntax.range_item.findall(b" ".join(texts))
        if len(found) != int(counts.sum()):
            yield None  # a range of another shape
            return
        triples = np.array(found, dtype=bytes).reshape(-1, 3)
        try:
            owners = np.array([i for i, _ in ranges], dtype=bytes).astype(np.int64)
            starts, stops = triples[:, 0].astype(np.int64), triples[:, 1].astype(np.int64)
        except OverflowError:
            yield None
            return
        labels = syntax.entry_labels.findall(raw, position, end)
        sizes = np.fromiter(map(len, labels), np.int64, len(labels))
        yield _Slice(owners, counts, starts, stops, triples[:, 2].copy(), b"".join(labels), sizes)
        if cut < 0:
            return
        position = end


def _names(column: Any) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A pyarrow list<string> array (no nulls) as its distinct strings, each item's position
    among them and each list's first item: a partition file's name is held once, not once for
    each of its devices."""
    import pyarrow as pa
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(column.values, memory_pool=pa.system_memory_pool())
    which = encoded.indices
    offsets = column.offsets
    return encoded.dictionary.to_pylist(), _numbers(which, np.int32), _numbers(offsets, np.int32)


def _numbers(column: Any, dtype: type[np.generic]) -> np.ndarray:
    """A pyarrow array of numbers without nulls as numpy, from its buffer (``to_numpy`` imports
    pandas: +30 MB and 0.3 s)."""
    values = np.frombuffer(column.buffers()[1], dtype=dtype)
    return values[column.offset : column.offset + len(column)].copy()


def _parsed_entries(raw: bytes | bytearray, syntax: _Syntax) -> Any:
    """The entries of a table's JSON parsed by pyarrow as a struct array (the columns verify
    reads; other keys, the reports and tails, parsed and left out), or None where the text is
    not one JSON document or a value has another type."""
    import pyarrow as pa
    import pyarrow.json as pa_json

    entry = pa.struct([("device_id", pa.int64()), ("n_windows", pa.int64()), ("first_time", pa.int64()),
                       ("last_time", pa.int64()), ("sources", pa.list_(pa.string())),
                       ("scattered_checksum", pa.string()), ("scattered_digest", pa.string())])
    devices = [("devices", pa.list_(entry))]
    schema = pa.schema([("attributes", pa.struct([("birdzarr", pa.struct(devices))]))] if syntax.in_attributes
                       else devices)
    try:  # the system allocator: the parser's ~1x the text is given back once the columns are read
        parsed = pa_json.read_json(
            pa.py_buffer(raw), read_options=pa_json.ReadOptions(block_size=len(raw) + 64, use_threads=False),
            parse_options=pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
            memory_pool=pa.system_memory_pool())
    except (pa.ArrowInvalid, OSError):
        return None
    if parsed.num_rows != 1:
        return None
    if syntax.in_attributes:
        found = parsed.column("attributes").combine_chunks().field("birdzarr").field("devices")
    else:
        found = parsed.column("devices").combine_chunks()
    if found.null_count:
        return None
    return found.values[found.offsets[0].as_py() : found.offsets[1].as_py()]


def device_table_columns(store: Store, *, details: bool = True) -> _Table:
    """The store's device table as columns (module note above). Without ``details``, a format-2
    table that has its check arrays is read from its index arrays alone (``_Table.of_columns``: no
    JSON, no sources or label counts); otherwise a format-2 table written as the writers write it
    is read from its text, and any other (and format 1's) from ``Store.device_table``."""
    from birdzarr.store._device_table import table_path

    where = table_path(store.root)
    if where is not None and "device_table" not in store.__dict__:
        if not details:
            columns = _Table.of_columns(store.location, where, store.shuffled)
            if columns is not None:
                return columns
        found = _table_text(store.location, where)
        if found is not None:
            table = _Table.of_text(*found)
            del found
            if table is not None:
                return table
    return _Table.of_entries(store.device_table)


def _index_array(location: Location, key: str) -> np.ndarray:
    """One of a table group's int64 index or check arrays, every chunk read (``ArrayChunks``'
    errors: missing, damaged); ValueError where it is not one-dimensional int64."""
    chunks = ArrayChunks.open(location, key)
    if chunks.dtype != np.int64 or len(chunks.shape) != 1:
        raise ValueError(f"'{key}' is not a one-dimensional int64 array")
    return chunks.read_all()


def _table_text(location: Location, where: str) -> tuple[bytes | bytearray, _Syntax] | None:
    """The JSON text of the table group at ``where``: its zarr.json where its attributes hold the
    entries, or the array its attributes name (``details``); None where it cannot be read (then
    ``Store.device_table`` says why)."""
    try:
        raw = read_object(location, f"{where}/zarr.json")
        if raw.startswith(_IN_ATTRIBUTES.head):
            return raw, _IN_ATTRIBUTES
        if len(raw) > 1 << 16:
            return None
        name = json.loads(raw)["attributes"]["birdzarr"]["details"]
        chunks = ArrayChunks.open(location, f"{where}/{name}")
        if chunks.dtype != np.uint8 or len(chunks.shape) != 1:
            return None
        text = bytearray(chunks.length)
        for index in range(chunks.n_chunks):  # chunk by chunk: the chunks never held at once
            first, last = chunks.span(index)
            part = chunks.read(index)
            if len(part) != last - first:
                return None
            text[first:last] = part.tobytes()
    except (BirdzarrError, OSError, ValueError, KeyError, TypeError):
        return None
    return text, _IN_ARRAY  # bytes-like: the patterns give bytes, pyarrow reads it in place


# -- comparison with the sources ---------------------------------------------------------------


def _batches(store: Store, entry: DeviceEntry) -> list[list[str]]:
    """The device's source file names grouped as they were read: the conversion, then each
    append; an append that continued the device's unfinished last burst (``continued_rows``)
    read its files as the continuation of the batch before, so they join it."""
    device = str(entry.device_id)
    appends = (store.root.get("report") or {}).get("appends") or []  # the root holds them
    appended = [a.get("files", {}).get(device, []) for a in appends]
    later = {name for files in appended for name in files}
    batches = [[name for name in entry.sources if name not in later]]
    for record, files in zip(appends, appended, strict=True):
        if device in (record.get("continued_rows") or {}):
            batches[-1] = [*batches[-1], *files]
        else:
            batches.append(list(files))
    return [batch for batch in batches if batch]


def _read_source(store: Store, given: list[Location]) -> tuple[Location, list[DeviceSource]]:
    """The source's devices and files, or the error ``convert`` gives for this source (a missing
    path, a file or directory holding no input files, unknown entries), or BadInputError for
    input of the other kind than the store was converted from."""
    from birdzarr.convert._sources import find_inputs

    # entries the conversion (or an append) skipped as not input files are skipped again, and
    # only those: any other unknown entry is refused as convert refuses it
    root = store.root  # a format-2 store's device table holds none of these: not read
    report = root.get("report") or {}
    recorded = {*(root.get("skipped_files") or []),
                *(name for a in report.get("appends", []) for name in a.get("skipped_unknown_files", []))}
    src = given[0]  # the messages name the first source; find_inputs names the one at fault
    found = find_inputs(given if len(given) > 1 else src, skip_unknown_files=bool(recorded))
    unexpected = [name for name in found.skipped if name not in recorded]
    if unexpected:
        one = len(unexpected) == 1
        raise BadInputError(
            f"{src.display}: {len(unexpected)} "
            f"{'entry is not an input file and was' if one else 'entries are not input files and were'} "
            f"not skipped when {store.url} was converted: {', '.join(repr(n) for n in unexpected[:10])}. "
            f"Remove or rename {'it' if one else 'them'}, or point --source at the converted files only."
        )
    kind, devices = found.kind, found.devices
    if kind != root.get("source_kind"):
        raise BadInputError(
            f"{src.display} holds {kind} files, but {store.url} was converted from "
            f"{root.get('source_kind')} input: point --source (Python: source=) at the files "
            "it was converted from."
        )
    return src, devices


def _compare_with_source(
    store: Store, src: Location, devices: list[DeviceSource], result: VerifyResult,
    digests: _Digests | None = None, *, table: _Table | None = None,
) -> None:
    from birdzarr.convert._append import store_curation
    from birdzarr.convert._parquet import clear_group_cache

    if result.undecodable:
        result.problem(f"the devices cannot be compared with {src.display}: the dictionaries are missing or "
                       "damaged (above)")
        return
    table = device_table_columns(store) if table is None else table
    curation = store_curation(store.root)
    reports = _reports_that_skip(store)
    ids = table.ids.tolist()
    in_source = np.fromiter((d.device_id for d in devices), np.int64, len(devices))
    for gone in np.flatnonzero(~np.isin(table.ids, in_source)).tolist():
        result.problem(f"device {ids[gone]} ({int(table.n_windows[gone]):,} windows) has no source files in "
                       f"{src.display}")
    rows = _rows_of(table, in_source).tolist()  # each source device's entry, -1 where it has none
    stored = _ChunkMemo(store)  # devices share chunks: each is decoded once, not once a device
    parquet = store.root.get("source_kind") == "parquet"
    # device order: compared with the stored windows; shuffled: with the digests of this pass
    runs = (_Runs(store, table, stored, digests)
            if parquet and (digests is not None) == store.shuffled else None)
    names: dict[int, str] = {}  # id(file) -> its name (partition files are listed by many devices)
    # the devices that may join a run: read from partition files alone, named by their entries
    joins = [False] * len(devices) if runs is None else runs.candidates(devices, rows, names).tolist()

    def compare(device: DeviceSource, k: int) -> None:
        """One device of the source against its entry ``k``, as read by itself."""
        entry = table.entry(k)

        def derived(device: DeviceSource = device, entry: DeviceEntry = entry) -> _Rows:
            return derive_device(store, device, entry, curation, reports)

        try:
            if digests is not None:
                _compare_by_digest(store, entry, derived, result, digests)
            else:
                _compare_device(store, entry, derived(), result, stored)
        except MissingChunkError:
            result.problem(f"device {device.device_id}: cannot be compared, a chunk is missing or damaged")
        except BirdzarrError as exc:
            result.problem(f"device {device.device_id}: its source cannot be read again: {exc}")
        result.devices_compared += 1

    for device, k, joining in zip(devices, rows, joins, strict=True):
        if k < 0:
            if runs is not None:
                runs.flush(result, compare)
            result.problem(f"device {device.device_id} is in {src.display} but not in the store "
                           "(add it with `birdzarr append`)")
            continue
        if runs is not None:
            if joining and runs.add(device, k):
                continue  # compared with the devices around it (``_Runs``)
            runs.flush(result, compare)
            if joining and runs.add(device, k):
                continue  # the first of the next run (the run before was full)
        given = [_file_name(f, names) for f in device.files]
        files = dict(zip(given, device.files, strict=True))
        sources = table.sources(k)
        missing = [name for name in sources if name not in files]
        extra = [name for name in files if name not in sources]
        if extra:
            result.problem(f"device {device.device_id}: source file(s) {extra[:5]} are not in the store "
                           "(add them with `birdzarr append`)")
        if missing:
            result.problem(f"device {device.device_id}: the store was made from {missing[:5]}, which "
                           f"{src.display} does not hold; cannot compare this device")
            continue
        compare(device, k)
    if runs is not None:
        runs.flush(result, compare)
        clear_group_cache()  # the row groups read_runs kept decoded


def _rows_of(table: _Table, ids: np.ndarray) -> np.ndarray:
    """Each id's entry in ``table`` (the last of equal ids), -1 where it has none."""
    found, order = table.sorted_ids()
    if not len(found):
        return np.full(len(ids), -1, np.int64)
    at = np.searchsorted(found, ids, "right") - 1
    hit = (at >= 0) & (found[np.maximum(at, 0)] == ids)
    return np.where(hit, order[np.maximum(at, 0)], -1).astype(np.int64)


def _file_name(file: Location, known: dict[int, str]) -> str:
    """A source file's name (``known``: by ``id(file)``, as partition files are listed by many
    devices)."""
    name = known.get(id(file))
    if name is None:
        name = known[id(file)] = file.display.rsplit("/", 1)[-1]
    return name


def _reports_that_skip(store: Store) -> dict[int, Any]:
    """The reports ``derive_device`` needs: every device's, unless the root's totals say that no
    device had bad lines or files (then none reads its source skipping them: no report needed,
    and the table's reports are not read)."""
    totals = (store.root.get("report") or {}).get("totals")
    if totals is not None and not int(totals.get("bad_lines", 0)) and not int(totals.get("bad_files", 0)):
        return {}
    return store.report


_RUN_WINDOWS = 16_384  # windows of consecutive small devices read and compared at once (as convert)


class _Runs:
    """Consecutive devices of a Parquet store compared at once: devices read only from partition
    files, all their files named in their entry (none appended since) and, in device order, one
    range each, the ranges end to end. Their windows, times and labels are read together
    (``_parquet.read_runs``, as ``convert`` reads them) and compared with the stored run in one
    comparison, or, in a shuffled store, each device's count and digest with the ones this pass
    gathered (``_Digests``); a device whose count or values differ anywhere, or a run that cannot
    be read that way, is compared again by itself, which says what differs as for any device."""

    def __init__(self, store: Store, table: _Table, memo: _ChunkMemo, digests: _Digests | None = None
                 ) -> None:
        appends = (store.root.get("report") or {}).get("appends") or []
        self.appended = {int(d) for a in appends for d in (a.get("files") or {})}
        self.memo = memo
        self.digests = digests
        self.table = table
        self.count = table.n_windows.tolist()
        self.partition: dict[int, bool] = {}  # id(file) -> a partition file (no device in its name)
        # each entry's range where it has one, else -1 (lists: read one entry at a time)
        start = np.full(len(table), -1, np.int64)
        stop = np.full(len(table), -1, np.int64)
        one = np.bincount(table.range_entry, minlength=len(table)) == 1
        at = np.searchsorted(table.range_entry, np.flatnonzero(one))
        start[one], stop[one] = table.range_start[at], table.range_stop[at]
        self.start, self.stop = start.tolist(), stop.tolist()
        self.held: list[tuple[DeviceSource, int, list[Location]]] = []
        self.windows = 0
        self.end = -1 if digests is None else 0  # where the run held ends (shuffled: its windows)

    def candidates(self, devices: list[DeviceSource], rows: list[int], names: dict[int, str]) -> np.ndarray:
        """Whether each device (its entry ``rows[i]``, -1: none) may join a run: a Parquet device
        of partition files alone, not appended to, whose entry names its files in their order
        and, in device order, has one range. Devices of one file are checked as arrays (their
        file's name against each entry's only source, by their positions among the names)."""
        from birdzarr.convert._parquet import names_its_device

        table = self.table
        distinct, only = table.only_sources()
        place = {name: j for j, name in enumerate(distinct)}
        single = np.full(len(devices), -2, np.int64)  # the one file's name among ``distinct`` (-1: none)
        fits = np.zeros(len(devices), bool)  # Parquet, of partition files alone, not appended to
        partition = self.partition
        at_of: dict[int, int] = {}  # id(file) -> its name's place among ``distinct``
        appended = self.appended
        for i, device in enumerate(devices):
            if rows[i] < 0 or device.kind != "parquet" or device.device_id in appended:
                continue
            files = device.files
            for f in files:
                known = partition.get(id(f))
                if known is None:
                    known = partition[id(f)] = names_its_device(f) is None
                if not known:
                    break
            else:
                fits[i] = True
                if len(files) == 1:
                    at = at_of.get(id(files[0]))
                    if at is None:
                        at = at_of[id(files[0])] = place.get(_file_name(files[0], names), -1)
                    single[i] = at
        k = np.asarray(rows, np.int64)
        ok = fits & (k >= 0)
        named = np.zeros(len(devices), bool)
        one = ok & (single >= 0)
        named[one] = only[k[one]] == single[one]
        for i in np.flatnonzero(ok & (single == -2)).tolist():  # several files: as listed
            given = [_file_name(f, names) for f in devices[i].files]
            named[i] = len(set(given)) == len(given) and given == table.sources(rows[i])
        if self.digests is None:  # device order: one range each
            named &= np.asarray(self.start, np.int64)[np.maximum(k, 0)] >= 0
        return named

    def add(self, device: DeviceSource, k: int) -> bool:
        """Hold ``device`` (entry ``k``, one of the ``candidates``) for the run where it fits
        (class doc); False: it does not, and the devices held must be compared (``flush``)
        before it."""
        start, stop = self.start[k], self.stop[k]
        if self.digests is not None:  # shuffled: no ranges, any devices in turn
            start, stop = self.end, self.end + max(self.count[k], 0)
        if start < 0:
            return False
        if self.held and (self.windows + stop - start > _RUN_WINDOWS or start != self.end):
            return False
        self.held.append((device, k, device.files))
        self.windows += stop - start
        self.end = stop
        return True

    def flush(self, result: VerifyResult, compare: Callable[[DeviceSource, int], None]) -> None:
        """Compare the devices held: those found equal are counted, the others ``compare`` d alone."""
        held, self.held, self.windows = self.held, [], 0
        if not held:
            return
        for (device, k, _), equal in zip(held, self._equal(held).tolist(), strict=True):
            if equal:
                result.devices_compared += 1
            else:
                compare(device, k)

    def _same_digests(self, held: list[tuple[DeviceSource, int, list[Location]]], found: Any) -> np.ndarray:
        """Whether each device held has the count and digest (``_Digests``) of its source's rows."""
        digests = self.digests
        assert digests is not None
        unknown = np.zeros(len(held), bool)
        if digests.broken or not len(digests.known):
            return unknown
        counts = found.counts
        sums = np.zeros(len(held), np.uint64)
        some = counts > 0
        if some.any():  # each device's rows' hashes summed, wrapping as the digest does
            hashes = row_hashes(found.windows, found.timestamps, found.labels)
            sums[some] = np.add.reduceat(hashes, (np.cumsum(counts) - counts)[some]).astype(np.uint64)
        ids = np.array([device.device_id for device, _, _ in held], np.int64)
        at = np.minimum(np.searchsorted(digests.known, ids), len(digests.known) - 1)
        return ((digests.known[at] == ids) & (digests.count_of[at] == counts)
                & (digests.sum_of[at] == sums))

    def _equal(self, held: list[tuple[DeviceSource, int, list[Location]]]) -> np.ndarray:
        """Whether each device held has the windows, times and labels of its source, in order."""
        from birdzarr.convert._parquet import read_runs

        rows = [k for _, k, _ in held]
        unknown = np.zeros(len(held), bool)
        try:
            found = read_runs([(device.device_id, files) for device, _, files in held])
        except BirdzarrError:
            return unknown
        if self.digests is not None:
            return unknown if found is None else self._same_digests(held, found)
        counts = np.array([self.stop[k] - self.start[k] for k in rows], np.int64)
        if found is None or not np.array_equal(found.counts, counts):
            return unknown
        lo, hi = self.start[rows[0]], self.stop[rows[-1]]
        n = hi - lo
        if not n:
            return ~unknown
        try:
            windows, times, labels = (self.memo.read(name, lo, hi) for name in (GIMU, TIMESTAMP, LABEL))
        except BirdzarrError:
            return unknown
        mine = np.ascontiguousarray(windows, dtype="<f4").reshape(n, _VALUES).view(np.uint32)
        theirs = np.ascontiguousarray(found.windows, dtype="<f4").reshape(n, _VALUES).view(np.uint32)
        unequal = (mine != theirs).any(axis=1)  # bitwise, so NaN equals NaN
        unequal |= (times != found.timestamps) | (labels != found.labels)
        if not unequal.any():
            return ~unknown
        some = counts > 0
        differing = np.zeros(len(held), bool)
        differing[some] = np.logical_or.reduceat(unequal, (np.cumsum(counts) - counts)[some])
        return ~differing


def derive_device(store: Store, device: DeviceSource, entry: DeviceEntry, curation: Any,
                  reports: dict[int, Any]) -> _Rows:
    """One device's (windows, times, labels) derived again from its source files, batch by batch
    as the conversion and each append read them, with the store's curation: in the store's
    order for a device-ordered store. Its files must all be in ``device`` (checked by callers)."""
    from birdzarr.convert._sources import DeviceSource

    files = {f.display.rsplit("/", 1)[-1]: f for f in device.files}
    report = reports.get(device.device_id)
    skip = report is not None and (report.bad_lines > 0 or getattr(report, "bad_files", 0) > 0)
    for batch in _batches(store, entry):
        source = DeviceSource(device.device_id, device.kind, [files[n] for n in batch])
        for block in source.blocks(curation=curation, on_bad_rows="skip" if skip else "error"):
            yield block.windows, block.timestamps, block.labels


class _ChunkMemo:
    """Windows ``[lo, hi)`` of a device-ordered store's arrays, keeping the last chunk decoded of
    each: the devices are compared in the store's order, so the many small devices of a chunk
    are read from one decoding of it."""

    def __init__(self, store: Store) -> None:
        self.reader = store.reader
        self.held: dict[str, tuple[int, np.ndarray]] = {}

    def _chunk(self, name: str, index: int) -> np.ndarray:
        held = self.held.get(name)
        if held is None or held[0] != index:
            held = (index, self.reader.read(name, index))
            self.held[name] = held
        return held[1]

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        width = self.reader.chunk_windows
        first, last = lo // width, max(lo, hi - 1) // width
        parts = [self._chunk(name, index)[max(lo - index * width, 0) : hi - index * width]
                 for index in range(first, last + 1)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _stored(store: Store, entry: DeviceEntry, memo: _ChunkMemo | None = None) -> _Rows:
    if store.shuffled:
        indices = store.device_indices(entry.device_id)
        for lo in range(0, len(indices), _PIECE):
            part = indices[lo : lo + _PIECE]
            yield store.windows[part], store.timestamps[part], store.labels[part]
        return
    memo = memo or _ChunkMemo(store)
    for r in entry.ranges:
        for lo in range(r.start, r.stop, _PIECE):
            hi = min(lo + _PIECE, r.stop)
            yield tuple(memo.read(name, lo, hi) for name in (GIMU, TIMESTAMP, LABEL))


def _pieces(parts: Iterator[tuple[np.ndarray, ...]]) -> Iterator[tuple[np.ndarray, ...]]:
    """Regroup a stream of (windows, times, labels) into pieces of exactly _PIECE windows."""
    held: list[tuple[np.ndarray, ...]] = []
    count = 0
    for part in parts:
        held.append(part)
        count += len(part[0])
        while count >= _PIECE:
            joined = tuple(np.concatenate(column) for column in zip(*held, strict=True))
            yield tuple(column[:_PIECE] for column in joined)
            held = [tuple(column[_PIECE:] for column in joined)]
            count -= _PIECE
    if count:
        yield tuple(np.concatenate(column) for column in zip(*held, strict=True))


def _sorted_rows(parts: Iterator[tuple[np.ndarray, ...]]) -> np.ndarray:
    """Each (window, time, label) as one opaque row of bytes, sorted: an order-free comparison."""
    columns = [list(c) for c in zip(*parts, strict=True)] or [[], [], []]
    if not columns[0]:
        return np.empty(0, dtype="V332")
    windows, times, labels = (np.concatenate(c) for c in columns)
    n = len(windows)
    raw = np.concatenate([
        np.ascontiguousarray(windows, dtype="<f4").reshape(n, _VALUES).view(np.uint8),
        np.ascontiguousarray(times, dtype="<i8").reshape(n, 1).view(np.uint8),
        np.ascontiguousarray(labels, dtype="<i4").reshape(n, 1).view(np.uint8),
    ], axis=1)
    return np.sort(np.ascontiguousarray(raw).view(f"V{raw.shape[1]}").ravel())


class _Digests:
    """Per device of a shuffled store: its window count and the wrapping sum of a 64-bit hash of
    each (window, time, label) row (``row_hashes``): the order-free fingerprint the device
    table records as ``scattered_digest``, gathered in verify's one pass over the chunks.
    Different multisets of rows have different sums with probability ~1 - 2**-64."""

    def __init__(self, known: np.ndarray) -> None:
        self.known = known  # the device table's ids, sorted; the figures below are in this order
        self.count_of = np.zeros(len(known), dtype=np.int64)
        self.sum_of = np.zeros(len(known), dtype=np.uint64)  # wraps modulo 2**64, as the digest
        self.broken = False  # a chunk could not be read: no device can be compared this way
        self.differing = 0  # devices found different so far

    def add(self, data: dict[str, np.ndarray]) -> None:
        if any(name not in data for name in _ARRAYS):
            self.broken = True
            return
        ids = data[DEVICE]
        hashes = row_hashes(data[GIMU], data[TIMESTAMP], data[LABEL])
        if not len(ids) or not len(self.known):
            return
        runs = device_runs(ids)
        sums = np.add.reduceat(hashes[runs.order], runs.starts).astype(np.uint64)
        counts = runs.stops - runs.starts
        # ids not in the table are reported by the pass over the chunks; only the table's count
        at = np.minimum(np.searchsorted(self.known, runs.ids), len(self.known) - 1)
        present = self.known[at] == runs.ids
        at = at[present]  # distinct: one run a device
        self.count_of[at] += counts[present]
        self.sum_of[at] += sums[present]

    def of(self, device: int) -> tuple[int, int]:
        """(windows, digest sum) of one device of the table."""
        at = int(np.searchsorted(self.known, device))
        if at < len(self.known) and self.known[at] == device:
            return int(self.count_of[at]), int(self.sum_of[at])
        return 0, 0


_EXACT_LIMIT = 3  # devices whose digests differ that are then compared window by window


_Rows = Iterator[tuple[np.ndarray, ...]]


def _compare_by_digest(store: Store, entry: DeviceEntry, derive: Callable[[], _Rows], result: VerifyResult,
                       digests: _Digests) -> None:
    """Shuffled store: compare a device's digest with its source's; only a device that differs
    is read again (a full pass of the store each, so at most a few) to count the difference."""
    if digests.broken:
        raise MissingChunkError("a chunk is missing or damaged")
    theirs, count = RowDigest(), 0
    for windows, times, labels in derive():
        theirs.update(windows, times, labels)
        count += len(windows)
    device = entry.device_id
    mine = digests.of(device)
    other = (count, theirs.value)
    if mine == other:
        return
    digests.differing += 1
    if digests.differing <= _EXACT_LIMIT:
        _compare_shuffled_device(store, entry, derive(), result)
        return
    if mine[0] != other[0]:
        result.problem(f"device {device}: the store holds {mine[0]:,} windows, its sources give {other[0]:,}")
    else:
        result.problem(f"device {device}: its windows (with their times and labels) differ from the "
                       "sources (compared as sets: the store is shuffled; not counted one by one)")


def _compare_shuffled_device(store: Store, entry: DeviceEntry, derived: Iterator[tuple[np.ndarray, ...]],
                             result: VerifyResult) -> None:
    """A shuffled store keeps a device's windows in a random order: compare them as multisets
    (memory: twice the device's windows)."""
    mine, theirs = _sorted_rows(_stored(store, entry)), _sorted_rows(derived)
    device = f"device {entry.device_id}"
    if len(mine) != len(theirs):
        result.problem(f"{device}: the store holds {len(mine):,} windows, its sources give {len(theirs):,}")
        return
    if (mine != theirs).any():  # rare: count exactly, row by row
        only_mine = Counter(r.tobytes() for r in mine)
        only_mine.subtract(r.tobytes() for r in theirs)
        differing = sum(c for c in only_mine.values() if c > 0)
        result.problem(f"{device}: {differing:,} window(s) (with their times and labels) differ from "
                       "the sources (compared as sets: the store is shuffled)")


def _compare_device(store: Store, entry: DeviceEntry, derived: Iterator[tuple[np.ndarray, ...]],
                    result: VerifyResult, memo: _ChunkMemo | None = None) -> None:
    if store.shuffled:
        _compare_shuffled_device(store, entry, derived, result)
        return
    stored_n = derived_n = 0
    differing = {"windows": 0, "timestamps": 0, "labels": 0}
    first_difference: dict[str, int] = {}  # per array: its own first differing window
    stored_pieces, derived_pieces = _pieces(_stored(store, entry, memo)), _pieces(derived)
    for mine, theirs in _zip_longest(stored_pieces, derived_pieces):
        stored_n += len(mine[0]) if mine else 0
        derived_n += len(theirs[0]) if theirs else 0
        if not mine or not theirs:
            continue
        n = min(len(mine[0]), len(theirs[0]))
        base = stored_n - len(mine[0])
        for name, a, b in zip(differing, mine, theirs, strict=True):
            if name == "windows":
                bits_a = np.ascontiguousarray(a[:n], dtype="<f4").reshape(n, _VALUES).view(np.uint32)
                bits_b = np.ascontiguousarray(b[:n], dtype="<f4").reshape(n, _VALUES).view(np.uint32)
                unequal = (bits_a != bits_b).any(axis=1)  # bitwise, so NaN equals NaN
            else:
                unequal = a[:n] != b[:n]
            differing[name] += int(unequal.sum())
            if unequal.any() and name not in first_difference:  # pieces come in window order
                first_difference[name] = base + int(np.flatnonzero(unequal)[0])
    device = f"device {entry.device_id}"
    if stored_n != derived_n:
        result.problem(f"{device}: the store holds {stored_n:,} windows, its sources give {derived_n:,}")
    for name, count in differing.items():
        if count:
            result.problem(f"{device}: {count:,} window(s) differ in {name} from the sources "
                           f"(first at the device's window {first_difference[name]})")


def _zip_longest(a: Iterator[Any], b: Iterator[Any]) -> Iterator[tuple[Any, Any]]:
    while True:
        x, y = next(a, None), next(b, None)
        if x is None and y is None:
            return
        yield x, y


# -- format version 2 ------------------------------------------------------------------------------


def window_arrays(format_version: int) -> tuple[str, ...]:
    """The arrays of a store of ``format_version`` that hold one entry a window."""
    windows = WINDOW_ARRAYS_V2 if format_version >= 2 else (GIMU,)
    return (*windows, DEVICE, TIMESTAMP, LABEL)


class ArrayChunks:
    """The chunks of one array of a version-2 store, read straight from its objects: a missing
    object raises ``MissingChunkError``, bytes that fail their CRC-32C or do not decode
    ``CorruptChunkError``, both naming the store and the key (as ``ChunkReader`` does). Version 2
    writes only core chains (``_v2.CODECS``: an optional transpose, bytes, blosc, crc32c); the
    chunk grid spans every axis but the first, so chunk ``i`` is ``c/i/0/...``."""

    def __init__(self, location: Location, name: str, meta: dict[str, Any],
                 length: int | None = None) -> None:
        self.location = location
        self.name = name
        self.meta = meta
        self.shape = tuple(int(n) for n in meta["shape"])
        self.length = self.shape[0] if length is None else length  # committed extent along axis 0
        self.chunk_shape = tuple(int(n) for n in meta["chunk_grid"]["configuration"]["chunk_shape"])
        self.dtype = np.dtype(meta["data_type"])
        encoding = meta.get("chunk_key_encoding", {})
        self.separator = encoding.get("configuration", {}).get("separator", "/")
        self.n_chunks = -(-self.length // self.chunk_shape[0])

    @classmethod
    def open(cls, location: Location, name: str, length: int | None = None) -> ArrayChunks:
        from birdzarr.store._chunks import read_array_meta

        return cls(location, name, read_array_meta(location, name), length)

    def key(self, index: int) -> str:
        """The object key of chunk ``index`` relative to the store's root."""
        return f"{self.name}/" + self.separator.join(["c", str(index), *["0"] * (len(self.shape) - 1)])

    def span(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_shape[0]
        return start, min(start + self.chunk_shape[0], self.length)

    def read(self, index: int) -> np.ndarray:
        """Chunk ``index``, trimmed to the committed extent."""
        key = self.key(index)
        data = read_object(self.location, key)
        try:
            array = decode_core_chunk(data, self.meta["codecs"], self.chunk_shape, self.dtype)
        except (ValueError, RuntimeError, TypeError, KeyError) as exc:
            raise CorruptChunkError(
                f"{self.location.display}: chunk '{key}' cannot be decoded ({exc}). The store is "
                "damaged; run `birdzarr verify`."
            ) from None
        start, stop = self.span(index)
        return array[: stop - start]

    def read_all(self) -> np.ndarray:
        parts = [self.read(i) for i in range(self.n_chunks)]
        return np.concatenate(parts) if parts else np.empty((0, *self.shape[1:]), self.dtype)


def decode_core_chunk(data: bytes, codecs: list[dict[str, Any]], chunk_shape: tuple[int, ...],
                      dtype: np.dtype[Any]) -> np.ndarray:
    """One whole chunk from its stored bytes through a chain of core codecs: [transpose], bytes,
    then blosc / zstd / gzip / crc32c (decoded last to first)."""
    import numcodecs

    raw: bytes | memoryview = data
    order: list[int] | None = None
    endian = "little"
    names = [c["name"] for c in codecs]
    if "sharding_indexed" in names:
        raise ValueError("a sharded chain")
    serializer = names.index("bytes")
    for codec in codecs[:serializer]:
        if codec["name"] != "transpose":
            raise ValueError(f"the array-to-array codec {codec['name']!r}")
        order = [int(a) for a in codec["configuration"]["order"]]
    endian = codecs[serializer].get("configuration", {}).get("endian", "little")
    for codec in reversed(codecs[serializer + 1 :]):
        name = codec["name"]
        if name == "crc32c":
            raw = strip_crc32c(bytes(raw))
        elif name == "blosc":
            raw = numcodecs.Blosc().decode(raw)
        elif name == "zstd":
            raw = numcodecs.Zstd().decode(raw)
        elif name == "gzip":
            raw = numcodecs.GZip().decode(raw)
        else:
            raise ValueError(f"the bytes-to-bytes codec {name!r}")
    stored_shape = chunk_shape if order is None else tuple(chunk_shape[a] for a in order)
    flat = np.frombuffer(raw, dtype=dtype.newbyteorder("<" if endian == "little" else ">"))
    if flat.size != int(np.prod(stored_shape)):
        raise ValueError(f"{flat.size} values where a chunk of shape {list(chunk_shape)} holds "
                         f"{int(np.prod(stored_shape))}")
    array = flat.reshape(stored_shape)
    if order is not None:
        array = array.transpose(np.argsort(order))
    return np.ascontiguousarray(array).astype(dtype.newbyteorder("="), copy=False)


def dictionary_lengths(store: Store) -> tuple[int, int]:
    """Committed entries and rows of a version-2 store's dictionaries: the lengths its commit
    records (``committed.dictionary``), or the arrays' shapes where it records none."""
    layouts = store.reader.layouts
    return layouts[_v2.VALUES].length, layouts[_v2.DEVICE].length


def load_dictionaries(store: Store, problems: Callable[[str], None], *, known: np.ndarray | None = None
                      ) -> _v2.Dictionaries | None:
    """A version-2 store's dictionary arrays, every chunk read and checked; each damaged chunk and
    each inconsistency is passed to ``problems`` (one line each), and then None is returned.
    ``known``: the device table's ids, sorted (read from the table when not given)."""
    n_values, n_rows = dictionary_lengths(store)
    lengths = {_v2.VALUES: n_values, _v2.START: n_rows, _v2.DEVICE: n_rows}
    arrays: dict[str, np.ndarray] = {}
    sound = True
    for name in DICTIONARY_ARRAYS:
        chunks = ArrayChunks.open(store.location, name, lengths[name])
        # filled chunk by chunk: the chunks and their concatenation are never held at once
        # (dict_values is the largest array verify holds)
        whole = np.empty((chunks.length, *chunks.shape[1:]), chunks.dtype)
        for index in range(chunks.n_chunks):
            try:
                part = chunks.read(index)
            except MissingChunkError as exc:
                problems(str(exc))
                sound = False
                continue
            first, last = chunks.span(index)
            whole[first:last] = part
        if sound:
            arrays[name] = whole
    if not sound:
        return None
    values, start, device = arrays[_v2.VALUES], arrays[_v2.START], arrays[_v2.DEVICE]
    sizes = _v2.entry_counts(start, len(values))
    where = f"{store.location.display}: the dictionaries"
    misplaced = _v2.misplaced_rows(start, len(values))
    if misplaced.any():
        row = int(np.flatnonzero(misplaced)[0])
        problems(f"{where}: 'dict_start' is not ascending within row {row} or points outside "
                 "'dict_values'")
        return None
    if (sizes > _v2.MAX_ENTRIES).any():
        row = int(np.flatnonzero((sizes > _v2.MAX_ENTRIES).any(axis=1))[0])
        problems(f"{where}: row {row} of 'dict_start' holds more than {_v2.MAX_ENTRIES:,} entries a channel")
        return None
    unknown = _unknown_ids(device, _table_index(store)[0] if known is None else known)
    if len(unknown):
        problems(f"{where}: 'dict_device' names device ids {unknown[:5].tolist()} that are not in the "
                 "device table")
    return _v2.Dictionaries(values, start, device)


def check_coded(codes: np.ndarray, row: np.ndarray, dicts: _v2.Dictionaries, first_window: int,
                sizes: np.ndarray | None = None) -> str | None:
    """What is wrong with a chunk's codes and rows against the dictionaries (None: every row
    exists and every code lies inside its row's dictionary); ``_v2.check``, said precisely.
    ``sizes``: ``dicts.sizes()``, found once by a caller checking many chunks."""
    n_rows = dicts.n_rows
    missing_row = row >= n_rows
    if missing_row.any():
        at = int(np.flatnonzero(missing_row)[0])
        return (f"{int(missing_row.sum()):,} window(s) refer to a dictionary row that does not exist "
                f"(first: window {first_window + at:,}, row {int(row[at])}; the dictionaries hold "
                f"{n_rows:,} rows)")
    sizes = dicts.sizes() if sizes is None else sizes
    # uint16 against uint16 (sizes are at most MAX_ENTRIES), each window's 60 codes in one run
    limits = np.tile(sizes[row].astype(np.uint16), (1, _v2.WINDOW_LENGTH))  # (n, 60) as (20, 3) flattens
    flat = np.ascontiguousarray(codes).reshape(len(row), -1)
    if (flat >= limits).any():
        past = codes >= sizes[row][:, None, :]
        windows = past.any(axis=(1, 2))
        at = int(np.flatnonzero(windows)[0])
        sample, channel = (int(i[0]) for i in np.nonzero(past[at]))
        r = int(row[at])
        return (f"{int(windows.sum()):,} window(s) hold a code past the end of their dictionary "
                f"(first: window {first_window + at:,}, sample {sample}, channel {channel}: code "
                f"{int(codes[at, sample, channel])} of row {r}, which holds {int(sizes[r, channel])} "
                "entries)")
    return None
