"""Conversion benchmark: Parquet and CSV -> store with 1 and 2 workers (Parquet also on threads
only, against the worker processes), and --shuffle; MB/s,
CPU seconds, cores used, store size against the Parquet source, peak memory, load average.

    python benchmarks/convert.py                       # 186 devices, 1 M windows, CSV, shuffle
    python benchmarks/convert.py --windows 300000      # quicker
    python benchmarks/convert.py --workers 1 2 16      # on a larger machine
    python benchmarks/convert.py --repeat 5            # median of 5 alternating runs each

Generated data goes to --workdir (default: a temporary directory), removed at the end unless
--keep is given or the directory existed before (then generated data there is reused). Each
conversion runs in its own process (the CLI) so its peak RSS (whole
process tree, sampled every 50 ms) and CPU time (children's rusage) are its own. Parquet MB/s
counts float32 window bytes (320 per window), CSV MB/s counts CSV text bytes. The machine's load
average (1 minute) is printed beside each run: on a shared machine the wall-clock figures are
only comparable between runs of similar load; "MB per CPU s" is the robust one. With
``--repeat R`` every conversion runs R times, the rounds interleaved (1 worker, 2 workers,
--shuffle, CSV, then again), and each figure is the run of median seconds: on a shared machine a
single run can be off by 20%. The last table gives the ratios: each worker count against the
fewest measured (1 worker by default), --shuffle against device order, and each store's size
against its Parquet source.

"MB/CPU s" is MB/s's bytes per CPU second of the whole conversion (all its processes).

The "2 x 1 worker on halves, at once" row is this machine's ceiling for 2 workers: two
independent 1-worker conversions, of half the devices each, started together. They share
nothing, so no 2-worker conversion can beat their combined rate; on a machine whose second core
gives less than a whole one (shared vCPUs, memory bandwidth) it shows how much less.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _util import children_cpu, dir_bytes, machine, run_measured, table, work_directory  # noqa: E402

from birdzarr.demo import _synthetic  # noqa: E402

WINDOW_BYTES = 320


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def make_parquet(directory: str, sizes: dict[int, int], *, seed: int) -> None:
    """Write one file per device, generated piecewise so the generator's memory stays small."""
    os.makedirs(directory, exist_ok=True)
    marker = directory.rstrip("/") + ".complete"  # beside it: a source holds input files only
    if os.path.exists(marker):
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    for device, size in sizes.items():
        path = os.path.join(directory, f"{device}.parquet")
        schema = pa.schema([("gimu", pa.list_(pa.float32()))])
        with pq.ParquetWriter(path, schema) as writer:  # default settings: row groups of 1,048,576
            done = 0
            batches = []
            while done < size:
                n = min(262_144, size - done)
                windows = _synthetic.curated_windows(n, seed=seed * 100_003 + device * 1009 + done)
                flat = pa.array(windows.reshape(-1), type=pa.float32())
                offsets = pa.array(np.arange(0, n * 80 + 1, 80, dtype=np.int32))
                batches.append(pa.ListArray.from_arrays(offsets, flat))
                done += n
            writer.write_table(pa.table({"gimu": pa.chunked_array(batches)}))
    open(marker, "w").close()


def make_csv(directory: str, *, devices: int, bursts: int, parts: int, seed: int) -> None:
    """Raw CSV exports of ``devices`` devices, ``parts`` parts each (bursts cross the parts)."""
    marker = directory.rstrip("/") + ".complete"
    if os.path.exists(marker):
        return
    _synthetic.make_csv_dir(directory, n_devices=devices, bursts_per_device=bursts, parts=parts, seed=seed)
    open(marker, "w").close()


def input_bytes(source: str, suffix: str) -> int:
    return sum(os.path.getsize(os.path.join(source, f)) for f in os.listdir(source) if f.endswith(suffix))


_CLI = "import sys; from birdzarr.cli import main; sys.exit(main(sys.argv[1:]))"  # `birdzarr` in a process


