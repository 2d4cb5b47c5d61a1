"""The codec in the engine loop (`codec.overlap: false`): pieces gathered into fewer calls between the AR
steps, a stream's chunk never held, every request still its one-pass decode."""

import time

import numpy as np
import pytest
import torch

from intone.engine.chunk_planner import Chunk, Frontier
from intone.engine.codec_stage import CodecStage
from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.engine.loop_codec import LoopCodec
from intone.engine.request import EngineRequest
from intone.models.registry import load_model
from intone.models.vocoder import WindowVocoder
from intone.protocol import SamplingParams, SynthesisRequest
from tests.engine.test_codec_worker import run_keeping_codes, whole_responses


def _loop_codec(tiny_fish, **options):
    """A LoopCodec over the real windowed vocoder; calls records each call's request ids; four whole
    responses' chunks (r0-r3, non-streamed) to hand over."""
    stage = CodecStage(WindowVocoder(tiny_fish, max_batch=64, max_padded_frames=4096))
    calls, decode = [], stage.run

    def recorded(items, pause=None):
        calls.append([req.request_id for req, _ in items])
        return decode(items)
    stage.run = recorded
    items = whole_responses(tiny_fish, Frontier(0, whole=True))  # non-streamed
    return LoopCodec(stage, **options), calls, items, decode


def test_pieces_wait_for_company_and_a_streams_chunk_takes_them_along(tiny_fish):
    codec, calls, items, decode = _loop_codec(tiny_fish, gather_s=30.0, full=4)
    codec.submit([items["r0"], items["r1"]], [12, 13])
    assert codec.collect() == [] and calls == [] and codec.queued == 2 and codec.in_flight == 2
    stream = EngineRequest("s", prompt=None, params=SamplingParams())
    stream.codes, stream.frontier = items["r2"][0].codes, Frontier(4)  # a listener plays its chunks as they come
    codec.submit([(stream, Chunk("s", 0, 9, 0, False))], [14])
    got = codec.collect()
    assert calls == [["r0", "r1", "s"]] and codec.queued == 0 and codec.in_flight == 0
    for item, audio in zip(got[0].items, got[0].audio):
        assert np.allclose(audio, decode([item])[0], atol=1e-4)


def test_a_full_calls_worth_or_an_idle_loop_decodes_at_once(tiny_fish):
    codec, calls, items, _ = _loop_codec(tiny_fish, gather_s=30.0, full=3)
    codec.submit([items["r0"], items["r1"], items["r2"]], [12, 13, 14])  # `full` requests wait
    assert [len(d.items) for d in codec.collect()] == [3]
    codec.submit([items["r3"]], [15])
    assert codec.collect() == []
    codec.wait(0.01)  # the loop has nothing else to run
    assert [len(d.items) for d in codec.collect()] == [1] and calls == [["r0", "r1", "r2"], ["r3"]]


def test_without_gathering_every_collect_decodes_what_waits(tiny_fish):
    codec, calls, items, _ = _loop_codec(tiny_fish, max_call=2)
    codec.submit(list(items.values()), [12, 13, 14, 15])
    assert [len(d.items) for d in codec.collect()] == [2, 2] and codec.in_flight == 0


def _stream_chunk(codes, rid: str, start: int, end: int, finished: bool = False):
    req = EngineRequest(rid, prompt=None, params=SamplingParams())
    req.codes, req.frontier = codes, Frontier(4)  # a listener plays its chunks as they come
    return req, Chunk(rid, start, end, 0, finished)


