"""CosyVoice3 flow decoder on a tiny config: checkpoint layout, fixed noise, shapes, the streaming
chunk property, batching, the attention mask and RoPE layout. Fidelity to the official code itself is
checked outside the repo (bit-exact in fp32/fp64/bf16 on CPU at the time of writing)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.engine.cuda_graphs import FunctionGraphs
from intone.models.cosyvoice3.dit import DiTConfig, RotaryEmbedding, apply_rope
from intone.models.cosyvoice3.flow import (GRAPH_FRAME_BUCKET, CosyFlow, FlowConfig, FlowRequest, cosine_euler_steps,
                                          graph_rows, graph_shape, pad_solve_inputs)
from intone.models.cosyvoice3.vocoder import compile_batches, compile_dit, store_for_autocast

TINY = FlowConfig(pre_lookahead_channels=32, dit=DiTConfig(dim=64, depth=2, heads=4, dim_head=16))
CHUNK = TINY.dit.static_chunk_size


def make_flow(dtype=torch.float64, seed=0) -> CosyFlow:
    """Random non-trivial weights (the gates are not zero-initialised in a real checkpoint either)."""
    flow = CosyFlow(TINY).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in flow.parameters():
            std = 0.3 / max(1, p.shape[-1]) ** 0.5 if p.ndim > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return flow.to(dtype)


@pytest.fixture(scope="module")
def flow():
    return make_flow()


def request(g, prompt=10, tokens=30, mel=None, streaming=True, finalize=True, dtype=torch.float64):
    return FlowRequest(
        tokens=torch.randint(0, TINY.vocab_size, (tokens,), generator=g),
        prompt_tokens=torch.randint(0, TINY.vocab_size, (prompt,), generator=g),
        prompt_mel=torch.randn(2 * prompt if mel is None else mel, 80, generator=g).to(dtype),
        speaker=(3 * torch.randn(192, generator=g)).to(dtype),
        streaming=streaming,
        finalize=finalize,
    )


def official_keys(depth: int) -> set[str]:
    """flow.pt keys as the official module tree names them (CausalMaskedDiffWithDiT, read off the source)."""
    est = "decoder.estimator."
    keys = {
        "input_embedding.weight",
        "spk_embed_affine_layer.weight", "spk_embed_affine_layer.bias",
        "pre_lookahead_layer.conv1.weight", "pre_lookahead_layer.conv1.bias",
        "pre_lookahead_layer.conv2.weight", "pre_lookahead_layer.conv2.bias",
        est + "rotary_embed.inv_freq",  # x-transformers registers it as a persistent buffer
    }
    layers = ["time_embed.time_mlp.0", "time_embed.time_mlp.2", "input_embed.proj",
              "input_embed.conv_pos_embed.conv1.0", "input_embed.conv_pos_embed.conv2.0", "norm_out.linear", "proj_out"]
    for i in range(depth):
        block = f"transformer_blocks.{i}."
        layers += [block + name for name in ("attn_norm.linear", "attn.to_q", "attn.to_k", "attn.to_v",
                                             "attn.to_out.0", "ff.ff.0.0", "ff.ff.2")]
    return keys | {est + layer + suffix for layer in layers for suffix in (".weight", ".bias")}


def test_state_dict_keys_are_the_official_ones():
    flow = CosyFlow(TINY)
    assert set(flow.state_dict()) == official_keys(TINY.dit.depth)
    flow.load_state_dict(make_flow(seed=1).state_dict(), strict=True)


def test_default_config_is_the_real_model():
    cfg = FlowConfig()
    assert (cfg.vocab_size, cfg.spk_embed_dim, cfg.pre_lookahead_channels, cfg.noise_frames) == (6561, 192, 1024, 15000)
    assert (cfg.dit.dim, cfg.dit.depth, cfg.dit.heads, cfg.dit.dim_head, cfg.dit.ff_mult) == (1024, 22, 16, 64, 2)


def test_noise_is_seed0_randn_and_not_a_checkpoint_key():
    torch.manual_seed(1234)  # a private generator: the global RNG state must not matter
    flow = CosyFlow(TINY)
    expected = torch.randn(1, 80, TINY.noise_frames, generator=torch.Generator().manual_seed(0))
    assert flow.decoder.noise.dtype == torch.float32
    assert torch.equal(flow.decoder.noise, expected)
    assert not any("noise" in k for k in flow.state_dict())
    flow.half().double()  # module dtype casts must not round the stored noise
    assert torch.equal(flow.decoder.noise, expected)


@pytest.mark.parametrize("finalize", [True, False])
@pytest.mark.parametrize("prompt,mel", [(0, 0), (12, 24), (12, 21)])
def test_output_shapes(flow, finalize, prompt, mel):
    g = torch.Generator().manual_seed(3)
    out = flow.inference([request(g, prompt=prompt, tokens=20, mel=mel, finalize=finalize)])[0]
    conditioned = 2 * (prompt + 20 - (0 if finalize else TINY.pre_lookahead_len))
    assert out.shape == (80, conditioned - mel) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


def stable_frames(prompt: int, tokens: int) -> int:
    """Output frames (after the M = 2P prompt frames) inside completed chunks of a non-final call."""
    conditioned = 2 * (prompt + tokens - TINY.pre_lookahead_len)
    return conditioned // CHUNK * CHUNK - 2 * prompt


@settings(max_examples=4, deadline=None)
@given(prompt=st.integers(0, 30), tokens=st.integers(26, 50), more=st.integers(1, 30), finalize=st.booleans())
def test_streaming_frames_in_completed_chunks_never_change(flow, prompt, tokens, more, finalize):
    g = torch.Generator().manual_seed(prompt * 1000 + tokens)
    full = request(g, prompt=prompt, tokens=tokens + more, finalize=finalize)
    part = FlowRequest(full.tokens[:tokens], full.prompt_tokens, full.prompt_mel, full.speaker, True, False)
    before, after = flow.inference([part])[0], flow.inference([full])[0]
    n = stable_frames(prompt, tokens)
    assert torch.equal(before[:, : max(n, 0)], after[:, : max(n, 0)])


def test_chunks_are_counted_from_the_prompt_start(flow):
    # P=17, M=34, N=50 non-final: 128 conditioned frames, so chunks [0,50) [50,100) are complete and
    # frames 100..127 (output 66..93) are not. Chunks counted from the output start (frame 34) would
    # complete only [34,84), and output frames 50..65 would move too.
    g = torch.Generator().manual_seed(5)
    full = request(g, prompt=17, tokens=90, finalize=True)
    part = FlowRequest(full.tokens[:50], full.prompt_tokens, full.prompt_mel, full.speaker, True, False)
    before, after = flow.inference([part])[0], flow.inference([full])[0]
    assert stable_frames(17, 50) == 66
    assert torch.equal(before[:, :66], after[:, :66])
    assert (before[:, 66:] - after[:, 66:94]).abs().amax(dim=0).min() > 0  # every later frame moves


def test_attention_mask_layout(flow):
    lengths, streaming = torch.tensor([130, 70, 120]), torch.tensor([True, True, False])
    mask, valid = flow.decoder.estimator.attention_mask(lengths, streaming, 130)
    assert mask.shape == (3, 1, 130, 130) and mask.dtype == torch.bool
    for b in range(3):
        for i in range(130):
            end = (i // CHUNK + 1) * CHUNK if streaming[b] else 130
            expected = torch.arange(130) < min(end, int(lengths[b]))
            assert torch.equal(mask[b, 0, i], expected)
        assert torch.equal(valid[b], torch.arange(130) < lengths[b])


@settings(max_examples=3, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(4, 40), st.booleans(), st.booleans()), min_size=2, max_size=3))
def test_batched_rows_equal_each_row_alone(flow, rows):
    # fp64: padding changes the matrix shapes, so BLAS may block reductions differently; that is
    # ulp-level (observed: exact) and stays far below 1e-12 after 10 Euler steps.
    g = torch.Generator().manual_seed(len(rows))
    reqs = [request(g, prompt=p, tokens=n, streaming=s, finalize=f) for p, n, s, f in rows]
    for alone, batched in zip((flow.inference([r])[0] for r in reqs), flow.inference(reqs)):
        assert alone.shape == batched.shape
        torch.testing.assert_close(batched, alone, rtol=0, atol=1e-12)


def test_a_solve_paused_at_each_euler_step_for_other_solves_gives_its_own_mel(flow):
    """The codec worker's preemption: at each pause point of a solve, whole solves of other requests
    run; the paused solve's mel and theirs are what each gets alone (fp64, exact)."""
    g = torch.Generator().manual_seed(11)
    backlog = [request(g, prompt=12, tokens=60, finalize=False), request(g, prompt=5, tokens=40)]
    urgent = [request(g, prompt=9, tokens=20, finalize=False)]
    alone, urgent_alone = flow.inference(backlog), flow.inference(urgent)
    during = []
    paused = flow.inference(backlog, pause=lambda: during.append(flow.inference(urgent)))
    assert len(during) == TINY.n_timesteps
    for got, want in zip(paused + [mel for mels in during for mel in mels], alone + urgent_alone * len(during)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_runs_and_roughly_agrees(flow, dtype):
    g = torch.Generator().manual_seed(9)
    req = request(g, prompt=8, tokens=40, streaming=True, finalize=False)
    ref = flow.inference([req])[0]
    low = make_flow(dtype).inference([req])[0]
    assert low.dtype == torch.float32 and low.shape == ref.shape
    assert (low - ref).abs().max() < {torch.float32: 1e-4}.get(dtype, 0.2)


def test_cosine_euler_schedule():
    steps = list(cosine_euler_steps(10, torch.device("cpu"), torch.float64))
    assert len(steps) == 10
    ts = torch.stack([t for t, _ in steps])
    expected = 1 - torch.cos(torch.arange(10, dtype=torch.float64) / 10 * math.pi / 2)
    torch.testing.assert_close(ts, expected)
    assert abs(float(steps[-1][0] + steps[-1][1]) - 1.0) < 1e-15


def test_rope_rotates_interleaved_pairs_of_head0_only():
    rope = RotaryEmbedding(4, 100.0)
    cos, sin = rope(3)
    x = torch.randn(1, 3, 12, dtype=torch.float64)  # 3 heads of 4 flattened: only channels 0..3 rotate
    out = apply_rope(x, (cos.double(), sin.double()))
    assert torch.equal(out[..., 4:], x[..., 4:])
    for pos in range(3):
        for pair, freq in enumerate((1.0, 0.1)):  # 1 / 100 ** (2i / 4)
            a, b = x[0, pos, 2 * pair], x[0, pos, 2 * pair + 1]
            c, s = math.cos(pos * freq), math.sin(pos * freq)
            torch.testing.assert_close(out[0, pos, 2 * pair: 2 * pair + 2], torch.stack([a * c - b * s, b * c + a * s]))


@pytest.mark.gpu
def test_cuda_matches_cpu():
    cpu = make_flow()
    gpu = make_flow().cuda()
    g = torch.Generator().manual_seed(11)
    reqs = [request(g, prompt=10, tokens=50, streaming=True, finalize=False), request(g, prompt=0, tokens=20)]
    for a, b in zip(cpu.inference(reqs), gpu.inference(reqs)):  # fp64 inside, fp32 out: 1 fp32 ulp
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=1e-6)
    bf16 = make_flow(torch.bfloat16).cuda().inference(reqs)
    assert all(m.is_cuda and m.dtype == torch.float32 and torch.isfinite(m).all() for m in bf16)


