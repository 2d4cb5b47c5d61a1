"""Seed-TTS-eval WER ("seedtts-official"): the official text normalization, per-utterance jiwer
scores, Whisper ASR from a local directory, and the official macro-mean aggregation.

The behaviour follows BytedanceSpeech/seed-tts-eval `run_wer.py` / `average_wer.py` as described
in shared/reference/seedtts_eval.md §2. Where intone deliberately differs (missing or unreadable
wavs are counted as failures instead of being skipped) the report shows it in `failures`.

torch, transformers and scipy are imported where the ASR needs them, so that normalization and
aggregation stay cheap to import (the CLI and report code use them without a model).
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass
from pathlib import Path

import jiwer
import numpy as np
import soundfile as sf
import zhon.hanzi
from tqdm import tqdm

from intone.eval.meta import MetaItem
from intone.errors import IntoneError, ModelLoadError

ASR_SAMPLE_RATE = 16000
PROTOCOL = "seedtts-official"

# The ASCII apostrophe survives so that contractions ("don't") stay one word; everything else in
# the official punctuation set, including the curly apostrophe, is deleted.
_PUNCTUATION = "".join(ch for ch in zhon.hanzi.punctuation + string.punctuation if ch != "'")
_DELETE_PUNCTUATION = str.maketrans("", "", _PUNCTUATION)


class WerError(IntoneError):
    """The WER evaluation cannot run as asked (unsupported language, unusable input)."""


def normalize(text: str, lang: str = "en") -> str:
    """The official `process_one` normalization; no number or abbreviation normalization."""
    if lang not in ("en", "zh"):
        raise ValueError(f"lang must be 'en' or 'zh', got {lang!r}")
    text = text.translate(_DELETE_PUNCTUATION)
    # A single non-overlapping pass, exactly as the official script; jiwer collapses what is left.
    text = text.replace("  ", " ")
    if lang == "zh":
        # Every character becomes a token (a CER), Latin letters and existing spaces included.
        return " ".join(text)
    return text.lower()


@dataclass(frozen=True)
class UtteranceWer:
    reference_norm: str
    hypothesis_norm: str
    wer: float
    substitutions: int
    deletions: int
    insertions: int
    hits: int
    ref_words: int


def utterance_wer(reference: str, hypothesis: str, lang: str = "en") -> UtteranceWer:
    """WER of one utterance after normalizing both sides. An empty hypothesis scores 1.0."""
    ref, hyp = normalize(reference, lang), normalize(hypothesis, lang)
    if not ref.split():
        # jiwer 4 would return a number here, but the official jiwer-3 code raised: no defined WER.
        raise WerError(f"reference {reference!r} has no words after normalization")
    out = jiwer.process_words(ref, hyp)
    return UtteranceWer(
        reference_norm=ref,
        hypothesis_norm=hyp,
        wer=float(out.wer),
        substitutions=out.substitutions,
        deletions=out.deletions,
        insertions=out.insertions,
        hits=out.hits,
        ref_words=out.hits + out.substitutions + out.deletions,
    )


@dataclass(frozen=True)
class WerRecord:
    """One row of the report. `failure` is None for a scored row; otherwise the scores are None."""

    utt_id: str
    reference: str
    hypothesis: str | None = None
    reference_norm: str | None = None
    hypothesis_norm: str | None = None
    wer: float | None = None
    substitutions: int | None = None
    deletions: int | None = None
    insertions: int | None = None
    hits: int | None = None
    ref_words: int | None = None
    failure: str | None = None

    @classmethod
    def scored(cls, utt_id: str, reference: str, hypothesis: str, lang: str = "en") -> WerRecord:
        try:
            score = utterance_wer(reference, hypothesis, lang)
        except WerError as e:
            return cls(utt_id, reference, hypothesis, failure=str(e))
        return cls(utt_id, reference, hypothesis, **asdict(score))

    @classmethod
    def failed(cls, utt_id: str, reference: str, reason: str) -> WerRecord:
        return cls(utt_id, reference, failure=reason)


@dataclass
class WerReport:
    records: list[WerRecord]
    lang: str = "en"
    asr_model: str | None = None
    protocol: str = PROTOCOL

    def summary(self) -> dict:
        """Official headline (macro mean ×100, 3 decimals) plus the extra aggregates of §2.6."""
        scored = [r for r in self.records if r.failure is None]
        wers = np.array([r.wer for r in scored], dtype=np.float64)
        errors = sum(r.substitutions + r.deletions + r.insertions for r in scored)
        ref_words = sum(r.ref_words for r in scored)
        # Strict: a failed row counts as a total miss, so dropping outputs cannot improve the score.
        strict = np.array([1.0 if r.failure else r.wer for r in self.records], dtype=np.float64)
        return {
            "protocol": self.protocol,
            "lang": self.lang,
            "utterances": len(self.records),
            "evaluated": len(scored),
            "failures": len(self.records) - len(scored),
            "wer_mean_x100": _x100(np.mean(wers)) if len(wers) else None,
            "wer_corpus_x100": _x100(np.float64(errors) / ref_words) if ref_words else None,
            "wer_median_x100": _x100(np.median(wers)) if len(wers) else None,
            "over_50_count": int(np.sum(wers > 0.5)),
            "wer_strict_mean_x100": _x100(np.mean(strict)) if len(strict) else None,
        }

    def to_json(self, indent: int | None = 2) -> str:
        body = {
            "summary": self.summary(),
            "asr_model": self.asr_model,
            "records": [asdict(r) for r in self.records],
        }
        return json.dumps(body, ensure_ascii=False, indent=indent)


def _x100(value: np.floating) -> float:
    # numpy's round on the np.float64, as average_wer.py does, so ties round the same way.
    return float(round(value * 100, 3))


def resample_to_16k(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """FFT resampling as run_wer.py does it, including its truncating `int()` of the length."""
    if sample_rate == ASR_SAMPLE_RATE:
        return audio
    import scipy.signal

    return scipy.signal.resample(audio, int(len(audio) * ASR_SAMPLE_RATE / sample_rate))


class WhisperASR:
    """English Whisper transcription, decoded like the official script: fp32, greedy, no
    timestamps, the `<|en|><|transcribe|>` prompt. Every input is padded to 30 s by the feature
    extractor, so batching only stacks equal-shaped features and does not change what each
    utterance sees. `max_new_tokens=None` keeps the checkpoint's own limit, as the official run."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", batch_size: int = 8,
                 max_new_tokens: int | None = None):
        import torch
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"{model_dir}: Whisper model directory not found")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        try:
            self.processor = WhisperProcessor.from_pretrained(model_dir, local_files_only=True)
            # transformers 5 honours a checkpoint's float16 dtype; the protocol is fp32.
            self.model = WhisperForConditionalGeneration.from_pretrained(
                model_dir, local_files_only=True, torch_dtype=torch.float32
            )
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{model_dir}: cannot load Whisper: {e}") from e
        self.model.to(device).eval()
        self.device = device
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens

    def transcribe(self, audios: list[tuple[np.ndarray, int]]) -> list[str]:
        """`audios` are (mono waveform, sample rate) pairs; returns one transcript per input."""
        texts: list[str] = []
        for start in range(0, len(audios), self.batch_size):
            texts.extend(self._transcribe_batch(audios[start : start + self.batch_size]))
        return texts

    def _features(self, audio: np.ndarray, sample_rate: int):
        # One call per utterance so each feature tensor is computed exactly as in the official loop.
        audio = resample_to_16k(np.asarray(audio, dtype=np.float64), sample_rate)
        return self.processor(audio, sampling_rate=ASR_SAMPLE_RATE, return_tensors="pt").input_features

    def _transcribe_batch(self, batch: list[tuple[np.ndarray, int]]) -> list[str]:
        import torch

        features = torch.cat([self._features(a, sr) for a, sr in batch]).to(self.device)
        limits = {} if self.max_new_tokens is None else {"max_new_tokens": self.max_new_tokens}
        with torch.inference_mode():
            ids = self.model.generate(
                features, language="en", task="transcribe", return_timestamps=False,
                num_beams=1, do_sample=False, **limits,
            )
        return self.processor.batch_decode(ids, skip_special_tokens=True)


