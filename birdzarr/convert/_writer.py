"""Writing a store: arrays first, the commit (root attributes) last.

A store whose root attributes lack ``committed`` is an unfinished conversion; readers refuse it
and a new conversion replaces it. Windows are written in whole-chunk slabs (``_slabs.py``),
encoded on a thread pool while the caller parses the next input.

``Writer`` is what every writer of a store does. ``StoreWriter`` creates a new store;
``AppendWriter`` (``_append.py``) extends a committed one. They differ only in three hooks: how
the destination is opened, what the commit writes, and how a failure is undone.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Iterable
from typing import Any, Self

import numpy as np
import zarr

from birdzarr._errors import NotAStoreError, StoreExistsError
from birdzarr._version import __version__
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._cpus import resolve_workers
from birdzarr.convert._csv import tail_to_json
from birdzarr.convert._slabs import EVERY_CHUNK, SlabWriter
from birdzarr.convert._summary import DeviceSummary, Summarizer, column_summaries
from birdzarr.format import _device_table as device_table
from birdzarr.format import _v2
from birdzarr.format._codec import per_window_codecs
from birdzarr.format._device_columns import DeviceColumns
from birdzarr.format._rows import RowCoder
from birdzarr.format._spec import (
    ATTRS_KEY,
    CHANNELS,
    DEVICE,
    FORMAT_VERSION,
    LABEL,
    LABEL_UNLABELLED,
    TIMESTAMP,
    TIMESTAMP_UNKNOWN,
    WINDOW_LENGTH,
    DeviceEntry,
    DeviceReport,
    array_attributes,
    label_totals,
    report_totals,
)
from birdzarr.storage._location import Location, exists, write_json, zarr_store
from birdzarr.storage._lock import LOCK_NAME, StoreLock, clear_except_lock, release_and_tidy
from birdzarr.store._tail import discard_format2_leftovers

_PER_WINDOW_DTYPES = {DEVICE: np.int32, TIMESTAMP: np.int64, LABEL: np.int32}
_FILL = {DEVICE: -1, TIMESTAMP: TIMESTAMP_UNKNOWN, LABEL: LABEL_UNLABELLED}
SLABS_IN_FLIGHT = 2  # slabs encoded on background threads while the next one fills (docs/conversion.md)


def _array(group: zarr.Group, name: str) -> zarr.Array:
    node = group[name]
    if not isinstance(node, zarr.Array):
        raise NotAStoreError(f"'{name}' in the store is a group, not an array")
    return node


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class Writer:
    """A context manager that holds a store's lock, writes devices through one ``SlabWriter``,
    keeps the device table and report, and commits once, last.

    Subclasses fill in the hooks: ``_open`` (the destination's group and arrays, and the first
    window to write), ``_committed_attrs`` (the root attributes of the commit) and ``_abandon``
    (undo an uncommitted write).
    """

    def __init__(
        self,
        location: Location,
        *,
        lock_command: str | None = None,
        workers: int | None = None,
    ) -> None:
        # encoding threads of the fast write path (default: all usable cores); 1: everything is
        # encoded in the calling thread, one chunk after another
        self.workers = resolve_workers(workers)
        self.location = location
        self.lock = StoreLock(location, lock_command)  # one writer per store (birdzarr/storage/_lock.py)
        self.devices: dict[int, DeviceEntry] = {}
        self.reports: dict[int, DeviceReport] = {}
        # CSV: each device's unfinished last burst (rows, maybe none); None where it is unknown
        self.tails: dict[int, Any] = {}
        # devices recorded as columns (``record_runs``), beside ``devices`` and ``reports``
        self.runs: list[DeviceColumns] = []
        self.started_at = _now()
        self.group: zarr.Group | None = None  # set by _open as soon as it is open
        self._slabs: SlabWriter | None = None
        # format 2: codes the windows this process writes; its rows, and those coded elsewhere
        # (worker processes, Dask tasks: ``add_rows``), are stored at the commit
        self.coder: RowCoder | None = None
        self._rows_from_elsewhere: list[_v2.Dictionaries] = []
        self._committed = False
        self._created = False  # this writer created the store: a failed write removes its root too

    # -- hooks -----------------------------------------------------------------------------------
    def _open(self) -> tuple[dict[str, Any], int]:
        """Open the destination (setting ``self.group``, and ``self.coder`` for format 2); its
        per-window arrays and the first window to write."""
        raise NotImplementedError

    def _committed_attrs(self, extra_report: dict[str, Any] | None) -> dict[str, Any]:
        """The root attributes that commit what was written."""
        raise NotImplementedError

    def _abandon(self) -> None:
        """Undo an uncommitted write, under the lock (also after a failed ``_open``)."""
        raise NotImplementedError

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.lock.acquire()
        try:
            arrays, start = self._open()
            # workers=1: slabs are written in the calling thread too, one at a time
            in_flight = 0 if self.workers == 1 else SLABS_IN_FLIGHT
            self._slabs = SlabWriter(self.location, arrays, start=start, workers=self.workers,
                                     in_flight=in_flight, coder=self.coder)
        except BaseException:
            self._abandon()
            release_and_tidy(self.lock, remove_root=True)
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        slabs = self.slabs
        try:
            if exc_type is None:
                slabs.drain()
            else:  # leaving on an error: write nothing more, only let slabs in flight finish
                slabs.abandon()
        finally:
            slabs.close()
            failed = exc_type is not None and not self._committed
            if failed:
                self._abandon()
            release_and_tidy(self.lock, remove_root=failed and self._created)

    @property
    def slabs(self) -> SlabWriter:
        if self._slabs is None:
            raise RuntimeError("a writer writes inside its `with` block only")
        return self._slabs

    @property
    def n_windows(self) -> int:
        """Windows in the store once everything added so far is written."""
        return self.slabs.end

    # -- writing ---------------------------------------------------------------------------------
    def _write(self, device_id: int, blocks: Iterable[WindowBlock], sources: list[str]) -> DeviceSummary:
        """Append every window of one device as one run; returns its summary (not yet recorded)."""
        summary = Summarizer(device_id, sources, start=self.slabs.end)
        for block in blocks:
            summary.add(block)
            self.slabs.add(device_id, block)
        if self.coder is not None:
            self.slabs.close_device(device_id)  # once its blocks waiting in the slab are coded
        return summary.finish()

    def reserve(self, n: int) -> None:
        """Size the arrays for ``n`` more windows that tasks write (``_segments.py``); the
        caller records the devices' summaries (``record``)."""
        self.slabs.reserve(n)

    def write_device(self, device_id: int, blocks: Iterable[WindowBlock], sources: list[str],
                     continued: int = 0) -> DeviceReport:
        """Write every window of one device, given in store order, and record it (``continued``:
        rows of a committed unfinished burst its blocks continue, an append's)."""
        raise NotImplementedError

    def record(self, summary: DeviceSummary) -> None:
        """Enter a device that tasks wrote (``reserve``) in the table and report."""
        raise NotImplementedError

    def record_runs(self, runs: DeviceColumns) -> None:
        """Enter devices that tasks wrote as consecutive runs (``reserve``), given as columns; a
        writer that does not keep them so records each one's summary."""
        for summary in column_summaries(runs):
            self.record(summary)

    def has_windows(self) -> bool:
        """Whether any device recorded so far has a window."""
        return (any(entry.n_windows for entry in self.devices.values())
                or any(bool(runs.counts.any()) for runs in self.runs))

    def problems(self) -> Iterable[list[str]]:
        """Every recorded device's report notes (``DeviceReport.problems``)."""
        yield from (report.problems for report in self.reports.values())
        for runs in self.runs:
            yield from runs.problems.values()

    def add_rows(self, rows: _v2.Dictionaries) -> None:
        """Format 2: dictionary rows coded elsewhere (a worker process, a Dask task), numbered
        after every row added before them; stored at the commit."""
        self._rows_from_elsewhere.append(rows)

    def _store_dictionaries(self) -> None:
        """Format 2: append the conversion's dictionary rows to the dictionary arrays (before the
        commit; an append's ``_abandon`` cuts them back)."""
        if self.coder is None:
            return
        assert self.group is not None
        # one concatenation of every part (extending part by part copied the rows once a part)
        parts = [self.coder.new_rows(), *self._rows_from_elsewhere]
        arrays = {name: _array(self.group, name).with_config(EVERY_CHUNK)
                  for name in (_v2.VALUES, _v2.START, _v2.DEVICE)}
        for name, new in ((_v2.VALUES, np.concatenate([p.values for p in parts])),
                          (_v2.START, np.concatenate([p.start for p in parts])),
                          (_v2.DEVICE, np.concatenate([p.device for p in parts]))):
            array = arrays[name]
            old = array.shape[0]
            if len(new):
                array.resize((old + len(new), *array.shape[1:]))
                array[old:] = new

    # -- commit ----------------------------------------------------------------------------------
    def commit(self, extra_report: dict[str, Any] | None = None) -> dict[str, Any]:
        """Make everything written visible: the one write that turns the group into a store."""
        self.slabs.drain()
        self._store_dictionaries()
        attrs = self._committed_attrs(extra_report)
        assert self.group is not None
        root = attrs
        if self.coder is not None:  # format 2
            # what an interrupted append is cut back to (_append.py)
            attrs["committed"]["dictionary"] = {"rows": int(_array(self.group, _v2.DEVICE).shape[0]),
                                                "values": int(_array(self.group, _v2.VALUES).shape[0])}
            root = self._write_device_table(attrs)
        self.group.attrs.put({ATTRS_KEY: root})
        self._committed = True
        if self.coder is not None:  # older tables and a killed commit's: leftovers now (kept_tables)
            with contextlib.suppress(OSError):  # best effort: the next writer or repair removes them too
                discard_format2_leftovers(self.location, self.group, root["committed"])
        return attrs

    def _write_device_table(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Format 2: write the device table of ``attrs`` (the full root attributes of the
        commit) into its own group (birdzarr/format/_device_table.py); returns the root
        attributes without it, which name the group."""
        root = dict(attrs)
        report = dict(root.get("report") or {})
        entries = [self.devices[d] for d in sorted(self.devices)]
        runs = self.runs
        _refuse_repeated(entries, runs)
        # the details' JSON spelled out from the objects and the runs' columns
        # (device_table.details_json), with the (id, report) pairs made one at a time: 100K kept
        # at once cost a garbage collection
        reports = ((d, self.reports[d]) for d in sorted(self.reports))
        details = device_table.details_json(entries, reports, root.pop(CSV_TAILS, None), runs)
        # the sums `info` shows, so that it reads the root alone at any device count
        totals = report_totals(self.reports.values())
        totals["rows_read"] += sum(int(r.counts.sum()) for r in runs)  # a run's other counts are 0
        report["totals"] = totals
        n_devices, labels = len(entries) + sum(len(r) for r in runs), _label_totals(entries, runs)
        root["report"] = report
        committed = dict(root["committed"])
        where = device_table.path(int(committed["generation"]))
        write_device_table(self.location, where, details, entries, runs)
        committed["device_table"] = where
        committed["n_devices"] = n_devices
        committed["label_counts"] = labels
        root["committed"] = committed
        return root


class StoreWriter(Writer):
    """Creates a store, takes device after device, and commits once."""

    def __init__(
        self,
        location: Location,
        *,
        chunk_windows: int = 8192,
        overwrite: bool = False,
        static_attrs: dict[str, Any] | None = None,
        lock_command: str | None = None,
        workers: int | None = None,
    ) -> None:
        super().__init__(location, lock_command=lock_command, workers=workers)
        self.chunk_windows = chunk_windows
        self.overwrite = overwrite
        self.static_attrs = dict(static_attrs or {})

    def _open(self) -> tuple[dict[str, Any], int]:
        self._prepare_destination()
        store = zarr_store(self.location, read_only=False)
        # mode "a", not "w": "w" would delete the lock file; _prepare_destination emptied the root.
        group = self.group = zarr.open_group(store, mode="a", zarr_format=3)
        self._created = True
        group.attrs.put({ATTRS_KEY: self._attrs(committed=None)})
        arrays = self._create_format2_arrays(group)
        for name, dtype in _PER_WINDOW_DTYPES.items():
            arrays[name] = group.create_array(
                name, shape=(0,), dtype=dtype, chunks=(self.chunk_windows,), fill_value=_FILL[name],
                dimension_names=("window",), attributes=array_attributes(name), overwrite=True,
                config=EVERY_CHUNK, **per_window_codecs(),
            )
        return arrays, 0

    def _create_format2_arrays(self, group: zarr.Group) -> dict[str, Any]:
        """Format 2's window and dictionary arrays, empty, from their zarr.json documents
        (birdzarr/format/_v2.py): core codecs only. Returns the per-window ones."""
        self.coder = RowCoder()
        for name, meta in _v2.array_metadata(0, 0, 0, chunk_windows=self.chunk_windows).items():
            write_json(self.location, f"{name}/zarr.json", meta)
        return {name: _array(group, name).with_config(EVERY_CHUNK) for name in (_v2.CODES, _v2.GPS, _v2.ROW)}

    def _abandon(self) -> None:
        """A failed conversion leaves nothing behind."""
        if self._created:
            clear_except_lock(self.location)

    def _prepare_destination(self) -> None:
        if not exists(self.location):
            return
        fs, path = self.location.fs, self.location.path
        if fs.isfile(path):
            raise StoreExistsError(f"{self.location.display} is a file; choose another destination.")
        if not [p for p in fs.ls(path, detail=False) if not p.rstrip("/").endswith(LOCK_NAME)]:
            return
        if self.overwrite:
            clear_except_lock(self.location)
            return
        if _is_unfinished_store(self.location):
            clear_except_lock(self.location)  # an interrupted conversion: start it again from scratch
            return
        raise StoreExistsError(
            f"{self.location.display} already exists and is not empty. Pass --overwrite "
            "(Python: overwrite=True) to replace it, or choose another destination."
        )

    # -- writing ---------------------------------------------------------------------------------
    def write_device(self, device_id: int, blocks: Iterable[WindowBlock], sources: list[str],
                     continued: int = 0) -> DeviceReport:
        """Append every window of one device; returns what its input produced (``continued``:
        an append's, a new store continues no committed burst)."""
        self._refuse_twice(device_id)
        summary = self._write(device_id, blocks, sources)
        self.record(summary)
        return summary.report

    def write_mixed(self, block: WindowBlock) -> None:
        """Append windows of several devices (a shuffled bucket); the block carries each
        window's device id, and the caller records the devices' summaries (``record``)."""
        self.slabs.add(-1, block)

    def record_runs(self, runs: DeviceColumns) -> None:
        """Enter devices written by ``reserve`` as consecutive runs, kept as columns until the
        commit (a device given twice is refused there)."""
        self.runs.append(runs)

    def record(self, summary: DeviceSummary) -> None:
        """Enter a device written by ``write_mixed`` or ``reserve`` in the table and report."""
        device_id = summary.entry.device_id
        self._refuse_twice(device_id)
        self.devices[device_id] = summary.entry
        self.reports[device_id] = summary.report
        self.tails[device_id] = summary.tail

    def _refuse_twice(self, device_id: int) -> None:
        if device_id in self.devices:
            raise NotAStoreError(f"device {device_id} was given twice in one conversion")

    # -- commit ----------------------------------------------------------------------------------
    def _committed_attrs(self, extra_report: dict[str, Any] | None) -> dict[str, Any]:
        report = {
            "started_at": self.started_at,
            "finished_at": _now(),
            **(extra_report or {}),
        }
        committed = {"n_windows": self.n_windows, "generation": 1, "committed_at": _now()}
        attrs = self._attrs(committed=committed)
        attrs["report"] = report
        layout = self.static_attrs.get("layout") or {}
        if self.static_attrs.get("source_kind") == "csv" and not layout.get("shuffled"):
            unknown = [d for d, tail in self.tails.items() if tail is None]
            known = {d: tail_to_json(tail) for d, tail in self.tails.items() if tail is not None}
            attrs[CSV_TAILS] = csv_tails_record(known, unknown)
        return attrs

    def _attrs(self, *, committed: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "window_length": WINDOW_LENGTH,
            "channels": list(CHANNELS),
            **self.static_attrs,
            "converter": {"name": "birdzarr", "version": __version__},
            "committed": committed,
        }


CSV_TAILS = "csv_tails"  # the root attribute: each device's unfinished last burst (docs/format.md)


def _refuse_repeated(entries: list[DeviceEntry], runs: list[DeviceColumns]) -> None:
    """A device recorded twice, among the entries and the runs (``record`` refuses it among the
    entries as they come)."""
    if not runs:
        return
    ids = np.sort(np.concatenate([np.fromiter((e.device_id for e in entries), np.int64, len(entries)),
                                  *(r.device_ids for r in runs)]))
    twice = np.flatnonzero(ids[1:] == ids[:-1])
    if len(twice):
        raise NotAStoreError(f"device {int(ids[twice[0]])} was given twice in one conversion")


def _label_totals(entries: list[DeviceEntry], runs: list[DeviceColumns]) -> dict[str, int]:
    """``label_totals`` of the entries and the runs' devices."""
    totals = {int(label): count for label, count in label_totals(entries).items()}
    for r in runs:
        found, index = np.unique(r.label_value, return_inverse=True)
        sums = np.bincount(index.reshape(-1), weights=r.label_count, minlength=len(found))
        for label, count in zip(found.tolist(), sums.astype(np.int64).tolist(), strict=True):
            totals[label] = totals.get(label, 0) + count
    return {str(label): totals[label] for label in sorted(totals)}


def write_device_table(location: Location, where: str, details: dict[str, Any] | bytes,
                       entries: list[DeviceEntry], runs: list[DeviceColumns] | None = None) -> None:
    """Write a format-2 device table group at ``where`` (its attributes and index arrays);
    ``details``: the object of the ``details`` array, or its JSON (``device_table.details_json``);
    ``runs``: devices recorded as columns, beside ``entries``."""
    store = zarr_store(location, read_only=False)
    documents = {device_table.GROUP: {"zarr_format": 3, "node_type": "group", "attributes": {}},
                 where: device_table.group_metadata()}
    arrays = device_table.columns(entries, runs or ())
    for name, values in arrays.items():
        documents[f"{where}/{name}"] = device_table.array_metadata(len(values))
    if not isinstance(details, bytes):
        details = json.dumps(details, separators=(",", ":"), allow_nan=False, check_circular=False).encode()
    blob = np.frombuffer(details, np.uint8)
    documents[f"{where}/{device_table.DETAILS}"] = device_table.details_metadata(len(blob))
    arrays[device_table.DETAILS] = blob
    for key, document in documents.items():
        write_json(location, f"{key}/zarr.json", document)
    for name, values in arrays.items():
        if len(values):
            # every chunk stored, even one equal to the fill value (a table of one device at 0)
            zarr.open_array(store, path=f"{where}/{name}", mode="r+").with_config(EVERY_CHUNK)[:] = values


def csv_tails_record(known: dict[int, dict[str, Any] | None], unknown: Iterable[int]) -> dict[str, Any]:
    """The ``csv_tails`` root attribute of a CSV store in device order: per device, the rows of
    its unfinished last burst (``_csv.tail_to_json``; a device not listed has none), and the
    devices whose tail is not known (written before stores recorded it). An append continues
    these bursts, so it stores the windows one conversion of all the parts would."""
    return {
        "devices": {str(d): known[d] for d in sorted(known) if known[d] is not None},
        "unknown": sorted(int(d) for d in unknown),
    }


def _is_unfinished_store(location: Location) -> bool:
    """True if the location holds a birdzarr group that never committed."""
    try:
        raw = json.loads(location.fs.cat_file(location.join("zarr.json")))
    except (FileNotFoundError, ValueError):
        return False
    meta = raw.get("attributes", {}).get(ATTRS_KEY)
    return isinstance(meta, dict) and meta.get("committed") is None
