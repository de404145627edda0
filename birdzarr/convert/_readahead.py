"""Reading a device's input on a thread a few blocks ahead, so parsing overlaps encoding."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._sources import DeviceSource
from birdzarr.format._spec import Curation

READAHEAD_BLOCKS = 4


def read_ahead(
    device: DeviceSource, curation: Curation, on_bad_rows: str, *, depth: int = READAHEAD_BLOCKS
) -> Iterator[WindowBlock]:
    """The device's blocks, read on a thread at most ``depth`` blocks ahead.

    Safe to abandon part way: every hand-over gives up once the consumer has stopped, so a
    consumer that raises or stops early never leaves the reader thread blocked on a full queue.
    """
    items: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for block in device.blocks(curation=curation, on_bad_rows=on_bad_rows):
                if not put(block):
                    return
            put(done)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            put(exc)

    thread = threading.Thread(target=produce, name="birdzarr-read", daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
