"""Training loader benchmark: shuffled batches of 8192 windows, 2 DataLoader workers, one run.

    python benchmarks/loader.py                      # 186 devices, 2.5 M windows, + 2x scale check
    python benchmarks/loader.py --windows 500000 --no-scale-check   # quicker
    python benchmarks/loader.py --only "(f) WindowDataset default, --shuffle store" --epochs 4
                                                     # + the first batch of epochs 1..3

Generates realistic data (186 devices as skewed as the real set, calibrated values) into
--workdir (under /tmp; removed at the end unless --keep, or unless it existed before the run),
writes it as per-device Parquet files, one ``.npy`` of all windows and one ``.npy`` per device,
converts it with birdzarr (device order, and pre-shuffled when ``birdzarr.convert`` has
``shuffle=``), then compares:

  (a) the in-RAM BirdDataset birdzarr replaces, DataLoader with a shuffled sampler (per item)
  (b) one memory-mapped .npy, per-item __getitem__
  (c) per-device .npy memmaps, per-item __getitem__
  (d) a block-random sampler over the memmap (shuffled block order, blocks read sequentially)
  (e) an ideal in-RAM numpy gather of sorted random indices (no DataLoader: the upper limit)
  (g) torch's own transport: 2 workers that only hand over a new shared-memory batch each (what any
      loader pays that does not reuse shared memory, as WindowDataset does)
  (f) birdzarr.WindowDataset, default settings, on the device-ordered and the pre-shuffled
      store; and one chunk a batch (a pool of one 8192-window chunk of a --shuffle store written
      in 8192-window chunks), the reference the default pools are measured against

Every case runs in its own process. Reported: windows/s after the first batch (a full epoch, or
the first --item-batches batches for the slow per-item loaders (b)-(d)), time to the first batch
(from creating the DataLoader iterator, so it includes starting the workers), peak private RAM of
the process tree (sum of USS of the process and its workers, sampled every 0.2 s from outside),
and the shuffle quality ratio of the first --quality-batches batches (birdzarr: device ids from
``with_ldt=True``; the others: the known device of each index the sampler handed out). With
``--epochs N`` the WindowDataset cases go on for epochs 1..N-1 with the same persistent workers
(``set_epoch`` before each): the table adds the median (and the largest) time to the first batch
of those epochs, from creating each epoch's iterator, and their median rate.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import PeakSampler, log, machine, outside_repository, table, tree_private, work_directory  # noqa: E402

BATCH = 8192
WORKERS = 2
SEED = 1234
MB = 1e6
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- data ----------------------------------------------------------------------------------------
def prepare(workdir: str, n_windows: int, n_devices: int, *, scale_check: bool, log: Any) -> dict[str, Any]:
    """Generate the data once (reused when --keep left a matching one behind)."""
    import pyarrow.parquet as pq  # noqa: F401  (fail early if missing)

    import birdzarr
    from birdzarr.demo import _synthetic

    formats: dict[str, Any] = {}
    shuffled: dict[str, Any] = {"shuffle": True, "seed": 0}
    # one chunk a batch, the reference the default pools are measured against: a --shuffle store
    # in 8192-window chunks
    one_batch_chunks = {**shuffled, "chunk_windows": BATCH}
    conversions = [("device", "parquet", formats), ("shuffled", "parquet", shuffled),
                   ("shuffled8k", "parquet", one_batch_chunks)]
    if scale_check:
        conversions += [("device2x", "parquet2x", formats), ("shuffled2x", "parquet2x", shuffled)]
    meta_path = os.path.join(workdir, "meta.json")
    wanted = {"windows": n_windows, "devices": n_devices, "scale_check": scale_check,
              "conversions": {name: options for name, _, options in conversions}}
    if os.path.exists(meta_path):
        with open(meta_path) as handle:
            meta = json.load(handle)
        if meta["params"] == wanted:
            log(f"reusing the data in {workdir}")
            return meta
        shutil.rmtree(workdir)
    os.makedirs(workdir, exist_ok=True)
    ids = _synthetic.device_ids(n_devices).tolist()
    sizes = _synthetic.device_sizes(n_devices, n_windows, seed=0).tolist()
    paths = {name: os.path.join(workdir, name) for name in ("parquet", "npy", "parquet2x")}
    for path in paths.values():
        os.makedirs(path, exist_ok=True)
    all_npy = os.path.join(workdir, "all.npy")
    everything = np.lib.format.open_memmap(all_npy, mode="w+", dtype=np.float32, shape=(n_windows, 20, 4))
    started = time.perf_counter()
    at = 0
    for device, size in zip(ids, sizes, strict=True):
        windows = _synthetic.curated_windows(size, seed=device)
        _synthetic.write_parquet(windows, os.path.join(paths["parquet"], f"{device}.parquet"))
        np.save(os.path.join(paths["npy"], f"{device}.npy"), windows)
        everything[at : at + size] = windows
        at += size
        if scale_check:  # 2x the data with the same skew: every device's windows twice
            doubled = np.concatenate([windows, windows])
            _synthetic.write_parquet(doubled, os.path.join(paths["parquet2x"], f"{device}.parquet"))
    everything.flush()
    del everything
    log(f"generated {n_windows:,} windows of {n_devices} devices in {time.perf_counter() - started:.0f} s "
        f"(largest device {max(sizes):,}, smallest {min(sizes):,})")
    has_shuffle = "shuffle" in inspect.signature(birdzarr.convert).parameters
    stores: dict[str, str] = {}
    for name, source, options in conversions:
        if "shuffle" in options and not has_shuffle:
            continue
        dest = os.path.join(workdir, f"{name}.zarr")
        started = time.perf_counter()
        with warnings.catch_warnings():
            if source == "parquet2x":  # every window twice, on purpose: the duplicate warning is expected
                warnings.simplefilter("ignore", birdzarr.DuplicateWindowsWarning)
            birdzarr.convert(paths[source], dest, overwrite=True, progress=False, **options)
        stores[name] = dest
        log(f"converted {name} store in {time.perf_counter() - started:.0f} s")
    if not has_shuffle:
        log("birdzarr.convert has no shuffle= yet: the pre-shuffled store is skipped")
    meta = {"params": wanted, "device_ids": ids, "sizes": sizes, "stores": stores, "all_npy": all_npy,
            "parquet": paths["parquet"], "npy": paths["npy"]}
    with open(meta_path, "w") as handle:
        json.dump(meta, handle)
    return meta


# -- one case, in its own process ----------------------------------------------------------------
def _iterate(batches: Any, *, max_batches: int | None, quality_batches: int,
             ids_of: Any = None) -> dict[str, Any]:
    """Consume batches; time the first one and the rest; keep the device ids of the first ones."""
    started = time.perf_counter()
    first_at = None
    n = n_first = count = 0
    kept: list[np.ndarray] = []
    for batch in batches:
        x = batch[0] if isinstance(batch, tuple | list) else batch
        count += 1
        n += len(x)
        if first_at is None:
            first_at, n_first = time.perf_counter(), len(x)
        if ids_of is not None and len(kept) < quality_batches:
            kept.append(ids_of(batch))
        if max_batches and count >= max_batches:
            break
    ended = time.perf_counter()
    assert first_at is not None, "no batch"
    rest = ended - first_at
    return {"windows": n, "batches": count, "first_batch_s": first_at - started, "seconds": ended - started,
            "windows_per_s": (n - n_first) / rest if rest > 0 else float("nan"), "kept": kept}


def _quality(kept: list[np.ndarray], meta: dict[str, Any]) -> float:
    from birdzarr.loader._quality import quality_ratio

    return quality_ratio(kept, np.asarray(meta["device_ids"]), np.asarray(meta["sizes"]))


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    import _loader_baselines as base
    from torch.utils.data import DataLoader

    meta = spec["meta"]
    kind, q = spec["kind"], spec["quality_batches"]
    ids, sizes = np.asarray(meta["device_ids"]), np.asarray(meta["sizes"])
    starts = np.concatenate(([0], np.cumsum(sizes)))
    n_total = int(starts[-1])
    result: dict[str, Any] = {}

    def devices_of(indices: np.ndarray) -> np.ndarray:
        return ids[np.searchsorted(starts, indices, side="right") - 1]

    def by_index(sampler: base.RecordingSampler, batches: int) -> list[np.ndarray]:
        recorded = sampler.recorded[: batches * BATCH]
        return [devices_of(recorded[i : i + BATCH]) for i in range(0, len(recorded), BATCH)]

    if kind == "ideal":
        started = time.perf_counter()
        data = np.load(meta["all_npy"])  # fully into RAM
        result["load_s"] = time.perf_counter() - started
        out = _iterate(base.ideal_gather(data, BATCH, seed=SEED), max_batches=None, quality_batches=q,
                       ids_of=lambda batch: devices_of(batch[1]))
    elif kind == "ceiling":
        loader = DataLoader(base.ReadyBatches(n_total, BATCH), batch_size=None, num_workers=WORKERS)
        out = _iterate(loader, max_batches=None, quality_batches=q)
    elif kind == "birdzarr":
        import birdzarr

        started = time.perf_counter()
        names = ("shuffle_buffer", "resident", "resident_codes", "allow_device_order", "split", "devices")
        options = {k: spec[k] for k in names if spec.get(k) is not None}
        if "devices" in options:  # every other device: a subset that is not one contiguous range
            options["devices"] = meta["device_ids"][:: int(options["devices"])]
        try:
            ds = birdzarr.WindowDataset(meta["stores"][spec["store"]], batch_size=BATCH, seed=SEED,
                                        with_ldt=spec["ldt"], progress=False, **options)
        except birdzarr.SamplingError as exc:
            return {"refused": str(exc).split(": ", 1)[1][:60] + "..."}
        result["open_s"] = time.perf_counter() - started
        workers = spec.get("workers", WORKERS)
        if ds.resident is None:
            pools = ds.plan(num_workers=workers).pools
            result["pool_chunks"] = float(np.mean([len(p.chunks) for p in pools]))
        loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
        ids_of = (lambda batch: batch[1][:, 1].numpy().copy()) if spec["ldt"] else None
        out = _iterate(loader, max_batches=None, quality_batches=q, ids_of=ids_of)
        later = []  # epochs 1.. of the same (persistent) workers: their first batch and rate
        for epoch in range(1, spec.get("epochs", 1)):
            ds.set_epoch(epoch)
            later.append(_iterate(loader, max_batches=None, quality_batches=0))
        if later:
            result["later_first_batch_s"] = [e["first_batch_s"] for e in later]
            result["later_windows_per_s"] = [e["windows_per_s"] for e in later]
        # batch membership of epochs 0 and 1 (from the plan, not timed): fresh batches every epoch?
        members = []
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            plan = ds.plan(num_workers=workers)  # the pools are sized for the workers
            members.append([ds.batch_indices(b, plan) for b in ds.delivery_order(workers)])
        from birdzarr.loader._quality import pair_cooccurrence_ratio, repeated_batch_fraction

        result["repeated"] = repeated_batch_fraction(members[0], members[1])
        n_store = n_total * spec.get("scale", 1)
        result["cooccurrence"] = pair_cooccurrence_ratio(members[0], members[1], n_store)
        window_devices = birdzarr.open_store(meta["stores"][spec["store"]]).window_devices[:]
        if ids_of is None:  # quality from the same batches' device ids (x-only runs deliver the same)
            out["kept"] = [window_devices[m] for m in members[0][:q]]
        # a subset is compared with its own device proportions
        chosen, counts = np.unique(window_devices[np.concatenate(members[0])], return_counts=True)
        result["selection"] = {"device_ids": chosen.tolist(), "sizes": counts.tolist()}
    else:
        started = time.perf_counter()
        if kind == "old":
            files = [os.path.join(meta["parquet"], f"{d}.parquet") for d in meta["device_ids"]]
            ds = base.BirdDataset(files)
        elif kind == "memmap":
            ds = base.MemmapDataset(meta["all_npy"])
        elif kind == "perdevice":
            ds = base.PerDeviceMemmapDataset(
                [os.path.join(meta["npy"], f"{d}.npy") for d in meta["device_ids"]], meta["sizes"])
        else:  # block-random sampler over the memmap
            ds = base.MemmapDataset(meta["all_npy"])
        result["load_s"] = time.perf_counter() - started
        assert len(ds) == n_total
        if kind == "block":
            sampler = base.BlockRandomSampler(n_total, block=BATCH, seed=SEED, keep=q * BATCH)
        else:
            sampler = base.RecordingSampler(n_total, seed=SEED, keep=q * BATCH)
        loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=WORKERS)
        out = _iterate(loader, max_batches=spec.get("max_batches"), quality_batches=q)
        out["kept"] = by_index(sampler, min(q, out["batches"]))
    kept = out.pop("kept")
    result.update(out)
    if "selection" in result:
        meta = {**meta, **result.pop("selection")}
    result["quality"] = _quality(kept, meta) if kept else None
    result["quality_batches"] = len(kept)
    result["self_maxrss_mb"] = _maxrss() / MB
    return result


def _maxrss() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def measure(spec: dict[str, Any], *, interval: float = 0.2) -> dict[str, Any]:
    """Run one case in a child process; sample the USS/PSS of its process tree from here."""
    argv = [sys.executable, os.path.abspath(__file__), "--run-case", json.dumps(spec)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    with PeakSampler(lambda: tree_private(proc.pid), interval) as sampler:
        out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"case {spec['label']} failed (exit {proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_uss_mb"], result["peak_pss_mb"] = (value / MB for value in sampler.peak)
    return result


# -- the run -------------------------------------------------------------------------------------
def cases(meta: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    common = {"meta": meta, "quality_batches": args.quality_batches, "epochs": args.epochs}
    items = {"max_batches": args.item_batches}
    out: list[dict[str, Any]] = [
        {"label": "(a) in-RAM BirdDataset (baseline)", "kind": "old", "max_batches": None},
        {"label": "(b) one .npy memmap, per item", "kind": "memmap", **items},
        {"label": "(c) per-device .npy memmaps", "kind": "perdevice", **items},
        {"label": "(d) block-random sampler", "kind": "block", **items},
        {"label": "(e) ideal in-RAM gather", "kind": "ideal"},
        {"label": "(g) torch transport only: 2 workers, fresh shared batches", "kind": "ceiling"},
    ]
    shuffled = {"kind": "birdzarr", "store": "shuffled", "ldt": True}
    device = {"kind": "birdzarr", "store": "device", "ldt": True}
    out += [
        {"label": "(f) one chunk a batch: pool of 1 chunk, --shuffle store in 8192-window chunks",
         **shuffled, "store": "shuffled8k", "shuffle_buffer": BATCH},
        {"label": "(f) WindowDataset default, --shuffle store", **shuffled},
        {"label": "(f) WindowDataset default, x only, --shuffle store", **shuffled, "ldt": False},
        {"label": "(f) WindowDataset default, --shuffle store, split=train", **shuffled, "split": "train"},
        {"label": "(f) WindowDataset default, --shuffle store, every 2nd device", **shuffled, "devices": 2},
        {"label": "(f) WindowDataset default, device order (refused)", **device},
        {"label": "(f) WindowDataset default, device order, allow_device_order", **device,
         "allow_device_order": True},
        {"label": "(f) WindowDataset device order, allow_device_order, split=train", **device,
         "allow_device_order": True, "split": "train"},
        {"label": "(h) resident='cpu', --shuffle store (codes), 0 workers", **shuffled, "resident": "cpu",
         "workers": 0},
        {"label": "(h) resident='cpu', device order (codes), 0 workers", **device, "resident": "cpu",
         "workers": 0},
        {"label": "(h) resident='cpu', device order (codes), 2 workers", **device, "resident": "cpu"},
        {"label": "(h) resident='cpu', device order, resident_codes=False, 0 workers", **device,
         "resident": "cpu", "resident_codes": False, "workers": 0},
        {"label": "(h) resident='cpu', device order, resident_codes=False, 2 workers", **device,
         "resident": "cpu", "resident_codes": False},
    ]
    for store in ("device2x", "shuffled2x"):
        if store in meta["stores"]:
            if store == "shuffled2x":
                out.append({"label": "(f) WindowDataset default, --shuffle store, 2x data",
                            "kind": "birdzarr", "store": store, "ldt": True, "scale": 2})
            else:
                out.append({"label": "(f) WindowDataset device order, allow_device_order, split=train, 2x",
                            "kind": "birdzarr", "store": store, "ldt": True, "scale": 2,
                            "allow_device_order": True, "split": "train"})
    return [{**common, **case} for case in out]


def predicted_device_order(meta: dict[str, Any], pool_chunks: float) -> float:
    """Quality ratio of a batch whose windows come from K chunks of one device each: the device
    mix then has only K independent draws (TV of K multinomial draws, ~sqrt(B/K) times that of B
    draws until it saturates) plus the batch's own sampling noise, so about sqrt(1 + B/K)."""
    from birdzarr.loader._quality import uniform_tv_distance

    sizes = np.asarray(meta["sizes"], dtype=float)
    proportions = sizes / sizes.sum()
    k = max(1, round(pool_chunks))
    ratio = uniform_tv_distance(proportions, k) / uniform_tv_distance(proportions, BATCH)
    return float(np.sqrt(1 + ratio**2))


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["loader"] for r in rows][::-1]
    speed = [r["M windows/s"] for r in rows][::-1]
    ram = [r["peak private MB"] for r in rows][::-1]
    quality = [r["device mix"] if isinstance(r["device mix"], float) else np.nan for r in rows][::-1]
    palette = {"(f)": "#1f77b4", "(h)": "#9467bd", "(e)": "#2ca02c", "(g)": "#ff7f0e"}
    colours = [palette.get(label[:3], "#7f7f7f") for label in labels]
    # drawn at the width the docs site shows it (~700 px): 9 in at 80 dpi, fonts >= 8 pt
    fig, axes = plt.subplots(1, 3, figsize=(11, 0.36 * len(rows) + 2.0), sharey=True,
                             gridspec_kw={"width_ratios": [1.3, 1, 1]})
    y = np.arange(len(labels))
    xlabels = ("M windows/s, log scale\n(higher is better)", "peak private RAM, MB\n(USS, process tree)",
               "device mix, log scale\n(1.0 = uniform; lower is better)")
    for ax, values, xlabel in zip(axes, (speed, ram, quality), xlabels, strict=True):
        ax.barh(y, values, color=colours)
        ax.set_xlabel(xlabel, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        for yi, v in zip(y, values, strict=True):
            if np.isfinite(v):
                # a white backing keeps a value readable where it crosses a reference line
                ax.text(v, yi, f" {v:.2f}" if v < 100 else f" {v:,.0f}", va="center", fontsize=9,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.85})
    axes[0].set_yticks(y, labels, fontsize=10)
    axes[0].set_xscale("log")
    axes[0].set_xlim(min(v for v in speed if v > 0) / 2, max(speed) * 3)
    for yi, v, label in zip(y, quality, labels, strict=True):
        if not np.isfinite(v) and "refused" in label:
            axes[0].text(axes[0].get_xlim()[0], yi, "  refused: SamplingError", va="center", fontsize=8,
                         color="#555555")
    axes[1].axvline(1000, color="red", ls="--", lw=1)
    axes[1].text(1000, -0.9, " 1 GB", color="red", fontsize=9)
    axes[2].set_xscale("log")
    axes[2].axvline(1.3, color="red", ls="--", lw=1)
    axes[2].text(1.3, -0.9, " 1.3: well mixed", color="red", fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2_500_000)
    parser.add_argument("--devices", type=int, default=186)
    parser.add_argument("--workdir", default="/tmp/birdzarr-loader-bench")
    parser.add_argument("--keep", action="store_true", help="keep the generated data (reused next time)")
    parser.add_argument("--no-scale-check", dest="scale_check", action="store_false",
                        help="skip WindowDataset on 2x the data")
    parser.add_argument("--item-batches", type=int, default=30,
                        help="batches timed for the slow per-item loaders (b)-(d)")
    parser.add_argument("--quality-batches", type=int, default=100)
    parser.add_argument("--only", default=None,
                        help="run only cases whose label contains this (several: separated by |)")
    parser.add_argument("--epochs", type=int, default=1,
                        help="epochs the WindowDataset cases run with the same persistent workers; "
                             "from 2, the table adds the first batch and the rate of epochs 1..")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every case this many times, interleaved; report the median run")
    parser.add_argument("--plot", default=os.path.join(REPO, "benchmarks", "out", "loader.png"))
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="only draw --plot from the rows a run wrote with --json")
    parser.add_argument("--run-case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as handle:
            saved = json.load(handle)
        plot(saved["rows"], args.plot, saved.get("title", "Training loader"))
        print(f"plot: {args.plot}")
        return 0
    if args.run_case:
        print(json.dumps(run_case(json.loads(args.run_case))))
        return 0

    workdir = outside_repository(parser, args.workdir)

    started = time.perf_counter()
    with work_directory(workdir, prefix="", keep=args.keep):
        meta = prepare(workdir, args.windows, args.devices, scale_check=args.scale_check, log=log)
        wanted = args.only.split("|") if args.only else []
        every = cases(meta, args)
        selected = [spec for spec in every if not wanted or any(w in spec["label"] for w in wanted)]
        if not selected:
            labels = "\n  ".join(spec["label"] for spec in every)
            parser.error(f"--only {args.only!r} matches no case; the cases are:\n  {labels}")
        runs: dict[str, list[dict[str, Any]]] = {spec["label"]: [] for spec in selected}
        for _ in range(args.repeat):  # interleaved, so a noisy minute does not hit one case only
            for spec in selected:
                result = measure(spec)
                result["label"] = spec["label"]
                if "refused" in result:
                    log(f"{spec['label']}: refused: {result['refused']}")
                    continue
                runs[spec["label"]].append(result)
                log(f"{spec['label']}: {result['windows_per_s'] / MB:.3f} M windows/s, first batch "
                    f"{result['first_batch_s']:.2f} s, peak private {result['peak_uss_mb']:.0f} MB, quality "
                    f"{result['quality'] if result['quality'] is None else round(result['quality'], 2)}")
        results = []
        for spec in selected:
            if not runs[spec["label"]]:
                results.append((spec, {"refused": True}))
                continue
            measured = sorted(runs[spec["label"]], key=lambda r: r["windows_per_s"])
            median = dict(measured[len(measured) // 2])
            median["runs_windows_per_s"] = [r["windows_per_s"] for r in runs[spec["label"]]]
            median["peak_uss_mb"] = max(r["peak_uss_mb"] for r in measured)
            results.append((spec, median))
    reference = {spec["kind"]: r["windows_per_s"] for spec, r in results if spec["kind"] in ("old", "ideal")}
    nan = float("nan")
    rows = []
    for spec, r in results:
        if r.get("refused"):
            rows.append({"loader": spec["label"], "M windows/s": nan, "x (a)": nan, "% of (e)": nan,
                         "first batch s": nan, "peak private MB": nan, "device mix": "", "repeated %": "",
                         "co-occurrence": "", "runs M/s": "",
                         "timed over": "refused (SamplingError)"})
            continue
        row = {
            "loader": spec["label"],
            "M windows/s": r["windows_per_s"] / MB,
            "x (a)": r["windows_per_s"] / reference["old"] if "old" in reference else nan,
            "% of (e)": 100 * r["windows_per_s"] / reference["ideal"] if "ideal" in reference else nan,
            "first batch s": r["first_batch_s"],
            "peak private MB": r["peak_uss_mb"],
            "device mix": r["quality"] if r["quality"] is not None else "",
            "repeated %": 100 * r["repeated"] if "repeated" in r else "",
            "co-occurrence": r.get("cooccurrence", ""),
            "runs M/s": " ".join(f"{w / MB:.2f}" for w in r["runs_windows_per_s"]),
            "timed over": (f"{r['batches']} batches" if spec.get("max_batches") else "1 epoch")
                          + ("" if "load_s" not in r else f"; load {r['load_s']:.1f} s")
                          + ("" if not spec.get("resident") else f"; load {r['open_s']:.1f} s"),
        }
        if args.epochs > 1:  # the same run's later epochs (persistent workers)
            firsts, rates = r.get("later_first_batch_s", []), r.get("later_windows_per_s", [])
            row["first batch, later epochs s (max)"] = (f"{np.median(firsts):.3f} ({max(firsts):.3f})"
                                                        if firsts else "")
            row["later epochs M/s"] = float(np.median(rates)) / MB if rates else ""
        if "pool_chunks" in r:
            row["timed over"] += f"; {r['pool_chunks']:.0f} chunks a pool"
            if spec["store"].startswith("device"):
                row["timed over"] += f", predicted mix {predicted_device_order(meta, r['pool_chunks']):.1f}"
        rows.append(row)
    print()
    print(f"{args.windows:,} windows, {args.devices} devices, batch {BATCH}, {WORKERS} workers, "
          f"{machine()}; "
          f"total {time.perf_counter() - started:.0f} s; median of {args.repeat} run(s), "
          "peak memory the largest")
    print(table(rows))
    print("device mix: mean TV distance of a batch's device histogram from the data set's, over that of "
          "uniform batches (1.0 = a true shuffle); repeated %: epoch 1's batches equal as sets to a batch "
          "of epoch 0; co-occurrence: pairs batched together in epoch 0 batched together again in "
          "epoch 1, over batch_size / n_windows (1.0 = uniform)")
    if args.plot:
        os.makedirs(os.path.dirname(args.plot), exist_ok=True)
        plot(rows, args.plot, f"Training loader, {args.windows / 1e6:.1f} M windows, batch {BATCH}, "
                              f"{WORKERS} DataLoader workers ({machine()})")
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as handle:
            records = [{"spec": {k: v for k, v in s.items() if k != "meta"}, "result": r} for s, r in results]
            title = (f"Training loader, {args.windows / 1e6:.1f} M windows, batch {BATCH}, "
                     f"{WORKERS} DataLoader workers ({machine()})")
            json.dump({"rows": rows, "records": records, "title": title}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
