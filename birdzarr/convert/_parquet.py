"""Reader of Parquet input: per-device files and partition files of many devices.

Each row is one curated window: 80 float32 values in column ``gimu``, time-major
(``reshape(-1, 20, 4)``). Optional columns are read when present: ``label`` (integer; null or
absent: -1), ``timestamp`` (integer seconds since 1970-01-01 UTC or a timestamp type, floored to
seconds; null or absent: ``TIMESTAMP_UNKNOWN``) and ``device_id`` (integer). Any other column is
not read, and named in the report (and a warning, ``birdzarr.convert``).

A per-device file (``{device}.parquet`` or any file in a ``device_id=K/`` folder) is streamed
batch by batch, so memory is bounded by the batch size, not by the device's size; a
``device_id`` column in it must say that device. A partition file (any other name) must have a
``device_id`` column; a device's rows are read from the row groups that may hold it (by the
column's statistics), each decoded once for all its devices and kept in a bounded cache.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from birdzarr._errors import BadInputError
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._input import split_suffix
from birdzarr.format._spec import (
    LABEL_UNLABELLED,
    N_CHANNELS,
    TIMESTAMP_UNKNOWN,
    WINDOW_LENGTH,
    WINDOW_VALUES,
    DeviceReport,
)
from birdzarr.storage._location import Location

COLUMN = "gimu"
DEVICE_COLUMN, LABEL_COLUMN, TIME_COLUMN = "device_id", "label", "timestamp"
KNOWN_COLUMNS = (COLUMN, DEVICE_COLUMN, LABEL_COLUMN, TIME_COLUMN)  # read when present
HIVE_FOLDER = re.compile(r"^device_id=(\d{1,9})$")
IGNORED_PREFIX = "columns not read (birdzarr reads gimu, device_id, label, timestamp):"
# Decoded row groups of partition files kept for the next devices read from them (per process)
GROUP_CACHE_BYTES = 256 << 20
# Measured: 16,384-row batches decode 2x faster than 65,536 (they stay in the CPU caches), and
# two of them fill one default 8,192-window chunk twice.
BATCH_ROWS = 16384
READ_BUFFER = 1 << 20
_SKIP_HINT = "or pass --on-bad-rows skip (Python: on_bad_rows='skip') to skip such rows and count them"
_SKIP_FILE_HINT = "or pass --on-bad-rows skip to skip the file and count it in the report"


def _schema_problem(schema: pa.Schema) -> str | None:
    if COLUMN not in schema.names:
        return (
            f"no column '{COLUMN}' (columns: {', '.join(schema.names) or 'none'}); birdzarr reads "
            f"Parquet files with one list<float32> column '{COLUMN}' of 80 values a row"
        )
    kind = schema.field(COLUMN).type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if is_list and _is_list(kind.value_type):
        return (
            f"column '{COLUMN}' has type {kind}, expected list<float32> of 80 values a row, time-major "
            "([t0: x, y, z, gps, t1: ...]); flatten each row's nested lists into one list of 80 values "
            "(pyarrow.compute.list_flatten) and write that"
        )
    if not is_list or kind.value_type != pa.float32():
        return (
            f"column '{COLUMN}' has type {kind}, expected list<float32> (80 values a row); cast it "
            "to float32 lists yourself if rounding is acceptable (birdzarr never rounds silently)"
        )
    for name, expected in ((DEVICE_COLUMN, "an integer type"), (LABEL_COLUMN, "an integer type"),
                           (TIME_COLUMN, "integer seconds since 1970-01-01 UTC or a timestamp type")):
        if name in schema.names:
            kind = schema.field(name).type
            if not (pa.types.is_integer(kind) or (name == TIME_COLUMN and pa.types.is_timestamp(kind))):
                return f"column '{name}' has type {kind}, expected {expected}"
    return None


def _is_list(kind: pa.DataType) -> bool:
    return bool(pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))


def ignored_columns(schema: pa.Schema) -> list[str]:
    """The file's columns that birdzarr does not read (named in the report and a warning)."""
    return [name for name in schema.names if name not in KNOWN_COLUMNS]


def ignored_note(source: str, columns: list[str]) -> str:
    """The report's note for a file with columns that are not read (``ignored_from_notes``)."""
    return f"{source}: {IGNORED_PREFIX} {json.dumps(columns)}"


