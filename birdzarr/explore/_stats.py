"""Per-channel statistics of a whole store, computed one chunk at a time and cached outside it.

Reading a store never writes to it. The numbers are keyed by the store's place and commit
(generation, window count and commit time), so an append, a rewrite or a new conversion to the same
place makes them stale, and they are reused, first found first:

1. in memory, for the open store;
2. the local statistics cache, one small JSON file per store in ``$BIRDZARR_CACHE_DIR/stats``
   (default ``$XDG_CACHE_HOME/birdzarr/stats``, i.e. ``~/.cache/birdzarr/stats``), written after
   each computation unless ``persist=False``. A cache that cannot be written is a warning; the
   numbers are returned either way;
3. the store's ``stats`` group (its ``zarr.json`` attributes), present only where someone ran
   ``birdzarr stats STORE --save`` (``save_stats``): an explicit write that takes the store's
   writer lock, as a conversion does, so every machine that opens the store gets the numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from birdzarr._checks import require_bool, require_int
from birdzarr._errors import BirdzarrWarning, ReadOnlyLocationError, StoreLockedError
from birdzarr._progress import progress_bar
from birdzarr.explore._units import gps_scale
from birdzarr.format._spec import CHANNELS, GIMU, N_CHANNELS, WINDOW_LENGTH, Curation
from birdzarr.storage._lock import StoreLock, read_holder

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from birdzarr.explore._protocol import ReadableStore as Store

STATS_NODE = "stats"
STATS_ATTR = "birdzarr_stats"
STATS_VERSION = 2  # 2: keyed by committed_at too (a re-conversion to the same place is generation 1 again)
DEFAULT_BINS = 64

# Stats of the stores opened in this process, so a read-only store computes them once.
_MEMORY: weakref.WeakKeyDictionary[Store, StoreStats] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class StoreStats:
    """Per-channel statistics over every committed value, in stored units.

    Stored units are g for imu_x/y/z and m/s divided by ``gps_scale`` for gps_speed (what a
    model is fed; ``gps_scale`` is the store's recorded divisor, kept here so that
    ``plot`` can show m/s). ``std`` is the population standard deviation (numpy's default,
    ``ddof=0``).
    ``counts[c]`` is the histogram of channel ``c`` over ``edges[c]``; values outside the edges
    are counted in ``below`` and ``above``.
    """

    channels: tuple[str, ...]
    n_windows: int
    generation: int | None
    committed_at: str | None
    count: int
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    edges: np.ndarray
    counts: np.ndarray
    below: np.ndarray
    above: np.ndarray
    gps_scale: float

    def to_dataframe(self) -> pd.DataFrame:
        """One row per channel: count, mean, std, min, max, and values outside the histogram."""
        import pandas as pd

        return pd.DataFrame(
            {"count": self.count, "mean": self.mean, "std": self.std, "min": self.min, "max": self.max,
             "below_range": self.below, "above_range": self.above},
            index=pd.Index(self.channels, name="channel"),
        )

    def plot(self) -> Figure:
        """Histograms of the four channels in physical units: g, and m/s for GPS speed (stored
        value x ``gps_scale``, as in the other plots). Each panel marks the mean and mean ± std."""
        from birdzarr.explore._plots import _figure
        from birdzarr.explore._units import CHANNEL_UNITS

        fig = _figure(figsize=(8.5, 6))
        axes = fig.subplots(2, 2).ravel()
        for c, (ax, name) in enumerate(zip(axes, self.channels, strict=True)):
            scale = self.gps_scale if name == "gps_speed" else 1.0
            unit = CHANNEL_UNITS[name]
            mean, std = self.mean[c] * scale, self.std[c] * scale
            ax.stairs(self.counts[c], self.edges[c] * scale, fill=True, color="tab:blue", alpha=0.6)
            ax.axvline(mean, color="black", linewidth=1.2, label="mean")
            for side in (-1, 1):
                ax.axvline(mean + side * std, color="black", linewidth=1, linestyle="--",
                           label="mean ± std" if side == 1 else None)
            ax.set_title(f"{name}: {mean_std_text(mean, std, unit)}")
            ax.set_xlabel(f"{name} ({unit})")
            ax.set_ylabel("count")
            ax.ticklabel_format(axis="y", style="plain")
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="outside lower center", ncols=2)
        fig.suptitle(f"value histograms over {self.n_windows:,} windows ({self.count:,} values a channel)")
        return fig

    def to_json(self) -> dict[str, Any]:
        arrays = ("mean", "std", "min", "max", "edges", "counts", "below", "above")
        return {
            "stats_version": STATS_VERSION, "channels": list(self.channels), "n_windows": self.n_windows,
            "generation": self.generation, "committed_at": self.committed_at, "count": self.count,
            "gps_scale": self.gps_scale,
            **{name: getattr(self, name).tolist() for name in arrays},
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StoreStats:
        return cls(
            channels=tuple(raw["channels"]), n_windows=int(raw["n_windows"]), generation=raw["generation"],
            committed_at=raw["committed_at"], count=int(raw["count"]),
            mean=np.array(raw["mean"]), std=np.array(raw["std"]), min=np.array(raw["min"]),
            max=np.array(raw["max"]), edges=np.array(raw["edges"]),
            counts=np.array(raw["counts"], dtype=np.int64), below=np.array(raw["below"], dtype=np.int64),
            above=np.array(raw["above"], dtype=np.int64), gps_scale=float(raw["gps_scale"]),
        )

    def __repr__(self) -> str:
        return f"StoreStats over {self.n_windows:,} windows\n{self.to_dataframe().to_string()}"

    def _repr_html_(self) -> str:
        return f"<p>StoreStats over {self.n_windows:,} windows</p>{self.to_dataframe().to_html()}"


def mean_std_text(mean: float, std: float, unit: str) -> str:
    """``mean 0.012 g, std 0.456 g``: both to the decimal of the std's third significant figure."""
    if not np.isfinite(std) or std <= 0:
        return f"mean {mean:.3g} {unit}, std {std:.3g} {unit}"
    decimals = max(0, 2 - int(np.floor(np.log10(std))))
    mean = round(float(mean), decimals) + 0.0  # + 0.0: no "-0.000"
    return f"mean {mean:.{decimals}f} {unit}, std {std:.{decimals}f} {unit}"


