"""Conversion on a Dask LocalCluster against the local converter, both orders: wall seconds.

    python benchmarks/convert_dask.py                   # 186 devices, 600,000 windows, 2 workers
    python benchmarks/convert_dask.py --windows 200000 --repeat 1
    python benchmarks/convert_dask.py --pythonpath /tmp/other-checkout   # another commit's birdzarr

The same Parquet input (generated into --workdir, default a temporary directory) is converted
with ``workers=N`` here (forked worker processes) and with ``client=`` a ``LocalCluster`` of N
worker processes of one thread each (started once, before the runs, and warmed up by a small
conversion in which its workers import what a conversion needs: both printed apart),
in device order and with ``shuffle=True`` (the same seed), the rounds interleaved; each figure is
the median of ``--repeat`` runs. Every Dask store is checked to hold the local store's chunk
files byte for byte. Wall-clock seconds on a shared machine depend on its load (printed); the
CPU seconds (this process, its worker processes and the cluster's processes, all on this
machine) depend far less on it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import tree_cpu  # noqa: E402


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and p.relative_to(root) != pathlib.Path("zarr.json")}


def _birdzarr_file() -> str:
    import birdzarr

    return str(birdzarr.__file__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--windows", type=int, default=600_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--pythonpath", default=None,
                        help="import birdzarr from this checkout (here and on the cluster's workers), "
                             "to compare commits")
    args = parser.parse_args()
    if args.pythonpath:
        where = os.path.abspath(args.pythonpath)
        sys.path.insert(0, where)  # the workers are spawned with this sys.path and this environment
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))

    import distributed

    import birdzarr
    from birdzarr.demo import _synthetic

    print(f"birdzarr from {os.path.dirname(os.path.dirname(os.path.abspath(birdzarr.__file__)))}", flush=True)

    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="birdzarr-dask-bench-"))
    src = work / "src"
    if not src.exists():
        _synthetic.make_parquet_dir(src, n_devices=args.devices, total_windows=args.windows, seed=1)
    size = sum(p.stat().st_size for p in src.iterdir())
    print(f"input: {args.devices} devices, {args.windows:,} windows, {size / 1e6:.0f} MB Parquet; "
          f"{args.workers} workers", flush=True)
    started = time.perf_counter()
    cluster = distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                                       dashboard_address=None, silence_logs=40)
    client = distributed.Client(cluster)
    print(f"LocalCluster started in {time.perf_counter() - started:.1f} s (not counted below)", flush=True)
    on_workers = set(client.run(_birdzarr_file).values())
    assert on_workers == {birdzarr.__file__}, f"the workers import another birdzarr: {on_workers}"
    spill = work / "spill"
    spill.mkdir(exist_ok=True)
    # a new cluster's workers import birdzarr, pyarrow, zarr and pandas on their first tasks (the
    # local converter's forked workers inherit them): one small conversion first, timed apart
    warm = work / "warm"
    if not warm.exists():
        _synthetic.make_parquet_dir(warm, n_devices=4, total_windows=20_000, seed=2)
    began = time.perf_counter()
    for shuffle in (False, True):
        extra: dict[str, Any] = {"seed": 1, "shuffle_tmp": str(spill)} if shuffle else {}
        birdzarr.convert(warm, work / "warm.zarr", client=client, progress=False, overwrite=True,
                         shuffle=shuffle, **extra)
    print(f"warm-up on the new cluster (20,000 windows, both orders): {time.perf_counter() - began:.1f} s "
          "(not counted below)", flush=True)
    began, cpu = time.perf_counter(), tree_cpu()
    time.sleep(10)  # what the cluster costs doing nothing: part of every Dask figure below
    print(f"the idle cluster and this process: {(tree_cpu() - cpu) / (time.perf_counter() - began):.2f} "
          "CPU s a second (10 s)", flush=True)
    times: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    try:
        for round_ in range(args.repeat):
            for order in ("device order", "shuffle"):
                for where in ("local", "dask"):
                    dest = work / f"{where}-{order.replace(' ', '-')}.zarr"
                    options: dict[str, Any] = {"progress": False, "overwrite": True, "workers": args.workers}
                    if order == "shuffle":
                        options.update(shuffle=True, seed=7, shuffle_tmp=str(spill))
                    if where == "dask":
                        options["client"] = client
                    load = os.getloadavg()[0]
                    began, cpu = time.perf_counter(), tree_cpu()
                    store = birdzarr.convert(src, dest, **options)
                    seconds, cpu = time.perf_counter() - began, tree_cpu() - cpu
                    times.setdefault((order, where), []).append(seconds)
                    cpus.setdefault((order, where), []).append(cpu)
                    report = store.meta["report"]
                    engine = ("threads" if not {"worker_processes", "dask"} & set(report) else
                              f"{report['worker_processes']} worker processes" if "worker_processes" in report
                              else f"{report['dask']['workers']} Dask workers")
                    passes = (report.get("shuffle") or {}).get("pass_seconds")
                    print(f"round {round_ + 1} {order:12s} {where:5s} {seconds:6.2f} s, {cpu:5.1f} CPU s  "
                          + (f"(pass 1 {passes[0]:.2f} s, pass 2 {passes[1]:.2f} s) " if passes else "")
                          + f"load {load:.1f}, {engine}", flush=True)
                local_files = _files(work / f"local-{order.replace(' ', '-')}.zarr")
                assert local_files == _files(work / f"dask-{order.replace(' ', '-')}.zarr"), order
        print("\nmedians (the Dask store equals the local one, every chunk file):")
        for order in ("device order", "shuffle"):
            local = statistics.median(times[(order, "local")])
            dask = statistics.median(times[(order, "dask")])
            local_cpu = statistics.median(cpus[(order, "local")])
            dask_cpu = statistics.median(cpus[(order, "dask")])
            print(f"  {order:12s} wall: local {local:6.2f} s, dask {dask:6.2f} s, "
                  f"dask/local {dask / local:.2f}x; CPU: local {local_cpu:5.1f} s, dask {dask_cpu:5.1f} s, "
                  f"dask/local {dask_cpu / local_cpu:.2f}x")
            rounds = [d / loc for d, loc in zip(times[(order, "dask")], times[(order, "local")], strict=True)]
            print(f"  {'':12s} dask/local wall by round: " + ", ".join(f"{r:.2f}x" for r in rounds)
                  + f" (min {min(rounds):.2f}x, median {statistics.median(rounds):.2f}x)")
    finally:
        client.close()
        cluster.close()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
