"""Training reads from S3 against reads from local disk, with cloud-like latency added.

The same read as a training loop: ``WindowDataset(url, batch_size, shuffle=True)`` in a
``DataLoader(batch_size=None, num_workers=W, persistent_workers=True)``, three epochs, each timed
from its ``iter()`` to its last batch: the first (fresh workers) and the mean of the later ones
(steady state) are reported. Sources, in one run:

- the store on local disk;
- the same store uploaded (``birdzarr copy``) to moto's S3 server on loopback (its own process);
- the same endpoint behind an HTTP proxy (its own process) adding 10 ms and 25 ms each way, i.e.
  20 ms and 50 ms round trips (this kernel has no netem).

Requests per epoch and bytes per request are counted by a zero-delay proxy for the loopback run
and by the delay proxies for theirs. Then: raw chunk-object fetches at +10 ms, s3fs (birdzarr's
path) against obstore (if installed); and whole-chunk reads of the store's ``gimu_codes`` array
(uint16 codes, core Zarr v3 codecs), birdzarr's fsspec path (``ChunkReader`` on a thread pool)
against TensorStore's reader.

    python benchmarks/s3.py                                  # defaults: 1M windows, the converter's chunks
    python benchmarks/s3.py --windows 300000 --requests 16   # smaller, more fetches in flight
    python benchmarks/s3.py --pin-servers                    # servers on their own core
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from s3_support import REGION, s3_options  # noqa: E402

import birdzarr  # noqa: E402
from birdzarr.demo import _synthetic  # noqa: E402
from birdzarr.maintenance._copy import copy_store  # noqa: E402
from birdzarr.storage._location import FETCHER_ENV, resolve  # noqa: E402
from birdzarr.store._chunks import ChunkReader  # noqa: E402

# With --pin-servers, the servers run on this core and the loader on the others, as if the
# endpoint were another machine (moto and the proxy are Python and cost ~15 ms of CPU per GET).
SERVER_CPUS: set[int] = set()


class Server:
    """``tests/s3_support.py moto|proxy`` in its own process (no shared interpreter lock)."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE.parent / "tests" / "s3_support.py"), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        if SERVER_CPUS:
            os.sched_setaffinity(self.proc.pid, SERVER_CPUS)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.terminate()
        self.proc.wait(10)


def _has_obstore() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


EPOCHS = 3  # per measurement: the first with freshly started workers, then steady state


def epoch(url: str, options: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, float]:
    """``EPOCHS`` shuffled epochs through one DataLoader with persistent workers, as a training
    job runs them; windows/s from each ``iter()`` to its last batch.

    ``windows_per_s`` is the first epoch (it includes starting the workers, and for S3 creating
    each worker's client: ~0.25 CPU s per worker); ``steady_windows_per_s`` the later ones.
    """
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "stored in device order": irrelevant to throughput
        dataset = birdzarr.WindowDataset(url, batch_size=args.batch_size, shuffle=True, seed=0,
                                         requests=args.requests, storage_options=options)
    loader = DataLoader(dataset, batch_size=None, num_workers=args.workers,
                        persistent_workers=args.workers > 0,
                        multiprocessing_context="fork" if args.workers else None)
    rates = []
    for number in range(EPOCHS):
        dataset.set_epoch(number)
        started = time.perf_counter()
        windows = sum(len(batch) for batch in loader)
        rates.append(windows / (time.perf_counter() - started))
    del loader  # stops the persistent workers
    return {"windows": windows, "windows_per_s": rates[0],
            "steady_windows_per_s": sum(rates[1:]) / (EPOCHS - 1)}


def chunk_reads(url: str, options: dict[str, Any] | None, threads: int,
                name: str = "gimu") -> dict[str, float]:
    """Every chunk of ``name`` read and decoded once (``gimu``: the windows, from their codes and
    dictionaries), ``threads`` at a time, by birdzarr's fsspec path."""
    store = birdzarr.open_store(url, storage_options=options)
    reader = ChunkReader(resolve(url, options), store.reader.layouts, len(store))
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(len(a) for a in pool.map(lambda i: reader.read(name, i), range(reader.n_chunks)))
    seconds = time.perf_counter() - started
    return {"windows_per_s": total / seconds, "seconds": seconds, "requests": reader.requests}


def tensorstore_reads(
    spec_kvstore: dict[str, Any], n_windows: int, chunk: int, threads: int
) -> dict[str, float]:
    """The same whole-chunk reads through TensorStore: all at once, and ``threads`` chunks in flight."""
    import tensorstore as ts

    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    array = ts.open({"driver": "zarr3", "kvstore": spec_kvstore}, read=True, context=context).result()
    started = time.perf_counter()
    whole = array[:n_windows].read().result()
    whole_s = time.perf_counter() - started
    starts = list(range(0, n_windows, chunk))
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(len(a) for a in pool.map(
            lambda s: array[s : min(s + chunk, n_windows)].read().result(), starts))
    chunked_s = time.perf_counter() - started
    assert len(whole) == total == n_windows
    return {"whole_array_windows_per_s": n_windows / whole_s,
            "per_chunk_windows_per_s": n_windows / chunked_s}


