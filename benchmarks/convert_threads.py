"""Where a conversion's CPU goes: each thread's CPU seconds, grouped by the thread's role, and for
``--shuffle`` split into pass 1 (read, code, spill) and pass 2 (load buckets, encode chunks).

    python benchmarks/convert_threads.py SOURCE                    # device order, 2 workers
    python benchmarks/convert_threads.py SOURCE --shuffle --repeat 2

SOURCE is a directory of per-device Parquet files or CSV exports (``benchmarks/convert.py
--keep`` leaves one). The conversion runs in this process (progress bars off); a sampler thread
reads ``/proc/self/task/*/stat`` every 20 ms and maps thread ids to the names birdzarr gives
its threads (``birdzarr-read``, ``birdzarr-encode``, ``birdzarr-spill``, ...). Linux only.
The sampler's own CPU is left out of the totals. It sees the threads of this process only:
Parquet input of 64 MB or more, and any ``--shuffle`` of that size, are converted in worker
processes (birdzarr/convert/_segments.py, _shuffle_processes.py), whose CPU it does not show.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _util import PeakSampler, table  # noqa: E402

import birdzarr  # noqa: E402

_shuffle = importlib.import_module("birdzarr.convert._shuffle")
_TICK = os.sysconf("SC_CLK_TCK")


class ThreadClock:
    """CPU seconds per thread id, and each id's role (its name without a pool's thread index),
    sampled on a thread of its own while in use (its own CPU is left out)."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}
        self.role: dict[int, str] = {}
        self._sampler = PeakSampler(self._measure, 0.02)
        self._sampler_id: int | None = None

    def snapshot(self) -> dict[int, float]:
        for thread in threading.enumerate():
            if thread.native_id is not None:
                # a pool's threads share a role: "birdzarr-encode_1", "birdzarr-read-0"
                self.role[thread.native_id] = re.sub(r"[-_]\d+$", "", thread.name)
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended between listing and reading
                continue
            self.cpu[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
        return dict(self.cpu)

    def _measure(self) -> tuple[int, ...]:
        self.snapshot()
        return ()

    def __enter__(self) -> ThreadClock:
        self._sampler.__enter__()
        self._sampler_id = self._sampler._thread.native_id
        return self

    def __exit__(self, *exc: object) -> None:
        self._sampler.__exit__(*exc)

    def by_role(self, since: dict[int, float], until: dict[int, float]) -> collections.Counter[str]:
        roles: collections.Counter[str] = collections.Counter()
        for tid, seconds in until.items():
            if tid != self._sampler_id:
                roles[self.role.get(tid, "other")] += seconds - since.get(tid, 0.0)
        return roles


def measure(source: str, *, workers: int, shuffle: bool) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    marks: dict[str, Any] = {}
    finish = _shuffle.Spiller.finish

    def finish_and_mark(self: Any) -> None:
        finish(self)
        marks["pass 1"] = (time.perf_counter(), clock.snapshot())

    _shuffle.Spiller.finish = finish_and_mark  # type: ignore[method-assign]
    dest = tempfile.mkdtemp(prefix="bz-threads-")
    try:
        with ThreadClock() as clock:
            start, before = time.perf_counter(), clock.snapshot()
            birdzarr.convert(source, os.path.join(dest, "s.zarr"), workers=workers, shuffle=shuffle,
                             progress=False)
            end = time.perf_counter()
        after = clock.snapshot()
    finally:
        _shuffle.Spiller.finish = finish  # type: ignore[method-assign]
        shutil.rmtree(dest, ignore_errors=True)
    spans = [("all", start, before, end, after)]
    if "pass 1" in marks:
        middle, at_middle = marks["pass 1"]
        spans += [("pass 1", start, before, middle, at_middle), ("pass 2", middle, at_middle, end, after)]
    results = []
    for name, t0, c0, t1, c1 in spans:
        roles = clock.by_role(c0, c1)
        total = sum(roles.values())
        summary = {"span": name, "seconds": t1 - t0, "CPU s": total, "cores used": total / (t1 - t0)}
        threads = [{"thread": role, "CPU s": seconds, "share": f"{seconds / total:.0%}"}
                   for role, seconds in roles.most_common() if seconds >= 0.01]
        results.append((summary, threads))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    import pandas  # noqa: F401  (imported once, before the first run, as a long conversion would)

    for run in range(args.repeat):
        results = measure(args.source, workers=args.workers, shuffle=args.shuffle)
        mode = ", --shuffle" if args.shuffle else ""
        workers = "1 worker" if args.workers == 1 else f"{args.workers} workers"
        print(f"run {run + 1}: {args.source}, {workers}{mode}\n")
        print(table([summary for summary, _ in results]) + "\n")
        for summary, threads in results:  # one table a span: the threads differ from span to span
            print(f"{summary['span']}:\n{table(threads)}\n")


if __name__ == "__main__":
    main()
