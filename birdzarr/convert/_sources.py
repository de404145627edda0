"""Finding the input: directories (or fsspec URLs) of CSV parts or Parquet files, or single files.

Two layouts, which one source may mix (Parquet):

- **Per-device files**: the name carries the device id: ``{device}_{part}.csv`` (parts sort
  numerically: ``298_10`` after ``298_9``; also ``.csv.gz`` and ``.csv.zst``, extensions in any
  case), ``{device}.parquet``, or any Parquet file in a ``device_id={device}/`` folder (hive
  partitioning; its files in name order). A single CSV named otherwise (``export.csv``) takes its
  device id from its first row.
- **Partition files** (Parquet): any other name, with an integer ``device_id`` column; their rows
  may hold many devices, grouped or not, and a device may be split over several files. Their
  ``device_id`` columns are read here (one integer column, one row group at a time) to list the
  devices each holds; a device's windows are its rows in file order, its files in name order
  (numbers compared as numbers: ``part-2`` before ``part-10``).

A device's windows come from one per-device file (or folder) or from partition files, never both.
Several sources are read as one directory holding all their files: CSV parts of one device are
ordered numerically across sources; one device's Parquet file in two sources is refused.
Devices are stored in ascending id order. Every entry of a source directory is read or named:
see ``find_inputs``.
"""

from __future__ import annotations

import itertools
import posixpath
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from birdzarr._errors import BadInputError, StoreNotFoundError
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._csv import CsvDeviceReader
from birdzarr.convert._input import CSV_SUFFIXES, read_bytes, split_suffix
from birdzarr.convert._parquet import (
    DEVICE_COLUMN,
    HIVE_FOLDER,
    READ_BUFFER,
    ParquetDeviceReader,
    int64_values,
    names_its_device,
    no_device_message,
)
from birdzarr.format._spec import Curation
from birdzarr.storage._location import Location, missing_bucket_error

Kind = Literal["csv", "parquet"]
_CSV_STEM = re.compile(r"^(\d{1,9})_(\d{1,9})$")
_CSV_PARTED = re.compile(r"^(.*)_(\d{1,9})$")  # "gull-A12_0": a part of a device named by a non-integer
_LISTED = 10  # file names listed in an error; the rest are counted
MAX_DEVICE_ID = 999_999_999  # nine digits, as file names give them (stored as int32)


@dataclass(frozen=True)
class DevicePart:
    """Part ``index`` of ``parts`` of a device split into window ranges (``_segments.split_large``):
    the row groups of its per-device Parquet files it reads, ``(file, groups, noted)`` a file
    (``file`` an index into the device's ``files``; ``noted``: this part names the file's
    ignored columns, the part that holds the file's first row group, or the file's only part)."""

    index: int
    parts: int
    files: tuple[tuple[int, tuple[int, ...], bool], ...]


@dataclass
class DeviceSource:
    """All input files of one device, in reading order (or, with ``part``, one part of them)."""

    device_id: int
    kind: Kind
    files: list[Location] = field(default_factory=list)
    # rows of this device in its partition files (their device_id columns, counted by find_inputs);
    # None: not known (an append that skips some of them), the device is read to count them
    partition_rows: int | None = 0
    part: DevicePart | None = None  # a part of a split device: only these row groups are read

    def source_names(self) -> list[str]:
        """The names of its files, as the device table lists them (``sources``; a part's are the
        whole device's)."""
        return [file_name(f) for f in self.files]

    def blocks(self, *, curation: Curation, on_bad_rows: str) -> Iterator[WindowBlock]:
        if self.kind == "csv":
            yield from CsvDeviceReader(self.device_id, self.files, curation, on_bad_rows).blocks()
        elif self.part is not None:
            for at, groups, noted in self.part.files:
                yield from ParquetDeviceReader(self.device_id, self.files[at], on_bad_rows,
                                               row_groups=groups, noted=noted).blocks()
        else:
            for file in self.files:
                yield from ParquetDeviceReader(self.device_id, file, on_bad_rows).blocks()


