"""Model registry: a `--model` value is a checkpoint directory or `tiny:<family>`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from intone.errors import ModelLoadError
from intone.models.base import TTSModel
from intone.models.cosyvoice3.prompt import BLANK_EN, CosyTokenizer
from intone.models.cosyvoice3.text import CosyTextFrontend
# TINY_MAKERS, cache_dir, make_tiny, resolve_model_dir live in paths (the families use them) and
# stay importable from here.
from intone.models.paths import TINY_MAKERS, cache_dir, import_ref, make_tiny, resolve_model_dir

FAMILIES_BY_MODEL_TYPE = {"fish_qwen3_omni": "intone.models.fish_s2:FishS2"}
# Checkpoints without a top-level config.json, recognised by a file of their own.
FAMILIES_BY_MARKER = {"cosyvoice3.yaml": "intone.models.cosyvoice3.model:CosyVoice3"}


# The profile a model family runs with when none is named (None: the built-in defaults).
DEFAULT_PROFILES = {"cosyvoice3": "cosyvoice3-streaming"}


def family_of(spec: str) -> str:
    """`tiny:X` / `random:X` -> X; a checkpoint directory -> the family its files show."""
    for prefix in ("tiny:", "random:"):
        if spec.startswith(prefix):
            return spec[len(prefix):]
    if (Path(spec) / "cosyvoice3.yaml").exists():
        return "cosyvoice3"
    return "fish-s2"


def text_frontend(spec: str):
    """The model's text frontend (`normalize`, `segments`; torch-free, for the API process), or None:
    the text goes to the model as sent (Fish: the official server speaks text without speaker tags
    as one prompt)."""
    if family_of(spec) != "cosyvoice3":
        return None
    # random: borrows the tiny checkpoint's tokenizer, as its model does
    tokenizer = CosyTokenizer(resolve_model_dir("tiny:cosyvoice3" if spec.startswith("random:") else spec) / BLANK_EN)
    return CosyTextFrontend(lambda text: len(tokenizer.encode(text)))


def default_profile(spec: str) -> str | None:
    return DEFAULT_PROFILES.get(family_of(spec))


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
