"""The codec on its own worker thread: the same chunks as decoding in the loop, nothing left after aborts."""

import time

import numpy as np
import pytest
import torch

from intone.engine.codec_worker import is_awaited, is_first_chunk
from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.models.registry import load_model
from intone.protocol import SamplingParams, SynthesisRequest

# The engine's loop and codec worker threads on one torch thread each (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(model, overlap: bool, cancel_at: int | None = None, **overrides):
    profile = load_profile("fish-s2-default", device="cpu", **{"codec.overlap": overlap, **overrides})
    core = EngineCore(model, profile)
    for i in range(6):
        core.add_request(SynthesisRequest(f"r{i}", "Hello over there.", params=SamplingParams(seed=i, max_new_tokens=40)))
    chunks, steps = {}, 0
    while core.has_work():
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
        steps += 1
        if steps == cancel_at:
            for rid in ("r1", "r4"):
                core.abort(rid)
    core.close()
    return chunks, core.snapshot()


def test_overlapped_codec_gives_the_same_chunks_as_the_loop(tiny_fish):
    inline, _ = run(tiny_fish, overlap=False)
    overlapped, snap = run(tiny_fish, overlap=True)
    assert inline.keys() == overlapped.keys()
    for rid in inline:
        a, b = inline[rid], overlapped[rid]
        assert [(c.start_frame, c.end_frame, c.finished, c.completion_tokens) for c in a] == \
               [(c.start_frame, c.end_frame, c.finished, c.completion_tokens) for c in b]
        assert all(np.array_equal(x.audio, y.audio) for x, y in zip(a, b))
    assert snap["live_requests"] == 0 and snap["kv_blocks_free"] == snap["kv_blocks_total"]


@pytest.mark.parametrize("overlap,gather_ms", [(True, 0), (False, 1000), (True, 1000)])
def test_aborts_with_chunks_in_flight_end_once_at_the_delivered_frontier(tiny_fish, overlap, gather_ms):
    """Also with chunks still gathering in the codec (worker or loop) when their request is aborted."""
    chunks, snap = run(tiny_fish, overlap=overlap, cancel_at=12, **{"codec.gather_ms": gather_ms})
    for rid in ("r1", "r4"):
        got = chunks[rid]
        assert sum(c.finished for c in got) == 1 and got[-1].stop_reason == "abort"
        spans = [(c.start_frame, c.end_frame) for c in got[:-1]]
        assert all(s == e0 for (_, e0), (s, _) in zip([(0, 0)] + spans, spans))  # contiguous from 0
        assert got[-1].start_frame == (spans[-1][1] if spans else 0)
    assert snap["live_requests"] == 0 and snap["kv_tables"] == 0 and snap["planner_requests"] == 0


def _gated_worker(tiny_fish, max_call, alone=None, **options):
    """A worker whose decode calls wait for `gate`; calls records the request ids of each call."""
    import threading

    from intone.engine.codec_stage import CodecStage
    from intone.engine.codec_worker import CodecWorker
    from intone.models.vocoder import WindowVocoder

    stage = CodecStage(WindowVocoder(tiny_fish, max_batch=64, max_padded_frames=4096))
    gate, calls, decode = threading.Event(), [], stage.run

    def gated(items):
        calls.append([req.request_id for req, _ in items])
        gate.wait(10)
        return decode(items)
    stage.run = gated
    items = whole_responses(tiny_fish)
    worker = CodecWorker(stage, tiny_fish.device, max_call=max_call, alone=alone, **options)
    return worker, gate, calls, items, decode


