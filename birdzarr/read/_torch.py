"""``WindowDataset``: shuffled, batched windows for ``torch.utils.data.DataLoader``.

This is the only module that imports torch. The dataset yields whole batches (use
``DataLoader(ds, batch_size=None)``); each batch is gathered with one vectorised numpy indexing
per chunk from chunks fetched and decoded ahead on a thread pool. The epoch's order is planned by
the pure functions in ``_sampling`` and depends on (seed, epoch, world size) only.

Memory per reader (the main process, or each DataLoader worker) is bounded by its settings::

    (chunks per group + 2 x prefetch) x chunk_windows x 320 B  +  4 x batch_size x 320 B

(held and prefetched chunks, per-thread decode scratch, the batch and its scratch buffers) plus
DataLoader's own ``prefetch_factor x num_workers`` finished batches. It never depends on the
number of windows in the store.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.reduction import DupFd
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from birdzarr._format import DEVICE, GIMU, LABEL, N_CHANNELS, TIMESTAMP, WINDOW_LENGTH
from birdzarr._storage import StoreLike, resolve
from birdzarr._store import open_store
from birdzarr.read import _handoff
from birdzarr.read._chunks import ChunkReader
from birdzarr.read._fetch import BufferPool, ChunkData, prefetched
from birdzarr.read._sampling import EpochPlan, plan_epoch, rank_window_counts, worker_batches
from birdzarr.read._selection import make_selection

_STATE_VERSION = 2  # 2: ranks take whole batch-sized pieces of the stream (order differs from 1)
Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _new_batch(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An uninitialised tensor, in shared memory when ``shared`` (inside a DataLoader worker)."""
    if shared:
        # Straight into a new shared segment, as default_collate does in workers;
        # ``share_memory_()`` would allocate, then copy into the segment (twice the page faults).
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        try:
            storage = torch.UntypedStorage._new_shared(nbytes)
        except (AttributeError, RuntimeError):  # a torch without it: the public way
            return torch.empty(shape, dtype=dtype).share_memory_()
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]
    return torch.empty(shape, dtype=dtype)


_X_BYTES = WINDOW_LENGTH * N_CHANNELS * 4  # one float32 window
_LDT_BYTES = 3 * 8  # one int64 (label, device, unix seconds) row
_FREE_SLOTS = 4  # reusable batch slots a worker keeps when they are free


class _SharedBatch:
    """A finished batch in a worker's reusable shared-memory slot (read/_handoff.py).

    DataLoader pickles it to the training process, where it becomes the batch's tensor (or the
    ``(x, ldt)`` tuple) on the slot's memory; the slot is reused once those tensors are freed.
    """

    __slots__ = ("slot", "fields")

    def __init__(self, slot: _handoff.Slot, fields: list[tuple[str, tuple[int, ...], int]]) -> None:
        self.slot, self.fields = slot, fields

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled once, by DataLoader's queue; only a slot's first handle carries its fd
        fd = self.slot.hand_over_fd()
        handle = None
        if fd is not None:
            handle = DupFd(fd)  # keeps its own duplicate until the receiver fetches it
            os.close(fd)
        return (_receive_batch, (self.slot.key, handle, self.slot.size, self.fields))


def _receive_batch(
    key: _handoff.SlotKey, handle: Any, size: int, fields: list[tuple[str, tuple[int, ...], int]]
) -> Batch:
    lease = _handoff.receive(key, None if handle is None else handle.detach(), size)
    tensors = [
        torch.frombuffer(lease, dtype=getattr(torch, name), count=math.prod(shape), offset=at).view(shape)
        for name, shape, at in fields
    ]
    return tensors[0] if len(tensors) == 1 else (tensors[0], tensors[1])


@dataclass
class _PerProcess:
    """What one process (the main one, or a DataLoader worker) opens for itself."""

    pid: int
    reader: ChunkReader
    buffers: BufferPool
    scratch: dict[str, np.ndarray] = field(default_factory=dict)
    slots: _handoff.SlotRing | None = None  # batch slots, in a DataLoader worker only


