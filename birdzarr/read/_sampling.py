"""Pure, seeded planning of an epoch: which windows form which batch on which rank.

Everything here is a function of ``(counts, seed, epoch, world_size, rank, batch_size, ...)``;
nothing reads data. The epoch is built in four steps:

1. **Chunk order**: the chunks that hold selected windows, permuted by ``(seed, epoch)``; full
   chunks first, then any partly selected or partial last chunk (see :func:`chunk_order`).
2. **Stream**: the selected windows of those chunks, concatenated in that order. Every selected
   window appears exactly once.
3. **Ranks**: the stream is cut into batch-sized pieces dealt to the ranks round-robin; the
   remainder (fewer than ``world_size * batch_size`` windows) is split evenly, one short last
   batch per rank, so every rank has the same number of batches.
4. **Groups**: each rank's batches are grouped ``group_batches`` at a time; the windows of a group
   are permuted uniformly (seeded by seed, epoch, rank and group) and cut into its batches.

DataLoader workers take every ``num_workers``-th batch of their rank, so the order a training
loop sees does not depend on ``num_workers``; only how often a chunk is decoded does. When the
batch size equals the chunk size (the defaults), steps 1 and 3 make each batch one whole chunk,
so no chunk is decoded by two workers.
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

    The stream's first ``rounds = total // (world_size * batch_size)`` rounds of full batches are
    dealt to the ranks round-robin. ``drop_last``: that is all; the remainder (fewer than
    ``world_size * batch_size`` windows, a different set every epoch because the chunk order
    changes) is not delivered. Otherwise the remainder is split evenly (the first ranks one window
    more) as each rank's short last batch, so every window is delivered exactly once and all ranks
    have the same number of batches.
    """
    if world_size < 1 or batch_size < 1:
        raise ValueError("world_size and batch_size must be positive")
    rounds, remainder = divmod(total, world_size * batch_size)
    per_rank = np.full(world_size, rounds * batch_size, dtype=np.int64)
    if drop_last or remainder == 0:
        return per_rank, rounds
    per_rank += remainder // world_size
    per_rank[: remainder % world_size] += 1
    if per_rank.min() == 0:
        raise ValueError(
            f"{total} windows cannot be split over {world_size} ranks with drop_last=False "
            "(a rank would get none); select more windows or use fewer ranks"
        )
    return per_rank, rounds + 1


def batch_sizes(n_windows: int, n_batches: int, batch_size: int) -> np.ndarray:
    """Sizes of a rank's batches: full batches, then the remainder (never an empty batch)."""
    sizes = np.full(n_batches, batch_size, dtype=np.int64)
    if n_batches:
        sizes[-1] = n_windows - (n_batches - 1) * batch_size
        if sizes[-1] == 0:  # this rank has no share of the remainder but others have one each
            sizes[-2:] = (batch_size - 1, 1)
    assert sizes.sum() == n_windows and (sizes > 0).all()
    return sizes


def chunk_order(counts: np.ndarray, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Indices of the chunks holding selected windows, in stream order.

    Shuffled: a seeded permutation, then stably partitioned so that chunks with the most selected
    windows (all full chunks, without a subset) come first. Batches of the chunk size then line up
    with whole chunks instead of straddling two of them behind a partial chunk.
    """
    nonempty = np.flatnonzero(counts > 0)
    if not shuffle or len(nonempty) == 0:
        return nonempty
    permuted = nonempty[_rng(seed, epoch).permutation(len(nonempty))]
    full = counts[permuted] == counts.max()
    return np.concatenate((permuted[full], permuted[~full]))


def group_permutation(
    size: int, *, seed: int, epoch: int, rank: int, group: int, shuffle: bool
) -> np.ndarray:
    """The order of a group's windows (identity when not shuffling)."""
    if not shuffle:
        return np.arange(size, dtype=np.int64)
    return _rng(seed, epoch, rank, group, 1).permutation(size)


@dataclass(frozen=True)
class EpochPlan:
    """One rank's epoch: batch boundaries and how to find each window in the stream."""

    chunks: np.ndarray  # chunk indices in stream order
    bounds: np.ndarray  # stream position where each chunk's selected windows start; len+1
    world_size: int
    batch_size: int
    rounds: int  # rounds of full batches dealt round-robin; this rank's first rounds x batch_size windows
    tail_start: int  # stream position of this rank's share of the remainder
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

    def stream_positions(self, relative: np.ndarray) -> np.ndarray:
        """Rank-relative window positions -> stream positions."""
        dealt = self.rounds * self.batch_size
        out = self.tail_start + (relative - dealt)
        head = relative < dealt
        piece, within = np.divmod(relative[head], self.batch_size)
        out[head] = (piece * self.world_size + self.rank) * self.batch_size + within
        return out

    def stream_spans(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The rank-relative range ``[start, stop)`` as stream ranges, in stream order."""
        dealt, size = self.rounds * self.batch_size, self.batch_size
        spans = []
        for piece in range(start // size, min(-(-stop // size), self.rounds)):
            lo, hi = max(start, piece * size), min(stop, (piece + 1) * size)
            at = (piece * self.world_size + self.rank) * size
            spans.append((at + lo - piece * size, at + hi - piece * size))
        if stop > dealt:
            lo = max(start, dealt) - dealt
            spans.append((self.tail_start + lo, self.tail_start + stop - dealt))
        return spans

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
        return self.stream_positions(start + order[lo:hi])

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions -> (chunk index, rank among that chunk's selected windows)."""
        slot = np.searchsorted(self.bounds, positions, side="right") - 1
        return self.chunks[slot], positions - self.bounds[slot]

    def group_chunks(self, group: int) -> np.ndarray:
        """Chunks whose selected windows overlap a group, in stream order (each once)."""
        slots: dict[int, None] = {}
        for lo, hi in self.stream_spans(*self.group_span(group)):
            first = int(np.searchsorted(self.bounds, lo, side="right")) - 1
            last = int(np.searchsorted(self.bounds, hi, side="left"))
            slots.update(dict.fromkeys(range(first, last)))
        return self.chunks[np.fromiter(slots, dtype=np.int64, count=len(slots))]


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
    total = int(bounds[-1])
    per_rank, n_batches = rank_window_counts(total, world_size, batch_size, drop_last)
    rounds = total // (world_size * batch_size)
    dealt = rounds * batch_size
    tail_start = world_size * dealt + int((per_rank[:rank] - dealt).sum())
    sizes = batch_sizes(int(per_rank[rank]), n_batches, batch_size)
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    return EpochPlan(
        chunks, bounds, world_size, batch_size, rounds, tail_start, offsets, group_batches,
        seed, epoch, rank, shuffle,
    )


def worker_batches(n_batches: int, *, start: int, worker: int, num_workers: int) -> range:
    """Batches of a rank that one DataLoader worker produces, from ``start`` on.

    DataLoader takes batches from its workers round-robin starting at worker 0, so worker ``w``
    produces batches ``start + w``, ``start + w + num_workers``, ... and the loop sees them in order.
    """
    return range(start + worker, n_batches, num_workers)
