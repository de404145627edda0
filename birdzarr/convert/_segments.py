"""A device-order conversion as tasks: the store cut into segments of devices and device parts.

Threads share one GIL. A Parquet conversion on threads holds it for about 44% of its CPU time
(``py-spy record --gil``, 1 M windows on 2 workers: 0.89 of 2.0 CPU s), so no number of
threads makes it use more than about 2.3 cores. Here each *segment* (consecutive whole devices,
about ``total / (SEGMENTS_PER_WORKER x width)`` windows) is converted by one task
(``convert_segment``) on an engine's worker (``_engine.py``: a forked worker process, or a Dask
worker), start to end: read, summarised (row count, checksum, labels, times), checked for
repeated windows, and every chunk that lies wholly inside it encoded and written. The windows of
a chunk that two segments share (at most the first and the last chunk of a segment) come back to
this process, which writes that chunk once all its windows have arrived.

Every window's place must be known before the tasks start (``count_devices``): each device's
window count comes from its Parquet footers where ``on_bad_rows="error"`` makes them exact (a
bad row fails the conversion); other Parquet devices (``on_bad_rows="skip"``) are read once to
count them, by tasks on the engine. CSV, whose counting would cost most of its conversion, is
converted part by part instead (``_pipeline.py``). Every engine runs the same segments: forked
worker processes, a Dask cluster, threads of this process or this thread (``_engine.py``); a
segment whose engine has more width than segments reads ahead and encodes on threads of its own.

The store is byte-identical on every engine and with any number of workers: same window order and
chunking, chunks encoded by the same code, the device table from the same ``Summarizer``.

Format 2's dictionary rows are numbered in store order, but a segment knows only its own: it
numbers them from 0, and once every segment before it is in, the collector knows its shift and
runs it as a task on the engine (``shift_rows``: its gimu_row chunks read and written again, 4
bytes a window) beside the segments still running. Shifted one after another at the end, in
this process, they kept 16 workers at 3.37x the MB/s of 2 on 5 M windows; as tasks, 4.34x
(``python benchmarks/convert.py --windows 5000000 --workers 2 16``, a 16-core GPU node).

An append (``_append.py``) runs the same segments, placed after the committed windows
(``plan_segments``' ``first``): the chunk the commit ends inside is shared with the commit, its
committed windows read back and written again with the new ones (``AppendTo.shared``); format
2's segments number their new rows from the committed count, each extended device continuing its
latest committed row (``Continuation``), and the collector shifts only the new row numbers.

A device of more than ``PART_WINDOWS`` windows whose window offsets the footers give (per-device
Parquet files read with ``on_bad_rows="error"``) is planned as *parts* (``split_large``): window
ranges cut at row-group boundaries, the first at or after each multiple of ``PART_WINDOWS``. A
part is planned as a device is, so a device's parts may land in different segments; its task
reads only the part's row groups and sends back the part's summary and duplicate keys
(``PartResult``), which this process merges once every part is in (``_summary.merge_parts``: the
checksums joined by ``crc32c_combine``; ``_duplicates.repeated_in_parts``). Format 2 closes the
device's row at each part's end, as at ``MAX_ENTRIES``. CSV, partition files and ``skip`` (whose
offsets are known only once read) and appends are not split.

Small devices of partition files are read, summarised, checked and coded together, runs of
consecutive devices of at most ``RUN_WINDOWS`` windows (``_parquet.read_runs``): no reader, block,
summariser or duplicate keys a device; any other device is read on its own, block by block.

Memory: each task holds one reader batch (16,384 windows) or one run of small devices (at most
``RUN_WINDOWS`` windows, and their hashes), one slab (``SLAB_WINDOWS``, 65,536 windows of all the
per-window arrays, at least one chunk), the duplicate check's 8 B a window of the device it reads,
and at most two chunks of shared windows; this process
holds the shared windows of segments whose neighbours have not finished yet (at most two chunks
a segment) and, for each split device whose parts are not all in, its parts' distinct window
hashes (8 bytes a window of the parts received), whose repeats it counts range by range
(``repeated_in_parts``: at most 65,536 hashes of each part at once, not one joined and sorted
copy of them all). Splitting a device changes no worker's bound (a part is read as a device is,
one reader batch of one row group at a time); what it adds is in this process: the parts'
hashes until the last part is in, and each part's result while it is unpickled.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from birdzarr._errors import BadInputError
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._duplicates import (
    DeviceKeys,
    DuplicateCounter,
    PartKeys,
    repeated_in_parts,
    repeated_in_runs,
    repeated_windows,
)
from birdzarr.convert._engine import Engine, Runner, run_all
from birdzarr.convert._parquet import clear_group_cache, names_its_device, read_runs, row_group_rows
from birdzarr.convert._pipeline import bar_counter, count_on_bar
from birdzarr.convert._readahead import read_ahead
from birdzarr.convert._slabs import SlabWriter, writable_arrays
from birdzarr.convert._sources import DeviceSource, file_name
from birdzarr.convert._summary import DeviceSummary, Summarizer, merge_parts, summarize_run_columns
from birdzarr.convert._writer import SLABS_IN_FLIGHT, Writer
from birdzarr.format import _v2
from birdzarr.format._device_columns import DeviceColumns
from birdzarr.format._digest import window_hashes
from birdzarr.format._rows import RowCoder, shared_groups
from birdzarr.format._spec import DEVICE, LABEL, TIMESTAMP, Curation, DeviceReport
from birdzarr.storage._location import Location, resolve

# Segments per worker: more, smaller segments even out devices of different sizes at the end of
# a conversion; each costs the store's metadata read once and up to two chunks sent back here
SEGMENTS_PER_WORKER = 4
MIN_SEGMENT_CHUNKS = 8  # a segment of fewer chunks would send back a large share of its windows
SLAB_CHUNKS = 8  # chunks of gimu_row shifted at a time (format 2's row numbers of later segments)
# Local input smaller than this (bytes) is converted on threads, in either order and either input
# kind (``_engine.processes_pay``): starting worker processes costs more than they save.
PROCESS_MIN_BYTES = 64 << 20
# Consecutive devices of partition files of at most this many windows in all are read, summarised,
# checked for repeats and coded together (``read_runs``); a larger device is read on its own.
RUN_WINDOWS = 16_384
# A device of more windows than this (per-device Parquet files read with on_bad_rows="error") is
# planned as parts of about this many windows, cut at its row groups' boundaries (``split_large``).
# pyarrow's default row group (1,048,576 rows): a file written with default settings splits at
# every row group. A part is seconds of a worker's CPU, so what a part costs beyond its windows
# (opening the store, its first and last chunk sent back, a dictionary row, its duplicate keys
# sent back) is small. A constant of the input alone, never of the workers or the executor: the
# parts, and so the store's bytes (format 2's rows close at a part's end), are the same on every
# engine and with any number of workers.
PART_WINDOWS = 1 << 20


def count_device(device: DeviceSource, curation: Curation, on_bad_rows: str) -> int:
    """Windows the device will produce: from its Parquet footers where that is exact (Parquet
    read with ``on_bad_rows="error"``: a bad row fails the conversion anyway), else by reading
    and curating it once."""
    if (counted := footer_count(device, on_bad_rows)) is not None:
        return counted
    return sum(len(block) for block in device.blocks(curation=curation, on_bad_rows=on_bad_rows))


def footer_count(device: DeviceSource, on_bad_rows: str) -> int | None:
    """The device's windows from its Parquet footers, or None where they do not give them exactly
    (CSV, ``on_bad_rows="skip"``, an unreadable footer: reading the device raises the proper error)."""
    if device.kind != "parquet" or on_bad_rows != "error" or device.partition_rows is None:
        return None
    try:
        import pyarrow.parquet as pq

        from birdzarr.convert._parquet import names_its_device

        total = device.partition_rows  # its rows in partition files, counted by find_inputs
        for file in device.files:
            if names_its_device(file) is None:  # a partition file: counted above
                continue
            with file.fs.open(file.path, "rb") as handle:
                total += pq.ParquetFile(handle).metadata.num_rows
        return total
    except Exception:  # noqa: BLE001 - unreadable: reading it raises the proper error
        return None


def count_devices(devices: list[DeviceSource], *, curation: Curation, on_bad_rows: str,
                  engine: Engine | None = None) -> list[int]:
    """Every device's windows: from footers, read here on threads (one small read a file); the
    devices whose footers do not tell are read and curated once on ``engine``'s workers (tasks of
    consecutive devices), or here without one."""
    from concurrent.futures import ThreadPoolExecutor

    # a device of partition files alone: its rows there, counted by find_inputs (no file read
    # and no thread's task a device); the rest from their files' footers, on threads
    partition: dict[str, bool] = {}
    counts: list[int | None] = [
        device.partition_rows if on_bad_rows == "error" and _partition_only(device, partition) else None
        for device in devices]
    footers = [i for i, c in enumerate(counts) if c is None]
    if footers:
        with ThreadPoolExecutor(max(1, min(16, len(footers)))) as threads:
            from_footers = threads.map(lambda i: footer_count(devices[i], on_bad_rows), footers)
            for i, count in zip(footers, from_footers, strict=True):
                counts[i] = count
    left = [i for i, c in enumerate(counts) if c is None]
    if left:
        width = 1 if engine is None else engine.width
        size = max(1, math.ceil(len(left) / (SEGMENTS_PER_WORKER * width)))
        batches = [[devices[i] for i in left[at : at + size]] for at in range(0, len(left), size)]
        if engine is None:
            found = [count_batch(batch, curation, on_bad_rows) for batch in batches]
        else:
            found = run_all(engine, count_batch, [(batch,) for batch in batches], curation=curation,
                            on_bad_rows=on_bad_rows)
        for i, count in zip(left, (c for batch in found for c in batch), strict=True):
            counts[i] = count
    return [int(c) for c in counts if c is not None]


def _partition_only(device: DeviceSource, partition: dict[str, bool]) -> bool:
    """Whether the device's windows all come from partition files (``partition``: each file URL
    seen so far -> whether it is one, a partition file being listed by each of its devices)."""
    if device.kind != "parquet" or not device.files:
        return False
    for file in device.files:
        known = partition.get(file.url)
        if known is None:
            known = partition[file.url] = names_its_device(file) is None
        if not known:
            return False
    return True


def count_batch(devices: list[DeviceSource], curation: Curation, on_bad_rows: str) -> list[int]:
    """``count_device`` for consecutive devices (one task); devices of partition files alone with
    at most ``RUN_WINDOWS`` rows in all are read together (``read_runs``, which reads them only
    where every row is a window: their counts are then their rows), the rest one by one."""
    partition: dict[str, bool] = {}
    counts: list[int] = []
    at = 0
    while at < len(devices):
        end, rows = at, 0
        while end < len(devices):
            known = devices[end].partition_rows
            if known is None or rows + known > RUN_WINDOWS or not _partition_only(devices[end], partition):
                break
            rows += known
            end += 1
        found = read_runs([(d.device_id, d.files) for d in devices[at:end]]) if end > at else None
        if found is not None:
            counts.extend(found.counts.tolist())
            at = end
            continue
        counts.extend(count_device(d, curation, on_bad_rows) for d in devices[at: max(end, at + 1)])
        at = max(end, at + 1)
    return counts


def part_cuts(group_rows: list[int], part_windows: int) -> list[int]:
    """Where a device of row groups of ``group_rows`` rows (in reading order) is cut into parts:
    for each multiple of ``part_windows`` inside the device, the first row-group boundary at or
    after it (ascending, distinct, never 0 or the device's end). A pure function of the footers."""
    ends = np.cumsum(np.asarray(group_rows, np.int64))
    total = int(ends[-1]) if len(ends) else 0
    cuts: list[int] = []
    for target in range(part_windows, total, part_windows):
        k = int(np.searchsorted(ends, target, side="left"))  # the first boundary at or after it
        if k < len(ends) and int(ends[k]) < total and (not cuts or int(ends[k]) > cuts[-1]):
            cuts.append(int(ends[k]))
    return cuts


def device_parts(device: DeviceSource, layout: list[list[int]],
                 part_windows: int) -> list[tuple[DeviceSource, int]]:
    """``device`` as parts (``DevicePart``) and their windows: ``layout[f]`` the rows of each row
    group of its file ``f``; cut by ``part_cuts``. A file without row groups goes with the part
    its place falls in; a file's ignored columns are named by the part of its first row group."""
    from birdzarr.convert._sources import DevicePart

    flat = [(f, g, rows) for f, groups in enumerate(layout) for g, rows in enumerate(groups)]
    cuts = part_cuts([rows for _, _, rows in flat], part_windows)
    if not cuts:
        return [(device, sum(rows for _, _, rows in flat))]
    pieces: list[list[tuple[int, list[int], bool]]] = [[] for _ in range(len(cuts) + 1)]
    windows = [0] * (len(cuts) + 1)
    position = 0
    for f, groups in enumerate(layout):
        if not groups:  # no rows: read (for its schema and notes) by the part it falls in
            pieces[bisect.bisect_right(cuts, position)].append((f, [], True))
        for g, rows in enumerate(groups):
            k = bisect.bisect_right(cuts, position)
            mine = pieces[k]
            if mine and mine[-1][0] == f:
                mine[-1][1].append(g)
            else:
                mine.append((f, [g], g == 0))
            windows[k] += rows
            position += rows
    parts = len(pieces)
    return [(dataclasses.replace(device, part=DevicePart(k, parts, tuple(
                (f, tuple(groups), noted) for f, groups, noted in files))), windows[k])
            for k, files in enumerate(pieces)]


def split_large(devices: list[DeviceSource], counts: list[int], *, on_bad_rows: str,
                part_windows: int | None = None) -> tuple[list[DeviceSource], list[int]]:
    """The devices to plan (``plan_segments``) and their windows, each device of more than
    ``part_windows`` (default ``PART_WINDOWS``) windows replaced by its parts (``device_parts``),
    consecutive, in order. Only devices whose window offsets the footers give before any reading
    are split: per-device Parquet files read with ``on_bad_rows="error"``. CSV, partition files
    and ``skip`` (whose windows are known only once read) stay whole, as does a device whose
    footers do not add up to its count (reading it raises the proper error)."""
    limit = PART_WINDOWS if part_windows is None else part_windows
    if on_bad_rows != "error":
        return devices, counts
    large = [k for k, (device, count) in enumerate(zip(devices, counts, strict=True))
             if count > limit and device.kind == "parquet" and device.part is None and device.files
             and device.partition_rows == 0 and all(names_its_device(f) is not None for f in device.files)]
    if not large:
        return devices, counts
    out_devices: list[DeviceSource] = []
    out_counts: list[int] = []
    at = 0
    for k in large:
        out_devices += devices[at:k]
        out_counts += counts[at:k]
        at = k + 1
        try:
            layout = [row_group_rows(file) for file in devices[k].files]
        except Exception:  # noqa: BLE001 - unreadable: reading it whole raises the proper error
            layout = None
        if layout is None or sum(map(sum, layout)) != counts[k]:
            out_devices.append(devices[k])
            out_counts.append(counts[k])
            continue
        for part, count in device_parts(devices[k], layout, limit):
            out_devices.append(part)
            out_counts.append(count)
    out_devices += devices[at:]
    out_counts += counts[at:]
    return out_devices, out_counts


def input_bytes(devices: list[DeviceSource]) -> int:
    """The input's size (a partition file, listed by each of its devices, once)."""
    files = {f.url: f for d in devices for f in d.files}
    return sum(int(f.fs.size(f.path) or 0) for f in files.values())


@dataclass(frozen=True)
class Segment:
    """Global windows ``[start, stop)``: whole devices or parts of split ones (``split_large``),
    each with its first window and count, and the groups of its devices whose dictionary rows
    share entries (``_rows.shared_groups``)."""

    start: int
    stop: int
    devices: list[tuple[DeviceSource, int, int]]
    shares: list[list[int]] = field(default_factory=list)


def plan_segments(devices: list[DeviceSource], counts: list[int], *, workers: int,
                  chunk_windows: int, first: int = 0, alone: AbstractSet[int] = frozenset()) -> list[Segment]:
    """Consecutive devices grouped into segments of at least the target size (the last may be
    smaller); every device in exactly one segment, in order, the first from window ``first`` (an
    append's: the committed count). One worker: one segment (nothing to even out). Small devices
    share dictionary entries in groups (``_rows.shared_groups``; ``alone``: devices that
    continue committed rows), and a segment ends only where a group does, so the groups, and
    the store, do not depend on the number of workers. ``devices`` may hold the parts of split
    devices (``split_large``): a split device shares no entries, and its parts may land in
    different segments."""
    ids = [device.device_id for device in devices]
    split = {device.device_id for device in devices if device.part is not None}
    groups = shared_groups(ids, counts, alone=alone | split)
    group_of = {d: k for k, group in enumerate(groups) for d in group}
    total = sum(counts)
    if workers <= 1:
        starts = first + np.cumsum([0, *counts[:-1]])
        return [Segment(first, first + total,
                        [(d, int(at), c) for d, c, at in zip(devices, counts, starts, strict=True)], groups)]
    target = max(math.ceil(total / (SEGMENTS_PER_WORKER * workers)), MIN_SEGMENT_CHUNKS * chunk_windows)
    segments: list[Segment] = []
    members: list[tuple[DeviceSource, int, int]] = []
    start = position = first
    for k, (device, count) in enumerate(zip(devices, counts, strict=True)):
        members.append((device, position, count))
        position += count
        group = group_of.get(ids[k])
        inside = group is not None and k + 1 < len(ids) and group_of.get(ids[k + 1]) == group
        if position - start >= target and not inside:
            segments.append(_segment(start, position, members, groups, group_of))
            members, start = [], position
    if members:
        segments.append(_segment(start, position, members, groups, group_of))
    return segments


def _segment(start: int, stop: int, members: list[tuple[DeviceSource, int, int]],
             groups: list[list[int]], group_of: dict[int, int]) -> Segment:
    inside = sorted({group_of[d.device_id] for d, _, _ in members if d.device_id in group_of})
    return Segment(start, stop, members, [groups[k] for k in inside])


@dataclass
class SharedChunkPart:
    """Windows ``[start, start + len)`` of chunk ``chunk``, which another segment shares."""

    chunk: int
    start: int
    data: dict[str, np.ndarray]  # the per-window arrays' rows (gimu or format 2's, device, timestamp, label)

    def __len__(self) -> int:
        return len(self.data[DEVICE])


@dataclass(frozen=True)
class Continuation:
    """What a segment of an append needs to know of the committed store: format 2's committed
    row count (its new rows are numbered from there) and the latest committed row of each device
    it extends (``_rows.latest_rows``: they are continued, frozen, as ``RowCoder.appending_to``
    does); and the devices it extends, whose duplicate-check keys come back to be compared with
    their committed windows (``SegmentCollector``'s ``existing``)."""

    first_row: int = 0
    rows: dict[int, tuple[int, list[np.ndarray]]] = field(default_factory=dict)
    extended: frozenset[int] = frozenset()


@dataclass
class SegmentResult:
    summaries: list[DeviceSummary]
    repeated: dict[int, int]  # device id -> windows that repeat another of its windows
    shared: list[SharedChunkPart] = field(default_factory=list)
    # format 2: the dictionary rows the segment opened, numbered from 0 (and its gimu_row chunks
    # so written): the collector shifts them after the rows of the segments before it
    rows: _v2.Dictionaries | None = None
    # an append's extended devices: their duplicate-check keys (``Continuation.extended``)
    keys: dict[int, DeviceKeys] = field(default_factory=dict)
    # the summaries of devices read together (``place_runs``), as columns, in store order
    runs: list[DeviceColumns] = field(default_factory=list)
    # the parts of split devices (``split_large``) the segment read: merged in this process
    parts: list[PartResult] = field(default_factory=list)


@dataclass
class PartResult:
    """One part of a split device: its summary (a ``Summarizer`` of the part's windows alone) and
    its duplicate-check keys; ``SegmentCollector`` merges them once every part is in."""

    device_id: int
    index: int
    summary: DeviceSummary
    keys: PartKeys


# -- in a worker process -------------------------------------------------------------------------
def whole_chunks(start: int, stop: int, chunk_windows: int) -> tuple[int, int]:
    """The windows of the chunks lying wholly inside ``[start, stop)`` (``(0, 0)``: none)."""
    first = -(-start // chunk_windows) * chunk_windows
    last = stop // chunk_windows * chunk_windows
    return (first, last) if first < last else (0, 0)


class ChunkRouter:
    """Sends the windows of ``[start, stop)``, in order, to a slab writer (the chunks wholly
    inside: ``whole_chunks``, the writer starting at the first) or to the parts of the chunks
    the range shares with its neighbours."""

    def __init__(self, start: int, stop: int, slabs: SlabWriter) -> None:
        self.chunk_windows = slabs.chunk_windows
        self.whole = whole_chunks(start, stop, self.chunk_windows)
        self.slabs = slabs
        self.parts: dict[int, list[tuple[int, int, WindowBlock]]] = {}  # chunk -> (start, device, rows)

    def add(self, device_id: int, block: WindowBlock, position: int) -> None:
        inside = self.whole[0] <= position and position + len(block) <= self.whole[1]
        if block.coded is None and not (inside and block.devices is None):
            # coded here, before routing (a shared chunk's windows), after the blocks waiting in
            # the slab writer; a block wholly in whole chunks waits there (SlabWriter.code_pending)
            block = self.slabs.code(device_id, block)
        end, at = position + len(block), position
        while at < end:
            if self.whole[0] <= at < self.whole[1]:
                stop = min(end, self.whole[1])
                self.slabs.add(device_id, block.part(at - position, stop - position))
            else:
                chunk = at // self.chunk_windows
                stop = min(end, (chunk + 1) * self.chunk_windows)
                part = block.part(at - position, stop - position)
                self.parts.setdefault(chunk, []).append((at, device_id, part))
            at = stop

    def shared(self) -> list[SharedChunkPart]:
        out = []
        for chunk, pieces in sorted(self.parts.items()):
            blocks = [block for _, _, block in pieces]
            out.append(SharedChunkPart(chunk, pieces[0][0], {
                _v2.CODES: np.concatenate([b.coded[0] for b in blocks if b.coded is not None]),
                _v2.GPS: np.concatenate([b.windows[:, :, 3] for b in blocks]),
                _v2.ROW: np.concatenate([b.coded[1] for b in blocks if b.coded is not None]),
                DEVICE: np.concatenate([np.full(len(b), d, dtype=np.int32) if b.devices is None
                                        else b.devices for _, d, b in pieces]),
                TIMESTAMP: np.concatenate([b.timestamps for b in blocks]),
                LABEL: np.concatenate([b.labels for b in blocks]),
            }))
        return out


def miscounted(device_id: int, count: int, found: int) -> BadInputError:
    return BadInputError(
        f"device {device_id}: counted {count:,} windows before the conversion "
        f"(from its Parquet footers, or by reading it), but reading gave "
        f"{found:,}; did the input change during the conversion? "
        "Convert again."
    )


def convert_segment(segment: Segment, dest_url: str, dest_options: dict[str, Any], curation: Curation,
                    on_bad_rows: str, threads: int = 1,
                    progress: Callable[[int], None] | None = None,
                    continuation: Continuation | None = None) -> SegmentResult:
    """Read, summarise and write one segment (in a worker process): its whole chunks go to the
    store, the windows of the chunks it shares come back. ``threads`` > 1: each device is read
    a few blocks ahead on a thread and slabs are encoded on ``threads`` threads (the engine has
    fewer segments than width); ``progress`` (a task in this process) is told the windows of
    each block as it is placed; ``continuation``: an append's segment."""
    import zarr

    from birdzarr.storage._location import zarr_store

    location = resolve(dest_url, dest_options)
    group = zarr.open_group(zarr_store(location, read_only=False), mode="r+", zarr_format=3)
    arrays = writable_arrays(group)  # sized by the writer before any worker started
    first = whole_chunks(segment.start, segment.stop, int(arrays[DEVICE].chunks[0]))[0]
    more = continuation or Continuation()
    coder = RowCoder.continuing(more.rows, first_row=more.first_row) if _v2.CODES in arrays else None
    if coder is not None:
        coder.share(segment.shares)
    slabs = SlabWriter(location, arrays, start=first, workers=threads,
                       in_flight=0 if threads <= 1 else SLABS_IN_FLIGHT, coder=coder)
    router = ChunkRouter(segment.start, segment.stop, slabs)
    result = SegmentResult([], {})
    members = segment.devices
    partition: dict[str, bool] = {}  # file URL -> a partition file (no device in its name)

    def small(device: DeviceSource, count: int) -> bool:
        """Read with other devices (``place_runs``): a device of partition files alone, of at
        most ``RUN_WINDOWS`` windows, whose duplicate keys need not come back (not extended)."""
        return (count <= RUN_WINDOWS and device.device_id not in more.extended
                and _partition_only(device, partition))

    def place_runs(run: list[tuple[DeviceSource, int, int]]) -> bool:
        """Consecutive small devices read, summarised, checked for repeats and routed at once,
        as one block of many devices (False: they must be read one by one)."""
        found = read_runs([(device.device_id, device.files) for device, _, _ in run])
        if found is None:
            return False
        expected = np.fromiter((count for _, _, count in run), np.int64, len(run))
        if not np.array_equal(found.counts, expected):
            k = int(np.flatnonzero(found.counts != expected)[0])
            raise miscounted(run[k][0].device_id, int(expected[k]), int(found.counts[k]))
        ids = [device.device_id for device, _, _ in run]
        problems: dict[int, list[str]] = {}
        if found.notes:
            reports = found.reports
            problems = {k: reports[k].problems for k in found.noted_devices()}
        result.runs.append(summarize_run_columns(
            np.asarray(ids, np.int64), np.fromiter((first for _, first, _ in run), np.int64, len(run)),
            found.counts, found.windows, found.timestamps, found.labels, [file_name(f) for f in found.files],
            found.file_at, found.file_bounds, problems))
        repeated = repeated_in_runs(window_hashes(found.windows, found.timestamps), found.counts)
        for k in np.flatnonzero(repeated).tolist():
            result.repeated[ids[k]] = int(repeated[k])
        if len(found.windows):
            block = WindowBlock(found.windows, found.timestamps, found.labels, DeviceReport(),
                                devices=found.devices.astype(np.int32))
            if coder is not None:
                slabs.code_pending()  # the blocks of devices before, waiting uncoded, first
                block.coded = coder.code_runs(found.devices, found.windows)
                coder.close_devices(np.asarray(ids, np.int64))
            router.add(ids[0], block, run[0][1])
            if progress is not None:
                progress(len(block))
        return True

    def one_device(device: DeviceSource, first: int, count: int) -> None:
        summary = Summarizer(device.device_id, device.source_names(), first)
        keys = DeviceKeys()
        position = first
        blocks = (read_ahead(device, curation, on_bad_rows) if threads > 1 else
                  device.blocks(curation=curation, on_bad_rows=on_bad_rows))
        for block in blocks:
            summary.add(block)
            if not len(block):
                continue
            if position + len(block) > first + count:
                break  # more windows than counted: reported below
            keys.add(block)
            router.add(device.device_id, block, position)
            position += len(block)
            if progress is not None:
                progress(len(block))
        finished = summary.finish()
        if position != first + count or finished.entry.n_windows != count:
            raise miscounted(device.device_id, count, finished.entry.n_windows)
        if coder is not None:
            # once its blocks waiting in the slab are coded; a part's row closes at the part's
            # end, so the next part opens a row of its own, in this segment or another
            slabs.close_device(device.device_id)
        if device.part is not None:  # merged, and its repeats counted, in this process
            result.parts.append(PartResult(device.device_id, device.part.index, finished, PartKeys.of(keys)))
            return
        result.summaries.append(finished)
        if device.device_id in more.extended:
            result.keys[device.device_id] = keys
        elif repeated := keys.repeated():
            result.repeated[device.device_id] = repeated

    try:
        at = 0
        while at < len(members):
            end, windows = at, 0
            while (end < len(members) and windows + members[end][2] <= RUN_WINDOWS
                   and small(members[end][0], members[end][2])):
                windows += members[end][2]
                end += 1
            if end > at and place_runs(members[at:end]):
                at = end
                continue
            for device, first, count in members[at: max(end, at + 1)]:
                one_device(device, first, count)
            at = max(end, at + 1)
        slabs.drain()
    finally:
        slabs.close()
    result.shared = router.shared()
    result.rows = None if coder is None else coder.new_rows()
    return result


# -- in this process -----------------------------------------------------------------------------
class SegmentCollector:
    """What the segments' workers send back, taken in any order: the device summaries, the
    repeated-window counts, and the windows of shared chunks, each chunk written here once all
    its windows are in. Sizes the store's arrays for all segments first (before any worker opens
    them), and records every device in store order at the end."""

    def __init__(self, writer: Writer, segments: list[Segment], *,
                 duplicates: DuplicateCounter | None, bar: Any | None,
                 write_chunk: Callable[[int, int, dict[str, np.ndarray]], Any] | None = None,
                 count_segments: bool = True, append: AppendTo | None = None) -> None:
        self.writer, self.segments, self.duplicates, self.bar = writer, segments, duplicates, bar
        self.append = append or AppendTo()
        self.count_segments = count_segments  # False: the tasks count their windows on the bar
        # how a shared chunk is written once complete (default: encoded here, by the writer's sink)
        self.write_chunk = write_chunk or writer.slabs.sink.write
        first = self.append.committed
        self.total = segments[-1].stop if segments else first
        self.chunk_windows = writer.slabs.chunk_windows
        self.summaries: dict[int, DeviceSummary] = {}
        self.runs: dict[int, DeviceColumns] = {}  # by their first device
        # split devices: their parts' results until every part is in (then merged into summaries)
        self.parts: dict[int, dict[int, PartResult]] = {}
        self.split = {device.device_id: device for segment in segments
                      for device, _, _ in segment.devices if device.part is not None}
        self.waiting: dict[int, list[SharedChunkPart]] = {}
        # format 2: each segment's rows (by its first window) and shared chunks' parts (with the
        # segment they came from), held until the segments before it are in: then its shift is
        # known (``_number_rows``)
        self.rows: dict[int, _v2.Dictionaries] = {}
        self.held: dict[int, list[SharedChunkPart]] = {}
        self.in_order = sorted(segments, key=lambda s: s.start)
        self.numbered = 0  # segments of in_order whose rows are numbered
        # rows and entries before the next segment to number: an append's come after the
        # committed ones; committed row numbers (continued rows) stay as they are
        self.rows_before, self.values_before = 0, self.append.values
        self.shifts: list[RowShift] = []  # whole chunks' row numbers to shift (``take_shifts``)
        writer.reserve(self.total - first)
        if self.append.shared is not None and self.total > first:  # the chunk it shares with the commit
            self.waiting[self.append.shared.chunk] = [self.append.shared]
        if bar is not None:
            bar.reset(total=self.total - first)

    def add(self, segment: Segment, result: SegmentResult) -> None:
        for summary in result.summaries:
            self.summaries[summary.entry.device_id] = summary
        for runs in result.runs:
            if len(runs):
                self.runs[int(runs.device_ids[0])] = runs
        for piece in result.parts:
            self._add_part(piece)
        # format 2 rows numbered in the segment are shifted once the segments before it are in
        # (a shuffle's are global already)
        if result.rows is not None:
            self.rows[segment.start] = result.rows
            self.held[segment.start] = result.shared
            self._number_rows()
        for part in result.shared if result.rows is None else ():
            self._share(part)
        if self.duplicates is not None:
            for device_id, repeated in result.repeated.items():
                self.duplicates.add(device_id, repeated)
            for device_id, keys in result.keys.items():  # compared with its committed windows
                existing = self.append.existing(device_id) if self.append.existing else None
                self.duplicates.add(device_id, repeated_windows(keys.hashes, keys.times, existing)
                                    if keys.hashes else 0)
        if self.bar is not None and self.count_segments:
            count_on_bar(self.bar, segment.stop - segment.start)

    def _add_part(self, part: PartResult) -> None:
        """A part of a split device; once all are in, the device's summary (``merge_parts``) and
        its repeated windows (``repeated_in_parts``)."""
        device = self.split[part.device_id]
        assert device.part is not None
        held = self.parts.setdefault(part.device_id, {})
        held[part.index] = part
        if len(held) < device.part.parts:
            return
        del self.parts[part.device_id]
        ordered = [held[k] for k in range(device.part.parts)]
        self.summaries[part.device_id] = merge_parts([p.summary for p in ordered], device.source_names())
        if self.duplicates is not None:
            self.duplicates.add(part.device_id, repeated_in_parts([p.keys for p in ordered]))

    def take_shifts(self) -> list[RowShift]:
        """The row shifts found since the last call, for the caller to run (``shift_rows``, as
        tasks on the engine); every one must have run before the store is committed."""
        shifts, self.shifts = self.shifts, []
        return shifts

    def finish(self) -> None:
        """Record every device (after every segment's result was added, and every shift run)."""
        assert not self.rows or self.numbered == len(self.in_order), "every segment's rows were numbered"
        assert not self.shifts, "every row shift was taken"
        assert not self.waiting, "every shared chunk was written"
        assert not self.parts, "every part of a split device was merged"
        for segment in self.segments:
            members, at = segment.devices, 0
            while at < len(members):
                part = members[at][0].part
                if part is not None and part.index:  # recorded at its first part
                    at += 1
                    continue
                device_id = members[at][0].device_id
                runs = self.runs.get(device_id)
                if runs is None:
                    self.writer.record(self.summaries[device_id])
                    at += 1
                else:  # consecutive devices of the segment
                    self.writer.record_runs(runs)
                    at += len(runs)

    def _number_rows(self) -> None:
        """Format 2: every segment numbered its rows from 0; each segment whose predecessors are
        all in is shifted after their rows (the numbers one process writing in store order
        gives): its rows go to the writer, its whole chunks' row numbers to ``shifts`` (read and
        written again, 4 bytes a window, by tasks on the engine, while later segments still
        run) and its shared windows, shifted here, to their chunks."""
        committed = self.append.first_row
        while self.numbered < len(self.in_order) and self.in_order[self.numbered].start in self.rows:
            segment = self.in_order[self.numbered]
            opened, by = self.rows[segment.start], self.rows_before
            self.writer.add_rows(_v2.Dictionaries(opened.values, opened.start + self.values_before,
                                                  opened.device))
            self.rows_before += opened.n_rows
            self.values_before += len(opened.values)
            self.numbered += 1
            first, last = whole_chunks(segment.start, segment.stop, self.chunk_windows)
            if by and first < last:
                self.shifts.append(RowShift(first, last, by, committed))
            for part in self.held.pop(segment.start):
                part.data[_v2.ROW] = _shifted(part.data[_v2.ROW], by, committed)
                self._share(part)

    def _share(self, part: SharedChunkPart) -> None:
        parts = self.waiting.setdefault(part.chunk, [])
        parts.append(part)
        start = part.chunk * self.chunk_windows
        stop = min(start + self.chunk_windows, self.total)
        if sum(len(p) for p in parts) < stop - start:
            return
        del self.waiting[part.chunk]
        parts.sort(key=lambda p: p.start)
        data = {name: np.concatenate([p.data[name] for p in parts]) for name in parts[0].data}
        if self.append.shared is not None and part.chunk == self.append.shared.chunk:
            # the chunk an append shares with the commit, which readers may be reading: through
            # zarr, whose local writes replace a file whole (a temporary file, renamed)
            for name, array in self.writer.slabs.arrays.items():
                array[start:stop] = data[name]
            return
        self.write_chunk(start, stop, data)


@dataclass
class AppendTo:
    """An append's segments (``SegmentCollector``): the committed windows, the committed part of
    the chunk the first new window falls in (written again with the new windows, None where the
    commit ends on a chunk boundary), format 2's committed rows and entries, and the committed
    hashes of an extended device's windows (``_append._committed_hashes``)."""

    committed: int = 0
    shared: SharedChunkPart | None = None
    first_row: int = 0
    values: int = 0
    existing: Callable[[int], Callable[[np.ndarray], np.ndarray] | None] | None = None


@dataclass(frozen=True)
class RowShift:
    """Format 2: windows ``[first, last)`` (whole chunks) hold row numbers counted from their
    segment's first row: ``by`` is the rows of the segments before it (``committed``: an append's
    committed row count, below which numbers stay)."""

    first: int
    last: int
    by: int
    committed: int


def shift_rows(shift: RowShift, dest_url: str, dest_options: dict[str, Any]) -> None:
    """A task: shift the row numbers of ``shift``'s chunks, ``SLAB_CHUNKS`` chunks at a time
    (read, shifted and written again through zarr: the bytes any writer gives)."""
    import zarr

    from birdzarr.storage._location import zarr_store

    group = zarr.open_group(zarr_store(resolve(dest_url, dest_options), read_only=False), mode="r+",
                            zarr_format=3)
    rows = writable_arrays(group)[_v2.ROW]
    step = int(rows.chunks[0]) * SLAB_CHUNKS
    for start in range(shift.first, shift.last, step):
        stop = min(start + step, shift.last)
        rows[start:stop] = _shifted(rows[start:stop], shift.by, shift.committed)


def _shifted(rows: np.ndarray, by: int, committed: int) -> np.ndarray:
    """Row numbers of a segment's windows after the rows of the segments before it: its new rows
    (numbered from ``committed``) shifted ``by``, committed rows kept."""
    if not committed:
        return rows + np.asarray(by, rows.dtype)
    return np.where(rows >= committed, rows + np.asarray(by, rows.dtype), rows)


def largest_first(segments: list[Segment]) -> list[Segment]:
    """The order to start segments in: a segment of one large device, started last, would end
    the conversion long after the others (the order changes nothing stored)."""
    return sorted(segments, key=lambda s: s.start - s.stop)




def convert_segments(engine: Engine, writer: Writer, segments: list[Segment], *, curation: Curation,
                     on_bad_rows: str, dest: Location, duplicates: DuplicateCounter | None,
                     bar: Any, append: AppendTo | None = None,
                     continuation: Callable[[Segment], Continuation] | None = None) -> dict[str, Any]:
    """Convert the segments (``plan_segments``) on ``engine``'s workers into the store ``writer``
    has open, which must be empty, or hold a commit the segments follow (an append: ``append``,
    and each segment's ``continuation``); records every device with ``writer``. Returns facts for
    the conversion report (the segments, where they ran outside this process)."""
    # tasks in this process count their windows on the bar as they go; others when they end
    progress = bar_counter(bar) if engine.in_process and bar is not None else None
    collector = SegmentCollector(writer, segments, duplicates=duplicates, bar=bar,
                                 count_segments=progress is None, append=append)
    threads = max(1, engine.width // len(segments)) if segments else 1
    with Runner(engine) as runner:
        for segment in largest_first(segments):
            runner.submit(segment, convert_segment, segment, dest.url, dest.storage_options, curation,
                          on_bad_rows, threads, progress,
                          None if continuation is None else continuation(segment))
        for tag, result in runner.results():
            if isinstance(tag, Segment):
                collector.add(tag, result)
            # format 2: the row numbers of segments whose predecessors are all in, shifted by tasks
            # of their own beside the segments still running, not one after another at the end
            for shift in collector.take_shifts():
                runner.submit(shift, shift_rows, shift, dest.url, dest.storage_options)
    # every segment read: this process's decoded row groups of partition files go before the
    # commit builds the device table and report (up to GROUP_CACHE_BYTES beside them)
    clear_group_cache()
    collector.finish()
    return {} if engine.in_process else {"segments": len(segments)}