@pytest.mark.parametrize("kernel", ["sdpa", "varlen"])
def test_dit_weights_stored_in_the_autocast_dtype_give_the_same_bits(kernel):
    """`make_vocoder` stores the DiT's weights in the flow's autocast dtype (GPU) instead of letting autocast
    cast them in every pass: each feeds a matmul or a convolution that autocast runs in that dtype, so the mel
    is the same to the bit (here under the CPU's bf16 autocast, whole and streamed rows; the RoPE table and the
    flow outside the DiT stay fp32)."""
    g = torch.Generator().manual_seed(3)
    reqs = [request(g, prompt=10, tokens=40, streaming=False, dtype=torch.float32),
            request(g, prompt=5, tokens=30, streaming=True, finalize=False, dtype=torch.float32),
            request(g, prompt=7, tokens=22, streaming=False, dtype=torch.float32)]
    per_pass, stored = make_flow(torch.float32), make_flow(torch.float32)
    store_for_autocast(stored.decoder.estimator, torch.bfloat16)
    assert stored.decoder.estimator.rotary_embed.inv_freq.dtype == torch.float32
    wide = make_flow(torch.float64)  # autocast leaves float64 alone: so does the store
    store_for_autocast(wide.decoder.estimator, torch.bfloat16)
    assert all(p.dtype == torch.float64 for p in wide.parameters())
    for flow in (per_pass, stored):
        flow.decoder.estimator.attention_kernel = kernel
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        want, got = per_pass.inference(reqs), stored.inference(reqs)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)


