"""Resident mode on a CUDA device: the batches a GPU gathers and decodes are the store's windows,
every window once an epoch, over ranks, resumed, selected and class-balanced.

Skipped where PyTorch sees no CUDA device (CI); run on a GPU node with
``python -m pytest -q tests/test_cuda.py``. The permutation is drawn on the GPU, so batches are
compared with the store through ``batch_indices``, not with ``resident="cpu"``'s (another
generator gives another order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import birdzarr
from tests.labelled_support import labelled_csv_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch sees no CUDA device")


def _on_gpu(store: birdzarr.Store, **options: object) -> birdzarr.WindowDataset:
    options.setdefault("batch_size", 777)
    options.setdefault("seed", 5)
    options.setdefault("progress", False)
    return birdzarr.WindowDataset(store.url, resident="cuda", **options)  # type: ignore[arg-type]


def _check_epoch(ds: birdzarr.WindowDataset, store: birdzarr.Store, *, channel_first: bool) -> np.ndarray:
    """Every batch equals the store at its indices (x, label, device, time); the indices seen."""
    seen = []
    for batch, (x, ldt) in enumerate(ds):
        assert x.device.type == "cuda" and ldt.device.type == "cuda"
        idx = ds.batch_indices(batch)
        expected = store.windows[idx]
        if channel_first:
            expected = expected.transpose(0, 2, 1)
        assert np.array_equal(x.cpu().numpy(), expected)
        got = ldt.cpu().numpy()
        assert np.array_equal(got[:, 0], store.labels[idx])
        assert np.array_equal(got[:, 1], store.window_devices[idx])
        assert np.array_equal(got[:, 2], store.timestamps[idx])
        seen.append(idx)
    return np.concatenate(seen)


@pytest.mark.parametrize("codes", [True, False], ids=["codes", "float32"])
@pytest.mark.parametrize("version", ["format2", "format1"])
def test_every_batch_is_the_stores_windows_once_an_epoch(
    small_store: birdzarr.Store, small_store_v1: birdzarr.Store, version: str, codes: bool
) -> None:
    store = small_store if version == "format2" else small_store_v1
    ds = _on_gpu(store, with_ldt=True, channel_first=True, resident_codes=codes)
    assert ds.resident is not None and ds.resident.device.type == "cuda"
    epochs = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        flat = _check_epoch(ds, store, channel_first=True)
        assert np.array_equal(np.sort(flat), np.arange(len(store)))
        epochs.append(flat)
    assert not np.array_equal(epochs[0], epochs[1]), "epoch 1 is another permutation"


def test_ranks_split_every_window_once_in_equal_batches(small_store: birdzarr.Store) -> None:
    ranks = [_on_gpu(small_store, batch_size=1300, world_size=3, rank=r, seed=4) for r in range(3)]
    sizes = [[len(ds.batch_indices(b)) for b in range(len(ds))] for ds in ranks]
    assert sizes[0] == sizes[1] == sizes[2], "the same number of batches of the same sizes"
    flat = np.concatenate([ds.batch_indices(b) for ds in ranks for b in range(len(ds))])
    assert np.array_equal(np.sort(flat), np.arange(len(small_store)))


def test_a_resume_gives_the_rest_of_the_epoch(small_store: birdzarr.Store) -> None:
    whole = _on_gpu(small_store, seed=9)
    whole.set_epoch(2)
    expected = [x.cpu() for x in whole]
    head = _on_gpu(small_store, seed=9)
    head.set_epoch(2)
    for seen, _ in enumerate(head, start=1):
        if seen == 5:
            break
    resumed = _on_gpu(small_store, seed=9)
    resumed.load_state_dict(head.state_dict(batches_seen=5))
    tail = [x.cpu() for x in resumed]
    assert len(tail) == len(expected) - 5
    assert all(torch.equal(a, b) for a, b in zip(tail, expected[5:], strict=True))


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    """6 CSV devices with burst times, every burst labelled 0 (about 5%), 1 or 2."""
    return labelled_csv_store(tmp_path_factory.mktemp("labelled"), n_devices=6, n_bursts=400,
                              shares=[0.05, 0.35, 0.60], seed=300, name="labelled.zarr")


def test_selections_and_balanced_batches_on_the_gpu(labelled: birdzarr.Store) -> None:
    times = labelled.timestamps[:]
    middle = int(np.median(times))
    ds = _on_gpu(labelled, with_ldt=True, stop=middle, labels=[1, 2])
    flat = _check_epoch(ds, labelled, channel_first=False)
    assert np.array_equal(np.sort(flat), np.flatnonzero((times < middle) & (labelled.labels[:] >= 1)))
    balanced = _on_gpu(labelled, with_ldt=True, label_weights="balanced")
    labels = np.concatenate([ldt[:, 0].cpu().numpy() for _, ldt in balanced])
    assert (labels >= 0).all()
    _, counts = np.unique(labels, return_counts=True)
    assert counts.max() / counts.min() < 1.2, counts


def test_full_batches_replay_one_graph_and_kept_batches_stay_intact(small_store: birdzarr.Store) -> None:
    """Every full batch comes from one captured CUDA graph (birdzarr.loader._cuda_graph); a batch
    kept while the next ones are gathered keeps its values (the graph's output is copied out)."""
    ds = _on_gpu(small_store, with_ldt=True, channel_first=True, batch_size=1100)
    kept = list(ds)
    assert ds.resident is not None
    graphed = ds.resident._graphs[True]
    assert graphed.captured and not graphed.failed
    assert len(kept[-1][0]) < 1100, "the epoch's last batch is smaller: gathered op by op"
    for batch, (x, ldt) in enumerate(kept):
        idx = ds.batch_indices(batch)
        assert np.array_equal(x.cpu().numpy(), small_store.windows[idx].transpose(0, 2, 1))
        assert np.array_equal(ldt[:, 1].cpu().numpy(), small_store.window_devices[idx])
