"""birdzarr: millions of small sensor windows in one chunked Zarr v3 store, fed to PyTorch fast.

Public API (everything else is private and may change)::

    birdzarr.convert(source, dest, **options)   # CSV exports or per-device Parquet -> store
    birdzarr.append(store, source, **options)   # new devices or parts, committed atomically
    birdzarr.open_store(url) -> Store            # read-only handle for notebooks and scripts
    birdzarr.WindowDataset(url, batch_size=...)  # batches redrawn every epoch, for torch
    birdzarr.verify(url) / repair(url) / copy(src, dest)   # keeping stores sound
    birdzarr.subset(src, dest, labelled_only=True)  # a selection written once as its own store
    birdzarr.generate_demo(directory)            # generated CSV exports to try it on

The package is layered; each layer imports only the ones below it, at run time, lazily or for
typing (tests/test_layers.py): ``format`` (the spec, codecs) < ``storage`` (locations, cache,
lock) < ``store`` (the read-only handle, chunk reading) < ``explore`` (summaries, views, plots,
statistics: functions over the handle's read interface, attached to ``Store`` as methods below)
< ``convert`` < ``maintenance`` (verify, repair, copy) < ``loader`` (the torch dataset) <
``demo`` < this module < ``cli``.

Only ``birdzarr.WindowDataset`` needs PyTorch (the ``torch`` extra); everything else works
without it.
"""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING, Any

from birdzarr import explore as _explore
from birdzarr._errors import (
    AppendError,
    ArgumentError,
    BadInputError,
    BirdzarrError,
    BirdzarrWarning,
    ChecksumMismatchError,
    ChunkFetchError,
    CorruptChunkError,
    DestinationError,
    DeviceNotFoundError,
    DuplicateWindowsWarning,
    FallbackWarning,
    FormatVersionError,
    IgnoredColumnsWarning,
    IncompleteStoreError,
    MissingChunkError,
    MissingDependencyError,
    NotAStoreError,
    ReadOnlyLocationError,
    ResidentMemoryError,
    SamplingError,
    SchedulerError,
    SkippedFilesWarning,
    StorageError,
    StoreAccessError,
    StoreExistsError,
    StoreLockedError,
    StoreNotFoundError,
    TransferError,
    UnknownProtocolError,
    WindowIndexError,
    warn_renamed,
)
from birdzarr._version import __version__
from birdzarr.convert import append, convert
from birdzarr.convert._append import AppendResult
from birdzarr.explore import StoreStats
from birdzarr.format._spec import (
    CHANNELS,
    FORMAT_VERSION,
    TIMESTAMP_UNKNOWN,
    Curation,
    DeviceEntry,
    DeviceReport,
)
from birdzarr.maintenance._copy import CopyResult
from birdzarr.maintenance._copy import copy_store as copy
from birdzarr.maintenance._repair import RepairResult, repair
from birdzarr.maintenance._subset import subset
from birdzarr.maintenance._verify import VerifyResult, verify
from birdzarr.storage._cache import ChunkCache, attach_cache
from birdzarr.store._handle import Store, WindowsView, open_store

if TYPE_CHECKING:  # imported on first use (``__getattr__`` below); named here for typing and the docs
    from birdzarr.loader._config import LoaderConfig
    from birdzarr.loader._dataset import WindowDataset
    from birdzarr.loader._sampling import EpochPlan
    from birdzarr.store._selection import SelectionStats

_explore.attach(Store)  # store.to_xarray(), .plot_window(), .plot_device(), .stats(), the summaries

_TORCH_HINT = (
    "PyTorch is not installed. Install it first the way your machine needs (for a GPU, the command "
    "pytorch.org gives for your CUDA version; the CPU build: pip install torch), then: "
    'pip install "birdzarr[torch]"'
)

__all__ = [
    "CHANNELS",
    "FORMAT_VERSION",
    "TIMESTAMP_UNKNOWN",
    "AppendError",
    "AppendResult",
    "ArgumentError",
    "BadInputError",
    "BirdzarrError",
    "BirdzarrWarning",
    "ChecksumMismatchError",
    "ChunkCache",
    "ChunkFetchError",
    "CopyResult",
    "CorruptChunkError",
    "Curation",
    "DestinationError",
    "DeviceEntry",
    "DeviceNotFoundError",
    "DeviceReport",
    "DuplicateWindowsWarning",
    "EpochPlan",
    "FallbackWarning",
    "FormatVersionError",
    "IgnoredColumnsWarning",
    "SkippedFilesWarning",
    "IncompleteStoreError",
    "LoaderConfig",
    "MissingChunkError",
    "MissingDependencyError",
    "NotAStoreError",
    "ReadOnlyLocationError",
    "RepairResult",
    "ResidentMemoryError",
    "SamplingError",
    "SchedulerError",
    "SelectionStats",
    "StorageError",
    "Store",
    "StoreAccessError",
    "StoreExistsError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StoreStats",
    "TransferError",
    "UnknownProtocolError",
    "VerifyResult",
    "WindowDataset",
    "WindowIndexError",
    "WindowsView",
    "__version__",
    "append",
    "attach_cache",
    "convert",
    "copy",
    "generate_demo",
    "open_store",
    "repair",
    "subset",
    "verify",
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
    from birdzarr.demo._synthetic import make_csv_dir

    make_csv_dir(directory, n_devices=devices, bursts_per_device=bursts_per_device, parts=parts, seed=seed)
    return pathlib.Path(directory)


# what the loader hands out, imported from it on first use (the loader's modules are not imported
# by `import birdzarr`; those that need torch say so)
_LOADER_NAMES = {
    "WindowDataset": "birdzarr.loader._dataset",
    "LoaderConfig": "birdzarr.loader._config",
    "EpochPlan": "birdzarr.loader._sampling",
    "SelectionStats": "birdzarr.store._selection",
}
_RENAMED = {"RepairReport": "RepairResult"}  # old name -> new, kept for one release


def __getattr__(name: str) -> Any:
    # torch is imported only when the dataset is first used, so conversion and exploration
    # never pay for it.
    if name in _LOADER_NAMES:
        import importlib

        try:
            module = importlib.import_module(_LOADER_NAMES[name])
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] != "torch":
                raise
            raise MissingDependencyError(f"birdzarr.{name} needs torch: {_TORCH_HINT}") from exc
        return getattr(module, name)
    if name in _RENAMED:
        warn_renamed(f"birdzarr.{name}", f"birdzarr.{_RENAMED[name]}")
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'birdzarr' has no attribute {name!r}")
