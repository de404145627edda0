"""One row per window: device, burst time, label and per-channel summaries of its 20 samples."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from birdzarr._errors import WindowIndexError
from birdzarr.format._spec import CHANNELS, GIMU

if TYPE_CHECKING:
    import pandas as pd

    from birdzarr.explore._protocol import ReadableStore as Store

SUMMARIES = ("mean", "std", "min", "max")


def _indices(windows: Any, n: int) -> np.ndarray:
    """Global window indices from what ``store.windows[...]`` accepts (None: every window)."""
    if windows is None:
        return np.arange(n, dtype=np.int64)
    if isinstance(windows, slice):
        return np.arange(*windows.indices(n), dtype=np.int64)
    given = np.asarray(windows)
    if given.ndim == 0 and given.dtype.kind in "iu":
        given = given.reshape(1)
    if given.dtype.kind == "b" and given.shape == (n,):
        return np.flatnonzero(given).astype(np.int64)
    if given.dtype.kind not in "iu" or given.ndim != 1:
        raise TypeError(f"windows must be None, an integer, a slice, integers or a mask of all {n} "
                        f"windows, not {type(windows).__name__} {given.dtype}")
    indices = np.where(given < 0, given + n, given).astype(np.int64)
    if len(indices) and (indices.min() < 0 or indices.max() >= n):
        raise WindowIndexError(f"a window index is out of range: the store holds {n} windows")
    return indices


def window_table(store: Store, windows: Any = None) -> pd.DataFrame:
    """The table of ``windows`` (default every window; an index, slice, index array or mask).

    Indexed by the global window index (``window``); columns ``device``, ``time``
    (datetime64[s], NaT where unknown), ``label`` and, for each channel, ``<channel>_mean``,
    ``_std``, ``_min`` and ``_max`` over its 20 samples (float32, stored units).
    """
    import pandas as pd

    n = len(store)
    indices = _indices(windows, n)
    reader = store.reader
    cw = store.chunk_windows
    summaries = np.empty((len(indices), len(CHANNELS), len(SUMMARIES)), dtype=np.float32)
    chunk_of = indices // cw
    order = np.argsort(chunk_of, kind="stable")
    bounds = np.flatnonzero(np.diff(chunk_of[order])) + 1
    for group in np.split(order, bounds):  # each touched chunk read once, one in memory
        if not len(group):
            continue
        chunk = int(chunk_of[group[0]])
        values = reader.read(GIMU, chunk)[indices[group] - chunk * cw].astype(np.float64)
        summaries[group, :, 0] = values.mean(axis=1)
        summaries[group, :, 1] = values.std(axis=1)
        summaries[group, :, 2] = values.min(axis=1)
        summaries[group, :, 3] = values.max(axis=1)
    whole = windows is None or (isinstance(windows, slice) and len(indices) == n)
    picked = slice(None) if whole else indices
    times = store.timestamps[picked]
    columns: dict[str, Any] = {
        "device": store.window_devices[picked],
        "time": times.view("datetime64[s]"),  # TIMESTAMP_UNKNOWN (int64 min) is NaT
        "label": store.labels[picked],
    }
    for c, channel in enumerate(CHANNELS):
        for k, what in enumerate(SUMMARIES):
            columns[f"{channel}_{what}"] = summaries[:, c, k]
    return pd.DataFrame(columns, index=pd.Index(indices, name="window"))
