"""Pure, seeded planning of an epoch: which windows form which batch on which rank.

Everything here is a function of ``(counts, seed, epoch, world_size, rank, batch_size, ...)``;
nothing reads data. The epoch is built in four steps:

1. **Chunk order**: the chunks that hold selected windows, permuted by ``(seed, epoch)``.
2. **Stream**: the selected windows of those chunks, concatenated in that order. Every selected
   window appears exactly once.
3. **Ranks**: the stream is cut into ``world_size`` contiguous spans of equal batch count.
4. **Groups**: each rank's batches are grouped ``group_batches`` at a time; the windows of a group
   are permuted uniformly (seeded by seed, epoch, rank and group) and cut into its batches.

DataLoader workers take every ``num_workers``-th batch of their rank, so the order a training
loop sees does not depend on ``num_workers``; only how often a chunk is decoded does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_SEED_STREAM = 0xB1BD2A


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([_SEED_STREAM, *[int(k) & 0xFFFFFFFFFFFFFFFF for k in key]])


def rank_window_counts(
    total: int, world_size: int, batch_size: int, drop_last: bool
) -> tuple[np.ndarray, int]:
    """Windows per rank and batches per rank for one epoch.

    ``drop_last``: every rank gets ``total // (world_size * batch_size)`` full batches; the
    windows past that (fewer than ``world_size * batch_size``, a different set every epoch because
    the chunk order changes) are not delivered. Otherwise every window is delivered exactly once:
    ranks get ``total // world_size`` windows (the first ``total % world_size`` ranks one more),
    all ranks the same number of batches, and only each rank's last batch may be short.
    """
    if world_size < 1 or batch_size < 1:
        raise ValueError("world_size and batch_size must be positive")
    if drop_last:
        n_batches = total // (world_size * batch_size)
        return np.full(world_size, n_batches * batch_size, dtype=np.int64), n_batches
    per_rank = np.full(world_size, total // world_size, dtype=np.int64)
    per_rank[: total % world_size] += 1
    if per_rank.min() == 0:
        raise ValueError(
            f"{total} windows cannot be split over {world_size} ranks with drop_last=False "
            "(a rank would get none); select more windows or use fewer ranks"
        )
    return per_rank, int(-(-per_rank.max() // batch_size))


def batch_sizes(n_windows: int, n_batches: int, batch_size: int) -> np.ndarray:
    """Sizes of a rank's batches: full batches, then the remainder (never an empty batch)."""
    sizes = np.full(n_batches, batch_size, dtype=np.int64)
    if n_batches:
        sizes[-1] = n_windows - (n_batches - 1) * batch_size
        if sizes[-1] == 0:  # this rank has one window fewer than others whose last batch holds one
            sizes[-2:] = (batch_size - 1, 1)
    assert sizes.sum() == n_windows and (sizes > 0).all()
    return sizes


def chunk_order(counts: np.ndarray, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Indices of the chunks holding selected windows, in stream order."""
    nonempty = np.flatnonzero(counts > 0)
    if not shuffle:
        return nonempty
    return nonempty[_rng(seed, epoch).permutation(len(nonempty))]


def group_permutation(
    size: int, *, seed: int, epoch: int, rank: int, group: int, shuffle: bool
) -> np.ndarray:
    """The order of a group's windows (identity when not shuffling)."""
    if not shuffle:
        return np.arange(size, dtype=np.int64)
    return _rng(seed, epoch, rank, group, 1).permutation(size)


@dataclass(frozen=True)
class EpochPlan:
    """One rank's epoch: batch boundaries in the stream and how to find each window."""

    chunks: np.ndarray  # chunk indices in stream order
    bounds: np.ndarray  # stream position where each chunk's selected windows start; len+1
    rank_start: int  # stream position of this rank's first window
    offsets: np.ndarray  # rank-relative start of each batch; len n_batches + 1
    group_batches: int
    seed: int
    epoch: int
    rank: int
    shuffle: bool
    # The last group's window order: a group's batches are taken one after another (also within
    # one worker), so one entry spares a permutation per batch without growing memory.
    _last_order: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_batches(self) -> int:
        return len(self.offsets) - 1

    def group_of(self, batch: int) -> int:
        return batch // self.group_batches

    def group_span(self, group: int) -> tuple[int, int]:
        """Rank-relative window range of a group."""
        first = group * self.group_batches
        last = min(first + self.group_batches, self.n_batches)
        return int(self.offsets[first]), int(self.offsets[last])

    def batch_positions(self, batch: int) -> np.ndarray:
        """Stream positions of the windows of ``batch``, in the order they are delivered."""
        group = self.group_of(batch)
        start, stop = self.group_span(group)
        order = self._last_order.get(group)
        if order is None:
            order = group_permutation(
                stop - start,
                seed=self.seed,
                epoch=self.epoch,
                rank=self.rank,
                group=group,
                shuffle=self.shuffle,
            )
            self._last_order.clear()
            self._last_order[group] = order
        lo, hi = int(self.offsets[batch]) - start, int(self.offsets[batch + 1]) - start
        return self.rank_start + start + order[lo:hi]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions -> (chunk index, rank among that chunk's selected windows)."""
        slot = np.searchsorted(self.bounds, positions, side="right") - 1
        return self.chunks[slot], positions - self.bounds[slot]

    def group_chunks(self, group: int) -> np.ndarray:
        """Chunks whose selected windows overlap a group, in stream order."""
        start, stop = self.group_span(group)
        lo = np.searchsorted(self.bounds, self.rank_start + start, side="right") - 1
        hi = np.searchsorted(self.bounds, self.rank_start + stop, side="left")
        return self.chunks[lo:hi]


def plan_epoch(
    counts: np.ndarray,
    *,
    seed: int,
    epoch: int,
    world_size: int,
    rank: int,
    batch_size: int,
    drop_last: bool,
    shuffle: bool,
    group_batches: int,
) -> EpochPlan:
    """The plan of one rank for one epoch; ``counts[i]`` is the number of selected windows of chunk i."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if group_batches < 1:
        raise ValueError("group_batches must be at least 1")
    chunks = chunk_order(counts, seed=seed, epoch=epoch, shuffle=shuffle)
    bounds = np.concatenate(([0], np.cumsum(counts[chunks]))).astype(np.int64)
    per_rank, n_batches = rank_window_counts(int(bounds[-1]), world_size, batch_size, drop_last)
    rank_start = int(per_rank[:rank].sum())
    sizes = batch_sizes(int(per_rank[rank]), n_batches, batch_size)
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    return EpochPlan(chunks, bounds, rank_start, offsets, group_batches, seed, epoch, rank, shuffle)


def worker_batches(n_batches: int, *, start: int, worker: int, num_workers: int) -> range:
    """Batches of a rank that one DataLoader worker produces, from ``start`` on.

    DataLoader takes batches from its workers round-robin starting at worker 0, so worker ``w``
    produces batches ``start + w``, ``start + w + num_workers``, ... and the loop sees them in order.
    """
    return range(start + worker, n_batches, num_workers)
