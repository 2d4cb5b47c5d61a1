"""Where the time goes: the server's own per-stage metrics, scraped before and after a level.

Our server exports `intone_request_stage_seconds{stage=...}` (a histogram per finished request)
and engine counters (see intone/api/metrics.py). Per level, a stage's mean is
(sum after - sum before) / (count after - count before): seconds per request in that stage.
Stages overlap (`codec` counts every codec call that carried a request's chunks in full, and
`total` is the engine's whole span), so they do not add up. A server without these metrics
(another framework) gives a level without a breakdown and nothing fails.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from intone.protocol import REQUEST_STAGES as STAGES, STEP_COMPANY

STAGE_METRIC = "intone_request_stage_seconds"
# label in results -> sample name on /metrics
COUNTERS = {
    "reference_cache_hits": "intone_reference_cache_hits_total",
    "reference_cache_misses": "intone_reference_cache_misses_total",
    "prefix_cache_blocks": "intone_prefix_cache_blocks_total",
    "compiled_graphs": "intone_compiled_graphs_total",
    "frontend_batches": "intone_frontend_batches_total",
    "frontend_clips": "intone_frontend_clips_total",
    "frontend_jobs": "intone_frontend_jobs_total",
    "frontend_busy_seconds": "intone_frontend_busy_seconds_total",
    "frontend_queued_seconds": "intone_frontend_queued_seconds_total",
    "frontend_process_seconds": "intone_frontend_process_seconds_total",
    "graph_replays": "intone_graph_replays_total",
    "codec_graph_replays": "intone_codec_graph_replays_total",
    "codec_eager_runs": "intone_codec_eager_runs_total",
    "eager_decode_steps": "intone_eager_decode_steps_total",
    "engine_steps": "intone_engine_steps_total",
    "step_wait_seconds": "intone_engine_step_wait_seconds_total",
    "step_gpu_seconds": "intone_engine_step_gpu_seconds_total",
    "step_launch_seconds": "intone_engine_step_launch_seconds_total",
    "step_pace_seconds": "intone_engine_step_pace_seconds_total",
    "loop_cpu_seconds": "intone_engine_loop_cpu_seconds_total",
    "codec_cpu_seconds": "intone_engine_codec_cpu_seconds_total",
    "frontend_cpu_seconds": "intone_engine_frontend_cpu_seconds_total",
    "process_cpu_seconds": "intone_engine_process_cpu_seconds_total",
    "gpu_timed_steps": "intone_engine_gpu_timed_steps_total",
    **{f"step_gpu_seconds_{c}": f"intone_engine_step_gpu_seconds_{c.replace('+', '_')}_total" for c in STEP_COMPANY},
    **{f"gpu_timed_steps_{c}": f"intone_engine_gpu_timed_steps_{c.replace('+', '_')}_total" for c in STEP_COMPANY},
    "gpu_timed_prefill_tokens": "intone_engine_gpu_timed_prefill_tokens_total",
    "engine_frames": "intone_engine_frames_total",
    "codec_calls": "intone_codec_calls_total",
    "codec_busy_seconds": "intone_codec_busy_seconds_total",
    "codec_first_calls": "intone_codec_first_calls_total",
    "codec_first_call_seconds": "intone_codec_first_call_seconds_total",
    "codec_first_call_gpu_seconds": "intone_codec_first_call_gpu_seconds_total",
    "codec_first_call_flow_seconds": "intone_codec_first_call_flow_seconds_total",
    "codec_first_call_chunks": "intone_codec_first_call_chunks_total",
    "codec_preempted_calls": "intone_codec_preempted_calls_total",
    "codec_flow_seconds": "intone_codec_flow_seconds_total",
    "codec_vocoder_seconds": "intone_codec_vocoder_seconds_total",
    "codec_padded_tokens": "intone_codec_padded_tokens_total",
    "codec_useful_tokens": "intone_codec_useful_tokens_total",
    "codec_hift_padded_frames": "intone_codec_hift_padded_frames_total",
    "codec_hift_useful_frames": "intone_codec_hift_useful_frames_total",
    "codec_references_ahead": "intone_codec_references_ahead_total",
    "codec_prepares_skipped": "intone_codec_prepares_skipped_total",
    "gpu_alloc_retries": "intone_gpu_alloc_retries_total",
    "gpu_device_mallocs": "intone_gpu_device_mallocs_total",
    "gpu_device_frees": "intone_gpu_device_frees_total",
    "gpu_sync_all_streams": "intone_gpu_sync_all_streams_total",
}
GAUGES = {
    "reference_cache_entries": "intone_reference_cache_entries",
    "reference_cache_bytes": "intone_reference_cache_bytes",
    "captured_graphs": "intone_captured_graphs",
    "mean_step_ms_since_start": "intone_engine_mean_step_ms",
    "kv_cache_bytes": "intone_kv_cache_bytes",
    "gpu_allocated_peak_at_ready_bytes": "intone_gpu_allocated_peak_at_ready_bytes",
    "gpu_allocated_peak_bytes": "intone_gpu_allocated_peak_bytes",
    "gpu_reserved_bytes": "intone_gpu_reserved_bytes",
    "gpu_reserved_peak_bytes": "intone_gpu_reserved_peak_bytes",
}


def scrape(base_url: str, headers: dict | None = None, timeout: float = 30) -> dict | None:
    """{(sample name, ((label, value), ...)): value} from GET /metrics, or None if it has none."""
    try:
        r = httpx.get(base_url + "/metrics", headers=headers, timeout=timeout)
        if r.status_code != 200:
            return None
        samples = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples
    except (httpx.HTTPError, ValueError):
        return None


def level_breakdown(before: dict | None, after: dict | None) -> dict:
    """Per stage the mean seconds per request over the level, and the engine counters' deltas."""
    has_stages = after is not None and any(name.startswith(STAGE_METRIC) for name, _ in after)
    if not has_stages:
        return dict(available=False, reason="the server exports no intone_request_stage_seconds metrics")
    before = before or {}

    def delta(name: str, labels: tuple = ()) -> float | None:
        if (name, labels) not in after:
            return None
        return after[(name, labels)] - before.get((name, labels), 0.0)

    stages = {}
    for stage in STAGES:
        labels = (("stage", stage),)
        total, count = delta(f"{STAGE_METRIC}_sum", labels), delta(f"{STAGE_METRIC}_count", labels)
        stages[stage] = dict(mean_s=total / count if total is not None and count else None,
                             requests=int(count) if count is not None else 0)
    counters = {key: delta(name) for key, name in COUNTERS.items()}
    gauges = {key: after.get((name, ())) for key, name in GAUGES.items()}
    steps = counters.get("engine_steps")
    mean_step_ms = None
    b_mean, a_mean = before.get((GAUGES["mean_step_ms_since_start"], ())), gauges["mean_step_ms_since_start"]
    b_steps, a_steps = before.get((COUNTERS["engine_steps"], ())), after.get((COUNTERS["engine_steps"], ()))
    if steps and None not in (b_mean, a_mean, b_steps, a_steps):
        mean_step_ms = (a_mean * a_steps - b_mean * b_steps) / steps
    return dict(available=True, stages=stages, counters=counters, gauges=gauges, mean_step_ms=mean_step_ms)


def engine_breakdown(timings: list[dict]) -> dict:
    """The same shape from the terminal chunks' `timings` (engine_throughput: no API stages)."""
    if not timings:
        return dict(available=False, reason="the engine's terminal chunks carry no timings")
    stages = {}
    for stage in STAGES:
        values = [t[f"{stage}_s"] for t in timings if isinstance(t.get(f"{stage}_s"), (int, float))]
        stages[stage] = dict(mean_s=sum(values) / len(values) if values else None, requests=len(values))
    return dict(available=True, stages=stages)
