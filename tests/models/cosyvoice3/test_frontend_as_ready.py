"""CosyVoice3's reference frontend hands each clip back when it is done, not when its batch is."""

import threading
import time

import torch

from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.engine.frontend_stage import FrontendStage
from intone.models.registry import load_model
from intone.protocol import SynthesisRequest, VoiceReference


def clip(seconds: float, pitch: float, rate: int = 16000) -> torch.Tensor:
    t = torch.arange(int(seconds * rate)) / rate
    return (0.3 * torch.sin(2 * torch.pi * pitch * t)).float()


class GatedSpeakerEncoder:
    """The real CAM++ calls, counted; the calls numbered in `gates` wait until their event is set."""

    def __init__(self, encoder, gates: dict[int, threading.Event]):
        self.encoder, self.gates, self.calls = encoder, gates, 0
        self.real = encoder.embed_batch

    def __call__(self, clips):
        self.calls += 1
        gate = self.gates.get(self.calls)
        assert gate is None or gate.wait(60), f"CAM++ call {self.calls} was never released"
        return self.real(clips)

    def __enter__(self):
        self.encoder.embed_batch = self
        return self

    def __exit__(self, *exc):
        for gate in self.gates.values():
            gate.set()
        self.encoder.embed_batch = self.real


def wait_until(condition, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_the_model_yields_a_clip_before_embedding_the_next(tiny_cosy):
    clips = [(clip(1.0 + 0.2 * i, 140 + 30 * i), 16000) for i in range(3)]
    with GatedSpeakerEncoder(tiny_cosy.speaker_encoder, {}) as encoder:
        seen = []
        for i, features in tiny_cosy.reference_features_as_ready(clips):
            seen.append((i, encoder.calls))
            assert not isinstance(features, Exception)
    assert seen == [(0, 1), (1, 2), (2, 3)]
    alone = tiny_cosy.reference_features_batch(clips[2:])[0]
    together = tiny_cosy.reference_features_batch(clips)[2]
    assert torch.equal(alone["speech_tokens"], together["speech_tokens"])
    assert torch.equal(alone["speaker"], together["speaker"])


def test_the_stage_hands_back_a_request_while_its_batch_is_still_encoding(tiny_cosy):
    stage = FrontendStage(tiny_cosy, cache_bytes=1 << 20)
    first, last = threading.Event(), threading.Event()
    requests = [SynthesisRequest(f"r{i}", "Hello there.", [VoiceReference("Ref.", clip(1.0 + 0.2 * i, 150 + 20 * i),
                                                                             16000)]) for i in range(4)]
    collected: list[str] = []

    def collect() -> list[str]:
        for prepared in stage.collect():
            assert prepared.error is None, prepared.error
            collected.append(prepared.request.request_id)
        return collected

    try:
        with GatedSpeakerEncoder(tiny_cosy.speaker_encoder, {1: first, 4: last}) as encoder:
            stage.submit(requests[0])  # the worker takes r0 alone and waits in its CAM++ call
            assert wait_until(lambda: encoder.calls == 1)
            for r in requests[1:]:  # queued meanwhile: the next batch is r1, r2, r3
                stage.submit(r)
            first.set()
            # r1 comes back while r3's speaker vector (CAM++ call 4) is still held
            assert wait_until(lambda: "r1" in collect()), collected
            assert wait_until(lambda: encoder.calls == 4) and "r3" not in collect()
            last.set()
            assert wait_until(lambda: len(collect()) == 4)
        assert collected == ["r0", "r1", "r2", "r3"] and stage.batches == 2 and stage.clips == 4
    finally:
        stage.close()



def test_hand_back_batch_keeps_a_batch_together(tiny_cosy):
    """`frontend.hand_back: batch` (the behaviour before, kept for A/B runs): no request of a batch
    goes back before its last clip is done."""
    stage = FrontendStage(tiny_cosy, cache_bytes=0, each=False)
    first, last = threading.Event(), threading.Event()
    requests = [SynthesisRequest(f"r{i}", "Hi.", [VoiceReference("Ref.", clip(1.0, 150 + 20 * i), 16000)])
                for i in range(4)]
    got: list[str] = []

    def collect() -> list[str]:
        got.extend(p.request.request_id for p in stage.collect())
        return got

    try:
        with GatedSpeakerEncoder(tiny_cosy.speaker_encoder, {1: first, 4: last}) as encoder:
            stage.submit(requests[0])
            assert wait_until(lambda: encoder.calls == 1)
            for r in requests[1:]:
                stage.submit(r)
            first.set()
            assert wait_until(lambda: encoder.calls == 4)  # r1 and r2 are encoded, r3's CAM++ is held
            assert collect() == ["r0"]
            last.set()
            assert wait_until(lambda: len(collect()) == 4)
        assert got == ["r0", "r1", "r2", "r3"]
    finally:
        stage.close()


def test_the_profile_lets_same_bucket_clips_share_a_campplus_call_with_their_alone_features(tiny_cosy_dir):
    """`cosyvoice3.speaker_rows` / `speaker_bucket_s` reach the model through the engine: five clips of
    2.5-3.7 s (one 2 s bucket) take two CAM++ network calls of four rows instead of five calls, a bad
    clip among them gets its own error, and each good clip's features are the bits it gets alone
    (on a CPU; on a GPU, see the gpu test of row positions)."""
    model = load_model(str(tiny_cosy_dir))  # its own: the profile reconfigures its CAM++
    profile = load_profile("cosyvoice3-streaming", device="cpu",
                           **{"cosyvoice3.speaker_rows": 4, "cosyvoice3.speaker_bucket_s": 2})
    core = EngineCore(model, profile)
    try:
        clips = [(clip(2.5 + 0.3 * i, 120 + 15 * i), 16000) for i in range(5)]
        clips.insert(2, (torch.zeros(0), 16000))  # a bad clip: its own error, the others' indices unmoved
        network, forwards = model.speaker_encoder._forward, []
        model.speaker_encoder._forward = lambda x, lengths: forwards.append(x.shape) or network(x, lengths)
        try:
            together = dict(model.reference_features_as_ready(clips))
        finally:
            model.speaker_encoder._forward = network
        assert [shape[0] for shape in forwards] == [4, 4] and sorted(together) == list(range(6))
        assert isinstance(together.pop(2), Exception)
        for i in together:
            alone = model.reference_features_batch([clips[i]])[0]
            assert torch.equal(alone["speaker"], together[i]["speaker"]), i
            assert torch.equal(alone["speech_tokens"], together[i]["speech_tokens"]), i
    finally:
        core.close()


def test_two_workers_prepare_a_request_while_the_other_is_held_and_close_joins_both(tiny_cosy):
    """`frontend.workers: 2`: while one worker is held inside its CAM++ call, the other takes the
    next request and hands it back; each request gets the features it gets alone; close() ends
    both threads."""
    before = set(threading.enumerate())
    stage = FrontendStage(tiny_cosy, cache_bytes=0, workers=2)
    held = threading.Event()
    requests = [SynthesisRequest(f"r{i}", "Hello there.", [VoiceReference("Ref.", clip(1.0 + 0.3 * i, 150 + 20 * i),
                                                                             16000)]) for i in range(2)]
    prepared: dict[str, object] = {}

    def collect() -> dict:
        for p in stage.collect():
            assert p.error is None, p.error
            prepared[p.request.request_id] = p
        return prepared

    try:
        with GatedSpeakerEncoder(tiny_cosy.speaker_encoder, {1: held}) as encoder:
            stage.submit(requests[0])  # one worker takes r0 and waits in CAM++ call 1
            assert wait_until(lambda: encoder.calls == 1)
            stage.submit(requests[1])  # the other worker takes r1
            assert wait_until(lambda: "r1" in collect()) and "r0" not in prepared
            held.set()
            assert wait_until(lambda: len(collect()) == 2)
        for r in requests:
            alone = tiny_cosy.reference_features_batch([(r.references[0].audio, 16000)])[0]
            got = prepared[r.request_id].request.references[0].features
            assert torch.equal(torch.as_tensor(got["speaker"]), alone["speaker"])
    finally:
        stage.close()
    started = [t for t in threading.enumerate() if t not in before and t.name.startswith("intone-frontend")]
    assert not started, started


def test_a_request_queued_behind_a_held_worker_is_counted_as_queued_and_the_worker_as_busy(tiny_cosy):
    """The stage's saturation counters: with its one worker held 0.3 s inside a CAM++ call, the
    request submitted meanwhile waits for it (queued), and the worker's batches count as busy."""
    stage = FrontendStage(tiny_cosy, cache_bytes=0)
    held = threading.Event()
    requests = [SynthesisRequest(f"r{i}", "Hello there.", [VoiceReference("Ref.", clip(1.0 + 0.3 * i, 150 + 20 * i),
                                                                             16000)]) for i in range(2)]
    try:
        with GatedSpeakerEncoder(tiny_cosy.speaker_encoder, {1: held}) as encoder:
            stage.submit(requests[0])
            assert wait_until(lambda: encoder.calls == 1)
            stage.submit(requests[1])
            time.sleep(0.3)
            held.set()
            done: list = []

            def all_back() -> bool:
                done.extend(stage.collect())
                return len(done) == 2
            assert wait_until(all_back)
        assert wait_until(lambda: stage.jobs == 2)  # counted after the batch's last hand-back
        assert stage.batches == 2
        assert stage.queued_s >= 0.3  # r1 waited for r0's held batch
        assert stage.busy_s >= 0.3
    finally:
        stage.close()
