"""CosyVoice3 reference-audio frontend: a voice sample -> prompt speech tokens, prompt mel, speaker vector.

What the official `CosyVoiceFrontEnd.frontend_zero_shot` computes from `prompt_wav`:

1. The recording is mixed to mono and resampled (torchaudio's `Resample`) to 16 kHz and 24 kHz.
   Rates below 16 kHz are refused, as the official loader refuses them.
2. Speech tokens: whisper log-mel (128 bins, 100 frames/s) of the 16 kHz audio through
   `speech_tokenizer_v3.onnx`, 25 tokens/s. At most 30 s of audio is accepted.
3. Prompt mel: the Matcha mel of the 24 kHz audio, 80 bins, 50 frames/s.
4. Alignment: n = min(mel_frames // 2, tokens); tokens are cut to n and the mel to 2n frames.
5. Speaker vector: Kaldi fbank (80 bins) of the 16 kHz audio, minus its mean over time, through
   `campplus.onnx` -> 192 floats (from the whole recording, not the aligned part).

The official path neither trims silence nor normalises loudness of the prompt (only its web demo
does, for its own uploads), so neither happens here.

The official code runs both ONNX files through onnxruntime on one CPU thread, one clip at a time.
Here each file is read into a torch port of its network (`speech_tokenizer_net`, `campplus_net`)
that runs batches of clips on any device; a file whose graph is not that network (or that, by
default, disagrees with onnxruntime on a probe clip at load) runs through onnxruntime instead.
The log says which backend each model uses.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from intone.errors import InvalidRequestError, ModelLoadError
from intone.models.cosyvoice3.campplus_net import CamShape, campplus_from_onnx, random_campplus
from intone.models.cosyvoice3.features import (
    fbank_frames,
    kaldi_fbank,
    official_resample,
    prompt_mel,
    prompt_mel_frames,
    whisper_log_mel,
)
from intone.models.cosyvoice3.onnx_weights import NotThisArchitecture, OnnxGraph
from intone.models.cosyvoice3.speech_tokenizer_net import (
    TokenizerShape,
    random_speech_tokenizer,
    speech_tokenizer_from_onnx,
)

__all__ = [
    "CAMPPLUS_FILE",
    "MAX_REFERENCE_SECONDS",
    "MIN_SAMPLE_RATE",
    "SPEECH_TOKENIZER_FILE",
    "ReferenceFeatures",
    "ReferenceFrontend",
    "SpeakerEncoder",
    "SpeechTokenizer",
    "extract_batch",
    "extract_reference",
    "warm_up",
    "kaldi_fbank",
    "prompt_mel",
    "random_frontend",
    "whisper_log_mel",
]

log = logging.getLogger(__name__)

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
CAMPPLUS_FILE = "campplus.onnx"
TOKENIZER_RATE = 16000
PROMPT_RATE = 24000
MAX_REFERENCE_SECONDS = 30.0  # the official tokenizer path asserts this, on the 16 kHz audio
MIN_SAMPLE_RATE = 16000  # the official loader asserts input rates of at least this
# CAM++ is only ever run on >= 4 fbank frames officially (the TensorRT profile's minimum).
MIN_FBANK_FRAMES = 4
BACKENDS = ("auto", "torch", "onnxruntime")
MAX_BATCH_CLIPS = 64
MAX_BATCH_FRAMES = 64 * 1000  # padded feature frames (100 per second) in one network call
# Network inputs are zero-padded (with their true lengths, so results are unchanged to float
# rounding) to a multiple of this many feature frames (1 s): on a GPU every new input shape makes
# the convolutions build new plans (hundreds of ms for CAM++), and unique clip lengths would make
# every request pay that; with buckets the shapes repeat, and start-up warms them.
FRAME_BUCKET = 100
WARM_UP_SECONDS = range(1, 11)
PROBE_SECONDS = 3.0
PROBE_TOKEN_AGREEMENT = 0.9  # FSQ rounding may flip a few codes between runtimes, not more
PROBE_VECTOR_RTOL = 1e-3


def _probe_audio() -> Tensor:
    """A fixed 16 kHz clip (noise and two tones) on which a port is checked against onnxruntime."""
    n = int(PROBE_SECONDS * TOKENIZER_RATE)
    g = torch.Generator().manual_seed(1234)
    t = torch.arange(n, dtype=torch.float64) / TOKENIZER_RATE
    tones = 0.3 * torch.sin(2 * math.pi * 180.0 * t) + 0.2 * torch.sin(2 * math.pi * 1130.0 * t * (1 + t / 6))
    return (tones + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)).to(torch.float32)


def _groups(lengths: list[int]) -> list[list[int]]:
    """Indices in batches of similar length, each within MAX_BATCH_CLIPS and MAX_BATCH_FRAMES (padded)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is None or len(g) >= MAX_BATCH_CLIPS or (len(g) + 1) * lengths[g[0]] > MAX_BATCH_FRAMES:
            groups.append([i])
        else:
            g.append(i)
    return groups


