"""``birdzarr repair``: remove what an interrupted writer left behind, keep every committed window.

What a killed convert or append can leave (see docs/reliability.md):

- arrays whose shape runs past the committed count (the writer resizes before writing data);
- chunk files past the last committed chunk;
- ``*.partial`` temp files of zarr's LocalStore (written, then renamed into place);
- the last committed chunk rewritten with extra, uncommitted windows after its committed prefix
  (harmless: readers stop at the committed count, and the next append overwrites them);
- a stale lock file, or one renamed aside (``*.broken``) by a writer that died breaking it;
- a first conversion that never committed (the whole group is a leftover);
- beside the store, ``DEST.birdzarr-new-*``: the replacement a killed ``convert --overwrite`` was
  writing (removed when DEST holds its committed store; named, and left alone, otherwise);
- ``birdzarr-shuffle-*`` spill directories of a killed ``convert --shuffle`` in the temporary
  directory: named with their size (they may belong to a conversion still running elsewhere;
  a custom ``--shuffle-tmp`` is not searched).

Repair never touches a window below the committed count, except with ``--source`` (Python:
``source=``) on a format-2 store: then each damaged per-window chunk (``gimu_codes``,
``gps_speed``, ``gimu_row``: missing, failing its CRC-32C, or coded outside the dictionaries; in
device order also ``device``, ``timestamp`` and ``label``) is rebuilt from the windows the sources
give for it, coded with each window's dictionary row (from
``gimu_row`` where that chunk is sound, else the first row of the window's device that holds all
its values). A device-ordered chunk's windows follow from the device table's ranges, and are
checked against the range checksums recorded at write time; a shuffled chunk's are its devices'
source windows that the store's sound chunks lack (the sources checked against each device's
recorded digest), placed by time, label and the chunk's intact parts. Everything is planned in
memory first: what cannot be rebuilt (damaged dictionaries, a value none of a device's rows holds,
sources that do not match) is refused in one line and nothing is changed. Chunks are written
whole, through zarr-python from the array's own zarr.json, then read back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from birdzarr._checks import require_bool
from birdzarr._errors import (
    BadInputError,
    ChunkFetchError,
    CorruptChunkError,
    MissingChunkError,
    NotAStoreError,
    StoreLockedError,
)
from birdzarr.format import _v2
from birdzarr.format._spec import DEVICE, GIMU, LABEL, TIMESTAMP, check_root_attrs, format1_refusal
from birdzarr.storage._location import Location, StoreLike, resolve, zarr_store
from birdzarr.storage._lock import StoreLock, clear_except_lock, read_holder
from birdzarr.storage._lock import break_lock as _break_lock
from birdzarr.storage._root import parse_root
from birdzarr.store._chunks import array_names, read_array_meta
from birdzarr.store._tail import discard_format2_leftovers, discard_uncommitted

if TYPE_CHECKING:
    from birdzarr.store._handle import Store


@dataclass
class RepairResult:
    """What repair found and did (``birdzarr.RepairReport`` is its deprecated name)."""

    url: str
    committed_windows: int | None = None
    actions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # found, not changed: for the user to decide

    def format(self) -> str:
        """What repair did, as ``birdzarr repair`` prints it (``str(result)`` is the same)."""
        head = f"{self.url}: "
        if self.committed_windows is None:
            head += "no committed store"
        else:
            head += f"{self.committed_windows:,} committed windows kept"
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        if not self.actions:
            return head + "; nothing to repair." + notes
        return head + "\n" + "\n".join(f"  - {a}" for a in self.actions) + notes

    def __str__(self) -> str:
        return self.format()


def repair(
    store: StoreLike, *, break_lock: bool = False, source: StoreLike | Sequence[StoreLike] | None = None,
    storage_options: dict[str, Any] | None = None, source_storage_options: dict[str, Any] | None = None,
) -> RepairResult:
    """Remove uncommitted leftovers; a live writer's lock is respected unless ``break_lock``
    (the CLI's ``--break-lock``). With ``source`` (the files the store was converted from, one
    source or several as ``verify`` takes them), a format-2 store's damaged per-window chunks
    (``gimu_codes``, ``gps_speed``, ``gimu_row``: missing, failing their CRC-32C, or coded outside
    the dictionaries; in device order also ``device``, ``timestamp``, ``label``) are rebuilt from
    the source's windows; what cannot be rebuilt (damaged
    dictionaries, a source whose windows are not the store's) is refused in one line before
    anything changes."""
    import zarr

    # break_lock="no" must not break a live writer's lock
    break_lock = require_bool("break_lock", break_lock)
    location = resolve(store, storage_options)
    given: list[Location] = []
    if source is not None:
        many: list[StoreLike] = list(source) if isinstance(source, list | tuple) else [source]  # type: ignore[list-item]
        given = [resolve(one, source_storage_options) for one in many]
    report = RepairResult(url=location.display)
    holder = read_holder(location)
    meta: dict[str, Any]
    try:
        raw = location.fs.cat_file(location.join("zarr.json"))
    except FileNotFoundError:
        if holder is None:
            raise NotAStoreError(
                f"{location.display}: no zarr.json, so nothing here is a birdzarr store to repair."
            ) from None
        meta = {"committed": None}  # a conversion killed before it wrote any metadata
    else:
        # the readers' checks and messages: damaged metadata is refused before anything changes
        meta = check_root_attrs(parse_root(raw, location), where=location.display)
        if meta.get("committed"):
            for name in array_names(int(meta["format_version"])):
                read_array_meta(location, name)
    if holder is not None and not holder.is_stale():
        if not break_lock:
            raise StoreLockedError(
                f"{location.display} is locked by {holder.describe()}, which may still be writing. "
                "Wait for it, or if you know that process is gone (another host), re-run with "
                "--break-lock."
            )
        _break_lock(location, expected=holder)
        report.actions.append(f"broke the lock of {holder.describe()} (--break-lock)")
    lock = StoreLock(location, command="birdzarr repair")
    lock.acquire()
    try:
        if lock.took_over is not None:
            report.actions.append(f"removed the stale lock of {lock.took_over.describe()}")
        from birdzarr.convert._overwrite import NEW_INFIX, _remove, sibling_leftovers

        committed = meta.get("committed")
        siblings = sibling_leftovers(location)
        if not committed and siblings:
            report.notes.append(
                f"{location.display} is not committed and {_listed(siblings)} lie beside it: an "
                "interrupted `convert --overwrite` swap. Nothing was removed. If one of them is a "
                "committed store (`birdzarr info` on it), copy it back with `birdzarr copy IT "
                f"{location.display} --overwrite`, or convert again."
            )
            return report
        for leftover in siblings if committed else []:
            if NEW_INFIX in leftover:
                _remove(location.fs, leftover)
                report.actions.append(f"removed {leftover}, the replacement an interrupted "
                                      "`convert --overwrite` was writing (the store here is intact)")
        if not committed:
            clear_except_lock(location)
            report.actions.append(
                "removed an unfinished conversion that never committed (re-run `birdzarr convert`)"
            )
            return report
        from birdzarr.maintenance._verify import window_arrays
        from birdzarr.store._handle import open_store

        n_windows = int(committed["n_windows"])
        opened = open_store(location) if given else None
        # planned (read only) before anything changes: a refusal leaves the store as it was
        plans, notes = _plan_rebuilds(opened, given) if opened is not None else ([], [])
        report.notes += notes
        report.committed_windows = n_windows
        group = zarr.open_group(zarr_store(location, read_only=False), mode="r+", zarr_format=3)
        report.actions += discard_uncommitted(location, group, n_windows,
                                              window_arrays(int(meta["format_version"])))
        if int(meta["format_version"]) >= 2:
            report.actions += discard_format2_leftovers(location, group, committed)
        if opened is not None:
            _write_rebuilds(opened, plans, report)
    finally:
        lock.release()
        if report.committed_windows is None:
            _remove_if_empty(location)
    report.notes += shuffle_leftovers()
    return report


def shuffle_leftovers(directory: str | None = None) -> list[str]:
    """Name the ``birdzarr-shuffle-*`` spill directories in ``directory`` (default: $TMPDIR)."""
    import glob
    import os
    import tempfile

    found = []
    for path in sorted(glob.glob(os.path.join(directory or tempfile.gettempdir(), "birdzarr-shuffle-*"))):
        size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)
        found.append(f"{path} ({size / 1e6:,.1f} MB) is the spill directory of a `convert --shuffle`; "
                     "if no such conversion is running on this machine, it was killed: delete it")
    return found


def _listed(paths: list[str]) -> str:
    return ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def _remove_if_empty(location: Location) -> None:
    fs = location.fs
    try:
        if fs.exists(location.path) and not fs.ls(location.path, detail=False):
            fs.rmdir(location.path)
    except OSError:
        pass



# -- rebuilding damaged chunks of a version-2 store from its sources ---------------------------------

_CHANNEL_NAMES = ("imu_x", "imu_y", "imu_z")


@dataclass
class _Rebuild:
    """One chunk index's rebuilt per-window arrays (only those to write) and why."""

    index: int
    start: int
    stop: int
    windows: np.ndarray  # float32 (n, 20, 4): the source's windows, what the chunk decodes to
    arrays: dict[str, np.ndarray]  # name -> the chunk's new content, trimmed to committed windows
    why: dict[str, str]  # name -> what was wrong with it