def histogram_edges(store: Store, bins: int) -> np.ndarray:
    """Fixed edges per channel from the curation ranges, so one pass over the data suffices."""
    recorded = store.meta.get("curation") or {}
    default = Curation()
    low, high = recorded.get("clip", [default.clip_min, default.clip_max])
    speed_limit = recorded.get("speed_limit", default.speed_limit)
    speed_top = speed_limit / recorded.get("gps_scale", default.gps_scale)
    ranges = [(low, high)] * 3 + [(0.0, speed_top)]
    return np.array([np.linspace(lo, hi, bins + 1) for lo, hi in ranges])


def compute(store: Store, *, bins: int = DEFAULT_BINS, progress: bool = True) -> StoreStats:
    """One pass over the committed chunks; memory is one chunk plus the running sums."""
    reader = store.reader
    edges = histogram_edges(store, bins)
    n = 0
    mean = np.zeros(N_CHANNELS)
    m2 = np.zeros(N_CHANNELS)  # sum of squared deviations, merged per chunk (Chan et al.)
    low = np.full(N_CHANNELS, np.inf)
    high = np.full(N_CHANNELS, -np.inf)
    counts = np.zeros((N_CHANNELS, bins), dtype=np.int64)
    below = np.zeros(N_CHANNELS, dtype=np.int64)
    above = np.zeros(N_CHANNELS, dtype=np.int64)
    with progress_bar(progress, total=len(store), unit="win", desc="stats") as bar:
        for chunk in range(reader.n_chunks):
            # Channel-major float64: reductions along contiguous rows are ~10x faster than
            # along the 4-wide axis of the stored layout, and float64 keeps the sums exact enough.
            values = reader.read(GIMU, chunk).reshape(-1, N_CHANNELS).T.astype(np.float64, order="C")
            k = values.shape[1]
            chunk_mean = values.mean(axis=1)
            chunk_m2 = np.square(values - chunk_mean[:, None]).sum(axis=1)
            delta = chunk_mean - mean
            total = n + k
            mean = mean + delta * (k / total)
            m2 = m2 + chunk_m2 + delta**2 * (n * k / total)
            n = total
            low = np.minimum(low, values.min(axis=1))
            high = np.maximum(high, values.max(axis=1))
            for c in range(N_CHANNELS):
                counts[c] += np.histogram(values[c], bins=edges[c])[0]
            below += (values < edges[:, :1]).sum(axis=1)
            above += (values > edges[:, -1:]).sum(axis=1)
            bar.update(k // WINDOW_LENGTH)
    return StoreStats(
        channels=CHANNELS, n_windows=len(store), generation=_generation(store),
        committed_at=_committed_at(store.meta), count=n,
        mean=mean, std=np.sqrt(m2 / n) if n else np.full(N_CHANNELS, np.nan),
        min=low, max=high, edges=edges, counts=counts, below=below, above=above,
        gps_scale=gps_scale(store),
    )


def _generation(store: Store) -> int | None:
    generation = store.meta.get("committed", {}).get("generation")
    return None if generation is None else int(generation)


def _committed_at(meta: dict[str, Any]) -> str | None:
    committed_at = (meta.get("committed") or {}).get("committed_at")
    return None if committed_at is None else str(committed_at)


def _valid(stats: StoreStats | None, store: Store, bins: int) -> bool:
    return (
        stats is not None and stats.n_windows == len(store) and stats.generation == _generation(store)
        and stats.committed_at == _committed_at(store.meta) and stats.counts.shape[1] == bins
    )


def _node_path(store: Store) -> str:
    return store.location.join(STATS_NODE, "zarr.json")


def load_saved(store: Store) -> StoreStats | None:
    """The stats saved in the store, or None when there are none or they cannot be read."""
    try:
        node = json.loads(store.location.fs.cat_file(_node_path(store)))
        raw = node["attributes"][STATS_ATTR]
        if raw.get("stats_version") != STATS_VERSION:
            return None
        return StoreStats.from_json(raw)
    except (FileNotFoundError, KeyError, ValueError, TypeError):
        return None


def cache_directory() -> str:
    """Where computed statistics are cached on this machine (one JSON file per store)."""
    explicit = os.environ.get("BIRDZARR_CACHE_DIR")
    if explicit:
        return os.path.join(os.path.expanduser(explicit), "stats")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "birdzarr", "stats")


