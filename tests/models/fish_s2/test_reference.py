"""Reference clips -> codes in batched encoder calls: the codes do not depend on how clips share calls
(the encoder is causal), and every call is at a shape start-up primed."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.models.fish_s2.reference import ReferencePlan, encode_batch
from intone.ops.batching import bucket_rows

RATE, HOP = 44100, 2048


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.integers(1, 215), min_size=1, max_size=40), rows=st.sampled_from([1, 3, 16]),
       bucket_s=st.sampled_from([0.5, 1.0, 2.0]))
def test_calls_hold_each_clip_once_within_bounds_at_primed_shapes(frames, rows, bucket_s):
    """fish_s2.reference_rows / reference_bucket_s: at most `rows` clips a call, rows x padded frames within
    the plan's bound (or one clip alone), and each call's (rows, frames) among the shapes start-up
    primes (clips up to 10 s: 215 frames)."""
    plan = ReferencePlan.of(rows, bucket_s, RATE, HOP)
    calls = plan.calls(frames)
    assert sorted(i for c in calls for i in c) == list(range(len(frames)))
    primed = set(plan.shapes(RATE, HOP))
    for call in calls:
        padded = plan.frames(max(frames[i] for i in call))
        assert len(call) <= rows and padded >= max(frames[i] for i in call)
        assert len(call) == 1 or bucket_rows(len(call)) * padded <= plan.max_batch_frames
        assert (bucket_rows(len(call)), padded) in primed


def test_a_clips_codes_do_not_depend_on_the_clips_beside_it(tiny_fish_dir):
    """Five clips of 0.1-1.5 s encoded 16 a call in 2 s buckets (the default: one call of 8 rows padded to 2 s)
    and alone in 1 s buckets: the same codes, each its clip's own encode (float64)."""
    from intone.models.registry import load_model

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    codec = model.codec
    g = torch.Generator().manual_seed(3)
    wavs = [torch.randn(int(s * RATE), generator=g) * 0.1 for s in (0.1, 1.5, 0.6, 1.2, 0.35)]
    alone = [codec.encode(w[None])[0] for w in wavs]
    for plan in (ReferencePlan(), ReferencePlan.of(1, 1.0, RATE, HOP)):
        codes = encode_batch(codec, wavs, plan=plan)
        assert all(torch.equal(c, a) for c, a in zip(codes, alone))


def test_the_profile_section_sets_the_models_plan(tiny_fish):
    from intone.engine.config import ProfileError, load_profile

    profile = load_profile("fish-s2-high-concurrency", **{"fish_s2.reference_rows": 1, "fish_s2.reference_bucket_s": 1})
    tiny_fish.configure_frontend(profile.options_for("fish-s2"))
    try:
        assert tiny_fish._reference_plan == ReferencePlan(1, 22)  # 1 s: 21.5 frames of 2048 at 44.1 kHz
    finally:
        tiny_fish.configure_frontend(None)
    assert tiny_fish._reference_plan == ReferencePlan()
    with pytest.raises(ProfileError, match=r"fish_s2\.reference_rows"):
        load_profile("fish-s2-high-concurrency", **{"fish_s2.reference_rows": 0})
    with pytest.raises(ProfileError, match="fish_s2"):
        load_profile("cosyvoice3-streaming", **{"fish_s2.reference_rows": 1}).options_for("cosyvoice3")