def source_names_of(devices: Iterable[DeviceSource]) -> list[list[str]]:
    """Each device's ``source_names``, each file's name found once: the devices of partition
    files share their files (a 100,000-device conversion named 100 files 100,000 times)."""
    names: dict[int, str] = {}  # by file object: every one is alive while ``devices`` are
    out = []
    for device in devices:
        mine = []
        for file in device.files:
            name = names.get(id(file))
            if name is None:
                name = names[id(file)] = file_name(file)
            mine.append(name)
        out.append(mine)
    return out


def refuse_repeated_devices(where: str, devices: list[DeviceSource]) -> None:
    """A device id given by two inputs (a directory and a single file naming the same device)."""
    seen: set[int] = set()
    for device in devices:
        if device.device_id in seen:
            raise BadInputError(f"{where}: device {device.device_id} appears in more than one input.")
        seen.add(device.device_id)


def file_name(file: Location) -> str:
    """A source file's name within its device: what appends compare to skip known files."""
    return file.display.rsplit("/", 1)[-1]


def _kind_of(name: str) -> Kind | None:
    found = split_suffix(name)
    if found is None:
        return None
    return "csv" if found[1] in CSV_SUFFIXES else "parquet"


def natural_key(name: str) -> list[Any]:
    """Sorts names with their numbers compared as numbers (``part-2`` before ``part-10``)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def csv_name_problem(name: str) -> str | None:
    """Why a CSV name that looks like ``{device}_{part}`` does not name a device, or None. The
    same message for a file in a directory and for a single file."""
    stem = (split_suffix(name) or (name, ""))[0]
    parted = _CSV_PARTED.match(stem)
    if _CSV_STEM.match(stem) or parted is None:
        return None
    return (
        f"{name!r}: {parted.group(1)!r} is not a device id; device ids are integers (at most 9 "
        "digits), and CSV exports are named {device}_{part}.csv (12_0.csv; also .csv.gz, .csv.zst): "
        "rename the file"
    )


@dataclass
class Inputs:
    """What a source holds: its kind, the files per device, and what was skipped (by request)."""

    kind: Kind
    devices: list[DeviceSource]
    skipped: list[str] = field(default_factory=list)  # names in SOURCE that are not input files


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def discover(source: Location) -> tuple[Kind, list[DeviceSource]]:
    """Classify the input and group its files per device, sorted by device id. Every entry of a
    source directory must be an input file (see ``find_inputs``)."""
    found = find_inputs(source)
    return found.kind, found.devices


@dataclass
class _Entry:
    """One input file found: where, its name, its kind, and whether it was given on its own."""

    file: Location
    name: str
    kind: Kind
    single: bool
    order: int  # the source it came from (0, 1, ...)


def find_inputs(source: Location | Sequence[Location], *, skip_unknown_files: bool = False) -> Inputs:
    """Classify the input of one source or several and group its files per device, sorted by
    device id; several sources are read as one directory holding all their files.

    Every entry of a source directory is either read or named: one whose name is not an input
    file (``{device}_{part}.csv``, ``.csv.gz``, ``.csv.zst``, ``*.parquet``, a
    ``device_id={device}/`` folder of Parquet files; any case) raises ``BadInputError``, or with
    ``skip_unknown_files`` is listed in ``Inputs.skipped`` (and in the report). Nothing is
    skipped silently.
    """
    sources = [source] if isinstance(source, Location) else list(source)
    entries: list[_Entry] = []
    skipped: list[str] = []
    for order, src in enumerate(sources):
        found, unknown = _list_source(src, order, skip_unknown_files=skip_unknown_files)
        entries += found
        skipped += unknown
    kinds = {e.kind for e in entries}
    if len(kinds) > 1:
        where = f"{sources[0].display}: holds" if len(sources) == 1 else "the sources hold"
        raise BadInputError(
            f"{where} both CSV and Parquet files; convert one kind at a time "
            "(put them in separate directories)."
        )
    kind: Kind = "csv" if kinds == {"csv"} else "parquet"
    devices = _group_csv(entries) if kind == "csv" else _group_parquet(entries)
    return Inputs(kind, devices, skipped)


def _list_source(src: Location, order: int, *, skip_unknown_files: bool) -> tuple[list[_Entry], list[str]]:
    """The input files of one source, and the entries that are not (refused unless skipped)."""
    fs = src.fs
    if not fs.exists(src.path):
        # A missing bucket is the usual cause on an object store: name it, not the path.
        raise missing_bucket_error(src) or StoreNotFoundError(f"{src.display}: no such file or directory")
    if not fs.isdir(src.path):
        name = posixpath.basename(src.path)
        single = _kind_of(name)
        if single is None:
            raise BadInputError(f"{src.display}: not a .csv, .csv.gz, .csv.zst or .parquet file.")
        return [_Entry(src, name, single, True, order)], []
    entries: list[_Entry] = []
    unknown: list[str] = []
    for entry in sorted(fs.ls(src.path, detail=True), key=lambda e: str(e["name"])):
        name = posixpath.basename(str(entry["name"]).rstrip("/"))
        if entry.get("type") == "directory":
            if HIVE_FOLDER.match(name):
                entries += _hive_folder(src.child(name), name, order, unknown)
            else:
                unknown.append(name + "/")
            continue
        kind = _kind_of(name)
        if kind is None:
            unknown.append(name)
        else:
            entries.append(_Entry(src.child(name), name, kind, False, order))
    if unknown and not skip_unknown_files:
        raise BadInputError(
            f"{src.display}: {len(unknown)} "
            f"{'entry is not an input file' if len(unknown) == 1 else 'entries are not input files'}"
            f": {_listed(unknown)}. Inputs are {{device}}_{{part}}.csv (also "
            ".csv.gz, .csv.zst) or .parquet files (and device_id={device}/ folders of them); remove or "
            "rename the others, or pass --skip-unknown-files (Python: skip_unknown_files=True) to skip "
            "them and list them in the report."
        )
    if not entries:
        raise BadInputError(
            f"{src.display}: no .csv, .csv.gz, .csv.zst or .parquet files found. Give a "
            "directory of {device}_{part}.csv exports or .parquet files, or at one file."
        )
    return entries, unknown


def _hive_folder(folder: Location, name: str, order: int, unknown: list[str]) -> list[_Entry]:
    """The Parquet files of a ``device_id=K/`` folder; anything else in it is unknown."""
    found: list[_Entry] = []
    for entry in sorted(folder.fs.ls(folder.path, detail=True), key=lambda e: str(e["name"])):
        inner = posixpath.basename(str(entry["name"]).rstrip("/"))
        if entry.get("type") == "directory" or _kind_of(inner) != "parquet":
            unknown.append(f"{name}/{inner}" + ("/" if entry.get("type") == "directory" else ""))
        else:
            found.append(_Entry(folder.child(inner), f"{name}/{inner}", "parquet", False, order))
    return found


def _group_csv(entries: list[_Entry]) -> list[DeviceSource]:
    by_device: dict[int, list[tuple[int, int, _Entry]]] = {}
    for entry in entries:
        stem = (split_suffix(entry.name) or (entry.name, ""))[0]
        match = _CSV_STEM.match(stem)
        if match is None:
            problem = csv_name_problem(entry.name)
            where = entry.file.display.rsplit("/", 1)[0]
            if problem is not None:
                raise BadInputError(f"{where}: {problem}.")
            if not entry.single:
                raise BadInputError(
                    f"{where}: {entry.name!r}: cannot tell the device id from the file name: name files "
                    "{device}_{part}.csv (or .csv.gz, .csv.zst) with a numeric device id."
                )
            by_device.setdefault(_first_device_id(entry.file), []).append((0, entry.order, entry))
            continue
        device, part = int(match.group(1)), int(match.group(2))
        by_device.setdefault(device, []).append((part, entry.order, entry))
    devices = []
    for device in sorted(by_device):
        parts = sorted(by_device[device], key=lambda p: (p[0], p[1]))
        for (part, _, one), (next_part, _, other) in zip(parts, parts[1:], strict=False):
            if part == next_part:  # "5_0.csv" and "5_0.CSV" or "5_0.csv.gz", or in two sources
                raise BadInputError(
                    f"{_pair(one, other)} both name the same device and part ({part}) {device}; keep "
                    "one file per device and part, or rename one."
                )
        devices.append(DeviceSource(device, "csv", [p[2].file for p in parts]))
    return devices


def _pair(one: _Entry, other: _Entry) -> str:
    """Two files, by name where they share a directory, else in full."""
    here, there = one.file.display.rsplit("/", 1)[0], other.file.display.rsplit("/", 1)[0]
    if here == there and not one.single:
        return f"{here}: {one.name!r} and {other.name!r}"
    return f"{one.file.display!r} and {other.file.display!r}"


def _group_parquet(entries: list[_Entry]) -> list[DeviceSource]:
    """Per-device files (named, or in a device's folder) and partition files, per device. The
    devices of partition files are grouped as arrays (one sort of every file's (device, rows)
    pairs), and the devices found in one partition file alone share one list of it (a device's
    ``files`` are never changed in place)."""
    whole: dict[int, list[_Entry]] = {}  # the per-device files (a folder may hold several)
    partitions: list[_Entry] = []
    for entry in entries:
        named = names_its_device(entry.file)
        if named is not None:
            whole.setdefault(named, []).append(entry)
        else:
            partitions.append(entry)
    parted = _PartitionDevices.of(partitions)
    conflicts = set(np.intersect1d(np.fromiter(whole, np.int64, len(whole)), parted.ids).tolist())
    named_devices = []
    for device in sorted(whole):
        files = whole[device]
        origins = {(e.order, e.name.split("/", 1)[0] if "/" in e.name else e.name) for e in files}
        if len(origins) > 1:  # "12.parquet" and "012.parquet", or a device's file in two sources
            one, other = sorted(files, key=lambda e: (e.order, e.name))[:2]
            raise BadInputError(
                f"{_pair(one, other)} both hold device {device}; keep one file (or device_id={device}/ "
                "folder) per device, or give files of many devices a device_id column and a name "
                "that is not a device id (part-0.parquet)."
            )
        if device in conflicts:
            raise BadInputError(
                f"device {device} is in {files[0].file.display!r} and also in the partition file "
                f"{parted.first_file(device).display!r}: a device's windows come from its own file "
                "(or folder) or from partition files, not both; remove one."
            )
        ordered = sorted(files, key=lambda e: natural_key(e.name))
        named_devices.append(DeviceSource(device, "parquet", [e.file for e in ordered]))
    devices = parted.sources()
    if not named_devices:
        return devices
    if not devices:
        return named_devices
    every = named_devices + devices
    ids = np.fromiter((d.device_id for d in every), np.int64, len(every))
    return [every[k] for k in np.argsort(ids, kind="stable").tolist()]


@dataclass
class _PartitionDevices:
    """The devices of partition files: device ``ids[k]`` (ascending) has ``rows[k]`` rows, in the
    partition files ``files[file_at[bounds[k]:bounds[k + 1]]]`` (in reading order: names in
    natural order, then the sources' order)."""

    files: list[_Entry]
    ids: np.ndarray
    rows: np.ndarray
    file_at: np.ndarray
    bounds: np.ndarray

    @classmethod
    def of(cls, partitions: list[_Entry]) -> _PartitionDevices:
        found = [_partition_devices(entry) for entry in partitions]
        ranked = sorted(range(len(partitions)),
                        key=lambda i: (natural_key(partitions[i].name), partitions[i].order))
        rank = np.empty(len(partitions), np.int64)
        rank[ranked] = np.arange(len(partitions))
        ids = np.concatenate([np.empty(0, np.int64), *(f[0] for f in found)])
        rows = np.concatenate([np.empty(0, np.int64), *(f[1] for f in found)])
        file_at = np.repeat(np.arange(len(partitions)), [len(f[0]) for f in found]).astype(np.int64)
        order = np.lexsort((rank[file_at], ids))
        ids, rows, file_at = ids[order], rows[order], file_at[order]
        first = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if len(ids) else np.empty(0, np.int64)
        bounds = np.append(first, len(ids))
        totals = np.add.reduceat(rows, first) if len(first) else rows
        return cls(partitions, ids[first], totals, file_at, bounds)

    def first_file(self, device: int) -> Location:
        """The first of the device's partition files as the source lists them."""
        k = int(np.searchsorted(self.ids, device))
        return self.files[int(self.file_at[self.bounds[k]: self.bounds[k + 1]].min())].file

    def sources(self) -> list[DeviceSource]:
        """A ``DeviceSource`` a device, in ascending id: each device's list of files picked
        first, then the objects made by one ``map`` (a fifth less CPU than one comprehension
        doing both, at 100,000 devices)."""
        alone = [[entry.file] for entry in self.files]  # shared by the devices of one file alone
        lists = [alone[k] for k in self.file_at[self.bounds[:-1]].tolist()]
        files = [entry.file for entry in self.files]
        at, bounds = self.file_at.tolist(), self.bounds.tolist()
        for k in np.flatnonzero(np.diff(self.bounds) > 1).tolist():  # devices of several files
            lists[k] = [files[i] for i in at[bounds[k] : bounds[k + 1]]]
        kind: itertools.repeat[Kind] = itertools.repeat("parquet")
        return list(map(DeviceSource, self.ids.tolist(), kind, lists, self.rows.tolist()))


def _partition_devices(entry: _Entry) -> tuple[np.ndarray, np.ndarray]:
    """The devices of a partition file (ascending) and their rows, from its ``device_id`` column
    (one row group at a time: memory is one row group's ids). A file without that column, or
    with a null or a negative id, is refused."""
    file = entry.file
    try:
        with file.fs.open(file.path, "rb") as handle:
            parquet = pq.ParquetFile(handle, buffer_size=READ_BUFFER, pre_buffer=False)
            if DEVICE_COLUMN not in parquet.schema_arrow.names:
                raise BadInputError(f"{file.display}: {no_device_message()}; this file has no "
                                    f"{DEVICE_COLUMN} column.")
            kind = parquet.schema_arrow.field(DEVICE_COLUMN).type
            if not pa.types.is_integer(kind):
                raise BadInputError(f"{file.display}: column '{DEVICE_COLUMN}' has type {kind}; device "
                                    "ids are integers.")
            found: list[np.ndarray] = []
            counts: list[np.ndarray] = []
            for group in range(parquet.num_row_groups):
                ids = parquet.read_row_group(group, columns=[DEVICE_COLUMN], use_threads=False).column(0)
                if ids.null_count:
                    raise BadInputError(f"{file.display}, row group {group}: {ids.null_count:,} rows have no "
                                        f"{DEVICE_COLUMN}; every row of a partition file needs one.")
                values = int64_values(ids)
                if len(values) and (values.min() < 0 or values.max() > MAX_DEVICE_ID):
                    bad = int(values[(values < 0) | (values > MAX_DEVICE_ID)][0])
                    raise BadInputError(f"{file.display}, row group {group}: {DEVICE_COLUMN} {bad} is not a "
                                        f"device id (0 to {MAX_DEVICE_ID:,}).")
                devices, rows = np.unique(values, return_counts=True)
                found.append(devices.astype(np.int64))
                counts.append(rows.astype(np.int64))
    except (pa.ArrowInvalid, OSError, ValueError) as exc:
        if isinstance(exc, BadInputError):
            raise
        raise BadInputError(f"{file.display}: {no_device_message()}; this file is not readable as Parquet "
                            f"({exc}).") from None
    if len(found) == 1:
        return found[0], counts[0]
    every = np.concatenate([np.empty(0, np.int64), *found])
    order = np.argsort(every, kind="stable")
    every, rows = every[order], np.concatenate([np.empty(0, np.int64), *counts])[order]
    first = np.flatnonzero(np.r_[True, every[1:] != every[:-1]]) if len(every) else np.empty(0, np.int64)
    return every[first], (np.add.reduceat(rows, first) if len(first) else rows)


def _first_device_id(file: Location) -> int:
    """The device id in the first line of a CSV whose name does not carry one."""
    if (split_suffix(file.path) or ("", ".csv"))[1] == ".csv":
        with file.fs.open(file.path, "rb") as handle:
            first = handle.readline(4096)
    else:  # compressed: decompress (the whole file; it is read again for the conversion)
        first = read_bytes(file)[:4096].split(b"\n", 1)[0]
    field0 = first.split(b",", 1)[0].strip()
    if not first.strip():
        raise BadInputError(f"{file.display}: the file is empty; nothing to convert.")
    if not field0.isdigit() or len(field0) > 9:
        raise BadInputError(
            f"{file.display}, line 1: device_id {field0.decode('utf-8', 'replace')!r} is not a "
            "non-negative integer. Is this a raw tracker CSV export (no header, 8 columns)?"
        )
    return int(field0)
