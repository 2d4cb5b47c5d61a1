"""Stored voices: a reference recording and its transcript, encoded once, reused by name."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from intone.errors import InvalidRequestError
from intone.protocol import VoiceReference

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Names clients send without asking what a server has; they mean "the model's default voice" here.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer",
                           "verse", "marin", "cedar"})
VLLM_OMNI_PRESETS = frozenset({"vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna",
                               "sohee"})  # Qwen3-TTS's speakers; "vivian" is vLLM-Omni's default
PRESET_VOICES = OPENAI_VOICES | VLLM_OMNI_PRESETS | {"default"}

log = logging.getLogger(__name__)


class VoiceExists(InvalidRequestError):
    """Answered with 409."""


class UnknownVoice(InvalidRequestError):
    """Answered with 404 on delete, 400 in a speech request."""


@dataclass
class VoiceInfo:
    name: str
    transcript: str
    sample_rate: int
    duration_s: float
    frames: int
    created_at: float


class VoiceStore:
    """One directory per voice: meta.json, reference.npy (float32 audio), features.npz (the model's
    reference features; older voices have codes.npy)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._cache: dict[str, tuple[int, VoiceReference]] = {}  # name -> (meta.json's mtime, reference)

    def _dir(self, name: str) -> Path:
        if not NAME.fullmatch(name):
            raise InvalidRequestError("name", "use 1-64 letters, digits, '_' or '-'")
        return self.root / name

    def add(self, name: str, transcript: str, audio: np.ndarray, sample_rate: int,
            features: dict[str, np.ndarray]) -> VoiceInfo:
        folder = self._dir(name)
        if not transcript.strip():
            raise InvalidRequestError("transcript", "must not be empty")
        if folder.exists():
            raise VoiceExists("name", f"voice {name!r} already exists")
        tmp = self.root / f".{name}.{time.monotonic_ns()}"
        tmp.mkdir()
        frames = int(next(iter(features.values())).shape[-1])
        info = VoiceInfo(name, transcript, sample_rate, len(audio) / sample_rate, frames, time.time())
        np.save(tmp / "reference.npy", audio.astype(np.float32))
        np.savez(tmp / "features.npz", **features)
        (tmp / "meta.json").write_text(json.dumps(asdict(info)))
        tmp.rename(folder)  # a voice appears whole or not at all
        return info

    def list(self) -> list[VoiceInfo]:
        out = []
        for meta in sorted(self.root.glob("*/meta.json")):
            try:
                out.append(VoiceInfo(**json.loads(meta.read_text())))
            except (OSError, ValueError, TypeError) as e:  # one broken voice must not hide the others
                log.warning("skipping the stored voice in %s: unreadable meta.json (%s)", meta.parent, e)
        return out

    def delete(self, name: str) -> None:
        folder = self._dir(name)
        if not folder.exists():
            raise UnknownVoice("name", f"unknown voice {name!r}")
        shutil.rmtree(folder)
        self._cache.pop(name, None)

    def reference(self, name: str) -> VoiceReference:
        """The stored transcript and features; the audio is never re-encoded. The cache is checked
        against the voice's meta.json, so a voice deleted or replaced by another server sharing the
        directory (Ray Serve replicas) is not served from memory."""
        folder = self._dir(name) if NAME.fullmatch(name) else None
        try:
            stamp = (folder / "meta.json").stat().st_mtime_ns if folder is not None else None
        except OSError:
            stamp = None
        if stamp is None:
            self._cache.pop(name, None)
            raise UnknownVoice("voice", f"unknown voice {name!r}")
        if name in self._cache and self._cache[name][0] == stamp:
            return self._cache[name][1]
        try:
            info = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError) as e:
            log.warning("stored voice %s has an unreadable meta.json (%s)", name, e)
            raise InvalidRequestError("voice", f"the stored voice {name!r} is damaged; upload it again") from None
        if (folder / "features.npz").exists():
            with np.load(folder / "features.npz") as stored:
                features = {k: stored[k] for k in stored.files}
        else:
            features = {"codes": np.load(folder / "codes.npy")}
        ref = VoiceReference(text=info["transcript"], codes=features.get("codes"), features=features)
        self._cache[name] = (stamp, ref)
        return ref


def resolve_voice(name: str | None, store: VoiceStore, aliases: dict[str, str]) -> VoiceReference | None:
    """A request's voice: an alias (--voice-alias) first, then a stored voice, then a preset name,
    which means the model's default voice (None)."""
    if name is None:
        return None
    target = aliases.get(name, name)
    if target == "default":
        return None
    try:
        return store.reference(target)
    except UnknownVoice:
        if target.lower() in PRESET_VOICES:
            return None
        if name in aliases:
            raise UnknownVoice("voice", f"{name!r} is an alias of {target!r}, which is not a stored voice") from None
        raise UnknownVoice("voice", f"unknown voice {name!r}: not a stored voice, an alias (--voice-alias) "
                                    "or a preset name (alloy, vivian, ...)") from None
