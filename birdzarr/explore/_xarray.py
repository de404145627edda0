"""A lazy ``xarray.Dataset`` over a store, read through the store's own chunk reader.

Why not ``xr.open_zarr``: zarr-python returns fill values for a missing chunk (the store's reader
raises), it would see windows past the committed count during an append, and it needs the
``birdzarr.dict16`` codec registered. Reading through :class:`~birdzarr.read._chunks.ChunkReader`
keeps all three guarantees and counts every request, on local disks and S3 alike.
Each variable is wrapped in xarray's lazy indexing: selecting windows reads only their chunks,
and nothing is read when the Dataset is built or displayed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from birdzarr._format import CHANNELS, DEVICE, GIMU, GIMU_DIMS, LABEL, N_CHANNELS, TIMESTAMP, WINDOW_LENGTH
from birdzarr.explore._deps import require
from birdzarr.explore._units import gps_scale

if TYPE_CHECKING:
    import xarray as xr

    from birdzarr._store import Store


_FEATURE = "store.to_xarray()"
# This module is imported only by Store.to_xarray(), so a missing xarray surfaces there, named.
_backends = require("xarray.backends", _FEATURE)
_indexing = require("xarray.core.indexing", _FEATURE)


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
        # OUTER_1VECTOR: xarray hands us ints, slices and at most one integer array; a vector
        # of windows becomes one gather that reads each touched chunk once.
        return _indexing.explicit_indexing_adapter(
            key, self.shape, _indexing.IndexingSupport.OUTER_1VECTOR, self._read
        )

    def _read(self, key: tuple[Any, ...]) -> np.ndarray:
        from birdzarr._store import WindowsView

        windows, rest = key[0], key[1:]
        data = WindowsView(self.store, self.name)[windows]
        if rest:
            data = data[rest] if isinstance(windows, (int, np.integer)) else data[(slice(None), *rest)]
        # int64 unix seconds with INT64_MIN for "unknown" is exactly datetime64[s] with NaT.
        return data.view(self.dtype) if self.name == TIMESTAMP else data


def to_xarray(store: Store) -> xr.Dataset:
    """The store as a lazy Dataset: ``gimu(window, time, channel)`` with per-window coordinates."""
    xarray = require("xarray", _FEATURE)  # again: the module may be cached from an earlier call
    layouts = store.reader.layouts

    def lazy(name: str, dims: tuple[str, ...], dtype: np.dtype[Any], attrs: dict[str, Any]) -> Any:
        data = _indexing.LazilyIndexedArray(WindowArray(store, name, dtype))
        return xarray.Variable(dims, data, attrs=attrs)

    gimu = lazy(GIMU, GIMU_DIMS, layouts[GIMU].dtype, {
        "long_name": "curated sensor windows",
        "units": "imu_x, imu_y, imu_z: g; gps_speed: m/s divided by gps_scale",
        "gps_scale": gps_scale(store),
    })
    coords = {
        "device": lazy(DEVICE, ("window",), layouts[DEVICE].dtype, {"long_name": "device id"}),
        "time": lazy(TIMESTAMP, ("window",), np.dtype("datetime64[s]"),
                     {"long_name": "burst start (UTC)", "note": "NaT where the source has no timestamps"}),
        "label": lazy(LABEL, ("window",), layouts[LABEL].dtype, {"long_name": "label (-1 = unlabelled)"}),
        "channel": ("channel", list(CHANNELS)),
    }
    committed = store.meta.get("committed", {})
    attrs = {
        "store": store.url,
        "birdzarr_format_version": store.format_version,
        "generation": committed.get("generation"),
        "chunk_windows": store.chunk_windows,
    }
    return xarray.Dataset({GIMU: gimu}, coords=coords, attrs=attrs)
