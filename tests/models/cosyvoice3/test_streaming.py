"""CosyVoice3 through the engine: the official streaming property, per-request hop state,
batched codec == each request alone, full response, seeds, and the frame audit."""


import gc
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

from tests.procs import frame_audit_alongside
from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.engine.loading import chunk_policy
from tests.offline import OfflineRequest, run_to_completion
from intone.engine.trace import FrameTracer
from intone.models.registry import load_model
from intone.models.cosyvoice3.flow_slots import slot_bucket
from intone.protocol import SamplingParams, SynthesisRequest, VoiceReference

from .conftest import voice_audio
from .official_stream import official_full as _official_full
from .official_stream import official_stream as _official_stream

TEXTS = ["Hello world.", "The rain falls on the quiet town.", "Numbers like 1, 2, 3.",
         "Streaming audio arrives in chunks, frame after frame, exactly once and in order."]


def voices(n):
    """References of different lengths, so each request has its own first-hop padding."""
    return [VoiceReference(text="She said the weather would be fine.", audio=voice_audio(1.0 + 0.37 * i, pitch=110 + 9 * i),
                           sample_rate=16000) for i in range(n)]


def assert_same_audio(sent: np.ndarray, want: torch.Tensor) -> None:
    """The float32 samples a chunk carries against a float64 reference: the same value to float32
    rounding (one ulp, where float64 summation order tips a rounding), plus 1e-9."""
    want = want.double().numpy()
    assert sent.shape == want.shape
    excess = np.abs(sent.astype(np.float64) - want) - (np.spacing(np.abs(want).astype(np.float32)) + 1e-9)
    assert excess.max(initial=0) <= 0, f"max |diff| {np.abs(sent - want).max():.3g} beyond float32 rounding"


def run_engine(model, profile, requests, tracer=None, tokens: dict | None = None):
    """Chunks per request; `tokens`, if given, receives each request's generated tokens."""
    return run_core(EngineCore(model, profile, tracer), requests, tokens)


def run_core(core: EngineCore, requests, tokens: dict | None = None):
    """`run_engine` on a core of the caller's (to read its counters after)."""
    for r in requests:
        core.add_request(r)
    chunks = {}
    while core.has_work():
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
        if tokens is not None:  # the request's own list: it outlives the request's release
            tokens.update({rid: req.tokens for rid, req in core.requests.items()})
    snap = core.snapshot()
    assert snap["live_requests"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"]
    return chunks


# ---- each request alone and its official audio, in a process of its own ----------------------------------
# A worker process holds models of its own (loaded as the session's fixtures load them) and runs there what
# a test would run here after its engine: each request alone, and the official loop on its tokens. The test
# hands it over before running the engine, so both run at once, each on a core (the same work, spread over
# the cores). Several tests and parametrizations ask for the same request and audio: each is computed once per
# model and inputs. The official audio also depends on the flow's attention kernel and packing, which the
# engine's profile sets on the model: the worker's model is set as the test's engine set the test's, and they
# are part of the key.

_MODELS: dict = {}
_ALONE: dict = {}
_OFFICIAL: dict = {}


def _request_key(model, text, ref, params):
    audio = np.ascontiguousarray(np.asarray(ref.audio, dtype=np.float32)).tobytes()
    return id(model), text, ref.text, ref.sample_rate, audio, repr(params)


def alone_tokens(model, text, ref, params):
    key = _request_key(model, text, ref, params)
    if key not in _ALONE:
        prompt = model.build_prompt(text, [ref])
        r = run_to_completion(model, [OfflineRequest(prompt, params)])[0]
        _ALONE[key] = (model, ([int(t) for t in r.codes[0]], r.tokens, prompt))  # the model kept: its id stays its own
    frames, tokens, prompt = _ALONE[key][1]
    return list(frames), list(tokens), prompt


def _official(fn, model, tokens, features, **kw):
    flow = model.flow
    key = (fn.__name__, id(model), tuple(tokens), id(features), tuple(sorted(kw.items())),
           flow.decoder.estimator.attention_kernel, flow.decoder.packed)
    if key not in _OFFICIAL:
        _OFFICIAL[key] = (model, features, fn(model, tokens, features, **kw))  # kept alive: their ids stay theirs
    return _OFFICIAL[key][2]


def official_stream(model, tokens, features, **kw):
    return _official(_official_stream, model, tokens, features, **kw)


def official_full(model, tokens, features, **kw):
    return _official(_official_full, model, tokens, features, **kw)


def _reference_start(model_dir: str, threads: int) -> None:
    """The worker's models: `cosy64` (float64 talker, flow and HiFT) and `tiny_cosy`, as the fixtures load them;
    its torch threads the test process's (the references' float32 features are the same sums, bit for bit)."""
    torch.set_num_threads(threads)
    _MODELS["cosy64"] = load_model(model_dir, dtype=torch.float64, codec_dtype=torch.float64)
    _MODELS["tiny_cosy"] = load_model(model_dir)


def _reference(name, frontend, kernel, packed, text, ref, params, asks):
    """In the worker: the request alone, then per ask ("stream" or "full", with its keyword arguments) the
    official audio of its tokens. -> (frames, tokens, the reference's speech tokens, [audio of each ask])"""
    model = _MODELS[name]
    model.configure_frontend(frontend)
    model.flow.decoder.estimator.attention_kernel, model.flow.decoder.packed = kernel, packed
    frames, tokens, prompt = alone_tokens(model, text, ref, params)
    official = {"stream": official_stream, "full": official_full}
    audio = [official[kind](model, frames, prompt.conditioning, **kw) for kind, kw in asks]
    return frames, tokens, int(prompt.conditioning.speech_tokens.shape[0]), audio


# The module's engines on one torch thread, its references worker (below) on the other core.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def references(one_torch_thread, tiny_cosy_dir, cosy64, tiny_cosy):
    """references(model, profile, text, ref, params, *asks) -> a future of `_reference`'s answer, for the test's
    `model` (cosy64 or tiny_cosy) once its engine is built with `profile` (which set the model's flow); the
    worker runs as many torch threads as the module's engines (one)."""
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_reference_start,
                               initargs=(str(tiny_cosy_dir), torch.get_num_threads()))
    names = {id(cosy64): "cosy64", id(tiny_cosy): "tiny_cosy"}

    def submit(model, profile, text, ref, params, *asks):
        flow = model.flow.decoder
        return pool.submit(_reference, names[id(model)], profile.options_for(model.name),
                           flow.estimator.attention_kernel, flow.packed, text, ref, params, asks)
    try:
        yield submit
    finally:
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("schedule, kernel, cache", [("preempt", "varlen", True), ("preempt", "sdpa", False),
                                                     ("first", "sdpa", True)])
