"""The causal HiFT vocoder of CosyVoice3 (`hift.pt`): mel [B, 80, T] at 50 Hz -> 24 kHz audio.

HiFT is a neural source-filter + iSTFT generator. A causal F0 predictor (float64, looks 3 frames
ahead) drives a harmonic excitation; its STFT is injected at every upsampling stage of a causal
conv stack (conv_pre looks 4 frames ahead); the stack predicts log-magnitude and phase of a
16-point iSTFT with hop 4. One mel frame is 480 samples.

Streaming: a non-final call (`finalize=False`) holds back 3 + 4 + 1 = 8 frames (F0 look-ahead,
conv_pre look-ahead and one frame of iSTFT tail), so T frames give (T - 8) * 480 samples, and
every sample it returns equals the same sample of any longer call. A final call returns T * 480.

Parameter names are the official generator's after weight-norm folding (see
`fold_hift_weight_norm`). The fixed SineGen2 noise buffers are not checkpoint keys: they are
official random draws at construction, replayed by `intone.models.cosyvoice3.noise`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intone.models.cosyvoice3.hift_config import RAND_INI_KEY, SINE_NOISE_KEY, HiFTConfig
from intone.models.cosyvoice3.hift_source import CausalF0Predictor, HarmonicSource, PaddedConv1d, SourceWindow
from intone.models.cosyvoice3.noise import FlowSizes, official_noise
from intone.ops.snake import snake


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, alpha per channel on a linear scale."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        return snake(x, self.alpha[None, :, None])


class ResBlock(nn.Module):
    """Three residual units: Snake, left-causal dilated conv, Snake, left-causal conv."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            PaddedConv1d(channels, channels, kernel, left=(kernel - 1) * d, dilation=d) for d in dilations
        )
        self.convs2 = nn.ModuleList(PaddedConv1d(channels, channels, kernel, left=kernel - 1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


@functools.lru_cache(maxsize=16)
def _hann(n_fft: int, device: torch.device) -> Tensor:
    # Periodic Hann computed in float64 and rounded to float32: the official scipy window bit for bit
    # (torch.hann_window in float32 differs in the last bit). Cached: one host-to-device copy per device.
    with torch.inference_mode(False), torch.no_grad():
        return torch.hann_window(n_fft, periodic=True, dtype=torch.float64).to(device=device, dtype=torch.float32)


class CausalHiFT(nn.Module):
    """Official `CausalHiFTGenerator` with `CausalConvRNNF0Predictor` (inference only).

    Parameters live in the module dtype (float32, float16, bfloat16 or float64), except the F0
    predictor, which is always float64, and the noise buffers, always float32. The excitation,
    its STFT and the final iSTFT run in float32 (float64 when the module is float64), as the
    official float32 type promotion does.

    `noise`: the fixed SineGen2 buffers, keyed by their official attribute paths (see
    `noise.official_noise`); taken by reference, not copied. None: replay the official draws for
    this config with the real flow sizes.
    """

    def __init__(self, cfg: HiFTConfig = HiFTConfig(), noise: Mapping[str, Tensor] | None = None):
        super().__init__()
        n_stages = len(cfg.upsample_rates)
        if not (len(cfg.upsample_kernel_sizes) == len(cfg.source_resblock_kernel_sizes) == n_stages):
            raise ValueError("upsample_rates, upsample_kernel_sizes and source_resblock_kernel_sizes differ in length")
        self.cfg = cfg
        spec_channels = cfg.n_fft + 2
        base = cfg.base_channels

        self.m_source = HarmonicSource(
            sampling_rate=cfg.sampling_rate,
            hop=cfg.hop,
            harmonics=cfg.nb_harmonics,
            sine_amp=cfg.nsf_alpha,
            noise_std=cfg.nsf_sigma,
            voiced_threshold=cfg.nsf_voiced_threshold,
            noise_samples=cfg.noise_samples,
        )
        look = cfg.conv_pre_look_right
        self.conv_pre = PaddedConv1d(cfg.in_channels, base, look + 1, right=look)
        self.ups = nn.ModuleList(
            PaddedConv1d(base >> i, base >> (i + 1), k, left=k - 1, upsample=u)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes))
        )
        # The source STFT (hop_len samples per frame) is brought to each stage's rate: strides are the
        # cumulative upsampling still to come, e.g. 15, 3, 1.
        strides = [math.prod(cfg.upsample_rates[i + 1 :]) for i in range(n_stages)]
        self.source_downs = nn.ModuleList(
            PaddedConv1d(spec_channels, base >> (i + 1), 1)
            if s == 1
            else PaddedConv1d(spec_channels, base >> (i + 1), 2 * s, stride=s, left=s - 1)
            for i, s in enumerate(strides)
        )
        self.source_resblocks = nn.ModuleList(
            ResBlock(base >> (i + 1), k, tuple(d))
            for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes))
        )
        self.resblocks = nn.ModuleList(
            ResBlock(base >> (i + 1), k, tuple(d))
            for i in range(n_stages)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
        self.conv_post = PaddedConv1d(base >> n_stages, spec_channels, 7, left=6)
        self.f0_predictor = CausalF0Predictor(cfg.in_channels, cfg.f0_cond_channels, cfg.f0_look_right)

        if noise is None:
            noise = official_noise(FlowSizes(), cfg, include_uv=False)
        self.set_noise(noise)

    # ---------------------------------------------------------------- noise

    def set_noise(self, noise: Mapping[str, Tensor]) -> None:
        """Install the fixed noise. Keys may carry a prefix (e.g. `hift.`); other keys are ignored.
        A longer `sine_waves` is cut to cfg.noise_samples (copied then, so the long one can be freed)."""
        found = {}
        for key, value in noise.items():
            for name in (RAND_INI_KEY, SINE_NOISE_KEY):
                if key == name or key.endswith("." + name):
                    found[name] = value
        if set(found) != {RAND_INI_KEY, SINE_NOISE_KEY}:
            raise KeyError(f"noise needs {RAND_INI_KEY} and {SINE_NOISE_KEY}; got {sorted(noise)}")
        channels, samples = self.cfg.nb_harmonics + 1, self.cfg.noise_samples
        rand_ini, sine = found[RAND_INI_KEY], found[SINE_NOISE_KEY]
        if tuple(rand_ini.shape) != (1, channels) or sine.dim() != 3 or (sine.shape[0], sine.shape[2]) != (1, channels):
            raise ValueError(
                f"noise shapes {tuple(rand_ini.shape)}, {tuple(sine.shape)} do not fit {channels} channels"
            )
        if sine.shape[1] < samples:
            raise ValueError(f"sine noise holds {sine.shape[1]} samples, config needs {samples}")
        if sine.shape[1] > samples:
            sine = sine[:, :samples].clone()
        holder = self.m_source.l_sin_gen
        device = holder.sine_waves.device
        holder.rand_ini = rand_ini.to(device=device, dtype=torch.float32)
        holder.sine_waves = sine.to(device=device, dtype=torch.float32)

    # ---------------------------------------------------------------- inference

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_pre.weight.dtype

    def _excitation_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @torch.inference_mode()
    def inference(self, mel: Tensor, finalize: bool) -> Tensor:
        """mel [B, in_channels, T] -> audio [B, T*480] (finalize) or [B, (T-8)*480] (not finalize).

        Same computation as the official `inference` (which also returns the excitation; this
        returns the audio only). Non-final calls with T <= 8 give no samples (the official code
        fails for T < 8).
        """
        batch, _, frames = mel.shape
        if not finalize and frames <= self.cfg.held_back_frames:
            return mel.new_zeros(batch, 0, dtype=self._excitation_dtype())
        if finalize and frames == 0:
            return mel.new_zeros(batch, 0, dtype=self._excitation_dtype())
        return self._run(mel, [frames] * batch, [finalize] * batch, pad=finalize)

    @torch.inference_mode()
    def vocode_batch(self, mels: list[Tensor], finalize: list[bool], window: SourceWindow | None = None) -> list[Tensor]:
        """Rows [in_channels, T_i] (or [1, in_channels, T_i]) of any lengths, each with its own
        `finalize`, vocoded as one right-padded batch. Row i's audio [S_i] equals
        `inference(row_i[None], finalize[i])[0]` up to float rounding.

        Zero right-padding is exactly the official final-call look-ahead padding, and the rest of
        the network is left-causal, so each row is computed as a final call on the padded batch;
        the per-row parts with edge effects (excitation length, the source STFT's reflect padding,
        the iSTFT) are taken at each row's own official length, and a non-final row keeps the
        official non-final frames and drops its last 480 samples.

        `window`: rows that are windows of longer streams (see SourceWindow; its `recorded` is set,
        the carried phase unchanged for a row that gives no samples): a row's samples from
        `cfg.stream_context_frames` frames into its window on equal those of the whole stream's call.
        """
        if len(mels) != len(finalize):
            raise ValueError("mels and finalize differ in length")
        rows = [m[0] if m.dim() == 3 else m for m in mels]
        lengths = [r.shape[-1] for r in rows]
        out: list[Tensor | None] = [None] * len(rows)
        live = []
        for i, (t, fin) in enumerate(zip(lengths, finalize)):
            if t == 0 or (not fin and t <= self.cfg.held_back_frames):
                out[i] = rows[i].new_zeros(0, dtype=self._excitation_dtype())
            else:
                live.append(i)
        sub = window.rows(live) if window is not None else None
        if live:
            if len({(lengths[i], finalize[i]) for i in live}) == 1:
                fin, t = finalize[live[0]], lengths[live[0]]
                audio = self._run(torch.stack([rows[i] for i in live]), [t] * len(live), [fin] * len(live), fin, sub)
            else:
                t_max = max(lengths[i] for i in live)
                mel = torch.stack([F.pad(rows[i], (0, t_max - lengths[i])) for i in live])
                audio = self._run(mel, [lengths[i] for i in live], [finalize[i] for i in live], True, sub)
            for j, i in enumerate(live):
                out[i] = audio[j, : self.cfg.output_samples(lengths[i], finalize[i])]
        if window is not None:  # a row that consumed no frames carries its phase on unchanged
            window.recorded = window.carried.to(self._excitation_dtype(), copy=True)
            for j, i in enumerate(live):
                window.recorded[i] = sub.recorded[j]
        return out  # type: ignore[return-value]

    def _run(self, mel: Tensor, lengths: list[int], finals: list[bool], pad: bool,
             stream: SourceWindow | None = None) -> Tensor:
        """Vocode a batch whose row b has `lengths[b]` real frames. `pad`: zero look-ahead padding
        (official final call; rows may differ); without it every row is a non-final call of the
        batch's full length. Returns [B, max samples]; row b is valid up to its official length."""
        cfg, hop = self.cfg, self.cfg.hop
        batch, _, total = mel.shape
        if total > cfg.max_frames:
            raise ValueError(f"{total} mel frames exceed the fixed noise ({cfg.max_frames} frames)")
        compute = self._excitation_dtype()
        stft_hop = cfg.hop_len
        frames_per_mel = hop // stft_hop  # STFT frames per mel frame (120)
        window = _hann(cfg.n_fft, torch.device(mel.device))

        # F0 at frame rate, float64, cast like the official (to the mel dtype; float32 at least here).
        f0 = self.f0_predictor(mel, pad=pad).to(compute)
        # Per row: excitation frames (a non-final row's F0 stops 3 frames early) and conv frames.
        src_frames = [t if fin else t - cfg.f0_look_right for t, fin in zip(lengths, finals)]
        conv_frames = [t if fin else t - cfg.f0_look_right - cfg.conv_pre_look_right for t, fin in zip(lengths, finals)]
        n_conv = total if pad else total - cfg.f0_look_right - cfg.conv_pre_look_right

        # Source STFT per group of equal rows: [B, n_fft + 2, n_conv*120 + 1], zeros past a row's frames.
        spec = mel.new_zeros(batch, cfg.n_fft + 2, n_conv * frames_per_mel + 1, dtype=compute)
        if stream is not None:
            stream.recorded = torch.zeros(batch, stream.carried.shape[1], dtype=compute, device=mel.device)
        for (n_src, n_keep), idx in _groups(zip(src_frames, conv_frames)).items():
            rows = stream.rows(idx) if stream is not None else None
            source = self.m_source(f0[idx, :n_src], rows)
            if rows is not None:
                stream.recorded[idx] = rows.recorded
            stft = torch.stft(source, cfg.n_fft, stft_hop, cfg.n_fft, window=window, return_complex=True)
            stft = torch.view_as_real(stft)
            keep = n_keep * frames_per_mel + 1
            spec[idx, :, :keep] = torch.cat([stft[..., 0], stft[..., 1]], dim=1)[:, :, :keep]
            del source, stft
        spec = spec.to(self.dtype)

        x = mel.to(self.dtype)
        if not pad:
            x = x[:, :, : total - cfg.f0_look_right]
        x = self.conv_pre(x, pad=pad)
        n_stages, n_kernels = len(self.ups), len(cfg.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == n_stages - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](spec))
            acc = self.resblocks[i * n_kernels](x)
            for j in range(1, n_kernels):
                acc = acc + self.resblocks[i * n_kernels + j](x)
            x = acc / n_kernels
        x = self.conv_post(F.leaky_relu(x)).to(compute)

        half = cfg.n_fft // 2 + 1
        magnitude = torch.clip(torch.exp(x[:, :half]), max=1e2)
        phase = torch.sin(x[:, half:])
        spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        del x, magnitude, phase

        # A final row keeps all n * hop samples of its iSTFT; a non-final one drops the last hop.
        width = max(n * hop - (0 if fin else hop) for n, fin in zip(conv_frames, finals))
        audio = mel.new_zeros(batch, width, dtype=compute)
        for (n_keep, fin), idx in _groups(zip(conv_frames, finals)).items():
            frames = n_keep * frames_per_mel + 1
            wave = torch.istft(spectrum[idx, :, :frames], cfg.n_fft, stft_hop, cfg.n_fft, window=window)
            if not fin:
                wave = wave[:, :-hop]
            audio[idx, : wave.shape[1]] = torch.clamp(wave, -cfg.audio_limit, cfg.audio_limit)
        return audio


