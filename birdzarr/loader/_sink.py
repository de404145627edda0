"""Where a batch is gathered to: one sink per output path.

A batch source (a loaded pool, or the host-resident selection) hands a sink a ``Filler``: a
function that writes the batch's channel-last windows into an ``x`` array and, with ``ldt``, its
(label, device, unix seconds) rows. The sink owns the output memory:

* ``TensorSink``: new tensors. In the training process plain ones; in a DataLoader worker that
  does not reuse batch memory, tensors straight in a new shared segment (as ``default_collate``
  does there), so handing them over sends a handle instead of a copy.
* ``SlotSink``: a DataLoader worker's few reusable shared-memory slots (``_handoff``); the batch
  travels as a ``SharedBatch``, which the training process turns back into tensors on the slot.

Both gather with one vectorised take straight into the output (channel-first batches go through
one reused channel-last scratch buffer and a transposing copy). A resident selection on a GPU
gathers with torch where it lies (``device_batch``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import DupFd
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from birdzarr.format._spec import N_CHANNELS, WINDOW_LENGTH
from birdzarr.loader import _handoff
from birdzarr.loader._config import LdtTransform, Transform

if TYPE_CHECKING:
    from birdzarr.loader._resident import ResidentPlan, ResidentSelection

Batch = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
Filler = Callable[[np.ndarray, "np.ndarray | None"], None]

_X_BYTES = WINDOW_LENGTH * N_CHANNELS * 4  # one float32 window
_LDT_BYTES = 3 * 8  # one int64 (label, device, unix seconds) row
_FREE_SLOTS = 4  # reusable batch slots a worker keeps when they are free


def new_batch(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
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


class SharedBatch:
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


@dataclass(frozen=True)
class BatchLayout:
    """What a batch looks like: at most ``batch_size`` windows, their axes, and ``ldt`` or not."""

    batch_size: int
    channel_first: bool
    with_ldt: bool

    def x_shape(self, size: int) -> tuple[int, int, int]:
        return (size, N_CHANNELS, WINDOW_LENGTH) if self.channel_first else (size, WINDOW_LENGTH, N_CHANNELS)


def apply_transform(transform: Transform | LdtTransform, transform_ldt: bool, x: torch.Tensor,
                    ldt: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``transform(x)``, or with ``transform_ldt`` ``transform(x, ldt)``, checked: the result must
    be a tensor, or a tuple ``(x, ldt)`` of two tensors (in a worker a batch travels as tensors;
    in this process anything else would reach the training loop only there)."""
    if not transform_ldt:
        result = cast(Transform, transform)(x)
        if not isinstance(result, torch.Tensor):
            raise TypeError(f"transform must return a torch.Tensor, got {type(result).__name__}")
        return result, ldt
    assert ldt is not None
    pair = cast(LdtTransform, transform)(x, ldt)
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair)):
        got = (f"tuple of ({', '.join(type(t).__name__ for t in pair)})" if isinstance(pair, tuple)
               else type(pair).__name__)
        raise TypeError(f"transform (transform_ldt=True) must return a tuple (x, ldt) of two "
                        f"torch.Tensors, got {got}")
    return pair[0], pair[1]


