"""Benchmark datasets: Seed-TTS meta lists, and a built-in synthetic set that needs no download."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from intone.errors import IntoneError


@dataclass(frozen=True)
class MetaItem:
    utt_id: str
    target_text: str
    prompt_text: str | None = None
    prompt_wav: Path | None = None  # absolute
    line: int = 0  # 1-based line number in the list, for messages


class MetaListError(IntoneError):
    pass


def parse_meta_list(path: str | Path) -> list[MetaItem]:
    """Seed-TTS `meta.lst`: `utt|prompt_text|prompt_wav|target_text` (also the 2-, 3- and 5-field
    shapes of the official parser). Relative wav paths are relative to the list's directory.
    Blank lines are skipped; any other malformed line is an error naming its line number."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise MetaListError(f"{path}: file not found") from None
    items, seen = [], set()
    for n, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) == 2:
            utt, target, prompt_text, wav = fields[0], fields[1], None, None
        elif len(fields) == 3:
            utt, target, wav, prompt_text = fields[0], fields[1], fields[2], None
        elif len(fields) in (4, 5):
            utt, prompt_text, wav, target = fields[0], fields[1], fields[2], fields[3]
        else:
            raise MetaListError(f"{path}:{n}: expected 2 to 5 '|'-separated fields, got {len(fields)}")
        utt = utt.strip()
        if not utt:
            raise MetaListError(f"{path}:{n}: empty utterance id")
        if not target.strip():
            raise MetaListError(f"{path}:{n}: empty target text")
        if utt in seen:
            raise MetaListError(f"{path}:{n}: duplicate utterance id {utt!r}")
        seen.add(utt)
        wav_path = None
        if wav is not None and wav.strip():
            wav_path = Path(wav.strip())
            wav_path = wav_path if wav_path.is_absolute() else (path.parent / wav_path)
        items.append(MetaItem(utt, target, prompt_text, wav_path, n))
    if not items:
        raise MetaListError(f"{path}: no utterances")
    return items


WORDS = (
    "the a of and to in is was that for on with as it his at by from they this be are which or had not but "
    "people time year world water house morning river light story music garden city friend window letter "
    "early quietly bright small long warm green old new every often never always little great open late "
    "walked found carried painted listened opened remembered followed watched answered reached began "
    "mountain station evening market bridge forest teacher journey weather kitchen picture harbor"
).split()


def synthetic_items(n: int, out_dir: Path, seed: int = 0, sample_rate: int = 16000) -> list[MetaItem]:
    """Deterministic English sentences of Seed-TTS-like length (8-30 words) with 3-8 s references.

    Reference audio is a synthetic voiced signal (harmonics of a gliding pitch, syllable-rate
    envelope), written once under out_dir/prompt-wavs; no download is needed.
    """
    rnd = random.Random(seed)
    wav_dir = Path(out_dir) / "prompt-wavs"
    wav_dir.mkdir(parents=True, exist_ok=True)
    items = []
    for i in range(n):
        target = _sentence(rnd, rnd.randint(8, 30))
        prompt_text = _sentence(rnd, rnd.randint(6, 16))
        wav = wav_dir / f"synthetic_{seed}_{i:05d}.wav"
        # drawn whether or not the file exists, so a second call gives the same items
        seconds, pitch, voice_seed = rnd.uniform(3.0, 8.0), rnd.uniform(90, 240), rnd.randint(0, 2**31)
        if not wav.exists():
            _write_voice(wav, seconds, pitch, sample_rate, voice_seed)
        items.append(MetaItem(f"synthetic_{seed}_{i:05d}", target, prompt_text, wav, i + 1))
    return items


def _sentence(rnd: random.Random, words: int) -> str:
    text = " ".join(rnd.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + rnd.choice(".!?.")


def _write_voice(path: Path, seconds: float, pitch: float, rate: int, seed: int) -> None:
    import soundfile as sf

    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = pitch * (1 + 0.1 * np.sin(2 * np.pi * 0.5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = np.clip(np.sin(2 * np.pi * 4 * t + g.uniform(0, 6)), 0, None) ** 0.5
    audio = 0.2 * voiced * envelope + 0.005 * g.standard_normal(len(t))
    sf.write(path, (audio / max(np.abs(audio).max(), 1e-6) * 0.5).astype(np.float32), rate)


def write_meta_list(items: list[MetaItem], path: Path) -> None:
    """Write items as a Seed-TTS list with wav paths relative to the list's directory."""
    lines = []
    for it in items:
        wav = it.prompt_wav.relative_to(path.parent) if it.prompt_wav else ""
        lines.append(f"{it.utt_id}|{it.prompt_text or ''}|{wav}|{it.target_text}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