def _cache_file(store: Store) -> str:
    """The cache file of a store's place (protocol and path; credentials are never part of it)."""
    location = store.location
    place = json.dumps([location.protocol, location.path])
    return os.path.join(cache_directory(), hashlib.sha256(place.encode()).hexdigest()[:32] + ".json")


def load_cached(store: Store) -> StoreStats | None:
    """The numbers in the local statistics cache for this store's place, or None."""
    try:
        with open(_cache_file(store), "rb") as handle:
            raw = json.load(handle)
        if raw.get("stats_version") != STATS_VERSION:
            return None
        return StoreStats.from_json(raw)
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _write_cache(store: Store, stats: StoreStats) -> None:
    """Keep the numbers in the local cache: written aside and renamed, a reader never sees half."""
    path = _cache_file(store)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False,
                                         suffix=".partial") as handle:
            json.dump(stats.to_json(), handle)
        os.replace(handle.name, path)
    except OSError as exc:
        warnings.warn(
            f"statistics of {store.url} were computed but not cached in {os.path.dirname(path)} "
            f"({type(exc).__name__}: {exc}). They are kept in memory for this process; set "
            "BIRDZARR_CACHE_DIR to a writable directory, or pass persist=False.",
            BirdzarrWarning, stacklevel=4,
        )


