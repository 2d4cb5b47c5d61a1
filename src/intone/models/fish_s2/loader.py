"""Reading a Fish S2 Pro checkpoint directory, strictly.

Layout: config.json, model.safetensors (or shards + model.safetensors.index.json),
codec.pth, tokenizer.json (+ tokenizer_config.json, special_tokens_map.json).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file
from torch import Tensor

from intone.errors import ModelLoadError
from intone.models.checkpoint import read_torch_state


def read_lm_weights(model_dir: Path) -> tuple[dict[str, Tensor], str]:
    """All LM tensors and a description of where they came from (for error messages)."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: malformed index ({e})") from None
        state = {}
        for shard in sorted(set(weight_map.values())):
            state.update(_load_safetensors(model_dir / shard))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise ModelLoadError(f"{index}: tensor {missing[0]!r} is listed but absent from its shard")
        return state, str(index)
    if single.exists():
        return _load_safetensors(single), str(single)
    raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    if not path.exists():
        raise ModelLoadError(f"{path}: file not found")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises SafetensorError / OSError with terse text
        raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from None


def read_codec_weights(path: Path) -> dict[str, Tensor]:
    """codec.pth: a state dict, possibly under 'state_dict' and/or a 'generator.' prefix."""
    state = read_torch_state(path, unwrap="state_dict")
    if any(k.startswith("generator.") for k in state):
        state = {k[len("generator."):]: v for k, v in state.items() if k.startswith("generator.")}
    return state