def read_wav(path: Path) -> tuple[tuple[np.ndarray, int] | None, str | None]:
    """(audio, sample rate) of the first channel, or None and the reason it cannot be scored."""
    if not path.is_file():
        return None, f"missing wav: {path.name}"
    try:
        audio, sample_rate = sf.read(path, always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError) as e:
        return None, f"unreadable wav: {e}"
    if audio.shape[0] == 0:
        return None, "empty wav"
    return (audio[:, 0], sample_rate), None


def evaluate_wer(
    audio_dir: Path,
    items: list[MetaItem],
    asr_model_dir: Path,
    device: str = "cpu",
    lang: str = "en",
    batch_size: int = 8,
    progress: bool = True,
    max_new_tokens: int | None = None,
) -> WerReport:
    """Transcribe `<audio_dir>/<utt_id>.wav` for every item and score it against `target_text`.

    Unlike the official script, a row without usable audio is kept as a failure, so the report
    always has one record per item, in order."""
    if lang != "en":
        raise WerError(f"WER for lang={lang!r} is not supported: only 'en' (Whisper) is implemented; "
                       "'zh' needs FunASR paraformer-zh")
    asr = WhisperASR(asr_model_dir, device=device, batch_size=batch_size, max_new_tokens=max_new_tokens)
    audio_dir = Path(audio_dir)
    records: list[WerRecord] = []
    with tqdm(total=len(items), desc="WER", unit="utt", disable=not progress) as bar:
        # Read and transcribe one batch at a time so memory stays bounded on the full test set.
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            records.extend(_evaluate_chunk(asr, audio_dir, chunk, lang))
            bar.update(len(chunk))
    return WerReport(records, lang=lang, asr_model=str(asr_model_dir))


def _evaluate_chunk(asr: WhisperASR, audio_dir: Path, chunk: list[MetaItem], lang: str) -> list[WerRecord]:
    loaded = [read_wav(audio_dir / f"{item.utt_id}.wav") for item in chunk]
    texts = iter(asr.transcribe([audio for audio, _ in loaded if audio is not None]))
    records = []
    for item, (audio, failure) in zip(chunk, loaded):
        if audio is None:
            records.append(WerRecord.failed(item.utt_id, item.target_text, failure))
        else:
            records.append(WerRecord.scored(item.utt_id, item.target_text, next(texts), lang))
    return records
