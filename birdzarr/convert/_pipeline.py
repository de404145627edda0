"""CSV in device order as tasks: each part read, parsed and curated by a task on an engine, the
parts joined and written here in store order.

A CSV device's window count is known only once it is read and curated, which is most of its
conversion's CPU (one device of the benchmark's CSV, 33,019 windows: counting 0.56-0.74 CPU s,
converting 0.73-0.80 CPU s), so a CSV conversion does not count its windows first to place them
(as Parquet segments do from their footers, ``_segments.py``). Its tasks are the parts instead
(``_csv.read_part``): ``2 x width`` of them in flight on the engine's workers (``_engine.ordered``),
their results taken in part order. A part's ends (a burst may continue from one part into the
next) are joined here by ``_csv.Stitcher``, and the writer encodes and writes the windows in
store order, so the store is the same on every engine and with any number of workers. An append
runs the same tasks, each device's first new part continuing the burst its commit left
unfinished (``carries``), its windows checked for duplicates against the committed ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._csv import PartPieces, Stitcher, _Rows, read_part
from birdzarr.convert._duplicates import DuplicateCounter
from birdzarr.convert._engine import Engine, ordered
from birdzarr.convert._sources import DeviceSource
from birdzarr.convert._writer import Writer
from birdzarr.format._spec import Curation

Hashes = Callable[[np.ndarray], np.ndarray]  # timestamps -> hashes of committed windows that may match


def write_csv_devices(engine: Engine, writer: Writer, devices: list[DeviceSource], *, curation: Curation,
                      on_bad_rows: str, duplicates: DuplicateCounter | None, bar: Any,
                      carries: dict[int, _Rows] | None = None,
                      existing: Callable[[int], Hashes | None] | None = None) -> None:
    """Every CSV device, in order, written by ``writer``: its parts read on ``engine``. An
    append's: ``carries`` (device -> the committed unfinished burst its first new part
    continues) and ``existing`` (device -> the hashes of its committed windows, for the duplicate
    check: ``DuplicateCounter.watch``)."""
    calls = [(device.device_id, part, curation, on_bad_rows) for device in devices for part in device.files]
    parts = ordered(engine, read_part, calls)
    carries = carries or {}
    try:
        for device in devices:
            carry = carries.get(device.device_id)
            blocks = counted(_stitched(parts, len(device.files), curation, carry), bar)
            if duplicates is not None:  # counts windows repeated within a device (convert/_duplicates.py)
                blocks = duplicates.watch(device.device_id, blocks,
                                          None if existing is None else existing(device.device_id))
            writer.write_device(device.device_id, blocks, device.source_names(),
                                continued=0 if carry is None else len(carry))
    finally:
        parts.close()  # on a failure: nothing more submitted, every submitted part ended


def _stitched(parts: Iterator[PartPieces], n: int, curation: Curation,
              carry: _Rows | None = None) -> Iterator[WindowBlock]:
    """The curated blocks of a device's next ``n`` parts (the first continuing ``carry``)."""
    stitcher = Stitcher(curation, carry)
    for _ in range(n):
        yield from stitcher.add(next(parts))
    yield stitcher.finish()


def counted(blocks: Iterator[WindowBlock], bar: Any) -> Iterator[WindowBlock]:
    """Count blocks on the progress bar (``count_on_bar``)."""
    for block in blocks:
        count_on_bar(bar, len(block))
        yield block


def count_on_bar(bar: Any, windows: int, window_bytes: int = 320) -> None:
    """Windows done, on the progress bar: windows/s as its rate, MB/s of float32 windows beside."""
    bar.update(windows)
    if getattr(bar, "disable", False):  # --quiet: no rate to show (format_dict is per block)
        return
    elapsed = bar.format_dict.get("elapsed", 0) if hasattr(bar, "format_dict") else 0
    if elapsed:
        bar.set_postfix_str(f"{bar.n * window_bytes / elapsed / 1e6:.0f} MB/s", refresh=False)


def bar_counter(bar: Any) -> Callable[[int], None]:
    """``count_on_bar`` for tasks running on threads of this process (an engine's ``in_process``):
    they count their windows as they go, one at a time."""
    lock = threading.Lock()

    def count(windows: int) -> None:
        with lock:
            count_on_bar(bar, windows)

    return count
