"""Conversion benchmark: realistic per-device Parquet -> store; MB/s, ratio, peak memory.

    python benchmarks/convert.py                       # 186 devices, 2.5 M windows, + memory test
    python benchmarks/convert.py --windows 300000      # quicker

Generated data goes to --workdir (default: a temporary directory) and is removed at the end
unless --keep is given. Each conversion runs in its own process so its peak RSS (whole process
tree, sampled every 50 ms) is its own. MB/s counts float32 window bytes (320 per window).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _util import children_cpu, dir_bytes, machine, run_measured, table  # noqa: E402

from birdzarr import _synthetic  # noqa: E402

WINDOW_BYTES = 320


def make_parquet(directory: str, sizes: dict[int, int], *, seed: int) -> None:
    """Write one file per device, generated piecewise so the generator's memory stays small."""
    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, ".complete")
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


def convert_measured(source: str, dest: str, *extra: str) -> dict[str, float]:
    cli = "import sys; from birdzarr.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", cli, "convert", source, dest, "--overwrite", "--quiet", *extra]
    cpu_before, load = children_cpu(), os.getloadavg()[0]
    wall, peak, _ = run_measured(argv)
    cpu = children_cpu() - cpu_before
    import birdzarr

    store = birdzarr.open_store(dest)
    seconds = float(store.meta["report"]["seconds"])
    raw = len(store) * WINDOW_BYTES
    stored = dir_bytes(dest)
    parquet = sum(
        os.path.getsize(os.path.join(source, f)) for f in os.listdir(source) if f.endswith(".parquet")
    )
    return {
        "windows": len(store),
        "seconds": seconds,
        "wall_s": wall,
        "MB/s": raw / seconds / 1e6,
        "CPU s": cpu,
        "MB per CPU s": raw / cpu / 1e6,
        "load": load,
        "raw MB": raw / 1e6,
        "parquet MB": parquet / 1e6,
        "store MB": stored / 1e6,
        "ratio vs float32": raw / stored,
        "store/parquet": stored / parquet,
        "peak RSS MB": peak / 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--windows", type=int, default=2_500_000)
    parser.add_argument(
        "--device-sizes",
        type=int,
        nargs="+",
        default=[9_296, 150_000, 1_500_000],
        help="windows of the single-device conversions of the memory test",
    )
    parser.add_argument("--workers", type=int, nargs="*", default=[0], help="0 = default (all cores)")
    parser.add_argument("--skip-memory", action="store_true", help="skip the big-vs-small device test")
    parser.add_argument("--skip-shuffle", action="store_true", help="skip the --shuffle conversion")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the generated data and stores")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    workdir = args.workdir or tempfile.mkdtemp(prefix="birdzarr-bench-convert-")
    os.makedirs(workdir, exist_ok=True)
    results: dict[str, list[dict[str, object]]] = {"corpus": [], "memory": []}
    try:
        print(f"# {machine()}; workdir {workdir}")
        ids = _synthetic.device_ids(args.devices).tolist()
        sizes = _synthetic.device_sizes(args.devices, args.windows, seed=0).tolist()
        corpus = os.path.join(workdir, f"parquet_{args.devices}_{args.windows}")
        make_parquet(corpus, dict(zip(ids, sizes, strict=True)), seed=0)
        for workers in args.workers:
            extra = ["--workers", str(workers)] if workers else []
            row = {
                "input": f"{args.devices} devices",
                "workers": workers or "default",
                **convert_measured(corpus, os.path.join(workdir, "corpus.zarr"), *extra),
            }
            results["corpus"].append(row)
            print(table([row]), flush=True)
        if not args.skip_shuffle:
            row = {
                "input": f"{args.devices} devices, --shuffle",
                "workers": "default",
                **convert_measured(
                    corpus,
                    os.path.join(workdir, "shuffled.zarr"),
                    "--shuffle",
                    "--seed",
                    "1",
                    "--shuffle-tmp",
                    workdir,
                ),
            }
            results["corpus"].append(row)
            print(table([row]), flush=True)
        if not args.skip_memory:
            for size in args.device_sizes:
                name = "one device"
                source = os.path.join(workdir, f"one_{size}")
                make_parquet(source, {900 + size % 97: size}, seed=1)
                row = {
                    "input": f"{name} ({size:,} windows)",
                    **convert_measured(source, os.path.join(workdir, f"one_{size}.zarr")),
                }
                results["memory"].append(row)
                print(table([row]), flush=True)
        print()
        print(table(results["corpus"] + results["memory"]))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=2)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