@settings(max_examples=4, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(4, 90), st.booleans(), st.booleans()), min_size=1, max_size=4))
def test_flex_attention_gives_the_sdpa_mel(flow, rows):
    """`cosyvoice3.flow.attention: flex`: the block mask hides exactly what the dense mask hides, for
    streamed and whole rows of any padding (float64, eager: to 1e-12)."""
    g = torch.Generator().manual_seed(len(rows))
    reqs = [request(g, prompt=p, tokens=n, streaming=s, finalize=f) for p, n, s, f in rows]
    dense = flow.inference(reqs)
    flow.decoder.estimator.attention_kernel = "flex"
    try:
        blocks = flow.inference(reqs)
    finally:
        flow.decoder.estimator.attention_kernel = "sdpa"
    for got, want in zip(blocks, dense):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# each unit, each kernel, each wrapper
@pytest.mark.parametrize("unit,kernel,wrapper", [("block", "sdpa", "cpp"), ("dit", "flex", "python")])
def test_a_compiled_dit_gives_the_eager_mel(unit, kernel, wrapper):
    """`cosyvoice3.flow.compile_unit`: whichever part is compiled, a batch of streamed and whole rows of
    different lengths gets the eager flow's mel (float32: to rounding); a second batch of other
    shapes reuses the compiled code (dynamic shapes), with either attention kernel (flex: new block
    masks for new lengths, no new compile) and either of inductor's wrappers (`compile_wrapper`)."""
    flow = make_flow(torch.float32, seed=3)
    flow.decoder.estimator.attention_kernel = kernel
    g = torch.Generator().manual_seed(5)
    # mel frames: 60-124 (flex: one 128-frame block), 140-154 and 264-290 (several; chunk edges across blocks)
    batches = [[request(g, 8, 30, streaming=True, finalize=False, dtype=torch.float32),
                request(g, 12, 21, streaming=False, dtype=torch.float32)],
               [request(g, 10, 44 + i, streaming=bool(i % 2), dtype=torch.float32) for i in range(3)],
               [request(g, 5, 25 + i, streaming=bool(i % 2), dtype=torch.float32) for i in range(2)],
               [request(g, 70, 62 + 3 * i, streaming=not i % 2, finalize=bool(i), dtype=torch.float32)
                for i in range(3)]]
    eager = [flow.inference(b) for b in batches]
    counters = torch._dynamo.utils.counters
    graphs, traces = counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]
    compile_dit(flow.decoder.estimator, unit, wrapper)
    for batch, want in zip(batches, eager):
        for got, ref in zip(flow.inference(batch), want):
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    # compiled for real, once: one graph whatever the unit (the blocks share theirs) or the attention
    # (flex pads a one-block call to two), none for the later batches
    assert counters["stats"]["unique_graphs"] - graphs == 1
    # traced once: a symbolic float made dynamo trace the DiT twice, the first trace thrown away (`ops.compiling`)
    assert counters["aot_autograd"]["total"] - traces == 1


