"""Resident mode (CPU here): the selection held once, a full permutation every epoch."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import birdzarr
from birdzarr.loader import _resident as resident_module
from birdzarr.loader._shared_dictionaries import MAX_ENTRIES, share_dictionaries
from tests.format1_support import format1_copy


def _resident(store: birdzarr.Store, **options: object) -> birdzarr.WindowDataset:
    options.setdefault("batch_size", 1000)
    options.setdefault("resident", "cpu")
    return birdzarr.WindowDataset(store.url, **options)  # type: ignore[arg-type]


def _epoch(ds: birdzarr.WindowDataset) -> list[np.ndarray]:
    return [ds.batch_indices(b) for b in range(len(ds))]


@pytest.mark.slow
def test_values_ldt_and_layout_equal_the_store(small_store_v1: birdzarr.Store) -> None:
    small_store = small_store_v1  # a version-1 store: its dict16 codes are held as they are
    ds = _resident(small_store, batch_size=77, seed=5, with_ldt=True, channel_first=True)
    assert ds.resident.x.dtype == torch.int16, "a dict16 store stays dictionary-coded in memory"
    n = len(small_store)
    # 16 bits a value; gps_speed, one value a window in this data as in real exports, held once
    assert ds.resident.x.numel() * ds.resident.x.element_size() == n * 122
    # plus each chunk's dictionaries, held once however many chunks share a value
    per_chunk = sum(4 * len(d) for c in range(small_store.reader.n_chunks)
                    for d in small_store.reader.read_codes(c)[1])  # type: ignore[index]
    assert n * 122 < ds.resident.nbytes < n * 122 + n * 16 + per_chunk
    seen = []
    for batch, (x, ldt) in enumerate(ds):
        idx = ds.batch_indices(batch)
        assert x.dtype == torch.float32 and tuple(x.shape[1:]) == (4, 20)
        assert np.array_equal(x.numpy(), small_store.windows[idx].transpose(0, 2, 1))
        assert np.array_equal(ldt[:, 1].numpy(), small_store.window_devices[idx])
        assert np.array_equal(ldt[:, 2].numpy(), small_store.timestamps[idx])
        seen.append(idx)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(len(small_store)))


@pytest.mark.slow
@pytest.mark.parametrize("codes", [True, False])
def test_rows_of_a_batch_come_in_random_order(small_store: birdzarr.Store, codes: bool) -> None:
    """A slice of a batch (a micro-batch) is a uniform sample too, on this device-ordered store:
    rows come in the permutation's order, and hold the values of the indices reported."""
    ds = _resident(small_store, batch_size=500, seed=3, resident_codes=codes, progress=False)
    rising = []
    for batch, x in enumerate(ds):
        idx = ds.batch_indices(batch)
        assert np.array_equal(x.numpy(), small_store.windows[idx])
        rising.append(float(np.mean(np.diff(idx) > 0)))  # stored order: 1.0; random: 0.5
    assert 0.45 < float(np.mean(rising)) < 0.55


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_window_once_over_ranks_with_equal_batch_counts(
    small_store: birdzarr.Store, world_size: int, drop_last: bool
) -> None:
    ranks = [_resident(small_store, batch_size=1300, world_size=world_size, rank=r, seed=4,
                       drop_last=drop_last, progress=False) for r in range(world_size)]
    assert len({len(ds) for ds in ranks}) == 1
    flat = np.concatenate([i for ds in ranks for i in _epoch(ds)])
    assert len(np.unique(flat)) == len(flat)
    if drop_last:
        assert all(len(i) == 1300 for ds in ranks for i in _epoch(ds))
        assert len(flat) == (len(small_store) // world_size // 1300) * 1300 * world_size
    else:
        assert np.array_equal(np.sort(flat), np.arange(len(small_store)))


def test_a_new_uniform_permutation_every_epoch_from_seed_and_epoch(small_store: birdzarr.Store) -> None:
    a, b = _resident(small_store, seed=7), _resident(small_store, seed=7)
    a.set_epoch(3)
    b.set_epoch(3)
    assert all(np.array_equal(x, y) for x, y in zip(_epoch(a), _epoch(b), strict=True))
    b.set_epoch(4)
    first = {np.sort(i).tobytes() for i in _epoch(a)}
    assert not any(np.sort(i).tobytes() in first for i in _epoch(b)), "no batch comes back"
    # a batch is a uniform sample: its device mix matches the store's (device-ordered store!)
    from birdzarr.loader._quality import quality_ratio

    devices = small_store.window_devices[:]
    ids, counts = np.unique(devices, return_counts=True)
    assert quality_ratio([devices[i] for i in _epoch(b)], ids, counts) < 1.3


@pytest.mark.slow
def test_workers_share_one_copy_and_keep_the_order(small_store: birdzarr.Store) -> None:
    ds = _resident(small_store, batch_size=900, seed=2)
    ds.set_epoch(1)
    in_process = [x.clone() for x in ds]
    assert ds.resident.x.is_shared()
    got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert len(got) == len(in_process)
    assert all(torch.equal(x, y) for x, y in zip(got, in_process, strict=True))


def test_refused_before_loading_when_it_does_not_fit(
    small_store: birdzarr.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = (1_000_000, "the job's memory limit (test)")
    monkeypatch.setattr(resident_module, "memory_limit", lambda: limit)
    with pytest.raises(birdzarr.ResidentMemoryError,
                       match=r"30,000 windows as 16-bit dictionary codes\) needs \d\.\d MiB, but the job's "
                             r"memory limit \(test\) is 1\.0 MiB\. Stream instead"):
        _resident(small_store)


def test_a_gps_speed_that_varies_within_a_window_is_held_in_every_sample(tmp_path: pathlib.Path) -> None:
    """One window whose gps_speed changes mid-window, in the store's last chunk (a version-1
    store, tests/data/format1/varying_gps.zarr): the load starts again with all 80 codes a
    window, and every value is exact, on the host and in torch ops."""
    store = birdzarr.open_store(format1_copy("varying_gps.zarr", tmp_path))
    held = _resident(store, progress=False).resident
    assert held.layout is not None and held.layout.width == 80 and tuple(held.x.shape) == (250, 80)
    rows = np.random.default_rng(0).permutation(250)[:90]
    expected = store.windows[held.global_index[rows]]
    assert np.array_equal(held._decode_on_host(rows), expected)
    assert np.array_equal(held._gather_with_torch(torch.from_numpy(rows)).numpy(), expected)


@pytest.mark.slow
def test_a_standard_store_is_held_as_float32(tmp_path: pathlib.Path) -> None:
    store = birdzarr.open_store(format1_copy("standard.zarr", tmp_path))  # version 1's standard chain
    ds = _resident(store, batch_size=16, seed=1)
    assert ds.resident.x.dtype == torch.float32
    for batch, x in enumerate(ds):
        assert np.array_equal(x.numpy(), store.windows[ds.batch_indices(batch)])


def test_the_torch_gather_a_gpu_runs_equals_the_store(small_store_v1: birdzarr.Store) -> None:
    """The gather and dict16 decode that run on a GPU are torch ops: run here on the CPU."""
    small_store = small_store_v1  # a version-1 store's dict16 codes
    rows = torch.from_numpy(np.random.default_rng(0).permutation(len(small_store))[:700])
    for codes in (True, False):
        held = _resident(small_store, with_ldt=True, resident_codes=codes, progress=False).resident
        assert (held.table is not None) == codes
        idx = held.global_index[rows.numpy()]
        assert np.array_equal(held._gather_with_torch(rows).numpy(), small_store.windows[idx])
        expected = np.stack([small_store.labels[idx], small_store.window_devices[idx],
                             small_store.timestamps[idx]], axis=1)
        assert np.array_equal(held._ldt_with_torch(rows).numpy(), expected)


def test_packed_ldt_keeps_every_int64_timestamp() -> None:
    """ldt is held as int32 rows; timestamps past 2038, before 1970 and near the limits survive."""
    seconds = np.array([0, 2**31, 2**40 + 5, -3, -(2**62), 2**63 - 1, 1_700_000_000], dtype=np.int64)
    n = len(seconds)
    packed = np.empty((n, 4), np.int32)
    packed[:, 0], packed[:, 1] = np.arange(n) - 1, np.arange(n) * 7
    packed[:, 2:] = resident_module.timestamp_halves(seconds)
    held = resident_module.ResidentSelection(
        torch.device("cpu"), torch.zeros((n, 20, 4)), None, None, None, torch.from_numpy(packed),
        np.arange(n, dtype=np.int64))
    expected = np.stack([np.arange(n) - 1, np.arange(n) * 7, seconds], axis=1)
    order = np.array([3, 0, 6, 5, 1, 4, 2])
    assert np.array_equal(held._ldt_with_torch(torch.from_numpy(order)).numpy(), expected[order])
    x, ldt = np.empty((n, 20, 4), np.float32), np.empty((n, 3), np.int64)
    held.filler(order)(x, ldt)
    assert np.array_equal(ldt, expected[order])


def test_consecutive_chunks_share_dictionaries_and_every_code_keeps_its_value() -> None:
    """Chunks of 30,000 values a channel, each overlapping the last: a union of more than
    65,536 values must start a new group; every code still finds its exact bit pattern."""
    rng = np.random.default_rng(7)
    special = np.array([0.0, -0.0, np.inf, -np.inf], dtype=np.float32)
    nan_payload = np.array([0x7FC00001], dtype=np.uint32).view(np.float32)
    pool = np.unique(rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32))
    # drop random draws equal to the special values (a dictionary holds each value once) and
    # NaNs (only the one with a payload, added below)
    pool = pool[~np.isnan(pool.view(np.float32)) & ~np.isin(pool, special.view(np.uint32))]
    dictionaries, codes, starts = [], [], [0]
    for chunk in range(6):
        per_channel = []
        for channel in range(4):
            start = chunk * 20_000 + channel * 1_000  # 10,000 values shared with the chunk before
            values = np.concatenate([special, nan_payload, pool[start : start + 30_000].view(np.float32)])
            per_channel.append(rng.permutation(values))  # a chunk's dictionary in any order
        dictionaries.append(per_channel)
        windows = 50 + chunk
        codes.append(np.stack([rng.integers(0, 30_005, size=(windows, 20)) for _ in range(4)], axis=2))
        starts.append(starts[-1] + windows)
    held = np.concatenate(codes).astype(np.uint16)
    expected = np.empty(held.shape, dtype=np.uint32)
    for i in range(6):
        for c in range(4):
            rows = slice(starts[i], starts[i + 1])
            expected[rows, :, c] = dictionaries[i][c].view(np.uint32)[held[rows, :, c]]
    columns = [slice(c, 80, 4) for c in range(4)]  # sample-major rows of 80 codes
    shared = share_dictionaries(dictionaries, held.reshape(len(held), 80), np.array(starts), columns,
                                threads=3)
    # chunks 0+1 hold 50,005 values a channel; chunk 2 would add 20,000 more: 3 groups of 2
    assert shared.groups == 3
    assert np.array_equal(shared.offsets[::2], shared.offsets[1::2])
    sizes = np.diff(np.append(np.unique(shared.offsets), len(shared.values)))
    assert sizes.max() <= MAX_ENTRIES
    got = np.empty(held.shape, dtype=np.uint32)
    for i in range(6):
        for c in range(4):
            rows = slice(starts[i], starts[i + 1])
            index = shared.offsets[i, c] + held[rows, :, c].astype(np.int64)
            got[rows, :, c] = shared.values.view(np.uint32)[index]
    assert np.array_equal(got, expected)  # bit for bit: -0.0, infinities and the NaN payload too


def test_a_device_ordered_store_holds_fewer_dictionary_values_than_its_chunks(
    small_store_v1: birdzarr.Store,
) -> None:
    small_store = small_store_v1  # version 1's per-chunk dictionaries, shared when held
    held = _resident(small_store, progress=False).resident
    reader = small_store.reader
    per_chunk = 0
    for chunk in range(reader.n_chunks):
        got = reader.read_codes(chunk)
        assert got is not None
        per_chunk += sum(len(d) for d in got[1])
    assert held.table is not None and held.table.numel() < per_chunk  # values chunks share, held once


def _expected(reference: birdzarr.WindowDataset, store: birdzarr.Store, epoch: int, skip: int = 0
              ) -> list[np.ndarray]:
    """The windows of an epoch's batches, from a plan drawn directly: ``reference`` is never
    iterated, so it never has a plan prepared ahead."""
    reference.set_epoch(epoch)
    return [store.windows[reference.batch_indices(b)] for b in range(skip, len(reference))]


def test_len_counts_batches_without_drawing_a_permutation(small_store: birdzarr.Store) -> None:
    for world_size, drop_last in ((1, False), (3, False), (2, True)):
        ds = _resident(small_store, batch_size=700, world_size=world_size, rank=world_size - 1,
                       drop_last=drop_last, progress=False)
        counted = (len(ds), ds.windows_per_epoch, repr(ds))
        assert ds.resident.plans_drawn == 0, "len(), windows_per_epoch and repr() only count"
        plan = ds._resident_plan()
        assert ds.resident.plans_drawn == 1
        assert counted[:2] == (plan.n_batches, int(plan.offsets[-1]))
        # the plan holds this rank's rows only (8 B a window of the rank), not the whole permutation
        assert plan.order.untyped_storage().nbytes() == 8 * ds.windows_per_epoch


def _ahead(ds: birdzarr.WindowDataset) -> tuple[int, int, int]:
    """This process's next-epoch plans: (started ahead, taken when their epoch began, dropped)."""
    ahead = ds._local().ahead
    return ahead.prepared, ahead.taken, ahead.discarded


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_the_next_epochs_plan_is_drawn_ahead_in_process(small_store: birdzarr.Store) -> None:
    """Iterated in this process: once an epoch's first batch is out, the next epoch's plan is
    being drawn; that epoch takes it (exactly the batches of a plan drawn directly); a set_epoch
    elsewhere drops it; a resume point inside the prepared epoch is exact."""
    options = {"batch_size": 700, "seed": 11, "progress": False}
    ds, reference = _resident(small_store, **options), _resident(small_store, **options)
    for epoch in (0, 1, 2):
        ds.set_epoch(epoch)
        iterator = iter(ds)
        first = next(iterator).clone()
        # before the next epoch's iterator exists, its plan is under way
        assert _ahead(ds) == (epoch + 1, epoch, 0), epoch
        got = [first] + [x.clone() for x in iterator]
        expected = _expected(reference, small_store, epoch)
        assert len(got) == len(expected) == len(ds)
        assert all(np.array_equal(x.numpy(), y) for x, y in zip(got, expected, strict=True)), epoch
    ds.set_epoch(7)  # not the prepared epoch 3: dropped, epoch 7 drawn on the spot
    got = [x.clone() for x in ds]
    assert _ahead(ds) == (4, 2, 1)
    assert all(np.array_equal(x.numpy(), y) for x, y in zip(got, _expected(reference, small_store, 7),
                                                               strict=True))
    # epoch 8 was prepared during epoch 7: a resume point inside it, on a fresh iteration
    ds.set_epoch(8)
    iterator = iter(ds)
    head = [next(iterator).clone() for _ in range(2)]
    state = ds.state_dict()
    del iterator
    ds.load_state_dict(state)
    tail = [x.clone() for x in ds]
    assert _ahead(ds)[1] == 3, "epoch 8 came from its prepared plan"
    expected = _expected(reference, small_store, 8)
    assert len(head) + len(tail) == len(expected)
    assert all(np.array_equal(x.numpy(), y) for x, y in zip(head + tail, expected, strict=True))


def _with_plan_counts(batch: object) -> tuple[object, tuple[int, int, int, int]]:
    """collate_fn (it runs in the worker): the batch, and the worker's plans drawn ahead."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    assert info is not None
    ahead = info.dataset._local().ahead  # type: ignore[attr-defined]
    return batch, (info.id, ahead.prepared, ahead.taken, ahead.discarded)


@pytest.mark.slow
def test_persistent_workers_start_each_epoch_on_a_plan_drawn_ahead(small_store: birdzarr.Store) -> None:
    """Each persistent worker draws the next epoch's plan while it serves this one; the next
    epoch takes it (exactly the batches of plans drawn directly, as with 0 workers); a set_epoch
    elsewhere drops it; a resume point inside a prepared epoch is exact."""
    options = {"batch_size": 700, "seed": 12, "progress": False}
    ds, reference = _resident(small_store, **options), _resident(small_store, **options)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork", collate_fn=_with_plan_counts)

    def epoch(number: int, skip: int = 0) -> dict[int, tuple[int, int, int]]:
        """Each worker's (prepared, taken, discarded) at its first batch of the epoch."""
        got = [(x.clone(), counts) for x, counts in loader]  # type: ignore[union-attr]
        expected = _expected(reference, small_store, number, skip)
        assert len(got) == len(expected)
        assert all(np.array_equal(x.numpy(), y) for (x, _), y in zip(got, expected, strict=True)), number
        first: dict[int, tuple[int, int, int]] = {}
        for _, (worker, *counts) in got:
            first.setdefault(worker, tuple(counts))  # type: ignore[arg-type]
        return first

    for number in (0, 1, 2):
        ds.set_epoch(number)
        # at its first batch a worker has started the next epoch's plan and taken this one's
        assert epoch(number) == {w: (number + 1, number, 0) for w in (0, 1)}, number
    ds.set_epoch(5)  # the prepared epoch 3 is dropped
    assert epoch(5) == {w: (4, 2, 1) for w in (0, 1)}
    state = ds.state_dict(batches_seen=0)
    ds.load_state_dict({**state, "epoch": 6, "next_batch": 3})  # inside the prepared epoch 6
    assert epoch(6, skip=3) == {w: (5, 3, 1) for w in (0, 1)}


def test_a_version2_selection_is_held_in_one_row_a_window_on_the_host(small_store: birdzarr.Store) -> None:
    """On the host a window's codes, dictionary row and gps_speed lie in one 128-byte row
    (``HeldCodes.packed``, in shared memory), of which ``codes``, ``row`` and ``gps`` are views:
    nothing else is held a window, and every batch, from 0 and 2 DataLoader workers, equals the
    store (ldt included)."""
    ds = _resident(small_store, batch_size=700, seed=6, with_ldt=True, progress=False)
    coded = ds.resident.coded
    n = len(small_store)
    assert coded is not None and coded.packed is not None
    assert coded.packed.dtype == torch.int16 and tuple(coded.packed.shape) == (n, 64)
    assert coded.packed.is_shared()
    for view, column in ((coded.codes, 0), (coded.row, 60), (coded.gps, 62)):
        assert view.untyped_storage().data_ptr() == coded.packed.untyped_storage().data_ptr()
        assert view.data_ptr() == coded.packed.data_ptr() + 2 * column
        assert view.stride(0) * view.element_size() == 128
    assert coded.nbytes == n * 128 + 4 * (coded.values.numel() + coded.offsets.numel())
    expected = [ds.batch_indices(b) for b in range(len(ds))]
    for workers in (0, 2):
        loader = DataLoader(ds, batch_size=None, num_workers=workers,
                            multiprocessing_context="fork" if workers else None)
        got = list(loader)
        assert len(got) == len(expected)
        for (x, ldt), idx in zip(got, expected, strict=True):
            assert np.array_equal(x.numpy().view(np.uint32), small_store.windows[idx].view(np.uint32))
            assert np.array_equal(ldt[:, 1].numpy(), small_store.window_devices[idx])
            assert np.array_equal(ldt[:, 2].numpy(), small_store.timestamps[idx])


@pytest.mark.parametrize("gps_once", [True, False])
def test_the_host_decode_of_the_packed_rows_equals_arrays_of_their_own(
    small_store: birdzarr.Store, gps_once: bool
) -> None:
    """``decode_host`` reads the host layout (one row a window) or, where codes, row and gps_speed
    are arrays of their own (``packed=None``, as ``HeldCodes.to`` gives a GPU), gathers them into it: the same
    values, bit for bit, as the torch ops and the documented lookup, gps_speed once a window or
    in every sample (NaN payloads and -0.0 kept), rows repeated, in a 102-column row for the latter."""
    held = _resident(small_store, progress=False).resident.coded
    assert held is not None
    n = len(held.row)
    rng = np.random.default_rng(7)
    packed, codes, gps, row = resident_module.HeldCodes.host_layout(n, gps_once, shared=False)
    assert tuple(packed.shape) == (n, 64 if gps_once else 102)
    codes.copy_(held.codes)
    row.copy_(held.row)
    speeds = rng.standard_normal(gps.shape).astype(np.float32)
    speeds.reshape(-1)[:3] = np.array([0x7FC00123, 0xFFC00001, 0x80000000], np.uint32).view(np.float32)
    gps.copy_(torch.from_numpy(speeds))
    in_rows = resident_module.HeldCodes(codes, gps, row, held.values, held.offsets, packed)
    apart = in_rows.to(torch.device("cpu"))  # what a GPU is given: each an array of its own
    assert apart.packed is None and all(t.is_contiguous() for t in (apart.codes, apart.gps, apart.row))
    picked = np.concatenate([rng.permutation(n)[:1500], [0, 0, n - 1]])
    start = (held.offsets[:, :3] - resident_module.CODE_BIAS).numpy()
    expected = np.empty((len(picked), 20, 4), np.float32)
    true_codes = (held.codes.numpy().view(np.uint16) ^ np.uint16(resident_module.CODE_BIAS)).astype(np.int64)
    expected[:, :, :3] = held.values.numpy()[start[held.row.numpy()[picked]][:, None, :] + true_codes[picked]]
    expected[:, :, 3] = speeds[picked][:, None] if gps_once else speeds[picked]
    rows = torch.from_numpy(picked)
    for decoded in (in_rows.decode_host(picked), apart.decode_host(picked), in_rows.decode(rows).numpy(),
                    apart.decode(rows).numpy()):
        assert np.array_equal(decoded.view(np.uint32), expected.view(np.uint32))