def _padded(items: list[Tensor], dim: int) -> tuple[Tensor, Tensor]:
    """Stack along a new first axis, zero-padding axis `dim` to a multiple of FRAME_BUCKET; (batch, lengths)."""
    lengths = [int(x.shape[dim]) for x in items]
    longest = -(-max(lengths) // FRAME_BUCKET) * FRAME_BUCKET
    pads = []
    for x, n in zip(items, lengths):
        pad = [0, 0] * x.dim()
        pad[2 * (x.dim() - 1 - dim % x.dim()) + 1] = longest - n
        pads.append(torch.nn.functional.pad(x.to(torch.float32), pad))
    return torch.stack(pads), torch.tensor(lengths, device=items[0].device)


class _FrontendModel:
    """One of the two frontend files: a torch port of its network, or an onnxruntime CPU session.

    The file's existence is checked at construction; the backend is chosen by `load()` (or the
    first call). backend: "auto" (the port when the file's graph is its network, else
    onnxruntime), "torch" (the port or ModelLoadError) or "onnxruntime". With verify, "auto"
    also runs the port and onnxruntime on a probe clip at load and keeps onnxruntime if they
    disagree. Results are CPU tensors; inputs may be on any device.
    """

    what = "ONNX model"

    def __init__(self, onnx_path: str | Path, num_threads: int = 1, *, backend: str = "auto", verify: bool = True):
        self.path = Path(onnx_path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file (the CosyVoice3 {self.what})")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.num_threads = int(num_threads)
        self.requested, self.verify = backend, verify
        self.net: nn.Module | None = None
        self.backend: str | None = None  # "torch" or "onnxruntime", once loaded
        self._session = None
        self._device = torch.device("cpu")
        self._lock = threading.Lock()

    @classmethod
    def from_net(cls, net: nn.Module):
        """A model around a torch network that did not come from a file (random weights)."""
        self = cls.__new__(cls)
        self.path, self.num_threads, self.requested, self.verify = None, 1, "torch", False
        self.net, self.backend, self._session = net.eval(), "torch", None
        self._device = next(net.parameters()).device
        self._lock = threading.Lock()
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    def to(self, device) -> _FrontendModel:
        """Run on `device` (the torch backend; onnxruntime stays on the CPU). Returns self."""
        self.load()
        with self._lock:
            if self.net is not None:
                self.net.to(device)
            self._device = torch.device(device)
        return self

    def load(self) -> _FrontendModel:
        """Choose the backend and read the file now (it is otherwise done by the first call). Returns self."""
        if self.backend is None:
            with self._lock:
                if self.backend is None:
                    self._choose()
        return self

    def _choose(self) -> None:
        net = self._port() if self.requested != "onnxruntime" else None
        if net is not None:
            self.net = net.to(self._device).eval()
        else:
            self._session = self._open()
        self.backend = "torch" if net is not None else "onnxruntime"
        log.info("%s: the CosyVoice3 %s runs on %s", self.path, self.what,
                 "the torch port" if net is not None else "onnxruntime (CPU, one clip at a time)")

    def _port(self) -> nn.Module | None:
        try:
            net = self._from_onnx(OnnxGraph(self.path))
        except NotThisArchitecture as e:
            if self.requested == "torch":
                raise ModelLoadError(f"{self.path}: the torch port cannot read this {self.what}: {e}") from None
            log.info("%s: the graph is not the network of the torch port (%s)", self.path, e)
            return None
        if self.verify and self.requested == "auto":
            with torch.no_grad():
                problem = self._disagreement(net, self._open())
            if problem:
                log.warning("%s: the torch port disagrees with onnxruntime on a probe clip (%s)", self.path, problem)
                return None
        return net

    def _open(self):
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise ModelLoadError(f"{self.path}: reading the CosyVoice3 {self.what} needs onnxruntime ({e})") from None
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = self.num_threads  # the official frontend runs both models on 1 thread
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        try:
            return ort.InferenceSession(str(self.path), sess_options=options, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime's errors (InvalidProtobuf, Fail, ...) subclass Exception
            raise ModelLoadError(f"{self.path}: not a loadable {self.what} ({type(e).__name__}: {e})") from None

    def _run(self, session, *arrays: np.ndarray) -> np.ndarray:
        """Feed `arrays` to the model's inputs in order (by the names the file declares); first output."""
        names = [i.name for i in session.get_inputs()]
        if len(names) != len(arrays):
            raise ModelLoadError(f"{self.path}: the {self.what} takes {len(names)} inputs, expected {len(arrays)}")
        return np.asarray(session.run(None, dict(zip(names, arrays)))[0])

    def _batched(self, feats: list[Tensor], dim: int, run_net, run_session) -> list[Tensor]:
        """Per item, run_net on padded batches (torch) or run_session one at a time (onnxruntime)."""
        self.load()
        if self.net is None:
            return [run_session(f) for f in feats]
        out: list[Tensor | None] = [None] * len(feats)
        for group in _groups([int(f.shape[dim]) for f in feats]):
            x, lengths = _padded([feats[i].to(self._device) for i in group], dim)
            with torch.no_grad():
                rows = run_net(x, lengths)
            for row, i in zip(rows, group):
                out[i] = row
        return out

    def _from_onnx(self, graph: OnnxGraph) -> nn.Module:
        raise NotImplementedError

    def _disagreement(self, net: nn.Module, session) -> str | None:
        raise NotImplementedError


class SpeechTokenizer(_FrontendModel):
    """`speech_tokenizer_v3.onnx`: 16 kHz audio [N] -> int64 speech tokens [ceil((N // 160) / 4)], ids < 6561.

    The file's inputs are the whisper log-mel [B, 128, T] float32 and its length [B] int32, in
    that order; its first output is the tokens (as the official `_extract_speech_token`).
    """

    what = "speech tokenizer"

    def __call__(self, audio16k: Tensor) -> Tensor:
        return self.tokenize_batch([audio16k])[0]

    def tokenize_batch(self, clips: list[Tensor]) -> list[Tensor]:
        """16 kHz mono clips -> per clip its int64 tokens (CPU), each equal to the clip alone."""
        self.load()
        return self.tokenize_features_batch([whisper_log_mel(c.to(self._device)) for c in clips])

    def tokenize_features(self, feats: Tensor) -> Tensor:
        """[128, T] whisper log-mel -> int64 [T_tok]."""
        return self.tokenize_features_batch([feats])[0]

    def tokenize_features_batch(self, feats: list[Tensor]) -> list[Tensor]:
        def run_net(x: Tensor, lengths: Tensor) -> list[Tensor]:
            tokens, counts = self.net.tokenize(x, lengths)
            tokens, counts = tokens.cpu(), counts.tolist()
            return [tokens[r, :n].clone() for r, n in enumerate(counts)]

        return self._batched(feats, -1, run_net, self._session_tokens)

    def _session_tokens(self, feats: Tensor, session=None) -> Tensor:
        mel = feats.detach().to("cpu", torch.float32).numpy()[None]
        length = np.array([mel.shape[2]], dtype=np.int32)
        tokens = self._run(session or self._session, np.ascontiguousarray(mel), length)
        return torch.from_numpy(tokens.reshape(-1).astype(np.int64))

    def _from_onnx(self, graph: OnnxGraph) -> nn.Module:
        return speech_tokenizer_from_onnx(graph)

    def _disagreement(self, net: nn.Module, session) -> str | None:
        feats = whisper_log_mel(_probe_audio())
        ours = net.tokenize(feats[None], torch.tensor([feats.shape[1]]))[0][0]
        theirs = self._session_tokens(feats, session)
        if ours.shape != theirs.shape:
            return f"{ours.numel()} tokens against {theirs.numel()}"
        agree = float((ours == theirs).double().mean())
        return None if agree >= PROBE_TOKEN_AGREEMENT else f"{agree:.1%} of the tokens agree"


class SpeakerEncoder(_FrontendModel):
    """`campplus.onnx`: 16 kHz audio -> 192-d speaker vector (float32), from the mean-normalised fbank."""

    what = "speaker encoder (CAM++)"

    def __call__(self, audio16k: Tensor) -> Tensor:
        return self.embed_batch([audio16k])[0]

    def embed_batch(self, clips: list[Tensor]) -> list[Tensor]:
        """16 kHz mono clips -> per clip its float32 [192] vector (CPU), each equal to the clip alone."""
        self.load()
        feats = [kaldi_fbank(c.to(self._device)) for c in clips]
        return self.embed_features_batch([f - f.mean(dim=0, keepdim=True) for f in feats])

    def embed_features(self, feats: Tensor) -> Tensor:
        """[T, 80] fbank, already mean-normalised -> float32 [192]."""
        return self.embed_features_batch([feats])[0]

    def embed_features_batch(self, feats: list[Tensor]) -> list[Tensor]:
        def run_net(x: Tensor, lengths: Tensor) -> list[Tensor]:
            return list(self.net(x, lengths).float().cpu().unbind(0))

        return self._batched(feats, 0, run_net, self._session_vector)

    def _session_vector(self, feats: Tensor, session=None) -> Tensor:
        x = np.ascontiguousarray(feats.detach().to("cpu", torch.float32).numpy()[None])
        return torch.from_numpy(self._run(session or self._session, x).reshape(-1).astype(np.float32))

    def _from_onnx(self, graph: OnnxGraph) -> nn.Module:
        return campplus_from_onnx(graph)

    def _disagreement(self, net: nn.Module, session) -> str | None:
        feats = kaldi_fbank(_probe_audio())
        feats = feats - feats.mean(dim=0, keepdim=True)
        ours, theirs = net(feats[None])[0], self._session_vector(feats, session)
        if ours.shape != theirs.shape:
            return f"vectors of {ours.numel()} and {theirs.numel()} values"
        diff = float((ours - theirs).abs().max())
        return None if diff <= PROBE_VECTOR_RTOL * max(1.0, float(theirs.abs().max())) else f"max |diff| {diff:.3g}"


@dataclass(frozen=True)
class ReferenceFeatures:
    """What the LLM and the flow take from a reference recording.

    speech_tokens: int64 [n], the prompt speech tokens (25 per second).
    prompt_mel: float32 [2n, 80], the aligned prompt mel (50 frames per second).
    speaker: float32 [192], the CAM++ x-vector (conditions the flow only).
    """

    speech_tokens: Tensor
    prompt_mel: Tensor
    speaker: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.speech_tokens.shape[0])


def _resampled_length(num_samples: int, orig: int, new: int) -> int:
    g = math.gcd(orig, new)
    return -(-num_samples * (new // g) // (orig // g))  # ceil, as the resampler's output length


def _checked(audio, sample_rate: int, field: str) -> Tensor:
    """The recording as float32 mono [N], or InvalidRequestError(field, ...) saying what is wrong."""
    if not isinstance(audio, Tensor):
        audio = torch.as_tensor(np.asarray(audio))
    if audio.dim() == 2:
        audio = audio.to(torch.float32).mean(dim=0)  # the official loader averages the channels
    if audio.dim() != 1:
        raise InvalidRequestError(field, f"audio must be [samples] or [channels, samples], not {tuple(audio.shape)}")
    audio = audio.to(torch.float32)
    rate = int(sample_rate)
    if audio.numel() == 0:
        raise InvalidRequestError(field, "audio is empty")
    if rate < MIN_SAMPLE_RATE:
        raise InvalidRequestError(field, f"sample rate {rate} Hz is below {MIN_SAMPLE_RATE} Hz; "
                                         "CosyVoice3 needs a reference recorded at 16 kHz or more")
    if not bool(torch.isfinite(audio).all()):
        raise InvalidRequestError(field, "audio contains NaN or infinite samples")
    n16 = _resampled_length(audio.numel(), rate, TOKENIZER_RATE)
    n24 = _resampled_length(audio.numel(), rate, PROMPT_RATE)
    if n16 > MAX_REFERENCE_SECONDS * TOKENIZER_RATE:
        raise InvalidRequestError(field, f"audio is {n16 / TOKENIZER_RATE:.2f} s; CosyVoice3 takes at most "
                                         f"{MAX_REFERENCE_SECONDS:g} s of reference audio")
    if prompt_mel_frames(n24) < 2 or fbank_frames(n16) < MIN_FBANK_FRAMES:
        raise InvalidRequestError(field, f"audio is {1000 * audio.numel() / rate:.0f} ms, too short for a "
                                         "reference (at least 55 ms is needed)")
    return audio


def _each(model, batched: str, clips: list[Tensor]) -> list:
    """Per clip `model.<batched>(clips)`'s result, or (for a plain callable, or when the batch
    fails) `model(clip)` one at a time; a clip that fails gets its exception."""
    run = getattr(model, batched, None)
    if run is not None:
        try:
            return run(clips)
        except Exception as e:  # noqa: BLE001 - retried clip by clip so that only the bad one fails
            if len(clips) == 1:
                return [e]
            log.warning("a frontend batch of %d clips failed (%s); running them one at a time", len(clips), e)
    out = []
    for clip in clips:
        try:
            out.append(model(clip))
        except Exception as e:  # noqa: BLE001
            out.append(e)
    return out


def _assemble(tokens, mel: Tensor, speaker, field: str) -> ReferenceFeatures:
    if isinstance(tokens, Exception):
        raise tokens
    n = min(mel.shape[0] // 2, int(tokens.shape[0]))
    if n == 0:
        raise InvalidRequestError(field, "the speech tokenizer gave no tokens for this audio; it is too short")
    if isinstance(speaker, Exception):
        raise speaker
    speaker = speaker.to("cpu", torch.float32)
    if not bool(torch.isfinite(speaker).all()):
        raise InvalidRequestError(field, "the speaker encoder gave a non-finite vector for this audio")
    return ReferenceFeatures(speech_tokens=tokens[:n].to("cpu", torch.int64).contiguous(),
                             prompt_mel=mel[: 2 * n].to("cpu").contiguous(), speaker=speaker)


def extract_batch(items: list[tuple[Tensor, int]], tokenizer, speaker_encoder,
                  field: str = "ref_audio") -> list[ReferenceFeatures | Exception]:
    """Reference recordings (audio, sample rate), as for `extract_reference` -> per item its
    features (CPU tensors) or the error it raised (`InvalidRequestError(field, ...)` for bad
    audio); one bad clip does not affect the others. The feature math runs on the tokenizer's
    device; the two networks run batched (each clip's result equals it alone, to float rounding).
    """
    device = getattr(tokenizer, "device", torch.device("cpu"))
    results: list = [None] * len(items)
    todo, clips16, mels = [], [], []
    for i, (audio, rate) in enumerate(items):
        try:
            audio = _checked(audio, rate, field).to(device)
            mels.append(prompt_mel(official_resample(audio, int(rate), PROMPT_RATE, bucket=int(rate))))  # [frames, 80]
            clips16.append(official_resample(audio, int(rate), TOKENIZER_RATE, bucket=int(rate)))
            todo.append(i)
        except InvalidRequestError as e:
            results[i] = e
    if todo:
        tokens = _each(tokenizer, "tokenize_batch", clips16)
        # The x-vector conditions every flow frame, and a padded batch moves it by float rounding:
        # each clip is embedded alone (CAM++ is cheap), so a request's audio never depends on
        # which other references arrived with it. Tokens are discrete and stay batched.
        speakers = [_each(speaker_encoder, "embed_batch", [clip])[0] for clip in clips16]
        for i, tok, mel, spk in zip(todo, tokens, mels, speakers):
            try:
                results[i] = _assemble(tok, mel, spk, field)
            except Exception as e:  # noqa: BLE001 - this item's error, in its slot
                results[i] = e
    return results


def warm_up(tokenizer, speaker_encoder) -> int:
    """Run both networks once per bucketed input length of 1-10 s (a GPU's start-up); returns the count."""
    device = getattr(tokenizer, "device", torch.device("cpu"))
    for seconds in WARM_UP_SECONDS:
        clip = torch.zeros(seconds * TOKENIZER_RATE, device=device)
        clip[:: TOKENIZER_RATE // 100] = 0.1  # not silent, so no path is skipped
        _each(tokenizer, "tokenize_batch", [clip])
        _each(speaker_encoder, "embed_batch", [clip])
    return len(WARM_UP_SECONDS)


def extract_reference(audio: Tensor, sample_rate: int, tokenizer: SpeechTokenizer, speaker_encoder: SpeakerEncoder,
                      field: str = "ref_audio") -> ReferenceFeatures:
    """A reference recording (float samples in [-1, 1], [N] or [channels, N], any rate >= 16 kHz)
    -> the official zero-shot prompt features. Problems with the audio raise
    `InvalidRequestError(field, ...)`. `extract_batch` of one item.
    """
    result = extract_batch([(audio, sample_rate)], tokenizer, speaker_encoder, field=field)[0]
    if isinstance(result, Exception):
        raise result
    return result


class ReferenceFrontend:
    """The two frontend models of a CosyVoice3 checkpoint directory, with `extract_reference` as a call."""

    def __init__(self, model_dir: str | Path, num_threads: int = 1, *, backend: str = "auto", verify: bool = True):
        model_dir = Path(model_dir)
        self.tokenizer = SpeechTokenizer(model_dir / SPEECH_TOKENIZER_FILE, num_threads, backend=backend, verify=verify)
        self.speaker_encoder = SpeakerEncoder(model_dir / CAMPPLUS_FILE, num_threads, backend=backend, verify=verify)

    @classmethod
    def from_models(cls, tokenizer: SpeechTokenizer, speaker_encoder: SpeakerEncoder) -> ReferenceFrontend:
        self = cls.__new__(cls)
        self.tokenizer, self.speaker_encoder = tokenizer, speaker_encoder
        return self

    @property
    def device(self) -> torch.device:
        return self.tokenizer.device

    def to(self, device) -> ReferenceFrontend:
        self.tokenizer.to(device)
        self.speaker_encoder.to(device)
        return self

    def load(self) -> ReferenceFrontend:
        self.tokenizer.load()
        self.speaker_encoder.load()
        return self

    def __call__(self, audio: Tensor, sample_rate: int, field: str = "ref_audio") -> ReferenceFeatures:
        return extract_reference(audio, sample_rate, self.tokenizer, self.speaker_encoder, field=field)

    def extract_batch(self, items: list[tuple[Tensor, int]], field: str = "ref_audio") -> list:
        return extract_batch(items, self.tokenizer, self.speaker_encoder, field=field)


def random_frontend(device="cpu", seed: int = 0) -> ReferenceFrontend:
    """Both networks at their real sizes with random weights from `seed` (no files, no onnxruntime),
    for pricing the frontend honestly in benchmarks."""
    device = torch.device(device)
    tokenizer = SpeechTokenizer.from_net(random_speech_tokenizer(TokenizerShape(), seed, device))
    encoder = SpeakerEncoder.from_net(random_campplus(CamShape(), seed + 1, device))
    log.info("CosyVoice3 frontend: real-size torch ports with random weights on %s", device)
    return ReferenceFrontend.from_models(tokenizer, encoder)
