"""Reading a Fun-CosyVoice3 checkpoint directory, strictly.

Layout: cosyvoice3.yaml, llm.pt, flow.pt, hift.pt (pickled state dicts),
CosyVoice-BlankEN/{config.json, tokenizer files, model.safetensors}, campplus.onnx and
speech_tokenizer_v3.onnx. `llm.pt` holds every talker tensor (the BlankEN safetensors are
what it overwrites officially), so the backbone's own weights are not read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from intone.errors import ModelLoadError
from intone.models.checkpoint import load_strict, read_torch_state as read_state
from intone.models.cosyvoice3.codec_config import flow_config, flow_sizes, hift_config
from intone.models.cosyvoice3.config import read_model_yaml, section
from intone.models.cosyvoice3.flow import CosyFlow
from intone.models.cosyvoice3.frontend import ReferenceFrontend
from intone.models.cosyvoice3.hift import CausalHiFT, fold_hift_weight_norm
from intone.models.cosyvoice3.noise import FLOW_NOISE_KEY, HIFT_RAND_INI_KEY, HIFT_SINE_NOISE_KEY, official_noise
from intone.models.cosyvoice3.talker import CosyTalker, QwenShape
from intone.models.cosyvoice3.tokenizer import BLANK_EN, CosyTokenizer


def qwen_shape(model_dir: Path) -> QwenShape:
    path = model_dir / BLANK_EN / "config.json"
    try:
        return QwenShape.from_hf(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: not a Qwen2 config ({e})") from None


def build_strict(make, state: dict[str, Tensor], source: str, dtype: torch.dtype, device) -> nn.Module:
    with torch.device("meta"):
        module = make()
    load_strict(module, state, source, dtype, device)
    return module.eval()


def load_talker(model_dir: Path, cfg: dict, dtype: torch.dtype, device) -> CosyTalker:
    shape = qwen_shape(model_dir)
    llm = section(cfg, "llm")
    talker = build_strict(lambda: CosyTalker(shape, llm.get("speech_token_size", 6561)),
                          read_state(model_dir / "llm.pt"), str(model_dir / "llm.pt"), dtype, device)
    if shape.tie_word_embeddings:  # assign=True loaded the two names as two tensors
        talker.llm.model.lm_head.weight = talker.llm.model.model.embed_tokens.weight
    return talker


def load_cosyvoice3(cls, model_dir: Path, device: torch.device, dtype: torch.dtype, codec_dtype: torch.dtype):
    yaml_path = model_dir / "cosyvoice3.yaml"
    cfg = read_model_yaml(yaml_path)
    tokenizer = CosyTokenizer(model_dir / BLANK_EN)
    talker = load_talker(model_dir, cfg, dtype, device)
    if len(tokenizer) > talker.shape.vocab_size:
        raise ModelLoadError(f"{model_dir / BLANK_EN}: tokenizer has {len(tokenizer)} tokens, "
                             f"more than the embedding's {talker.shape.vocab_size}")
    fcfg, hcfg = flow_config(cfg, yaml_path), hift_config(cfg, yaml_path)
    noise = official_noise(flow_sizes(fcfg), hcfg, include_uv=False)
    flow = load_flow(model_dir / "flow.pt", fcfg, codec_dtype, device)
    hift = load_hift(model_dir / "hift.pt", hcfg, codec_dtype, device)
    install_noise(flow, hift, noise, device)
    frontend = ReferenceFrontend(model_dir).load().to(device)
    return cls(talker, flow, hift, tokenizer, frontend.tokenizer, frontend.speaker_encoder,
               sample_rate=int(cfg.get("sample_rate", 24000)))


def load_flow(path: Path, cfg, dtype: torch.dtype, device):
    return build_strict(lambda: CosyFlow(cfg), read_state(path), str(path), dtype, device)


def load_hift(path: Path, cfg, dtype: torch.dtype, device):
    state = fold_hift_weight_norm(read_state(path), torch.promote_types(dtype, torch.float32))
    with torch.device("meta"):
        placeholder = {HIFT_RAND_INI_KEY: torch.zeros(1, cfg.nb_harmonics + 1),
                       HIFT_SINE_NOISE_KEY: torch.zeros(1, cfg.noise_samples, cfg.nb_harmonics + 1)}
        hift = CausalHiFT(cfg, noise=placeholder)
    # The official F0 predictor runs in float64 (folded in float64 too); the rest in `dtype`.
    load_strict(hift, state, str(path), lambda name: torch.float64 if name.startswith("f0_predictor.") else dtype,
                device)
    return hift.eval()


def install_noise(flow, hift, noise: dict, device) -> None:
    """The official fixed noise (`noise.official_noise`) into modules built on the meta device."""
    flow.decoder.noise_bits = noise[FLOW_NOISE_KEY].view(torch.int32).to(device)
    hift.m_source.l_sin_gen.sine_waves = torch.zeros(0, device=device)  # set_noise installs on the holder's device
    hift.set_noise(noise)
