"""HiFT's configuration and the checkpoint keys of its fixed noise (shared by `hift` and `noise`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from intone.models.cosyvoice3.hift_source import F0_CAUSAL_CONVS, F0_CAUSAL_KERNEL, OFFICIAL_NOISE_SAMPLES

RAND_INI_KEY = "m_source.l_sin_gen.rand_ini"
SINE_NOISE_KEY = "m_source.l_sin_gen.sine_waves"


@dataclass(frozen=True)
class HiFTConfig:
    """Defaults are the `hift:` block of the official cosyvoice3.yaml."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4
    f0_cond_channels: int = 512  # f0_predictor.cond_channels (its in_channels is in_channels)
    f0_look_right: int = 3  # the F0 predictor's first conv has kernel f0_look_right + 1
    noise_samples: int = OFFICIAL_NOISE_SAMPLES  # length of the fixed noise: the longest input, in samples

    @property
    def hop(self) -> int:
        """Samples per mel frame (480)."""
        return math.prod(self.upsample_rates) * self.hop_len

    @property
    def held_back_frames(self) -> int:
        """Frames a non-final call does not turn into audio (8)."""
        return self.f0_look_right + self.conv_pre_look_right + 1

    @property
    def f0_history_frames(self) -> int:
        """Mel frames before a frame that its F0 depends on (the predictor's causal convs)."""
        return F0_CAUSAL_CONVS * (F0_CAUSAL_KERNEL - 1)

    @property
    def stream_context_frames(self) -> int:
        """Mel frames before the first sample wanted that a windowed call must see (its left receptive
        field, rounded up, + 1): the F0 predictor's four causal convs, then the source's STFT, its
        downsampling and resblocks and every later stage's upsampling and resblocks, at their rates."""
        stage_rates = [math.prod(self.upsample_rates[: i + 1]) for i in range(len(self.upsample_rates))]
        spec_rate = self.hop // self.hop_len  # source STFT frames per mel frame

        def resblock(kernels, dilations) -> int:
            return max(sum((k - 1) * d + (k - 1) for d in ds) for k, ds in zip(kernels, dilations))

        later = [(k - 1 + resblock(self.resblock_kernel_sizes, self.resblock_dilation_sizes)) / rate
                 for k, rate in zip(self.upsample_kernel_sizes, stage_rates)]
        source = max(
            (2 * math.prod(self.upsample_rates[i + 1 :]) + resblock([k], [d]) * spec_rate / stage_rates[i]) / spec_rate
            + sum(later[i:])
            for i, (k, d) in enumerate(zip(self.source_resblock_kernel_sizes, self.source_resblock_dilation_sizes)))
        tail = (7 + self.n_fft) / spec_rate  # conv_post and the STFTs, in mel frames
        return self.f0_history_frames + math.ceil(source + tail) + 1

    @property
    def max_frames(self) -> int:
        return self.noise_samples // self.hop

    def output_samples(self, frames: int, finalize: bool) -> int:
        return frames * self.hop if finalize else max(frames - self.held_back_frames, 0) * self.hop
