"""``WindowDataset``: shuffled, batched windows for ``torch.utils.data.DataLoader``.

This package is the only one that imports torch. The dataset yields whole batches (use
``DataLoader(ds, batch_size=None)``). Streaming (the default), each epoch is planned by the pure
functions in ``_sampling``: a seeded permutation of chunks split over ranks, cut into pools that
DataLoader workers take whole; a worker decodes a pool's chunks once into its own buffers
(``_pool``), permutes the pool's windows and gathers each batch with one vectorised take.
``resident=`` holds the selection in memory instead and draws a full permutation every epoch
(``_resident``).

Memory per streaming reader (the main process, or each DataLoader worker) is set by its settings::

    pool_chunks x chunk_windows x (320 B + 16 B with ldt)  +  (4 + 2) x batch_size x 344 B

(the pool; the reused batch slots and scratch) plus DataLoader's own ``prefetch_factor x
num_workers`` batches in flight. It never depends on the number of windows in the store.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.reduction import DupFd
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from birdzarr._errors import SamplingError
from birdzarr.format._spec import DEVICE, LABEL, N_CHANNELS, TIMESTAMP, WINDOW_LENGTH
from birdzarr.loader import _handoff
from birdzarr.loader._pool import LoadedPool, PoolBuffers
from birdzarr.loader._sampling import EpochPlan, plan_epoch, resumed_worker
from birdzarr.loader._selection import make_selection
from birdzarr.storage._location import StoreLike, resolve
from birdzarr.store._chunks import ChunkReader
from birdzarr.store._handle import open_store

_STATE_VERSION = 3  # 3: pools of whole chunks taken by workers (order depends on num_workers)
Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
DEFAULT_SHUFFLE_BUFFER = 2**18  # windows per pool: 80 MiB of float32, 32 chunks of 8192


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
    pool: PoolBuffers
    scratch: dict[str, np.ndarray] = field(default_factory=dict)
    slots: _handoff.SlotRing | None = None  # batch slots, in a DataLoader worker only


def _distributed_defaults() -> tuple[int, int]:
    """(world_size, rank) from torch.distributed if initialised, else torchrun's environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


# Slots of the shared control tensor (training process -> persistent workers, and back).
_EPOCH, _RESUME_AT, _RESUME_EPOCH, _RESUME_WORKERS, _NUM_WORKERS = range(5)