def _refusal(store: Store, what: str) -> BadInputError:
    return BadInputError(f"{store.url}: {what}. Nothing was changed.")


def _dictionaries_or_refuse(store: Store) -> _v2.Dictionaries:
    """The dictionaries, every chunk checked; damage to them refused in one line: they cannot be
    rebuilt from the windows of one chunk."""
    from birdzarr.maintenance._verify import (
        DICTIONARY_ARRAYS,
        ArrayChunks,
        dictionary_lengths,
        load_dictionaries,
    )

    redo = (f"the dictionary arrays cannot be rebuilt from the windows of a chunk (every chunk's codes "
            f"index them): convert the store again from its sources (`birdzarr convert SOURCE "
            f"{store.url} --overwrite`), or restore it from a copy")
    n_values, n_rows = dictionary_lengths(store)
    lengths = {_v2.VALUES: n_values, _v2.START: n_rows, _v2.DEVICE: n_rows}
    for name in DICTIONARY_ARRAYS:
        chunks = ArrayChunks.open(store.location, name, lengths[name])
        for index in range(chunks.n_chunks):
            try:
                chunks.read(index)
            except ChunkFetchError:
                raise
            except CorruptChunkError:
                raise CorruptChunkError(f"{store.url}: dictionary chunk '{chunks.key(index)}' is damaged "
                                        f"(it fails its CRC-32C or does not decode); {redo}.") from None
            except MissingChunkError:
                raise MissingChunkError(f"{store.url}: dictionary chunk '{chunks.key(index)}' is missing; "
                                        f"{redo}.") from None
    problems: list[str] = []
    found = load_dictionaries(store, problems.append)
    if found is None or problems:
        raise CorruptChunkError(f"{problems[0]}; {redo}.")
    return found


