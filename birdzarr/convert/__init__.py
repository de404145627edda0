"""Conversion of raw CSV exports and per-device Parquet files into one store."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import secrets
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import zarr

from birdzarr._checks import require_bool, require_int
from birdzarr._errors import ArgumentError, BadInputError, IgnoredColumnsWarning
from birdzarr._progress import progress_bar
from birdzarr.convert._cpus import cpu_report, cpu_seconds, resolve_workers
from birdzarr.convert._duplicates import DuplicateCounter
from birdzarr.convert._engine import Engine, choose_engine, processes_pay
from birdzarr.convert._memory import arrow_pool
from birdzarr.convert._overwrite import check_destination, replacing, staged_location
from birdzarr.convert._parquet import clear_group_cache, ignored_from_notes
from birdzarr.convert._pipeline import bar_counter, write_csv_devices
from birdzarr.convert._segments import (
    convert_segments,
    count_devices,
    input_bytes,
    plan_segments,
    split_large,
)
from birdzarr.convert._shuffle import bucket_count
from birdzarr.convert._shuffle_processes import write_shuffled_on
from birdzarr.convert._sources import DeviceSource, find_inputs, natural_key, refuse_repeated_devices
from birdzarr.convert._writer import StoreWriter
from birdzarr.format._spec import (
    DEFAULT_CHUNK_WINDOWS,
    MAX_CHUNK_WINDOWS,
    MIXED_LABEL_POLICY,
    SHUFFLED_CHUNK_WINDOWS,
    WINDOW_RULE,
    Curation,
)
from birdzarr.storage._location import Location, StoreLike, require_writable, resolve

if TYPE_CHECKING:
    from birdzarr.store._handle import Store

__all__ = ["append", "convert"]

ON_BAD_ROWS = ("error", "skip")


def convert(
    source: StoreLike | Sequence[StoreLike],
    dest: StoreLike,
    *,
    overwrite: bool = False,
    chunk_windows: int | None = None,
    on_bad_rows: str = "error",
    curation: Curation | None = None,
    workers: int | None = None,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    source_storage_options: dict[str, Any] | None = None,
    shuffle: bool = False,
    seed: int | None = None,
    shuffle_tmp: str | None = None,
    client: Any = None,
    skip_unknown_files: bool = False,
) -> Store:
    """Convert a directory (or file, or fsspec URL) of CSV exports or Parquet files into a store.

    ``source`` may be a list of them (``[season1, season2]``): the store is the one converting a
    single directory holding all their files would give (docs/conversion.md#several-sources).
    Parquet input is per-device files (``{device}.parquet``, ``device_id={device}/`` folders)
    or partition files of many devices with a ``device_id`` column (docs/conversion.md#input-layouts).

    CSV input is curated per window (see docs/conversion.md); Parquet input is already curated
    and copied exactly. Returns the committed store, opened read-only. On any error nothing is
    committed at ``dest`` and what was written is removed; input that gives no window at all is
    an error too.

    ``dest`` must be new, empty, or a birdzarr store (an unfinished one is replaced); anything
    else there is refused, and ``dest`` may not be, contain or sit inside ``source``.
    ``overwrite=True`` replaces a committed store: the new one is written aside and put in place
    only once committed, so a failure leaves the old store readable, on object stores too
    (docs/reliability.md). Every entry of a source directory must be an input file; with
    ``skip_unknown_files=True`` the others are skipped and listed in the report. Windows that
    repeat another window of their device are kept, counted in the report and warned about.

    ``shuffle=True`` stores the windows in a random order drawn from ``seed`` (a random seed,
    recorded, if None): every chunk a uniform sample of all windows, grouped by device inside;
    spilling them through temporary bucket files in ``shuffle_tmp``
    (default ``$TMPDIR``); see docs/conversion.md#shuffle for what that costs and buys.
    ``chunk_windows`` is the windows per chunk (default 8192; 32768 for shuffled stores).
    ``workers`` is the number of processes or threads doing conversion work (default:
    all usable cores, as CPU affinity and the cgroup quota allow; 1: all in the calling thread;
    at most 4 per usable core, with a warning); it never changes the stored bytes. ``client`` (a
    ``distributed.Client``) runs the same tasks (reading, curation, chunk writing; with
    ``shuffle=True`` both passes) on a Dask cluster instead, with a byte-identical result; a
    shuffle's ``shuffle_tmp`` must then be a directory every worker reaches at the same path
    (docs/scaling.md#conversion-on-a-dask-cluster). The store is format 2: the windows as uint16
    codes into per-device dictionary rows, with core Zarr v3 codecs only, which any Zarr v3
    reader opens (docs/format.md).
    """
    from birdzarr.store._handle import open_store

    # before anything is read or written: a truthy non-bool (overwrite="no") must not act as True
    overwrite = require_bool("overwrite", overwrite)
    progress = require_bool("progress", progress)
    shuffle = require_bool("shuffle", shuffle)
    skip_unknown_files = require_bool("skip_unknown_files", skip_unknown_files)
    if on_bad_rows not in ON_BAD_ROWS:
        raise ArgumentError(f"on_bad_rows must be one of {ON_BAD_ROWS}, got {on_bad_rows!r}")
    if chunk_windows is None:
        chunk_windows = SHUFFLED_CHUNK_WINDOWS if shuffle else DEFAULT_CHUNK_WINDOWS
    chunk_windows = require_int("chunk_windows", chunk_windows)
    if not 1 <= chunk_windows <= MAX_CHUNK_WINDOWS:
        raise ArgumentError(f"chunk_windows must be from 1 to {MAX_CHUNK_WINDOWS:,}, got {chunk_windows}")
    workers = resolve_workers(workers)  # a negative count is refused before any work
    if seed is not None:
        seed = require_int("seed", seed)
        if not 0 <= seed < 2**63:  # what the store records
            raise ArgumentError(f"seed must be an integer in 0..2**63-1, got {seed}")
    if curation is not None and not isinstance(curation, Curation):
        raise TypeError(f"curation must be a birdzarr.Curation (or None for the default), got {curation!r}")
    if client is not None:
        _require_client(client)
    if not shuffle and (seed is not None or shuffle_tmp is not None):
        raise ArgumentError("seed and shuffle_tmp (--seed, --shuffle-tmp) apply to a shuffled conversion "
                            "only: add shuffle=True (--shuffle), or leave them out")
    if shuffle and shuffle_tmp is not None and not os.path.isdir(shuffle_tmp):
        missing = not os.path.exists(shuffle_tmp)
        error = FileNotFoundError if missing else NotADirectoryError
        raise error(errno.ENOENT if missing else errno.ENOTDIR,
                    f"{'no such' if missing else 'not a'} directory, where the shuffle's temporary files "
                    "were to go (--shuffle-tmp, Python: shuffle_tmp=; default $TMPDIR)", shuffle_tmp)
    curation = curation or Curation()
    sources = _resolve_sources(source, source_storage_options)
    src = _named_together(sources)
    dst = resolve(dest, storage_options)
    require_writable(dst)
    for one in sources:
        state = check_destination(dst, overwrite=overwrite, source=one)
    inputs = find_inputs(sources, skip_unknown_files=skip_unknown_files)
    kind, devices = inputs.kind, inputs.devices
    curation_attrs = (
        curation.to_json(applied_by="birdzarr")
        if kind == "csv"
        else {"applied_by": "source", "note": "Parquet input holds windows curated before conversion"}
    )
    layout: dict[str, Any] = {"chunk_windows": chunk_windows, "shuffled": False}
    static: dict[str, Any] = {
        "source_kind": kind,
        "window_rule": WINDOW_RULE if kind == "csv" else "one Parquet row is one window",
        "mixed_label_policy": MIXED_LABEL_POLICY,
        "curation": curation_attrs,
        "layout": layout,
    }
    buckets = 0
    if shuffle:
        if seed is None:
            seed = secrets.randbits(63)
        buckets = bucket_count(_estimated_windows(kind, devices))
        layout["shuffled"], layout["shuffle_seed"], layout["shuffle_buckets"] = True, int(seed), buckets
    # overwriting a local store: write the new one aside and swap it in once committed
    staged = staged_location(dst, overwrite=overwrite, state=state)
    with DuplicateCounter() as duplicates, _freeing_group_cache():
        if inputs.skipped:
            static["skipped_files"] = inputs.skipped
        with replacing(dst, staged) if staged is not None else contextlib.nullcontext():
            target = staged or dst
            _convert_here(src, target, kind, devices, chunk_windows=chunk_windows,
                          overwrite=overwrite, static=static, workers=workers, progress=progress,
                          curation=curation, on_bad_rows=on_bad_rows, shuffle=shuffle, seed=seed,
                          buckets=buckets, shuffle_tmp=shuffle_tmp, duplicates=duplicates, client=client)
    duplicates.warn(dst.display)
    store = open_store(dst)
    # the report's own list (every engine's devices' reports reach the commit), from the root
    # attributes alone: the device table is not parsed again at 100K devices
    _warn_ignored_columns(store.root.get("report", {}).get("ignored_columns") or {})
    return store


@contextlib.contextmanager
def _freeing_group_cache() -> Iterator[None]:
    """Partition files' decoded row groups are freed when the conversion ends, however it ends."""
    try:
        yield
    finally:
        clear_group_cache()


def _resolve_sources(source: Any, storage_options: dict[str, Any] | None) -> list[Location]:
    """One source, or a non-empty list or tuple of them, as Locations (each named once)."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise ArgumentError("source is an empty list: give at least one directory, file or URL")
        sources = [resolve(one, storage_options) for one in source]
        seen: set[str] = set()
        for one in sources:
            if one.url.rstrip("/") in seen:
                raise ArgumentError(f"source {one.display} is given twice")
            seen.add(one.url.rstrip("/"))
        return sources
    return [resolve(source, storage_options)]


def _named_together(sources: list[Location]) -> Location:
    """The location that names the input in messages and the report (``source``): the one
    source, or all of them, comma-separated (only its ``display`` is used)."""
    if len(sources) == 1:
        return sources[0]
    return dataclasses.replace(sources[0], url=", ".join(one.url for one in sources))


def _ignored_columns(problems: Iterable[list[str]]) -> dict[str, list[str]]:
    """{column: [file, ...]} of input columns that were not read, from the devices' report
    notes (``_parquet.ignored_note``)."""
    found: dict[str, set[str]] = {}
    for notes in problems:
        for column, files in ignored_from_notes(notes).items():
            found.setdefault(column, set()).update(files)
    return {column: sorted(files, key=natural_key) for column, files in sorted(found.items())}


def _warn_ignored_columns(ignored: dict[str, list[str]]) -> None:
    if ignored:
        files = sorted({f for names in ignored.values() for f in names}, key=natural_key)
        warnings.warn(
            f"{len(files)} input file(s) ({', '.join(files[:3])}{' ...' if len(files) > 3 else ''}) have "
            f"columns birdzarr does not read: {', '.join(repr(c) for c in ignored)}; it reads gimu, "
            "device_id, label and timestamp. They are listed in the report (ignored_columns).",
            IgnoredColumnsWarning, stacklevel=3,
        )


def _require_client(client: Any) -> None:
    """Refuse a ``client`` that is not a ``distributed.Client`` (a scheduler address, say), which
    would otherwise fail deep in the conversion with an AttributeError."""
    try:
        from distributed import Client
    except ImportError:  # without distributed nothing can be a Client
        is_client = False
    else:
        is_client = isinstance(client, Client)
    if not is_client:
        hint = f"; connect first: client=distributed.Client({client!r})" if isinstance(client, str) else ""
        raise TypeError(f"client must be a distributed.Client (or None to convert here), "
                        f"got {client!r}{hint}")


def _convert_here(
    src: Location, dst: Location, kind: str, devices: list[DeviceSource], *,
    chunk_windows: int, overwrite: bool, static: dict[str, Any], workers: int, progress: bool,
    curation: Curation, on_bad_rows: str, shuffle: bool, seed: int | None, buckets: int,
    shuffle_tmp: str | None, duplicates: DuplicateCounter | None = None, client: Any = None,
) -> None:
    """The conversion, driven from this process as tasks on one engine (``_engine.py``): the Dask
    cluster behind ``client``; else forked worker processes where they pay (``processes_pay``);
    else threads of this process (one worker: this thread). The tasks and the store are the same
    on every engine."""
    started, cpu = time.perf_counter(), cpu_seconds()
    config = {"threading.max_workers": workers}
    with arrow_pool(), zarr.config.set(config), StoreWriter(
        dst, chunk_windows=chunk_windows, overwrite=overwrite, static_attrs=static, workers=workers,
    ) as writer, progress_bar(progress, desc=f"convert {kind}" + (" on dask" if client else ""),
                              unit=" windows") as bar:
        extra: dict[str, Any] = {}
        pass_one: list[float] = []  # a shuffle's: when pass 1 ended, wall clock and CPU seconds

        def second_pass(name: str, windows: int) -> None:
            # pass 1's worker processes have ended: their CPU time is counted
            pass_one[:] = [time.perf_counter(), cpu_seconds()]
            # no redraw before the reset: it would print pass 1's count under pass 2's name
            bar.set_description(f"convert {kind}: {name} shuffled", refresh=False)
            bar.set_postfix_str("", refresh=False)  # pass 1's MB/s is not pass 2's
            bar.reset(total=windows)

        windows_done = bar_counter(bar)  # windows/s and MB/s on the bar, in either pass (from any thread)

        # the one choice: which engine runs the tasks (a Dask cluster, worker processes, threads)
        processes = client is None and processes_pay(input_bytes(devices), workers=workers,
                                                     dest_shared=dst.shared_between_processes)

        def engines() -> contextlib.AbstractContextManager[Engine]:
            return choose_engine(client, processes=processes, workers=workers)

        extra.update(_on_engine(engines, writer, src, dst, kind, devices, curation=curation,
                                on_bad_rows=on_bad_rows, chunk_windows=chunk_windows, shuffle=shuffle,
                                seed=seed, buckets=buckets, shuffle_tmp=shuffle_tmp, duplicates=duplicates,
                                bar=bar, second_pass=second_pass, windows_done=windows_done))
        # the last slabs are written (and waited for) before the clock stops: the time and CPU
        # reported are the whole conversion's (commit only writes the root attributes)
        writer.slabs.drain()
        seconds = time.perf_counter() - started
        if client is None:  # a cluster's CPU is its workers', which this process does not see
            extra.update(cpu_report(seconds, cpu, workers))
        if shuffle and pass_one:  # each pass's share (they add up to the two figures above)
            first = pass_one[0] - started
            extra["shuffle"]["pass_seconds"] = [round(first, 3), round(seconds - first, 3)]
            if client is None:
                first_cpu = pass_one[1] - cpu
                extra["shuffle"]["pass_cpu_seconds"] = [round(first_cpu, 3),
                                                        round(extra["cpu_seconds"] - first_cpu, 3)]
        require_windows(src.display, writer)
        if duplicates is not None and duplicates.counts:
            extra["duplicate_windows"] = duplicates.report()
        ignored = _ignored_columns(writer.problems())
        if ignored:
            extra["ignored_columns"] = ignored
        writer.commit({"source": src.display, "seconds": round(seconds, 3), **extra})


def _on_engine(
    engines: Callable[[], contextlib.AbstractContextManager[Engine]], writer: StoreWriter,
    src: Location, dst: Location, kind: str, devices: list[DeviceSource], *, curation: Curation,
    on_bad_rows: str, chunk_windows: int, shuffle: bool, seed: int | None, buckets: int,
    shuffle_tmp: str | None, duplicates: DuplicateCounter | None, bar: Any,
    second_pass: Callable[[str, int], None], windows_done: Callable[[int], None],
) -> dict[str, Any]:
    """The conversion's tasks on engines from ``engines()``, whichever they are: the shuffle's two
    passes, CSV parts (``_pipeline.py``) or the segments of Parquet devices (``_segments.py``).
    Facts for the report."""
    refuse_repeated_devices(src.display, devices)
    if shuffle:
        assert seed is not None
        shuffled, facts = write_shuffled_on(
            engines, writer, devices, seed=seed, buckets=buckets, tmp_dir=shuffle_tmp,
            curation=curation, on_bad_rows=on_bad_rows, dest=dst, duplicates=duplicates, on_pass=second_pass,
            on_written=windows_done, on_spilled=windows_done)
        return {"shuffle": shuffled, **facts}
    with engines() as engine:
        if kind == "csv":
            write_csv_devices(engine, writer, devices, curation=curation, on_bad_rows=on_bad_rows,
                              duplicates=duplicates, bar=bar)
            return dict(engine.facts)
        counts = count_devices(devices, curation=curation, on_bad_rows=on_bad_rows, engine=engine)
        # devices larger than PART_WINDOWS as parts, cut at row groups: the tasks stay even
        members, sizes = split_large(devices, counts, on_bad_rows=on_bad_rows)
        plan = plan_segments(members, sizes, workers=engine.width, chunk_windows=chunk_windows)
        return {**convert_segments(engine, writer, plan, curation=curation, on_bad_rows=on_bad_rows,
                                   dest=dst, duplicates=duplicates, bar=bar), **engine.facts}


def require_windows(where: str, writer: StoreWriter) -> None:
    """Refuse to commit a store without a single window (all rows bad, filtered or too short)."""
    if writer.has_windows():
        return
    rows = sum(r.rows_read for r in writer.reports.values())
    bad = sum(r.bad_lines for r in writer.reports.values())
    bad_files = sum(r.bad_files for r in writer.reports.values())
    dropped: dict[str, int] = {}
    for report in writer.reports.values():
        for reason, count in report.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + count
    why = ", ".join(f"{reason} {count:,}" for reason, count in sorted(dropped.items())) or "none"
    raise BadInputError(
        f"{where}: the input gives no windows ({rows:,} rows read, {bad:,} bad lines or rows and "
        f"{bad_files} unreadable file(s) skipped; windows dropped: {why}), so nothing was "
        "committed. Check the input (without --on-bad-rows skip the first bad line is named)."
    )


def _estimated_windows(kind: str, devices: list[DeviceSource]) -> int:
    """An over-estimate of the windows in the input, from file sizes (sizes the shuffle's buckets)."""
    files = {f.url: f for d in devices for f in d.files}  # a partition file is listed by each device
    total = sum(f.fs.size(f.path) or 0 for f in files.values())
    # Parquet of calibrated windows compresses ~2.2x (320 bytes a window); a CSV window is 20
    # lines of 50-80 bytes. Over-estimating only makes more, smaller buckets.
    return int(total * 3 / 320) if kind == "parquet" else int(total / 1000)


# Last: _append imports helpers defined above (ON_BAD_ROWS).
from birdzarr.convert._append import append  # noqa: E402
