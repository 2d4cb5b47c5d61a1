"""The reference frontend stage: batched, cached, and a bad clip refuses only its own request."""

import time

import numpy as np
import torch

from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.engine.frontend_stage import ReferenceCache
from intone.protocol import SamplingParams, SynthesisRequest, VoiceReference, clip_key


def clip(seconds: float, pitch: float, rate: int = 16000) -> torch.Tensor:
    t = torch.arange(int(seconds * rate)) / rate
    return (0.3 * torch.sin(2 * torch.pi * pitch * t) * (1 + 0.5 * torch.sin(2 * torch.pi * 3 * t))).float()


def drain(core):
    chunks = {}
    while core.has_work():
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
    return chunks


def test_batched_encodes_equal_each_clip_alone_and_bad_clips_fail_alone(tiny_fish):
    clips = [(clip(1.0 + 0.3 * i, 120 + 20 * i), 16000) for i in range(5)]
    clips.insert(2, (torch.zeros(0), 16000))
    together = tiny_fish.reference_features_batch(clips)
    assert isinstance(together[2], Exception)
    for i, (audio, rate) in enumerate(clips):
        if i != 2:
            assert torch.equal(together[i]["codes"], tiny_fish.encode_reference(audio, rate))


def test_requests_with_references_get_the_tokens_they_would_get_alone(tiny_fish):
    profile = load_profile("fish-s2-default", device="cpu")
    refs = [VoiceReference("A short reference.", audio=clip(1.0 + 0.25 * i, 150 + 10 * i), sample_rate=16000)
            for i in range(6)]
    reqs = [SynthesisRequest(f"r{i}", "Hello there.", [refs[i]], SamplingParams(seed=i, max_new_tokens=12))
            for i in range(6)]
    bad = SynthesisRequest("bad", "Hello there.", [VoiceReference("x", audio=torch.zeros(0), sample_rate=16000)])
    core = EngineCore(tiny_fish, profile)
    for r in reqs[:3] + [bad] + reqs[3:]:
        core.add_request(r)
    together = drain(core)
    assert together["bad"][-1].error_code == "invalid_request" and len(together["bad"]) == 1
    for r in reqs:
        alone = EngineCore(tiny_fish, profile)
        alone.add_request(r)
        expected = drain(alone)[r.request_id]
        got = together[r.request_id]
        assert [c.completion_tokens for c in got] == [c.completion_tokens for c in expected]
        # Same codes (different codes would give unrelated audio); fp32 codec batches round differently.
        assert np.allclose(np.concatenate([c.audio for c in got]), np.concatenate([c.audio for c in expected]),
                           atol=1e-4)
        assert got[-1].timings["frontend_s"] > 0 and got[-1].timings["total_s"] >= got[-1].timings["decode_s"]
    snap = core.snapshot()
    assert snap["reference_cache_misses"] == 7 and snap["frontend_clips"] == 7 and snap["live_requests"] == 0


def test_a_repeated_clip_is_encoded_once(tiny_fish):
    core = EngineCore(tiny_fish, load_profile("fish-s2-default", device="cpu"))
    ref = clip(1.2, 140)
    for i in range(3):
        core.add_request(SynthesisRequest(f"r{i}", "Hi.", [VoiceReference("Ref.", audio=ref.clone(), sample_rate=16000)],
                                          SamplingParams(seed=i, max_new_tokens=4)))
        drain(core)
    snap = core.snapshot()
    assert snap["reference_cache_misses"] == 1 and snap["reference_cache_hits"] == 2 and snap["frontend_clips"] == 1
    stored = core.encode_reference(ref.numpy(), 16000)  # a voice upload of the same clip: no new encode
    assert core.snapshot()["frontend_clips"] == 1 and stored["codes"].shape[0] == tiny_fish.num_codebooks


def test_aborting_while_the_reference_is_encoded_frees_everything(tiny_fish):
    core = EngineCore(tiny_fish, load_profile("fish-s2-default", device="cpu"))
    core.add_request(SynthesisRequest("r", "Hi.", [VoiceReference("Ref.", audio=clip(2.0, 100), sample_rate=16000)]))
    core.abort("r")
    chunks = drain(core)
    assert [c.stop_reason for c in chunks["r"]] == ["abort"]
    # The frontend's worker done with the request's job (encoded, or dropped as cancelled: then nothing is
    # handed back, so waiting for a hand-back would wait out its timeout), within the same 5 s.
    deadline = time.monotonic() + 5
    while core.snapshot()["frontend_jobs"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    core.step()
    assert core.snapshot()["live_requests"] == 0 and core.snapshot()["preparing"] == 0


def test_the_cache_is_bounded_and_keyed_by_samples_and_rate():
    cache = ReferenceCache(max_bytes=3 * 800)
    a = torch.ones(100, dtype=torch.float64)  # 800 bytes each
    keys = [clip_key(np.full(10, i, np.float32), 16000) for i in range(4)]
    for k in keys:
        cache.put(k, {"codes": a})
    assert len(cache) == 3 and cache.bytes == 2400 and cache.get(keys[0]) is None
    assert cache.get(keys[3]) is not None and (cache.hits, cache.misses) == (1, 1)
    assert clip_key(np.zeros(10, np.float32), 16000) != clip_key(np.zeros(10, np.float32), 22050)


def test_a_voice_upload_is_encoded_beside_the_running_streams(tiny_fish):
    """Uploads go through the frontend's worker (never the loop's thread) while requests keep stepping,
    and come back equal to the same clip encoded directly."""
    import threading

    core = EngineCore(tiny_fish, load_profile("fish-s2-default", device="cpu"))
    threads, encode = [], tiny_fish.reference_features_batch

    def recording(clips, *a, **k):
        threads.append(threading.current_thread().name)
        return encode(clips, *a, **k)
    tiny_fish.reference_features_batch = recording
    try:
        core.add_request(SynthesisRequest("r", "Keep talking.", params=SamplingParams(seed=1, max_new_tokens=30)))
        upload = clip(3.0, 180)
        core.submit_encode("voice-1", upload.numpy(), 16000)
        steps_before = core.stats.steps
        encoded = []
        while not encoded or core.has_work():
            core.step()
            encoded += core.take_encoded()
        (token, features, error), = encoded
        assert token == "voice-1" and error is None
        assert threads == ["intone-frontend"]  # encoded on the worker, not in a step
        assert core.stats.steps > steps_before and core.frontend.pending_encodes == 0
        direct = tiny_fish.encode_reference(upload, 16000)
        assert np.array_equal(features["codes"], direct.numpy())
        core.submit_encode("voice-2", np.zeros(0, np.float32), 16000)  # unusable audio: an error, no crash
        while core.frontend.pending_encodes or not (done := core.take_encoded()):
            core.step()
        assert done[0][0] == "voice-2" and done[0][1] is None and done[0][2]
    finally:
        tiny_fish.reference_features_batch = encode
        core.close()
