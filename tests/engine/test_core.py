"""The engine core end to end on the tiny model, in process: exactness, batch independence, leaks."""

import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tests.procs import frame_audit_alongside
from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.engine.device_lost import DeviceLost
from tests.offline import OfflineRequest, run_to_completion
from intone.engine.trace import FrameTracer, audit_file
from intone.models.registry import load_model
from intone.protocol import SamplingParams, SynthesisRequest

# The engine's loop and codec threads on one torch thread each (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fish64(tiny_fish_dir):
    """float64 everywhere, so batching can never flip a sample and audio compares exactly."""
    return load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)


_ALONE = {}


def _alone_start(model_dir: str) -> None:
    """A worker of the pool that runs requests alone: its own float64 model, one thread per worker."""
    torch.set_num_threads(1)
    _ALONE["model"] = load_model(model_dir, dtype=torch.float64, codec_dtype=torch.float64)


def _alone(text: str, params: SamplingParams):
    """One request run to completion alone (the offline loop, batch of one): its tokens and codes."""
    model = _ALONE["model"]
    alone = run_to_completion(model, [OfflineRequest(model.build_prompt(text, []), params)])[0]
    return alone.tokens, alone.codes


def hc_profile(**overrides):
    """The shipped high-concurrency profile, with a capacity small enough to reach backlog."""
    values = {"ar.max_num_seqs": 8, "codec.max_batch": 8, "chunking.backlog_min_ready": 4, "device": "cpu"}
    values.update(overrides)
    return load_profile("fish-s2-high-concurrency", **values)


def drain(core: EngineCore, cancel=None) -> dict[str, list]:
    chunks: dict[str, list] = {}
    while core.has_work():
        if cancel:
            cancel(core)
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
    return chunks


STREAMS = 16  # two waves through the 8 seats: enough to reach the backlog chunk size


def test_16_streams_exact_backlog_and_batch_independent(fish64, tiny_fish_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    texts = ["Hello world", "A longer sentence to say.", "Hi", "Numbers 1, 2, 3."]
    params = [SamplingParams(seed=100 + i, max_new_tokens=56 + (i % 3) * 6) for i in range(STREAMS)]
    # Each request alone, in worker processes, while this one runs them together: the same
    # work as running them here one after another, spread over the cores.
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"), initializer=_alone_start,
                             initargs=(str(tiny_fish_dir),)) as pool:
        alone_runs = [pool.submit(_alone, texts[i % 4], params[i]) for i in range(STREAMS)]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # three processes on the cores, one thread each: no oversubscription
        try:
            # the windowed codec stage (the default; the carried state is tested in test_codec_worker)
            # no ramp: its hops would reach the backlog's 50 frames past these requests' lengths
            core = EngineCore(fish64, hc_profile(**{"codec.carry_state": False, "codec.stream_graph_frames": 0,
                                                     "chunking.whole_chunk_frames": 0, "chunking.ramp_factor": 0,
                                                     "chunking.listener_margin_s": 0}),
                              FrameTracer(trace))
            for i in range(STREAMS):
                core.add_request(SynthesisRequest(f"r{i}", texts[i % 4], params=params[i]))
            chunks = drain(core)
            core.tracer.close()
        finally:
            torch.set_num_threads(threads)
        alone_runs = [f.result() for f in alone_runs]

    assert core.stats.backlog_steps > 0 and core.stats.chunk_sizes[50] > 0  # the switch really happened
    with frame_audit_alongside(trace):  # the CLI's audit runs beside the checks below
        rows = {}
        for r in audit_file(trace).values():
            rows[r.request_id] = r
        for i in range(STREAMS):
            rid = f"r{i}"
            got = chunks[rid]
            assert sum(c.finished for c in got) == 1 and got[-1].finished
            tokens, codes = alone_runs[i]
            assert len(tokens) == got[-1].end_frame == rows[rid].frames
            # Each streamed chunk is the decode of its window alone, trimmed to its new frames.
            for c, (start, end, ctx) in zip(got, _spans(trace, rid)):
                assert (c.start_frame, c.end_frame) == (start, end)
                if end == start:
                    continue
                window = fish64.decode(codes[:, start - ctx : end][None], start - ctx)[0, ctx * 2048 :]
                # float64 decodes, batched or alone, agree to ~1e-15; the float32 chunk to its last bit.
                diff = (torch.from_numpy(c.audio).double() - window).abs().max()
                assert diff < 1e-7, (rid, start, end, float(diff))


def _spans(trace, rid):
    import json

    return [(r["start"], r["end"], r["context"]) for r in map(json.loads, open(trace)) if r["request_id"] == rid]


