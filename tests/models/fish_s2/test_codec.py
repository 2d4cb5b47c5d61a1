"""Codec: exact output length, causality, and windowed decoding against the one-pass decode."""

import dataclasses

import pytest
import torch

from intone.models.fish_s2.codec import CodecConfig, FishCodec, receptive_field_frames
from intone.models.fish_s2.tiny import TINY_CODEC, _init_codec

HOP = 2048
# A short attention window keeps the receptive field small enough to test cheaply.
SMALL = dataclasses.replace(TINY_CODEC, quantizer_window=4, quantizer_layers=2)


@pytest.fixture(scope="module")
def small_codec():
    torch.manual_seed(0)
    codec = FishCodec(SMALL)
    _init_codec(codec)
    with torch.no_grad():  # full-strength attention, so long-range influence is measurable
        for name, p in codec.named_parameters():
            if name.endswith("layer_scale.gamma"):
                p.fill_(1.0)
    return codec.eval()


def random_codes(frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4096, (batch, 10, frames), generator=g)  # residuals >= 1024 get clamped


@pytest.mark.parametrize("frames", [1, 2, 7, 33])
def test_output_is_exactly_frames_times_hop(tiny_fish, frames):
    audio = tiny_fish.decode(random_codes(frames, batch=2))
    assert audio.shape == (2, frames * HOP)
    assert tiny_fish.samples_per_frame == HOP and tiny_fish.sample_rate == 44100


def test_decoding_is_causal(small_codec):
    codes = random_codes(24)
    changed = codes.clone()
    changed[:, :, 15:] = random_codes(9, seed=1)
    a, b = small_codec.decode(codes), small_codec.decode(changed)
    assert torch.equal(a[:, : 15 * HOP], b[:, : 15 * HOP])
    assert not torch.allclose(a[:, 15 * HOP :], b[:, 15 * HOP :])


def test_receptive_field_formula():
    assert receptive_field_frames(CodecConfig()) == 8 * 127 + 10
    assert receptive_field_frames(SMALL) == 2 * 3 + 10


def test_window_with_full_context_matches_one_pass_decode(small_codec):
    codes = random_codes(60)
    full = small_codec.decode(codes)
    context = receptive_field_frames(SMALL)
    start, end = 30, 41
    window = small_codec.decode(codes[:, :, start - context : end], position_offset=start - context)
    trimmed = window[:, context * HOP :]
    assert trimmed.shape[-1] == (end - start) * HOP
    # Not bit-exact: convolutions over inputs of other lengths round differently (~5e-6).
    assert torch.allclose(trimmed, full[:, start * HOP : end * HOP], atol=2e-5, rtol=0)


def test_window_with_less_context_differs(small_codec):
    codes = random_codes(60)
    full = small_codec.decode(codes)
    context = receptive_field_frames(SMALL) - 6  # the formula is a safe bound, not a tight one
    start, end = 30, 41
    window = small_codec.decode(codes[:, :, start - context : end], position_offset=start - context)
    diff = (window[:, context * HOP :] - full[:, start * HOP : end * HOP]).abs()
    assert diff[:, :HOP].max() > 1e-3  # the start of the chunk is wrong


def test_window_positions_must_be_absolute(small_codec):
    """RoPE tables are bf16-rounded, so positions are not shift-invariant: use absolute ones."""
    codes = random_codes(300)
    context = receptive_field_frames(SMALL)
    start = 290 - context
    right = small_codec.decode(codes[:, :, start:], position_offset=start)
    wrong = small_codec.decode(codes[:, :, start:], position_offset=0)
    assert not torch.equal(right, wrong)


def test_encode_gives_codes_per_started_frame(tiny_fish):
    audio = torch.randn(2048 * 3 + 5) * 0.1
    codes = tiny_fish.encode_reference(audio, 44100)
    assert codes.shape == (10, 4)
    assert int(codes[0].max()) < 4096 and int(codes[1:].max()) < 1024
    again = tiny_fish.encode_reference(audio, 44100)
    assert torch.equal(codes, again)


def test_encode_resamples_to_the_codec_rate(tiny_fish):
    audio = torch.randn(16000) * 0.1  # 1 s at 16 kHz -> 44100 samples -> 22 frames
    assert tiny_fish.encode_reference(audio, 16000).shape == (10, 22)
