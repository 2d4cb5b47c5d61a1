"""Prometheus metrics of the API server; engine occupancy is read from the core at scrape time.

With several engine cores (data parallel) the unlabelled engine series are their sum (a core that
restarts starts its counters at 0 again, which the sum shows as a counter reset), and the
`intone_engine_*{engine="k"}` series are per core: up, frames owed, running, waiting, KV usage,
reference-cache hits and misses, and the requests routed to it (`reason`: load or affinity).

Per finished request, `intone_request_stage_seconds{stage=...}` says where its time went: the API's
own stages (`api_in`: HTTP request parsed -> handed to the engine, i.e. reference loading and
decoding; `api_out`: terminal chunk -> response handed to the server, i.e. encoding of a whole
file) and the engine core's (the terminal chunk's `timings`: `intone.protocol.ENGINE_STAGES`).
The engine's counters (reference cache, frontend batches, decode graph replays
against eager steps, ...) are exported from its snapshot at each scrape, when it has them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from intone.protocol import ENGINE_STAGES, STEP_COMPANY

LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 8, 13, 20, 30, 60)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


# what each of STEP_COMPANY means, for the help texts: what ran between a step's launch and its tokens' read
_COMPANY = {"prefill": "that carried a prefill", "codec+frontend": "beside both the codec's calls and the frontend's "
            "batches", "codec": "beside the codec's calls (not the frontend's)", "frontend": "beside the frontend's "
            "batches (not the codec's)", "alone": "beside neither the codec's calls nor the frontend's batches"}

# engine snapshot key -> (metric name, help). Counters render with a `_total` suffix.
ENGINE_COUNTERS = {
    "reference_cache_hits": ("intone_reference_cache_hits", "Reference-feature cache hits"),
    "prefix_cache_blocks": ("intone_prefix_cache_blocks", "KV blocks requests took from earlier prompts (ar.prefix_caching)"),
    "compiled_graphs": ("intone_compiled_graphs", "Graphs torch.compile compiled in the engine process, start-up "
                        "included (a rise while serving is a compile that requests waited for)"),
    "reference_cache_misses": ("intone_reference_cache_misses", "Reference-feature cache misses"),
    "frontend_batches": ("intone_frontend_batches", "Batched calls of the reference frontend"),
    "frontend_clips": ("intone_frontend_clips", "Reference clips encoded by the frontend"),
    "frontend_jobs": ("intone_frontend_jobs", "Requests and voice uploads taken by the frontend's workers"),
    "frontend_busy_seconds": ("intone_frontend_busy_seconds", "Seconds the frontend's workers spent on batches"),
    "frontend_queued_seconds": ("intone_frontend_queued_seconds",
                                "Seconds requests waited for a frontend worker before their batch began, summed"),
    "frontend_process_seconds": ("intone_frontend_process_seconds",
                                 "Seconds the frontend processes spent encoding their batches (frontend.process; the "
                                 "rest of the workers' busy time went to messages and waiting)"),
    "graph_replays": ("intone_graph_replays", "AR steps replayed from a captured CUDA graph"),
    "eager_decode_steps": ("intone_eager_decode_steps", "AR steps not replayed from a CUDA graph"),
    "static_steps": ("intone_static_steps", "AR steps run through the static step (ar.static_step), from a graph "
                                            "or not"),
    "frontend_graph_replays": ("intone_frontend_graph_replays",
                               "Reference-frontend network calls replayed from a CUDA graph"),
    "frontend_eager_runs": ("intone_frontend_eager_runs",
                            "Reference-frontend network calls run eagerly (a shape without a graph)"),
    "codec_graph_replays": ("intone_codec_graph_replays",
                            "Codec graph replays (CosyVoice3: each Euler step of a flow solve, and HiFT calls)"),
    "codec_eager_runs": ("intone_codec_eager_runs",
                         "Codec calls with graphs on that ran eagerly (a shape beyond them; CosyVoice3: flow "
                         "solves and HiFT calls)"),
    "steps": ("intone_engine_steps", "Engine steps"),
    "step_wait_seconds": ("intone_engine_step_wait_seconds",
                          "Seconds the engine loop waited for its AR steps' tokens (the rest of a step is host work)"),
    "step_launch_seconds": ("intone_engine_step_launch_seconds",
                            "Seconds the engine loop spent building its AR steps' inputs and launching them (host)"),
    "step_pace_seconds": ("intone_engine_step_pace_seconds",
                          "Seconds the engine loop slept before launching its AR steps (ar.min_step_ms)"),
    "loop_cpu_seconds": ("intone_engine_loop_cpu_seconds", "CPU seconds of the engine loop's thread (a step's "
                         "host time that is not CPU time is spent off the CPU: waiting for the GIL or blocked)"),
    "codec_cpu_seconds": ("intone_engine_codec_cpu_seconds", "CPU seconds of the codec worker's thread"),
    "frontend_cpu_seconds": ("intone_engine_frontend_cpu_seconds", "CPU seconds of the frontend workers' threads"),
    "process_cpu_seconds": ("intone_engine_process_cpu_seconds",
                            "CPU seconds of the engine process, every thread (native ones too)"),
    "step_gpu_seconds": ("intone_engine_step_gpu_seconds",
                         "GPU: the AR steps' spans on the loop's CUDA stream, each from the end of the step before "
                         "(waits for SMs that other streams' kernels hold, and gaps while the host launches, included)"),
    "gpu_timed_steps": ("intone_engine_gpu_timed_steps", "AR steps in intone_engine_step_gpu_seconds"),
    # the same split by what ran beside a step (exclusive; STEP_COMPANY: e.g. codec+frontend -> codec_frontend)
    **{f"step_gpu_seconds_{c}": (f"intone_engine_step_gpu_seconds_{c.replace('+', '_')}",
                                 f"GPU: the AR steps' spans (as intone_engine_step_gpu_seconds) of steps {_COMPANY[c]}")
       for c in STEP_COMPANY},
    "gpu_timed_prefill_tokens": ("intone_engine_gpu_timed_prefill_tokens",
                                 "Prompt tokens the steps in intone_engine_step_gpu_seconds_prefill computed"),
    **{f"gpu_timed_steps_{c}": (f"intone_engine_gpu_timed_steps_{c.replace('+', '_')}",
                                f"AR steps in intone_engine_step_gpu_seconds_{c.replace('+', '_')}") for c in STEP_COMPANY},
    "frames": ("intone_engine_frames", "Frames the AR steps made (one per request a step: steps x filled seats)"),
    "codec_calls": ("intone_codec_calls", "Codec stage calls"),
    "codec_seconds": ("intone_codec_busy_seconds", "Seconds the codec spent in decode calls (its worker's wall time)"),
    "codec_first_calls": ("intone_codec_first_calls", "Codec calls made only of streams' first chunks"),
    "codec_first_call_seconds": ("intone_codec_first_call_seconds",
                                 "Seconds of codec calls made only of streams' first chunks (wall time)"),
    "codec_first_call_gpu_seconds": ("intone_codec_first_call_gpu_seconds",
                                     "CosyVoice3: those calls' spans on the codec's CUDA stream"),
    "codec_first_call_flow_seconds": ("intone_codec_first_call_flow_seconds",
                                      "CosyVoice3: the flow's part of those spans (the rest is HiFT)"),
    "codec_first_call_chunks": ("intone_codec_first_call_chunks", "First chunks decoded in those calls"),
    "codec_preempted_calls": ("intone_codec_preempted_calls",
                              "Codec calls made at a pause point of a call over the backlog (schedule: preempt)"),
    "codec_padded_tokens": ("intone_codec_padded_tokens",
                            "Rows x length the codec's calls computed, padding included (CosyVoice3: the flow's "
                            "token rows; Fish: the decoder's frames)"),
    "codec_flow_seconds": ("intone_codec_flow_seconds",
                           "CosyVoice3: the flow's spans on the codec's CUDA stream (waits for SMs and host gaps included)"),
    "codec_vocoder_seconds": ("intone_codec_vocoder_seconds",
                              "CosyVoice3: HiFT's spans on the codec's CUDA stream (waits for SMs and host gaps included)"),
    "codec_useful_tokens": ("intone_codec_useful_tokens",
                            "The real part of intone_codec_padded_tokens (the rest is padding)"),
    "codec_hift_padded_frames": ("intone_codec_hift_padded_frames",
                                 "CosyVoice3: rows x mel frames HiFT's calls computed, padding included"),
    "codec_hift_useful_frames": ("intone_codec_hift_useful_frames",
                                 "CosyVoice3: the real part of intone_codec_hift_padded_frames"),
    "codec_references_ahead": ("intone_codec_references_ahead",
                               "CosyVoice3: streams' references solved ahead of their first hops "
                               "(cosyvoice3.flow.reference_ahead)"),
    "codec_prepares_skipped": ("intone_codec_prepares_skipped",
                               "Streams' prepare chunks left undone: their first hops went to a call first and "
                               "solved the reference themselves"),
    "gpu_alloc_retries": ("intone_gpu_alloc_retries", "Times the engine process's allocator found no free block, "
                          "freed its cache (waiting for every stream) and tried again"),
    "gpu_device_mallocs": ("intone_gpu_device_mallocs", "cudaMalloc calls of the engine process's allocator"),
    "gpu_device_frees": ("intone_gpu_device_frees", "cudaFree calls of the engine process's allocator (each waits "
                         "for the whole device)"),
    "gpu_sync_all_streams": ("intone_gpu_sync_all_streams", "Times the engine process's allocator waited for every "
                             "stream before freeing"),
    "codec_flow_cache_refused": ("intone_codec_flow_cache_refused",
                                 "CosyVoice3: streamed hops that kept no flow cache for want of room "
                                 "(cosyvoice3.flow.cache_gb)"),
}
ENGINE_GAUGES = {
    "reference_cache_entries": ("intone_reference_cache_entries", "Reference features held in the cache"),
    "reference_cache_bytes": ("intone_reference_cache_bytes", "Bytes held by the reference cache"),
    "captured_graphs": ("intone_captured_graphs", "CUDA graphs captured"),
    "capture_seconds": ("intone_graph_capture_seconds", "Seconds spent capturing CUDA graphs"),
    "mean_step_ms": ("intone_engine_mean_step_ms", "Mean engine step time since start, ms"),
    # The engine's per-request tables: all zero when nothing runs (a leak shows here first).
    "live_requests": ("intone_engine_live_requests", "Requests the engine core holds state for"),
    "preparing": ("intone_engine_preparing_requests", "Requests whose reference audio is being encoded"),
    "planner_requests": ("intone_engine_planner_requests", "Requests the chunk planner tracks"),
    "kv_tables": ("intone_engine_kv_tables", "KV block tables held"),
    # torch's allocator in the engine core's process (GPU; a codec process has its own): where memory goes
    "kv_cache_bytes": ("intone_kv_cache_bytes", "Bytes of the KV cache pool (allocated once, at start-up)"),
    "gpu_allocated_bytes": ("intone_gpu_allocated_bytes", "GPU bytes allocated by the engine process's tensors"),
    "gpu_allocated_peak_bytes": ("intone_gpu_allocated_peak_bytes", "Peak of intone_gpu_allocated_bytes since start"),
    "gpu_allocated_peak_at_ready_bytes": ("intone_gpu_allocated_peak_at_ready_bytes",
                                          "Peak of intone_gpu_allocated_bytes when start-up ended (warm-ups, captures)"),
    "gpu_reserved_bytes": ("intone_gpu_reserved_bytes", "GPU bytes the engine process's allocator holds (allocated "
                           "plus its cache)"),
    "gpu_reserved_peak_bytes": ("intone_gpu_reserved_peak_bytes", "Peak of intone_gpu_reserved_bytes since start"),
    "codec_flow_cache_bytes": ("intone_codec_flow_cache_bytes", "CosyVoice3: bytes the streams' flow caches hold "
                               "(cosyvoice3.flow.cache)"),
    "codec_flow_cache_pool_bytes": ("intone_codec_flow_cache_pool_bytes", "CosyVoice3: bytes of the flow caches' "
                                    "pool (0 until the first streamed flow call sizes it)"),
}


class _EngineSnapshot:
    """Exports the numeric keys of the last engine snapshot that it knows (absent keys: no series)."""

    def __init__(self):
        self.values: dict = {}

    def describe(self):
        return []

    def collect(self):
        for table, family in ((ENGINE_COUNTERS, CounterMetricFamily), (ENGINE_GAUGES, GaugeMetricFamily)):
            for key, (name, doc) in table.items():
                value = self.values.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    yield family(name, doc, value=float(value))


# engine snapshot key -> (per-engine metric name, help): with an `engine` label, one series per core.
PER_ENGINE_GAUGES = {
    "running": ("intone_engine_requests_running", "Requests in this engine core's AR batch"),
    "waiting": ("intone_engine_requests_waiting", "Requests queued in this engine core"),
    "kv_usage": ("intone_engine_kv_cache_usage_ratio", "Share of this engine core's KV cache blocks in use"),
}
PER_ENGINE_COUNTERS = {
    "reference_cache_hits": ("intone_engine_reference_cache_hits", "Reference-feature cache hits of this engine core"),
    "reference_cache_misses": ("intone_engine_reference_cache_misses",
                               "Reference-feature cache misses of this engine core"),
}


class _PerEngine:
    """Per engine core (label `engine`): up, frames owed, and its snapshot's occupancy and cache counters."""

    def __init__(self):
        self.rows: list[tuple[int, bool, int, dict | None]] = []  # (index, serving, frames owed, snapshot)

    def describe(self):
        return []

    def collect(self):
        up = GaugeMetricFamily("intone_engine_up", "1 while this engine core serves, else 0", labels=["engine"])
        owed = GaugeMetricFamily("intone_engine_outstanding_frames",
                                 "Frames this engine core still owes its open requests (estimated)", labels=["engine"])
        for index, serving, frames, _ in self.rows:
            up.add_metric([str(index)], 1.0 if serving else 0.0)
            owed.add_metric([str(index)], float(frames))
        yield up
        yield owed
        for table, family in ((PER_ENGINE_GAUGES, GaugeMetricFamily), (PER_ENGINE_COUNTERS, CounterMetricFamily)):
            for key, (name, doc) in table.items():
                metric = family(name, doc, labels=["engine"])
                for index, _, _, stats in self.rows:
                    if stats is not None and key in stats:
                        metric.add_metric([str(index)], float(stats[key]))
                yield metric


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
        self.engine_restarts = Counter("intone_engine_restarts", "Engine cores replaced after dying or hanging",
                                       registry=r)
        self.stages = Histogram("intone_request_stage_seconds", "Seconds of one finished request spent per stage "
                                "(intone.protocol.REQUEST_STAGES; total: the engine's)",
                                ["stage"], buckets=STAGE_BUCKETS, registry=r)
        self.routed = Counter("intone_engine_routed_requests", "Engine requests sent to each engine core, by why it "
                              "was chosen (load: it owed the fewest frames; affinity: it had the reference clip)",
                              ["engine", "reason"], registry=r)
        self._engine = _EngineSnapshot()
        r.register(self._engine)
        self._per_engine = _PerEngine()
        r.register(self._per_engine)

    def finished(self, outcome: str, audio_seconds: float = 0.0, frames: int = 0, engine_s: float | None = None):
        self.outcomes.labels(outcome).inc()
        if audio_seconds > 0:
            self.audio_seconds.inc(audio_seconds)
            self.frames.inc(frames)
            if engine_s is not None:
                self.rtf.observe(engine_s / audio_seconds)

    def stage_times(self, timings: dict | None, api_in: float | None = None, api_out: float | None = None) -> None:
        """One finished request: the engine's timings (keys `<stage>_s`) and the API's own stages."""
        for stage, value in (("api_in", api_in), ("api_out", api_out)):
            if value is not None:
                self.stages.labels(stage).observe(max(value, 0.0))
        for stage in ENGINE_STAGES:
            value = (timings or {}).get(f"{stage}_s")
            if isinstance(value, (int, float)) and value == value:  # not NaN
                self.stages.labels(stage).observe(max(float(value), 0.0))

    def engine_states(self, rows: list[tuple[int, bool, int, dict | None]], merged: dict) -> None:
        """Per engine core (index, serving, frames owed, snapshot or None) and their snapshots summed."""
        self._per_engine.rows = [(i, up, owed, _with_kv_usage(stats)) for i, up, owed, stats in rows]
        if any(stats is not None for *_, stats in rows):
            self.engine_state(merged)

    def engine_state(self, stats: dict) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        used = stats["kv_blocks_total"] - stats["kv_blocks_free"]
        self.kv_used.set(used)
        self.kv_usage.set(used / max(stats["kv_blocks_total"], 1))
        self._engine.values = dict(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _with_kv_usage(stats: dict | None) -> dict | None:
    if stats is None:
        return None
    used = stats["kv_blocks_total"] - stats["kv_blocks_free"]
    return {**stats, "kv_usage": used / max(stats["kv_blocks_total"], 1)}
