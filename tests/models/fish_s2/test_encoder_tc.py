"""The reference encoder time-major (`fish_s2.encoder_layout: time_major`) computes the channels-first encoder's
sums: float64 latents within rounding and the same codes, at lengths whose inner rates are no multiple of the
dilations (the padded buffers), batched or alone."""

import torch
from hypothesis import given, settings, strategies as st

from intone.models.fish_s2.codec import FishCodec
from intone.models.fish_s2.encoder_tc import encode_tc
from intone.models.fish_s2.tiny import TINY_CODEC


def _codec() -> FishCodec:
    torch.manual_seed(0)
    codec = FishCodec(TINY_CODEC).double().eval()
    with torch.no_grad():  # Snakes away from the init's all-ones, biases away from zero
        for name, p in codec.encoder.named_parameters():
            if name.endswith("alpha"):
                p.uniform_(0.3, 3.0)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return codec


CODEC = _codec()


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.integers(0, 2**31 - 1))
def test_the_time_major_encoder_gives_the_channels_first_latent_and_codes(frames, seed):
    g = torch.Generator().manual_seed(seed)
    hop = CODEC.hop_length
    audio = 0.3 * torch.randn(len(frames), max(frames) * hop, generator=g, dtype=torch.float64)
    for row, n in enumerate(frames):  # right-padded with silence, as the frontend's calls are
        audio[row, n * hop:] = 0
    x = audio.unsqueeze(1)
    with torch.inference_mode():
        expected = CODEC.encoder(x)
        got = encode_tc(CODEC.encoder, x)
        assert got.shape == expected.shape
        assert (got - expected).abs().max() <= 1e-10 * max(1.0, expected.abs().max().item())
        first = CODEC.encode(audio)
        CODEC.encoder_layout = "time_major"
        try:
            assert torch.equal(CODEC.encode(audio), first)
        finally:
            CODEC.encoder_layout = "channels_first"


def test_a_clip_alone_and_batched_gets_the_same_codes_time_major():
    hop = CODEC.hop_length
    g = torch.Generator().manual_seed(1)
    clips = [0.3 * torch.randn(n * hop, generator=g, dtype=torch.float64) for n in (2, 5)]
    batch = torch.zeros(2, 5 * hop, dtype=torch.float64)
    for row, clip in enumerate(clips):
        batch[row, : clip.shape[0]] = clip
    CODEC.encoder_layout = "time_major"
    try:
        together = CODEC.encode(batch)
        alone = [CODEC.encode(clip[None]) for clip in clips]
    finally:
        CODEC.encoder_layout = "channels_first"
    assert torch.equal(together[0, :, :2], alone[0][0]) and torch.equal(together[1], alone[1][0])