def test_streams_release_exactly_the_official_streaming_audio(cosy64, references, schedule, kernel, cache):
    """Interleaved requests with different references and modes: every chunk's span and samples
    equal the official loop run for that request alone (float64: to 1e-9), with first chunks decoded at the
    Euler steps of the backlog's flow calls (codec.schedule: preempt, shipped) or only between calls (first),
    and with later hops solved against the flow state their earlier ones kept (cosyvoice3.flow.cache, shipped;
    with the varlen kernel, each call's new frames packed over their rows' past) or over the whole prefix."""
    refs = voices(4)
    # Standard mode keeps every stop id out below min_new_tokens (RAS, as officially, only sos),
    # so request 3 surely runs long enough for the hop to reach 100.
    params = [SamplingParams(seed=7 + i, min_new_tokens=(60, 80, 100, 200)[i], max_new_tokens=(160, 160, 160, 240)[i],
                             top_k=25, top_p=0.8, temperature=1.0, mode="ras" if i % 2 == 0 else "standard")
              for i in range(4)]
    reqs = [SynthesisRequest(f"r{i}", TEXTS[i], [refs[i]], params[i]) for i in range(4)]
    # call_cost 64: the chunks that share a codec worker batch go in flow calls of similar lengths (some
    # of several padded rows, some alone); the audio must not change.
    # the shipped profile (preempt, varlen, the flow cache); the whole-prefix hops, and the cache on padded rows,
    # under SDPA's mask (flex's block mask and the DiT on packed rows are test_flow's and test_flow_cache's: on a
    # CPU flex materializes the scores, twice SDPA's time here)
    profile = load_profile("cosyvoice3-streaming", device="cpu", **{
        "ar.max_num_seqs": 4, "cosyvoice3.flow.call_cost": 64, "codec.schedule": schedule,
        "cosyvoice3.flow.attention": kernel, "cosyvoice3.flow.cache": cache})
    core = EngineCore(cosy64, profile)
    alone = [references(cosy64, profile, TEXTS[i], refs[i], params[i], ("stream", {})) for i in range(4)]
    chunks = run_core(core, reqs)
    hops_seen = set()
    for i in range(4):
        frames, _, _, (expected,) = alone[i].result()
        got = chunks[f"r{i}"]
        assert [(c.start_frame, c.end_frame) for c in got] == [(s, e) for s, e, _ in expected]
        assert got[-1].finished and sum(c.finished for c in got) == 1
        for c, (_, _, audio) in zip(got, expected):
            assert c.audio.shape[0] == audio.shape[0]
            assert_same_audio(c.audio, audio)
        total = sum(c.audio.shape[0] for c in got)
        assert total == len(frames) * cosy64.samples_per_frame  # nothing lost, nothing repeated
        hops_seen |= {c.end_frame - c.start_frame for c in got[1:-1]}
    assert {50, 100} <= hops_seen  # hops grew per request, whatever the others did


