"""CosyVoice3's text frontend: the official `text_normalize` (wetext normalisation, then sentences
of ~60-80 units), as the official client applies it to the text to speak and, unsplit, to a
reference's transcript. Torch-free: it runs in the API process, beside the request's validation.

Rules (CosyVoice `frontend.text_normalize` and `utils/frontend_utils.py`, wetext branch):
- text with a `<|...|>` control token is left exactly as sent (and never split);
- Chinese text (any CJK ideograph): wetext TN, newlines dropped, spaces kept only between two
  ASCII characters, superscripts 2/3 spoken, '.' -> '。', ' - ' -> '，', some brackets dropped,
  trailing commas -> '。'; sentences end at 。？！；：、.?!; and are packed by characters;
- other text: wetext TN, any digits left spelled out in English; sentences end at .?!;: and are
  packed by Qwen2 tokens;
- packing: a sentence (with a closing quote that follows it) joins the current segment unless that
  would pass 80 units while the segment already has more than 60; a last segment under 20 units
  joins the one before; segments of punctuation only are dropped.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable

import regex

log = logging.getLogger(__name__)
CJK = re.compile(r"[\u4e00-\u9fff]")
MAX_UNITS, MIN_UNITS, MERGE_UNITS = 80, 60, 20
ZH_ENDS = frozenset("。？！；：、.?!;")
EN_ENDS = frozenset(".?!;:")
CLOSING_QUOTES = frozenset('"”')
ONLY_PUNCTUATION = regex.compile(r"[\p{P}\p{S}]*")


@functools.cache
def _normalizer():
    from wetext import Normalizer

    return Normalizer(remove_erhua=False)


def text_normalized(text: str) -> str:
    """wetext's TN, or the text unchanged where wetext has nothing to read (punctuation only) or fails
    on an input (it asserts on some): an odd input is read as written, never a server error."""
    if ONLY_PUNCTUATION.fullmatch(text.strip()):
        return text
    try:
        return _normalizer().normalize(text)
    except Exception:  # noqa: BLE001
        log.warning("wetext could not normalise %r; it is read as written", text[:80], exc_info=True)
        return text


@functools.cache
def _inflect():
    import inflect

    return inflect.engine()


def spell_digits(text: str) -> str:
    """Each run of digits as English words (inflect), the rest unchanged."""
    return re.sub(r"\d+", lambda m: _inflect().number_to_words(m.group()), text)


def keep_ascii_spaces(text: str) -> str:
    """Drop spaces except those between two non-space ASCII characters (Chinese text)."""
    out = []
    for i, c in enumerate(text):
        if c != " ":
            out.append(c)
            continue
        before = text[i - 1] if i > 0 else " "
        after = text[i + 1] if i + 1 < len(text) else " "
        if before != " " and after != " " and before.isascii() and after.isascii():
            out.append(c)
    return "".join(out)


def _chinese(text: str) -> str:
    text = text_normalized(text).replace("\n", "")
    text = keep_ascii_spaces(text).replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for mark in ("（", "）", "【", "】", "`"):
        text = text.replace(mark, "")
    text = text.replace("——", " ")
    return re.sub(r"[，,、]+$", "。", text)


def sentences(text: str, ends: frozenset, full_stop: str) -> list[str]:
    """Cut after each sentence-ending mark (a closing quote right after it stays with it)."""
    if text[-1] not in ends:
        text += full_stop
    out, start, i = [], 0, 0
    while i < len(text):
        if text[i] in ends:
            end = i + 1
            if end < len(text) and text[end] in CLOSING_QUOTES:
                end += 1
            if text[start:i]:
                out.append(text[start:end])
            elif end > i + 1 and out:  # a quote after a bare mark still closes the sentence before
                out[-1] += text[i + 1:end]
            start, i = end, end
        else:
            i += 1
    return out


def pack(parts: list[str], units: Callable[[str], int]) -> list[str]:
    segments, current = [], ""
    for part in parts:
        if units(current + part) > MAX_UNITS and units(current) > MIN_UNITS:
            segments.append(current)
            current = ""
        current += part
    if current:
        if segments and units(current) < MERGE_UNITS:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


def as_sent(text: str) -> bool:
    """Left exactly as sent: text with a control token, or nothing but blanks."""
    return "<|" in text and "|>" in text or not text.strip()


class CosyTextFrontend:
    def __init__(self, count_tokens: Callable[[str], int]):
        """count_tokens: Qwen2 tokens of a text (the talker's tokenizer), the unit of English segments."""
        self.count_tokens = count_tokens
        _normalizer()  # now: a missing wetext fails the start-up, not each request

    def units(self, segment: str, whole: str) -> int:
        """A segment's length as the packer counts it: characters when the whole text is Chinese, else tokens."""
        return len(segment) if CJK.search(whole) else self.count_tokens(segment)

    def normalize(self, text: str) -> str:
        """The text as the model should read it (one piece; a reference transcript)."""
        if as_sent(text):
            return text
        text = text.strip()
        return _chinese(text) if CJK.search(text) else spell_digits(text_normalized(text))

    def segments(self, text: str) -> list[str]:
        """The text to speak, normalised, as the sentences-or-so the model speaks one at a time
        (none when it is only punctuation: nothing to speak)."""
        if as_sent(text):
            return [text]
        normal = self.normalize(text)
        if not normal:
            return [text]
        if CJK.search(text):
            parts = pack(sentences(normal, ZH_ENDS, "。"), len)
        else:
            parts = pack(sentences(normal, EN_ENDS, "."), self.count_tokens)
        return [p for p in parts if not ONLY_PUNCTUATION.fullmatch(p)]
