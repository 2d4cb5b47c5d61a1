"""The codec stage in a process of its own: the same chunks as on the worker thread;
aborts and finishes leave no request state in that process; a dead codec process fails the engine
loudly (the supervisor then restarts it) instead of leaving its requests waiting."""

import os
import signal

import numpy as np
import pytest
import torch

from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.protocol import SamplingParams, SynthesisRequest, VoiceReference


def reference(i: int) -> VoiceReference:
    t = torch.arange(int((1.0 + 0.2 * i) * 16000)) / 16000
    audio = (0.3 * torch.sin(2 * torch.pi * (140 + 15 * i) * t)).float()
    return VoiceReference("A short reference voice.", audio=audio, sample_rate=16000)


def run(spec: str, profile_name: str, process: bool, abort_at: int | None = None, **overrides):
    profile = load_profile(profile_name, device="cpu", **{"codec.process": process, **overrides})
    core = EngineCore.build(spec, profile)
    for i in range(4):
        core.add_request(SynthesisRequest(f"r{i}", "Hello over there, friend.", [reference(i)],
                                          SamplingParams(seed=i, max_new_tokens=24, min_new_tokens=24),
                                          stream=i % 3 != 0))
    chunks, steps = {}, 0
    try:
        while core.has_work():
            for c in core.step():
                chunks.setdefault(c.request_id, []).append(c)
            steps += 1
            if steps == abort_at:
                core.abort("r1")
        return chunks, core.snapshot(), core.codec_worker
    finally:
        core.close()


def spans(chunks):
    return [(c.start_frame, c.end_frame, c.finished, c.stop_reason) for c in chunks]


# Fish's chunk boundaries by frame counts, the same in both runs (its shipped listener margin makes them follow timing)
FIXED_SPANS = {"chunking.listener_margin_s": 0}


@pytest.mark.parametrize("spec, profile, overrides", [
    ("tiny:cosyvoice3", "cosyvoice3-streaming", {}),
    ("tiny:fish-s2", "fish-s2-high-concurrency", {"codec.packed_decode": True, "codec.stream_graph_frames": 0,
                                                  "fish_s2.decoder_layout": "channels_first", **FIXED_SPANS}),
    ("tiny:fish-s2", "fish-s2-high-concurrency", {"codec.schedule": "awaited", "chunking.whole_chunk_frames": 8,
                                                  **FIXED_SPANS}),
])
def test_codec_process_gives_the_chunks_of_the_worker_thread(tiny_cache, spec, profile, overrides):
    """CosyVoice3: the stage whose per-request state (mel history, released samples) lives in the process.
    Fish: its carried decode states, whole responses in pieces, the packed decode; the `awaited` schedule (the
    process's queue reads its jobs' requests as the worker reads its own)."""
    thread, _, _ = run(spec, profile, process=False, **overrides)
    process, snap, worker = run(spec, profile, process=True, **{"codec.device": "cpu"}, **overrides)  # placed explicitly
    assert thread.keys() == process.keys() == {f"r{i}" for i in range(4)}
    for rid in thread:
        assert spans(thread[rid]) == spans(process[rid])
        # Which chunks share a decode call depends on timing in both, and a batch of another shape
        # rounds differently: equal to float rounding, not bit for bit (that needs batch-invariant kernels).
        for a, b in zip(thread[rid], process[rid]):
            np.testing.assert_allclose(a.audio, b.audio, rtol=1e-3, atol=1e-4)  # -60 dB of each sample, -80 dB near 0
    assert snap["codec_calls"] > 0 and worker.live_requests == 0 and worker.in_flight == 0


def test_aborts_leave_no_state_in_the_codec_process(tiny_cache):
    """Fish (the default stage, carrying each request's codec state there) in the process: aborts end
    once, the rest run to their length, each chunk's audio exactly its frames long."""
    chunks, snap, worker = run("tiny:fish-s2", "fish-s2-default", process=True, abort_at=8,
                               **{"codec.carry_state": True})
    assert all(c.audio.shape[0] == 2048 * (c.end_frame - c.start_frame) for cs in chunks.values() for c in cs)
    assert chunks["r1"][-1].stop_reason == "abort" and sum(c.finished for c in chunks["r1"]) == 1
    assert all(chunks[f"r{i}"][-1].stop_reason == "length" for i in (0, 2, 3))
    assert worker.live_requests == 0 and worker.in_flight == 0
    assert snap["live_requests"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"]


def test_a_dead_codec_process_fails_the_engine_loudly(tiny_cache):
    core = EngineCore.build("tiny:fish-s2", load_profile("fish-s2-default", device="cpu", **{"codec.process": True}))
    try:
        core.add_request(SynthesisRequest("r0", "Hello there.", params=SamplingParams(seed=0, max_new_tokens=30)))
        os.kill(core.codec_worker.pid, signal.SIGKILL)
        core.codec_worker._child.process.wait()
        with pytest.raises(RuntimeError, match="codec process exited"):
            while core.has_work():
                core.step()
    finally:
        core.close()


@pytest.mark.parametrize("gather_ms, calls", [(400, 1), (0, 2)])
def test_the_codec_process_gathers_non_streamed_pieces_as_the_worker_does(tiny_fish_dir, gather_ms, calls):
    """codec.gather_ms in the process: a non-streamed request's piece waits for company until the oldest has
    waited that long, so two pieces handed over 100 ms apart go in one call; with no gathering, in two."""
    import pickle
    import threading
    import time

    import zmq

    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_process import Job, _loop, call_hold
    from intone.engine.codec_worker import ChunkQueue
    from intone.engine.loading import codec_stage_for
    from intone.models.base import Prompt
    from intone.models.registry import load_model

    model = load_model(str(tiny_fish_dir))
    profile = load_profile("fish-s2-high-concurrency", device="cpu", **{"codec.gather_ms": gather_ms})
    stage = codec_stage_for(model, profile)
    k = model.num_codebooks
    context = zmq.Context.instance()
    name = f"inproc://codec-gather-{gather_ms}"
    engine_push, child_pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    child_push, engine_pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    child_pull.bind(name + "-in"), engine_push.connect(name + "-in")
    engine_pull.bind(name + "-out"), child_push.connect(name + "-out")
    child = threading.Thread(target=_loop, args=(stage, ChunkQueue(None), child_pull, child_push, call_hold(profile)))
    child.start()

    def piece(i: int) -> Job:
        prompt = Prompt(torch.zeros(0, dtype=torch.long), torch.zeros(0, k, dtype=torch.long))
        codes = torch.randint(0, 8, (k, 12), generator=torch.Generator().manual_seed(i))
        return Job(i, Chunk(f"r{i}", 0, 12, 0, False), codes, prompt, 1.0, time.perf_counter(), False)
    try:
        engine_push.send(pickle.dumps(("chunks", [piece(0)])))
        time.sleep(0.1)
        engine_push.send(pickle.dumps(("chunks", [piece(1)])))
        decoded = []
        while sum(len(m[1]) for m in decoded) < 2:
            assert engine_pull.poll(5000), "the codec process sent nothing"
            decoded.append(pickle.loads(engine_pull.recv()))
        assert [m[0] for m in decoded] == ["decoded"] * calls
        assert all(isinstance(audio, np.ndarray) and audio.shape == (12 * 2048,) for m in decoded for _, audio in m[1])
    finally:
        engine_push.send(pickle.dumps(("shutdown",)))
        child.join(10)
        for s in (engine_push, child_pull, child_push, engine_pull):
            s.close(linger=0)
