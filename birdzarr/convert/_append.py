"""Appending new devices, or new parts of existing devices, to a committed store.

The store stays readable throughout: new windows are written past the committed count, and one
final write of the root attributes (committed count, device table, merged report) commits them.

An append runs convert's tasks on convert's engine (``_engine.choose_engine``: this thread,
threads, forked worker processes where they pay, or the Dask cluster behind ``client``), so the
stored bytes are the same on every engine: Parquet devices as segments placed after the committed
windows (``_segments.py``; the chunk the commit ends inside is written again, its committed
windows with the new ones; an extended device continues its committed dictionary row, format 2,
and its duplicate-check keys come back to be compared with its committed windows here), CSV
devices part by part (``_pipeline.py``), written here in store order.
A killed append leaves the previous commit in place; the next append (or ``birdzarr repair``)
first cuts the arrays back to the committed count.

Idempotence: a source file is identified by its file name within its device. Files already in a
device's ``sources`` are skipped, so re-running an interrupted or finished append adds exactly
what is missing and nothing twice.

CSV bursts continue across an append. A CSV store in device order records, at each commit, the
rows of each device's unfinished last burst (``csv_tails``: fewer than 20 rows a device, the
float64 values as parsed); an append hands them to the device's first new part, so a burst split
between a committed part and a new one forms the windows one conversion of all the parts would.
A store written before that record existed (or a new part numbered before a stored part of its
device) continues nothing: such a burst loses its remainder rows, as at the end of any export.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import numpy as np
import zarr

from birdzarr._checks import require_bool
from birdzarr._errors import AppendError, ArgumentError, IncompleteStoreError, SkippedFilesWarning
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._cpus import cpu_report, cpu_seconds, resolve_workers
from birdzarr.convert._csv import tail_from_json, tail_to_json
from birdzarr.convert._duplicates import DuplicateCounter
from birdzarr.convert._engine import Engine, choose_engine, processes_pay
from birdzarr.convert._input import split_suffix
from birdzarr.convert._memory import arrow_pool
from birdzarr.convert._pipeline import Hashes, write_csv_devices
from birdzarr.convert._segments import (
    AppendTo,
    Continuation,
    Segment,
    SharedChunkPart,
    convert_segments,
    count_devices,
    input_bytes,
    plan_segments,
)
from birdzarr.convert._slabs import writable_arrays
from birdzarr.convert._sources import DeviceSource, file_name, find_inputs
from birdzarr.convert._summary import DeviceSummary, merge_entries
from birdzarr.convert._writer import CSV_TAILS, Writer, _now, csv_tails_record
from birdzarr.format import _v2
from birdzarr.format._digest import window_hashes
from birdzarr.format._rows import RowCoder, latest_rows
from birdzarr.format._spec import (
    FORMAT_VERSION,
    GIMU,
    TIMESTAMP,
    Curation,
    DeviceEntry,
    DeviceReport,
    check_root_attrs,
    format1_refusal,
)
from birdzarr.storage._location import Location, StoreLike, resolve, zarr_store
from birdzarr.store._device_table import merged
from birdzarr.store._tail import discard_format2_leftovers, discard_uncommitted

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from birdzarr.convert._csv import _Rows
    from birdzarr.store._handle import Store

_PIECE = 65536  # committed windows read at a time when looking for duplicates


def store_curation(meta: dict[str, Any]) -> Curation:
    """The curation a store was converted with (CSV input), so appends curate the same way."""
    raw = meta.get("curation", {})
    if raw.get("applied_by") != "birdzarr":
        return Curation()
    low, high = raw["clip"]
    return Curation(speed_limit=float(raw["speed_limit"]), clip_min=float(low), clip_max=float(high),
                    gps_scale=float(raw["gps_scale"]))


class AppendWriter(Writer):
    """A ``Writer`` that opens a committed store and writes past its committed count."""

    def __init__(
        self, location: Location, *, lock_command: str | None = None, workers: int | None = None
    ) -> None:
        super().__init__(location, lock_command=lock_command, workers=workers)
        self.meta: dict[str, Any] = {}  # the root attributes of the commit appended to
        self.previous_windows = 0  # its committed count
        self.cleaned: list[str] = []  # what an interrupted write had left past it, removed first
        self.appended: dict[int, list[str]] = {}  # device -> the source files appended
        # CSV: the committed unfinished bursts (``csv_tails``) as JSON, and the devices whose
        # tail is not known (committed before stores recorded it)
        self.stored_tails: dict[int, dict[str, Any] | None] = {}
        self.unknown_tails: set[int] = set()
        self.continued: dict[int, int] = {}  # device -> rows of a committed burst continued
        self.window_arrays: tuple[str, ...] = ()  # the store's per-window arrays
        self.committed_format2: dict[str, Any] | None = None  # format 2: the commit record appended to
        self.committed_rows = _v2.Dictionaries.empty()  # format 2: its dictionary rows

    def _open(self) -> tuple[dict[str, Any], int]:
        from birdzarr.storage._root import read_root as _read_root

        # with a format-2 store's device table put back (store/_device_table.py)
        meta = merged(self.location, check_root_attrs(_read_root(self.location), where=self.location.display))
        committed = meta.get("committed")
        if not committed:
            raise IncompleteStoreError(
                f"{self.location.display}: a conversion started here and never committed, so there "
                "is nothing to append to. Re-run the same `birdzarr convert` command first."
            )
        if meta.get("format_version") != FORMAT_VERSION:
            raise format1_refusal(self.location.display, "append", meta)
        if meta.get("layout", {}).get("shuffled"):
            raise AppendError(
                f"{self.location.display} was converted with --shuffle; appended windows would sit "
                "unshuffled at the end. Convert all sources again with --shuffle instead."
            )
        self.meta = meta
        self.previous_windows = int(committed["n_windows"])
        group = zarr.open_group(zarr_store(self.location, read_only=False), mode="r+", zarr_format=3)
        arrays = writable_arrays(group)
        self.window_arrays = tuple(arrays)
        self.cleaned = discard_uncommitted(self.location, group, self.previous_windows, self.window_arrays)
        # opened again: the cut changed their shapes on disk, and a writer that still took them for
        # a killed run's would not grow them back (the commit's arrays kept the committed length)
        arrays = writable_arrays(group)
        # new windows reuse or extend the committed dictionary rows
        self.cleaned += discard_format2_leftovers(self.location, group, committed)
        self.committed_rows = read_dictionary(group, committed_dictionary(committed, group))
        self.coder = RowCoder.appending_to(self.committed_rows)
        self.committed_format2 = committed
        self.group = group  # from here on, a failure cuts the arrays back again (_abandon)
        self.devices = {e.device_id: e for e in (DeviceEntry.from_json(d) for d in meta.get("devices", []))}
        report = meta.get("report", {}).get("devices", {})
        self.reports = {int(k): DeviceReport.from_json(v) for k, v in report.items()}
        self._read_tails(meta)
        return arrays, self.previous_windows

    def _read_tails(self, meta: dict[str, Any]) -> None:
        if meta.get("source_kind") != "csv":
            return
        record = meta.get(CSV_TAILS)
        if not isinstance(record, dict):  # a store from before the record: no tail is known
            self.unknown_tails = set(self.devices)
            return
        self.unknown_tails = {int(d) for d in record.get("unknown", [])}
        stored = record.get("devices", {})
        self.stored_tails = {d: stored.get(str(d)) for d in self.devices if d not in self.unknown_tails}

    def carry(self, device_id: int, files: list[str]) -> _Rows | None:
        """The committed unfinished burst that ``files`` (a device's new parts) continue; None
        when there is none, or it is not known, or a new part is numbered before a stored one."""
        raw = self.stored_tails.get(device_id)
        if raw is None:
            return None
        stored = _part_numbers(self.devices[device_id].sources)
        new = _part_numbers(files)
        if stored is None or new is None or min(new) <= max(stored, default=-1):
            return None
        try:
            return tail_from_json(device_id, raw)
        except ValueError as exc:
            raise AppendError(
                f"{self.location.display}: the root attribute '{CSV_TAILS}' is damaged: {exc}. "
                "Restore the store's zarr.json from a copy, or convert all sources again."
            ) from None

    def _abandon(self) -> None:
        """A failed append leaves its previous commit exactly as it was, leftovers removed."""
        if self.group is not None:
            # the append's own error is the one to report; `birdzarr repair` can finish this
            with contextlib.suppress(Exception):
                discard_uncommitted(self.location, self.group, self.previous_windows, self.window_arrays)
                if self.committed_format2 is not None:  # the rows and table group it wrote
                    discard_format2_leftovers(self.location, self.group, self.committed_format2)

    def write_device(self, device_id: int, blocks: Iterable[WindowBlock], sources: list[str],
                     continued: int = 0) -> DeviceReport:
        """Write one device's new windows as a new range; merge its table entry and report.
        ``continued``: rows of its committed unfinished burst that the blocks continued."""
        self._refuse_twice(device_id)
        summary = self._write(device_id, blocks, sources)
        self.record(summary, continued)
        return summary.report

    def record(self, summary: DeviceSummary, continued: int = 0) -> None:
        """Merge a device's new windows (written here or by tasks) into its table entry and
        report (``write_device``)."""
        device_id = summary.entry.device_id
        self._refuse_twice(device_id)
        self.appended[device_id] = list(summary.entry.sources)
        self.tails[device_id] = summary.tail
        if continued:
            self.continued[device_id] = continued
        previous = self.devices.get(device_id)
        entry = summary.entry
        self.devices[device_id] = entry if previous is None else merge_entries(previous, entry)
        previous_report = self.reports.get(device_id)
        if previous_report is None:
            self.reports[device_id] = summary.report
        else:
            merged = DeviceReport.from_json(previous_report.to_json())
            if continued:  # counted as remainder rows at the last commit, counted again now
                left = merged.dropped.get("remainder_rows", 0) - continued
                merged.dropped.pop("remainder_rows", None)
                merged.drop("remainder_rows", left)
            merged.merge(summary.report)
            self.reports[device_id] = merged

    def _refuse_twice(self, device_id: int) -> None:
        if device_id in self.appended:
            raise AppendError(f"device {device_id} was given twice in one append")

    def committed_part(self) -> SharedChunkPart | None:
        """The committed windows of the chunk the first appended window falls in (None when the
        commit ends on a chunk boundary): tasks write whole chunks, so that chunk is written
        again, its committed windows with the new ones (``_segments.AppendTo``)."""
        chunk_windows = self.slabs.chunk_windows
        chunk, inside = divmod(self.previous_windows, chunk_windows)
        if not inside:
            return None
        start = chunk * chunk_windows
        data = {name: np.asarray(array[start : self.previous_windows])
                for name, array in self.slabs.arrays.items()}
        return SharedChunkPart(chunk, start, data)

    def _committed_attrs(self, extra_report: dict[str, Any] | None) -> dict[str, Any]:
        """The appended windows become visible as generation + 1."""
        meta = dict(self.meta)
        previous = meta["committed"]
        report = dict(meta.get("report", {}))
        report.pop("devices", None)  # the device table: _write_device_table, from the objects
        report["appends"] = [*report.get("appends", []), {
            "started_at": self.started_at,
            "finished_at": _now(),
            "first_window": self.previous_windows,
            "windows": self.n_windows - self.previous_windows,
            "files": {str(d): files for d, files in sorted(self.appended.items())},
            "converter_version": _version(),
            **({"continued_rows": {str(d): n for d, n in sorted(self.continued.items())}}
               if self.continued else {}),
            **(extra_report or {}),
        }]
        if meta.get("source_kind") == "csv":
            known = dict(self.stored_tails)
            unknown = set(self.unknown_tails)
            for device, tail in self.tails.items():
                if tail is None:
                    unknown.add(device)
                    known.pop(device, None)
                else:
                    known[device] = tail_to_json(tail)
                    unknown.discard(device)
            meta[CSV_TAILS] = csv_tails_record(known, unknown)
        meta["committed"] = {
            "n_windows": self.n_windows,
            "generation": int(previous.get("generation", 1)) + 1,
            "committed_at": _now(),
        }
        meta.pop("devices", None)
        meta["report"] = report
        return meta


def committed_dictionary(committed: dict[str, Any], group: Any) -> tuple[int, int]:
    """Format 2: the dictionary rows and entries the commit counts (the arrays' lengths where
    the commit does not say: none longer can exist, every writer records them)."""
    recorded = committed.get("dictionary") or {}
    rows = recorded.get("rows", group[_v2.DEVICE].shape[0])
    values = recorded.get("values", group[_v2.VALUES].shape[0])
    return int(rows), int(values)


def read_dictionary(group: Any, committed: tuple[int, int]) -> _v2.Dictionaries:
    """Format 2: the committed dictionary arrays."""
    rows, values = committed
    return _v2.Dictionaries(group[_v2.VALUES][:values], group[_v2.START][:rows], group[_v2.DEVICE][:rows])


def _version() -> str:
    from birdzarr._version import __version__

    return __version__


def _part_numbers(names: list[str]) -> list[int] | None:
    """The part numbers of ``{device}_{part}.csv`` names; None if one has none."""
    numbers = []
    for name in names:
        stem = (split_suffix(name) or (name, ""))[0]
        device, _, part = stem.rpartition("_")
        if not (device.isdigit() and part.isdigit()):
            return None
        numbers.append(int(part))
    return numbers


@dataclass
class AppendResult:
    """What an append did: windows added, devices touched, files skipped as already present."""

    store: Store
    windows_added: int = 0
    devices_added: list[int] = field(default_factory=list)
    devices_extended: list[int] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    cleaned: list[str] = field(default_factory=list)
    duplicate_windows: dict[int, int] = field(default_factory=dict)  # device -> repeated windows
    unknown_files: list[str] = field(default_factory=list)  # not input files, skipped on request

    def skipped_line(self) -> str | None:
        """The files skipped as already in the store, in one line (the CLI prints it, ``append``
        warns with it); None if none was."""
        if not self.skipped_files:
            return None
        shown = ", ".join(self.skipped_files[:10]) + (" ..." if len(self.skipped_files) > 10 else "")
        return (f"{len(self.skipped_files)} file(s) skipped, already in the store by name within their "
                f"device: {shown}. New data for an existing device needs a new file name.")

    def format(self) -> str:
        """What the append did, as ``birdzarr append`` prints it (``str(result)`` is the same)."""
        lines = [f"appended {self.windows_added:,} windows: {len(self.devices_added)} new device(s), "
                 f"{len(self.devices_extended)} extended"]
        if self.skipped_files:
            lines.append(f"skipped {len(self.skipped_files)} file(s) already in the store")
        if self.unknown_files:
            names = ", ".join(self.unknown_files[:10])
            lines.append(f"skipped {len(self.unknown_files)} source entries that are not input files "
                         f"(--skip-unknown-files): {names}")
        if self.duplicate_windows:
            lines.append(f"duplicate windows (kept): {sum(self.duplicate_windows.values()):,} in "
                         f"device(s) {sorted(self.duplicate_windows)[:10]}")
        lines += [f"cleaned up first: {c}" for c in self.cleaned]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def plan_append(
    devices: list[DeviceSource], table: dict[int, DeviceEntry]
) -> tuple[list[DeviceSource], list[str]]:
    """Keep only the source files not already in the store; returns (work, skipped file names)."""
    work, skipped = [], []
    for device in devices:
        known = set(table[device.device_id].sources) if device.device_id in table else set()
        fresh = [f for f in device.files if file_name(f) not in known]
        skipped += [file_name(f) for f in device.files if file_name(f) in known]
        if len(fresh) == len(device.files):
            work.append(device)  # as found: its rows in partition files counted
        elif fresh:  # rows in its remaining partition files not known: counted by reading them
            work.append(DeviceSource(device.device_id, device.kind, fresh,
                                     partition_rows=None if device.partition_rows else 0))
    return work, skipped


def append_detailed(
    store: StoreLike,
    source: StoreLike,
    *,
    on_bad_rows: str = "error",
    workers: int | None = None,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    source_storage_options: dict[str, Any] | None = None,
    skip_unknown_files: bool = False,
    client: Any = None,
) -> AppendResult:
    """``append``, returning what was done as well as the store."""
    from birdzarr._progress import progress_bar
    from birdzarr.convert import ON_BAD_ROWS, _freeing_group_cache, _require_client
    from birdzarr.store._handle import open_store

    # before anything is read or written: a truthy non-bool ("no") must not act as True
    progress = require_bool("progress", progress)
    skip_unknown_files = require_bool("skip_unknown_files", skip_unknown_files)
    if on_bad_rows not in ON_BAD_ROWS:
        raise ArgumentError(f"on_bad_rows must be one of {ON_BAD_ROWS}, got {on_bad_rows!r}")
    workers = resolve_workers(workers)
    if client is not None:
        _require_client(client)
    src = resolve(source, source_storage_options)
    dst = resolve(store, storage_options)
    before = open_store(dst)  # a clear error (not a store, unfinished, newer format) before the lock
    if before.format_version != FORMAT_VERSION:  # format 1 is read, never written
        raise format1_refusal(dst.display, "append", before.meta)
    inputs = find_inputs(src, skip_unknown_files=skip_unknown_files)
    kind, devices = inputs.kind, inputs.devices
    started, cpu_before = time.perf_counter(), cpu_seconds()
    threads = zarr.config.set({"threading.max_workers": workers})
    with arrow_pool(), threads, _freeing_group_cache(), DuplicateCounter() as duplicates, \
            AppendWriter(dst, lock_command=f"birdzarr append {src.display}", workers=workers) as writer:
        if kind != writer.meta.get("source_kind"):
            raise AppendError(
                f"{dst.display} was converted from {writer.meta.get('source_kind')} input and "
                f"{src.display} holds {kind} files; append sources of the same kind, or convert "
                "everything again into a new store."
            )
        curation = store_curation(writer.meta)
        work, skipped = plan_append(devices, writer.devices)
        committed = dict(writer.devices)  # the commit's device table, before any device is merged
        extended = [d.device_id for d in work if d.device_id in committed]
        added = [d.device_id for d in work if d.device_id not in committed]

        def existing(device_id: int) -> Hashes | None:
            entry = committed.get(device_id)
            return None if entry is None else _committed_hashes(before, entry)

        # the one choice, as convert makes it: a Dask cluster, worker processes or threads
        processes = client is None and processes_pay(input_bytes(work), workers=workers,
                                                     dest_shared=dst.shared_between_processes)
        facts: dict[str, Any] = {}
        with progress_bar(progress and bool(work), desc=f"append {kind}" + (" on dask" if client else ""),
                          unit=" windows") as bar, \
                choose_engine(client, processes=processes, workers=workers) as engine:
            if kind == "csv":  # each device's first new part continues its committed last burst
                carries = {d.device_id: carry for d in work
                           if (carry := writer.carry(d.device_id, d.source_names())) is not None}
                write_csv_devices(engine, writer, work, curation=curation, on_bad_rows=on_bad_rows,
                                  duplicates=duplicates, bar=bar, carries=carries, existing=existing)
            elif work:
                facts = _append_segments(engine, writer, work, dest=dst, curation=curation,
                                         on_bad_rows=on_bad_rows, duplicates=duplicates, bar=bar,
                                         existing=existing)
            facts.update(engine.facts)
        if work:
            writer.slabs.drain()  # the last slabs written before the clock stops
            seconds = round(time.perf_counter() - started, 3)
            extra: dict[str, Any] = {"source": src.display, "seconds": seconds, "skipped_files": len(skipped),
                                     **facts}
            if client is None:  # a cluster's CPU is its workers', which this process does not see
                extra.update(cpu_report(seconds, cpu_before, workers))
            if duplicates.counts:
                extra["duplicate_windows"] = duplicates.report()
            if inputs.skipped:
                extra["skipped_unknown_files"] = inputs.skipped
            writer.commit(extra)
        windows_added = writer.n_windows - writer.previous_windows
        cleaned = writer.cleaned
    duplicates.warn(dst.display)
    return AppendResult(open_store(dst), windows_added, added, extended, skipped, cleaned,
                        duplicate_windows=dict(duplicates.counts), unknown_files=inputs.skipped)


def _append_segments(engine: Engine, writer: AppendWriter, work: list[DeviceSource], *, dest: Location,
                     curation: Curation, on_bad_rows: str, duplicates: DuplicateCounter, bar: Any,
                     existing: Callable[[int], Hashes | None]) -> dict[str, Any]:
    """Parquet devices appended as convert writes them (``_segments.py``): counted, cut into
    segments that follow the committed windows, each converted by a task on ``engine``. A
    segment's extended devices continue their committed dictionary rows (format 2) and are
    checked for duplicates against their committed windows here. Facts for the report."""
    counts = count_devices(work, curation=curation, on_bad_rows=on_bad_rows, engine=engine)
    extended = {d.device_id for d in work} & set(writer.devices)
    plan = plan_segments(work, counts, workers=engine.width, chunk_windows=writer.slabs.chunk_windows,
                         first=writer.previous_windows, alone=extended)
    rows = writer.committed_rows
    latest = latest_rows(rows, extended) if writer.coder is not None else {}

    def continuation(segment: Segment) -> Continuation:
        mine = {device.device_id for device, _, _ in segment.devices}
        return Continuation(first_row=rows.n_rows,
                            rows={d: latest[d] for d in sorted(mine & set(latest))},
                            extended=frozenset(mine & extended))

    append = AppendTo(committed=writer.previous_windows, shared=writer.committed_part(),
                      first_row=rows.n_rows, values=len(rows.values), existing=existing)
    return convert_segments(engine, writer, plan, curation=curation, on_bad_rows=on_bad_rows, dest=dest,
                            duplicates=duplicates, bar=bar, append=append, continuation=continuation)


def _committed_hashes(store: Store, entry: DeviceEntry) -> Hashes:
    """For an appended device: the hashes of its committed windows whose time is among the new
    windows' times. Only timestamps are read unless times coincide (they do not, for new data),
    so an ordinary append reads 8 bytes per committed window of the device."""

    def hashes(times: np.ndarray) -> np.ndarray:
        reader, found = store.reader, []
        for r in entry.ranges:
            for lo in range(r.start, r.stop, _PIECE):
                hi = min(lo + _PIECE, r.stop)
                stamps = reader.read_range(TIMESTAMP, lo, hi)
                match = np.isin(stamps, times)
                if match.any():
                    windows = reader.read_range(GIMU, lo, hi)
                    found.append(window_hashes(windows[match], stamps[match]))
        return np.concatenate(found) if found else np.empty(0, np.uint64)

    return hashes


class AppendOptions(TypedDict, total=False):
    """The keyword options of ``append`` (those of ``convert`` that apply to an append)."""

    on_bad_rows: str
    workers: int | None
    progress: bool
    storage_options: dict[str, Any] | None
    source_storage_options: dict[str, Any] | None
    skip_unknown_files: bool
    client: Any


def append(store: StoreLike, source: StoreLike, **options: Unpack[AppendOptions]) -> Store:
    """Add the windows of ``source`` (new devices, or new CSV parts of existing ones) to ``store``.

    Same curation (the store's recorded parameters), validation and options as
    ``birdzarr.convert``: ``on_bad_rows``, ``workers``, ``progress``, ``storage_options``,
    ``source_storage_options``, ``skip_unknown_files``, ``client`` (an unknown option is a
    ``TypeError``). The new windows are read and written by the tasks convert runs, on the same
    engine (threads, worker processes, or the Dask cluster behind ``client``).
    Files already in the store are skipped, so re-running an interrupted append completes it;
    a ``SkippedFilesWarning`` names them (a file is identified by its name within its device).
    Returns the store, opened read-only, at its new commit.
    """
    result = append_detailed(store, source, **options)
    if (skipped := result.skipped_line()) is not None:
        warnings.warn(SkippedFilesWarning(skipped), stacklevel=2)
    return result.store
