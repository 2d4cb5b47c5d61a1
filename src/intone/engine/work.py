"""How much work an open request still owes: the frames the engine has yet to make for it.

Data-parallel routing (api/engine_pool.py) sends a request to the engine that owes the fewest
frames, not the one with the fewest requests: a 30 s utterance costs an engine thirty times the
AR steps and codec windows of a 1 s one. What a request will cost is known only roughly when it
arrives, so it is estimated, then corrected as the engine reports progress:

- expected frames: with `ignore_eos` exactly `max_new_tokens`; otherwise the text's speaking time
  (narrow characters at ~14 per second, wide ones, CJK ideographs and kana, at ~4.5 per second)
  times the model's frame rate, at least `min_new_tokens` and at most `max_new_tokens`;
- frames made: the furthest of the frames its chunks have delivered and the frames the core says it
  has generated (every heartbeat carries them, so a non-streamed request shows progress too);
- owed: expected - made, but at least 1 while the request is open (an utterance that runs past its
  estimate is near its end, yet still holds a seat).
"""

from __future__ import annotations

import math
import unicodedata

NARROW_CHARS_PER_S = 14.0  # English read aloud: ~150 words a minute
WIDE_CHARS_PER_S = 4.5  # Mandarin read aloud: ~270 characters a minute


def speaking_seconds(text: str) -> float:
    narrow = wide = 0
    for ch in text:
        if ch.isspace():
            continue
        if unicodedata.east_asian_width(ch) in ("W", "F"):
            wide += 1
        else:
            narrow += 1
    return narrow / NARROW_CHARS_PER_S + wide / WIDE_CHARS_PER_S


def expected_frames(request, frames_per_second: float) -> int:
    """The frames `request` (a SynthesisRequest) will probably make, by the rules above."""
    params = request.params
    if params.ignore_eos:
        return max(1, params.max_new_tokens)
    estimate = math.ceil(speaking_seconds(request.text) * frames_per_second)
    return max(1, min(params.max_new_tokens, max(estimate, params.min_new_tokens)))


class OpenWork:
    """The requests an engine client has open: expected and made frames of each."""

    def __init__(self):
        self._requests: dict[str, list[int]] = {}

    def open(self, request_id: str, expected: int) -> None:
        self._requests[request_id] = [expected, 0]

    def progress(self, request_id: str, frames: int) -> None:
        entry = self._requests.get(request_id)
        if entry is not None and frames > entry[1]:
            entry[1] = frames

    def close(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def owed(self) -> int:
        return sum(max(expected - made, 1) for expected, made in self._requests.values())

    def __len__(self) -> int:
        return len(self._requests)