def _distributed_defaults() -> tuple[int, int]:
    """(world_size, rank) from torch.distributed if initialised, else torchrun's environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


class WindowDataset(IterableDataset[Batch]):
    """Batches of windows from a store, shuffled per epoch, split over workers and ranks.

    Args:
        store: path or URL of a committed store (``s3://...`` works the same).
        batch_size: windows per batch; the last batch of an epoch may be shorter unless
            ``drop_last``.
        shuffle: a new seeded order every epoch (call :meth:`set_epoch`).
        seed: the shuffle seed; the order is a pure function of (seed, epoch, world size).
        drop_last: drop the windows that do not fill a batch on every rank (fewer than
            ``world_size * batch_size`` a epoch) instead of delivering a short last batch.
        channel_first: yield ``(B, 4, 20)`` instead of ``(B, 20, 4)``.
        with_ldt: yield ``(x, ldt)`` with ``ldt`` int64 ``(B, 3)`` = label, device id, unix seconds.
        devices / exclude_devices: keep only / drop these device ids.
        split: ``"train"`` or ``"val"`` to take one side of a seeded split; ``split_by`` is
            ``"device"`` (default: birds stay on one side) or ``"window"`` (per-window, like the
            old 90/10 code); ``val_fraction`` and ``split_seed`` set it.
        shuffle_buffer: windows shuffled together (rounded up to whole batches; default one
            batch). On a pre-shuffled store one batch is enough; larger buffers mix more chunks
            per batch at the cost of memory and, with several workers, repeated chunk decoding.
        prefetch: chunks fetched and decoded ahead of use (raise it for object stores).
        transform: optional callable applied to each batch tensor ``x`` in the reader.
        world_size / rank: override what torch.distributed or the environment say.
        storage_options: passed to fsspec (credentials are never stored or printed).
        cache_dir / cache_max_bytes: opt-in local disk cache of a remote store's chunks, so later
            epochs read local disk; at the cap it stops admitting chunks (docs/cloud.md).
        reuse_batch_memory: in DataLoader workers, hand batches over through a few reused
            shared-memory slots instead of a fresh segment per batch (Linux; 2x faster here,
            docs/training.md#workers-and-ranks). Turn it off if a custom ``collate_fn`` must see
            tensors inside the worker. A ``transform`` keeping shape and dtype writes into the slot.
    """

    def __init__(
        self,
        store: StoreLike,
        *,
        batch_size: int = 8192,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        channel_first: bool = False,
        with_ldt: bool = False,
        devices: Iterable[int] | None = None,
        exclude_devices: Iterable[int] | None = None,
        split: str | None = None,
        split_by: str = "device",
        val_fraction: float = 0.1,
        split_seed: int = 0,
        shuffle_buffer: int | None = None,
        prefetch: int = 4,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_bytes: int = 50 * 2**30,
        reuse_batch_memory: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError("batch_size must be positive")
        env_world, env_rank = _distributed_defaults()
        self.world_size = env_world if world_size is None else int(world_size)
        self.rank = env_rank if rank is None else int(rank)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.channel_first = channel_first
        self.with_ldt = with_ldt
        self.prefetch = max(1, prefetch)
        self.transform = transform
        self.reuse_batch_memory = reuse_batch_memory
        self.group_batches = max(1, -(-(shuffle_buffer or batch_size) // batch_size))
        self.location = resolve(store, storage_options)
        opened = open_store(self.location)
        # A snapshot: windows committed later (an append during training) are not seen.
        self.n_windows = len(opened)
        self.shuffled_store = opened.shuffled
        self.selection = make_selection(
            opened.device_table,
            shuffled_store=opened.shuffled,
            devices=devices,
            exclude_devices=exclude_devices,
            split=split,
            split_by=split_by,
            val_fraction=val_fraction,
            split_seed=split_seed,
        )
        self.counts = self.selection.counts(opened.reader)
        self._layouts = opened.reader.layouts
        self._cache = None
        if cache_dir is not None:
            from birdzarr._cache import cache_for

            self._cache = cache_for(opened, cache_dir, cache_max_bytes)
        self.n_selected = int(self.counts.sum())
        self._per_rank, self._n_batches = rank_window_counts(
            self.n_selected, self.world_size, batch_size, drop_last
        )
        if shuffle and not opened.shuffled and len(opened.device_table) > 1:
            warnings.warn(
                f"{opened.url} is stored in device order: a batch mixes only the few devices of "
                "the chunks in its shuffle buffer. For training, convert with --shuffle "
                "(docs/training.md#shuffle-quality).",
                stacklevel=2,
            )
        self.epoch = 0
        self._resume_at = 0  # rank-level batch index the next iteration starts from
        self._resume_epoch: int | None = None
        self._yielded = 0
        self._skip_own = 0  # batches this worker already yielded before a StatefulDataLoader resume
        self._restored_here = False  # load_state_dict ran in this worker (StatefulDataLoader)
        # (epoch, resume_at, resume_epoch or -1) in shared memory: persistent DataLoader workers
        # keep their own copy of the dataset, so set_epoch() in the training process reaches
        # them only through this
        self._control = torch.tensor([0, 0, -1], dtype=torch.int64).share_memory_()
        self._per_process: _PerProcess | None = None

    # -- sizes and state -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        return self._n_batches

    @property
    def windows_per_epoch(self) -> int:
        """Windows this rank yields per epoch."""
        return int(self._per_rank[self.rank])

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's order; call before iterating (keeps a resume point of that epoch)."""
        self.epoch = int(epoch)
        if self._resume_epoch is not None and self._resume_epoch != self.epoch:
            self._resume_at, self._resume_epoch, self._skip_own = 0, None, 0
        self._publish()

    def _publish(self) -> None:
        """Share the epoch and resume point with (persistent) workers; the training process only."""
        if get_worker_info() is None:
            resume_epoch = -1 if self._resume_epoch is None else self._resume_epoch
            self._control.copy_(torch.tensor([self.epoch, self._resume_at, resume_epoch]))

    def _follow(self) -> None:
        """In a worker, take the epoch and resume point the training process set last."""
        if get_worker_info() is None:
            return
        if self._restored_here:  # a worker's own restored state wins for the iteration it resumes
            self._restored_here = False
            return
        epoch, resume_at, resume_epoch = self._control.tolist()
        self.epoch, self._resume_at, self._skip_own = epoch, resume_at, 0
        self._resume_epoch = None if resume_epoch < 0 else resume_epoch
        if self._resume_epoch != self.epoch:
            self._resume_at = 0

    def state_dict(self, batches_seen: int | None = None) -> dict[str, Any]:
        """Where the epoch stands. With DataLoader workers, pass the batches the loop consumed
        this epoch (the dataset in the main process does not see workers' progress), or use
        torchdata's ``StatefulDataLoader``, which snapshots each worker's own state."""
        state = {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "rank": self.rank,
            "batch_size": self.batch_size,
        }
        info = get_worker_info()
        if info is not None and batches_seen is None:
            # inside a worker (StatefulDataLoader): this worker's own progress
            return {
                **state,
                "start": self._resume_at,
                "worker_yielded": self._yielded,
                "num_workers": info.num_workers,
            }
        seen = self._yielded if batches_seen is None else int(batches_seen)
        return {**state, "next_batch": self._resume_at + seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state['epoch']`` starts at its next batch."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"cannot resume from WindowDataset state version {state.get('version')!r}: this "
                f"birdzarr writes and reads version {_STATE_VERSION}, whose batch order differs. "
                "Restart the epoch (call set_epoch without load_state_dict) or use the birdzarr "
                "version that saved the state."
            )
        for key in ("seed", "world_size", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume: the state was saved with {key}={state[key]!r}, this dataset "
                    f"has {key}={getattr(self, key)!r}; the order would differ"
                )
        self.epoch = int(state["epoch"])
        self._resume_epoch = self.epoch
        self._yielded = 0
        self._skip_own = 0
        if "worker_yielded" in state:  # a worker's own snapshot, restored into that worker
            self._resume_at, self._skip_own = int(state["start"]), int(state["worker_yielded"])
        else:
            self._resume_at = int(state["next_batch"])
        self._restored_here = get_worker_info() is not None
        self._publish()

    # -- reading ---------------------------------------------------------------------------------
    def plan(self) -> EpochPlan:
        """This rank's plan of the current epoch."""
        return plan_epoch(
            self.counts,
            seed=self.seed,
            epoch=self.epoch,
            world_size=self.world_size,
            rank=self.rank,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            shuffle=self.shuffle,
            group_batches=self.group_batches,
        )

    def batch_indices(self, batch: int, plan: EpochPlan | None = None) -> np.ndarray:
        """Global window indices of one batch of this rank, in delivery order (for debugging)."""
        plan = plan or self.plan()
        reader = self._chunk_reader()
        chunk_ids, ranks = plan.locate(plan.batch_positions(batch))
        out = np.empty(len(chunk_ids), dtype=np.int64)
        for chunk in np.unique(chunk_ids).tolist():
            where = np.flatnonzero(chunk_ids == chunk)
            out[where] = self.selection.selected_indices(reader, chunk)[ranks[where]]
        return out

    def _local(self) -> _PerProcess:
        """This process's reader and buffers, opened on first use in each process, so nothing
        (sockets, event loops, threads, buffers) crosses a DataLoader worker's fork."""
        if self._per_process is None or self._per_process.pid != os.getpid():
            location = resolve(self.location.url, self.location.storage_options)
            reader = ChunkReader(location, self._layouts, self.n_windows)
            reader.cache = self._cache
            pool = BufferPool((reader.chunk_windows, WINDOW_LENGTH, N_CHANNELS))
            self._per_process = _PerProcess(os.getpid(), reader, pool)
        return self._per_process

    def _chunk_reader(self) -> ChunkReader:
        return self._local().reader

    def _load(self, chunk: int) -> ChunkData:
        reader = self._chunk_reader()
        device_ids = reader.read(DEVICE, chunk) if self.with_ldt else None
        mask = self.selection.read_mask(reader, chunk, device_ids)
        names = [GIMU, LABEL, TIMESTAMP] if self.with_ldt else [GIMU]
        pool = self._local().buffers
        buffer = pool.get()
        data = {
            name: reader.read(name, chunk, out=buffer) if name == GIMU else reader.read(name, chunk)
            for name in names
        }
        if device_ids is not None:
            data[DEVICE] = device_ids
        if mask is not None:
            data = {name: array[mask] for name, array in data.items()}
            pool.put(buffer)  # the masked copy no longer refers to it
        elif data[GIMU].base is not buffer and data[GIMU] is not buffer:
            pool.put(buffer)  # decoded elsewhere (another codec chain): the buffer is unused
        return data

    def _release(self, data: ChunkData) -> None:
        self._local().buffers.put(data.get(GIMU))

    def _scratch(self, name: str, size: int) -> np.ndarray:
        """A reused (batch_size, 20, 4) float32 buffer of this process, first ``size`` windows
        (reuse avoids page faults on a fresh temporary every batch; only _assemble uses it)."""
        scratch = self._local().scratch
        if name not in scratch:
            scratch[name] = np.empty((self.batch_size, WINDOW_LENGTH, N_CHANNELS), np.float32)
        return scratch[name][:size]

    def __iter__(self) -> Iterator[Batch]:
        self._follow()
        plan = self.plan()
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        start = self._resume_at
        batches = worker_batches(plan.n_batches, start=start, worker=worker, num_workers=num_workers)
        batches = batches[self._skip_own :]
        steps = [plan.group_chunks(plan.group_of(b)) for b in batches]
        self._yielded = self._skip_own
        self._skip_own = 0
        loads = prefetched(self._load, steps, prefetch=self.prefetch, release=self._release)
        try:
            for batch, chunks in zip(batches, loads, strict=False):
                assembled = self._assemble(plan, batch, chunks)
                self._yielded += 1  # counted before handing over: state_dict() names the next batch
                # a _SharedBatch only in a DataLoader worker, which the transport turns into a Batch
                yield cast(Batch, assembled)
        finally:
            local = self._per_process
            if local is not None and local.slots is not None:  # the receiver may drop its mappings
                local.slots.retire()
        if info is None:  # a finished in-process epoch consumes its resume point
            self._yielded += self._resume_at
            self._resume_at, self._resume_epoch = 0, None
            self._publish()

    def _slot(self) -> _handoff.Slot | None:
        """A free batch slot when batches go to the training process through reused shared memory."""
        if not (self.reuse_batch_memory and _handoff.AVAILABLE):
            return None
        if get_worker_info() is None:
            return None
        local = self._local()
        if local.slots is None:
            per_window = _X_BYTES + (_LDT_BYTES if self.with_ldt else 0)
            local.slots = _handoff.SlotRing(self.batch_size * per_window, keep=_FREE_SLOTS)
        return local.slots.acquire()

    def _assemble(self, plan: EpochPlan, batch: int, chunks: dict[int, ChunkData]) -> Batch | _SharedBatch:
        chunk_ids, ranks = plan.locate(plan.batch_positions(batch))
        size = len(chunk_ids)
        shape = (size, N_CHANNELS, WINDOW_LENGTH) if self.channel_first else (size, WINDOW_LENGTH, N_CHANNELS)
        ldt_offset = self.batch_size * _X_BYTES
        slot = self._slot()
        tensor = ldt_tensor = None
        if slot is not None:
            out = slot.data[: size * _X_BYTES].view(np.float32).reshape(shape)
            ldt = None
            if self.with_ldt:
                ldt = slot.data[ldt_offset : ldt_offset + size * _LDT_BYTES].view(np.int64).reshape(size, 3)
        else:
            # In a DataLoader worker the batch is built in shared memory, so handing it to the
            # main process sends a handle instead of copying it into a fresh shared segment.
            shared = get_worker_info() is not None
            tensor = _new_batch(shape, torch.float32, shared)
            out = tensor.numpy()
            ldt_tensor = _new_batch((size, 3), torch.int64, shared) if self.with_ldt else None
            ldt = None if ldt_tensor is None else ldt_tensor.numpy()
        x = self._scratch("channel_last", size) if self.channel_first else out
        # one stable sort groups the batch's windows by chunk (no per-chunk scan of the batch)
        order = np.argsort(chunk_ids, kind="stable")
        cuts = np.flatnonzero(np.diff(chunk_ids[order])) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), size], strict=True):
            where = order[lo:hi]
            data = chunks[int(chunk_ids[where[0]])]
            rows = ranks[where]
            # the plan's ranks index the chunk's selected windows, so mode="clip" (3x faster than
            # the default, which buffers the output) never clips
            assert int(rows.max()) < len(data[GIMU])
            if hi - lo == size:  # the whole batch comes from one chunk: gather straight into x
                np.take(data[GIMU], rows, axis=0, out=x, mode="clip")
            else:  # gather into a warm scratch buffer, then scatter
                part = self._scratch("part", hi - lo)
                np.take(data[GIMU], rows, axis=0, out=part, mode="clip")
                x[where] = part
            if ldt is not None:
                ldt[where, 0] = data[LABEL][rows]
                ldt[where, 1] = data[DEVICE][rows]
                ldt[where, 2] = data[TIMESTAMP][rows]
        if self.channel_first:
            out[:] = x.transpose(0, 2, 1)
        if slot is not None and self.transform is not None:
            x_slot = torch.from_numpy(out)
            transformed = self.transform(x_slot)
            if transformed.shape != x_slot.shape or transformed.dtype != x_slot.dtype:
                # another shape or dtype: torch's own transport (copies: the slot is reused)
                ldt_copy = None if ldt is None else torch.from_numpy(ldt).clone()
                transformed = transformed.clone()
                return transformed if ldt_copy is None else (transformed, ldt_copy)
            if transformed.data_ptr() != x_slot.data_ptr():
                x_slot.copy_(transformed)
            elif transformed.stride() != x_slot.stride():  # a rearranged view of the slot itself
                x_slot.copy_(transformed.clone())
        if slot is not None:
            slot.lease()
            fields: list[tuple[str, tuple[int, ...], int]] = [("float32", shape, 0)]
            if self.with_ldt:
                fields.append(("int64", (size, 3), ldt_offset))
            return _SharedBatch(slot, fields)
        assert tensor is not None
        if self.transform is not None:
            tensor = self.transform(tensor)
        if ldt_tensor is not None:
            return tensor, ldt_tensor
        return tensor

    def __repr__(self) -> str:
        return (
            f"WindowDataset({self.location.display!r}, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, rank={self.rank}/"
            f"{self.world_size}, windows={self.windows_per_epoch:,}, batches={len(self)})"
        )
