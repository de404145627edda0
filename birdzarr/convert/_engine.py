"""One runner for a conversion's worker-side work, on any ``concurrent.futures.Executor``.

A conversion (or an append) is a plan of tasks: picklable functions of picklable arguments
(``_segments.convert_segment`` for a device-order segment, ``_csv.read_part`` for a CSV part,
``_shuffle_processes.spill_group`` and ``write_bucket_run`` for the shuffle's passes). The
``Runner`` submits them to an ``Engine``'s executor, at most ``2 x width`` at once, and hands
back each result as it arrives (a failure as soon as it is known); ``ordered`` hands them back
in the order of the calls instead. Every conversion runs this way; choosing the engine is the
only thing that differs between conversions (``choose_engine``):

- ``in_process_engine()``: one worker, this thread: a task runs when it is submitted
  (``workers=1``);
- ``thread_engine(n)``: ``n`` threads of this process (input too small to pay for worker
  processes, a ``memory://`` destination, no ``fork``);
- ``local_engine(n)``: ``n`` worker processes started with ``fork`` (Linux; a worker starts in
  milliseconds, imports nothing again and ends with this process: ``die_with_parent``);
- ``cluster_engine(client)``: a Dask cluster, through ``client.get_executor()``.

A task never relies on what a worker inherited: everything it needs is in its arguments or in
files it is told the path of (the shuffle's spill, on storage every worker reaches).

Every task runs under ``TaskMalloc``: where the process's environment pins glibc malloc's
thresholds (a Dask worker: its nanny sets ``MALLOC_TRIM_THRESHOLD_``), a task's arrays come from
the heap, as in a forked worker, instead of fresh pages from the kernel each time.

On a failure (or an interrupt) no queued task starts, and every task already submitted ends
before the caller goes on (it then removes what was written: no task writes a chunk after the
clean-up). Tasks are never cancelled once submitted, since neither executor can stop a running
one, so at most ``2 x width`` tasks run after a failure.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Generator, Hashable, Iterable, Iterator
from concurrent.futures import (
    FIRST_COMPLETED,
    Executor,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass, field
from typing import Any

# tasks submitted per unit of width: one running, one queued to start as soon as it ends
IN_FLIGHT_PER_SLOT = 2


@dataclass
class Engine:
    """An executor, the tasks it runs at once (``width``) and the facts the report gives of it."""

    executor: Executor
    width: int
    facts: dict[str, Any] = field(default_factory=dict)
    # its tasks run in this process (they share its memory: a memory:// store, its CPU count)
    in_process: bool = False


class InProcess(Executor):
    """An executor that runs each call in the calling thread, when it is submitted (one worker:
    nothing is started, and a task's exception is its future's)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the future's, raised where it is read
            future.set_exception(exc)
        return future


def fork_available() -> bool:
    """Whether worker processes can be forked (in milliseconds, nothing imported again): Linux,
    not macOS, where fork after threads have started is unsafe in its system libraries."""
    return "fork" in multiprocessing.get_all_start_methods() and sys.platform != "darwin"


