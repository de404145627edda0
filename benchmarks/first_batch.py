"""How long a training loop waits for each epoch's first batch, for one checkout or two side by side.

    python benchmarks/first_batch.py STORE                          # this checkout
    python benchmarks/first_batch.py STORE --trees /tmp/before .    # two checkouts, interleaved

STORE is a committed store (the loader benchmark's ``--shuffle`` store, for example
``/tmp/birdzarr-peer-bench/shuffled.zarr`` after ``python benchmarks/peer_annbatch.py --keep``).
Each round runs every checkout once, alternating, each in a fresh process with ``PYTHONPATH`` set
to the checkout (the run asserts which ``birdzarr`` it imported): ``WindowDataset`` defaults,
batch 8192, ``--workers`` persistent DataLoader workers, ``--epochs`` epochs. Reported per
checkout and epoch, as medians over the rounds (and each round's value): the first batch, timed
from creating the epoch's iterator (epoch 0 includes starting the workers), windows/s after it,
and the epoch's seconds in all. The machine may be shared: compare checkouts of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import REPO, machine  # noqa: E402

CHILD = r"""
import json, sys, time
import birdzarr
assert birdzarr.__file__.startswith(sys.argv[1]), birdzarr.__file__
from torch.utils.data import DataLoader
store, workers, epochs = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ds = birdzarr.WindowDataset(store, batch_size=8192, seed=0)
loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
out = []
for epoch in range(epochs):
    ds.set_epoch(epoch)
    started = time.perf_counter()
    first, n = None, 0
    for x in loader:
        if first is None:
            first = time.perf_counter()
        n += len(x)
    ended = time.perf_counter()
    out.append({"first_s": first - started, "rate": n / (ended - first) / 1e6, "epoch_s": ended - started})
print(json.dumps(out))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--trees", nargs="+", default=[REPO], help="checkouts to compare (default: this one)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    trees = [os.path.abspath(t) for t in args.trees]
    results: dict[str, list[list[dict[str, float]]]] = {t: [] for t in trees}
    print(machine(), "load at the start:", os.getloadavg())
    for _ in range(args.rounds):
        for tree in trees:
            run = subprocess.run(
                [sys.executable, "-c", CHILD, tree, args.store, str(args.workers), str(args.epochs)],
                capture_output=True, text=True, check=True, cwd=tempfile.gettempdir(),
                env={**os.environ, "PYTHONPATH": tree},
            )
            results[tree].append(json.loads(run.stdout.strip().splitlines()[-1]))
    for tree in trees:
        print(tree)
        for epoch in range(args.epochs):
            runs = [r[epoch] for r in results[tree]]
            line = []
            for key, unit in (("first_s", "s first batch"), ("rate", "M windows/s"), ("epoch_s", "s epoch")):
                values = [r[key] for r in runs]
                each = ", ".join(f"{v:.3f}" for v in values)
                line.append(f"{statistics.median(values):.3f} {unit} ({each})")
            print(f"  epoch {epoch}: " + "; ".join(line))
    print("load at the end:", os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
