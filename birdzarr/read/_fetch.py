"""Chunk prefetching inside one reader (one DataLoader worker, or the main process).

Given the chunks each upcoming batch needs, fetch and decode them on a small thread pool ahead
of use (decoding releases the GIL), keep each decoded chunk only until the last batch that needs
it, and never hold more than ``prefetch`` chunks beyond the current batch. Memory is therefore
``(chunks of the current group + prefetch) x chunk size``, whatever the data set's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

ChunkData = dict[str, np.ndarray]


def prefetched(
    load: Callable[[int], ChunkData], steps: Sequence[np.ndarray], *, prefetch: int
) -> Iterator[dict[int, ChunkData]]:
    """For each step (the chunks one batch needs), yield those chunks' data, loaded ahead."""
    first_use: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for step, chunks in enumerate(steps):
        for chunk in chunks.tolist():
            first_use.setdefault(chunk, step)
            last_use[chunk] = step
    order = sorted(first_use, key=first_use.__getitem__)
    pool = ThreadPoolExecutor(max_workers=max(1, prefetch), thread_name_prefix="birdzarr-fetch")
    loaded: dict[int, Future[ChunkData]] = {}
    submitted = 0
    try:
        for step, chunks in enumerate(steps):
            # everything this step needs, then up to `prefetch` chunks first used later
            while submitted < len(order) and (
                first_use[order[submitted]] <= step
                or sum(first_use[c] > step for c in loaded) < prefetch
            ):
                chunk = order[submitted]
                loaded[chunk] = pool.submit(load, chunk)
                submitted += 1
            yield {chunk: loaded[chunk].result() for chunk in chunks.tolist()}
            for chunk in chunks.tolist():
                if last_use[chunk] == step:
                    loaded.pop(chunk, None)
    finally:
        for future in loaded.values():
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
