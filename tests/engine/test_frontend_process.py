"""The reference frontend in processes of its own (`frontend.process`): a clip gets the features it gets
from the frontend thread, a request the same tokens; a bad clip refuses its own request, naming the field;
a dead frontend process fails the engine loudly instead of refusing every later voice."""

import os
import signal

import numpy as np
import pytest
import torch

from intone.engine.config import ProfileError, load_profile
from intone.engine.core import EngineCore
from intone.engine.frontend_process import FrontendProcess
from intone.protocol import SamplingParams, SynthesisRequest, VoiceReference

SPEC, PROFILE = "tiny:cosyvoice3", "cosyvoice3-streaming"


def clip(i: int) -> torch.Tensor:
    t = torch.arange(int((1.0 + 0.3 * i) * 16000)) / 16000
    return (0.3 * torch.sin(2 * torch.pi * (140 + 15 * i) * t)).float()


def run(process: bool, bad: int | None = None):
    """Four requests with their own voices (the `bad`th's audio holds a NaN); each request's chunks, and the
    core's snapshot."""
    profile = load_profile(PROFILE, device="cpu", **{"frontend.process": process, "frontend.workers": 2})
    core = EngineCore.build(SPEC, profile)
    try:
        for i in range(4):
            audio = clip(i)
            if i == bad:
                audio[100] = float("nan")
            core.add_request(SynthesisRequest(
                f"r{i}", "Hello over there, friend.", [VoiceReference("A short reference voice.", audio=audio,
                                                                       sample_rate=16000)],
                SamplingParams(seed=i, max_new_tokens=20, min_new_tokens=20), stream=i % 2 == 0))
        chunks = {}
        while core.has_work():
            for c in core.step():
                chunks.setdefault(c.request_id, []).append(c)
        return chunks, core.snapshot()
    finally:
        core.close()


def test_a_frontend_process_gives_the_features_of_the_model_here(tiny_cache):
    profile = load_profile(PROFILE, device="cpu")
    encoder = FrontendProcess(SPEC, profile)  # its process starts up while the model loads and encodes here
    core = None
    try:
        core = EngineCore.build(SPEC, profile)  # the model as the engine loads it, its frontend here
        clips = [(clip(i), 16000) for i in range(3)]
        threads = torch.get_num_threads()
        # as many threads as the process (OMP_NUM_THREADS, tests/conftest.py): the same sums, bit for bit
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads)))
        try:
            here = dict(core.model.reference_features_as_ready(clips))
        finally:
            torch.set_num_threads(threads)
        encoder.wait_ready()
        there = dict(encoder.encode(clips))
        assert sorted(there) == [0, 1, 2]
        for i in range(3):
            assert here[i].keys() == there[i].keys()
            for name in here[i]:
                assert there[i][name].dtype == here[i][name].dtype
                assert torch.equal(there[i][name], here[i][name]), name
    finally:
        encoder.close()
        if core is not None:
            core.close()


def test_requests_get_the_chunks_of_the_frontend_threads_and_a_bad_clip_refuses_its_own(tiny_cache):
    threads, _ = run(process=False, bad=1)
    processes, snap = run(process=True, bad=1)
    assert threads.keys() == processes.keys() == {f"r{i}" for i in range(4)}
    (refused,) = processes["r1"]  # its clip holds a NaN: refused alone, naming the field, as in the threads
    assert refused.stop_reason == "error" and refused.error_code == "invalid_request"
    assert refused.error_field == "ref_audio" and "NaN" in refused.error
    for rid in threads:
        a, b = threads[rid], processes[rid]
        assert [(c.start_frame, c.end_frame, c.finished, c.stop_reason, c.completion_tokens, c.error) for c in a] == \
            [(c.start_frame, c.end_frame, c.finished, c.stop_reason, c.completion_tokens, c.error) for c in b]
        # the codec's calls group chunks by timing: equal to float rounding (as in test_codec_process)
        np.testing.assert_allclose(np.concatenate([c.audio for c in a]), np.concatenate([c.audio for c in b]),
                                   rtol=1e-3, atol=1e-4)
    assert all(processes[f"r{i}"][-1].stop_reason == "length" for i in (0, 2, 3))
    assert snap["frontend_clips"] == 4 and snap["live_requests"] == 0 and snap["preparing"] == 0
    assert snap["kv_blocks_free"] == snap["kv_blocks_total"]
    # the processes' encoding happened while their workers waited for it
    assert 0 < snap["frontend_process_seconds"] <= snap["frontend_busy_seconds"]


def test_a_dead_frontend_process_fails_the_engine_loudly(tiny_cache):
    core = EngineCore.build(SPEC, load_profile(PROFILE, device="cpu", **{"frontend.process": True, "frontend.workers": 1}))
    try:
        (encoder,) = core.frontend.encoders
        os.kill(encoder.pid, signal.SIGKILL)
        encoder._child.process.wait()
        core.add_request(SynthesisRequest("r0", "Hello there.", [VoiceReference("Hi.", audio=clip(0),
                                                                                 sample_rate=16000)]))
        with pytest.raises(RuntimeError, match="frontend process 0 exited"):
            while core.has_work():
                core.step()
    finally:
        core.close()


def test_a_frontend_process_has_no_sm_share():
    with pytest.raises(ProfileError, match="frontend.sms needs the in-process"):
        load_profile(PROFILE, **{"frontend.process": True, "frontend.sms": 64})
