"""The GPU's static AR step (`engine.step_graphs`: inputs staged in one buffer at a bucket's offsets, prompts as
decode rows, the previous step's frame read on the device, padding rows past the step's) gives every request the
frames and audio of the eager step. The static functions run here eagerly on the CPU, over the same buffers a
GPU's graphs replay; the engine core and its loop are the real ones, in order and with a step in flight."""

import numpy as np
import pytest
import torch

from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.engine.model_runner import ModelRunner, StepInput
from intone.models.base import Prompt
from intone.models.registry import load_model
from intone.ops.kv_cache import BlockManager, KVCache
from intone.protocol import SamplingParams, SynthesisRequest, VoiceReference

# The engine's loop and codec threads on one torch thread each (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["Hello world", "A longer sentence to say.", "Hi", "Numbers 1, 2, 3."]


def serve(core: EngineCore, arrivals: dict[int, list[SynthesisRequest]]) -> dict[str, list]:
    chunks: dict[str, list] = {}
    step = 0
    while step <= max(arrivals) or core.has_work():
        for req in arrivals.get(step, []):
            core.add_request(req)
        for c in core.step():
            chunks.setdefault(c.request_id, []).append(c)
        step += 1
    return chunks


def static(core: EngineCore, max_tokens: int) -> EngineCore:
    """The core's runner with the static step a GPU builds (rows up to its capacity, token rows up to max_tokens:
    a step with more prompt tokens runs eagerly, so the two alternate)."""
    core.runner.graphs = core.runner._step_graphs(core.profile.ar.max_num_seqs, max_tokens)
    return core


def same_requests(a: dict, b: dict, tol: float) -> None:
    assert set(a) == set(b)
    for rid in a:
        ends = [(c[-1].stop_reason, c[-1].end_frame, c[-1].completion_tokens) for c in (a[rid], b[rid])]
        assert ends[0] == ends[1] and ends[0][0] in ("stop", "length"), rid
        audio = [np.concatenate([c.audio for c in cs]) for cs in (a[rid], b[rid])]
        assert audio[0].shape == audio[1].shape and audio[0].size > 0, rid
        assert np.abs(audio[0] - audio[1]).max() < tol, rid


@pytest.mark.parametrize("in_flight", [True])  # in order: the CosyVoice3 case and test_decode_graphs (CI's time)
def test_static_fish_steps_give_each_request_the_eager_steps_frames_and_audio(tiny_fish_dir, in_flight):
    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    params = [SamplingParams(seed=40 + i, max_new_tokens=(6 + 5 * i) if i % 3 else 90, temperature=1.0,
                             top_k=[30, 200, 0][i % 3] or 50) for i in range(9)]
    arrivals = {0: [0, 1], 2: [2, 3, 4], 5: [5], 9: [6, 7], 14: [8]}

    def run(make_static: bool):
        core = EngineCore(model, load_profile("fish-s2-high-concurrency", device="cpu", **{
            "ar.max_num_seqs": 6, "codec.max_batch": 6, "ar.async_steps": in_flight}))
        if make_static:
            static(core, 48)
        reqs = {k: [SynthesisRequest(f"r{i}", TEXTS[i % 4], params=params[i]) for i in v] for k, v in arrivals.items()}
        return core, serve(core, reqs)

    (_, eager), (core, staged) = run(False), run(True)
    same_requests(eager, staged, 1e-7)
    assert core.runner.graphs.eager > 20  # most steps ran static (the rest, too many prompt tokens, eagerly)
    snap = core.snapshot()
    assert snap["kv_blocks_free"] == snap["kv_blocks_total"] and snap["live_requests"] == 0


@pytest.mark.parametrize("in_flight", [False, True])
def test_static_cosyvoice3_steps_give_each_request_the_eager_steps_frames_and_audio(tiny_cache, in_flight):
    """Both sampling modes in one batch and alone (the head's per-mode graphs), streams and full responses."""
    model = load_model("tiny:cosyvoice3", dtype=torch.float64, codec_dtype=torch.float64)
    t = torch.arange(16000) / 16000
    voice = VoiceReference(text="A reference.", audio=0.1 * torch.sin(2 * torch.pi * 150 * t), sample_rate=16000)
    modes = ["standard", "ras", "standard", "standard", "ras"]

    def run(make_static: bool):
        core = EngineCore(model, load_profile("cosyvoice3-streaming", device="cpu", **{
            "ar.async_steps": in_flight, "ar.max_num_seqs": 3}))
        if make_static:
            static(core, 256)
        reqs = {2 * i: [SynthesisRequest(f"r{i}", TEXTS[i % 4], [voice], stream=i % 2 == 1, params=SamplingParams(
            seed=10 + i, max_new_tokens=12 + 7 * i, mode=modes[i]))] for i in range(5)}
        return core, serve(core, reqs)

    (_, eager), (core, staged) = run(False), run(True)
    same_requests(eager, staged, 1e-7)
    assert core.runner.graphs.eager > 10


