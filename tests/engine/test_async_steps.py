"""`ar.async_steps`: one AR step in flight gives every request the frames and audio it gets with the
steps in order, under staggered arrivals, stop tokens, lengths and cancellations, and leaves nothing."""

import numpy as np
import pytest
import torch

from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.models.registry import load_model
from intone.protocol import SamplingParams, SynthesisRequest

# The engine's loop and codec threads on one torch thread each (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["Hello world", "A longer sentence to say.", "Hi", "Numbers 1, 2, 3."]


@pytest.fixture(scope="module")
def fish64(tiny_fish_dir):
    """float64: the codec's batching then changes the audio only at the level of 1e-15."""
    return load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)


def profile(in_flight: bool, **overrides):
    # chunk boundaries by frame counts, the same in every run (the shipped listener margin makes them follow timing)
    values = {"ar.max_num_seqs": 6, "codec.max_batch": 6, "chunking.backlog_min_ready": 3, "device": "cpu",
              "ar.async_steps": in_flight, "chunking.listener_margin_s": 0}
    values.update(overrides)
    return load_profile("fish-s2-high-concurrency", **values)


def serve(model, in_flight: bool, arrivals: dict[int, list[int]], cancels: dict[int, list[int]], params,
          **overrides):
    """Requests r{i} added at the steps `arrivals` names, aborted at those `cancels` names; per request its
    chunks. Arrivals and cancels count loop iterations, the same in both modes."""
    core = EngineCore(model, profile(in_flight, **overrides))
    chunks: dict[str, list] = {}
    step = 0
    while step <= max(arrivals) or core.has_work():
        for i in arrivals.get(step, []):
            core.add_request(SynthesisRequest(f"r{i}", TEXTS[i % 4], params=params[i]))
        for i in cancels.get(step, []):
            core.abort(f"r{i}")
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
        step += 1
    return core, chunks


def test_one_step_in_flight_gives_each_request_its_frames_and_audio(fish64):
    n = 14
    # some long enough to sample the stop token (the tiny model does within ~100 frames), some cut by length
    params = [SamplingParams(seed=500 + i, max_new_tokens=(8 + 7 * i) if i % 3 else 160, temperature=1.0)
              for i in range(n)]
    arrivals = {0: [0, 1, 2, 3], 3: [4, 5], 7: [6], 8: [7, 8, 9], 20: [10, 11], 31: [12, 13]}
    cancels = {12: [5], 40: [11]}
    runs = {mode: serve(fish64, mode, arrivals, cancels, params) for mode in (False, True)}
    (ordered, a), (in_flight, b) = runs[False], runs[True]
    assert in_flight.ar.keep_in_flight and not ordered.ar.keep_in_flight
    assert set(a) == set(b) == {f"r{i}" for i in range(n)}
    reasons = {c[-1].stop_reason for c in a.values()}
    assert {"stop", "length"} <= reasons, reasons  # both ways of stopping were exercised
    for rid in a:
        ends = [(c[-1].stop_reason, c[-1].end_frame, c[-1].completion_tokens) for c in (a[rid], b[rid])]
        if ends[0][0] == "abort":  # a cancel lands on a frontier that depends on when steps finish
            assert ends[1][0] == "abort"
            continue
        assert ends[0] == ends[1], rid
        audio = [np.concatenate([c.audio for c in cs]) for cs in (a[rid], b[rid])]
        assert audio[0].shape == audio[1].shape and np.abs(audio[0] - audio[1]).max() < 1e-7, rid
        assert sum(c.finished for c in b[rid]) == 1
    for core in (ordered, in_flight):
        snap = core.snapshot()
        assert snap["live_requests"] == snap["running"] == snap["waiting"] == snap["kv_tables"] == 0
        assert snap["kv_blocks_free"] == snap["kv_blocks_total"] and not core.ar.busy


