"""Fish's fast-AR attention on a GPU is one Triton kernel per layer call (`ops/fast_attention.py`): it must write the
call's keys and values into the step's cache and give the attention SDPA's math gives over that cache."""

import pytest
import torch
import torch.nn.functional as F


def _reference(q, k, v, k_cache, v_cache, position):
    """The fast AR's torch path (`FishLM.fast_step`), in fp32 math: (output, the caches it leaves)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    end = position + q.shape[1]
    k_cache[:, position:end], v_cache[:, position:end] = k, v
    out = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k_cache[:, :end], v_cache[:, :end])),
                                         is_causal=q.shape[1] > 1, enable_gqa=True)
    return out.transpose(1, 2), k_cache, v_cache


@pytest.mark.gpu
@pytest.mark.parametrize("position, t", [(0, 2), (1, 1), (2, 1), (9, 1)])
@pytest.mark.parametrize("rows", [1, 48])
def test_the_kernel_writes_the_cache_and_attends_as_sdpa_does(position, t, rows):
    """The real fast AR's shapes (32 heads over 8 KV heads of 128, ten slots), q/k/v strided views of one projection
    as the layers make them: the cache holds the new keys and values (bit for bit) and nothing past them changes;
    the output is SDPA's fp32 math rounded to bf16 (one rounding of the output apart)."""
    from intone.ops.fast_attention import attend

    g = torch.Generator(device="cuda").manual_seed(position * 10 + t + rows)
    heads, kv_heads, dim, slots = 32, 8, 128, 10
    qkv = torch.randn(rows, t, heads + 2 * kv_heads, dim, device="cuda", generator=g).bfloat16()
    q, k, v = qkv[:, :, :heads], qkv[:, :, heads: heads + kv_heads], qkv[:, :, heads + kv_heads:]
    k_cache, v_cache = (torch.randn(rows, slots, kv_heads, dim, device="cuda", generator=g).bfloat16() for _ in "kv")
    want, want_k, want_v = _reference(q, k, v, k_cache, v_cache, position)
    got = attend(q, k, v, k_cache, v_cache, position)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 * 1.001 + 1e-6).all()  # half a bf16 unit