def convert_measured(source: str, dest: str, *extra: str, parquet: str | None = None,
                     threads_only: bool = False, format_version: int = 2) -> dict[str, Any]:
    """One CLI conversion; ``parquet`` (a directory) for the store-vs-Parquet size column;
    ``threads_only``: Parquet converted on threads, as below the worker processes' size threshold
    (birdzarr/convert/_segments.py), for the comparison."""
    cli = _CLI
    if threads_only:
        cli = ("import importlib; importlib.import_module('birdzarr.convert._segments').PROCESS_MIN_BYTES = "
               "1 << 62; " + cli)
    argv = [sys.executable, "-c", cli, "convert", source, dest, "--overwrite", "--quiet", *extra]
    cpu_before, load = children_cpu(), os.getloadavg()[0]
    wall, peak, *_ = run_measured(argv)
    cpu = children_cpu() - cpu_before
    load_after = os.getloadavg()[0]
    import birdzarr

    store = birdzarr.open_store(dest)
    report = store.meta["report"]
    seconds = float(report["seconds"])
    raw = len(store) * WINDOW_BYTES
    stored = dir_bytes(dest)
    is_csv = store.meta["source_kind"] == "csv"
    source_bytes = input_bytes(source, ".csv" if is_csv else ".parquet")
    counted = source_bytes if is_csv else raw
    cpu_seconds = float(report.get("cpu_seconds", cpu))
    row = {
        "format": int(store.meta["format_version"]),
        "windows": len(store),
        "seconds": seconds,
        "MB/s": counted / seconds / 1e6,
        "of": "CSV text" if is_csv else "float32",
        "MB/CPU s": counted / cpu_seconds / 1e6 if cpu_seconds > 0 else "",
        "CPU s": cpu_seconds,
        "cores used": float(report.get("cores_used", 0.0)),
        "process CPU s": cpu,
        "wall_s": wall,
        "load": f"{load:.1f}-{load_after:.1f}",
        "store MB": stored / 1e6,
        "store/parquet": stored / input_bytes(parquet, ".parquet") if parquet else "",
        "peak RSS MB": peak / 1e6,
    }
    if "pass_cpu_seconds" in report.get("shuffle", {}):
        row["pass CPU s"] = report["shuffle"]["pass_cpu_seconds"]
    return row


def split_in_two(source: str, into: str) -> list[str]:
    """Hard-link ``source``'s Parquet files into two directories of about equal bytes (largest
    first, each to the lighter half): the input of two independent 1-worker conversions."""
    # named after the source: a kept --workdir may hold the halves of another corpus
    halves = [os.path.join(into, f"{os.path.basename(source)}.half_{h}") for h in "ab"]
    if all(os.path.isdir(h) for h in halves):
        return halves
    for h in halves:
        shutil.rmtree(h, ignore_errors=True)
        os.makedirs(h)
    names = sorted((f for f in os.listdir(source) if f.endswith(".parquet")),
                   key=lambda f: -os.path.getsize(os.path.join(source, f)))
    weight = [0, 0]
    for name in names:
        lighter = int(weight[1] < weight[0])
        os.link(os.path.join(source, name), os.path.join(halves[lighter], name))
        weight[lighter] += os.path.getsize(os.path.join(source, name))
    return halves


