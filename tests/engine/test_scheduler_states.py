"""The scheduler's bookkeeping that the boundary tests (test_chunk_planner_boundaries) leave open: whole
blocks per request when several are admitted at once, cancelling a queued request, the soft step target
with decodes running, the hard token bound under a higher soft target, and the request states the core
reads (it plans chunks only for RUNNING requests, so a request left in another state streams nothing
until it ends). Each was a surviving mutant of tools/mutation_run.sh."""

import pytest
import torch

from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.engine.request import EngineRequest, Status
from intone.engine.scheduler import Scheduler
from intone.models.base import Prompt
from intone.ops.kv_cache import BlockManager
from intone.protocol import SamplingParams, SynthesisRequest


def request(rid, prompt=4, max_new=4):
    return EngineRequest(rid, Prompt(torch.zeros(prompt, dtype=torch.long), torch.zeros(prompt, 1, dtype=torch.long)),
                         SamplingParams(max_new_tokens=max_new))


def scheduler(blocks=100, block_size=4, seqs=8, waiting=8, tokens=64):
    return Scheduler(BlockManager(blocks, block_size), seqs, waiting, tokens)


def ids(reqs):
    return [r.request_id for r in reqs]


@pytest.mark.parametrize("blocks, admitted", [(5, 2), (6, 3)])
def test_each_request_admitted_in_one_step_is_counted_in_whole_blocks(blocks, admitted):
    """5 tokens of 4-token blocks are 2 blocks, not 1.25: three such requests need 6 blocks, not 3.75."""
    s = scheduler(blocks=blocks, block_size=4)
    for i in range(3):
        s.add(request(f"r{i}", prompt=4, max_new=1))
    s.schedule()
    assert len(s.running) == admitted and len(s.waiting) == 3 - admitted
    for r in s.running:  # and every admitted request can really grow to its maximum
        s.blocks.grow(r.block_table, r.kv_tokens_needed)
    s.add(request("late", prompt=4, max_new=1))
    s.schedule()  # nothing is left unclaimed: the late one waits behind the rest
    assert "late" not in ids(s.running)


def test_a_request_cancelled_while_queued_leaves_the_queue_and_a_running_one_frees_its_blocks():
    s = scheduler(blocks=10, block_size=4, seqs=1)
    a, b, c = request("a"), request("b"), request("c")
    for r in (a, b, c):
        s.add(r)
    assert [r.status for r in (a, b, c)] == [Status.WAITING] * 3
    assert ids(s.schedule()) == ["a"] and a.status is Status.RUNNING and b.status is Status.WAITING
    s.blocks.grow(a.block_table, a.kv_tokens_needed)
    s.remove(b)  # cancelled while queued
    assert ids(s.waiting) == ["c"] and b.status is Status.FINISHED
    s.remove(b)  # idempotent
    s.remove(a)  # cancelled while running: its blocks come back
    assert a.status is Status.FINISHED and s.running == [] and s.blocks.num_free == 10
    assert ids(s.schedule()) == ["c"] and c.status is Status.RUNNING


@pytest.mark.parametrize("second, admitted", [(3, True), (4, False)])
def test_the_soft_step_target_counts_the_running_decodes(second, admitted):
    s = scheduler(tokens=64)
    s.step_token_target = 10
    for i in range(3):
        s.add(request(f"run{i}", prompt=1))
    s.schedule()
    s.add(request("a", prompt=4))
    s.add(request("b", prompt=second))  # 3 decodes + 4 + 3 = 10 tokens: exactly the target
    assert ids(s.schedule()) == (["a", "b"] if admitted else ["a"]) + ["run0", "run1", "run2"]


def test_the_hard_token_bound_holds_when_the_soft_target_is_above_it():
    """The core raises the soft target to what the CUDA graphs cover, which may exceed the hard bound."""
    s = scheduler(tokens=16)
    s.step_token_target = 100
    for rid, prompt in (("a", 10), ("b", 6), ("c", 1)):
        s.add(request(rid, prompt=prompt))
    assert ids(s.schedule()) == ["a", "b"]  # 16 tokens: c waits for the next step
    assert ids(s.schedule()) == ["c", "a", "b"]


def test_a_streamed_request_gets_chunks_while_it_is_still_generating(tiny_fish):
    profile = load_profile("fish-s2-high-concurrency", **{"ar.max_num_seqs": 8, "codec.max_batch": 8,
                                                          "device": "cpu"})
    core = EngineCore(tiny_fish, profile)
    core.add_request(SynthesisRequest("a", "Hello", params=SamplingParams(seed=5, max_new_tokens=30, ignore_eos=True),
                                      initial_chunk_frames=2))
    steps = []  # per step: the chunks it returned
    while core.has_work():
        steps.append(core.step())
    first = next(i for i, cs in enumerate(steps) if cs)
    last = next(i for i, cs in enumerate(steps) if any(c.finished for c in cs))
    assert not any(c.finished for c in steps[first]) and first < last - 10
    assert (steps[first][0].start_frame, steps[first][0].end_frame) == (0, 2)
