"""``birdzarr demo``: generated raw data in both formats, converted, summarised, then
two shuffled epochs read the two ways that train well."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from birdzarr._errors import BadInputError
from birdzarr.convert import convert
from birdzarr.demo import _synthetic
from birdzarr.store._summary import format_summary, summary

MARKER = ".birdzarr-demo"  # a directory holding it was made by the demo, and only its files are replaced


MIN_WINDOWS = 1_000  # the generated Parquet data's 24 devices need a few dozen windows each


def run_demo(directory: str, *, windows: int = 200_000) -> int:
    if windows < MIN_WINDOWS:
        raise BadInputError(f"--windows {windows}: the demo generates at least {MIN_WINDOWS:,} windows "
                            f"(24 devices); give {MIN_WINDOWS:,} or more (default 200,000)")
    if "://" in directory or "::" in directory:
        raise BadInputError(f"{directory}: the demo writes its raw files and stores into a local "
                            "directory; give a path, e.g. birdzarr demo ./demo")
    _claim(directory)
    parquet_dir = os.path.join(directory, "raw_parquet")
    csv_dir = os.path.join(directory, "raw_csv")
    for path in (parquet_dir, csv_dir):
        shutil.rmtree(path, ignore_errors=True)  # the demo's own generated data (see _claim)
    print(f"generating {windows:,} windows as per-device Parquet in {parquet_dir} ...")
    _synthetic.make_parquet_dir(parquet_dir, n_devices=24, total_windows=windows, seed=1)
    print(f"generating raw CSV exports (4 devices) in {csv_dir} ...")
    _synthetic.make_csv_dir(csv_dir, n_devices=4, bursts_per_device=400, parts=3, seed=1)
    # device order (for exploration) from each format, and the training layout (--shuffle)
    stores: list[tuple[str, str, dict[str, Any]]] = [
        (parquet_dir, "from_parquet.zarr", {}), (csv_dir, "from_csv.zarr", {}),
        (parquet_dir, "train.zarr", {"shuffle": True, "seed": 1}),
    ]
    for source, name, options in stores:
        store = convert(source, os.path.join(directory, name), overwrite=True, **options)
        print()
        print(format_summary(summary(store)))
    _train_epoch(os.path.join(directory, "train.zarr"))
    print(
        f"\nnext: train on it, `python examples/train.py {os.path.join(directory, 'train.zarr')} "
        f"--epochs 2 --checkpoint ckpt.pt`; look at it, `birdzarr info "
        f"{os.path.join(directory, 'from_parquet.zarr')} --devices` (docs/quickstart.md)"
    )
    return 0


def _claim(directory: str) -> None:
    """Use ``directory`` for the demo only if it is new, empty or an earlier demo's: the demo
    replaces its own generated files and stores there, never anything of the user's."""
    if os.path.isdir(directory) and os.listdir(directory) and not os.path.exists(
        os.path.join(directory, MARKER)
    ):
        raise BadInputError(
            f"{directory}: exists and holds files the demo did not make; the demo writes into a new "
            "or empty directory (or one of its own). Choose another: birdzarr demo ./demo"
        )
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise BadInputError(f"{directory}: is a file; give the demo a directory to create.")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, MARKER), "w") as marker:
        marker.write("made by `birdzarr demo`; the demo may replace the files in this directory\n")


def _train_epoch(dest: str) -> None:
    """Read two shuffled epochs the two ways that train well, the store converted with --shuffle
    (``dest``, streamed) and the device-ordered store held in memory (resident='cpu'), and print
    the shuffle-quality figures of each (docs/training.md#shuffle-quality)."""
    import numpy as np

    try:
        from birdzarr.loader._dataset import WindowDataset  # torch only when the demo gets here
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torch":
            raise
        print('\ntraining reads skipped: PyTorch is not installed (pip install "birdzarr[torch]")')
        return
    from birdzarr.loader._quality import pair_cooccurrence_ratio, quality_ratio, repeated_batch_fraction
    from birdzarr.store._handle import open_store

    device_ordered = os.path.join(os.path.dirname(dest), "from_parquet.zarr")
    table = open_store(dest).device_table
    devices = np.asarray([e.device_id for e in table])
    counts = np.asarray([e.n_windows for e in table])
    n_windows = int(counts.sum())
    print("\ntraining reads (a demo on a small store, not a benchmark: see docs/benchmarks.md)")
    cases: list[tuple[str, str, dict[str, object]]] = [
        (dest, "converted with --shuffle, streamed", {}),
        (device_ordered, "device order, resident='cpu'", {"resident": "cpu", "progress": False}),
    ]
    for path, layout, options in cases:
        dataset = WindowDataset(path, batch_size=8192, shuffle=True, seed=1234, with_ldt=True,
                                **options)  # type: ignore[arg-type]
        epochs, seconds = [], 0.0
        for epoch in (0, 1):
            dataset.set_epoch(epoch)
            started = time.perf_counter()
            batch_devices = [ldt[:, 1].numpy().copy() for _, ldt in dataset]
            seconds = time.perf_counter() - started
            epochs.append([dataset.batch_indices(b) for b in range(len(dataset))])
        windows = sum(len(b) for b in epochs[1])
        print(
            f"  {path} ({layout}): {len(epochs[1])} batches, {windows / seconds / 1e6:.2f} M windows/s; "
            f"device mix {quality_ratio(batch_devices, devices, counts):.2f}, "
            f"repeated batches {100 * repeated_batch_fraction(epochs[0], epochs[1]):.0f}%, "
            f"pair co-occurrence {pair_cooccurrence_ratio(epochs[0], epochs[1], n_windows):.1f} "
            "(1.0, 0% and 1.0 = a fresh uniform shuffle every epoch)"
        )
