"""``birdzarr demo``: generated raw data in both formats, converted, summarised."""

from __future__ import annotations

import os
import shutil

from birdzarr import _synthetic
from birdzarr._summary import format_summary, summary
from birdzarr.convert import convert


def run_demo(directory: str, *, windows: int = 200_000) -> int:
    parquet_dir = os.path.join(directory, "raw_parquet")
    csv_dir = os.path.join(directory, "raw_csv")
    for path in (parquet_dir, csv_dir):
        shutil.rmtree(path, ignore_errors=True)
    print(f"generating {windows:,} windows as per-device Parquet in {parquet_dir} ...")
    _synthetic.make_parquet_dir(parquet_dir, n_devices=24, total_windows=windows, seed=1)
    print(f"generating raw CSV exports (4 devices) in {csv_dir} ...")
    _synthetic.make_csv_dir(csv_dir, n_devices=4, bursts_per_device=400, parts=3, seed=1)
    for source, name in ((parquet_dir, "from_parquet.zarr"), (csv_dir, "from_csv.zarr")):
        store = convert(source, os.path.join(directory, name), overwrite=True)
        print()
        print(format_summary(summary(store)))
    print(
        f"\nnext: birdzarr info {os.path.join(directory, 'from_parquet.zarr')} --json, or in Python "
        f"birdzarr.open_store({os.path.join(directory, 'from_parquet.zarr')!r})"
    )
    return 0
