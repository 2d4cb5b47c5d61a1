"""The model runner's CUDA graphs: captured at start-up, replayed bit for bit like the eager step."""

import threading
import time

import numpy as np
import pytest
import torch

from intone.engine.cuda_graphs import FunctionGraphs
from intone.engine.model_runner import ModelRunner, StepInput
from intone.models import resolve_model_dir
from intone.models.base import Prompt
from intone.models.registry import load_model
from intone.ops.kv_cache import BlockManager, KVCache
from intone.protocol import SamplingParams

pytestmark = pytest.mark.gpu


def _prompt(model, n: int, g: torch.Generator) -> Prompt:
    tokens = torch.randint(0, 50, (n,), generator=g)
    fill = -1 if model.name == "cosyvoice3" else 0
    return Prompt(tokens=tokens, codes=torch.full((n, model.num_codebooks), fill, dtype=torch.long))


def _new(blocks, rid: str, prompt: Prompt, params: SamplingParams) -> StepInput:
    """A request's prefill input, its block table lent enough for the prefill and one decode."""
    return StepInput(rid, prompt, params, [], None, blocks.grow([], len(prompt) + 1))


def _decodes(model, runner, blocks, lens, g, top_k_step=1, modes=(None,)):
    """Prefill len(lens) requests through `runner`, then return their decode inputs (top_k 7, 7 + step, ...;
    sampling modes from `modes` in turn)."""
    reqs = [_new(blocks, f"r{i}", _prompt(model, n, g),
                 SamplingParams(seed=i, top_k=7 + i * top_k_step, mode=modes[i % len(modes)]))
            for i, n in enumerate(lens)]
    tokens, _, codes = runner.run(reqs).to_host()
    return [StepInput(r.request_id, r.prompt, r.params, [t], c, r.block_table) for r, t, c in zip(reqs, tokens, codes)]


@pytest.mark.parametrize("name,autocast", [("fish-s2", None), ("cosyvoice3", None), ("cosyvoice3", torch.float16)])
def test_replayed_step_equals_the_eager_static_step_bitwise(name, autocast, tiny_cache):
    model = load_model(str(resolve_model_dir(f"tiny:{name}")), device="cuda", dtype=torch.float32)
    if autocast is not None:  # ar.autocast: the official fp16 talker, its KV cache in fp16
        model.use_ar_autocast(autocast)
    blocks = BlockManager(256, 16)
    kv = KVCache(model.kv_layout, 256, 16, model.dtype, "cuda")
    graphed = ModelRunner(model, kv, cuda_graphs=True)
    report = graphed.capture(8, 600)
    assert report.failed == 0 and report.graphs == len(graphed.graphs.captured) > 0
    eager = ModelRunner(model, kv, cuda_graphs=True)  # same padded buffers, nothing captured
    g = torch.Generator().manual_seed(0)
    # a head per bound on the rows' top_k (Fish: ar.sample_candidates, every token) and per sampling-mode mix
    # the head runs fewer kernels for (CosyVoice3: one mode's batch, both modes')
    assert len(graphed.head_bounds) == (2 if model.head_takes_candidates else 1)
    assert {("head", 8, c, m) for c in graphed.head_bounds for m in model.head_modes} <= set(graphed.graphs.captured)
    modes = [(None,), ("standard",), ("standard", "ras")] if model.head_modes != ("both",) else [(None,)] * 3
    # the second batch's top_k reach 127: its head sorts every token, the others' 64
    for (lens, step), mix in zip((([5, 40, 17], 1), ([3, 90, 4, 61, 8], 30), ([33] * 8, 1)), modes):
        batch = _decodes(model, graphed, blocks, lens, g, step, mix)
        k0, v0 = kv.k.clone(), kv.v.clone()
        a = graphed.run(batch)
        kv.k.copy_(k0), kv.v.copy_(v0)
        b = eager.run(batch)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.codes, b.codes)
        for r in batch:
            blocks.free(r.block_table)
    assert graphed.graphs.replays == 3 and graphed.graphs.eager == 0 and eager.graphs.eager == 3