@settings(max_examples=6, deadline=None)  # codec graphs are not shipped: a lighter property run
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(4, 40), st.booleans(), st.booleans()), min_size=1, max_size=5),
       st.integers(0, 3), st.integers(0, 2))
def test_a_solve_padded_to_its_graph_shape_leaves_every_valid_frame_as_it_was(flow, rows, more_rows, more_buckets):
    """What the flow's CUDA graphs rely on: the ODE solve at a bucket shape (rows copied from row 0,
    zero frames past every length) gives each real row's valid frames exactly what the unpadded solve
    gives them (float64), streaming rows and finalized ones alike."""
    g = torch.Generator().manual_seed(len(rows))
    reqs = [request(g, prompt=p, tokens=n, streaming=s, finalize=f) for p, n, s, f in rows]
    inputs = flow.solve_inputs(reqs)
    shape_rows, shape_frames = graph_shape(len(reqs) + more_rows, inputs[0].shape[1])
    shape_frames += more_buckets * GRAPH_FRAME_BUCKET
    padded = pad_solve_inputs(*inputs, shape_rows, shape_frames)
    assert padded[0].shape[:2] == (shape_rows, shape_frames)
    with torch.inference_mode():
        plain, wide = flow.decoder(*inputs), flow.decoder(*padded)
    for i, n in enumerate(flow.mel_lengths(reqs)):
        torch.testing.assert_close(wide[i, :n], plain[i, :n], rtol=0, atol=1e-12)


