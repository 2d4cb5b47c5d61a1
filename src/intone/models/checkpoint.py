"""Strict checkpoint reading shared by the model families."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from intone.errors import ModelLoadError


def read_torch_state(path: Path, unwrap: str | None = None) -> dict[str, Tensor]:
    """A pickled state dict (weights only, memory-mapped); `unwrap`: a key it may be nested under."""
    if not path.exists():
        raise ModelLoadError(f"{path}: file not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot read torch checkpoint ({e})") from None
    if unwrap and isinstance(state, dict) and unwrap in state:
        state = state[unwrap]
    if not isinstance(state, dict):
        raise ModelLoadError(f"{path}: expected a state dict, got {type(state).__name__}")
    return state


def load_strict(module: nn.Module, state: dict[str, Tensor], source: str, dtype, device) -> None:
    """Assign every tensor; name the first missing, unexpected or mis-shaped one on failure.

    dtype: one dtype for all tensors, or a function of the tensor name giving it.
    """
    expected = module.state_dict(keep_vars=True)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise ModelLoadError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise ModelLoadError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    for name, param in expected.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(state[name].shape)}, expected {tuple(param.shape)}"
            )
    dtype_of = dtype if callable(dtype) else (lambda name: dtype)
    module.load_state_dict({k: v.to(device=device, dtype=dtype_of(k)) for k, v in state.items()},
                           strict=True, assign=True)