def die_with_parent() -> None:
    """A worker process ends when this process does, even killed: it never writes into a store
    after the conversion that started it is gone (Linux ``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent ended before the line above took effect
        os._exit(1)


def forked_pool(processes: int) -> ProcessPoolExecutor:
    """Worker processes started with ``fork``, each ending with this process (``die_with_parent``)."""
    # The encoders' hash tables are pandas': imported here once, before the fork, instead of in
    # every worker (0.1 s of CPU each here)
    import pandas  # noqa: F401

    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"),
                               initializer=die_with_parent)


@contextlib.contextmanager
def local_engine(processes: int) -> Iterator[Engine]:
    """``processes`` forked worker processes (``fork_available`` must be true)."""
    pool = forked_pool(processes)
    try:
        yield Engine(pool, processes, {"worker_processes": processes})
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def in_process_engine() -> Iterator[Engine]:
    """Every task in this thread, one after another (``workers=1``)."""
    yield Engine(InProcess(), 1, in_process=True)


@contextlib.contextmanager
def thread_engine(threads: int) -> Iterator[Engine]:
    """``threads`` threads of this process (one: ``in_process_engine``)."""
    if threads <= 1:
        with in_process_engine() as engine:
            yield engine
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="birdzarr-task")
    try:
        yield Engine(pool, threads, in_process=True)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def processes_pay(input_bytes: int, *, workers: int, dest_shared: bool) -> bool:
    """Whether a local conversion runs in worker processes: more than one worker, ``fork``
    available, a destination they can write to (not ``memory://``) and input of at least
    ``PROCESS_MIN_BYTES`` (below it, starting them costs more than they save: threads)."""
    from birdzarr.convert import _segments  # the threshold lives beside the segments' plan

    return (workers > 1 and dest_shared and fork_available()
            and input_bytes >= _segments.PROCESS_MIN_BYTES)


def choose_engine(client: Any, *, processes: bool, workers: int) -> contextlib.AbstractContextManager[Engine]:
    """The one choice a conversion makes: the Dask cluster behind ``client``; else ``workers``
    forked processes where ``processes`` (``processes_pay``); else ``workers`` threads (one: this
    thread)."""
    if client is not None:
        return cluster_engine(client)
    if processes:
        return local_engine(workers)
    return thread_engine(workers)


@contextlib.contextmanager
def cluster_engine(client: Any) -> Iterator[Engine]:
    """The Dask cluster behind ``client`` (a ``distributed.Client``): its worker threads."""
    threads = client.nthreads()  # {worker address: threads}
    facts = {"dask": {"scheduler": _scheduler_address(client), "workers": len(threads)}}
    executor = client.get_executor(pure=False)  # every task runs, even with equal arguments
    try:
        yield Engine(executor, max(1, sum(threads.values())), facts)
    finally:
        executor.shutdown(wait=True)


def _scheduler_address(client: Any) -> str:
    try:
        return str(client.scheduler.address)
    except AttributeError:  # pragma: no cover
        return "unknown"


_Queued = tuple[Hashable, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class Runner:
    """Runs tasks on an engine; use as a context manager around ``results``.

    ``submit`` queues a task (also while results are being taken: a result may call for more
    work); ``results`` yields ``(tag, result)`` as tasks finish, in any order, and raises the
    first failure it sees. Leaving the ``with`` block, however it is left, starts nothing more
    and waits for every submitted task to end."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.limit = IN_FLIGHT_PER_SLOT * engine.width
        self.queued: collections.deque[_Queued] = collections.deque()
        self.running: dict[Future[Any], Hashable] = {}
        self.tasks = 0  # submitted to the executor so far

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.queued.clear()
        wait(self.running)  # a task started (or queued in the executor) may be writing

    def submit(self, tag: Hashable, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.queued.append((tag, fn, args, kwargs))

    def results(self) -> Iterator[tuple[Any, Any]]:
        while self.queued or self.running:
            while self.queued and len(self.running) < self.limit:
                tag, fn, args, kwargs = self.queued.popleft()
                self.running[self.engine.executor.submit(_call, fn, args, kwargs)] = tag
                self.tasks += 1
            done, _ = wait(self.running, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: f.exception() is None):  # a failure first
                tag = self.running.pop(future)
                yield tag, future.result()


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)``: the task's keywords never reach the executor's ``submit``, whose own
    keywords (Dask's ``key``, ``workers``, ``priority``, ...) they could collide with. It runs
    under ``_TASK_MALLOC`` (malloc's thresholds for the task, where the process pins them)."""
    with _TASK_MALLOC:
        return fn(*args, **kwargs)


# glibc's mallopt parameters, and their defaults
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_DEFAULT_THRESHOLD = 128 * 1024
# While tasks run: what glibc's own adjustment reaches (blocks up to 32 MiB come from the heap
# and are reused; 64 MiB may stay free at its top), where the process pins lower thresholds
TASK_MMAP_THRESHOLD = 32 * 1024 * 1024
TASK_TRIM_THRESHOLD = 2 * TASK_MMAP_THRESHOLD


class TaskMalloc:
    """glibc malloc's thresholds while tasks run, where the process's environment pins them.

    A Dask nanny starts its workers with ``MALLOC_TRIM_THRESHOLD_=65536`` (Dask's
    ``distributed.nanny.pre-spawn-environ``), which also turns off glibc's adjustment of the
    mmap threshold: every array above 128 KiB is then mapped fresh from the kernel and unmapped
    when freed, and the heap is returned at each free. A task allocates and frees its blocks'
    arrays over and over (tens of MB each), so its pages were faulted in again and again: the
    shuffle's tasks on a ``LocalCluster`` took 1.4-1.9x the CPU seconds of the same tasks in
    forked worker processes, most of it in the kernel. While any task runs in a process whose
    environment pins a threshold (``MALLOC_TRIM_THRESHOLD_`` or ``MALLOC_MMAP_THRESHOLD_``),
    the thresholds are those glibc reaches by itself (``TASK_*``); when the last one ends they are
    the environment's again and ``malloc_trim(0)`` gives back what the tasks left free, as the
    pinned thresholds intend. Elsewhere (glibc adjusting them itself, not glibc) nothing is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._pinned: tuple[int, int] | None = None
        self._libc: Any = None

    def _restore_to(self) -> tuple[int, int] | None:
        """The environment's (trim, mmap) thresholds where it pins either; else None."""
        trim, mmap = os.environ.get("MALLOC_TRIM_THRESHOLD_"), os.environ.get("MALLOC_MMAP_THRESHOLD_")
        if trim is None and mmap is None:
            return None
        try:
            return (int(trim) if trim is not None else _DEFAULT_THRESHOLD,
                    int(mmap) if mmap is not None else _DEFAULT_THRESHOLD)
        except ValueError:
            return None

    def __enter__(self) -> None:
        with self._lock:
            self._running += 1
            if self._running > 1:
                return
            self._pinned = self._restore_to()
            if self._pinned is None:
                return
            try:
                self._libc = ctypes.CDLL(None)
                mallopt = self._libc.mallopt
            except (OSError, AttributeError):
                self._pinned = None
                return
            mallopt(_M_MMAP_THRESHOLD, TASK_MMAP_THRESHOLD)
            mallopt(_M_TRIM_THRESHOLD, TASK_TRIM_THRESHOLD)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._running -= 1
            if self._running or self._pinned is None:
                return
            trim, mmap = self._pinned
            self._libc.mallopt(_M_MMAP_THRESHOLD, mmap)
            self._libc.mallopt(_M_TRIM_THRESHOLD, trim)
            self._libc.malloc_trim(0)
            self._pinned = None


_TASK_MALLOC = TaskMalloc()


def ordered(engine: Engine, fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]],
            **kwargs: Any) -> Generator[Any, None, None]:
    """``fn(*call, **kwargs)`` for each call, run on the engine, the results handed back in the
    order of the calls. At most ``2 x width`` calls are submitted beyond the one being handed
    back (what is held here is bounded). A failure is raised where its result would come;
    closing the iterator, however it ends, submits nothing more and waits for every submitted
    call to end."""
    limit = IN_FLIGHT_PER_SLOT * engine.width
    pending: collections.deque[Future[Any]] = collections.deque()
    calls = iter(calls)
    try:
        while True:
            while len(pending) < limit:
                call = next(calls, None)
                if call is None:
                    break
                pending.append(engine.executor.submit(_call, fn, call, kwargs))
            if not pending:
                return
            yield pending.popleft().result()
    finally:
        wait(pending)


def run_all(engine: Engine, fn: Callable[..., Any], calls: list[tuple[Any, ...]], **kwargs: Any) -> list[Any]:
    """``[fn(*call, **kwargs) for call in calls]``, run on the engine."""
    out: list[Any] = [None] * len(calls)
    with Runner(engine) as runner:
        for i, call in enumerate(calls):
            runner.submit(i, fn, *call, **kwargs)
        for i, result in runner.results():
            out[i] = result
    return out
