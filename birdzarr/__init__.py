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
from birdzarr.maintenance._verify import VerifyResult, verify
from birdzarr.storage._cache import ChunkCache, attach_cache
from birdzarr.store._handle import Store, WindowsView, open_store

if TYPE_CHECKING:  # imported on first use (``__getattr__`` below); named here for typing and the docs
    from collections.abc import Iterable

    from birdzarr.loader._config import LoaderConfig
    from birdzarr.loader._dataset import WindowDataset
    from birdzarr.loader._sampling import EpochPlan
    from birdzarr.loader._selection import SelectionStats
    from birdzarr.storage._location import StoreLike

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


def subset(
    source: StoreLike,
    destination: StoreLike,
    *,
    devices: Iterable[int] | None = None,
    exclude_devices: Iterable[int] | None = None,
    split: str | None = None,
    split_by: str = "device",
    val_fraction: float = 0.1,
    split_seed: int = 0,
    labelled_only: bool = False,
    labels: Iterable[int] | None = None,
    start: Any = None,
    stop: Any = None,
    overwrite: bool = False,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
    source_storage_options: dict[str, Any] | None = None,
) -> Store:
    """Write the windows a ``WindowDataset`` with the same selection options would deliver
    (``devices``, ``exclude_devices``, ``split``, ``split_by``, ``val_fraction``, ``split_seed``,
    ``labelled_only``, ``labels``, ``start``, ``stop``: the same meanings and rules) as a new
    store at ``destination``, and open it.

    Streaming a selection that keeps a small part of each chunk still fetches and decompresses
    every chunk; streaming its subset reads only the kept windows. Nothing is re-encoded: the
    windows' codes, dictionary rows and gps_speed are copied in the source's stored order and
    packed into chunks of the source's length, so the subset of a ``--shuffle`` store is itself
    shuffled (a uniform order) and streams without ``allow_device_order``. Its device table is
    computed from its windows (``birdzarr verify`` checks it), and its root attribute ``subset``
    records the source, its window count and commit generation, and the selection.

    The source must be a format-2 store. ``destination`` follows ``convert``'s rules: a new or
    empty location, or with ``overwrite=True`` a birdzarr store, replaced only once the subset has
    committed beside it; never inside the source. Memory is bounded: chunk by chunk, with the
    dictionaries and one bit per source window. ``storage_options``: fsspec options of the
    destination; ``source_storage_options``: those of the source.
    """
    # the loader's selection rules (no torch), imported on first use as the loader's names are
    from birdzarr._checks import require_bool, require_int
    from birdzarr.loader._selection import WindowFilter, make_selection, unix_seconds
    from birdzarr.maintenance._subset import ids, subset_store

    overwrite, progress = require_bool("overwrite", overwrite), require_bool("progress", progress)
    labelled_only = require_bool("labelled_only", labelled_only)
    split_seed = require_int("split_seed", split_seed, minimum=0)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise ArgumentError(f"val_fraction must be a number between 0 and 1, got {val_fraction!r}")
    first, end = unix_seconds("start", start), unix_seconds("stop", stop)
    if first is not None and end is not None and first >= end:
        raise ArgumentError(f"start must be before stop, got start={start!r} and stop={stop!r}")
    chosen, excluded = ids("devices", devices), ids("exclude_devices", exclude_devices)
    kept = ids("labels", labels)
    kept = None if kept is None else tuple(sorted(set(kept)))
    fraction = float(val_fraction)
    split_record = {"split_by": split_by, "val_fraction": fraction, "split_seed": split_seed}
    record = {
        "devices": None if chosen is None else sorted(set(chosen)),
        "exclude_devices": None if excluded is None else sorted(set(excluded)),
        "split": split, **{k: (v if split is not None else None) for k, v in split_record.items()},
        "labelled_only": labelled_only, "labels": None if kept is None else list(kept),
        "start": first, "stop": end,
    }

    def select(store: Store) -> Any:
        return make_selection(store.device_columns, reader=store.reader, shuffled_store=store.shuffled,
                              devices=chosen, exclude_devices=excluded, split=split, split_by=split_by,
                              val_fraction=fraction, split_seed=split_seed,
                              filters=WindowFilter(labelled_only, kept, first, end))

    return subset_store(source, destination, select, selection_record=record, overwrite=overwrite,
                        progress=progress, storage_options=storage_options,
                        source_storage_options=source_storage_options)


# what the loader hands out, imported from it on first use (the loader's modules are not imported
# by `import birdzarr`; those that need torch say so)
_LOADER_NAMES = {
    "WindowDataset": "birdzarr.loader._dataset",
    "LoaderConfig": "birdzarr.loader._config",
    "EpochPlan": "birdzarr.loader._sampling",
    "SelectionStats": "birdzarr.loader._selection",
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
