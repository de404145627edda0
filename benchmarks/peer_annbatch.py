"""birdzarr's default streaming beside its closest peer, annbatch, on the same generated data.

    python benchmarks/peer_annbatch.py                          # 2.5 M windows of 186 devices
    python benchmarks/peer_annbatch.py --windows 600000 --rounds 1
    git worktree add /tmp/before HEAD~1 && python benchmarks/peer_annbatch.py --baseline /tmp/before

The data is the loader benchmark's (``benchmarks/loader.py``: 186 devices as skewed as the real
set, calibrated values, one ``all.npy`` and a ``--shuffle`` birdzarr store, under --workdir).
annbatch (Zarr v3; each epoch shuffles 512-row slices, preloads a pool of slices, permutes it and
cuts batches, in the training process on threads) needs Python >= 3.12: this script makes its own
virtual environment under ``benchmarks/out/annbatch-venv`` (with ``python3.12`` from PATH or
pyenv), installs ``annbatch[zarrs]`` there, writes annbatch's shuffled collection from the same
windows (an AnnData of ``X`` = the 80 values of each window, ``DatasetCollection.add_adatas``
with its defaults), and skips the peer with one line when any of that fails.

Cases, each in its own process, interleaved over --rounds (ratios come from one run):

* the in-RAM numpy gather of a random permutation (the limit: no decoding, no DataLoader);
* birdzarr ``WindowDataset`` defaults on the ``--shuffle`` store, 2 persistent DataLoader workers;
* birdzarr ``resident="cpu"`` (the store's codes held in shared memory), 2 persistent workers;
* with ``--baseline PATH``: the default streaming case of the birdzarr checkout at PATH (run with
  ``PYTHONPATH=PATH``), for a before/after of a change in the same run;
* annbatch defaults (``chunk_size=512, preload_nchunks=32``) and its README's recommended
  ``chunk_size=32, preload_nchunks=256``, in-process (its README advises against DataLoader
  workers), zarrs decoding, numpy batches.

Every case runs --epochs epochs (default 3) of batch 8192 in one process (DataLoader workers
persist across them). Reported: time to the first batch of epoch 0 (from creating the iterator:
it includes starting workers) and of the later epochs (the median and the largest over epochs
1.. of every round), windows/s after the first batch of each epoch (epoch 0 apart; the later
epochs are the steady state), peak private RAM of the process tree (USS), the three
shuffle-quality figures (docs/training.md#shuffle-quality) of epochs 0 and 1, and the 1-minute
load average (``/proc/loadavg``) at the start and end of the case's runs: the machine may be
shared, and every rate is then a fraction of what the same code does on a quiet one.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import (  # noqa: E402
    PeakSampler,
    dir_bytes,
    log,
    machine,
    outside_repository,
    table,
    tree_private,
    work_directory,
)
from loader import BATCH, REPO, SEED, prepare  # noqa: E402

MB = 1e6
VENV = os.path.join(REPO, "benchmarks", "out", "annbatch-venv")
ANNBATCH = "annbatch[zarrs]==0.3.1"
WORKERS = 2

# Run by the annbatch environment's Python: write the collection, or read two epochs.
PEER = textwrap.dedent(
    """
    import json, os, sys, time, resource
    import numpy as np
    import anndata as ad
    import pandas as pd
    import zarr
    from annbatch import DatasetCollection, Loader

    try:
        import zarrs  # noqa: F401
        zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})  # as its README says
    except ImportError:
        pass
    command, workdir = sys.argv[1], sys.argv[2]
    collection_path = os.path.join(workdir, "annbatch.zarr")
    if command == "write":
        started = time.perf_counter()
        windows = np.load(os.path.join(workdir, "all.npy"), mmap_mode="r")
        adata = ad.AnnData(X=np.ascontiguousarray(windows).reshape(len(windows), -1),
                           obs=pd.DataFrame({"window": np.arange(len(windows))},
                                            index=np.arange(len(windows)).astype(str)))
        source = os.path.join(workdir, "annbatch-source.h5ad")
        adata.write_h5ad(source)
        del adata, windows
        wrote_source = time.perf_counter() - started
        started = time.perf_counter()
        DatasetCollection(collection_path).add_adatas([source], rng=np.random.default_rng(0))
        os.remove(source)
        print(json.dumps({"source_s": wrote_source, "collection_s": time.perf_counter() - started,
                          "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3}))
        sys.exit(0)
    chunk_size, preload, batch, seed, n_epochs = (int(a) for a in sys.argv[3:8])
    collection = DatasetCollection(collection_path)
    window_of = collection.obs(columns=["window"])["window"].to_numpy()  # collection row -> window
    loader = Loader(batch_size=batch, chunk_size=chunk_size, preload_nchunks=preload, shuffle=True,
                    return_index=True, rng=np.random.default_rng(seed))
    loader.use_collection(collection, load_adata=lambda g: ad.AnnData(X=g["X"]))
    epochs, members = [], []
    for epoch in range(n_epochs):
        started = time.perf_counter()
        first = None
        n = n_first = 0
        kept = []
        for out in loader:
            x = out["X"]
            n += len(x)
            if first is None:
                first, n_first = time.perf_counter(), len(x)
            if epoch < 2:
                kept.append(window_of[out["index"]])
        ended = time.perf_counter()
        epochs.append({"first_batch_s": first - started, "windows_per_s": (n - n_first) / (ended - first),
                       "windows": n})
        if epoch < 2:
            members.append(kept)
    path = os.path.join(workdir, f"members-annbatch-{chunk_size}-{preload}.npz")
    np.savez(path, **{f"e{e}": np.concatenate(m) for e, m in enumerate(members)},
             **{f"s{e}": np.array([len(b) for b in m]) for e, m in enumerate(members)})
    print(json.dumps({"epochs": epochs, "members": path}))
    """
)


# -- the peer's environment ------------------------------------------------------------------------
def python312() -> str | None:
    """A Python >= 3.12 to make annbatch's environment with: PATH first, then pyenv's versions."""
    for name in ("python3.14", "python3.13", "python3.12"):
        found = shutil.which(name)
        if found:
            return found
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for pattern in ("3.14*", "3.13*", "3.12*"):
        found = sorted(glob.glob(os.path.join(root, "versions", pattern, "bin", "python3")), reverse=True)
        if found:
            return found[0]
    return None


def peer_environment(log: Any) -> tuple[str | None, str]:
    """(the annbatch environment's python, or None; why not, in one line)."""
    python = os.path.join(VENV, "bin", "python")
    check = [python, "-c", "import annbatch, zarrs; print(annbatch.__version__)"]
    if os.path.exists(python) and subprocess.run(check, capture_output=True).returncode == 0:
        return python, ""
    base = python312()
    if base is None:
        return None, "no Python >= 3.12 found (PATH or pyenv) for annbatch"
    log(f"making annbatch's environment in {VENV} with {base}")
    steps = [[base, "-m", "venv", "--clear", VENV], [python, "-m", "pip", "install", "-q", ANNBATCH]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return None, f"{' '.join(step[2:4])} failed: {last[:150]}"
    if subprocess.run(check, capture_output=True).returncode:
        return None, f"{ANNBATCH} installed but does not import"
    return python, ""


# -- cases -----------------------------------------------------------------------------------------
def _timed_epochs(epochs_of: Any, n_epochs: int) -> list[dict[str, float]]:
    """Time each epoch: ``epochs_of(epoch)`` gives an iterable of batches (x first, or a pair)."""
    epochs = []
    for epoch in range(n_epochs):
        batches = epochs_of(epoch)
        started = time.perf_counter()
        first, n, n_first = None, 0, 0
        for batch in batches:
            x = batch[0] if isinstance(batch, tuple) else batch
            n += len(x)
            if first is None:
                first, n_first = time.perf_counter(), len(x)
        ended = time.perf_counter()
        assert first is not None, "no batch"
        epochs.append({"first_batch_s": first - started, "windows_per_s": (n - n_first) / (ended - first),
                       "windows": n})
    return epochs


def own_case(kind: str, workdir: str, store: str, n_epochs: int, shuffle_buffer: int | None = None,
             tag: str | None = None) -> dict[str, Any]:
    """In this environment's child process: the gather limit, or birdzarr (streaming, resident;
    ``shuffle_buffer``: streaming with that instead of the default)."""
    if kind == "gather":
        import _loader_baselines as base

        data = np.load(os.path.join(workdir, "all.npy"))  # fully into RAM
        members: list[list[np.ndarray]] = [[], []]

        def gather(epoch: int) -> Any:
            for x, indices in base.ideal_gather(data, BATCH, seed=SEED + epoch):
                if epoch < 2:
                    members[epoch].append(indices)
                yield x

        epochs = _timed_epochs(gather, n_epochs)
        devices = None
    else:
        from torch.utils.data import DataLoader

        import birdzarr

        options: dict[str, Any] = {"resident": "cpu", "progress": False} if kind == "resident" else {}
        if shuffle_buffer is not None:
            options["shuffle_buffer"] = shuffle_buffer
        ds = birdzarr.WindowDataset(store, batch_size=BATCH, seed=SEED, **options)
        loader = DataLoader(ds, batch_size=None, num_workers=WORKERS, persistent_workers=True)

        def stream(epoch: int) -> Any:
            ds.set_epoch(epoch)
            return loader

        epochs = _timed_epochs(stream, n_epochs)
        members = []
        for epoch in (0, 1):  # from the plan (pure), not timed
            ds.set_epoch(epoch)
            plan = ds.plan(num_workers=WORKERS) if ds.resident is None else None
            members.append([ds.batch_indices(b, plan) for b in ds.delivery_order(WORKERS)])
        devices = birdzarr.open_store(store).window_devices[:]
    tag = ("" if shuffle_buffer is None else f"-{shuffle_buffer}") + ("" if tag is None else f"-{tag}")
    path = os.path.join(workdir, f"members-{kind}{tag}.npz")
    extra = {} if devices is None else {"devices": devices}
    np.savez(path, **{f"e{e}": np.concatenate(m) for e, m in enumerate(members)},
             **{f"s{e}": np.array([len(b) for b in m]) for e, m in enumerate(members)}, **extra)
    return {"epochs": epochs, "members": path}


def measure(argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one case in a child process (``env``: its environment, else this one's); sample the
    private memory of its process tree from here."""
    load_before = os.getloadavg()[0]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    with PeakSampler(lambda: tree_private(proc.pid), 0.2) as sampler:
        out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])} failed (exit {proc.returncode})")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["peak_uss_mb"] = sampler.peak[0] / MB
    result["load"] = (load_before, os.getloadavg()[0])
    return result


def quality(members_path: str, devices_by_window: np.ndarray, proportions: tuple[np.ndarray, np.ndarray],
            quality_batches: int) -> dict[str, float]:
    from birdzarr.loader._quality import pair_cooccurrence_ratio, quality_ratio, repeated_batch_fraction

    saved = np.load(members_path)
    devices = saved["devices"] if "devices" in saved.files else devices_by_window
    epochs = [np.split(saved[f"e{e}"], np.cumsum(saved[f"s{e}"])[:-1]) for e in (0, 1)]
    ids, counts = proportions
    return {
        "device_mix": quality_ratio([devices[b] for b in epochs[1][:quality_batches]], ids, counts),
        "repeated": repeated_batch_fraction(epochs[0], epochs[1]),
        "cooccurrence": pair_cooccurrence_ratio(epochs[0], epochs[1], len(devices)),
    }


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return handle.read().strip()


CASES = ("gather", "birdzarr", "resident", "annbatch", "annbatch-recommended")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2_500_000)
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs a case runs in one process (>= 2: epoch 0, then the steady state)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    parser.add_argument("--workdir", default="/tmp/birdzarr-peer-bench")
    parser.add_argument("--keep", action="store_true", help="keep the generated data (reused next time)")
    parser.add_argument("--quality-batches", type=int, default=100)
    parser.add_argument("--no-peer", action="store_true", help="skip annbatch")
    parser.add_argument("--shuffle-buffers", default="",
                        help="comma-separated shuffle_buffer values: a birdzarr streaming case for each, "
                             "beside the default one (the memory a smaller pool saves, its co-occurrence)")
    parser.add_argument("--baseline", default=None, metavar="PATH",
                        help="a checkout of birdzarr (e.g. a `git worktree` of an older commit): adds "
                             "its default streaming case, run with PYTHONPATH=PATH, interleaved with "
                             "the others, for a before/after in one run")
    parser.add_argument("--shuffle-buffer", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tag", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--own-case", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.own_case:
        kind, workdir, store, n_epochs = args.own_case
        print(json.dumps(own_case(kind, workdir, store, int(n_epochs), args.shuffle_buffer, args.tag)))
        return 0
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CASES))
    if unknown or not chosen:
        parser.error(f"--cases: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(CASES)}")
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (epoch 0, then the steady state)")
    workdir = outside_repository(parser, args.workdir)
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    with work_directory(workdir, prefix="", keep=args.keep):
        meta = prepare(workdir, args.windows, args.devices, scale_check=False, log=log)
        store = meta["stores"]["shuffled"]
        devices_by_window = np.repeat(np.asarray(meta["device_ids"]), np.asarray(meta["sizes"]))
        proportions = (np.asarray(meta["device_ids"]), np.asarray(meta["sizes"]))
        me = [sys.executable, os.path.abspath(__file__), "--workdir", workdir, "--own-case"]
        own = {
            "gather": ("in-RAM numpy gather (the limit)", "gather"),
            "birdzarr": ("birdzarr defaults: streaming a --shuffle store, 2 persistent workers", "birdzarr"),
            "resident": ('birdzarr resident="cpu" (codes), --shuffle store, 2 persistent workers',
                         "resident"),
        }
        cases: list[tuple[str, list[str]]] = [
            (own[c][0], [*me, own[c][1], workdir, store, str(args.epochs)]) for c in CASES
            if c in own and c in chosen]
        envs: dict[str, dict[str, str]] = {}
        if args.baseline:
            baseline = os.path.abspath(args.baseline)
            if not os.path.isdir(os.path.join(baseline, "birdzarr")):
                parser.error(f"--baseline: {baseline} holds no birdzarr package")
            label = f"birdzarr defaults streaming, baseline ({baseline})"
            cases.append((label, [*me[:-1], "--tag", "baseline", "--own-case", "birdzarr", workdir,
                                  store, str(args.epochs)]))
            envs[label] = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [baseline, *filter(None, [os.environ.get("PYTHONPATH")])])}
        for value in [int(v) for v in args.shuffle_buffers.split(",") if v.strip()]:
            cases.append((f"birdzarr streaming, shuffle_buffer={value:,}",
                          [*me[:-1], "--shuffle-buffer", str(value), "--own-case", "birdzarr", workdir, store,
                           str(args.epochs)]))
        wanted_peers = [c for c in ("annbatch", "annbatch-recommended") if c in chosen]
        python, why = (None, "--no-peer") if args.no_peer else (
            peer_environment(log) if wanted_peers else (None, "not in --cases"))
        peer_label = None
        if python is None:
            print(f"annbatch: skipped ({why})")
        else:
            peer = os.path.join(workdir, "annbatch_peer.py")
            with open(peer, "w") as handle:
                handle.write(PEER)
            if not os.path.exists(os.path.join(workdir, "annbatch.zarr")):
                wrote = measure([python, peer, "write", workdir])
                log(f"annbatch's collection written in {wrote['source_s'] + wrote['collection_s']:.0f} s "
                    f"(h5ad source {wrote['source_s']:.0f} s, add_adatas {wrote['collection_s']:.0f} s), "
                    f"peak RSS {wrote['maxrss_mb']:.0f} MB")
            sizes = {"annbatch": dir_bytes(os.path.join(workdir, "annbatch.zarr")),
                     "birdzarr": dir_bytes(store), "parquet": dir_bytes(meta["parquet"])}
            log("store vs Parquet: birdzarr --shuffle "
                f"{sizes['birdzarr'] / sizes['parquet']:.2f}x, "
                f"annbatch {sizes['annbatch'] / sizes['parquet']:.2f}x")
            peers = {"annbatch": (512, 32, "annbatch 0.3.1 defaults (512-row slices, 32 preloaded)"),
                     "annbatch-recommended": (32, 256, "annbatch, README's recommended 32 / 256")}
            for name in wanted_peers:
                chunk_size, preload, label = peers[name]
                peer_label = peer_label or (label if name == "annbatch" else None)
                cases.append((label, [python, peer, "read", workdir, str(chunk_size), str(preload),
                                      str(BATCH), str(SEED), str(args.epochs)]))
        log(f"load average at the start: {loadavg()}")
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in cases}
        for round_number in range(args.rounds):  # interleaved: a noisy minute does not hit one case only
            for label, argv in cases:
                result = measure(argv, envs.get(label))
                if round_number == 0:
                    result.update(quality(result["members"], devices_by_window, proportions,
                                          args.quality_batches))
                runs[label].append(result)
                e0, later = result["epochs"][0], result["epochs"][1:]
                rates = " ".join(f"{e['windows_per_s'] / MB:.2f}" for e in later)
                waits = " ".join(f"{e['first_batch_s']:.3f}" for e in later)
                log(f"{label}: epoch 0 {e0['windows_per_s'] / MB:.2f} M/s (first batch "
                    f"{e0['first_batch_s']:.2f} s), later epochs {rates} M/s (first batch {waits} s), "
                    f"peak private {result['peak_uss_mb']:.0f} MB, load {result['load'][0]:.1f}-"
                    f"{result['load'][1]:.1f}")
        log(f"load average at the end: {loadavg()}")
        rows = []

        def values(label: str, key: str, later: bool) -> list[float]:
            return [e[key] for r in runs[label] for e in (r["epochs"][1:] if later else r["epochs"][:1])]

        limit_label = own["gather"][0] if "gather" in chosen else None
        limit = float(np.median(values(limit_label, "windows_per_s", True))) if limit_label else None
        peer_steady = float(np.median(values(peer_label, "windows_per_s", True))) if peer_label else None
        for label, _ in cases:
            first = runs[label][0]
            steady = float(np.median(values(label, "windows_per_s", True)))
            firsts = values(label, "first_batch_s", True)
            loads = [x for r in runs[label] for x in r["load"]]
            rows.append({
                "loader": label,
                "later epochs M windows/s": round(steady / MB, 2),
                "% of gather": round(100 * steady / limit) if limit else "-",
                "x annbatch defaults": round(steady / peer_steady, 2) if peer_steady else "-",
                "epoch 0 M/s": round(float(np.median(values(label, "windows_per_s", False))) / MB, 2),
                "first batch, epoch 0 (s)": round(float(np.median(values(label, "first_batch_s", False))), 3),
                "first batch, later epochs: median / max (s)":
                    f"{float(np.median(firsts)):.3f} / {max(firsts):.3f}",
                "device mix": round(first["device_mix"], 2),
                "repeated": f"{100 * first['repeated']:.0f}%",
                "co-occurrence": round(first["cooccurrence"], 2),
                "peak private MB": round(float(np.median([r["peak_uss_mb"] for r in runs[label]]))),
                "load (1 min)": f"{min(loads):.1f}-{max(loads):.1f}",
            })
        print()
        print(f"{args.windows:,} windows of {args.devices} devices, birdzarr "
              f"store, batch {BATCH}, {args.epochs} epochs a case, {args.rounds} interleaved round(s), "
              f"medians (later epochs: epochs 1..{args.epochs - 1} of every round); started {started_at}; "
              f"{machine()}")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
