"""The duplicate-window check's two costs, in one run: hashing every window, and counting the
distinct hashes at a device's end by a sort (``distinct``) against numpy's ``np.unique``.

    python benchmarks/duplicates.py                     # one device of 1.5 M windows
    python benchmarks/duplicates.py --windows 300000 --repeat 9

Every window of a device is hashed (``window_hashes``: 40 words multiplied, mixed and summed),
and at the device's end its hashes' distinct values are counted (``distinct``). numpy >= 2.3
finds plain ``np.unique`` with a hash table, far slower than a sort on millions of distinct
values. The rows alternate; each figure is the median of ``--repeat`` runs. The
conversion runs both on its ``birdzarr-duplicates`` thread, beside the readers and encoders
(``python benchmarks/convert_threads.py SOURCE`` shows that thread's CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _util import machine, table  # noqa: E402

from birdzarr.convert._duplicates import distinct  # noqa: E402
from birdzarr.format._digest import window_hashes  # noqa: E402

BLOCK = 16_384  # windows per block, as the Parquet reader hands them over


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", type=int, default=1_500_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    windows = rng.normal(size=(args.windows, 20, 4)).astype(np.float32)
    timestamps = np.arange(args.windows, dtype=np.int64) * 20
    blocks = [(windows[a : a + BLOCK], timestamps[a : a + BLOCK]) for a in range(0, args.windows, BLOCK)]
    hashes = np.concatenate([window_hashes(w, t) for w, t in blocks])
    assert np.array_equal(distinct(hashes), np.unique(hashes))

    steps: list[tuple[str, str, Callable[[], object]]] = [
        ("hash every window", "window_hashes, block by block",
         lambda: [window_hashes(w, t) for w, t in blocks]),
        ("distinct hashes", "sort (distinct)", lambda: distinct(hashes)),
        ("distinct hashes", f"np.unique (numpy {np.__version__})", lambda: np.unique(hashes)),
    ]
    runs: dict[str, list[float]] = {way: [] for _, way, _ in steps}
    for _ in range(args.repeat):  # the ways alternate, so a busy moment hits all of them
        for _, way, fn in steps:
            runs[way].append(_seconds(fn))
    rows = []
    for step, way, _ in steps:
        seconds = statistics.median(runs[way])
        first = statistics.median(runs[next(w for s, w, _ in steps if s == step)])
        rows.append({"step": step, "way": way, "ms": seconds * 1e3,
                     "M windows/s": args.windows / seconds / 1e6, "time vs birdzarr's": seconds / first})
    print(f"# {machine()}; {args.windows:,} windows (one device), blocks of {BLOCK:,}, "
          f"median of {args.repeat}")
    print(table(rows))


if __name__ == "__main__":
    main()
