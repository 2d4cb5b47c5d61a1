"""Generation: seeds, stopping, max_new_tokens, batch independence, voice cloning."""

import pytest
import torch

from tests.offline import OfflineRequest, run_to_completion
from intone.errors import InvalidRequestError
from intone.protocol import SamplingParams, VoiceReference


def generate(model, text="Hello world", seed=1, refs=(), **kw):
    params = SamplingParams(seed=seed, **kw)
    return run_to_completion(model, [OfflineRequest(model.build_prompt(text, list(refs)), params)])[0]


def test_same_seed_same_codes_and_audio(tiny_fish):
    a, b = generate(tiny_fish, seed=5, max_new_tokens=60), generate(tiny_fish, seed=5, max_new_tokens=60)
    assert a.codes.shape[1] > 0 and torch.equal(a.codes, b.codes)
    assert torch.equal(tiny_fish.decode(a.codes[None]), tiny_fish.decode(b.codes[None]))
    c = generate(tiny_fish, seed=6, max_new_tokens=60)
    assert not torch.equal(a.codes[:, :5], c.codes[:, :5])


@pytest.fixture(scope="module")
def seed5(tiny_fish):
    """Seed 5 with room to stop by itself (the two tests below read the same run)."""
    return generate(tiny_fish, seed=5, max_new_tokens=400)


def test_max_new_tokens_caps_the_frames(tiny_fish, seed5):
    long_run = seed5
    assert long_run.stop_reason == "stop" and len(long_run.frames) > 7
    capped = generate(tiny_fish, seed=5, max_new_tokens=7)
    assert capped.stop_reason == "length" and capped.codes.shape == (10, 7)
    assert torch.equal(capped.codes, long_run.codes[:, :7])  # the cap cuts, it does not change


def test_stop_step_makes_no_frame(tiny_fish, seed5):
    r = seed5
    tok = tiny_fish.tokenizer
    assert r.stop_reason == "stop"
    assert len(r.frames) == len(r.tokens)
    assert all(tok.semantic_begin <= t <= tok.semantic_end for t in r.tokens)
    assert all(int(f[0]) == t - tok.semantic_begin for f, t in zip(r.frames, r.tokens))


def test_codes_are_valid_for_the_codec(tiny_fish):
    r = generate(tiny_fish, seed=2, max_new_tokens=50)
    assert int(r.codes[0].max()) < 4096 and int(r.codes.min()) >= 0
    assert int(r.codes[1:].max()) < 4096  # residuals span 4096; the codec clamps them to 1023


def test_a_request_gets_the_same_codes_alone_and_in_a_batch(tiny_fish):
    prompts = [tiny_fish.build_prompt(t, []) for t in ("Hello world", "A longer sentence to speak here.", "Hi")]
    alone = [run_to_completion(tiny_fish, [OfflineRequest(p, SamplingParams(seed=10 + i, max_new_tokens=40))])[0]
             for i, p in enumerate(prompts)]
    together = run_to_completion(tiny_fish, [
        OfflineRequest(p, SamplingParams(seed=10 + i, max_new_tokens=40)) for i, p in reversed(list(enumerate(prompts)))
    ])[::-1]
    for a, b in zip(alone, together):
        assert torch.equal(a.codes, b.codes)


def test_voice_cloning_from_reference_audio(tiny_fish):
    t = torch.arange(44100 * 2) / 44100
    voice = 0.3 * torch.sin(2 * torch.pi * 220 * t)
    ref = VoiceReference(text="A reference sentence.", audio=voice, sample_rate=44100)
    prompt = tiny_fish.build_prompt("Say this", [ref])
    tok = tiny_fish.tokenizer
    semantic = ((prompt.tokens >= tok.semantic_begin) & (prompt.tokens <= tok.semantic_end)).sum()
    assert int(semantic) == -(-voice.shape[0] // 2048)
    r = generate(tiny_fish, text="Say this", refs=[ref], seed=3, max_new_tokens=20)
    assert r.codes.shape[0] == 10


def test_prompt_longer_than_the_model_allows_is_rejected(tiny_fish):
    codes = torch.zeros(10, tiny_fish.max_seq_len, dtype=torch.long)
    prompt = tiny_fish.build_prompt("hi", [VoiceReference(text="x", codes=codes)])
    with pytest.raises(InvalidRequestError, match="prompt"):
        run_to_completion(tiny_fish, [OfflineRequest(prompt, SamplingParams(seed=1))])


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", 0),
                                          ("max_new_tokens", 0), ("repetition_penalty", 0.0), ("seed", -3)])
def test_bad_sampling_values_are_rejected(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value}).validate()
    assert err.value.field == field
