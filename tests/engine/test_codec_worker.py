"""The codec on its own worker thread: the same chunks as decoding in the loop, nothing left after aborts."""

import numpy as np

from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.engine.request import SynthesisRequest
from intone.models.base import SamplingParams


def run(model, overlap: bool, cancel_at: int | None = None):
    profile = load_profile("fish-s2-default", device="cpu", **{"codec.overlap": overlap})
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


def test_aborts_with_chunks_in_flight_end_once_at_the_delivered_frontier(tiny_fish):
    chunks, snap = run(tiny_fish, overlap=True, cancel_at=12)
    for rid in ("r1", "r4"):
        got = chunks[rid]
        assert sum(c.finished for c in got) == 1 and got[-1].stop_reason == "abort"
        spans = [(c.start_frame, c.end_frame) for c in got[:-1]]
        assert all(s == e0 for (_, e0), (s, _) in zip([(0, 0)] + spans, spans))  # contiguous from 0
        assert got[-1].start_frame == (spans[-1][1] if spans else 0)
    assert snap["live_requests"] == 0 and snap["kv_tables"] == 0 and snap["planner_requests"] == 0
