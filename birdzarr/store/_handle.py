"""The read-only store handle: ``open_store(url) -> Store``."""

from __future__ import annotations

import os
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from birdzarr._checks import require_int
from birdzarr._errors import (
    ArgumentError,
    DeviceNotFoundError,
    FormatVersionError,
    IncompleteStoreError,
    MissingChunkError,
    WindowIndexError,
)
from birdzarr.format._device_table import columns as device_table_columns
from birdzarr.format._spec import (
    DEVICE,
    GIMU,
    LABEL,
    TIMESTAMP,
    TIMESTAMP_UNKNOWN,
    DeviceEntry,
    DeviceReport,
    check_root_attrs,
)
from birdzarr.storage._cache import DEFAULT_MAX_BYTES, ChunkCache, cache_for, check_cache_dir
from birdzarr.storage._location import Location, StoreLike, resolve, zarr_store
from birdzarr.storage._root import read_root as _read_root
from birdzarr.store._chunks import ChunkReader
from birdzarr.store._device_table import columns, merged, table_path

if TYPE_CHECKING:
    from collections.abc import Callable

    import pandas as pd
    import zarr

_T = TypeVar("_T")


class Store:
    """A committed birdzarr store, opened read-only. Only committed windows are visible.

    Reading never writes to the store. The exploration methods (``to_xarray``, ``plot_window``,
    ``plot_device``, ``stats`` and the text and Jupyter summaries) are the functions of
    ``birdzarr.explore``, a layer above this one, attached by ``import birdzarr``.
    """

    def __init__(self, location: Location, attrs: dict[str, Any]) -> None:
        self.location = location
        # the root attributes alone: a format-2 store keeps its device table apart, read on first
        # use (``meta``, ``device_table``), so opening reads one object whatever the device count
        self.root = attrs
        committed = attrs.get("committed")
        if not committed:
            raise IncompleteStoreError(
                f"{location.display}: a conversion started here and never committed (it was "
                "interrupted or failed). Re-run the same `birdzarr convert` command to finish it, "
                "or delete the directory."
            )
        self.n_windows = int(committed["n_windows"])
        self.reader = ChunkReader.open(location, self.n_windows, int(attrs["format_version"]),
                                       committed=committed)

    @cached_property
    def meta(self) -> dict[str, Any]:
        """The store's attributes, as format 1 keeps them all in the root ``zarr.json``: with the
        device table (``devices``), each device's report (``report.devices``) and CSV tails. A
        format-2 store reads its device table group the first time this is used."""
        return self._of_this_commit(lambda: merged(self.location, self.root))

    @cached_property
    def device_table(self) -> list[DeviceEntry]:
        """Every device's entry (windows, ranges, times, sources, labels), ascending id."""
        return [DeviceEntry.from_json(d) for d in self.meta.get("devices", [])]

    @cached_property
    def device_columns(self) -> dict[str, np.ndarray]:
        """The device table's index columns (``device_id``, ``n_windows``, ``first_time``,
        ``last_time``, ``range_device``, ``range_start``, ``range_stop``: int64, ascending id / by
        range start; and the check columns ``range_checksum`` and ``scattered_digest`` where the
        table holds them: ``birdzarr.format._device_table``): a format-2 store's index arrays,
        read without its entries, so a loader's selection at 100K devices parses no per-device JSON."""
        where = table_path(self.root)
        if where is not None:
            return self._of_this_commit(lambda: columns(self.location, where))
        return device_table_columns(self.device_table)

    def _of_this_commit(self, read: Callable[[], _T]) -> _T:
        """``read()`` of this commit's device table, which is read lazily, after the open. A
        commit keeps the table it replaced, so one commit since the open is fine; after two, the
        table is gone, and the error says to open the store again rather than that it is damaged."""
        try:
            return read()
        except MissingChunkError:
            opened = int(self.root["committed"].get("generation", 0))
            now = (check_root_attrs(_read_root(self.location), where=self.location.display).get("committed")
                   or {})
            if int(now.get("generation", opened)) != opened:
                raise MissingChunkError(
                    f"{self.location.display}: this Store was opened at commit generation {opened}, and the "
                    f"store has been committed since (now generation {now.get('generation')}), which removed "
                    "the device table of the commit it opened. Open the store again (birdzarr.open_store)."
                ) from None
            raise

    @property
    def n_devices(self) -> int:
        """The number of devices (without reading a format-2 store's device table)."""
        recorded = self.root["committed"].get("n_devices")
        return int(recorded) if recorded is not None else len(self.device_table)

    # -- basic facts -----------------------------------------------------------------------------
    def __len__(self) -> int:
        """The number of committed windows."""
        return self.n_windows

    @property
    def url(self) -> str:
        """Where the store is, as given (credentials left out)."""
        return self.location.display

    @property
    def format_version(self) -> int:
        """The birdzarr format version the store was written with (docs/format.md)."""
        return int(self.root["format_version"])

    @property
    def chunk_windows(self) -> int:
        """Windows per chunk (the read unit)."""
        return self.reader.chunk_windows

    @property
    def shuffled(self) -> bool:
        """True for a ``--shuffle`` store: windows in one seeded random order, not by device."""
        return bool(self.root.get("layout", {}).get("shuffled", False))

    @property
    def report(self) -> dict[int, DeviceReport]:
        """The conversion report of each device: rows read, dropped and why (device id -> report)."""
        devices = self.meta.get("report", {}).get("devices", {})
        return {int(k): DeviceReport.from_json(v) for k, v in devices.items()}

    def summary(self) -> dict[str, Any]:
        """The store's facts as ``birdzarr info --json`` prints them (the same keys and values;
        ``info`` without ``--json`` shows them as text): url, format version, windows, devices,
        stored bytes per array, layout, curation, the commit, the conversion report's totals and
        the appends. Lists the window arrays' chunk files once to count their bytes."""
        from birdzarr.store._summary import summary

        return summary(self)

    @property
    def appends(self) -> list[dict[str, Any]]:
        """Every append to the store, oldest first, as the report keeps it (``report.appends``:
        first window, windows, files per device, source, times, CPU figures); [] if none."""
        return [dict(record) for record in self.meta.get("report", {}).get("appends") or []]

    def device(self, device_id: int) -> DeviceEntry:
        """The device table's entry for ``device_id`` (``DeviceNotFoundError``, a
        ``KeyError``, if the store has no such device). The id may be given as a string
        (``"200"``, as a table or the command line gives it), not as a float (200.5 is no id)."""
        from birdzarr._checks import refuse_float

        refuse_float("device_id", device_id)
        wanted = int(device_id)
        ids, order = self._device_index
        at = int(np.searchsorted(ids, wanted)) if -2**63 <= wanted < 2**63 else len(ids)
        if at < len(ids) and ids[at] == wanted:
            return self.device_table[int(order[at])]
        known = ", ".join(str(e.device_id) for e in self.device_table[:20])
        more = ", ..." if len(self.device_table) > 20 else ""
        raise DeviceNotFoundError(f"device {device_id} is not in {self.url} (it holds "
                                  f"{len(self.device_table)} devices: {known}{more}); "
                                  "`birdzarr info --devices` lists them")

    @cached_property
    def _device_index(self) -> tuple[np.ndarray, np.ndarray]:
        """The device ids sorted, and each one's position in ``device_table``: ``device`` finds
        an entry by binary search (at 100K devices a scan cost ~2.5 ms a lookup)."""
        if table_path(self.root) is not None:  # format 2: the index array, ascending like the table
            ids = self.device_columns["device_id"]
            return ids, np.arange(len(ids))
        ids = np.fromiter((e.device_id for e in self.device_table), dtype=np.int64,
                          count=len(self.device_table))
        order = np.argsort(ids, kind="stable")
        return ids[order], order

    @property
    def cache(self) -> ChunkCache | None:
        """The local chunk cache this handle reads through (``open_store(url, cache_dir=...)``),
        with its figures (``hits``, ``misses``, ``used_bytes``, ``full``); None without one."""
        cache: ChunkCache | None = self.reader.cache
        return cache

    # -- zarr and tables -------------------------------------------------------------------------
    @cached_property
    def group(self) -> zarr.Group:
        import zarr

        return zarr.open_group(zarr_store(self.location, read_only=True), mode="r", zarr_format=3)

    @property
    def gimu(self) -> zarr.Array:
        """The ``gimu`` zarr array of a format-1 store. Its shape may exceed ``len(store)`` during
        an append: windows at or past ``len(store)`` are not committed.

        A format-2 store has no ``gimu`` array (its windows are ``gimu_codes`` + dictionaries,
        docs/format.md): this raises FormatVersionError naming ``store.windows``, which gives
        float32 windows on every version; ``store.group`` holds the stored arrays."""
        if self.format_version >= 2:
            raise FormatVersionError(
                f"{self.url} is a format-{self.format_version} store: it has no 'gimu' array (its windows "
                "are stored as dictionary codes). Read float32 windows with store.windows[a:b]; "
                "store.group['gimu_codes'] and the dict_* arrays are the stored arrays."
            )
        return self.group[GIMU]  # type: ignore[return-value]

    @property
    def devices(self) -> pd.DataFrame:
        """The device table as a pandas DataFrame: one row per device in ascending ``device_id``
        order, a plain ``RangeIndex`` and ``device_id`` as a column (so ``reset_index()``,
        ``merge`` and ``to_parquet`` work as usual); ``.set_index("device_id")`` to look rows up by id."""
        import pandas as pd

        rows = []
        for e in self.device_table:
            rows.append({
                "device_id": e.device_id,
                "n_windows": e.n_windows,
                "first_time": _to_datetime(e.first_time),
                "last_time": _to_datetime(e.last_time),
                "n_ranges": len(e.ranges),
                "label_counts": dict(e.label_counts),
                "sources": list(e.sources),
            })
        columns = ["device_id", "n_windows", "first_time", "last_time", "n_ranges", "label_counts", "sources"]
        return pd.DataFrame(rows, columns=columns)

    # -- data ------------------------------------------------------------------------------------
    def device_windows(self, device_id: int) -> np.ndarray:
        """All committed windows of one device, float32 ``(n, 20, 4)``, in stored order."""
        entry = self.device(device_id)
        if self.shuffled:
            return self._scattered(entry.device_id)
        parts = [self.reader.read_range(GIMU, r.start, r.stop) for r in entry.ranges]
        if not parts:
            return np.empty((0, 20, 4), dtype=np.float32)
        return np.concatenate(parts)

    def device_indices(self, device_id: int) -> np.ndarray:
        """Global window indices of one device, ascending."""
        entry = self.device(device_id)
        if self.shuffled:
            hits = [
                np.flatnonzero(self.reader.read(DEVICE, i) == entry.device_id) + self.reader.chunk_span(i)[0]
                for i in range(self.reader.n_chunks)
            ]
            return np.concatenate(hits) if hits else np.empty(0, dtype=np.int64)
        return np.concatenate([np.arange(r.start, r.stop) for r in entry.ranges] or [np.empty(0, np.int64)])

    def _scattered(self, device_id: int) -> np.ndarray:
        pieces = []
        for i in range(self.reader.n_chunks):
            mask = self.reader.read(DEVICE, i) == device_id
            if mask.any():
                pieces.append(self.reader.read(GIMU, i)[mask])
        return np.concatenate(pieces) if pieces else np.empty((0, 20, 4), dtype=np.float32)

    def array_view(self, name: str) -> WindowsView:
        """Chunk-aware reads of one stored array (``gimu``, ``label``, ``timestamp``, ``device``)
        by global window index."""
        return WindowsView(self, name)

    @property
    def windows(self) -> WindowsView:
        """Chunk-aware random access by global index: ``store.windows[1000:1016]``."""
        return self.array_view(GIMU)

    @property
    def labels(self) -> WindowsView:
        """The label of every window (int32), sliced like ``windows``."""
        return self.array_view(LABEL)

    @property
    def timestamps(self) -> WindowsView:
        """The burst time of every window (int64 unix seconds; the minimum int64 when the source
        has none, as in Parquet input)."""
        return self.array_view(TIMESTAMP)

    @property
    def window_devices(self) -> WindowsView:
        """The device id of every window (int32), sliced like ``windows``."""
        return self.array_view(DEVICE)

    def __repr__(self) -> str:
        # `import birdzarr` replaces this with the full summary (birdzarr.explore, attached above)
        return f"<birdzarr.Store {self.url}: {self.n_windows:,} windows, {len(self.device_table)} devices>"