def ignored_from_notes(problems: list[str]) -> dict[str, list[str]]:
    """{column: [file name, ...]} from a device report's notes (``ignored_note``)."""
    found: dict[str, list[str]] = {}
    marker = f": {IGNORED_PREFIX} "
    for note in problems:
        if marker in note:
            source, columns = note.split(marker, 1)
            for column in json.loads(columns):
                found.setdefault(str(column), []).append(source.rsplit("/", 1)[-1])
    return found


def names_its_device(path: Location) -> int | None:
    """The device a file's place names: ``{device}.parquet``, or any file in a ``device_id=K/``
    folder (hive partitioning). None: a partition file, whose ``device_id`` column says."""
    parts = path.path.rstrip("/").split("/")
    stem = (split_suffix(parts[-1]) or (parts[-1], ""))[0]
    if stem.isdigit() and len(stem) <= 9 and stem.isascii():
        return int(stem)
    folder = HIVE_FOLDER.match(parts[-2]) if len(parts) > 1 else None
    return int(folder.group(1)) if folder else None


def _values(array: pa.Array, dtype: type[np.generic]) -> np.ndarray:
    """A primitive array without nulls as numpy, without copying. ``to_numpy`` does the same
    through pyarrow's pandas conversion, which imports pandas (0.3 s) on its first call and
    costs a little on every call."""
    item = np.dtype(dtype).itemsize
    if not len(array):  # an empty array may have no data buffer at all
        return np.empty(0, dtype=dtype)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * item)


