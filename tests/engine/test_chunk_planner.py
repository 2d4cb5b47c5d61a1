"""The chunk planner: every frame exactly once, in order, whatever the policy does when."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.engine.chunk_planner import Chunk, ChunkPlanner, ChunkPolicy

from .planner_tables import PlannerTables

K = 3


class ScriptedPlanner(ChunkPlanner):
    """A planner whose steady size follows a script (steady, falling, rising, oscillating, random)."""

    def __init__(self, policy, capacity, sizes):
        super().__init__(policy, capacity)
        self.sizes, self.calls = sizes, 0

    def steady_size(self, pending):
        size = self.sizes[self.calls % len(self.sizes)]
        self.calls += 1
        return size


PATTERNS = {
    "steady": [25], "falling": [50, 50, 50, 25], "rising": [25, 25, 50], "oscillating": [25, 50],
}
patterns = st.one_of(st.sampled_from(list(PATTERNS.values())), st.lists(st.sampled_from([1, 2, 7, 25, 50]), min_size=1, max_size=8))


def check_exact(chunks: list[Chunk], totals: dict[str, int], payloads=None):
    for rid, n in totals.items():
        mine = [c for c in chunks if c.request_id == rid]
        covered = [f for c in mine for f in range(c.start, c.end)]
        assert covered == list(range(n)), f"{rid}: frames {covered} != 0..{n - 1}"
        assert sum(c.finished for c in mine) == 1 and mine[-1].finished
        for c in mine:
            assert 0 <= c.context <= c.start
        if payloads is not None:
            got = torch.cat([payloads[id(c)][:, c.context:] for c in mine], dim=1) if n else torch.zeros(K, 0)
            assert torch.equal(got, frames_of(rid, n)[:, :n]) if n else got.numel() == 0


def take_window(frames, chunk: Chunk):
    """The codes of a chunk's window, from frames held as a [K, n] tensor or a list of [K] frames."""
    lo, hi = chunk.window
    if hasattr(frames, "shape"):
        return frames[:, lo:hi]
    window = frames[lo:hi]
    if not window:
        return torch.zeros(0, 0, dtype=torch.long)
    return torch.stack([torch.as_tensor(f) for f in window], dim=1)


def frames_of(rid: str, n: int) -> torch.Tensor:
    base = int(rid[1:]) * 1000
    return (torch.arange(n) + base).repeat(K, 1)


@settings(max_examples=150, deadline=None)
@given(
    sizes=patterns,
    initial=st.sampled_from([0, 1, 4, 7]),
    as_list=st.booleans(),
    lengths=st.lists(st.integers(0, 130), min_size=1, max_size=6),
    finish_repeats=st.integers(1, 3),
    data=st.data(),
)
def test_every_frame_exactly_once_in_order(sizes, initial, as_list, lengths, finish_repeats, data):
    policy = ChunkPolicy(initial_chunk_frames=initial, steady_chunk_frames=25, backlog_chunk_frames=50,
                         left_context_frames=25)
    planner = PlannerTables(ScriptedPlanner(policy, capacity=4, sizes=sizes))
    rids = [f"r{i}" for i in range(len(lengths))]
    for rid in rids:
        planner.add(rid)
    target = dict(zip(rids, lengths))
    made = {rid: 0 for rid in rids}
    done: set[str] = set()
    chunks, payloads = [], {}
    idle = 0  # steps in a row at which no frame arrived
    while len(done) < len(rids):
        growing = [r for r in rids if r not in done and made[r] < target[r]]
        # frames arrive at random, some requests skip a step, at some steps none comes; after 4 such steps in a
        # row a frame comes (longer runs of them ran examples into hypothesis's size limit, each step planned
        # before the example was discarded: up to 30 s of discarded examples a run)
        arrived = [r for r in growing if data.draw(st.booleans(), label="step")]
        idle = 0 if arrived or not growing else idle + 1
        if idle > 4:
            arrived, idle = growing[:1], 0
        for r in arrived:
            made[r] += 1
        finishing = [r for r in rids if r not in done and made[r] == target[r]]
        for _ in range(finish_repeats):  # the finish callback may fire more than once
            for c in planner.plan(dict(made), finishing):
                full = frames_of(c.request_id, made[c.request_id])
                held = [full[:, i] for i in range(full.shape[1])] if as_list else full
                payloads[id(c)] = take_window(held, c)
                chunks.append(c)
        done |= set(finishing)
    check_exact(chunks, target, payloads)
    for rid in rids:
        planner.remove(rid)
    assert len(planner) == 0


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 80), min_size=1, max_size=5), data=st.data())
def test_cancel_at_any_step_leaves_nothing(lengths, data):
    planner = PlannerTables(ChunkPlanner(ChunkPolicy(initial_chunk_frames=4), capacity=2))
    rids = [f"r{i}" for i in range(len(lengths))]
    for r in rids:
        planner.add(r)
    made = dict.fromkeys(rids, 0)
    cancel_at = {r: data.draw(st.integers(0, n), label=r) for r, n in zip(rids, lengths)}
    seen = {r: [] for r in rids}
    live = set(rids)
    while live:
        for r in list(live):
            if made[r] == cancel_at[r]:
                planner.remove(r)
                planner.remove(r)  # idempotent
                live.discard(r)
            else:
                made[r] += 1
        for c in planner.plan({r: made[r] for r in live}):
            seen[c.request_id].extend(range(c.start, c.end))
    assert len(planner) == 0
    for r in rids:  # what was released before the cancel is a gap-free prefix
        assert seen[r] == list(range(len(seen[r])))
        assert len(seen[r]) <= cancel_at[r]


