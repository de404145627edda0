"""One device of most of the windows: conversion wall time (device order, or ``--shuffle``) with
the large device split into parts (``PART_WINDOWS``) and read whole (one task, as a device that is
not split), on the same input; or, with ``--pythonpath``, this checkout against another (a
worktree of an earlier commit).

    python benchmarks/large_device.py --windows 3300000 --small 10 --small-windows 60000 \\
        --workdir /tmp/bz-large --repeat 3
    python benchmarks/large_device.py --shuffle ...   # --shuffle --seed 1: pass 1's tasks

The source: ``--small`` devices of ``--small-windows`` windows each and one device holding the
rest, every file written with pyarrow's default settings (row groups of 1,048,576 rows), as the
real per-device files are. Each conversion is the CLI in its own process (``--workers``, default
2, ``--quiet``); its wall time, CPU seconds (the process tree's rusage), the peak RSS of its
process tree and each process's own peak (VmHWM: the converting process's, each worker's) are printed,
the two cases interleaved round by round, with the machine's load average. On a shared
machine the wall time measures the load as much as the code; so each task's CPU seconds are
recorded too (``convert_segment``, or with ``--shuffle`` pass 1's ``spill_group``, wrapped in
the converting process, inherited by its forked workers), and scheduled largest first on
``--workers`` idle workers (``makespan``): the wall time the tasks would take on an idle machine,
the converting process's own work (counting, the chunks shared between tasks, the commit; with
``--shuffle``, merging pass 1's results and all of pass 2, whose wall time the report's
``pass_seconds`` gives) left out. A task that encodes on threads of its own (fewer tasks than
workers) counts all its threads' CPU, so its figure overstates its wall time. The medians of
each come last. Generated data stays in --workdir
(reused by the next run); the stores are replaced by each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _util import children_cpu, outside_repository, run_measured  # noqa: E402
from convert import make_parquet  # noqa: E402

_CLI = "import sys; from birdzarr.cli import main; sys.exit(main(sys.argv[1:]))"
# Each task's CPU seconds (the worker process's, during the task: one task at a time a worker),
# appended to $BZ_TASK_LOG: device order's segments and --shuffle's pass-1 groups; the wrapper
# keeps the task's name, so the tasks pickle by it
_TASK_CPU = """
import os, sys, time
# ``python -c`` puts the working directory first on sys.path: run from a checkout's root, that
# checkout's birdzarr would shadow --pythonpath's. The birdzarr imported is logged and checked.
if sys.path and sys.path[0] == "":
    del sys.path[0]
import birdzarr
from birdzarr.convert import _segments, _shuffle_processes
with open(os.environ["BZ_TASK_LOG"], "a") as log:
    log.write(f"from {os.path.dirname(os.path.dirname(birdzarr.__file__))}\\n")
def _timed(module, name):
    real = getattr(module, name)
    def task(*args, **kwargs):
        before = time.process_time()
        out = real(*args, **kwargs)
        with open(os.environ["BZ_TASK_LOG"], "a") as log:
            log.write(f"{name} {time.process_time() - before:.3f}\\n")
        return out
    task.__module__, task.__qualname__ = real.__module__, real.__qualname__
    setattr(module, name, task)
if os.environ.get("BZ_PART_WINDOWS"):  # "whole": no device split (the plan reads it at call time)
    _segments.PART_WINDOWS = int(os.environ["BZ_PART_WINDOWS"])