def int64_values(column: pa.Array | pa.ChunkedArray, fill: int = 0) -> np.ndarray:
    """An integer column as int64 numpy, nulls as ``fill``. Without pandas: ``to_numpy`` and
    ``pa.scalar`` (which ``fill_null`` and comparisons with a Python value use) import it."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    column = column.cast(pa.int64())
    values = _values(column, np.int64)
    return np.where(_null_mask(column), fill, values) if column.null_count else values


def _null_mask(column: pa.Array) -> np.ndarray:
    """True where ``column`` is null (without pandas)."""
    return _values(column.is_null().cast(pa.int8()), np.int8).astype(bool)


def _exact_windows(column: pa.Array) -> np.ndarray | None:
    """The batch as float32 (n, 20, 4) without copying, if every row is 80 finite values."""
    if column.null_count or column.values.null_count:
        return None
    n = len(column)
    if pa.types.is_fixed_size_list(column.type):
        if column.type.list_size != WINDOW_VALUES:
            return None
        flat = column.flatten()
    else:
        offsets = _values(column.offsets, np.int64 if pa.types.is_large_list(column.type) else np.int32)
        if offsets[-1] - offsets[0] != n * WINDOW_VALUES or (np.diff(offsets) != WINDOW_VALUES).any():
            return None
        flat = column.values.slice(int(offsets[0]), n * WINDOW_VALUES)
    values = _values(flat, np.float32)
    # A finite sum proves every value finite (NaN and inf propagate) and costs a tenth of
    # isfinite(); a sum that overflowed falls back to the exact check.
    if not np.isfinite(values.sum()) and not np.isfinite(values).all():
        return None
    return values.reshape(n, WINDOW_LENGTH, N_CHANNELS)


def _row_problems(column: pa.Array) -> np.ndarray:
    """Boolean mask of rows that are not exactly 80 finite float32 values (the slow path)."""
    n = len(column)
    bad = np.zeros(n, dtype=bool)
    if column.null_count:
        bad |= ~np.asarray(column.is_valid())
    lengths = np.asarray(pc.list_value_length(column).fill_null(0))
    bad |= lengths != WINDOW_VALUES
    values = column.flatten()
    row_of_value = np.repeat(np.arange(n), lengths)
    if values.null_count:
        bad[row_of_value[~np.asarray(values.is_valid())]] = True
        values = values.fill_null(np.float32(np.nan))
    flat = values.to_numpy(zero_copy_only=False)
    bad[row_of_value[~np.isfinite(flat)]] = True
    return bad


def _describe(column: pa.Array, row: int) -> str:
    value = column[row]
    if not value.is_valid:
        return "is null"
    items = value.values
    if len(items) != WINDOW_VALUES:
        return f"has {len(items)} values (expected {WINDOW_VALUES})"
    return "holds a null, NaN or infinite value"


class _Group:
    """One decoded row group of a partition file, with its rows indexed by device."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table.combine_chunks()
        ids_np = int64_values(self.table.column(DEVICE_COLUMN), fill=-1)
        self.order = np.argsort(ids_np, kind="stable")  # stable: a device's rows stay in file order
        ordered = ids_np[self.order]
        self.ids, self.starts = np.unique(ordered, return_index=True)
        self.starts = np.append(self.starts, len(ordered))
        self.nbytes = int(self.table.nbytes) + 3 * ids_np.nbytes
        self.sorted_ids = ordered
        self._columns: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._irregular = False

    def columns(self, source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The whole group's windows (float32 (n, 20, 4), a view of the decoded column), labels
        and timestamps, found once for every run of devices read from it (``read_runs``); None
        where a row is not 80 finite values or a column is out of range (its devices are then
        read one by one, which reports the row)."""
        if self._columns is None and not self._irregular:
            names = self.table.schema.names
            n = self.table.num_rows

            def column(name: str) -> pa.Array:  # the combined table's one chunk (combining copies)
                chunks = self.table.column(name)
                return chunks.chunk(0) if chunks.num_chunks == 1 else chunks.combine_chunks()

            try:
                windows = _exact_windows(column(COLUMN))
                labels = (_integers(column(LABEL_COLUMN), LABEL_UNLABELLED, np.int32, source, LABEL_COLUMN)
                          if LABEL_COLUMN in names else np.full(n, LABEL_UNLABELLED, dtype=np.int32))
                times = (_timestamps(column(TIME_COLUMN), source)
                         if TIME_COLUMN in names else np.full(n, TIMESTAMP_UNKNOWN, dtype=np.int64))
            except BadInputError:
                windows = None
            if windows is None:
                self._irregular = True
                return None
            self._columns = (windows, labels, times)
            self.nbytes += labels.nbytes + times.nbytes
        return self._columns

    def rows_of(self, device: int) -> np.ndarray:
        """The row numbers (within the group, ascending) of ``device``."""
        at = int(np.searchsorted(self.ids, device))
        if at == len(self.ids) or self.ids[at] != device:
            return np.empty(0, np.int64)
        return self.order[self.starts[at]: self.starts[at + 1]]


class _GroupCache:
    """Decoded row groups of partition files, kept for the next devices that read them: devices
    are read one after another, and the rows of many sit in one row group, which is decoded once
    while it stays here. At most ``max_bytes`` are kept (always the last group used), least
    recently used first out; threads asking for the same group wait for one decoding of it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked worker starts empty, unlocked

    def _reset(self) -> None:
        self.lock = threading.Lock()
        self.entries: collections.OrderedDict[tuple[Any, ...], _Group] = collections.OrderedDict()
        self.loading: dict[tuple[Any, ...], threading.Lock] = {}

    def _cached(self, key: tuple[Any, ...]) -> _Group | None:
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
            return entry

    def get(self, key: tuple[Any, ...], load: Callable[[], pa.Table]) -> _Group:
        entry = self._cached(key)
        if entry is not None:
            return entry
        with self.lock:
            gate = self.loading.setdefault(key, threading.Lock())
        with gate:
            entry = self._cached(key)
            if entry is not None:
                return entry
            try:
                entry = _Group(load())
            finally:
                with self.lock:
                    self.loading.pop(key, None)
            with self.lock:
                self.entries[key] = entry
                size = sum(e.nbytes for e in self.entries.values())
                while size > self.max_bytes and len(self.entries) > 1:
                    _, old = self.entries.popitem(last=False)
                    size -= old.nbytes
            return entry

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


_GROUPS = _GroupCache(GROUP_CACHE_BYTES)


@dataclass(frozen=True)
class _PartitionFile:
    """What a partition file's footer says, kept for the next devices read from it: a partition
    file holds many devices, each read by a reader of its own, and parsing the footer and checking
    the schema once a device was most of a small device's reading cost (a 20,000-device
    conversion, cProfile: ``ParquetFile`` 9.1 of 72 s)."""

    columns: list[str]  # the known columns it has, read
    extra: list[str]  # the columns not read (named in the report)
    bounds: list[tuple[int, int] | None]  # each row group's device_id min and max (None: unknown)
    keys: list[tuple[Any, ...]]  # each row group's key in the decoded-group cache

    @classmethod
    def of(cls, path: Location, file: pq.ParquetFile, columns: list[str], extra: list[str]) -> _PartitionFile:
        groups = range(file.num_row_groups)
        return cls(columns, extra, [_device_bounds(file, g) for g in groups],
                   [_group_key(path, file, g, columns) for g in groups])

    def may_hold(self, group: int, device: int) -> bool:
        """False where the row group's statistics of ``device_id`` rule ``device`` out."""
        bounds = self.bounds[group]
        return bounds is None or bounds[0] <= device <= bounds[1]


# partition files' footers, by file (``_identity``), for the conversion that reads them (a plain
# dict: one item read or written at a time; forked workers start with their parent's)
_FILES: dict[tuple[Any, ...], _PartitionFile] = {}


def _identity(path: Location) -> tuple[Any, ...]:
    """A partition file as ``_FILES`` knows it: its URL, size and modification time (or ETag),
    so a file rewritten since its footer was kept is read anew (a ``stat``; elsewhere fsspec's
    ``info``, from the listing's cache where the file system keeps one)."""
    try:
        if path.is_local:
            st = os.stat(path.path)
            return (path.url, st.st_size, st.st_mtime_ns)
        info = path.fs.info(path.path)
    except OSError:
        return (path.url, None)
    changed = info.get("mtime") or info.get("LastModified") or info.get("ETag")
    return (path.url, info.get("size"), str(changed))


def clear_group_cache() -> None:
    """Free the decoded row groups and footers of partition files (a conversion calls it when it
    ends)."""
    _GROUPS.clear()
    _FILES.clear()


def _device_bounds(file: pq.ParquetFile, group: int) -> tuple[int, int] | None:
    """The row group's device_id min and max from its statistics (None: not recorded)."""
    meta = file.metadata.row_group(group)
    for index in range(meta.num_columns):
        column = meta.column(index)
        if column.path_in_schema == DEVICE_COLUMN:
            stats = column.statistics
            if stats is None or not stats.has_min_max:
                return None
            try:
                return int(stats.min), int(stats.max)
            except (TypeError, ValueError):
                return None
    return None


def _group_key(path: Location, file: pq.ParquetFile, group: int, columns: list[str]) -> tuple[Any, ...]:
    """A decoded group's cache key: the file, the group and what its footer says of it (a file
    rewritten in between has other offsets and sizes, and is decoded again)."""
    meta = file.metadata.row_group(group)
    layout = tuple(
        (meta.column(i).file_offset, meta.column(i).total_compressed_size) for i in range(meta.num_columns)
    )
    return (path.url, group, tuple(columns), meta.num_rows, file.metadata.serialized_size, layout)


@dataclass
class ParquetDeviceReader:
    """Streams one device's windows of one file into ``WindowBlock`` s of at most ``BATCH_ROWS``.

    A per-device file (``{device}.parquet``, or a file in a ``device_id=K/`` folder) is read
    whole; a ``device_id`` column in it must say the same device. A partition file (any other
    name) gives the rows whose ``device_id`` is this device, in file order.
    """

    device_id: int
    path: Location
    on_bad_rows: str = "error"
    # a per-device file's row groups to read (a part of a split device, ``_segments.split_large``);
    # None: all of them
    row_groups: tuple[int, ...] | None = None
    noted: bool = True  # this reading names the file's ignored columns (one part of a split file does)

    def blocks(self) -> Iterator[WindowBlock]:
        """The windows of the whole file (or of ``row_groups``), row group by row group."""
        source = self.path.display
        named = names_its_device(self.path)
        identity = _identity(self.path) if named is None else ()
        known = _FILES.get(identity) if named is None else None
        if known is not None:  # a partition file another device's reader opened
            yield from self._partition_blocks(known, source, None)
            return
        try:
            # Local files: pyarrow's own reader, measured 1.5x less CPU than a Python file object
            # (not a memory map: mapped pages would count in RSS); elsewhere the fsspec file.
            handle = (
                pa.OSFile(self.path.path) if self.path.is_local else self.path.fs.open(self.path.path, "rb")
            )
        except OSError as exc:
            yield from self._bad_file(f"{source}: cannot be opened ({exc})", "check the path and permissions")
            return
        with handle:
            try:
                # Without pre_buffer=False pyarrow loads a whole column chunk (a 1,048,576-row row
                # group: ~160 MB) before decoding; buffered reads keep the peak near one batch.
                file = pq.ParquetFile(handle, buffer_size=READ_BUFFER, pre_buffer=False)
            except (pa.ArrowInvalid, OSError, ValueError) as exc:  # ValueError: a non-UTF-8 name
                yield from self._bad_file(
                    f"{source}: not a readable Parquet file ({exc}); is it truncated or not Parquet?",
                    "re-export or re-copy it",
                )
                return
            schema = file.schema_arrow
            problem = _schema_problem(schema)
            if problem is not None:
                yield from self._bad_file(f"{source}: {problem}", "fix the file")
                return
            columns = [name for name in KNOWN_COLUMNS if name in schema.names]
            if named is None and DEVICE_COLUMN not in schema.names:
                raise BadInputError(f"{source}: {no_device_message()}")
            extra = ignored_columns(schema)
            if named is None:
                index = _FILES[identity] = _PartitionFile.of(self.path, file, columns, extra)
                yield from self._partition_blocks(index, source, file)
                return
            note = ignored_note(source, extra) if extra and self.noted else None
            groups = range(file.num_row_groups) if self.row_groups is None else self.row_groups
            yield from _noted((block for group in groups
                               for block in self._row_group(file, group, columns, source)), note)

    def _bad_file(self, message: str, remedy: str) -> Iterator[WindowBlock]:
        if self.on_bad_rows != "skip":
            raise BadInputError(f"{message}. To fix: {remedy}, {_SKIP_FILE_HINT}.")
        report = DeviceReport(bad_files=1)
        report.note(message)
        yield _empty_block(report)

    def _row_group(
        self, file: pq.ParquetFile, group: int, columns: list[str], source: str
    ) -> Iterator[WindowBlock]:
        first_row = 0
        # one thread a reader: the parallelism is the engine's, a segment a task (_segments.py)
        batches = file.iter_batches(
            batch_size=BATCH_ROWS, row_groups=[group], columns=columns, use_threads=False
        )
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowInvalid, OSError, ValueError) as exc:
                yield from self._bad_group(exc, group, first_row, source)
                return
            if batch is None:
                return
            yield self._batch(batch, group, first_row, source)
            first_row += batch.num_rows

    def _bad_group(self, exc: Exception, group: int, first_row: int, source: str) -> Iterator[WindowBlock]:
        yield from self._bad_file(
            f"{source}, row group {group}, from row {first_row}: cannot be decoded ({exc}); "
            "the file is damaged or truncated",
            "re-export or re-copy it",
        )

    def _partition_blocks(self, index: _PartitionFile, source: str,
                          file: pq.ParquetFile | None) -> Iterator[WindowBlock]:
        """This device's rows of a partition file, row group by row group (``file``: open
        already, else opened only to decode a group no other device's reader decoded)."""
        note = ignored_note(source, index.extra) if index.extra else None
        yield from _noted((block for group in range(len(index.keys)) if index.may_hold(group, self.device_id)
                           for block in self._partition_group(index, file, group, source)), note)

    def _decode(self, file: pq.ParquetFile | None, group: int, columns: list[str]) -> pa.Table:
        if file is not None:
            return file.read_row_group(group, columns=columns, use_threads=False)
        return _decode_group(self.path, group, columns)

    def _partition_group(
        self, index: _PartitionFile, file: pq.ParquetFile | None, group: int, source: str
    ) -> Iterator[WindowBlock]:
        """This device's rows of one row group of a partition file (decoded once for all the
        devices it holds, see ``_GroupCache``)."""
        try:
            decoded = _GROUPS.get(index.keys[group], lambda: self._decode(file, group, index.columns))
        except (pa.ArrowInvalid, OSError, ValueError) as exc:
            yield from self._bad_group(exc, group, 0, source)
            return
        rows = decoded.rows_of(self.device_id)
        for start in range(0, len(rows), BATCH_ROWS):
            take = rows[start: start + BATCH_ROWS]
            consecutive = int(take[-1]) - int(take[0]) + 1 == len(take)
            if consecutive:  # a view, no copy
                part = decoded.table.slice(int(take[0]), len(take))
            else:
                part = decoded.table.take(pa.array(take))
            block = self._batch(part, group, take, source)
            if consecutive:  # its own copy: a view would keep the whole decoded group alive
                block.windows = np.array(block.windows)
            yield block

    def _batch(
        self, batch: pa.RecordBatch | pa.Table, group: int, rows: int | np.ndarray, source: str
    ) -> WindowBlock:
        """One batch's windows and per-window columns. ``rows``: the group's row number of the
        batch's first row, or of each of its rows (partition files)."""

        def row_number(index: int) -> int:
            return rows + index if isinstance(rows, int) else int(rows[index])

        column = _column(batch, COLUMN)
        names = batch.schema.names
        if DEVICE_COLUMN in names and names_its_device(self.path) is not None:
            self._check_device(_column(batch, DEVICE_COLUMN), group, row_number, source)
        labels = (
            _integers(_column(batch, LABEL_COLUMN), LABEL_UNLABELLED, np.int32, source, LABEL_COLUMN)
            if LABEL_COLUMN in names else np.full(len(column), LABEL_UNLABELLED, dtype=np.int32)
        )
        times = (
            _timestamps(_column(batch, TIME_COLUMN), source)
            if TIME_COLUMN in names else np.full(len(column), TIMESTAMP_UNKNOWN, dtype=np.int64)
        )
        report = DeviceReport(rows_read=len(column))
        windows = _exact_windows(column)
        if windows is None:
            bad = _row_problems(column)
            found = np.flatnonzero(bad)
            first = int(found[0])
            message = f"{source}, row group {group}, row {row_number(first)}: the window " + _describe(
                column, first
            )
            if self.on_bad_rows != "skip":
                raise BadInputError(f"{message}. Fix the file, {_SKIP_HINT}.")
            report.bad_lines += len(found)
            report.drop("bad_rows", len(found))
            more = f" (and {len(found) - 1} more rows of this batch)" if len(found) > 1 else ""
            report.note(message + more)
            kept = column.filter(pa.array(~bad))
            flat = kept.flatten().to_numpy(zero_copy_only=False)
            windows = np.asarray(flat, dtype=np.float32).reshape(-1, WINDOW_LENGTH, N_CHANNELS)
            labels, times = labels[~bad], times[~bad]
        n = len(windows)
        report.windows_written = n
        return WindowBlock(windows, times, labels, report)

    def _check_device(
        self, ids: pa.Array, group: int, row_number: Callable[[int], int], source: str
    ) -> None:
        """A per-device file's ``device_id`` column must say the device its name says."""
        wrong = np.flatnonzero(int64_values(ids, fill=-1) != self.device_id)
        if not len(wrong):
            return
        at = int(wrong[0])
        other = ids[at].as_py()
        raise BadInputError(
            f"{source}, row group {group}, row {row_number(at)}: device_id is {other}, but the file's "
            f"name (or folder) says device {self.device_id}; a file holding other devices must not be "
            "named after one: rename it (part-0.parquet, say) to read it as a partition file by its "
            "device_id column."
        )


