"""``birdzarr demo``: generated raw data in both formats, converted, summarised, then one
shuffled training epoch read from the device-ordered and from a pre-shuffled store."""

from __future__ import annotations

import os
import shutil
import time

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
    _train_epoch(parquet_dir, os.path.join(directory, "train.zarr"))
    print(
        f"\nnext: birdzarr info {os.path.join(directory, 'from_parquet.zarr')} --json, or in Python "
        f"birdzarr.open_store({os.path.join(directory, 'from_parquet.zarr')!r})"
    )
    return 0


def _train_epoch(source: str, dest: str) -> None:
    """Read one shuffled epoch of batches from the device-ordered store and from a pre-shuffled
    conversion (the training layout), and show how well each mixes devices."""
    import warnings

    import numpy as np

    from birdzarr._store import open_store
    from birdzarr.read._quality import quality_ratio
    from birdzarr.read._torch import WindowDataset  # torch only when the demo gets here

    device_ordered = os.path.join(os.path.dirname(dest), "from_parquet.zarr")
    convert(source, dest, overwrite=True, shuffle=True, seed=1, progress=False)
    table = open_store(dest).device_table
    devices = np.asarray([e.device_id for e in table])
    counts = np.asarray([e.n_windows for e in table])
    print()
    for path, layout in ((device_ordered, "device order"), (dest, "converted with --shuffle")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the device-order warning is what this line shows
            dataset = WindowDataset(path, batch_size=8192, shuffle=True, seed=1234, with_ldt=True)
        started = time.perf_counter()
        windows, batch_devices = 0, []
        for x, ldt in dataset:
            windows += len(x)
            batch_devices.append(ldt[:, 1].numpy().copy())
        seconds = time.perf_counter() - started
        mixed = np.mean([len(np.unique(b)) for b in batch_devices])
        print(
            f"training read  {path} ({layout}): one epoch of {len(dataset)} batches, "
            f"{windows:,} windows in {seconds:.2f} s ({windows / seconds / 1e6:.2f} M windows/s); "
            f"{mixed:.1f} of {len(devices)} devices per batch, shuffle quality "
            f"{quality_ratio(batch_devices, devices, counts):.2f} (1.0 = a full shuffle)"
        )
    print("  -> train on stores converted with --shuffle (docs/training.md#shuffle-quality)")
