"""Partition files against per-device files: the same windows, three layouts, one store.

    python benchmarks/partitions.py                          # 3,000 devices x 35 windows, 30 files
    python benchmarks/partitions.py --devices 10000 --files 100 --repeat 3

Layouts: ``per_device`` (one ``{device}.parquet`` each), ``grouped`` (partition files of
consecutive devices, each device's rows together) and ``mixed`` (the same files with the rows of
their devices interleaved, each device's own rows in order). Each conversion runs in its own
process (``birdzarr convert --quiet --workers W``); its CPU seconds (user + system, from
``resource.getrusage``) and peak RSS (``VmHWM`` of ``/proc/self/status``: Linux) are that
process's. The stores are checked to hold the same
chunks. On a shared machine compare CPU seconds, not wall time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

_RUN = """
import json, resource, sys, time
from birdzarr.cli import main
started = time.perf_counter()
code = main(["convert", sys.argv[1], sys.argv[2], "--quiet", "--workers", sys.argv[3]])
usage = resource.getrusage(resource.RUSAGE_SELF)
# VmHWM: this process image's peak (ru_maxrss keeps the forking parent's peak across exec)
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(json.dumps({"code": code, "seconds": time.perf_counter() - started,
                  "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": peak / 1024}))
"""


def _gimu(windows: np.ndarray) -> pa.Array:
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)


def make(root: pathlib.Path, devices: int, per: int, files: int) -> None:
    from birdzarr.demo import _synthetic

    windows = _synthetic.curated_windows(devices * per, seed=1).reshape(devices, per, 80)
    (root / "per_device").mkdir(parents=True)
    for device in range(devices):
        path = root / "per_device" / f"{device + 1}.parquet"
        pq.write_table(pa.table({"gimu": _gimu(windows[device])}), path)
    rng = np.random.default_rng(0)
    for name in ("grouped", "mixed"):
        (root / name).mkdir()
        for number in range(files):
            ids = np.repeat(np.arange(number * devices // files, (number + 1) * devices // files), per)
            if name == "mixed":  # interleave the devices' rows; each device's rows stay in order
                ids = ids[rng.permutation(len(ids))]
            index = np.zeros(len(ids), dtype=np.int64)
            for device in np.unique(ids):
                index[ids == device] = np.arange(per)
            table = pa.table({"device_id": pa.array(ids + 1, pa.int32()), "gimu": _gimu(windows[ids, index])})
            pq.write_table(table, root / name / f"part-{number}.parquet")


def _chunks(store: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*"))
            if p.is_file() and p.name != "zarr.json" or p.parent != store and p.name == "zarr.json"}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=3000)
    parser.add_argument("--windows-per-device", type=int, default=35)
    parser.add_argument("--files", type=int, default=30)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        make(root, args.devices, args.windows_per_device, args.files)
        runs: dict[str, list[dict[str, float]]] = {"per_device": [], "grouped": [], "mixed": []}
        for round_ in range(args.repeat):
            for layout, results in runs.items():
                dest = root / f"{layout}-{round_}.zarr"
                command = [sys.executable, "-c", _RUN, str(root / layout), str(dest), str(args.workers)]
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                assert result["code"] == 0, out.stderr
                results.append(result)
        reference = _chunks(root / "per_device-0.zarr")
        for layout in ("grouped", "mixed"):
            assert _chunks(root / f"{layout}-0.zarr") == reference, f"{layout}: another store"
    print(f"{args.devices:,} devices x {args.windows_per_device} windows, {args.files} partition files, "
          f"--workers {args.workers}, median of {args.repeat}; stores identical (chunks, array metadata)")
    print("| layout | wall s | CPU s | peak RSS MB |\n|---|---|---|---|")
    for layout, results in runs.items():
        median = {k: statistics.median(r[k] for r in results) for k in ("seconds", "cpu", "rss_mb")}
        print(f"| {layout} | {median['seconds']:.2f} | {median['cpu']:.2f} | {median['rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