def test_with_a_lead_a_playing_streams_chunk_waits_until_its_listener_needs_it(tiny_fish):
    """codec.stream_lead_ms: a stream's chunk between its first and its last waits until its deadline
    is within the lead (then it takes every waiting chunk along); a first chunk never waits."""
    codec, calls, items, _ = _loop_codec(tiny_fish, gather_s=30.0, full=64, lead_s=0.5)
    codes = items["r0"][0].codes
    now = time.perf_counter()
    codec.submit([_stream_chunk(codes, "s", 4, 9)], [9], [now + 60.0])  # its listener has a minute of audio
    codec.submit([items["r1"]], [13], [now])
    assert codec.collect() == [] and codec.queued == 2
    codec.submit([_stream_chunk(codes, "t", 4, 9)], [9], [now + 0.3])  # due within the lead
    assert [len(d.items) for d in codec.collect()] == [3] and calls == [["r1", "t", "s"]]  # earliest deadline first
    codec.submit([_stream_chunk(codes, "u", 4, 9)], [9], [now + 60.0])
    assert codec.collect() == []
    codec.submit([_stream_chunk(codes, "v", 0, 4)], [4], [now])  # a new stream's first chunk
    assert [len(d.items) for d in codec.collect()] == [2]


def test_with_a_lead_a_streams_last_chunk_is_decoded_at_once(tiny_fish):
    """A client may wait for a stream's end before its next request: the end never waits for its deadline."""
    codec, calls, items, _ = _loop_codec(tiny_fish, lead_s=0.5)
    codes = items["r0"][0].codes
    later = time.perf_counter() + 60.0
    codec.submit([_stream_chunk(codes, "s", 4, 9)], [9], [later])
    assert codec.collect() == []
    codec.submit([_stream_chunk(codes, "s2", 9, 12, finished=True)], [12], [later + 1])
    assert [len(d.items) for d in codec.collect()] == [2]


def test_a_full_calls_worth_of_held_chunks_is_decoded_at_once(tiny_fish):
    """The loop's backpressure waits on `max_batch` queued chunks: that many never wait for a deadline,
    even when fewer requests hold them (two streams far ahead of their listeners)."""
    codec, calls, items, _ = _loop_codec(tiny_fish, full=4, lead_s=0.5)
    codes, later = items["r0"][0].codes, time.perf_counter() + 60.0
    for rid in ("s", "t"):
        codec.submit([_stream_chunk(codes, rid, 4, 6)], [6], [later])
        assert codec.collect() == []
        codec.submit([_stream_chunk(codes, rid, 6, 9)], [9], [later + 1])
    assert [len(d.items) for d in codec.collect()] == [4]


@pytest.mark.parametrize("overlap", [False, True])
def test_an_ended_requests_waiting_chunks_are_handed_back_undecoded(tiny_fish, overlap):
    """A request that ends (abort, error) while its chunks wait (gathering, or held for a deadline long
    after the end) gets them back at once, undecoded, so nothing of it waits in the codec."""
    from intone.engine.codec_worker import CodecWorker

    codec, calls, items, _ = _loop_codec(tiny_fish, gather_s=30.0, full=64, lead_s=0.5)
    if overlap:
        codec = CodecWorker(codec.stage, tiny_fish.device, gather_s=30.0, lead_s=0.5)
    def handed_back():  # the loop's wait would decode what waits: it collects only
        if overlap:
            codec.wait(1.0)
        return codec.collect()
    codes, later = items["r0"][0].codes, time.perf_counter() + 60.0
    codec.submit([_stream_chunk(codes, "s", 4, 9), items["r1"]], [9, 13], [later, time.perf_counter()])
    codec.release("s")
    got = handed_back()
    assert [(len(d.items), d.dropped) for d in got] == [(1, True)] and got[0].items[0][0].request_id == "s"
    assert codec.queued == 1 and codec.in_flight == 1 and calls == []
    codec.release("r1")
    assert [d.dropped for d in handed_back()] == [True] and codec.in_flight == 0 and calls == []
    codec.close()


def test_the_profile_puts_the_codec_in_the_loop(tiny_fish):
    core = EngineCore(tiny_fish, load_profile("fish-s2-default", device="cpu", **{
        "codec.overlap": False, "codec.gather_ms": 50, "codec.max_batch": 8}))
    try:
        assert isinstance(core.codec_worker, LoopCodec)
        assert (core.codec_worker._gather_s, core.codec_worker._full) == (0.05, 8)
    finally:
        core.close()


