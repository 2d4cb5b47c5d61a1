"""CosyVoice3 sampling: the official RAS rule on hand-made histories, and the standard mode."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.engine.model_runner import sampling_batch
from intone.models.cosyvoice3.sampling import SPEECH_TOKENS, sample_speech_tokens
from intone.protocol import SamplingParams

VOCAB = 6761


def logits_with(probs: dict[int, float]) -> torch.Tensor:
    """A row whose softmax puts these probabilities on these ids (the rest share ~1e-12)."""
    row = torch.full((VOCAB,), -40.0)
    for token, p in probs.items():
        row[token] = math.log(p)
    return row


def draw(rows, histories, seeds, mode="ras", steps=None, **kw):
    params = [SamplingParams(temperature=kw.get("temperature", 1.0), top_p=kw.get("top_p", 0.8),
                             top_k=kw.get("top_k", 25), repetition_penalty=kw.get("repetition_penalty", 1.0),
                             min_new_tokens=kw.get("min_new_tokens", 0), seed=s, mode=mode) for s in seeds]
    steps = steps or [len(h) for h in histories]
    batch = sampling_batch(params, steps, "cpu")
    width = max(len(h) for h in histories) + 1
    hist = torch.tensor([list(h) + [-1] * (width - len(h)) for h in histories])
    return sample_speech_tokens(torch.stack(rows).float(), batch, hist).tolist()


def test_a_token_in_the_last_ten_is_redrawn_from_the_rest():
    row = logits_with({7: 0.999, 8: 0.0005, 9: 0.0005})
    history = [7] + [100 + i for i in range(9)]  # 7 is 10 tokens back: inside the window
    out = draw([row] * 50, [history] * 50, range(50))
    assert 7 not in out and set(out) <= {8, 9} | set(range(SPEECH_TOKENS))
    assert set(out) & {8, 9}


def test_a_token_eleven_back_is_not_a_repeat():
    row = logits_with({7: 0.999, 8: 0.001})
    history = [7] + [100 + i for i in range(10)]  # 11 back: outside the window
    assert draw([row] * 20, [history] * 20, range(20)) == [7] * 20


def test_one_occurrence_is_enough_and_the_prompt_does_not_count():
    row = logits_with({7: 0.999, 8: 0.001})
    assert set(draw([row] * 20, [[5, 7, 5]] * 20, range(20))) != {7}
    assert draw([row] * 20, [[]] * 20, range(20)) == [7] * 20  # nothing generated yet


def test_the_token_crossing_top_p_is_kept_and_the_next_is_not():
    row = logits_with({1: 0.5, 2: 0.35, 3: 0.15 - 1e-6})
    out = draw([row] * 400, [[]] * 400, range(400), top_p=0.8)
    assert set(out) == {1, 2}  # 1 (mass before 0), 2 (mass before 0.5 < 0.8); 3 has 0.85 before it
    share = out.count(1) / len(out)
    assert abs(share - 0.5 / 0.85) < 0.07  # drawn in proportion to the kept probabilities


def test_top_k_caps_the_nucleus():
    row = logits_with({1: 0.3, 2: 0.3, 3: 0.3, 4: 0.1 - 1e-6})
    assert set(draw([row] * 200, [[]] * 200, range(200), top_k=2)) == {1, 2}


def test_the_redraw_may_pick_a_stop_id():
    row = logits_with({7: 0.9, 6562: 0.1 - 1e-6})
    out = draw([row] * 30, [[7]] * 30, range(30))
    assert set(out) == {6562}


def test_min_length_masks_sos_only_as_officially():
    row = logits_with({6561: 0.6, 6600: 0.4 - 1e-6})
    out = draw([row] * 30, [[]] * 30, range(30), min_new_tokens=5)
    assert set(out) == {6600}  # 6561 (sos) is masked; the other stop ids are not


def test_standard_mode_masks_every_stop_below_min_length():
    row = logits_with({6561: 0.3, 6600: 0.3, 42: 0.4 - 1e-6})
    out = draw([row] * 30, [[]] * 30, range(30), mode="standard", min_new_tokens=5, top_p=1.0)
    assert set(out) == {42}


def test_standard_mode_penalises_every_generated_token_not_only_recent_ones():
    row = torch.zeros(VOCAB)
    row[5], row[6] = 3.0, 2.9
    history = [5] + [1000 + i for i in range(30)]
    out = draw([row] * 50, [history] * 50, range(50), mode="standard", repetition_penalty=2.0, top_k=1)
    assert set(out) == {6}  # 3.0 / 2 < 2.9


def test_draws_depend_on_the_seed_and_step_not_on_the_batch():
    torch.manual_seed(0)
    rows = [torch.randn(VOCAB) * 2 for _ in range(6)]
    hists = [[int(t) for t in torch.randint(0, SPEECH_TOKENS, (n,))] for n in (0, 3, 12, 40, 5, 9)]
    alone = [draw([r], [h], [s])[0] for r, h, s in zip(rows, hists, range(6))]
    assert draw(rows, hists, range(6)) == alone
    mixed = draw(rows, hists, range(6), mode="standard")
    assert mixed == [draw([r], [h], [s], mode="standard")[0] for r, h, s in zip(rows, hists, range(6))]


@pytest.mark.parametrize("mode", ["ras", "standard"])
def test_mixed_modes_in_one_batch_equal_each_mode_alone(mode):
    torch.manual_seed(1)
    rows = [torch.randn(VOCAB) for _ in range(4)]
    hists = [[1, 2, 3], [], [9] * 12, [4]]
    from intone.engine.model_runner import sampling_batch as sb

    params = [SamplingParams(temperature=1.0, top_p=0.8, top_k=25, seed=i, mode=m)
              for i, m in enumerate(["ras", "standard", "ras", "standard"])]
    batch = sb(params, [len(h) for h in hists], "cpu")
    width = max(map(len, hists)) + 1
    out = sample_speech_tokens(torch.stack(rows), batch, torch.tensor([h + [-1] * (width - len(h)) for h in hists]))
    for i, m in enumerate(["ras", "standard", "ras", "standard"]):
        if m == mode:
            assert out[i] == draw([rows[i]], [hists[i]], [i], mode=m)[0]


@settings(max_examples=25, deadline=None)
@given(modes=st.lists(st.sampled_from(["ras", "standard", None]), min_size=1, max_size=6), seed=st.integers(0, 2**31))
def test_a_batch_of_one_mode_skips_the_other_sampler_and_draws_the_same_tokens(modes, seed):
    """The head runs one sampler for a batch of one mode (`SamplingBatch.modes`): every row's token is the
    one it draws in a batch that computes both."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(modes), VOCAB, generator=g) * 3
    hists = [[int(t) for t in torch.randint(0, SPEECH_TOKENS, (n,), generator=g)] for n in range(len(modes))]
    params = [SamplingParams(temperature=0.9, top_p=0.8, top_k=20, repetition_penalty=1.2, seed=i, mode=m)
              for i, m in enumerate(modes)]
    batch = sampling_batch(params, [len(h) for h in hists], "cpu")
    assert batch.modes == ("standard" if all(m == "standard" for m in modes)
                           else "ras" if "standard" not in modes else "both")
    width = max(map(len, hists)) + 1
    hist = torch.tensor([h + [-1] * (width - len(h)) for h in hists])
    both = dataclasses.replace(batch, modes="both")
    assert torch.equal(sample_speech_tokens(rows, batch, hist), sample_speech_tokens(rows, both, hist))
