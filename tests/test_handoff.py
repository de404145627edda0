"""Batches handed from DataLoader workers through reused shared-memory slots (read/_handoff.py).

A slot may be reused only after every tensor made from it in the receiving process is gone; these
tests hold, view, drop and compare batches to catch a slot overwritten while still in use.
"""

from __future__ import annotations

import gc
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import birdzarr
from birdzarr.loader import _handoff
from birdzarr.loader._sink import SharedBatch

pytestmark = [
    pytest.mark.slow,  # DataLoader worker processes in every test
    pytest.mark.filterwarnings("ignore:.*stored in device order"),
    pytest.mark.skipif(not _handoff.AVAILABLE, reason="needs os.memfd_create (Linux)"),
]


def _through_torch(url: str, **options: object) -> list[object]:
    """The batches a 2-worker loader yields through torch's own transport (no slots): the
    reference for the slot path (the pools are sized for the 2 workers, so the in-process
    batches differ)."""
    ds = birdzarr.WindowDataset(url, reuse_batch_memory=False, **options)  # type: ignore[arg-type]
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    return [tuple(t.clone() for t in b) if isinstance(b, tuple | list) else b.clone() for b in loader]


def _send(slot: _handoff.Slot, fields: list[tuple[str, tuple[int, ...], int]]) -> object:
    """Through the pickler DataLoader uses, back into this process (a worker's fd via DupFd)."""
    return pickle.loads(ForkingPickler.dumps(SharedBatch(slot, fields)))


def test_a_slot_is_reused_only_after_every_tensor_and_view_is_freed() -> None:
    ring = _handoff.SlotRing(8 * 4 + 8 * 3 * 8, keep=2)
    slot = ring.acquire()
    slot.data[:32].view(np.float32)[:] = np.arange(8, dtype=np.float32)
    slot.data[32:].view(np.int64)[:] = np.arange(24)
    slot.lease()
    x, ldt = _send(slot, [("float32", (8,), 0), ("int64", (8, 3), 32)])  # type: ignore[misc]
    assert torch.equal(x, torch.arange(8, dtype=torch.float32))
    assert torch.equal(ldt, torch.arange(24).view(8, 3))
    view = x[2:5]
    as_numpy = ldt.numpy()
    del x, ldt
    gc.collect()
    assert slot.leased and ring.acquire() is not slot  # views still use it
    del view
    gc.collect()
    assert slot.leased  # the numpy view of ldt still does
    del as_numpy
    gc.collect()
    assert not slot.leased
    assert ring.acquire() is slot


def test_the_ring_keeps_at_most_keep_free_slots() -> None:
    ring = _handoff.SlotRing(64, keep=2)
    held = []
    for _ in range(5):
        slot = ring.acquire()
        slot.lease()
        held.append(_send(slot, [("float32", (16,), 0)]))
    assert len(ring) == 5
    del held
    gc.collect()
    ring.acquire()
    assert len(ring) == 2
    ring.retire()


def _mapped_slots(pid: int) -> int:
    """Batch slots a worker has mapped (each slot is one mapping of its memfd)."""
    with open(f"/proc/{pid}/maps") as maps:
        return sum("birdzarr-batch" in line for line in maps)


@pytest.mark.parametrize("options", [{}, {"with_ldt": True, "channel_first": True}])
def test_workers_reuse_slots_and_every_batch_holds_its_values(
    small_store: birdzarr.Store, options: dict[str, bool]
) -> None:
    ds = birdzarr.WindowDataset(small_store.url, batch_size=50, seed=4, **options)  # type: ignore[arg-type]
    expected = _through_torch(small_store.url, batch_size=50, seed=4, **options)
    assert len(expected) > 150
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    # a forked worker inherits the slots this process still maps (batches of earlier tests)
    inherited = _mapped_slots(os.getpid())
    iterator = iter(loader)
    most_slots = 0
    for n, (got, want) in enumerate(zip(iterator, expected, strict=True)):
        if options:
            (x, ldt), (want_x, want_ldt) = got, want
            assert torch.equal(ldt, want_ldt)
        else:
            x, want_x = got, want
        assert torch.equal(x, want_x), f"batch {n} differs: a slot was overwritten while in use"
        if n % 10 == 5:
            workers = iterator._workers  # type: ignore[attr-defined]
            most_slots = max(most_slots, *(_mapped_slots(w.pid) - inherited for w in workers))
        del got, x
    # Slots are reused: a worker maps a handful (those in flight or held by this loop, plus at most
    # 4 free ones), not one per batch (more than 75 per worker here).
    assert 0 < most_slots <= 12


