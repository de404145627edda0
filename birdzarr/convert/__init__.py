"""Conversion of raw CSV exports and per-device Parquet files into one store."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import zarr

from birdzarr._errors import BadInputError
from birdzarr._format import MIXED_LABEL_POLICY, WINDOW_RULE, Curation
from birdzarr._progress import progress_bar
from birdzarr._storage import StoreLike, resolve
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._sources import DeviceSource, discover
from birdzarr.convert._writer import StoreWriter

if TYPE_CHECKING:
    from birdzarr._store import Store

__all__ = ["convert"]

ON_BAD_ROWS = ("error", "skip")
_READAHEAD_BLOCKS = 4
_DONE = object()


def _read_ahead(source: DeviceSource, curation: Curation, on_bad_rows: str) -> Iterator[WindowBlock]:
    """Run the reader in a thread so parsing overlaps encoding; at most a few blocks in flight."""
    blocks: queue.Queue[Any] = queue.Queue(maxsize=_READAHEAD_BLOCKS)
    stop = threading.Event()

    def produce() -> None:
        try:
            for block in source.blocks(curation=curation, on_bad_rows=on_bad_rows):
                while not stop.is_set():
                    try:
                        blocks.put(block, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            blocks.put(_DONE)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            blocks.put(exc)

    thread = threading.Thread(target=produce, name="birdzarr-read", daemon=True)
    thread.start()
    try:
        while True:
            item = blocks.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def convert(
    source: StoreLike,
    dest: StoreLike,
    *,
    overwrite: bool = False,
    codec: str = "dict16",
    chunk_windows: int = 8192,
    on_bad_rows: str = "error",
    curation: Curation | None = None,
    workers: int | None = None,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    source_storage_options: dict[str, Any] | None = None,
) -> Store:
    """Convert a directory (or file, or fsspec URL) of CSV exports or Parquet files into a store.

    CSV input is curated per window (see docs/conversion.md); Parquet input is already curated
    and copied exactly. Returns the committed store, opened read-only. On any error nothing is
    committed at ``dest`` and what was written is removed.
    """
    from birdzarr._store import open_store

    if on_bad_rows not in ON_BAD_ROWS:
        raise ValueError(f"on_bad_rows must be one of {ON_BAD_ROWS}, got {on_bad_rows!r}")
    if chunk_windows < 1:
        raise ValueError("chunk_windows must be positive")
    curation = curation or Curation()
    src = resolve(source, source_storage_options)
    dst = resolve(dest, storage_options)
    kind, devices = discover(src)
    curation_attrs = (
        curation.to_json(applied_by="birdzarr")
        if kind == "csv"
        else {"applied_by": "source", "note": "Parquet input holds windows curated before conversion"}
    )
    static = {
        "source_kind": kind,
        "window_rule": WINDOW_RULE if kind == "csv" else "one Parquet row is one window",
        "mixed_label_policy": MIXED_LABEL_POLICY,
        "curation": curation_attrs,
        "layout": {"codec": codec, "chunk_windows": chunk_windows, "shuffled": False},
    }
    started = time.perf_counter()
    config = {"threading.max_workers": workers} if workers else {}
    with zarr.config.set(config), StoreWriter(
        dst, codec=codec, chunk_windows=chunk_windows, overwrite=overwrite, static_attrs=static
    ) as writer, progress_bar(progress, desc=f"convert {kind}", unit=" windows") as bar:
        seen: set[int] = set()
        for device in devices:
            sources = [f.display.rsplit("/", 1)[-1] for f in device.files]
            blocks = _counted(_read_ahead(device, curation, on_bad_rows), bar)
            device_id = device.device_id
            if device_id in seen:
                raise BadInputError(f"{src.display}: device {device_id} appears in more than one input.")
            seen.add(device_id)
            writer.write_device(device_id, blocks, sources)
        seconds = time.perf_counter() - started
        writer.commit({"source": src.display, "seconds": round(seconds, 3)})
    return open_store(dst)


def _counted(blocks: Iterator[WindowBlock], bar: Any) -> Iterator[WindowBlock]:
    for block in blocks:
        bar.update(len(block))
        yield block

