"""Copies between a GPU and the host for threads that run beside the engine loop (the reference frontend, the
codec worker).

A plain `.cpu()` or `.to("cuda")` of pageable memory is staged by the CUDA driver through a pinned buffer of its
own, synchronously, and the calling thread spins in the driver until the stream has reached the copy; measured
over HTTP (session 37), the frontend's threads then cost the engine loop ~3.5 ms of host time per AR step, time
that came back when the frontend ran in processes of its own. Here a copy goes through pinned memory from torch's
caching host allocator, asynchronously on the current stream, and the host waits for a device-to-host copy on an
event made with blocking sync: the thread sleeps in the kernel instead of spinning in the driver. The values are
the same bits as `.cpu()` / `.to(device)` give.
"""

from __future__ import annotations

import torch
from torch import Tensor


class PinnedCopy:
    """Device tensors being copied into pinned host memory on the current stream; `wait()` gives them once the
    copy is done (asleep on a blocking-sync event, or spinning in the driver: the sooner back)."""

    def __init__(self, tensors: list[Tensor], sleep: bool = True):
        self.pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for p, t in zip(self.pinned, tensors):
            p.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event(blocking=sleep)
        self.event.record()

    def wait(self) -> list[Tensor]:
        self.event.synchronize()
        return self.pinned


def to_host(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors on the host (ordinary pageable tensors, so the pinned blocks go back to the cache at once);
    those already there are returned as they are."""
    on_device = [t for t in tensors if t.is_cuda]
    if not on_device:
        return tensors
    copied = iter(PinnedCopy(on_device).wait())
    return tuple(next(copied).clone() if t.is_cuda else t for t in tensors)


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """t on `device`, copied from pinned memory on the current stream (which orders it before any later work
    there; the allocator keeps the pinned block until the copy is done)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    if t.is_cuda:
        return t.to(device)  # device to device: no host memory involved
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned.to(device, non_blocking=True)
