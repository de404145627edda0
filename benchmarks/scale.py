"""Full-scale run on one machine: ~25 M windows (~8 GB float32), 186 skewed devices.

    python benchmarks/scale.py --windows 1000000                     # try it small first
    nohup python benchmarks/scale.py --workdir /tmp/birdzarr-scale \\
        --json /tmp/scale.json > /tmp/scale.log 2>&1 &                # full scale (15-25 min)

Steps, each timed:

1. **Generate** realistic per-device Parquet files (``_synthetic.device_sizes`` skew, calibrated
   values from ``_synthetic.curated_windows``, default ``pyarrow`` settings: row groups of up to
   1,048,576 rows) in ``--workdir`` (never in the repository; refused if the disk is too small).
2. **Convert** them with the CLI, ``birdzarr convert SRC DEST --workers W`` in a child process,
   for each ``--convert-workers`` value; MB/s counts float32 window bytes (320 per window) over
   the converter's own ``seconds`` (recorded in the store's report).
3. **One full shuffled epoch** with ``WindowDataset`` (batch 8192) through a DataLoader with
   ``--workers`` workers, in a child process. A background thread samples the private memory
   (psutil USS, pages no other process shares) of that process and its workers every 0.2 s;
   the peak of the sum is reported and must stay under 1 GB. Windows/s and time to first batch
   come from the same run; the shuffle quality ratio (1.0 = uniform) from a sample of batches.

The work directory is removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _util import PeakSampler, dir_bytes, machine, run_measured, table, tree_private  # noqa: E402

WINDOW_BYTES = 320
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIECE = 262_144  # windows generated at a time (bounds the generator's memory)


# -- 1. generation ---------------------------------------------------------------------------------
def _write_device(job: tuple[str, int, int, int]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from birdzarr.demo import _synthetic

    directory, device, size, seed = job
    path = os.path.join(directory, f"{device}.parquet")
    pieces = []
    for done in range(0, size, PIECE):
        n = min(PIECE, size - done)
        # one calibration per device (a tracker's sensor), fresh samples in every piece
        windows = _synthetic.curated_windows(n, seed=seed * 100_003 + device * 1009 + done,
                                             calibration_seed=seed * 100_003 + device)
        offsets = pa.array(np.arange(0, n * 80 + 1, 80, dtype=np.int32))
        pieces.append(pa.ListArray.from_arrays(offsets, pa.array(windows.reshape(-1), type=pa.float32())))
    # Default writer settings, as the real files were written: row groups of up to 1,048,576 rows.
    pq.write_table(pa.table({"gimu": pa.chunked_array(pieces)}), path + ".tmp")
    os.replace(path + ".tmp", path)
    return size


def generate(directory: str, n_devices: int, n_windows: int, *, seed: int, processes: int) -> dict[str, Any]:
    from birdzarr.demo import _synthetic

    # beside the input directory, not in it: the converter refuses files that are not inputs
    marker = directory.rstrip(os.sep) + ".complete"
    ids = _synthetic.device_ids(n_devices).tolist()
    sizes = _synthetic.device_sizes(n_devices, n_windows, seed=seed).tolist()
    started = time.perf_counter()
    if not os.path.exists(marker):
        os.makedirs(directory, exist_ok=True)
        jobs = sorted(((directory, d, s, seed) for d, s in zip(ids, sizes, strict=True)), key=lambda j: -j[2])
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            for _ in pool.imap_unordered(_write_device, jobs):
                pass
        open(marker, "w").close()
    files = [f for f in os.listdir(directory) if f.endswith(".parquet")]
    return {
        "devices": len(files), "windows": int(sum(sizes)), "largest device": int(max(sizes)),
        "smallest device": int(min(sizes)), "parquet GB": dir_bytes(directory) / 1e9,
        "float32 GB": sum(sizes) * WINDOW_BYTES / 1e9, "generate s": time.perf_counter() - started,
    }


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- 2. conversion ---------------------------------------------------------------------------------
def convert_measured(source: str, dest: str, workers: int, extra: list[str]) -> dict[str, Any]:
    import birdzarr

    cli = "import sys; from birdzarr.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", cli, "convert", source, dest, "--overwrite", "--quiet",
            "--workers", str(workers), *extra]
    cpu_before = _children_cpu()
    wall, peak, *_ = run_measured(argv, interval=0.2)
    cpu = _children_cpu() - cpu_before  # user + system seconds: robust to other load on the machine
    store = birdzarr.open_store(dest)
    seconds = float(store.meta["report"]["seconds"])
    raw = len(store) * WINDOW_BYTES
    stored = dir_bytes(dest)
    return {
        "workers": workers, "windows": len(store), "convert s": seconds, "wall s": wall,
        "MB/s": raw / seconds / 1e6, "cpu s": cpu, "MB per cpu s": raw / cpu / 1e6,
        "store GB": stored / 1e9, "ratio vs float32": raw / stored,
        "chunk files": sum(len(f) for _, _, f in os.walk(dest)), "peak RSS MB": peak / 1e6,
        "load avg": round(os.getloadavg()[1], 1),  # 5-minute load average: others' work on the machine
        "command": " ".join(["birdzarr convert SRC DEST --overwrite --quiet --workers",
                             str(workers), *extra]),
    }


def dask_measured(source: str, dest: str, local_dest: str, n_workers: int) -> dict[str, Any]:
    """Convert on a LocalCluster (worker processes, one thread each) through the CLI's
    ``--dask-scheduler``, then compare every file of the store with the local conversion."""
    import filecmp

    import distributed

    import birdzarr

    cpu_before = _children_cpu()
    with distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                                  dashboard_address=None, silence_logs=40) as cluster:
        cli = "import sys; from birdzarr.cli import main; sys.exit(main(sys.argv[1:]))"
        argv = [sys.executable, "-c", cli, "convert", source, dest, "--overwrite", "--quiet",
                "--dask-scheduler", cluster.scheduler_address]
        wall = run_measured(argv, interval=0.5).seconds
    cpu = _children_cpu() - cpu_before  # the CLI client plus the worker processes, once they exit
    store = birdzarr.open_store(dest)
    seconds = float(store.meta["report"]["seconds"])
    differing, compared = [], 0
    for directory, _, names in os.walk(local_dest):
        for name in names:
            rel = os.path.relpath(os.path.join(directory, name), local_dest)
            if rel == "zarr.json":  # root attributes: timings differ; the device table is compared below
                continue
            compared += 1
            mine, other = os.path.join(local_dest, rel), os.path.join(dest, rel)
            if not os.path.exists(other) or not filecmp.cmp(mine, other, shallow=False):
                differing.append(rel)
    local = birdzarr.open_store(local_dest)
    same_table = [e.to_json() for e in local.device_table] == [e.to_json() for e in store.device_table]
    return {
        "dask workers": n_workers, "windows": len(store), "convert s": seconds, "wall s": wall,
        "MB/s": len(store) * WINDOW_BYTES / seconds / 1e6, "cpu s": cpu,
        "MB per cpu s": len(store) * WINDOW_BYTES / cpu / 1e6, "files compared": compared,
        "files differing": len(differing), "same device table": same_table,
        "load avg": round(os.getloadavg()[1], 1),
    }


# -- 3. one epoch (runs in a child process: `scale.py _epoch STORE ...`) ---------------------------
def epoch_child(store: str, batch_size: int, workers: int, seed: int, quality_batches: int) -> dict[str, Any]:
    import psutil
    import torch
    from torch.utils.data import DataLoader

    import birdzarr
    from birdzarr.loader._quality import quality_ratio

    me = psutil.Process()
    # USS of the whole tree (main + workers) and of the main process alone
    with PeakSampler(lambda: (tree_private(me.pid)[0], me.memory_full_info().uss), 0.2) as sampler:
        started = time.perf_counter()
        ds = birdzarr.WindowDataset(store, batch_size=batch_size, shuffle=True, seed=seed)
        ds.set_epoch(0)
        loader = DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=torch.cuda.is_available(),
                            persistent_workers=False)
        first = None
        windows = batches = 0
        checksum = 0.0
        for x in loader:
            if first is None:
                first = time.perf_counter() - started
            windows += len(x)
            batches += 1
            checksum += float(x[:, 0, 0].sum())  # touch the data
        seconds = time.perf_counter() - started
    import resource

    cpu = sum(getattr(resource.getrusage(who), f)
              for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
    peak_uss, peak_main = sampler.peak
    series = [(at, values[0]) for at, values in sampler.series]

    # Shuffle quality from a sample of this epoch's batches: each window's device from the
    # store's per-window device array (a shuffled store's devices have no index ranges)
    opened = birdzarr.open_store(store)
    plan = ds.plan()
    pick = np.unique(np.linspace(0, plan.n_batches - 1, min(quality_batches, plan.n_batches)).astype(int))
    sampled = [opened.window_devices[np.sort(ds.batch_indices(int(b), plan))] for b in pick]
    devices = np.asarray([e.device_id for e in opened.device_table])
    counts = np.asarray([e.n_windows for e in opened.device_table])
    return {
        "windows": windows, "batches": batches, "epoch s": seconds, "first batch s": first,
        "windows/s": windows / seconds, "MB/s": windows * WINDOW_BYTES / seconds / 1e6,
        "peak USS MB": peak_uss / 1e6, "quality": quality_ratio(sampled, devices, counts),
        "cpu s": cpu, "windows per cpu s": windows / cpu, "peak main USS MB": peak_main / 1e6,
        "USS MB at 10/50/90% of the run": [round(series[int(f * (len(series) - 1))][1] / 1e6)
                                           for f in (0.1, 0.5, 0.9)] if series else None,
        "complete": windows == len(opened), "loader workers": workers, "batch": batch_size,
        "load avg": round(os.getloadavg()[1], 1),
    }


def epoch_measured(store: str, batch_size: int, workers: int, seed: int,
                   extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    argv = [sys.executable, os.path.abspath(__file__), "_epoch", store,
            str(batch_size), str(workers), str(seed)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(extra_env or {})}
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


# -- driver ----------------------------------------------------------------------------------------
def _check_workdir(workdir: str, n_windows: int) -> None:
    real = os.path.realpath(workdir)
    if real == REPO or real.startswith(REPO + os.sep):
        raise SystemExit(f"--workdir {workdir} is inside the repository; use a path under /tmp")
    os.makedirs(real, exist_ok=True)
    # Parquet ~0.5x and the store ~0.35x the float32 bytes (measured at small scale), plus margin.
    need = int(n_windows * WINDOW_BYTES * 1.2)
    free = shutil.disk_usage(real).free
    if free < need:
        raise SystemExit(f"{workdir}: {free / 1e9:.1f} GB free, need about {need / 1e9:.1f} GB")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_epoch":
        store, batch, workers, seed = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(epoch_child(store, batch, workers, seed, quality_batches=24)))
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", type=int, default=25_000_000, help="total windows (default 25 M)")
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="/tmp/birdzarr-scale", help="generated data and the store")
    parser.add_argument("--gen-processes", type=int, default=2, help="processes generating Parquet")
    parser.add_argument("--convert-workers", type=int, nargs="+", default=[2],
                        help="`birdzarr convert --workers` values to measure, in order "
                             "(the last store is read)")
    parser.add_argument("--convert-args", default="--shuffle --seed 1",
                        help="arguments for `birdzarr convert` (default: the training layout)")
    parser.add_argument("--dask-workers", type=int, default=0,
                        help="also convert on a dask LocalCluster of this many worker processes and "
                             "compare every chunk file with the local store (needs birdzarr[dask])")
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--epoch-env", action="append", default=[], metavar="KEY=VALUE",
                        help="run one more epoch with this environment variable (e.g. MALLOC_ARENA_MAX=2)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    _check_workdir(args.workdir, args.windows)
    results: dict[str, Any] = {"machine": machine(), "argv": sys.argv, "convert": []}
    source = os.path.join(args.workdir, f"parquet_{args.devices}_{args.windows}")
    dest = os.path.join(args.workdir, "scale.zarr")
    try:
        print(f"# {machine()}; workdir {args.workdir}", flush=True)
        results["data"] = generate(source, args.devices, args.windows, seed=args.seed,
                                   processes=args.gen_processes)
        print(table([results["data"]]), flush=True)
        for workers in args.convert_workers:
            row = convert_measured(source, dest, workers, args.convert_args.split())
            results["convert"].append(row)
            print(table([row]), flush=True)
        if args.dask_workers:
            row = dask_measured(source, os.path.join(args.workdir, "dask.zarr"), dest, args.dask_workers)
            results["dask"] = row
            print(table([row]), flush=True)
        results["epoch"] = epoch_measured(dest, args.batch_size, args.workers, args.seed)
        print(table([results["epoch"]]), flush=True)
        for item in args.epoch_env:
            key, _, value = item.partition("=")
            row = epoch_measured(dest, args.batch_size, args.workers, args.seed, {key: value})
            results.setdefault("epoch_env", []).append({"env": item, **row})
            print(table([{"env": item, **row}]), flush=True)
        ok = results["epoch"]["peak USS MB"] < 1000 and results["epoch"]["complete"]
        results["under 1 GB"] = ok
        print(f"\npeak private RAM of the loader tree {results['epoch']['peak USS MB']:.0f} MB "
              f"({'under' if ok else 'NOT under'} 1 GB); epoch complete: {results['epoch']['complete']}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=2, default=str)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
