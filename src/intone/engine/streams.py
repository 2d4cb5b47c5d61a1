"""CUDA streams that belong to one long-lived role each (the engine loop, the codec worker, a frontend
worker, a set of captured graphs).

`torch.cuda.Stream()` hands out the streams of a fixed pool round-robin (32 per device and priority), so
after 32 draws it hands out one that an earlier caller still runs on. Start-up's graph captures each
draw one for their warm-up run, so a stream drawn after them may be the engine loop's or the codec's:
session 34's GPU timeline found the frontend workers' kernels on those two streams (each role then
waits for the other's kernels), and two graph sets captured on one stream would share its cuBLAS
workspace (`cuda_graphs.capture_graph`). `own_stream` skips the streams a live role holds.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import torch
from torch.cuda import green_contexts

POOL_STREAMS = 32  # torch's pool: streams per device and priority, handed out round-robin

_held: dict[int, str] = {}  # a held stream's handle -> its role
_lock = threading.RLock()  # re-entrant: a collection inside `own_stream` may run `_release` on this thread


def own_stream(device: torch.device | str | int | None, role: str, priority: int = 0,
               draw: Callable[..., torch.cuda.Stream] | None = None) -> torch.cuda.Stream:
    """A stream from the pool that no other live role holds, held for `role` until the returned object
    is collected (keep it as long as the role runs on it). draw: the pool (torch.cuda.Stream)."""
    draw = draw or torch.cuda.Stream
    for attempt in range(2):
        with _lock:
            for _ in range(POOL_STREAMS):
                stream = draw(device, priority=priority)
                handle = stream.cuda_stream
                if handle not in _held:
                    _held[handle] = role
                    weakref.finalize(stream, _release, handle)
                    return stream
        if attempt == 0:
            gc.collect()  # roles gone but not yet collected (an engine's reference cycles) give theirs back
    held = held_roles()
    raise RuntimeError(f"no CUDA stream of priority {priority} left for the {role}: every stream of torch's pool "
                       f"is held ({len(held)} in all, by {', '.join(sorted(set(held.values())))})")


def held_roles() -> dict[int, str]:
    """The streams held now: handle -> role."""
    with _lock:
        return dict(_held)


def _release(handle: int) -> None:
    with _lock:
        _held.pop(handle, None)


def sm_share(device: torch.device, sms: int, field: str):
    """A green context of `sms` of the GPU's SMs (its `.Stream()`s run there): a role whose long kernels run
    there never holds every SM, so the engine loop's small ones (unpartitioned) always find some free. Stream
    priorities cannot give that: a running block is never preempted (session 8). Keep the context as long
    as its streams run. field: the profile's name for `sms`, in errors."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    # SM groups come in multiples of 8 on Hopper (CUDA rounds a request up to them).
    granule = 8 if props.major >= 9 else 2
    if not 0 < sms < props.multi_processor_count or sms % granule:
        raise ValueError(f"{field} must be a multiple of {granule} below the GPU's {props.multi_processor_count} "
                         f"SMs, got {sms}")
    if not getattr(green_contexts, "SUPPORTED", True):
        raise RuntimeError(f"{field} needs CUDA green contexts; torch {torch.__version__} was built without them")
    try:
        return green_contexts.GreenContext.create(num_sms=sms, device_id=index)
    except (RuntimeError, TypeError, AttributeError) as e:
        raise RuntimeError(f"{field}: no green context of {sms} SMs on this GPU and torch: {e}") from e
