"""Loading one pool of chunks into a reader's reused buffers, every chunk once, concurrently.

A reader (the main process, or one DataLoader worker) owns one ``PoolBuffers``: a float32
array of ``capacity`` chunks for the windows, plus label, device and timestamp arrays when the
dataset yields ``ldt``. Each chunk of a pool decodes straight into its slot of those arrays (on a
small thread pool: decoding releases the GIL, and remote fetches overlap), so a batch is then one
vectorised gather from memory the reader already owns. Of a version-2 chunk only the pool's
piece of its selected windows is looked up, packed at the start of the slot
(``ChunkReader.read_windows``). Nothing is handed back to a free list and
nothing grows with the store: memory is ``capacity x chunk_windows x (320 B + 16 B with ldt)``.

A DataLoader worker's fetch threads are idle while it serves a pool: ``prefetch`` starts
decoding its next pool (or, while it serves its last pool of an epoch, its first pool of the
next epoch: plans are pure functions of the epoch) into the other of two banks of buffers, with
the pool's order of windows drawn meanwhile by the worker (not on its serving path), and ``load`` takes
it if the iteration asks for that pool, else cancels it. Once the worker has gathered its last
batch of an epoch, the bank it served from is free: ``prefetch(..., served=True)`` decodes its
second pool of the next epoch there, beside the first one (so a bank holds at most one pending
prefetch, and memory stays two banks). The fetch threads are daemon threads: a DataLoader worker
that exits (a non-persistent one, at the end of its epoch) does not wait for a prefetch nobody
will use.

A bank remembers which pieces of which chunks its latest pool holds, and where. A pool whose
pieces a bank already holds (the same chunk, the same or fewer of its selected windows) is not
decoded again: a piece held by the bank being loaded stays where it is and the pool's other
pieces go to the bank's other slots; a piece only the other bank holds is copied from it (a
gather of its rows, about a sixth of a decode's CPU); a pool held whole by one bank is served
from that bank as it is. The values are those the decode wrote, so batches are unchanged. This
is what makes a small store's epochs cheap: a reader whose epoch is one pool (the training
process reading a selection or subset store of up to ``shuffle_buffer`` windows) decodes it
once, in its first epoch, and a DataLoader worker keeps its last two pools across the epoch
boundary in its two banks.

A pool decoded on the spot (an iteration's first pool, which no prefetch holds) would keep the
iteration's first batch waiting for every chunk of the pool: each batch is a sample of all of
them. ``start(pool, key, first)`` therefore decodes the windows of that first batch on their own
first, queued ahead of the pool's own decodes: of a version-2 chunk its blosc frames, then the
lookup of those windows alone (the lookup is about half of a chunk's CPU, docs/benchmarks.md),
so the first batch is served (``Loading.early``) while the pool decodes. The values are the
same (the same function decodes the same chunks); the pool's chunks are read twice, so this is
done only on a store on this machine's file system without a chunk cache (a remote store's first
pool is not fetched twice), and only for a reader with more than one pool that iteration (the
caller decides: its only pool would be all its epoch's chunks). Of a first batch's windows held
in a bank, only those a chunk to decode holds are decoded on their own; the others are gathered
from the bank.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from birdzarr.convert._cpus import usable_cpus
from birdzarr.format._spec import DEVICE, LABEL, N_CHANNELS, TIMESTAMP, WINDOW_LENGTH
from birdzarr.loader._sampling import Pool
from birdzarr.store._chunks import ChunkReader
from birdzarr.store._selection import Selection

PER_WINDOW = {LABEL: np.int32, DEVICE: np.int32, TIMESTAMP: np.int64}


def reader_threads(requests: int, *, local: bool, readers: int, cores: int | None = None) -> int:
    """The threads one reader fetches and decodes chunks on.

    A store read over a network: ``requests`` (reads in flight hide its latency). A store on this
    machine's file system: no more than the reader's share of the cores, ``cores // readers``
    (at least 1), where ``readers`` is the number of DataLoader workers (1 for the training
    process): a read there is a copy from the page cache and decoding is the work, so more threads
    only contend for the same cores and for the interpreter lock, and each holds its own decode
    scratch (about 13 MB for a chunk of 32,768 windows). On the 2-core benchmark machine with 2
    workers that is one thread a worker (docs/training.md#memory)."""
    if not local:
        return requests
    return max(1, min(requests, (usable_cpus() if cores is None else cores) // max(1, readers)))


@dataclass
class LoadedPool:
    """A pool in the buffers: ``rows[i]`` is the buffer row of the pool's window ``i``."""

    rows: np.ndarray
    gimu: np.ndarray
    ldt: dict[str, np.ndarray] | None


class _DaemonThreads:
    """A few daemon threads running submitted calls (a ThreadPoolExecutor's threads are joined
    at exit, so an exiting worker would first finish every queued decode)."""

    def __init__(self, n: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None]
        self._queue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(n)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            call, args, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call(*args))
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)

    def submit(self, call: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((call, args, future))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()


def _results(futures: list[Future[Any]], also: Sequence[Future[Any]] = ()) -> list[Any]:
    """The futures' results in order; on the first failure the rest (and ``also``) are
    cancelled (and the running ones waited for: they write into the buffers) before it is raised."""
    try:
        return [future.result() for future in futures]
    except BaseException:
        every = [*futures, *also]
        for future in every:
            future.cancel()
        wait(every)
        raise


@dataclass(frozen=True)
class _Held:
    """A piece of a chunk in a bank: the chunk's selected windows ``[lo, hi)`` (ranks among its
    selected windows), in slot ``slot``; ``rows[i]`` is the bank row of window ``lo + i``."""

    slot: int
    lo: int
    hi: int
    rows: np.ndarray


class _Bank:
    """One pool's worth of buffers: float32 windows, and label, device, time with ldt; and which
    piece of which chunk each slot holds (``held``: the pieces of the latest pool loaded here)."""

    def __init__(self, with_ldt: bool) -> None:
        self.with_ldt = with_ldt
        self.capacity = 0
        self.gimu = np.empty((0, WINDOW_LENGTH, N_CHANNELS), np.float32)
        self.ldt: dict[str, np.ndarray] = {}
        self.held: dict[int, _Held] = {}  # chunk -> its piece here

    def reserve(self, chunks: int, chunk_windows: int) -> None:
        if chunks <= self.capacity:
            return
        rows = chunks * chunk_windows
        self.held = {}
        self.gimu = np.empty((rows, WINDOW_LENGTH, N_CHANNELS), np.float32)
        if self.with_ldt:
            self.ldt = {name: np.empty(rows, dtype) for name, dtype in PER_WINDOW.items()}
        self.capacity = chunks

    def find(self, chunk: int, lo: int, hi: int) -> tuple[_Held, np.ndarray] | None:
        """The held piece of ``chunk`` holding its selected windows ``[lo, hi)``, and their rows."""
        held = self.held.get(chunk)
        if held is None or not held.lo <= lo < hi <= held.hi:
            return None
        return held, held.rows[lo - held.lo : hi - held.lo]

    def forget(self, slots: set[int]) -> None:
        """Slots about to be written: what they held is gone."""
        self.held = {chunk: h for chunk, h in self.held.items() if h.slot not in slots}


@dataclass(frozen=True)
class _Source:
    """Where one piece of a pool comes from: rows already in a bank (``found``: a bank and rows;
    kept in place when that bank is the one loaded), else decoded (``found`` None) into ``slot``;
    a piece found in the other bank is copied into ``slot``."""

    found: tuple[int, np.ndarray] | None
    slot: int
    kept: _Held | None = None  # the piece held in place (it stays recorded as it is)

    @property
    def decodes(self) -> bool:
        return self.found is None


@dataclass(frozen=True)
class _Arranged:
    """A pool's pieces in one bank: each piece's source; ``direct``: every piece is already in
    ``bank`` (nothing to decode, copy or record)."""

    bank: int
    sources: list[_Source]
    direct: bool


EarlyBatch = tuple[np.ndarray, "dict[str, np.ndarray] | None"]  # windows (and ldt) of a first batch


@dataclass(frozen=True, eq=False)  # compared by identity
class _Pending:
    """A prefetch: its key and pool, each piece's rows being loaded, where they go, and the
    pool's order being computed (None: none asked for)."""

    key: Hashable
    pool: Pool
    futures: list[Future[np.ndarray]]
    arranged: _Arranged
    order: Future[np.ndarray] | None
    early: list[tuple[np.ndarray, Future[EarlyBatch]]] | None = None  # its first batch, on its own
    first: tuple[int, int] = (0, 0)  # (that batch's number, its windows)

    def every_future(self) -> list[Future[Any]]:
        """The pieces', the early batch's and the order's futures."""
        return [*self.futures, *(future for _, future in self.early or []),
                *([] if self.order is None else [self.order])]


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class Loading:
    """A pool being loaded into one bank (``PoolBuffers.start``): ``early()`` gives the first
    batch's windows decoded on their own (None when none were), ``wait()`` the whole pool."""

    def __init__(self, buffers: PoolBuffers, pool: Pool, futures: list[Future[np.ndarray]],
                 arranged: _Arranged, early: list[tuple[np.ndarray, Future[EarlyBatch]]] | None = None,
                 first: int = 0, order: Future[np.ndarray] | None = None,
                 early_batch: int | None = None) -> None:
        self._buffers = buffers
        self._pool = pool
        self._futures = futures  # each piece's rows in the bank
        self._arranged = arranged
        self._early = early  # (the batch's members in a chunk, their windows being decoded)
        self._first = first  # windows of the first batch
        self._order = order  # the pool's order, computed with a prefetch
        self.early_batch = early_batch  # the batch a prefetch decoded on its own (None: the caller's)
        self._loaded: LoadedPool | None = None

    @property
    def futures(self) -> list[Future[Any]]:
        return [*self._futures, *(future for _, future in self._early or []),
                *([] if self._order is None else [self._order])]

    def order(self) -> np.ndarray | None:
        """The pool's order of windows computed with its prefetch (``prefetch(..., order=)``),
        or None (a pool started on the spot, or a prefetch given no order)."""
        if self._order is None:
            return None
        return _results([self._order], also=self._futures)[0]

    def early(self) -> EarlyBatch | None:
        """The first batch's windows ``(x, ldt)`` in the batch's order, decoded on their own, or
        None (a prefetched pool, no first batch asked for, a store not on this machine)."""
        if self._early is None:
            return None
        early, self._early = self._early, None
        parts = _results([future for _, future in early], also=self._futures)
        x = np.empty((self._first, WINDOW_LENGTH, N_CHANNELS), np.float32)
        ldt = ({name: np.empty(self._first, dtype) for name, dtype in PER_WINDOW.items()}
               if self._buffers.with_ldt else None)
        for (members, _), (windows, values) in zip(early, parts, strict=True):
            x[members] = windows
            if ldt is not None and values is not None:
                for name in PER_WINDOW:
                    ldt[name][members] = values[name]
        self._buffers.early_batches += 1
        return x, ldt

    def wait(self) -> LoadedPool:
        """The pool in its bank, once every chunk is decoded (the same object on later calls)."""
        if self._loaded is None:
            pieces = _results(self._futures)
            self._loaded = self._buffers._loaded(self._pool, pieces, self._arranged)
            if self._buffers._loading is self:
                self._buffers._loading = None
        return self._loaded


class PoolBuffers:
    """One reader's pool memory and its fetch threads (create after a DataLoader worker forks).

    Two banks: a pool loaded on the spot goes to bank 0; a prefetch goes to the bank not holding
    the pool being served, and is served from there; a pool one bank holds whole is served from
    it. In the training process (no prefetch) only bank 0 is ever allocated.
    """

    def __init__(self, reader: ChunkReader, selection: Selection, *, with_ldt: bool, threads: int) -> None:
        self.reader = reader
        self.selection = selection
        self.with_ldt = with_ldt
        self._banks = (_Bank(with_ldt), _Bank(with_ldt))
        self._serving = 0  # the bank of the pool handed out last
        self.threads = max(1, threads)
        self._threads = _DaemonThreads(self.threads, "birdzarr-fetch")
        self._pending: list[_Pending] = []  # prefetches not taken yet: at most one a bank
        self.decoded = 0  # chunks decoded by this reader for pools it served (tests count them)
        self.reused = 0  # pieces of pools it served taken from a bank instead (tests count them)
        self.prefetched = 0  # pools taken from a prefetch (tests count them)
        self.discarded = 0  # prefetches not used
        self.early_batches = 0  # first batches decoded on their own (tests count them)
        self._loading: Loading | None = None  # a pool being loaded on the spot, not yet waited for

    # bank 0: where every pool that was not prefetched is loaded
    @property
    def capacity(self) -> int:
        return self._banks[0].capacity

    @property
    def gimu(self) -> np.ndarray:
        return self._banks[0].gimu

    @property
    def ldt(self) -> dict[str, np.ndarray]:
        return self._banks[0].ldt

    @property
    def prefetch_capacity(self) -> int:
        """Chunks the second bank holds (0 until a prefetch has used it)."""
        return self._banks[1].capacity

    def close(self) -> None:
        self._drop_pending()
        self._settle()
        self._threads.shutdown()

    def _settle(self) -> None:
        """Cancel the decodes of a pool started on the spot and never waited for (an iteration
        dropped after its first batch): the running ones finish first, as they write into a bank."""
        if self._loading is not None:
            futures, self._loading = self._loading.futures, None
            for future in futures:
                future.cancel()
            wait(futures)

    def _arrange(self, bank: int, pool: Pool) -> _Arranged:
        """Where each piece of ``pool`` comes from when it is loaded into ``bank``: a bank holding
        every piece serves it as it is; else pieces ``bank`` holds stay in their slots, pieces
        the other bank holds are copied, the rest decoded, into ``bank``'s other slots (which
        forget what they held). Nothing is written into a bank while it is read, as before: the
        other bank is only read, and is not being loaded (a prefetch into it was dropped)."""
        pieces = list(zip(pool.chunks.tolist(), pool.lo.tolist(), pool.hi.tolist(), strict=True))
        other = 1 - bank
        for b in (bank, other):
            found = [self._banks[b].find(*piece) for piece in pieces]
            if pieces and all(f is not None for f in found):
                return _Arranged(b, [_Source((b, f[1]), f[0].slot, f[0]) for f in found if f is not None],
                                 direct=True)
        target = self._banks[bank]
        target.reserve(len(pieces), self.reader.chunk_windows)  # growing forgets what it held
        here = [target.find(*piece) for piece in pieces]
        there = [self._banks[other].find(*piece) for piece in pieces]
        kept = {h[0].slot for h in here if h is not None}
        free = iter([slot for slot in range(target.capacity) if slot not in kept])
        sources = []
        for h, t in zip(here, there, strict=True):
            if h is not None:
                sources.append(_Source((bank, h[1]), h[0].slot, h[0]))
            else:
                sources.append(_Source(None if t is None else (other, t[1]), next(free)))
        target.forget({source.slot for source in sources if source.kept is None})
        return _Arranged(bank, sources, direct=False)

    def _submit(self, arranged: _Arranged, pool: Pool) -> list[Future[np.ndarray]]:
        """Each piece's rows in the bank: held already, or a copy or a decode queued."""
        futures: list[Future[np.ndarray]] = []
        for source, chunk, lo, hi in zip(arranged.sources, pool.chunks.tolist(), pool.lo.tolist(),
                                         pool.hi.tolist(), strict=True):
            if source.kept is not None and source.found is not None:
                futures.append(_done(source.found[1]))
            elif source.found is not None:
                futures.append(self._threads.submit(self._copy_piece, *source.found, arranged.bank,
                                                    source.slot))
            else:
                futures.append(self._threads.submit(self._load_chunk, arranged.bank, source.slot, chunk,
                                                    lo, hi))
        return futures

    def prefetch(self, key: Hashable, pool: Pool, order: Callable[[], np.ndarray] | None = None, *,
                 served: bool = False,
                 first: tuple[int, Callable[[np.ndarray], np.ndarray]] | None = None) -> None:
        """Start decoding ``pool`` into the bank not being served; ``load(pool, key)`` takes it.
        ``order`` (the pool's order of windows, a pure function) is drawn here, on the calling
        thread, once the decodes are queued (they run meanwhile), and served by the taking
        ``Loading.order()``: the reader's thread then starts serving the pool without drawing its
        permutation (tens of ms for a default pool) while the fetch threads wait for it, and
        the fetch threads do not draw it either (they are what a worker waits for).

        ``served=True``: into the bank of the pool served last instead, which the caller is done
        with (every batch of it gathered), beside a prefetch into the other bank: a worker that
        has gathered its last batch of an epoch decodes its second pool of the next epoch there
        while its first one waits in the other bank. A prefetch already started for this key
        and pool is left as it is.

        ``first``: (a batch number, the pool positions of that batch given the order), for a
        prefetch that may not be done when it is asked for (a worker's only pool of an epoch
        prefetches its next one, which takes longer to decode than that pool to serve): the
        order is then drawn first and that batch's windows are decoded on their own ahead of the
        pool, as ``start`` does for an iteration's first batch (``Loading.early``; the same
        conditions: a version-2 store on this machine without a chunk cache)."""
        if self.prefetching(pool, key):
            return
        bank = self._serving if served else 1 - self._serving
        self._drop_pending(bank)
        self._settle()
        arranged = self._arrange(bank, pool)
        if first is not None and order is not None and self._early_allowed(arranged):
            drawn = order()  # first: the early batch's windows depend on it
            positions = np.asarray(first[1](drawn), dtype=np.int64)
            early = self._submit_early(pool, positions, arranged)
            self._pending.append(_Pending(key, pool, self._submit(arranged, pool), arranged, _done(drawn),
                                          early, (first[0], len(positions))))
            return
        # registered before the order is drawn, so that a draw that raises leaves the queued
        # decodes where the next _drop_pending cancels them
        pending = _Pending(key, pool, self._submit(arranged, pool), arranged, None)
        self._pending.append(pending)
        if order is not None:
            self._pending[-1] = replace(pending, order=_done(order()))

    def _early_allowed(self, arranged: _Arranged) -> bool:
        """Whether a first batch may be decoded on its own: something of the pool is decoded,
        on a version-2 store on this machine without a chunk cache (a remote store's chunks are
        not fetched twice)."""
        return (any(s.decodes for s in arranged.sources) and self.reader.format_version == 2
                and self.reader.location.is_local and self.reader.cache is None)

    def _drop_pending(self, bank: int | None = None) -> None:
        """Cancel the prefetches nobody asked for (into ``bank``, or every one): their running
        decodes finish first."""
        dropped = [p for p in self._pending if bank is None or p.arranged.bank == bank]
        self._pending = [p for p in self._pending if all(p is not d for d in dropped)]
        for pending in dropped:
            futures = pending.every_future()
            for future in futures:
                future.cancel()
            wait(futures)
            self.discarded += 1

    def _find_pending(self, pool: Pool, key: Hashable) -> _Pending | None:
        if key is None:
            return None
        return next((p for p in self._pending if p.key == key and _same(p.pool, pool)), None)

    def prefetching(self, pool: Pool, key: Hashable) -> bool:
        """Whether ``start(pool, key)`` will take a prefetch (then it decodes no first batch
        on its own, and ``Loading.order()`` gives the order drawn with it, if one was asked for)."""
        return self._find_pending(pool, key) is not None

    def load(self, pool: Pool, key: Hashable = None) -> LoadedPool:
        """Fetch and decode every chunk of ``pool`` into the buffers (all in flight at once), or
        take the prefetch started with this ``key`` for the same pool."""
        return self.start(pool, key).wait()

    def start(self, pool: Pool, key: Hashable = None, first: np.ndarray | None = None) -> Loading:
        """Take the prefetch started with this ``key`` for the same pool, or start decoding every
        chunk of ``pool`` into bank 0 (but the pieces a bank holds: ``_arrange``). In that case,
        given ``first`` (the pool positions of its first batch, in the batch's order) and a
        version-2 store on this machine, those windows are decoded on their own first
        (``Loading.early``), queued ahead of the pool's chunks; those a bank holds are gathered
        from it; with nothing to decode, nothing is done early."""
        self._settle()
        pending = self._find_pending(pool, key)
        if pending is not None:  # the other bank's prefetch, if any, stays: the next pool's
            self._pending.remove(pending)
            self.prefetched += 1
            return Loading(self, pool, pending.futures, pending.arranged, pending.early, pending.first[1],
                           order=pending.order, early_batch=pending.first[0] if pending.early else None)
        self._drop_pending()
        arranged = self._arrange(0, pool)
        early = None
        if first is not None and len(first) and self._early_allowed(arranged):
            early = self._submit_early(pool, np.asarray(first, dtype=np.int64), arranged)
        loading = Loading(self, pool, self._submit(arranged, pool), arranged, early,
                          0 if first is None else len(first))
        self._loading = loading
        return loading

    def _submit_early(self, pool: Pool, first: np.ndarray, arranged: _Arranged
                      ) -> list[tuple[np.ndarray, Future[EarlyBatch]]]:
        """Queue the decode of the windows at pool positions ``first``, chunk by chunk; those
        of a piece a bank holds are gathered from it now."""
        bounds = np.concatenate(([0], np.cumsum(pool.hi - pool.lo)))
        piece = np.searchsorted(bounds, first, side="right") - 1
        ranks = pool.lo[piece] + first - bounds[piece]  # among the chunk's selected windows
        tasks = []
        for j in np.unique(piece).tolist():
            members = np.flatnonzero(piece == j)
            found = arranged.sources[j].found
            if found is not None:
                bank, rows = found
                tasks.append((members, _done(self._gather(bank, rows[ranks[members] - int(pool.lo[j])]))))
                continue
            chunk = int(pool.chunks[j])
            mask = self.selection.chunk_mask(self.reader, chunk)
            positions = ranks[members] if mask is None else np.flatnonzero(mask)[ranks[members]]
            order = np.argsort(positions, kind="stable")  # read_windows takes ascending positions
            tasks.append((members[order], self._threads.submit(self._read_early, chunk, positions[order])))
        return tasks

    def _gather(self, bank: int, rows: np.ndarray) -> EarlyBatch:
        """Rows of a bank, and their ldt."""
        held = self._banks[bank]
        x = np.take(held.gimu, rows, axis=0)
        return x, ({name: held.ldt[name][rows] for name in PER_WINDOW} if self.with_ldt else None)

    def _read_early(self, chunk: int, positions: np.ndarray) -> EarlyBatch:
        """Windows ``positions`` (ascending, within the chunk) of one chunk, and their ldt."""
        x = np.empty((len(positions), WINDOW_LENGTH, N_CHANNELS), np.float32)
        self.reader.read_windows(chunk, positions, x)
        ldt = None
        if self.with_ldt:
            ldt = {name: self.reader.read(name, chunk)[positions] for name in PER_WINDOW}
        return x, ldt

    def _loaded(self, pool: Pool, pieces: list[np.ndarray], arranged: _Arranged) -> LoadedPool:
        rows = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
        decoded = sum(source.decodes for source in arranged.sources)
        self.decoded += decoded
        self.reused += len(arranged.sources) - decoded
        if not arranged.direct:  # the bank now holds this pool's pieces
            self._banks[arranged.bank].held = {
                chunk: source.kept or _Held(source.slot, lo, hi, piece)
                for source, chunk, lo, hi, piece in zip(arranged.sources, pool.chunks.tolist(),
                                                        pool.lo.tolist(), pool.hi.tolist(), pieces,
                                                        strict=True)}
        self._serving = arranged.bank
        held = self._banks[arranged.bank]
        return LoadedPool(rows.astype(np.int64, copy=False), held.gimu, held.ldt if self.with_ldt else None)

    def _copy_piece(self, source: int, rows: np.ndarray, bank: int, slot: int) -> np.ndarray:
        """Copy a piece the other bank holds (its ``rows`` there) into ``slot`` of ``bank``;
        return its rows in ``bank``."""
        width, src, held = self.reader.chunk_windows, self._banks[source], self._banks[bank]
        start, stop = slot * width, slot * width + len(rows)
        np.take(src.gimu, rows, axis=0, out=held.gimu[start:stop], mode="clip")
        if self.with_ldt:
            for name in PER_WINDOW:
                held.ldt[name][start:stop] = src.ldt[name][rows]
        return np.arange(start, stop, dtype=np.int64)

    def _load_chunk(self, bank: int, slot: int, chunk: int, lo: int, hi: int) -> np.ndarray:
        """Decode the pool's piece of one chunk (its selected windows ``[lo, hi)``, ranks among
        the chunk's selected windows) into ``slot`` of ``bank``; return their rows in the bank,
        in stored order (a version-2 chunk: only they are looked up, packed at the slot's
        start; version 1: the whole chunk, each where it is)."""
        reader, width, held = self.reader, self.reader.chunk_windows, self._banks[bank]
        start, stop = reader.chunk_span(chunk)
        mask = self.selection.chunk_mask(reader, chunk)
        if mask is None:
            selected = None if (lo, hi) == (0, stop - start) else np.arange(lo, hi)
        else:
            selected = np.flatnonzero(mask)[lo:hi]
        rows = reader.read_windows(chunk, selected, held.gimu[slot * width : (slot + 1) * width])
        if self.with_ldt:
            for name in PER_WINDOW:
                values = reader.read(name, chunk)
                held.ldt[name][slot * width + rows] = values if selected is None else values[selected]
        return slot * width + rows


def _same(a: Pool, b: Pool) -> bool:
    return all(np.array_equal(x, y) for x, y in ((a.chunks, b.chunks), (a.lo, b.lo), (a.hi, b.hi)))