def test_a_request_is_not_run_past_its_length_while_its_last_step_is_in_flight(tiny_fish):
    core = EngineCore(tiny_fish, profile(True))
    core.add_request(SynthesisRequest("r0", "Hi", params=SamplingParams(seed=3, max_new_tokens=5, ignore_eos=True)))
    rows = []
    run = core.runner.run

    def counting(reqs):
        rows.extend(r.request_id for r in reqs)
        return run(reqs)
    core.runner.run = counting
    while core.has_work():
        core.step()
    assert rows.count("r0") == 5  # the prefill and four decodes: never a sixth row for a known last frame


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_steps_launch_and_token_wait_are_parts_of_its_time_and_idle_calls_add_nothing(tiny_fish, in_flight):
    """/metrics splits the steps' time into building and launching them and waiting for their tokens: the parts
    never exceed the whole (with a step in flight, the call that applies the last one has no batch of its own),
    and a loop iteration with nothing to run (while the frontend or the codec works) counts nothing."""
    params = [SamplingParams(seed=90 + i, max_new_tokens=4 + 2 * i, ignore_eos=True) for i in range(3)]
    core = serve(tiny_fish, in_flight, {0: [0, 1], 3: [2]}, {}, params)[0]
    stats = core.stats
    assert stats.steps > 0 and stats.step_launch_seconds > 0 and stats.step_wait_seconds > 0
    assert stats.step_launch_seconds + stats.step_wait_seconds <= stats.step_seconds
    before = (stats.steps, stats.step_seconds, stats.step_launch_seconds, stats.step_wait_seconds)
    for _ in range(2000):
        core.ar.step([])
    assert (stats.steps, stats.step_seconds, stats.step_launch_seconds, stats.step_wait_seconds) == before


