"""The shuffle on an engine's workers (``_engine.py``): pass 1 by groups of devices (and parts of
large ones), pass 2 by runs of buckets.

The two passes of ``_shuffle.py`` as tasks that the ``Runner`` submits to any engine: forked
worker processes (``local_engine``), a Dask cluster (``cluster_engine``), threads of this
process (``thread_engine``) or this thread (``in_process_engine``), the same tasks on each:

- **Pass 1** (``spill_group``): consecutive devices are cut into groups of about
  ``input bytes / (4 x width)``, and each group is read, coded and spilled by one task into bucket
  files of its own, in a folder of the spill directory. A window's bucket is drawn from
  ``(seed, device, window number)`` (``draw_buckets``), so a bucket holds the same windows, in
  the same order, as on threads: each group's file of that bucket, in group order. A device of
  more than ``PART_WINDOWS`` windows of per-device Parquet files joins the groups as its parts
  (``spill_plan``, the parts of ``_segments.split_large``), each part's windows numbered from
  its place in the device; a part's codes point into dictionaries of its own, and it comes back
  apart (``SpilledPart``).
- Between the passes (here): the groups' dictionaries make every device's table (a split
  device's parts merged into the device's dictionaries, summary and repeats:
  ``merge_spilled_parts``; pass 2 maps a part's codes into them), format 2's rows are seeded,
  and what pass 2 needs (the bucket files of every group, the dictionaries, the seed, the
  coder) is written once to ``pass2.pickle`` in the spill directory, which every
  task reads (once per worker thread) instead of receiving it with each task; tasks in this
  process (this thread, its threads) share the plan itself (``_PLANS``) where every device was
  seeded (the plan is then read only).
- **Pass 2** (``write_bucket_run``): the buckets are cut into runs of consecutive buckets
  (``plan_bucket_runs``), and each run is written by one task, which loads and permutes its
  buckets one at a time and encodes every chunk wholly inside the run's windows, also the chunks
  two of its buckets share; the windows of a run's first and last chunk come back here and each
  such chunk is written by a task of its own once all its windows are in (``SegmentCollector``,
  ``write_shared_chunk``). Each device's digest (``scattered_digest``) does not depend on the
  order of its windows: pass 1 finds it as it reads the device.

The spill directory must therefore be one that every worker and this process reach at the same
path: any local directory for worker processes and a Dask ``LocalCluster``; a shared file system
(NFS, Lustre, a mounted bucket) for a cluster of several machines (docs/scaling.md). A pass-2
task reads the bucket files other tasks wrote.

One worker: one group and one run (nothing to even out). A device with more than 65,535
distinct values in a channel (format 2) opens rows as pass 2 codes it, which only one task can
number: pass 2 is then one run, whose task hands back the rows it opened.

The store is byte-identical on every engine. Memory: each pass-1 task holds at
most ``PASS1_BUFFER_WINDOWS / width`` windows waiting to be spilled (so all together as one
task's) and one block; each pass-2 worker thread the dictionaries (a copy each, but
threads of this process share this process's), one bucket's buffers (344
bytes a window: the float32 values, device, label and time; 464 with the format 2 codes, where
every device was seeded), one
permuted bucket (the one before is freed as the next loads: the windows of it that the slab
writer still holds are copies, ``_pieces``) and one slab (``SLAB_WINDOWS``); this process the
dictionaries (and, while ``seed_rows`` merges rows that share values, the merged rows' unions:
no more entries than the rows it seeds, 4 B each; the plan's row codes, 2 B a dictionary entry
a coded channel, then exist also where pass 1's codes were the row codes already, in every
pass-2 worker too) and, until pass 1's results are merged, the distinct window hashes of split
devices' parts (8 bytes a window; counted range by range, ``repeated_in_parts``), let go before
pass 2 starts: its worker processes are forked then, and each would map what this process still
holds (a split device of 2.7 M windows held through pass 2 made each pass-2 worker's peak RSS
about 40 MB higher). A
worker process keeps the last conversion's pass-2 state (the dictionaries and one bucket's
buffers per thread) until it runs the next conversion's; threads of this process end with
their engine, and this thread (one worker) drops it when the conversion ends.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from birdzarr._errors import ArgumentError
from birdzarr.convert import _segments
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._chunkwrite import ChunkSink
from birdzarr.convert._device_coder import DeviceValues
from birdzarr.convert._duplicates import DeviceKeys, DuplicateCounter, PartKeys, repeated_in_parts
from birdzarr.convert._engine import Engine, Runner
from birdzarr.convert._parquet import clear_group_cache, names_its_device, read_runs
from birdzarr.convert._readahead import read_ahead
from birdzarr.convert._segments import (
    SEGMENTS_PER_WORKER,
    ChunkRouter,
    Segment,
    SegmentCollector,
    SegmentResult,
    _partition_only,
    whole_chunks,
)
from birdzarr.convert._shuffle import (
    PASS1_BUFFER_WINDOWS,
    BucketLoader,
    SpillBuckets,
    SpilledPart,
    Spiller,
    SpillFiles,
    merge_part_dictionaries,
    seed_rows,
)
from birdzarr.convert._slabs import SlabWriter, writable_arrays
from birdzarr.convert._sources import DeviceSource
from birdzarr.convert._summary import DeviceSummary, merge_parts
from birdzarr.convert._writer import StoreWriter
from birdzarr.format import _v2
from birdzarr.format._device_columns import DeviceColumns
from birdzarr.format._digest import digest_hex
from birdzarr.format._rows import RowCoder, shared_groups
from birdzarr.format._spec import DEVICE, N_CHANNELS, Curation
from birdzarr.storage._location import Location, resolve

# A device is split for pass 1 (``spill_plan``) only where its files hold at least this many bytes
# a window of ``PART_WINDOWS`` (its footers are read to count its windows; the files of 100,000
# small devices are not): Parquet of float32 windows of sensor data holds far more (the test and
# benchmark sources: ~150). A device below it is spilled whole, which changes no byte of the store.
SPLIT_MIN_WINDOW_BYTES = 16


@dataclass(frozen=True)
class SpillMember:
    """One member of pass 1's plan: a device, or a part of a split device (``device.part``) whose
    first window is the device's window number ``first`` and which holds ``windows`` windows
    (from the footers); its input bytes (a part's share of its device's), or None where not
    found yet (``spill_groups`` finds them)."""

    device: DeviceSource
    size: int | None = None
    first: int = 0
    windows: int = 0


def _bytes(device: DeviceSource) -> int:
    return sum(int(f.fs.size(f.path) or 0) for f in device.files)


def spill_plan(devices: list[DeviceSource], *, on_bad_rows: str, width: int) -> list[SpillMember]:
    """Pass 1's members: every device, each device of more than ``PART_WINDOWS`` windows that
    ``_segments.split_large`` splits (per-device Parquet files read with ``on_bad_rows="error"``)
    as its parts, so that its windows are read by several tasks. Only devices whose files hold at
    least ``SPLIT_MIN_WINDOW_BYTES`` a window of ``PART_WINDOWS`` have their footers read; with
    one worker (one task) nothing is split. A window's bucket depends on its device and window
    number alone (``draw_buckets``), and the converting process merges the parts' dictionaries
    and summaries into the device's (``merge_spilled_parts``), so the store is the same bytes as
    with every device whole."""
    whole = [SpillMember(device) for device in devices]
    if width <= 1 or on_bad_rows != "error":
        return whole
    limit = _segments.PART_WINDOWS
    counts = [0] * len(devices)  # 0: not counted, never split
    for k, device in enumerate(devices):
        if (device.kind == "parquet" and device.partition_rows == 0 and device.files and device.part is None
                and all(names_its_device(f) is not None for f in device.files)):  # per-device files
            whole[k] = SpillMember(device, _bytes(device))
            if (whole[k].size or 0) >= limit * SPLIT_MIN_WINDOW_BYTES:
                counts[k] = _segments.footer_count(device, on_bad_rows) or 0
    members, windows = _segments.split_large(devices, counts, on_bad_rows=on_bad_rows)
    if len(members) == len(devices):
        return whole
    plan: list[SpillMember] = []
    by_id = {device.device_id: (member, count)
             for device, member, count in zip(devices, whole, counts, strict=True)}
    first = 0
    for device, count in zip(members, windows, strict=True):
        kept, total = by_id[device.device_id]
        if device.part is None:
            plan.append(kept)
            continue
        first = 0 if device.part.index == 0 else first
        plan.append(SpillMember(device, (kept.size or 0) * count // max(1, total), first, count))
        first += count
    return plan


def spill_groups(members: list[SpillMember], *, width: int) -> list[list[SpillMember]]:
    """Consecutive members (``spill_plan``) in about ``SEGMENTS_PER_WORKER x width`` groups of
    about equal input bytes (the last may be smaller); every member in one group, in order. One
    worker: one group."""
    if width <= 1:
        return [list(members)]
    sizes = [_bytes(member.device) if member.size is None else member.size for member in members]
    target = sum(sizes) / (SEGMENTS_PER_WORKER * width)
    groups: list[list[SpillMember]] = []
    group: list[SpillMember] = []
    held = 0
    for member, size in zip(members, sizes, strict=True):
        group.append(member)
        held += size
        if held >= target:
            groups.append(group)
            group, held = [], 0
    if group:
        groups.append(group)
    return groups


@dataclass
class SpillResult:
    """What one group's pass 1 leaves: its devices' summaries (those read alone) and columns
    (those read together) and dictionaries (in device order), its bucket files and their
    windows, its devices' repeated windows, and the parts of split devices it read (their
    summaries, dictionaries and duplicate keys, merged by the converting process)."""

    summaries: dict[int, DeviceSummary]
    columns: list[DeviceColumns]
    dictionaries: DeviceValues
    paths: list[str]
    windows: np.ndarray
    bytes_written: int
    repeated: dict[int, int]
    parts: list[SpilledPart] = field(default_factory=list)


def row_keys(devices: list[DeviceSource], on_bad_rows: str) -> np.ndarray | None:
    """Each device's dictionary row before any is read: the id of the first device of its group
    (``shared_groups`` of the ids and their windows), its own id if it has a row alone; None
    where the windows are not all known before reading (a device not of partition files alone,
    or ``on_bad_rows="skip"``, which may drop rows). Known: a device's windows are its rows in
    the partition files (``partition_rows``), every row a window or the conversion fails, so
    these are the rows ``seed_rows`` opens after pass 1, and pass 1 codes each group's devices
    of a run into one dictionary (``Spiller.runs``)."""
    if on_bad_rows != "error":
        return None
    partition: dict[str, bool] = {}
    counts: list[int] = []
    for device in devices:
        if device.partition_rows is None or not _partition_only(device, partition):
            return None
        counts.append(device.partition_rows)
    ids = [d.device_id for d in devices]
    keys = np.array(ids, np.int64)
    at = {d: k for k, d in enumerate(ids)}
    for group in shared_groups(ids, counts):
        keys[at[group[0]] : at[group[0]] + len(group)] = group[0]
    return keys


def merge_spilled_parts(members: list[SpillMember], spilled: list[SpilledPart]) -> tuple[
        dict[int, DeviceSummary], DeviceValues, dict[tuple[int, int], list[np.ndarray]], dict[int, int]]:
    """The split devices of pass 1 from their parts (``spilled``, any order): each device's
    summary (``merge_parts``, its digest the parts' digests summed as ``RowDigest`` sums them),
    its dictionaries (``merge_part_dictionaries``: those of the device spilled whole), each part's
    codes into them (for pass 2), and its repeated windows (``repeated_in_parts``, those with
    any). A part that read another count of windows than its footers gave fails the conversion
    (its later parts' window numbers, and so their buckets, would be wrong)."""
    planned = {(m.device.device_id, m.device.part.index): m for m in members if m.device.part is not None}
    by_device: dict[int, dict[int, SpilledPart]] = {}
    for piece in spilled:
        member = planned[(piece.device_id, piece.index)]
        if piece.summary.entry.n_windows != member.windows:
            raise _segments.miscounted(piece.device_id, member.windows, piece.summary.entry.n_windows)
        by_device.setdefault(piece.device_id, {})[piece.index] = piece
    summaries: dict[int, DeviceSummary] = {}
    known: list[tuple[int, list[np.ndarray]]] = []
    part_codes: dict[tuple[int, int], list[np.ndarray]] = {}
    repeated: dict[int, int] = {}
    for device_id in sorted(by_device):
        held = by_device[device_id]
        first = planned[(device_id, 0)].device
        assert first.part is not None and sorted(held) == list(range(first.part.parts)), "every part spilled"
        ordered = [held[k] for k in range(first.part.parts)]
        summary = merge_parts([p.summary for p in ordered], first.source_names())
        summary.entry.scattered_digest = digest_hex(
            sum(int(str(p.summary.entry.scattered_digest), 16) for p in ordered) % 2**64)
        summaries[device_id] = summary
        values, codes = merge_part_dictionaries([p.known for p in ordered])
        known.append((device_id, values))
        for piece, moved in zip(ordered, codes, strict=True):
            part_codes[(device_id, piece.index)] = moved
        keys = [p.keys for p in ordered]
        assert all(k is not None for k in keys)
        if count := repeated_in_parts([k for k in keys if k is not None]):
            repeated[device_id] = count
    return summaries, DeviceValues.of_devices(known, N_CHANNELS), part_codes, repeated


def spill_group(members: list[SpillMember], directory: str, *, seed: int, buckets: int,
                buffer_windows: int, curation: Curation, on_bad_rows: str, threads: int = 1,
                progress: Callable[[int], None] | None = None, rows: np.ndarray | None = None) -> SpillResult:
    """Pass 1 for a group of devices (a task). ``threads`` > 1 (fewer groups than the engine's
    width): each device read ahead on a thread, its blocks' values found and its pieces
    compressed on ``threads`` threads (the spill is the same). ``progress`` (a task in this
    process) is told the windows of each block as it is read. ``rows``: each device's row
    (``row_keys``), or None: a run of devices read together is cut between rows where it can,
    and each row's devices in it coded together (``Spiller.runs``). A part of a split device
    (``spill_plan``) is read, coded and spilled as a device is, from its first window number; it
    comes back as a ``SpilledPart``."""
    devices = [member.device for member in members]
    os.makedirs(directory)
    spill = SpillBuckets(directory, buckets)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="birdzarr-spill") if threads > 1 else None
    file_writer = ThreadPoolExecutor(1, thread_name_prefix="birdzarr-spill-write") if threads > 1 else None
    repeated: dict[int, int] = {}
    part_keys: dict[tuple[int, int], PartKeys] = {}
    try:
        spiller = Spiller(spill, seed=seed, buckets=buckets, pool=pool, file_writer=file_writer,
                          workers=threads, buffer_windows=buffer_windows)
        partition: dict[str, bool] = {}  # file URL -> a partition file
        at = 0
        while at < len(devices):
            end, held = at, 0  # consecutive small devices of partition files, read together
            while end < len(devices):
                known = devices[end].partition_rows
                if (known is None or held + known > _segments.RUN_WINDOWS
                        or not _partition_only(devices[end], partition)):
                    break
                held += known
                end += 1
            if rows is not None and at < end < len(devices) and rows[end] == rows[end - 1]:
                cut = end - 1  # the run ends inside a row: it ends before the row, if the row starts in it
                while cut > at and rows[cut - 1] == rows[end]:
                    cut -= 1
                end = cut if cut > at else end
            found = read_runs([(d.device_id, d.files) for d in devices[at:end]]) if end > at else None
            if found is not None:
                repeated.update(spiller.runs(found, [d.device_id for d in devices[at:end]],
                                             None if rows is None else rows[at:end]))
                if progress is not None and len(found.windows):
                    progress(len(found.windows))
                at = end
                continue
            for member in members[at: max(end, at + 1)]:  # read one by one (which reports any problem)
                device, keys = member.device, DeviceKeys()
                blocks = (read_ahead(device, curation, on_bad_rows) if threads > 1 else
                          device.blocks(curation=curation, on_bad_rows=on_bad_rows))
                part = -1 if device.part is None else device.part.index
                spiller.device(device.device_id, device.source_names(), _keyed(blocks, keys, progress),
                               first=member.first, part=part)
                if part >= 0:  # counted once every part is in (``repeated_in_parts``)
                    part_keys[(device.device_id, part)] = PartKeys.of(keys)
                elif count := keys.repeated():
                    repeated[device.device_id] = count
            at = max(end, at + 1)
        spiller.finish()
    finally:
        # the pool first: a piece waiting to be written then ends with its cancelled compression
        for executor in (pool, file_writer):
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
        spill.close()
    for piece in spiller.parts:
        piece.keys = part_keys[(piece.device_id, piece.index)]
    return SpillResult(spiller.summaries, spiller.columns, spiller.dictionaries(), spill.paths, spill.windows,
                       spill.bytes_written, repeated, spiller.parts)


def _keyed(blocks: Iterator[WindowBlock], keys: DeviceKeys,
           progress: Callable[[int], None] | None) -> Iterator[WindowBlock]:
    """The blocks, each one's duplicate-check keys kept (and its windows counted) as it passes."""
    for block in blocks:
        keys.add(block)
        if progress is not None:
            progress(len(block))
        yield block


# Pass-2 runs of consecutive buckets per unit of the engine's width: more, shorter runs even out the end
# of the pass; each costs its first and last chunk's windows sent here and back out
RUNS_PER_WORKER = 2


@dataclass
class Pass2Plan:
    """What every pass-2 task needs, written once to the spill directory (``pass2.pickle``), or
    shared by tasks in this process (``_PLANS``)."""

    spill: SpillFiles
    dictionaries: DeviceValues  # per part (a device, or devices of one row) and channel, as pass 1 found them
    seed: int
    chunk_windows: int
    # every device's row, seeded; None where pass 2 hands the writer coded windows (``first_row``):
    # its rows (one a device) are then not pickled for every task
    coder: RowCoder | None
    seeded_rows: int = 0  # the rows the coder holds (a device left unseeded opens more)
    # every device seeded: the row of the k-th device (ascending id), whose windows pass 2 then
    # hands the writer coded (``BucketLoader``) with ``row_codes``; None: the writer's coder codes them
    first_row: int | None = None
    row_codes: list[np.ndarray | None] | None = None
    devices: np.ndarray | None = None  # every device id, ascending (the dictionaries' parts: fewer)
    # split devices' parts: (device, part) -> per channel its codes' codes in the device's dictionaries
    part_codes: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)


