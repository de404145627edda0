"""The shuffle in worker processes: pass 1 by groups of whole devices, pass 2 by buckets.

The same two passes as ``_shuffle.py``, which runs them on threads (the GIL then caps them
near two cores, as it does an ordered conversion: ``_segments.py``). Here:

- **Pass 1**: consecutive devices are cut into groups of about ``input bytes / (4 x workers)``,
  and each group is read, coded and spilled by one worker process into bucket files of its
  own. A window's bucket is drawn from ``(seed, device)``, so a bucket holds the same windows,
  in the same order, as on threads: each group's file of that bucket, in group order.
- **Pass 2**: the buckets are cut into runs of consecutive buckets (``plan_bucket_runs``),
  and each run is written by one worker process, which loads and permutes its buckets one at a
  time and encodes every chunk wholly inside the run's windows, also the chunks two of its
  buckets share; the windows of a run's first and last chunk come back here and are written
  once all are in (``SegmentCollector``). Each device's digest (``scattered_digest``) does not
  depend on the order of its windows: pass 1 finds it as it reads the device.

The store is byte-identical to the one written on threads. Memory: each pass-1 process holds at
most ``PASS1_BUFFER_WINDOWS / processes`` windows waiting to be spilled (so all together as on
threads) and one block; each pass-2 process one bucket's buffers (176 bytes a window as codes)
and one slab; this process the dictionaries, as on threads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from birdzarr._errors import BadInputError
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._chunkwrite import ChunkSink
from birdzarr.convert._duplicates import DeviceKeys, DuplicateCounter
from birdzarr.convert._gdict_encode import DictionaryTable
from birdzarr.convert._segments import (
    PROCESS_MIN_BYTES,
    SEGMENTS_PER_WORKER,
    SLAB_CHUNKS,
    ChunkRouter,
    Segment,
    SegmentCollector,
    SegmentResult,
    as_finished,
    fork_available,
    forked_pool,
    whole_chunks,
)
from birdzarr.convert._shuffle import (
    PASS1_BUFFER_WINDOWS,
    BucketLoader,
    SpillBuckets,
    Spiller,
    SpillFiles,
    seed_rows,
)
from birdzarr.convert._slabs import SlabWriter, writable_arrays
from birdzarr.convert._sources import DeviceSource
from birdzarr.convert._summary import DeviceSummary
from birdzarr.convert._writer import StoreWriter
from birdzarr.format import _v2
from birdzarr.format._rows import RowCoder
from birdzarr.format._spec import DEVICE, GIMU, N_CHANNELS, Curation
from birdzarr.storage._location import Location


def plan_spill_groups(devices: list[DeviceSource], *, workers: int,
                      dest: Location | None = None) -> list[list[DeviceSource]] | None:
    """Consecutive devices in groups of about equal input bytes, or None where the shuffle runs
    on threads (one worker, no ``fork``, input under 64 MB, fewer groups than workers, or a
    ``dest`` that worker processes cannot write to: ``memory://``)."""
    if workers <= 1 or not fork_available() or (dest is not None and not dest.shared_between_processes):
        return None
    sizes = [sum(int(f.fs.size(f.path) or 0) for f in d.files) for d in devices]
    total = sum(sizes)
    if total < PROCESS_MIN_BYTES:
        return None
    target = total / (SEGMENTS_PER_WORKER * workers)
    groups: list[list[DeviceSource]] = []
    members: list[DeviceSource] = []
    held = 0
    for device, size in zip(devices, sizes, strict=True):
        members.append(device)
        held += size
        if held >= target:
            groups.append(members)
            members, held = [], 0
    if members:
        groups.append(members)
    return groups if len(groups) >= workers else None


@dataclass
class SpillResult:
    """What one group's pass 1 leaves: its devices' summaries and dictionaries (in device order),
    its bucket files and their windows, and its devices' repeated windows."""

    summaries: dict[int, DeviceSummary]
    dictionaries: dict[int, list[np.ndarray]]
    paths: list[str]
    windows: np.ndarray
    bytes_written: int
    repeated: dict[int, int]


def spill_group(devices: list[DeviceSource], directory: str, *, seed: int, buckets: int,
                buffer_windows: int, curation: Curation, on_bad_rows: str) -> SpillResult:
    """Pass 1 for a group of devices (in a worker process)."""
    os.makedirs(directory)
    spill = SpillBuckets(directory, buckets)
    spiller = Spiller(spill, seed=seed, buckets=buckets, pool=None, file_writer=None, workers=1,
                       buffer_windows=buffer_windows)
    repeated: dict[int, int] = {}
    try:
        for device in devices:
            keys = DeviceKeys()
            blocks = _keyed(device.blocks(curation=curation, on_bad_rows=on_bad_rows), keys)
            spiller.device(device.device_id, device.source_names(), blocks)  # placed as read
            if count := keys.repeated():
                repeated[device.device_id] = count
        spiller.finish()
    finally:
        spill.close()
    return SpillResult(spiller.summaries, spiller.dictionaries, spill.paths, spill.windows,
                       spill.bytes_written, repeated)


def _keyed(blocks: Iterator[WindowBlock], keys: DeviceKeys) -> Iterator[WindowBlock]:
    """The blocks, each one's duplicate-check keys kept as it passes."""
    for block in blocks:
        keys.add(block)
        yield block


# Pass-2 runs of consecutive buckets per worker process: more, shorter runs even out the end
# of the pass; each costs its first and last chunk's windows sent here and back out
RUNS_PER_WORKER = 2


@dataclass
class _Pass2:
    """What every pass-2 process needs, set here before they are forked (so inherited, not sent).
    ``dest`` is this process's location: a worker opens its own (``_Opened``), never uses its
    filesystem (an inherited s3fs fails after the fork: "This class is not fork-safe")."""

    loader: BucketLoader
    table: DictionaryTable
    coded: bool
    dest: Location
    coder: RowCoder | None = None  # format 2: every device's row, seeded (each process codes with its copy)


@dataclass
class _Opened:
    """A worker process's own destination (its own filesystem) and the store's arrays there."""

    pid: int
    dest: Location
    arrays: dict[str, Any]


_PASS2: _Pass2 | None = None
_OPENED: _Opened | None = None  # per worker process: opened on its first task


def _arrays() -> tuple[_Pass2, Location, dict[str, Any]]:
    """This worker process's pass-2 state, its own destination and the store's arrays (opened
    once a process)."""
    global _OPENED
    import zarr

    from birdzarr.storage._location import zarr_store

    state = _PASS2
    assert state is not None, "set before the pass-2 processes are forked"
    if _OPENED is None or _OPENED.pid != os.getpid():
        dest = state.dest.reopened()
        group = zarr.open_group(zarr_store(dest, read_only=False), mode="r+", zarr_format=3)
        _OPENED = _Opened(os.getpid(), dest, writable_arrays(group))  # sized before any worker started
    return state, _OPENED.dest, _OPENED.arrays


def write_shared_chunk(start: int, stop: int, data: dict[str, np.ndarray]) -> None:
    """Encode and store one chunk that two runs of buckets share (in a worker process, so that
    this process only gathers windows: encoding is most of a chunk's cost)."""
    state, dest, arrays = _arrays()
    sink = ChunkSink(dest, arrays, workers=1)
    sink.code_encoder = state.table.encode if state.coded else None
    sink.write(start, stop, data)


def plan_bucket_runs(buckets: int, *, workers: int) -> list[range]:
    """Consecutive buckets in ``RUNS_PER_WORKER x workers`` runs of about equal counts (buckets
    hold about equal windows), each written by one pass-2 process: a chunk that two buckets of
    one run share is written there, and only a run's first and last chunk come back here."""
    runs = max(1, min(buckets, RUNS_PER_WORKER * workers))
    edges = [round(i * buckets / runs) for i in range(runs + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:], strict=False)]