def row_group_rows(path: Location) -> list[int]:
    """The rows of each row group of a Parquet file, from its footer (which ``ParquetFile`` reads
    alone: one small read)."""
    with path.fs.open(path.path, "rb") as handle:
        meta = pq.ParquetFile(handle).metadata
        return [meta.row_group(group).num_rows for group in range(meta.num_row_groups)]


def _decode_group(path: Location, group: int, columns: list[str]) -> pa.Table:
    """Row group ``group`` of a partition file, opened for it."""
    handle = pa.OSFile(path.path) if path.is_local else path.fs.open(path.path, "rb")
    with handle:
        opened = pq.ParquetFile(handle, buffer_size=READ_BUFFER, pre_buffer=False)
        return opened.read_row_group(group, columns=columns, use_threads=False)


@contextlib.contextmanager
def _partition_index(path: Location) -> Iterator[tuple[_PartitionFile | None, pq.ParquetFile | None]]:
    """What a partition file's footer says (``_PartitionFile``, kept in ``_FILES``) and the file,
    where it was opened to read its footer (None: another reader had), to decode its row groups
    while open. The footer is None where the file cannot be opened, is not Parquet or has the
    wrong schema (its devices are then read one by one, which reports it)."""
    identity = _identity(path)
    known = _FILES.get(identity)
    if known is not None:
        yield known, None
        return
    try:
        handle = pa.OSFile(path.path) if path.is_local else path.fs.open(path.path, "rb")
    except OSError:
        yield None, None
        return
    with handle:
        try:
            file = pq.ParquetFile(handle, buffer_size=READ_BUFFER, pre_buffer=False)
        except (pa.ArrowInvalid, OSError, ValueError):
            yield None, None
            return
        schema = file.schema_arrow
        if _schema_problem(schema) is not None or DEVICE_COLUMN not in schema.names:
            yield None, None
            return
        columns = [name for name in KNOWN_COLUMNS if name in schema.names]
        index = _FILES[identity] = _PartitionFile.of(path, file, columns, ignored_columns(schema))
        yield index, file