def test_graph_rows_waste_little_on_large_calls():
    """Up to 8 rows a power of two, then multiples of 8: never fewer rows than asked, and a large
    call pads by fewer than 8 rows (a power of two would pad 33 rows to 64)."""
    for rows in range(1, 200):
        padded = graph_rows(rows)
        assert padded >= rows and (padded - rows < 8 if rows > 8 else padded & (padded - 1) == 0)
    assert [graph_rows(n) for n in (1, 3, 5, 9, 33, 64)] == [1, 4, 8, 16, 40, 64]


def test_split_calls_are_priced_at_their_graph_shape_when_graphed(cosy64):
    """With the flow's graphs, `call_cost`'s split prices a call at the shape its graph pads it to (rows to the
    graph's rows, mel frames to a multiple of 128); beyond the graphs, at rows x longest."""
    from intone.engine.config import load_profile

    profile = load_profile("cosyvoice3-streaming", device="cpu", **{"cosyvoice3.flow.cuda_graphs": True,
                                                                    "cosyvoice3.flow.attention": "sdpa",
                                                                    "cosyvoice3.flow.cache": False})
    graphed = cosy64.make_vocoder(profile.codec, profile.cosyvoice3)
    plain = cosy64.make_vocoder(profile.codec, load_profile("cosyvoice3-streaming", device="cpu").cosyvoice3)
    assert graphed._graph_cost(3, 100) == 4 * 256 // 2  # 3 rows -> 4; 200 mel frames -> 256
    assert graphed._graph_cost(9, 64) == 16 * 128 // 2
    assert graphed._graph_cost(2, 600) == 2 * 600  # 1200 frames: beyond the graphs, its own shape
    assert plain._graph_cost(3, 100) == 3 * 100


