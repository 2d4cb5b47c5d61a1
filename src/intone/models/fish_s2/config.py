"""Fish S2 Pro configuration, read from the checkpoint's nested `config.json`.

The fast AR takes its RoPE base and norm epsilon from the *text* config: the official
code never reads the audio decoder's `rope_base`, `norm_eps` or `max_seq_len`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from intone.errors import ModelLoadError


# config.json of the real fishaudio/s2-pro checkpoint (nested, Fish-native key names).
S2_PRO_CONFIG = {
    "model_type": "fish_qwen3_omni", "dtype": "bfloat16", "eos_token_id": 151645, "pad_token_id": 151669,
    "audio_pad_token_id": 151677, "semantic_start_token_id": 151678, "semantic_end_token_id": 155773,
    "text_config": {
        "model_type": "fish_qwen3", "dim": 2560, "n_layer": 36, "n_head": 32, "n_local_heads": 8, "head_dim": 128,
        "intermediate_size": 9728, "vocab_size": 155776, "max_seq_len": 32768, "rope_base": 1000000,
        "norm_eps": 1e-6, "tie_word_embeddings": True, "attention_qk_norm": True,
        "attention_qkv_bias": False, "attention_o_bias": False,
    },
    "audio_decoder_config": {
        "model_type": "fish_qwen3_audio_decoder", "dim": 2560, "n_layer": 4, "n_head": 32, "n_local_heads": 8,
        "head_dim": 128, "intermediate_size": 9728, "max_seq_len": 11, "num_codebooks": 10, "vocab_size": 4096,
        "text_dim": 2560, "rope_base": 1000000, "norm_eps": 1e-6, "attention_qk_norm": False,
    },
}


@dataclass(frozen=True)
class TransformerShape:
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    intermediate_size: int
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False


@dataclass(frozen=True)
class FishS2Config:
    slow: TransformerShape
    fast: TransformerShape
    vocab_size: int
    max_seq_len: int
    rope_base: float
    norm_eps: float
    tie_word_embeddings: bool
    num_codebooks: int  # codes per frame (semantic + residual)
    codebook_size: int  # rows per codebook in the embedding tables and the fast-AR head
    text_dim: int  # width of the slow-AR hidden state fed to the fast AR

    @classmethod
    def from_dict(cls, data: dict, source: str = "config.json") -> "FishS2Config":
        try:
            if data.get("model_type") != "fish_qwen3_omni":
                raise ModelLoadError(
                    f"{source}: model_type is {data.get('model_type')!r}, expected 'fish_qwen3_omni'"
                )
            tc, ac = data["text_config"], data["audio_decoder_config"]
            slow = _shape(tc, tc)
            fast = _shape(ac, tc)
            return cls(
                slow=slow,
                fast=fast,
                vocab_size=int(tc["vocab_size"]),
                max_seq_len=int(tc.get("max_seq_len", 2048)),
                rope_base=float(tc.get("rope_base", 10000)),
                norm_eps=float(tc.get("norm_eps", 1e-5)),
                tie_word_embeddings=bool(tc.get("tie_word_embeddings", True)),
                num_codebooks=int(ac["num_codebooks"]),
                codebook_size=int(ac["vocab_size"]),
                text_dim=int(ac.get("text_dim", tc["dim"])),
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing key {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: Path) -> "FishS2Config":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: file not found") from None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data, source=str(path))


def _shape(cfg: dict, text_cfg: dict) -> TransformerShape:
    """Fast-AR fields left unset fall back to the slow AR's, as in the official model args."""

    def pick(key, default=None):
        value = cfg.get(key)
        if value is None:
            value = text_cfg.get(key, default)
        return value

    n_head = int(pick("n_head"))
    n_kv = pick("n_local_heads", -1)
    n_kv = n_head if n_kv in (None, -1) else int(n_kv)
    dim = int(pick("dim"))
    ffn = pick("intermediate_size")
    if ffn is None:  # the official default: 2/3 of 4*dim, rounded up to a multiple of 256
        ffn = -(-int(8 * dim / 3) // 256) * 256
    return TransformerShape(
        dim=dim,
        n_layer=int(cfg["n_layer"]),
        n_head=n_head,
        n_kv_head=n_kv,
        head_dim=int(pick("head_dim", dim // n_head)),
        intermediate_size=int(ffn),
        qk_norm=bool(pick("attention_qk_norm", False)),
        qkv_bias=bool(pick("attention_qkv_bias", False)),
        o_bias=bool(pick("attention_o_bias", False)),
    )
