"""The Dual-AR language model: slow AR over frames, fast AR over the codebooks of one frame.

Module names mirror the checkpoint's tensor names (`text_model.model.*`, `audio_decoder.*`)
so that loading is a strict, direct state-dict load.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intone.models.fish_s2.config import FishS2Config, TransformerShape
from intone.models.fish_s2.layers import RMSNorm, SwiGLU, rope_table
from intone.ops import fast_attention, fused
from intone.ops.attention import AttentionMetadata, decode_attention, paged_attention, store_kv
from intone.ops.kv_cache import KVCache

# attend(q, k, v) with q [.., T, H, D] and k, v [.., T, H_kv, D] -> [.., T, H, D]
AttendFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class Attention(nn.Module):
    def __init__(self, shape: TransformerShape, eps: float):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = shape.n_head, shape.n_kv_head, shape.head_dim
        qkv_dim = (shape.n_head + 2 * shape.n_kv_head) * shape.head_dim
        self.wqkv = nn.Linear(shape.dim, qkv_dim, bias=shape.qkv_bias)
        self.wo = nn.Linear(shape.n_head * shape.head_dim, shape.dim, bias=shape.o_bias)
        if shape.qk_norm:
            self.q_norm = nn.RMSNorm(shape.head_dim, eps=eps)
            self.k_norm = nn.RMSNorm(shape.head_dim, eps=eps)
        self.qk_norm = shape.qk_norm

    def forward(self, x: Tensor, rope: Tensor, attend: AttendFn) -> Tensor:
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        qkv = self.wqkv(x)
        v = qkv[..., q_size + kv_size:].unflatten(-1, (self.n_kv_head, self.head_dim))
        if self.qk_norm:  # before RoPE, in one piece with it
            q = qkv[..., :q_size].unflatten(-1, (self.n_head, self.head_dim))
            k = qkv[..., q_size: q_size + kv_size].unflatten(-1, (self.n_kv_head, self.head_dim))
            q, k = fused.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rope)
        else:  # the queries' and keys' heads rotated in one pass (the fast AR: a kernel fewer a layer)
            heads = self.n_head + self.n_kv_head
            qk = fused.rope_pairs(qkv[..., : q_size + kv_size].unflatten(-1, (heads, self.head_dim)), rope)
            q, k = qk.split([self.n_head, self.n_kv_head], dim=-2)
        return self.wo(attend(q, k, v).flatten(-2))


class Block(nn.Module):
    def __init__(self, shape: TransformerShape, eps: float):
        super().__init__()
        self.attention = Attention(shape, eps)
        self.feed_forward = SwiGLU(shape.dim, shape.intermediate_size, fusable=True)
        self.attention_norm = RMSNorm(shape.dim, eps, fusable=True)
        self.ffn_norm = RMSNorm(shape.dim, eps, fusable=True)

    def forward(self, x: Tensor, rope: Tensor, attend: AttendFn) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, attend)
        return h + self.feed_forward(self.ffn_norm(h))

    def residual(self, x: Tensor, delta: Tensor | None, rope: Tensor, attend: AttendFn) -> tuple[Tensor, Tensor]:
        """`forward` on the stream x + delta (delta None: x), its last add left to whatever reads it next:
        (h, the feed-forward's output), the layer's output being their sum. Each add is done with the norm
        that reads it (`RMSNorm.add`): the same sums, two kernels fewer a layer where the pieces are fused."""
        if delta is None:
            normed = self.attention_norm(x)
        else:
            x, normed = self.attention_norm.add(x, delta)
        h, normed = self.ffn_norm.add(x, self.attention(normed, rope, attend))
        return h, self.feed_forward(normed)


def run_layers(layers, x: Tensor, rope: Tensor, attends) -> tuple[Tensor, Tensor | None]:
    """The layers along one residual stream (`Block.residual`): (x, delta), the output being x + delta."""
    delta = None
    for layer, attend in zip(layers, attends):
        x, delta = layer.residual(x, delta, rope, attend)
    return x, delta


class SlowModel(nn.Module):
    """`text_model.model`: embeddings, layers, final norm (and `output` when not tied)."""

    def __init__(self, cfg: FishS2Config):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.slow.dim)
        self.layers = nn.ModuleList(Block(cfg.slow, cfg.norm_eps) for _ in range(cfg.slow.n_layer))
        self.norm = RMSNorm(cfg.slow.dim, cfg.norm_eps, fusable=True)
        if not cfg.tie_word_embeddings:
            self.output = nn.Linear(cfg.slow.dim, cfg.vocab_size, bias=False)

    def output_weight(self) -> Tensor:
        return self.embeddings.weight if not hasattr(self, "output") else self.output.weight


class TextModel(nn.Module):
    def __init__(self, cfg: FishS2Config):
        super().__init__()
        self.model = SlowModel(cfg)


class AudioDecoder(nn.Module):
    """`audio_decoder`: the slow AR's codebook embeddings plus the whole fast AR."""

    def __init__(self, cfg: FishS2Config):
        super().__init__()
        fast = cfg.fast
        self.codebook_embeddings = nn.Embedding(cfg.codebook_size * cfg.num_codebooks, cfg.slow.dim)
        if cfg.text_dim != fast.dim:
            self.project_in = nn.Linear(cfg.text_dim, fast.dim)
        self.embeddings = nn.Embedding(cfg.codebook_size, fast.dim)
        self.layers = nn.ModuleList(Block(fast, cfg.norm_eps) for _ in range(fast.n_layer))
        self.norm = RMSNorm(fast.dim, cfg.norm_eps, fusable=True)
        self.output = nn.Linear(fast.dim, cfg.codebook_size, bias=False)

    def project(self, hidden: Tensor) -> Tensor:
        return self.project_in(hidden) if hasattr(self, "project_in") else hidden


class DualARTransformer(nn.Module):
    def __init__(self, cfg: FishS2Config, semantic_begin: int, semantic_end: int):
        super().__init__()
        self.cfg = cfg
        self.semantic_begin, self.semantic_end = semantic_begin, semantic_end
        self.text_model = TextModel(cfg)
        self.audio_decoder = AudioDecoder(cfg)
        self.make_buffers()

    def join_projections(self) -> None:
        """Each AR layer's w1 and w3 as one GEMM (`SwiGLU.join`): call once the weights are where they run."""
        for layer in (*self.text_model.model.layers, *self.audio_decoder.layers):
            layer.feed_forward.join()

    def make_buffers(self, device=None) -> None:
        """(Re)build the non-persistent tables, e.g. after loading into a meta-device model."""
        cfg = self.cfg
        with torch.device(device or "cpu"):
            self.register_buffer("slow_rope", rope_table(cfg.max_seq_len, cfg.slow.head_dim, cfg.rope_base), persistent=False)
            # The fast AR uses the slow AR's RoPE base; positions 0..num_codebooks-1.
            self.register_buffer("fast_rope", rope_table(cfg.num_codebooks, cfg.fast.head_dim, cfg.rope_base), persistent=False)
            offsets = torch.arange(cfg.num_codebooks) * cfg.codebook_size
            self.register_buffer("codebook_offsets", offsets, persistent=False)

    # ---- slow AR ---------------------------------------------------------------------------

    def embed(self, tokens: Tensor, codes: Tensor) -> Tensor:
        """tokens [T], codes [T, K] -> [T, dim].

        At semantic positions: (token embedding + sum of the K codebook embeddings) / sqrt(K+1);
        elsewhere the token embedding alone.
        """
        slow = self.text_model.model
        x = slow.embeddings(tokens)
        vq = self.audio_decoder.codebook_embeddings(codes + self.codebook_offsets).sum(dim=1)
        is_semantic = ((tokens >= self.semantic_begin) & (tokens <= self.semantic_end)).unsqueeze(-1)
        x = x + torch.where(is_semantic, vq, torch.zeros_like(vq))
        return torch.where(is_semantic, x / math.sqrt(self.cfg.num_codebooks + 1), x)

    def forward_slow(self, x: Tensor, meta: AttentionMetadata, kv: KVCache) -> Tensor:
        """Packed embeddings x [T, dim] -> final normed hidden of each request's last token [R, dim]."""
        h, delta = self._slow_layers(x, meta.positions, meta.slot_mapping, kv,
                                     lambda q, kc, vc: paged_attention(q, kc, vc, meta))
        return self.text_model.model.norm((h + delta)[meta.last_token_rows])

    def decode_slow(self, x: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, seq_lens: Tensor,
                    kv: KVCache) -> Tensor:
        """One new token per row, static shapes (CUDA-graph capture): [B, dim] -> normed hidden [B, dim]."""
        h, delta = self._slow_layers(x, positions, slots, kv,
                                     lambda q, kc, vc: decode_attention(q, kc, vc, tables, seq_lens))
        return self.text_model.model.norm.add(h, delta)[1]

    def _slow_layers(self, x: Tensor, positions: Tensor, slots: Tensor, kv: KVCache, attention) -> tuple[Tensor, Tensor]:
        """attention(q, k_cache, v_cache) runs after this step's keys are stored at `slots`. (x, delta):
        the last layer's output is their sum (`run_layers`)."""

        def attend(i):
            k_cache, v_cache = kv.layer(i)

            def run(q, k, v):
                store_kv(k_cache, v_cache, k, v, slots)
                return attention(q, k_cache, v_cache)
            return run

        layers = self.text_model.model.layers
        return run_layers(layers, x, self.slow_rope[positions], (attend(i) for i in range(len(layers))))

    def full_logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.text_model.model.output_weight())

    def semantic_logits(self, hidden: Tensor, stop_id: int) -> Tensor:
        """Logits over the allowed vocabulary only: [R, codebook + 1]; column codebook_size is stop_id.

        Equal to full_logits restricted to the semantic tokens and `<|im_end|>`: every other
        token gets -inf in the official constrained decoding, so it can never be drawn.
        """
        w = self.text_model.model.output_weight()
        rows = torch.cat([w[self.semantic_begin : self.semantic_begin + self.cfg.codebook_size], w[stop_id : stop_id + 1]])
        return F.linear(hidden, rows)

    # ---- fast AR ---------------------------------------------------------------------------

    def fast_step(self, x: Tensor, position: int, cache: list[tuple[Tensor, Tensor]]) -> Tensor:
        """Fast-AR positions for a batch: x [B, dim] (one position) or [B, T, dim] (T positions from
        `position`, each attending causally) -> the last position's normed hidden [B, dim].

        cache[layer] = (k, v), each [B, num_codebooks, H_kv, D]; positions p..p+T-1 write their slots
        and attend to slots 0..their own.
        """
        h = x.unsqueeze(1) if x.dim() == 2 else x
        end = position + h.shape[1]
        if position and end > position + 1:
            raise ValueError("several fast-AR positions at once only from position 0")

        def attend(k_buf, v_buf):
            def run(q, k, v):
                if fast_attention.available(q):  # the cache writes and the attention in one kernel
                    return fast_attention.attend(q, k, v, k_buf, v_buf, position)
                k_buf[:, position:end] = k
                v_buf[:, position:end] = v
                keys, values = k_buf[:, :end], v_buf[:, :end]
                out = F.scaled_dot_product_attention(  # from position 0, queries and keys align: causal
                    q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                    is_causal=end > position + 1, enable_gqa=q.shape[2] != keys.shape[2],
                )
                return out.transpose(1, 2)
            return run

        h, delta = run_layers(self.audio_decoder.layers, h, self.fast_rope[position:end],
                              (attend(k_buf, v_buf) for k_buf, v_buf in cache))
        if h.shape[1] == 1:  # every row's only position: the last add goes with the norm
            return self.audio_decoder.norm.add(h[:, 0], delta[:, 0])[1]
        return self.audio_decoder.norm((h + delta)[:, -1])

    def new_fast_cache(self, batch: int, dtype: torch.dtype, device) -> list[tuple[Tensor, Tensor]]:
        f = self.cfg.fast
        shape = (batch, self.cfg.num_codebooks, f.n_kv_head, f.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(f.n_layer)
        ]

    def fast_logits(self, hidden: Tensor) -> Tensor:
        return self.audio_decoder.output(hidden)
