"""Building blocks of the CosyVoice3 HiFT vocoder: padded convolutions, the causal F0 predictor
and the harmonic (neural source-filter) excitation.

Two parts keep a fixed dtype whatever the rest of the vocoder is cast to:
- the F0 predictor stays float64 (the official code casts it to float64 before every call and
  notes that F0 precision is crucial for causal inference);
- the fixed noise buffers stay float32 (they are official uniform draws; only their device moves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intone.ops.padded_conv import padded_conv1d

# The F0 predictor's left-causal convolutions after its look-ahead one (official CausalConvRNNF0Predictor).
F0_CAUSAL_CONVS, F0_CAUSAL_KERNEL = 4, 3

# Official SineGen2 uses fixed noise of 300 s at 24 kHz for 9 harmonic channels, whatever the config.
OFFICIAL_NOISE_SAMPLES = 300 * 24000


class PinnedDtype(nn.Module):
    """Floating tensors of this module (and its children) keep `pinned_dtype` through .to(dtype),
    .half(), .double() and friends; device moves still apply. The value is taken from the
    original tensor, so a round trip through a narrower dtype never loses precision."""

    pinned_dtype: torch.dtype = torch.float32

    def _apply(self, fn, recurse=True):
        dtype = self.pinned_dtype

        def keep_dtype(t):
            out = fn(t)
            if t.is_floating_point() and out.dtype != dtype:
                out = t.to(device=out.device, dtype=dtype)
            return out

        return super()._apply(keep_dtype, recurse)


class PaddedConv1d(nn.Module):
    """A 1-D convolution with explicit zero padding: `left` frames before, `right` frames after
    (the official causal convs concatenate zeros the same way), an optional nearest-neighbour
    upsampling of the input by `upsample` first, and a stride.

    `forward(x, pad=False)` skips the padding: the official non-final calls hand the look-ahead
    frames over as a "cache" instead of zeros, which is the same as not padding at all.
    """

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel: int,
        *,
        left: int = 0,
        right: int = 0,
        stride: int = 1,
        dilation: int = 1,
        upsample: int = 1,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c_out, c_in, kernel, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(c_out, dtype=dtype))
        self.left, self.right = left, right
        self.stride, self.dilation, self.upsample = stride, dilation, upsample
        bound = 1.0 / math.sqrt(c_in * kernel)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            self.bias.uniform_(-bound, bound)

    def forward(self, x: Tensor, pad: bool = True) -> Tensor:
        if self.upsample > 1:
            x = F.interpolate(x, scale_factor=float(self.upsample), mode="nearest")
        left, right = (self.left, self.right) if pad else (0, 0)
        return padded_conv1d(x, self.weight, self.bias, left, right, self.stride, self.dilation)


class CausalF0Predictor(PinnedDtype):
    """mel [B, C, T] -> F0 in Hz [B, T] (or [B, T - 3] without look-ahead padding); float64 only.

    One conv of kernel 4 that looks 3 frames ahead, four left-causal convs of kernel 3, ELU after
    each, then a linear map to one value and its absolute value. `condnet` keeps the official
    Sequential indices (convs at even positions, ELUs at odd ones).
    """

    pinned_dtype = torch.float64

    def __init__(self, in_channels: int = 80, cond_channels: int = 512, look_right: int = 3):
        super().__init__()
        f64 = torch.float64
        first = PaddedConv1d(in_channels, cond_channels, look_right + 1, right=look_right, dtype=f64)
        layers: list[nn.Module] = [first, nn.ELU()]
        for _ in range(F0_CAUSAL_CONVS):
            layers += [PaddedConv1d(cond_channels, cond_channels, F0_CAUSAL_KERNEL, left=F0_CAUSAL_KERNEL - 1,
                                    dtype=f64), nn.ELU()]
        self.condnet = nn.ModuleList(layers)
        self.classifier = nn.Linear(cond_channels, 1, dtype=f64)
        self.look_right = look_right

    def forward(self, mel: Tensor, pad: bool = True) -> Tensor:
        x = self.condnet[0](mel.to(torch.float64), pad=pad)
        for layer in self.condnet[1:]:
            x = layer(x)
        # Detached weights: the official F0 predictor is cast to float64 inside inference mode, so its
        # weights are inference tensors, and matmul then takes the path it takes for tensors without
        # grad (a parameter that requires grad is folded differently and can differ in the last bit).
        weight, bias = self.classifier.weight.detach(), self.classifier.bias.detach()
        return torch.abs(F.linear(x.transpose(1, 2), weight, bias).squeeze(-1))


class SineNoise(PinnedDtype):
    """Holder of the fixed SineGen2 noise (official `m_source.l_sin_gen.{rand_ini,sine_waves}`).

    Neither buffer is a checkpoint key. `sine_waves` [1, N, harmonics+1] float32 is the per-sample
    noise of every harmonic channel (259.2 MB at the official N = 7.2 M samples); `rand_ini`
    [1, harmonics+1] is the official initial phase, kept for reference only: the official code adds
    it to sample 0 of the per-sample phase increments, but the linear x1/hop resampling that
    follows reads only samples hop*i + hop/2 - 1 and hop*i + hop/2, so it never reaches the output.
    """

    pinned_dtype = torch.float32

    def __init__(self, channels: int, samples: int):
        super().__init__()
        self.register_buffer("rand_ini", torch.zeros(1, channels), persistent=False)
        self.register_buffer("sine_waves", torch.zeros(1, samples, channels), persistent=False)


@dataclass
class SourceWindow:
    """Rows that continue a stream from a window of its mel (CosyVoice3's carried HiFT state).

    Row b's frame 0 is absolute frame `first[b]` (the fixed noise is read from there). Its phase
    is the carried sum `carried[b]` (per harmonic, in cycles) of the wrapped per-frame increments
    of every frame before absolute frame `carried_at[b]`, continued over the window's frames from
    there; the window's frames before `carried_at[b]` are context whose phase is not used. After
    the call, `recorded[b]` is the same sum over the frames before `record_at[b]`, for the row's
    next window. `carried_at[b] == first[b] == 0` starts a stream.
    """

    first: list[int]
    carried_at: list[int]
    carried: Tensor  # [B, harmonics + 1]
    record_at: list[int]
    recorded: Tensor | None = None

    def rows(self, idx: list[int] | slice) -> SourceWindow:
        pick = range(len(self.first))[idx] if isinstance(idx, slice) else idx
        return SourceWindow([self.first[i] for i in pick], [self.carried_at[i] for i in pick],
                            self.carried[list(pick)], [self.record_at[i] for i in pick])

    def check(self, frames: list[int]) -> None:
        """Each row's phase can be recorded where asked, given the row's frames in this window."""
        for start, at, carried_at, n in zip(self.first, self.record_at, self.carried_at, frames):
            if at != carried_at and not carried_at <= at <= start + n:
                raise ValueError(f"cannot record the phase before frame {at}: the window covers frames "
                                 f"{start}..{start + n} with its phase known from {carried_at}")


@dataclass
class SourceRows:
    """A SourceWindow's rows as device tensors ([B] int64 each, `carried` [B, harmonics + 1]), so the
    excitation runs without reading them on the host (a fixed-shape call, replayable from a CUDA graph)."""

    first: Tensor
    carried_at: Tensor
    carried: Tensor
    record_at: Tensor


class HarmonicSource(nn.Module):
    """Official `m_source` (SourceModuleHnNSF with the causal SineGen2): F0 at frame rate ->
    excitation at sample rate, made of `harmonics + 1` sines merged by `l_linear` and tanh.

    The arithmetic mirrors the official per-sample code; the phase increments are computed at
    frame rate, which gives the same values: F0 is constant over each frame after the nearest
    upsampling, and the official linear downsampling by `hop` takes the mean of two equal
    samples of each frame.
    """

    def __init__(
        self,
        *,
        sampling_rate: int,
        hop: int,
        harmonics: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
        noise_samples: int,
    ):
        super().__init__()
        self.sampling_rate, self.hop, self.harmonics = sampling_rate, hop, harmonics
        self.sine_amp, self.noise_std, self.voiced_threshold = sine_amp, noise_std, voiced_threshold
        self.l_sin_gen = SineNoise(harmonics + 1, noise_samples)
        self.l_linear = nn.Linear(harmonics + 1, 1)

    def check_noise(self, first: int, frames: int) -> None:
        """A window from absolute frame `first` of `frames` frames reads fixed noise that exists."""
        if (first + frames) * self.hop > self.l_sin_gen.sine_waves.shape[1]:
            raise ValueError(f"HiFT input up to frame {first + frames} needs more noise samples than the "
                             f"fixed noise holds ({self.l_sin_gen.sine_waves.shape[1]})")

    def forward(self, f0: Tensor, rows: SourceRows | None = None) -> tuple[Tensor, Tensor | None]:
        """f0 [B, T] Hz (float32 or float64) -> (excitation [B, T * hop], same dtype; each row's recorded
        phase or None). With `rows`, each row continues its stream (see SourceWindow), read from device
        tensors only (`check_noise` and `SourceWindow.check` are the host's checks)."""
        batch, frames = f0.shape
        samples = frames * self.hop
        noise = self.l_sin_gen.sine_waves
        # The official code multiplies by a float32 tensor of harmonic numbers (float64 F0 stays float64).
        harm = torch.arange(1, self.harmonics + 2, dtype=torch.float32, device=f0.device)
        # Per-frame phase increment of each harmonic in cycles per sample, wrapped to [0, 1).
        step = (f0.unsqueeze(-1) * harm / self.sampling_rate) % 1  # [B, T, H]
        recorded = None
        if rows is not None:
            # The carried sum takes the place of the frames before carried_at, so the running sum
            # from there adds the same terms in the same order as over the whole stream.
            pos = torch.arange(frames, device=f0.device)
            local = (rows.carried_at - rows.first)[:, None]
            step = step.masked_fill((pos < local)[..., None], 0)
            carried = rows.carried.to(device=f0.device, dtype=step.dtype)
            step = torch.where(((pos == local - 1) & (local > 0))[..., None], carried[:, None], step)
        cycles = torch.cumsum(step, dim=1)
        if rows is not None:
            # Each row's sum over the frames before record_at: a running sum inside the window, or
            # (record_at at or before the window's start) the carried sum itself.
            pick = rows.record_at - rows.first - 1
            inside = cycles[torch.arange(batch, device=f0.device), pick.clamp(0, frames - 1)]
            recorded = torch.where((pick >= 0)[:, None], inside, rows.carried.to(device=f0.device, dtype=cycles.dtype))
        # Phase at frame rate, in radians; then scaled by hop and held (nearest) over each frame.
        phase = cycles * 2 * math.pi
        phase = F.interpolate(phase.transpose(1, 2) * self.hop, scale_factor=float(self.hop), mode="nearest")
        sines = torch.sin(phase.transpose(1, 2)) * self.sine_amp  # [B, L, H]

        f0_up = F.interpolate(f0[:, None], scale_factor=float(self.hop), mode="nearest").transpose(1, 2)  # [B, L, 1]
        voiced = (f0_up > self.voiced_threshold).type(torch.float32)
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        if rows is not None:
            noise = noise[0][rows.first[:, None] * self.hop + torch.arange(samples, device=f0.device)]  # [B, L, H]
        else:
            noise = noise[:, :samples]
        excitation = sines * voiced + noise_amp * noise
        del sines, phase
        weight = self.l_linear.weight.to(excitation.dtype)
        bias = self.l_linear.bias.to(excitation.dtype)
        merged = torch.tanh(F.linear(excitation, weight, bias))  # [B, L, 1]
        return merged.squeeze(-1).view(batch, samples), recorded
