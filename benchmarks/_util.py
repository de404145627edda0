"""Small helpers shared by the benchmark scripts: peak memory of a process tree, tables, plots."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants right now."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total


def children_cpu() -> float:
    """CPU seconds (user + system) used so far by this process's finished children."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_measured(
    argv: Sequence[str], *, interval: float = 0.05, env: dict[str, str] | None = None
) -> tuple[float, int, str]:
    """Run a command; return (seconds, peak RSS in bytes of its process tree, stdout).

    Sampled every ``interval`` seconds, so a spike shorter than that can be missed; the child
    also reports its own ``ru_maxrss`` where it matters (see ``self_peak_rss``).
    """
    started = time.perf_counter()
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    done.set()
    sampler.join()
    seconds = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed with exit code {proc.returncode}")
    return seconds, peak, out


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