def test_full_response_is_one_chunk_equal_to_the_request_vocoded_alone(cosy64, references):
    """Batched flow + HiFT vs each request alone, in float64 (to the samples' float32 rounding). In float32 the batch
    shape moves the flow's mel by ~1e-6 (GEMM blocking), and HiFT integrates F0 into phase,
    so such rounding grows along the utterance: bit-level agreement is only meaningful in float64."""
    tiny_cosy = cosy64
    refs = voices(3)
    params = [SamplingParams(seed=40 + i, max_new_tokens=80, temperature=0.7, top_k=20, repetition_penalty=1.21,
                             mode="standard") for i in range(3)]
    reqs = [SynthesisRequest(f"f{i}", TEXTS[i], [refs[i]], params[i]) for i in range(3)]
    profile = load_profile("cosyvoice3-full-response", device="cpu", **{"ar.max_num_seqs": 3})
    core = EngineCore(tiny_cosy, profile)
    official = [references(tiny_cosy, profile, TEXTS[i], refs[i], params[i], ("full", {})) for i in range(3)]
    chunks = run_core(core, reqs)
    for i in range(3):
        got = chunks[f"f{i}"]
        assert len(got) == 1 and got[0].finished
        frames, _, _, (alone,) = official[i].result()
        assert got[0].audio.shape[0] == alone.shape[0] == len(frames) * 960
        assert_same_audio(got[0].audio, alone)


def test_whole_responses_at_fixed_sizes_get_the_varlen_audio(cosy64):
    """`cosyvoice3.flow.cuda_graphs` with the varlen kernel (the full-response profile): a codec call of whole
    responses runs at its (rows, frames) buckets (`flow_slots`; on a CPU each Euler step runs eagerly) and each
    response gets the audio of the varlen solve (float64); the call counts its bucket's frames as computed."""
    from intone.engine.config import load_profile as profile_of
    from intone.engine.cuda_graphs import FunctionGraphs
    from intone.models.vocoder import CodecWindow

    refs, g = voices(3), torch.Generator().manual_seed(3)
    prompts = [cosy64.build_prompt(TEXTS[i], refs[i:i + 1]) for i in range(3)]
    codes = [torch.randint(0, 6561, (1, n), generator=g) for n in (30, 47, 61)]

    def decode(**sets):
        profile = profile_of("cosyvoice3-full-response", device="cpu", **sets)
        vocoder = cosy64.make_vocoder(profile.codec, profile.options_for("cosyvoice3"))
        vocoder.graphs = FunctionGraphs()  # as the engine hands it over (on a CPU nothing is captured)
        windows = [CodecWindow(i, f"w{i}", c, p, 0, c.shape[1], 0, True)
                   for i, (c, p) in enumerate(zip(codes, prompts))]
        return vocoder.decode(windows, {})[0], vocoder

    slotted, graphed = decode(**{"cosyvoice3.flow.cuda_graphs": True})
    varlen, eager = decode()
    assert graphed.slotted and not eager.slotted
    # the fixed-shape solve, once (eager on a CPU), beside HiFT's calls, which both make
    assert graphed.graphs.eager - eager.graphs.eager == 1 and not graphed.pauses
    frames = sum(2 * (len(p.conditioning.speech_tokens) + c.shape[1]) for p, c in zip(prompts, codes))
    assert graphed.padded_tokens == slot_bucket(frames) // 2 and eager.padded_tokens == frames // 2
    for got, want in zip(slotted, varlen):
        assert_same_audio(got, torch.from_numpy(want))


