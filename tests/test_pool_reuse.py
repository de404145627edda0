"""A pool whose pieces a reader's buffers already hold is not decoded again
(birdzarr/loader/_pool.py, ``PoolBuffers._arrange``): a small store's epochs after the first cost
no decode in the training process; a worker keeps its last two pools across the epoch boundary.
Every batch stays exactly the planned one, every window once an epoch, resume exact."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import birdzarr
from birdzarr.loader._sampling import Pool
from tests.pool_support import with_pool_counts


@pytest.fixture(scope="module")
def shuffled(parquet_source, tmp_path_factory) -> birdzarr.Store:  # type: ignore[no-untyped-def]
    """30,000 windows of 12 devices, shuffled, in 30 chunks of 1024 (the last 304)."""
    directory, _ = parquet_source
    dest = tmp_path_factory.mktemp("reuse") / "shuffled.zarr"
    return birdzarr.convert(directory, dest, chunk_windows=1024, shuffle=True, seed=5, progress=False)


_STORED: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _stored(store: birdzarr.Store) -> tuple[np.ndarray, np.ndarray]:
    """Every window of a (small) store and its (label, device, time) rows, read once."""
    if store.url not in _STORED:
        n = len(store)
        ldt = np.stack([store.labels[:n], store.window_devices[:n], store.timestamps[:n]], axis=1)
        _STORED[store.url] = (np.asarray(store.windows[:n]), ldt)
    return _STORED[store.url]


def _expected(ds: birdzarr.WindowDataset, store: birdzarr.Store, workers: int = 0
              ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each batch of this epoch in delivery order: its window indices, windows and ldt rows,
    read from the store at the indices the plan names."""
    windows, ldt = _stored(store)
    plan = ds.plan(num_workers=workers)
    out = []
    for b in ds.delivery_order(workers):
        idx = ds.batch_indices(b, plan)
        out.append((idx, windows[idx], ldt[idx]))
    return out


def _check_epoch(got: list[tuple[torch.Tensor, torch.Tensor]],
                 expected: list[tuple[np.ndarray, np.ndarray, np.ndarray]], n_windows: int) -> None:
    assert len(got) == len(expected)
    for (x, ldt), (_, want_x, want_ldt) in zip(got, expected, strict=True):
        assert np.array_equal(x.numpy(), want_x) and np.array_equal(ldt.numpy(), want_ldt)
    every = np.concatenate([idx for idx, _, _ in expected])
    assert len(every) == n_windows and len(np.unique(every)) == n_windows  # each window once


_FILTERED = pytest.param({"exclude_devices": "first"}, marks=pytest.mark.slow)


@pytest.mark.parametrize("selection", [{}, _FILTERED], ids=["all", "subset"])
def test_a_reader_of_one_pool_decodes_its_chunks_only_in_the_first_epoch(
    shuffled: birdzarr.Store, selection: dict[str, object]
) -> None:
    """In the training process, a selection that is one pool an epoch (a small store) decodes
    its chunks in epoch 0 only; every later epoch is a new order of exactly the same windows,
    every batch and its ldt the stored values."""
    if selection:
        selection = {"exclude_devices": [int(shuffled.devices.device_id[0])]}
    ds = birdzarr.WindowDataset(shuffled.url, batch_size=1000, seed=3, shuffle_buffer=2**16,
                                with_ldt=True, **selection)  # type: ignore[arg-type]
    assert len(ds.plan().pools) == 1
    chunks = int((ds.counts > 0).sum())
    pool = ds._local().pool
    orders = []
    for epoch in range(4):
        ds.set_epoch(epoch)
        expected = _expected(ds, shuffled)
        _check_epoch([(x, ldt) for x, ldt in ds], expected, ds.n_selected)
        orders.append(np.concatenate([idx for idx, _, _ in expected]))
        assert (pool.decoded, pool.reused) == (chunks, chunks * epoch)
    assert all(not np.array_equal(a, b) for a, b in zip(orders, orders[1:], strict=False))


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_resuming_across_the_epoch_boundary_is_exact(shuffled: birdzarr.Store) -> None:
    """A resume point in epoch 1, loaded into the dataset that read epoch 0 (its buffer holds the
    pool) and into a fresh one (it decodes): the same rest of the epoch, from the stored values."""
    options = {"batch_size": 700, "seed": 8, "shuffle_buffer": 2**16, "with_ldt": True}
    ds = birdzarr.WindowDataset(shuffled.url, **options)  # type: ignore[arg-type]
    for _ in ds:
        pass
    ds.set_epoch(1)
    expected = _expected(ds, shuffled)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    del it
    for reader in (ds, birdzarr.WindowDataset(shuffled.url, **options)):  # type: ignore[arg-type]
        reader.load_state_dict(state)
        rest = [(x, ldt) for x, ldt in reader]
        assert len(rest) == len(expected) - 5
        for (x, ldt), (_, want_x, want_ldt) in zip(rest, expected[5:], strict=True):
            assert np.array_equal(x.numpy(), want_x) and np.array_equal(ldt.numpy(), want_ldt)
    assert ds._local().pool.decoded == int((ds.counts > 0).sum())  # epoch 1 decoded nothing