def _group_of(path: Location, file: pq.ParquetFile | None, index: _PartitionFile, group: int) -> _Group:
    """Row group ``group`` of a partition file, decoded (``file``: open already) or from the cache."""
    if file is not None:
        return _GROUPS.get(index.keys[group],
                           lambda: file.read_row_group(group, columns=index.columns, use_threads=False))
    return _GROUPS.get(index.keys[group], lambda: _decode_group(path, group, index.columns))


@dataclass
class PartitionRuns:
    """The windows of consecutive devices read from partition files at once (``read_runs``), in
    store order: device after device, each device's rows in the order of its files, then of the
    files' row groups and rows (what its own ``ParquetDeviceReader`` s give, one after another)."""

    devices: np.ndarray  # int64 (n,): each window's device, ascending
    windows: np.ndarray  # float32 (n, 20, 4)
    timestamps: np.ndarray  # int64 (n,)
    labels: np.ndarray  # int32 (n,)
    counts: np.ndarray  # int64: each device's windows, in the order the devices were given
    # the files read (one reading order of all of them), and device ``k``'s files in its reading
    # order: ``files[file_at[file_bounds[k]:file_bounds[k + 1]]]``
    files: list[Location]
    file_at: np.ndarray
    file_bounds: np.ndarray
    notes: dict[int, str]  # file (its place in ``files``) -> the note its devices' reports carry

    @property
    def reports(self) -> list[DeviceReport]:
        """Each device's report, as its readers' blocks would give it: its windows read and
        written, and the notes of its files (built here: the conversion keeps them as columns,
        ``_summary.summarize_run_columns``)."""
        reports = [DeviceReport(rows_read=count, windows_written=count) for count in self.counts.tolist()]
        for k in self.noted_devices():
            for at in self.file_at[self.file_bounds[k]: self.file_bounds[k + 1]].tolist():
                if at in self.notes:
                    reports[k].note(self.notes[at])
        return reports

    def noted_devices(self) -> list[int]:
        """The devices (their places) with a file that carries a note."""
        if not self.notes:
            return []
        noted = np.isin(self.file_at, np.fromiter(self.notes, np.int64, len(self.notes)))
        return np.unique(np.searchsorted(self.file_bounds, np.flatnonzero(noted), "right") - 1).tolist()


