"""`--preset` fills in what was not given; `--reference-pool` cycles clips; every other request
(warm-up, later levels) gets a clip of its own; the stage breakdown without server metrics; an
after-run check that cannot be made."""

import argparse
import io
import socket

import soundfile as sf

from intone.bench.client import ClipUse, ReferencePlan, clip_bytes
from intone.bench.dataset import synthetic_items
from intone.bench.presets import apply_preset
from intone.bench.report import after_run_line, memory_table, stage_tables
from intone.bench.runner import after_run
from intone.bench.server_metrics import level_breakdown
from intone.cli.main import _parser


def parsed(*argv):
    args = _parser().parse_args(["bench", "--output-dir", "x", *argv])
    apply_preset(args)
    return args


def test_presets_apply_and_given_flags_win():
    fish = parsed("--preset", "seedtts-fish")
    assert (fish.dataset, fish.num_requests, fish.concurrency, fish.warmup, fish.force_output_frames,
            fish.reference_pool) == ("synthetic", 1088, "64", 64, "normal:86:30", None)
    cosy = parsed("--preset", "seedtts-cosyvoice3", "--num-requests", "6", "--warmup", "0", "--concurrency", "2")
    assert (cosy.num_requests, cosy.warmup, cosy.concurrency, cosy.force_output_frames) == (6, 0, "2", "normal:128:45")
    assert parsed("--preset", "seedtts-fish", "--force-output-frames", "5").force_output_frames == "5"
    plain = parsed()  # no preset: the old defaults
    assert (plain.num_requests, plain.concurrency, plain.warmup, plain.force_output_frames) == (64, "1", 4, None)


def test_unique_clips_everywhere_and_the_pool_cycles(tmp_path):
    items = synthetic_items(4, tmp_path)
    plan = ReferencePlan()
    measured, warm = plan.assign(items[:3]), plan.assign(items[:1])  # warm-up reusing a measured item
    level2 = plan.assign(items[:3])
    uses = measured + warm + level2
    assert len({(u.wav, u.variant) for u in uses}) == len(uses) == 7
    assert [u.variant for u in measured] == [0, 0, 0] and warm[0].variant == 1 and level2[0].variant == 2
    again = clip_bytes(warm[0])
    assert again != items[0].prompt_wav.read_bytes()
    a, _ = sf.read(io.BytesIO(again))
    b, _ = sf.read(items[0].prompt_wav)
    assert len(a) == len(b) and abs(a).max() < abs(b).max()
    assert plan.summary()["mode"] == "unique" and plan.summary()["distinct_clips"] == 7

    pool = ReferencePlan(items[:2])
    cycled = pool.assign(items) + pool.assign(items[:2])
    assert [u.wav for u in cycled] == [items[i % 2].prompt_wav for i in range(6)]
    assert all(u == ClipUse(u.wav, u.text, 0) for u in cycled)
    assert pool.summary()["mode"] == "pool" and pool.summary()["pool"] == 2


def test_no_server_metrics_is_said_not_failed():
    server = level_breakdown(None, {("http_requests_total", ()): 3.0})
    assert server["available"] is False
    lines = stage_tables({"levels": [{"concurrency": 4, "server": server}]})
    assert any("No per-stage breakdown" in line for line in lines)


def test_an_after_run_check_that_cannot_be_made_says_why_and_is_not_clean(tmp_path):
    """The server gone before the check (nothing listens on the port): the run keeps its figures,
    and the check is reported as failed, not as clean."""
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    after = after_run(f"http://127.0.0.1:{port}", tmp_path, argparse.Namespace(api_key=None))
    assert after["clean"] is False and "ConnectError" in after["error"]
    assert after_run_line(after).startswith("**NOT CLEAN**: the check failed: ConnectError")


def test_the_memory_table_appears_only_when_the_server_reports_gpu_memory():
    gib = 2**30
    gpu = {"kv_cache_bytes": 60 * gib, "gpu_allocated_peak_at_ready_bytes": 80 * gib,
           "gpu_allocated_peak_bytes": 90.5 * gib, "gpu_reserved_bytes": 95 * gib, "gpu_reserved_peak_bytes": 99 * gib}
    lines = memory_table({"levels": [{"concurrency": 64, "server": {"available": True, "gauges": gpu}}]})
    assert "| 64 | 60.0 | 80.0 | 90.5 | 95.0 | 99.0 |" in lines
    cpu = {"kv_cache_bytes": gib, "gpu_allocated_peak_bytes": None}
    assert memory_table({"levels": [{"concurrency": 2, "server": {"available": True, "gauges": cpu}}]}) == []