_timed(_segments, "convert_segment")
_timed(_shuffle_processes, "spill_group")
"""


def makespan(tasks: list[float], workers: int) -> float:
    """The tasks' CPU seconds run largest first, each on the first free worker (what the engine
    does with ``largest_first``): the wall time of the tasks on an otherwise idle machine."""
    free = [0.0] * workers
    for cpu in sorted(tasks, reverse=True):
        free[free.index(min(free))] += cpu
    return max(free)


def convert_once(source: str, dest: str, *, workers: int, pythonpath: str | None,
                 shuffle: bool = False, whole: bool = False) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.pop("BZ_PART_WINDOWS", None)
    if whole:
        env["BZ_PART_WINDOWS"] = str(1 << 62)
    log = dest + ".tasks"
    env["BZ_TASK_LOG"] = log
    if os.path.exists(log):
        os.remove(log)
    argv = [sys.executable, "-c", _TASK_CPU + _CLI, "convert", source, dest, "--overwrite", "--quiet",
            "--workers", str(workers), *(["--shuffle", "--seed", "1"] if shuffle else [])]
    before, load = children_cpu(), os.getloadavg()[0]
    measured = run_measured(argv, env=env)
    wall, peak = measured.seconds, measured.peak
    cpu = children_cpu() - before
    kind = "spill_group" if shuffle else "convert_segment"
    with open(log) as lines:
        found = [line.split(maxsplit=1) for line in lines]
    tasks = [float(value) for name, value in found if name == kind]
    (imported,) = {value.strip() for name, value in found if name == "from"}
    if pythonpath and os.path.realpath(imported) != os.path.realpath(pythonpath):
        raise RuntimeError(f"--pythonpath {pythonpath}: the conversion imported birdzarr from {imported}")
    probe = ("import json, sys, birdzarr; s = birdzarr.open_store(sys.argv[1]); r = s.meta['report']; "
             "print(json.dumps([len(s), r.get('segments', 1), r.get('shuffle', {}).get('pass_seconds')]))")
    windows, segments, passes = json.loads(subprocess.run([sys.executable, "-c", probe, dest], env=env,
                                                          check=True, capture_output=True, text=True).stdout)
    return {"wall": wall, "cpu": cpu, "peak_mb": peak / 1e6, "own_mb": measured.own_peak / 1e6,
            "worker_mb": [w / 1e6 for w in measured.worker_peaks], "load": load, "windows": windows,
            "segments": segments, "tasks": sorted(tasks, reverse=True), "idle_wall": makespan(tasks, workers),
            "pass1": passes[0] if passes else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=3_300_000)
    parser.add_argument("--small", type=int, default=5, help="small devices")
    parser.add_argument("--small-windows", type=int, default=40_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pythonpath", default=None, help="the other checkout (a git worktree)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shuffle", action="store_true", help="convert with --shuffle --seed 1")
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    workdir = outside_repository(parser, args.workdir)
    source = os.path.join(workdir, "src")
    large = args.windows - args.small * args.small_windows
    sizes = {device: args.small_windows for device in range(1, args.small + 1)}
    sizes[1000] = large
    make_parquet(source, sizes, seed=33)
    print(f"{args.windows:,} windows: {args.small} devices of {args.small_windows:,}, one of {large:,}; "
          f"{args.workers} workers{', --shuffle' if args.shuffle else ''}", flush=True)
    # (pythonpath, whole): this checkout splitting the large device, and reading it whole (one
    # task, as a CSV device is); or, with --pythonpath, this checkout against the other
    versions: dict[str, tuple[str | None, bool]] = {"devices as parts": (None, False)}
    if args.pythonpath:
        versions[f"PYTHONPATH={args.pythonpath}"] = (args.pythonpath, False)
    else:
        versions["the large device whole"] = (None, True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in versions}
    for round_ in range(args.repeat):
        for k, (name, (path, whole)) in enumerate(versions.items()):
            found = convert_once(source, os.path.join(workdir, f"store{k}.zarr"), workers=args.workers,
                                 pythonpath=path, shuffle=args.shuffle, whole=whole)
            runs[name].append(found)
            tasks = ", ".join(f"{t:.1f}" for t in found["tasks"])
            workers = ", ".join(f"{w:.0f} MB" for w in found["worker_mb"]) or "none"
            pass1 = "" if found["pass1"] is None else f"pass 1 {found['pass1']:.2f} s wall, "
            print(f"round {round_ + 1} {name}: {found['wall']:.2f} s wall, {pass1}{found['cpu']:.1f} CPU s, "
                  f"{found['peak_mb']:.0f} MB peak (converting process {found['own_mb']:.0f} MB, workers "
                  f"{workers}), load {found['load']:.1f}; "
                  f"{'pass-1 ' if args.shuffle else ''}tasks' CPU s {tasks}: "
                  f"{found['idle_wall']:.2f} s on {args.workers} idle workers", flush=True)
    for name, results in runs.items():
        pass1 = ("" if not args.shuffle else
                 f"pass 1 {statistics.median(r['pass1'] for r in results):.2f} s wall, ")
        print(f"median {name}: {statistics.median(r['wall'] for r in results):.2f} s wall, {pass1}"
              f"{statistics.median(r['cpu'] for r in results):.1f} CPU s, "
              f"{statistics.median(r['peak_mb'] for r in results):.0f} MB peak (converting process "
              f"{statistics.median(r['own_mb'] for r in results):.0f} MB, largest worker "
              f"{statistics.median(max(r['worker_mb'], default=0) for r in results):.0f} MB), "
              f"{statistics.median(r['idle_wall'] for r in results):.2f} s of tasks on idle workers")


if __name__ == "__main__":
    main()
