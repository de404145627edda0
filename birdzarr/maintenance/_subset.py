"""Writing a derived store of some of a store's windows (``birdzarr.subset``).

A format-2 window is its codes (``gimu_codes``), its dictionary row (``gimu_row``) and its
``gps_speed``; the dictionaries are global arrays. So a subset re-encodes nothing: the selected
windows' per-window arrays are copied in the source's stored order, packed densely into chunks
of the source's length, and the dictionary rows they use are copied and renumbered (row order
kept). A shuffled source's stored order is a uniform random permutation, so any selection taken
in that order is one too: the subset is a shuffled store (its layout records the source's
``shuffle_seed``). A device-ordered source gives a device-ordered subset, each device's windows
in runs with a checksum each, as the converter records them.

The device table is computed again from the selected windows (counts, times, labels, ranges and
checksums, or the order-free digests of a shuffled store), so ``birdzarr verify`` checks a subset
like any store. The root attribute ``subset`` records where the windows came from.

Memory: work goes chunk by chunk. At most ``requests`` source chunks are read ahead (each one
chunk of every per-window array: 32,768 windows are ~5.9 MB), one destination chunk is filled
at a time, and the dictionaries are held whole (what every reader holds: ~6 MB at 186 devices),
plus one byte per dictionary row and the selection's one bit per source window.

Writing follows the converter's rules (``birdzarr/convert/_overwrite.py``): only to a new or
empty location or over a birdzarr store with ``overwrite``, never inside the source, under the
destination's writer lock, the root attributes (the commit) written last; a committed store is
replaced only once the new one has committed beside it, and a failed run leaves the previous
state.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import numbers
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

from birdzarr._checks import require_bool, require_int
from birdzarr._errors import ArgumentError
from birdzarr._progress import progress_bar
from birdzarr._version import __version__
from birdzarr.convert._overwrite import check_destination, replacing, staged_location
from birdzarr.convert._slabs import EVERY_CHUNK
from birdzarr.convert._summary import WindowChecksum, device_runs, label_counts
from birdzarr.convert._writer import csv_tails_record, write_device_table
from birdzarr.format import _device_table as device_table
from birdzarr.format import _v2
from birdzarr.format._codec import per_window_codecs
from birdzarr.format._digest import RowDigest
from birdzarr.format._spec import (
    ATTRS_KEY,
    DEVICE,
    LABEL,
    TIMESTAMP,
    TIMESTAMP_UNKNOWN,
    DeviceEntry,
    DeviceRange,
    DeviceReport,
    array_attributes,
)
from birdzarr.storage._location import Location, StoreLike, require_writable, resolve, write_json, zarr_store
from birdzarr.storage._lock import StoreLock, clear_except_lock, release_and_tidy
from birdzarr.store._selection import Selection, WindowFilter, make_selection, unix_seconds

if TYPE_CHECKING:
    from birdzarr.store._handle import Store

SUBSET = "subset"  # the root attribute that records the source and the selection
_KEPT_ROOT = ("format_version", "window_length", "channels", "source_kind", "curation", "window_rule",
              "mixed_label_policy")
_PER_WINDOW = {DEVICE: (np.int32, -1), TIMESTAMP: (np.int64, TIMESTAMP_UNKNOWN), LABEL: (np.int32, -1)}


def refuse_format1(store: Store) -> None:
    """A subset copies format-2 codes: a version-1 store is refused in one line."""
    if store.format_version != 2:
        from birdzarr.format._spec import format1_refusal

        raise format1_refusal(store.url, "subset", store.meta, cannot="copy its windows' codes")


def subset(
    source: StoreLike,
    destination: StoreLike,
    *,
    devices: Iterable[int] | None = None,
    exclude_devices: Iterable[int] | None = None,
    split: str | None = None,
    split_by: str = "device",
    val_fraction: float = 0.1,
    split_seed: int = 0,
    labelled_only: bool = False,
    labels: Iterable[int] | None = None,
    start: Any = None,
    stop: Any = None,
    overwrite: bool = False,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    source_storage_options: dict[str, Any] | None = None,
) -> Store:
    """Write the windows a ``WindowDataset`` with the same selection options would deliver
    (``devices``, ``exclude_devices``, ``split``, ``split_by``, ``val_fraction``, ``split_seed``,
    ``labelled_only``, ``labels``, ``start``, ``stop``: the same meanings and rules) as a new
    store at ``destination``, and open it.

    Streaming a selection that keeps a small part of each chunk still fetches and decompresses
    every chunk; streaming its subset reads only the kept windows. Nothing is re-encoded: the
    windows' codes, dictionary rows and gps_speed are copied in the source's stored order and
    packed into chunks of the source's length, so the subset of a ``--shuffle`` store is itself
    shuffled (a uniform order) and streams without ``allow_device_order``. Its device table is
    computed from its windows (``birdzarr verify`` checks it), and its root attribute ``subset``
    records the source, its window count and commit generation, and the selection.

    The source must be a format-2 store. ``destination`` follows ``convert``'s rules: a new or
    empty location, or with ``overwrite=True`` a birdzarr store, replaced only once the subset has
    committed beside it; never inside the source. Memory is bounded: chunk by chunk, with the
    dictionaries and one bit per source window. ``storage_options``: fsspec options of the
    destination; ``source_storage_options``: those of the source.
    """
    from birdzarr.store._handle import open_store

    overwrite, progress = require_bool("overwrite", overwrite), require_bool("progress", progress)
    labelled_only = require_bool("labelled_only", labelled_only)
    split_seed = require_int("split_seed", split_seed, minimum=0)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise ArgumentError(f"val_fraction must be a number between 0 and 1, got {val_fraction!r}")
    first, end = unix_seconds("start", start), unix_seconds("stop", stop)
    if first is not None and end is not None and first >= end:
        raise ArgumentError(f"start must be before stop, got start={start!r} and stop={stop!r}")
    chosen, excluded = ids("devices", devices), ids("exclude_devices", exclude_devices)
    kept = ids("labels", labels)
    kept = None if kept is None else tuple(sorted(set(kept)))
    fraction = float(val_fraction)
    split_record = {"split_by": split_by, "val_fraction": fraction, "split_seed": split_seed}
    record = {
        "devices": None if chosen is None else sorted(set(chosen)),
        "exclude_devices": None if excluded is None else sorted(set(excluded)),
        "split": split, **{k: (v if split is not None else None) for k, v in split_record.items()},
        "labelled_only": labelled_only, "labels": None if kept is None else list(kept),
        "start": first, "stop": end,
    }

    dst = resolve(destination, storage_options)
    require_writable(dst)
    store = open_store(source, storage_options=source_storage_options)
    refuse_format1(store)  # before the selection reads anything
    selection = make_selection(store.device_columns, reader=store.reader, shuffled_store=store.shuffled,
                               devices=chosen, exclude_devices=excluded, split=split, split_by=split_by,
                               val_fraction=fraction, split_seed=split_seed,
                               filters=WindowFilter(labelled_only, kept, first, end))
    write_subset(store, dst, selection, selection_record=record, overwrite=overwrite, progress=progress)
    return open_store(dst)


def ids(name: str, given: Iterable[int] | None) -> tuple[int, ...] | None:
    """Device ids or labels as given (a list), each an integer."""
    if given is None:
        return None
    if isinstance(given, (str, bytes, numbers.Integral)):
        raise TypeError(f"{name} is a list of ids, got {given!r}: write [{given!r}]")
    return tuple(require_int(f"an id of {name}", one) for one in given)


def write_subset(
    store: Store, dst: Location, selection: Selection, *, selection_record: dict[str, Any],
    overwrite: bool, progress: bool, requests: int = 4,
) -> None:
    """Write the windows ``selection`` keeps of ``store`` as a new store at ``dst`` (see the
    module doc); the caller opens the result."""
    refuse_format1(store)
    counts = np.asarray(selection.counts(), dtype=np.int64)
    n_selected = int(counts.sum())
    if not n_selected:
        raise ArgumentError(
            f"the selection holds no window of {store.url} ({_described(selection_record)}); nothing "
            "to write. Choose devices the store holds (`birdzarr info --devices`) and filters that "
            "keep windows"
        )
    state = check_destination(dst, overwrite=overwrite, source=store.location)
    staged = staged_location(dst, overwrite=overwrite, state=state)
    with replacing(dst, staged) if staged is not None else contextlib.nullcontext():
        _write_locked(store, staged or dst, selection, counts, selection_record=selection_record,
                      progress=progress, requests=requests)


def _described(record: dict[str, Any]) -> str:
    shown = [f"{k}={v!r}" for k, v in record.items() if v not in (None, False)]
    return ", ".join(shown) or "every window"


def _write_locked(
    store: Store, target: Location, selection: Selection, counts: np.ndarray, *,
    selection_record: dict[str, Any], progress: bool, requests: int,
) -> None:
    lock = StoreLock(target, f"birdzarr subset {store.url}")
    lock.acquire()  # one writer at a time: no convert, append or copy to the same place meanwhile
    committed = False
    try:
        clear_except_lock(target)  # check_destination allowed only an empty or unfinished store here
        _SubsetWriter(store, target, selection, counts, requests=requests).write(
            selection_record, progress=progress)
        committed = True
    finally:
        if not committed:
            with contextlib.suppress(OSError):
                clear_except_lock(target)  # nothing half-written stays behind
        release_and_tidy(lock, remove_root=not committed)


class _SubsetWriter:
    def __init__(self, store: Store, target: Location, selection: Selection, counts: np.ndarray, *,
                 requests: int) -> None:
        self.store, self.target, self.selection = store, target, selection
        self.reader = store.reader
        self.chunks = np.flatnonzero(counts > 0).tolist()
        self.n_windows = int(counts.sum())
        self.width = self.reader.chunk_windows
        self.requests = requests
        self.started = time.perf_counter()
        self.started_at = _now()

    # -- reading -----------------------------------------------------------------------------------
    def _positions(self, chunk: int) -> np.ndarray | None:
        mask = self.selection.chunk_mask(self.reader, chunk)
        return None if mask is None else np.flatnonzero(mask)

    def _read(self, chunk: int) -> dict[str, np.ndarray]:
        """The selected windows of one source chunk: codes, rows, gps_speed, device, time, label."""
        selected = self._positions(chunk)
        codes, row, gps = self.reader.read_coded(chunk, selected)
        out = {_v2.CODES: np.ascontiguousarray(codes), _v2.ROW: np.asarray(row), _v2.GPS: np.asarray(gps)}
        for name in _PER_WINDOW:
            values = self.reader.read(name, chunk)
            out[name] = values if selected is None else values[selected]
        return out

    def _rows_used(self) -> np.ndarray:
        """One flag per source dictionary row: does a selected window use it (reads ``gimu_row``)."""
        used = np.zeros(self.reader.dictionaries().n_rows, dtype=bool)
        for chunk in self.chunks:
            row = self.reader.read(_v2.ROW, chunk)
            selected = self._positions(chunk)
            used[row if selected is None else row[selected]] = True
        return used

    def _selected_chunks(self) -> Iterator[dict[str, np.ndarray]]:
        """The selected windows chunk by chunk in stored order, at most ``requests`` chunks read ahead."""
        with ThreadPoolExecutor(max_workers=self.requests, thread_name_prefix="birdzarr-subset") as pool:
            ahead: deque[Future[dict[str, np.ndarray]]] = deque()
            todo = iter(self.chunks)
            try:
                for chunk in todo:
                    ahead.append(pool.submit(self._read, chunk))
                    if len(ahead) >= self.requests:
                        yield ahead.popleft().result()
                while ahead:
                    yield ahead.popleft().result()
            finally:
                for future in ahead:
                    future.cancel()

    # -- writing -----------------------------------------------------------------------------------
    def write(self, selection_record: dict[str, Any], *, progress: bool) -> None:
        source = self.reader.dictionaries()
        used = self._rows_used()
        dictionaries, renumber = _kept_rows(source, used)
        group = zarr.open_group(zarr_store(self.target, read_only=False), mode="a", zarr_format=3)
        root = self._root_attrs(selection_record, committed=None)
        group.attrs.put({ATTRS_KEY: root})
        arrays = self._create_arrays(group, dictionaries)
        table = _TableBuilder(self.store, shuffled=self.store.shuffled)
        buffers = {name: np.empty((self.width, *a.shape[1:]), a.dtype) for name, a in arrays.items()}
        filled = written = 0
        with progress_bar(progress, desc="subset", total=self.n_windows, unit=" windows") as bar:
            for part in self._selected_chunks():
                part[_v2.ROW] = renumber[part[_v2.ROW]]
                table.add(written + filled, part, dictionaries)
                at = 0
                n = len(part[DEVICE])
                while at < n:
                    take = min(n - at, self.width - filled)
                    for name, buffer in buffers.items():
                        buffer[filled : filled + take] = part[name][at : at + take]
                    filled += take
                    at += take
                    if filled == self.width:
                        self._flush(arrays, buffers, written, filled)
                        written, filled = written + filled, 0
                bar.update(n)
            if filled:
                self._flush(arrays, buffers, written, filled)
                written += filled
        assert written == self.n_windows, (written, self.n_windows)
        table.write(self.target, group, root, self._report(table), started=self.started)

    def _flush(self, arrays: dict[str, zarr.Array], buffers: dict[str, np.ndarray], at: int, n: int) -> None:
        """One destination chunk of every per-window array (whole: ``at`` is a chunk boundary)."""
        for name, array in arrays.items():
            array[at : at + n] = buffers[name][:n]

    def _create_arrays(self, group: zarr.Group, dictionaries: _v2.Dictionaries) -> dict[str, zarr.Array]:
        """Every array at its final length; the dictionaries written; the per-window ones returned."""
        metadata = _v2.array_metadata(self.n_windows, len(dictionaries.values), dictionaries.n_rows,
                                      chunk_windows=self.width)
        for name, meta in metadata.items():
            write_json(self.target, f"{name}/zarr.json", meta)
        opened = {name: _open_array(group, name) for name in _v2.ARRAYS}
        for name, values in ((_v2.VALUES, dictionaries.values), (_v2.START, dictionaries.start),
                             (_v2.DEVICE, dictionaries.device)):
            if len(values):
                opened[name][:] = values
        for name, (dtype, fill) in _PER_WINDOW.items():
            opened[name] = group.create_array(
                name, shape=(self.n_windows,), dtype=dtype, chunks=(self.width,), fill_value=fill,
                dimension_names=("window",), attributes=array_attributes(name), overwrite=True,
                config=EVERY_CHUNK, **per_window_codecs(),
            ).with_config(EVERY_CHUNK)
        return {name: opened[name] for name in (_v2.CODES, _v2.GPS, _v2.ROW, *_PER_WINDOW)}

    def _root_attrs(self, selection_record: dict[str, Any], *, committed: dict[str, Any] | None
                    ) -> dict[str, Any]:
        source = self.store.root
        layout = dict(source.get("layout") or {})
        layout["chunk_windows"] = self.width
        # what the windows are (their format, curation and rules); not the source's commit, report,
        # device table or the files its conversion skipped
        kept = {k: source[k] for k in _KEPT_ROOT if k in source}
        return {
            **kept,
            "layout": layout,
            "converter": {"name": "birdzarr", "version": __version__},
            SUBSET: {
                "source": self.store.url,
                "source_n_windows": self.store.n_windows,
                "source_generation": int(source["committed"]["generation"]),
                "selection": selection_record,
                "windows": self.n_windows,
            },
            "committed": committed,
        }

    def _report(self, table: _TableBuilder) -> dict[str, Any]:
        return {
            "started_at": self.started_at,
            "source": self.store.url,
            "devices": {str(d): DeviceReport(windows_written=e.n_windows).to_json()
                        for d, e in sorted(table.entries.items())},
        }


def _open_array(group: zarr.Group, name: str) -> zarr.Array:
    node = group[name]
    assert isinstance(node, zarr.Array)
    return node.with_config(EVERY_CHUNK)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _kept_rows(source: _v2.Dictionaries, used: np.ndarray) -> tuple[_v2.Dictionaries, np.ndarray]:
    """The dictionary rows the subset's windows use, in the source's order, their entries copied
    (``Dictionaries.kept``: entries rows share copied once), and the source row -> kept row map
    (uint32)."""
    rows = np.flatnonzero(used)
    renumber = np.zeros(source.n_rows, dtype=np.uint32)
    renumber[rows] = np.arange(len(rows), dtype=np.uint32)
    kept = source.kept(used)
    return _v2.Dictionaries(kept.values.astype(np.float32, copy=False), kept.start.astype(np.int64),
                            kept.device.astype(np.int64)), renumber


class _TableBuilder:
    """The subset's device table, from its windows fed in stored order."""

    def __init__(self, store: Store, *, shuffled: bool) -> None:
        self.store = store
        self.shuffled = shuffled
        self.entries: dict[int, DeviceEntry] = {}
        self.digests: dict[int, RowDigest] = {}
        self.run: tuple[int, int, WindowChecksum] | None = None  # device-ordered: (device, start, crc)
        self.n = 0

    def _entry(self, device: int) -> DeviceEntry:
        entry = self.entries.get(device)
        if entry is None:
            entry = self.entries[device] = DeviceEntry(device_id=device,
                                                       sources=list(self.store.device(device).sources))
        return entry

    def add(self, first: int, part: dict[str, np.ndarray], dictionaries: _v2.Dictionaries) -> None:
        """The windows of ``part``, the subset's windows ``first`` onwards."""
        devices, times, labels = part[DEVICE].astype(np.int64), part[TIMESTAMP], part[LABEL]
        windows = _v2.decode(part[_v2.CODES], part[_v2.ROW], part[_v2.GPS], dictionaries.values,
                             dictionaries.start)
        runs = device_runs(devices)
        for device, a, b in runs:
            where = runs.order[a:b]
            entry = self._entry(device)
            entry.n_windows += len(where)
            for label, count in zip(*label_counts(labels[where]), strict=True):
                entry.label_counts[label] = entry.label_counts.get(label, 0) + count
            when = times[where]
            known = when[when != TIMESTAMP_UNKNOWN]
            if len(known):
                low, high = int(known.min()), int(known.max())
                unknown = entry.first_time == TIMESTAMP_UNKNOWN
                entry.first_time = low if unknown else min(entry.first_time, low)
                entry.last_time = high if unknown else max(entry.last_time, high)
            if self.shuffled:
                self.digests.setdefault(device, RowDigest()).update(windows[where], when, labels[where])
        if not self.shuffled:
            self._ranges(first, devices, windows)
        self.n = first + len(devices)

    def _ranges(self, first: int, devices: np.ndarray, windows: np.ndarray) -> None:
        """Device-ordered: each run of one device's windows is a range with its checksum."""
        cuts = np.flatnonzero(np.diff(devices)) + 1
        for a, b in zip(np.concatenate([[0], cuts]).tolist(), np.append(cuts, len(devices)).tolist(),
                        strict=True):
            device = int(devices[a])
            if self.run is None or self.run[0] != device:
                self._close_run(first + a)
                self.run = (device, first + a, WindowChecksum())
            self.run[2].update(np.ascontiguousarray(windows[a:b], dtype="<f4"))

    def _close_run(self, stop: int) -> None:
        if self.run is not None:
            device, start, crc = self.run
            self._entry(device).ranges.append(DeviceRange(start, stop, crc.hexdigest()))
            self.run = None

    def write(self, target: Location, group: zarr.Group, root: dict[str, Any], report: dict[str, Any], *,
              started: float) -> None:
        """The device table group, then the commit: the root attributes, last."""
        self._close_run(self.n)
        for device, digest in self.digests.items():
            self.entries[device].scattered_digest = digest.hexdigest()
        entries = [self.entries[d] for d in sorted(self.entries)]
        details: dict[str, Any] = {
            "devices": [e.to_json() for e in entries],
            "report_devices": report.pop("devices"),
            "csv_tails": None,
        }
        if root.get("source_kind") == "csv" and not self.shuffled:
            # the subset holds no unfinished bursts it could continue: an append starts new ones
            details["csv_tails"] = csv_tails_record({}, [e.device_id for e in entries])
        where = device_table.path(1)
        write_device_table(target, where, details, entries)
        finished = dict(root)
        seconds = round(time.perf_counter() - started, 3)
        finished["report"] = {**report, "finished_at": _now(), "seconds": seconds}
        finished["committed"] = {
            "n_windows": self.n, "generation": 1, "committed_at": _now(),
            "dictionary": {"rows": int(_open_array(group, _v2.DEVICE).shape[0]),
                           "values": int(_open_array(group, _v2.VALUES).shape[0])},
            "device_table": where, "n_devices": len(entries),
        }
        group.attrs.put({ATTRS_KEY: finished})