def _damaged_chunks(store: Store, dicts: _v2.Dictionaries) -> dict[int, dict[str, str]]:
    """Per chunk index, the per-window arrays of the windows whose chunk is missing, fails its
    CRC-32C, does not decode, or (codes and rows) points outside the dictionaries."""
    from birdzarr.maintenance._verify import WINDOW_ARRAYS_V2, check_coded

    reader = store.reader
    damaged: dict[int, dict[str, str]] = {}
    # in device order the device table and the sources give the other per-window arrays too
    names = WINDOW_ARRAYS_V2 if store.shuffled else (*WINDOW_ARRAYS_V2, DEVICE, TIMESTAMP, LABEL)
    for index in range(reader.n_chunks):
        parts: dict[str, np.ndarray] = {}
        for name in names:
            try:
                parts[name] = reader.read(name, index)
            except ChunkFetchError:
                raise  # the storage failed, not the chunk
            except CorruptChunkError:
                damaged.setdefault(index, {})[name] = "damaged"
            except MissingChunkError:
                damaged.setdefault(index, {})[name] = "missing"
        if _v2.CODES in parts and _v2.ROW in parts:
            start = reader.chunk_span(index)[0]
            wrong = check_coded(parts[_v2.CODES], parts[_v2.ROW], dicts, start)
            if wrong is not None:
                for name in (_v2.CODES, _v2.ROW):
                    damaged.setdefault(index, {})[name] = "inconsistent"
    return damaged


