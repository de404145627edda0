"""Exploration of a store: summaries, a lazy xarray view, plots and statistics.

This layer sits above the read-only store handle: its functions take anything with the store's
read interface (``ReadableStore``, which ``birdzarr.Store`` satisfies), and ``birdzarr/store/``
never imports it (tests/test_layers.py). ``import birdzarr`` attaches them to ``birdzarr.Store``
as methods, the way pandas and xarray attach ``.plot`` above their core, so both spellings work::

    birdzarr.explore.plot_device(store, 207)   # the function
    store.plot_device(207)                     # the same, as a method

matplotlib and xarray are imported only when a feature needs them (the ``explore`` extra), so
opening a store or training never pays for them; without them, plots and the xarray view raise
``MissingDependencyError`` naming the extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from birdzarr.explore._protocol import ReadableStore
from birdzarr.explore._stats import DEFAULT_BINS, StoreStats, save_stats, store_stats

if TYPE_CHECKING:
    import pandas as pd
    import xarray as xr
    from matplotlib.figure import Figure

__all__ = [
    "ReadableStore", "StoreStats", "plot_device", "plot_window", "save_stats", "stats", "to_xarray",
    "window_table",
]


def to_xarray(store: ReadableStore) -> xr.Dataset:
    """A lazy ``xarray.Dataset``: ``gimu(window, sample, channel)`` with coordinates ``window``
    (the global window index, kept through ``isel``: ``ds.isel(window=store.device_indices(207))``
    numbers its windows as the store does), ``device``, ``time`` (the burst start, datetime64,
    NaT when unknown), ``label`` and ``channel``.
    Nothing is read until values are asked for; then only the chunks holding them.
    ``ds.sel(time=...)`` selects by burst time (a date string means its whole day or month;
    slices include both ends), reading the timestamps on the first selection.
    ``to_dataframe()`` indexes its rows by ``window`` and ``time`` (then ``sample``, ``channel``)."""
    from birdzarr.explore._xarray import to_xarray as build

    return build(store)


def window_table(store: ReadableStore, windows: Any = None) -> pd.DataFrame:
    """A pandas DataFrame with one row per window: ``device``, ``time`` (the burst start,
    datetime64[s], NaT when unknown), ``label`` and, for each channel, the ``mean``, ``std``
    (ddof=0), ``min`` and ``max`` of its 20 samples (columns ``imu_x_mean`` ... ``gps_speed_max``,
    float32, in stored units like ``stats``: gps_speed times ``gps_scale`` is m/s).

    ``windows`` picks the rows as ``store.windows[...]`` does: every window (the default), a
    slice, global indices (``store.device_indices(207)``) or a mask of all windows. The index
    is the global window index, named ``window`` (as in ``to_xarray``), in the order given.
    Each chunk holding a picked window is read once, one chunk at a time; the table takes 88
    bytes a row, index included.
    """
    from birdzarr.explore._table import window_table as build

    return build(store, windows)


def plot_window(store: ReadableStore, index: int, *, label_names: Mapping[int, str] | None = None) -> Figure:
    """A matplotlib Figure of window ``index``: imu x/y/z (g) and GPS speed (m/s) over its 20
    samples. ``label_names`` maps label ids to names for the title (``{3: "flying"}``)."""
    from birdzarr.explore._plots import plot_window as draw

    return draw(store, index, label_names=label_names)


def plot_device(
    store: ReadableStore, device_id: int, max_windows: int = 500, *,
    label_names: Mapping[int, str] | None = None,
) -> Figure:
    """A matplotlib Figure of one device over time: each channel's per-window mean coloured by
    label and its min..max, for at most ``max_windows`` windows spread evenly over the device's
    windows in time order (first and last burst included, on a shuffled store too).

    The x axis is the burst time, or the global window index when the source has no
    timestamps (a random order on a shuffled store; the axis label says so).
    ``label_names`` maps label ids to names for the legend (``{3: "flying"}``)."""
    from birdzarr.explore._plots import plot_device as draw

    return draw(store, device_id, max_windows=max_windows, label_names=label_names)


def stats(
    store: ReadableStore, *, bins: int = DEFAULT_BINS, cache: bool = True, persist: bool = True,
    progress: bool = True,
) -> StoreStats:
    """Per-channel count, mean, std, min, max and histograms over all committed windows.

    Computed chunk by chunk (one chunk in memory), with a progress bar unless
    ``progress=False``. Reused while the store holds the same commit: from memory, else from
    this machine's statistics cache, else from the store's ``stats`` group if someone saved
    them there (``birdzarr stats STORE --save``). ``cache=False`` forces a recomputation.
    Never writes to the store: a computed result is kept in memory and, unless
    ``persist=False``, in the local cache (``$BIRDZARR_CACHE_DIR/stats``, default
    ``~/.cache/birdzarr/stats``; docs/exploration.md#statistics).
    """
    return store_stats(store, bins=bins, cache=cache, persist=persist, progress=progress)


def _repr(store: ReadableStore) -> str:
    from birdzarr.explore._html import text_repr

    return text_repr(store)


def _repr_html(store: ReadableStore) -> str:
    from birdzarr.explore._html import html_repr

    return html_repr(store)


_METHODS: dict[str, Any] = {
    "__repr__": _repr,
    "_repr_html_": _repr_html,  # Jupyter's rich display
    "to_xarray": to_xarray,
    "plot_window": plot_window,
    "plot_device": plot_device,
    "stats": stats,
    "window_table": window_table,
}


def attach(cls: type[ReadableStore]) -> None:
    """Make the exploration functions methods of ``cls`` (``birdzarr/__init__.py`` does it for
    ``birdzarr.Store``): ``store.plot_device(207)`` is ``plot_device(store, 207)``."""
    for name, function in _METHODS.items():
        setattr(cls, name, function)