class _Sink:
    def __init__(self, layout: BatchLayout, transform: Transform | LdtTransform | None,
                 transform_ldt: bool = False) -> None:
        self.layout = layout
        self.transform = transform
        self.transform_ldt = transform_ldt
        self._channel_last: np.ndarray | None = None  # reused: a fresh temporary page-faults every batch

    def _fill(self, out: np.ndarray, ldt: np.ndarray | None, fill: Filler) -> None:
        """Write the batch into ``out`` in the layout's axis order (and ``ldt``)."""
        if not self.layout.channel_first:
            fill(out, ldt)
            return
        if self._channel_last is None:
            self._channel_last = np.empty((self.layout.batch_size, WINDOW_LENGTH, N_CHANNELS), np.float32)
        x = self._channel_last[: len(out)]
        fill(x, ldt)
        out[:] = x.transpose(0, 2, 1)

    def _transformed(self, x: torch.Tensor, ldt: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.transform is not None
        return apply_transform(self.transform, self.transform_ldt, x, ldt)

    def end_iteration(self) -> None:
        """An iteration is over (finished or abandoned)."""


class TensorSink(_Sink):
    """Each batch in new tensors (in shared memory when ``shared``: inside a DataLoader worker)."""

    def __init__(self, layout: BatchLayout, transform: Transform | LdtTransform | None, *, shared: bool,
                 transform_ldt: bool = False) -> None:
        super().__init__(layout, transform, transform_ldt)
        self.shared = shared

    def __call__(self, size: int, fill: Filler) -> Batch:
        tensor = new_batch(self.layout.x_shape(size), torch.float32, self.shared)
        ldt = new_batch((size, 3), torch.int64, self.shared) if self.layout.with_ldt else None
        self._fill(tensor.numpy(), None if ldt is None else ldt.numpy(), fill)
        if self.transform is not None:
            tensor, ldt = self._transformed(tensor, ldt)
        return tensor if ldt is None else (tensor, ldt)


class SlotSink(_Sink):
    """A DataLoader worker's batches in its reused shared-memory slots (Linux)."""

    def __init__(self, layout: BatchLayout, transform: Transform | LdtTransform | None,
                 transform_ldt: bool = False) -> None:
        super().__init__(layout, transform, transform_ldt)
        per_window = _X_BYTES + (_LDT_BYTES if layout.with_ldt else 0)
        self.slots = _handoff.SlotRing(layout.batch_size * per_window, keep=_FREE_SLOTS)
        self._ldt_offset = layout.batch_size * _X_BYTES

    def __call__(self, size: int, fill: Filler) -> Batch | SharedBatch:
        slot = self.slots.acquire()
        shape = self.layout.x_shape(size)
        out = slot.data[: size * _X_BYTES].view(np.float32).reshape(shape)
        ldt = None
        if self.layout.with_ldt:
            at = self._ldt_offset
            ldt = slot.data[at : at + size * _LDT_BYTES].view(np.int64).reshape(size, 3)
        self._fill(out, ldt, fill)
        if self.transform is not None:
            held = [torch.from_numpy(out)] + ([] if ldt is None else [torch.from_numpy(ldt)])
            x, new_ldt = self._transformed(held[0], None if ldt is None else held[1])
            results = [x] + ([] if new_ldt is None else [new_ldt])
            if any(r.shape != h.shape or r.dtype != h.dtype for r, h in zip(results, held, strict=True)):
                # another shape or dtype: torch's own transport (copies: the slot is reused)
                x, copied = x.clone(), None if new_ldt is None else new_ldt.clone()
                return x if copied is None else (x, copied)
            for result, slot_part in zip(results, held, strict=True):
                if result.data_ptr() != slot_part.data_ptr():
                    slot_part.copy_(result)
                elif result.stride() != slot_part.stride():  # a rearranged view of the slot itself
                    slot_part.copy_(result.clone())
        slot.lease()
        fields: list[tuple[str, tuple[int, ...], int]] = [("float32", shape, 0)]
        if self.layout.with_ldt:
            fields.append(("int64", (size, 3), self._ldt_offset))
        return SharedBatch(slot, fields)

    def end_iteration(self) -> None:
        self.slots.end_iteration()  # kept for this worker's next iteration (a persistent worker)


Sink = TensorSink | SlotSink


def make_sink(
    layout: BatchLayout, transform: Transform | LdtTransform | None, *, in_worker: bool, reuse_slots: bool,
    transform_ldt: bool = False,
) -> Sink:
    """The sink of one process: reused slots in a worker where allowed and possible, else tensors."""
    if in_worker and reuse_slots and _handoff.AVAILABLE:
        return SlotSink(layout, transform, transform_ldt)
    return TensorSink(layout, transform, shared=in_worker, transform_ldt=transform_ldt)


def device_batch(resident: ResidentSelection, plan: ResidentPlan, batch: int, channel_first: bool,
                 transform: Transform | LdtTransform | None, transform_ldt: bool = False) -> Batch:
    """One batch of a selection held on a GPU, gathered there by torch."""
    x, ldt = resident.gather(plan, batch, channel_first=channel_first)
    if transform is not None:
        x, ldt = apply_transform(transform, transform_ldt, x, ldt)
    return x if ldt is None else (x, ldt)