def test_beside_the_flow_cache_whole_rows_run_at_fixed_sizes_and_every_window_keeps_its_audio(cosy64):
    """`cosyvoice3.flow.cuda_graphs` beside the flow cache (the streaming profile, varlen, preempt): a call's whole
    rows (a full response; a stream's final hop, which officially re-solves the whole utterance) run at fixed
    sizes in a call of their own, each Euler step apart (its pause points kept; the steps' graphs are what
    start-up captures, so a call the codec runs unpaused replays them too), and the continued hops as before;
    every window's audio is the one without graphs (float64)."""
    from intone.engine.config import load_profile as profile_of
    from intone.engine.cuda_graphs import FunctionGraphs
    from intone.models.vocoder import CodecWindow

    refs, g = voices(2), torch.Generator().manual_seed(4)
    prompts = [cosy64.build_prompt(TEXTS[i], refs[i:i + 1]) for i in range(2)]
    codes = [torch.randint(0, 6561, (1, n), generator=g) for n in (64, 41)]

    def run(**sets):
        profile = profile_of("cosyvoice3-streaming", device="cpu", **sets)
        vocoder = cosy64.make_vocoder(profile.codec, profile.options_for("cosyvoice3"))
        vocoder.graphs = FunctionGraphs()  # as the engine hands it over (on a CPU nothing is captured)
        pauses = []
        first = [CodecWindow(0, "a", codes[0], prompts[0], 0, 25, 0, False),  # a stream's first hop
                 CodecWindow(1, "b", codes[1], prompts[1], 0, 41, 0, True)]  # a full response
        audio, states = vocoder.decode(first, {}, lambda: pauses.append(1))
        final, _ = vocoder.decode([CodecWindow(0, "a", codes[0], prompts[0], 25, 64, 0, True)], states)  # unpaused
        return audio + final, vocoder, len(pauses)

    slotted, graphed, graphed_pauses = run(**{"cosyvoice3.flow.cuda_graphs": True})
    plain, eager, eager_pauses = run()
    assert graphed.slotted and graphed.flow_cache and graphed.pauses and not eager.slotted
    # the first call's two kinds of rows in two flow calls; the slotted solves stepped (10 steps, each a run)
    assert (graphed.calls, eager.calls) == (3, 2)
    assert graphed.graphs.eager - eager.graphs.eager == 2 * 10 and graphed_pauses == eager_pauses + 10
    for got, want in zip(slotted, plain):
        assert_same_audio(got, torch.from_numpy(want))


@pytest.mark.parametrize("hift_cost", [None, 0])
def test_hift_calls_split_by_length_give_each_request_its_official_audio(cosy64, references, hift_cost):
    """cosyvoice3.hift.call_cost: three full responses of 30, 45 and 60 tokens decoded in one codec call (in
    the loop, gathered); HiFT takes them as one padded batch (None: 3 rows x 120 mel frames computed, 270
    of them real) or, at no cost per call, one call per length (no padding). Each request's audio is its
    official full response either way (float64), and the counters say what HiFT computed."""
    refs = voices(3)
    params = [SamplingParams(seed=60 + i, min_new_tokens=n, max_new_tokens=n, temperature=0.7, top_k=20,
                             repetition_penalty=1.21, mode="standard") for i, n in enumerate((30, 45, 60))]
    reqs = [SynthesisRequest(f"h{i}", TEXTS[i], [refs[i]], params[i], stream=False) for i in range(3)]
    profile = load_profile("cosyvoice3-full-response", device="cpu", **{
        "ar.max_num_seqs": 3, "codec.overlap": False, "codec.gather_ms": 1000, "cosyvoice3.hift.call_cost": hift_cost})
    core = EngineCore(cosy64, profile)
    official = [references(cosy64, profile, TEXTS[i], refs[i], params[i], ("full", {})) for i in range(3)]
    for r in reqs:
        core.add_request(r)
    chunks = {}
    while core.has_work():
        for c in core.step():
            chunks[c.request_id] = c
    snap = core.snapshot()
    assert snap["codec_calls"] == 1  # the three responses shared one codec call
    padded = 3 * 120 if hift_cost is None else 60 + 90 + 120
    assert (snap["codec_hift_padded_frames"], snap["codec_hift_useful_frames"]) == (padded, 270)
    for i in range(3):
        assert_same_audio(chunks[f"h{i}"].audio, official[i].result()[3][0])


