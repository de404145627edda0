"""Finding the input: a directory (or fsspec URL) of CSV parts or Parquet files, or single files.

File names carry the device id: ``{device}_{part}.csv`` (parts sort numerically: ``298_10``
after ``298_9``; also ``.csv.gz`` and ``.csv.zst``, extensions in any case) or
``{device}.parquet``. A single CSV with another name takes its device id from its first row.
Every entry of a source directory is read or named: see ``find_inputs``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from birdzarr._errors import BadInputError, StoreNotFoundError
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._csv import CsvDeviceReader
from birdzarr.convert._input import CSV_SUFFIXES, read_bytes, split_suffix
from birdzarr.convert._parquet import ParquetDeviceReader
from birdzarr.format._spec import Curation
from birdzarr.storage._location import Location

Kind = Literal["csv", "parquet"]
_CSV_STEM = re.compile(r"^(\d{1,9})_(\d{1,9})$")
_PARQUET_STEM = re.compile(r"^(\d{1,9})$")
_LISTED = 10  # file names listed in an error; the rest are counted


@dataclass
class DeviceSource:
    """All input files of one device, in reading order."""

    device_id: int
    kind: Kind
    files: list[Location] = field(default_factory=list)

    def source_names(self) -> list[str]:
        """The names of its files, as the device table lists them (``sources``)."""
        return [file_name(f) for f in self.files]

    def blocks(self, *, curation: Curation, on_bad_rows: str) -> Iterator[WindowBlock]:
        if self.kind == "csv":
            yield from CsvDeviceReader(self.device_id, self.files, curation, on_bad_rows).blocks()
        else:
            for file in self.files:
                yield from ParquetDeviceReader(self.device_id, file, on_bad_rows).blocks()


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


def _name_hint(name: str, kind: Kind) -> str:
    pattern = "{device}_{part}.csv (or .csv.gz, .csv.zst)" if kind == "csv" else "{device}.parquet"
    return (
        f"cannot tell the device id from the file name {name!r}: name files {pattern} with a "
        "numeric device id"
    )


def _kind_of(name: str) -> Kind | None:
    found = split_suffix(name)
    if found is None:
        return None
    return "csv" if found[1] in CSV_SUFFIXES else "parquet"


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


def find_inputs(source: Location, *, skip_unknown_files: bool = False) -> Inputs:
    """Classify the input and group its files per device, sorted by device id.

    Every entry of a source directory is either read or named: one whose name is not an input
    file (``{device}_{part}.csv``, ``.csv.gz``, ``.csv.zst`` or ``{device}.parquet``, any case)
    raises ``BadInputError``, or with ``skip_unknown_files`` is listed in
    ``Inputs.skipped`` (and in the report). Nothing is skipped silently.
    """
    fs = source.fs
    if not fs.exists(source.path):
        raise StoreNotFoundError(f"{source.display}: no such file or directory")
    if fs.isdir(source.path):
        entries = fs.ls(source.path, detail=True)
        names, unknown = [], []
        for entry in sorted(entries, key=lambda e: str(e["name"])):
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            is_dir = entry.get("type") == "directory"
            if is_dir or _kind_of(name) is None:
                unknown.append(name + ("/" if is_dir else ""))
            else:
                names.append(name)
        if unknown and not skip_unknown_files:
            raise BadInputError(
                f"{source.display}: {len(unknown)} "
                f"{'entry is not an input file' if len(unknown) == 1 else 'entries are not input files'}"
                f": {_listed(unknown)}. Inputs are {{device}}_{{part}}.csv (also "
                ".csv.gz, .csv.zst) or {device}.parquet files; remove or rename the others, or pass "
                "--skip-unknown-files (Python: skip_unknown_files=True) to skip them and list them "
                "in the report."
            )
        if not names:
            raise BadInputError(
                f"{source.display}: no .csv, .csv.gz, .csv.zst or .parquet files found. Give a "
                "directory of {device}_{part}.csv exports or {device}.parquet files, or at one file."
            )
        kinds = {_kind_of(n) for n in names}
        if len(kinds) > 1:
            raise BadInputError(
                f"{source.display}: holds both CSV and Parquet files; convert one kind at a time "
                "(put them in separate directories)."
            )
        kind: Kind = "csv" if kinds == {"csv"} else "parquet"
        return Inputs(kind, _group(source, names, kind, single=False), unknown)
    name = posixpath.basename(source.path)
    single = _kind_of(name)
    if single is None:
        raise BadInputError(f"{source.display}: not a .csv, .csv.gz, .csv.zst or .parquet file.")
    return Inputs(single, _group(source, [name], single, single=True))


def _group(source: Location, names: list[str], kind: Kind, *, single: bool) -> list[DeviceSource]:
    base = source if not single else Location(
        url=source.url.rsplit("/", 1)[0], fs=source.fs, path=posixpath.dirname(source.path),
        storage_options=source.storage_options,
    )
    by_device: dict[int, list[tuple[int, str]]] = {}
    pattern = _CSV_STEM if kind == "csv" else _PARQUET_STEM
    for name in names:
        stem = (split_suffix(name) or (name, ""))[0]
        match = pattern.match(stem)
        if match is None:
            if single and kind == "csv":
                by_device.setdefault(_first_device_id(base.child(name)), []).append((0, name))
                continue
            raise BadInputError(f"{base.display}/{name}: {_name_hint(name, kind)}.")
        device = int(match.group(1))
        part = int(match.group(2)) if kind == "csv" else 0
        by_device.setdefault(device, []).append((part, name))
    devices = []
    for device in sorted(by_device):
        parts = sorted(by_device[device])
        for (part, name), (next_part, other) in zip(parts, parts[1:], strict=False):
            if part == next_part:  # "12.parquet" and "012.parquet", "5_0.csv" and "5_0.CSV" or "5_0.csv.gz"
                what = "the same device" if kind == "parquet" else f"the same device and part ({part})"
                raise BadInputError(
                    f"{base.display}: {name!r} and {other!r} both name {what} {device}; keep one "
                    "file per device (and part), or rename one."
                )
        devices.append(DeviceSource(device, kind, [base.child(n) for _, n in parts]))
    return devices


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
