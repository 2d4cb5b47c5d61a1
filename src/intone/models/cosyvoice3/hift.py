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
from intone.models.cosyvoice3.flow import graph_rows
from intone.models.cosyvoice3.hift_source import (
    CausalF0Predictor,
    HarmonicSource,
    PaddedConv1d,
    SourceRows,
    SourceWindow,
)
from intone.models.cosyvoice3.noise import FlowSizes, official_noise
from intone.ops.snake import snake

HIFT_FRAME_BUCKET = 32  # mel frames: a graphed HiFT batch's length is padded to a multiple of this


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
        return torch.stack(self.vocode_batch(list(mel), [finalize] * batch))

    @torch.inference_mode()
    def vocode_batch(self, mels: list[Tensor], finalize: list[bool], window: SourceWindow | None = None,
                     graphs=None) -> list[Tensor]:
        """Rows [in_channels, T_i] (or [1, in_channels, T_i]) of any lengths, each with its own
        `finalize`, vocoded as one right-padded batch. Row i's audio [S_i] equals
        `inference(row_i[None], finalize[i])[0]` up to float rounding.

        Zero right-padding is exactly the official final-call look-ahead padding, and the rest of
        the network is left-causal, so each row is computed as a final call on the padded batch;
        the per-row parts with edge effects (excitation length, the source STFT's reflect padding,
        the iSTFT) are taken at each row's own official length (`_vocode`), and a non-final row keeps
        the official non-final frames and drops its last 480 samples.

        `window`: rows that are windows of longer streams (see SourceWindow; its `recorded` is set,
        the carried phase unchanged for a row that gives no samples): a row's samples from
        `cfg.stream_context_frames` frames into its window on equal those of the whole stream's call.
        `graphs`: an engine's FunctionGraphs holding `capture` shapes: the batch is padded to its graph
        shape (`graph_shape`) and replayed when one was captured.
        """
        if len(mels) != len(finalize):
            raise ValueError("mels and finalize differ in length")
        rows = [m[0] if m.dim() == 3 else m for m in mels]
        lengths = [r.shape[-1] for r in rows]
        harmonics = self.cfg.nb_harmonics + 1
        out: list[Tensor | None] = [None] * len(rows)
        live = []
        for i, (t, fin) in enumerate(zip(lengths, finalize)):
            if not self.cfg.output_samples(t, fin):
                out[i] = rows[i].new_zeros(0, dtype=self._excitation_dtype())
            else:
                live.append(i)
        recorded = None
        if live:
            sub = window.rows(live) if window is not None else None
            if sub is not None:
                sub.check([lengths[i] - (0 if finalize[i] else self.cfg.f0_look_right) for i in live])
            # first frame, carried_at and record_at of each row's window (zeros: rows that start their streams)
            spans = (sub.first, sub.carried_at, sub.record_at) if sub is not None else ([0] * len(live),) * 3
            carried = sub.carried if sub is not None else torch.zeros(len(live), harmonics, dtype=torch.float64)
            t_max = max(lengths[i] for i in live)
            self.m_source.check_noise(max(spans[0]), t_max)
            if t_max > self.cfg.max_frames:
                raise ValueError(f"{t_max} mel frames exceed the fixed noise ({self.cfg.max_frames} frames)")
            n, t = graph_shape(len(live), t_max) if graphs is not None else (len(live), t_max)

            def padded(values: list) -> list:  # added rows repeat the first (their output is dropped)
                return values + values[:1] * (n - len(live))
            mel = torch.stack([F.pad(rows[i], (0, t - lengths[i])) for i in padded(live)])
            ints = torch.tensor([padded(v) for v in ([lengths[i] for i in live], [int(finalize[i]) for i in live],
                                                     *spans)]).to(mel.device)
            carried = torch.cat([carried, carried[:1].expand(n - len(live), -1)]).to(mel.device, self._excitation_dtype())
            inputs = (mel, ints, carried)
            if graphs is not None:
                audio, recorded = graphs.run("hift", self._vocode, *inputs)
            else:
                audio, recorded = self._vocode(*inputs)
            for j, i in enumerate(live):
                out[i] = audio[j, : self.cfg.output_samples(lengths[i], finalize[i])]
        if window is not None:  # a row that consumed no frames carries its phase on unchanged
            window.recorded = window.carried.to(self._excitation_dtype(), copy=True)
            if live:
                window.recorded[live] = recorded[: len(live)].to(window.recorded)
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def capture(self, rows: int, frames: int, graphs) -> None:
        """Capture `_vocode` in `graphs` at this (rows, frames) graph shape (start-up only)."""
        device = self.conv_pre.weight.device
        mel = torch.zeros(rows, self.cfg.in_channels, frames, device=device)
        ints = torch.tensor([[frames] * rows, [1] * rows, [0] * rows, [0] * rows, [0] * rows], device=device)
        carried = torch.zeros(rows, self.cfg.nb_harmonics + 1, device=device, dtype=self._excitation_dtype())
        graphs.capture("hift", self._vocode, mel, ints, carried)

    def _vocode(self, mel: Tensor, ints: Tensor, carried: Tensor) -> tuple[Tensor, Tensor]:
        """The batch on device tensors only (fixed shapes: a CUDA graph per (B, T)): mel [B, C, T]
        right-padded; ints [5, B] int64: each row's real frames, finalize (0/1), and its window's
        first frame, carried_at and record_at (SourceWindow; zeros: a row that starts its stream);
        carried [B, harmonics + 1]. Every row is a final call on the padded batch (zero look-ahead
        padding); each row's edge parts are taken at its own official length by masks and gathers.
        -> audio [B, T * hop] (row b valid up to its official length, zeros after), recorded phases."""
        cfg = self.cfg
        lengths, finals, first, carried_at, record_at = ints
        finals = finals.bool()
        compute = self._excitation_dtype()
        per_mel = cfg.hop // cfg.hop_len  # source STFT frames per mel frame (120)
        window = _hann(cfg.n_fft, torch.device(mel.device))

        # F0 at frame rate, float64, cast like the official (to the mel dtype; float32 at least here).
        f0 = self.f0_predictor(mel, pad=True).to(compute)
        # Per row: excitation frames (a non-final row's F0 stops 3 frames early) and conv frames.
        src_frames = torch.where(finals, lengths, lengths - cfg.f0_look_right)
        conv_frames = torch.where(finals, lengths, lengths - cfg.f0_look_right - cfg.conv_pre_look_right)
        source, recorded = self.m_source(f0, SourceRows(first, carried_at, carried, record_at))
        spec = _source_spectrum(source, src_frames * cfg.hop, conv_frames * per_mel + 1, cfg.n_fft, cfg.hop_len,
                                window).to(self.dtype)
        del source

        x = self.conv_pre(mel.to(self.dtype), pad=True)
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
        wave = _inverse_stft(spectrum, conv_frames * per_mel + 1, cfg.n_fft, cfg.hop_len, window)
        # A final row keeps all n * hop samples of its iSTFT; a non-final one drops the last hop.
        valid = conv_frames * cfg.hop - torch.where(finals, 0, cfg.hop)
        inside = torch.arange(wave.shape[1], device=wave.device) < valid[:, None]
        return torch.where(inside, torch.clamp(wave, -cfg.audio_limit, cfg.audio_limit), 0), recorded