def test_same_seed_same_audio_different_seed_different_tokens(tiny_cosy):
    ref = voices(1)[0]
    profile = load_profile("cosyvoice3-streaming", device="cpu")
    runs = []
    for seed in (5, 5, 6):
        params = SamplingParams(seed=seed, min_new_tokens=30, max_new_tokens=60, temperature=1.0, top_k=25)
        chunks = run_engine(tiny_cosy, profile, [SynthesisRequest("s", TEXTS[1], [ref], params)])["s"]
        runs.append(torch.cat([torch.from_numpy(c.audio) for c in chunks]))
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape != runs[2].shape or not torch.equal(runs[0], runs[2])


def test_16_concurrent_streams_pass_the_audit_and_match_their_tokens_alone(tiny_cosy, references, tmp_path):
    refs = voices(4)
    params = [SamplingParams(seed=100 + i, max_new_tokens=90, temperature=1.0, top_k=25) for i in range(16)]
    reqs = [SynthesisRequest(f"c{i}", TEXTS[i % 4], [refs[i % 4]], params[i]) for i in range(16)]
    trace = tmp_path / "trace.jsonl"
    # the audit and the tokens do not depend on the flow's attention kernel; SDPA is the faster one uncompiled
    profile = load_profile("cosyvoice3-streaming", device="cpu", **{"ar.max_num_seqs": 16,
                                                                    "cosyvoice3.flow.attention": "sdpa"})
    tracer = FrameTracer(trace)
    tokens = {}
    core = EngineCore(tiny_cosy, profile, tracer)
    alone = [references(tiny_cosy, profile, TEXTS[i % 4], refs[i % 4], params[i]) for i in range(16)]
    chunks = run_core(core, reqs, tokens)
    tracer.close()
    with frame_audit_alongside(trace):  # the CLI's audit runs beside the checks below
        for i in range(16):
            frames, generated, _, _ = alone[i].result()
            got = chunks[f"c{i}"]
            assert tokens[f"c{i}"] == generated  # every generated token, as when the request runs alone
            assert got[-1].end_frame == len(frames)
            assert sum(c.audio.shape[0] for c in got) == len(frames) * 960


@pytest.mark.parametrize("refs, field", [([], "ref_audio"), (None, "ref_audio")])
def test_a_request_without_a_usable_reference_is_refused_and_harms_no_other(tiny_cosy, refs, field):
    bad_refs = refs if refs is not None else voices(2)  # none, or two
    good = SynthesisRequest("good", TEXTS[0], voices(1), SamplingParams(seed=1, max_new_tokens=30))
    bad = SynthesisRequest("bad", TEXTS[0], bad_refs, SamplingParams(seed=1))
    chunks = run_engine(tiny_cosy, load_profile("cosyvoice3-streaming", device="cpu"), [bad, good])
    assert len(chunks["bad"]) == 1 and chunks["bad"][0].error_code == "invalid_request"
    assert chunks["bad"][0].error_field == field and "reference" in chunks["bad"][0].error
    assert chunks["good"][-1].stop_reason in ("stop", "length") and chunks["good"][-1].error is None


def test_the_codec_lookahead_holds_whatever_the_profile_says(tiny_cosy):
    """The flow reads 3 tokens past a non-final chunk: a profile without lookahead still waits for them."""
    profile = load_profile("cosyvoice3-full-response", device="cpu")
    assert profile.chunking.lookahead_frames == 0
    core = EngineCore(tiny_cosy, profile)
    assert core.policy.lookahead_frames == 3
    assert chunk_policy(profile, tiny_cosy) == core.policy  # the one the codec's warm-up bounds its chunks by
    params = SamplingParams(seed=3, min_new_tokens=40, max_new_tokens=40, mode="standard")
    core.add_request(SynthesisRequest("la", TEXTS[3], voices(1), params, initial_chunk_frames=10))
    chunks = []
    while core.has_work():
        chunks += core.step()
    assert [(c.start_frame, c.end_frame) for c in chunks] == [(0, 10), (10, 40)]
    assert chunks[-1].error is None and sum(len(c.audio) for c in chunks) == 40 * 960


