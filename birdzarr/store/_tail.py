"""What lies past a store's committed count, and cutting it away.

A writer resizes arrays before writing their data and commits the window count last, so a killed
convert or append can leave longer arrays, chunk files past the last committed chunk and partial
temp files. ``append`` discards them before it writes; ``repair`` reports and removes them;
``verify`` names them.
"""

from __future__ import annotations

from typing import Any

from birdzarr.format import _device_table, _v2
from birdzarr.format._spec import GIMU, PER_WINDOW_ARRAYS
from birdzarr.storage._location import Location
from birdzarr.storage._lock import read_holder
from birdzarr.store._chunks import read_array_meta

ARRAYS = (GIMU, *PER_WINDOW_ARRAYS)  # format 1's per-window arrays
ARRAYS_V2 = (_v2.CODES, _v2.GPS, _v2.ROW, *PER_WINDOW_ARRAYS)  # format 2's
_TEMP_SUFFIXES = (".partial", ".broken", ".tmp", ".breaking")


def _found_arrays(location: Location, arrays: tuple[str, ...] | None) -> tuple[str, ...]:
    """``arrays`` as given, or the per-window arrays of the store's format (format 2 where it
    holds ``gimu_codes``)."""
    if arrays is not None:
        return arrays
    return ARRAYS_V2 if location.fs.exists(location.join(_v2.CODES, "zarr.json")) else ARRAYS


def _chunk_indices(location: Location, name: str) -> list[tuple[int, str]]:
    """(chunk index along windows, path) of every chunk file of one array (default "/" keys)."""
    fs, root = location.fs, location.join(name, "c")
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        tail = entry.rstrip("/").rsplit("/", 1)[-1]
        if tail.isdigit():
            found.append((int(tail), entry))
    return found