def test_forty_frames_backlog_dropped_at_completion_flushes_the_tail():
    policy = ChunkPolicy(initial_chunk_frames=4, steady_chunk_frames=25, backlog_chunk_frames=50, left_context_frames=25)
    planner = PlannerTables(ScriptedPlanner(policy, capacity=1, sizes=[50]))  # backlog from the start
    planner.add("r0")
    chunks = []
    for n in range(1, 41):
        chunks += planner.plan({"r0": n})
    chunks += planner.plan({"r0": 40}, ["r0"])
    chunks += planner.plan({"r0": 40}, ["r0"])  # a repeated finish changes nothing
    assert [(c.start, c.end, c.context, c.finished) for c in chunks] == [(0, 4, 0, False), (4, 40, 4, True)]


def test_real_backlog_switch_depends_on_load():
    policy = ChunkPolicy(steady_chunk_frames=2, backlog_chunk_frames=4, backlog_load_threshold=0.75,
                         backlog_min_ready=2, left_context_frames=1)
    planner = PlannerTables(ChunkPlanner(policy, capacity=2))
    for r in ("a", "b"):
        planner.add(r)
    assert planner.plan({"a": 2, "b": 2}) == []  # both ready, load 1.0: backlog size 4
    assert planner.backlog_active
    chunks = planner.plan({"a": 4, "b": 2})
    assert [(c.request_id, c.start, c.end) for c in chunks] == [("a", 0, 4)]
    chunks = planner.plan({"a": 4, "b": 3})  # only b pending: load 0.5, steady size 2
    assert not planner.backlog_active
    assert [(c.request_id, c.start, c.end, c.context) for c in chunks] == [("b", 0, 2, 0)]


# ---- CosyVoice3's schedule: prompt-aligned first hop, lookahead, growing hops ----------------

COSY = ChunkPolicy(steady_chunk_frames=25, align_first_chunk=25, lookahead_frames=3, growth_factor=2,
                   max_chunk_frames=100, left_context_frames=0)


