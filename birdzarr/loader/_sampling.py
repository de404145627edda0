"""Pure, seeded planning of an epoch: which windows form which batch, on which rank and worker.

Everything here is a function of ``(counts, seed, epoch, world_size, batch_size, pool size,
drop_last, shuffle, num_workers)``; nothing reads data. ``counts[i]`` is the number of selected
windows of chunk ``i`` (the read unit: a chunk is fetched and decoded as a whole). An epoch is
built so that **every rank yields the same number of batches of the same size** and batch
membership is **redrawn every epoch**:

1. **Chunk order**: the chunks holding selected windows, permuted by ``(seed, epoch)`` (stored
   order when not shuffling); their selected windows, one chunk after another, are the epoch's
   window sequence.
2. **Ranks**: rank ``r`` takes a contiguous run of that sequence: ``n // world_size`` windows,
   one more for the first ``n % world_size`` ranks. Every rank then has
   ``ceil(largest share / batch_size)`` batches: full ones and one shorter last batch; in the one
   case where a share of one window less would be left a batch short (``n // world_size`` a
   multiple of ``batch_size``), that rank's last two batches hold ``batch_size - 1`` and 1
   windows. With ``drop_last`` every rank has ``(n // world_size) // batch_size`` full batches and
   the rest of its share (fewer than ``batch_size + 1`` windows) is not delivered this epoch.
   A chunk cut by a rank boundary is decoded by both ranks (at most ``world_size - 1`` a epoch).
3. **Pools** (shuffled): a rank's chunks (whole chunks first, the pieces cut by rank boundaries
   and the short ones last) are cut into pools at batch boundaries, so every batch but the last
   is full. The number of pools is a multiple of the number of DataLoader workers (each worker
   gets the same number of pools, and of batches give or take a chunk's), large enough that no
   pool holds more than ``pool_chunks`` chunks, or else one batch a pool. A worker's first pool
   holds about half as many batches as its other pools (a quicker first batch); each pool is
   decoded while the worker serves the one before, the first while it serves the previous
   epoch's last pool (``_pool``). A pool boundary
   falls on a chunk boundary where one lies within half a chunk's batches (and, with several
   workers, a tenth of a typical pool) of the even cut; else that chunk is decoded by both
   pools. A pool's windows are permuted uniformly (seeded by seed, epoch, rank and pool) and cut
   into batches; so each batch is a uniform sample of its pool, and a different one every
   epoch. Unshuffled, every batch is its own pool of consecutive windows (the stored order).
4. **Workers**: DataLoader worker ``w`` of ``k`` takes pools ``w, w + k, ...`` whole. DataLoader
   takes batches from its workers round-robin, skipping finished ones; ``delivery_order`` is that
   interleaving. Which windows form a batch depends on ``num_workers`` (the pools are sized for
   it); ``num_workers=0`` (reading in the training process) plans as one reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.ma  # noqa: F401  (np.unique's lazy import: loaded here, forked DataLoader workers inherit it
import numpy.random  # noqa: F401  instead of importing both, ~50 ms, before their first batch)

from birdzarr._errors import ArgumentError

_SEED_STREAM = 0xB1BD2A
LEAD_SHARE = 2  # a worker's first pool of an epoch holds about 1/LEAD_SHARE of its other pools


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([_SEED_STREAM, *[int(k) & 0xFFFFFFFFFFFFFFFF for k in key]])


def chunk_order(counts: np.ndarray, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Indices of the chunks holding selected windows: permuted by (seed, epoch), or stored order."""
    nonempty = np.flatnonzero(counts > 0)
    if not shuffle:
        return nonempty
    return nonempty[_rng(seed, epoch).permutation(len(nonempty))]