def test_graphed_inference_on_a_cpu_runs_the_unpadded_solve(flow):
    """Off the GPU nothing is captured: `inference` with graphs runs the plain solve and counts it eager."""
    g = torch.Generator().manual_seed(5)
    reqs = [request(g, prompt=6, tokens=20), request(g, prompt=9, tokens=33, streaming=False)]
    graphs = FunctionGraphs()
    flow.capture_solve(reqs, graphs)
    got = flow.inference(reqs, graphs)
    want = flow.inference(reqs)
    assert len(graphs) == 0 and graphs.eager == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast,compiled,kernel,tolerance", [
    (None, False, "sdpa", 1e-4), (torch.bfloat16, False, "sdpa", 5e-2), (torch.bfloat16, True, "sdpa", 5e-2),
    (torch.bfloat16, True, "flex", 5e-2)])
def test_the_flow_solve_replayed_from_its_graph_gives_the_eager_mel(autocast, compiled, kernel, tolerance, no_tf32):
    """A captured solve (tiny flow on the GPU) against the eager one at the unpadded shape, for a batch
    that is padded in rows and frames: the same mel to fp32 rounding, and to bf16 rounding under the
    shipped streaming profile's settings (bf16 autocast, a compiled DiT, flex attention, whose block mask
    the graph builds from the rows' lengths at each replay; autocast's cast cache off, as the codec stage
    runs it)."""
    assert torch.cuda.is_available()
    flow = make_flow(torch.float32).cuda()
    flow.decoder.estimator.attention_kernel = kernel
    if compiled:
        compile_dit(flow.decoder.estimator, "dit")
    g = torch.Generator().manual_seed(7)
    reqs = [request(g, prompt=p, tokens=n, streaming=s, dtype=torch.float32) for p, n, s in
            ((8, 30, True), (12, 41, False), (5, 17, True))]
    reqs = [FlowRequest(r.tokens.cuda(), r.prompt_tokens.cuda(), r.prompt_mel.cuda(), r.speaker.cuda(), r.streaming,
                        r.finalize) for r in reqs]
    graphs = FunctionGraphs()

    def under_autocast():  # as the codec stage runs the flow: no cast cache
        return torch.autocast("cuda", autocast or torch.float32, enabled=autocast is not None, cache_enabled=False)

    with under_autocast():
        flow.capture_solve(reqs, graphs)
    assert len(graphs) == 1
    with under_autocast():
        replayed, eager = flow.inference(reqs, graphs), flow.inference(reqs)
        again = flow.inference(reqs, graphs)
    steps = flow.decoder.n_timesteps  # one replay per Euler step
    assert graphs.replays == 2 * steps and graphs.eager == 0
    for a, b, c in zip(replayed, eager, again):
        assert torch.equal(a, c)  # a replay is deterministic
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
    # Other lengths and streaming flags at the same padded shape: the replay masks them as they are now
    # (the attention mask is built inside the graph from the rows' lengths), not as at the capture.
    other = [request(g, prompt=p, tokens=n, streaming=s, dtype=torch.float32) for p, n, s in
             ((6, 44, False), (10, 26, True), (9, 33, True))]
    other = [FlowRequest(r.tokens.cuda(), r.prompt_tokens.cuda(), r.prompt_mel.cuda(), r.speaker.cuda(), r.streaming,
                         r.finalize) for r in other]
    with under_autocast():
        replayed, eager = flow.inference(other, graphs), flow.inference(other)
    assert graphs.replays == 3 * steps and graphs.eager == 0
    for a, b in zip(replayed, eager):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def gpu_batches(g, batches) -> list[list[FlowRequest]]:
    """fp32 requests on the GPU, a batch per tuple of (prompt tokens, tokens, streamed) rows; whole rows finalize."""
    def on_gpu(r):
        return FlowRequest(r.tokens.cuda(), r.prompt_tokens.cuda(), r.prompt_mel.cuda(), r.speaker.cuda(),
                           r.streaming, r.finalize)

    return [[on_gpu(request(g, prompt=p, tokens=n, streaming=s, finalize=not s, dtype=torch.float32))
             for p, n, s in rows] for rows in batches]


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_flex_attention_on_the_gpu_gives_the_sdpa_mel(no_tf32, packed):
    """`cosyvoice3.flow.attention: flex` as the stage runs it (compiled DiT, bf16 autocast without the cast
    cache; padded rows, or packed: `cosyvoice3.flow.packed`) against the dense-mask SDPA flow on padded rows,
    eager, for streamed and whole rows of different lengths: the same mel to bf16 rounding; a second batch
    of other lengths compiles nothing new."""
    flow = make_flow(torch.float32).cuda()
    g = torch.Generator().manual_seed(11)

    batches = gpu_batches(g, (((8, 60, True), (12, 41, False), (5, 97, True)), ((20, 130, True), (3, 33, False))))
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        dense = [flow.inference(b) for b in batches]
        flow.decoder.estimator.attention_kernel, flow.decoder.packed = "flex", packed
        torch._dynamo.reset()  # an earlier test's compile of the same code would otherwise be reused
        compile_dit(flow.decoder.estimator, "dit")
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        blocks = [flow.inference(b) for b in batches]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    for got_batch, want_batch in zip(blocks, dense):
        for got, want in zip(got_batch, want_batch):
            assert got.shape == want.shape
            assert (got - want).abs().max() < 5e-2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 700), st.booleans()), min_size=1, max_size=4), st.integers(0, 300),
       st.sampled_from([50, 0, 128, 37]))
