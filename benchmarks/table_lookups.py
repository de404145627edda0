"""Random lookups in a dictionary table of 1.51 M against 3.57 M float32 entries: what a batch's
decode does in format 2's dictionaries at 186 against 100,000 devices (``many_devices.py``'s
store sizes), and whether transparent huge pages (``madvise``) change it.

    python benchmarks/table_lookups.py

Each batch: 8,192 windows, each in a random row of 7,300 entries (about a row's three
channels), 60 lookups inside it (``np.take``), 60 batches; CPU seconds, the best of two tables
made each way (huge pages asked for with ``MADV_HUGEPAGE`` or not), and the ratio to the
smaller table. Whether the kernel gave huge pages: ``AnonHugePages`` in /proc/meminfo, printed.
"""

from __future__ import annotations

import mmap
import time

import numpy as np

_ALIGN = 2 << 20  # a huge page


def table(n: int, huge: bool) -> tuple[np.ndarray, mmap.mmap]:
    """``n`` random float32 entries in anonymous memory aligned to 2 MiB (and the mapping)."""
    mapping = mmap.mmap(-1, n * 4 + _ALIGN)
    if huge:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(mapping, dtype=np.uint8)
    at = (-raw.ctypes.data) % _ALIGN
    values = raw[at : at + n * 4].view(np.float32)
    values[:] = np.random.default_rng(0).random(n, dtype=np.float32)
    return values, mapping


def lookups(values: np.ndarray, index: np.ndarray) -> float:
    out = np.empty(index.shape[1:], np.float32)
    started = time.process_time()
    for batch in index:
        np.take(values, batch, out=out)
    return time.process_time() - started


def anon_huge_kb() -> int:
    with open("/proc/meminfo") as info:
        return next(int(line.split()[1]) for line in info if line.startswith("AnonHugePages"))


def main() -> None:
    rng = np.random.default_rng(1)
    print("| entries | CPU s, 60 batches | with MADV_HUGEPAGE | ratio to 1.51 M |")
    print("|---|---|---|---|")
    base = None
    for n in (1_510_000, 3_570_000):
        rows = rng.integers(0, n - 8_000, size=(60, 8192, 1))
        index = (rows + rng.integers(0, 7_300, size=(60, 8192, 60))).astype(np.int64)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for huge in (False, True, False, True):
            values, mapping = table(n, huge)
            seconds[huge].append(lookups(values, index))
            huge_kb = anon_huge_kb()
            del values
            mapping.close()
        plain, huge_best = min(seconds[False]), min(seconds[True])
        base = base or plain
        print(f"| {n:,} | {plain:.3f} | {huge_best:.3f} | {plain / base:.2f}x |")
    print(f"\nAnonHugePages after the last table: {huge_kb} kB")


if __name__ == "__main__":
    main()