@pytest.mark.parametrize("in_flight", [False, True])
def test_no_leaks_after_200_requests_half_cancelled(tiny_fish, in_flight):
    core = EngineCore(tiny_fish, hc_profile(**{"ar.max_num_seqs": 16, "ar.max_waiting": 300,
                                              "ar.async_steps": in_flight}))
    rnd = random.Random(7)
    cancel_at = {}
    for i in range(200):
        core.add_request(SynthesisRequest(f"r{i}", "Leak check", params=SamplingParams(seed=i, max_new_tokens=12)))
        if i % 2:
            cancel_at[f"r{i}"] = rnd.randint(0, 40)
    step = 0

    def cancel(core):
        nonlocal step
        for rid, at in cancel_at.items():
            if at == step:
                core.abort(rid)
        step += 1

    chunks = drain(core, cancel)
    snap = core.snapshot()
    assert snap["live_requests"] == snap["running"] == snap["waiting"] == snap["planner_requests"] == 0
    assert snap["kv_tables"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"]
    assert all(sum(c.finished for c in cs) == 1 for cs in chunks.values()) and len(chunks) == 200
    assert snap["finished"].get("abort", 0) >= 50


def test_a_bad_request_fails_alone(tiny_fish):
    core = EngineCore(tiny_fish, hc_profile())
    core.add_request(SynthesisRequest("good", "Fine text", params=SamplingParams(seed=1, max_new_tokens=10)))
    core.add_request(SynthesisRequest("empty", "   ", params=SamplingParams(seed=1)))
    core.add_request(SynthesisRequest("bad-top-p", "x", params=SamplingParams(top_p=3.0)))
    core.add_request(SynthesisRequest("good", "duplicate id"))
    chunks = drain(core)
    assert chunks["empty"][0].stop_reason == "error" and "must not be empty" in chunks["empty"][0].error
    assert "top_p" in chunks["bad-top-p"][0].error
    good = chunks["good"]
    assert sum(c.error is not None for c in good) == 1  # the duplicate was refused
    assert any(c.finished and c.stop_reason in ("stop", "length") for c in good)


def test_a_lost_gpu_context_stops_the_core_while_other_step_errors_fail_only_their_batch(tiny_fish, monkeypatch):
    """A CUDA sticky error (the context refuses all later work) must end the core, so its process
    exits and the supervisor starts a new one, instead of failing every later request one by one;
    a recoverable error (out of memory, a bug) fails only the batch it hit."""
    core = EngineCore(tiny_fish, hc_profile())
    run = core.runner.run
    failure = [RuntimeError("CUDA error: out of memory")]

    def failing(reqs):
        if failure:
            raise failure.pop()
        return run(reqs)
    monkeypatch.setattr(core.runner, "run", failing)
    core.add_request(SynthesisRequest("r0", "First one", params=SamplingParams(seed=1, max_new_tokens=6)))
    first = drain(core)["r0"]
    assert first[-1].stop_reason == "error" and "out of memory" in first[-1].error
    core.add_request(SynthesisRequest("r1", "Second one", params=SamplingParams(seed=2, max_new_tokens=6)))
    assert drain(core)["r1"][-1].stop_reason == "length"  # the engine went on
    failure.append(RuntimeError("CUDA error: an illegal memory access was encountered\nCompile with ..."))
    core.add_request(SynthesisRequest("r2", "Third one", params=SamplingParams(seed=3, max_new_tokens=6)))
    with pytest.raises(DeviceLost, match="illegal memory access"):
        drain(core)


def test_full_queue_refuses_with_an_error(tiny_fish):
    core = EngineCore(tiny_fish, hc_profile(**{"ar.max_num_seqs": 1, "ar.max_waiting": 2}))
    for i in range(4):
        core.add_request(SynthesisRequest(f"r{i}", "queue", params=SamplingParams(seed=i, max_new_tokens=3)))
    chunks = drain(core)
    refused = sorted(rid for rid, cs in chunks.items() if cs[0].error)
    # Nothing is admitted before the next step: the idle seat's request and two more wait, the fourth is refused.
    assert refused == ["r3"] and "waiting" in chunks["r3"][0].error
    assert all(cs[-1].stop_reason in ("stop", "length") for rid, cs in chunks.items() if rid not in refused)


def test_a_burst_that_idle_seats_take_is_not_refused(tiny_fish):
    """max_waiting bounds the requests beyond the free seats: a burst of as many requests as there
    are seats, arriving before any step, all run (none is refused for having come at once)."""
    core = EngineCore(tiny_fish, hc_profile(**{"ar.max_num_seqs": 4, "ar.max_waiting": 0}))
    for i in range(5):
        core.add_request(SynthesisRequest(f"r{i}", "burst", params=SamplingParams(seed=i, max_new_tokens=3)))
    chunks = drain(core)
    assert sorted(rid for rid, cs in chunks.items() if cs[0].error) == ["r4"]
    assert all(chunks[f"r{i}"][-1].stop_reason in ("stop", "length") for i in range(4))


def test_request_too_big_for_the_cache_is_refused(tiny_fish):
    core = EngineCore(tiny_fish, hc_profile(**{"ar.kv_cache_tokens": 64}))
    core.add_request(SynthesisRequest("big", "x", params=SamplingParams(seed=1, max_new_tokens=500)))
    chunks = drain(core)
    assert "KV cache" in chunks["big"][0].error


def test_per_request_initial_chunk(tiny_fish):
    core = EngineCore(tiny_fish, hc_profile())
    core.add_request(SynthesisRequest("a", "Hello", params=SamplingParams(seed=5, max_new_tokens=30,
                                                                            ignore_eos=True), initial_chunk_frames=2))
    chunks = drain(core)["a"]
    assert (chunks[0].start_frame, chunks[0].end_frame) == (0, 2)
    assert chunks[-1].end_frame == 30  # ignore_eos forces the length


def test_kv_admission_waits_instead_of_overcommitting(tiny_fish):
    # Room for about two requests at a time: the rest wait, and all finish.
    core = EngineCore(tiny_fish, hc_profile(**{"ar.kv_cache_tokens": 2 * 96, "ar.block_size": 16}))
    for i in range(5):
        core.add_request(SynthesisRequest(f"r{i}", "Hi", params=SamplingParams(seed=i, max_new_tokens=40)))
    peak = 0
    while core.has_work():
        core.step()
        peak = max(peak, len(core.scheduler.running))
        assert core.blocks.num_free >= 0
    assert peak == 2
    assert core.snapshot()["kv_blocks_free"] == core.kv.num_blocks
