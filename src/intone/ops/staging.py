"""A step's host arrays to the device in one transfer.

Each small tensor made from host data costs a transfer of its own (from pageable memory, which
the driver stages synchronously) and an allocation; a step's metadata is some twenty of them.
Here the arrays are packed into one host buffer at 16-byte offsets, copied once, and handed back
as views of the one device buffer. On CUDA the host buffers are pinned and reused, two in turn:
a buffer is refilled only after the copy that read it has finished (its event), so the copy runs
asynchronously and never reads a buffer being rewritten.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

ALIGN = 16  # bytes: every view starts where any dtype may, and as Triton's kernels like (it specializes on 16)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostStaging:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._buffers: list[Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, Tensor]:
        """The arrays (any shapes, fixed-size dtypes) as device tensors of the same dtypes and shapes."""
        arrays = {k: np.ascontiguousarray(a).reshape(np.shape(a)) for k, a in arrays.items()}
        offsets, total = {}, 0
        for key, a in arrays.items():
            offsets[key] = total
            total += _aligned(a.nbytes)
        host = self._host(max(total, ALIGN))
        raw = host.numpy()
        for key, a in arrays.items():
            raw[offsets[key] : offsets[key] + a.nbytes] = a.reshape(-1).view(np.uint8)
        if self.pinned:
            dev = host[:total].to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._copied[self._turn] = event
        else:
            dev = host[:total]  # a fresh buffer each call (`_host`): nothing later rewrites it
        out = {}
        for key, a in arrays.items():
            start = offsets[key]
            piece = dev[start : start + a.nbytes]
            dtype = torch.from_numpy(a.reshape(-1)[:0]).dtype
            out[key] = (piece.view(dtype) if a.nbytes else torch.empty(0, dtype=dtype, device=dev.device)).view(a.shape)
        return out

    def _host(self, nbytes: int) -> Tensor:
        if not self.pinned:
            return torch.empty(nbytes, dtype=torch.uint8)
        self._turn ^= 1
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer (two steps ago) is done
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.shape[0] < nbytes:
            buffer = self._buffers[self._turn] = torch.empty(max(nbytes, 2 * (0 if buffer is None else buffer.shape[0])),
                                                             dtype=torch.uint8, pin_memory=True)
        return buffer
