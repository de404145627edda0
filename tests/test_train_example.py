"""examples/train.py runs, checkpoints, and resumes to exactly the run it would have been."""

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

import pytest
import torch

import birdzarr
from birdzarr.demo import _synthetic

pytestmark = pytest.mark.slow

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train.py"
BATCH = 256
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    root = tmp_path_factory.mktemp("train")
    _synthetic.make_parquet_dir(root / "src", n_devices=5, total_windows=3_000, seed=3)
    return birdzarr.convert(root / "src", root / "store.zarr", chunk_windows=512, progress=False)


def _argv(store: birdzarr.Store, ckpt: pathlib.Path, log: pathlib.Path, *extra: str) -> list[str]:
    return [store.url, "--epochs", "2", "--batch-size", str(BATCH), "--workers", "2",
            "--checkpoint", str(ckpt), "--checkpoint-every", "4", "--log-file", str(log), *extra]


def _train_cli(store: birdzarr.Store, ckpt: pathlib.Path, log: pathlib.Path, *extra: str) -> str:
    """As a user runs it: a fresh interpreter."""
    argv = [sys.executable, str(SCRIPT), *_argv(store, ckpt, log, *extra)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _train_here(store: birdzarr.Store, ckpt: pathlib.Path, log: pathlib.Path, *extra: str) -> str:
    """In this process (saves a torch import per run); the script's signal handlers are undone after."""
    spec = importlib.util.spec_from_file_location("birdzarr_example_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            assert module.main(_argv(store, ckpt, log, *extra)) == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return out.getvalue()


def _records(log: pathlib.Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("mode", [(), ("--resident", "cpu")], ids=["streaming", "resident"])
def test_train_resume_matches_an_uninterrupted_run(
    tiny_store: birdzarr.Store, tmp_path: pathlib.Path, mode: tuple[str, ...]
) -> None:
    per_epoch = -(-len(tiny_store) // BATCH)
    # Uninterrupted: two epochs.
    full_log = tmp_path / "full.jsonl"
    _train_cli(tiny_store, tmp_path / "full.pt", full_log, *mode)
    full = _records(full_log)
    assert len(full) == 2 * per_epoch
    assert [r["batch"] for r in full] == list(range(per_epoch)) * 2

    # Interrupted twice: mid-epoch 0, then mid-epoch 1 (crossing the epoch boundary), then finished.
    ckpt, log = tmp_path / "cut.pt", tmp_path / "cut.jsonl"
    out = _train_here(tiny_store, ckpt, log, "--max-steps", "5", *mode)
    assert "stopping at epoch 0, batch 5" in out
    out = _train_here(tiny_store, ckpt, log, "--resume", "--max-steps", str(per_epoch), *mode)
    assert "resumed from" in out and "epoch 0, batch 5" in out
    out = _train_here(tiny_store, ckpt, log, "--resume", *mode)
    assert "epoch 1" in out
    cut = _records(log)

    # The same batches in the same order, and the same training trajectory.
    def where(records: list[dict[str, float]]) -> list[tuple[float, ...]]:
        return [(r["epoch"], r["batch"], r["step"]) for r in records]

    assert where(cut) == where(full)
    assert [r["x_sum"] for r in cut] == pytest.approx([r["x_sum"] for r in full], rel=1e-12)
    assert [r["loss"] for r in cut] == pytest.approx([r["loss"] for r in full], rel=1e-5)
    a = torch.load(tmp_path / "full.pt", weights_only=False)
    b = torch.load(ckpt, weights_only=False)
    assert a["epoch"] == b["epoch"] == 2 and a["loader"] is None and b["loader"] is None
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=1e-5, atol=1e-6)
    # Resuming a finished run does nothing.
    _train_here(tiny_store, ckpt, log, "--resume", *mode)
    assert len(_records(log)) == len(full)


def test_train_under_torchrun_two_ranks_stops_and_resumes(
    tiny_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    ckpt, log = tmp_path / "ddp.pt", tmp_path / "ddp.jsonl"
    per_rank = -(-(len(tiny_store) // 2) // BATCH)

    def launch(*extra: str) -> str:
        argv = [torchrun, "--standalone", "--nproc_per_node=2", str(SCRIPT),
                *_argv(tiny_store, ckpt, log, "--epochs", "1", *extra)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=ENV)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    assert "on 2 rank(s)" in launch("--max-steps", "2")
    assert "epoch 0, batch 2" in launch("--resume")
    records = _records(log)  # rank 0's batches: 0, 1, then 2.. after the restart
    assert [r["batch"] for r in records] == list(range(per_rank))
    assert torch.load(ckpt, weights_only=False)["world_size"] == 2
