"""What a selection costs: construction time and streamed windows/s of WindowDataset selections.

    python benchmarks/selection.py                       # 1 M windows, 186 devices, 3 rounds
    python benchmarks/selection.py --windows 300000 --rounds 1

Generates per-device Parquet files (birdzarr.demo._synthetic), converts them with ``--shuffle``
(default 32,768-window chunks), then gives the store labels and burst times, which generated
Parquet does not carry: 10% of windows labelled (0-9, label 0 rarest), times spread uniformly over
480 days from 2012-05-15 (written through zarr into the ``label`` and ``timestamp`` arrays; the
device table's label counts are left as converted, which the loader does not read).

Each case makes a dataset (timed: the selection's one pass over the per-window arrays, or over
``gimu`` for ``split_by="window"``; with ``resident="cpu"`` also loading the selected windows),
then reads one epoch in the main process (batch 8192, no DataLoader workers) and reports
windows/s, and windows per CPU second of the process (every thread: on a shared machine the
CPU a window costs, which the load does not change as much). After one warm-up dataset, rounds
are interleaved; medians are reported.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import work_directory  # noqa: E402

DAY = 86_400
START = int(dt.datetime(2012, 5, 15, tzinfo=dt.UTC).timestamp())


def prepare(workdir: str, n_windows: int, n_devices: int) -> str:
    import zarr

    import birdzarr
    from birdzarr.demo import _synthetic

    dest = os.path.join(workdir, "shuffled.zarr")
    if os.path.exists(dest):
        return dest
    source = os.path.join(workdir, "parquet")
    _synthetic.make_parquet_dir(source, n_devices=n_devices, total_windows=n_windows, seed=1)
    birdzarr.convert(source, dest, shuffle=True, seed=0, progress=False)
    rng = np.random.default_rng(0)
    labels = np.full(n_windows, -1, dtype=np.int32)
    chosen = np.less(rng.random(n_windows), 0.10)
    labels[chosen] = rng.choice(10, int(chosen.sum()), p=[0.01] + [0.11] * 9)
    label = zarr.open_array(os.path.join(dest, "label"), mode="r+")
    label[:] = labels.astype(label.dtype)
    times = zarr.open_array(os.path.join(dest, "timestamp"), mode="r+")
    times[:] = START + rng.integers(0, 480 * DAY, n_windows)
    return dest


def cases() -> dict[str, dict[str, object]]:
    return {
        "everything": {},
        'split="train" (by device)': {"split": "train"},
        'split="train", split_by="window"': {"split": "train", "split_by": "window"},
        "labelled_only (10%)": {"labelled_only": True},
        "start/stop: 240 days (50%)": {"start": START, "stop": START + 240 * DAY},
        "start/stop: 30 days (6%)": {"start": START + 60 * DAY, "stop": START + 90 * DAY},
        'labels=[0] (0.1%)': {"labels": [0]},
        'labelled_only, resident="cpu"': {"labelled_only": True, "resident": "cpu"},
        'start/stop: 30 days, resident="cpu"': {"start": START + 60 * DAY, "stop": START + 90 * DAY,
                                                "resident": "cpu"},
    }


def run(store: str, options: dict[str, object]) -> tuple[float, float, int, float]:
    """Seconds to make the dataset; windows per second of one epoch; its windows; and windows per
    CPU second of this process (all its threads: the pool's decoding threads too)."""
    import birdzarr

    started = time.perf_counter()
    ds = birdzarr.WindowDataset(store, batch_size=8192, seed=1, progress=False, **options)  # type: ignore[arg-type]
    made = time.perf_counter() - started
    started, cpu = time.perf_counter(), time.process_time()
    n = sum(len(x) for x in ds)
    return made, n / (time.perf_counter() - started), n, n / max(time.process_time() - cpu, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=1_000_000)
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    with work_directory(args.workdir, prefix="birdzarr-selection-", keep=args.keep) as workdir:
        store = prepare(workdir, args.windows, args.devices)
        run(store, {})  # warm-up: imports, page cache
        results: dict[str, list[tuple[float, float, int, float]]] = {name: [] for name in cases()}
        for _ in range(args.rounds):
            for name, options in cases().items():
                results[name].append(run(store, options))
        base = statistics.median(r[1] for r in results["everything"])
        base_cpu = statistics.median(r[3] for r in results["everything"])
        print(f"{args.windows:,} windows, {args.devices} devices, --shuffle store, batch 8192, "
              f"0 workers, medians of {args.rounds} round(s)")
        print("| selection | windows | construction s | M windows/s | vs everything "
              "| M windows a CPU s | vs everything |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, runs in results.items():
            made = statistics.median(r[0] for r in runs)
            speed = statistics.median(r[1] for r in runs)
            cpu = statistics.median(r[3] for r in runs)
            print(f"| {name} | {runs[0][2]:,} | {made:.2f} | {speed / 1e6:.2f} | {speed / base:.2f} "
                  f"| {cpu / 1e6:.2f} | {cpu / base_cpu:.2f} |")


if __name__ == "__main__":
    main()
