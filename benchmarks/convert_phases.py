"""Where a device-order conversion's wall time goes: its phases in the converting process and
every segment task, as a timeline (seconds from the conversion's start).

    python benchmarks/convert_phases.py --windows 5000000 --workers 16   # a 16-core node
    python benchmarks/convert_phases.py --windows 1000000 --workers 2

Generates benchmarks/convert.py's corpus (186 devices, per-device Parquet) in --workdir (kept,
and reused when it is there), converts it once in this process and prints: counting the devices,
planning the segments, the segments' phase (first task start to the collector's finish), the
commit, each worker process's busy seconds, and how many tasks ran at each tenth of the
segments' phase. The wrappers only record times (the tasks, forked, write them to a file): the
store is the one the conversion writes without them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_LOG = os.path.join(tempfile.gettempdir(), f"birdzarr-phases-{os.getpid()}.jsonl")


def _record(what: str, start: float, end: float, **extra: Any) -> None:
    with open(_LOG, "a") as out:
        out.write(json.dumps({"what": what, "pid": os.getpid(), "start": start, "end": end, **extra}) + "\n")


def _timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that records when each call starts and ends."""
    function: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return function(*args, **kwargs)
        finally:
            _record(label, start, time.time())

    setattr(owner, name, wrapper)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "birdzarr-bench-phases"))
    args = parser.parse_args()

    from convert import make_parquet

    import birdzarr
    from birdzarr.convert import _segments, _writer
    from birdzarr.demo import _synthetic

    source = os.path.join(args.workdir, f"parquet_186_{args.windows}")
    if not os.path.isdir(source):
        ids = _synthetic.device_ids(186).tolist()
        sizes = _synthetic.device_sizes(186, args.windows, seed=0).tolist()
        make_parquet(source, dict(zip(ids, sizes, strict=True)), seed=0)
    converting = sys.modules["birdzarr.convert"]  # the package (birdzarr.convert is the function)
    for name in ("count_devices", "plan_segments"):
        _timed(converting, name, name)
    _timed(_segments.SegmentCollector, "finish", "finish")
    _timed(_writer.StoreWriter, "commit", "commit")
    _timed(_segments, "convert_segment", "task")
    # pickled by name into the forked workers, which find the wrapper there
    _segments.convert_segment.__module__, _segments.convert_segment.__qualname__ = (
        "birdzarr.convert._segments", "convert_segment")
    if os.path.exists(_LOG):
        os.remove(_LOG)
    started = time.time()
    birdzarr.convert(source, os.path.join(args.workdir, "store.zarr"), overwrite=True, workers=args.workers,
                     progress=False)
    ended = time.time()
    with open(_LOG) as log:
        rows = [json.loads(line) for line in log]
    os.remove(_LOG)
    tasks = [r for r in rows if r["what"] == "task"]
    print(f"{args.windows:,} windows, {args.workers} workers, {len(tasks)} segment tasks on "
          f"{len({r['pid'] for r in tasks})} processes; convert() {ended - started:.2f} s")
    for r in sorted((r for r in rows if r["what"] != "task"), key=lambda r: r["start"]):
        print(f"  {r['what']:<14} {r['start'] - started:7.3f} -> {r['end'] - started:7.3f} s "
              f"({r['end'] - r['start']:.3f} s)")
    if tasks:
        first, last = min(r["start"] for r in tasks), max(r["end"] for r in tasks)
        busy = sum(r["end"] - r["start"] for r in tasks)
        print(f"  tasks          {first - started:7.3f} -> {last - started:7.3f} s; busy {busy:.2f} s, "
              f"{busy / (last - first):.2f} tasks running on average")
        for k in range(10):
            at = first + (last - first) * (k + 0.5) / 10
            print(f"    at {at - started:6.2f} s: {sum(r['start'] <= at < r['end'] for r in tasks)} running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