class WindowsView:
    """``view[i]``, ``view[i:j]`` and ``view[index_array]`` over one per-window array; more
    indices after the window's (``view[i, :, 0]``) index into what those give, as numpy does."""

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, tuple):  # the windows first, then the rest within them
            if not key:
                return self[slice(None)]
            first, rest = key[0], key[1:]
            picked = self[first]
            if isinstance(first, (int, np.integer)):
                return np.asarray(picked[rest])
            if isinstance(first, slice):
                return np.asarray(picked[(slice(None), *rest)])
            # an index array (or mask) stands as the positions it picked, so further index arrays
            # pair with it as numpy's do (view[[0, 1], [2, 3]]: two samples, not a 2 x 2 block)
            return np.asarray(picked[(np.arange(len(picked)), *rest)])
        reader = self.store.reader
        n = len(self.store)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                return self[np.arange(start, stop, step)]
            return reader.read_range(self.name, start, max(start, stop))
        if isinstance(key, (int, np.integer)):
            index = int(key) + n if key < 0 else int(key)
            if not 0 <= index < n:
                raise WindowIndexError(f"window {key} is out of range: the store holds {n} windows")
            return reader.read_range(self.name, index, index + 1)[0]
        given = np.asarray(key)
        if given.dtype.kind not in "iub" or given.dtype.kind == "b" and given.shape != (n,):
            raise TypeError(f"windows are indexed by an integer, a slice, integers or a mask of all "
                            f"{n} windows, not {type(key).__name__} {given.dtype}")
        indices = np.flatnonzero(given) if given.dtype.kind == "b" else given.astype(np.int64)
        indices = np.where(indices < 0, indices + n, indices)
        if len(indices) and (indices.min() < 0 or indices.max() >= n):
            raise WindowIndexError(f"a window index is out of range: the store holds {n} windows")
        return gather(reader, self.name, indices)


