"""Conversion on a Dask cluster: workers read and curate the input and write whole chunks.

``convert(..., client=distributed.Client(...))`` and ``birdzarr convert SRC DEST --dask-scheduler
tcp://host:8786`` use this module. The store is byte-identical to a local conversion (every chunk
file; the device table too): the layout is the same (devices in id order, windows in source
order, ``chunk_windows`` per chunk) and chunks are encoded by the same code.

The plan, in three steps:

1. **Count** (on the workers, one task per device): windows per device. Parquet files read with
   ``on_bad_rows="error"`` are counted from their footers (any bad row fails the conversion
   later anyway); otherwise the device is read and curated once just to count it.
2. **Allocate** (here): every device gets its global window range; the arrays are resized to the
   final length once. Chunk ``c`` is *owned* by the device holding window ``c x chunk_windows``;
   each device that owns chunks becomes one task that writes exactly its chunks (its own
   windows from its first owned chunk on, then the first windows of the devices that follow, up
   to the next owned chunk boundary). No two tasks write the same chunk: writes are chunk-aligned
   and conflict-free, straight to a local path or a bucket (each chunk is one object PUT).
3. **Write** (on the workers): each task streams its devices through the reader, writes slabs of
   whole chunks with ``birdzarr.convert._slabs.SlabWriter`` (the local writer's), and
   summarises every device it reads to the end with ``birdzarr.convert._summary.Summarizer``
   (the local writer's: row count, checksum, labels, times, the reader's report). Devices no
   task read to the end (empty ones) are summarised by small extra tasks.

Only then does the driver commit (root attributes last), so a failure anywhere leaves an
uncommitted store that the next conversion replaces. The driver holds the store's lock.

Costs: step 1 reads CSV input (and Parquet with ``on_bad_rows="skip"``) twice overall; each
writing task also reads the head of the next device (at most ``chunk_windows`` windows). The
largest device bounds the time of one task: on a large cluster, split such devices (a device is
one task today).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from birdzarr._errors import BadInputError
from birdzarr._progress import progress_bar
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._readahead import read_ahead
from birdzarr.convert._segments import count_device
from birdzarr.convert._slabs import SlabWriter, writable_arrays
from birdzarr.convert._sources import DeviceSource
from birdzarr.convert._summary import DeviceSummary, Summarizer
from birdzarr.convert._writer import StoreWriter
from birdzarr.format._spec import Curation
from birdzarr.storage._location import Location, resolve

SLAB_CHUNKS = 8  # chunks written at a time by a task (bounds a worker's memory)


# -- on the workers ------------------------------------------------------------------------------
def summarize_device(device: DeviceSource, start: int, curation: Curation, on_bad_rows: str) -> DeviceSummary:
    """Read a device to the end only to summarise it (devices no write task finished)."""
    summary = Summarizer(device.device_id, device.source_names(), start)
    for block in device.blocks(curation=curation, on_bad_rows=on_bad_rows):
        summary.add(block)
    return summary.finish()


@dataclass(frozen=True)
class Span:
    """One write task: global windows ``[start, stop)`` (``start`` on a chunk boundary)."""

    start: int
    stop: int
    devices: list[tuple[DeviceSource, int, int]]  # (device, its global start, its window count)


def _span_blocks(span: Span, curation: Curation, on_bad_rows: str,
                 summaries: dict[int, DeviceSummary]) -> Iterator[tuple[int, WindowBlock]]:
    """(device id, block) for the span's windows, in order; summarises devices read to the end."""
    for device, first, count in span.devices:
        lo, hi = max(span.start, first) - first, min(span.stop, first + count) - first
        to_end = first + count <= span.stop  # this task reads the device to its end: summarise it
        summary = Summarizer(device.device_id, device.source_names(), first) if to_end else None
        position = 0
        for block in read_ahead(device, curation, on_bad_rows):
            if summary is not None:
                summary.add(block)
            n = len(block)
            a, b = max(lo, position), min(hi, position + n)
            if a < b:
                yield device.device_id, block.part(a - position, b - position)
            position += n
            if summary is None and position >= hi:
                break  # the rest belongs to the next task
        if summary is not None:
            if position != count:
                raise BadInputError(
                    f"device {device.device_id}: produced {position} windows, counted {count} before; "
                    "did the input change during the conversion?"
                )
            summaries[device.device_id] = summary.finish()
        elif position < hi:
            raise BadInputError(
                f"device {device.device_id}: produced {position} windows, expected at least {hi}; "
                "did the input change during the conversion?"
            )


def write_span(span: Span, dest_url: str, dest_options: dict[str, Any], curation: Curation,
               on_bad_rows: str, encode_threads: int) -> dict[int, DeviceSummary]:
    """Write every chunk of a span (step 3); returns the summaries of the devices it finished."""
    import zarr

    from birdzarr.storage._location import zarr_store

    location = resolve(dest_url, dest_options)
    group = zarr.open_group(zarr_store(location, read_only=False), mode="r+", zarr_format=3)
    # the driver sized the arrays (StoreWriter.reserve); slabs are written in this thread, their
    # chunks encoded on ``encode_threads``
    slabs = SlabWriter(location, writable_arrays(group), start=span.start,
                       slab_chunks=SLAB_CHUNKS, workers=encode_threads, in_flight=0)
    summaries: dict[int, DeviceSummary] = {}
    try:
        for device_id, block in _span_blocks(span, curation, on_bad_rows, summaries):
            slabs.add(device_id, block)
        slabs.drain()
    finally:
        slabs.close()
    if slabs.written != span.stop:
        raise BadInputError(f"windows {span.start}-{span.stop}: wrote up to {slabs.written}; input changed?")
    return summaries


