"""examples/train_classifier.py learns a learnable label, validates on other birds only, and
resumes to exactly the run it would have been."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import birdzarr
from birdzarr.demo import _synthetic

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_classifier.py"
BATCH = 256
SPLIT = ("--val-fraction", "0.25", "--split-seed", "2")  # 6 training and 2 validation birds of 8
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def write_labelled_parquet(
    directory: pathlib.Path, *, n_devices: int, per_device: int, seed: int = 0
) -> None:
    """``{device}.parquet`` files with ``gimu`` and ``label``: realistic windows where label 0
    (60%) is left as is, 1 (25%) carries a 4-sample oscillation on imu_z, 2 (5%, the rare one) a
    10-sample oscillation on imu_x; 10% are unlabelled (-1). The label is learnable from the window."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t = np.arange(20)
    for device in range(101, 101 + n_devices):
        x = _synthetic.curated_windows(per_device, seed=seed * 1000 + device)
        label = rng.choice([0, 1, 2, -1], size=per_device, p=[0.6, 0.25, 0.05, 0.1])
        x[label == 1, :, 2] += (0.6 * np.sin(2 * np.pi * t / 4)).astype(np.float32)
        x[label == 2, :, 0] += (0.6 * np.sin(2 * np.pi * t / 10)).astype(np.float32)
        flat = pa.array(x.reshape(-1), type=pa.float32())
        gimu = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)
        pq.write_table(pa.table({"gimu": gimu, "label": pa.array(label, pa.int32())}),
                       directory / f"{device}.parquet")