def _describes_the_store_now(store: Store, stats: StoreStats) -> bool:
    """Under the lock: the store still holds the commit the numbers were computed from."""
    from birdzarr.storage._root import read_root as _read_root

    current = (_read_root(store.location).get("birdzarr") or {})
    committed = current.get("committed") or {}
    return (committed.get("n_windows"), committed.get("generation"), _committed_at(current)) == (
        stats.n_windows, stats.generation, stats.committed_at)


def _write_node(store: Store, stats: StoreStats) -> None:
    node = {"zarr_format": 3, "node_type": "group", "attributes": {STATS_ATTR: stats.to_json()}}
    data = json.dumps(node).encode()
    location = store.location
    if location.is_local:
        # Write and rename so a concurrent reader sees the old node or the new, never half;
        # an interrupted write leaves a .partial file, which `birdzarr repair` removes.
        directory = os.path.dirname(_node_path(store))
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, delete=False, suffix=".partial") as handle:
            handle.write(data)
        os.replace(handle.name, _node_path(store))
    else:
        location.fs.pipe_file(_node_path(store), data)  # one PUT: atomic on object stores


def save_stats(store: Store, *, bins: int = DEFAULT_BINS, progress: bool = True) -> StoreStats:
    """Write the store's statistics into it (its ``stats`` group), for every machine that opens it.

    The one way birdzarr writes statistics into a store, and only when asked
    (``birdzarr stats STORE --save``): it takes the store's writer lock, as a conversion does,
    and under it checks that the store still holds the commit the numbers describe. The numbers
    come from the caches when still valid, else from one pass over the store. Raises
    ``StoreLockedError`` when a writer holds the lock (never taken over: ``birdzarr repair``
    deals with a killed writer), ``ReadOnlyLocationError`` where the location cannot be
    written, and ``StoreLockedError`` too when a commit landed while the numbers were computed.
    """
    stats_now = store_stats(store, bins=bins, progress=progress)
    location = store.location
    if location.read_only:
        raise ReadOnlyLocationError(f"{location.display}: the location is read-only; statistics are "
                                    "cached on this machine instead (store.stats())")
    holder = read_holder(location)
    if holder is not None:
        raise StoreLockedError(f"{location.display} is locked by {holder.describe()}; statistics not "
                               "saved (a writer is at work, or was killed: `birdzarr repair`)")
    with StoreLock(location, command="birdzarr stats --save"):
        if not _describes_the_store_now(store, stats_now):
            raise StoreLockedError(f"{location.display}: a writer committed while the statistics "
                                   "were computed; nothing saved. Run the command again.")
        try:
            _write_node(store, stats_now)
        except PermissionError as exc:
            raise ReadOnlyLocationError(f"{location.display}: cannot write the stats group ({exc})") from exc
    return stats_now


def store_stats(
    store: Store, *, bins: int = DEFAULT_BINS, cache: bool = True, persist: bool = True, progress: bool = True
) -> StoreStats:
    """Cached stats if still valid (memory, the local cache, the store's saved group), else
    computed and cached (in memory, and in the local cache unless ``persist=False``)."""
    bins = require_int("bins", bins, minimum=1)
    cache = require_bool("cache", cache)
    persist = require_bool("persist", persist)
    progress = require_bool("progress", progress)
    if cache:
        for source in (_MEMORY.get, load_cached, load_saved):
            candidate = source(store)
            if candidate is not None and _valid(candidate, store, bins):
                _MEMORY[store] = candidate
                return candidate
    stats = compute(store, bins=bins, progress=progress)
    _MEMORY[store] = stats
    if persist:
        _write_cache(store, stats)
    return stats