def raw_fetches(proxy_url: str, n_chunks: int, threads: int) -> dict[str, float]:
    """MB/s of fetching every gimu_codes chunk object (no decoding): s3fs (birdzarr's path) vs obstore."""
    from birdzarr.storage._location import read_object

    location = resolve("s3://bench/shuffled.zarr", s3_options(proxy_url))
    keys = [f"gimu_codes/c/{i}/0/0" for i in range(n_chunks)]
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(len(b) for b in pool.map(lambda k: read_object(location, k), keys))
    out = {"mb": total / 1e6, "s3fs_mb_per_s": total / 1e6 / (time.perf_counter() - started)}
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        return out
    options = s3_options(proxy_url)
    store = S3Store("bench", endpoint=proxy_url, access_key_id=options["key"], region=REGION,
                    secret_access_key=options["secret"], client_options={"allow_http": True})
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(lambda k: len(obstore.get(store, f"shuffled.zarr/{k}").bytes()), keys))
    out["obstore_mb_per_s"] = total / 1e6 / (time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", type=int, default=1_000_000)
    parser.add_argument("--devices", type=int, default=40)
    parser.add_argument("--chunk-windows", type=int, default=None,
                        help="windows per chunk (default: the converter's, 32768 for a --shuffle store)")
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--requests", type=int, default=4,
                        help="WindowDataset requests: chunk fetches in flight (its default is 4)")
    parser.add_argument("--delays-ms", type=float, nargs="*", default=[10.0, 25.0], help="added each way")
    parser.add_argument("--skip-tensorstore", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--pin-servers", action="store_true",
                        help="run moto and the proxies on the last core and everything else (local "
                             "and S3 epochs alike) on the other cores")
    args = parser.parse_args()
    if args.pin_servers:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--pin-servers needs at least 2 cores")
        SERVER_CPUS.add(cpus[-1])
        os.sched_setaffinity(0, set(cpus[:-1]))

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="birdzarr-s3-bench-"))
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "workdir")}
    results: dict[str, Any] = {"settings": settings}
    servers: list[Server] = []
    try:
        source = workdir / "parquet"
        if not source.exists():
            _synthetic.make_parquet_dir(source, n_devices=args.devices, total_windows=args.windows, seed=1)
        # the training layout: WindowDataset refuses to stream shuffled batches from device order
        local = birdzarr.convert(source, workdir / "shuffled.zarr", chunk_windows=args.chunk_windows,
                                 overwrite=True, progress=False, shuffle=True, seed=1)
        moto = Server("moto")
        servers.append(moto)
        options = s3_options(moto.url)
        import boto3

        boto3.client("s3", endpoint_url=moto.url, region_name=REGION, aws_access_key_id=options["key"],
                     aws_secret_access_key=options["secret"]).create_bucket(Bucket="bench")
        copied = copy_store(local.location, "s3://bench/shuffled.zarr", progress=False,
                            dest_storage_options=options)
        results["upload"] = {"mb": copied.bytes_copied / 1e6, "seconds": copied.seconds,
                             "mb_per_s": copied.bytes_copied / 1e6 / copied.seconds,
                             "objects": copied.objects}
        print(f"upload: {copied.format()}", flush=True)

        rows: list[dict[str, Any]] = []
        local_url = str(workdir / "shuffled.zarr")
        epoch(local_url, None, args)  # warm-up: the page cache holds the store
        rows.append({"source": "local disk", "rtt_ms": 0.0, **epoch(local_url, None, args)})
        for delay in [0.0, *args.delays_ms]:
            proxy = Server("proxy", "--upstream", str(moto.port), "--delay", str(delay / 1000))
            servers.append(proxy)
            if delay == 0.0:  # the loopback endpoint itself, then a zero-delay proxy to count requests
                direct = epoch("s3://bench/shuffled.zarr", options, args)
                counted = epoch("s3://bench/shuffled.zarr", s3_options(proxy.url), args)
                stats = proxy.stats()
                row = {"source": "moto S3, loopback", "rtt_ms": 0.0, **direct,
                       "windows_per_s_via_counting_proxy": counted["windows_per_s"]}
            else:
                measured = epoch("s3://bench/shuffled.zarr", s3_options(proxy.url), args)
                stats = proxy.stats()
                row = {"source": f"moto S3 +{delay:g} ms each way", "rtt_ms": 2 * delay, **measured}
            row.update(requests=stats["requests"] / EPOCHS,
                       methods={k: v / EPOCHS for k, v in stats["methods"].items()},
                       bytes_per_request=stats["get_bytes"] / max(1, stats["methods"].get("GET", 1)))
            rows.append(row)
            if delay and _has_obstore():
                # The same epoch with the optional obstore fetcher (DataLoader workers use it; this
                # process must not have started obstore before they fork).
                os.environ[FETCHER_ENV] = "obstore"
                try:
                    fast = epoch("s3://bench/shuffled.zarr", s3_options(proxy.url), args)
                finally:
                    del os.environ[FETCHER_ENV]
                stats = proxy.stats()
                rows.append({"source": f"moto S3 +{delay:g} ms each way, obstore fetcher",
                             "rtt_ms": 2 * delay, **fast, "requests": stats["requests"] / EPOCHS,
                             "methods": {k: v / EPOCHS for k, v in stats["methods"].items()},
                             "bytes_per_request": stats["get_bytes"] / max(1, stats["requests"])})
                print(json.dumps(rows[-1]), flush=True)
            proxy.stop()
            servers.remove(proxy)
            print(json.dumps(row), flush=True)
        local_ws, local_steady = rows[0]["windows_per_s"], rows[0]["steady_windows_per_s"]
        for row in rows:
            row["vs_local"] = row["windows_per_s"] / local_ws
            row["steady_vs_local"] = row["steady_windows_per_s"] / local_steady
        results["epochs"] = rows

        proxy = Server("proxy", "--upstream", str(moto.port), "--delay", "0.01")
        try:
            results["raw_fetch_10ms"] = raw_fetches(proxy.url, local.reader.n_chunks, max(args.requests, 8))
        finally:
            proxy.stop()
        print(json.dumps(results["raw_fetch_10ms"]), flush=True)
        if not args.skip_tensorstore:
            results["tensorstore"] = compare_tensorstore(source, workdir, moto, args)
    finally:
        for server in servers:
            server.stop()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def compare_tensorstore(
    source: Path, workdir: Path, moto: Server, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Whole-chunk reads of the store's gimu_codes array: fsspec path vs TensorStore, local and +10 ms."""
    standard = birdzarr.open_store(workdir / "shuffled.zarr")
    options = s3_options(moto.url)
    copy_store(standard.location, "s3://bench/standard.zarr", progress=False, dest_storage_options=options)
    os.environ.update(AWS_ACCESS_KEY_ID=options["key"], AWS_SECRET_ACCESS_KEY=options["secret"])
    n, chunk, threads = len(standard), standard.chunk_windows, max(args.requests, 8)
    rows = []
    proxy = Server("proxy", "--upstream", str(moto.port), "--delay", "0.01")
    try:
        for label, url, opts, kvstore in (
            ("local disk", str(workdir / "shuffled.zarr"), None,
             {"driver": "file", "path": str(workdir / "shuffled.zarr" / "gimu_codes") + "/"}),
            ("moto S3 +10 ms each way", "s3://bench/standard.zarr", s3_options(proxy.url),
             {"driver": "s3", "bucket": "bench", "path": "standard.zarr/gimu_codes/", "endpoint": proxy.url,
              "aws_region": REGION, "aws_credentials": {"type": "environment"}}),
        ):
            ours = chunk_reads(url, opts, threads, "gimu_codes")
            theirs = tensorstore_reads(kvstore, n, chunk, threads)
            rows.append({"source": label, "threads": threads, "fsspec_windows_per_s": ours["windows_per_s"],
                         **{f"tensorstore_{k}": v for k, v in theirs.items()}})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        proxy.stop()
    return rows


def print_table(results: dict[str, Any]) -> None:
    s = results["settings"]
    print(f"\n{s['windows']:,} windows, chunk {s['chunk_windows'] or 'default'}, batch {s['batch_size']}, "
          f"{s['workers']} DataLoader workers, requests {s['requests']}"
          + (", servers pinned to their own core" if s.get("pin_servers") else ", all on shared cores"))
    print("| source | RTT | first epoch windows/s | vs local | later epochs windows/s | vs local "
          "| requests/epoch | bytes/request |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["epochs"]:
        requests = f"{r['requests']:.0f}" if "requests" in r else "-"
        size = f"{r['bytes_per_request'] / 1e3:,.0f} kB" if "bytes_per_request" in r else "-"
        print(f"| {r['source']} | {r['rtt_ms']:g} ms | {r['windows_per_s'] / 1e6:.2f} M | "
              f"{r['vs_local']:.0%} | {r['steady_windows_per_s'] / 1e6:.2f} M | {r['steady_vs_local']:.0%} "
              f"| {requests} | {size} |")
    raw = results.get("raw_fetch_10ms")
    if raw:
        obstore_rate = raw.get("obstore_mb_per_s", float("nan"))
        print(f"fetching all gimu_codes chunk objects at +10 ms each way ({raw['mb']:.0f} MB, no decoding): "
              f"s3fs {raw['s3fs_mb_per_s']:.1f} MB/s, obstore {obstore_rate:.1f} MB/s")
    for r in results.get("tensorstore", []):
        print(f"whole-chunk reads, {r['source']}, {r['threads']} in flight: fsspec path "
              f"{r['fsspec_windows_per_s'] / 1e6:.2f} M windows/s; TensorStore whole array "
              f"{r['tensorstore_whole_array_windows_per_s'] / 1e6:.2f} M, per chunk "
              f"{r['tensorstore_per_chunk_windows_per_s'] / 1e6:.2f} M")


if __name__ == "__main__":
    main()