@dataclass
class _Pass2:
    """A worker thread's pass-2 state: the plan's loader, its own coder and arrays."""

    plan_path: str
    loader: BucketLoader
    coder: RowCoder | None  # None once its one run that opens rows has coded
    dest: Location
    arrays: dict[str, Any]
    seeded_rows: int


_LOCAL = threading.local()  # per worker thread: the _Pass2 of the plan it last ran
# plans whose pass 2 runs in this process, by the path other processes would read them from
_PLANS: dict[str, Pass2Plan] = {}


def _pass2(plan_path: str, dest_url: str, dest_options: dict[str, Any]) -> _Pass2:
    """This worker thread's pass-2 state for the plan (read and built once a thread: a Dask
    worker's threads share nothing mutable, as worker processes do not)."""
    import zarr

    from birdzarr.storage._location import zarr_store

    state: _Pass2 | None = getattr(_LOCAL, "state", None)
    if state is None or state.plan_path != plan_path:
        _LOCAL.state = None  # the previous conversion's buffers go first
        plan = _PLANS.get(plan_path)
        if plan is None:
            with open(plan_path, "rb") as handle:
                plan = pickle.load(handle)
        loader = BucketLoader(plan.spill, plan.dictionaries, seed=plan.seed, chunk_windows=plan.chunk_windows,
                              first_row=plan.first_row, row_codes=plan.row_codes, devices=plan.devices,
                              part_codes=plan.part_codes)
        dest = resolve(dest_url, dest_options)
        group = zarr.open_group(zarr_store(dest, read_only=False), mode="r+", zarr_format=3)
        # a plan without a coder hands the writer coded windows: its slab writer's coder stays unused
        coder = RowCoder() if plan.coder is None else plan.coder
        state = _Pass2(plan_path, loader, coder, dest,
                       writable_arrays(group), plan.seeded_rows)  # sized before any task started
        _LOCAL.state = state
    return state


