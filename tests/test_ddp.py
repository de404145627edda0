"""Multi-process training: ``torchrun --nproc_per_node=2`` (gloo, CPU) with WindowDataset.

Each rank iterates one epoch through a forked multi-worker DataLoader, identifies every delivered
window by matching its bytes against the store (not by trusting the loader's own bookkeeping),
all_reduces after every batch (a rank with fewer batches would hang the other: the process group
has a short timeout so a hang fails the test instead of stalling it) and writes what it saw. The
test then checks: disjoint windows across ranks, equal batch counts and sizes, and the whole
epoch covered.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import birdzarr
from birdzarr.demo import _synthetic

pytestmark = [pytest.mark.filterwarnings("ignore:.*stored in device order"), pytest.mark.slow]

N_WINDOWS = 9_999  # odd: the ranks' shares differ, the last batches are short
BATCH = 700
WORLD = 2
EPOCHS = (0, 1)

RANK_SCRIPT = textwrap.dedent(
    """
    import datetime, json, os, sys

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import birdzarr

    store_url, out_dir, batch_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    epochs = [int(e) for e in sys.argv[4].split(",")]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()

    # Every window of the store, keyed by its bytes: delivered tensors are matched against these.
    store = birdzarr.open_store(store_url)
    truth = np.ascontiguousarray(store.windows[:], dtype=np.float32)
    by_bytes = {truth[i].tobytes(): i for i in range(len(truth))}
    assert len(by_bytes) == len(truth), "generated windows must be unique"

    ds = birdzarr.WindowDataset(store_url, batch_size=batch_size, seed=11, with_ldt=False)
    assert (ds.config.world_size, ds.config.rank) == (world, rank), (ds.config.world_size, ds.config.rank)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    for epoch in epochs:
        ds.set_epoch(epoch)
        plan = ds.plan(num_workers=2)
        order = ds.delivery_order(2)  # the order the 2-worker loader yields batch numbers in
        delivered, claimed, sizes = [], [], []
        for step, x in enumerate(loader):
            assert x.dtype == torch.float32 and x.shape[1:] == (20, 4), x.shape
            arr = np.ascontiguousarray(x.numpy())
            delivered.append(np.array([by_bytes[w.tobytes()] for w in arr], dtype=np.int64))
            claimed.append(ds.batch_indices(order[step], plan))
            sizes.append(len(arr))
            total = torch.tensor([float(x.sum())])
            dist.all_reduce(total)  # a rank with fewer batches than the other would hang here
        dist.barrier()
        tag = f"e{epoch}r{rank}"
        np.save(os.path.join(out_dir, f"delivered_{tag}.npy"), np.concatenate(delivered))
        np.save(os.path.join(out_dir, f"claimed_{tag}.npy"), np.concatenate(claimed))
        with open(os.path.join(out_dir, f"meta_{tag}.json"), "w") as f:
            json.dump({"batches": len(sizes), "len": len(ds), "sizes": sizes, "world": world}, f)
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def ddp_store(tmp_path_factory: pytest.TempPathFactory) -> birdzarr.Store:
    root = tmp_path_factory.mktemp("ddp")
    _synthetic.make_parquet_dir(root / "src", n_devices=7, total_windows=N_WINDOWS, seed=5)
    return birdzarr.convert(root / "src", root / "store.zarr", chunk_windows=512, progress=False)


def _torchrun() -> str:
    found = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if found is None:
        pytest.skip("torchrun is not installed")
    return found


def test_torchrun_two_ranks_cover_each_epoch_exactly_once(
    ddp_store: birdzarr.Store, tmp_path: pathlib.Path
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [_torchrun(), "--standalone", f"--nproc_per_node={WORLD}", str(script), ddp_store.url, str(out),
         str(BATCH), ",".join(map(str, EPOCHS))],
        capture_output=True, text=True, timeout=150, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    orders = []
    for epoch in EPOCHS:
        meta = [json.loads((out / f"meta_e{epoch}r{r}.json").read_text()) for r in range(WORLD)]
        delivered = [np.load(out / f"delivered_e{epoch}r{r}.npy") for r in range(WORLD)]
        claimed = [np.load(out / f"claimed_e{epoch}r{r}.npy") for r in range(WORLD)]
        assert all(m["world"] == WORLD for m in meta)
        # Equal batch counts (what keeps DDP's collectives in step), equal to len(ds).
        assert meta[0]["batches"] == meta[1]["batches"] == meta[0]["len"] == meta[1]["len"]
        # Equal batch sizes too: all full but the last, whose sizes differ by at most one window
        # (9,999 windows: 5,000 and 4,999 a rank, 7 batches of 700 and one of 100 or 99)
        assert [m["sizes"] for m in meta] == [[BATCH] * 7 + [100], [BATCH] * 7 + [99]]
        # batch_indices() tells the truth about what was delivered, in order.
        for r in range(WORLD):
            np.testing.assert_array_equal(delivered[r], claimed[r])
        # Disjoint across ranks, no window twice within a rank, and together the whole epoch.
        assert not np.intersect1d(delivered[0], delivered[1]).size
        assert all(len(np.unique(d)) == len(d) for d in delivered)
        np.testing.assert_array_equal(np.sort(np.concatenate(delivered)), np.arange(len(ddp_store)))
        assert [len(d) for d in delivered] == [5_000, 4_999]
        # Shuffled: no rank receives the store in order.
        assert not any((np.diff(d) == 1).all() for d in delivered)
        orders.append(delivered[0])
    # A new order every epoch.
    assert not np.array_equal(orders[0], orders[1])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_the_same_batches_of_the_same_size(
    ddp_store: birdzarr.Store, world: int, drop_last: bool
) -> None:
    """Ranks simulated by world_size/rank, each read by a 2-worker loader: the same number of
    batches, all full but the last (one window apart between ranks); every window once over
    the ranks, or with drop_last exactly each rank's rest left out. (Ranks used to split at
    chunk boundaries: shares a chunk apart, and the poorer rank's batches halved to even the
    counts.)"""
    from torch.utils.data import DataLoader

    share = N_WINDOWS // world  # 4,999 or 3,333, plus one window for the first N_WINDOWS % world ranks
    delivered, sizes = [], []
    for rank in range(world):
        ds = birdzarr.WindowDataset(ddp_store.url, batch_size=BATCH, seed=11, world_size=world, rank=rank,
                                    drop_last=drop_last)
        ds.set_epoch(1)
        plan = ds.plan(num_workers=2)
        order = ds.delivery_order(2)
        got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
        assert len(got) == len(ds)
        sizes.append(sorted((len(x) for x in got), reverse=True))
        indices = [ds.batch_indices(b, plan) for b in order]
        for x, idx in zip(got, indices, strict=True):
            np.testing.assert_array_equal(x.numpy(), ddp_store.windows[idx])
        delivered.append(np.concatenate(indices))
    if drop_last:
        assert sizes == [[BATCH] * (share // BATCH)] * world
    else:
        lasts = [share + (r < N_WINDOWS % world) - (len(sizes[0]) - 1) * BATCH for r in range(world)]
        assert sizes == [[BATCH] * (len(sizes[0]) - 1) + [last] for last in lasts]
    flat = np.concatenate(delivered)
    assert len(np.unique(flat)) == len(flat)
    if drop_last:
        assert len(flat) == world * (share // BATCH) * BATCH
    else:
        np.testing.assert_array_equal(np.sort(flat), np.arange(N_WINDOWS))
