"""Tiny random stand-ins for CosyVoice3's two ONNX frontend models, for tests and `tiny:` models.

Each has the real file's calling convention, so the frontend runs on them unchanged:

- `speech_tokenizer_v3.onnx`: inputs `feats` float32 [B, 128, T] (whisper log-mel) and
  `feats_length` int32 [B]; output `indices` int32 [B, ceil(T / 4)], token ids in [0, 6561).
  Two stride-2 convolutions (kernel 3, padding 1, as in the real encoder, so the token count is
  ceil(ceil(T / 2) / 2)) and an 8-digit base-3 FSQ code (6561 = 3 ** 8).
- `campplus.onnx`: input `input` float32 [B, T, 80] (mean-normalised Kaldi fbank); output
  `output` float32 [B, 192].

Weights are drawn from a private generator, so a seed always gives the same model. Export uses
torch's TorchScript exporter (`dynamo=False`), which needs neither `onnx` nor `onnxscript`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TOKEN_VOCAB = 6561  # 3 ** 8
FSQ_DIGITS = 8
WHISPER_MELS = 128
FBANK_MELS = 80
SPEAKER_DIM = 192
OPSET = 17

SPEECH_TOKENIZER_INPUTS = ("feats", "feats_length")
SPEECH_TOKENIZER_OUTPUTS = ("indices",)
CAMPPLUS_INPUTS = ("input",)
CAMPPLUS_OUTPUTS = ("output",)


def _fill(module: nn.Module, seed: int, scale: float) -> nn.Module:
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) * (scale / fan_in**0.5))
    return module.eval()


class TinySpeechTokenizer(nn.Module):
    """[B, 128, T] log-mel (+ valid lengths) -> [B, ceil(T / 4)] int32 ids in [0, 6561)."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.conv1 = nn.Conv1d(WHISPER_MELS, hidden, kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(hidden, hidden, kernel_size=3, stride=2, padding=1)
        self.project = nn.Linear(hidden, FSQ_DIGITS)
        self.register_buffer("place", torch.tensor([3.0**k for k in range(FSQ_DIGITS)]), persistent=False)

    def forward(self, feats: Tensor, feats_length: Tensor) -> Tensor:
        frames = torch.arange(feats.shape[-1], device=feats.device)
        valid = (frames[None, :] < feats_length.to(torch.int64)[:, None]).to(feats.dtype)
        h = F.gelu(self.conv1(feats * valid[:, None, :]))
        h = F.gelu(self.conv2(h))
        digits = torch.round(torch.tanh(self.project(h.transpose(1, 2))) * 0.999) + 1.0  # each in {0, 1, 2}
        return (digits * self.place).sum(-1).to(torch.int32)


class TinyCampPlus(nn.Module):
    """[B, T, 80] fbank -> [B, 192] speaker embedding (mean and max pooling over time)."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.frame = nn.Linear(FBANK_MELS, hidden)
        self.embed = nn.Linear(2 * hidden, SPEAKER_DIM)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.frame(x))
        return self.embed(torch.cat([h.mean(dim=1), h.amax(dim=1)], dim=-1))


def tiny_speech_tokenizer(seed: int = 0) -> TinySpeechTokenizer:
    """The torch module `export_tiny_speech_tokenizer(path, seed)` writes."""
    return _fill(TinySpeechTokenizer(), seed, scale=2.0)


def tiny_campplus(seed: int = 0) -> TinyCampPlus:
    """The torch module `export_tiny_campplus(path, seed)` writes."""
    return _fill(TinyCampPlus(), seed + 1, scale=1.0)


def _export(module: nn.Module, args: tuple, path: str | Path, inputs, outputs, axes: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter announces its deprecation
        torch.onnx.export(module, args, str(path), input_names=list(inputs), output_names=list(outputs),
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    return path


def export_tiny_speech_tokenizer(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny `speech_tokenizer_v3.onnx` look-alike (about 70 KB) to `path`; returns the path."""
    feats = torch.zeros(1, WHISPER_MELS, 40)
    length = torch.tensor([40], dtype=torch.int32)
    axes = {"feats": {0: "batch", 2: "frames"}, "feats_length": {0: "batch"}, "indices": {0: "batch", 1: "tokens"}}
    return _export(tiny_speech_tokenizer(seed), (feats, length), path, SPEECH_TOKENIZER_INPUTS,
                   SPEECH_TOKENIZER_OUTPUTS, axes)


def export_tiny_campplus(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny `campplus.onnx` look-alike (about 35 KB) to `path`; returns the path."""
    axes = {"input": {0: "batch", 1: "frames"}, "output": {0: "batch"}}
    return _export(tiny_campplus(seed), (torch.zeros(1, 50, FBANK_MELS),), path, CAMPPLUS_INPUTS,
                   CAMPPLUS_OUTPUTS, axes)