_Piece = tuple[np.ndarray, int, int, np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]


def _pieces(path: Location, file: pq.ParquetFile | None, index: _PartitionFile, mine: np.ndarray,
            at: int) -> list[_Piece] | None:
    """The rows of devices ``mine`` (ascending) in each row group of the file (the ``at``-th):
    (their device ids, ``at``, the group, their row numbers, the group's columns), each group's
    rows by device, then row; None where a group cannot be decoded or a row is irregular."""
    low, high = int(mine[0]), int(mine[-1])
    out: list[_Piece] = []
    for group, bounds in enumerate(index.bounds):
        if bounds is not None and (bounds[1] < low or bounds[0] > high):
            continue
        try:
            decoded = _group_of(path, file, index, group)
        except (pa.ArrowInvalid, OSError, ValueError):
            return None
        columns = decoded.columns(path.display)
        if columns is None:
            return None
        a, b = np.searchsorted(decoded.ids, [low, high + 1])
        if a == b:
            continue
        rows = decoded.order[decoded.starts[a]: decoded.starts[b]]
        who = decoded.sorted_ids[decoded.starts[a]: decoded.starts[b]]
        if not np.isin(decoded.ids[a:b], mine).all():  # devices that do not read this file
            keep = np.isin(who, mine)
            rows, who = rows[keep], who[keep]
            if not len(rows):
                continue
        out.append((who, at, group, rows, columns))
    return out


