"""The server's per-stage metrics, and `intone bench` reading them back (real HTTP, tiny model)."""

import json
from argparse import Namespace

import httpx

from intone.bench.presets import apply_preset
from intone.bench.runner import run
from intone.bench.server_metrics import STAGES, scrape


def test_stage_histogram_and_engine_counters_after_a_request(server, reference_wav):
    r = httpx.post(server.url("/v1/audio/speech"), timeout=120, json={
        "input": "Hello there", "seed": 1, "max_new_tokens": 4, "ignore_eos": True,
        "ref_audio": str(reference_wav), "ref_text": "A reference."})
    assert r.status_code == 200
    text = httpx.get(server.url("/metrics")).text
    assert "# TYPE intone_request_stage_seconds histogram" in text
    samples = scrape(server.base)
    for stage in STAGES:
        assert samples[("intone_request_stage_seconds_count", (("stage", stage),))] >= 1, stage
    assert samples[("intone_request_stage_seconds_sum", (("stage", "total"),))] > 0
    for name in ("intone_reference_cache_misses_total", "intone_reference_cache_hits_total",
                 "intone_engine_steps_total", "intone_reference_cache_entries"):
        assert (name, ()) in samples, name
    assert samples[("intone_compiled_graphs_total", ())] == 0  # the CPU profile compiles nothing
    assert samples[("intone_kv_cache_bytes", ())] > 0
    # the codec's work, padding included, and its real part (a call pads rows and frames to buckets)
    assert samples[("intone_codec_padded_tokens_total", ())] >= samples[("intone_codec_useful_tokens_total", ())] > 0
    assert not any(name.startswith("intone_gpu_") for name, _ in samples)  # no GPU: no allocator series


def bench_args(server, out, **kw):
    args = Namespace(mode="run", base_url=server.base, model=None, profile=None, device=None, serve_args=None,
                     api_key=None, preset=None, dataset=None, num_requests=6, concurrency="2", warmup=2,
                     reference_pool=None, request_rate=float("inf"), stream=False, seed=0, max_new_tokens=None,
                     force_output_frames="3", sample_rate=None, output_dir=str(out), save_audio=None, title=None,
                     asr_model=None, sim_checkpoint=None, wavlm=None)
    for k, v in kw.items():
        setattr(args, k, v)
    apply_preset(args)
    return args


def test_bench_reports_where_the_time_goes(server, tmp_path):
    run(bench_args(server, tmp_path / "unique"))
    results = json.loads((tmp_path / "unique" / "results.json").read_text())
    level = results["levels"][0]
    assert results["references"]["mode"] == "unique" and results["references"]["distinct_clips"] == 8
    assert len({r["reference"] for r in level["records"]}) == 6
    srv = level["server"]
    assert srv["available"] and srv["stages"]["total"]["requests"] == 6
    assert all(srv["stages"][s]["mean_s"] is not None for s in STAGES)
    stages = {s: srv["stages"][s]["mean_s"] for s in STAGES}
    # A whole response's first (only) chunk goes to the codec after its last frame, within its span.
    assert stages["first_codec"] > 0 and stages["first_hop"] <= stages["decode"] + 0.05
    assert stages["first_hop"] + stages["first_codec"] <= stages["total"]
    assert srv["counters"]["reference_cache_hits"] == 0 and srv["counters"]["reference_cache_misses"] == 6
    assert srv["counters"]["codec_calls"] >= 1 and srv["counters"]["codec_busy_seconds"] > 0
    k = srv["counters"]  # the loop's wait for its steps' tokens is part of its steps; no GPU: no spans
    assert 0 < k["step_wait_seconds"] <= k["engine_steps"] * srv["mean_step_ms"] / 1000 + 1e-6
    assert k["gpu_timed_steps"] == 0 and k["step_gpu_seconds"] == 0
    # the loop's launching is part of its steps' host time; the threads' CPU time, part of the process's
    # (on a CPU a step is mostly its launch; the level's mean step comes from a gauge, to its rounding)
    assert 0 < k["step_launch_seconds"] <= (k["engine_steps"] * srv["mean_step_ms"] / 1000 - k["step_wait_seconds"]) * 1.001
    assert 0 < k["loop_cpu_seconds"] and 0 < k["frontend_cpu_seconds"] and 0 < k["codec_cpu_seconds"]
    assert k["loop_cpu_seconds"] + k["codec_cpu_seconds"] + k["frontend_cpu_seconds"] <= k["process_cpu_seconds"] + 0.05
    report = (tmp_path / "unique" / "report.md").read_text()
    assert "## Where the time goes" in report and "a distinct clip for every request" in report
    assert "- C2: building and launching a step " in report and "CPU time per step, ms: the loop " in report
    assert "| concurrency | api_in s | frontend s | queue s | prefill s | first_hop s | first_codec s | decode s " \
           "| codec s | api_out s | total s |" in report
    row = next(line for line in report.splitlines() if line.startswith("| 2 | ") and line.count("|") == len(STAGES) + 3)
    assert all(cell.strip().replace(".", "").isdigit() for cell in row.split("|")[2:-1])

    run(bench_args(server, tmp_path / "pool", reference_pool=2, num_requests=4))
    results = json.loads((tmp_path / "pool" / "results.json").read_text())
    level = results["levels"][0]
    assert results["references"]["mode"] == "pool"
    assert len({r["reference"] for r in level["records"]}) == 2
    assert level["server"]["counters"]["reference_cache_hits"] == 4  # the warm-up filled the cache
    assert "CACHED VARIANT" in (tmp_path / "pool" / "report.md").read_text()
