"""Seed-TTS meta lists (`meta.lst`), the item type that the benchmark and the evaluators share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


def write_meta_list(items: list[MetaItem], path: Path) -> None:
    """Write items as a Seed-TTS list with wav paths relative to the list's directory."""
    lines = []
    for it in items:
        wav = it.prompt_wav.relative_to(path.parent) if it.prompt_wav else ""
        lines.append(f"{it.utt_id}|{it.prompt_text or ''}|{wav}|{it.target_text}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
