"""Class-balanced sampling against the plain resident shuffle: windows/s and each batch's label mix.

    python benchmarks/balanced.py                        # 1 M windows, 5 rounds
    python benchmarks/balanced.py --windows 300000 --rounds 3

Generates per-device Parquet files (birdzarr.demo._synthetic), converts them (device order: a
resident selection trains as well from it), then labels every window: label 0 is 1% of the
windows, labels 1 and 2 33% and 66% (written through zarr into the ``label`` array). Two
datasets hold the store as float32 in memory (``resident="cpu", resident_codes=False``: the
fastest gather, where the epoch's planning weighs most): the plain shuffle and
``label_weights="balanced"`` (with replacement; epochs of the same size). Each round reads one
new epoch of each, interleaved (batch 8192, in the main process, the epoch's plan included);
medians are reported (and, apart, the time to plan an epoch), and the label mix of every full
batch of the balanced epochs: the largest distance of a label's count from its requested share,
in windows and as a part of the batch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import work_directory  # noqa: E402

SHARES = [0.01, 0.33, 0.66]
BATCH = 8192


def prepare(workdir: str, n_windows: int, n_devices: int) -> str:
    import zarr

    import birdzarr
    from birdzarr.demo import _synthetic

    dest = os.path.join(workdir, "store.zarr")
    if os.path.exists(dest):
        return dest
    source = os.path.join(workdir, "parquet")
    _synthetic.make_parquet_dir(source, n_devices=n_devices, total_windows=n_windows, seed=1)
    birdzarr.convert(source, dest, progress=False)
    labels = np.random.default_rng(0).choice(len(SHARES), n_windows, p=SHARES)
    label = zarr.open_array(os.path.join(dest, "label"), mode="r+")
    label[:] = labels.astype(label.dtype)
    return dest


def epoch(ds: object, number: int) -> tuple[float, list[np.ndarray]]:
    """Windows/s of one new epoch, and the labels of its batches."""
    ds.set_epoch(number)  # type: ignore[attr-defined]
    started = time.perf_counter()
    batches = [ldt[:, 0].numpy() for _, ldt in ds]  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - started
    return sum(len(b) for b in batches) / elapsed, batches


def main() -> None:
    import birdzarr

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=1_000_000)
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    with work_directory(args.workdir, prefix="birdzarr-balanced-", keep=args.keep) as workdir:
        store = prepare(workdir, args.windows, args.devices)
        common = {"batch_size": BATCH, "seed": 1, "resident": "cpu", "resident_codes": False,
                  "with_ldt": True, "progress": False}
        datasets = {"plain shuffle": birdzarr.WindowDataset(store, **common),  # type: ignore[arg-type]
                    'label_weights="balanced"': birdzarr.WindowDataset(
                        store, label_weights="balanced", **common)}  # type: ignore[arg-type]
        for ds in datasets.values():
            epoch(ds, 0)  # warm-up: page faults of the held copy
        speeds: dict[str, list[float]] = {name: [] for name in datasets}
        plans: dict[str, list[float]] = {name: [] for name in datasets}
        worst = 0.0
        for number in range(1, args.rounds + 1):
            for name, ds in datasets.items():
                started = time.perf_counter()
                ds._resident_plan(10_000 + number)  # planning alone, of an epoch not read
                plans[name].append(time.perf_counter() - started)
                speed, batches = epoch(ds, number)
                speeds[name].append(speed)
                if name != "plain shuffle":
                    mix = np.array([np.bincount(b, minlength=len(SHARES)) for b in batches[:-1]])
                    worst = max(worst, float(np.abs(mix - BATCH / len(SHARES)).max()))
        base = statistics.median(speeds["plain shuffle"])
        counts = np.bincount(birdzarr.open_store(store).labels[:], minlength=len(SHARES))
        print(f"{args.windows:,} windows (labels {counts.tolist()}), resident='cpu' float32, batch {BATCH}, "
              f"0 workers, medians of {args.rounds} epoch(s) each, interleaved")
        print("| sampling | M windows/s | vs plain shuffle | planning an epoch, s |")
        print("|---|---:|---:|---:|")
        for name, runs in speeds.items():
            speed, plan = statistics.median(runs), statistics.median(plans[name])
            print(f"| {name} | {speed / 1e6:.2f} | {speed / base:.2f} | {plan:.3f} |")
        print(f"balanced batches: every label {BATCH / len(SHARES):,.0f} windows a full batch asked; the "
              f"largest distance seen {worst:.0f} window(s) ({worst / BATCH:.3%} of the batch)")


if __name__ == "__main__":
    main()
