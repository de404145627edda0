"""birdzarr: millions of small sensor windows in one chunked Zarr v3 store, fed to PyTorch fast.

Public API (everything else is private and may change)::

    birdzarr.convert(source, dest, **options)   # CSV exports or per-device Parquet -> store
    birdzarr.append(store, source, **options)   # new devices or parts, committed atomically
    birdzarr.open_store(url) -> Store            # read-only handle for notebooks and scripts
    birdzarr.WindowDataset(url, batch_size=...)  # shuffled batches for torch DataLoader
    birdzarr.generate_demo(directory)            # generated CSV exports to try it on
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

__version__ = "0.1.0"

from birdzarr._errors import (  # noqa: E402
    AppendError,
    BadInputError,
    BirdzarrError,
    ChecksumMismatchError,
    FormatVersionError,
    IncompleteStoreError,
    MissingChunkError,
    MissingDependencyError,
    NotAStoreError,
    ResidentMemoryError,
    SamplingError,
    StoreAccessError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
)
from birdzarr._format import CHANNELS, FORMAT_VERSION, TIMESTAMP_UNKNOWN, Curation  # noqa: E402
from birdzarr._store import Store, open_store  # noqa: E402
from birdzarr.convert import append, convert  # noqa: E402

__all__ = [
    "CHANNELS",
    "FORMAT_VERSION",
    "TIMESTAMP_UNKNOWN",
    "AppendError",
    "BadInputError",
    "BirdzarrError",
    "ChecksumMismatchError",
    "Curation",
    "FormatVersionError",
    "IncompleteStoreError",
    "MissingChunkError",
    "MissingDependencyError",
    "NotAStoreError",
    "ResidentMemoryError",
    "SamplingError",
    "Store",
    "StoreAccessError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreNotFoundError",
    "WindowDataset",
    "__version__",
    "append",
    "convert",
    "generate_demo",
    "open_store",
]


def generate_demo(
    directory: str | os.PathLike[str], *, devices: int = 4, bursts_per_device: int = 500, parts: int = 3,
    seed: int = 0,
) -> pathlib.Path:
    """Write generated tracker exports to ``directory`` (created) for trying birdzarr; returns it.

    The files look like a tracker's CSV export: ``{device}_{part}.csv`` parts, labelled rows in
    bursts with burst times, a few rows too fast for the curation to keep. The values are
    synthetic (calibrated 12-bit counts), for examples and notebooks, not for science.
    ``birdzarr.convert(directory, "demo.zarr")`` makes a store of them.
    """
    from birdzarr._synthetic import make_csv_dir

    make_csv_dir(directory, n_devices=devices, bursts_per_device=bursts_per_device, parts=parts, seed=seed)
    return pathlib.Path(directory)


def __getattr__(name: str) -> Any:
    # torch is imported only when the dataset is first used, so conversion and exploration
    # never pay for it.
    if name == "WindowDataset":
        from birdzarr.read._torch import WindowDataset

        return WindowDataset
    raise AttributeError(f"module 'birdzarr' has no attribute {name!r}")
