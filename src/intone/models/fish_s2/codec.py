"""The 44.1 kHz modded-DAC codec of Fish S2 Pro: codes <-> audio.

Module names mirror the official `codec.pth` state dict (535 tensors at full size).
The decoder path is quantizer lookup -> windowed causal transformer (`post_module`) ->
2 x (causal transposed conv + ConvNeXt) -> causal conv decoder, 2048 samples per frame.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import Tensor, nn

from intone.models.fish_s2.codec_modules import (
    CODEC_HEAD_DIM,
    CODEC_NORM_EPS,
    CODEC_ROPE_BASE,
    CausalConv,
    CausalTransConv,
    ConvNeXtBlock,
    ResidualQuantizer,
    ResidualUnit,
    Snake,
    WindowTransformer,
)
from intone.models.fish_s2.encoder_tc import encode_tc

SAMPLE_RATE = 44100


@dataclass(frozen=True)
class CodecConfig:
    """Defaults are the official `modded_dac_vq.yaml`."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    encoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 4)
    encoder_window: int = 512
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    downsample_factor: tuple[int, ...] = (2, 2)
    n_codebooks: int = 9  # residual codebooks; the semantic one is extra
    codebook_size: int = 1024
    semantic_codebook_size: int = 4096
    codebook_dim: int = 8
    quantizer_layers: int = 8  # pre_module and post_module
    quantizer_window: int = 128
    # what tensor shapes cannot tell: from the checkpoint's `modded_dac_vq.yaml` when it ships one
    head_dim: int = CODEC_HEAD_DIM
    rope_base: float = CODEC_ROPE_BASE
    norm_eps: float = CODEC_NORM_EPS
    sample_rate: int = SAMPLE_RATE

    @property
    def latent_dim(self) -> int:
        return self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def hop_length(self) -> int:
        """Samples per code frame: encoder strides times the quantizer's downsampling."""
        return math.prod(self.encoder_rates) * math.prod(self.downsample_factor)

    @property
    def num_codebooks(self) -> int:
        return 1 + self.n_codebooks


def receptive_field_frames(cfg: CodecConfig) -> int:
    """Left context (in frames) after which decoding a window reproduces the one-pass decode.

    The windowed transformer sees `window - 1` earlier frames per layer, so its layers chain
    to layers * (window - 1) frames (8 * 127 = 1016 at full size). The causal convolutions
    after it look back 9.2 frames in all (ConvNeXt k7 at 2x and 4x the frame rate, the k7
    input conv, one input sample per transposed conv, 78 samples per stack of dilated
    residual units at each rate), which rounds up to 10: 1026 frames (~47.6 s) in all.
    With less context the first samples of a window differ from the one-pass decode.
    """
    lookback = 0.0  # in frames
    rate = 1
    for f in reversed(cfg.downsample_factor):  # k = stride transposed conv: no overlap
        rate *= f
        lookback += 6 / rate  # ConvNeXt depthwise k7
    lookback += 6 / rate  # decoder input conv, k7
    for stride in cfg.decoder_rates:
        lookback += 1 / rate  # transposed conv k = 2 * stride reaches one input sample back
        rate *= stride
        lookback += (6 + 18 + 54) / rate  # residual units: k7 at dilations 1, 3, 9
    lookback += 6 / rate  # output conv, k7
    return cfg.quantizer_layers * (cfg.quantizer_window - 1) + math.ceil(lookback)


class Encoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        d = cfg.encoder_dim
        blocks: list[nn.Module] = [CausalConv(1, d, 7)]
        for stride, n_layers in zip(cfg.encoder_rates, cfg.encoder_transformer_layers):
            d *= 2
            blocks.append(EncoderBlock(d, stride, n_layers, cfg))
        blocks += [Snake(d), CausalConv(d, cfg.latent_dim, 3)]
        self.block = nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)


def _transformer(dim: int, n_layers: int, window: int, cfg: CodecConfig) -> WindowTransformer:
    return WindowTransformer(dim, n_layers, window, head_dim=cfg.head_dim, rope_base=cfg.rope_base,
                             norm_eps=cfg.norm_eps)


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int, n_layers: int, cfg: CodecConfig):
        super().__init__()
        half = dim // 2
        self.block = nn.Sequential(
            ResidualUnit(half, 1), ResidualUnit(half, 3), ResidualUnit(half, 9), Snake(half),
            CausalConv(half, dim, 2 * stride, stride=stride),
            _transformer(dim, n_layers, cfg.encoder_window, cfg) if n_layers else nn.Identity(),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)


class DecoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake(c_in), CausalTransConv(c_in, c_out, 2 * stride, stride),
            ResidualUnit(c_out, 1), ResidualUnit(c_out, 3), ResidualUnit(c_out, 9),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)


class Decoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        ch = cfg.decoder_dim
        layers: list[nn.Module] = [CausalConv(cfg.latent_dim, ch, 7)]
        for i, stride in enumerate(cfg.decoder_rates):
            layers.append(DecoderBlock(ch // 2**i, ch // 2 ** (i + 1), stride))
        out = ch // 2 ** len(cfg.decoder_rates)
        layers += [Snake(out), CausalConv(out, 1, 7), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, z: Tensor) -> Tensor:
        return self.model(z)


class Quantizer(nn.Module):
    """Semantic VQ + residual VQ at the frame rate, with transformer and resampling around them."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        dim = cfg.latent_dim
        self.semantic_quantizer = ResidualQuantizer(dim, 1, cfg.semantic_codebook_size, cfg.codebook_dim)
        self.quantizer = ResidualQuantizer(dim, cfg.n_codebooks, cfg.codebook_size, cfg.codebook_dim)
        self.downsample = nn.Sequential(
            *(nn.Sequential(CausalConv(dim, dim, f, stride=f), ConvNeXtBlock(dim)) for f in cfg.downsample_factor)
        )
        self.upsample = nn.Sequential(
            *(nn.Sequential(CausalTransConv(dim, dim, f, f), ConvNeXtBlock(dim)) for f in reversed(cfg.downsample_factor))
        )
        self.pre_module = _transformer(dim, cfg.quantizer_layers, cfg.quantizer_window, cfg)
        self.post_module = _transformer(dim, cfg.quantizer_layers, cfg.quantizer_window, cfg)

    def encode(self, z: Tensor) -> Tensor:
        z = self.pre_module(self.downsample(z))
        semantic_z, semantic_codes = self.semantic_quantizer.quantize(z)
        _, residual_codes = self.quantizer.quantize(z - semantic_z)
        return torch.cat([semantic_codes, residual_codes], dim=1)

    def decode(self, codes: Tensor, position_offset: int | Tensor = 0) -> Tensor:
        # The LM samples residual codes over 4096 values; the codec clamps them (official behaviour).
        semantic = codes[:, :1].clamp(max=self.semantic_quantizer.codebook_size - 1)
        residual = codes[:, 1:].clamp(max=self.quantizer.codebook_size - 1)
        z = self.semantic_quantizer.lookup(semantic) + self.quantizer.lookup(residual)
        return self.upsample(self.post_module(z, position_offset))


class FishCodec(nn.Module):
    def __init__(self, cfg: CodecConfig = CodecConfig()):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = Quantizer(cfg)
        self.decoder = Decoder(cfg)
        self.encoder_layout = "channels_first"  # or "time_major" (`encoder_tc`; fish_s2.encoder_layout)

    @property
    def sample_rate(self) -> int:
        return self.cfg.sample_rate

    @property
    def hop_length(self) -> int:
        return self.cfg.hop_length

    @torch.inference_mode()
    def decode(self, codes: Tensor, position_offset: int | Tensor = 0) -> Tensor:
        """codes [B, K, T] (int) -> audio [B, T * hop] (float, in [-1, 1]).

        position_offset: absolute frame index of codes[..., 0], for the batch or per row [B]
        (see WindowTransformer).
        """
        z = self.quantizer.decode(codes.long(), position_offset)
        return self.decoder(z.to(self.dtype)).squeeze(1)

    @torch.inference_mode()
    def encode(self, audio: Tensor) -> Tensor:
        """audio [B, N] at the codec rate -> codes [B, K, ceil(N / hop)]; right-pads with silence."""
        n = audio.shape[-1]
        pad = math.ceil(n / self.hop_length) * self.hop_length - n
        x = torch.nn.functional.pad(audio.to(self.dtype), (0, pad)).unsqueeze(1)
        z = encode_tc(self.encoder, x) if self.encoder_layout == "time_major" else self.encoder(x)
        return self.quantizer.encode(z)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.model[0].conv.weight.dtype


# ---- checkpoint key forms -------------------------------------------------------------------

_PARAM_G = ".parametrizations.weight.original0"
_PARAM_V = ".parametrizations.weight.original1"


def fold_weight_norm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Both weight-norm key forms -> plain `.weight` (w = g * v / ||v||, norm over all but dim 0)."""
    out, pairs = {}, {}
    for key, value in state.items():
        for g_suffix, v_suffix in ((_PARAM_G, _PARAM_V), (".weight_g", ".weight_v")):
            if key.endswith(g_suffix) or key.endswith(v_suffix):
                base = key[: -len(g_suffix if key.endswith(g_suffix) else v_suffix)]
                pairs.setdefault(base, {})["g" if key.endswith(g_suffix) else "v"] = value
                break
        else:
            out[key] = value
    for base, gv in pairs.items():
        if set(gv) != {"g", "v"}:
            missing = "g" if "g" not in gv else "v"
            raise KeyError(f"{base}: weight-norm {missing} tensor is missing")
        out[base + ".weight"] = torch._weight_norm(gv["v"], gv["g"], 0)
    return out


def unfold_weight_norm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Plain weights -> the official on-disk forms: parametrizations in the causal conv
    stacks (torch.nn.utils.parametrizations), weight_g/weight_v in the VQ projections (DAC)."""
    out = {}
    for key, value in state.items():
        base = key[: -len(".weight")]
        norm = value.flatten(1).norm(dim=1).view(-1, *([1] * (value.dim() - 1))) if value.dim() == 3 else None
        if re.match(r"(encoder|decoder)\..*\.conv\.weight$", key):
            out[base + _PARAM_G], out[base + _PARAM_V] = norm, value
        elif re.search(r"\.(in|out)_proj\.weight$", key):
            out[base + ".weight_g"], out[base + ".weight_v"] = norm, value
        else:
            out[key] = value
    return out


def config_from_state(state: dict[str, Tensor]) -> CodecConfig:
    """Infer the codec's sizes from its (folded) tensors; windows and head size are the official
    config's (`with_config_file` reads them from a checkpoint's own)."""

    def count(pattern: str) -> int:
        found = {int(m.group(1)) for k in state if (m := re.match(pattern, k))}
        return max(found) + 1 if found else 0

    enc0 = state["encoder.block.0.conv.weight"]
    dec0 = state["decoder.model.0.conv.weight"]
    n_enc = count(r"encoder\.block\.(\d+)\.block\.0\.") - 1  # blocks 1..n_enc
    enc_rates, enc_layers = [], []
    for i in range(1, n_enc + 1):
        enc_rates.append(state[f"encoder.block.{i}.block.4.conv.weight"].shape[-1] // 2)
        enc_layers.append(count(rf"encoder\.block\.{i}\.block\.5\.layers\.(\d+)\."))
    n_dec = count(r"decoder\.model\.(\d+)\.block\.0\.alpha")  # blocks 1..n_dec-1
    dec_rates = [state[f"decoder.model.{i}.block.1.conv.weight"].shape[-1] // 2 for i in range(1, n_dec)]
    down = [state[f"quantizer.downsample.{i}.0.conv.weight"].shape[-1] for i in range(count(r"quantizer\.downsample\.(\d+)\."))]
    return CodecConfig(
        encoder_dim=enc0.shape[0],
        encoder_rates=tuple(enc_rates),
        encoder_transformer_layers=tuple(enc_layers),
        decoder_dim=dec0.shape[0],
        decoder_rates=tuple(dec_rates),
        downsample_factor=tuple(down),
        n_codebooks=count(r"quantizer\.quantizer\.quantizers\.(\d+)\."),
        codebook_size=state["quantizer.quantizer.quantizers.0.codebook.weight"].shape[0],
        semantic_codebook_size=state["quantizer.semantic_quantizer.quantizers.0.codebook.weight"].shape[0],
        codebook_dim=state["quantizer.semantic_quantizer.quantizers.0.codebook.weight"].shape[1],
        quantizer_layers=count(r"quantizer\.post_module\.layers\.(\d+)\."),
    )


CONFIG_FILE = "modded_dac_vq.yaml"  # the official codec config's name


def with_config_file(cfg: CodecConfig, path: Path) -> CodecConfig:
    """`cfg` with the transformer settings of the official codec config at `path` (its quantizer's
    `post_module`: window_size and config.head_dim / rope_base / norm_eps; `pre_module` is the same
    YAML anchor). Its `transformer_general_config` (the encoder's) must agree on them: one set serves both."""
    doc = yaml.safe_load(path.read_text()) or {}
    post = (doc.get("quantizer") or {}).get("post_module") or {}
    block = post.get("config") or {}
    found = dict(quantizer_window=post.get("window_size"), head_dim=block.get("head_dim"),
                 rope_base=block.get("rope_base"), norm_eps=block.get("norm_eps"))
    found = {k: type(getattr(cfg, k))(v) for k, v in found.items() if v is not None}
    general = doc.get("transformer_general_config") or {}
    for key in ("head_dim", "rope_base", "norm_eps"):
        if key in general and key in found and float(general[key]) != float(found[key]):
            raise ValueError(f"{path}: transformer_general_config.{key} {general[key]} differs from the quantizer's "
                             f"{found[key]}; the codec takes one value for both")
    return dataclasses.replace(cfg, **found)