def _device_rows(store: Store, given: list[Location], wanted: set[int]
                 ) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The (windows, times, labels) of each device in ``wanted``, derived again from the sources
    (in store order for a device-ordered store); a shuffled store's devices are checked against
    their recorded digests here, since their windows are then placed by what identifies them
    (``_shuffled_windows``), not by a checksum of their positions."""
    from birdzarr.convert._append import store_curation
    from birdzarr.format._digest import RowDigest
    from birdzarr.maintenance._verify import _read_source, derive_device

    src, devices = _read_source(store, given)
    in_source = {d.device_id: d for d in devices}
    curation, reports = store_curation(store.meta), store.report
    found = {}
    for device_id in sorted(wanted):
        entry = store.device(device_id)
        device = in_source.get(device_id)
        names = {f.display.rsplit("/", 1)[-1] for f in device.files} if device is not None else set()
        missing = [name for name in entry.sources if name not in names]
        if device is None or missing:
            raise _refusal(store, f"device {device_id}'s source files {missing[:5]} are not in "
                                  f"{src.display}, so its damaged chunks cannot be rebuilt; point --source "
                                  "at the files the store was converted from (and appended)")
        blocks = list(derive_device(store, device, entry, curation, reports))
        if blocks:
            windows, times, labels = (np.concatenate(column) for column in zip(*blocks, strict=True))
        else:
            windows = np.empty((0, 20, 4), np.float32)
            times, labels = np.empty(0, np.int64), np.empty(0, np.int32)
        if len(windows) != entry.n_windows:
            raise _refusal(store, f"device {device_id}: its sources give {len(windows):,} windows, the "
                                  f"store holds {entry.n_windows:,}; --source is not what the store was "
                                  "converted from")
        windows = np.ascontiguousarray(windows, dtype=np.float32)
        if store.shuffled:
            digest = RowDigest()
            digest.update(windows, times, labels)
            if entry.scattered_digest is None or digest.hexdigest() != entry.scattered_digest:
                raise _refusal(store, f"device {device_id}: the windows its sources give do not match the "
                                      f"digest recorded at write time ({digest.hexdigest()}, not "
                                      f"{entry.scattered_digest}): --source is not what the store was "
                                      "converted from")
        found[device_id] = (windows, np.asarray(times, np.int64), np.asarray(labels))
    return found


def _shuffled_windows(store: Store, dicts: _v2.Dictionaries, damaged: dict[int, dict[str, str]],
                      keys: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]],
                      sources: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
                      ) -> tuple[dict[int, np.ndarray], int]:
    """The source windows of a shuffled store's damaged chunks, and how many were placed among
    windows that nothing recorded tells apart.

    A device's windows there are its source windows less those the store's sound chunks hold (a
    multiset of (window, time, label) rows; the sources already matched the recorded digest). Each
    goes to a position whose device, time, label and intact parts (gps_speed; the codes, decoded
    with the chunk's rows or, where those are lost, with the first of the device's rows that gives
    a window of the source) it agrees with; chunks with the most intact parts are matched first.
    Windows that agree on all of that (windows of one burst, or a source without times) are placed
    in source order: the store then holds exactly its windows, times and labels, possibly two such
    windows in each other's place. A position that no left-over window fits refuses the repair."""
    from birdzarr.format._digest import row_hashes
    from birdzarr.maintenance._verify import check_coded

    reader = store.reader
    wanted = np.array(sorted(sources), np.int64)
    stored: dict[int, list[np.ndarray]] = {int(d): [] for d in wanted}
    for index in range(reader.n_chunks):  # the rows the sound chunks hold
        if index in damaged:
            continue
        device = np.asarray(reader.read(DEVICE, index), np.int64)
        mine = np.isin(device, wanted)
        if not mine.any():
            continue
        hashes = row_hashes(reader.read(GIMU, index)[mine], reader.read(TIMESTAMP, index)[mine],
                            reader.read(LABEL, index)[mine])
        for d in np.unique(device[mine]).tolist():
            stored[d].append(hashes[device[mine] == d])
    left: dict[int, list[int]] = {}  # per device: its source windows in no sound chunk, in source order
    for d, (windows, times, labels) in sources.items():
        hashes = row_hashes(windows, times, labels)
        held = np.sort(np.concatenate(stored[d])) if stored[d] else np.empty(0, np.uint64)
        order = np.argsort(hashes, kind="stable")
        ranked = hashes[order]
        # the k-th copy of a hash is in a sound chunk when the store holds at least k copies of it
        copy = np.arange(len(ranked)) - np.searchsorted(ranked, ranked, side="left")
        copies = np.searchsorted(held, ranked, side="right") - np.searchsorted(held, ranked, side="left")
        left[d] = sorted(order[copy >= copies].tolist())
    intact = {index: {name: reader.read(name, index) for name in (_v2.CODES, _v2.GPS, _v2.ROW)
                      if name not in why} for index, why in damaged.items()}
    sizes = dicts.sizes()
    found: dict[int, np.ndarray] = {}
    ambiguous = 0

    def rank(index: int) -> tuple[int, int]:  # most intact parts first
        parts = intact[index]
        return (-int(_v2.CODES in parts) - int(_v2.ROW in parts), -int(_v2.GPS in parts))

    for index in sorted(damaged, key=lambda i: (rank(i), i)):
        device, times, labels = keys[index]
        parts = intact[index]
        codes, rows, gps = parts.get(_v2.CODES), parts.get(_v2.ROW), parts.get(_v2.GPS)
        first = reader.chunk_span(index)[0]
        if codes is not None and rows is not None and check_coded(codes, rows, dicts, first) is not None:
            rows = None  # codes or rows out of range: the codes are used with the device's rows
        windows = np.empty((len(device), 20, 4), np.float32)
        for d in np.unique(device).tolist():
            here = np.flatnonzero(device == d)
            source_windows, source_times, source_labels = sources[d]
            candidates = np.array(left[d], np.int64)
            cw = source_windows[candidates]
            offered = _match_keys(source_times[candidates], source_labels[candidates],
                                  cw[:, :, 3] if gps is not None else None,
                                  cw[:, :, :3] if codes is not None else None)
            by_key: dict[bytes, list[int]] = {}
            for key, c in zip(offered, candidates.tolist(), strict=True):
                by_key.setdefault(key, []).append(c)
            device_rows = np.flatnonzero(dicts.device == d).tolist()
            used = set()
            told_apart: dict[bytes, bool] = {}
            for position in here.tolist():
                tries: list[np.ndarray | None] = [None]
                if codes is not None:  # the codes' values in the chunk's row, or in each of the device's
                    code = codes[position : position + 1]
                    options = [int(rows[position])] if rows is not None else device_rows
                    tries = [_v2.decode(code, np.array([r]), np.zeros((1, 20), np.float32), dicts.values,
                                        dicts.start)[:, :, :3]
                             for r in options if (code < sizes[r]).all()]
                matches: list[int] = []
                for imu in tries:
                    key = _match_keys(times[position : position + 1], labels[position : position + 1],
                                      gps[position : position + 1] if gps is not None else None, imu)[0]
                    matches = by_key.get(key, [])
                    if matches:
                        break
                if not matches:
                    raise _refusal(store, (
                        f"window {first + position:,} of shuffled chunk {index} (device {d}) matches none of "
                        "its source's windows that the store's sound chunks lack (by time, label and its "
                        "chunk's intact parts); convert the store again from its sources"))
                if key not in told_apart:  # first use: do its windows differ?
                    told_apart[key] = len({source_windows[c].tobytes() for c in matches}) == 1
                ambiguous += not told_apart[key]
                chosen = matches.pop(0)
                used.add(chosen)
                windows[position] = source_windows[chosen]
            left[d] = [c for c in left[d] if c not in used]
        found[index] = windows
    return found, ambiguous


