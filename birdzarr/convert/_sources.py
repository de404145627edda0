"""Finding the input: a directory (or fsspec URL) of CSV parts or Parquet files, or single files.

File names carry the device id: ``{device}_{part}.csv`` (parts sort numerically: ``298_10``
after ``298_9``) or ``{device}.parquet``. A single CSV with another name takes its device id
from its first row.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from birdzarr._errors import BadInputError, StoreNotFoundError
from birdzarr._format import Curation
from birdzarr._storage import Location
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._csv import CsvDeviceReader
from birdzarr.convert._parquet import ParquetDeviceReader

Kind = Literal["csv", "parquet"]
_CSV_NAME = re.compile(r"^(\d{1,9})_(\d{1,9})\.csv$")
_PARQUET_NAME = re.compile(r"^(\d{1,9})\.parquet$")


@dataclass
class DeviceSource:
    """All input files of one device, in reading order."""

    device_id: int
    kind: Kind
    files: list[Location] = field(default_factory=list)

    def blocks(self, *, curation: Curation, on_bad_rows: str) -> Iterator[WindowBlock]:
        if self.kind == "csv":
            yield from CsvDeviceReader(self.device_id, self.files, curation, on_bad_rows).blocks()
        else:
            for file in self.files:
                yield from ParquetDeviceReader(self.device_id, file, on_bad_rows).blocks()


def _name_hint(name: str, kind: Kind) -> str:
    pattern = "{device}_{part}.csv" if kind == "csv" else "{device}.parquet"
    return (
        f"cannot tell the device id from the file name {name!r}: name files {pattern} with a "
        "numeric device id"
    )


def discover(source: Location) -> tuple[Kind, list[DeviceSource]]:
    """Classify the input and group its files per device, sorted by device id."""
    fs = source.fs
    if not fs.exists(source.path):
        raise StoreNotFoundError(f"{source.display}: no such file or directory")
    if fs.isdir(source.path):
        names = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(source.path, detail=False))
        files = [n for n in names if n.endswith((".csv", ".parquet"))]
        if not files:
            raise BadInputError(
                f"{source.display}: no .csv or .parquet files found. Point convert at a directory of "
                "{device}_{part}.csv exports or {device}.parquet files, or at one file."
            )
        kinds = {"csv" if n.endswith(".csv") else "parquet" for n in files}
        if len(kinds) > 1:
            raise BadInputError(
                f"{source.display}: holds both CSV and Parquet files; convert one kind at a time "
                "(put them in separate directories)."
            )
        kind: Kind = "csv" if kinds == {"csv"} else "parquet"
        return kind, _group(source, files, kind, single=False)
    name = posixpath.basename(source.path)
    if name.endswith(".csv"):
        return "csv", _group(source, [name], "csv", single=True)
    if name.endswith(".parquet"):
        return "parquet", _group(source, [name], "parquet", single=True)
    raise BadInputError(f"{source.display}: not a .csv or .parquet file.")


def _group(source: Location, names: list[str], kind: Kind, *, single: bool) -> list[DeviceSource]:
    base = source if not single else Location(
        url=source.url.rsplit("/", 1)[0], fs=source.fs, path=posixpath.dirname(source.path),
        storage_options=source.storage_options,
    )
    by_device: dict[int, list[tuple[int, str]]] = {}
    pattern = _CSV_NAME if kind == "csv" else _PARQUET_NAME
    for name in names:
        match = pattern.match(name)
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
            if part == next_part:  # "12.parquet" and "012.parquet", or "5_0.csv" and "05_0.csv"
                what = "the same device" if kind == "parquet" else f"the same device and part ({part})"
                raise BadInputError(
                    f"{base.display}: {name!r} and {other!r} both name {what} {device}; keep one "
                    "file per device (and part), or rename one."
                )
        devices.append(DeviceSource(device, kind, [base.child(n) for _, n in parts]))
    return devices


def _first_device_id(file: Location) -> int:
    """The device id in the first line of a CSV whose name does not carry one."""
    with file.fs.open(file.path, "rb") as handle:
        first = handle.readline(4096)
    field0 = first.split(b",", 1)[0].strip()
    if not first.strip():
        raise BadInputError(f"{file.display}: the file is empty; nothing to convert.")
    if not field0.isdigit() or len(field0) > 9:
        raise BadInputError(
            f"{file.display}, line 1: device_id {field0.decode('utf-8', 'replace')!r} is not a "
            "non-negative integer. Is this a raw tracker CSV export (no header, 8 columns)?"
        )
    return int(field0)