@pytest.fixture(scope="module")
def fish64(tiny_fish_dir):
    return load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)


_ONE_PASS: dict = {}


def one_pass(model, codes: torch.Tensor) -> np.ndarray:
    """A request's one-pass decode. The parametrizations below run the same requests (the codec's settings change
    no token): each request's codes are decoded once (the model and the codes are the key)."""
    key = (id(model), tuple(codes.shape), codes.numpy().tobytes())
    if key not in _ONE_PASS:
        _ONE_PASS[key] = model.codec.decode(codes[None])[0].numpy()
    return _ONE_PASS[key]


@pytest.mark.parametrize("overlap,gather_ms,lead_ms", [(False, 0, None), (False, 1000, 200), (True, 40, 200)])
def test_every_request_is_its_one_pass_decode_however_its_chunks_wait(fish64, overlap, gather_ms, lead_ms):
    """Streams and non-streamed requests in pieces, the codec in the loop or on its worker, pieces gathered
    or not, streams' chunks held for their deadlines or not: joined, each request's chunks are its one-pass
    decode (float64)."""
    model = fish64
    profile = load_profile("fish-s2-high-concurrency", device="cpu", **{
        "ar.max_num_seqs": 4, "codec.max_batch": 4, "codec.carry_state": True, "chunking.whole_chunk_frames": 30,
        "codec.overlap": overlap, "codec.gather_ms": gather_ms, "codec.stream_lead_ms": lead_ms})
    requests = [SynthesisRequest(f"r{i}", "A stream in chunks.", stream=i % 3 > 0,
                                 params=SamplingParams(seed=i, max_new_tokens=75, min_new_tokens=35 + 10 * i))
                for i in range(5)]
    chunks, codes = run_keeping_codes(EngineCore(model, profile), requests)
    for rid, cs in chunks.items():
        joined = np.concatenate([c.audio for c in cs])
        whole = one_pass(model, codes[rid])
        assert cs[-1].stop_reason in ("stop", "length") and joined.shape == whole.shape
        assert np.abs(joined - whole).max() < 1e-6


@pytest.mark.parametrize("gather_ms", [0, 1000])
def test_in_the_loop_gathered_pieces_go_in_fewer_calls(tiny_fish, gather_ms):
    """Non-streamed requests in pieces (no listener, so nothing is due before its company): without
    gathering the loop decodes each step's pieces as they come, one call a step that handed some over;
    gathered, fewer calls (each empties the queue, so never more)."""
    profile = load_profile("fish-s2-high-concurrency", device="cpu", **{
        "ar.max_num_seqs": 4, "codec.max_batch": 8, "codec.carry_state": True, "chunking.whole_chunk_frames": 10,
        "codec.overlap": False, "codec.gather_ms": gather_ms})
    core = EngineCore(tiny_fish, profile)
    handed, decode = [], core.codec_worker.stage.run
    calls = []
    submit = core.codec_worker.submit

    def counted(items, tokens, deadlines=None):
        handed.append(len(items))
        submit(items, tokens, deadlines)

    def decoded(items, pause=None):
        calls.append(len(items))
        return decode(items)
    core.codec_worker.submit, core.codec_worker.stage.run = counted, decoded
    requests = [SynthesisRequest(f"r{i}", "Pieces.", stream=False,
                                 params=SamplingParams(seed=i, max_new_tokens=45, min_new_tokens=25 + 5 * i))
                for i in range(4)]
    chunks, _ = run_keeping_codes(core, requests)
    assert all(cs[-1].stop_reason in ("stop", "length") for cs in chunks.values()) and len(chunks) == 4
    assert sum(calls) == sum(handed)
    assert len(calls) < len(handed) if gather_ms else len(calls) == len(handed)
