"""Loading a model: a `--model` value is a checkpoint directory, `tiny:<family>` or `random:<family>`."""

from __future__ import annotations

import json

import torch

from intone.errors import ModelLoadError
from intone.models.base import TTSModel
from intone.models.paths import import_ref, resolve_model_dir

FAMILIES_BY_MODEL_TYPE = {"fish_qwen3_omni": "intone.models.fish_s2:FishS2"}
# Checkpoints without a top-level config.json, recognised by a file of their own.
FAMILIES_BY_MARKER = {"cosyvoice3.yaml": "intone.models.cosyvoice3.model:CosyVoice3"}

RANDOM_FULL_SIZE = {
    "fish-s2": "intone.models.fish_s2.model:random_s2_pro",
    "cosyvoice3": "intone.models.cosyvoice3.model:random_cosyvoice3",
}


def load_model(spec: str, device: str = "cpu", dtype: torch.dtype | None = None,
               codec_dtype: torch.dtype = torch.float32) -> TTSModel:
    """`spec`: a checkpoint directory, `tiny:<family>`, or `random:<family>` (the real-size
    architecture with random weights, for speed measurements only)."""
    if spec.startswith("random:"):
        family = spec[len("random:"):]
        if family not in RANDOM_FULL_SIZE:
            raise ModelLoadError(f"unknown model {spec!r}; random: knows {', '.join(RANDOM_FULL_SIZE)}")
        return import_ref(RANDOM_FULL_SIZE[family])(device=device, dtype=dtype, codec_dtype=codec_dtype)
    model_dir = resolve_model_dir(spec)
    for marker, ref in FAMILIES_BY_MARKER.items():
        if (model_dir / marker).exists():
            return import_ref(ref).load(model_dir, device=device, dtype=dtype, codec_dtype=codec_dtype)
    config = model_dir / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except FileNotFoundError:
        raise ModelLoadError(f"{config}: file not found") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config}: not valid JSON ({e})") from None
    if model_type not in FAMILIES_BY_MODEL_TYPE:
        raise ModelLoadError(f"{config}: unsupported model_type {model_type!r}")
    family = import_ref(FAMILIES_BY_MODEL_TYPE[model_type])
    return family.load(model_dir, device=device, dtype=dtype, codec_dtype=codec_dtype)
