"""A lazy ``xarray.Dataset`` over a store, read through the store's own chunk reader.

Why not ``xr.open_zarr``: zarr-python returns fill values for a missing chunk (the store's reader
raises), it would see windows past the committed count during an append, and it shows a store's
arrays as stored: a format-1 store's ``gimu`` needs the ``birdzarr.dict16`` codec registered, and a
format-2 store holds uint16 codes and dictionaries, not windows. Reading through
``birdzarr.store._chunks.ChunkReader`` keeps these guarantees (``gimu`` is the decoded float32
windows on every format version, with the same coordinates and attributes) and counts every
request, on local disks and S3 alike.
Each variable is wrapped in xarray's lazy indexing: selecting windows reads only their chunks,
and nothing is read when the Dataset is built or displayed.

The 20 samples of a window are the dimension ``sample`` whatever the store calls it on disk
(stores written before the rename say ``time``), so ``time`` is only the burst-time coordinate.
It shares one index with the ``window`` coordinate (the global window index), ``WindowIndex``:
``ds.sel(time=...)`` works on it, although burst times are neither unique nor sorted (several
windows share a burst; a device-ordered store starts over at each device), the timestamps are
read on the first selection, not before, and ``to_dataframe()`` keeps both.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from birdzarr._errors import WindowIndexError
from birdzarr.explore._deps import require
from birdzarr.explore._units import gps_scale
from birdzarr.format._spec import (
    CHANNELS,
    DEVICE,
    GIMU,
    GIMU_DIMS,
    LABEL,
    N_CHANNELS,
    PER_WINDOW_DIMS,
    TIMESTAMP,
    WINDOW_LENGTH,
    array_attributes,
)

if TYPE_CHECKING:
    import xarray as xr

    from birdzarr.explore._protocol import ReadableStore as Store


_FEATURE = "store.to_xarray()"
# This module is imported only by Store.to_xarray(), so a missing xarray surfaces there, named.
_xarray = require("xarray", _FEATURE)
_backends = require("xarray.backends", _FEATURE)
_indexing = require("xarray.core.indexing", _FEATURE)
_indexes = require("xarray.core.indexes", _FEATURE)

TIME = "time"  # the burst-time coordinate of the view
WINDOW = "window"  # the window dimension and its coordinate, the global window index
CHANNEL = "channel"


class WindowArray(_backends.BackendArray):  # type: ignore[misc,name-defined]
    """One per-window array of the store (``gimu``, ``device``, ``timestamp``, ``label``).

    Defined at module level so a Dataset can be pickled (dask workers, multiprocessing).
    """

    def __init__(self, store: Store, name: str, dtype: np.dtype[Any]) -> None:
        self.store = store
        self.name = name
        self.dtype = dtype
        tail = (WINDOW_LENGTH, N_CHANNELS) if name == GIMU else ()
        self.shape = (len(store), *tail)

    def __getitem__(self, key: Any) -> Any:
        self._refuse_wrapped(key.tuple[0])
        # OUTER_1VECTOR: xarray hands us ints, slices and at most one integer array; a vector
        # of windows becomes one gather that reads each touched chunk once.
        return _indexing.explicit_indexing_adapter(
            key, self.shape, _indexing.IndexingSupport.OUTER_1VECTOR, self._read
        )

    def _refuse_wrapped(self, windows: Any) -> None:
        """Refuse a window index that is still negative when it reaches us.

        xarray's lazy indexing adds the length once to a negative index (``isel(window=-1)``
        arrives as ``len - 1``) and checks nothing, so a negative index here was below ``-len``;
        passed on, the store's view would add the length again and read a wrong window
        (``-5000`` of 2,605 windows gave window 210) where numpy raises ``IndexError``.
        """
        if isinstance(windows, slice):
            return
        n = self.shape[0]
        if np.ndim(windows) == 0:
            if int(windows) < 0:
                raise WindowIndexError(f"a window index is out of range: the store holds {n} windows")
            return
        given = np.asarray(windows)
        if given.dtype.kind in "iu" and given.size and int(given.min()) < 0:
            raise WindowIndexError(f"a window index is out of range: the store holds {n} windows")

    def _read(self, key: tuple[Any, ...]) -> np.ndarray:
        windows, rest = key[0], key[1:]
        data = self.store.array_view(self.name)[windows]
        if rest:
            data = data[rest] if isinstance(windows, (int, np.integer)) else data[(slice(None), *rest)]
        # int64 unix seconds with INT64_MIN for "unknown" is exactly datetime64[s] with NaT.
        return data.view(self.dtype) if self.name == TIMESTAMP else data


def _label_range(label: Any) -> tuple[np.datetime64, np.datetime64]:
    """The first and last instant a time label means, both included.

    A date string without a UTC offset covers its whole period, as in pandas: ``"2012-05"`` is the
    month, ``"2012-05-15"`` the day, ``"2012-05-15T10"`` the hour. Anything else (a full time,
    ``datetime``, ``np.datetime64``, a string with an offset) is one instant, converted to UTC.
    """
    import pandas as pd

    instant = pd.Timestamp(label)
    if instant is pd.NaT:
        raise KeyError(f"{label!r} is not a time")
    if instant.tzinfo is not None:
        instant = instant.tz_convert("UTC").tz_localize(None)
    elif isinstance(label, str):
        period = pd.Period(label)
        return np.datetime64(period.start_time.asm8, "ns"), np.datetime64(period.end_time.asm8, "ns")
    return np.datetime64(instant.asm8, "ns"), np.datetime64(instant.asm8, "ns")


def _positions(mask: np.ndarray) -> slice | np.ndarray:
    """Window positions of a mask; a contiguous run becomes a slice (a cheaper, basic index)."""
    hits = np.flatnonzero(mask)
    if len(hits) and hits[-1] - hits[0] == len(hits) - 1:
        return slice(int(hits[0]), int(hits[-1]) + 1)
    return hits


class WindowIndex(_xarray.Index):  # type: ignore[misc,name-defined]
    """The xarray index of the ``window`` dimension: the global window index and the burst time.

    One index over both per-window coordinates, so that both stay indexes and both reach
    ``to_dataframe()``: xarray leaves every indexed coordinate out of a DataFrame's columns and
    builds the rows' index from the dimensions' indexes, so this index gives the pandas index
    ``(window, time)`` (xarray issue #10851: an index on a coordinate that is not a dimension
    never reaches the frame). ``ds.to_dataframe()`` rows are then indexed by ``window``, ``time``,
    ``sample`` and ``channel``; ``reset_index()`` makes them columns.

    ``window`` selects as a pandas index (``ds.sel(window=[1000, 5])``, slices include both ends).
    Burst times repeat (every window of a burst) and are not sorted along ``window``, so a pandas
    index could only select exact times. ``time`` compares the times directly:

    - ``ds.sel(time="2012-05-15")``: every window of that day (strings mean their whole period);
    - ``ds.sel(time=slice("2012-05-15", "2012-05-16T12"))``: both ends included, any order of
      windows, unknown times (NaT) never selected;
    - ``ds.sel(time=np.datetime64(...))`` or a list of times: windows at exactly those times.

    A time selection always keeps the ``window`` dimension (a time matches any number of
    windows); a label that matches no window raises ``KeyError``, an empty slice gives zero
    windows. The times are read on the first ``sel`` by time or ``to_dataframe`` (8 bytes a window;
    of the selected windows only after an ``isel``), then kept. ``method=`` and ``tolerance=``
    apply to ``window`` only.
    """

    def __init__(self, window: Any, variable: Any, name: Hashable = TIME, *, store_windows: int) -> None:
        self.window = window  # xarray's PandasIndex of the global window indices
        self.variable = variable  # the lazy burst-time variable
        self.name = name
        self.store_windows = store_windows  # windows of the store (errors say whether a selection's)
        (self.dim,) = variable.dims
        self._times: np.ndarray | None = None

    @classmethod
    def from_variables(cls, variables: Mapping[Any, Any], *, options: Mapping[str, Any]) -> WindowIndex:
        import pandas as pd

        if set(variables) != {WINDOW, TIME}:
            raise ValueError(f"WindowIndex indexes the coordinates {WINDOW!r} and {TIME!r} together")
        time = variables[TIME]
        if time.ndim != 1 or not np.issubdtype(time.dtype, np.datetime64):
            raise ValueError(f"WindowIndex needs a 1-D datetime64 coordinate {TIME!r}")
        n = int(options.get("n_windows", time.shape[0]))
        window = _indexes.PandasIndex(pd.RangeIndex(n, name=WINDOW), WINDOW, coord_dtype=np.dtype(np.int64))
        return cls(window, time, store_windows=n)

    def times(self) -> np.ndarray:
        """The indexed times as datetime64, read once."""
        if self._times is None:
            self._times = np.asarray(self.variable.values)
        return self._times

    def create_variables(self, variables: Mapping[Any, Any] | None = None) -> dict[Hashable, Any]:
        created: dict[Hashable, Any] = dict(self.window.create_variables(
            {WINDOW: variables[WINDOW]} if variables is not None and WINDOW in variables else None))
        variable = self.variable
        if variables is not None and self.name in variables:
            variable = variable.copy(deep=False)
            variable.attrs = dict(variables[self.name].attrs)
        created[self.name] = variable
        return created

    def _subset(self, window: Any, key: Any) -> WindowIndex:
        variable = self.variable[{self.dim: key}]
        subset = type(self)(window, variable, self.name, store_windows=self.store_windows)
        if self._times is not None:
            subset._times = self._times[key]
        return subset

    def isel(self, indexers: Mapping[Any, Any]) -> WindowIndex | None:
        key = indexers[self.dim]
        if isinstance(key, _xarray.Variable):
            if key.dims != (self.dim,):
                return None  # vectorised indexing onto new dimensions: the index is dropped
            key = key.data
        self._refuse_out_of_range(key)
        if not isinstance(key, slice) and np.ndim(key) == 0:
            return None  # one window: the coordinates become scalars
        window = self.window.isel({self.dim: key})
        if window is None:
            return None
        return self._subset(window, key)

    def _refuse_out_of_range(self, key: Any) -> None:
        """An index past either end is refused as the store's view refuses it (xarray calls the
        index's isel before indexing the variables, where pandas would raise its own error)."""
        if isinstance(key, slice):
            return
        given = np.asarray(key)
        if given.dtype.kind not in "iu" or not given.size:
            return
        n = len(self.window.index)
        if int(given.min()) < -n or int(given.max()) >= n:
            holder = "the store holds" if n == self.store_windows else "this selection of the store holds"
            raise WindowIndexError(f"a window index is out of range: {holder} {n} windows")

    def sel(self, labels: dict[Any, Any], method: Any = None, tolerance: Any = None) -> Any:
        if WINDOW in labels and self.name in labels:
            raise NotImplementedError(f"select by {WINDOW} and by {self.name} in two calls: "
                                      f"ds.sel({WINDOW}=...).sel({self.name}=...)")
        if WINDOW in labels:
            return self.window.sel({WINDOW: labels[WINDOW]}, method=method, tolerance=tolerance)
        if method is not None or tolerance is not None:
            raise NotImplementedError(
                "the burst-time index selects exact times, date strings and slices; method= and "
                "tolerance= are not supported (burst times are not sorted)"
            )
        (label,) = labels.values()
        times = self.times()
        if isinstance(label, slice):
            if label.step is not None:
                raise NotImplementedError("a time slice with a step is not supported")
            mask = ~np.isnat(times)
            if label.start is not None:
                mask &= times >= _label_range(label.start)[0]
            if label.stop is not None:
                mask &= times <= _label_range(label.stop)[1]
        elif isinstance(label, str) or np.ndim(label) == 0:
            first, last = _label_range(label)
            mask = (times >= first) & (times <= last)
        else:
            wanted = np.asarray(label, dtype="datetime64[ns]")
            mask = np.isin(times.astype("datetime64[ns]"), wanted[~np.isnat(wanted)])
        if not isinstance(label, slice) and not mask.any():
            raise KeyError(f"no window has burst time {label!r}")
        return _xarray.IndexSelResult({self.dim: _positions(mask)})

    def equals(self, other: Any, **kwargs: Any) -> bool:
        if other is self:
            return True  # the common case (arrays of one Dataset): decided without reading
        if not isinstance(other, WindowIndex) or other.dim != self.dim:
            return False
        return bool(self.window.index.equals(other.window.index)
                    and np.array_equal(self.times(), other.times(), equal_nan=True))

    @classmethod
    def concat(cls, indexes: Any, dim: Hashable, positions: Any = None) -> WindowIndex:
        indexes = list(indexes)
        window = _indexes.PandasIndex.concat([i.window for i in indexes], dim, positions)
        variable = _xarray.Variable.concat([i.variable for i in indexes], dim, positions)
        return cls(window, variable, indexes[0].name, store_windows=indexes[0].store_windows)

    def to_pandas_index(self) -> Any:
        import pandas as pd

        times = pd.DatetimeIndex(self.times(), name=self.name)
        return pd.MultiIndex.from_arrays([self.window.index, times], names=[WINDOW, self.name])

    def _copy(self, deep: bool = True, memo: dict[int, Any] | None = None) -> WindowIndex:
        copied = type(self)(self.window, self.variable, self.name, store_windows=self.store_windows)
        copied._times = self._times
        return copied

    def _repr_inline_(self, max_width: int) -> str:
        state = "read" if self._times is not None else "read on the first sel"
        return f"WindowIndex (global index; burst start, not unique or sorted, {state})"