def scraped(counters: dict) -> dict:
    """What /metrics gives for an engine snapshot with these keys (the API's own exporter)."""
    from prometheus_client.parser import text_string_to_metric_families

    from intone.api.metrics import ServerMetrics

    snapshot = {"running": 0, "waiting": 0, "kv_blocks_total": 8, "kv_blocks_free": 8, **counters}
    metrics = ServerMetrics()
    metrics.stage_times({"total_s": 1.0})
    metrics.engine_states([(0, True, 0, snapshot)], snapshot)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_the_steps_gpu_span_by_their_company_goes_from_the_engines_snapshot_to_the_report():
    """The engine's split of its steps' GPU span (`STEP_COMPANY`), exported per company, scraped before and after
    a level and said per step in the report; companies no step had are left out, and a CPU server says nothing."""
    before = scraped({"steps": 100, "mean_step_ms": 10.0, "step_wait_seconds": 0.2, "step_gpu_seconds_alone": 0.1,
                      "gpu_timed_steps_alone": 10, "step_gpu_seconds_codec": 0.0, "gpu_timed_steps_codec": 0})
    after = scraped({"steps": 300, "mean_step_ms": 11.0, "step_wait_seconds": 1.4, "step_gpu_seconds_alone": 1.3, "gpu_timed_steps_alone": 110, "step_gpu_seconds_codec": 0.9,
                     "gpu_timed_steps_codec": 60, "step_gpu_seconds_codec+frontend": 0.4,
                     "gpu_timed_steps_codec+frontend": 20, "step_gpu_seconds_prefill": 0.25, "gpu_timed_steps_prefill": 10,
                     "gpu_timed_prefill_tokens": 4500})
    assert ("intone_engine_step_gpu_seconds_codec_frontend_total", ()) in after
    lines = stage_tables({"levels": [{"concurrency": 64, "server": level_breakdown(before, after)}]})
    assert "- C64: the step on the GPU by what ran beside it, ms (steps): prefill 25.00 (10, 450 prompt tokens a step), codec+frontend 20.00 " \
        "(20), codec 15.00 (60), alone 12.00 (100)" in lines
    cpu = stage_tables({"levels": [{"concurrency": 64, "server": level_breakdown(scraped({}), scraped({}))}]})
    assert not any("by what ran beside it" in line for line in cpu)


def test_references_solved_ahead_go_from_the_servers_metrics_to_the_report():
    """The engine's prepare counters as the API exports them, scraped before and after a level, and said in
    the report (CosyVoice3's reference_ahead); a level without them says nothing."""
    server = level_breakdown(scraped({"codec_references_ahead": 3, "codec_prepares_skipped": 1}),
                             scraped({"codec_references_ahead": 40, "codec_prepares_skipped": 9}))
    assert server["counters"]["codec_references_ahead"] == 37 and server["counters"]["codec_prepares_skipped"] == 8
    lines = stage_tables({"levels": [{"concurrency": 64, "server": server}]})
    assert "- C64: references solved ahead 37, prepares skipped 8 (their first hops came first)" in lines
    plain = level_breakdown(scraped({}), scraped({}))
    assert not any("solved ahead" in line for line in stage_tables({"levels": [{"concurrency": 64, "server": plain}]}))


def test_an_ar_steps_wait_and_gpu_span_go_from_the_servers_metrics_to_the_report():
    """Over a level: the mean step, the loop's wait for tokens per step, and the steps' GPU span (a GPU server)."""
    before = scraped({"steps": 100, "mean_step_ms": 10.0, "step_wait_seconds": 0.2, "step_gpu_seconds": 0.5,
                      "gpu_timed_steps": 100})
    after = scraped({"steps": 300, "mean_step_ms": 11.0, "step_wait_seconds": 1.4, "step_gpu_seconds": 2.5,
                     "gpu_timed_steps": 290})
    lines = stage_tables({"levels": [{"concurrency": 64, "server": level_breakdown(before, after)}]})
    assert "- C64: an AR step 11.50 ms, 6.00 ms of it the loop waiting for its tokens (the rest host work); " \
        "on the GPU 10.53 ms a step (the loop's stream, SM waits included)" in lines
    cpu = scraped({"steps": 300, "mean_step_ms": 11.0, "step_wait_seconds": 1.4, "gpu_timed_steps": 0})
    assert "- C64: an AR step 11.50 ms, 6.00 ms of it the loop waiting for its tokens (the rest host work)" in \
        stage_tables({"levels": [{"concurrency": 64, "server": level_breakdown(before, cpu)}]})
    assert not any("CPU time per step" in line for line in lines)  # a server without the host counters


