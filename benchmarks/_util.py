"""Small helpers shared by the benchmark scripts: scratch directories, peak memory of a process
tree, tables, plots."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def outside_repository(parser: Any, workdir: str) -> str:
    """``workdir`` made absolute; a parser error if it lies in the repository (generated data,
    gigabytes, must never land in a clone)."""
    workdir = os.path.abspath(workdir)
    if workdir == REPO or workdir.startswith(REPO + os.sep):
        parser.error("--workdir must be outside the repository (generated data never goes there)")
    return workdir


def log(message: str) -> None:
    """A timestamped progress line on stdout, flushed (benchmarks run for minutes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@contextlib.contextmanager
def work_directory(given: str | None, *, prefix: str, keep: bool = False) -> Iterator[str]:
    """A benchmark's scratch directory: ``given`` (made if missing) or a new temporary one.

    Removed at the end unless ``keep``, and only if this run made it: a directory that already
    existed (the user's, or one an earlier run kept to reuse its data) is never deleted."""
    made = given is None or not os.path.exists(given)
    path = tempfile.mkdtemp(prefix=prefix) if given is None else given
    os.makedirs(path, exist_ok=True)
    try:
        yield path
    finally:
        if made and not keep:
            shutil.rmtree(path, ignore_errors=True)


def tree_private(pid: int) -> tuple[int, int]:
    """(USS, PSS) bytes of a process and all its descendants right now: memory only they hold,
    and memory they hold with shared pages split between their sharers (reads smaps: slower)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    uss = pss = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            info = proc.memory_full_info()
            uss, pss = uss + info.uss, pss + info.pss
    return uss, pss


class PeakSampler:
    """Calls ``measure()`` every ``interval`` seconds on a thread while in use, and once more at the
    end; keeps the element-wise peak and the (seconds, values) series."""

    def __init__(self, measure: Callable[[], tuple[int, ...]], interval: float) -> None:
        self.measure, self.interval = measure, interval
        self.peak: tuple[int, ...] = ()
        self.series: list[tuple[float, tuple[int, ...]]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = 0.0

    def _sample(self) -> None:
        values = self.measure()
        self.peak = tuple(max(a, b) for a, b in zip(self.peak or values, values, strict=True))
        self.series.append((round(time.perf_counter() - self._started, 1), values))

    def _run(self) -> None:
        while not self._done.is_set():
            self._sample()
            self._done.wait(self.interval)

    def __enter__(self) -> PeakSampler:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._sample()


def children_cpu() -> float:
    """CPU seconds (user + system) used so far by this process's finished children."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_cpu() -> float:
    """CPU seconds (user + system) of this process, its ended children (reaped worker
    processes) and its live descendants (DataLoader workers, a LocalCluster's nannies and
    workers): take the difference of two calls."""
    import psutil

    me = psutil.Process()
    own = me.cpu_times()
    total = own.user + own.system + own.children_user + own.children_system
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class Measured(NamedTuple):
    """What ``run_measured`` saw of one command."""

    seconds: float
    peak: int  # the process tree's peak RSS, bytes (sampled: the sum's peak)
    stdout: str
    own_peak: int  # the command's own process's peak RSS (the kernel's VmHWM), bytes
    worker_peaks: list[int]  # each descendant's VmHWM, bytes, largest first


def _memory(pid: int) -> tuple[int, int]:
    """A process's resident bytes now and its peak so far (VmRSS, VmHWM in /proc/<pid>/status:
    Linux), in one read; zeros if it is gone."""
    found = {b"VmRSS:": 0, b"VmHWM:": 0}
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                key = line[:6]
                if key in found:
                    found[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found[b"VmRSS:"], found[b"VmHWM:"]


def run_measured(argv: Sequence[str], *, interval: float = 0.05,
                 env: dict[str, str] | None = None) -> Measured:
    """Run a command; return its wall seconds, the peak RSS of its process tree, its stdout, and
    the peak of each process in the tree.

    The tree is sampled every ``interval`` seconds, so a spike of the sum shorter than that can be
    missed; each process's own peak is its VmHWM, exact up to its last sample before it exits
    (a process that lives less than ``interval`` may be missed).
    """
    started = time.perf_counter()
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    peaks: dict[int, int] = {}

    def measure() -> tuple[int]:
        """The tree's resident bytes now, each process's peak kept: one pass over the tree."""
        try:
            pids = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
        except psutil.NoSuchProcess:
            return (0,)
        total = 0
        for pid in pids:
            rss, high = _memory(pid)
            total += rss
            peaks[pid] = max(peaks.get(pid, 0), high)
        return (total,)

    with PeakSampler(measure, interval) as sampler:
        out, _ = proc.communicate()
    seconds = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed with exit code {proc.returncode}")
    own = peaks.pop(proc.pid, 0)
    return Measured(seconds, sampler.peak[0], out, own, sorted(peaks.values(), reverse=True))


def self_peak_rss() -> int:
    """Peak resident bytes of this process so far (the kernel's exact high-water mark)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub-flavoured Markdown table."""
    columns = list(columns or rows[0].keys())
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + " |" for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
