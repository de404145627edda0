"""An iteration's first batch is decoded on its own, ahead of the rest of its pool
(birdzarr/loader/_pool.py, ``PoolBuffers.start``): the same values, the rest of the epoch exact."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import birdzarr
from birdzarr.loader import _pool
from tests.pool_support import with_pool_counts


def _dataset(store: birdzarr.Store, **options: object) -> birdzarr.WindowDataset:
    options.setdefault("batch_size", 700)
    options.setdefault("shuffle_buffer", 6000)
    options.setdefault("allow_device_order", True)
    return birdzarr.WindowDataset(store.url, **options)  # type: ignore[arg-type]


def _expected(
    ds: birdzarr.WindowDataset, store: birdzarr.Store, workers: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each batch's windows and (label, device, time) rows read from the store at the plan's indices."""
    plan = ds.plan(num_workers=workers)
    out = []
    for b in ds.delivery_order(workers):
        indices = ds.batch_indices(b, plan)
        ldt = [store.labels[indices], store.window_devices[indices], store.timestamps[indices]]
        out.append((store.windows[indices], np.stack(ldt, axis=1)))
    return out


@pytest.mark.parametrize("selection", [{}, {"exclude_devices": "first"}], ids=["all", "subset"])
def test_the_first_batch_is_served_before_its_pool_is_decoded(
    small_store: birdzarr.Store, monkeypatch: pytest.MonkeyPatch, selection: dict[str, object]
) -> None:
    """With the decode of every chunk of the pool held back, the iteration's first batch still
    comes, with the stored values and ldt; released, the rest of the epoch is exact."""
    if selection:
        selection = {"exclude_devices": [int(small_store.devices.device_id[0])]}
    ds = _dataset(small_store, with_ldt=True, seed=4, **selection)
    expected = _expected(ds, small_store)
    release, decoded = threading.Event(), []
    load_chunk = _pool.PoolBuffers._load_chunk

    def held(self: _pool.PoolBuffers, *args: int) -> np.ndarray:
        assert release.wait(60), "the first batch never came"
        decoded.append(args[2])
        return load_chunk(self, *args)

    monkeypatch.setattr(_pool.PoolBuffers, "_load_chunk", held)
    iterator = iter(ds)
    x, ldt = next(iterator)
    assert decoded == []  # no chunk of the pool decoded yet
    assert np.array_equal(x.numpy(), expected[0][0]) and np.array_equal(ldt.numpy(), expected[0][1])
    assert ds._local().pool.early_batches == 1
    release.set()
    rest = list(iterator)
    assert len(rest) == len(expected) - 1 and decoded
    for (x, ldt), (want_x, want_ldt) in zip(rest, expected[1:], strict=True):
        assert np.array_equal(x.numpy(), want_x) and np.array_equal(ldt.numpy(), want_ldt)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_each_iteration_decodes_its_first_batch_ahead_and_a_dropped_one_is_settled(
    small_store: birdzarr.Store,
) -> None:
    """Every iteration in this process decodes its first batch ahead once; an iteration dropped
    after its first batch (its pool still decoding) is superseded by the next, which is exact."""
    ds = _dataset(small_store, seed=9)
    pool = ds._local().pool
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        expected = [x for x, _ in _expected(ds, small_store)]
        dropped = iter(ds)
        first = next(dropped)
        assert isinstance(first, torch.Tensor) and np.array_equal(first.numpy(), expected[0])
        # a new iteration while the dropped one's pool decodes
        got = [x.numpy() for x in ds if isinstance(x, torch.Tensor)]
        assert len(got) == len(expected)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
        with pytest.raises(RuntimeError, match="superseded"):
            next(dropped)
    assert pool.early_batches == 4


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_format_1_store_loads_its_first_pool_whole(small_store_v1: birdzarr.Store) -> None:
    """Version 1 chunks decode whole either way: no batch is decoded on its own; batches exact."""
    ds = _dataset(small_store_v1, seed=2)
    expected = [x for x, _ in _expected(ds, small_store_v1)]
    got = [x.numpy() for x in ds if isinstance(x, torch.Tensor)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert ds._local().pool.early_batches == 0



@pytest.mark.slow
def test_persistent_workers_decode_only_epoch_0s_first_batch_ahead(small_store: birdzarr.Store) -> None:
    """Each worker decodes its first batch of epoch 0 ahead of its pool; later epochs start on
    the pool prefetched during the previous one (no batch decoded on its own). Every batch exact."""
    ds = _dataset(small_store, seed=6)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork",
                        collate_fn=with_pool_counts("early_batches", "prefetched"))
    for epoch in (0, 1, 2):
        ds.set_epoch(epoch)
        expected = [x for x, _ in _expected(ds, small_store, 2)]
        got = [(x.clone(), counts) for x, counts in loader]  # type: ignore[union-attr]
        assert len(got) == len(expected)
        assert all(torch.equal(x, torch.from_numpy(y)) for (x, _), y in zip(got, expected, strict=True))
        early = {worker: n for _, (worker, n, _) in got}
        assert early == {0: 1, 1: 1}, (epoch, early)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_store_read_through_a_chunk_cache_reads_each_chunk_once(
    small_store: birdzarr.Store, tmp_path: object
) -> None:
    """Decoding the first batch on its own reads its chunks twice: not done through a chunk cache
    (a remote store's bytes), where every chunk of the first epoch is fetched once."""
    # one pool: no chunk is cut between two pools (each of which would read it)
    ds = _dataset(small_store, seed=4, shuffle_buffer=2**19, cache_dir=tmp_path,  # type: ignore[arg-type]
                  cache_max_bytes=2**30)
    expected = [x for x, _ in _expected(ds, small_store)]
    got = [x.numpy() for x in ds if isinstance(x, torch.Tensor)]
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert ds._local().pool.early_batches == 0
    assert ds._cache is not None and ds._cache.hits == 0 and ds._cache.misses > 0


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_reader_of_one_pool_decodes_it_whole(small_store: birdzarr.Store) -> None:
    """A reader whose iteration is one pool (a small selection) decodes it whole: decoding its
    first batch on its own would read every chunk of its epoch twice."""
    ds = _dataset(small_store, seed=5, shuffle_buffer=2**19)
    assert len(ds.plan().pools) == 1
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        expected = [x for x, _ in _expected(ds, small_store)]
        got = [x.numpy() for x in ds if isinstance(x, torch.Tensor)]
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert ds._local().pool.early_batches == 0
