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
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from intone.errors import InvalidRequestError, ModelLoadError
from intone.models.cosyvoice3.features import (
    fbank_frames,
    kaldi_fbank,
    official_resample,
    prompt_mel,
    prompt_mel_frames,
    whisper_log_mel,
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
    "extract_reference",
    "kaldi_fbank",
    "prompt_mel",
    "whisper_log_mel",
]

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
CAMPPLUS_FILE = "campplus.onnx"
TOKENIZER_RATE = 16000
PROMPT_RATE = 24000
MAX_REFERENCE_SECONDS = 30.0  # the official tokenizer path asserts this, on the 16 kHz audio
MIN_SAMPLE_RATE = 16000  # the official loader asserts input rates of at least this
# CAM++ is only ever run on >= 4 fbank frames officially (the TensorRT profile's minimum).
MIN_FBANK_FRAMES = 4


class _OnnxModel:
    """One onnxruntime CPU session over a file, made on first use (or by `load()`).

    The file's existence is checked at construction. Making the session is guarded by a lock;
    onnxruntime sessions may then be run from any thread.
    """

    what = "ONNX model"

    def __init__(self, onnx_path: str | Path, num_threads: int = 1):
        self.path = Path(onnx_path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file (the CosyVoice3 {self.what})")
        self.num_threads = int(num_threads)
        self._session = None
        self._lock = threading.Lock()

    def load(self):
        """Make the session now (it is otherwise made by the first call). Returns self."""
        if self._session is None:
            with self._lock:
                if self._session is None:
                    self._session = self._open()
        return self

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

    def _run(self, *arrays: np.ndarray) -> np.ndarray:
        """Feed `arrays` to the model's inputs in order (by the names the file declares); first output."""
        session = self.load()._session
        names = [i.name for i in session.get_inputs()]
        if len(names) != len(arrays):
            raise ModelLoadError(f"{self.path}: the {self.what} takes {len(names)} inputs, expected {len(arrays)}")
        return np.asarray(session.run(None, dict(zip(names, arrays)))[0])


class SpeechTokenizer(_OnnxModel):
    """`speech_tokenizer_v3.onnx`: 16 kHz audio [N] -> int64 speech tokens [ceil((N // 160) / 4)], ids < 6561.

    Inputs are the whisper log-mel [1, 128, T] float32 and its length [1] int32, in that order;
    the first output, flattened, is the tokens (as the official `_extract_speech_token`).
    """

    what = "speech tokenizer"

    def __call__(self, audio16k: Tensor) -> Tensor:
        return self.tokenize_features(whisper_log_mel(audio16k))

    def tokenize_features(self, feats: Tensor) -> Tensor:
        """[128, T] whisper log-mel -> int64 [T_tok]."""
        mel = feats.detach().to("cpu", torch.float32).numpy()[None]
        tokens = self._run(np.ascontiguousarray(mel), np.array([mel.shape[2]], dtype=np.int32))
        return torch.from_numpy(tokens.reshape(-1).astype(np.int64))


class SpeakerEncoder(_OnnxModel):
    """`campplus.onnx`: 16 kHz audio -> 192-d speaker vector (float32), from the mean-normalised fbank."""

    what = "speaker encoder (CAM++)"

    def __call__(self, audio16k: Tensor) -> Tensor:
        feats = kaldi_fbank(audio16k)
        return self.embed_features(feats - feats.mean(dim=0, keepdim=True))

    def embed_features(self, feats: Tensor) -> Tensor:
        """[T, 80] fbank, already mean-normalised -> float32 [192]."""
        x = np.ascontiguousarray(feats.detach().to("cpu", torch.float32).numpy()[None])
        return torch.from_numpy(self._run(x).reshape(-1).astype(np.float32))


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


def extract_reference(audio: Tensor, sample_rate: int, tokenizer: SpeechTokenizer, speaker_encoder: SpeakerEncoder,
                      field: str = "ref_audio") -> ReferenceFeatures:
    """A reference recording (float samples in [-1, 1], [N] or [channels, N], any rate >= 16 kHz)
    -> the official zero-shot prompt features. Problems with the audio raise
    `InvalidRequestError(field, ...)`.
    """
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

    audio16 = official_resample(audio, rate, TOKENIZER_RATE)
    audio24 = official_resample(audio, rate, PROMPT_RATE)
    mel = prompt_mel(audio24)  # [frames, 80]
    tokens = tokenizer(audio16)
    n = min(mel.shape[0] // 2, int(tokens.shape[0]))
    if n == 0:
        raise InvalidRequestError(field, "the speech tokenizer gave no tokens for this audio; it is too short")
    speaker = speaker_encoder(audio16)
    if not bool(torch.isfinite(speaker).all()):
        raise InvalidRequestError(field, "the speaker encoder gave a non-finite vector for this audio")
    return ReferenceFeatures(speech_tokens=tokens[:n].to(torch.int64).contiguous(),
                             prompt_mel=mel[: 2 * n].contiguous(), speaker=speaker.to(torch.float32))


class ReferenceFrontend:
    """The two frontend models of a CosyVoice3 checkpoint directory, with `extract_reference` as a call."""

    def __init__(self, model_dir: str | Path, num_threads: int = 1):
        model_dir = Path(model_dir)
        self.tokenizer = SpeechTokenizer(model_dir / SPEECH_TOKENIZER_FILE, num_threads=num_threads)
        self.speaker_encoder = SpeakerEncoder(model_dir / CAMPPLUS_FILE, num_threads=num_threads)

    def load(self) -> ReferenceFrontend:
        self.tokenizer.load()
        self.speaker_encoder.load()
        return self

    def __call__(self, audio: Tensor, sample_rate: int, field: str = "ref_audio") -> ReferenceFeatures:
        return extract_reference(audio, sample_rate, self.tokenizer, self.speaker_encoder, field=field)
