"""Frame tracing (one JSON line per chunk sent) and the audit that checks a trace."""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable

import torch

from intone.models.base import Prompt


class FrameTracer:
    def __init__(self, path: str | Path):
        self._file: IO[str] = open(path, "a", buffering=1)

    def record(self, request_id: str, start: int, end: int, context: int, finished: bool, **extra) -> None:
        row = dict(request_id=request_id, start=start, end=end, context=context, finished=finished, **extra)
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


def wall_clock(times) -> dict[str, float]:
    """A finished request's instants as Unix seconds, for a terminal trace row: when it reached the engine
    core, when its first audio and its end were sent (a client on the same host joins them to its own clock:
    what came before the engine and after it, `intone.bench.tail`), and when the API had parsed it."""
    now_perf, now_unix = time.perf_counter(), time.time()
    marks = dict(arrived_at=times.arrived, first_audio_at=times.first_delivered, finished_at=now_perf)
    out = {k: round(now_unix - (now_perf - v), 6) for k, v in marks.items() if v}
    return out | ({"received_at": round(times.received_at, 6)} if times.received_at else {})


def prompt_digest(prompt: Prompt) -> dict[str, str]:
    """Digests of what a request's AR reads (its prompt's tokens and codes) and of what its codec reads besides
    (the model's conditioning, e.g. a reference's mel): two requests with the same digests and the same seed
    should draw the same tokens (invariant 3), whatever else ran beside them."""
    conditioning = prompt.conditioning
    parts = vars(conditioning).values() if hasattr(conditioning, "__dict__") else (
        conditioning.values() if isinstance(conditioning, dict) else [])
    return {"prompt": _digest([prompt.tokens, prompt.codes]),
            "conditioning": _digest([t for t in parts if isinstance(t, torch.Tensor)])}


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class RequestAudit:
    request_id: str
    frames: int = 0  # frames the request released in all (end of its terminal chunk)
    missing: list[int] = field(default_factory=list)
    repeated: list[int] = field(default_factory=list)
    out_of_order: int = 0
    terminals: int = 0

    @property
    def exact(self) -> bool:
        return not self.missing and not self.repeated and not self.out_of_order and self.terminals == 1


def audit(rows: Iterable[dict]) -> dict[str, RequestAudit]:
    spans: dict[str, list[tuple[int, int, bool]]] = defaultdict(list)
    for row in rows:
        spans[row["request_id"]].append((row["start"], row["end"], bool(row["finished"])))
    report = {}
    for rid, chunks in spans.items():
        a = RequestAudit(rid, terminals=sum(f for _, _, f in chunks))
        terminal_ends = [e for _, e, f in chunks if f]
        a.frames = max(terminal_ends) if terminal_ends else max(e for _, e, _ in chunks)
        seen: dict[int, int] = defaultdict(int)
        cursor = 0
        for start, end, _ in chunks:
            if start != cursor:
                a.out_of_order += 1
            cursor = end
            for f in range(start, end):
                seen[f] += 1
        a.missing = [f for f in range(a.frames) if seen[f] == 0]
        a.repeated = sorted(f for f, n in seen.items() if n > 1)
        report[rid] = a
    return report


def audit_file(path: str | Path) -> dict[str, RequestAudit]:
    with open(path) as f:
        return audit(json.loads(line) for line in f if line.strip())