def test_a_failed_step_in_flight_fails_its_requests_and_the_engine_goes_on(tiny_fish):
    core = EngineCore(tiny_fish, profile(True))
    run = core.runner.run
    calls = []

    def failing(reqs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA error: out of memory")
        return run(reqs)
    core.runner.run = failing
    core.add_request(SynthesisRequest("r0", "First one", params=SamplingParams(seed=1, max_new_tokens=8)))
    chunks = {}
    while core.has_work():
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
    assert chunks["r0"][-1].stop_reason == "error" and "out of memory" in chunks["r0"][-1].error
    core.add_request(SynthesisRequest("r1", "Second one", params=SamplingParams(seed=2, max_new_tokens=6,
                                                                              ignore_eos=True)))
    while core.has_work():
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
    assert chunks["r1"][-1].stop_reason == "length" and chunks["r1"][-1].end_frame == 6
    snap = core.snapshot()
    assert snap["kv_blocks_free"] == snap["kv_blocks_total"] and snap["live_requests"] == 0


def test_cosyvoice3_with_a_step_in_flight_gives_each_request_its_audio(tiny_cache):
    """The same for CosyVoice3 (one token a frame, no codes; its flow reads frames beyond a chunk):
    full responses and streams, float64, each request its audio of the steps in order."""
    from intone.protocol import VoiceReference

    model = load_model("tiny:cosyvoice3", dtype=torch.float64, codec_dtype=torch.float64)
    t = torch.arange(16000) / 16000

    def run(in_flight: bool):
        core = EngineCore(model, load_profile("cosyvoice3-streaming", device="cpu",
                                              **{"ar.async_steps": in_flight, "ar.max_num_seqs": 3}))
        for i in range(4):
            voice = VoiceReference("Ref.", (0.3 * torch.sin(2 * torch.pi * (150 + 20 * i) * t)).float(), 16000)
            core.add_request(SynthesisRequest(f"r{i}", "Hello there.", [voice], stream=i % 2 == 1,
                                              params=SamplingParams(seed=10 + i, max_new_tokens=20 + 9 * i)))
        chunks = {}
        while core.has_work():
            for c in core.step():
                chunks.setdefault(c.request_id, []).append(c)
        return chunks

    a, b = run(False), run(True)
    assert set(a) == set(b) == {f"r{i}" for i in range(4)}
    for rid in a:
        assert a[rid][-1].stop_reason == b[rid][-1].stop_reason != "error"
        x, y = (np.concatenate([c.audio for c in cs]) for cs in (a[rid], b[rid]))
        assert x.shape == y.shape and x.size > 0 and np.abs(x - y).max() < 1e-7, rid


@pytest.mark.gpu
@pytest.mark.parametrize("in_flight", [False, True])
def test_a_loop_asleep_on_its_tokens_gets_the_tokens_of_one_spinning(tiny_fish_dir, in_flight):
    """`ar.token_wait: sleep` (a blocking-sync event) against `spin`, in order and with a step in flight: every
    request the same frames, stop and tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = load_model(str(tiny_fish_dir), device="cuda")
    params = [SamplingParams(seed=70 + i, max_new_tokens=(10 + 9 * i) if i % 2 else 120, temperature=1.0)
              for i in range(6)]
    arrivals = {0: [0, 1, 2], 4: [3], 9: [4, 5]}
    runs = {wait: serve(model, in_flight, arrivals, {}, params, device="cuda", **{"ar.token_wait": wait})[1]
            for wait in ("spin", "sleep")}
    spin, sleep = runs["spin"], runs["sleep"]
    assert set(spin) == set(sleep) == {f"r{i}" for i in range(6)}
    for rid in spin:
        assert [(c.end_frame, c.stop_reason, c.completion_tokens) for c in spin[rid]][-1] == \
            [(c.end_frame, c.stop_reason, c.completion_tokens) for c in sleep[rid]][-1], rid
        # other tokens would give other audio; the codec's batches (timing) move it by rounding only (its
        # convolutions in TF32 by default: 7e-3 of a 0.16 peak was seen)
        audio = [np.concatenate([c.audio for c in cs]) for cs in (spin[rid], sleep[rid])]
        assert audio[0].shape == audio[1].shape, rid
        assert np.abs(audio[0] - audio[1]).max() < 0.1 * np.abs(audio[0]).max(), rid


@pytest.mark.gpu
@pytest.mark.parametrize("in_flight", [False, True])
def test_a_step_whose_tokens_arrive_before_its_gpu_span_ends_is_counted_not_fatal(tiny_fish_dir, in_flight):
    """The static step's launch enqueues its tokens' copy before the loop records the end of the step's GPU
    span, so the host can hold the tokens while that event is still pending (a served CosyVoice3 core died of
    `elapsed_time` on it). Here GPU work queued after every step's copy widens that moment to ~10 ms: every
    request still ends as it should and every step's span is counted."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = load_model(str(tiny_fish_dir), device="cuda")
    params = [SamplingParams(seed=80 + i, max_new_tokens=6 + 3 * i, temperature=1.0) for i in range(4)]
    # the AR's static step and its graphs as shipped; no codec graphs or compiled pieces (start-up time only)
    core = EngineCore(model, profile(in_flight, device="cuda", **{"codec.stream_graph_frames": 0,
                                                                   "ar.fuse_elementwise": False}))
    run = core.ar.runner.run

    def run_then_busy(inputs):
        out = run(inputs)
        torch.cuda._sleep(20_000_000)  # after the copy, before the span's end event
        return out

    core.ar.runner.run = run_then_busy
    for i in range(4):
        core.add_request(SynthesisRequest(f"r{i}", TEXTS[i], params=params[i]))
    ends = {}
    while core.has_work():
        for c in core.step():
            if c.stop_reason:
                ends[c.request_id] = (c.stop_reason, c.end_frame)
    assert set(ends) == {f"r{i}" for i in range(4)}
    assert all(reason in ("length", "stop") for reason, _ in ends.values()), ends
    assert core.stats.gpu_timed_steps == core.stats.steps > 0


def test_a_paced_loop_steps_at_most_every_min_step_ms_and_gives_the_same_audio(fish64):
    """`ar.min_step_ms`: the loop sleeps before a launch until the period since the last one is over; the tokens
    and audio are those of an unpaced loop (with a step in flight)."""
    params = [SamplingParams(seed=90 + i, max_new_tokens=12 + 5 * i, temperature=1.0) for i in range(4)]
    arrivals = {0: [0, 1], 4: [2, 3]}
    unpaced, plain = serve(fish64, True, arrivals, {}, params)
    # a period well above this machine's own step, so the loop must sleep (a slow CI machine steps in ~40 ms)
    snap = unpaced.snapshot()
    period_ms = min(1000.0, max(25.0, 3000 * snap["step_seconds"] / snap["steps"]))  # the field's bounds
    paced, slow = serve(fish64, True, arrivals, {}, params, **{"ar.min_step_ms": period_ms})
    for rid in plain:
        assert [(c.end_frame, c.stop_reason) for c in plain[rid]] == [(c.end_frame, c.stop_reason) for c in slow[rid]]
        a, b = (np.concatenate([c.audio for c in cs]) for cs in (plain[rid], slow[rid]))
        assert a.shape == b.shape and np.abs(a - b).max() < 1e-7, rid
    snap = paced.snapshot()
    assert snap["step_seconds"] >= period_ms / 1000 * (snap["steps"] - 1) and snap["step_pace_seconds"] > 0
