"""Costs of the loader's individual steps, each next to its alternative, in one process.

    python benchmarks/reader_parts.py            # local steps (~10 s)
    python benchmarks/reader_parts.py --s3       # also an S3 client in a fresh worker (moto, ~20 s)

The figures behind docs/training.md (the cost of a batch's chunk) and docs/cloud.md (the S3
client's cost per worker and per GET). Every row is the mean over
``--repeat`` calls on an 8192-window chunk (2.6 MB of float32), after one warm-up call.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _util import table  # noqa: E402

from birdzarr.loader import _handoff  # noqa: E402
from birdzarr.loader._sink import SharedBatch  # noqa: E402

B = 8192  # windows per batch and per chunk


def timed(function: Callable[[], Any], repeat: int) -> float:
    """Mean milliseconds per call, after one warm-up call."""
    function()
    started = time.perf_counter()
    for _ in range(repeat):
        function()
    return (time.perf_counter() - started) / repeat * 1e3


def local_rows(repeat: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    chunk = rng.random((B, 20, 4), dtype=np.float32)
    order = rng.permutation(B)
    reused = np.empty_like(chunk)
    ring = _handoff.SlotRing(B * 320, keep=4)
    slot_x = ring.acquire().data[: B * 320].view(np.float32).reshape(B, 20, 4)

    def fresh_shared() -> None:  # what torch's transport does for every batch a worker yields
        storage = torch.UntypedStorage._new_shared(B * 320)
        batch = torch.empty(0).set_(storage, 0, (B, 20, 4))  # type: ignore[call-overload]
        np.take(chunk, order, axis=0, out=batch.numpy(), mode="clip")

    channel_major = np.ascontiguousarray(chunk.transpose(2, 0, 1))

    def per_channel() -> None:
        for c in range(4):
            reused[:, :, c] = channel_major[c]

    raw = rng.bytes(1_844_000)  # a standard-codec chunk object's size
    stored = raw + google_crc32c.value(raw).to_bytes(4, "little")

    fd_ring = _handoff.SlotRing(B * 320, keep=4)

    def handover(first_only: bool) -> Callable[[], None]:
        def run() -> None:
            slot = fd_ring.acquire()
            slot.lease()
            if not first_only:  # pretend every batch is a slot's first: an fd each time
                slot.fd = os.dup(slot.fd) if slot.fd is not None else os.memfd_create("x")
                os.ftruncate(slot.fd, slot.size)
                _handoff._RECEIVED.pop(slot.key, None)
            batch = pickle.loads(ForkingPickler.dumps(SharedBatch(slot, [("float32", (B, 20, 4), 0)])))
            del batch
        return run

    rows = [
        ("gather a batch", "into a fresh shared segment (torch's transport)", fresh_shared,
         "into a reused slot", lambda: np.take(chunk, order, axis=0, out=slot_x, mode="clip")),
        ("gather a batch", 'np.take default mode="raise"', lambda: np.take(chunk, order, axis=0, out=reused),
         'np.take mode="clip"', lambda: np.take(chunk, order, axis=0, out=reused, mode="clip")),
        ("channel-major chunk to (B, 20, 4)", "one 3-D transposed copy",
         lambda: np.copyto(reused, channel_major.transpose(1, 2, 0)), "four per-channel copies", per_channel),
        ("check a chunk's CRC-32C", "crc(data[:-4]), return data[:-4]",
         lambda: (google_crc32c.value(stored[:-4]), stored[:-4]),
         "residue of the whole object, return a view",
         lambda: (google_crc32c.value(stored), memoryview(stored)[:-4])),
        ("hand a slot to the training process (pickle + receive)", "file descriptor every time",
         handover(first_only=False), "file descriptor once per slot", handover(first_only=True)),
    ]
    return [{"step": step, "before": before, "before ms": timed(a, repeat), "after": after,
             "after ms": timed(b, repeat)} for step, before, a, after, b in rows]


def s3_rows(repeat: int) -> list[dict[str, Any]]:
    """CPU of a fresh process's first GET (creating its client) and of later GETs, birdzarr's path."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import boto3
    from s3 import Server
    from s3_support import REGION, s3_options

    from birdzarr.storage._location import read_object, resolve

    moto = Server("moto")
    try:
        options = s3_options(moto.url)
        boto3.client("s3", endpoint_url=moto.url, region_name=REGION, aws_access_key_id=options["key"],
                     aws_secret_access_key=options["secret"]).create_bucket(Bucket="bench")
        location = resolve("s3://bench/parts", options)
        location.fs.pipe_file(location.join("chunk"), np.random.default_rng(1).bytes(800_000))
        read_object(location, "chunk")  # the parent has used s3fs, as WindowDataset's open does
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a fresh DataLoader worker: its own filesystem and client
            started = time.process_time()
            mine = resolve("s3://bench/parts", options)
            read_object(mine, "chunk")
            first = time.process_time() - started
            started = time.process_time()
            for _ in range(repeat):
                read_object(mine, "chunk")
            later = (time.process_time() - started) / repeat
            os.write(write, f"{first * 1e3} {later * 1e3}".encode())
            os._exit(0)
        os.waitpid(pid, 0)
        first_ms, later_ms = (float(v) for v in os.read(read, 100).split())
    finally:
        moto.stop()
    return [{"step": "S3 GET of an 800 kB chunk object in a fresh worker (CPU ms)",
             "before": "first GET, creating the client", "before ms": first_ms,
             "after": "each later GET", "after ms": later_ms}]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--s3", action="store_true", help="also measure an S3 client (starts moto)")
    args = parser.parse_args()
    rows = local_rows(args.repeat)
    if args.s3:
        rows += s3_rows(20)
    for row in rows:
        row["before ms"], row["after ms"] = round(row["before ms"], 2), round(row["after ms"], 2)
    print(table(rows))


if __name__ == "__main__":
    main()