def convert_halves_at_once(halves: list[str], workdir: str, format_version: int = 2) -> dict[str, Any]:
    """Two 1-worker conversions of half the devices each, started together: no conversion can
    share its work between two cores better than two that share nothing, so their combined rate
    against one 1-worker conversion of everything is this machine's ceiling for 2 workers."""
    dests = [os.path.join(workdir, f"half_{i}_v{format_version}.zarr") for i in range(len(halves))]
    load = os.getloadavg()[0]
    procs = [subprocess.Popen([sys.executable, "-c", _CLI, "convert", half, dest, "--overwrite", "--quiet",
                               "--workers", "1"])
             for half, dest in zip(halves, dests, strict=True)]
    if any(proc.wait() for proc in procs):
        raise RuntimeError("a half conversion failed")
    import birdzarr

    stores = [birdzarr.open_store(dest) for dest in dests]
    # each report's seconds leave out the interpreter's start, as the other rows' do
    seconds = max(float(store.meta["report"]["seconds"]) for store in stores)
    windows = sum(len(store) for store in stores)
    return {"format": format_version, "windows": windows, "seconds": seconds,
            "MB/s": windows * WINDOW_BYTES / seconds / 1e6,
            "of": "float32", "CPU s": sum(float(s.meta["report"]["cpu_seconds"]) for s in stores),
            "load": f"{load:.1f}-{os.getloadavg()[0]:.1f}"}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--windows", type=int, default=1_000_000)
    parser.add_argument("--csv-devices", type=int, default=8)
    parser.add_argument("--csv-bursts", type=int, default=20_000, help="bursts per CSV device")
    parser.add_argument("--csv-parts", type=int, default=3)
    parser.add_argument(
        "--device-sizes",
        type=int,
        nargs="+",
        default=[9_296, 1_500_000],
        help="windows of the single-device conversions of the memory test",
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--skip-memory", action="store_true", help="skip the big-vs-small device test")
    parser.add_argument("--skip-ceiling", action="store_true",
                        help="skip the two independent half conversions (this machine's 2-worker ceiling)")
    parser.add_argument("--skip-shuffle", action="store_true", help="skip the --shuffle conversion")
    parser.add_argument("--skip-csv", action="store_true", help="skip the CSV conversions")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the generated data and stores")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each conversion, interleaved; figures are the medians")
    args = parser.parse_args()

    rows: list[dict[str, Any]] = []
    most = max(args.workers)
    with work_directory(args.workdir, prefix="birdzarr-bench-convert-", keep=args.keep) as workdir:
        print(f"# {machine()}; workdir {workdir}")
        ids = _synthetic.device_ids(args.devices).tolist()
        sizes = _synthetic.device_sizes(args.devices, args.windows, seed=0).tolist()
        corpus = os.path.join(workdir, f"parquet_{args.devices}_{args.windows}")
        make_parquet(corpus, dict(zip(ids, sizes, strict=True)), seed=0)

        runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
        versions = [2]  # the format birdzarr writes (the rows name it)

        def run(name: str, workers: int, source: str, dest: str, *extra: str, version: int,
                threads_only: bool = False) -> dict[str, Any]:
            is_parquet = any(f.endswith(".parquet") for f in os.listdir(source))
            dest = os.path.join(workdir, dest.removesuffix(".zarr") + f"_v{version}.zarr")
            row = {"input": name, "workers": workers,
                   **convert_measured(source, dest, "--workers", str(workers), *extra,
                                      parquet=source if is_parquet else None, threads_only=threads_only,
                                      format_version=version)}
            print(table([row]), flush=True)
            runs.setdefault((name, workers, version), []).append(row)
            return row

        def median(name: str, workers: int, version: int) -> dict[str, Any]:
            """The run of median seconds (of ``--repeat``), in the summary tables."""
            done = sorted(runs[(name, workers, version)], key=lambda r: float(r["seconds"]))
            row = dict(done[(len(done) - 1) // 2])
            if len(done) > 1:
                row["runs"] = len(done)
            rows.append(row)
            return row

        parquet_name = f"parquet, {args.devices} devices"
        ceiling_name = f"parquet, {args.devices} devices, 2 x 1 worker on halves, at once"
        halves = split_in_two(corpus, workdir) if not args.skip_ceiling and 1 in args.workers else None
        threads_name = f"parquet, {args.devices} devices, threads only"
        shuffle_name = f"parquet, {args.devices} devices, --shuffle"
        csv_name = f"csv, {args.csv_devices} devices x {args.csv_parts} parts"
        csv_dir = os.path.join(workdir, f"csv_{args.csv_devices}_{args.csv_bursts}")
        if not args.skip_csv:
            make_csv(csv_dir, devices=args.csv_devices, bursts=args.csv_bursts, parts=args.csv_parts, seed=0)
        for round_ in range(max(1, args.repeat)):
            order = args.workers if round_ % 2 == 0 else args.workers[::-1]
            formats = versions if round_ % 2 == 0 else versions[::-1]
            for w in order:
                for v in formats:
                    run(parquet_name, w, corpus, "corpus.zarr", version=v)
            if most > 1:
                for v in formats:
                    run(threads_name, most, corpus, "corpus.zarr", version=v, threads_only=True)
            if halves:
                for v in formats:
                    half_row = {"input": ceiling_name, "workers": 2,
                                **convert_halves_at_once(halves, workdir, v)}
                    print(table([half_row]), flush=True)
                    runs.setdefault((ceiling_name, 2, v), []).append(half_row)
            if not args.skip_shuffle:
                for v in formats:
                    run(shuffle_name, most, corpus, "shuffled.zarr",
                        "--shuffle", "--seed", "1", "--shuffle-tmp", workdir, version=v)
            if not args.skip_csv:
                for w in order:
                    for v in formats:
                        run(csv_name, w, csv_dir, "csv.zarr", version=v)
        ordered = {v: {w: median(parquet_name, w, v) for w in args.workers} for v in versions}
        threads = {v: median(threads_name, most, v) for v in versions} if most > 1 else {}
        ceiling = {v: median(ceiling_name, 2, v) for v in versions} if halves else {}
        shuffled = {v: median(shuffle_name, most, v) for v in versions} if not args.skip_shuffle else {}
        csv_rows = {v: {w: median(csv_name, w, v) for w in args.workers} for v in versions} \
            if not args.skip_csv else {}
        if not args.skip_memory:
            for size in args.device_sizes:
                source = os.path.join(workdir, f"one_{size}")
                make_parquet(source, {900 + size % 97: size}, seed=1)
                for v in versions:
                    run(f"one device ({size:,} windows)", most, source, f"one_{size}.zarr", version=v)
                    median(f"one device ({size:,} windows)", most, v)
        print()
        print(table(rows))
        # one column of ratios, with what each is against: a table's columns are its first row's
        targets: list[dict[str, object]] = []
        for v in versions:
            fmt = f"format {v}: " if len(versions) > 1 else ""
            # each worker count against the fewest measured (--workers 2 16: 16 against 2)
            fewest = min(ordered[v])
            one, base_name = ordered[v][fewest], _workers(fewest)
            csv_one = csv_rows[v].get(min(csv_rows[v])) if csv_rows and csv_rows[v] else None
            for w, row in ordered[v].items():
                targets.append({"figure": f"{fmt}parquet MB/s, {_workers(w)}", "value": row["MB/s"],
                                "ratio": float(row["MB/s"]) / float(one["MB/s"]),
                                "against": base_name, "load": row["load"]})
            if v in ceiling and fewest == 1:
                targets.append({"figure": f"{fmt}parquet MB/s, 2 x 1 worker on halves at once (ceiling)",
                                "value": ceiling[v]["MB/s"],
                                "ratio": float(ceiling[v]["MB/s"]) / float(one["MB/s"]),
                                "against": "1 worker", "load": ceiling[v]["load"]})
                if 2 in ordered[v]:
                    targets.append({"figure": f"{fmt}parquet MB/s, 2 workers", "value": ordered[v][2]["MB/s"],
                                    "ratio": float(ordered[v][2]["MB/s"]) / float(ceiling[v]["MB/s"]),
                                    "against": "the ceiling", "load": ordered[v][2]["load"]})
            if v in threads:
                targets.append({"figure": f"{fmt}parquet MB/s, {_workers(most)}, worker processes",
                                "value": ordered[v][most]["MB/s"],
                                "ratio": float(ordered[v][most]["MB/s"]) / float(threads[v]["MB/s"]),
                                "against": f"threads only, {_workers(most)}", "load": threads[v]["load"]})
            for w, row in (csv_rows[v].items() if csv_rows else ()):
                targets.append({"figure": f"{fmt}CSV MB/s of text, {_workers(w)}", "value": row["MB/s"],
                                "ratio": float(row["MB/s"]) / float(csv_one["MB/s"]) if csv_one else "",
                                "against": base_name, "load": row["load"]})
            if v in shuffled:
                sh, base = shuffled[v], ordered[v][most]
                targets.append({"figure": f"{fmt}--shuffle MB/s, {_workers(most)}", "value": sh["MB/s"],
                                "ratio": float(sh["MB/s"]) / float(base["MB/s"]),
                                "against": f"device order, {_workers(most)}", "load": sh["load"]})
                targets.append({"figure": f"{fmt}--shuffle MB/CPU s, {_workers(most)}",
                                "value": sh["MB/CPU s"],
                                "ratio": float(sh["MB/CPU s"]) / float(base["MB/CPU s"]),
                                "against": f"device order, {_workers(most)}", "load": sh["load"]})
                # why --shuffle costs what it does: each of its passes against a whole ordered conversion
                for k, name in enumerate(("pass 1 (read, code, spill)", "pass 2 (load, permute, write)")):
                    targets.append({"figure": f"{fmt}--shuffle {name} CPU s", "value": sh["pass CPU s"][k],
                                    "ratio": float(sh["pass CPU s"][k]) / float(base["CPU s"]),
                                    "against": f"device order's CPU s, {_workers(most)}", "load": ""})
                targets.append({"figure": f"{fmt}shuffled store size", "value": sh["store MB"],
                                "ratio": sh["store/parquet"], "against": "the Parquet source", "load": ""})
            base = ordered[v][most]
            targets.append({"figure": f"{fmt}ordered store size", "value": base["store MB"],
                            "ratio": base["store/parquet"], "against": "the Parquet source", "load": ""})
        print()
        print(table(targets))
        if args.json:
            with open(args.json, "w") as handle:
                every = [row for done in runs.values() for row in done]
                results = {"runs": rows, "all_runs": every, "targets": targets}
                json.dump(results, handle, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