def test_a_failing_codec_batch_fails_only_the_request_that_fails_alone(cosy64):
    """Fault injection: the flow raises for one request's rows; the others get the audio they
    would get without that request (float64, exact to 1e-9)."""
    refs = voices(3)
    params = [SamplingParams(seed=60 + i, min_new_tokens=30, max_new_tokens=30, mode="standard") for i in range(3)]
    reqs = [SynthesisRequest(f"q{i}", TEXTS[i], [refs[i]], params[i]) for i in range(3)]
    profile = load_profile("cosyvoice3-full-response", device="cpu", **{"ar.max_num_seqs": 3})
    clean = run_engine(cosy64, profile, reqs)
    bad_prompt_len = cosy64.build_prompt(TEXTS[1], [refs[1]]).codec_prompt_frames
    flow = cosy64.flow
    real = flow.inference

    def failing(jobs, *graphs):
        if any(j.prompt_tokens.shape[0] == bad_prompt_len for j in jobs):
            raise RuntimeError("injected flow failure")
        return real(jobs, *graphs)

    flow.inference = failing
    try:
        got = run_engine(cosy64, profile, reqs)
    finally:
        del flow.inference
    assert got["q1"][-1].error_code == "internal" and "injected" in got["q1"][-1].error
    for rid in ("q0", "q2"):
        assert len(got[rid]) == 1 and got[rid][0].error is None
        assert np.allclose(got[rid][0].audio, clean[rid][0].audio, atol=1e-9, rtol=0)


def test_references_are_encoded_off_the_loop_and_can_be_cancelled_or_refused(tiny_cosy):
    core = EngineCore(tiny_cosy, load_profile("cosyvoice3-streaming", device="cpu"))
    good = SynthesisRequest("g", TEXTS[0], voices(1), SamplingParams(seed=2, max_new_tokens=30))
    gone = SynthesisRequest("x", TEXTS[0], voices(1), SamplingParams(seed=2))
    long_ref = VoiceReference(text="too long", audio=voice_audio(31.0), sample_rate=16000)
    bad = SynthesisRequest("b", TEXTS[0], [long_ref], SamplingParams(seed=2))
    for r in (good, gone, bad):
        core.add_request(r)
    assert core.snapshot()["preparing"] == 3 and not core.requests  # nothing encoded in add_request
    core.abort("x")
    chunks = {}
    while core.has_work():
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
    assert [c.stop_reason for c in chunks["x"]] == ["abort"]
    assert chunks["b"][0].error_code == "invalid_request" and chunks["b"][0].error_field == "ref_audio"
    assert chunks["g"][-1].error is None and chunks["g"][-1].end_frame > 0
    snap = core.snapshot()
    assert snap["preparing"] == 0 and snap["live_requests"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"]


def test_speed_stretches_a_full_response_as_officially_and_is_refused_when_streaming(cosy64, references):
    ref = voices(1)[0]
    params = SamplingParams(seed=9, min_new_tokens=40, max_new_tokens=40, mode="standard")
    full = load_profile("cosyvoice3-full-response", device="cpu")
    core = EngineCore(cosy64, full)
    official = references(cosy64, full, TEXTS[1], ref, params, ("full", {"speed": 1.5}))
    got = run_core(core, [SynthesisRequest("s", TEXTS[1], [ref], params, speed=1.5)])["s"]
    _, _, _, (expected,) = official.result()
    assert len(got) == 1 and got[0].audio.shape[0] == expected.shape[0] == int(2 * 40 / 1.5) * 480
    assert_same_audio(got[0].audio, expected)
    streaming = load_profile("cosyvoice3-streaming", device="cpu")
    refused = run_engine(cosy64, streaming, [SynthesisRequest("t", TEXTS[1], [ref], params, speed=1.5)])["t"]
    assert refused[0].error_code == "invalid_request" and refused[0].error_field == "speed"


def test_a_stream_with_the_flex_attention_flow_releases_the_same_audio(cosy64):
    """cosyvoice3.flow.attention: flex, set through the profile, reaches the flow and changes no sample (float64)."""
    refs = voices(2)
    reqs = [SynthesisRequest(f"x{i}", TEXTS[i], [refs[i]], SamplingParams(seed=3 + i, min_new_tokens=60,
                                                                           max_new_tokens=90)) for i in range(2)]
    runs = {}
    try:
        for kernel in ("flex", "sdpa"):
            profile = load_profile("cosyvoice3-streaming", device="cpu",
                                   **{"ar.max_num_seqs": 2, "cosyvoice3.flow.attention": kernel})
            runs[kernel] = run_engine(cosy64, profile, reqs)
            assert cosy64.flow.decoder.estimator.attention_kernel == kernel
    finally:  # the model is shared by the module's tests
        cosy64.flow.decoder.estimator.attention_kernel = "sdpa"
    for rid, chunks in runs["sdpa"].items():
        flex = runs["flex"][rid]
        assert [(c.start_frame, c.end_frame) for c in flex] == [(c.start_frame, c.end_frame) for c in chunks]
        for a, b in zip(flex, chunks):
            np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-9)