@pytest.mark.slow
def test_persistent_workers_reuse_the_pools_they_hold_and_stay_exact_and_balanced(
    shuffled: birdzarr.Store,
) -> None:
    """Two persistent workers over a store of a few pools a worker: from epoch 1 on some pieces
    come from the banks instead of a decode (decodes + reused = what the plans name); every batch
    is the planned one, every window once an epoch, the workers' batches within one of each other."""
    ds = birdzarr.WindowDataset(shuffled.url, batch_size=1024, seed=4, shuffle_buffer=4 * 1024,
                                with_ldt=True)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork", collate_fn=with_pool_counts("decoded", "reused"))
    planned = 0
    last: dict[int, tuple[int, int]] = {}
    for epoch in range(4):
        ds.set_epoch(epoch)
        expected = _expected(ds, shuffled, workers=2)
        got = [(batch, counts) for batch, counts in loader]  # type: ignore[misc]
        _check_epoch([batch for batch, _ in got], expected, len(shuffled))  # type: ignore[misc]
        per_worker = [sum(1 for _, (w, _, _) in got if w == worker) for worker in (0, 1)]
        assert abs(per_worker[0] - per_worker[1]) <= 1
        for _, (worker, decoded, reused) in got:
            last[worker] = (decoded, reused)
        planned += ds.plan(num_workers=2).decodes()
    # the last batch's counts include the prefetch of epoch 4's first pools only once taken: none
    decoded = sum(d for d, _ in last.values())
    reused = sum(r for _, r in last.values())
    assert reused > 0 and decoded + reused == planned


def test_pieces_held_by_either_bank_are_kept_copied_or_served_as_they_are(shuffled: birdzarr.Store) -> None:
    """PoolBuffers directly: a prefetch copies what the bank being served holds and decodes the
    rest; a pool loaded on the spot keeps what its bank holds in place; a pool one bank holds
    whole is served from it. Windows and ldt equal the stored ones every time."""
    ds = birdzarr.WindowDataset(shuffled.url, batch_size=1000, seed=1, with_ldt=True)
    buffers = ds._local().pool
    width = 1024

    def pool(*pieces: tuple[int, int, int]) -> Pool:
        chunks, lo, hi = (np.array(column, dtype=np.int64) for column in zip(*pieces, strict=True))
        return Pool(chunks, lo, hi, np.array([int((hi - lo).sum())]))

    def check(p: Pool, key: object = None, prefetched: bool = False) -> None:
        if prefetched:
            buffers.prefetch(key, p)
        loaded = buffers.load(p, key)
        pieces = zip(p.chunks.tolist(), p.lo.tolist(), p.hi.tolist(), strict=True)
        idx = np.concatenate([np.arange(c * width + lo, c * width + hi) for c, lo, hi in pieces])
        assert np.array_equal(loaded.gimu[loaded.rows], shuffled.windows[idx])
        assert loaded.ldt is not None
        assert np.array_equal(loaded.ldt["label"][loaded.rows], shuffled.labels[idx])
        assert np.array_equal(loaded.ldt["timestamp"][loaded.rows], shuffled.timestamps[idx])

    check(pool((0, 0, 1024), (1, 0, 1024), (2, 0, 1024)))  # bank 0: decoded
    assert (buffers.decoded, buffers.reused) == (3, 0)
    check(pool((2, 100, 900), (3, 0, 1024)), "a", prefetched=True)  # bank 1: chunk 2 copied from bank 0
    assert (buffers.decoded, buffers.reused) == (4, 1)
    check(pool((3, 0, 500), (1, 0, 1024), (4, 0, 1024)))  # bank 0: 1 kept, 3 copied, 4 decoded
    assert (buffers.decoded, buffers.reused) == (5, 3)
    check(pool((4, 10, 20), (1, 5, 1000)), "b", prefetched=True)  # held whole by bank 0: served from it
    assert (buffers.decoded, buffers.reused) == (5, 5)
    check(pool((0, 0, 1024),))  # chunk 0 was forgotten when bank 0 took the pool of chunks 3, 1, 4
    assert (buffers.decoded, buffers.reused) == (6, 5)