def test_a_steps_host_time_and_the_threads_cpu_go_from_the_servers_metrics_to_the_report():
    """Over a level, per AR step: the loop's building and launching, and each role's CPU time (the loop's own
    against its host time says whether it computed or waited off the CPU)."""
    first = dict(step_wait_seconds=0.2, step_launch_seconds=0.1, loop_cpu_seconds=5.0, codec_cpu_seconds=7.0,
                 frontend_cpu_seconds=1.0, process_cpu_seconds=20.0)
    later = dict(step_wait_seconds=1.4, step_launch_seconds=0.9, loop_cpu_seconds=6.2, codec_cpu_seconds=9.4,
                 frontend_cpu_seconds=1.6, process_cpu_seconds=25.0)
    before = scraped({"steps": 100, "mean_step_ms": 10.0, **first})
    after = scraped({"steps": 300, "mean_step_ms": 11.0, **later})
    lines = stage_tables({"levels": [{"concurrency": 64, "server": level_breakdown(before, after)}]})
    assert "- C64: building and launching a step 4.00 ms of its host work; CPU time per step, ms: the loop 6.00, " \
        "the codec worker 12.00, the frontend workers 3.00, the whole process 25.00" in lines


def test_the_frontend_processes_time_goes_from_the_servers_metrics_to_the_report():
    """With frontend.process: a clip's seconds in the processes against the workers' busy seconds for it, over the
    level; a server with its frontend in threads says nothing of them."""
    step = {"steps": 100, "mean_step_ms": 10.0, "step_wait_seconds": 0.2}
    before = scraped({**step, "frontend_clips": 10, "frontend_busy_seconds": 1.0, "frontend_process_seconds": 0.5})
    after = scraped({**step, "steps": 300, "frontend_clips": 50, "frontend_busy_seconds": 5.0,
                     "frontend_process_seconds": 2.1})
    lines = stage_tables({"levels": [{"concurrency": 64, "server": level_breakdown(before, after)}]})
    assert "- C64: the frontend processes encoded for 40.0 ms a clip, of the workers' 100.0 ms busy a clip (the " \
        "rest: messages, and their prompts here)" in lines
    threads = {**step, "frontend_clips": 10, "frontend_busy_seconds": 1.0}
    lines = stage_tables({"levels": [{"concurrency": 64, "server": level_breakdown(scraped(threads), scraped(
        {**threads, "steps": 300, "frontend_clips": 50}))}]})
    assert not any("frontend processes" in line for line in lines)


def test_the_allocators_device_calls_over_a_level_go_from_the_servers_metrics_to_the_report():
    """The engine process's allocator counters (GPU) as the API exports them, differenced over the level and said
    under the memory table; a server without them (a CPU) says nothing."""
    memory = {"gpu_allocated_peak_bytes": 2**33, "gpu_reserved_bytes": 2**33}
    before = scraped({**memory, "gpu_alloc_retries": 2, "gpu_device_mallocs": 40, "gpu_device_frees": 5,
                      "gpu_sync_all_streams": 2})
    after = scraped({**memory, "gpu_alloc_retries": 9, "gpu_device_mallocs": 52, "gpu_device_frees": 30,
                     "gpu_sync_all_streams": 9})
    server = level_breakdown(before, after)
    assert server["counters"]["gpu_sync_all_streams"] == 7
    lines = memory_table({"levels": [{"concurrency": 64, "server": server}]})
    assert "- C64: over the level the allocator retried 7 allocations (each after freeing its cache, waiting for " \
        "every stream), and made 12 cudaMalloc and 25 cudaFree calls (each cudaFree waits for the whole device)" in lines
    cpu = level_breakdown(scraped({}), scraped({}))
    assert not any("allocator retried" in line for line in stage_tables({"levels": [{"concurrency": 8, "server": cpu}]})
                   + memory_table({"levels": [{"concurrency": 8, "server": cpu}]}))