def gather(reader: ChunkReader, name: str, indices: np.ndarray) -> np.ndarray:
    """Windows at arbitrary global indices, reading each touched chunk once."""
    chunk_of = indices // reader.chunk_windows
    order = np.argsort(chunk_of, kind="stable")
    out = np.empty((len(indices), *reader.item_shape(name)), dtype=reader.dtype(name))
    sorted_chunks = chunk_of[order]
    bounds = np.flatnonzero(np.diff(sorted_chunks)) + 1
    for group in np.split(order, bounds):
        if not len(group):
            continue
        chunk = int(chunk_of[group[0]])
        data = reader.read(name, chunk)
        out[group] = data[indices[group] - chunk * reader.chunk_windows]
    return out


def _to_datetime(seconds: int) -> Any:
    if seconds == TIMESTAMP_UNKNOWN:
        return np.datetime64("NaT", "s")
    return np.datetime64(seconds, "s")


def open_store(
    store: StoreLike, *, storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None, cache_max_bytes: int = DEFAULT_MAX_BYTES,
) -> Store:
    """Open a committed store read-only (a path, ``file://``, ``s3://``, ``memory://``, ...;
    an opened ``Store`` is opened again at its location, to see a later commit).

    ``cache_dir``: keep the chunks this handle reads in a local directory (made if missing), so
    reading them again reads local disk instead of a bucket; at most ``cache_max_bytes`` (default
    50 GiB), after which nothing more is admitted and nothing evicted. Entries are keyed by the
    store's URL and commit (docs/cloud.md#local-chunk-cache-opt-in); ``store.cache`` gives its
    hits and misses. The same cache as ``WindowDataset(url, cache_dir=...)``.
    """
    if cache_dir is not None:  # wrong options are refused before anything is read
        check_cache_dir(cache_dir)
        if require_int("cache_max_bytes", cache_max_bytes) < 0:
            raise ArgumentError(f"cache_max_bytes must be an integer of 0 or more, got {cache_max_bytes}")
    location = resolve(store, storage_options)
    attrs = _read_root(location)
    meta = check_root_attrs(attrs, where=location.display)
    opened = Store(location, meta)
    if cache_dir is not None:
        opened.reader.cache = cache_for(opened, cache_dir, cache_max_bytes)
    return opened
