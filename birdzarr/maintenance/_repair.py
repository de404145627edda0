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

Repair never touches a window below the committed count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from birdzarr._checks import require_bool
from birdzarr._errors import NotAStoreError, StoreLockedError
from birdzarr.format._spec import check_root_attrs
from birdzarr.storage._location import Location, StoreLike, resolve, zarr_store
from birdzarr.storage._lock import StoreLock, clear_except_lock, read_holder
from birdzarr.storage._lock import break_lock as _break_lock
from birdzarr.storage._root import parse_root
from birdzarr.store._chunks import read_array_meta
from birdzarr.store._tail import ARRAYS, discard_uncommitted


@dataclass
class RepairReport:
    """What repair found and did."""

    url: str
    committed_windows: int | None = None
    actions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # found, not changed: for the user to decide

    def format(self) -> str:
        head = f"{self.url}: "
        if self.committed_windows is None:
            head += "no committed store"
        else:
            head += f"{self.committed_windows:,} committed windows kept"
        notes = "".join(f"\nnote: {n}" for n in self.notes)
        if not self.actions:
            return head + "; nothing to repair." + notes
        return head + "\n" + "\n".join(f"  - {a}" for a in self.actions) + notes


def repair(
    store: StoreLike, *, break_lock: bool = False, storage_options: dict[str, Any] | None = None
) -> RepairReport:
    """Remove uncommitted leftovers; a live writer's lock is respected unless ``break_lock``
    (the CLI's ``--break-lock``)."""
    import zarr

    # break_lock="no" must not break a live writer's lock
    break_lock = require_bool("break_lock", break_lock)
    location = resolve(store, storage_options)
    report = RepairReport(url=location.display)
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
            for name in ARRAYS:
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
        n_windows = int(committed["n_windows"])
        report.committed_windows = n_windows
        group = zarr.open_group(zarr_store(location, read_only=False), mode="r+", zarr_format=3)
        report.actions += discard_uncommitted(location, group, n_windows)
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

