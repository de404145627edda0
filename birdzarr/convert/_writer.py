"""Writing a store: arrays first, the commit (root attributes) last.

A store whose root attributes lack ``committed`` is an unfinished conversion; readers refuse it
and a new conversion replaces it. Windows are written in whole-chunk slabs through zarr-python,
which encodes the chunks of a slab on its thread pool while the caller parses the next input.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from typing import Any

import google_crc32c
import numpy as np
import zarr

from birdzarr._errors import NotAStoreError, StoreExistsError
from birdzarr._version import __version__
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._chunkwrite import ChunkSink
from birdzarr.convert._cpus import resolve_workers
from birdzarr.format._codec import gimu_codecs, per_window_codecs
from birdzarr.format._spec import (
    ATTRS_KEY,
    CHANNELS,
    DEVICE,
    FORMAT_VERSION,
    GIMU,
    GIMU_DIMS,
    LABEL,
    LABEL_UNLABELLED,
    N_CHANNELS,
    TIMESTAMP,
    TIMESTAMP_UNKNOWN,
    WINDOW_LENGTH,
    DeviceEntry,
    DeviceRange,
    DeviceReport,
    array_attributes,
)
from birdzarr.storage._location import Location, exists, zarr_store
from birdzarr.storage._lock import LOCK_NAME, StoreLock, clear_except_lock, release_and_tidy

_PER_WINDOW_DTYPES = {DEVICE: np.int32, TIMESTAMP: np.int64, LABEL: np.int32}
_FILL = {DEVICE: -1, TIMESTAMP: TIMESTAMP_UNKNOWN, LABEL: LABEL_UNLABELLED}
# Every committed chunk is written, even one equal to the fill value (an all-unlabelled label
# chunk): readers treat a missing chunk as damage, never as fill values.
_EVERY_CHUNK: Any = {"write_empty_chunks": True}


class WindowChecksum:
    """CRC-32C (Castagnoli) of windows' little-endian float32 bytes, fed in order.

    Hardware CRC-32C runs at several GB/s, over ten times BLAKE2b, which cost a fifth of the
    conversion's CPU; the checksums guard against damage, not against an adversary.
    """

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: bytes | memoryview) -> None:
        self._crc = google_crc32c.extend(self._crc, data if isinstance(data, bytes) else bytes(data))

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


def checksum_hasher() -> WindowChecksum:
    """The checksum of a run of curated windows (see ``WindowChecksum``)."""
    return WindowChecksum()


def label_counts(labels: np.ndarray) -> tuple[list[int], list[int]]:
    """The distinct labels (ascending) and their counts; one label (all Parquet input, most
    blocks of CSV input) is counted without sorting."""
    if len(labels) and labels.min() == labels.max():
        return [int(labels[0])], [len(labels)]
    values, counts = np.unique(labels, return_counts=True)
    return values.tolist(), counts.tolist()


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class StoreWriter:
    """Context manager that creates a store, takes device after device, and commits once."""

    def __init__(
        self,
        location: Location,
        *,
        codec: str = "dict16",
        chunk_windows: int = 8192,
        overwrite: bool = False,
        static_attrs: dict[str, Any] | None = None,
        chunks_per_slab: int = 8,
        max_pending_slabs: int = 2,
        lock_command: str | None = None,
        workers: int | None = None,
    ) -> None:
        # encoding threads of the fast write path (default: all usable cores); 1: everything is
        # encoded in the calling thread, one chunk after another
        self.workers = resolve_workers(workers)
        self.location = location
        self.lock = StoreLock(location, lock_command)  # one writer per store (birdzarr/storage/_lock.py)
        self.codec = codec
        self.chunk_windows = chunk_windows
        self.overwrite = overwrite
        self.static_attrs = dict(static_attrs or {})
        self.slab_windows = chunk_windows * chunks_per_slab
        self.devices: dict[int, DeviceEntry] = {}
        self.reports: dict[int, DeviceReport] = {}
        self.n_windows = 0  # windows handed to zarr so far
        self._buffer: list[tuple[int, WindowBlock]] = []
        self._buffered = 0
        self._pool = ThreadPoolExecutor(max_workers=max_pending_slabs, thread_name_prefix="birdzarr-write")
        self._pending: list[Future[None]] = []
        self._max_pending = max_pending_slabs
        self._committed = False
        self._created = False
        self.started_at = _now()

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> StoreWriter:
        self.lock.acquire()
        try:
            return self._open()
        except BaseException:
            if self._created:
                clear_except_lock(self.location)
            release_and_tidy(self.lock, remove_root=True)
            raise

    def _open(self) -> StoreWriter:
        self._prepare_destination()
        store = zarr_store(self.location, read_only=False)
        # mode "a", not "w": "w" would delete the lock file; _prepare_destination emptied the root.
        self.group = zarr.open_group(store, mode="a", zarr_format=3)
        self._created = True
        self.group.attrs.put({ATTRS_KEY: self._attrs(committed=None)})
        self.gimu = self.group.create_array(
            GIMU, shape=(0, WINDOW_LENGTH, N_CHANNELS), dtype="float32",
            chunks=(self.chunk_windows, WINDOW_LENGTH, N_CHANNELS), fill_value=0.0,
            dimension_names=GIMU_DIMS, attributes=array_attributes(GIMU),
            overwrite=True, config=_EVERY_CHUNK,
            **gimu_codecs(self.codec, **self.static_attrs.get("layout", {}).get("compressor", {})),
        )
        self.per_window = {
            name: self.group.create_array(
                name, shape=(0,), dtype=dtype, chunks=(self.chunk_windows,), fill_value=_FILL[name],
                dimension_names=("window",), attributes=array_attributes(name), overwrite=True,
                config=_EVERY_CHUNK, **per_window_codecs(),
            )
            for name, dtype in _PER_WINDOW_DTYPES.items()
        }
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                self._drain()
            else:  # leaving on an error: write nothing more, only let slabs in flight finish
                self._buffer.clear()
                self._buffered = 0
                for pending in self._pending:
                    pending.cancel()
                    with contextlib.suppress(BaseException):  # the original error is the one to raise
                        pending.result()
                self._pending.clear()
        finally:
            self._pool.shutdown(wait=True)
            failed = exc_type is not None and not self._committed
            if failed:
                self._abandon()
            release_and_tidy(self.lock, remove_root=failed and self._created)

    def _abandon(self) -> None:
        """Undo an uncommitted write, under the lock: a failed conversion leaves nothing behind."""
        if self._created:
            clear_except_lock(self.location)

    def _prepare_destination(self) -> None:
        if not exists(self.location):
            return
        fs, path = self.location.fs, self.location.path
        if fs.isfile(path):
            raise StoreExistsError(f"{self.location.display} is a file; choose another destination.")
        if not [p for p in fs.ls(path, detail=False) if not p.rstrip("/").endswith(LOCK_NAME)]:
            return
        if self.overwrite:
            clear_except_lock(self.location)
            return
        if _is_unfinished_store(self.location):
            clear_except_lock(self.location)  # an interrupted conversion: start it again from scratch
            return
        raise StoreExistsError(
            f"{self.location.display} already exists and is not empty. Pass --overwrite "
            "(Python: overwrite=True) to replace it, or choose another destination."
        )

    # -- writing ---------------------------------------------------------------------------------
    def write_device(self, device_id: int, blocks: Iterable[WindowBlock], sources: list[str]) -> DeviceReport:
        """Append every window of one device; returns what its input produced."""
        if device_id in self.devices:
            raise NotAStoreError(f"device {device_id} was given twice in one conversion")
        entry = DeviceEntry(device_id=device_id, sources=sources)
        report = DeviceReport()
        start = self.n_windows + self._buffered
        hasher = checksum_hasher()
        times: list[np.ndarray] = []
        for block in blocks:
            report.merge(block.report)
            if not len(block):
                continue
            hasher.update(np.ascontiguousarray(block.windows, dtype="<f4").data.cast("B"))
            for label, count in zip(*label_counts(block.labels), strict=True):
                entry.label_counts[label] = entry.label_counts.get(label, 0) + count
            known = block.timestamps[block.timestamps != TIMESTAMP_UNKNOWN]
            if len(known):
                times.append(np.array([known.min(), known.max()]))
            self._add(device_id, block)
        stop = self.n_windows + self._buffered
        entry.n_windows = stop - start
        if entry.n_windows:
            entry.ranges.append(DeviceRange(start, stop, hasher.hexdigest()))
        if times:
            stacked = np.concatenate(times)
            entry.first_time, entry.last_time = int(stacked.min()), int(stacked.max())
        self.devices[device_id] = entry
        self.reports[device_id] = report
        return report

    def _add(self, device_id: int, block: WindowBlock) -> None:
        self._buffer.append((device_id, block))
        self._buffered += len(block)
        while self._buffered >= self._slab_room():
            self._flush(self._slab_room())

    def _slab_room(self) -> int:
        """Windows to the next slab boundary: an append that starts inside a chunk first fills
        that chunk, so no two slabs in flight ever rewrite the same chunk."""
        return self.slab_windows - self.n_windows % self.chunk_windows

    def _take(self, n: int) -> dict[str, np.ndarray]:
        """Remove the first ``n`` buffered windows and return them as arrays."""
        parts: dict[str, list[np.ndarray]] = {GIMU: [], DEVICE: [], TIMESTAMP: [], LABEL: []}
        need = n
        while need:
            device_id, block = self._buffer[0]
            take = min(need, len(block))
            parts[GIMU].append(block.windows[:take])
            parts[TIMESTAMP].append(block.timestamps[:take])
            parts[LABEL].append(block.labels[:take])
            parts[DEVICE].append(block.device_column(device_id)[:take])
            if take == len(block):
                self._buffer.pop(0)
            else:
                self._buffer[0] = (device_id, block.tail(take))
            need -= take
        self._buffered -= n
        return {name: np.concatenate(arrays) for name, arrays in parts.items()}

    def _flush(self, n: int) -> None:
        data = self._take(n)
        start, stop = self.n_windows, self.n_windows + n
        self._wait(self._max_pending - 1)
        self.gimu.resize((stop, WINDOW_LENGTH, N_CHANNELS))
        for array in self.per_window.values():
            array.resize((stop,))
        self.n_windows = stop
        if self.workers == 1:
            self._write_slab(start, stop, data)
            return
        self._pending.append(self._pool.submit(self._write_slab, start, stop, data))

    @cached_property
    def chunk_sink(self) -> ChunkSink:
        return ChunkSink(self.location, {GIMU: self.gimu, **self.per_window}, workers=self.workers)

    def _write_slab(self, start: int, stop: int, data: dict[str, np.ndarray]) -> None:
        if self.chunk_sink.can_write(start):
            self.chunk_sink.write(start, stop, data)  # whole chunks, no zarr overhead: _chunkwrite.py
            return
        self.gimu[start:stop] = data[GIMU]
        for name, array in self.per_window.items():
            array[start:stop] = data[name]

    def _wait(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.pop(0).result()

    def _drain(self) -> None:
        if self._buffered:
            self._flush(self._buffered)
        self._wait(0)

    # -- commit ----------------------------------------------------------------------------------
    def commit(self, extra_report: dict[str, Any] | None = None) -> dict[str, Any]:
        """Make everything written visible: the one write that turns the group into a store."""
        self._drain()
        report = {
            "started_at": self.started_at,
            "finished_at": _now(),
            "devices": {str(d): r.to_json() for d, r in sorted(self.reports.items())},
            **(extra_report or {}),
        }
        committed = {"n_windows": self.n_windows, "generation": 1, "committed_at": _now()}
        attrs = self._attrs(committed=committed)
        attrs["devices"] = [self.devices[d].to_json() for d in sorted(self.devices)]
        attrs["report"] = report
        self.group.attrs.put({ATTRS_KEY: attrs})
        self._committed = True
        return attrs

    def _attrs(self, *, committed: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "window_length": WINDOW_LENGTH,
            "channels": list(CHANNELS),
            **self.static_attrs,
            "converter": {"name": "birdzarr", "version": __version__},
            "committed": committed,
        }


def _is_unfinished_store(location: Location) -> bool:
    """True if the location holds a birdzarr group that never committed."""
    import json

    try:
        raw = json.loads(location.fs.cat_file(location.join("zarr.json")))
    except (FileNotFoundError, ValueError):
        return False
    meta = raw.get("attributes", {}).get(ATTRS_KEY)
    return isinstance(meta, dict) and meta.get("committed") is None
