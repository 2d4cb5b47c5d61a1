"""`ar.prefix_caching`: requests whose prompts start alike (Fish: the same voice) share that prefix's KV
blocks instead of computing them again, and get what they get without sharing."""

import numpy as np
import pytest
import torch

from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.models.registry import load_model
from intone.ops.kv_cache import BlockManager, prefix_hashes
from intone.protocol import SamplingParams, SynthesisRequest, VoiceReference


def test_blocks_published_by_one_prompt_are_shared_by_the_next_and_lent_afresh_only_when_free():
    m = BlockManager(6, 4)
    tokens, codes = torch.arange(14), torch.zeros(14, 2, dtype=torch.long)
    hashes = prefix_hashes(tokens, codes, 4, 13)  # 3 whole blocks short of the last token
    assert len(hashes) == 3 and hashes == prefix_hashes(tokens, codes, 4, 13)
    other = prefix_hashes(tokens, codes.index_fill(0, torch.tensor([5]), 7), 4, 13)
    assert other[0] == hashes[0] and other[1:] != hashes[1:]  # a code differs in the second block
    a: list[int] = []
    m.grow(a, 14)
    m.publish(a, hashes)
    b: list[int] = []
    assert m.share(b, other) == 1 and b == a[:1] and m.num_free == 2  # the shared block counts once
    m.free(a)
    assert m.num_free == 5  # block 0 is still b's
    c: list[int] = []
    assert m.share(c, hashes) == 3 and c == a_blocks(hashes, m) and m.num_free == 3  # freed, kept, taken back
    m.free(b), m.free(c)
    d: list[int] = []
    m.grow(d, 24)  # every block lent afresh: what they held is forgotten
    e: list[int] = []
    assert m.share(e, hashes) == 0 and m.tables == 1


def a_blocks(hashes, m):
    return [m._by_hash[h] for h in hashes]


@pytest.fixture(scope="module")
def fish64(tiny_fish_dir):
    return load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)


def run(model, caching: bool) -> tuple[dict, dict, dict]:
    """Two requests in the voice of a stored reference (whole blocks of codes), the second admitted
    after the first's prefill, and one without a reference: each one's tokens, audio, and the end
    state of the engine."""
    g = torch.Generator().manual_seed(0)
    voice = VoiceReference("A stored voice.", codes=torch.randint(0, 100, (model.num_codebooks, 70), generator=g))
    profile = load_profile("fish-s2-default", device="cpu", **{"ar.max_num_seqs": 4, "ar.prefix_caching": caching,
                                                                "codec.overlap": False})
    core = EngineCore(model, profile)
    texts = {"a": "First thing to say.", "b": "Something else entirely.", "c": "No voice here."}
    tokens, audio = {}, {}
    core.add_request(SynthesisRequest("a", texts["a"], [voice], SamplingParams(seed=1, max_new_tokens=12)))
    core.add_request(SynthesisRequest("c", texts["c"], [], SamplingParams(seed=3, max_new_tokens=12)))
    steps = 0
    while core.has_work():
        if steps == 2:
            core.add_request(SynthesisRequest("b", texts["b"], [voice], SamplingParams(seed=2, max_new_tokens=12)))
        tokens.update({rid: req.tokens for rid, req in core.requests.items()})
        for c in core.step():
            assert c.error is None, c.error
            audio.setdefault(c.request_id, []).append(c.audio)
        steps += 1
    snap = core.snapshot()
    core.close()
    return tokens, {k: np.concatenate(v) for k, v in audio.items()}, snap


def test_a_second_request_in_the_same_voice_takes_the_voices_blocks_and_gets_the_same_tokens(fish64):
    tokens, audio, snap = run(fish64, caching=True)
    plain_tokens, plain_audio, plain_snap = run(fish64, caching=False)
    assert snap["prefix_cache_blocks"] >= 4 and plain_snap["prefix_cache_blocks"] == 0
    assert tokens == plain_tokens and set(tokens) == {"a", "b", "c"}
    for rid in tokens:
        np.testing.assert_allclose(audio[rid], plain_audio[rid], rtol=0, atol=1e-6)
    for s in (snap, plain_snap):
        assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["kv_tables"] == 0 and s["live_requests"] == 0


def test_a_waiting_request_shares_only_when_admitted_and_a_big_one_is_judged_by_the_whole_cache():
    """Sharing is undone while a request waits (nothing counted, nothing held), and whether a request
    could ever run counts every block once, however many tables hold it."""
    from intone.engine.request import EngineRequest
    from intone.engine.scheduler import Scheduler
    from intone.models.base import Prompt

    def request(rid, prompt, max_new):
        tokens = torch.arange(prompt)
        r = EngineRequest(rid, Prompt(tokens, torch.zeros(prompt, 1, dtype=torch.long)),
                          SamplingParams(max_new_tokens=max_new))
        r.prefix_hashes = prefix_hashes(r.prompt.tokens, r.prompt.codes, 4, prompt - 1)
        return r

    s = Scheduler(BlockManager(10, 4), 8, 8, 64)
    first = request("a", 13, 3)  # 4 blocks, 3 of them published after its prefill
    s.add(first)
    s.schedule()
    s.blocks.publish(first.block_table, first.prefix_hashes)
    late = request("b", 13, 27)  # 10 blocks: with a's 3 shared it needs 7 more, and 6 are free
    s.add(late)
    for _ in range(3):
        assert s.schedule() == [first] and late.block_table == [] and s.shared_blocks == 0
    assert s.fits_ever(request("big", 13, 27)) and not s.fits_ever(request("huge", 13, 28))  # 10 blocks, 11
    s.remove(first)
    assert [r.request_id for r in s.schedule()] == ["b"] and s.shared_blocks == 3 and late.cached_tokens == 12
