"""Reading and curating the input on several workers at once, handed over in store order.

The input is cut into tasks in store order: a Parquet task is one row group of one file, a CSV
task is one part file of one device. ``workers`` tasks run at once and their results are handed
to the writer strictly in task order, so the store is the same whatever the number of workers.

- Parquet row groups run on threads: pyarrow decodes with the GIL released. A task streams
  batches of 16,384 windows into its own queue; the task the writer is waiting for may hold
  ``HEAD_DEPTH`` batches, and all later tasks together at most ``workers * AHEAD_PER_WORKER``
  (they wait when that is full, so a huge row group never lets the others run away with memory).
- CSV parts run in worker processes: parsing and window curation hold the GIL for much of their
  time. A worker reads, parses and curates one part (``birdzarr.convert._csv.read_part``);
  at most ``workers + 1`` parts are in flight and the part's ends (a burst may continue from one
  part into the next) are joined here, in order, by ``birdzarr.convert._csv.Stitcher``.

With ``workers=1`` everything runs in the calling thread, one task after another.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._csv import PartPieces, Stitcher, read_part
from birdzarr.convert._engine import fork_available, forked_pool
from birdzarr.convert._parquet import ParquetDeviceReader
from birdzarr.convert._sources import DeviceSource
from birdzarr.format._spec import Curation

HEAD_DEPTH = 4  # batches buffered for the task the writer reads now
AHEAD_PER_WORKER = 2  # batches buffered per worker for all the tasks after it
# Parquet files at least this large are split into one task per row group (pyarrow's default
# row group of 1,048,576 windows is ~150 MB of calibrated Parquet).
SPLIT_MIN_BYTES = 32 << 20

Task = Callable[[], Iterator[WindowBlock]]


def device_blocks(
    devices: list[DeviceSource], curation: Curation, on_bad_rows: str, *, workers: int
) -> Iterator[tuple[DeviceSource, Iterator[WindowBlock]]]:
    """Each device with an iterator of its curated blocks, in device order; the next devices'
    input is read ahead while the caller consumes one. Consume each iterator before the next."""
    if not devices:
        return
    if devices[0].kind == "parquet":
        stream: Iterator[tuple[int, Any]] = _parquet_stream(devices, on_bad_rows, workers)
    else:
        stream = _csv_stream(devices, curation, on_bad_rows, workers)
    feed = _Peekable(stream)
    try:
        for index, device in enumerate(devices):
            items = feed.take_while(index)
            if device.kind == "csv":
                yield device, _stitched(items, curation)
            else:
                yield device, items
            feed.skip(index)  # whatever the consumer left of this device
    finally:
        feed.close()


def _stitched(pieces: Iterator[PartPieces], curation: Curation) -> Iterator[WindowBlock]:
    stitcher = Stitcher(curation)
    for part in pieces:
        yield from stitcher.add(part)
    yield stitcher.finish()


class _Peekable:
    """A stream of ``(device index, item)`` read one device at a time."""

    def __init__(self, stream: Iterator[tuple[int, Any]]) -> None:
        self.stream = stream
        self.next: tuple[int, Any] | None = None
        self.ended = False

    def _peek(self) -> tuple[int, Any] | None:
        if self.next is None and not self.ended:
            try:
                self.next = next(self.stream)
            except StopIteration:
                self.ended = True
        return self.next

    def take_while(self, index: int) -> Iterator[Any]:
        while (item := self._peek()) is not None and item[0] == index:
            self.next = None
            yield item[1]

    def skip(self, index: int) -> None:
        for _ in self.take_while(index):
            pass

    def close(self) -> None:
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()


# -- Parquet: row groups on threads ------------------------------------------------------------
def _parquet_tasks(devices: list[DeviceSource], on_bad_rows: str) -> Iterator[tuple[int, Task]]:
    for index, device in enumerate(devices):
        for file in device.files:
            reader = ParquetDeviceReader(device.device_id, file, on_bad_rows)
            # a file smaller than a row group's worth of windows is one task (no extra footer read)
            small = file.fs.size(file.path) < SPLIT_MIN_BYTES if file.is_local else False
            groups = None if small else reader.row_groups()
            if groups is None or groups <= 1:  # one task; a bad file reports itself
                yield index, reader.blocks
            else:
                for group in range(groups):
                    yield index, functools.partial(reader.blocks, group)


def _parquet_stream(devices: list[DeviceSource], on_bad_rows: str, workers: int) -> Iterator[tuple[int, Any]]:
    tasks = _parquet_tasks(devices, on_bad_rows)
    if workers <= 1:
        for index, task in tasks:
            for block in task():
                yield index, block
        return
    yield from ordered_streams(tasks, workers=workers, ahead=workers * AHEAD_PER_WORKER)


class _State:
    """What the workers and the consumer of ``ordered_streams`` share, under its lock."""

    def __init__(self) -> None:
        self.next_task = 0  # the number of the next task to start
        self.head = -1  # the task the consumer reads now (-1: none yet)
        self.ahead = 0  # items buffered by tasks after the head
        self.stop = False
        self.tasks_done = False
        self.count: int | None = None  # the number of tasks, once known


class _Slot:
    """One task's hand-over queue."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.items: collections.deque[Any] = collections.deque()
        self.done = False
        self.error: BaseException | None = None


