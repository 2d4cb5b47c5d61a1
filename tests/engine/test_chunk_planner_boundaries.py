"""Every threshold of the chunk planner and the scheduler, exactly at it and one step to each side.

Each test fails if its comparison is turned from `>=` into `>` (or `<` into `<=`, and so on)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.engine.chunk_planner import ChunkPlanner, ChunkPolicy
from intone.engine.request import EngineRequest
from intone.engine.scheduler import QueueFull, Scheduler
from intone.models.base import Prompt
from intone.ops.kv_cache import BlockManager
from intone.protocol import SamplingParams

from .planner_tables import PlannerTables

STEADY, BACKLOG = 4, 8


def planner(capacity=4, **kw):
    policy = dict(steady_chunk_frames=STEADY, backlog_chunk_frames=BACKLOG, backlog_load_threshold=0.5,
                  backlog_min_ready=2, left_context_frames=2)
    return PlannerTables(ChunkPlanner(ChunkPolicy(**{**policy, **kw}), capacity))


def spans(chunks):
    return [(c.request_id, c.start, c.end, c.context, c.finished) for c in chunks]


# ---- backlog mode: load threshold, min ready, what counts as waiting / ready ------------------------

@pytest.mark.parametrize("capacity, threshold, waiting, active", [
    (4, 0.5, 2, True), (4, 0.5, 1, False), (4, 0.5, 3, True),  # load 0.5 = threshold; 0.25 below; 0.75 above
    (10, 0.3, 3, True), (10, 0.3, 2, False), (10, 0.3, 4, True),  # 3 / 10 == 0.3 in floating point too
    (4, 0.75, 3, True), (4, 0.75, 2, False), (4, 1.0, 4, True), (4, 1.0, 3, False)])
def test_backlog_load_threshold_is_inclusive(capacity, threshold, waiting, active):
    p = planner(capacity, backlog_load_threshold=threshold, backlog_min_ready=1)
    pending = {f"r{i}": STEADY for i in range(waiting)}
    assert p.steady_size(pending) == (BACKLOG if active else STEADY)
    assert p.backlog_active is active


def test_backlog_at_exactly_the_threshold_holds_chunks_back_in_plan():
    """Through plan(): at load == threshold the due size is the backlog one, so nothing is released."""
    p = planner(capacity=4)
    for r in "abcd":
        p.add(r)
    assert p.plan({"a": STEADY, "b": STEADY, "c": 0, "d": 0}) == []  # load 2/4 == 0.5: backlog size 8
    assert p.backlog_active
    q = planner(capacity=5)  # same frames, load 2/5 < 0.5: steady chunks are due now
    for r in "abcd":
        q.add(r)
    assert spans(q.plan({"a": STEADY, "b": STEADY, "c": 0, "d": 0})) == [("a", 0, 4, 0, False), ("b", 0, 4, 0, False)]


@pytest.mark.parametrize("ready, min_ready, active", [(2, 2, True), (1, 2, False), (3, 2, True), (3, 3, True),
                                                      (2, 3, False), (1, 1, True), (0, 1, False)])
def test_backlog_min_ready_is_inclusive(ready, min_ready, active):
    p = planner(capacity=4, backlog_load_threshold=0.5, backlog_min_ready=min_ready)
    pending = {"r0": 1, "r1": 1, "r2": 1, "r3": 1}  # load 1.0 whatever is ready
    pending.update({f"r{i}": STEADY for i in range(ready)})
    assert p.steady_size(pending) == (BACKLOG if active else STEADY)


@pytest.mark.parametrize("frames, ready", [(STEADY, True), (STEADY - 1, False), (STEADY + 1, True)])
def test_a_request_is_ready_with_exactly_a_steady_chunk_pending(frames, ready):
    p = planner(capacity=2, backlog_load_threshold=0.0, backlog_min_ready=2)
    p.steady_size({"a": STEADY, "b": frames})
    assert p.backlog_active is ready


@pytest.mark.parametrize("frames, waiting", [(0, False), (1, True)])
def test_a_request_waits_with_one_pending_frame_not_zero(frames, waiting):
    p = planner(capacity=4, backlog_load_threshold=0.75, backlog_min_ready=1)
    p.steady_size({"a": STEADY, "b": STEADY, "c": frames, "d": 0})  # 3 waiting: 0.75; 2: 0.5
    assert p.backlog_active is waiting


@pytest.mark.parametrize("backlog, possible", [(STEADY, False), (STEADY + 1, True), (STEADY - 1, False), (0, False)])
def test_backlog_mode_needs_a_backlog_size_above_the_steady_one(backlog, possible):
    p = planner(capacity=1, backlog_chunk_frames=backlog, backlog_load_threshold=0.0, backlog_min_ready=0)
    assert p.steady_size({"a": 100}) == (backlog if possible else STEADY)
    assert p.backlog_active is possible


def test_zero_capacity_counts_as_one():
    p = planner(capacity=0, backlog_load_threshold=1.0, backlog_min_ready=1)
    assert p.steady_size({"a": STEADY}) == BACKLOG and p.backlog_active


# ---- when a chunk is due: hop sizes, lookahead, first chunk, growth, context ------------------------

def release_points(p, rid="r", upto=60, **add):
    """The frame counts at which plan() released a chunk, with the chunks."""
    p.add(rid, **add)
    out = []
    for n in range(upto + 1):
        out += [(n, c.start, c.end, c.context) for c in p.plan({rid: n})]
    return out


@pytest.mark.parametrize("lookahead", [0, 1, 3])
def test_a_chunk_is_due_at_exactly_hop_plus_lookahead_frames(lookahead):
    got = release_points(planner(capacity=8, backlog_chunk_frames=0, lookahead_frames=lookahead), upto=13)
    third = [(12 + lookahead, 8, 12, 2)] if 12 + lookahead <= 13 else []
    assert got == [(4 + lookahead, 0, 4, 0), (8 + lookahead, 4, 8, 2)] + third


@pytest.mark.parametrize("initial, hops", [(0, [4, 4]), (1, [1, 4]), (3, [3, 4]), (4, [4, 4]), (5, [4, 4]),
                                           (99, [4, 4]), (-2, [4, 4])])
def test_first_chunk_size_is_capped_at_the_steady_size(initial, hops):
    for p, add in [(planner(initial_chunk_frames=max(initial, 0), backlog_chunk_frames=0), {}),
                   (planner(backlog_chunk_frames=0), {"initial_chunk_frames": initial})]:
        got = release_points(p, upto=hops[0] + hops[1], **add)
        assert [(n, s, e) for n, s, e, _ in got] == [(hops[0], 0, hops[0]), (hops[0] + hops[1], hops[0], sum(hops))]


@pytest.mark.parametrize("growth, cap, hops", [(2, 16, [4, 8, 16, 16]), (2, 12, [4, 8, 12, 12]), (2, 8, [4, 8, 8, 8]),
                                               (2, 0, [4, 8, 16, 32]), (1, 0, [4, 4, 4, 4]), (3, 36, [4, 12, 36, 36])])
def test_hops_grow_by_the_factor_up_to_exactly_the_cap(growth, cap, hops):
    p = planner(backlog_chunk_frames=0, growth_factor=growth, max_chunk_frames=cap, left_context_frames=0)
    got = release_points(p, upto=sum(hops))
    ends = [sum(hops[: i + 1]) for i in range(len(hops))]
    assert [(n, e) for n, _, e, _ in got] == [(e, e) for e in ends]  # each released the moment it is complete


@pytest.mark.parametrize("prompt, pad", [(0, 0), (4, 0), (8, 0), (1, 3), (5, 3), (3, 1), (7, 1), (2, 2)])
def test_first_hop_is_padded_so_prompt_plus_hop_ends_on_a_multiple(prompt, pad):
    """The shipped CosyVoice3 schedule: align == steady (25 and 25); here 4 and 4."""
    got = release_points(planner(backlog_chunk_frames=0, align_first_chunk=STEADY), upto=2 * STEADY + pad,
                         prompt_frames=prompt, initial_chunk_frames=1)  # the override does not apply
    assert [(n, s, e) for n, s, e, _ in got] == [(STEADY + pad, 0, STEADY + pad), (2 * STEADY + pad, STEADY + pad,
                                                                                    2 * STEADY + pad)]
    assert (prompt + got[0][2]) % STEADY == 0


@pytest.mark.parametrize("prompt", [0, 1, 3])
def test_first_hop_alignment_when_align_does_not_divide_the_steady_size(prompt):
    got = release_points(planner(backlog_chunk_frames=0, align_first_chunk=5), upto=20, prompt_frames=prompt)
    assert (prompt + got[0][2]) % 5 == 0


@pytest.mark.parametrize("left, contexts", [(0, [0, 0, 0]), (3, [0, 3, 3]), (4, [0, 4, 4]), (5, [0, 4, 5]),
                                            (8, [0, 4, 8]), (9, [0, 4, 8])])
def test_context_is_min_of_emitted_and_left_context(left, contexts):
    got = release_points(planner(backlog_chunk_frames=0, left_context_frames=left), upto=12)
    assert [c for *_, c in got] == contexts


@pytest.mark.parametrize("lookahead", [0, 2])
def test_one_chunk_agrees_with_plan_at_the_boundary(lookahead):
    base = dict(backlog_chunk_frames=0, lookahead_frames=lookahead)
    edge = STEADY + lookahead  # the first frame count at which a non-final chunk is due
    for n in (edge - 1, edge, edge + 1):
        p = planner(**base)
        p.add("r")
        chunks = [c for k in range(n + 1) for c in p.plan({"r": k}, ["r"] if k == n else [])]
        assert p.one_chunk(None, n) is (len(chunks) == 1), n
    assert planner(**base).one_chunk(None, edge - 1) and not planner(**base).one_chunk(None, edge)
    assert not planner(**base, initial_chunk_frames=1).one_chunk(None, 1) and planner(**base).one_chunk(0, edge - 1)


@pytest.mark.parametrize("initial", [None, 0, 1, 3])
def test_one_chunk_follows_the_requests_own_first_chunk_and_whole_requests(initial):
    """`speed` != 1 is allowed only when one_chunk holds: it must agree with plan() for the request's
    initial_chunk_frames override, and hold for every whole (non-streamed) request."""
    n = STEADY - 1  # below the steady size: one chunk unless the request's first chunk comes earlier
    p = planner(backlog_chunk_frames=0)
    p.add("r", initial)
    chunks = [c for k in range(n + 1) for c in p.plan({"r": k}, ["r"] if k == n else [])]
    assert p.one_chunk(initial, n) is (len(chunks) == 1) is (not initial)
    w = planner(backlog_chunk_frames=0, initial_chunk_frames=1, lookahead_frames=0)
    w.add("w", initial, whole=True)
    n = 5 * STEADY
    chunks = [c for k in range(n + 1) for c in w.plan({"w": k}, ["w"] if k == n else [])]
    assert len(chunks) == 1 and w.one_chunk(initial, n, whole=True)


@pytest.mark.parametrize("pieces", [1, 3, STEADY, 7])
def test_a_whole_request_in_pieces_gets_them_at_its_own_size_under_any_load(pieces):
    """whole_chunk_frames: a non-streamed request's chunks are each exactly that long, whatever the
    backlog mode the streams beside it switch (its audio must not depend on them), then its tail; a
    prompt that needs one chunk still gets one."""
    p = planner(capacity=2, initial_chunk_frames=1, whole_chunk_frames=pieces)
    p.add("w", whole=True)
    p.add("s")  # a stream: its backlog size switches with the load
    p.add("one", whole=True, one_chunk=True)
    n = 5 * BACKLOG + 1
    got = {"w": [], "s": [], "one": []}
    modes = set()
    for k in range(n + 1):
        for c in p.plan({"w": k, "s": k, "one": k}, ["w", "one"] if k == n else []):
            got[c.request_id].append(c)
        modes.add(p.backlog_active)
    assert modes == {True, False}  # the load went both ways
    w = got["w"]
    assert [(c.start, c.end) for c in w[:-1]] == [(i, i + pieces) for i in range(0, n - pieces + 1, pieces)]
    assert w[-1].finished and w[-1].end == n and w[-1].start == (n // pieces) * pieces
    assert not any(c.finished for c in w[:-1])
    assert [(c.start, c.end, c.finished) for c in got["one"]] == [(0, n, True)]


def test_frame_count_may_stay_but_not_go_back():
    p = planner(backlog_chunk_frames=0)
    p.add("r")
    p.plan({"r": 5})
    assert p.plan({"r": 4}) == []  # emitted 4: n == emitted is fine
    with pytest.raises(ValueError, match=r"^r: frame count went backwards \(3 < 4\)$"):
        p.plan({"r": 3})


@pytest.mark.parametrize("field, low_ok, bad", [("steady_chunk_frames", 1, 0), ("growth_factor", 1, 0),
                                                ("initial_chunk_frames", 0, -1), ("left_context_frames", 0, -1),
                                                ("backlog_chunk_frames", 0, -1), ("lookahead_frames", 0, -1),
                                                ("max_chunk_frames", 0, -1), ("align_first_chunk", 0, -1),
                                                ("whole_chunk_frames", 0, -1)])
def test_policy_bounds_are_inclusive(field, low_ok, bad):
    ChunkPolicy(**{field: low_ok})
    with pytest.raises(ValueError, match=f"must be >= {low_ok}"):
        ChunkPolicy(**{field: bad})


# ---- the scheduler: max_waiting, max_num_seqs, step tokens, KV blocks --------------------------------

def request(rid, prompt=4, max_new=4):
    return EngineRequest(rid, Prompt(torch.zeros(prompt, dtype=torch.long), torch.zeros(prompt, 1, dtype=torch.long)),
                         SamplingParams(max_new_tokens=max_new))


def scheduler(blocks=100, block_size=4, seqs=8, waiting=8, tokens=64):
    return Scheduler(BlockManager(blocks, block_size), seqs, waiting, tokens)


def test_max_waiting_refuses_exactly_at_capacity_beyond_the_free_seats():
    s = scheduler(waiting=3, seqs=2)
    for i in range(5):
        s.add(request(f"r{i}"))  # two for the free seats, three waiting: the fifth fills the queue
    with pytest.raises(QueueFull):
        s.add(request("r5"))
    s.schedule()  # both seats taken: three may wait, and three do
    with pytest.raises(QueueFull):
        s.add(request("r6"))
    s.remove(s.running[0])  # a seat frees: one more may wait
    s.add(request("r7"))
    with pytest.raises(QueueFull):
        s.add(request("r8"))


@pytest.mark.parametrize("running, seqs, admitted", [(0, 3, 3), (2, 3, 1), (3, 3, 0), (2, 4, 2), (1, 1, 0)])
def test_max_num_seqs_is_filled_exactly(running, seqs, admitted):
    s = scheduler(seqs=seqs)
    for i in range(running):
        s.add(request(f"run{i}"))
    s.schedule()
    for i in range(5):
        s.add(request(f"w{i}"))
    batch = s.schedule()
    assert len(s.running) == running + admitted and len(batch) == len(s.running)


@pytest.mark.parametrize("running, prompt, admitted", [(0, 16, True), (0, 17, False), (3, 13, True), (3, 14, False)])
def test_a_prompt_fits_when_it_takes_exactly_the_step_tokens_left(running, prompt, admitted):
    s = scheduler(tokens=16)  # each running decode takes one of the 16 tokens
    for i in range(running):
        s.add(request(f"run{i}", prompt=1))
    s.schedule()
    s.add(request("new", prompt=prompt))
    assert ("new" in [r.request_id for r in s.schedule()]) is admitted


@pytest.mark.parametrize("second, admitted", [(4, True), (5, False)])
def test_the_soft_step_target_admits_a_second_prompt_exactly_at_it(second, admitted):
    s = scheduler(tokens=64)
    s.step_token_target = 10
    s.add(request("a", prompt=6))
    s.add(request("b", prompt=second))
    assert [r.request_id for r in s.schedule()] == (["a", "b"] if admitted else ["a"])
    alone = scheduler(tokens=64)
    alone.step_token_target = 10
    alone.add(request("big", prompt=40))  # a step with no prefill yet may go past the soft target
    assert [r.request_id for r in alone.schedule()] == ["big"]


@pytest.mark.parametrize("max_new, admitted", [(36, True), (37, False), (33, True)])
def test_kv_admission_needs_exactly_the_blocks_left(max_new, admitted):
    s = scheduler(blocks=12, block_size=4)  # one running request holds 1 block and may claim 1 more
    s.add(request("run", prompt=4, max_new=4))
    s.schedule()
    assert len(s.running[0].block_table) == 1  # the step's prompt tokens, grown by the scheduler
    s.add(request("new", prompt=4, max_new=max_new))  # 40 tokens: 10 blocks == 12 - 1 held - 1 owed
    assert ("new" in [r.request_id for r in s.schedule()]) is admitted


@pytest.mark.parametrize("tokens, fits", [(40, True), (41, False)])
def test_fits_ever_counts_free_and_running_blocks_inclusively(tokens, fits):
    s = scheduler(blocks=10, block_size=4)
    s.add(request("run", prompt=4, max_new=4))
    s.schedule()
    s.blocks.grow(s.running[0].block_table, 8)  # 2 blocks held by a running request still count
    assert s.fits_ever(request("big", prompt=4, max_new=tokens - 4)) is fits


# ---- listener_margin_s: chunks paced by the listener ---------------------------------------------------

FRAME_S = 2048 / 44100


def paced_stream(n, dt, latency, margin, initial, ramp=0.0, steady=25):
    """One stream producing a frame every dt s, each chunk reaching its listener `latency` s after its
    release: (its chunks' (start, end), the simulated player's stall)."""
    from intone.bench.metrics import underrun

    p = PlannerTables(ChunkPlanner(ChunkPolicy(initial_chunk_frames=initial, steady_chunk_frames=steady,
                                               listener_margin_s=margin, frame_seconds=FRAME_S,
                                               ramp_factor=ramp), 4))
    p.add("r")
    chunks, arrivals = [], []
    for k in range(n + 1):
        for c in p.plan({"r": k}, ["r"] if k == n else [], now=k * dt):
            chunks.append((c.start, c.end))
            if c.end > c.start:
                arrivals.append((k * dt + latency, (c.end - c.start) * FRAME_S))
    return chunks, underrun(arrivals)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 200), dt=st.floats(0.005, 0.045), latency=st.floats(0, 1.5),
       extra=st.floats(0, 1), initial=st.sampled_from([0, 1, 4]))
def test_a_stream_paced_by_its_listener_never_stalls_once_started(n, dt, latency, extra, initial):
    """Frames faster than real time, a steady codec latency, a margin of at least a step: the player
    never waits once playing, and the chunks hold frames 0..n-1 once each, in order."""
    chunks, stall = paced_stream(n, dt, latency, dt + extra, initial)
    assert [s for s, _ in chunks[1:]] == [e for _, e in chunks[:-1]] and chunks[0][0] == 0 and chunks[-1][1] == n
    assert stall < 1e-9


def test_without_the_margin_a_small_first_chunk_leaves_its_listener_waiting():
    """The shipped sizes alone (4, then 25 frames) at a 20 ms step: the second chunk comes 0.5 s after
    the first, whose 4 frames play for 0.19 s."""
    assert paced_stream(100, 0.02, 0.2, 0.0, 4)[1] > 0.25
    assert paced_stream(100, 0.02, 0.2, 0.02, 4)[1] == 0


# ---- ramp_factor: hops that grow from the first chunk ------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 300), ramp=st.floats(1.1, 2.5), slack=st.floats(0, 1), latency=st.floats(0, 1.5),
       initial=st.sampled_from([1, 2, 4, 8]), steady=st.sampled_from([25, 50]))
def test_a_ramped_stream_never_stalls_once_started_while_it_runs_faster_than_the_ramp(
        n, ramp, slack, latency, initial, steady):
    """chunking.ramp_factor: a stream generating at ramp + 1/initial (the hops' rounding) x real time or
    faster, any steady codec latency: the player never waits once playing; frames 0..n-1 once each, in
    order; no hop above the steady size."""
    speed = ramp + 1 / initial + slack
    chunks, stall = paced_stream(n, FRAME_S / speed, latency, 0.0, initial, ramp, steady)
    assert [s for s, _ in chunks[1:]] == [e for _, e in chunks[:-1]] and chunks[0][0] == 0 and chunks[-1][1] == n
    assert max(e - s for s, e in chunks) <= steady
    assert stall < 1e-9


def test_the_ramp_climbs_from_the_first_chunk_to_the_steady_size():
    chunks, _ = paced_stream(120, 0.02, 0.1, 0.0, 4, 1.5)
    assert [e - s for s, e in chunks] == [4, 6, 9, 14, 21, 25, 25, 16]  # the last: the tail
    assert paced_stream(120, 0.02, 0.1, 0.0, 4, 1.5)[1] == 0  # the shipped sizes stall 0.25+ s here (above)
    assert paced_stream(200, FRAME_S / 1.3, 0.1, 0.0, 4, 1.5)[1] > 0.2  # a stream slower than its ramp stalls
