"""Which committed windows an epoch draws from: device filters and seeded train/val splits.

A selection answers two questions without holding anything per window: how many selected
windows each chunk has (for planning) and which windows of one chunk are selected (when the chunk
is read). Device filters on a device-ordered store use the device table's ranges; on a
pre-shuffled store they use the chunk's per-window ``device`` array. The per-window split hashes
the global window index, so it needs no stored state either.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from birdzarr._errors import DeviceNotFoundError
from birdzarr.format._spec import DEVICE, DeviceEntry
from birdzarr.store._chunks import ChunkReader

SPLITS = ("train", "val")
SPLIT_BY = ("device", "window")


def split_devices(
    device_ids: Iterable[int], *, val_fraction: float, split_seed: int
) -> tuple[set[int], set[int]]:
    """Seeded device-level split: (train devices, val devices). Windows of a bird stay together."""
    ids = sorted(int(d) for d in device_ids)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    order = np.random.default_rng([0x5B117, split_seed]).permutation(len(ids))
    n_val = min(max(1, round(val_fraction * len(ids))), len(ids) - 1) if len(ids) > 1 else 0
    val = {ids[i] for i in order[:n_val]}
    return set(ids) - val, val


def window_in_val(indices: np.ndarray, *, val_fraction: float, split_seed: int) -> np.ndarray:
    """Seeded per-window split (parity with the old 90/10 random split): True for validation."""
    # splitmix64 of (index, seed): a fixed, platform-independent hash, uniform in [0, 2**64)
    with np.errstate(over="ignore"):
        z = indices.astype(np.uint64) + np.uint64((split_seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z < np.uint64(int(val_fraction * 2.0**64))


@dataclass(frozen=True)
class Selection:
    """Selected windows: an optional device set, optionally one side of a per-window split."""

    devices: frozenset[int] | None  # None: every device
    ranges: tuple[tuple[int, int], ...] | None  # window ranges of the devices (device-ordered store)
    window_split: tuple[str, float, int] | None  # (split, val_fraction, split_seed)

    @property
    def reads_device_array(self) -> bool:
        """True if selecting needs each chunk's per-window device ids."""
        return self.devices is not None and self.ranges is None

    def chunk_mask(self, reader: ChunkReader, chunk: int, device_ids: np.ndarray | None) -> np.ndarray | None:
        """Selected windows of one chunk (None: all of them)."""
        start, stop = reader.chunk_span(chunk)
        mask: np.ndarray | None = None
        if self.devices is not None:
            if self.ranges is not None:
                mask = np.zeros(stop - start, dtype=bool)
                for lo, hi in self.ranges:
                    a, b = max(lo, start), min(hi, stop)
                    if a < b:
                        mask[a - start : b - start] = True
            else:
                assert device_ids is not None
                mask = np.isin(device_ids, np.fromiter(self.devices, dtype=np.int64))
        if self.window_split is not None:
            split, fraction, seed = self.window_split
            in_val = window_in_val(np.arange(start, stop), val_fraction=fraction, split_seed=seed)
            side = in_val if split == "val" else ~in_val
            mask = side if mask is None else mask & side
        return mask

    def read_mask(
        self, reader: ChunkReader, chunk: int, device_ids: np.ndarray | None = None
    ) -> np.ndarray | None:
        """``chunk_mask``, reading the chunk's device ids first if the selection needs them."""
        if device_ids is None and self.reads_device_array:
            device_ids = reader.read(DEVICE, chunk)
        return self.chunk_mask(reader, chunk, device_ids)

    def selected_indices(self, reader: ChunkReader, chunk: int) -> np.ndarray:
        """Global indices of the selected windows of one chunk, in stored order."""
        start, stop = reader.chunk_span(chunk)
        mask = self.read_mask(reader, chunk)
        return np.arange(start, stop) if mask is None else start + np.flatnonzero(mask)

    def counts(self, reader: ChunkReader) -> np.ndarray:
        """Selected windows per chunk (reads the device array only for shuffled stores)."""
        counts = np.empty(reader.n_chunks, dtype=np.int64)
        for chunk in range(reader.n_chunks):
            start, stop = reader.chunk_span(chunk)
            mask = self.read_mask(reader, chunk)
            counts[chunk] = (stop - start) if mask is None else int(mask.sum())
        return counts


def make_selection(
    table: list[DeviceEntry],
    *,
    shuffled_store: bool,
    devices: Iterable[int] | None,
    exclude_devices: Iterable[int] | None,
    split: str | None,
    split_by: str,
    val_fraction: float,
    split_seed: int,
) -> Selection:
    """Validate the user's subset options and turn them into a ``Selection``."""
    known = {e.device_id for e in table}
    chosen: set[int] | None = None
    if devices is not None:
        chosen = {int(d) for d in devices}
        missing = sorted(chosen - known)
        if missing:
            listed = ", ".join(str(d) for d in missing[:10]) + (", ..." if len(missing) > 10 else "")
            raise DeviceNotFoundError(f"devices={listed} are not in the store ({len(known)} devices; "
                                      "`birdzarr info --devices` lists them)")
    if exclude_devices is not None:
        chosen = (known if chosen is None else chosen) - {int(d) for d in exclude_devices}
    window_split = None
    if split is not None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
        if split_by not in SPLIT_BY:
            raise ValueError(f"split_by must be one of {SPLIT_BY}, got {split_by!r}")
        if split_by == "device":
            train, val = split_devices(
                known if chosen is None else chosen, val_fraction=val_fraction, split_seed=split_seed
            )
            chosen = val if split == "val" else train
        else:
            if not 0.0 < val_fraction < 1.0:
                raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
            window_split = (split, float(val_fraction), int(split_seed))
    if chosen is None or chosen == known:
        return Selection(None, None, window_split)
    ranges = None
    if not shuffled_store:
        ranges = tuple(sorted((r.start, r.stop) for e in table if e.device_id in chosen for r in e.ranges))
    return Selection(frozenset(chosen), ranges, window_split)
