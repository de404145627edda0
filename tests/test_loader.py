"""WindowDataset: exactly-once delivery, seeded order, workers, ranks, resume, subsets, values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import birdzarr
from birdzarr import ArgumentError
from tests.pool_support import with_pool_counts


def _dataset(store: birdzarr.Store, **options: object) -> birdzarr.WindowDataset:
    """small_store is device-ordered (many small chunks): these tests check delivery, not mixing."""
    options.setdefault("batch_size", 1000)
    options.setdefault("allow_device_order", True)
    return birdzarr.WindowDataset(store.url, **options)  # type: ignore[arg-type]


def _epoch_indices(ds: birdzarr.WindowDataset, num_workers: int = 0) -> list[np.ndarray]:
    """Indices of every batch of one rank, in the order a loader with ``num_workers`` yields them."""
    plan = ds.plan(num_workers=num_workers)
    return [ds.batch_indices(b, plan) for b in ds.delivery_order(num_workers)]


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(world_size=2, num_workers=0, batch_size=205, drop_last=True, buffer_batches=1, epoch=0)
# 30,000 // 3 = 10,000 a rank, a multiple of 1000: no rank has a rest, all batches full
@example(world_size=3, num_workers=2, batch_size=1000, drop_last=False, buffer_batches=2, epoch=1)
@given(
    world_size=st.integers(1, 4),
    num_workers=st.integers(0, 3),
    batch_size=st.integers(200, 9000),
    drop_last=st.booleans(),
    buffer_batches=st.integers(1, 3),
    epoch=st.integers(0, 3),
)
def test_every_window_exactly_once_per_epoch(
    small_store: birdzarr.Store,
    world_size: int,
    num_workers: int,
    batch_size: int,
    drop_last: bool,
    buffer_batches: int,
    epoch: int,
) -> None:
    """Every rank yields the same number of batches, all of ``batch_size`` but the last (which
    differs between ranks by at most one window); every window once over the ranks, or with
    drop_last each rank's rest (fewer than batch_size + 1 windows) left out."""
    n = len(small_store)
    if drop_last and batch_size * world_size > n:  # some rank would hold less than a batch
        with pytest.raises(ValueError, match="gives no batch in any epoch"):
            _dataset(small_store, batch_size=batch_size, drop_last=True, world_size=world_size)
        return
    sizes, delivered = [], []
    for rank in range(world_size):
        ds = _dataset(
            small_store,
            batch_size=batch_size,
            drop_last=drop_last,
            world_size=world_size,
            rank=rank,
            shuffle_buffer=buffer_batches * batch_size,
            seed=3,
        )
        ds.set_epoch(epoch)
        batches = _epoch_indices(ds, num_workers)
        assert len(batches) == len(ds)
        plan = ds.plan(num_workers=num_workers)
        sizes.append([len(ds.batch_indices(b, plan)) for b in range(len(ds))])
        delivered.extend(batches)
    share = n // world_size
    if drop_last:
        assert all(s == [batch_size] * (share // batch_size) for s in sizes)
    else:
        assert all(len(s) == -(-(share + (n % world_size > 0)) // batch_size) for s in sizes)
        for s in sizes:  # full batches but the last; in the one case a last batch would be empty, (B-1, 1)
            assert s[:-1] == [batch_size] * (len(s) - 1) or s[-2:] == [batch_size - 1, 1]
        assert max(s[-1] for s in sizes) - min(s[-1] for s in sizes) <= 1 or {s[-1] for s in sizes} == {1}
    flat = np.concatenate(delivered) if delivered else np.empty(0, dtype=np.int64)
    assert len(np.unique(flat)) == len(flat), "a window was delivered twice"
    if drop_last:
        assert len(flat) == world_size * (share // batch_size) * batch_size
    else:
        assert np.array_equal(np.sort(flat), np.arange(n))


@pytest.mark.slow
def test_batches_hold_the_stored_values(small_store: birdzarr.Store) -> None:
    ds = _dataset(small_store, batch_size=777, seed=5)
    plan = ds.plan()
    for batch, x in enumerate(ds):
        expected = small_store.windows[ds.batch_indices(batch, plan)]
        assert x.dtype == torch.float32 and tuple(x.shape[1:]) == (20, 4)
        assert np.array_equal(x.numpy(), expected)


def test_rows_of_a_batch_come_in_random_order(small_store: birdzarr.Store) -> None:
    """Any slice of a batch (a micro-batch) is a uniform sample too: rows keep the pool's
    permuted order, not the store's, here a store in device order held by one pool."""
    ds = birdzarr.WindowDataset(small_store.url, batch_size=256, seed=2, shuffle_buffer=len(small_store))
    plan = ds.plan()
    devices = small_store.window_devices[:]
    rising, first_quarter_devices = [], []
    for batch in range(len(ds)):
        indices = ds.batch_indices(batch, plan)
        if len(indices) < 256:
            continue
        # in stored order (even chunk by chunk) nearly every next row lies further on; at random, half
        rising.append(float(np.mean(np.diff(indices) > 0)))
        first_quarter_devices.append(len(np.unique(devices[indices[:64]])))
    assert 0.45 < float(np.mean(rising)) < 0.55
    # a quarter of a batch holds about as many devices as 64 uniformly drawn windows
    rng = np.random.default_rng(0)
    uniform = [len(np.unique(devices[rng.choice(len(devices), 64, replace=False)])) for _ in range(200)]
    assert abs(np.mean(first_quarter_devices) - np.mean(uniform)) < 0.5


def test_same_seed_and_epoch_give_the_same_batches_and_epochs_differ(small_store: birdzarr.Store) -> None:
    a, b = _dataset(small_store, seed=11), _dataset(small_store, seed=11)
    a.set_epoch(2)
    b.set_epoch(2)
    first = [x.clone() for x in a]
    assert all(torch.equal(x, y) for x, y in zip(first, b, strict=True))
    b.set_epoch(3)
    other = _epoch_indices(b)
    a_idx = _epoch_indices(a)
    assert not all(np.array_equal(x, y) for x, y in zip(a_idx, other, strict=True))
    c = _dataset(small_store, seed=12)
    c.set_epoch(2)
    assert not np.array_equal(_epoch_indices(c)[0], a_idx[0])


def test_unshuffled_order_is_the_stored_order(small_store: birdzarr.Store) -> None:
    ds = _dataset(small_store, shuffle=False, batch_size=4096)
    assert np.array_equal(np.concatenate(_epoch_indices(ds)), np.arange(len(small_store)))


def _expected(ds: birdzarr.WindowDataset, workers: int) -> list[torch.Tensor]:
    """What a loader with ``workers`` workers yields this epoch, read from the store by the
    indices the plan names, in ``delivery_order``."""
    store = birdzarr.open_store(ds.location.url)
    plan = ds.plan(num_workers=workers)
    return [torch.from_numpy(np.ascontiguousarray(store.windows[ds.batch_indices(b, plan)]))
            for b in ds.delivery_order(workers)]


@pytest.mark.slow
def test_forked_workers_yield_the_planned_batches(small_store: birdzarr.Store) -> None:
    """A loader with k workers yields the batches of the plan for k workers, in delivery_order();
    the number of batches and their sizes do not depend on k."""
    ds = _dataset(small_store, batch_size=1500, seed=2, shuffle_buffer=3000)
    ds.set_epoch(1)
    in_process = [x.clone() for x in ds]
    assert ds.delivery_order(0) == list(range(len(ds)))
    assert all(torch.equal(x, y) for x, y in zip(in_process, _expected(ds, 0), strict=True))
    for workers in (2, 3):
        loader = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="fork")
        got = list(loader)
        assert len(got) == len(in_process) == len(ds) == 20
        assert all(len(x) == 1500 for x in got)  # 30,000 windows: 20 full batches whatever k
        assert all(torch.equal(x, y) for x, y in zip(got, _expected(ds, workers), strict=True))


@pytest.mark.slow
def test_spawned_workers_after_the_main_process_has_read(small_store: birdzarr.Store) -> None:
    """A ``spawn`` worker (``forkserver``, Python 3.14's default on Linux, pickles the same way)
    gets the dataset pickled, also once this process has read batches and holds reader threads."""
    ds = _dataset(small_store, batch_size=1500, seed=2)
    in_process = [x.clone() for x in ds]
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    got = list(loader)
    expected = _expected(ds, 2)
    assert len(got) == len(expected) == len(in_process) == len(ds)
    assert all(torch.equal(x, y) for x, y in zip(got, expected, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [{"allow_device_order": True}, {"resident": "cpu"}],
                         ids=["streaming", "resident"])
def test_resume_mid_epoch_equals_uninterrupted(small_store: birdzarr.Store, mode: dict[str, object]) -> None:
    def dataset() -> birdzarr.WindowDataset:
        return birdzarr.WindowDataset(small_store.url, batch_size=900, seed=9, **mode)  # type: ignore[arg-type]

    full = dataset()
    full.set_epoch(4)
    expected = [x.clone() for x in full]
    first = dataset()
    first.set_epoch(4)
    iterator = iter(first)
    head = [next(iterator).clone() for _ in range(7)]
    state = first.state_dict()
    assert state["next_batch"] == 7 and state["epoch"] == 4
    resumed = dataset()
    resumed.load_state_dict(state)
    resumed.set_epoch(4)  # the usual loop calls set_epoch; the resume point of epoch 4 survives
    tail = [x.clone() for x in resumed]
    assert len(head) + len(tail) == len(expected)
    assert all(torch.equal(x, y) for x, y in zip(head + tail, expected, strict=True))
    resumed.set_epoch(5)
    assert len(list(resumed)) == len(resumed), "the next epoch starts from its first batch"


@pytest.mark.slow
def test_resume_with_workers_from_the_loop_count(small_store: birdzarr.Store) -> None:
    ds = _dataset(small_store, batch_size=1200, seed=1, shuffle_buffer=2048)
    expected = _expected(ds, 2)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    seen = 0
    for _ in loader:
        seen += 1
        if seen == 5:
            break
    state = ds.state_dict(batches_seen=seen)
    assert state["num_workers"] == 2
    again = _dataset(small_store, batch_size=1200, seed=1, shuffle_buffer=2048)
    again.load_state_dict(state)
    tail = list(DataLoader(again, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert len(tail) == len(expected) - 5
    assert all(torch.equal(x, y) for x, y in zip(tail, expected[5:], strict=True))
    other = _dataset(small_store, batch_size=1200, seed=1, shuffle_buffer=2048)
    other.load_state_dict(state)
    message = ("cannot resume: the resume point was counted with num_workers=2, this loader reads in "
               "the training process (num_workers=0); which windows form a batch and the order "
               "batches arrive in depend on num_workers. Resume with num_workers=2.")
    with pytest.raises(ValueError) as refused:
        next(iter(other))  # in-process is one reader: the order would differ
    assert str(refused.value) == message


@pytest.mark.slow
def test_resume_in_process_from_an_in_process_or_one_worker_state(small_store: birdzarr.Store) -> None:
    """num_workers=0 and 1 read the same batches in the same order: either resumes the other (a
    state saved in-process was refused as 'this loader has 1 worker')."""
    expected = _expected(_dataset(small_store, batch_size=1200, seed=1), 0)
    one = _dataset(small_store, batch_size=1200, seed=1)
    loader = DataLoader(one, batch_size=None, num_workers=1, multiprocessing_context="fork")
    for seen, _ in enumerate(loader, start=1):
        if seen == 4:
            break
    in_process = _dataset(small_store, batch_size=1200, seed=1)
    in_process.load_state_dict(one.state_dict(batches_seen=4))
    assert all(torch.equal(x, y) for x, y in zip(list(in_process), expected[4:], strict=True))
    head = _dataset(small_store, batch_size=1200, seed=1)
    iterator = iter(head)
    next(iterator), next(iterator), next(iterator)
    state = head.state_dict()
    assert state["num_workers"] == 1 and state["next_batch"] == 3
    for workers in (0, 1):
        again = _dataset(small_store, batch_size=1200, seed=1)
        again.load_state_dict(state)
        context = "fork" if workers else None
        tail = list(DataLoader(again, batch_size=None, num_workers=workers, multiprocessing_context=context))
        assert all(torch.equal(x, y) for x, y in zip(tail, expected[3:], strict=True)), workers


def test_resume_refuses_a_different_configuration(small_store: birdzarr.Store) -> None:
    state = _dataset(small_store, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        _dataset(small_store, seed=2).load_state_dict(state)


def test_ldt_rows_match_their_windows(tmp_path: object) -> None:
    from birdzarr.demo import _synthetic

    source = tmp_path / "csv"  # type: ignore[operator]
    _synthetic.make_csv_dir(source, n_devices=3, bursts_per_device=150, parts=2, seed=4, labelled=True)
    store = birdzarr.convert(source, tmp_path / "s.zarr", chunk_windows=256, progress=False)  # type: ignore[operator]
    ds = birdzarr.WindowDataset(store.url, batch_size=300, with_ldt=True, seed=3, shuffle_buffer=600)
    plan = ds.plan()
    for batch, (x, ldt) in enumerate(ds):
        idx = ds.batch_indices(batch, plan)
        assert ldt.dtype == torch.int64 and tuple(ldt.shape) == (len(x), 3)
        assert np.array_equal(x.numpy(), store.windows[idx])
        assert np.array_equal(ldt[:, 0].numpy(), store.labels[idx])
        assert np.array_equal(ldt[:, 1].numpy(), store.window_devices[idx])
        assert np.array_equal(ldt[:, 2].numpy(), store.timestamps[idx])
    assert (store.labels[:] >= 0).all()


def test_channel_first_and_transform(small_store: birdzarr.Store) -> None:
    plain = next(iter(_dataset(small_store, seed=1)))
    cf = next(iter(_dataset(small_store, seed=1, channel_first=True)))
    assert tuple(cf.shape[1:]) == (4, 20) and cf.is_contiguous()
    assert torch.equal(cf, plain.transpose(1, 2))
    doubled = next(iter(_dataset(small_store, seed=1, transform=lambda x: x * 2)))
    assert torch.equal(doubled, plain * 2)


def _all_indices(ds: birdzarr.WindowDataset) -> np.ndarray:
    return np.concatenate(_epoch_indices(ds))


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_device_filters_and_splits_are_disjoint_and_complete(small_store: birdzarr.Store) -> None:
    window_devices = small_store.window_devices[:]
    ids = sorted(small_store.devices["device_id"].tolist())
    some = ids[:3]
    chosen = _all_indices(_dataset(small_store, devices=some))
    assert np.array_equal(np.sort(chosen), np.flatnonzero(np.isin(window_devices, some)))
    rest = _all_indices(_dataset(small_store, exclude_devices=some))
    assert np.array_equal(np.sort(np.concatenate([chosen, rest])), np.arange(len(small_store)))
    for split_by in ("device", "window"):
        train = _all_indices(
            _dataset(small_store, split="train", split_by=split_by, val_fraction=0.25, split_seed=4)
        )
        val = _all_indices(
            _dataset(small_store, split="val", split_by=split_by, val_fraction=0.25, split_seed=4)
        )
        assert len(np.intersect1d(train, val)) == 0
        assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(len(small_store)))
        if split_by == "device":
            assert not set(window_devices[train]) & set(window_devices[val])
        else:
            assert 0.2 < len(val) / len(small_store) < 0.3
    other_seed = _all_indices(_dataset(small_store, split="val", val_fraction=0.25, split_seed=5))
    assert not np.array_equal(np.sort(other_seed), np.sort(val))
    with pytest.raises(KeyError, match="not in the store"):
        _dataset(small_store, devices=[123456789])


def test_shuffled_streaming_of_a_device_ordered_store_is_refused(small_store: birdzarr.Store) -> None:
    with pytest.raises(birdzarr.SamplingError, match=r"stored in device order.*--shuffle.*resident="):
        birdzarr.WindowDataset(small_store.url, batch_size=4096, shuffle_buffer=4096)
    # what is allowed: unshuffled reads, one device, a pool holding every chunk, or an opt-in
    assert len(birdzarr.WindowDataset(small_store.url, batch_size=4096, shuffle=False)) == 8
    one = int(small_store.devices["device_id"].iloc[0])
    birdzarr.WindowDataset(small_store.url, batch_size=4096, devices=[one], shuffle_buffer=4096)
    whole = birdzarr.WindowDataset(small_store.url, batch_size=4096)  # 30 chunks, a 256-chunk pool
    assert len(whole.plan().pools) == 1
    assert len(whole) == -(-len(small_store) // 4096)
    assert len(_dataset(small_store, batch_size=4096, drop_last=True)) == len(small_store) // 4096


@pytest.mark.slow
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_stateful_dataloader_resumes_exactly(
    small_store: birdzarr.Store, num_workers: int, persistent: bool
) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    reference = _dataset(small_store, batch_size=1100, seed=8, shuffle_buffer=3072)
    reference.set_epoch(1)
    expected = _expected(reference, num_workers)

    def loader_of(ds: birdzarr.WindowDataset) -> object:
        return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=num_workers,
                                           persistent_workers=persistent)

    first = _dataset(small_store, batch_size=1100, seed=8, shuffle_buffer=3072)
    loader = loader_of(first)
    assert len(list(loader)) == len(first)  # epoch 0, then stop inside epoch 1
    first.set_epoch(1)
    iterator = iter(loader)  # type: ignore[call-overload]
    head = [next(iterator).clone() for _ in range(6)]
    state = loader.state_dict()  # type: ignore[attr-defined]
    del iterator, loader
    again_ds = _dataset(small_store, batch_size=1100, seed=8, shuffle_buffer=3072)
    again = loader_of(again_ds)
    again.load_state_dict(state)  # type: ignore[attr-defined]
    again_ds.set_epoch(1)
    tail = [x.clone() for x in again]  # type: ignore[attr-defined]
    assert all(torch.equal(x, y) for x, y in zip(head + tail, expected, strict=True))
    again_ds.set_epoch(2)
    reference.set_epoch(2)
    following = [x.clone() for x in again]  # type: ignore[attr-defined]
    assert len(following) == len(expected), "the epoch after a resume is whole again"
    expected_2 = _expected(reference, num_workers)
    assert all(torch.equal(x, y) for x, y in zip(following, expected_2, strict=True))


@pytest.mark.slow
def test_damaged_chunks_raise_during_training(parquet_source, tmp_path) -> None:  # type: ignore[no-untyped-def]
    directory, _ = parquet_source
    store = birdzarr.convert(directory, tmp_path / "d.zarr", chunk_windows=2048, progress=False)
    chunk = tmp_path / "d.zarr" / "gimu_codes" / "c" / "3" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit that still decompresses
    chunk.write_bytes(bytes(data))
    with pytest.raises(birdzarr.MissingChunkError, match=r"gimu_codes/c/3/0/0.*crc32c"):
        list(_dataset(store, batch_size=4096))
    chunk.unlink()
    with pytest.raises(birdzarr.MissingChunkError, match=r"gimu_codes/c/3/0/0.*missing"):
        list(_dataset(store, batch_size=4096))


@pytest.mark.slow
def test_local_chunk_cache_serves_the_second_epoch(small_store: birdzarr.Store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    first = _dataset(small_store, seed=4, cache_dir=tmp_path / "cache", cache_max_bytes=2**30)
    epoch0 = [x.clone() for x in first]
    assert first._cache is not None and first._cache.misses > 0 and first._cache.hits == 0
    second = _dataset(small_store, seed=4, cache_dir=tmp_path / "cache", cache_max_bytes=2**30)
    epoch0_again = [x.clone() for x in second]
    assert second._cache is not None and second._cache.hits > 0 and second._cache.misses == 0
    assert all(torch.equal(x, y) for x, y in zip(epoch0, epoch0_again, strict=True))


@pytest.mark.slow
def test_batches_of_one_window_over_ranks_of_unequal_windows_are_refused() -> None:
    """5 windows over 2 ranks in batches of 1: equal batch counts would give rank 1 an empty
    batch (sizes [1, 0, 1] before); refused in one line, and drop_last works."""
    from birdzarr.loader._sampling import plan_epoch

    message = (r"^5 windows cannot be split over 2 ranks in equal numbers of batches of 1 window; "
               r"use drop_last=True or a batch_size above 1$")
    with pytest.raises(ArgumentError, match=message):
        plan_epoch(np.array([0, 0, 0, 5]), seed=1, epoch=0, world_size=2, rank=1, batch_size=1,
                   drop_last=False, shuffle=True, pool_chunks=1, num_workers=3)
    for rank in range(2):
        plan = plan_epoch(np.array([0, 0, 0, 5]), seed=1, epoch=0, world_size=2, rank=rank, batch_size=1,
                          drop_last=True, shuffle=True, pool_chunks=1, num_workers=3)
        assert [int(s) for p in plan.pools for s in p.sizes] == [1, 1]


@settings(max_examples=80, deadline=None)
@given(
    world_size=st.integers(1, 4),
    num_workers=st.integers(1, 4),
    counts=st.lists(st.integers(0, 100), min_size=4, max_size=60),
    pool_chunks=st.integers(1, 9),
    batch_size=st.integers(1, 250),
    drop_last=st.booleans(),
    epoch=st.integers(0, 5),
)
@pytest.mark.slow
def test_pools_are_balanced_and_hold_every_window_once(
    world_size: int, num_workers: int, counts: list[int], pool_chunks: int, batch_size: int,
    drop_last: bool, epoch: int,
) -> None:
    """Shuffled, whatever the ranks, workers, pool size and batch size: every selected window is
    in one pool of one rank (drop_last: each rank's rest is left out); a pool holds at most
    pool_chunks chunks, or one batch; every worker gets the same number of pools and
    about the same batches; pools cut at batch boundaries, so only the last batch is short."""
    from birdzarr.loader._sampling import plan_epoch

    chunk_counts = np.array(counts, dtype=np.int64)
    total = int(chunk_counts.sum())
    if total < world_size or (drop_last and total // world_size < batch_size):
        return
    if not drop_last and batch_size == 1 and total % world_size:  # no equal batches without an empty one
        with pytest.raises(ArgumentError, match="in equal numbers of batches of 1 window"):
            plan_epoch(chunk_counts, seed=1, epoch=epoch, world_size=world_size, rank=0, batch_size=1,
                       drop_last=False, shuffle=True, pool_chunks=pool_chunks, num_workers=num_workers)
        return
    seen: list[tuple[int, int]] = []
    for rank in range(world_size):
        plan = plan_epoch(chunk_counts, seed=1, epoch=epoch, world_size=world_size, rank=rank,
                          batch_size=batch_size, drop_last=drop_last, shuffle=True,
                          pool_chunks=pool_chunks, num_workers=num_workers)
        for pool in plan.pools:
            assert len(pool.chunks) <= pool_chunks or len(pool.sizes) == 1
            for chunk, lo, hi in zip(pool.chunks.tolist(), pool.lo.tolist(), pool.hi.tolist(), strict=True):
                assert 0 <= lo < hi <= chunk_counts[chunk]
                seen.extend((chunk, i) for i in range(lo, hi))
        sizes = np.concatenate([p.sizes for p in plan.pools])
        assert (sizes[:-2] == batch_size).all()
        pools_per_worker = [len(plan.worker_pools(w, num_workers)) for w in range(num_workers)]
        if len(plan.pools) < plan.n_batches:  # else one batch a pool: fewer batches than workers
            assert len(set(pools_per_worker)) == 1
    assert len(seen) == len(set(seen)), "a window is in two pools"
    if not drop_last:
        assert len(seen) == total


def test_one_reader_decodes_each_chunk_once_per_epoch(small_store: birdzarr.Store) -> None:
    """With a batch size dividing the chunk size, pool boundaries fall on chunk boundaries and
    every chunk is decoded once an epoch; otherwise a chunk cut by a pool boundary is decoded
    by both pools: ``plan.decodes()`` counts it, at most one more per pool boundary. A piece the
    buffer still holds from the pool before (the previous epoch's last) is not decoded again."""
    n_chunks = 30  # 29 chunks of 1024 windows and one of 304
    for batch_size, exact in ((512, True), (700, False)):
        ds = _dataset(small_store, batch_size=batch_size, seed=3, shuffle_buffer=5000)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            pool = ds._local().pool
            before = pool.decoded, pool.reused
            assert sum(len(x) for x in ds) == len(small_store)
            decoded, reused, plan = pool.decoded - before[0], pool.reused - before[1], ds.plan()
            assert decoded + reused == plan.decodes() <= n_chunks + len(plan.pools) - 1
            assert (plan.decodes() == n_chunks) == exact, (batch_size, decoded)
            assert reused == 0 or epoch == 1  # the first epoch decodes every piece


@pytest.mark.slow
def test_persistent_workers_follow_set_epoch_and_resume(small_store: birdzarr.Store) -> None:
    """Persistent workers keep their own dataset copy; epochs and resume points must reach them."""
    reference = _dataset(small_store, batch_size=700, seed=6, shuffle_buffer=4096)

    def epoch_of(epoch: int) -> list[torch.Tensor]:
        reference.set_epoch(epoch)
        return _expected(reference, 2)

    ds = _dataset(small_store, batch_size=700, seed=6, shuffle_buffer=4096)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    for epoch in (0, 1, 2):
        ds.set_epoch(epoch)
        got = [x.clone() for x in loader]
        assert len(got) == len(ds)
        assert all(torch.equal(x, y) for x, y in zip(got, epoch_of(epoch), strict=True)), epoch
    state = ds.state_dict(batches_seen=3)
    state["epoch"] = 1
    ds.load_state_dict(state)  # the workers are already running
    tail = [x.clone() for x in loader]
    assert all(torch.equal(x, y) for x, y in zip(tail, epoch_of(1)[3:], strict=True))
    assert len(tail) == len(ds) - 3
    ds.set_epoch(2)
    assert len([x for x in loader]) == len(ds)


def _with_reader_counts(batch: object) -> tuple[object, tuple[int, int, int]]:
    """collate_fn (it runs in the worker): the batch, and what the worker's pool buffers did."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    assert info is not None
    pool = info.dataset._local().pool  # type: ignore[attr-defined]
    return batch, (info.id, pool.prefetched, pool.discarded)


@pytest.mark.slow
def test_persistent_workers_start_each_epoch_on_a_prefetched_pool(small_store: birdzarr.Store) -> None:
    """A worker decodes its next pool while it serves the current one, while it serves its
    last pool its first pool of the next epoch, and once that last pool is gathered its second
    one, into the buffer it served from; a persistent worker's next epoch takes them (exactly
    the planned batches); a set_epoch or a resume point asking for something else drops them
    (still exactly the planned batches)."""
    options = {"batch_size": 500, "seed": 6, "shuffle_buffer": 4096}  # 6 pools a worker
    reference = _dataset(small_store, **options)
    ds = _dataset(small_store, **options)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork", collate_fn=_with_reader_counts)

    def epoch(number: int, skip: int = 0) -> dict[int, list[tuple[int, int]]]:
        """Each worker's (pools taken from a prefetch, prefetches dropped) at each of its batches."""
        reference.set_epoch(number)
        got = [(x.clone(), counts) for x, counts in loader]  # type: ignore[union-attr]
        expected = _expected(reference, 2)[skip:]
        assert len(got) == len(expected)
        assert all(torch.equal(x, y) for (x, _), y in zip(got, expected, strict=True)), number
        per_worker: dict[int, list[tuple[int, int]]] = {}
        for _, (worker, prefetched, discarded) in got:
            per_worker.setdefault(worker, []).append((prefetched, discarded))
        return per_worker

    ds.set_epoch(0)
    before = epoch(0)
    pools = len(ds.plan(num_workers=2).pools) // 2
    assert pools == 6
    # the first pool decoded on the spot, every later one taken from a prefetch
    assert {w: (c[0], c[-1]) for w, c in before.items()} == {w: ((0, 0), (pools - 1, 0)) for w in (0, 1)}
    for number in (1, 2):  # each worker's first pool came from its prefetch too
        ds.set_epoch(number)
        now = epoch(number)
        assert all(now[w][0] == (before[w][-1][0] + 1, 0) for w in (0, 1)), (number, now)
        before = now
    ds.set_epoch(2)  # epoch 2 again: the prefetches of epoch 3 (its first two pools) are dropped
    now = epoch(2)
    assert all(now[w][0] == (before[w][-1][0], 2) for w in (0, 1))
    ds.set_epoch(3)
    epoch(3)
    # a resume point in epoch 4, set while the workers hold its prefetched pools: exact, whichever
    # worker's list each restarted worker continues
    state = ds.state_dict(batches_seen=0)
    ds.load_state_dict({**state, "epoch": 4, "next_batch": 5})
    epoch(4, skip=5)
    ds.set_epoch(5)
    assert len(epoch(5)) == 2



@pytest.mark.slow
def test_a_worker_of_one_pool_an_epoch_decodes_the_next_epochs_first_batch_on_its_own(
    small_store: birdzarr.Store,
) -> None:
    """A worker whose epoch is one pool prefetches the next epoch's pool while it serves this one,
    which takes less time than the decode: the next epoch's first batch is decoded on its own
    ahead of that pool, so the epoch starts without waiting for the whole pool; every batch is
    the planned one. A resume point inside that pool serves its own batches (the early one
    unused); a set_epoch to another epoch drops the prefetch."""
    options = {"batch_size": 500, "seed": 6}
    reference = _dataset(small_store, **options)
    ds = _dataset(small_store, **options)
    assert len(ds.plan(num_workers=2).pools) == 2  # one pool a worker
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork",
                        collate_fn=with_pool_counts("early_batches", "prefetched"))

    def epoch(number: int, skip: int = 0) -> dict[int, tuple[int, int]]:
        """Each worker's (first batches decoded on their own, pools prefetched) at its last batch."""
        reference.set_epoch(number)
        got = [(x.clone(), counts) for x, counts in loader]  # type: ignore[union-attr]
        expected = _expected(reference, 2)[skip:]
        assert len(got) == len(expected)
        assert all(torch.equal(x, y) for (x, _), y in zip(got, expected, strict=True)), number
        return {worker: (early, prefetched) for _, (worker, early, prefetched) in got}

    for number in range(4):
        ds.set_epoch(number)
        assert epoch(number) == {w: (number, number) for w in (0, 1)}  # epoch 0 on the spot
    state = ds.state_dict(batches_seen=0)
    ds.load_state_dict({**state, "epoch": 4, "next_batch": 3})  # inside the prefetched pools
    # (a restarted worker may continue the other's list: its prefetch is then dropped)
    assert {w: early for w, (early, _) in epoch(4, skip=3).items()} == {0: 3, 1: 3}
    ds.set_epoch(7)  # not the epoch prefetched (5): decoded on the spot, nothing early
    assert {w: early for w, (early, _) in epoch(7).items()} == {0: 3, 1: 3}


_EVENTS: list[tuple[str, int, int]] = []  # in each worker: ("gather", 0, 0) or ("order", epoch, pool)


def _with_events(batch: object) -> tuple[object, tuple[int, list[tuple[str, int, int]]]]:
    """collate_fn (it runs in the worker): the batch, and this worker's gathers and orders so far."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    assert info is not None
    return batch, (info.id, list(_EVENTS))


@pytest.mark.slow
def test_a_persistent_worker_draws_each_pools_order_before_it_serves_it(
    small_store: birdzarr.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each pool's order is drawn once, and but for the iteration's first pool of epoch 0 (decoded
    on the spot) before the worker has gathered the last batch of the pool before it: when its
    prefetch is queued, not between two pools, where it would hold up the pool's first batch and
    the decode of the pool after it. The batches stay exactly the planned ones."""
    from birdzarr.loader import _dataset as dataset_module
    from birdzarr.loader._sampling import EpochPlan

    drawing, filling, early = EpochPlan.pool_order, dataset_module._pool_filler, dataset_module._early_filler

    def recorded(self: EpochPlan, pool: int) -> np.ndarray:
        _EVENTS.append(("order", self.epoch, pool))
        return drawing(self, pool)

    def counted(fill: object) -> object:
        def wrapped(*args: object) -> object:
            _EVENTS.append(("gather", 0, 0))
            return fill(*args)  # type: ignore[operator]
        return wrapped

    options = {"batch_size": 500, "seed": 6, "shuffle_buffer": 4096}  # 6 pools a worker
    reference = _dataset(small_store, **options)
    ds = _dataset(small_store, **options)
    monkeypatch.setattr(EpochPlan, "pool_order", recorded)
    monkeypatch.setattr(dataset_module, "_pool_filler", counted(filling))
    monkeypatch.setattr(dataset_module, "_early_filler", counted(early))
    _EVENTS.clear()
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork", collate_fn=_with_events)
    events: dict[int, list[tuple[str, int, int]]] = {}
    for number in range(3):
        ds.set_epoch(number)
        reference.set_epoch(number)
        got = [(x.clone(), found) for x, found in loader]  # type: ignore[union-attr]
        expected = _expected(reference, 2)
        assert len(got) == len(expected)
        assert all(torch.equal(x, y) for (x, _), y in zip(got, expected, strict=True)), number
        for _, (worker, seen) in got:
            events[worker] = seen
    for worker, seen in events.items():
        starts, gathered = {}, 0  # the gathers before each (epoch, pool) of this worker's is served
        for number in range(3):
            plan = reference.plan(number, num_workers=2)
            for pool in plan.worker_pools(worker, 2):
                starts[(number, pool)] = gathered
                gathered += int(plan.first_batch[pool + 1] - plan.first_batch[pool])
        drawn, gathers = [], 0
        for kind, number, pool in seen:
            if kind == "gather":
                gathers += 1
            elif number < 3:
                drawn.append(((number, pool), gathers))
        assert [key for key, _ in drawn] == list(starts)  # each pool's order once, in its order
        first = min(starts)
        assert all(at < starts[key] for key, at in drawn if key != first), (worker, drawn, starts)


@pytest.fixture(scope="module")
def shuffled_store(parquet_source, tmp_path_factory) -> birdzarr.Store:  # type: ignore[no-untyped-def]
    directory, _ = parquet_source
    dest = tmp_path_factory.mktemp("shuffled") / "shuffled.zarr"
    return birdzarr.convert(directory, dest, chunk_windows=1024, shuffle=True, seed=5, progress=False)


@pytest.mark.slow
def test_a_shuffled_store_gives_fresh_uniform_batches_every_epoch(shuffled_store: birdzarr.Store) -> None:
    """The three quality figures (docs/training.md#shuffle-quality) with the default settings'
    shape: pools of several chunks, batches of one chunk's size."""
    from birdzarr.loader._quality import pair_cooccurrence_ratio, quality_ratio, repeated_batch_fraction

    ds = birdzarr.WindowDataset(shuffled_store.url, batch_size=1024, shuffle_buffer=8 * 1024, seed=3)
    epochs = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        epochs.append(_epoch_indices(ds, 2))
    n = len(shuffled_store)
    devices = shuffled_store.window_devices[:]
    ids, counts = np.unique(devices, return_counts=True)
    assert quality_ratio([devices[b] for b in epochs[1]], ids, counts) < 1.3
    assert repeated_batch_fraction(epochs[0], epochs[1]) == 0.0
    # pools of G = 8 chunks of P = 1024 windows: about 1 - 1/G + n / (G * G * P) = 1.33
    assert pair_cooccurrence_ratio(epochs[0], epochs[1], n) < 2.0
    # the same figures for one chunk a batch ("shuffle once"): every batch comes back
    once = birdzarr.WindowDataset(shuffled_store.url, batch_size=1024, shuffle_buffer=1024, seed=3)
    again = [_epoch_indices(once)]
    once.set_epoch(1)
    again.append(_epoch_indices(once))
    assert repeated_batch_fraction(again[0], again[1]) > 0.9


@pytest.mark.slow
@pytest.mark.parametrize(
    "selection",
    [{}, {"devices": [200, 228, 249]}, {"exclude_devices": [200]}, {"split": "train"}, {"split": "val"},
     {"split": "train", "split_by": "window"}],
    ids=["all", "devices", "exclude", "train", "val", "window-split"],
)
@pytest.mark.parametrize("order", ["device", "shuffled"])
def test_memory_is_one_pool_buffer_for_every_selection(
    small_store: birdzarr.Store, shuffled_store: birdzarr.Store, selection: dict[str, object], order: str
) -> None:
    """The reader owns exactly one pool buffer of pool_chunks chunks and reuses it: nothing is
    allocated per chunk or per epoch, whatever the subset (a subset's masked copies once leaked)."""
    store = small_store if order == "device" else shuffled_store
    ds = _dataset(store, batch_size=500, shuffle_buffer=4096, with_ldt=True, **selection)
    buffers = ds._local().pool
    seen = []
    for epoch in (0, 1, 2):
        ds.set_epoch(epoch)
        assert sum(len(x) for x, _ in ds) == ds.windows_per_epoch
        seen.append((buffers.capacity, buffers.gimu.__array_interface__["data"][0], buffers.gimu.nbytes))
    pools = [p for e in (0, 1, 2) for p in ds.plan(e).pools]
    chunks = max(len(p.chunks) for p in pools)  # the largest pool of the three epochs
    # at most pool_chunks, unless one batch spans more (a small selection of every chunk: val)
    assert buffers.capacity == chunks and ds.pool_chunks == 4
    assert all(len(p.chunks) <= 4 or len(p.sizes) == 1 for p in pools)
    assert len(set(seen)) == 1, "the pool buffer was reallocated"
    assert buffers.gimu.nbytes == chunks * 1024 * 320
    assert {name: array.nbytes for name, array in buffers.ldt.items()} == {
        "label": chunks * 1024 * 4, "device": chunks * 1024 * 4, "timestamp": chunks * 1024 * 8}


def test_state_dict_format_round_trips_and_options_fail_at_once(small_store: birdzarr.Store) -> None:
    """The saved format (version 4) is what ResumeState reads and writes; bad options fail in the
    constructor, before the store is read; the options and the plan are immutable."""
    import dataclasses

    from birdzarr.loader._state import ResumeState

    ds = _dataset(small_store, seed=3)
    iterator = iter(ds)
    next(iterator), next(iterator)
    state = ds.state_dict()
    selection = {"store_windows": 30_000, "store_shuffle_seed": None, "shuffle": True, "drop_last": False,
                 "devices": None, "exclude_devices": None, "split": None, "split_by": None,
                 "val_fraction": None, "split_seed": None}
    assert state == {"version": 4, "seed": 3, "epoch": 0, "world_size": 1, "rank": 0, "batch_size": 1000,
                     "pool_chunks": ds.pool_chunks, "resident": False, "selection": selection,
                     "next_batch": 2, "num_workers": 1}
    assert ResumeState.from_dict(state).to_dict() == state
    # a state saved before the selection was recorded resumes as it did
    older = {k: v for k, v in state.items() if k != "selection"}
    assert ResumeState.from_dict(older).to_dict() == {**older, "selection": None}
    _dataset(small_store, seed=3).load_state_dict(older)
    in_worker = {**{k: v for k, v in state.items() if k != "next_batch"},
                 "start": 4, "start_workers": 2, "worker_yielded": 3, "num_workers": 2}
    assert ResumeState.from_dict(in_worker).to_dict() == in_worker
    with pytest.raises(ValueError, match="state version 3"):
        ds.load_state_dict({**state, "version": 3})
    for options, message in [({"batch_size": 0}, "batch_size must be positive"),
                             ({"shuffle_buffer": 0}, "shuffle_buffer must be positive"),
                             ({"world_size": 2, "rank": 2}, r"rank 2 is outside 0\.\.1"),
                             ({"split": "test"}, "split must be one of"),
                             ({"split": "val", "split_by": "bird"}, "split_by must be one of"),
                             ({"split": "val", "val_fraction": 1.5}, "val_fraction must be between")]:
        with pytest.raises(ValueError, match=message):
            _dataset(small_store, **options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ds.config.batch_size = 7  # type: ignore[misc]
    assert (ds.config.seed, ds.config.world_size) == (3, 1)  # ds.seed, ...: deprecated spellings
    assert not ds.plan().batch_pool.flags.writeable and not ds.plan().first_batch.flags.writeable


def _plan_members(
    counts: np.ndarray, epoch: int, world: int, workers: int
) -> tuple[list[np.ndarray], list[int]]:
    """Every batch of an epoch over all ranks as window ids (chunk x 32,768 + rank in the chunk),
    from the plan alone, and the windows each (rank, worker) reader serves."""
    from birdzarr.loader._sampling import plan_epoch

    batches, work = [], []
    for rank in range(world):
        plan = plan_epoch(counts, seed=1, epoch=epoch, world_size=world, rank=rank, batch_size=8192,
                          drop_last=False, shuffle=True, pool_chunks=16, num_workers=workers)
        orders = [plan.pool_order(pool) for pool in range(len(plan.pools))]  # once a pool, as a reader
        for batch in range(plan.n_batches):
            pool = int(plan.batch_pool[batch])
            piece, within = plan.locate(pool, plan.batch_positions(batch, orders[pool]))
            batches.append(plan.pools[pool].chunks[piece] * 32_768 + within)
        work += [sum(plan.pools[p].n_windows for p in plan.worker_pools(w, workers)) for w in range(workers)]
    return batches, work


@pytest.mark.parametrize(
    ("windows", "world", "workers", "most_cooccurrence", "most_share"),
    # the default pool (16 chunks of a --shuffle store's 32,768 windows), batch 8192
    [(100_000, 1, 2, 1.7, 1.15), (600_000, 1, 2, 1.1, 1.1), (600_000, 2, 2, 2.2, 1.1),
     (2_500_000, 1, 2, 1.4, 1.1), (2_500_000, 2, 2, 1.8, 1.1), (2_500_000, 1, 15, 4.0, 1.25)],
)
@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_default_pools_are_balanced_and_mix_well_at_any_size(
    windows: int, world: int, workers: int, most_cooccurrence: float, most_share: float
) -> None:
    """The figures docs/training.md#shuffle-quality states, from the plan alone: no repeated
    batch, pair co-occurrence under the bound, and no reader serving more than its share by
    more than the bound (a 0.6 M-window store's 18 chunks made pools of 16 and 2 chunks: one
    worker did 89%). 15 workers share 77 chunks: pool boundaries kept on chunk boundaries
    (every chunk decoded once) leave one worker 1.2x its share."""
    from birdzarr.loader._quality import pair_cooccurrence_ratio, repeated_batch_fraction

    counts = np.full(-(-windows // 32_768), 32_768, dtype=np.int64)
    counts[-1] = windows - 32_768 * (len(counts) - 1)
    (first, work), (second, _) = (_plan_members(counts, e, world, workers) for e in (0, 1))
    assert repeated_batch_fraction(first, second) == 0.0
    cooccurrence = pair_cooccurrence_ratio(first, second, len(counts) * 32_768)
    assert cooccurrence <= most_cooccurrence
    assert max(work) <= most_share * windows / (world * workers), work
    print(f"{windows:,} windows, {world} rank(s) x {workers} workers: co-occurrence {cooccurrence:.2f}, "
          f"largest share {max(work) * world * workers / windows:.2f}")
