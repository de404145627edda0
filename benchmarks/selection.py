"""What a selection costs: construction time and streamed windows/s of WindowDataset selections.

    python benchmarks/selection.py                       # 1 M windows, 186 devices, 3 rounds
    python benchmarks/selection.py --windows 300000 --rounds 1
    python benchmarks/selection.py --only labelled_only "30 days" --warm-epochs 1
    python benchmarks/selection.py --only "30 days" --warm-epochs 1 --equal-windows --workers 2

Generates per-device Parquet files (birdzarr.demo._synthetic), converts them with ``--shuffle``
(default 32,768-window chunks), then gives the store labels and burst times, which generated
Parquet does not carry: 10% of windows labelled (0-9, label 0 rarest), times spread uniformly over
480 days from 2012-05-15 (written through zarr into the ``label`` and ``timestamp`` arrays; the
device table's label counts are left as converted, which the loader does not read).

Each case makes a dataset (timed: the selection's one pass over the per-window arrays, or over
``gimu`` for ``split_by="window"``; with ``resident="cpu"`` also loading the selected windows),
then reads one epoch in the main process (batch 8192, no DataLoader workers; with
``--warm-epochs N``, after N untimed epochs of the same dataset) and reports
windows/s, and windows per CPU second of the process (every thread: on a shared machine the
CPU a window costs, which the load does not change as much). After one warm-up dataset, rounds
are interleaved; medians are reported.

``--equal-windows`` times each case over as many epochs as it takes to deliver at least the
unselected loader's windows of one epoch (the 62,727-window 30 days: 16 epochs against one of
the 1 M windows), so what an epoch costs once is weighed per delivered window, as a run training
for as many steps sees it. ``--workers K`` reads through a DataLoader with K persistent workers
(the CPU then counts the workers' processes too).

The "subset:" rows stream a store ``birdzarr.subset`` wrote of a selection (once, before the
rounds; its seconds are printed below the table) with no selection of their own: the same
windows as the selection's row, read without the chunks' other windows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from typing import Any

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


def subsets() -> dict[str, dict[str, object]]:
    """The selections also written as their own stores (``birdzarr.subset``)."""
    return {
        "subset: labelled_only (10%)": {"labelled_only": True},
        "subset: start/stop: 30 days (6%)": {"start": START + 60 * DAY, "stop": START + 90 * DAY},
    }


def _wanted(name: str, wanted: list[str] | None) -> bool:
    return wanted is None or any(text in name for text in wanted)


def write_subsets(workdir: str, store: str, wanted: list[str] | None) -> dict[str, tuple[str, float]]:
    """Each of ``subsets()`` (those ``wanted``) written next to the store: its path and seconds."""
    import birdzarr

    made = {}
    for number, (name, options) in enumerate(subsets().items()):
        if not _wanted(name, wanted):
            continue
        dest = os.path.join(workdir, f"subset-{number}.zarr")
        started = time.perf_counter()
        birdzarr.subset(store, dest, overwrite=True, progress=False, **options)  # type: ignore[arg-type]
        made[name] = (dest, time.perf_counter() - started)
    return made


def _cpu(workers: list[Any]) -> float:
    """CPU seconds of this process (every thread) and of the given worker processes."""
    import psutil

    total = time.process_time()
    for worker in workers:
        times = psutil.Process(worker.pid).cpu_times()
        total += times.user + times.system
    return total


def run(store: str, options: dict[str, object], warm_epochs: int = 0, *, at_least: int = 0,
        workers: int = 0) -> tuple[float, float, int, float]:
    """Seconds to make the dataset; windows per second of one epoch, or of as many as deliver
    ``at_least`` windows (after ``warm_epochs`` untimed ones of the same dataset); the windows
    timed; and windows per CPU second of this process (all its threads: the pool's decoding
    threads too) and its ``workers`` persistent DataLoader workers."""
    from torch.utils.data import DataLoader

    import birdzarr

    started = time.perf_counter()
    ds = birdzarr.WindowDataset(store, batch_size=8192, seed=1, progress=False, **options)  # type: ignore[arg-type]
    made = time.perf_counter() - started
    source: Any = ds
    if workers:
        source = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True)
    epoch = 0
    for epoch in range(warm_epochs):  # a dataset's first epoch also pays for its pool's buffers, threads
        ds.set_epoch(epoch)
        for _x in source:
            pass
    processes = list(source._iterator._workers) if workers and warm_epochs else []
    started, cpu, n = time.perf_counter(), _cpu(processes), 0
    first = warm_epochs
    while n == 0 or n < at_least:
        ds.set_epoch(first + epoch)
        n += sum(len(x) for x in source)
        epoch += 1
        processes = processes or (list(source._iterator._workers) if workers else [])
    return made, n / (time.perf_counter() - started), n, n / max(_cpu(processes) - cpu, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=1_000_000)
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--warm-epochs", type=int, default=0,
                        help="epochs each dataset reads before the timed one (default 0: its first epoch "
                             "is timed; 1: a later epoch, what a training run sees after its first)")
    parser.add_argument("--equal-windows", action="store_true",
                        help="time each case over the epochs that deliver at least the unselected "
                             "loader's windows of one epoch (per delivered window over equal numbers)")
    parser.add_argument("--workers", type=int, default=0,
                        help="persistent DataLoader workers (default 0: read in this process)")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="only the cases whose name holds one of these texts (the subset rows of "
                             "those selections too; 'everything' is always run)")
    args = parser.parse_args()
    with work_directory(args.workdir, prefix="birdzarr-selection-", keep=args.keep) as workdir:
        store = prepare(workdir, args.windows, args.devices)
        wanted = args.only
        chosen = {n: o for n, o in cases().items() if _wanted(n, wanted) or n == "everything"}
        written = write_subsets(workdir, store, wanted)
        run(store, {})  # warm-up: imports, page cache
        at_least = args.windows if args.equal_windows else 0
        timed = {"warm_epochs": args.warm_epochs, "at_least": at_least, "workers": args.workers}
        results: dict[str, list[tuple[float, float, int, float]]] = {name: [] for name in [*chosen, *written]}
        for _ in range(args.rounds):
            for name, options in chosen.items():
                results[name].append(run(store, options, **timed))
            for name, (path, _) in written.items():
                results[name].append(run(path, {}, **timed))
        base = statistics.median(r[1] for r in results["everything"])
        base_cpu = statistics.median(r[3] for r in results["everything"])
        epoch = "the first epoch" if not args.warm_epochs else f"epoch {args.warm_epochs + 1}"
        if args.equal_windows:
            start = epoch.removeprefix("the ")
            epoch = f"the epochs from {start} on that deliver >= {args.windows:,} windows"
        print(f"{args.windows:,} windows, {args.devices} devices, --shuffle store, batch 8192, "
              f"{args.workers} workers, {epoch} of each dataset timed, medians of {args.rounds} round(s), "
              f"load average {os.getloadavg()[0]:.1f}")
        print("| selection | windows timed | construction s | M windows/s | vs everything "
              "| M windows a CPU s | vs everything |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, runs in results.items():
            made = statistics.median(r[0] for r in runs)
            speed = statistics.median(r[1] for r in runs)
            cpu = statistics.median(r[3] for r in runs)
            print(f"| {name} | {runs[0][2]:,} | {made:.2f} | {speed / 1e6:.2f} | {speed / base:.2f} "
                  f"| {cpu / 1e6:.2f} | {cpu / base_cpu:.2f} |")
        for name, (_, seconds) in written.items():
            print(f"{name}: written by birdzarr.subset in {seconds:.2f} s")


if __name__ == "__main__":
    main()
