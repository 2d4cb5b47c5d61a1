"""`cosyvoice3.flow.cache`: a stream's hops solved against the keys, values and embedding context its earlier
hops kept give the official whole-prefix solve's new frames (float64, tiny flow)."""

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.models.cosyvoice3.flow import FlowRequest
from intone.models.cosyvoice3.flow_cache import reference_ahead, solve_continued
from intone.models.cosyvoice3.packing import continued_packing

from .official_stream import bounded_final_mel
from .test_flow import CHUNK, TINY, make_flow, request

LOOKAHEAD = TINY.pre_lookahead_len


# Flex attention runs unfused on a CPU, every score materialised, and no shipped profile uses it: its costliest
# CPU cases here keep one (the final hop behind one cache); the GPU tests below and the streamed flex test
# (test_streaming.py) cover the rest.
FLEX_ON_CPU = "flex attention on a CPU: one case of this test (CI time)"


@pytest.fixture(scope="module", params=["sdpa", "flex", "varlen"])
def flow(request):
    f = make_flow()
    f.decoder.estimator.attention_kernel = request.param
    return f


@pytest.fixture(scope="module", params=["sdpa", "varlen"])
def sdpa_flow(request):
    f = make_flow()  # the property test's many examples on the faster CPU kernels (flex: the tests below)
    f.decoder.estimator.attention_kernel = request.param
    return f