def test_a_continued_final_hop_changes_only_each_streams_final_chunk(cosy64, references, kernel="varlen"):
    """cosyvoice3.flow.final_hop: continued (with the flow cache): streams of several hops release the official
    chunks up to their last, and a last chunk of the same length whose flow is the whole solve with the
    earlier frames chunk-masked (float64, to 1e-9 as the official property); a stream whose only chunk is
    its final one, and a full response beside them, keep the official audio. (The varlen kernel's packed
    solve, as served; `test_flow_cache.py` holds every kernel to the definition.)"""
    refs = voices(4)
    lengths = ((70, 110), (140, 200), (4, 12), (50, 80))
    params = [SamplingParams(seed=17 + i, min_new_tokens=lo, max_new_tokens=hi, top_k=25, top_p=0.8, temperature=1.0)
              for i, (lo, hi) in enumerate(lengths)]
    reqs = [SynthesisRequest(f"c{i}", TEXTS[i], [refs[i]], params[i], stream=i != 3) for i in range(4)]
    profile = load_profile("cosyvoice3-streaming", device="cpu", **{
        "ar.max_num_seqs": 4, "codec.schedule": "first", "cosyvoice3.flow.attention": kernel,
        "cosyvoice3.flow.cache": True, "cosyvoice3.flow.final_hop": "continued"})
    core = EngineCore(cosy64, profile)
    alone = [references(cosy64, profile, TEXTS[i], refs[i], params[i],
                        *([("full", {})] if i == 3 else [("stream", {}), ("stream", {"final_hop": "continued"})]))
             for i in range(4)]
    chunks = run_core(core, reqs)
    differs = 0
    for i in range(4):
        frames, _, _, audio = alone[i].result()
        got = chunks[f"c{i}"]
        if i == 3:
            assert len(got) == 1
            assert_same_audio(got[0].audio, audio[0])
            continue
        official, expected = audio
        assert [(c.start_frame, c.end_frame) for c in got] == [(s, e) for s, e, _ in expected]
        assert (len(got) == 1) == (i == 2)
        for c, (_, _, audio), (_, _, whole) in zip(got, expected, official):
            assert_same_audio(c.audio, audio)
            assert c.audio.shape[0] == whole.shape[0]
        differs += len(got) > 1 and not np.allclose(got[-1].audio, official[-1][2].numpy(), rtol=0, atol=1e-6)
        assert sum(c.audio.shape[0] for c in got) == len(frames) * cosy64.samples_per_frame
    assert differs == 2  # the streams of several hops: the last chunk is not the official one


def test_a_flow_cache_budget_changes_the_work_not_the_audio_and_frees_everything(cosy64, references):
    """cosyvoice3.flow.cache_gb: with room for about one stream's cache, four concurrent streams keep caches
    where they fit and re-solve their prefixes where not; each stream still releases the official chunks
    (float64), the refusals are counted, and when the streams end no cache is held. The codec runs in the
    loop (codec.overlap off), so each step's reading falls between calls."""
    refs = voices(4)
    params = [SamplingParams(seed=30 + i, min_new_tokens=90, max_new_tokens=140, top_k=25, top_p=0.8,
                             temperature=1.0) for i in range(4)]
    reqs = [SynthesisRequest(f"b{i}", TEXTS[i], [refs[i]], params[i]) for i in range(4)]
    dit = cosy64.flow.decoder.estimator.config
    per_frame = cosy64.flow.config.n_timesteps * dit.depth * 4 * dit.heads * dit.dim_head * 8  # float64
    profile = load_profile("cosyvoice3-streaming", device="cpu", **{
        "ar.max_num_seqs": 4, "codec.overlap": False, "cosyvoice3.flow.attention": "sdpa",
        "cosyvoice3.flow.cache": True, "cosyvoice3.flow.cache_gb": 300 * per_frame / 1e9})
    core = EngineCore(cosy64, profile)
    alone = [references(cosy64, profile, TEXTS[i], refs[i], params[i], ("stream", {})) for i in range(4)]
    vocoder = core.codec.vocoder
    for r in reqs:
        core.add_request(r)
    chunks, held = {}, []
    while core.has_work():
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
        held.append(vocoder.flow_cache_bytes)
    assert 0 < max(held) <= 300 * per_frame
    assert vocoder.flow_cache_refused > 0
    for i in range(4):
        _, _, _, (expected,) = alone[i].result()
        got = chunks[f"b{i}"]
        assert [(c.start_frame, c.end_frame) for c in got] == [(s, e) for s, e, _ in expected]
        for c, (_, _, audio) in zip(got, expected):
            assert_same_audio(c.audio, audio)
    gc.collect()
    assert vocoder.flow_cache_bytes == 0
    assert core.snapshot()["codec_flow_cache_bytes"] == 0
    assert 0 < core.snapshot()["codec_flow_cache_pool_bytes"] <= 300 * per_frame