def to_xarray(store: Store) -> xr.Dataset:
    """The store as a lazy Dataset: ``gimu(window, sample, channel)`` with per-window coordinates."""
    xarray = require("xarray", _FEATURE)  # again: the module may be cached from an earlier call
    import pandas as pd
    layouts = store.reader.layouts

    def lazy(name: str, dims: tuple[str, ...], dtype: np.dtype[Any], attrs: dict[str, Any]) -> Any:
        data = _indexing.LazilyIndexedArray(WindowArray(store, name, dtype))
        return xarray.Variable(dims, data, attrs=attrs)

    gimu_attrs = {**array_attributes(GIMU), "gps_scale": gps_scale(store)}
    gimu = lazy(GIMU, GIMU_DIMS, store.reader.dtype(GIMU), gimu_attrs)  # float32, decoded, on every version
    # Decoded to datetime64[s], the timestamps carry their unit in the dtype: a "units" attribute
    # beside it would make xarray refuse to write the Dataset (to_zarr, to_netcdf).
    time_attrs = {"long_name": "burst start (UTC)", "note": "NaT where the source has no timestamps"}
    coords = {
        DEVICE: lazy(DEVICE, PER_WINDOW_DIMS, layouts[DEVICE].dtype, array_attributes(DEVICE)),
        TIME: lazy(TIMESTAMP, PER_WINDOW_DIMS, np.dtype("datetime64[s]"), time_attrs),
        LABEL: lazy(LABEL, PER_WINDOW_DIMS, layouts[LABEL].dtype, array_attributes(LABEL)),
        CHANNEL: (CHANNEL, list(CHANNELS)),
        # the global window index: kept through isel (ds.isel(window=store.device_indices(207))
        # keeps each window's number in the store) and sel(window=...) selects by it. A pandas
        # RangeIndex holds no array: 25 M windows cost nothing until selected.
        WINDOW: xarray.Variable(WINDOW, pd.RangeIndex(len(store), name=WINDOW),
                                {"long_name": "global window index"}),
    }
    committed = store.meta.get("committed", {})
    attrs = {
        "store": store.url,
        "birdzarr_format_version": store.format_version,
        "generation": committed.get("generation"),
        "chunk_windows": store.chunk_windows,
    }
    dataset = xarray.Dataset({GIMU: gimu}, coords=xarray.Coordinates(coords, indexes={}), attrs=attrs)
    dataset = dataset.set_xindex(CHANNEL)
    return dataset.set_xindex([WINDOW, TIME], WindowIndex, n_windows=len(store))