class WindowDataset(IterableDataset[Batch]):
    """Batches of windows from a store, reshuffled every epoch, split over workers and ranks.

    Args:
        store: path or URL of a committed store (``s3://...`` works the same).
        batch_size: windows per batch. Streaming, each pool's last batch may be shorter unless
            ``drop_last``.
        shuffle: new batches every epoch (call ``set_epoch``). Streaming from a
            device-ordered store this is refused (batches would mix only the devices of a pool's
            chunks); convert with ``--shuffle``, or use ``resident=``.
        seed: the shuffle seed; which windows form a batch is a pure function of (seed, epoch,
            world size, shuffle_buffer, batch_size, drop_last); streaming, the order batches
            arrive in also depends on ``num_workers``.
        drop_last: every batch has exactly ``batch_size`` windows; the rest of each pool is not
            delivered this epoch (a different rest every epoch).
        channel_first: yield ``(B, 4, 20)`` instead of ``(B, 20, 4)``.
        with_ldt: yield ``(x, ldt)`` with ``ldt`` int64 ``(B, 3)`` = label, device id, unix seconds.
        devices / exclude_devices: keep only / drop these device ids.
        split: ``"train"`` or ``"val"`` to take one side of a seeded split; ``split_by`` is
            ``"device"`` (default: birds stay on one side) or ``"window"`` (per-window, like the
            old 90/10 code); ``val_fraction`` and ``split_seed`` set it.
        shuffle_buffer: windows shuffled together per pool, rounded up to whole chunks (default
            262,144 = 80 MiB of float32 per reader). Larger pools make batches less likely to meet
            again next epoch (docs/training.md#shuffle-quality).
        prefetch: chunks fetched and decoded at once per reader (raise it for object stores).
        transform: optional callable applied to each batch tensor ``x`` in the reader.
        resident: ``False`` (stream), ``"cpu"`` or a torch device (``"cuda"``): hold the
            selection in memory once and draw a full permutation every epoch
            (docs/training.md#resident-mode).
        resident_codes: hold a dict16 store's 16-bit codes (0.5x the memory of float32, decoded
            in each gather); ``False`` holds float32 (faster gathers on the host).
        allow_device_order: stream shuffled batches from a device-ordered store anyway.
        progress: show a progress bar while a resident selection loads.
        world_size / rank: override what torch.distributed or the environment say.
        storage_options: passed to fsspec (credentials are never stored or printed).
        cache_dir / cache_max_bytes: opt-in local disk cache of a remote store's chunks, so later
            epochs read local disk; at the cap it stops admitting chunks (docs/cloud.md).
        reuse_batch_memory: in DataLoader workers, hand batches over through a few reused
            shared-memory slots instead of a fresh segment per batch (Linux). Turn it off if a
            custom ``collate_fn`` must see tensors inside the worker. A ``transform`` keeping
            shape and dtype writes into the slot.
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
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
        prefetch: int = 4,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        resident: bool | str | torch.device = False,
        resident_codes: bool = True,
        allow_device_order: bool = False,
        progress: bool = True,
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
        if shuffle_buffer < 1:
            raise ValueError("shuffle_buffer must be positive")
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
        self.chunk_windows = opened.reader.chunk_windows
        self.pool_chunks = max(1, -(-shuffle_buffer // self.chunk_windows))
        self._layouts = opened.reader.layouts
        self._cache = None
        if cache_dir is not None:
            from birdzarr.storage._cache import cache_for

            self._cache = cache_for(opened, cache_dir, cache_max_bytes)
        self.n_selected = int(self.counts.sum())
        self.resident: Any = None
        if resident is not False and resident is not None:
            from birdzarr.loader._resident import ResidentSelection

            self.resident = ResidentSelection.load(
                opened, self.selection, device=resident, with_ldt=with_ldt, prefetch=self.prefetch,
                progress=progress, codes=resident_codes,
            )
        elif shuffle and not opened.shuffled and not allow_device_order:
            refusal = _device_order_refusal(
                opened.url, self.selection, len(opened.device_table), self.counts, self.pool_chunks,
                batch_size, self.world_size,
            )
            if refusal:
                raise SamplingError(refusal)
        self.epoch = 0
        self._resume_at = 0  # delivered-batch position the next iteration starts from
        self._resume_epoch: int | None = None
        self._resume_workers = 0  # num_workers the resume point was counted with (0: unknown)
        self._yielded = 0
        self._skip_own = 0  # batches this worker already yielded before a StatefulDataLoader resume
        self._restored_here = False  # load_state_dict ran in this worker (StatefulDataLoader)
        # [epoch, resume_at, resume_epoch or -1, resume_workers, num_workers seen] in shared
        # memory: persistent DataLoader workers keep their own copy of the dataset, so set_epoch()
        # in the training process reaches them only through this, and workers report their count.
        self._control = torch.tensor([0, 0, -1, 0, 0], dtype=torch.int64).share_memory_()
        self._per_process: _PerProcess | None = None
        self._plans: dict[int, Any] = {}  # the current epoch's plan, computed once

    # -- sizes and state -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches this rank yields this epoch, the same on every rank.

        Streaming, it can differ by a batch or two between epochs when a subset or a batch size
        that does not divide the chunk size leaves pools of uneven sizes (docs/training.md).
        """
        if self.resident is not None:
            return self._resident_plan().n_batches
        return self.plan().n_batches

    @property
    def windows_per_epoch(self) -> int:
        """Windows this rank yields this epoch."""
        if self.resident is not None:
            return self.resident.rank_windows(self._resident_plan())
        return self.plan().n_windows

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
            published = [self.epoch, self._resume_at, resume_epoch, self._resume_workers]
            self._control[:4] = torch.tensor(published)

    def _follow(self) -> None:
        """In a worker, take the epoch and resume point the training process set last."""
        info = get_worker_info()
        self._control[_NUM_WORKERS] = 1 if info is None else info.num_workers
        if info is None:
            return
        if self._restored_here:  # a worker's own restored state wins for the iteration it resumes
            self._restored_here = False
            return
        epoch, resume_at, resume_epoch, resume_workers, _ = self._control.tolist()
        self.epoch, self._resume_at, self._skip_own = epoch, resume_at, 0
        self._resume_epoch = None if resume_epoch < 0 else resume_epoch
        self._resume_workers = resume_workers
        if self._resume_epoch != self.epoch:
            self._resume_at, self._resume_workers = 0, 0

    def _common_state(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "rank": self.rank,
            "batch_size": self.batch_size,
            "pool_chunks": self.pool_chunks,
            "resident": self.resident is not None,
        }

    def state_dict(self, batches_seen: int | None = None) -> dict[str, Any]:
        """Where the epoch stands. With DataLoader workers, pass the batches the loop consumed
        this epoch (the dataset in the main process does not see workers' progress), or use
        torchdata's ``StatefulDataLoader``, which snapshots each worker's own state."""
        state = self._common_state()
        info = get_worker_info()
        if info is not None and batches_seen is None:
            # inside a worker (StatefulDataLoader): this worker's own progress
            return {
                **state,
                "start": self._resume_at,
                "start_workers": self._resume_workers,
                "worker_yielded": self._yielded,
                "num_workers": info.num_workers,
            }
        seen = self._yielded if batches_seen is None else int(batches_seen)
        workers = int(self._control[_NUM_WORKERS]) or 1
        return {**state, "next_batch": self._resume_at + seen, "num_workers": workers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state['epoch']`` starts at its next batch."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"cannot resume from WindowDataset state version {state.get('version')!r}: this "
                f"birdzarr writes and reads version {_STATE_VERSION}, whose batch order differs. "
                "Restart the epoch (call set_epoch without load_state_dict) or use the birdzarr "
                "version that saved the state."
            )
        for key in ("seed", "world_size", "batch_size", "pool_chunks", "resident"):
            if state[key] != self._common_state()[key]:
                raise ValueError(
                    f"cannot resume: the state was saved with {key}={state[key]!r}, this dataset "
                    f"has {key}={self._common_state()[key]!r}; the order would differ"
                )
        self.epoch = int(state["epoch"])
        self._resume_epoch = self.epoch
        self._yielded = 0
        self._skip_own = 0
        if "worker_yielded" in state:  # a worker's own snapshot, restored into that worker
            self._resume_at, self._skip_own = int(state["start"]), int(state["worker_yielded"])
            self._resume_workers = int(state["start_workers"])
        else:
            self._resume_at = int(state["next_batch"])
            self._resume_workers = int(state["num_workers"])
        self._restored_here = get_worker_info() is not None
        self._publish()

    # -- planning ----------------------------------------------------------------------------------
    def plan(self) -> EpochPlan:
        """This rank's streaming plan of the current epoch (pools and batches)."""
        if self.epoch not in self._plans:
            self._plans = {self.epoch: self._new_plan()}
        return self._plans[self.epoch]

    def _new_plan(self) -> EpochPlan:
        return plan_epoch(
            self.counts,
            seed=self.seed,
            epoch=self.epoch,
            world_size=self.world_size,
            rank=self.rank,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            shuffle=self.shuffle,
            pool_chunks=self.pool_chunks,
        )

    def delivery_order(self, num_workers: int = 0) -> list[int]:
        """Batch numbers in the order a DataLoader with ``num_workers`` workers yields them this
        epoch (``0``: iterating the dataset itself). Resident mode's order ignores workers."""
        if self.resident is not None:
            return list(range(len(self)))
        return self.plan().delivery_order(max(1, num_workers)).tolist()

    def batch_indices(self, batch: int, plan: EpochPlan | None = None) -> np.ndarray:
        """Global window indices of batch number ``batch`` of this rank, in the order its rows
        are delivered (see ``delivery_order`` for which batch arrives when)."""
        if self.resident is not None:
            return self.resident.batch_indices(self._resident_plan(), batch)
        plan = plan or self.plan()
        pool = int(plan.batch_pool[batch])
        pieces, ranks = plan.locate(pool, plan.batch_positions(batch))
        reader = self._chunk_reader()
        out = np.empty(len(pieces), dtype=np.int64)
        for piece in np.unique(pieces).tolist():
            where = np.flatnonzero(pieces == piece)
            chunk = int(plan.pools[pool].chunks[piece])
            out[where] = self.selection.selected_indices(reader, chunk)[ranks[where]]
        return out

    # -- reading -----------------------------------------------------------------------------------
    def _local(self) -> _PerProcess:
        """This process's reader and buffers, opened on first use in each process, so nothing
        (sockets, event loops, threads, buffers) crosses a DataLoader worker's fork."""
        if self._per_process is None or self._per_process.pid != os.getpid():
            location = resolve(self.location.url, self.location.storage_options)
            reader = ChunkReader(location, self._layouts, self.n_windows)
            reader.cache = self._cache
            pool = PoolBuffers(reader, self.selection, with_ldt=self.with_ldt, threads=self.prefetch)
            self._per_process = _PerProcess(os.getpid(), reader, pool)
        return self._per_process

    def _chunk_reader(self) -> ChunkReader:
        return self._local().reader

    def _scratch(self, name: str, size: int) -> np.ndarray:
        """A reused (batch_size, 20, 4) float32 buffer of this process, first ``size`` windows
        (reuse avoids page faults on a fresh temporary every batch)."""
        scratch = self._local().scratch
        if name not in scratch:
            scratch[name] = np.empty((self.batch_size, WINDOW_LENGTH, N_CHANNELS), np.float32)
        return scratch[name][:size]

    def _my_batches(
        self,
        plan_batches: Callable[[int, int], np.ndarray],
        per_worker_counts: Callable[[int], list[int]],
    ) -> np.ndarray:
        """This reader's batch numbers this epoch, after any resume point."""
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        role, skip = worker, 0
        if self._resume_at:
            saved = self._resume_workers or num_workers
            if saved != num_workers:
                raise ValueError(
                    f"cannot resume: the resume point was counted with {saved} DataLoader "
                    f"worker(s), this loader has {num_workers}; batches arrive in an order that "
                    f"depends on num_workers. Resume with num_workers={saved if saved > 1 else 0}."
                )
            role, skip = resumed_worker(per_worker_counts(num_workers), self._resume_at, worker)
        return plan_batches(role, num_workers)[skip + self._skip_own :]

    def __iter__(self) -> Iterator[Batch]:
        self._follow()
        batches = self._streamed() if self.resident is None else self._held()
        self._yielded = self._skip_own
        self._skip_own = 0
        try:
            for assembled in batches:
                self._yielded += 1  # counted before handing over: state_dict() names the next batch
                # a _SharedBatch only in a DataLoader worker, which the transport turns into a Batch
                yield cast(Batch, assembled)
        finally:
            local = self._per_process
            if local is not None and local.slots is not None:  # the receiver may drop its mappings
                local.slots.retire()
        if get_worker_info() is None:  # a finished in-process epoch consumes its resume point
            self._yielded += self._resume_at
            self._resume_at, self._resume_epoch, self._resume_workers = 0, None, 0
            self._publish()

    def _streamed(self) -> Iterator[Batch | _SharedBatch]:
        """This reader's batches of the epoch: its pools, each loaded once, cut into batches.
        Which batches are this reader's is decided now, not when the first one is asked for."""
        plan = self.plan()
        batches = self._my_batches(
            plan.worker_batches, lambda k: [len(plan.worker_batches(w, k)) for w in range(k)]
        )
        pool_buffers = self._local().pool

        def produce() -> Iterator[Batch | _SharedBatch]:
            for pool, in_pool in itertools.groupby(batches.tolist(), key=lambda b: int(plan.batch_pool[b])):
                loaded = pool_buffers.load(plan.pools[pool])
                order = plan.pool_order(pool)
                for batch in in_pool:
                    rows = loaded.rows[plan.batch_positions(batch, order)]
                    yield self._assemble(len(rows), _pool_filler(loaded, rows))

        return produce()

    def _held(self) -> Iterator[Batch | _SharedBatch]:
        """Resident mode: this reader's batches of the epoch's permutation (every k-th)."""
        plan = self._resident_plan()
        n = plan.n_batches
        batches = self._my_batches(
            lambda worker, k: np.arange(worker, n, k), lambda k: [len(range(w, n, k)) for w in range(k)]
        )
        return (self._held_batch(plan, batch) for batch in batches.tolist())

    def _held_batch(self, plan: Any, batch: int) -> Batch | _SharedBatch:
        """One resident batch: gathered into a reused slot on the host, by torch on a device."""
        if self.resident.device.type == "cpu":
            rows = plan.rows(batch).numpy()
            return self._assemble(len(rows), self.resident.filler(rows))
        x, ldt = self.resident.gather(plan, batch, channel_first=self.channel_first)
        if self.transform is not None:
            x = self.transform(x)
        return x if ldt is None else (x, ldt)

    def _resident_plan(self) -> Any:
        """This rank's slice of the epoch's permutation (resident mode), computed once an epoch."""
        key = -1 - self.epoch  # beside the streaming plans, never equal to an epoch number
        if key not in self._plans:
            self._plans = {key: self.resident.plan(
                seed=self.seed, epoch=self.epoch, world_size=self.world_size, rank=self.rank,
                batch_size=self.batch_size, drop_last=self.drop_last, shuffle=self.shuffle,
            )}
        return self._plans[key]

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

    def _assemble(self, size: int, fill: Filler) -> Batch | _SharedBatch:
        """One batch of ``size`` windows into its output memory (a reused slot in a DataLoader
        worker, else a new tensor); ``fill`` writes the channel-last windows and the ldt rows."""
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
        fill(x, ldt)
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
        mode = "streaming" if self.resident is None else f"resident={self.resident.device}"
        return (
            f"WindowDataset({self.location.display!r}, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, rank={self.rank}/"
            f"{self.world_size}, {mode}, windows={self.windows_per_epoch:,}, batches={len(self)})"
        )


