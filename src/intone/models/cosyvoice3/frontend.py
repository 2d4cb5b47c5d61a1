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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from intone.errors import InvalidRequestError
from intone.models.cosyvoice3.campplus_net import CamShape, random_campplus
from intone.models.cosyvoice3.features import (
    fbank_frames,
    kaldi_fbank,
    official_resample,
    prompt_mel,
    prompt_mel_frames,
    whisper_log_mel,
)
from intone.models.cosyvoice3.frontend_networks import TOKENIZER_RATE, SpeakerEncoder, SpeechTokenizer
from intone.models.cosyvoice3.speech_tokenizer_net import TokenizerShape, random_speech_tokenizer
from intone.ops.host_copy import to_device, to_host

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
    "extract_each",
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
PROMPT_RATE = 24000
MAX_REFERENCE_SECONDS = 30.0  # the official tokenizer path asserts this, on the 16 kHz audio
MIN_SAMPLE_RATE = 16000  # the official loader asserts input rates of at least this
# CAM++ is only ever run on >= 4 fbank frames officially (the TensorRT profile's minimum).
MIN_FBANK_FRAMES = 4
WARM_UP_SECONDS = range(1, 11)
GRAPH_BATCH_ROWS = (1, 2, 4, 8, 16, 32)  # the frontend stage batches at most 32 clips


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
    (mel,) = to_host(mel[: 2 * n])
    return ReferenceFeatures(speech_tokens=tokens[:n].to("cpu", torch.int64).contiguous(),
                             prompt_mel=mel.contiguous(), speaker=speaker)


def extract_each(items: list[tuple[Tensor, int]], tokenizer, speaker_encoder,
                 field: str = "ref_audio") -> Iterator[tuple[int, ReferenceFeatures | Exception]]:
    """Reference recordings (audio, sample rate), as for `extract_reference` -> (index, features
    as CPU tensors, or the error that item raised) as each item is ready: bad audio at once, then
    the rest one by one after the speech tokenizer's batched call, so a clip's request need not
    wait for the whole batch's speaker vectors. One bad clip does not affect the others. The
    feature math runs on the tokenizer's device; each clip's result equals it alone, to float
    rounding."""
    device = getattr(tokenizer, "device", torch.device("cpu"))
    todo, clips16, mels = [], [], []
    for i, (audio, rate) in enumerate(items):
        try:
            audio = to_device(_checked(audio, rate, field), device)
            mels.append(prompt_mel(official_resample(audio, int(rate), PROMPT_RATE, bucket=int(rate))))  # [frames, 80]
            clips16.append(official_resample(audio, int(rate), TOKENIZER_RATE, bucket=int(rate)))
            todo.append(i)
        except InvalidRequestError as e:
            yield i, e
    if not todo:
        return
    tokens = _each(tokenizer, "tokenize_batch", clips16)
    # The x-vector conditions every flow frame, and a batch of another shape moves it by float
    # rounding: CAM++ runs every call at one shape per length bucket (`SpeakerEncoder.set_batching`;
    # by default one row, i.e. each clip alone), so a request's audio never depends on which other
    # references arrived with it. Tokens are discrete and stay batched.
    groups = speaker_encoder.embed_groups(clips16) if hasattr(speaker_encoder, "embed_groups") \
        else [[k] for k in range(len(clips16))]
    for group in groups:
        speakers = _each(speaker_encoder, "embed_batch", [clips16[k] for k in group])
        for k, speaker in zip(group, speakers):
            try:
                yield todo[k], _assemble(tokens[k], mels[k], speaker, field)
            except Exception as e:  # noqa: BLE001 - this item's error, in its slot
                yield todo[k], e


def extract_batch(items: list[tuple[Tensor, int]], tokenizer, speaker_encoder,
                  field: str = "ref_audio") -> list[ReferenceFeatures | Exception]:
    """`extract_each` gathered: per item (in order) its features or its error."""
    results: list = [None] * len(items)
    for i, result in extract_each(items, tokenizer, speaker_encoder, field):
        results[i] = result
    return results


def warm_up(tokenizer, speaker_encoder, graphs=None) -> int:
    """Run both networks once per bucketed input length of 1-10 s (a GPU's start-up); returns the
    count. With `graphs` (an engine's FunctionGraphs), each of those shapes is captured there too:
    CAM++ at its fixed rows (one by default: clips are embedded alone), the tokenizer at every power-of-two
    batch, or at its fixed rows when `cosyvoice3.tokenizer_rows` sets them."""
    device = getattr(tokenizer, "device", torch.device("cpu"))
    models = [m for m in (tokenizer, speaker_encoder) if graphs is not None and hasattr(m, "use_graphs")]
    for model in models:
        model.use_graphs(graphs)
        model._capturing = True
    try:
        for seconds in WARM_UP_SECONDS:
            clip = torch.zeros(seconds * TOKENIZER_RATE, device=device)
            clip[:: TOKENIZER_RATE // 100] = 0.1  # not silent, so no path is skipped
            # a tokenizer of fixed rows (`cosyvoice3.tokenizer_rows`) runs each bucket at one shape
            for rows in GRAPH_BATCH_ROWS if tokenizer in models and not getattr(tokenizer, "fixed_rows", None) else (1,):
                _each(tokenizer, "tokenize_batch", [clip] * rows)
            _each(speaker_encoder, "embed_batch", [clip])
    finally:
        for model in models:
            model._capturing = False
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
