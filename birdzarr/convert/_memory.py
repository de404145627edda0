"""Which allocator Arrow uses while a conversion runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pyarrow as pa


@contextlib.contextmanager
def arrow_pool() -> Iterator[None]:
    """Arrow allocates from jemalloc while the block runs, where pyarrow is built with it (the
    previous default pool is restored after; buffers remember the pool they came from).

    Why: the Parquet reader and the CSV parser allocate a fresh buffer of several MB per batch.
    pyarrow's default mimalloc gives freed memory back to the OS within milliseconds, so every
    batch faults its pages in again and the kernel zeroes them (14% of a Parquet conversion's
    CPU samples were page faults, `perf`). With jemalloc, 1 M Parquet windows on 2 workers
    took 2.72 CPU s against 3.08 s, peak RSS 322 against 397 MB (4 alternating runs each;
    mimalloc told never to purge: 2.80 CPU s, 400 MB). Worker processes forked inside the
    block inherit the setting.
    """
    try:
        pool = pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without jemalloc: keep its default
        yield
        return
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        yield
    finally:
        pa.set_memory_pool(previous)