Filler = Callable[[np.ndarray, "np.ndarray | None"], None]


def _pool_filler(loaded: LoadedPool, rows: np.ndarray) -> Filler:
    """Gather ``rows`` of a loaded pool: windows with one take, ldt from the pool's arrays."""

    def fill(x: np.ndarray, ldt: np.ndarray | None) -> None:
        # rows index the reader's own pool buffer, so mode="clip" (3x faster than the default,
        # which buffers the output) never clips
        np.take(loaded.gimu, rows, axis=0, out=x, mode="clip")
        if ldt is not None and loaded.ldt is not None:
            ldt[:, 0] = loaded.ldt[LABEL][rows]
            ldt[:, 1] = loaded.ldt[DEVICE][rows]
            ldt[:, 2] = loaded.ldt[TIMESTAMP][rows]

    return fill


def _device_order_refusal(
    url: str, selection: Any, n_devices: int, counts: np.ndarray, pool_chunks: int, batch_size: int,
    world_size: int,
) -> str | None:
    """Why a streamed shuffle of a device-ordered store is refused (None: it mixes well)."""
    if selection.devices is not None:
        n_devices = len(selection.devices)
    chunks = int((counts > 0).sum())
    if n_devices < 2 or pool_chunks * world_size >= chunks:  # one device, or a pool holds it all
        return None
    # a batch drawn from K single-device chunks has a device-mix (TV) ratio of about sqrt(1 + B/K)
    predicted = math.sqrt(1 + batch_size / pool_chunks)
    if predicted <= 1.3:
        return None
    return (
        f"{url} is stored in device order: streamed, each batch would mix only the devices of "
        f"{pool_chunks} chunk(s) of {chunks} ({n_devices} devices; device-mix ratio about "
        f"{predicted:.1f}, 1.0 = a true shuffle). Train on a shuffled store "
        "(`birdzarr convert SRC DEST --shuffle`), or hold the selection in memory with "
        "resident='cpu' or 'cuda', or pass allow_device_order=True to stream it anyway "
        "(docs/training.md#shuffle-quality)."
    )