def read_runs(devices: list[tuple[int, list[Location]]]) -> PartitionRuns | None:
    """The windows of ``devices`` (ascending ids, each with its partition files in reading order)
    read together: each file's row groups that may hold them are decoded once (``_GROUPS``) and
    cut into all their devices' rows with one sort, without a reader, a block or a check a
    device. None where that cannot give what reading device by device gives (a file that cannot
    be read, a row that is not 80 finite values, a column out of range, files listed in different
    orders): the caller then reads those devices one by one, which reports the problem."""
    ids = np.fromiter((d for d, _ in devices), np.int64, len(devices))
    if not len(ids) or (len(ids) > 1 and not (ids[1:] > ids[:-1]).all()):
        return None
    place: dict[int, int] = {}  # file (by identity; else URL) -> its place in one reading order
    by_url: dict[str, int] = {}
    files: list[Location] = []
    file_at: list[int] = []
    file_bounds = np.zeros(len(devices) + 1, np.int64)
    for k, (_, paths) in enumerate(devices):
        last = -1
        for path in paths:  # the devices of one partition file share its Location (find_inputs)
            at = place.get(id(path))
            if at is None:
                at = by_url.get(path.url)
                if at is None:
                    at = by_url[path.url] = len(files)
                    files.append(path)
                place[id(path)] = at
            if at <= last:  # two devices read these files in different orders
                return None
            last = at
            file_at.append(at)
        file_bounds[k + 1] = len(file_at)
    at_of = np.array(file_at, np.int64)
    device_of = np.repeat(np.arange(len(devices)), np.diff(file_bounds))
    notes: dict[int, str] = {}
    pieces: list[_Piece] = []
    for at, path in enumerate(files):
        with _partition_index(path) as (index, file):
            if index is None:
                return None
            found = _pieces(path, file, index, ids[device_of[at_of == at]], at)
        if found is None:
            return None
        pieces.extend(found)
        if index.extra:
            notes[at] = ignored_note(path.display, index.extra)
    if not pieces:
        return PartitionRuns(np.empty(0, np.int64), np.empty((0, WINDOW_LENGTH, N_CHANNELS), np.float32),
                             np.empty(0, np.int64), np.empty(0, np.int32), np.zeros(len(ids), np.int64),
                             files, at_of, file_bounds, notes)
    who = np.concatenate([p[0] for p in pieces])
    # rows that lie in order (devices grouped in the file) are a slice, copied once below
    takes = [slice(int(p[3][0]), int(p[3][-1]) + 1) if bool((np.diff(p[3]) == 1).all()) else p[3]
             for p in pieces]
    windows = np.concatenate([p[4][0][take] for p, take in zip(pieces, takes, strict=True)])
    labels = np.concatenate([p[4][1][take] for p, take in zip(pieces, takes, strict=True)])
    times = np.concatenate([p[4][2][take] for p, take in zip(pieces, takes, strict=True)])
    if len(pieces) > 1:  # by device, then file, row group and row
        order = np.lexsort((np.concatenate([p[3] for p in pieces]),
                            np.concatenate([np.full(len(p[0]), p[2]) for p in pieces]),
                            np.concatenate([np.full(len(p[0]), p[1]) for p in pieces]), who))
        who, windows, labels, times = who[order], windows[order], labels[order], times[order]
    counts = np.searchsorted(who, ids, "right") - np.searchsorted(who, ids, "left")
    return PartitionRuns(who, windows, times, labels, counts, files, at_of, file_bounds, notes)