def write_bucket_run(buckets: range) -> SegmentResult:
    """Pass 2 for a run of consecutive buckets (in a worker process), loaded one at a time: every
    chunk wholly inside the run written, the windows of its first and last chunk sent back."""
    state, dest, arrays = _arrays()
    starts = state.loader.starts
    start = int(starts[buckets.start])
    stop = start + int(state.loader.spill.windows[buckets.start : buckets.stop].sum())
    first = whole_chunks(start, stop, int(arrays[DEVICE].chunks[0]))[0]
    slabs = SlabWriter(dest, arrays, start=first, slab_chunks=SLAB_CHUNKS, workers=1, in_flight=0,
                       coder=state.coder)
    if state.coded:
        slabs.sink.code_encoder = state.table.encode
    router = ChunkRouter(start, stop, slabs)
    try:
        for bucket in buckets:
            block = state.loader.load(bucket)
            router.add(-1, block, int(starts[bucket]))  # the block carries each window's device
        slabs.drain()
    finally:
        slabs.close()
    return SegmentResult([], {}, router.shared())


def write_shuffled_in_processes(
    writer: StoreWriter, groups: list[list[DeviceSource]], *, seed: int, buckets: int,
    tmp_dir: str | None, curation: Curation, on_bad_rows: str, workers: int, dest: Location,
    duplicates: DuplicateCounter | None, on_pass: Callable[[str, int], Any] | None = None,
    on_written: Callable[[int], Any] | None = None, on_spilled: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """``write_shuffled`` in worker processes; the same store and the same facts, and the
    number of processes. ``on_spilled`` is told how many windows each group spilled in pass 1
    (a progress bar's steps, as ``on_written`` in pass 2)."""
    global _PASS2
    directory = tempfile.mkdtemp(prefix="birdzarr-shuffle-", dir=tmp_dir)
    processes = max(1, min(workers, len(groups)))
    try:
        buffer_windows = max(256 * buckets, PASS1_BUFFER_WINDOWS // processes)
        with forked_pool(processes) as pool:
            spilled: dict[Future[Any], int] = {
                pool.submit(spill_group, group, os.path.join(directory, f"group-{i:04d}"), seed=seed,
                            buckets=buckets, buffer_windows=buffer_windows, curation=curation,
                            on_bad_rows=on_bad_rows): i
                for i, group in enumerate(groups)
            }
            results: dict[int, SpillResult] = {}
            try:
                for future in as_finished(spilled):
                    result = results[spilled[future]] = future.result()
                    if on_spilled is not None:
                        on_spilled(int(result.windows.sum()))
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        ordered = [results[i] for i in range(len(groups))]
        summaries = {d: s for r in ordered for d, s in r.summaries.items()}
        dictionaries = {d: known for r in ordered for d, known in r.dictionaries.items()}
        if duplicates is not None:
            for r in ordered:
                for device_id, count in r.repeated.items():
                    duplicates.add(device_id, count)
        windows = np.sum([r.windows for r in ordered], axis=0).astype(np.int64)
        files = SpillFiles([[r.paths[k] for r in ordered] for k in range(buckets)], windows)
        if on_pass is not None:
            on_pass("write", int(windows.sum()))
        table = DictionaryTable({d: [np.sort(k) for k in known] for d, known in dictionaries.items()},
                                N_CHANNELS)
        if writer.coder is not None and (left_out := seed_rows(writer.coder, dictionaries)):
            # a row opened in one pass-2 process would take a number another process also gives
            raise BadInputError(
                f"device {left_out[0]} has more than {_v2.MAX_ENTRIES:,} distinct values in an IMU channel "
                "(not 12-bit counts): a shuffled format 2 store codes it on one process only. Convert "
                "with workers=1 (--workers 1), or without shuffle.")
        gimu_codec = writer.slabs.sink.codecs.get(GIMU)
        coded = gimu_codec is not None and gimu_codec.kind == "gdict16"
        loader = BucketLoader(files, table, dictionaries, seed=seed, coded=coded,
                         chunk_windows=writer.slabs.chunk_windows)
        runs = plan_bucket_runs(buckets, workers=workers)
        ends = np.concatenate((loader.starts, [windows.sum()]))
        segments = [Segment(int(ends[run.start]), int(ends[run.stop]), []) for run in runs]
        _PASS2 = _Pass2(loader, table, coded, dest, writer.coder)
        with forked_pool(max(1, min(workers, len(runs)))) as pool:
            chunks: list[Future[None]] = []
            collector = SegmentCollector(
                writer, segments, duplicates=None, bar=None,
                write_chunk=lambda start, stop, data: chunks.append(
                    pool.submit(write_shared_chunk, start, stop, data)))
            written = {pool.submit(write_bucket_run, run): i for i, run in enumerate(runs)}
            try:
                for future in as_finished(written):
                    i = written[future]
                    collector.add(segments[i], future.result())
                    if on_written is not None:
                        on_written(segments[i].stop - segments[i].start)
                for chunk in chunks:
                    chunk.result()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        collector.finish()
        for summary in summaries.values():
            writer.record(summary)  # with its digest, found in pass 1 (``Summarizer``)
        return {"buckets": buckets, "spill_bytes": sum(r.bytes_written for r in ordered),
                "worker_processes": processes}
    finally:
        _PASS2 = None
        shutil.rmtree(directory, ignore_errors=True)
