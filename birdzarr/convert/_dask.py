"""Conversion on a Dask cluster: the plan of the local worker processes, run on its workers.

``convert(..., client=distributed.Client(...))`` and ``birdzarr convert SRC DEST --dask-scheduler
tcp://host:8786`` use this module. The store is byte-identical to a local conversion (every chunk
file; the device table too): the layout is the same (devices in id order, windows in source
order, ``chunk_windows`` per chunk) and chunks are encoded by the same code.

The plan is ``birdzarr/convert/_segments.py``'s, in four steps:

1. **Count** (on the workers, one task per device): windows per device. Parquet files read with
   ``on_bad_rows="error"`` are counted from their footers (any bad row fails the conversion
   later anyway); otherwise the device is read and curated once just to count it.
2. **Plan** (here): segments of whole devices, about ``total / (4 x the cluster's threads)``
   windows each (at least 8 chunks); the arrays are resized to the final length once.
3. **Convert** (on the workers, one task per segment, the largest first): ``convert_segment``,
   as a local worker process runs it, reads its devices once, summarises them (row count,
   checksum, labels, times, the reader's report), counts their repeated windows, writes every
   chunk wholly inside the segment (straight to a local path or a bucket: each chunk is one
   object PUT, and no two tasks write the same chunk) and sends back the windows of the chunks
   it shares with the next segments, which the client writes once all their windows are in.
4. **Commit** (here), root attributes last, so a failure anywhere leaves an uncommitted store
   that the next conversion replaces. The client holds the store's lock.

Costs: step 1 reads CSV input (and Parquet with ``on_bad_rows="skip"``) twice overall. The
largest device bounds the time of one task: it is one segment, started first.
"""

from __future__ import annotations

import time
from typing import Any

from birdzarr._progress import progress_bar
from birdzarr.convert._duplicates import DuplicateCounter
from birdzarr.convert._segments import (
    SegmentCollector,
    convert_segment,
    count_device,
    largest_first,
    plan_segments,
)
from birdzarr.convert._sources import DeviceSource, refuse_repeated_devices
from birdzarr.convert._writer import StoreWriter
from birdzarr.format._spec import FORMAT_VERSION, Curation
from birdzarr.storage._location import Location


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
    duplicates: DuplicateCounter | None = None,
    format_version: int = FORMAT_VERSION,
) -> None:
    """Convert ``devices`` into ``dst`` using the cluster behind ``client``; commits at the end."""
    try:
        from distributed import as_completed, wait
    except ImportError as exc:  # pragma: no cover - a Client exists, so distributed does too
        raise ImportError("Dask conversion needs `pip install 'birdzarr[dask]'`") from exc

    refuse_repeated_devices(src.display, devices)
    started = time.perf_counter()
    with StoreWriter(dst, codec=codec, chunk_windows=chunk_windows, overwrite=overwrite, static_attrs=static,
                     workers=workers, format_version=format_version) as writer, progress_bar(
        progress, desc=f"convert {kind} on dask", unit=" windows"
    ) as bar:
        counts = client.gather(client.map(count_device, devices, curation=curation,
                                          on_bad_rows=on_bad_rows, pure=False))
        workers_info = client.scheduler_info()["workers"].values()
        threads = max(1, sum(int(w.get("nthreads", 1)) for w in workers_info))
        segments = plan_segments(devices, counts, workers=threads, chunk_windows=chunk_windows)
        collector = SegmentCollector(writer, segments, duplicates=duplicates, bar=bar)
        ordered = largest_first(segments)
        futures = client.map(convert_segment, ordered, dest_url=dst.url, dest_options=dst.storage_options,
                             curation=curation, on_bad_rows=on_bad_rows, pure=False)
        segment_of = {f.key: s for f, s in zip(futures, ordered, strict=True)}
        try:
            for future in as_completed(futures):
                collector.add(segment_of[future.key], future.result())
        except BaseException:
            # Let running tasks finish before the writer removes what was written, so none
            # writes a chunk after the clean-up; then report the first error.
            wait(futures)
            raise
        collector.finish()
        report: dict[str, Any] = {
            "source": src.display, "seconds": round(time.perf_counter() - started, 3),
            "segments": len(segments),
            "dask": {"scheduler": _scheduler_address(client), "tasks": len(segments),
                     "workers": len(client.scheduler_info()["workers"])},
        }
        if duplicates is not None and duplicates.counts:
            report["duplicate_windows"] = duplicates.report()
        writer.commit(report)


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
    from birdzarr._errors import SchedulerError

    try:
        return Client(address)
    except ValueError as exc:  # distributed's parsing of the address
        raise SchedulerError(f"--dask-scheduler {address}: not a scheduler address ({exc}); give "
                             "tcp://HOST:PORT, as `dask scheduler` prints it") from None
    except OSError as exc:  # nothing answered (distributed's connect timeout)
        raise SchedulerError(f"--dask-scheduler {address}: no scheduler answered ({exc}); check that it "
                             "runs and that this machine can reach that host and port") from None