def leftovers(location: Location, n_windows: int, arrays: tuple[str, ...] | None = None) -> list[str]:
    """Describe uncommitted leftovers without changing anything (verify reports these as notes).
    ``arrays``: the store's per-window arrays (default: those of its format, ``ARRAYS`` or
    ``ARRAYS_V2``)."""
    found = []
    for name in _found_arrays(location, arrays):
        meta = read_array_meta(location, name)  # damaged or missing: the readers' one-line error
        length = int(meta["shape"][0])
        if length > n_windows:  # shorter is damage, not a leftover: ``short_arrays``
            found.append(f"array '{name}' has shape {length:,} along windows; {n_windows:,} are committed")
        chunk = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
        n_chunks = -(-n_windows // chunk)
        extra = [path for index, path in _chunk_indices(location, name) if index >= n_chunks]
        if extra:
            found.append(f"array '{name}' has {len(extra)} chunk file(s) past the committed windows")
    temps = _temp_files(location)
    if temps:
        found.append(f"{len(temps)} partial temp file(s) of an interrupted write")
    holder = read_holder(location)
    if holder is not None and holder.is_stale():
        found.append(f"a stale lock left by {holder.describe()}")
    return found


def short_arrays(location: Location, n_windows: int, arrays: tuple[str, ...] | None = None
                 ) -> list[tuple[str, int]]:
    """(name, length) of each per-window array (``arrays``, as for ``leftovers``) shorter than the
    committed count: readers of the Zarr arrays (zarr-python, TensorStore) miss its last windows."""
    found = []
    for name in _found_arrays(location, arrays):
        length = int(read_array_meta(location, name)["shape"][0])
        if length < n_windows:
            found.append((name, length))
    return found


def _temp_files(location: Location) -> list[str]:
    if not location.is_local:
        return []  # object stores have no temp files: a PUT is all or nothing
    return [p for p in location.fs.find(location.path) if p.endswith(_TEMP_SUFFIXES)]


def discard_uncommitted(location: Location, group: Any, n_windows: int,
                        arrays: tuple[str, ...] | None = None) -> list[str]:
    """Cut every per-window array (``arrays``, as for ``leftovers``) back to the committed count
    and delete what lies past it.

    ``group`` is the store's zarr group opened for writing; the caller holds the lock.
    """
    actions = []
    for name in _found_arrays(location, arrays):
        array = group[name]
        length = int(array.shape[0])
        if length != n_windows:
            # zarr deletes the chunks that fall wholly outside the new shape
            array.resize((n_windows, *array.shape[1:]))
            actions.append(f"resized '{name}' from {length:,} to the committed {n_windows:,} windows")
        chunk = int(array.chunks[0])
        n_chunks = -(-n_windows // chunk)
        extra = [path for index, path in _chunk_indices(location, name) if index >= n_chunks]
        for path in extra:
            location.fs.rm(path, recursive=True)
        if extra:
            actions.append(f"deleted {len(extra)} chunk file(s) of '{name}' past the committed windows")
    temps = _temp_files(location)
    for path in temps:
        location.fs.rm_file(path)
    if temps:
        actions.append(f"deleted {len(temps)} partial temp file(s)")
    return actions


def format2_leftovers(location: Location, committed: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    """What an interrupted format-2 writer leaves beyond the per-window arrays: dictionary
    arrays longer than the commit counts (``("array", name, length, committed)``) and device
    table groups other than the committed generation's and the one before it
    (``("table", key, 0, 0)``, see ``kept_tables``)."""
    found: list[tuple[str, str, int, int]] = []
    counted = committed.get("dictionary") or {}
    for name, key in ((_v2.VALUES, "values"), (_v2.START, "rows"), (_v2.DEVICE, "rows")):
        if key in counted:
            length = int(read_array_meta(location, name)["shape"][0])
            if length > int(counted[key]):
                found.append(("array", name, length, int(counted[key])))
    keep = committed.get("device_table")
    if not keep:
        return found
    try:
        entries = location.fs.ls(location.join(_device_table.GROUP), detail=False)
    except (FileNotFoundError, OSError):
        entries = []
    names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)
    generations = [int(name) for name in names if name.isdigit()]
    kept = kept_tables(str(keep), generations)
    found += [("table", _device_table.path(g), 0, 0) for g in sorted(generations) if g not in kept]
    return found


def kept_tables(committed_table: str, generations: list[int]) -> set[int]:
    """The device table generations a store keeps: the committed one, and the highest below it
    (the table the last commit replaced). A reader that opened the root just before a commit
    reads its table later, lazily; keeping the replaced table until the next commit lets it
    finish instead of finding its table gone. Any other group (older, or a killed commit's
    newer one) is a leftover."""
    name = committed_table.rsplit("/", 1)[-1]
    if not name.isdigit():  # not a root this library wrote: remove nothing
        return set(generations)
    current = int(name)
    older = [g for g in generations if g < current]
    return {current, *([max(older)] if older else [])}


def describe_leftover(kind: str, name: str, length: int, committed: int) -> str:
    if kind == "table":
        return f"device table group '{name}' is neither the committed generation's nor the one it replaced"
    unit = "entries" if name == _v2.VALUES else "rows"
    return f"array '{name}' holds {length:,} {unit}; the commit counts {committed:,}"


def discard_format2_leftovers(location: Location, group: Any, committed: dict[str, Any]) -> list[str]:
    """Cut the dictionary arrays back to the lengths the commit counts and remove the device
    table groups ``kept_tables`` does not keep (what an interrupted append or commit leaves, and
    the tables older than the one the last commit replaced)."""
    actions = []
    for kind, name, length, counted in format2_leftovers(location, committed):
        if kind == "array":
            array = group[name]
            array.resize((counted, *array.shape[1:]))  # zarr deletes the chunks wholly outside
            unit = "entries" if name == _v2.VALUES else "rows"
            actions.append(f"resized '{name}' from {length:,} to the committed {counted:,} {unit}")
        else:
            location.fs.rm(location.join(name), recursive=True)
            actions.append(f"removed '{name}', a device table the commit does not name")
    return actions