def test_a_static_step_takes_requests_in_any_order_and_pads_past_them(tiny_fish):
    """Rows come back in the caller's order, a frame the host has not read is taken from the caller's row of the
    step before, and the padding rows past a step's (3 requests in a 4-row bucket, 40 prompt tokens in a 48-row
    one) change no real row's token."""
    model = tiny_fish
    g = torch.Generator().manual_seed(5)

    def runner():
        kv = KVCache(model.kv_layout, 64, 16, model.dtype, "cpu")
        r = ModelRunner(model, kv, max_seats=8)
        r.graphs = r._step_graphs(8, 64)
        return r, BlockManager(64, 16)

    def prompt(n):
        return Prompt(torch.randint(0, 50, (n,), generator=g), torch.zeros(n, model.num_codebooks, dtype=torch.long))

    prompts, late = [prompt(n) for n in (9, 17, 14)], prompt(11)
    params = [SamplingParams(seed=i, temperature=1.0) for i in range(4)]

    def three_steps(r: ModelRunner, blocks: BlockManager, read: bool):
        """r0's prefill; r0's decode beside r1's and r2's prefills (run prefills first: rows reordered); the
        three decodes, the rows reversed and a new prompt among them, their frames read or left on the device."""
        reqs = [StepInput(f"r{i}", p, params[i], [], None, blocks.grow([], 60)) for i, p in enumerate(prompts)]
        (t0,), _, (c0,) = r.run(reqs[:1]).to_host()
        reqs[0] = StepInput("r0", prompts[0], params[0], [t0], c0, reqs[0].block_table)
        out = r.run(reqs)
        tokens, _, codes = out.to_host() if read else ([], [], [])
        new = StepInput("late", late, params[3], [], None, blocks.grow([], 60))
        decodes = [StepInput(q.request_id, q.prompt, q.params, q.tokens + tokens[i:i + 1],
                             codes[i] if read else None, q.block_table, pending=-1 if read else i)
                   for i, q in enumerate(reqs)]
        last = r.run([decodes[2], new, decodes[1], decodes[0]]).to_host()
        return (out.to_host() if not read else (tokens, None, codes)), last

    (a, blocks_a), (b, blocks_b) = runner(), runner()
    (unread, second), (read, again) = three_steps(a, blocks_a, False), three_steps(b, blocks_b, True)
    assert unread[0] == read[0] and second[0] == again[0] and np.array_equal(second[2], again[2])
    c, blocks_c = runner()
    alone = [c.run([StepInput(f"r{i}", p, params[i], [], None, blocks_c.grow([], 60))]).to_host()
             for i, p in enumerate(prompts[1:], 1)]
    assert read[0][1:] == [t[0][0] for t in alone]  # prompts beside others and padding: their tokens alone


def test_a_step_with_more_requests_than_history_seats_runs_eagerly_and_so_do_the_next(tiny_fish):
    """The token history grows a new table past its seats; the static step's graphs read the old one, so that step
    and every later one run eagerly, with the tokens of a runner that never had a static step."""
    model = tiny_fish
    g = torch.Generator().manual_seed(8)
    prompts = [Prompt(torch.randint(0, 50, (9,), generator=g), torch.zeros(9, model.num_codebooks, dtype=torch.long))
               for _ in range(3)]

    def run(static: bool):
        kv = KVCache(model.kv_layout, 64, 16, model.dtype, "cpu")
        r, blocks = ModelRunner(model, kv, max_seats=2), BlockManager(64, 16)
        if static:
            r.graphs = r._step_graphs(4, 64)
        reqs = [StepInput(f"r{i}", p, SamplingParams(seed=i, temperature=1.0), [], None, blocks.grow([], 40))
                for i, p in enumerate(prompts)]
        for _ in range(3):
            tokens, _, codes = r.run(reqs).to_host()
            reqs = [StepInput(q.request_id, q.prompt, q.params, q.tokens + [t], c, q.block_table)
                    for q, t, c in zip(reqs, tokens, codes)]
        return r, [q.tokens for q in reqs]

    (static, a), (_, b) = run(True), run(False)
    assert a == b and static.graphs.eager == 0 and static.history.seats == 4