def write_shared_chunk(plan_path: str, dest_url: str, dest_options: dict[str, Any], start: int, stop: int,
                       data: dict[str, np.ndarray]) -> None:
    """Encode and store one chunk that two runs of buckets share (in a task, so that this process
    only gathers windows: encoding is most of a chunk's cost)."""
    state = _pass2(plan_path, dest_url, dest_options)
    sink = ChunkSink(state.dest, state.arrays, workers=1)
    sink.write(start, stop, data)


def plan_bucket_runs(buckets: int, *, workers: int) -> list[range]:
    """Consecutive buckets in ``RUNS_PER_WORKER x workers`` runs of about equal counts (buckets
    hold about equal windows), each written by one pass-2 process: a chunk that two buckets of
    one run share is written there, and only a run's first and last chunk come back here."""
    runs = max(1, min(buckets, RUNS_PER_WORKER * workers))
    edges = [round(i * buckets / runs) for i in range(runs + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:], strict=False)]


def require_shared(directory: str, written: list[str]) -> None:
    """Refuse in one line a spill directory that is not shared: pass 1's tasks wrote ``written``
    (on their machines), and pass 2's tasks, on any machine, must read them; here they must be
    seen too (a cluster's workers on other machines writing to their own disks)."""
    if missing := [path for path in written if not os.path.isdir(path)]:
        raise ArgumentError(
            f"the shuffle's spill directory {directory} is not shared with the workers: "
            f"{len(missing)} of {len(written)} pass-1 folders they wrote are not there from this process; "
            "give shuffle_tmp= (--shuffle-tmp) a directory that every worker and this machine reach "
            "at the same path (docs/scaling.md#dask)")


