"""What exploration needs of a store: a small read-only interface that ``birdzarr.Store`` satisfies.

Exploration sits above the store handle (tests/test_layers.py): it is written against this
Protocol, and ``birdzarr/store/`` knows nothing of it. Anything with these members can be
summarised, plotted, viewed as xarray and measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from birdzarr.format._spec import DeviceEntry
    from birdzarr.storage._location import Location
    from birdzarr.store._chunks import ChunkReader


class WindowArray(Protocol):
    """One per-window array indexed by global window index (``store.windows``, ``store.labels``...)."""

    def __getitem__(self, key: Any) -> np.ndarray: ...


@runtime_checkable
class ReadableStore(Protocol):
    """The read interface of a committed store that exploration uses."""

    location: Location  # where the store is (the statistics cache is keyed by it)
    reader: ChunkReader  # chunk reads by array name and chunk number

    def __len__(self) -> int: ...

    @property
    def meta(self) -> dict[str, Any]: ...  # the birdzarr attributes, device table included

    @property
    def root(self) -> dict[str, Any]: ...  # the root attributes alone (format 2: no device table)

    @property
    def device_table(self) -> list[DeviceEntry]: ...

    @property
    def device_columns(self) -> dict[str, np.ndarray]: ...  # the table's index arrays

    @property
    def n_devices(self) -> int: ...

    @property
    def url(self) -> str: ...

    @property
    def format_version(self) -> int: ...

    @property
    def chunk_windows(self) -> int: ...

    @property
    def shuffled(self) -> bool: ...

    @property
    def windows(self) -> WindowArray: ...

    @property
    def labels(self) -> WindowArray: ...

    @property
    def timestamps(self) -> WindowArray: ...

    @property
    def window_devices(self) -> WindowArray: ...

    def array_view(self, name: str) -> WindowArray: ...

    def device_indices(self, device_id: int) -> np.ndarray: ...