def hop_ends(prompt: int, total: int, hop: int, chunk: int = CHUNK) -> list[int]:
    """Token ends of a stream's hops: the first padded so that prompt + end fills whole chunks, then `hop`
    tokens each (a chunk boundary again), the last at `total` (final)."""
    per_chunk = chunk // TINY.token_mel_ratio
    end = -(-(prompt + 1) // per_chunk) * per_chunk - prompt
    ends = []
    while end + LOOKAHEAD < total:
        ends.append(end)
        end += hop
    return ends + [total]


def part(full: FlowRequest, end: int, final: bool) -> FlowRequest:
    n = end if final else end + LOOKAHEAD
    return FlowRequest(full.tokens[:n], full.prompt_tokens, full.prompt_mel, full.speaker, not final, final)


def assert_close(got, want):
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@settings(max_examples=3, deadline=None)
@given(prompt=st.integers(0, 30), total=st.integers(30, 120), hop=st.sampled_from([CHUNK // 2, CHUNK]))
def test_a_streams_hops_continued_from_its_cache_give_the_whole_prefix_solves(sdpa_flow, prompt, total, hop):
    flow = sdpa_flow
    g = torch.Generator().manual_seed(prompt * 1000 + total)
    full = request(g, prompt=prompt, tokens=total, finalize=True)
    ends, cache, done = hop_ends(prompt, total, hop), None, 0
    for i, end in enumerate(ends):
        final = i == len(ends) - 1
        job = part(full, end, final)
        want = flow.inference([job])[0]
        (mel,), (kept,) = solve_continued(flow, [job], [None if final else cache], [not final])
        # the official hop's new frames: from the cache's end (a non-final hop) or the prompt's (the final one)
        new_from = 0 if final or cache is None else cache.frames - 2 * prompt
        assert_close(mel, want[:, new_from:])
        assert (kept is None) == final
        if not final:
            assert kept.frames == 2 * (prompt + end) and kept.frames % CHUNK == 0
            assert kept.keys_values().shape[4] == kept.frames
            cache, done = kept, end
    assert done == ends[-2] if len(ends) > 1 else cache is None


def test_rows_of_every_kind_share_one_continued_solve(flow):
    """One call: a stream's first hop, two streams' later hops with caches of different lengths, a final
    hop and a whole response; each row gets what it gets alone (and its own cache), with the pause
    called after each Euler step."""
    if flow.decoder.estimator.attention_kernel == "flex":
        pytest.skip(FLEX_ON_CPU)
    g = torch.Generator().manual_seed(3)
    fulls = [request(g, prompt=p, tokens=n, finalize=True) for p, n in ((7, 90), (20, 100), (3, 110), (12, 60), (5, 40))]
    caches = []
    for full, hops in zip(fulls[1:3], (1, 2)):  # stream 1 after one hop, stream 2 after two
        ends = hop_ends(len(full.prompt_tokens), len(full.tokens), CHUNK // 2)
        cache = None
        for end in ends[:hops]:
            cache = solve_continued(flow, [part(full, end, False)], [cache], [True])[1][0]
        caches.append((cache, ends[hops]))
    p0 = len(fulls[0].prompt_tokens)
    jobs = [part(fulls[0], hop_ends(p0, 90, CHUNK // 2)[0], False),
            part(fulls[1], caches[0][1], False), part(fulls[2], caches[1][1], False),
            part(fulls[3], 60, True), fulls[4]]
    given = [None, caches[0][0], caches[1][0], None, None]
    keep = [True, True, True, False, False]
    paused = []
    mels, kept = solve_continued(flow, jobs, given, keep, pause=lambda: paused.append(1))
    assert len(paused) == TINY.n_timesteps
    for job, cache, k, mel, out in zip(jobs, given, keep, mels, kept):
        alone = solve_continued(flow, [job], [cache], [k])
        assert_close(mel, alone[0][0])
        want = flow.inference([job])[0]
        assert_close(mel, want[:, (cache.frames - job.prompt_mel.shape[0]) if cache else 0:])
        assert (out is None) == (not k)
        if k:
            torch.testing.assert_close(out.keys_values(), alone[1][0].keys_values(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("chunk", [CHUNK, 20])
def test_packed_continued_hops_keep_the_padded_solves_caches(chunk):
    """The varlen kernel's packed continued solve keeps the caches the padded one keeps (keys, values and the
    convolutions' context, float64), for rows with and without caches in one call, hops of one chunk and of
    two, and (chunks of 20 frames) hops shorter than the convolutions' 30 frames of context."""
    padded, packed = make_flow(), make_flow()
    for flow in (padded, packed):
        flow.decoder.estimator.config = replace(flow.decoder.estimator.config, static_chunk_size=chunk)
    packed.decoder.estimator.attention_kernel = "varlen"
    g = torch.Generator().manual_seed(9)
    fulls = [request(g, prompt=p, tokens=n, finalize=True) for p, n in ((6, 90), (17, 100), (2, 70))]
    hops = [hop_ends(len(f.prompt_tokens), len(f.tokens), h * chunk // CHUNK, chunk)
            for f, h in zip(fulls, (CHUNK // 2, CHUNK, CHUNK // 2))]
    caches = {"padded": [None] * 3, "packed": [None] * 3}
    for h in range(2):
        jobs = [part(f, ends[h], False) for f, ends in zip(fulls, hops)]
        for name, flow in (("padded", padded), ("packed", packed)):
            caches[name] = solve_continued(flow, jobs, caches[name], [True] * 3)[1]
        for a, b in zip(caches["padded"], caches["packed"]):
            assert a.frames == b.frames
            torch.testing.assert_close(b.keys_values(), a.keys_values(), rtol=0, atol=1e-12)
            torch.testing.assert_close(b.tails, a.tails, rtol=0, atol=1e-12)


def test_a_cache_continues_only_a_streamed_row_from_a_chunk_boundary(flow):
    g = torch.Generator().manual_seed(4)
    full = request(g, prompt=5, tokens=80, finalize=True)
    end = hop_ends(5, 80, CHUNK // 2)[0]
    cache = solve_continued(flow, [part(full, end, False)], [None], [True])[1][0]
    with pytest.raises(ValueError, match="chunk boundary"):
        solve_continued(flow, [part(full, 80, True)], [cache], [False])  # a final row attends to every frame
    # a non-final hop off the chunk grid (another profile's hops) is solved, but keeps no cache to go on from
    off_grid = part(full, end + 1, False)
    (mel,), (kept,) = solve_continued(flow, [off_grid], [cache], [True])
    assert kept is None
    assert_close(mel, flow.inference([off_grid])[0][:, cache.frames - 10:])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["flex", "varlen"])
def test_on_the_gpu_compiled_hops_in_bf16_stay_near_the_whole_prefix_solves(no_tf32, kernel):
    """As the stage runs it (compiled DiT, flex attention or the varlen kernel's packed hops, bf16 autocast
    without the cast cache): two streams' three hops continued from their caches against the eager SDPA
    whole-prefix solves: the same mel to bf16 rounding, and no compile once the server's start-up calls
    (`warm_continued`) have compiled both kinds (no cache, continued)."""
    from intone.models.cosyvoice3.vocoder import compile_batches, compile_dit, warm_continued

    flow = make_flow(torch.float32).cuda()
    g = torch.Generator().manual_seed(12)
    fulls = [request(g, prompt=p, tokens=n, finalize=True, dtype=torch.float32) for p, n in ((8, 120), (21, 140))]
    fulls = [FlowRequest(f.tokens.cuda(), f.prompt_tokens.cuda(), f.prompt_mel.cuda(), f.speaker.cuda(), True, True)
             for f in fulls]
    hops = [[part(f, end, False) for end in hop_ends(len(f.prompt_tokens), len(f.tokens), CHUNK // 2)[:3]] for f in fulls]
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        want = [[flow.inference([job])[0] for job in stream] for stream in hops]
        flow.decoder.estimator.attention_kernel = kernel
        compile_dit(flow.decoder.estimator, "dit")
        warm_continued(flow, compile_batches(flow, torch.device("cuda"))[0][1])
        caches, got, graphs = [None, None], [[], []], [torch._dynamo.utils.counters["stats"]["unique_graphs"]]
        for h in range(3):
            mels, caches = solve_continued(flow, [hops[0][h], hops[1][h]], caches, [True, True])
            for s in range(2):
                got[s].append(mels[s])
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs == graphs[:1] * 4  # the served hops compiled nothing
    for s in range(2):
        solved = 0
        for h in range(3):
            new_from = max(solved - hops[s][h].prompt_mel.shape[0], 0)
            expected = want[s][h][:, new_from:]
            assert got[s][h].shape == expected.shape
            assert (got[s][h] - expected).abs().max() < 5e-2
            solved = 2 * (len(hops[s][h].prompt_tokens) + len(hops[s][h].tokens) - LOOKAHEAD)


@pytest.mark.parametrize("behind", [0, 1, 2])
def test_a_continued_final_hop_is_the_whole_solve_with_its_earlier_frames_chunk_masked(flow, behind):
    """cosyvoice3.flow.final_hop: continued. The final hop's new frames from the stream's last cache (behind
    0), from an older one (1: its last non-final hop ran in the same call) or from none (2: both hops did):
    each time the whole-prefix solve whose frames before the final chunk keep the chunk mask and whose final
    chunk sees every frame (float64, every kernel). The frames before it are the mel the earlier hops
    released; the final chunk's differ from the official final hop's (full attention everywhere)."""
    if flow.decoder.estimator.attention_kernel == "flex" and behind != 1:
        pytest.skip(FLEX_ON_CPU)
    g = torch.Generator().manual_seed(21 + behind)
    prompt, total = 9, 110
    full = request(g, prompt=prompt, tokens=total, finalize=True)
    ends = hop_ends(prompt, total, CHUNK // 2)
    assert len(ends) >= 3
    caches, released = [None], []
    for end in ends[:-1]:
        (mel,), (kept,) = solve_continued(flow, [part(full, end, False)], [caches[-1]], [True])
        caches.append(kept)
        released.append(mel)
    full_from = 2 * (prompt + ends[-2])
    final = replace(part(full, total, True), full_from=full_from)
    cache = caches[-1 - behind] if behind < 2 else None
    (mel,), (kept,) = solve_continued(flow, [final], [cache], [False])
    assert kept is None
    want = bounded_final_mel(make_flow(), final, full_from)
    assert_close(mel, want[:, (cache.frames - 2 * prompt) if cache else 0:])
    assert_close(want[:, : full_from - 2 * prompt], torch.cat(released, dim=1))
    official = flow.inference([part(full, total, True)])[0]
    assert (want - official)[:, full_from - 2 * prompt:].abs().max() > 1e-6


def test_a_continued_final_hop_must_start_on_the_chunk_grid_of_its_cache(flow):
    g = torch.Generator().manual_seed(5)
    full = request(g, prompt=5, tokens=80, finalize=True)
    end = hop_ends(5, 80, CHUNK // 2)[0]
    cache = solve_continued(flow, [part(full, end, False)], [None], [True])[1][0]
    for full_from in (cache.frames - CHUNK, cache.frames + 2):
        with pytest.raises(ValueError, match="full_from"):
            solve_continued(flow, [replace(part(full, 80, True), full_from=full_from)], [cache], [False])
    with pytest.raises(ValueError, match="solve_continued"):
        flow.inference([replace(part(full, 80, True), full_from=cache.frames)])


@pytest.mark.parametrize("prompt", [26, 28, 50, 51, 52, 53, 64, 77])
def test_a_first_hop_from_its_reference_solved_ahead_is_the_official_one(sdpa_flow, prompt, total=40):
    """cosyvoice3.flow.reference_ahead: the reference's whole chunks that no generated token reaches, solved
    alone, then the first hop going on from them: the official first hop's mel (float64), whatever the
    reference's length against the chunk grid (references of 50-52 tokens: the lookahead reaches into the
    chunk that ends at the reference's end)."""
    flow = sdpa_flow
    g = torch.Generator().manual_seed(prompt * 100 + total)
    full = request(g, prompt=prompt, tokens=total, finalize=True)
    ahead = reference_ahead(flow, full.prompt_tokens, full.prompt_mel, full.speaker)
    if 2 * (prompt - LOOKAHEAD) < CHUNK:
        assert ahead is None
        return
    (mel,), (cache,) = solve_continued(flow, [ahead], [None], [True])
    assert mel.shape[1] == 0 and cache.frames % CHUNK == 0 and 0 < cache.frames <= 2 * (prompt - LOOKAHEAD)
    first = part(full, hop_ends(prompt, total + 60, CHUNK // 2)[0], False)
    (got,), _ = solve_continued(flow, [first], [cache], [True])
    assert_close(got, flow.inference([first])[0])


@pytest.mark.gpu
def test_on_the_gpu_a_compiled_continued_final_hop_stays_near_its_definition(no_tf32):
    """The varlen kernel's packed, compiled continued final hop in bf16 (as the streaming stage runs it) against
    `bounded_final_mel`'s eager dense-mask solve of the same hop in bf16: the same mel to bf16 rounding."""
    from intone.models.cosyvoice3.vocoder import compile_dit

    flow = make_flow(torch.float32).cuda()
    g = torch.Generator().manual_seed(13)
    f = request(g, prompt=11, tokens=130, finalize=True, dtype=torch.float32)
    full = FlowRequest(f.tokens.cuda(), f.prompt_tokens.cuda(), f.prompt_mel.cuda(), f.speaker.cuda(), True, True)
    ends = hop_ends(11, 130, CHUNK // 2)
    final = replace(part(full, 130, True), full_from=2 * (11 + ends[-2]))
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        want = bounded_final_mel(flow, final, final.full_from)
        flow.decoder.estimator.attention_kernel = "varlen"
        compile_dit(flow.decoder.estimator, "dit")
        cache = None
        for end in ends[:-1]:
            cache = solve_continued(flow, [part(full, end, False)], [cache], [True])[1][0]
        (mel,), _ = solve_continued(flow, [final], [cache], [False])
    expected = want[:, cache.frames - 22:]
    assert mel.shape == expected.shape
    assert (mel - expected).abs().max() < 5e-2


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 120), st.integers(1, 130), st.integers(0, 150)), min_size=1, max_size=6),
       chunk=st.sampled_from([0, 7, CHUNK]))
def test_each_continued_query_sees_its_rows_past_and_its_chunk_masked_new_frames(rows, chunk):
    """The packed continued solve's attention, against the chunk mask's definition: a new frame o of a row whose
    first `chunked` new frames are chunk-masked sees the row's whole past, then its new frames up to the end of
    o's chunk (at most `chunked`); a frame past `chunked` sees all its row's new frames. Keys in that order, and
    laid out once per row (a row's segments share them)."""
    past, new, chunked = (list(c) for c in zip(*rows))
    packing = continued_packing(past, new, chunked, 300, chunk, 4, torch.device("cpu"))
    spans = packing.mask
    q_starts, k_starts, keys = spans.starts.tolist(), spans.keys.tolist(), spans.key_index.tolist()
    used = spans.key_used.tolist()
    assert len(keys) == sum(past) + sum(new)
    past_at = [sum(past[:r]) for r in range(len(new))]
    new_at = [sum(past) + sum(new[:r]) for r in range(len(new))]
    q = 0
    for r, n in enumerate(new):
        masked = min(chunked[r], n) if chunk > 0 else 0
        for o in range(n):
            end = min((o // chunk + 1) * chunk, masked) if o < masked else n
            seg = max(i for i, start in enumerate(q_starts[:-1]) if start <= q)
            seen = keys[k_starts[seg]:k_starts[seg] + used[seg]]
            assert seen == [*range(past_at[r], past_at[r] + past[r]), *range(new_at[r], new_at[r] + end)], (r, o)
            assert spans.bound.shape[0] >= q_starts[seg + 1] - q_starts[seg]  # the kernel's query bound
            q += 1
    assert q == q_starts[-1] == sum(new)
