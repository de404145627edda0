"""The same conversion with two checkouts of birdzarr, alternated: which one is faster, by how much.

    git worktree add /tmp/bz-before <commit>
    python benchmarks/compare_trees.py /tmp/bz-before . SOURCE --repeat 6 -- --workers 2 --shuffle --seed 1

Each run is a fresh CLI process (``birdzarr convert SOURCE DEST --overwrite --quiet`` plus the
arguments after ``--``) with ``PYTHONPATH`` set to one checkout, which the run asserts it
imported. The two checkouts alternate (A B, B A, ...), so a change of the shared machine's speed
falls on both; the table gives each one's median seconds and CPU seconds (from the store's
report) and the ratio. The destinations are written under ``--workdir`` (default: a temporary
directory, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _util import machine, table, work_directory  # noqa: E402

_CLI = ("import sys, birdzarr; assert birdzarr.__file__.startswith(sys.argv[1]), birdzarr.__file__; "
        "from birdzarr.cli import main; sys.exit(main(sys.argv[2:]))")


def convert_with(tree: str, source: str, dest: str, extra: list[str]) -> dict[str, Any]:
    """One conversion by the birdzarr of checkout ``tree``; its report's seconds and CPU seconds."""
    root = os.path.abspath(tree)
    subprocess.run([sys.executable, "-c", _CLI, os.path.join(root, "birdzarr"), "convert", source, dest,
                    "--overwrite", "--quiet", *extra],
                   check=True, cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": root})
    with open(os.path.join(dest, "zarr.json")) as handle:
        report = json.load(handle)["attributes"]["birdzarr"]["report"]
    return {"seconds": float(report["seconds"]), "CPU s": float(report.get("cpu_seconds", 0.0))}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", help="checkout A (the baseline)")
    parser.add_argument("b", help="checkout B")
    parser.add_argument("source", help="input directory (Parquet or CSV)")
    parser.add_argument("--repeat", type=int, default=6, help="runs of each checkout, alternated")
    parser.add_argument("--workdir", default=None)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1 :]  # after "--": arguments for birdzarr convert
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    trees = {"A": args.a, "B": args.b}
    with work_directory(args.workdir, prefix="birdzarr-compare-") as workdir:
        print(f"# {machine()}; A = {args.a}, B = {args.b}; convert {args.source} {' '.join(extra)}")
        for round_ in range(args.repeat):
            for name in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                run = convert_with(trees[name], args.source, os.path.join(workdir, f"{name}.zarr"), extra)
                runs[name].append(run)
                print(f"{name}: {run['seconds']:.3f} s, {run['CPU s']:.2f} CPU s", flush=True)
        rows = [{"checkout": f"{name} ({trees[name]})", "runs": len(done),
                 "median s": statistics.median(r["seconds"] for r in done),
                 "median CPU s": statistics.median(r["CPU s"] for r in done)} for name, done in runs.items()]
        rows.append({"checkout": "B against A (speed-up)", "runs": "",
                     "median s": float(rows[0]["median s"]) / float(rows[1]["median s"]),
                     "median CPU s": float(rows[0]["median CPU s"]) / float(rows[1]["median CPU s"])})
        print()
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
