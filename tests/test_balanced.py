"""Class-balanced sampling (``label_weights=``, resident mode): each batch's label mix, seeded and
redrawn every epoch, with and without replacement, exact resume."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import birdzarr
from birdzarr.demo import _synthetic
from birdzarr.loader._balanced import LabelRows, apportion
from tests.labelled_support import labelled_csv_store

BATCH = 256  # not a multiple of 3: a third of a batch is 85.3 windows


@pytest.fixture(scope="module")
def rare(tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    """10 CSV devices, every burst labelled: label 0 about 1% of the windows, 1 about 29%, 2 the rest."""
    return labelled_csv_store(tmp_path_factory.mktemp("rare"), n_devices=10, n_bursts=700,
                              shares=[0.01, 0.29, 0.70], seed=900, name="rare.zarr")


def _balanced(store: birdzarr.Store, **options: object) -> birdzarr.WindowDataset:
    options.setdefault("batch_size", BATCH)
    options.setdefault("resident", "cpu")
    options.setdefault("progress", False)
    options.setdefault("label_weights", "balanced")
    return birdzarr.WindowDataset(store.url, **options)  # type: ignore[arg-type]


def _epoch(ds: birdzarr.WindowDataset) -> list[np.ndarray]:
    return [ds.batch_indices(b) for b in range(len(ds))]


def _mix(labels: np.ndarray, batches: list[np.ndarray], k: int = 3) -> np.ndarray:
    """Windows of each label in each batch: (batches, k)."""
    return np.array([np.bincount(labels[idx], minlength=k) for idx in batches])


@pytest.mark.slow  # the module's store takes over 2 s of CPU to write: not in the fast loop
def test_the_store_has_a_rare_label(rare: birdzarr.Store) -> None:
    labels = rare.labels[:]
    assert len(labels) == 11_601
    assert np.bincount(labels).tolist() == [116, 3_273, 8_212]  # label 0: 1.0%


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_each_batch_holds_the_requested_mix(rare: birdzarr.Store) -> None:
    labels = rare.labels[:]
    ds = _balanced(rare, seed=3, with_ldt=True)
    assert len(ds) == 46 and ds.windows_per_epoch == 11_601  # the selection's size by default
    assert ds.label_shares() == {0: (1 / 3, 3_867), 1: (1 / 3, 3_867), 2: (1 / 3, 3_867)}
    batches = _epoch(ds)
    mix = _mix(labels, batches)
    assert mix.sum(axis=0).tolist() == [3_867, 3_867, 3_867]
    # every full batch: 85 or 86 of each label (85.3 asked: within 0.3% of the batch); the last 27 each
    assert mix[:-1].min(axis=0).tolist() == [85, 85, 85] and mix[:-1].max(axis=0).tolist() == [86, 86, 86]
    assert mix[-1].tolist() == [27, 27, 27]
    # with replacement, in rounds: each rare window 33 or 34 times (3,867 draws of 116 windows)
    drawn = np.bincount(np.concatenate(batches), minlength=len(labels))
    assert sorted(set(drawn[labels == 0].tolist())) == [33, 34]
    assert set(drawn[labels == 2].tolist()) == {0, 1}  # a common label: some windows not this epoch
    # what is delivered is what batch_indices says, labels included
    for number, (x, ldt) in enumerate(ds):
        idx = batches[number]
        assert np.array_equal(x.numpy(), rare.windows[idx])
        assert np.array_equal(ldt[:, 0].numpy(), labels[idx])


@pytest.mark.slow  # the module's store takes over 2 s of CPU to write: not in the fast loop
def test_weights_set_the_shares_and_labels_left_out_are_never_drawn(rare: birdzarr.Store) -> None:
    labels = rare.labels[:]
    ds = _balanced(rare, label_weights={0: 1, 1: 2, 2: 7}, seed=1, epoch_windows=6_000)
    assert ds.windows_per_epoch == 6_000 and len(ds) == 24
    mix = _mix(labels, _epoch(ds))
    assert mix.sum(axis=0).tolist() == [600, 1_200, 4_200]
    # 25.6, 51.2 and 179.2 asked of each full batch
    assert mix[:-1].min(axis=0).tolist() == [25, 51, 179] and mix[:-1].max(axis=0).tolist() == [26, 52, 180]
    only = _balanced(rare, label_weights={1: 1.0, 2: 1.0, 0: 0}, seed=1)
    assert _mix(labels, _epoch(only))[:, 0].sum() == 0
    assert only.label_shares() == {1: (0.5, 5_801), 2: (0.5, 5_800)}


@pytest.mark.slow  # the module's store takes over 2 s of CPU to write: not in the fast loop
def test_reproducible_for_a_seed_and_redrawn_every_epoch(rare: birdzarr.Store) -> None:
    a, b = _balanced(rare, seed=7), _balanced(rare, seed=7)
    a.set_epoch(2)
    b.set_epoch(2)
    assert all(np.array_equal(x, y) for x, y in zip(_epoch(a), _epoch(b), strict=True))
    b.set_epoch(3)
    first = {np.sort(i).tobytes() for i in _epoch(a)}
    assert not any(np.sort(i).tobytes() in first for i in _epoch(b)), "no batch comes back"
    other = _balanced(rare, seed=8)
    other.set_epoch(2)
    assert not np.array_equal(_epoch(other)[0], _epoch(a)[0])


@pytest.mark.slow  # the module's store takes over 2 s of CPU to write: not in the fast loop
def test_without_replacement_no_window_twice(rare: birdzarr.Store) -> None:
    labels = rare.labels[:]
    ds = _balanced(rare, replacement=False, seed=2, batch_size=60)
    # label 0's 116 windows are a third of the epoch: 347 windows (116, 116, 115), every rare window once
    assert ds.windows_per_epoch == 347 and len(ds) == 6
    flat = np.concatenate(_epoch(ds))
    assert len(np.unique(flat)) == len(flat) == 347
    assert np.array_equal(np.sort(flat[labels[flat] == 0]), np.flatnonzero(labels == 0))
    mix = _mix(labels, _epoch(ds))
    assert (mix[:-1] == 20).all() and mix[-1].tolist() == [16, 16, 15]
    with pytest.raises(ValueError, match=(
            r"^epoch_windows=400 with replacement=False is more than the selection gives: label 0 has "
            r"116 windows for a share of 0\.3333, so an epoch drawing no window twice holds at most "
            r"347\. Lower epoch_windows, or draw with replacement=True$")):
        _balanced(rare, replacement=False, epoch_windows=400)


@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.slow  # the module's store takes over 2 s of CPU to write: not in the fast loop
def test_resume_mid_epoch_equals_uninterrupted(rare: birdzarr.Store, replacement: bool) -> None:
    options = {"seed": 9, "replacement": replacement, "batch_size": 50 if not replacement else BATCH}
    full = _balanced(rare, **options)
    full.set_epoch(4)
    expected = [x.clone() for x in full]
    first = _balanced(rare, **options)
    first.set_epoch(4)
    iterator = iter(first)
    head = [next(iterator).clone() for _ in range(3)]
    state = first.state_dict()
    assert state["selection"]["label_weights"] == "balanced"
    assert state["selection"]["replacement"] is replacement
    resumed = _balanced(rare, **options)
    resumed.load_state_dict(state)
    tail = [x.clone() for x in resumed]
    assert len(head) + len(tail) == len(expected)
    assert all(torch.equal(x, y) for x, y in zip(head + tail, expected, strict=True))
    with pytest.raises(ValueError, match=(
            r"^cannot resume: the state was saved with label_weights='balanced', this dataset has "
            r"label_weights=\[\[0, 1\.0\], \[1, 1\.0\], \[2, 1\.0\]\]")):
        _balanced(rare, **{**options, "label_weights": {0: 1.0, 1: 1.0, 2: 1.0}}).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^cannot resume: the state was saved with epoch_windows=\d+, this "
                                         r"dataset has epoch_windows=None"):
        _balanced(rare, seed=9, label_weights=None, batch_size=options["batch_size"]).load_state_dict(state)


@pytest.mark.slow  # the module's store takes over 2 s of CPU to write: not in the fast loop
def test_ranks_share_one_balanced_sequence(rare: birdzarr.Store) -> None:
    labels = rare.labels[:]
    ranks = [_balanced(rare, seed=4, world_size=2, rank=r, drop_last=True) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 22
    whole = _balanced(rare, seed=4, world_size=1)
    sequence = np.concatenate(_epoch(whole))
    start = (len(sequence) + 1) // 2
    assert np.array_equal(np.concatenate(_epoch(ranks[0])), sequence[: 22 * BATCH])
    assert np.array_equal(np.concatenate(_epoch(ranks[1])), sequence[start : start + 22 * BATCH])
    for ds in ranks:
        assert np.abs(_mix(labels, _epoch(ds)) - BATCH / 3).max() < 1


@pytest.mark.slow
def test_dataloader_workers_deliver_the_same_batches(rare: birdzarr.Store) -> None:
    ds = _balanced(rare, seed=5)
    ds.set_epoch(1)
    in_process = [x.clone() for x in ds]
    got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert len(got) == len(in_process)
    assert all(torch.equal(x, y) for x, y in zip(got, in_process, strict=True))


@pytest.mark.slow  # the module's store takes over 2 s of CPU to write: not in the fast loop
def test_refusals_are_one_line_naming_the_fix(rare: birdzarr.Store, tmp_path: pathlib.Path) -> None:
    with pytest.raises(birdzarr.ArgumentError, match=(
            r"^label_weights \(class-balanced sampling\) needs the selection held in memory: pass "
            r"resident='cpu' \(or 'cuda'\); streamed batches are cut from pools of whole chunks and "
            r"cannot be drawn by label$")):
        _balanced(rare, resident=False, allow_device_order=True)
    with pytest.raises(ValueError, match=r"^label_weights draws every epoch's windows at random: it needs "
                                         r"shuffle=True$"):
        _balanced(rare, shuffle=False)
    with pytest.raises(ValueError, match=r"^label_weights gives label\(s\) \[5\] a weight, but the selection "
                                         r"holds no window of them \(its windows per label: \{0: 116, 1: "
                                         r"3273, 2: 8212\}\)$"):
        _balanced(rare, label_weights={0: 1, 5: 1})
    with pytest.raises(ValueError, match=r"^replacement= applies to class-balanced sampling: give "
                                         r"label_weights= too \(got replacement=False without it\)$"):
        _balanced(rare, label_weights=None, replacement=False)
    with pytest.raises(ValueError, match=r"^label_weights\[1\] must be 0 or more, got -1$"):
        _balanced(rare, label_weights={1: -1})
    with pytest.raises(ValueError, match=r"^label_weights must be 'balanced' or a dict"):
        _balanced(rare, label_weights="equal")
    with pytest.raises(TypeError, match=r"^label_weights must be 'balanced' or a dict of label -> weight "
                                        r"\(e\.g\. \{0: 1, 3: 2\}\), got list$"):
        _balanced(rare, label_weights=[1, 1, 1])
    # 'balanced' on a selection with unlabelled windows: say so instead of dropping them silently
    csv = tmp_path / "csv"
    csv.mkdir()
    for device in (1, 2):
        _synthetic.write_csv(_synthetic.raw_device(device, 30, seed=device, labelled=device == 1),
                             csv / f"{device}_0.csv")
    mixed = birdzarr.convert(csv, tmp_path / "m.zarr", progress=False)
    with pytest.raises(ValueError, match=(
            r"^label_weights='balanced' balances labels, but the selection holds \d+ unlabelled "
            r"windows \(label -1\): add labelled_only=True, or give -1 a weight in a dict$")):
        _balanced(mixed, batch_size=8)
    assert len(_balanced(mixed, batch_size=8, labelled_only=True)) > 0


def test_apportion_and_label_rows() -> None:
    assert apportion(10, np.array([0.5, 0.25, 0.25])).tolist() == [5, 3, 2]
    assert apportion(7, np.array([1 / 3] * 3)).tolist() == [3, 2, 2]
    rows = LabelRows.of(np.array([2, 0, 2, 1, 0, 2], dtype=np.int32), {0: 0.5, 2: 0.5})
    assert rows.labels.tolist() == [0, 2] and [r.tolist() for r in rows.rows] == [[1, 4], [0, 2, 5]]
    assert rows.max_without_replacement() == 3
    epoch = rows.epoch(8, seed=1, epoch=0, replacement=True)
    drawn = np.bincount(epoch, minlength=6).tolist()
    assert drawn[1] == drawn[4] == 2 and drawn[3] == 0  # label 1 weighs nothing
    assert sorted(drawn[i] for i in (0, 2, 5)) == [1, 1, 2]  # rounds: none twice before all once
    # alternating labels: any two consecutive rows hold one of each
    assert all(np.isin(epoch[i : i + 2], [1, 4]).sum() == 1 for i in range(7))


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_any_weighting_keeps_every_batch_within_three_windows_of_its_shares() -> None:
    """20 seeded random weightings of 2-11 labels (some rare), batches of 256, 1000 and 8192."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for trial in range(20):
        k = int(rng.integers(2, 12))
        shares = rng.dirichlet(np.full(k, 0.5)) + 1e-3
        shares /= shares.sum()
        labels = rng.choice(k, 50_000, p=shares).astype(np.int32)
        present = np.unique(labels).tolist()
        weights = {c: float(shares[c]) for c in present}
        rows = LabelRows.of(labels, weights)
        asked = np.zeros(k)
        asked[rows.labels] = rows.totals(50_000) / 50_000
        for epoch in range(3):
            drawn = labels[rows.epoch(50_000, seed=trial, epoch=epoch, replacement=True)]
            for size in (256, 1000, 8192):
                mix = np.array([np.bincount(drawn[i : i + size], minlength=k)
                                for i in range(0, len(drawn) - size + 1, size)])
                worst = max(worst, float(np.abs(mix - asked * size).max()))
    assert 2 < worst < 3


