"""Benchmark metrics, defined once.

Per request (times are seconds from the request's send):
- completion: send -> last byte (the end-to-end latency);
- first audio: send -> first non-empty audio chunk (streaming only);
- audio seconds: samples received / the model's own sample rate (never an assumed 24 kHz);
- RTF: completion / audio seconds (< 1 is faster than real time);
- inter-chunk gaps: arrival time differences of consecutive non-empty chunks;
- underrun: a simulated player starts playing at the first chunk's arrival and plays every chunk
  as soon as both it has arrived and the previous one has finished; underrun is the total time
  it waits with nothing to play after starting (0 for a stream that always stays ahead); a stream's
  first stall is the (1-based) chunk the player first waited for, which tells a schedule whose first
  chunk is too short (2) from a codec that falls behind later.
Per run (the measured phase only, warm-up excluded): requests/s = completed requests / wall time;
audio-s/s = sum of audio seconds / wall time. Failed requests are counted, never dropped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    request_id: str
    utt_id: str
    ok: bool = False
    error: str | None = None
    sent_at: float = 0.0  # wall clock, for ordering
    started_at: float = 0.0  # wall clock when its clock started (its body built; joined to the server's trace)
    completion_s: float | None = None
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival s, audio s) per non-empty chunk
    audio_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reference: str | None = None  # the reference clip sent (file name, #variant for a re-gained copy)
    server_id: str | None = None  # the server's id for it (X-Request-Id), to find it in the server's trace

    @property
    def first_audio_s(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def rtf(self) -> float | None:
        return self.completion_s / self.audio_s if self.ok and self.audio_s > 0 else None

    @property
    def gaps(self) -> list[float]:
        arrivals = [a for a, _ in self.chunks]
        return [b - a for a, b in zip(arrivals, arrivals[1:])]

    @property
    def underrun_s(self) -> float:
        return underrun(self.chunks)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(first_audio_s=self.first_audio_s, rtf=self.rtf, underrun_s=self.underrun_s)
        return d


def stalls(chunks: list[tuple[float, float]]) -> list[tuple[int, float]]:
    """(1-based chunk index, seconds waited for it) for every chunk a player that starts at the first
    arrival (see the module docstring) had to wait for."""
    out, play_end = [], chunks[0][0] if chunks else 0.0
    for i, (arrival, duration) in enumerate(chunks, 1):
        if arrival > play_end:
            out.append((i, arrival - play_end))
        play_end = max(arrival, play_end) + duration
    return out


def underrun(chunks: list[tuple[float, float]]) -> float:
    """Total stall of a player that starts at the first arrival."""
    return sum(s for _, s in stalls(chunks))


def first_stalls(records: list[RequestRecord]) -> dict[str, int]:
    """How many streams first stalled at chunk 2, 3, 4 and later."""
    firsts = [s[0][0] for s in (stalls(r.chunks) for r in records) if s]
    return {"2": firsts.count(2), "3": firsts.count(3), "4": firsts.count(4), "5+": sum(i >= 5 for i in firsts)}


def _stats(values: list[float]) -> dict:
    if not values:
        return dict(mean=None, p50=None, p90=None, p99=None)
    a = np.asarray(values, dtype=float)
    return dict(mean=float(a.mean()), p50=float(np.percentile(a, 50)), p90=float(np.percentile(a, 90)),
                p99=float(np.percentile(a, 99)))


def opening_burst(records: list[RequestRecord], concurrency: int, stream: bool) -> dict | None:
    """A closed loop starts its clients together, so a level's first `concurrency` requests (by send time) reach
    the idle server at once: their latencies are that burst's, the rest's the steady state's. Per group the
    requests, the metric's stats (first audio for streams, else completion) and the streams that stalled; None
    unless the level holds more than twice `concurrency` requests."""
    split = opening_split(records, concurrency, lambda r: r.sent_at)
    if split is None:
        return None
    metric = client_metric(stream)

    def group(rows: list[RequestRecord]) -> dict:
        ok = [r for r in rows if r.ok]
        values = [v for v in (getattr(r, metric) for r in ok) if v is not None]
        return dict(requests=len(rows), stats=_stats(values),
                    streams_with_underrun=sum(1 for r in ok if r.underrun_s > 0) if stream else None)

    return dict(metric=metric, burst=group(split[0]), rest=group(split[1]))


def client_metric(stream: bool) -> str:
    """The latency a level is judged by: a stream's first audio, a whole response's completion."""
    return "first_audio_s" if stream else "completion_s"


def opening_split(rows: list, concurrency: int, sent_at) -> tuple[list, list] | None:
    """A closed loop's first `concurrency` rows by `sent_at(row)` (its opening burst) and the rest; None unless
    there are more than twice `concurrency` rows (else no steady state to tell the burst from)."""
    if len(rows) <= 2 * concurrency:
        return None
    ordered = sorted(rows, key=sent_at)
    return ordered[:concurrency], ordered[concurrency:]


def summarize(records: list[RequestRecord], wall_s: float, stream: bool) -> dict:
    ok = [r for r in records if r.ok]
    audio = sum(r.audio_s for r in ok)
    gaps = [g for r in ok for g in r.gaps]
    return dict(
        requests=len(records), completed=len(ok), failed=len(records) - len(ok), wall_s=wall_s,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        audio_s_per_s=audio / wall_s if wall_s > 0 else 0.0,
        mean_audio_s=audio / len(ok) if ok else None,
        completion_s=_stats([r.completion_s for r in ok]),
        first_audio_s=_stats([r.first_audio_s for r in ok if r.first_audio_s is not None]) if stream else None,
        rtf=_stats([r.rtf for r in ok if r.rtf is not None]),
        inter_chunk_gap_s=_stats(gaps) if stream else None,
        underrun_s=_stats([r.underrun_s for r in ok]) if stream else None,
        streams_with_underrun=sum(1 for r in ok if r.underrun_s > 0) if stream else None,
        first_stall_chunk=first_stalls(ok) if stream else None,
    )
