"""The CosyVoice3 talker: a Qwen2 decoder fed with text and speech-token embeddings.

Module names mirror `llm.pt` (`llm.model.model.*` is the Qwen2 stack, `speech_embedding`,
`llm_decoder`), so loading is a strict state-dict load. Attention runs over the engine's
paged KV cache; RoPE is Qwen2's (NeoX halves, cos/sin in fp32 then cast to the model dtype).

`use_autocast(float16)` gives the official `fp16=True` numerics (its LLM runs under fp16 autocast): the
GEMMs' weights stored in fp16 (the bits autocast's per-op cast gives) and their inputs rounded to it, while
the embeddings, the residual stream and the norms stay fp32; RoPE multiplies the fp16 projections by fp32
tables (so in fp32, by type promotion) and attention reads queries, keys and values in fp16, as autocast's
SDPA does. In the model's own dtype every cast below is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from intone.ops import fused
from intone.ops.joined_linear import JoinedLinear, join_linears
from intone.ops.attention import AttentionMetadata, decode_attention, paged_attention, store_kv
from intone.ops.kv_cache import KVCache


@dataclass(frozen=True)
class QwenShape:
    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    intermediate_size: int = 4864
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    vocab_size: int = 151936
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: dict) -> "QwenShape":
        """From a Qwen2 `config.json` (transformers 4.x puts rope_theta at the top, 5.x may nest it)."""
        theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 1e6)
        keys = cls.__dataclass_fields__.keys() - {"rope_theta"}
        return cls(rope_theta=float(theta), **{k: config[k] for k in keys if k in config})


class RMSNorm(nn.Module):
    """Qwen2's: normalised in fp32 whatever the model dtype (fp64 too), cast back, then scaled."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return fused.rms_norm(x, self.weight, self.eps, torch.float32)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """[T, head_dim] cos and sin at `positions`: computed in fp32 and cast, as transformers'
    Qwen2 does for every model dtype (fp64 models included)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


apply_rope = fused.rope_halves  # x [T, H, D]; cos/sin [T, D]


class Attention(nn.Module):
    def __init__(self, s: QwenShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden_size, self.heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(s.hidden_size, self.kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(s.hidden_size, self.kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.heads * self.head_dim, s.hidden_size, bias=False)
        self.qkv: JoinedLinear | None = None  # set by CosyTalker.join_projections

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, kv: tuple[Tensor, Tensor], attend):
        """attend(q, k_cache, v_cache) -> [T, H, D], after this step's keys are stored at `slots`."""
        x = x.to(self.o_proj.weight.dtype)
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = apply_rope(q.unflatten(-1, (self.heads, self.head_dim)), cos, sin)
        k = apply_rope(k.unflatten(-1, (self.kv_heads, self.head_dim)), cos, sin)
        v = v.unflatten(-1, (self.kv_heads, self.head_dim))
        store_kv(kv[0], kv[1], k, v, slots)
        return self.o_proj(attend(q.to(kv[0].dtype), kv[0], kv[1]).flatten(-2))


class MLP(nn.Module):
    def __init__(self, s: QwenShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.gate_up: JoinedLinear | None = None  # set by CosyTalker.join_projections

    def forward(self, x: Tensor) -> Tensor:
        x = x.to(self.down_proj.weight.dtype)
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(fused.silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, s: QwenShape):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, cos, sin, slots, kv, attend):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, kv, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class QwenModel(nn.Module):
    def __init__(self, s: QwenShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_hidden_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class QwenForCausalLM(nn.Module):
    """`llm.model`: the stack and its text head (unused for speech; kept so `llm.pt` loads strictly)."""

    def __init__(self, s: QwenShape):
        super().__init__()
        self.model = QwenModel(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        if s.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class QwenEncoder(nn.Module):
    def __init__(self, s: QwenShape):
        super().__init__()
        self.model = QwenForCausalLM(s)


class CosyTalker(nn.Module):
    """Speech-token LM: `speech_embedding` rows for sos/task/speech inputs, text rows otherwise."""

    def __init__(self, s: QwenShape, speech_token_size: int = 6561, extra_ids: int = 200):
        super().__init__()
        self.shape = s
        self.llm = QwenEncoder(s)
        self.speech_embedding = nn.Embedding(speech_token_size + extra_ids, s.hidden_size)
        self.llm_decoder = nn.Linear(s.hidden_size, speech_token_size + extra_ids, bias=False)

    def gemms(self) -> list[nn.Linear]:
        """The layers that official fp16 autocast runs in fp16 (every Linear that is not tied to an embedding)."""
        out = [self.llm_decoder]
        for layer in self.llm.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            out += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        return out

    def use_autocast(self, dtype: torch.dtype) -> None:
        """Run as the official code does under autocast to `dtype` (module docstring): the GEMMs' weights
        stored in it, joined again."""
        for layer in self.gemms():
            layer.to(dtype)
        self.join_projections()

    @property
    def kv_dtype(self) -> torch.dtype:
        """What attention reads: the GEMMs' dtype (fp16 under autocast), else the model's."""
        return self.llm_decoder.weight.dtype

    def join_projections(self) -> None:
        """q/k/v and gate/up as one GEMM each (ops.joined_linear): call once the weights are loaded
        where they will run."""
        for layer in self.llm.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv = join_linears(a.q_proj, a.k_proj, a.v_proj)
            m.gate_up = join_linears(m.gate_proj, m.up_proj)

    def embed(self, text_ids: Tensor, speech_ids: Tensor) -> Tensor:
        """Per position: speech_embedding[speech_id] where speech_id >= 0, else embed_tokens[text_id]."""
        is_speech = (speech_ids >= 0).unsqueeze(-1)
        speech = self.speech_embedding(speech_ids.clamp(min=0))
        text = self.llm.model.model.embed_tokens(torch.where(speech_ids >= 0, 0, text_ids))
        return torch.where(is_speech, speech, text)

    def forward(self, x: Tensor, meta: AttentionMetadata, kv: KVCache) -> Tensor:
        """Packed embeddings [T, D] -> logits [R, V] of each request's last position (at least fp32)."""
        h = self._layers(x, meta.positions, meta.slot_mapping, kv,
                         lambda q, kc, vc: paged_attention(q, kc, vc, meta))
        return self._logits(h[meta.last_token_rows])

    def decode_step(self, x: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, seq_lens: Tensor,
                    kv: KVCache) -> Tensor:
        """One new token per row, static shapes (CUDA-graph capture): [B, D] -> logits [B, V]."""
        h = self._layers(x, positions, slots, kv, lambda q, kc, vc: decode_attention(q, kc, vc, tables, seq_lens))
        return self._logits(h)

    def _layers(self, x: Tensor, positions: Tensor, slots: Tensor, kv: KVCache, attend) -> Tensor:
        cos, sin = rope_cos_sin(positions, self.shape.head_dim, self.shape.rope_theta, x.dtype)
        for i, layer in enumerate(self.llm.model.model.layers):
            x = layer(x, cos, sin, slots, kv.layer(i), attend)
        return x

    def _logits(self, h: Tensor) -> Tensor:
        logits = self.llm_decoder(self.llm.model.model.norm(h).to(self.llm_decoder.weight.dtype))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 models: fp64)
