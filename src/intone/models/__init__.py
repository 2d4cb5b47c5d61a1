"""What any process may ask about a model without loading it (torch-free: the API process asks):
its family, its default profile, its text frontend. Loading one is `models.registry.load_model`."""

from __future__ import annotations

from pathlib import Path

from intone.models.cosyvoice3.text import CosyTextFrontend
from intone.models.cosyvoice3.tokenizer import BLANK_EN, CosyTokenizer
# TINY_MAKERS, cache_dir, make_tiny, resolve_model_dir live in paths (the families use them) and
# stay importable from here.
from intone.models.paths import TINY_MAKERS, cache_dir, make_tiny, resolve_model_dir

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
    """The model's text frontend (`normalize`, `segments`, for the API process), or None: the text goes
    to the model as sent (Fish: the official server speaks text without speaker tags as one prompt).
    CosyVoice3's tokenizer comes from transformers, which loads torch when it is installed."""
    if family_of(spec) != "cosyvoice3":
        return None
    # random: borrows the tiny checkpoint's tokenizer, as its model does
    tokenizer = CosyTokenizer(resolve_model_dir("tiny:cosyvoice3" if spec.startswith("random:") else spec) / BLANK_EN)
    return CosyTextFrontend(lambda text: len(tokenizer.encode(text)))


def default_profile(spec: str) -> str | None:
    return DEFAULT_PROFILES.get(family_of(spec))