def _match_keys(times: np.ndarray, labels: np.ndarray, gps: np.ndarray | None, imu: np.ndarray | None
                ) -> list[bytes]:
    """Per window, the bytes of what identifies it in a shuffled chunk: time, label, and the
    chunk's intact parts (gps_speed, imu values)."""
    n = len(times)
    parts = [np.asarray(times, "<i8").reshape(n, 1).view(np.uint8),
             np.asarray(labels, "<i8").reshape(n, 1).view(np.uint8)]
    for values in (gps, imu):
        if values is not None:
            parts.append(np.ascontiguousarray(values, "<f4").reshape(n, -1).view(np.uint8))
    return [row.tobytes() for row in np.concatenate(parts, axis=1)]


def _chunk_keys(store: Store, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A shuffled chunk's device ids, times and labels, which identify its windows' source rows."""
    reader = store.reader
    try:
        return (np.asarray(reader.read(DEVICE, index), np.int64), np.asarray(reader.read(TIMESTAMP, index)),
                np.asarray(reader.read(LABEL, index)))
    except ChunkFetchError:
        raise
    except MissingChunkError as exc:
        raise _refusal(store, f"chunk {index} of a shuffled store cannot be rebuilt without its device, "
                              f"timestamp and label chunks, and one of them is damaged too ({exc})") from None


def _chunk_devices(store: Store, start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """``(device, lo, hi, offset)`` for the windows ``[lo, hi)`` of ``[start, stop)``: they are the
    device's windows ``offset ..`` in store order (its ranges, one after another)."""
    parts = []
    for entry in store.device_table:
        offset = 0
        for r in entry.ranges:
            lo, hi = max(r.start, start), min(r.stop, stop)
            if lo < hi:
                parts.append((entry.device_id, lo, hi, offset + lo - r.start))
            offset += r.stop - r.start
    parts.sort(key=lambda p: p[1])
    covered = sum(hi - lo for _, lo, hi, _ in parts)
    if covered != stop - start:
        raise _refusal(store, f"the device table does not account for windows {start:,}..{stop - 1:,} "
                              "exactly (run `birdzarr verify`), so their chunks cannot be rebuilt")
    return parts


def _codes_for(bits: np.ndarray, rows: np.ndarray, dicts: _v2.Dictionaries
               ) -> tuple[np.ndarray, np.ndarray]:
    """uint16 codes (n, 20, 3) of windows' value bits (uint32 (n, 20, 4)) in their rows, and a
    bool (n,) of the windows whose values all lie in their row's dictionaries."""
    n = len(bits)
    codes = np.zeros((n, _v2.WINDOW_LENGTH, _v2.N_CODED), np.uint16)
    held = np.ones(n, bool)
    entries_bits = dicts.values.view(np.uint32)
    sizes = dicts.sizes()
    for r in np.unique(rows).tolist():
        mine = np.flatnonzero(rows == r)
        for c in range(_v2.N_CODED):
            first = int(dicts.start[r, c])
            entries = entries_bits[first : first + int(sizes[r, c])]
            values = bits[mine, :, c]
            if not len(entries):
                held[mine] = False
                continue
            order = np.argsort(entries, kind="stable")
            at = np.minimum(np.searchsorted(entries, values, sorter=order), len(entries) - 1)
            found = order[at]
            held[mine] &= (entries[found] == values).all(axis=1)
            codes[mine, :, c] = found.astype(np.uint16)
    return codes, held


def _choose_rows(store: Store, index: int, bits: np.ndarray, device: np.ndarray, dicts: _v2.Dictionaries,
                 start: int) -> np.ndarray:
    """Each window's row when ``gimu_row`` is lost: the first row of its device that holds all its
    values; a window that no row of its device holds refuses the chunk."""
    rows = np.full(len(bits), -1, np.int64)
    for d in np.unique(device).tolist():
        mine = np.flatnonzero(device == d)
        candidates = np.flatnonzero(dicts.device == d).tolist()
        for r in candidates:
            left = mine[rows[mine] < 0]
            if not len(left):
                break
            _, held = _codes_for(bits[left], np.full(len(left), r, np.int64), dicts)
            rows[left[held]] = r
        lost = mine[rows[mine] < 0]
        if len(lost):
            w = int(lost[0])
            entries_bits = dicts.values.view(np.uint32)
            sizes = dicts.sizes()
            channel, value = 0, 0.0
            for c in range(_v2.N_CODED):  # name one value that the device's rows lack
                pool = (np.concatenate([entries_bits[dicts.start[r, c] : dicts.start[r, c] + sizes[r, c]]
                                        for r in candidates]) if candidates else np.empty(0, np.uint32))
                absent = ~np.isin(bits[w, :, c], pool)
                if absent.any():
                    sample = int(np.flatnonzero(absent)[0])
                    channel, value = c, float(bits[w, sample, c : c + 1].view(np.float32)[0])
                    break
            raise _refusal(store, (
                f"chunk '{_v2.ROW}/c/{index}' cannot be rebuilt: window {start + w:,} of device {d} (from "
                f"the source) holds values that none of the device's {len(candidates)} dictionary row(s) "
                f"holds (first: {_CHANNEL_NAMES[channel]} {value!r}; {len(lost):,} window(s) of this chunk); "
                "the source is not what the store was converted from (check --source), or convert the "
                "store again from its sources"))
    return rows


def _plan_rebuilds(store: Store, given: list[Location]) -> tuple[list[_Rebuild], list[str]]:
    """Every damaged per-window chunk rebuilt in memory from the sources, each checked against the
    checksums recorded at write time; BadInputError (nothing written) where one cannot be. Also
    the notes for the report."""
    from birdzarr.convert._summary import extend_checksum

    if store.format_version < 2:  # its chunks would be written in format 1, which birdzarr reads only
        raise format1_refusal(store.url, "repair --source", store.meta)
    dicts = _dictionaries_or_refuse(store)
    damaged = _damaged_chunks(store, dicts)
    if not damaged:
        return [], []
    notes = []
    reader = store.reader
    spans = {index: reader.chunk_span(index) for index in damaged}
    if store.shuffled:  # the chunk's devices, times and labels say which source window each is
        keys = {index: _chunk_keys(store, index) for index in damaged}
        ids = {int(d) for device, _, _ in keys.values() for d in np.unique(device)}
        sources = _device_rows(store, given, ids)
        shuffled, ambiguous = _shuffled_windows(store, dicts, damaged, keys, sources)
        if ambiguous:
            notes.append(f"{ambiguous:,} rebuilt window(s) could not be told apart from other windows of "
                         "their device by time, label or an intact part (windows of one burst, or a source "
                         "without times): they were placed in source order, so such windows may hold each "
                         "other's place in the shuffled order; the store holds exactly its windows, times "
                         "and labels")
    else:
        layout = {index: _chunk_devices(store, *spans[index]) for index in damaged}
        sources = _device_rows(store, given, {d for parts in layout.values() for d, _, _, _ in parts})
    plans = []
    for index, why in sorted(damaged.items()):
        start, stop = spans[index]
        if store.shuffled:
            device = keys[index][0]
            windows = shuffled[index]
        else:
            windows = np.empty((stop - start, 20, 4), np.float32)
            device = np.empty(stop - start, np.int64)
            times, labels = np.empty(stop - start, np.int64), np.empty(stop - start, np.int64)
            for d, lo, hi, offset in layout[index]:
                windows[lo - start : hi - start] = sources[d][0][offset : offset + hi - lo]
                times[lo - start : hi - start] = sources[d][1][offset : offset + hi - lo]
                labels[lo - start : hi - start] = sources[d][2][offset : offset + hi - lo]
                device[lo - start : hi - start] = d
        bits = windows.view(np.uint32)
        stored_rows = reader.read(_v2.ROW, index) if _v2.ROW not in why else None
        if stored_rows is not None and (dicts.device[stored_rows] != device).any():
            stored_rows = None  # rows of another device: chosen again
            why[_v2.ROW] = "inconsistent"
        rows = (stored_rows.astype(np.int64) if stored_rows is not None
                else _choose_rows(store, index, bits, device, dicts, start))
        codes, held = _codes_for(bits, rows, dicts)
        if not held.all():
            w = int(np.flatnonzero(~held)[0])
            raise _refusal(store, (
                f"chunk '{_v2.CODES}/c/{index}/0/0' cannot be rebuilt: window {start + w:,} of device "
                f"{int(device[w])} (from the source) holds values that its dictionary row {int(rows[w])} "
                f"(from '{_v2.ROW}/c/{index}') lacks; the source is not what the store was converted "
                "from (check --source), or convert the store again from its sources"))
        new = {_v2.CODES: codes, _v2.GPS: np.ascontiguousarray(windows[:, :, 3]),
               _v2.ROW: rows.astype(np.uint32)}
        if not store.shuffled:
            new.update({DEVICE: device, TIMESTAMP: times, LABEL: labels})
        if _v2.CODES not in why and not np.array_equal(reader.read(_v2.CODES, index), codes):
            why[_v2.CODES] = "coded for another row"  # the codes follow the chosen rows
        plans.append(_Rebuild(index, start, stop, windows, {name: new[name] for name in why}, why))
    # the rebuilt windows must be the ones written: every range they touch against its checksum
    # (a shuffled store's devices were checked against their digests as they were derived)
    rebuilt = {plan.index: plan for plan in plans}
    width = reader.chunk_windows
    for entry in store.device_table:
        for r in entry.ranges:
            chunks = range(r.start // width, -(-r.stop // width))
            if not any(index in rebuilt for index in chunks):
                continue
            crc = 0
            for index in chunks:
                start, stop = reader.chunk_span(index)
                whole = rebuilt[index].windows if index in rebuilt else reader.read(GIMU, index)
                crc = extend_checksum(crc, whole[max(r.start, start) - start : min(r.stop, stop) - start])
            if f"{crc:08x}" != r.checksum:
                raise _refusal(store, (
                    f"the windows the source gives for device {entry.device_id}, windows [{r.start:,}, "
                    f"{r.stop:,}) do not match the checksum recorded at write time ({crc:08x}, not "
                    f"{r.checksum}): --source is not what the store was converted from"))
    return plans, notes


def _encode_chunk(location: Location, name: str, index: int, start: int, data: np.ndarray,
                  n_windows: int) -> bytes:
    """The stored bytes of chunk ``index`` of array ``name`` holding ``data`` from window
    ``start``: encoded by zarr-python from the array's own zarr.json (in a scratch directory)."""
    import json
    import tempfile

    import zarr

    meta = read_array_meta(location, name)
    meta = {**meta, "shape": [n_windows, *meta["shape"][1:]]}
    with tempfile.TemporaryDirectory(prefix="birdzarr-repair-") as scratch:
        with open(os.path.join(scratch, "zarr.json"), "w") as f:
            json.dump(meta, f)
        array = zarr.open_array(scratch, mode="r+", zarr_format=3, config={"write_empty_chunks": True})
        array[start : start + len(data)] = data
        key = array.metadata.encode_chunk_key((index, *[0] * (len(meta["shape"]) - 1)))
        with open(os.path.join(scratch, *key.split("/")), "rb") as f:
            return f.read()


def _write_rebuilds(store: Store, plans: list[_Rebuild], report: RepairResult) -> None:
    from birdzarr.maintenance._copy import _write
    from birdzarr.store._handle import open_store

    location = store.location
    for plan in plans:
        for name, data in plan.arrays.items():
            key = f"{name}/" + "/".join(["c", str(plan.index), *["0"] * (data.ndim - 1)])
            encoded = _encode_chunk(location, name, plan.index, plan.start, data, store.n_windows)
            _write(location, key, encoded)
            report.actions.append(f"rebuilt chunk '{key}' ({plan.why[name]}) from the source: windows "
                                  f"{plan.start:,}..{plan.stop - 1:,}")
    reader = open_store(location).reader  # read back: each rebuilt chunk decodes to the source's windows
    for plan in plans:
        back = reader.read(GIMU, plan.index)
        if not np.array_equal(back.view(np.uint32), plan.windows.view(np.uint32)):
            raise CorruptChunkError(f"{store.url}: chunk {plan.index} does not read back as rebuilt; run "
                                    "`birdzarr verify`")
