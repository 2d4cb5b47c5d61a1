"""Feature math of the CosyVoice3 reference-audio frontend (pure torch, no model files).

Three spectral features are taken from a reference recording, each equal to what the official
frontend computes with a third-party library:

- `whisper_log_mel`: the input of the speech tokenizer. openai-whisper's
  `log_mel_spectrogram(audio, n_mels=128)`: 16 kHz, n_fft 400, hop 160, 100 frames/s.
- `kaldi_fbank`: the input of the CAM++ speaker encoder. torchaudio's
  `compliance.kaldi.fbank(wav, num_mel_bins=80, dither=0, sample_frequency=16000)` with every
  other option at its default, on samples in [-1, 1] (the official loader does not rescale to int16).
- `prompt_mel`: the flow's prompt condition. Matcha-TTS's `mel_spectrogram` with the
  `feat_extractor` settings of cosyvoice3.yaml: 24 kHz, n_fft = win = 1920, hop 480, 80 bins,
  fmin 0, fmax None, center False; 50 frames/s.

`official_resample` reproduces `torchaudio.transforms.Resample(orig, new)` (the official loader's
resampler) bit for bit; see its docstring for how it differs from `intone.ops.resample.resample`.

Every function runs on the device of its input. Filter banks, windows and resampling kernels are
built once on the CPU (so their values never depend on the device) and cached per device.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from intone.ops.resample import bank_fits, resample_direct

# speech tokenizer features (whisper front end)
WHISPER_N_FFT = 400
WHISPER_HOP = 160
WHISPER_N_MELS = 128
# speaker features (kaldi fbank defaults at 16 kHz)
FBANK_FRAME = 400  # 25 ms
FBANK_SHIFT = 160  # 10 ms
FBANK_FFT = 512  # frame length rounded up to a power of two
FBANK_N_MELS = 80
FBANK_LOW_HZ = 20.0
FBANK_PREEMPH = 0.97
FBANK_POVEY_POWER = 0.85
# prompt mel (matcha front end at 24 kHz)
PROMPT_SR = 24000
PROMPT_N_FFT = 1920
PROMPT_HOP = 480
PROMPT_N_MELS = 80
PROMPT_PAD = (PROMPT_N_FFT - PROMPT_HOP) // 2  # 720 samples of reflection on each side


# ---------------------------------------------------------------------------------------------
# mel filter banks


_SLANEY_HZ_PER_MEL = 200.0 / 3.0  # linear part of the scale
_SLANEY_KNEE_MEL = 1000.0 / _SLANEY_HZ_PER_MEL  # the scale turns logarithmic at 1 kHz
_SLANEY_LOG_STEP = math.log(6.4) / 27.0  # 27 mels per factor 6.4 of frequency above the knee


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    above = _SLANEY_KNEE_MEL + np.log(np.maximum(hz, 1e-300) / 1000.0) / _SLANEY_LOG_STEP
    return np.where(hz >= 1000.0, above, hz / _SLANEY_HZ_PER_MEL)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    above = 1000.0 * np.exp(_SLANEY_LOG_STEP * (mel - _SLANEY_KNEE_MEL))
    return np.where(mel >= _SLANEY_KNEE_MEL, above, _SLANEY_HZ_PER_MEL * mel)


@lru_cache(maxsize=8)
def _slaney_filters_np(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    # The float64 arithmetic and the two float32 roundings (the triangles, then the scaled
    # triangles) follow librosa's order of operations, so the float32 bank equals librosa's.
    bin_hz = np.arange(n_fft // 2 + 1) * (1.0 / (n_fft * (1.0 / sample_rate)))
    edges = _slaney_mel_to_hz(np.linspace(_hz_to_slaney_mel(fmin), _hz_to_slaney_mel(fmax), n_mels + 2))
    widths = np.diff(edges)
    dist = edges[:, None] - bin_hz[None, :]  # [n_mels + 2, n_bins]
    rising = -dist[:-2] / widths[:-1, None]
    falling = dist[2:] / widths[1:, None]
    tri = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    area = 2.0 / (edges[2:] - edges[:-2])  # each triangle gets the same area ("slaney" norm)
    return (tri * area[:, None]).astype(np.float32)


def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                       fmax: float | None = None) -> Tensor:
    """[n_mels, n_fft // 2 + 1] float32 triangular filters on the Slaney mel scale, area-normalised.

    The bank `librosa.filters.mel(sr=..., n_fft=..., n_mels=..., fmin=..., fmax=...)` gives with its
    defaults (htk=False, norm="slaney"); whisper's `mel_filters.npz` and Matcha's basis are that.
    """
    top = sample_rate / 2.0 if fmax is None else float(fmax)
    return torch.from_numpy(_slaney_filters_np(int(sample_rate), int(n_fft), int(n_mels), float(fmin), top).copy())


@lru_cache(maxsize=16)
def _slaney_on(device: torch.device, sample_rate: int, n_fft: int, n_mels: int) -> Tensor:
    return slaney_mel_filters(sample_rate, n_fft, n_mels).to(device)


@lru_cache(maxsize=8)
def _kaldi_banks(n_mels: int, n_fft: int, sample_rate: float, low_hz: float, high_hz: float,
                 device: torch.device = torch.device("cpu")) -> Tensor:
    """[n_mels, n_fft // 2 + 1]: triangles of peak 1 on Kaldi's mel scale, 1127 ln(1 + f / 700).

    As in Kaldi and torchaudio, FFT bins 0 .. n_fft/2 - 1 are weighted and the Nyquist bin gets 0.
    The band edges and the bin positions are float32 values, as torchaudio makes them, so the
    weights agree with its to the last bit.
    """
    lo = 1127.0 * math.log(1.0 + low_hz / 700.0)
    hi = 1127.0 * math.log(1.0 + high_hz / 700.0)
    step = (hi - lo) / (n_mels + 1)
    k = torch.arange(n_mels)[:, None]
    left, centre, right = lo + k * step, lo + (k + 1.0) * step, lo + (k + 2.0) * step
    bin_mel = 1127.0 * (1.0 + (sample_rate / n_fft) * torch.arange(float(n_fft // 2)) / 700.0).log()
    rising = (bin_mel[None] - left) / (centre - left)
    falling = (right - bin_mel[None]) / (right - centre)
    banks = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return F.pad(banks, (0, 1)).to(device)


# ---------------------------------------------------------------------------------------------
# features


def _mono(audio: Tensor, name: str) -> Tensor:
    if audio.dim() != 1:
        raise ValueError(f"{name} expects mono audio of shape [N], got {tuple(audio.shape)}")
    return audio.to(torch.float32)


@lru_cache(maxsize=16)
def _hann(n: int, periodic: bool, device: torch.device = torch.device("cpu"), power: float = 1.0) -> Tensor:
    window = torch.hann_window(n, periodic=periodic, dtype=torch.float32)
    return (window if power == 1.0 else window.pow(power)).to(device)


def whisper_log_mel(audio16k: Tensor) -> Tensor:
    """16 kHz mono [N] -> [128, N // 160] log-mel, scaled as whisper scales it.

    Centred STFT (reflection of 200 samples each side; needs N > 200), periodic Hann 400,
    hop 160, the last frame dropped; power spectrum; Slaney mel filters; log10 floored at 1e-10;
    values more than 8 below the utterance maximum raised to it; then (x + 4) / 4.
    """
    x = _mono(audio16k, "whisper_log_mel")
    spec = torch.stft(x, WHISPER_N_FFT, WHISPER_HOP, window=_hann(WHISPER_N_FFT, True, x.device), center=True,
                      pad_mode="reflect", return_complex=True)
    power = spec[..., :-1].abs() ** 2
    mel = _slaney_on(x.device, 16000, WHISPER_N_FFT, WHISPER_N_MELS) @ power
    logmel = torch.clamp(mel, min=1e-10).log10()
    logmel = torch.maximum(logmel, logmel.max() - 8.0)
    return (logmel + 4.0) / 4.0


def fbank_frames(num_samples: int) -> int:
    """Frames of `kaldi_fbank` (snip-edges framing): 0 below one 25 ms window."""
    return 0 if num_samples < FBANK_FRAME else 1 + (num_samples - FBANK_FRAME) // FBANK_SHIFT


def kaldi_fbank(audio16k: Tensor) -> Tensor:
    """16 kHz mono [N] (floats in [-1, 1]) -> [T, 80] Kaldi log mel filterbank, T = 1 + (N - 400) // 160.

    Per 25 ms frame: subtract the frame mean, pre-emphasis 0.97 (the first sample against itself),
    Povey window (symmetric Hann ** 0.85), zero-pad to 512, power spectrum, 80 triangular bins
    from 20 Hz to 8 kHz on Kaldi's mel scale, natural log floored at float32 epsilon.
    """
    x = _mono(audio16k, "kaldi_fbank")
    if x.shape[0] < FBANK_FRAME:
        raise ValueError(f"kaldi_fbank needs at least {FBANK_FRAME} samples, got {x.shape[0]}")
    frames = x.unfold(0, FBANK_FRAME, FBANK_SHIFT)  # [T, 400]
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - FBANK_PREEMPH * previous
    frames = frames * _hann(FBANK_FRAME, False, x.device, FBANK_POVEY_POWER)
    frames = F.pad(frames, (0, FBANK_FFT - FBANK_FRAME))
    power = torch.fft.rfft(frames).abs().pow(2.0)  # [T, 257]
    banks = _kaldi_banks(FBANK_N_MELS, FBANK_FFT, 16000.0, FBANK_LOW_HZ, 8000.0, x.device)
    energies = torch.mm(power, banks.T)
    return torch.clamp(energies, min=torch.finfo(torch.float32).eps).log()


def prompt_mel_frames(num_samples: int) -> int:
    """Frames of `prompt_mel` for N samples at 24 kHz: N // 480 (50 per second); 0 when N <= 720."""
    return num_samples // PROMPT_HOP if num_samples > PROMPT_PAD else 0


def prompt_mel(audio24k: Tensor) -> Tensor:
    """24 kHz mono [N] -> [N // 480, 80] natural-log mel magnitude (the flow's prompt features).

    Reflect-pad 720 samples each side (needs N > 720), STFT with periodic Hann 1920 and hop 480
    without centring, magnitude sqrt(re^2 + im^2 + 1e-9), Slaney mel filters (24 kHz, 0-12 kHz,
    80 bins), ln of the values floored at 1e-5.
    """
    x = _mono(audio24k, "prompt_mel")
    padded = F.pad(x[None, None], (PROMPT_PAD, PROMPT_PAD), mode="reflect")[0, 0]
    spec = torch.stft(padded, PROMPT_N_FFT, hop_length=PROMPT_HOP, win_length=PROMPT_N_FFT,
                      window=_hann(PROMPT_N_FFT, True, x.device), center=False, normalized=False, onesided=True,
                      return_complex=True)
    magnitude = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.matmul(_slaney_on(x.device, PROMPT_SR, PROMPT_N_FFT, PROMPT_N_MELS), magnitude)
    return torch.log(torch.clamp(mel, min=1e-5)).T.contiguous()


# ---------------------------------------------------------------------------------------------
# resampling as the official loader does it


@lru_cache(maxsize=16)
def _transform_kernel(orig: int, new: int, zeros: int = 6, rolloff: float = 0.99) -> tuple[Tensor, int]:
    """The Hann-windowed sinc bank of torchaudio.transforms.Resample with its defaults.

    That transform builds the bank in float64 and stores it as float32, except that the output
    phase offsets (j / new) are formed in float32 before joining the float64 grid; both are kept
    here, so the bank (and so the resampled audio) is bit-identical to the transform's.
    """
    cutoff = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig  # input positions
    phases = (torch.arange(0, -new, -1) / new).to(torch.float32)  # float32, as in the transform
    t = (phases[:, None, None].to(torch.float64) + taps[None, None]) * cutoff
    t = t.clamp(-zeros, zeros)
    hann = torch.cos(t * (math.pi / zeros / 2)) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones((), dtype=torch.float64), torch.sin(t) / t)
    return (sinc * (hann * (cutoff / orig))).to(torch.float32), width


@lru_cache(maxsize=16)
def _kernel_on(device: torch.device, orig: int, new: int) -> tuple[Tensor, int]:
    kernel, width = _transform_kernel(orig, new)
    return kernel.to(device), width


def official_resample(audio: Tensor, orig_rate: int, new_rate: int, bucket: int = 0) -> Tensor:
    """[..., N] float32 -> [..., ceil(N * new / orig)], equal to `torchaudio.transforms.Resample(orig, new)`.

    bucket > 0: the convolution's input is zero-padded on the right to a multiple of `bucket`
    samples beyond what it needs (outputs past the kept ones read the extra zeros and are
    dropped), so clips of nearby lengths share a shape; the kept samples are unchanged.

    `intone.ops.resample.resample` equals `torchaudio.functional.resample`, whose float32 bank differs
    from the transform's by float rounding (up to ~1e-5 on the output for 22.05/44.1 kHz input);
    the official frontend uses the transform, so reference features use this.
    """
    if orig_rate == new_rate:
        return audio
    if not bank_fits(int(orig_rate), int(new_rate)):  # an odd rate: its bank would take gigabytes
        return resample_direct(audio.to(torch.float32), int(orig_rate), int(new_rate))
    g = math.gcd(int(orig_rate), int(new_rate))
    orig, new = int(orig_rate) // g, int(new_rate) // g
    kernel, width = _kernel_on(audio.device, orig, new)
    shape = audio.shape
    extra = (-shape[-1]) % bucket if bucket > 0 else 0
    flat = F.pad(audio.reshape(-1, shape[-1]).to(torch.float32), (width, width + orig + extra))
    out = F.conv1d(flat[:, None], kernel, stride=orig).transpose(1, 2).reshape(flat.shape[0], -1)
    return out[..., : math.ceil(new * shape[-1] / orig)].reshape(*shape[:-1], -1)