def write_bucket_run(plan_path: str, dest_url: str, dest_options: dict[str, Any], buckets: range,
                     progress: Callable[[int], None] | None = None,
                     opens_rows: bool = False) -> SegmentResult:
    """Pass 2 for a run of consecutive buckets (a task), loaded one at a time: every chunk wholly
    inside the run written, the windows of its first and last chunk sent back. ``progress`` (a
    task in this process) is told each bucket's windows once they are placed. ``opens_rows``
    (the one run of pass 2: format 2 rows of devices left unseeded): the rows its coder opened
    after the seeded ones come back too, numbered as they are stored."""
    state = _pass2(plan_path, dest_url, dest_options)
    starts = state.loader.starts
    start = int(starts[buckets.start])
    stop = start + int(state.loader.spill.windows[buckets.start : buckets.stop].sum())
    first = whole_chunks(start, stop, int(state.arrays[DEVICE].chunks[0]))[0]
    slabs = SlabWriter(state.dest, state.arrays, start=first, workers=1, in_flight=0,
                       coder=state.coder)
    router = ChunkRouter(start, stop, slabs)
    try:
        for bucket in buckets:
            n = _route(router, state.loader.load(bucket), int(starts[bucket]), slabs.slab_windows)
            if progress is not None:
                progress(n)
        slabs.drain()
    finally:
        slabs.close()
    rows = None
    if opens_rows:
        assert state.coder is not None
        rows = _rows_after(state.coder.new_rows(), state.seeded_rows)
        state.coder = None  # this plan's coder has coded its one run: never again
        _LOCAL.state = None
    return SegmentResult([], {}, router.shared(), rows)