# -- on the driver -------------------------------------------------------------------------------
def plan_spans(
    devices: list[DeviceSource], counts: list[int], chunk_windows: int
) -> tuple[list[int], list[Span]]:
    """Global start of each device and the write tasks (one per device that owns a chunk)."""
    starts = [0, *np.cumsum(counts, dtype=np.int64).tolist()]
    total = starts[-1]
    spans = []
    for i in range(len(devices)):
        first, end = starts[i], starts[i + 1]
        c0, c1 = -(-first // chunk_windows), -(-end // chunk_windows)  # owned chunks: [c0, c1)
        if c0 >= c1:
            continue
        lo, hi = c0 * chunk_windows, min(c1 * chunk_windows, total)
        members = []
        for j in range(i, len(devices)):
            if starts[j] >= hi:
                break
            if counts[j] > 0:
                members.append((devices[j], starts[j], int(counts[j])))
        spans.append(Span(lo, hi, members))
    return starts[:-1], spans


def convert_on_cluster(
    client: Any,
    src: Location,
    dst: Location,
    devices: list[DeviceSource],
    *,
    kind: str,
    curation: Curation,
    on_bad_rows: str,
    codec: str,
    chunk_windows: int,
    overwrite: bool,
    static: dict[str, Any],
    workers: int | None,
    progress: bool,
) -> None:
    """Convert ``devices`` into ``dst`` using the cluster behind ``client``; commits at the end."""
    try:
        from distributed import as_completed, wait
    except ImportError as exc:  # pragma: no cover - a Client exists, so distributed does too
        raise ImportError("Dask conversion needs `pip install 'birdzarr[dask]'`") from exc

    ids = [d.device_id for d in devices]
    if len(set(ids)) != len(ids):
        raise BadInputError(f"{src.display}: a device appears in more than one input.")
    started = time.perf_counter()
    with StoreWriter(dst, codec=codec, chunk_windows=chunk_windows, overwrite=overwrite,
                     static_attrs=static, workers=workers) as writer, progress_bar(
        progress, desc=f"convert {kind} on dask", unit=" windows"
    ) as bar:
        counts = client.gather(client.map(count_device, devices, curation=curation,
                                          on_bad_rows=on_bad_rows, pure=False))
        starts, spans = plan_spans(devices, counts, chunk_windows)
        total = int(sum(counts))
        bar.reset(total=total)
        writer.reserve(total)  # the tasks write every window
        futures = client.map(
            write_span, spans, dest_url=dst.url, dest_options=dst.storage_options, curation=curation,
            on_bad_rows=on_bad_rows, encode_threads=workers or 1, pure=False,
        )
        sizes = {f.key: s.stop - s.start for f, s in zip(futures, spans, strict=True)}
        summaries: dict[int, DeviceSummary] = {}
        try:
            for future in as_completed(futures):
                summaries.update(future.result())
                bar.update(sizes[future.key])
        except BaseException:
            # Let running tasks finish before the writer removes what was written, so none
            # writes a chunk after the clean-up; then report the first error.
            wait(futures)
            raise
        missing = [i for i, d in enumerate(devices) if d.device_id not in summaries]
        if missing:
            extra = client.gather(client.map(
                summarize_device, [devices[i] for i in missing], [starts[i] for i in missing],
                curation=curation, on_bad_rows=on_bad_rows, pure=False,
            ))
            summaries.update({devices[i].device_id: s for i, s in zip(missing, extra, strict=True)})
        for device, count in zip(devices, counts, strict=True):
            summary = summaries[device.device_id]
            if summary.entry.n_windows != count:
                raise BadInputError(f"device {device.device_id}: {summary.entry.n_windows} windows, "
                                    f"counted {count}; did the input change during the conversion?")
            writer.record(summary)
        writer.commit({
            "source": src.display, "seconds": round(time.perf_counter() - started, 3),
            "dask": {"scheduler": _scheduler_address(client), "tasks": len(spans),
                     "workers": len(client.scheduler_info()["workers"])},
        })


def _scheduler_address(client: Any) -> str:
    try:
        return str(client.scheduler.address)
    except AttributeError:  # pragma: no cover
        return "unknown"


def connect(address: str) -> Any:
    """A ``distributed.Client`` for ``--dask-scheduler``; a clear error without the extra."""
    try:
        from distributed import Client
    except ImportError:
        from birdzarr._errors import MissingDependencyError

        raise MissingDependencyError(
            "--dask-scheduler needs Dask's distributed scheduler: pip install 'birdzarr[dask]'"
        ) from None
    return Client(address)