@pytest.mark.parametrize("replacement", [True, False])
@pytest.mark.slow  # the module's store takes over 2 s of CPU to write: not in the fast loop
def test_each_epoch_takes_its_draw_made_ahead_exactly(rare: birdzarr.Store, replacement: bool) -> None:
    """Iterated in this process, the next epoch's class-balanced draw is made once an epoch's
    first batch is out, and taken by that epoch: exactly the batches a dataset that drew each
    epoch directly gives; a set_epoch elsewhere drops it; len() draws nothing."""
    options = {"seed": 13, "replacement": replacement, "batch_size": 50 if not replacement else BATCH}
    ds, reference = _balanced(rare, **options), _balanced(rare, **options)
    len(ds), ds.windows_per_epoch  # noqa: B018 - counted, not drawn
    assert ds.resident.plans_drawn == 0
    windows = rare.windows[:]
    ahead = ds._local().ahead
    for epoch in (0, 1, 3):
        ds.set_epoch(epoch)
        got = [x.clone() for x in ds]
        reference.set_epoch(epoch)
        expected = [windows[reference.batch_indices(b)] for b in range(len(reference))]
        assert len(got) == len(expected) == len(ds)
        assert all(np.array_equal(x.numpy(), y) for x, y in zip(got, expected, strict=True)), epoch
    # epochs 0 and 1 prepared their next; epoch 3 is not the prepared 2 (dropped), and prepared 4
    assert (ahead.prepared, ahead.taken, ahead.discarded) == (3, 1, 1)