def whole_responses(model, frontier=None) -> dict:
    """Four requests' one whole chunk each (r0-r3, 12-15 frames of random codes), to hand to a codec;
    frontier: each request's (None: none)."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.request import EngineRequest

    g = torch.Generator().manual_seed(0)
    items = {}
    for b in range(4):
        req = EngineRequest(f"r{b}", prompt=None, params=SamplingParams())
        req.codes = torch.randint(0, 8, (model.num_codebooks, 12 + b), generator=g)
        req.frontier = frontier
        items[req.request_id] = (req, Chunk(req.request_id, 0, 12 + b, 0, True))
    return items


def _drain(worker, count):
    got = []
    while sum(len(d.items) for d in got) < count:
        worker.wait(1.0)
        got += worker.collect()
    worker.close()
    return got


def _until_busy(calls):
    import threading

    while not calls:  # the worker is inside its first decode
        threading.Event().wait(0.01)


def test_chunks_waiting_for_the_worker_go_into_one_call_in_order(tiny_fish):
    worker, gate, calls, items, decode = _gated_worker(tiny_fish, max_call=None)
    worker.submit([items["r0"]], [12])
    _until_busy(calls)
    worker.submit([items["r1"], items["r2"]], [13, 14])
    worker.submit([items["r3"]], [15])
    gate.set()
    got = _drain(worker, 4)
    assert calls == [["r0"], ["r1", "r2", "r3"]]
    for d in got:
        for (req, chunk), audio, tokens in zip(d.items, d.audio, d.tokens):
            assert tokens == 12 + int(req.request_id[1:])
            # the same window as decoded alone (to float rounding: batch shapes differ)
            assert np.allclose(audio, decode([(req, chunk)])[0], atol=1e-4)


def test_waiting_chunks_are_decoded_earliest_deadline_first_in_full_calls(tiny_fish):
    """With deadlines, each next call takes up to max_call waiting chunks, the earliest deadlines
    first (a new stream's first chunk ahead of the backlog)."""
    worker, gate, calls, items, _ = _gated_worker(tiny_fish, max_call=2)
    worker.submit([items["r0"]], [12], [5.0])
    _until_busy(calls)
    worker.submit([items["r1"], items["r2"]], [13, 14], [10.0, 3.0])
    worker.submit([items["r3"]], [15], [7.0])
    assert worker.queued == 3 and worker.in_flight == 4
    from intone.engine.chunk_planner import Chunk
    r3 = items["r3"][0]
    worker.submit([(r3, Chunk("r3", 15, 15, 0, True))], [15], [8.0])  # r3's second chunk: no new request
    assert worker.queued == 4
    gate.set()
    _drain(worker, 5)
    assert calls == [["r0"], ["r2", "r3"], ["r3", "r1"]]
    assert worker.in_flight == 0 and worker.queued == 0


def test_gathering_makes_one_call_of_the_chunks_handed_over_within_the_window(tiny_fish):
    """codec.gather_ms: whole responses' chunks handed over within the window of the oldest go into
    one call, which starts when the window closes (not before), with each chunk's own audio."""
    from intone.engine.chunk_planner import Frontier

    worker, gate, calls, items, decode = _gated_worker(tiny_fish, max_call=None, gather_s=0.4, full=64)
    for req, _ in items.values():
        req.frontier = Frontier(0, hop=8)  # non-streamed, in pieces
    gate.set()
    start = time.perf_counter()
    worker.submit([items["r0"]], [12])
    time.sleep(0.1)
    worker.submit([items["r1"], items["r2"]], [13, 14])
    got = _drain(worker, 3)
    assert calls == [["r0", "r1", "r2"]]
    assert time.perf_counter() - start >= 0.4  # the window of r0, not r2's arrival, closed it
    for d in got:
        for item, audio in zip(d.items, d.audio):
            assert np.allclose(audio, decode([item])[0], atol=1e-4)


@pytest.mark.parametrize("case", ["a stream's chunk", "a full call's worth"])
def test_gathering_never_holds_a_streams_chunk_or_a_full_call(tiny_fish, case):
    from intone.engine.chunk_planner import Chunk, Frontier

    worker, gate, calls, items, _ = _gated_worker(tiny_fish, max_call=None, gather_s=30.0, full=3)
    for req, _ in items.values():
        req.frontier = Frontier(0, hop=8)
    gate.set()
    if case == "a stream's chunk":
        req = items["r0"][0]
        req.frontier = Frontier(4)  # streamed: a listener plays its chunks as they come
        handed = [items["r1"], (req, Chunk("r0", 0, 9, 0, False))]  # with a piece, which goes along
    else:
        handed = [items["r0"], items["r1"], items["r2"]]
    start = time.perf_counter()
    worker.submit(handed, [12] * len(handed))
    _drain(worker, len(handed))
    assert len(calls) == 1 and time.perf_counter() - start < 10


@pytest.mark.parametrize("max_call, expected", [
    (None, [["r0"], ["r3", "r2"], ["r1", "r2"]]),
    (1, [["r0"], ["r3"], ["r2"], ["r1"], ["r2"]]),  # codec.max_call: small calls, first chunks still ahead
])
def test_schedule_first_decodes_new_streams_first_chunks_in_a_call_of_their_own(tiny_fish, max_call, expected):
    """codec.schedule: first: while first chunks wait beside later ones, a call takes only the first
    chunks (in the order handed over); the rest go in the next call, whole or up to max_call; each
    request's chunks come out in order, with the audio they get alone."""
    from intone.engine.chunk_planner import Chunk

    worker, gate, calls, items, decode = _gated_worker(tiny_fish, max_call=max_call, alone=is_first_chunk)
    later = {rid: (req, Chunk(rid, 6, req.codes.shape[1], 4, True)) for rid, (req, _) in items.items()}
    worker.submit([items["r0"]], [12])
    _until_busy(calls)
    worker.submit([later["r1"], items["r3"], items["r2"], later["r2"]], [13, 15, 14, 14])
    gate.set()
    got = _drain(worker, 5)
    assert calls == expected
    assert [c.start for d in got for _, c in d.items if c.request_id == "r2"] == [0, 6]
    for d in got:
        for item, audio in zip(d.items, d.audio):
            assert np.allclose(audio, decode([item])[0], atol=1e-4)  # the same audio whatever the call


def test_schedule_first_does_not_put_a_non_streamed_requests_earlier_pieces_ahead(tiny_fish):
    """A non-streamed request's first piece is no first chunk: nobody hears it before the request's last
    piece, so it waits its turn with the backlog; a stream's first chunk and a whole response still go first."""
    from intone.engine.chunk_planner import Chunk, Frontier

    worker, gate, calls, items, _ = _gated_worker(tiny_fish, max_call=None, alone=is_first_chunk)
    stream, piece = items["r1"][0], items["r2"][0]
    stream.frontier, piece.frontier = Frontier(4), Frontier(0, hop=8)
    worker.submit([items["r0"]], [12])
    _until_busy(calls)
    later = (stream, Chunk("r1", 6, 13, 4, True))  # a stream's later chunk: the backlog
    worker.submit([later, (piece, Chunk("r2", 0, 8, 0, False)), items["r3"]], [13, 8, 15])
    gate.set()
    _drain(worker, 4)
    assert calls == [["r0"], ["r3"], ["r1", "r2"]]


def test_schedule_awaited_decodes_a_non_streamed_requests_last_piece_ahead_with_its_earlier_one(tiny_fish):
    """codec.schedule: awaited: a non-streamed request's last piece is awaited (its client waits for the whole
    response), so it goes in a call ahead of other requests' earlier pieces, and takes its own earlier piece
    still waiting with it, before it (its state needs that one first); every chunk gets the audio it gets alone."""
    from intone.engine.chunk_planner import Chunk, Frontier

    worker, gate, calls, items, decode = _gated_worker(tiny_fish, max_call=None, alone=is_awaited)
    generating, ending = items["r1"][0], items["r2"][0]
    generating.frontier, ending.frontier = Frontier(0, hop=8), Frontier(0, hop=8)
    worker.submit([items["r0"]], [12])
    _until_busy(calls)
    worker.submit([(generating, Chunk("r1", 0, 8, 0, False)), (ending, Chunk("r2", 0, 8, 0, False)),
                   (generating, Chunk("r1", 8, 12, 0, False)), (ending, Chunk("r2", 8, 14, 0, True))], [8, 8, 12, 14])
    gate.set()
    got = _drain(worker, 5)
    assert calls == [["r0"], ["r2", "r2"], ["r1", "r1"]]
    assert [(c.start, c.end) for d in got for _, c in d.items if c.request_id == "r2"] == [(0, 8), (8, 14)]
    for d in got:
        for item, audio in zip(d.items, d.audio):
            assert np.allclose(audio, decode([item])[0], atol=1e-4)


def test_a_first_chunks_queue_takes_the_earlier_chunks_of_an_awaited_request_only():
    """ChunkQueue with a predicate: the awaited items, and their requests' earlier items (none later, none of
    other requests), in deadline order; with none of them waiting, everything."""
    from types import SimpleNamespace as NS

    from intone.engine.codec_worker import ChunkQueue

    a, b = NS(), NS()
    queue = ChunkQueue(None, lambda item: item[1].awaited)
    for req, start, awaited in ((a, 0, False), (b, 0, False), (a, 5, True), (a, 9, False), (b, 5, False)):
        queue.push((req, NS(start=start, awaited=awaited)), 0, float(len(queue)))
    taken, _ = queue.take()
    assert [(item[0] is a, item[1].start) for item in taken] == [(True, 0), (True, 5)]
    rest, _ = queue.take()
    assert [(item[0] is a, item[1].start) for item in rest] == [(False, 0), (True, 9), (False, 5)]


def test_preempt_decodes_a_new_streams_first_chunk_at_the_backlog_calls_next_pause_point(tiny_fish):
    """codec.schedule: preempt: a first chunk that arrives while a call over the backlog runs is
    decoded at that call's next pause point (here: after each of its one-window decodes), before the
    call's remaining windows; every chunk still gets the audio it gets alone."""
    import threading

    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.codec_worker import CodecWorker
    from intone.engine.request import EngineRequest
    from intone.models.vocoder import WindowVocoder

    stage = CodecStage(WindowVocoder(tiny_fish, max_batch=1, max_padded_frames=4096))  # one window per decode
    entered, gate, decoded, model_decode = threading.Event(), threading.Event(), [], tiny_fish.decode

    def gated_decode(codes, offsets):
        entered.set()
        gate.wait(10)
        decoded.append(int(offsets[0]))
        return model_decode(codes, offsets)
    g = torch.Generator().manual_seed(1)
    later, first = [], None
    for b in range(4):
        req = EngineRequest(f"r{b}", prompt=None, params=SamplingParams())
        req.codes = torch.randint(0, 8, (tiny_fish.num_codebooks, 14 + b), generator=g)
        if b < 3:
            later.append((req, Chunk(req.request_id, 6, 14 + b, 4, True)))
        else:
            first = (req, Chunk(req.request_id, 0, 6, 0, False))
    alone = [stage.run([item])[0] for item in later + [first]]
    tiny_fish.decode = gated_decode
    try:
        worker = CodecWorker(stage, tiny_fish.device, preempt=True)
        worker.submit(later, [14, 15, 16])
        entered.wait(10)  # inside the backlog call's first decode
        worker.submit([first], [6])
        gate.set()
        got = _drain(worker, 4)
    finally:
        tiny_fish.decode = model_decode
    # windows start 4 frames before each later chunk (its context); the first chunk's at 0
    assert decoded == [2, 0, 2, 2]
    assert [[(req.request_id, c.start) for req, c in d.items] for d in got] == \
        [[("r3", 0)], [("r0", 6), ("r1", 6), ("r2", 6)]]
    audio = [a for d in got for a in d.audio]
    for a, b in zip(audio, alone[3:] + alone[:3]):
        assert np.array_equal(a, b)
    assert worker.in_flight == 0 and worker.queued == 0


def test_a_streams_later_chunks_are_due_when_its_earlier_audio_has_played(tiny_fish):
    profile = load_profile("fish-s2-default", device="cpu", **{"codec.schedule": "deadline"})
    core = EngineCore(tiny_fish, profile)
    core.add_request(SynthesisRequest("d", "A deadline for every chunk.", params=SamplingParams(seed=3, max_new_tokens=60)))
    due, submit = [], core.codec_worker.submit

    def record(items, tokens, deadlines):
        due.extend((c.start, d) for (_, c), d in zip(items, deadlines))
        submit(items, tokens, deadlines)
    core.codec_worker.submit = record
    arrived = core._preparing.get("d") or time.perf_counter()
    while core.has_work():
        core.step()
    core.close()
    assert len(due) > 2 and due[0][0] == 0 and due[0][1] <= arrived
    fps = tiny_fish.sample_rate / tiny_fish.samples_per_frame
    anchor = due[1][1] - due[1][0] / fps
    for start, deadline in due[1:]:
        assert abs(deadline - (anchor + start / fps)) < 1e-6
    assert [d for _, d in due] == sorted(d for _, d in due)


def test_a_whole_response_is_one_chunk_decoded_in_one_pass(tiny_fish):
    profile = load_profile("fish-s2-default", device="cpu")
    params = SamplingParams(seed=7, max_new_tokens=60)
    requests = [SynthesisRequest(f"s{int(s)}", "One pass, please.", params=params, stream=s) for s in (False, True)]
    chunks, codes = run_keeping_codes(EngineCore(tiny_fish, profile), requests)
    whole, streamed = chunks["s0"], chunks["s1"]
    assert len(whole) == 1 and whole[0].finished and whole[0].start_frame == 0
    assert len(streamed) > 1 and whole[0].end_frame == streamed[-1].end_frame
    assert torch_equal(codes["s0"], codes["s1"])  # how the audio is chunked never changes the frames
    one_pass = tiny_fish.decode(codes["s0"].unsqueeze(0), 0)[0].float().numpy()
    assert whole[0].audio.shape == one_pass.shape  # padded to a bucketed shape, so equal to float rounding
    assert np.allclose(whole[0].audio, one_pass, atol=1e-4)


def run_keeping_codes(core: EngineCore, requests: list) -> tuple[dict, dict]:
    """Run the requests to the end: (chunks by request, each request's codes as it was released)."""
    codes, release = {}, core._release

    def keep_codes(req, reason):
        codes[req.request_id] = req.codes[:, : req.num_frames].clone()
        release(req, reason)
    core._release = keep_codes
    for request in requests:
        core.add_request(request)
    chunks = {}
    while core.has_work():
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
    core.close()
    return chunks, codes


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


@pytest.mark.parametrize("pieces, schedule, layout", [(0, "fifo", "channels_first"), (30, "fifo", "time_major"),
                                                      (30, "awaited", "channels_first")])
def test_streams_with_carried_codec_state_are_their_one_pass_decode(tiny_fish_dir, pieces, schedule, layout):
    """codec.carry_state: chunks of 4, 25 and 50 frames (first, steady, backlog), several requests per
    codec call, join into the one-pass decode of the request's codes (float64: equal to rounding); so do
    the non-streamed requests' pieces under chunking.whole_chunk_frames; and so does the time-major decoder
    (fish_s2.decoder_layout), whose states are its own."""
    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    profile = load_profile("fish-s2-high-concurrency", device="cpu", **{
        "ar.max_num_seqs": 4, "codec.max_batch": 4, "chunking.backlog_min_ready": 2, "codec.carry_state": True,
        "chunking.whole_chunk_frames": pieces, "codec.schedule": schedule, "fish_s2.decoder_layout": layout,
        "chunking.ramp_factor": 0, "chunking.listener_margin_s": 0})  # the three sizes, no hops of the ramp's or the
                                                                         # listeners' between them
    requests = [SynthesisRequest(f"r{i}", "A stream in chunks.", stream=i % 3 > 0,
                                 params=SamplingParams(seed=i, max_new_tokens=100, min_new_tokens=40 + 15 * i))
                for i in range(5)]
    core = EngineCore(model, profile)
    assert core.codec.vocoder.stream.time_major is (layout == "time_major")
    chunks, codes = run_keeping_codes(core, requests)
    sizes = {c.end_frame - c.start_frame for cs in chunks.values() for c in cs if c.end_frame > c.start_frame}
    assert {4, 25, 50} <= sizes, sizes
    for rid in ("r0", "r3"):  # the non-streamed ones
        spans = [c.end_frame - c.start_frame for c in chunks[rid]]
        assert spans[:-1] == [pieces] * (len(spans) - 1) and (len(spans) > 1) is (pieces > 0), spans
    for rid, cs in chunks.items():
        joined = np.concatenate([c.audio for c in cs])
        one_pass = model.codec.decode(codes[rid][None])[0].numpy()
        assert cs[-1].stop_reason in ("stop", "length") and joined.shape == one_pass.shape
        assert np.abs(joined - one_pass).max() < 1e-6  # float32 samples on the wire


def test_streams_paced_by_their_listeners_are_still_their_one_pass_decode(tiny_fish_dir):
    """chunking.listener_margin_s: with a margin no listener can meet, every step after a stream's
    first chunk releases what it made (one frame), so chunks of one frame wait beside each other for
    the codec; joined, each stream is still its one-pass decode."""
    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    profile = load_profile("fish-s2-high-concurrency", device="cpu", **{
        "ar.max_num_seqs": 4, "codec.max_batch": 4, "codec.carry_state": True, "chunking.listener_margin_s": 10})
    requests = [SynthesisRequest(f"r{i}", "Paced.", stream=True,
                                 params=SamplingParams(seed=i, max_new_tokens=30, min_new_tokens=20 + 4 * i))
                for i in range(3)]
    chunks, codes = run_keeping_codes(EngineCore(model, profile), requests)
    for rid, cs in chunks.items():
        spans = [c.end_frame - c.start_frame for c in cs]
        assert spans[0] == 4 and set(spans[1:-1]) == {1}, spans
        joined = np.concatenate([c.audio for c in cs])
        one_pass = model.codec.decode(codes[rid][None])[0].numpy()
        assert joined.shape == one_pass.shape and np.abs(joined - one_pass).max() < 1e-6


def test_the_profile_sets_the_codec_workers_call_size(tiny_fish):
    for schedule, max_call, expected in (("first", 16, 16), ("first", None, None), ("deadline", None, 64)):
        profile = load_profile("fish-s2-default", device="cpu",
                               **{"codec.schedule": schedule, "codec.max_call": max_call, "codec.max_batch": 64})
        core = EngineCore(tiny_fish, profile)
        try:
            assert core.codec_worker._waiting.max_call == expected
        finally:
            core.close()


def _sms_used(stream: torch.cuda.Stream, device: torch.device) -> set[int]:
    """The SMs that blocks launched on `stream` ran on (each block records its own)."""
    import triton
    import triton.language as tl

    @triton.jit
    def record_sm(out_ptr):
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), sm)

    blocks = 64 * torch.cuda.get_device_properties(device).multi_processor_count
    sm = torch.full((blocks,), -1, dtype=torch.int32, device=device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        record_sm[(blocks,)](sm)
    torch.cuda.current_stream().wait_stream(stream)
    used = set(sm.tolist())
    assert -1 not in used
    return used


@pytest.mark.gpu
def test_the_codec_stream_with_an_sm_share_runs_only_on_that_share():
    """codec.sms: every block launched on the codec's stream lands on one of its `sms` SMs, and the
    stream computes what the default one does."""
    from intone.engine.codec_worker import codec_stream

    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).multi_processor_count
    stream, context = codec_stream(device, 16)
    assert context is not None
    assert len(_sms_used(stream, device)) <= 16
    a = torch.randn(4096, 4096, device=device)
    expected = a @ a
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = a @ a
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-3)  # cuBLAS may pick another split on 16 SMs
    with pytest.raises(ValueError, match="codec.sms"):
        codec_stream(device, total)


