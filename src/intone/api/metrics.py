"""Prometheus metrics of the API server; engine occupancy is read from the core at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 8, 13, 20, 30, 60)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.in_flight = Gauge("intone_requests_in_flight", "Speech requests the API server is serving", registry=r)
        self.running = Gauge("intone_requests_running", "Requests in the engine's AR batch", registry=r)
        self.waiting = Gauge("intone_requests_waiting", "Requests queued in the engine", registry=r)
        self.kv_usage = Gauge("intone_kv_cache_usage_ratio", "Share of KV cache blocks in use", registry=r)
        self.kv_used = Gauge("intone_kv_cache_blocks_used", "KV cache blocks in use", registry=r)
        self.ttfa = Histogram("intone_time_to_first_audio_seconds", "Request start to first audio byte",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram("intone_request_rtf", "Engine time / audio duration, per finished request",
                             buckets=RTF_BUCKETS, registry=r)
        self.audio_seconds = Counter("intone_audio_seconds", "Audio produced, in seconds", registry=r)
        self.frames = Counter("intone_frames", "Codec frames produced", registry=r)
        self.outcomes = Counter("intone_requests", "Finished speech requests by outcome", ["outcome"], registry=r)

    def finished(self, outcome: str, audio_seconds: float = 0.0, frames: int = 0, engine_s: float | None = None):
        self.outcomes.labels(outcome).inc()
        if audio_seconds > 0:
            self.audio_seconds.inc(audio_seconds)
            self.frames.inc(frames)
            if engine_s is not None:
                self.rtf.observe(engine_s / audio_seconds)

    def engine_state(self, stats: dict) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        used = stats["kv_blocks_total"] - stats["kv_blocks_free"]
        self.kv_used.set(used)
        self.kv_usage.set(used / max(stats["kv_blocks_total"], 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