def test_batches_kept_by_the_loop_stay_intact(small_store: birdzarr.Store) -> None:
    ds = birdzarr.WindowDataset(small_store.url, batch_size=97, seed=4, with_ldt=True)
    expected = _through_torch(small_store.url, batch_size=97, seed=4, with_ldt=True)
    kept = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert len(kept) == len(expected)
    for (x, ldt), (want_x, want_ldt) in zip(kept, expected, strict=True):
        assert torch.equal(x, want_x) and torch.equal(ldt, want_ldt)


def test_reuse_can_be_turned_off(small_store: birdzarr.Store) -> None:
    ds = birdzarr.WindowDataset(small_store.url, batch_size=500, seed=4, reuse_batch_memory=False)
    plan = ds.plan(num_workers=2)
    expected = [small_store.windows[ds.batch_indices(b, plan)] for b in ds.delivery_order(2)]
    got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert len(got) == len(expected) == len(ds)
    assert all(np.array_equal(x.numpy(), y) for x, y in zip(got, expected, strict=True))


def test_the_training_process_drops_the_slots_of_finished_workers(small_store: birdzarr.Store) -> None:
    ds = birdzarr.WindowDataset(small_store.url, batch_size=100, seed=4)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    sizes = []
    for epoch in range(4):  # new workers (and new slots) every epoch
        ds.set_epoch(epoch)
        assert sum(len(x) for x in loader) == len(small_store)
        sizes.append(len(_handoff._RECEIVED))
    # at most the last epoch's slots (those retired while a batch was on its way) remain mapped
    assert max(sizes) <= 2 * 8, sizes


@pytest.mark.slow
def test_a_loop_that_stops_mid_epoch_leaves_no_slot_mapped(small_store: birdzarr.Store) -> None:
    ds = birdzarr.WindowDataset(small_store.url, batch_size=50, seed=4)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    before = set(_handoff._RECEIVED)  # slots of earlier tests' workers, dropped at any time
    iterator = iter(loader)
    for n, x in enumerate(iterator):  # batches dropped as they go: their slots are reused
        assert len(x) == 50
        if n == 30:
            break
    mapped = set(_handoff._RECEIVED) - before
    assert mapped
    del iterator  # shuts the workers down with batches still queued (their slots leased)
    del x  # the last batch's lease ends: the receiver drops what it may
    gc.collect()
    assert not mapped & set(_handoff._RECEIVED)


@pytest.mark.parametrize(
    "transform",
    [lambda x: x * 2, lambda x: x.mul_(3), lambda x: x[:, :10], lambda x: x.double()],
    ids=["new tensor", "in place", "other shape", "other dtype"],
)
def test_transforms_in_workers_equal_torchs_transport(small_store: birdzarr.Store, transform: object) -> None:
    ds = birdzarr.WindowDataset(small_store.url, batch_size=300, seed=2, with_ldt=True,
                                transform=transform)  # type: ignore[arg-type]
    expected = _through_torch(small_store.url, batch_size=300, seed=2, with_ldt=True, transform=transform)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = [(x.clone(), ldt.clone()) for x, ldt in loader]
    assert len(got) == len(expected)
    for (x, ldt), (want_x, want_ldt) in zip(got, expected, strict=True):
        assert x.dtype == want_x.dtype and torch.equal(x, want_x) and torch.equal(ldt, want_ldt)


def _slot_of(tensor: torch.Tensor) -> _handoff.SlotKey:
    """The key of the received slot whose mapping holds ``tensor``'s data."""
    for key, mapping in _handoff._RECEIVED.items():
        view = np.frombuffer(mapping, dtype=np.uint8)
        start = view.ctypes.data
        del view  # the mapping must stay closable
        if start <= tensor.data_ptr() < start + len(mapping):
            return key
    raise AssertionError("the batch lies in no received slot")


def test_a_persistent_worker_starts_each_later_epoch_on_the_slots_it_handed_over(
    small_store: birdzarr.Store,
) -> None:
    """The slots outlive the iteration: the first batch of every later epoch arrives in a slot
    the training process mapped in an earlier epoch (no new shared memory, no file descriptor
    to hand over), and every batch holds exactly the planned windows."""
    ds = birdzarr.WindowDataset(small_store.url, batch_size=400, seed=4)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    mapped_before: set[_handoff.SlotKey] = set()
    firsts = []
    for epoch in range(4):
        ds.set_epoch(epoch)
        plan = ds.plan(num_workers=2)
        expected = [small_store.windows[ds.batch_indices(b, plan)] for b in ds.delivery_order(2)]
        got = []
        for n, x in enumerate(loader):
            if n == 0:
                firsts.append(_slot_of(x) in mapped_before)
            got.append(x.numpy().copy())
            del x
        assert len(got) == len(expected) == len(ds)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True)), epoch
        gc.collect()  # every batch of the epoch dropped: the workers' slots are all free
        mapped_before |= set(_handoff._RECEIVED)
    assert firsts == [False, True, True, True]
