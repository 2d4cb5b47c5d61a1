"""Paged attention against plain causal attention, for any split into blocks and batches."""

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.ops.attention import AttentionMetadata, paged_attention, store_kv
from intone.ops.kv_cache import BlockManager

H, HKV, D, BLOCK = 4, 2, 8, 4


def dense_reference(q, k, v):
    """q [S, H, D], k/v [S, HKV, D] of one sequence -> causal attention [S, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=4), st.randoms())
def test_paged_attention_matches_dense(reqs, rnd):
    """Each request: `ctx` tokens already cached, `q` new ones, blocks in shuffled order."""
    torch.manual_seed(rnd.randint(0, 10**6))
    manager = BlockManager(64, BLOCK)
    k_cache, v_cache = torch.zeros(64, BLOCK, HKV, D), torch.zeros(64, BLOCK, HKV, D)
    order = list(manager._free)  # blocks lent in a shuffled order
    rnd.shuffle(order)
    manager._free = OrderedDict.fromkeys(order)
    seqs = []
    for r, (q_len, ctx) in enumerate(reqs):
        total = q_len + ctx
        q, k, v = torch.randn(total, H, D), torch.randn(total, HKV, D), torch.randn(total, HKV, D)
        table = manager.grow([], total)
        if ctx:  # earlier steps wrote the cached part
            prior = AttentionMetadata.build([ctx], [0], [table], BLOCK)
            store_kv(k_cache, v_cache, k[:ctx], v[:ctx], prior.slot_mapping)
        seqs.append((q, k, v, q_len, ctx, table))
    meta = AttentionMetadata.build([s[3] for s in seqs], [s[4] for s in seqs], [s[5] for s in seqs], BLOCK)
    assert meta.cu_seqlens_q.shape[0] == len(reqs) + 1
    assert bool((meta.cu_seqlens_q[1:] > meta.cu_seqlens_q[:-1]).all())
    new_k = torch.cat([s[1][s[4]:] for s in seqs])
    new_v = torch.cat([s[2][s[4]:] for s in seqs])
    store_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping)
    out = paged_attention(torch.cat([s[0][s[4]:] for s in seqs]), k_cache, v_cache, meta)
    rows = meta.cu_seqlens_q.tolist()
    for r, (q, k, v, q_len, ctx, _) in enumerate(seqs):
        expected = dense_reference(q, k, v)[ctx:]
        assert torch.allclose(out[rows[r] : rows[r + 1]], expected, atol=1e-5)


def test_block_manager_grows_a_table_and_frees_it_idempotently():
    m = BlockManager(8, 4)
    table: list[int] = []
    assert m.grow(table, 9) is table and len(table) == 3 and m.num_free == 5 and m.tables == 1
    m.grow(table, 12)  # still fits
    assert len(table) == 3 and m.num_free == 5
    m.grow(table, 13)
    assert m.num_free == 4
    m.free(table)
    m.free(table)
    assert m.num_free == 8 and table == [] and m.tables == 0


def test_block_manager_refuses_when_full():
    m = BlockManager(2, 4)
    a: list[int] = []
    b: list[int] = []
    m.grow(a, 8)
    with pytest.raises(MemoryError):
        m.grow(b, 1)
    assert b == [] and len(a) == 2 and m.num_free == 0


@pytest.mark.gpu
def test_paged_attention_on_cuda_matches_dense():
    torch.manual_seed(0)
    manager = BlockManager(32, BLOCK)
    k_cache = torch.zeros(32, BLOCK, HKV, D, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    seqs = [(torch.randn(n, H, D, device="cuda"), torch.randn(n, HKV, D, device="cuda"),
             torch.randn(n, HKV, D, device="cuda")) for n in (7, 13)]
    tables = [manager.grow([], q.shape[0]) for q, _, _ in seqs]
    meta = AttentionMetadata.build([7, 13], [0, 0], tables, BLOCK, "cuda")
    store_kv(k_cache, v_cache, torch.cat([s[1] for s in seqs]), torch.cat([s[2] for s in seqs]), meta.slot_mapping)
    out = paged_attention(torch.cat([s[0] for s in seqs]), k_cache, v_cache, meta)
    rows = meta.cu_seqlens_q.tolist()
    for r, (q, k, v) in enumerate(seqs):
        assert torch.allclose(out[rows[r] : rows[r + 1]], dense_reference(q, k, v), atol=1e-4)