@pytest.fixture(scope="module")
def labelled_store(tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    root = tmp_path_factory.mktemp("classifier")
    write_labelled_parquet(root / "src", n_devices=8, per_device=700)
    return birdzarr.convert(root / "src", root / "store.zarr", shuffle=True, seed=1, chunk_windows=512,
                            progress=False)


def _sides(store: birdzarr.Store) -> tuple[birdzarr.WindowDataset, birdzarr.WindowDataset]:
    """The example's two datasets, as it makes them with SPLIT."""
    common: dict[str, Any] = dict(batch_size=BATCH, labelled_only=True, val_fraction=0.25, split_seed=2)
    return (birdzarr.WindowDataset(store.url, split="train", **common),
            birdzarr.WindowDataset(store.url, split="val", shuffle=False, **common))


def _argv(store: birdzarr.Store, ckpt: pathlib.Path, log: pathlib.Path, *extra: str) -> list[str]:
    return [store.url, "--epochs", "2", "--batch-size", str(BATCH), "--workers", "2", *SPLIT,
            "--checkpoint", str(ckpt), "--checkpoint-every", "4", "--log-file", str(log), *extra]


def _train_cli(argv: list[str], launcher: tuple[str, ...] = (sys.executable,)) -> str:
    """As a user runs it: a fresh interpreter."""
    proc = subprocess.run([*launcher, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300,
                          env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _train_here(argv: list[str], expect: int = 0) -> tuple[str, str]:
    """In this process (saves a torch import per run); the script's signal handlers are undone after."""
    spec = importlib.util.spec_from_file_location("birdzarr_example_train_classifier", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert module.main(argv) == expect
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return out.getvalue(), err.getvalue()


def _records(log: pathlib.Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the step records, the epoch records) of a log."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in records if "step" in r], [r for r in records if "validation" in r]


@pytest.mark.slow
def test_classifier_learns_the_label_and_validates_on_other_birds(
    labelled_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    log = tmp_path / "log.jsonl"
    out = _train_cli(_argv(labelled_store, tmp_path / "c.pt", log, "--epochs", "4"))
    steps, epochs = _records(log)
    train, val = _sides(labelled_store)
    assert train.selection.devices is not None and val.selection.devices is not None
    # the split is by device: the windows validated on are of birds never trained on
    assert len(epochs) == 4
    for record in epochs:
        assert set(record["val_devices"]) == set(val.selection.devices)
        assert set(record["train_devices"]) == set(train.selection.devices)
        assert not set(record["val_devices"]) & set(record["train_devices"])
    # every labelled validation window is scored once: the confusion rows are the val label counts
    counts = val.label_counts()
    assert -1 not in counts and -1 not in train.label_counts()
    for record in epochs:
        assert [sum(row) for row in record["confusion"]] == [counts.get(c, 0) for c in range(3)]
    assert len(steps) == 4 * len(train)
    # it learns: the loss falls, and every class (the rare one too) is far above chance (1/3)
    mean_loss = [np.mean([r["loss"] for r in steps if r["epoch"] == e]) for e in range(4)]
    assert mean_loss[3] < 0.5 * mean_loss[0]
    final = epochs[-1]["validation"]
    assert final["balanced_accuracy"] > 0.9
    assert all(a > 0.8 for a in final["per_class"].values()), final
    assert "class weights [" in out and "per-class accuracy: 0: " in out
    assert "confusion (rows true, columns predicted)" in out


@pytest.mark.slow
@pytest.mark.parametrize("mode", [(), ("--resident", "cpu")], ids=["streaming", "resident"])
def test_classifier_resume_gives_the_weights_of_an_uninterrupted_run(
    labelled_store: birdzarr.Store, tmp_path: pathlib.Path, mode: tuple[str, ...]
) -> None:
    per_epoch = len(_sides(labelled_store)[0])
    full_log, full_ckpt = tmp_path / "full.jsonl", tmp_path / "full.pt"
    _train_here(_argv(labelled_store, full_ckpt, full_log, *mode))
    full_steps, full_epochs = _records(full_log)
    assert [r["batch"] for r in full_steps] == list(range(per_epoch)) * 2

    # Interrupted twice: mid-epoch 0, then mid-epoch 1 (crossing the epoch boundary and its
    # validation), then finished.
    ckpt, log = tmp_path / "cut.pt", tmp_path / "cut.jsonl"
    out, _ = _train_here(_argv(labelled_store, ckpt, log, "--max-steps", "5", *mode))
    assert "stopping at epoch 0, batch 5" in out
    out, _ = _train_here(_argv(labelled_store, ckpt, log, "--resume", "--max-steps", str(per_epoch), *mode))
    assert "resumed from" in out and "epoch 0, batch 5" in out
    out, _ = _train_here(_argv(labelled_store, ckpt, log, "--resume", *mode))
    assert "epoch 1 validation" in out
    cut_steps, cut_epochs = _records(log)

    assert [(r["epoch"], r["batch"], r["step"]) for r in cut_steps] == [
        (r["epoch"], r["batch"], r["step"]) for r in full_steps]
    assert [(r["x_sum"], r["label_sum"], r["loss"]) for r in cut_steps] == [
        (r["x_sum"], r["label_sum"], r["loss"]) for r in full_steps]
    a, b = torch.load(full_ckpt, weights_only=False), torch.load(ckpt, weights_only=False)
    assert a["epoch"] == b["epoch"] == 2 and a["loader"] is None and b["loader"] is None
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(b["model"][name], tensor), name  # exactly the same weights
    assert b["history"] == a["history"] and [h["epoch"] for h in a["history"]] == [0, 1]
    assert [r["validation"] for r in cut_epochs] == [r["validation"] for r in full_epochs]
    # Resuming a finished run does nothing.
    _train_here(_argv(labelled_store, ckpt, log, "--resume", *mode))
    assert len(_records(log)[0]) == len(full_steps)


@pytest.mark.slow
def test_classifier_under_torchrun_two_ranks_stops_resumes_and_scores_all_of_val(
    labelled_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    ckpt, log = tmp_path / "ddp.pt", tmp_path / "ddp.jsonl"
    train, val = _sides(labelled_store)
    per_rank = -(-(train.n_selected // 2) // BATCH)
    launcher = (torchrun, "--standalone", "--nproc_per_node=2")
    argv = _argv(labelled_store, ckpt, log, "--epochs", "1", "--workers", "1")

    assert "on 2 rank(s)" in _train_cli([*argv, "--max-steps", "2"], launcher)
    out = _train_cli([*argv, "--resume"], launcher)
    assert "epoch 0, batch 2" in out
    steps, epochs = _records(log)  # rank 0's batches: 0, 1, then 2.. after the restart
    assert [r["batch"] for r in steps] == list(range(per_rank))
    # the confusion matrix is summed over both ranks: every validation window once
    counts = val.label_counts()
    assert [sum(row) for row in epochs[0]["confusion"]] == [counts.get(c, 0) for c in range(3)]
    assert f"epoch 0 validation: {val.n_selected:,} windows" in out
    assert torch.load(ckpt, weights_only=False)["world_size"] == 2


def test_classifier_on_a_store_without_labels_exits_2_with_one_line(tmp_path: pathlib.Path) -> None:
    _synthetic.make_parquet_dir(tmp_path / "src", n_devices=3, total_windows=600, seed=3)
    store = birdzarr.convert(tmp_path / "src", tmp_path / "store.zarr", progress=False)
    out, err = _train_here([store.url, "--checkpoint", str(tmp_path / "c.pt")], expect=2)
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: the selection holds no window of "), err
    assert "labelled_only=True" in err
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.slow
def test_classifier_resume_with_another_batch_size_exits_2_and_keeps_the_checkpoint(
    labelled_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    ckpt, log = tmp_path / "c.pt", tmp_path / "log.jsonl"
    _train_here(_argv(labelled_store, ckpt, log, "--max-steps", "2", "--workers", "0"))
    before = ckpt.read_bytes()
    argv = _argv(labelled_store, ckpt, log, "--resume", "--workers", "0")
    argv[argv.index("--batch-size") + 1] = str(BATCH // 2)
    out, err = _train_here(argv, expect=2)
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: cannot resume from {ckpt}: cannot resume: the state was saved with "), err
    assert "batch_size" in err
    assert ckpt.read_bytes() == before


@pytest.mark.slow
def test_classifier_balanced_draws_every_label_equally_and_learns(
    labelled_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    log = tmp_path / "log.jsonl"
    out, _ = _train_here(_argv(labelled_store, tmp_path / "c.pt", log, "--balanced", "--resident", "cpu",
                               "--workers", "0"))
    train_counts = _sides(labelled_store)[0].label_counts()
    assert train_counts[2] < train_counts[0] / 5  # the rare label, drawn as often as the others
    assert "class weights" not in out  # the loss is unweighted: the batches are balanced already
    _, epochs = _records(log)
    assert len(epochs) == 2
    for record in epochs:
        drawn = record["train_labels"]
        assert sum(drawn) == sum(train_counts.values())  # an epoch is the selection's size
        assert max(drawn) - min(drawn) <= 1, drawn
    assert epochs[-1]["validation"]["balanced_accuracy"] > 0.8


@pytest.mark.slow  # with its module fixture (a labelled conversion) over 0.2 s of CPU: not in the fast loop
def test_classifier_balanced_without_resident_exits_2_with_one_line(
    labelled_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    out, err = _train_here(_argv(labelled_store, tmp_path / "c.pt", tmp_path / "log.jsonl", "--balanced"),
                           expect=2)
    assert out == ""
    assert err == "error: --balanced draws batches by label from memory: add --resident cpu (or cuda)\n"
    assert not (tmp_path / "c.pt").exists()
