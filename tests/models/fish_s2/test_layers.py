"""The slow-AR embedding rule and the RoPE pairing, on small hand-computed cases."""

import math

import torch

from intone.models.fish_s2.layers import apply_rope, rope_table


def test_rope_rotates_adjacent_pairs():
    # head_dim 4, position 1, base 100: pair 0 turns by 1 rad, pair 1 by 1/100**(2/4) = 0.1 rad.
    table = rope_table(torch.tensor([1]), 4, 100.0)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [T=1, H=1, D=4]
    out = apply_rope(x, table)[0, 0]
    c0, s0 = table[0, 0]
    c1, s1 = table[0, 1]
    assert torch.allclose(torch.stack([c0, s0, c1, s1]),
                          torch.tensor([math.cos(1), math.sin(1), math.cos(0.1), math.sin(0.1)]), atol=4e-3)
    expected = torch.tensor([1 * c0 - 2 * s0, 2 * c0 + 1 * s0, 3 * c1 - 4 * s1, 4 * c1 + 3 * s1])
    assert torch.allclose(out, expected)
    # NeoX (half-split) pairing would rotate (x0, x2) and (x1, x3) instead:
    neox = torch.tensor([1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1])
    assert not torch.allclose(out, neox)


def test_rope_table_is_bf16_rounded_even_in_fp32():
    table = rope_table(4096, 128, 1e6)
    assert table.dtype == torch.float32
    assert torch.equal(table, table.to(torch.bfloat16).float())
    exact = torch.tensor(math.cos(4095 * 1.0))
    assert (table[4095, 0, 0] - exact).abs() > 0  # rounding really happened
    assert (table[4095, 0, 0] - exact).abs() < 4e-3


def test_embedding_rule(tiny_fish):
    lm = tiny_fish.lm
    tok = tiny_fish.tokenizer
    emb = lm.text_model.model.embeddings.weight
    books = lm.audio_decoder.codebook_embeddings.weight
    text_id = tok.encode("Hello")[0]
    codes = torch.tensor([[0] * 10, [5, 1, 2, 3, 4, 1023, 4095, 0, 7, 9]])
    tokens = torch.tensor([text_id, tok.semantic_begin + 5])
    x = lm.embed(tokens, codes)
    # Text position: the token embedding alone (its codes are ignored).
    assert torch.allclose(x[0], emb[text_id])
    # Semantic position: (token + sum over codebooks i of row i * 4096 + code_i) / sqrt(11).
    manual = emb[tok.semantic_begin + 5] + sum(books[i * 4096 + int(codes[1, i])] for i in range(10))
    assert torch.allclose(x[1], manual / math.sqrt(11), atol=1e-6)


def test_stop_token_is_not_a_semantic_position(tiny_fish):
    lm, tok = tiny_fish.lm, tiny_fish.tokenizer
    x = lm.embed(torch.tensor([tok.im_end_id]), torch.ones(1, 10, dtype=torch.long))
    assert torch.allclose(x[0], lm.text_model.model.embeddings.weight[tok.im_end_id])


def test_semantic_logits_are_the_allowed_columns_of_the_full_logits(tiny_fish):
    lm, tok = tiny_fish.lm, tiny_fish.tokenizer
    h = torch.randn(3, lm.cfg.slow.dim)
    full = lm.full_logits(h)
    small = lm.semantic_logits(h, tok.im_end_id)
    assert torch.allclose(small[:, :4096], full[:, tok.semantic_begin : tok.semantic_end + 1], atol=1e-6)
    assert torch.allclose(small[:, 4096], full[:, tok.im_end_id], atol=1e-6)


def test_the_fast_ars_first_two_positions_together_are_the_two_one_after_the_other(tiny_fish_dir):
    """The head runs fast-AR positions 0 and 1 in one pass; each row's position-1 hidden state and the cache it
    leaves are those of the official order, one position at a time (float64: equal to rounding)."""
    from intone.models.registry import load_model

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    lm, rows = model.lm, 5
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, model.cfg.text_dim, generator=g, dtype=torch.float64)
    code = torch.randint(0, model.cfg.codebook_size, (rows,), generator=g)
    with torch.inference_mode():
        first, embedded = lm.audio_decoder.project(hidden), lm.audio_decoder.embeddings(code)
        apart = lm.new_fast_cache(rows, torch.float64, "cpu")
        lm.fast_step(first, 0, apart)
        want = lm.fast_step(embedded, 1, apart)
        together = lm.new_fast_cache(rows, torch.float64, "cpu")
        got = lm.fast_step(torch.stack([first, embedded], dim=1), 0, together)
        after_apart = lm.fast_step(embedded * 0.5, 2, apart)  # the next position reads both caches alike
        after_together = lm.fast_step(embedded * 0.5, 2, together)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    for (k1, v1), (k2, v2) in zip(apart, together):
        assert torch.allclose(k1, k2, rtol=0, atol=1e-12) and torch.allclose(v1, v2, rtol=0, atol=1e-12)
    assert torch.allclose(after_together, after_apart, rtol=0, atol=1e-12)


def test_the_layers_along_one_residual_stream_give_each_layers_forward_bit_for_bit(tiny_fish_dir):
    """`run_layers` (each residual add done with the norm that reads it) against the layers' own `forward`
    one after another, then the final norm: the same bits in bf16, for the slow AR's layers and the fast AR's;
    with w1 and w3 apart (not joined), the same to a few ulps."""
    from intone.models.fish_s2.transformer import run_layers
    from intone.models.registry import load_model

    model = load_model(str(tiny_fish_dir), dtype=torch.bfloat16)
    lm = model.lm
    g = torch.Generator().manual_seed(1)
    for layers, norm, rope in ((lm.text_model.model.layers, lm.text_model.model.norm, lm.slow_rope[:6]),
                               (lm.audio_decoder.layers, lm.audio_decoder.norm, lm.fast_rope[:6])):
        x = torch.randn(6, layers[0].attention_norm.weight.shape[0], generator=g).bfloat16()

        def attend(q, k, v):  # causal attention over the 6 positions, GQA by repeating the keys' heads
            rep = q.shape[-2] // k.shape[-2]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(rep, -2).transpose(0, 1),
                v.repeat_interleave(rep, -2).transpose(0, 1), is_causal=True)
            return out.transpose(0, 1)

        with torch.inference_mode():
            want = x
            for layer in layers:
                want = layer(want, rope, attend)
            want = norm(want)
            h, delta = run_layers(layers, x, rope, [attend] * len(layers))
            assert torch.equal(norm.add(h, delta)[1], want)
            joined = [layer.feed_forward.w13 for layer in layers]
            assert all(j is not None and j.joined() for j in joined)
            for layer in layers:
                layer.feed_forward.w13 = None
            h2, delta2 = run_layers(layers, x, rope, [attend] * len(layers))
            for layer, j in zip(layers, joined):
                layer.feed_forward.w13 = j
            # the same dot products, as the GEMM's blocking for the joined width sums them: a few bf16 ulps at most
            assert (norm.add(h2, delta2)[1].float() - want.float()).abs().max() <= 4 * 2**-8 * want.abs().max()