@pytest.mark.parametrize("kernel, final_hop", [("sdpa", "whole"), ("varlen", "continued")])
def test_references_solved_ahead_leave_every_chunk_as_it_was(cosy64, references, kernel, final_hop):
    """cosyvoice3.flow.reference_ahead: each stream's reference chunks are solved at admission (a `prepare`
    chunk: no audio) and its first hop goes on from them. Every chunk is still the official one (with a
    continued final hop, that mode's), in order from seq 0 with no chunk of its own, a full response beside
    the streams is untouched, and when all end no flow cache is held."""
    refs = voices(4)
    params = [SamplingParams(seed=50 + i, min_new_tokens=lo, max_new_tokens=lo + 40, top_k=25, top_p=0.8,
                             temperature=1.0) for i, lo in enumerate((70, 110, 8, 60))]
    reqs = [SynthesisRequest(f"a{i}", TEXTS[i], [refs[i]], params[i], stream=i != 3) for i in range(4)]
    profile = load_profile("cosyvoice3-streaming", device="cpu", **{
        "ar.max_num_seqs": 4, "cosyvoice3.flow.attention": kernel, "cosyvoice3.flow.cache": True,
        "cosyvoice3.flow.reference_ahead": True, "cosyvoice3.flow.final_hop": final_hop})
    core = EngineCore(cosy64, profile)
    alone = [references(cosy64, profile, TEXTS[i], refs[i], params[i],
                        ("full", {}) if i == 3 else ("stream", {"final_hop": final_hop})) for i in range(4)]
    chunks = run_core(core, reqs)
    vocoder = core.codec.vocoder
    ahead = 0
    for i in range(4):
        _, _, reference_tokens, (official,) = alone[i].result()
        # a whole 50-frame chunk of the reference that the lookahead's 3 tokens do not reach; not a full response
        ahead += i != 3 and 2 * (reference_tokens - 3) >= 50
        got = chunks[f"a{i}"]
        assert [c.seq for c in got] == list(range(len(got)))
        if i == 3:
            assert len(got) == 1
            assert_same_audio(got[0].audio, official)
            continue
        expected = official
        assert [(c.start_frame, c.end_frame) for c in got] == [(s, e) for s, e, _ in expected]
        for c, (_, _, audio) in zip(got, expected):
            assert_same_audio(c.audio, audio)
    # each is solved ahead unless its first hop went to a call while it still waited (then that hop solved it)
    assert vocoder.references_ahead + core.codec_worker.prepares_skipped == ahead >= 2 and vocoder.references_ahead
    assert core.snapshot()["codec_references_ahead"] == vocoder.references_ahead
    gc.collect()
    assert vocoder.flow_cache_bytes == 0


def test_a_prepared_stream_that_ends_without_a_token_ends_empty(cosy64):
    """A stream whose reference was solved ahead and whose terminal chunk holds no token (it stopped at once):
    the vocoder gives the prepare window no audio and the empty final window none, with the flow cache on and
    the final hop continued."""
    from intone.engine.config import load_profile as profile_of
    from intone.models.vocoder import CodecWindow

    profile = profile_of("cosyvoice3-streaming", device="cpu", **{
        "cosyvoice3.flow.cache": True, "cosyvoice3.flow.reference_ahead": True,
        "cosyvoice3.flow.final_hop": "continued"})
    vocoder = cosy64.make_vocoder(profile.codec, profile.options_for("cosyvoice3"))
    prompt = cosy64.build_prompt(TEXTS[1], voices(4)[3:])
    codes = torch.zeros(1, 8, dtype=torch.long)
    window = CodecWindow(1, "z", codes, prompt, 0, 0, 0, False, prepare=True)
    audio, states = vocoder.decode([window], {})
    assert audio[0].shape == (0,) and states[1].flow is not None and vocoder.references_ahead == 1
    audio, states = vocoder.decode([CodecWindow(1, "z", codes, prompt, 0, 0, 0, True)], states)
    assert audio[0].shape == (0,)