def test_the_flex_block_mask_has_the_blocks_create_block_mask_finds(rows, extra, chunk):
    """The block lists built from the lengths equal those torch's create_block_mask finds by evaluating
    every (query, key) pair: the same partial and the same fully visible key blocks per query block."""
    from dataclasses import replace

    from torch.nn.attention.flex_attention import create_block_mask

    from intone.models.cosyvoice3.dit import DiT

    dit = DiT(replace(TINY.dit, static_chunk_size=chunk))
    dit.attention_kernel = "flex"
    lengths = torch.tensor([n for n, _ in rows])
    streaming = torch.tensor([s for _, s in rows])
    total = int(lengths.max()) + extra
    ours, _ = dit.attention_mask(lengths, streaming, total)
    theirs = create_block_mask(ours.mask_mod, len(rows), None, total, total, device="cpu")

    def block_sets(count, indices):
        return [[set(indices[b, 0, i, : count[b, 0, i]].tolist()) for i in range(count.shape[-1])]
                for b in range(count.shape[0])]

    assert block_sets(ours.kv_num_blocks, ours.kv_indices) == block_sets(theirs.kv_num_blocks, theirs.kv_indices)
    assert block_sets(ours.full_kv_num_blocks, ours.full_kv_indices) == \
        block_sets(theirs.full_kv_num_blocks, theirs.full_kv_indices)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(4, 90), st.booleans(), st.booleans()), min_size=1, max_size=5),
       st.sampled_from(["sdpa", "flex"]))
def test_packed_rows_give_the_padded_mel(flow, rows, kernel):
    """`cosyvoice3.flow.packed`: the DiT over the rows' valid frames end to end gives every row the mel
    the right-padded solve gives it: streamed and whole rows, any lengths (float64, eager: to 1e-12)."""
    g = torch.Generator().manual_seed(len(rows))
    reqs = [request(g, prompt=p, tokens=n, streaming=s, finalize=f) for p, n, s, f in rows]
    flow.decoder.estimator.attention_kernel = kernel
    try:
        padded = flow.inference(reqs)
        flow.decoder.packed = True
        packed = flow.inference(reqs)
    finally:
        flow.decoder.estimator.attention_kernel, flow.decoder.packed = "sdpa", False
    for got, want in zip(packed, padded):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(4, 90), st.booleans(), st.booleans()), min_size=1, max_size=5))
