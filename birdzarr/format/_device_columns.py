"""Devices of the device table as columns: entries and reports without an object a device.

A conversion that reads many small devices together (``_parquet.read_runs``) summarises them at
once and keeps them so until its commit spells out the table (``_device_table.details_json``):
100,000 devices' entries, ranges, reports and their lists are ~600,000 objects, which the cyclic
garbage collector walks again and again while a conversion runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from birdzarr.format._digest import digest_hex
from birdzarr.format._spec import DeviceEntry, DeviceRange, DeviceReport


@dataclass
class DeviceColumns:
    """The device-table entries and reports of devices read together, as columns.

    Device ``k`` (``device_ids`` ascending) has ``counts[k]`` windows (read and written), the
    times ``first_times[k]``..``last_times[k]``, the labels ``label_value[i]`` (``label_count[i]``
    windows) for ``label_device[i] == k`` (by device, then label), the source files
    ``names[name_at[name_bounds[k]:name_bounds[k + 1]]]`` and the report notes
    ``problems.get(k, [])``. Its windows are either stored as one run (``digests`` None): from
    global window ``starts[k]``, with the CRC-32C ``checksums[k]`` of them (the entry's one range),
    or scattered (a shuffled store): no range, and the entry's order-free digest ``digests[k]``
    (uint64, ``RowDigest``; ``starts`` and ``checksums`` then unused, empty). No entry of columns
    has a ``scattered_checksum`` (stores of that field are read, never written)."""

    device_ids: np.ndarray
    counts: np.ndarray
    starts: np.ndarray
    checksums: np.ndarray
    first_times: np.ndarray
    last_times: np.ndarray
    label_device: np.ndarray
    label_value: np.ndarray
    label_count: np.ndarray
    names: list[str]
    name_at: np.ndarray
    name_bounds: np.ndarray
    problems: dict[int, list[str]]
    digests: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.device_ids)

    @property
    def scattered(self) -> bool:
        """Whether the devices' windows are scattered (a shuffled store): no ranges, digests."""
        return self.digests is not None

    @classmethod
    def joined(cls, runs: list[DeviceColumns]) -> DeviceColumns:
        """The devices of ``runs``, one after another, as one (the names of several once); all
        stored as runs or all scattered."""
        if len(runs) == 1:
            return runs[0]
        if len({r.scattered for r in runs}) > 1:
            raise ValueError("columns of devices stored as runs and of scattered devices are not joined")
        names: dict[str, int] = {}
        name_at, problems, shift = [], {}, 0
        for r in runs:
            place = np.array([names.setdefault(name, len(names)) for name in r.names], np.int64)
            name_at.append(place[r.name_at] if len(r.name_at) else r.name_at)
            problems.update({k + shift: notes for k, notes in r.problems.items()})
            shift += len(r)
        sizes = np.array([len(r) for r in runs], np.int64)
        firsts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        name_counts = np.concatenate([np.diff(r.name_bounds) for r in runs])

        def column(name: str) -> np.ndarray:
            return np.concatenate([getattr(r, name) for r in runs])

        label_device = [r.label_device + first for r, first in zip(runs, firsts.tolist(), strict=True)]
        return cls(column("device_ids"), column("counts"), column("starts"), column("checksums"),
                   column("first_times"), column("last_times"), np.concatenate(label_device),
                   column("label_value"), column("label_count"), list(names),
                   np.concatenate([np.empty(0, np.int64), *name_at]),
                   np.concatenate(([0], np.cumsum(name_counts))).astype(np.int64), problems,
                   column("digests") if runs[0].scattered else None)

    def label_counts(self) -> list[dict[int, int]]:
        """Each device's label counts (an entry's ``label_counts``)."""
        out: list[dict[int, int]] = [{} for _ in range(len(self))]
        for k, label, count in zip(self.label_device.tolist(), self.label_value.tolist(),
                                   self.label_count.tolist(), strict=True):
            out[k][label] = count
        return out

    def sources(self) -> list[list[str]]:
        """Each device's source file names (an entry's ``sources``)."""
        names, at = self.names, self.name_at.tolist()
        return [[names[i] for i in at[a:b]]
                for a, b in zip(self.name_bounds[:-1].tolist(), self.name_bounds[1:].tolist(), strict=True)]

    def objects(self) -> list[tuple[DeviceEntry, DeviceReport]]:
        """Each device's entry and report as objects (what a ``Summarizer`` finishes with)."""
        out = []
        digests = None if self.digests is None else self.digests.tolist()
        starts = self.starts.tolist() if digests is None else [0] * len(self)
        checksums = self.checksums.tolist() if digests is None else [0] * len(self)
        for k, (device_id, count, start, crc, first, last, labels, files) in enumerate(zip(
                self.device_ids.tolist(), self.counts.tolist(), starts, checksums,
                self.first_times.tolist(), self.last_times.tolist(), self.label_counts(), self.sources(),
                strict=True)):
            if digests is not None:
                entry = DeviceEntry(device_id=device_id, sources=files, n_windows=count, first_time=first,
                                    last_time=last, label_counts=labels,
                                    scattered_digest=digest_hex(digests[k]))
            elif count:
                entry = DeviceEntry(device_id=device_id, sources=files, n_windows=count, first_time=first,
                                    last_time=last, label_counts=labels,
                                    ranges=[DeviceRange(start, start + count, f"{crc:08x}")])
            else:
                entry = DeviceEntry(device_id=device_id, sources=files)
            report = DeviceReport(rows_read=count, windows_written=count)
            for note in self.problems.get(k, ()):
                report.note(note)
            out.append((entry, report))
        return out