def graph_shape(rows: int, frames: int) -> tuple[int, int]:
    """The (rows, frames) of the graph a HiFT batch replays: rows as the flow's (`graph_rows`), frames
    up to a multiple of HIFT_FRAME_BUCKET."""
    return graph_rows(rows), -(-frames // HIFT_FRAME_BUCKET) * HIFT_FRAME_BUCKET


def _source_spectrum(source: Tensor, samples: Tensor, keep: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """Each row's `torch.stft(source[b, :samples[b]], center=True)` (reflect padding at its own end) as
    [B, n_fft + 2, width / hop + 1] (real parts, then imaginary), zero from frame keep[b] on."""
    batch, width = source.shape
    pad = n_fft // 2
    pos = torch.arange(width + 2 * pad, device=source.device)[None] - pad
    last = samples[:, None] - 1
    index = torch.where(pos > last, 2 * last - pos, pos.abs()).clamp(0, width - 1)  # reflect at both ends
    stft = torch.stft(source.gather(1, index), n_fft, hop, n_fft, window=window, center=False, return_complex=True)
    stft = torch.view_as_real(stft)
    spec = torch.cat([stft[..., 0], stft[..., 1]], dim=1)
    frames = torch.arange(spec.shape[-1], device=source.device)
    return spec.masked_fill(frames >= keep[:, None, None], 0)


def _inverse_stft(spectrum: Tensor, frames: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """Each row's `torch.istft(spectrum[b, :, :frames[b]], center=True)` (the same steps: inverse FFT,
    window, overlap-add, divided by its own frames' window envelope), as [B, hop * (F - 1)]; row b
    valid up to hop * (frames[b] - 1). No host read (torch.istft checks the envelope with one)."""
    batch, _, total = spectrum.shape
    live = (torch.arange(total, device=spectrum.device) < frames[:, None])[..., None]  # [B, F, 1]
    frames_td = torch.fft.irfft(spectrum.transpose(1, 2), n_fft, dim=-1) * window  # [B, F, n_fft]
    length = n_fft + hop * (total - 1)
    wave = torch.ops.aten.unfold_backward(frames_td * live, [batch, length], 1, n_fft, hop)
    envelope = torch.ops.aten.unfold_backward(window.pow(2) * live, [batch, length], 1, n_fft, hop)
    pad = n_fft // 2
    wave, envelope = wave[:, pad: length - pad], envelope[:, pad: length - pad]
    return torch.where(envelope > 0, wave / envelope, 0)


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