def no_device_message() -> str:
    """Why a Parquet file's device cannot be told (the discovery's and the reader's message)."""
    return (
        "cannot tell the device: name per-device files {device}.parquet with a numeric device id (or "
        "put them in device_id={device}/ folders), or give files of many devices a device_id column"
    )


def _column(batch: pa.RecordBatch | pa.Table, name: str) -> pa.Array:
    column = batch.column(name)
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _integers(
    column: pa.Array, fill: int, dtype: type[np.integer[Any]], source: str, name: str
) -> np.ndarray:
    """An integer column as ``dtype``, nulls as ``fill``; values out of its range are refused."""
    info = np.iinfo(dtype)
    low, high = (v.as_py() for v in pc.min_max(column).values())
    if (low is not None and low < info.min) or (high is not None and high > info.max):
        raise BadInputError(
            f"{source}: column '{name}' holds values from {low} to {high}, outside {info.min}..{info.max} "
            f"(stored as {np.dtype(dtype)}); map them into that range"
        )
    return int64_values(column, fill).astype(dtype)


def _timestamps(column: pa.Array, source: str) -> np.ndarray:
    """Unix seconds (floored) of an integer-seconds or timestamp column; nulls are unknown."""
    if pa.types.is_timestamp(column.type):
        per_second = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[column.type.unit]
        seconds = np.floor_divide(int64_values(column), per_second)
    else:
        try:
            seconds = int64_values(column)
        except pa.ArrowInvalid as exc:
            raise BadInputError(
                f"{source}: column '{TIME_COLUMN}' does not fit int64 seconds ({exc})"
            ) from None
    if column.null_count:
        seconds = np.where(_null_mask(column), TIMESTAMP_UNKNOWN, seconds)
    return np.array(seconds, dtype=np.int64)  # a copy: not a view of the input's buffers


def _noted(blocks: Iterator[WindowBlock], note: str | None) -> Iterator[WindowBlock]:
    """The blocks, the first carrying ``note`` (the ignored columns of the file); where there is
    no block, one empty block carrying it: the ignored columns are named even without rows."""
    for block in blocks:
        if note is not None:
            block.report.note(note)
            note = None
        yield block
    if note is not None:
        report = DeviceReport()
        report.note(note)
        yield _empty_block(report)


def _empty_block(report: DeviceReport) -> WindowBlock:
    no_windows = np.empty((0, WINDOW_LENGTH, N_CHANNELS), np.float32)
    return WindowBlock(no_windows, np.empty(0, np.int64), np.empty(0, np.int32), report)
