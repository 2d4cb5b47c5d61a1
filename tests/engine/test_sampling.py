"""Sampling: official filter order, and draws that belong to the request, not the batch."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.ops.sampling import SamplingBatch, apply_repetition_penalty, best_tokens, request_uniforms, sample


def batch(n, temperature=0.8, top_p=0.8, top_k=30, seeds=None, steps=None, penalty=1.0):
    seeds = torch.tensor(seeds if seeds is not None else list(range(n)), dtype=torch.int64)
    steps = torch.tensor(steps if steps is not None else [0] * n, dtype=torch.int64)
    full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    return SamplingBatch(full(temperature, torch.float32), full(top_p, torch.float32), full(top_k, torch.int64),
                         full(penalty, torch.float32), seeds, steps, max_top_k=top_k, has_penalty=penalty != 1.0)


def official_kept(logits, top_p, top_k):
    """The official logits_to_probs filter, on one row: sort, cumulative softmax, keep rank 0."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove = (cum > top_p) | (torch.arange(len(logits)) >= top_k)
    remove[0] = False
    return set(order[~remove].tolist())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.floats(0.05, 1.0), st.integers(1, 64))
def test_only_tokens_the_official_filter_keeps_are_drawn(seed, top_p, top_k):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 200, generator=g) * 3
    kept = official_kept(logits[0], top_p, top_k)
    params = batch(1, temperature=1.0, top_p=top_p, top_k=top_k, seeds=[seed])
    drawn = {int(sample(logits, SamplingBatch(**{**params.__dict__, "steps": torch.tensor([s])}), 0))
             for s in range(60)}
    assert drawn <= kept


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**62), min_size=2, max_size=6, unique=True), st.integers(0, 500), st.randoms())
def test_a_rows_draw_does_not_depend_on_the_batch(seeds, step, rnd):
    n = len(seeds)
    logits = torch.randn(n, 300, generator=torch.Generator().manual_seed(step))
    together = sample(logits, batch(n, seeds=seeds, steps=[step] * n), 3)
    perm = list(range(n))
    rnd.shuffle(perm)
    shuffled = sample(logits[perm], batch(n, seeds=[seeds[i] for i in perm], steps=[step] * n), 3)
    for j, i in enumerate(perm):
        alone = sample(logits[i : i + 1], batch(1, seeds=[seeds[i]], steps=[step]), 3)
        assert int(alone) == int(together[i]) == int(shuffled[j])


def test_uniforms_vary_with_every_counter_and_look_uniform():
    ids = torch.arange(4096).unsqueeze(0)
    base = request_uniforms(torch.tensor([7]), torch.tensor([3]), 0, ids)
    assert torch.equal(base, request_uniforms(torch.tensor([7]), torch.tensor([3]), 0, ids))
    for other in (request_uniforms(torch.tensor([8]), torch.tensor([3]), 0, ids),
                  request_uniforms(torch.tensor([7]), torch.tensor([4]), 0, ids),
                  request_uniforms(torch.tensor([7]), torch.tensor([3]), 1, ids)):
        assert (other != base).float().mean() > 0.99
    assert 0 < float(base.min()) and float(base.max()) < 1
    assert abs(float(base.mean()) - 0.5) < 0.02


def test_tiny_temperature_or_top_k_1_is_greedy():
    logits = torch.randn(5, 100)
    best = logits.argmax(dim=-1)
    assert torch.equal(sample(logits, batch(5, temperature=0.0, top_p=1.0, top_k=100), 0), best)
    assert torch.equal(sample(logits, batch(5, temperature=1.5, top_p=1.0, top_k=1), 0), best)


def test_repetition_penalty_pushes_recent_tokens_down():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    window = torch.tensor([[0, 1, -1]])
    out = apply_repetition_penalty(logits, window, batch(1, penalty=2.0))
    assert out.tolist() == [[1.0, -2.0, 0.5, 0.0]]
    assert torch.equal(apply_repetition_penalty(logits, window, batch(1)), logits)


def tied_logits(seed: int, rows: int, vocab: int) -> torch.Tensor:
    """bf16-rounded logits (as the GPU's heads give them: many exact ties), with -inf, 0.0 and -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).float()
    x[:, 0], x[:, 1], x[:, 2] = float("-inf"), 0.0, -0.0
    return x[:, torch.randperm(vocab, generator=g)]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 300))
def test_best_tokens_are_the_stable_descending_order_for_any_k(seed, k):
    x = tied_logits(seed, 3, 300)
    want = np.argsort(-x.numpy(), axis=-1, kind="stable")[:, :k]  # equal logits: the lower id first
    assert np.array_equal(best_tokens(x, k).numpy(), want)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.lists(st.integers(1, 64), min_size=1, max_size=6), st.integers(0, 10**4))
def test_a_row_draws_the_same_token_whatever_number_of_candidates_is_sorted(seed, top_ks, step):
    """What lets a batch sort only as many candidates as its largest top_k asks for (a captured head: one
    of its fixed bounds): rows with small top_k draw the same, beside any other row."""
    n = len(top_ks)
    g = torch.Generator().manual_seed(seed)
    logits = tied_logits(seed, n, 4097)
    params = SamplingBatch(torch.rand(n, generator=g) * 1.5, 0.3 + 0.7 * torch.rand(n, generator=g),
                           torch.tensor(top_ks), torch.ones(n), torch.arange(n) + seed, torch.full((n,), step),
                           max_top_k=max(top_ks))
    draws = [sample(logits, params, 2, k) for k in (max(top_ks), 64, 100, 4097)]
    assert all(torch.equal(d, draws[0]) for d in draws)


@pytest.mark.gpu
def test_compiled_sort_keys_are_the_eager_ones_on_the_gpu():
    """ar.fuse_elementwise compiles the sampler's sort keys with the rest (one kernel inside the head's graph)."""
    from intone.ops import fused

    x = tied_logits(0, 64, 4097).cuda()
    eager = fused.order_keys_eager(x)
    fused.use_compiled(True)
    try:
        compiled = fused.order_keys(x)
    finally:
        fused.use_compiled(False)
    assert torch.equal(compiled, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 33, 64])
def test_running_totals_of_the_first_64_ranks_do_not_depend_on_the_shape_on_the_gpu(rows):
    """CUDA's innermost-axis scan tiles by both axes; the sampler's first 64 running totals may not."""
    from intone.ops.sampling import running_total

    x = torch.rand(64, 4097, generator=torch.Generator().manual_seed(rows)).cuda()
    full = running_total(x)[:rows, :64]
    assert torch.equal(running_total(x[:rows, :64]), full)
    assert torch.equal(running_total(x[:rows])[:, :64], full)
    assert torch.equal(running_total(x[:1, :64]), full[:1])  # a row alone: the same sums
    assert torch.allclose(full, torch.cumsum(x[:rows, :64], dim=-1))