@pytest.mark.gpu
def test_each_frontend_worker_with_an_sm_share_runs_only_on_that_share(tiny_fish_dir):
    """frontend.sms: every worker's stream is its own, and each one's blocks land on the share's SMs."""
    import threading

    from intone.engine.frontend_stage import FrontendStage

    model = load_model(str(tiny_fish_dir), device="cuda")
    stage = FrontendStage(model, 0, workers=2, sms=16)
    streams = []
    workers = [threading.Thread(target=lambda: streams.append(stage._stream())) for _ in range(2)]
    for w in workers:
        w.start()
        w.join()
    assert len({s.cuda_stream for s in streams}) == 2
    for stream in streams:
        assert len(_sms_used(stream, model.device)) <= 16
    total = torch.cuda.get_device_properties(model.device).multi_processor_count
    with pytest.raises(ValueError, match="frontend.sms"):
        FrontendStage(model, 0, sms=total)


def _recording_stage(tiny_fish_dir):
    """A tiny Fish codec stage on the GPU whose calls record the stream they ran on (`seen`), one whole
    response's chunk for it, and the stage's own decode (to call on a stream of the test's choosing)."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.request import EngineRequest
    from intone.models.vocoder import WindowVocoder

    device = torch.device("cuda", torch.cuda.current_device())
    model = load_model(str(tiny_fish_dir), device="cuda")
    stage = CodecStage(WindowVocoder(model, max_batch=64, max_padded_frames=4096))
    seen, decode = [], stage.run

    def recorded(items, pause=None):
        seen.append(torch.cuda.current_stream(device))
        return decode(items)
    stage.run = recorded
    req = EngineRequest("r0", prompt=None, params=SamplingParams())
    req.codes = torch.randint(0, 8, (model.num_codebooks, 20), generator=torch.Generator().manual_seed(0))
    return stage, seen, (req, Chunk("r0", 0, 20, 0, True)), decode


@pytest.mark.gpu
def test_on_the_loops_stream_the_worker_decodes_on_the_stream_current_where_it_was_built(tiny_fish_dir):
    """codec.stream: loop: the worker thread decodes on the loop's stream (so the GPU runs the codec's
    kernels and the loop's in launch order, none beside another), and the audio is the loop's decode."""
    from intone.engine.codec_worker import CodecWorker

    stage, seen, item, decode = _recording_stage(tiny_fish_dir)
    device = torch.device("cuda", torch.cuda.current_device())
    loop = torch.cuda.Stream(device)
    with torch.cuda.stream(loop):
        worker = CodecWorker(stage, device, shared_stream=True)
        want = decode([item])[0]
    worker.submit([item], [20])
    got = _drain(worker, 1)
    assert seen[-1] == loop and np.allclose(got[0].audio[0], want, atol=1e-4)


@pytest.mark.gpu
def test_codec_high_priority_decodes_on_a_stream_of_the_highest_priority(tiny_fish_dir):
    """codec.high_priority: the worker's calls run on a stream of its own at CUDA's most urgent priority, and
    decode what the default stream does."""
    from intone.engine.codec_worker import CodecWorker
    from intone.engine.config import load_profile

    stage, seen, item, decode = _recording_stage(tiny_fish_dir)
    device = torch.device("cuda", torch.cuda.current_device())
    want = decode([item])[0]
    priority = load_profile("fish-s2-high-concurrency", **{"codec.high_priority": True}).codec.stream_priority
    worker = CodecWorker(stage, device, priority=priority)
    worker.submit([item], [20])
    got = _drain(worker, 1)
    most_urgent = torch.cuda.Stream.priority_range()[1]
    assert seen[-1].priority == most_urgent and seen[-1] != torch.cuda.current_stream(device)
    assert np.allclose(got[0].audio[0], want, atol=1e-4)
