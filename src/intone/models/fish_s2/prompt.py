"""Tokenizer wrapper and the official ChatML prompt layout of Fish S2 Pro.

Each text part is tokenized on its own (no BOS/EOS added), exactly as the official
`ContentSequence.encode` does, so BPE never merges across part boundaries. Reference codes
go in as a bare run of semantic tokens (no `<|audio_start|>` wrapper: that is vLLM-Omni's
layout, not the official one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor

from intone.errors import InvalidRequestError, ModelLoadError
from intone.models.base import Prompt

IM_START, IM_END, VOICE = "<|im_start|>", "<|im_end|>", "<|voice|>"
CONTROL_TOKENS = (
    "<|endoftext|>", "<|pad|>", IM_START, IM_END, "<|phoneme_start|>", "<|phoneme_end|>",
    "<|text|>", VOICE, "<|interleave|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
)
SEMANTIC_TEMPLATE = "<|semantic:{}|>"
NUM_SEMANTIC = 4096

SYSTEM_PLAIN = "convert the provided text to speech"
SYSTEM_CLONE_HEAD = "convert the provided text to speech reference to the following:\n\nText:\n"
SYSTEM_CLONE_TAIL = "\n\nSpeech:\n"

_SPEAKER_TAG = re.compile(r"<\|speaker:\d+\|>")
_ANY_CONTROL = re.compile(r"<\|[^<>]*?\|>")


class FishTokenizer:
    def __init__(self, model_dir: Path):
        path = Path(model_dir) / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exceptions with Rust messages
            raise ModelLoadError(f"{path}: cannot load tokenizer ({e})") from None
        self.ids = {t: self._require(t, path) for t in (IM_START, IM_END, VOICE)}
        first = self._require(SEMANTIC_TEMPLATE.format(0), path)
        last = self._require(SEMANTIC_TEMPLATE.format(NUM_SEMANTIC - 1), path)
        if last - first != NUM_SEMANTIC - 1:
            raise ModelLoadError(f"{path}: semantic tokens are not contiguous ({first}..{last})")
        self.semantic_begin, self.semantic_end = first, last
        self.im_end_id = self.ids[IM_END]

    def _require(self, token: str, path: Path) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{path}: token {token!r} is missing from the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class Reference:
    """A voice-cloning reference: its transcript and its codec codes [K, T]."""

    text: str
    codes: Tensor


def check_text(text: str, field: str) -> str:
    if not text or not text.strip():
        raise InvalidRequestError(field, "must not be empty")
    for m in _ANY_CONTROL.finditer(text):
        if not _SPEAKER_TAG.fullmatch(m.group(0)):
            raise InvalidRequestError(field, f"control token {m.group(0)!r} is not allowed in text")
    return text


def speaker_turns(text: str) -> str:
    """Official `generate_long` text handling: with `<|speaker:N|>` tags, text before the first
    tag is dropped and the stripped turns are joined by newlines; untagged text is unchanged.

    The official loop also splits more than 5 speakers or more than `chunk_length` bytes into
    several generations chained as a conversation; intone keeps all turns in one user turn.
    """
    parts = re.split(f"({_SPEAKER_TAG.pattern})", text)
    turns = []
    for i, part in enumerate(parts):
        if _SPEAKER_TAG.fullmatch(part.strip()):
            turns.append((part.strip() + (parts[i + 1] if i + 1 < len(parts) else "")).strip())
    return "\n".join(turns) if turns else text


def build_prompt(tok: FishTokenizer, text: str, references: list[Reference], num_codebooks: int) -> Prompt:
    """The official `generate_long` prompt for one user turn."""
    check_text(text, "input")
    text = speaker_turns(text)
    parts: list[str | Tensor] = [f"{IM_START}system\n"]
    if references:
        for i, ref in enumerate(references):
            check_text(ref.text, f"references.{i}.text")
        # An untagged reference text gets the tag of its index.
        tagged = [r.text if _SPEAKER_TAG.search(r.text) else f"<|speaker:{i}|>{r.text}" for i, r in enumerate(references)]
        codes = torch.cat([r.codes.long() for r in references], dim=1)
        if codes.shape[0] != num_codebooks:
            raise InvalidRequestError("references", f"codes have {codes.shape[0]} codebooks, expected {num_codebooks}")
        parts += [SYSTEM_CLONE_HEAD, "\n".join(tagged), SYSTEM_CLONE_TAIL, codes]
    else:
        parts.append(SYSTEM_PLAIN)
    parts += [f"{IM_END}\n", f"{IM_START}user\n", text, f"{IM_END}\n", f"{IM_START}assistant\n{VOICE}"]

    tokens, code_rows = [], []
    for part in parts:
        if isinstance(part, str):
            ids = torch.tensor(tok.encode(part), dtype=torch.long)
            tokens.append(ids)
            code_rows.append(torch.zeros(len(ids), num_codebooks, dtype=torch.long))
        else:
            tokens.append(part[0] + tok.semantic_begin)
            code_rows.append(part.t())
    return Prompt(tokens=torch.cat(tokens), codes=torch.cat(code_rows))