def ordered_streams(
    tasks: Iterator[tuple[Any, Task]], *, workers: int, ahead: int, head_depth: int = HEAD_DEPTH
) -> Generator[tuple[Any, Any], None, None]:
    """Run each task (a function returning an iterator) on one of ``workers`` threads and yield
    ``(key, item)`` in task order. Tasks start in order; the task being yielded from may buffer
    ``head_depth`` items and all later ones together ``ahead`` items. A task's exception is
    raised where its items stop. Closing the generator stops the workers."""
    lock = threading.Condition()
    slots: dict[int, _Slot] = {}
    state = _State()
    task_iter = iter(tasks)

    def claim() -> tuple[int, Task] | None:
        with lock:
            if state.stop or state.tasks_done:
                return None
            try:
                key, task = next(task_iter)
            except StopIteration:
                state.tasks_done, state.count = True, state.next_task
                lock.notify_all()
                return None
            except BaseException as exc:  # listing the tasks failed: the consumer raises it
                number = state.next_task
                slot = slots[number] = _Slot(None)
                slot.error, slot.done = exc, True
                state.next_task += 1
                state.tasks_done, state.count = True, state.next_task
                lock.notify_all()
                return None
            number = state.next_task
            slots[number] = _Slot(key)
            state.next_task += 1
            return number, task

    def run() -> None:
        while (claimed := claim()) is not None:
            number, task = claimed
            slot = slots[number]
            try:
                iterator = task()
                try:
                    for item in iterator:
                        with lock:
                            while not state.stop and not (
                                (number == state.head and len(slot.items) < head_depth)
                                or (number != state.head and state.ahead < ahead)
                            ):
                                lock.wait()
                            if state.stop:
                                return
                            slot.items.append(item)
                            if number != state.head:
                                state.ahead += 1
                            lock.notify_all()
                finally:
                    close = getattr(iterator, "close", None)
                    if close is not None:
                        close()
            except BaseException as exc:  # handed to the consumer, which raises it in order
                with lock:
                    slot.error = exc
            with lock:
                slot.done = True
                lock.notify_all()

    threads = [threading.Thread(target=run, name=f"birdzarr-read-{i}", daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    try:
        number = 0
        while True:
            with lock:
                while number not in slots and not (state.count is not None and number >= state.count):
                    lock.wait()
                if number not in slots:
                    return
                slot = slots[number]
                state.head = number
                # items buffered while this task was not the head no longer count as "ahead"
                state.ahead -= len(slot.items)
                lock.notify_all()
            while True:
                with lock:
                    while not slot.items and not slot.done:
                        lock.wait()
                    if slot.items:
                        item = slot.items.popleft()
                        lock.notify_all()
                    elif slot.error is not None:
                        raise slot.error
                    else:
                        del slots[number]
                        break
                yield slot.key, item
            number += 1
    finally:
        with lock:
            state.stop = True
            lock.notify_all()
        for thread in threads:
            thread.join()


# -- CSV: part files in processes --------------------------------------------------------------
def _csv_stream(
    devices: list[DeviceSource], curation: Curation, on_bad_rows: str, workers: int
) -> Iterator[tuple[int, Any]]:
    calls = [(index, device.device_id, part) for index, device in enumerate(devices) for part in device.files]
    if workers <= 1:
        for index, device_id, part in calls:
            yield index, read_part(device_id, part, curation, on_bad_rows)
        return
    with _csv_executor(devices, workers) as pool:
        pending: collections.deque[tuple[int, Future[PartPieces]]] = collections.deque()
        try:
            for index, device_id, part in calls:
                pending.append((index, pool.submit(read_part, device_id, part, curation, on_bad_rows)))
                if len(pending) > workers:
                    index0, future = pending.popleft()
                    yield index0, future.result()
            while pending:
                index0, future = pending.popleft()
                yield index0, future.result()
        finally:
            for _, future in pending:
                future.cancel()


def _csv_executor(devices: list[DeviceSource], workers: int) -> Executor:
    """Worker processes for a large local-or-remote CSV input (threads for a small one, or where
    ``fork`` is unavailable): the engine's forked workers (``_engine.forked_pool``: a worker
    starts in milliseconds, imports nothing and ends with this process); they only run
    ``read_part`` (pyarrow and numpy re-initialise their thread pools after fork). The size
    threshold is ``_segments.PROCESS_MIN_BYTES``, the one every conversion uses."""
    from birdzarr.convert import _segments  # imports this module

    size = 0
    for device in devices:
        for part in device.files:
            size += int(part.fs.size(part.path) or 0)
            if size >= _segments.PROCESS_MIN_BYTES:
                break
    if size >= _segments.PROCESS_MIN_BYTES and fork_available():
        return forked_pool(workers)
    return ThreadPoolExecutor(workers, thread_name_prefix="birdzarr-csv")


def counted(blocks: Iterator[WindowBlock], bar: Any) -> Iterator[WindowBlock]:
    """Count blocks on the progress bar (``count_on_bar``)."""
    for block in blocks:
        count_on_bar(bar, len(block))
        yield block


def count_on_bar(bar: Any, windows: int, window_bytes: int = 320) -> None:
    """Windows done, on the progress bar: windows/s as its rate, MB/s of float32 windows beside."""
    bar.update(windows)
    elapsed = bar.format_dict.get("elapsed", 0) if hasattr(bar, "format_dict") else 0
    if elapsed:
        bar.set_postfix_str(f"{bar.n * window_bytes / elapsed / 1e6:.0f} MB/s", refresh=False)