def official_cosy_schedule(n_tokens: int, prompt_tokens: int) -> list[tuple[int, int, bool]]:
    """The official streaming loop's chunk boundaries (CosyVoice2Model.tts, per-request hop)."""
    pad = -(-prompt_tokens // 25) * 25 - prompt_tokens
    offset, hop, out = 0, 25, []
    for available in range(n_tokens + 1):
        this_hop = hop + pad if offset == 0 else hop
        if available - offset >= this_hop + 3:
            out.append((offset, offset + this_hop, False))
            offset += this_hop
            hop = min(100, hop * 2)
    out.append((offset, n_tokens, True))
    return out


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 700), prompt=st.integers(0, 400), others=st.integers(0, 3))
def test_cosy_schedule_equals_the_official_loop(n, prompt, others):
    planner = PlannerTables(ChunkPlanner(COSY, capacity=8))
    planner.add("r", prompt_frames=prompt)
    for i in range(others):  # other requests interleave; their hops are their own
        planner.add(f"o{i}", prompt_frames=prompt + 7 * i)
    got = []
    for count in range(n + 1):
        frames = {"r": count, **{f"o{i}": count * 2 for i in range(others)}}
        for c in planner.plan(frames, finished=["r"] if count == n else []):
            if c.request_id == "r":
                got.append((c.start, c.end, c.finished))
    assert got == official_cosy_schedule(n, prompt)


@settings(max_examples=80, deadline=None)
@given(
    policy=st.builds(
        ChunkPolicy, initial_chunk_frames=st.sampled_from([0, 1, 4, 9]), steady_chunk_frames=st.sampled_from([1, 6, 25]),
        backlog_chunk_frames=st.sampled_from([0, 10, 50]), backlog_min_ready=st.just(1),
        backlog_load_threshold=st.sampled_from([0.25, 1.0]), lookahead_frames=st.sampled_from([0, 3]),
        ramp_factor=st.sampled_from([0.0, 1.5]), growth_factor=st.sampled_from([1, 2]),
        max_chunk_frames=st.sampled_from([0, 20, 100]), align_first_chunk=st.sampled_from([0, 7, 25]),
        whole_chunk_frames=st.sampled_from([0, 50])),
    requests=st.lists(st.tuples(st.integers(0, 260), st.booleans(), st.integers(0, 40)), min_size=1, max_size=5),
    data=st.data(),
)
def test_no_chunk_but_a_requests_only_one_is_longer_than_the_policys_longest(policy, requests, data):
    """The codec's start-up warms the carried decode's shapes up to the policy's longest chunk
    (`ChunkPolicy.longest_chunk`): whatever the load, the growth, the ramp, the alignment and the lookahead,
    with frames coming at most one a step, every chunk that continues or precedes another is no longer."""
    longest = policy.longest_chunk()
    if longest is None:
        assert policy.growth_factor > 1 and not policy.max_chunk_frames
        return
    planner = ChunkPlanner(policy, capacity=4)
    fronts = {f"r{i}": planner.frontier(None, prompt, whole=not stream) for i, (_, stream, prompt) in enumerate(requests)}
    target = {f"r{i}": n for i, (n, _, _) in enumerate(requests)}
    made = dict.fromkeys(fronts, 0)
    live = set(fronts)
    while live:
        for rid in sorted(live):
            if made[rid] < target[rid] and data.draw(st.booleans(), label="frame"):
                made[rid] += 1
        finishing = [rid for rid in sorted(live) if made[rid] == target[rid]]
        for chunk in planner.plan({rid: (fronts[rid], made[rid]) for rid in sorted(live)}, finishing):
            if not (chunk.start == 0 and chunk.finished):
                assert chunk.end - chunk.start <= longest, (chunk, policy)
        live -= set(finishing)


def test_a_finished_streams_tail_holds_its_lookahead_beyond_a_hop():
    """The bound's lookahead term: a stream of 4 + 27 frames (hops of 25, 3 frames of lookahead) ends short of
    its second hop's release, so its terminal chunk holds 27 frames, more than any hop."""
    policy = ChunkPolicy(initial_chunk_frames=4, steady_chunk_frames=25, lookahead_frames=3)
    planner = ChunkPlanner(policy, capacity=4)
    front = planner.frontier()
    chunks = [c for n in range(1, 32) for c in planner.plan({"r": (front, n)}, ["r"] if n == 31 else [])]
    assert [(c.start, c.end) for c in chunks] == [(0, 4), (4, 31)]
    assert chunks[-1].end - chunks[-1].start == 27 <= policy.longest_chunk()