def _route(router: ChunkRouter, block: WindowBlock, position: int, slab_windows: int) -> int:
    """Send a loaded bucket to the router (``_pieces``); its windows. Nothing here refers to
    the bucket once this returns, so the next bucket loads without it."""
    for at, piece in _pieces(block, position, router.whole, slab_windows):
        router.add(-1, piece, at)  # the block carries each window's device
    return len(block)


def _pieces(block: WindowBlock, position: int, whole: tuple[int, int],
            slab_windows: int) -> Iterator[tuple[int, WindowBlock]]:
    """A loaded bucket at store ``position``, cut so that only views of whole slabs stay views:
    the windows that outlive it (past the last slab boundary, which the slab writer keeps until
    the next bucket fills the slab, and those of chunks shared with other runs) are copies, so
    the bucket is freed before the next one loads. Slabs start at ``whole[0]``, every
    ``slab_windows``; a different cut only costs memory (the store is the same)."""
    end = position + len(block)
    inside = (max(position, whole[0]), min(end, whole[1]))
    full = whole[0] + (inside[1] - whole[0]) // slab_windows * slab_windows  # the last boundary
    cuts = sorted({position, end, *(c for c in (*inside, full) if position < c < end)})
    for a, b in zip(cuts, cuts[1:], strict=False):
        part = block.part(a - position, b - position)
        yield a, (part if inside[0] <= a and b <= min(full, inside[1]) else _copied(part))


