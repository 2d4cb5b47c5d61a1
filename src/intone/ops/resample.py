"""Band-limited resampling (windowed sinc, torchaudio's default filter) of tensors on any device."""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

SINC_ZEROS, SINC_ROLLOFF = 6, 0.99  # torchaudio's defaults
MAX_BANK_TAPS = 1 << 20  # 4 MiB of float32 per cached bank; finer ratios are computed directly
DIRECT_CHUNK = 1 << 15  # output samples per step of resample_direct


@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int, dtype: torch.dtype, zeros: int = SINC_ZEROS,
                 rolloff: float = SINC_ROLLOFF) -> tuple[Tensor, int]:
    """Hann-windowed sinc filter bank, one row per output phase (torchaudio's default method)."""
    base = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / base)
    idx = torch.arange(-width, width + orig, dtype=dtype)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=dtype)[:, None, None] / new + idx
    t = (t * base).clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0, dtype=dtype), t.sin() / t)
    return kernel * (window * (base / orig)), width  # torchaudio's association, for equal bits


def bank_fits(orig_rate: int, new_rate: int) -> bool:
    """Whether the polyphase bank for this ratio is small (common rates); else `resample_direct`."""
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    width = math.ceil(SINC_ZEROS * orig / (min(orig, new) * SINC_ROLLOFF))
    return new * (2 * width + orig) <= MAX_BANK_TAPS


def resample(audio: Tensor, orig_rate: int, new_rate: int) -> Tensor:
    """[..., N] -> [..., ceil(N * new / orig)]; band-limited sinc interpolation.

    The same filter torchaudio.functional.resample uses by default (the official reference
    loader resamples with it), so reference codes match the official ones. A ratio whose
    polyphase bank would be large (a rate like 44,101 Hz: one row per output phase, gigabytes)
    is computed by `resample_direct` instead, in bounded memory.
    """
    if orig_rate == new_rate:
        return audio
    if not bank_fits(orig_rate, new_rate):
        return resample_direct(audio, orig_rate, new_rate)
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernel, width = _sinc_kernel(orig, new, audio.dtype)
    shape = audio.shape
    x = torch.nn.functional.pad(audio.reshape(-1, shape[-1]), (width, width + orig))
    y = torch.nn.functional.conv1d(x[:, None], kernel.to(audio.device), stride=orig)
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    target = math.ceil(new * shape[-1] / orig)
    return y[..., :target].reshape(*shape[:-1], -1)


def resample_direct(audio: Tensor, orig_rate: int, new_rate: int) -> Tensor:
    """The same windowed-sinc interpolation as `resample`, each output's taps computed where it
    falls (float64), a chunk of outputs at a time: memory ~ chunk x taps whatever the ratio.
    Equal to the polyphase result to float rounding."""
    if orig_rate == new_rate:
        return audio
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    base = min(orig, new) * SINC_ROLLOFF
    width = math.ceil(SINC_ZEROS * orig / base)
    shape = audio.shape
    x = audio.reshape(-1, shape[-1]).to(torch.float64)
    n_in, target = shape[-1], math.ceil(new * shape[-1] / orig)
    taps = torch.arange(-width, width + 2, device=audio.device)
    out = []
    for lo in range(0, target, DIRECT_CHUNK):
        j = torch.arange(lo, min(lo + DIRECT_CHUNK, target), device=audio.device)
        n = (j * orig // new)[:, None] + taps[None]  # input samples near each output
        t = ((n.to(torch.float64) / orig - j[:, None].to(torch.float64) / new) * base).clamp(-SINC_ZEROS, SINC_ZEROS)
        window = torch.cos(t * math.pi / SINC_ZEROS / 2) ** 2
        t = t * math.pi
        sinc = torch.where(t == 0, torch.ones((), dtype=torch.float64, device=audio.device), t.sin() / t)
        weights = sinc * window * (base / orig)
        inside = (n >= 0) & (n < n_in)
        samples = x[:, n.clamp(0, n_in - 1)] * inside  # [rows, J, taps], zeros outside the clip
        out.append((samples * weights).sum(-1))
    y = torch.cat(out, dim=-1) if out else x.new_zeros(x.shape[0], 0)
    return y.to(audio.dtype).reshape(*shape[:-1], -1)
