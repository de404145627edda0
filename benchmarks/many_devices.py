"""Many small devices against few large ones: the same windows, the per-device costs.

    python benchmarks/many_devices.py                                  # 186 vs 20,000 devices, 700 K windows
    python benchmarks/many_devices.py --devices 186 100000 --windows 3500000
    python benchmarks/many_devices.py --pythonpath /tmp/old            # another birdzarr (a before figure)
    python benchmarks/many_devices.py --calibration device             # no values shared between devices

The same ``--windows`` windows (``_synthetic.curated_windows``) are written as ``--files``
Parquet partition files with a ``device_id`` column, once for each device count (devices of
equal size, consecutive in the files), in ``--workdir``. Each step runs in its own process
(``--pythonpath`` is put first on its ``PYTHONPATH``): ``convert`` (``birdzarr convert --workers
1``, device order; ``convert_shuffle`` with ``--shuffle --seed 1``), ``open`` (``open_store``
alone, after the imports), ``info``, ``verify``, ``verify_source`` (``verify --source``),
``verify_shuffled`` (``verify`` of the shuffled store), ``split`` (making
``WindowDataset(shuffled, split="train")``: the device split's selection), ``stream_epoch`` and
``resident_epoch`` (epochs 1-3 of a ``WindowDataset`` read in the step's process, batch 8192, after
an untimed epoch 0: streaming the shuffled store, and ``resident="cpu"`` on the device-ordered
one; CPU seconds include the streaming reader's decoding threads; making the dataset, resident's
load, is reported apart as ``made_cpu``), ``decode_batch`` (format 2's
decode alone of 60 batches of 8,192 random windows of the device-ordered store, gathered first:
what a resident batch costs, and the dictionary entries it looks up in), ``device_all``
(``Store.device(id)`` for every device, after opening) and ``summary`` (``repr`` and the HTML
summary of an opened store);
``code_devices`` and ``code_slabs`` time format 2's row coder alone on the source's windows (read
first, not timed): ``RowCoder.code`` a device at a time (the reference), and
``RowCoder.code_runs`` on slabs of 65,536 windows of many devices, as the writers batch it
(skipped where the coder has no ``code_runs``), each device closed after its last window.
Each reports its wall seconds, CPU seconds (``time.process_time``: threads included) and peak
RSS (``VmHWM``: Linux). On a shared machine compare CPU seconds, not wall time. ``--rounds N``
runs every step N times, the device counts in turn, their order alternating round by round
(the table gives medians, and the CPU ratio's median and range over rounds): one pass measures
the machine's drift as much as the devices.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import dir_bytes  # noqa: E402

STEP = r'''
import json, sys, time
step, store, shuffled, src = sys.argv[1:5]
started, cpu = time.perf_counter(), time.process_time()
out = {}
if step in ("convert", "convert_shuffle"):
    from birdzarr.cli import main
    target, more = (store, []) if step == "convert" else (shuffled, ["--shuffle", "--seed", "1"])
    out["code"] = main(["convert", src, target, "--quiet", "--workers", "1", *more])
elif step == "open":
    import birdzarr
    started, cpu = time.perf_counter(), time.process_time()
    birdzarr.open_store(store)
elif step in ("info", "verify", "verify_source", "verify_shuffled"):
    import contextlib, io
    from birdzarr.cli import main
    args = {"info": ["info", store], "verify": ["verify", store], "verify_shuffled": ["verify", shuffled],
            "verify_source": ["verify", store, "--source", src]}[step]
    with contextlib.redirect_stdout(io.StringIO()):
        out["code"] = main(args)
elif step == "device_all":
    import birdzarr
    opened = birdzarr.open_store(store)
    ids = [e.device_id for e in opened.device_table]
    started, cpu = time.perf_counter(), time.process_time()
    assert sum(opened.device(i).n_windows for i in ids) == len(opened)
elif step in ("code_devices", "code_slabs"):
    import pathlib
    import numpy as np
    import pyarrow.parquet as pq
    from birdzarr.format._rows import RowCoder
    files = sorted(pathlib.Path(src).glob("part-*.parquet"), key=lambda f: int(f.stem.split("-")[1]))
    tables = [pq.read_table(f) for f in files]
    devices = np.concatenate([t["device_id"].to_numpy() for t in tables]).astype(np.int64)
    windows = np.concatenate([t["gimu"].combine_chunks().flatten().to_numpy() for t in tables])
    windows = windows.reshape(-1, 20, 4)
    bounds = np.flatnonzero(np.r_[True, devices[1:] != devices[:-1], True])
    coder = RowCoder()
    started, cpu = time.perf_counter(), time.process_time()
    if step == "code_devices":
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            coder.code(int(devices[a]), windows[a:b])
            coder.close_device(int(devices[a]))
    elif hasattr(coder, "code_runs"):
        for a in range(0, len(devices), 65536):
            coder.code_runs(devices[a : a + 65536], windows[a : a + 65536])
            ended = bounds[1:][(bounds[1:] > a) & (bounds[1:] <= a + 65536)]
            coder.close_devices(devices[ended - 1])
    else:
        out["skipped"] = "no RowCoder.code_runs"
    out["rows"] = coder.new_rows().n_rows
elif step == "split":
    import torch  # noqa: F401 (imported by the dataset: not the selection's cost)
    import birdzarr
    started, cpu = time.perf_counter(), time.process_time()
    ds = birdzarr.WindowDataset(shuffled, batch_size=8192, split="train", progress=False)
    out["windows"] = ds.windows_per_epoch
elif step in ("stream_epoch", "resident_epoch"):
    import birdzarr
    built, built_cpu = time.perf_counter(), time.process_time()
    ds = birdzarr.WindowDataset(shuffled if step == "stream_epoch" else store, batch_size=8192, seed=1,
                                progress=False, **({} if step == "stream_epoch" else {"resident": "cpu"}))
    # making the dataset (resident: loading the selection), not in the step's seconds
    out["made_cpu"] = round(time.process_time() - built_cpu, 3)
    out["made_seconds"] = round(time.perf_counter() - built, 3)
    assert sum(len(x) for x in ds) == ds.windows_per_epoch  # epoch 0 (buffers, threads) untimed
    started, cpu = time.perf_counter(), time.process_time()
    out["windows"] = 0
    for epoch in (1, 2, 3):
        ds.set_epoch(epoch)
        out["windows"] += sum(len(x) for x in ds)
    out["m_windows_s"] = round(out["windows"] / (time.perf_counter() - started) / 1e6, 3)
elif step == "decode_batch":
    import numpy as np
    import birdzarr
    from birdzarr.format import _v2
    reader = birdzarr.open_store(store).reader
    parts = [reader.read_coded(chunk) for chunk in range(reader.n_chunks)]
    codes, rows, gps = (np.concatenate([p[k] for p in parts]) for k in range(3))
    dictionaries = reader.dictionaries()
    rng, into = np.random.default_rng(0), np.empty((8192, 20, 4), np.float32)
    picks = [np.sort(rng.integers(0, len(rows), 8192)) for _ in range(60)]
    batches = [(codes[pick], rows[pick], gps[pick]) for pick in picks]  # gathered before the timing
    started, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        _v2.decode(*batch, dictionaries.values, dictionaries.start, out=into)
    out["entries"] = len(dictionaries.values)
elif step == "summary":
    import birdzarr
    opened = birdzarr.open_store(store)
    started, cpu = time.perf_counter(), time.process_time()
    out["chars"] = len(repr(opened)) + len(opened._repr_html_())
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
out.update(seconds=round(time.perf_counter() - started, 3), cpu=round(time.process_time() - cpu, 3),
           rss_mb=round(peak / 1024))
print("RESULT" + json.dumps(out))
'''
STEPS = ["convert", "convert_shuffle", "open", "info", "verify", "verify_source", "verify_shuffled",
         "split", "stream_epoch", "resident_epoch", "decode_batch", "device_all", "summary", "code_devices",
         "code_slabs"]


def _gimu(windows: np.ndarray) -> pa.Array:
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)


def make(root: pathlib.Path, devices: int, total: int, files: int, calibration: str = "shared") -> None:
    """``files`` partition files of consecutive devices; a marker beside the directory (the
    converter refuses files that are not inputs) says it is complete. ``calibration="device"``:
    each device's IMU values pass through its own affine map (float32 ``a * v + b``, ``a`` in
    [0.9, 1.1], ``b`` ~ N(0, 0.01)), so no two devices share values, as trackers calibrated one by
    one; ``"shared"``: the devices cut one calibrated sequence, so neighbours share values."""
    done = root.parent / (root.name + ".complete")
    if done.exists():
        return
    from birdzarr.demo import _synthetic

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    windows = _synthetic.curated_windows(total, seed=1)
    owner = np.minimum(np.arange(total) // (total // devices), devices - 1) + 1
    if calibration == "device":
        rng = np.random.default_rng(2)
        scale = rng.uniform(0.9, 1.1, (devices + 1, 3)).astype(np.float32)
        shift = rng.normal(0, 0.01, (devices + 1, 3)).astype(np.float32)
        windows[:, :, :3] = windows[:, :, :3] * scale[owner][:, None, :] + shift[owner][:, None, :]
    bounds = np.searchsorted(owner, np.linspace(1, devices + 1, files + 1).astype(int))
    for number in range(files):
        lo, hi = bounds[number], bounds[number + 1]
        table = pa.table({"device_id": pa.array(owner[lo:hi], pa.int32()), "gimu": _gimu(windows[lo:hi])})
        pq.write_table(table, root / f"part-{number}.parquet")
    done.touch()


def run(step: str, work: pathlib.Path, devices: int, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    args = [str(work / f"{name}{devices}{suffix}")
            for name, suffix in (("store", ".zarr"), ("shuffled", ".zarr"), ("src", ""))]
    done = subprocess.run([sys.executable, "-c", STEP, step, *args], capture_output=True, text=True, env=env,
                          cwd=work)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if not found:
        raise SystemExit(f"{step} at {devices} devices failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(found[-1][len("RESULT"):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=700_000)
    parser.add_argument("--devices", type=int, nargs="+", default=[186, 20_000])
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--workdir", default="/tmp/birdzarr-many-devices")
    parser.add_argument("--steps", nargs="+", default=STEPS, choices=STEPS)
    parser.add_argument("--pythonpath", default=None, help="put this first on the steps' PYTHONPATH")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every step this many times, the device counts' order alternating; medians")
    parser.add_argument("--calibration", choices=["shared", "device"], default="shared",
                        help="'device': every device its own calibration (no values shared between devices)")
    args = parser.parse_args()
    work = pathlib.Path(args.workdir)
    for devices in args.devices:
        make(work / f"src{devices}", devices, args.windows, args.files, args.calibration)
    # every step of every device count once a round; the counts' order alternates round by round
    # and the figures are medians over rounds: a machine that slows down during a run then
    # burdens both counts alike
    results: dict[int, dict[str, list[dict]]] = {d: {step: [] for step in args.steps} for d in args.devices}
    for round_ in range(args.rounds):
        for step in args.steps:
            for devices in args.devices[:: -1 if round_ % 2 else 1]:
                if step.startswith("convert"):
                    name = "store" if step == "convert" else "shuffled"
                    shutil.rmtree(work / f"{name}{devices}.zarr", ignore_errors=True)
                found = run(step, work, devices, args.pythonpath)
                results[devices][step].append(found)
                print(f"round {round_ + 1}", devices, step, found, flush=True)
    heads = " | ".join(f"{d:,} devices: s / CPU s / peak MB" for d in args.devices)
    pair = len(args.devices) == 2
    print(f"\n| step | {heads} |" + (" CPU ratio (rounds) |" if pair else ""))
    print("|---" * (len(args.devices) + 1 + pair) + "|")
    # the epochs' steps' making of the dataset (resident: the load) as a row of its own
    measures = [(step, step, ("seconds", "cpu")) for step in args.steps]
    measures += [(f"{step} (making the dataset)", step, ("made_seconds", "made_cpu"))
                 for step in args.steps if step.endswith("_epoch")]
    for label, step, (wall, used) in measures:
        rows = [[{"seconds": r[wall], "cpu": r[used], "rss_mb": r["rss_mb"]} for r in results[d][step]]
                for d in args.devices]
        cells = [{key: statistics.median(r[key] for r in runs) for key in ("seconds", "cpu", "rss_mb")}
                 for runs in rows]
        row = " | ".join(f"{c['seconds']:.3f} / {c['cpu']:.3f} / {c['rss_mb']:.0f}" for c in cells)
        ratio = ""
        if pair:
            ratios = [b["cpu"] / max(a["cpu"], 1e-3) for a, b in zip(rows[0], rows[1], strict=True)]
            spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
            ratio = f" {statistics.median(ratios):.2f}x{spread} |"
        print(f"| {label} | {row} |{ratio}")
    sizes = []
    for devices in args.devices:
        parquet = dir_bytes(str(work / f"src{devices}")) / 1e6
        stored = [(name, dir_bytes(str(work / f"{name}{devices}.zarr")) / 1e6)
                  for name in ("store", "shuffled")]
        sizes.append(f"{devices:,} devices: Parquet {parquet:.1f} MB" + "".join(
            f", {name} {mb:.1f} MB ({mb / parquet:.2f}x)" for name, mb in stored if mb))
    print("\nbytes on disk: " + "; ".join(sizes))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))



if __name__ == "__main__":
    main()
