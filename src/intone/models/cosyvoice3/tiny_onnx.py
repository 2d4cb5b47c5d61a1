"""Tiny random CosyVoice3 frontend files in the real architectures, for tests and `tiny:` models.

Each is the torch port of the real network at small sizes, exported the way the official files
were (TorchScript exporter, eval mode), so it has the real file's inputs, outputs, op structure
and initializer naming, and the frontend reads it with the same code as the real file:

- `speech_tokenizer_v3.onnx`: S3Tokenizer v3 with width 128 (2 heads of 64), 2 blocks, MLP 256;
  inputs `feats` float32 [B, 128, T] and `feats_length` int32 [B]; output `indices` int32
  [B, ceil(T / 4)], ids in [0, 6561).
- `campplus.onnx`: CAM++ with a 8-channel head, 32 TDNN channels, growth 8, dense blocks of
  2 / 3 / 2 layers; input `input` float32 [B, T, 80]; output `output` float32 [B, 192].

Weights are drawn from a private generator, so a seed always gives the same file.
"""

from __future__ import annotations

from pathlib import Path

from intone.models.cosyvoice3.campplus_net import CamPPlusNet, CamShape, export_campplus, random_campplus
from intone.models.cosyvoice3.speech_tokenizer_net import (
    SpeechTokenizerNet,
    TokenizerShape,
    export_speech_tokenizer,
    random_speech_tokenizer,
)

TOKEN_VOCAB = 6561  # 3 ** 8
SPEAKER_DIM = 192
TINY_TOKENIZER = TokenizerShape(dim=128, layers=2, mlp=256)
TINY_CAMPPLUS = CamShape(head_channels=8, channels=32, growth=8, bottleneck=16,
                         blocks=((2, 3, 1), (3, 3, 2), (2, 3, 2)))


def tiny_speech_tokenizer(seed: int = 0) -> SpeechTokenizerNet:
    """The torch module `export_tiny_speech_tokenizer(path, seed)` writes."""
    return random_speech_tokenizer(TINY_TOKENIZER, seed=seed)


def tiny_campplus(seed: int = 0) -> CamPPlusNet:
    """The torch module (trained form, BatchNorms separate) `export_tiny_campplus(path, seed)` writes."""
    return random_campplus(TINY_CAMPPLUS, seed=seed + 1, folded=False)


def export_tiny_speech_tokenizer(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny `speech_tokenizer_v3.onnx` (about 1.5 MB) to `path`; returns the path."""
    return export_speech_tokenizer(tiny_speech_tokenizer(seed), path)


def export_tiny_campplus(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny `campplus.onnx` (about 250 KB) to `path`; returns the path."""
    return export_campplus(tiny_campplus(seed), path)
