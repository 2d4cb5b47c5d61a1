"""The codec worker's schedule for `prepare` chunks (cosyvoice3.flow.reference_ahead), on the real tiny model in
float64 through the real CodecWorker: a prepare is work done ahead, never a first chunk; a stream whose first hop
is taken first skips its prepare; and a first hop never goes into a pause point of the call that prepares its
stream (its state would be overwritten by the older one that call commits). Every chunk stays the official one."""

import threading

import pytest
import torch

from intone.engine.chunk_planner import Chunk
from intone.engine.codec_stage import CodecStage
from intone.engine.codec_worker import CodecWorker
from intone.engine.config import load_profile
from intone.engine.request import EngineRequest
from intone.protocol import SamplingParams

from .official_stream import official_stream
from .test_streaming import TEXTS, assert_same_audio, voices


def _stage(model):
    profile = load_profile("cosyvoice3-streaming", device="cpu", **{
        "cosyvoice3.flow.attention": "sdpa", "cosyvoice3.flow.cache": True, "cosyvoice3.flow.reference_ahead": True})
    return CodecStage(model.make_vocoder(profile.codec, profile.options_for("cosyvoice3")))


def _stream(model, i: int, hops: int):
    """A request with tokens for its first `hops` official hops (25 padded to the reference's 25-token boundary,
    then 50) and their lookahead; its chunks; and the official audio of each."""
    prompt = model.build_prompt(TEXTS[i], voices(4)[i:i + 1])
    given = prompt.conditioning.speech_tokens.shape[0]
    ends = [25 + (-given) % 25]
    ends += [ends[0] + 50] * (hops > 1)
    tokens = torch.randint(0, 6561, (ends[-1] + 3,), generator=torch.Generator().manual_seed(i)).tolist()
    req = EngineRequest(f"s{i}", prompt=prompt, params=SamplingParams())
    req.codes = torch.tensor([tokens])
    chunks = [Chunk(req.request_id, start, end, 0, False) for start, end in zip([0, *ends], ends)]
    official = official_stream(model, tokens, prompt.conditioning)[:hops]
    assert [(s, e) for s, e, _ in official] == [(c.start, c.end) for c in chunks]
    return req, chunks, [audio for _, _, audio in official]


def _collect(worker, count):
    got = []
    while sum(len(d.items) for d in got) < count:
        worker.wait(1.0)
        got += worker.collect()
    return got


@pytest.mark.parametrize("preempt", [True, False])
def test_a_stream_whose_first_hop_is_taken_first_skips_its_prepare(cosy64, preempt):
    """Handed over together: under preempt the first hop is the only first chunk and its call takes it alone;
    in order (fifo) one call takes both. Either way the prepare is handed back undone."""
    stage = _stage(cosy64)
    req, [first], [audio] = _stream(cosy64, 1, 1)
    worker = CodecWorker(stage, cosy64.device, preempt=preempt)
    try:
        worker.submit([(req, Chunk(req.request_id, 0, 0, 0, False, prepare=True)), (req, first)], [0, first.end])
        got = _collect(worker, 2)
    finally:
        worker.close()
    skipped = [d for d in got if d.dropped]
    assert [[c.prepare for _, c in d.items] for d in skipped] == [[True]] and skipped[0].audio[0].shape == (0,)
    [decoded] = [d for d in got if not d.dropped]
    assert [c.start for _, c in decoded.items] == [0] and not decoded.preempted
    assert_same_audio(decoded.audio[0], audio)
    assert stage.vocoder.references_ahead == 0 and worker.prepares_skipped == 1
    assert worker.in_flight == 0 and worker.queued == 0


def test_a_first_hop_waits_out_the_call_that_prepares_its_stream(cosy64):
    """S's prepare is a call over the backlog; S's and T's first hops arrive during it: at its first pause point
    T's is decoded, S's waits for the call and then goes on from the state it committed. S's second hop is the
    official one, which it is not if S's first hop ran at the pause point (the prepare's state replaces its own)."""
    stage = _stage(cosy64)
    (s, s_chunks, s_audio), (t, [t_first], [t_audio]) = _stream(cosy64, 1, 2), _stream(cosy64, 2, 1)
    vocoder, gate, entered = stage.vocoder, threading.Event(), threading.Event()
    decode = vocoder.decode

    def gated(windows, states, pause=None):
        entered.set()
        gate.wait(30)
        return decode(windows, states, pause)
    vocoder.decode = gated
    worker = CodecWorker(stage, cosy64.device, preempt=True)
    try:
        worker.submit([(s, Chunk(s.request_id, 0, 0, 0, False, prepare=True))], [0])
        assert entered.wait(30)  # the prepare's call has begun
        worker.submit([(s, s_chunks[0]), (t, t_first)], [s_chunks[0].end, t_first.end])
        gate.set()
        got = _collect(worker, 3)
        worker.submit([(s, s_chunks[1])], [s_chunks[1].end])
        got += _collect(worker, 1)
    finally:
        worker.close()
    calls = [[(req.request_id, c.start, c.prepare) for req, c in d.items] for d in got]
    assert calls == [[("s2", 0, False)], [("s1", 0, True)], [("s1", 0, False)], [("s1", s_chunks[0].end, False)]]
    assert [d.preempted for d in got] == [True, False, False, False]
    assert got[1].audio[0].shape == (0,)
    for decoded, want in zip([got[0], got[2], got[3]], [t_audio, *s_audio]):
        assert_same_audio(decoded.audio[0], want)
    assert vocoder.references_ahead == 1 and worker.prepares_skipped == 0 and worker.in_flight == 0


def test_prepares_alone_make_no_first_chunk_call():
    """What the engine's counters call a first-chunk call, and what the queue puts first, leaves prepares out."""
    from intone.engine.codec_worker import is_first_chunk, opens_a_stream

    req = EngineRequest("p", prompt=None, params=SamplingParams())
    prepare, first = Chunk("p", 0, 0, 0, False, prepare=True), Chunk("p", 0, 28, 0, False)
    assert not is_first_chunk((req, prepare)) and not opens_a_stream((req, prepare))
    assert is_first_chunk((req, first)) and opens_a_stream((req, first))
