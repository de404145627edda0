"""WindowDataset refuses what would break exactly-once or exact resume, or train on nothing, with
an error that names it: a second iteration over one pool buffer, epochs and resume points out
of range, a state saved for other windows, empty selections, options of the wrong kind."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

import birdzarr


def _dataset(store: birdzarr.Store, **options: object) -> birdzarr.WindowDataset:
    options.setdefault("batch_size", 1000)
    options.setdefault("allow_device_order", True)  # small_store is device-ordered
    return birdzarr.WindowDataset(store, **options)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_newer_iteration_supersedes_an_unfinished_one(small_store: birdzarr.Store) -> None:
    ds = _dataset(small_store, batch_size=500, shuffle_buffer=4096)
    every = sorted(w.tobytes() for w in small_store.windows[:])
    older = iter(ds)
    next(older)
    newer = iter(ds)
    delivered = [x.clone() for x in newer]
    with pytest.raises(RuntimeError, match="^this iteration of the WindowDataset was superseded"):
        next(older)
    assert len(delivered) == len(ds)
    assert sorted(w.tobytes() for w in torch.cat(delivered).numpy()) == every  # each window once

    for _ in ds:  # leaving a loop early and starting again is the ordinary case
        break
    assert sorted(w.tobytes() for w in torch.cat([x.clone() for x in ds]).numpy()) == every


def test_a_refused_epoch_leaves_the_epoch_as_it_was(small_store: birdzarr.Store) -> None:
    ds = _dataset(small_store)
    ds.set_epoch(3)
    for epoch in (-1, 2**63, 1.5):  # each refused with its message in test_loader_options_are_refused_by_name
        with pytest.raises((ValueError, TypeError)):
            ds.set_epoch(epoch)  # type: ignore[arg-type]
    assert ds.epoch == 3  # unchanged by a refused value


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_a_state_of_other_windows_is_refused_by_name(
    small_store: birdzarr.Store, parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
    tmp_path: pathlib.Path,
) -> None:
    devices = [e.device_id for e in small_store.device_table]
    saved = _dataset(small_store, exclude_devices=devices[:1])
    next(iter(saved))
    state = saved.state_dict()
    for options, name in [({}, "exclude_devices"),
                          ({"exclude_devices": devices[:1], "shuffle": False}, "shuffle"),
                          ({"exclude_devices": devices[:1], "drop_last": True}, "drop_last"),
                          ({"exclude_devices": devices[:1], "split": "train"}, "split")]:
        with pytest.raises(ValueError, match=f"^cannot resume: the state was saved with {name}="):
            _dataset(small_store, **options).load_state_dict(state)
    val = _dataset(small_store, split="val", split_seed=0)
    with pytest.raises(ValueError, match="^cannot resume: the state was saved with split_seed=0, this "
                                         "dataset has split_seed=2; the epoch's windows would differ"):
        _dataset(small_store, split="val", split_seed=2).load_state_dict(val.state_dict())
    other = birdzarr.convert(parquet_source[0], tmp_path / "other.zarr", chunk_windows=1024, shuffle=True,
                             seed=5, progress=False)  # the same windows, another store
    with pytest.raises(ValueError, match="^cannot resume: the state was saved with store_shuffle_seed=None"):
        _dataset(other, exclude_devices=devices[:1]).load_state_dict(state)
    _dataset(small_store, exclude_devices=devices[:1]).load_state_dict(state)  # the same: resumes


def test_resume_points_and_states_are_checked(small_store: birdzarr.Store) -> None:
    ds = _dataset(small_store)
    n = len(ds)
    for seen in (-1, n + 1, 2.5, True):
        with pytest.raises(ValueError, match=f"^batches_seen must be an integer from 0 to the batches left "
                                             f"in this epoch \\({n}\\), got "):
            ds.state_dict(batches_seen=seen)  # type: ignore[arg-type]
    state = ds.state_dict(batches_seen=n)  # the epoch's end is a valid point
    with pytest.raises(TypeError, match="^load_state_dict takes what state_dict\\(\\) returned"):
        ds.load_state_dict(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^not a WindowDataset state_dict: it has no 'seed'"):
        ds.load_state_dict({k: v for k, v in state.items() if k != "seed"})
    with pytest.raises(ValueError, match="^not a WindowDataset state_dict: next_batch is -3, not an integer"):
        ds.load_state_dict({**state, "next_batch": -3})
    with pytest.raises(ValueError, match=f"^cannot resume at batch {n + 5}: epoch 0 of this dataset has {n} "
                                         "batches$"):
        ds.load_state_dict({**state, "next_batch": n + 5})


def test_selections_that_give_no_batch_are_refused(small_store: birdzarr.Store) -> None:
    devices = [e.device_id for e in small_store.device_table]
    for options in ({"devices": []}, {"exclude_devices": devices}, {"devices": [], "resident": "cpu"}):
        with pytest.raises(ValueError, match=f"^the selection holds no window of {small_store.url}"):
            _dataset(small_store, **options)
    refused = "^batch_size=40,000 with drop_last=True gives no batch in any epoch: 30,000 windows selected"
    with pytest.raises(ValueError, match=refused):
        _dataset(small_store, batch_size=40_000, drop_last=True)
    assert len(_dataset(small_store, batch_size=40_000)) == 1  # without drop_last: one short batch
    # a pool smaller than a batch no longer matters: pools hold at least one whole batch
    small_pools = _dataset(small_store, batch_size=3000, shuffle_buffer=2000, drop_last=True)
    assert len(small_pools) == 10 and small_pools.windows_per_epoch == 30_000


_NO_CUDA = (f"resident='cuda': this PyTorch sees no CUDA device (torch {torch.__version__}, CUDA build: "
            f"{torch.version.cuda is not None}); use resident='cpu', or install the CUDA build of PyTorch "
            "(README)")


def _call(store: birdzarr.Store, call: str) -> object:
    """One public loader call, written as text so that the parameter ids name it."""
    return eval(call, {"birdzarr": birdzarr, "store": store, "_dataset": _dataset})


# Every option WindowDataset and its methods refuse, once: an argument of the wrong kind is a
# TypeError, one out of range a birdzarr.ArgumentError (also a ValueError); each with its exact message.
@pytest.mark.parametrize(("call", "error", "message"), [
    # of the wrong kind
    ("_dataset(store, batch_size=1.5)", TypeError, "batch_size must be an integer, got 1.5"),
    ("_dataset(store, batch_size='8')", TypeError, "batch_size must be an integer, got '8'"),
    ("_dataset(store, shuffle='no')", TypeError, "shuffle must be True or False, got 'no'"),
    ("_dataset(store, drop_last=1)", TypeError, "drop_last must be True or False, got 1"),
    ("_dataset(store, seed=None)", TypeError, "seed must be an integer, got None"),
    ("_dataset(store, devices=[200.5])", TypeError, "a device id must be an integer, got 200.5"),
    ("_dataset(store, devices='200')", TypeError,
     "devices and exclude_devices are lists of device ids, got '200': write ['200']"),
    ("_dataset(store, exclude_devices=200)", TypeError,
     "devices and exclude_devices are lists of device ids, got 200: write [200]"),
    ("_dataset(store, world_size='2')", TypeError, "world_size must be an integer, got '2'"),
    ("next(iter(_dataset(store, transform=lambda x: x.numpy())))", TypeError,
     "transform must return a torch.Tensor, got ndarray"),
    ("_dataset(store).set_epoch(1.5)", TypeError, "epoch must be an integer, got 1.5"),
    # out of range
    ("_dataset(store, batch_size=0)", birdzarr.ArgumentError, "batch_size must be positive, got 0"),
    ("_dataset(store, shuffle_buffer=0)", birdzarr.ArgumentError, "shuffle_buffer must be positive, got 0"),
    ("_dataset(store, requests=-5)", birdzarr.ArgumentError, "requests must be positive, got -5"),
    ("_dataset(store, seed=-1)", birdzarr.ArgumentError, "seed must be an integer of 0 or more, got -1"),
    ("_dataset(store, split='val', split_seed=-1)", birdzarr.ArgumentError,
     "split_seed must be an integer of 0 or more, got -1"),
    ("_dataset(store, split='test')", birdzarr.ArgumentError,
     "split must be one of ('train', 'val') or None, got 'test'"),
    ("_dataset(store, split='val', val_fraction=1.5)", birdzarr.ArgumentError,
     "val_fraction must be between 0 and 1, got 1.5"),
    ("_dataset(store, world_size=2, rank=2)", birdzarr.ArgumentError, "rank 2 is outside 0..1"),
    ("_dataset(store, start='2013-01-01', stop='2012-01-01')", birdzarr.ArgumentError,
     "start must be before stop, got start='2013-01-01' and stop='2012-01-01'"),
    ("_dataset(store, start='soon')", birdzarr.ArgumentError,
     "start='soon' is not an ISO 8601 time (e.g. '2012-06-01' or '2012-06-01T12:00:00')"),
    ("_dataset(store, resident='nowhere')", birdzarr.ArgumentError,
     "resident must be False, 'cpu' or a torch device, got 'nowhere'"),
    pytest.param("_dataset(store, resident='cuda')", birdzarr.ArgumentError, _NO_CUDA,
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="PyTorch sees a CUDA device")),
    ("_dataset(store, label_weights={0: -1.0}, resident='cpu')", birdzarr.ArgumentError,
     "label_weights[0] must be 0 or more, got -1.0"),
    ("_dataset(store).set_epoch(-1)", birdzarr.ArgumentError,
     "epoch must be from 0 to 2,147,483,647, got -1"),
    ("_dataset(store).set_epoch(2**63)", birdzarr.ArgumentError,
     f"epoch must be from 0 to 2,147,483,647, got {2**63}"),
    ("_dataset(store).state_dict(batches_seen=-1)", birdzarr.ArgumentError,
     "batches_seen must be an integer from 0 to the batches left in this epoch (30), got -1"),
])
def test_loader_options_are_refused_by_name(
    small_store: birdzarr.Store, call: str, error: type[Exception], message: str,
) -> None:
    assert "ArgumentError" in birdzarr.__all__
    with pytest.raises(error) as refused:
        _call(small_store, call)
    assert str(refused.value) == message
    if error is birdzarr.ArgumentError:
        assert isinstance(refused.value, ValueError)  # callers catching ValueError keep working


def test_a_reader_of_a_local_store_decodes_on_its_share_of_the_cores() -> None:
    """``requests`` is the reads in flight for a store read over a network; on this machine's
    file system, where decoding is the work, a reader uses no more threads than its share of the
    cores (more only contend for them, each with its own decode scratch)."""
    from birdzarr.loader._pool import reader_threads

    assert reader_threads(4, local=True, readers=2, cores=2) == 1  # the benchmark machine, 2 workers
    assert reader_threads(4, local=True, readers=1, cores=2) == 2  # the training process
    assert reader_threads(4, local=True, readers=15, cores=16) == 1
    assert reader_threads(4, local=True, readers=2, cores=16) == 4  # never more than requests
    assert reader_threads(1, local=True, readers=1, cores=16) == 1
    assert reader_threads(4, local=False, readers=2, cores=2) == 4  # S3: reads in flight hide latency
    assert reader_threads(16, local=False, readers=15, cores=16) == 16


def _threads(batch: object) -> tuple[object, int]:
    """collate_fn (it runs in the worker): the batch and the worker's reader threads."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    assert info is not None
    return batch, info.dataset._local().pool.threads  # type: ignore[attr-defined]


def test_the_readers_of_a_local_store_take_their_threads_from_the_cores(small_store: birdzarr.Store) -> None:
    import os

    from torch.utils.data import DataLoader

    cores = len(os.sched_getaffinity(0))
    ds = _dataset(small_store, requests=4)
    next(iter(ds))
    assert ds._local().pool.threads == max(1, min(4, cores))  # the training process: one reader
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork",
                        collate_fn=_threads)
    threads = {n for _, n in loader}  # type: ignore[misc]
    assert threads == {max(1, min(4, cores // 2))}
