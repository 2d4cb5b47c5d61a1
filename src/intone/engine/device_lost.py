"""Telling a lost GPU context from a failed request."""

from __future__ import annotations


class DeviceLost(RuntimeError):
    """The GPU context is unusable: every later call fails the same way, so the core stops (its
    process exits and the API's supervisor starts a new one) instead of failing each request."""


# CUDA's sticky errors: once one is raised, the context rejects all further work.
_STICKY_CUDA_ERRORS = (
    "illegal memory access", "unspecified launch failure", "illegal instruction", "misaligned address",
    "invalid program counter", "hardware stack error", "device-side assert", "uncorrectable ecc",
    "launch timed out", "operation not supported on global/shared address space",
)


def check_device(error: BaseException | str) -> None:
    """Raise DeviceLost if `error` (an exception or its message) says the device context is gone."""
    text = str(error).lower()
    if "cuda error" in text and any(s in text for s in _STICKY_CUDA_ERRORS):
        cause = error if isinstance(error, BaseException) else None
        raise DeviceLost(f"the GPU context is lost ({str(error).splitlines()[0]}); the engine core stops") from cause