def test_a_step_with_prefills_runs_on_the_graphs(tiny_cache):
    """Prompt tokens are rows of the static step beside the decodes (up to its token rows); a step beyond them
    runs eagerly."""
    model = load_model(str(resolve_model_dir("tiny:fish-s2")), device="cuda", dtype=torch.float32)
    blocks = BlockManager(256, 16)
    kv = KVCache(model.kv_layout, 256, 16, model.dtype, "cuda")
    runner = ModelRunner(model, kv, cuda_graphs=True)
    runner.capture(8, 600, 64)
    g = torch.Generator().manual_seed(1)
    decodes = _decodes(model, runner, blocks, [12, 30], g)
    new = _new(blocks, "new", _prompt(model, 20, g), SamplingParams(seed=9))
    out = runner.run([decodes[0], new, decodes[1]])  # any order in, the same order out
    assert out.tokens.shape == (3,) and runner.graphs.replays == 2
    runner.run([_new(blocks, "long", _prompt(model, 70, g), SamplingParams(seed=3))])
    assert runner.graphs.replays == 2 and runner.graphs.eager == 0


def test_a_prompts_step_replays_the_graph_of_its_own_row_bucket(tiny_cache):
    """`ar.prompt_row_buckets`: a bucket of 40 token rows is captured at start-up at every KV bucket, and a step of
    a 37-token prompt beside two decodes (39 rows) replays its graph (48 rows without it), with the draws of the
    same step replayed at 48."""
    model = load_model(str(resolve_model_dir("tiny:fish-s2")), device="cuda", dtype=torch.float32)

    def run(buckets: tuple):
        blocks = BlockManager(256, 16)
        kv = KVCache(model.kv_layout, 256, 16, model.dtype, "cuda")
        runner = ModelRunner(model, kv, cuda_graphs=True, token_buckets=buckets)
        runner.capture(8, 600, 64)
        g = torch.Generator().manual_seed(4)
        decodes = _decodes(model, runner, blocks, [12, 30], g)
        new = _new(blocks, "new", _prompt(model, 37, g), SamplingParams(seed=9))
        replays = runner.graphs.replays
        tokens, _, _ = runner.run([new, *decodes]).to_host()
        return runner, runner.graphs.replays - replays, tokens

    (fine, replayed, tokens), (plain, replayed_plain, tokens_plain) = run((40,)), run(())
    assert replayed == replayed_plain == 1 and fine.graphs.eager == plain.graphs.eager == 0
    assert {k[1] for k in fine.graphs.captured if k[0] == 40} == {256, 512, 1024}
    assert not any(k[0] == 40 for k in plain.graphs.captured)
    assert tokens == tokens_plain


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(32, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("splits", [1, 4, 16])  # ar.decode_splits; at 16 a short row leaves most spans empty
def test_triton_decode_attention_matches_the_reference(dtype, tol, heads, kv_heads, dim, splits):
    from intone.ops import paged_decode
    from intone.ops.attention import decode_attention, decode_attention_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    blocks, bs, rows, per_row = 640, 16, 9, 64  # rows of up to 1024 keys: spans of several tiles each
    k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(blocks, bs, kv_heads, dim, device="cuda", generator=g).to(dtype)
    q = torch.randn(rows, heads, dim, device="cuda", generator=g).to(dtype)
    tables = torch.randperm(blocks, device="cuda", generator=g)[: rows * per_row].view(rows, per_row)
    seq_lens = torch.tensor([1, 2, 15, 16, 17, 31, 100, 1000, 1024], device="cuda")
    paged_decode.use_splits(splits)
    try:
        got = decode_attention(q, k, v, tables, seq_lens)
        alone = decode_attention(q[7:8], k, v, tables[7:8], seq_lens[7:8])  # a row's bits do not depend on its batch
    finally:
        paged_decode.use_splits(1)
    want = decode_attention_reference(q, k, v, tables, seq_lens)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max() < tol
    assert torch.equal(alone, got[7:8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(32, 8, 128), (14, 2, 64)])
def test_a_prompts_rows_sharing_a_program_keep_their_bits(dtype, heads, kv_heads, dim):
    """A served step's rows: a prompt (from a cached prefix on), decode rows of other requests at consecutive
    lengths (which must not share), a second prompt, padding. Runs of a prompt's rows read their keys once; every
    row has the bits it has alone in its program, and the reference's values."""
    from intone.ops import paged_decode
    from intone.ops.attention import decode_attention_reference

    g = torch.Generator(device="cuda").manual_seed(3)
    blocks, bs, width = 400, 16, 48
    k = torch.randn(blocks + 1, bs, kv_heads, dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(blocks + 1, bs, kv_heads, dim, device="cuda", generator=g).to(dtype)
    own = torch.randperm(blocks, device="cuda", generator=g)[:5 * width].view(5, width)  # five requests' blocks
    scratch = torch.full((width,), blocks, device="cuda")
    rows = ([(p + 1, own[0]) for p in range(35, 530)] + [(531, own[1]), (532, own[2]), (533, own[3])]
            + [(p + 1, own[4]) for p in range(0, 7)] + [(1, scratch)] * 9)
    seq_lens = torch.tensor([n for n, _ in rows], device="cuda")
    tables = torch.stack([t for _, t in rows])
    q = torch.randn(len(rows), heads, dim, device="cuda", generator=g).to(dtype)
    runs = paged_decode.paged_decode_attention(q, k, v, tables, seq_lens)
    paged_decode.use_prompt_runs(False)
    try:
        alone = paged_decode.paged_decode_attention(q, k, v, tables, seq_lens)
    finally:
        paged_decode.use_prompt_runs(True)
    assert torch.equal(runs, alone)
    want = decode_attention_reference(q, k, v, tables, seq_lens)
    assert (runs.float() - want.float()).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def test_prompt_tokens_as_graph_rows_equal_the_packed_prefill(tiny_cache):
    model, blocks, kv, runner = _cosy_runner()
    g = torch.Generator().manual_seed(2)
    decodes = _decodes(model, runner, blocks, [12, 50], g)
    new = [_new(blocks, f"n{i}", _prompt(model, n, g), SamplingParams(seed=i)) for i, n in enumerate((20, 70))]
    rows, packed = _rows_and_packed(model, runner, kv, new + decodes)
    assert rows.shape == packed.shape == (4, packed.shape[1])
    assert (rows - packed).abs().max() < 1e-4


def _cosy_runner():
    """Tiny CosyVoice3 on the GPU, its runner's graphs captured with prompt rows up to 512 tokens a step."""
    model = load_model(str(resolve_model_dir("tiny:cosyvoice3")), device="cuda", dtype=torch.float32)
    blocks = BlockManager(256, 16)
    kv = KVCache(model.kv_layout, 256, 16, model.dtype, "cuda")
    runner = ModelRunner(model, kv, cuda_graphs=True)
    runner.capture(8, 600, 512)
    return model, blocks, kv, runner


def _rows_and_packed(model, runner, kv, reqs):
    """Each request's head input as rows of the static step (replayed) and through the packed prefill and the
    eager decode, from the same cache (reqs: prefills first)."""
    k0, v0 = kv.k.clone(), kv.v.clone()
    replays = runner.graphs.replays
    runner.run(reqs)
    assert runner.graphs.replays == replays + 1
    q_lens = [len(r.prompt) - r.cached if r.is_prefill else 1 for r in reqs]
    rows = runner.graphs.hidden[torch.tensor(q_lens).cumsum(0) - 1].clone()
    kv.k.copy_(k0), kv.v.copy_(v0)
    batch = runner.build(reqs)
    with torch.inference_mode():
        x = model.embed(batch.tokens, batch.codes)
        n = batch.num_prefill_tokens
        parts = [model.forward(x[:n], batch.prefill, kv)]
        if batch.decode is not None:
            d = batch.decode
            parts.append(model.forward_decode(x[n:], d.positions, d.slot_mapping, d.block_tables, d.seq_lens, kv))
    return rows, torch.cat(parts)


def test_a_prefill_after_a_shared_prefix_as_graph_rows_equals_the_packed_prefill(tiny_cache):
    """ar.prefix_caching on the GPU: a prompt whose first two blocks are another prompt's (their keys and
    values written by its prefill) prefills only the rest, as rows of the static step and packed alike."""
    model, blocks, kv, runner = _cosy_runner()
    g = torch.Generator().manual_seed(4)
    first = _new(blocks, "a", _prompt(model, 40, g), SamplingParams(seed=1))
    runner.run([first])
    tail = _prompt(model, 12, g)
    prompt = Prompt(torch.cat([first.prompt.tokens[:32], tail.tokens]), torch.cat([first.prompt.codes[:32], tail.codes]))
    table = first.block_table[:2] + blocks.grow([], 32)  # 48 tokens: the prompt's 44 and a frame
    req = StepInput("b", prompt, SamplingParams(seed=2), [], None, table, cached=32)
    assert runner.build([req]).num_prefill_tokens == 12
    rows, packed = _rows_and_packed(model, runner, kv, [req])
    assert rows.shape == packed.shape == (1, packed.shape[1])
    assert (rows - packed).abs().max() < 1e-4


@pytest.mark.parametrize("temperature", [0.05, 0.8, 1.5])
@pytest.mark.parametrize("n", [4097, 64, 5])
def test_triton_race_draws_the_tokens_of_the_torch_race(temperature, n):
    """The fused race kernel and the torch ops it replaces pick the same token on every row: probabilities over
    every token, or (64 candidates, Fish's usual draws; 5) softmax's numerators, the best 1."""
    from intone.ops import sampling
    from intone.ops import race as race_kernel

    g = torch.Generator(device="cuda").manual_seed(1)
    rows = 512
    logits = torch.randn(rows, n, device="cuda", generator=g) * 4
    z = logits / temperature
    probs = torch.softmax(z, dim=-1) if n > 64 else torch.exp(z - z.amax(-1, keepdim=True))
    probs[:, n // 2 :] = torch.where(probs[:, n // 2 :] < 1e-4, 0.0, probs[:, n // 2 :])  # filtered tokens
    idx = torch.argsort(torch.rand(rows, n, device="cuda", generator=g), dim=-1)
    params = sampling.SamplingBatch(
        temperature=torch.full((rows,), temperature, device="cuda"), top_p=torch.ones(rows, device="cuda"),
        top_k=torch.full((rows,), n, device="cuda"), repetition_penalty=torch.ones(rows, device="cuda"),
        seeds=torch.randint(-2**63, 2**63 - 1, (rows,), device="cuda", generator=g),
        steps=torch.randint(0, 3000, (rows,), device="cuda", generator=g), max_top_k=n)
    for draw in (0, 1, 9, 10):  # Fish's draws reach 10
        got = race_kernel.race_argmax(probs, idx, params.seeds, params.steps, draw)
        u = sampling.request_uniforms(params.seeds, params.steps, draw, idx)
        want = idx.gather(1, (probs / (-torch.log(u)).to(probs.dtype)).argmax(-1, keepdim=True)).squeeze(1)
        assert torch.equal(got, want)


@pytest.mark.parametrize("temperature", [0.05, 0.8, 1.5])
@pytest.mark.parametrize("k", [64, 30, 5])
def test_the_filtered_race_kernel_draws_the_tokens_of_the_torch_ops(temperature, k):
    """`sampling.sample` on CUDA (one kernel after the sort: the running total, top-p and top-k, the temperature
    and the race) and the torch ops it replaces pick the same token on every row, for rows of their own top_p
    and top_k, at every draw Fish makes; and the kernel's running total is the torch one's, to the bit, where
    the top-p boundary falls (rows whose top_p is one of their own running totals)."""
    from intone.ops import sampling

    g = torch.Generator(device="cuda").manual_seed(2)
    rows, vocab = 512, 4096
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    idx = sampling.best_tokens(logits, k)
    cum = sampling.running_total(torch.exp(logits.gather(1, idx) - torch.logsumexp(logits, -1, keepdim=True)))
    top_p = torch.rand(rows, device="cuda", generator=g) * 0.9 + 0.1
    at = torch.randint(0, k, (rows // 4,), device="cuda", generator=g)
    top_p[: rows // 4] = cum[: rows // 4].gather(1, at[:, None]).squeeze(1)  # a boundary token kept only by <=
    params = sampling.SamplingBatch(
        temperature=torch.full((rows,), temperature, device="cuda"), top_p=top_p,
        top_k=torch.randint(1, k + 1, (rows,), device="cuda", generator=g), repetition_penalty=torch.ones(rows, device="cuda"),
        seeds=torch.randint(-2**63, 2**63 - 1, (rows,), device="cuda", generator=g),
        steps=torch.randint(0, 3000, (rows,), device="cuda", generator=g), max_top_k=k)
    for draw in (0, 1, 9, 10):
        assert torch.equal(sampling.sample(logits, params, draw, idx=idx),
                           sampling.filtered_race(logits, idx, params, draw)), draw


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_snake_returns_the_torch_expression(dtype):
    from intone.ops.snake import snake, snake_reference

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(3, 96, 5000, device="cuda", generator=g) * 3).to(dtype)
    alpha = (torch.rand(1, 96, 1, device="cuda", generator=g) * 2 + 0.05).to(dtype)
    got, want = snake(x, alpha), snake_reference(x, alpha)
    assert got.dtype == dtype
    # The same operations in the same dtype; the last bit may differ (fused multiply-adds, sin's
    # implementation), about one value in seven on the H200.
    ulp = torch.finfo(dtype).eps * want.float().abs().clamp(min=1.0)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()
    assert (got == want).float().mean() > 0.5


@pytest.mark.parametrize("name", ["fish-s2", "cosyvoice3"])
def test_fused_elementwise_pieces_replay_bitwise_and_stay_close_to_eager(name, tiny_cache):
    """ar.fuse_elementwise: the compiled norms / RoPE / gate are captured like any kernel (replay ==
    the same eager static step, bit for bit) and change the step's output by float rounding only."""
    from intone.ops import fused

    model = load_model(str(resolve_model_dir(f"tiny:{name}")), device="cuda", dtype=torch.float32)
    dev = torch.device("cuda")
    x = torch.randn(4, model.embed(torch.zeros(1, dtype=torch.long, device=dev),
                                   torch.zeros(1, model.num_codebooks, dtype=torch.long, device=dev)).shape[-1],
                    device=dev)
    kv = KVCache(model.kv_layout, 64, 16, model.dtype, "cuda")
    args = (torch.tensor([3, 7, 1, 0], device=dev), torch.tensor([3, 16 + 7, 32 + 1, 48], device=dev),
            torch.arange(4, device=dev).view(4, 1), torch.tensor([4, 8, 2, 1], device=dev), kv)
    with torch.inference_mode():
        plain = model.forward_decode(x, *args).clone()
        fused.use_compiled(True)
        try:
            eager = model.forward_decode(x, *args).clone()
            blocks = BlockManager(256, 16)
            cache = KVCache(model.kv_layout, 256, 16, model.dtype, "cuda")
            graphed = ModelRunner(model, cache, cuda_graphs=True)
            assert graphed.capture(8, 600).failed == 0
            g = torch.Generator().manual_seed(0)
            batch = _decodes(model, graphed, blocks, [5, 40, 17], g)
            k0, v0 = cache.k.clone(), cache.v.clone()
            a = graphed.run(batch)
            cache.k.copy_(k0), cache.v.copy_(v0)
            b = ModelRunner(model, cache, cuda_graphs=True).run(batch)
        finally:
            fused.use_compiled(False)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.codes, b.codes)
    assert (eager - plain).abs().max().item() <= 1e-4 * max(1.0, plain.abs().max().item())


def _serve(name: str, profile: str, graphs: bool) -> tuple[dict, dict]:
    """Run six seeded requests through an engine core; return each one's spans and its audio."""
    from intone.engine.config import load_profile
    from intone.engine.core import EngineCore
    from intone.protocol import SynthesisRequest

    from intone.ops import fused
    from intone.protocol import VoiceReference

    model = load_model(str(resolve_model_dir(f"tiny:{name}")), device="cuda", dtype=torch.float32)
    # The codec on the core's thread: its batches are then the same in both runs, not timing's choice.
    # A tiny DiT uncompiled, so on SDPA (flex is compiled-only on a GPU); the graphs here are the talker's.
    overrides = {"ar.cuda_graphs": graphs, "device": "cuda", "cosyvoice3.flow.compile": False, "codec.overlap": False,
                 "cosyvoice3.flow.attention": "sdpa"}
    core = EngineCore(model, load_profile(profile, **overrides))
    t = np.arange(24000 * 2) / 24000
    spans, audio = {}, {}
    try:
        # All six admitted by the first step: which step admits a request must not depend on how
        # fast the steps run, or the codec's batches (and their rounding) differ between the runs.
        # Each clip encoded alone: a clip's reference codes depend on the frontend batch it shares
        # (its rounding), and which clips share one depends on timing (seen: a prompt that differed).
        for i in range(6):
            voice = VoiceReference("A reference voice.",
                                   (0.3 * np.sin(2 * np.pi * (140 + 20 * i) * t)).astype(np.float32), 24000)
            params = SamplingParams(seed=i, max_new_tokens=20 + 7 * i)
            core.add_request(SynthesisRequest(f"r{i}", f"Hello graphs number {i}", [voice], params=params))
            deadline = time.monotonic() + 120
            while core.frontend.ready() < i + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert core.frontend.ready() == 6, "the frontend did not prepare the six requests in time"
        while core.has_work():
            for c in core.step():
                assert c.error is None, c.error
                spans.setdefault(c.request_id, []).append((c.start_frame, c.end_frame, c.completion_tokens))
                audio.setdefault(c.request_id, []).append(c.audio)
        if graphs:
            assert core.snapshot()["graph_replays"] > 0 and core.snapshot()["captured_graphs"] > 0
    finally:
        core.close()
        fused.use_compiled(False)  # the profile's ar.fuse_elementwise is process-wide
    return spans, {k: np.concatenate(v) for k, v in audio.items()}


@pytest.mark.parametrize("name,profile", [("fish-s2", "fish-s2-default"), ("cosyvoice3", "cosyvoice3-streaming")])
def test_the_engine_gives_the_same_spans_and_audio_bytes_with_graphs_as_without(name, profile, tiny_cache):
    """Design invariant 2: a replay and the eager step give the same bits, so the whole request does."""
    eager_spans, eager_audio = _serve(name, profile, graphs=False)
    graph_spans, graph_audio = _serve(name, profile, graphs=True)
    assert graph_spans == eager_spans and len(graph_spans) == 6
    for rid, audio in eager_audio.items():
        assert audio.size > 0 and np.array_equal(graph_audio[rid], audio), rid


def test_frontend_graph_copies_replay_side_by_side_with_the_eager_bits():
    """`frontend.workers` > 1: every shape captured once per worker; two threads, each on its own
    stream, replay at the same time and get the eager result's bits from either copy."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda().eval()
    fn = lambda x: net(x)  # noqa: E731
    graphs = FunctionGraphs(replicas=2)
    inputs = [torch.randn(8, 256, device="cuda") for _ in range(6)]
    with torch.no_grad():
        graphs.capture("net", fn, inputs[0])
        eager = [fn(x) for x in inputs]
    assert len(graphs) == 1 and graphs.report.graphs == 1
    results: dict[int, list] = {}

    def worker(w: int) -> None:
        with torch.no_grad(), torch.cuda.stream(torch.cuda.Stream()):
            results[w] = [graphs.run("net", fn, x)[0] for _ in range(20) for x in inputs]
            torch.cuda.current_stream().synchronize()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in range(2):
        for i, out in enumerate(results[w]):
            assert torch.equal(out, eager[i % len(inputs)]), (w, i)
    assert graphs.replays == 240 and graphs.eager == 0


def test_the_graphs_of_one_set_share_their_buffers_and_each_replays_its_eager_bits():
    """Eight shapes of a function captured in one set, largest first (as the vocoder captures), replayed in a
    shuffled order: each replay gives the eager result's bits, and the captured graphs keep about one largest
    shape's inputs and outputs (their shared buffers), not one copy per shape."""
    torch.manual_seed(0)
    net = torch.nn.Linear(1024, 1024).cuda().eval()
    fn = lambda x, y: (net(x) + y, x * 2)  # noqa: E731
    rows = [4024, 4016, 4008, 4000, 1024, 1016, 1008, 1000]
    inputs = {r: (torch.randn(r, 1024, device="cuda"), torch.randn(r, 1024, device="cuda")) for r in rows}
    graphs = FunctionGraphs()
    with torch.no_grad():
        eager = {r: fn(*inputs[r]) for r in rows}
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for r in rows:
            graphs.capture("net", fn, *inputs[r])
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        assert graphs.report.graphs == len(rows) and graphs.report.failed == 0
        largest = 4 * 4024 * 1024 * 4  # two inputs and two outputs of the largest shape, fp32
        assert kept < 2 * largest, kept  # one copy per shape would keep ~5x it
        order = rows * 3
        np.random.default_rng(1).shuffle(order)
        for r in order:
            out = graphs.run("net", fn, *inputs[r])
            assert all(torch.equal(o, e) for o, e in zip(out, eager[r])), r
    assert graphs.replays == len(order) and graphs.eager == 0


@pytest.mark.gpu
@pytest.mark.parametrize("high", [False, True])
def test_the_loop_stream_takes_the_highest_priority_only_when_asked(tiny_cache, high):
    """`ar.high_priority`: the engine loop's stream, where the AR steps and their graphs run, at the
    device's highest priority (so its kernels' blocks go before the codec's waiting ones); else the default."""
    from intone.engine.config import load_profile
    from intone.engine.loading import load_for_profile

    before = torch.cuda.current_stream()
    try:
        load_for_profile("tiny:fish-s2", load_profile("fish-s2-high-concurrency", device="cuda",
                                                      **{"ar.high_priority": high}))
        stream = torch.cuda.current_stream()
        assert stream != before
        assert (stream.priority < 0) == high  # CUDA's priorities: 0 the default, negative the more urgent
    finally:
        torch.cuda.set_stream(before)