def rank_window_counts(
    total: int, world_size: int, batch_size: int, drop_last: bool
) -> tuple[np.ndarray, int]:
    """Windows per rank and batches per rank: an even split (the first ranks one window more);
    every rank has the same number of batches. With ``drop_last`` each rank's count is cut to
    its full batches."""
    if world_size < 1:
        raise ArgumentError("world_size must be positive")
    per_rank = np.full(world_size, total // world_size, dtype=np.int64)
    per_rank[: total % world_size] += 1
    if drop_last:
        n_batches = int(per_rank.min()) // batch_size
        return np.full(world_size, n_batches * batch_size, dtype=np.int64), n_batches
    if per_rank.min() == 0:
        raise ArgumentError(
            f"{total} windows cannot be split over {world_size} ranks (a rank would get none)")
    if batch_size == 1 and per_rank.min() < per_rank.max():
        # equal batch counts would give the ranks with a window fewer an empty batch
        raise ArgumentError(
            f"{total} windows cannot be split over {world_size} ranks in equal numbers of batches of "
            f"1 window; use drop_last=True or a batch_size above 1")
    return per_rank, -(-int(per_rank.max()) // batch_size)


def rank_starts(total: int, world_size: int) -> np.ndarray:
    """Where each rank's run starts in the epoch's window sequence (the even split's offsets)."""
    even = np.full(world_size, total // world_size, dtype=np.int64)
    even[: total % world_size] += 1
    return np.concatenate(([0], np.cumsum(even)[:-1])).astype(np.int64)


def batch_sizes(n_windows: int, n_batches: int, batch_size: int) -> np.ndarray:
    """A rank's batch sizes: full batches, then the rest; never an empty batch."""
    sizes = np.full(n_batches, batch_size, dtype=np.int64)
    if n_batches:
        sizes[-1] = n_windows - (n_batches - 1) * batch_size
        if sizes[-1] == 0:  # one window fewer than the ranks with a last batch
            sizes[-2:] = (batch_size - 1, 1)
    return sizes


@dataclass(frozen=True)
class Pool:
    """Windows shuffled together: pieces of chunks and the sizes of the batches cut from them.

    Piece ``j`` is the selected windows ``[lo[j], hi[j])`` (ranks among the chunk's selected
    windows) of chunk ``chunks[j]``.
    """

    chunks: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    sizes: np.ndarray  # batch sizes; their sum is the pool's windows

    @property
    def n_windows(self) -> int:
        return int((self.hi - self.lo).sum())


@dataclass(frozen=True)
class _Pieces:
    """A rank's windows as pieces of chunks, in the order they are cut into batches."""

    chunks: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @property
    def ends(self) -> np.ndarray:
        """Cumulative windows at the end of each piece."""
        return np.cumsum(self.hi - self.lo)

    def cut(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The pieces holding windows ``[start, stop)`` of the run, clipped to them."""
        ends = self.ends
        begins = ends - (self.hi - self.lo)
        first = int(np.searchsorted(ends, start, side="right"))
        last = int(np.searchsorted(begins, stop, side="left"))
        lo = self.lo[first:last] + np.maximum(start - begins[first:last], 0)
        hi = self.hi[first:last] - np.maximum(ends[first:last] - stop, 0)
        return self.chunks[first:last], lo, hi


def _rank_pieces(order: np.ndarray, counts: np.ndarray, start: int, stop: int) -> _Pieces:
    """The pieces of chunks (in ``order``) holding windows ``[start, stop)`` of the sequence."""
    whole = _Pieces(order, np.zeros(len(order), np.int64), counts[order].astype(np.int64))
    return _Pieces(*whole.cut(start, stop))


def _pool_bounds(pieces: _Pieces, n_batches: int, batch_size: int, n_pools: int, workers: int) -> np.ndarray:
    """Batch numbers where pools start (len n_pools + 1): each worker's batches spread over its
    pools (its first pool about half the others), the workers' totals within one batch
    of each other; a boundary moves to a
    chunk boundary (a batch boundary there) within half a chunk's batches and a tenth of the
    typical (median) pool, if one lies there."""
    per_worker = np.full(workers, n_batches // workers, dtype=np.int64)
    per_worker[: n_batches % workers] += 1
    rounds = n_pools // workers
    per_pool = np.empty(n_pools, dtype=np.int64)
    for w in range(workers):
        total = int(per_worker[w])
        # a worker's first pool holds about half the others: it is the one the next
        # epoch's prefetch decodes while the worker serves its last pool (in a second buffer)
        lead = max(1, -(-total // (LEAD_SHARE * rounds))) if rounds > 1 else total
        share = np.full(rounds - 1, (total - lead) // max(1, rounds - 1), dtype=np.int64)
        share[: (total - lead) % max(1, rounds - 1)] += 1
        per_pool[w::workers] = np.concatenate(([lead], share))
    bounds = np.concatenate(([0], np.cumsum(per_pool))).astype(np.int64)
    ends = pieces.ends
    aligned = np.unique(ends[ends % batch_size == 0] // batch_size)  # chunk ends on a batch boundary
    if len(aligned) == 0 or len(pieces.chunks) == 0:
        return bounds
    # at most half a chunk's batches, and (balance first) a tenth of a typical pool
    reach = int(np.median(pieces.hi - pieces.lo)) // batch_size // 2
    if workers > 1:
        reach = min(reach, int(np.median(per_pool)) // 10)
    for j in range(1, n_pools if reach > 0 else 1):
        at = int(np.searchsorted(aligned, bounds[j]))
        near = [int(a) for a in aligned[max(0, at - 1) : at + 1] if abs(int(a) - bounds[j]) <= reach]
        if near:
            best = min(near, key=lambda a: abs(a - bounds[j]))
            if bounds[j - 1] < best < bounds[j + 1]:
                bounds[j] = best
    return bounds


def _shuffled_pools(pieces: _Pieces, sizes: np.ndarray, batch_size: int, pool_chunks: int,
                    workers: int) -> list[Pool]:
    """Cut a rank's pieces into pools at batch boundaries (see the module's step 3)."""
    n_batches = len(sizes)
    if n_batches == 0:
        return []
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    n_pools = workers * -(-max(1, -(-len(pieces.chunks) // pool_chunks)) // workers)
    while True:
        if n_pools >= n_batches:  # one batch a pool
            n_pools = n_batches
            bounds = np.arange(n_batches + 1, dtype=np.int64)
        else:  # a multiple of the workers
            bounds = _pool_bounds(pieces, n_batches, batch_size, n_pools, workers)
        pools = []
        for j in range(n_pools):
            chunks, lo, hi = pieces.cut(int(offsets[bounds[j]]), int(offsets[bounds[j + 1]]))
            pools.append(Pool(chunks, lo, hi, sizes[bounds[j] : bounds[j + 1]].copy()))
        most = max(len(p.chunks) for p in pools)
        if n_pools == n_batches or most <= pool_chunks:
            return pools
        n_pools = workers * -(-max(n_pools + 1, n_pools * most // pool_chunks) // workers)


def _sequential_pools(pieces: _Pieces, sizes: np.ndarray) -> list[Pool]:
    """One pool per batch: consecutive selected windows of the run's chunks, in stored order."""
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    return [Pool(*pieces.cut(int(offsets[b]), int(offsets[b + 1])), sizes[b : b + 1].copy())
            for b in range(len(sizes))]


@dataclass(frozen=True)
class EpochPlan:
    """One rank's epoch: its pools and batches. Batches are numbered pool after pool.

    Immutable, with no cache: the batch numbering (``first_batch``, ``batch_pool``) is computed
    once by ``EpochPlan.of`` and held as read-only arrays.
    """

    pools: tuple[Pool, ...]
    seed: int
    epoch: int
    rank: int
    shuffle: bool
    first_batch: np.ndarray  # number of the first batch of each pool; len(pools) + 1
    batch_pool: np.ndarray  # the pool of each batch
    num_workers: int = 1  # the readers the pools were sized for

    @classmethod
    def of(cls, pools: Sequence[Pool], *, seed: int, epoch: int, rank: int, shuffle: bool,
           num_workers: int = 1) -> EpochPlan:
        """The plan of these pools, with its batch numbering."""
        per_pool = [len(p.sizes) for p in pools]
        first_batch = np.concatenate(([0], np.cumsum(per_pool))).astype(np.int64)
        batch_pool = np.repeat(np.arange(len(pools)), per_pool).astype(np.int64)
        first_batch.flags.writeable = batch_pool.flags.writeable = False
        return cls(tuple(pools), seed, epoch, rank, shuffle, first_batch, batch_pool, num_workers)

    @property
    def n_batches(self) -> int:
        return int(self.first_batch[-1])

    @property
    def n_windows(self) -> int:
        return int(sum(int(p.sizes.sum()) for p in self.pools))

    def pool_order(self, pool: int) -> np.ndarray:
        """The order of the pool's windows (positions in the concatenation of its pieces)."""
        n = self.pools[pool].n_windows
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return _rng(self.seed, self.epoch, self.rank, pool, 1).permutation(n)

    def batch_positions(self, batch: int, order: np.ndarray | None = None) -> np.ndarray:
        """Positions (in the pool's pieces) of one batch's windows, in the pool's permuted order.

        Rows keep the permutation's order, not the store's: any slice of a batch (a micro-batch
        of gradient accumulation) is then a uniform sample too, whatever order windows have
        inside a chunk. Gathering them costs the same as gathering ascending rows (0.5-0.6 ms
        for 8192 rows of a 524,288-window pool either way).
        """
        pool = int(self.batch_pool[batch])
        order = self.pool_order(pool) if order is None else order
        within = batch - int(self.first_batch[pool])
        start = int(self.pools[pool].sizes[:within].sum())
        return order[start : start + int(self.pools[pool].sizes[within])]

    def locate(self, pool: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pool positions -> (piece number, rank among that chunk's selected windows)."""
        p = self.pools[pool]
        bounds = np.concatenate(([0], np.cumsum(p.hi - p.lo)))
        piece = np.searchsorted(bounds, positions, side="right") - 1
        return piece, p.lo[piece] + positions - bounds[piece]

    def worker_pools(self, worker: int, num_workers: int) -> range:
        """The pools DataLoader worker ``worker`` of ``num_workers`` loads, in its order."""
        return range(worker, len(self.pools), max(1, num_workers))

    def worker_batches(self, worker: int, num_workers: int) -> np.ndarray:
        """The batches DataLoader worker ``worker`` of ``num_workers`` produces, in its order."""
        spans = [np.arange(self.first_batch[p], self.first_batch[p + 1])
                 for p in self.worker_pools(worker, num_workers)]
        return np.concatenate(spans).astype(np.int64) if spans else np.empty(0, np.int64)

    def delivery_order(self, num_workers: int) -> np.ndarray:
        """Batch numbers in the order a DataLoader with ``num_workers`` workers yields them."""
        return delivery_order([self.worker_batches(w, num_workers) for w in range(max(1, num_workers))])

    def decodes(self) -> int:
        """Chunk decodes this rank's epoch costs (a chunk cut by a pool boundary counts twice)."""
        return int(sum(len(p.chunks) for p in self.pools))


def delivery_order(per_worker: list[np.ndarray]) -> np.ndarray:
    """Round-robin over the workers' batch lists, skipping finished workers (DataLoader's order)."""
    if not per_worker:
        return np.empty(0, np.int64)
    rounds = max(len(b) for b in per_worker)
    padded = np.full((rounds, len(per_worker)), -1, dtype=np.int64)
    for w, batches in enumerate(per_worker):
        padded[: len(batches), w] = batches
    flat = padded.ravel()
    return flat[flat >= 0]


def resumed_worker(per_worker_counts: list[int], delivered: int, worker: int) -> tuple[int, int]:
    """After ``delivered`` batches, which original worker's list a restarted worker continues,
    and how many of that list's batches were already delivered.

    A fresh DataLoader starts its round-robin at worker 0, so worker ``j`` takes over the role of
    the worker that was due next plus ``j``; with each role's delivered batches skipped, the
    restarted loader yields exactly the rest of the uninterrupted order.
    """
    k = len(per_worker_counts)
    counts = np.asarray(per_worker_counts, dtype=np.int64)
    consumed = np.zeros(k, dtype=np.int64)
    remaining, rounds, due = int(delivered), 0, 0
    while remaining > 0:
        active = np.flatnonzero(counts > rounds)
        if len(active) == 0:
            break
        take = min(remaining, len(active))
        consumed[active[:take]] += 1
        remaining -= take
        due = int(active[take]) if take < len(active) else 0
        rounds += 1
    role = (due + worker) % k
    return role, int(consumed[role])


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
    pool_chunks: int,
    num_workers: int = 1,
) -> EpochPlan:
    """The plan of one rank for one epoch; ``counts[i]`` is the number of selected windows of
    chunk i; ``num_workers`` the DataLoader workers the pools are sized for (0 or 1: one reader)."""
    if not 0 <= rank < world_size:
        raise ArgumentError(f"rank {rank} is outside 0..{world_size - 1}")
    if batch_size < 1 or pool_chunks < 1:
        raise ArgumentError("batch_size and pool_chunks must be positive")
    workers = max(1, int(num_workers))
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    per_rank, n_batches = rank_window_counts(total, world_size, batch_size, drop_last)
    start = int(rank_starts(total, world_size)[rank])
    order = chunk_order(counts, seed=seed, epoch=epoch, shuffle=shuffle)
    pieces = _rank_pieces(order, counts, start, start + int(per_rank[rank]))
    sizes = batch_sizes(int(per_rank[rank]), n_batches, batch_size)
    if shuffle:
        # whole chunks first: pool boundaries can then fall on chunk boundaries
        lengths = pieces.hi - pieces.lo
        ragged = lengths != (lengths.max() if len(lengths) else 0)
        first = np.argsort(ragged, kind="stable")
        pieces = _Pieces(pieces.chunks[first], pieces.lo[first], pieces.hi[first])
        pools = _shuffled_pools(pieces, sizes, batch_size, pool_chunks, workers)
    else:
        pools = _sequential_pools(pieces, sizes)
    return EpochPlan.of(pools, seed=seed, epoch=epoch, rank=rank, shuffle=shuffle, num_workers=workers)
