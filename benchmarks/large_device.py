"""One device of most of the windows: device-order conversion wall time, this checkout against
another (``--pythonpath``, a worktree of an earlier commit), on the same input.

    python benchmarks/large_device.py --windows 3300000 --workdir /tmp/bz-large \\
        --pythonpath /tmp/wt_split --repeat 3

The source: ``--small`` devices of ``--small-windows`` windows each and one device holding the
rest, every file written with pyarrow's default settings (row groups of 1,048,576 rows), as the
real per-device files are. Each conversion is the CLI in its own process (``--workers``, default
2, ``--quiet``); its wall time, CPU seconds (the process tree's rusage) and peak RSS are printed,
the two code versions interleaved round by round, with the machine's load average. On a shared
machine the wall time measures the load as much as the code; so each task's CPU seconds are
recorded too (``convert_segment`` wrapped in the converting process, inherited by its forked
workers), and scheduled largest first on ``--workers`` idle workers (``makespan``): the wall time
the tasks would take on an idle machine, the converting process's own work (counting, the chunks
shared between tasks, the commit) left out. A task that encodes on threads of its own (fewer
tasks than workers) counts all its threads' CPU, so its figure overstates its wall time. The
medians of each come last. Generated data stays in --workdir
(reused by the next run); the stores are replaced by each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _util import children_cpu, outside_repository, run_measured  # noqa: E402
from convert import make_parquet  # noqa: E402

_CLI = "import sys; from birdzarr.cli import main; sys.exit(main(sys.argv[1:]))"
# Each task's CPU seconds (the worker process's, during the task: one task at a time a worker),
# appended to $BZ_TASK_LOG; the wrapper keeps convert_segment's name, so the tasks pickle by it
_TASK_CPU = """
import os, sys, time
from birdzarr.convert import _segments
_real = _segments.convert_segment
def convert_segment(segment, *args, **kwargs):
    before = time.process_time()
    out = _real(segment, *args, **kwargs)
    with open(os.environ["BZ_TASK_LOG"], "a") as log:
        log.write(f"{segment.stop - segment.start} {time.process_time() - before:.3f}\\n")
    return out
convert_segment.__module__, convert_segment.__qualname__ = _real.__module__, _real.__qualname__
_segments.convert_segment = convert_segment
"""


def makespan(tasks: list[float], workers: int) -> float:
    """The tasks' CPU seconds run largest first, each on the first free worker (what the engine
    does with ``largest_first``): the wall time of the tasks on an otherwise idle machine."""
    free = [0.0] * workers
    for cpu in sorted(tasks, reverse=True):
        free[free.index(min(free))] += cpu
    return max(free)


def convert_once(source: str, dest: str, *, workers: int, pythonpath: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    log = dest + ".tasks"
    env["BZ_TASK_LOG"] = log
    if os.path.exists(log):
        os.remove(log)
    argv = [sys.executable, "-c", _TASK_CPU + _CLI, "convert", source, dest, "--overwrite", "--quiet",
            "--workers", str(workers)]
    before, load = children_cpu(), os.getloadavg()[0]
    wall, peak, _ = run_measured(argv, env=env)
    cpu = children_cpu() - before
    with open(log) as lines:
        tasks = [float(line.split()[1]) for line in lines]
    probe = ("import json, sys, birdzarr; s = birdzarr.open_store(sys.argv[1]); "
             "print(json.dumps([len(s), s.meta['report'].get('segments', 1)]))")
    windows, segments = json.loads(subprocess.run([sys.executable, "-c", probe, dest], env=env, check=True,
                                                  capture_output=True, text=True).stdout)
    return {"wall": wall, "cpu": cpu, "peak_mb": peak / 1e6, "load": load, "windows": windows,
            "segments": segments, "tasks": sorted(tasks, reverse=True), "idle_wall": makespan(tasks, workers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=3_300_000)
    parser.add_argument("--small", type=int, default=5, help="small devices")
    parser.add_argument("--small-windows", type=int, default=40_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pythonpath", default=None, help="the other checkout (a git worktree)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    workdir = outside_repository(parser, args.workdir)
    source = os.path.join(workdir, "src")
    large = args.windows - args.small * args.small_windows
    sizes = {device: args.small_windows for device in range(1, args.small + 1)}
    sizes[1000] = large
    make_parquet(source, sizes, seed=33)
    print(f"{args.windows:,} windows: {args.small} devices of {args.small_windows:,}, one of {large:,}; "
          f"{args.workers} workers", flush=True)
    versions = {"this checkout": None}
    if args.pythonpath:
        versions[f"PYTHONPATH={args.pythonpath}"] = args.pythonpath
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
    for round_ in range(args.repeat):
        for k, (name, path) in enumerate(versions.items()):
            found = convert_once(source, os.path.join(workdir, f"store{k}.zarr"), workers=args.workers,
                                 pythonpath=path)
            runs[name].append(found)
            tasks = ", ".join(f"{t:.1f}" for t in found["tasks"])
            print(f"round {round_ + 1} {name}: {found['wall']:.2f} s wall, {found['cpu']:.1f} CPU s, "
                  f"{found['peak_mb']:.0f} MB peak, load {found['load']:.1f}; tasks' CPU s {tasks}: "
                  f"{found['idle_wall']:.2f} s on {args.workers} idle workers", flush=True)
    for name, found in runs.items():
        print(f"median {name}: {statistics.median(r['wall'] for r in found):.2f} s wall, "
              f"{statistics.median(r['cpu'] for r in found):.1f} CPU s, "
              f"{statistics.median(r['peak_mb'] for r in found):.0f} MB peak, "
              f"{statistics.median(r['idle_wall'] for r in found):.2f} s of tasks on idle workers")


if __name__ == "__main__":
    main()
