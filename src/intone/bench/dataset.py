"""A built-in synthetic benchmark set that needs no download (Seed-TTS-like items: `eval.meta`)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import soundfile as sf

from intone.eval.meta import MetaItem


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
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = pitch * (1 + 0.1 * np.sin(2 * np.pi * 0.5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = np.clip(np.sin(2 * np.pi * 4 * t + g.uniform(0, 6)), 0, None) ** 0.5
    audio = 0.2 * voiced * envelope + 0.005 * g.standard_normal(len(t))
    sf.write(path, (audio / max(np.abs(audio).max(), 1e-6) * 0.5).astype(np.float32), rate)