def _groups(keys) -> dict[tuple, list[int] | slice]:
    """Row selectors grouped by key, in first-seen order; a run of consecutive rows is a slice
    (a view, and no index tensor to copy to the device)."""
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(tuple(key), []).append(i)
    return {k: slice(v[0], v[-1] + 1) if v[-1] - v[0] + 1 == len(v) else v for k, v in groups.items()}


# ---------------------------------------------------------------- checkpoint

_WN_FORMS = ((".parametrizations.weight.original0", ".parametrizations.weight.original1"), (".weight_g", ".weight_v"))


def fold_hift_weight_norm(state: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """An official `hift.pt` state dict -> CausalHiFT's.

    Removes `generator.` wherever it occurs in a key (as the official loader does) and folds
    weight norm, `g * v / ||v||` with the norm over all dims but 0, by torch's own
    `torch._weight_norm` (what both weight-norm APIs compute), so the weights are bit-exact with
    the official module's on the tensors' device. Accepts `<conv>.parametrizations.weight.original0/1`
    and legacy `<conv>.weight_g/_v`. The official module computes weight norm in its own dtype at
    every call, so g and v are folded in `dtype` (None: their own; float64 for a float64 model, where
    folding in float32 moves the audio by ~1e-5); F0 predictor weights always in float64 (the
    official code casts g and v to float64 before computing them). Plain keys pass through.
    """
    state = {k.replace("generator.", ""): v for k, v in state.items()}
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for key in state:
        for g_suffix, v_suffix in _WN_FORMS:
            if key.endswith(g_suffix):
                prefix = key[: -len(g_suffix)]
                v_key = prefix + v_suffix
                if v_key not in state:
                    raise KeyError(f"{key} has no matching {v_key}")
                g, v = state[key], state[v_key]
                fold = torch.float64 if prefix.startswith("f0_predictor.") else dtype
                if fold is not None:
                    g, v = g.to(fold), v.to(fold)
                out[prefix + ".weight"] = torch._weight_norm(v, g, 0)
                used.update((key, v_key))
    for key, value in state.items():
        if key not in used:
            if key.endswith((_WN_FORMS[0][1], _WN_FORMS[1][1])):
                raise KeyError(f"{key} has no matching weight-norm magnitude")
            out[key] = value
    return out