def test_varlen_attention_gives_the_padded_mel(flow, rows):
    """`cosyvoice3.flow.attention: varlen`: a call of whole rows runs packed, each row attending only to
    itself; a call with a streamed row runs padded under the dense mask. Either way every row gets the mel
    of the padded SDPA solve (float64, eager: the row-by-row reference of the kernel, to 1e-12)."""
    g = torch.Generator().manual_seed(len(rows))
    reqs = [request(g, prompt=p, tokens=n, streaming=s, finalize=f) for p, n, s, f in rows]
    padded = flow.inference(reqs)
    flow.decoder.estimator.attention_kernel = "varlen"
    try:
        assert flow.runs_packed(reqs) == (not any(r.streaming for r in reqs))
        got = flow.inference(reqs)
    finally:
        flow.decoder.estimator.attention_kernel = "sdpa"
    for a, b in zip(got, padded):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("wrapper", ["python", "cpp"])
def test_compiled_varlen_attention_on_the_gpu_gives_the_sdpa_mel(no_tf32, wrapper):
    """The varlen kernel as the full-response stage runs it (compiled DiT, bf16 autocast, FlashAttention's
    variable-length kernel on packed rows) against the dense-mask SDPA flow on padded rows: the same mel
    to bf16 rounding, for whole rows of different lengths and a call with a streamed row (padded, dense
    mask); after the start-up's compile calls (`compile_batches`) no call compiles anything (session 24:
    a packed solve first compiled mid-service, then again per new size, stalled a server for minutes)."""
    flow = make_flow(torch.float32).cuda()
    g = torch.Generator().manual_seed(12)

    batches = gpu_batches(g, (((8, 60, False), (12, 41, False), (5, 97, False)), ((20, 130, False), (3, 33, False)),
                              ((9, 70, True), (4, 50, False))))
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        dense = [flow.inference(b) for b in batches]
        flow.decoder.estimator.attention_kernel = "varlen"
        torch._dynamo.reset()
        compile_dit(flow.decoder.estimator, "dit", wrapper)
        for batch in compile_batches(flow, torch.device("cuda")):
            flow.inference(batch)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        got = [flow.inference(b) for b in batches]
        got.append(flow.inference(batches[0][1:]))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    for got_batch, want_batch in zip(got, dense + [dense[0][1:]]):
        for a, b in zip(got_batch, want_batch):
            assert a.shape == b.shape
            assert (a - b).abs().max() < 5e-2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.booleans()), min_size=1, max_size=5), st.sampled_from([50, 0, 37]))
def test_the_packed_block_mask_misses_no_visible_pair_and_skips_no_hidden_one(rows, chunk):
    """The packed block mask against create_block_mask's evaluation of every pair: each block holding a
    visible pair is listed (partial or full), and exactly the blocks where every pair is visible are full
    (the mask is not applied there)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from intone.models.cosyvoice3.packing import packing

    ours = packing([n for n, _ in rows], [s for _, s in rows], 400, chunk, 30, "flex", torch.device("cpu")).mask
    size = ours.seq_lengths[0]
    theirs = create_block_mask(ours.mask_mod, 1, None, size, size, device="cpu")

    def block_sets(count, indices):
        return [set(indices[0, 0, i, : count[0, 0, i]].tolist()) for i in range(count.shape[-1])]

    full, partial = block_sets(ours.full_kv_num_blocks, ours.full_kv_indices), block_sets(ours.kv_num_blocks, ours.kv_indices)
    their_full = block_sets(theirs.full_kv_num_blocks, theirs.full_kv_indices)
    their_any = [a | b for a, b in zip(their_full, block_sets(theirs.kv_num_blocks, theirs.kv_indices))]
    assert full == their_full
    assert all(want <= f | p for want, f, p in zip(their_any, full, partial))