def _copied(block: WindowBlock) -> WindowBlock:
    """``block`` with its own arrays (not views of a larger block)."""
    def own(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a.copy()

    coded = None if block.coded is None else (block.coded[0].copy(), block.coded[1].copy())
    return WindowBlock(block.windows.copy(), block.timestamps.copy(), block.labels.copy(), block.report,
                       own(block.devices), coded)


def _rows_after(rows: _v2.Dictionaries, seeded: int) -> _v2.Dictionaries:
    """The rows after the first ``seeded`` of a coder's ``new_rows`` (their starts are absolute)."""
    if rows.n_rows <= seeded:
        return _v2.Dictionaries.empty()
    first = int(rows.start[seeded, 0] - rows.start[0, 0])
    return _v2.Dictionaries(rows.values[first:], rows.start[seeded:], rows.device[seeded:])


def write_shuffled_on(
    engines: Callable[[], contextlib.AbstractContextManager[Engine]], writer: StoreWriter,
    devices: list[DeviceSource], *, seed: int, buckets: int,
    tmp_dir: str | None, curation: Curation, on_bad_rows: str, dest: Location,
    duplicates: DuplicateCounter | None, on_pass: Callable[[str, int], Any] | None = None,
    on_written: Callable[[int], Any] | None = None, on_spilled: Callable[[int], Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write every device's windows to ``writer`` in one seeded global random order
    (``_shuffle.py``), both passes as tasks on engines from ``engines()``. Each pass runs on an
    engine of its own (local worker processes then end with their pass: pass 1's memory is
    freed and its CPU counted before pass 2). ``tmp_dir`` must be reached at the same path by
    every worker (module docstring). Records every device with ``writer`` (no ranges;
    ``scattered_digest`` set). Returns the shuffle's facts for the report (buckets, spill bytes)
    and the engine's. ``on_pass`` is told when the second pass starts, with the number of
    windows it writes; ``on_spilled`` and ``on_written`` how many windows were spilled in pass 1
    and written in pass 2, as they go (a progress bar's steps)."""
    directory = tempfile.mkdtemp(prefix="birdzarr-shuffle-", dir=tmp_dir)
    try:
        results: dict[int, SpillResult] = {}
        with engines() as engine, Runner(engine) as runner:
            # devices of more than PART_WINDOWS windows as parts: pass 1's tasks stay even
            members = spill_plan(devices, on_bad_rows=on_bad_rows, width=engine.width)
            groups = spill_groups(members, width=engine.width)
            facts = engine.facts
            # tasks in this process count their windows as they go; others when they end
            progress = on_spilled if engine.in_process else None
            buffer_windows = max(256 * buckets, PASS1_BUFFER_WINDOWS // engine.width)
            threads = max(1, engine.width // len(groups)) if groups else 1
            keys = row_keys([member.device for member in members], on_bad_rows)
            at = 0
            for i, group in enumerate(groups):
                rows = None if keys is None else keys[at : at + len(group)]
                at += len(group)
                runner.submit(i, spill_group, group, os.path.join(directory, f"group-{i:04d}"), seed=seed,
                              buckets=buckets, buffer_windows=buffer_windows, curation=curation,
                              on_bad_rows=on_bad_rows, threads=threads, progress=progress, rows=rows)
            for i, result in runner.results():
                results[i] = result
                if on_spilled is not None and progress is None:
                    on_spilled(int(result.windows.sum()))
        # every device read: this process's decoded row groups of partition files (up to
        # GROUP_CACHE_BYTES) go before the dictionaries are seeded and pass 2 loads its buckets
        clear_group_cache()
        ordered = [results[i] for i in range(len(groups))]
        require_shared(directory, [os.path.join(directory, f"group-{i:04d}") for i in range(len(groups))])
        summaries = {d: s for r in ordered for d, s in r.summaries.items()}
        columns = [c for r in ordered for c in r.columns]
        parts = [r.dictionaries for r in ordered]
        for r in ordered:  # held once, here, until pass 2's plan holds them
            r.dictionaries = DeviceValues.of_devices([], N_CHANNELS)
        part_codes: dict[tuple[int, int], list[np.ndarray]] = {}
        if spilled := [piece for r in ordered for piece in r.parts]:
            merged, known, part_codes, repeated = merge_spilled_parts(members, spilled)
            # the parts' window hashes and dictionaries are merged: not held through pass 2 (a
            # forked pass-2 worker would map them too: 8 bytes a window of the split devices)
            del spilled
            for r in ordered:
                r.parts = []
            summaries = {d.device_id: (summaries.get(d.device_id) or merged[d.device_id]) for d in devices
                         if d.device_id in summaries or d.device_id in merged}  # in input order
            parts.append(known)
            if duplicates is not None:
                for device_id, count in repeated.items():
                    duplicates.add(device_id, count)
        dictionaries = DeviceValues.joined(parts, N_CHANNELS, consume=True)
        if duplicates is not None:
            for r in ordered:
                for device_id, count in r.repeated.items():
                    duplicates.add(device_id, count)
        windows = np.sum([r.windows for r in ordered], axis=0).astype(np.int64)
        files = SpillFiles([[r.paths[k] for r in ordered] for k in range(buckets)], windows)
        if on_pass is not None:
            on_pass("write", int(windows.sum()))
        # format 2: a device left unseeded opens rows in pass 2, which one task only can number
        assert writer.coder is not None
        before = writer.coder.first_row + writer.coder.n_rows
        ids = np.concatenate([np.fromiter(summaries, np.int64, len(summaries)),
                              *(c.device_ids for c in columns)])
        by_id = np.argsort(ids, kind="stable")
        ids = ids[by_id]
        counts = np.concatenate([np.fromiter((s.entry.n_windows for s in summaries.values()), np.int64,
                                             len(summaries)), *(c.counts for c in columns)])[by_id].tolist()
        seeding = seed_rows(writer.coder, dictionaries, counts, ids)
        left_out = seeding.left_out
        seeded = writer.coder.n_rows
        # rows are opened one after another from ``before``, in ascending device id
        opened = seeded + writer.coder.first_row - before
        first_row = None if left_out or opened != len(ids) else before
        plan_path = os.path.join(directory, "pass2.pickle")
        plan = Pass2Plan(files, dictionaries, seed, writer.slabs.chunk_windows,
                         writer.coder if first_row is None else None, seeded, first_row,
                         None if first_row is None else seeding.row_codes, ids, part_codes)
        del dictionaries, seeding  # pass 2 reads them from the plan
        where = (plan_path, dest.url, dest.storage_options)
        with engines() as engine, Runner(engine) as runner:
            if engine.in_process and plan.coder is None:
                # tasks in this process (this thread, its threads) share the plan, read only:
                # nothing written, read back or copied (336 MB at 100,000 devices of 10 windows)
                _PLANS[plan_path] = plan
            else:  # other processes read it; a plan with the writer's coder is copied for its task
                with open(plan_path, "wb") as handle:
                    pickle.dump(plan, handle, protocol=pickle.HIGHEST_PROTOCOL)
            del plan
            one_run = bool(left_out) or engine.width <= 1
            runs = [range(buckets)] if one_run else plan_bucket_runs(buckets, workers=engine.width)
            progress = on_written if engine.in_process else None
            ends = np.concatenate(([0], np.cumsum(windows)))
            segments = [Segment(int(ends[run.start]), int(ends[run.stop]), []) for run in runs]
            collector = SegmentCollector(
                writer, segments, duplicates=None, bar=None,
                write_chunk=lambda start, stop, data: runner.submit(None, write_shared_chunk, *where, start,
                                                                    stop, data))
            for i, run in enumerate(runs):
                runner.submit(i, write_bucket_run, *where, run, progress, bool(left_out))
            for i, result in runner.results():
                if i is None:  # a shared chunk written
                    continue
                collector.add(segments[i], result)
                if on_written is not None and progress is None:
                    on_written(segments[i].stop - segments[i].start)
            collector.finish()  # (may submit the last shared chunks)
            for _ in runner.results():
                pass
        for summary in summaries.values():
            writer.record(summary)  # with its digest, found in pass 1 (``Summarizer``)
        for together in columns:  # kept as columns until the commit spells them (``record_runs``)
            writer.record_runs(together)
        return {"buckets": buckets, "spill_bytes": sum(r.bytes_written for r in ordered)}, facts
    finally:
        # pass 2 in this thread (one worker) leaves its state here: not kept past the conversion
        _LOCAL.state = None
        _PLANS.pop(os.path.join(directory, "pass2.pickle"), None)
        shutil.rmtree(directory, ignore_errors=True)
