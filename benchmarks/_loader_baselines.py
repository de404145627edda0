"""The approaches birdzarr replaces, as the training loader benchmark runs them.

Each is what a user would write without birdzarr: a map-style dataset with a per-item
``__getitem__`` and PyTorch's default collate (``DataLoader(batch_size=8192)``), except the ideal
in-RAM gather, which has no DataLoader at all and is the practical upper limit.

Samplers record the indices they hand out (the first ``keep`` of them, in a preallocated array)
so the benchmark can compute the shuffle quality from the known device of each index.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info


class BirdDataset(Dataset[torch.Tensor]):
    """The in-RAM loader birdzarr replaces: every window of every per-device Parquet file in one
    float32 tensor.

    Loaded the way that loader does it: pandas reads each file, ``np.stack`` turns the column of
    per-row arrays into a matrix, and the per-device matrices are concatenated.
    """

    def __init__(self, files: Sequence[str]) -> None:
        import pandas as pd

        parts = []
        for path in files:
            frame = pd.read_parquet(path)
            parts.append(np.stack(frame["gimu"].values).astype(np.float32).reshape(-1, 20, 4))
            del frame
        self.data = torch.from_numpy(np.concatenate(parts))
        del parts

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class MemmapDataset(Dataset[torch.Tensor]):
    """(b) One memory-mapped ``.npy`` of all windows; opened lazily in each worker."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.n = int(np.load(path, mmap_mode="r").shape[0])
        self._map: np.ndarray | None = None
        self._pid = -1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._map is None or self._pid != os.getpid():
            self._map, self._pid = np.load(self.path, mmap_mode="r"), os.getpid()
        return torch.from_numpy(np.array(self._map[index]))


class PerDeviceMemmapDataset(Dataset[torch.Tensor]):
    """(c) One memory-mapped ``.npy`` per device; a global index is located by binary search."""

    def __init__(self, paths: Sequence[str], sizes: Sequence[int]) -> None:
        self.paths = list(paths)
        self.starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self._maps: list[np.ndarray] | None = None
        self._pid = -1

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._maps is None or self._pid != os.getpid():
            self._maps, self._pid = [np.load(p, mmap_mode="r") for p in self.paths], os.getpid()
        device = int(np.searchsorted(self.starts, index, side="right")) - 1
        return torch.from_numpy(np.array(self._maps[device][index - self.starts[device]]))


class RecordingSampler(Sampler[int]):
    """A random permutation per epoch (like ``shuffle=True``) that records its first indices."""

    def __init__(self, n: int, *, seed: int, keep: int) -> None:
        self.n, self.seed = n, seed
        self.recorded = np.full(keep, -1, dtype=np.int64)

    def __len__(self) -> int:
        return self.n

    def order(self) -> np.ndarray:
        return np.random.default_rng(self.seed).permutation(self.n)

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        keep = len(self.recorded)
        self.recorded[: min(keep, self.n)] = order[:keep]
        return iter(order.tolist())


class BlockRandomSampler(RecordingSampler):
    """(d) Shuffled block order, each block read sequentially (as LLM pre-training loaders do)."""

    def __init__(self, n: int, *, block: int, seed: int, keep: int) -> None:
        super().__init__(n, seed=seed, keep=keep)
        self.block = block

    def order(self) -> np.ndarray:
        starts = np.arange(0, self.n, self.block)
        starts = starts[np.random.default_rng(self.seed).permutation(len(starts))]
        return np.concatenate([np.arange(s, min(s + self.block, self.n)) for s in starts.tolist()])


def ideal_gather(data: np.ndarray, batch_size: int, *, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(e) Batches of an in-RAM array: a random permutation, each batch's indices sorted, one take."""
    order = np.random.default_rng(seed).permutation(len(data))
    for start in range(0, len(data), batch_size):
        indices = np.sort(order[start : start + batch_size])
        yield np.take(data, indices, axis=0), indices


class ReadyBatches(IterableDataset[torch.Tensor]):
    """The DataLoader's own ceiling: workers that only fill a new shared-memory batch (no reading).

    Each batch is a fresh shared-memory segment, as for every loader with workers; what this
    costs is what any loader with ``num_workers`` pays on top of producing the windows.
    """

    def __init__(self, n_windows: int, batch_size: int) -> None:
        self.n_batches, self.batch_size = -(-n_windows // batch_size), batch_size

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for _ in range(worker, self.n_batches, workers):
            batch = torch.empty((self.batch_size, 20, 4)).share_memory_()
            batch.fill_(1.0)
            yield batch