def test_a_format_1_stores_held_pieces_are_reused_exactly(small_store_v1: birdzarr.Store) -> None:
    """Version 1 decodes whole chunks, each window where it lies in its slot: the pieces held
    (here a selection's, some windows of a chunk) map to those rows; batches stay exact."""
    keep = [int(d) for d in small_store_v1.devices.device_id[1:]]
    ds = birdzarr.WindowDataset(small_store_v1.url, batch_size=30, seed=2, shuffle_buffer=256,
                                allow_device_order=True, with_ldt=True, devices=keep)
    assert len(ds.plan().pools) == 1 and (ds.counts < 64).any()  # one pool, a chunk in part
    pool = ds._local().pool
    for epoch in range(3):
        ds.set_epoch(epoch)
        _check_epoch([(x, ldt) for x, ldt in ds], _expected(ds, small_store_v1), ds.n_selected)
    assert (pool.decoded, pool.reused) == (4, 8)


def test_a_prefetch_draws_its_pools_order_once_its_decodes_are_queued(shuffled: birdzarr.Store) -> None:
    """prefetch(key, pool, order): the pool's order is drawn by the caller once the pool's decodes
    are queued (they run meanwhile: the fetch threads, which a worker waits for, do not draw it),
    and handed over with the pool when its key is asked for, so serving the pool draws nothing;
    a pool started on the spot has none, and a prefetch nobody takes is dropped with it."""
    ds = birdzarr.WindowDataset(shuffled.url, batch_size=1000, seed=1, shuffle_buffer=4096)
    buffers = ds._local().pool
    plan = ds.plan()
    assert len(plan.pools) > 2
    drawn: list[tuple[str, int]] = []

    def order_of(pool: int) -> object:
        def draw() -> np.ndarray:
            drawn.append((threading.current_thread().name, len(buffers._pending)))
            return plan.pool_order(pool)
        return draw

    buffers.prefetch("a", plan.pools[1], order_of(1))  # type: ignore[arg-type]
    assert drawn == [("MainThread", 1)]  # at prefetch, its decodes queued (pending)
    loading = buffers.start(plan.pools[1], "a")
    assert np.array_equal(loading.order(), plan.pool_order(1))  # type: ignore[arg-type]
    assert len(drawn) == 1 and buffers.prefetched == 1
    loading.wait()
    assert buffers.start(plan.pools[2], "b").order() is None  # on the spot: the caller draws it
    buffers.prefetch("c", plan.pools[0], order_of(0))  # type: ignore[arg-type]
    loading = buffers.start(plan.pools[0], "d")  # another key: the prefetch is dropped
    assert loading.order() is None and buffers.discarded == 1
    loaded = loading.wait()
    pieces = zip(plan.pools[0].chunks.tolist(), plan.pools[0].lo.tolist(), plan.pools[0].hi.tolist(),
                 strict=True)
    idx = np.concatenate([np.arange(c * 1024 + lo, c * 1024 + hi) for c, lo, hi in pieces])
    assert np.array_equal(loaded.gimu[loaded.rows], shuffled.windows[idx])


def test_a_prefetch_into_the_served_bank_waits_beside_the_other_banks(shuffled: birdzarr.Store) -> None:
    """prefetch(..., served=True) decodes into the bank of the pool served last (the caller has
    gathered every batch of it) while a prefetch into the other bank is pending: both are taken,
    in either order, with the stored values; a start asking for neither drops both."""
    ds = birdzarr.WindowDataset(shuffled.url, batch_size=1000, seed=1, shuffle_buffer=4096,
                                with_ldt=True)
    buffers = ds._local().pool
    plan = ds.plan()
    assert len(plan.pools) > 4

    def stored(p: Pool) -> np.ndarray:
        pieces = zip(p.chunks.tolist(), p.lo.tolist(), p.hi.tolist(), strict=True)
        return shuffled.windows[np.concatenate([np.arange(c * 1024 + lo, c * 1024 + hi)
                                                for c, lo, hi in pieces])]

    def served(number: int, key: object = None) -> None:
        loaded = buffers.load(plan.pools[number], key)
        assert np.array_equal(loaded.gimu[loaded.rows], stored(plan.pools[number]))

    served(0)
    for first, second in ((1, 2), (4, 3)):  # taken in the planned order, then the other way
        buffers.prefetch(("p", first), plan.pools[first])
        buffers.prefetch(("p", second), plan.pools[second], served=True)
        buffers.prefetch(("p", second), plan.pools[second], served=True)  # started already: kept
        assert buffers.prefetching(plan.pools[first], ("p", first))
        assert buffers.prefetching(plan.pools[second], ("p", second))
        banks = buffers.prefetched
        for number in (first, second) if first < second else (second, first):
            served(number, ("p", number))
        assert buffers.prefetched == banks + 2 and buffers.discarded == 0
    buffers.prefetch(("p", 0), plan.pools[0])
    buffers.prefetch(("p", 1), plan.pools[1], served=True)
    served(2, "another")  # neither: both dropped, the pool decoded on the spot
    assert buffers.discarded == 2