def test_prompt_row_buckets_pad_a_prompts_step_less_and_change_no_token(tiny_fish):
    """`ar.prompt_row_buckets`: 40 prompt tokens and a decode row in a step pad to 48 rows by default and to 44
    with a bucket of 44, whose graphs start-up captures at every KV bucket; every request draws the same tokens
    either way."""
    model = tiny_fish
    g = torch.Generator().manual_seed(11)
    prompts = [Prompt(torch.randint(0, 50, (n,), generator=g), torch.zeros(n, model.num_codebooks, dtype=torch.long))
               for n in (9, 17, 14)]

    def run(buckets: tuple):
        kv = KVCache(model.kv_layout, 64, 16, model.dtype, "cpu")
        r, blocks = ModelRunner(model, kv, max_seats=8, token_buckets=buckets), BlockManager(64, 16)
        r.graphs = r._step_graphs(8, 64)
        first = StepInput("first", prompts[0], SamplingParams(seed=7, temperature=1.0), [], None, blocks.grow([], 40))
        (t,), _, (c,) = r.run([first]).to_host()
        reqs = [StepInput(f"r{i}", p, SamplingParams(seed=i, temperature=1.0), [], None, blocks.grow([], 40))
                for i, p in enumerate(prompts)]
        reqs.append(StepInput("first", prompts[0], first.params, [t], c, first.block_table))
        key = r.graphs.key(sum(len(p) for p in prompts) + 1, 48, 4, None, "both")
        tokens, _, codes = r.run(reqs).to_host()
        return r, key, tokens, codes

    (plain, key_plain, a, codes_a), (fine, key_fine, b, codes_b) = run(()), run((44,))
    assert (key_plain.rows, key_fine.rows) == (48, 44)
    assert a == b and np.array_equal(codes_a, codes_b)
    assert fine.eager_steps == plain.eager_steps == 0  # both steps ran as the static step
    keys = fine.graphs.decode_keys(512, 64)
    assert {(44, kv) for kv in (256, 512)} <= set(keys)
    assert not any(r == 44 for r, _ in plain.graphs.decode_keys(512, 64))


def test_a_static_decode_step_makes_a_handful_of_torch_calls_whatever_its_rows(tiny_fish, monkeypatch):
    """Every torch call gives up the GIL the engine loop shares with the frontend's and codec's threads, and under
    load waits to win it back (session 38): a static step's host side (its graphs' replays aside) stays a few calls,
    at 4 rows and at 24 (before the static step it was 189 at 40 rows)."""
    from torch.overrides import TorchFunctionMode

    from intone.engine.step_graphs import StepGraphs

    counted = [False]

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += counted[0]
            return func(*args, **(kwargs or {}))

    def aside(fn):  # what a GPU replays from its graphs: not the host's calls
        def run(*args, **kwargs):
            was, counted[0] = counted[0], False
            try:
                return fn(*args, **kwargs)
            finally:
                counted[0] = was
        return run
    monkeypatch.setattr(StepGraphs, "_run", aside(StepGraphs._run))
    model = tiny_fish
    g = torch.Generator().manual_seed(6)
    for rows in (4, 24):
        kv = KVCache(model.kv_layout, 256, 16, model.dtype, "cpu")
        blocks, runner = BlockManager(256, 16), ModelRunner(model, kv, max_seats=64)
        runner.graphs = runner._step_graphs()
        reqs = [StepInput(f"r{i}", Prompt(torch.randint(0, 50, (12,), generator=g),
                                          torch.zeros(12, model.num_codebooks, dtype=torch.long)),
                          SamplingParams(seed=i), [], None, blocks.grow([], 40)) for i in range(rows)]
        for _ in range(3):  # the prefill, then a decode (the first use of a bucket makes its views)
            tokens, _, codes = runner.run(reqs).to_host()
            reqs = [StepInput(q.request_id, q.prompt, q.params, q.tokens + [t], c, q.block_table)
                    for q, t, c in zip(reqs, tokens, codes)]
        Count.calls = 0
        with Count():
            counted[0] = True
            runner.run(reqs).to_host()
            counted[0] = False
        assert Count.calls <= 5, (rows, Count.calls)
