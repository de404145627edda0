"""One device of most of the windows: device-order conversion wall time, this checkout against
another (``--pythonpath``, a worktree of an earlier commit), on the same input.

    python benchmarks/large_device.py --windows 3300000 --workdir /tmp/bz-large \\
        --pythonpath /tmp/wt_split --repeat 3

The source: ``--small`` devices of ``--small-windows`` windows each and one device holding the
rest, every file written with pyarrow's default settings (row groups of 1,048,576 rows), as the
real per-device files are. Each conversion is the CLI in its own process (``--workers``, default
2, ``--quiet``); its wall time, CPU seconds (the process tree's rusage) and peak RSS are printed,
the two code versions interleaved round by round, with the conversion report's ``segments`` and
the machine's load average. The medians of each come last. Generated data stays in --workdir
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


def convert_once(source: str, dest: str, *, workers: int, pythonpath: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    argv = [sys.executable, "-c", _CLI, "convert", source, dest, "--overwrite", "--quiet",
            "--workers", str(workers)]
    before, load = children_cpu(), os.getloadavg()[0]
    wall, peak, _ = run_measured(argv, env=env)
    cpu = children_cpu() - before
    probe = ("import json, sys, birdzarr; s = birdzarr.open_store(sys.argv[1]); "
             "print(json.dumps([len(s), s.meta['report'].get('segments', 1)]))")
    windows, segments = json.loads(subprocess.run([sys.executable, "-c", probe, dest], env=env, check=True,
                                                  capture_output=True, text=True).stdout)
    return {"wall": wall, "cpu": cpu, "peak_mb": peak / 1e6, "load": load, "windows": windows,
            "segments": segments}


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
            print(f"round {round_ + 1} {name}: {found['wall']:.2f} s wall, {found['cpu']:.1f} CPU s, "
                  f"{found['peak_mb']:.0f} MB peak, {found['segments']} tasks, load {found['load']:.1f}",
                  flush=True)
    for name, found in runs.items():
        print(f"median {name}: {statistics.median(r['wall'] for r in found):.2f} s wall, "
              f"{statistics.median(r['cpu'] for r in found):.1f} CPU s, "
              f"{statistics.median(r['peak_mb'] for r in found):.0f} MB peak")


if __name__ == "__main__":
    main()
