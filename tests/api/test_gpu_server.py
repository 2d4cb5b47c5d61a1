"""The GPU serving path as users run it: a real server process with the AR step's CUDA graphs
captured at start-up, concurrent requests each bringing its own reference voice."""

from concurrent.futures import ThreadPoolExecutor
import itertools

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
import yaml

from intone.engine.config import PROFILE_DIR
from tests.api.conftest import crowd_then_alone, metric, start_server, stop_server

pytestmark = pytest.mark.gpu

# (model, profile, codec overrides, cosyvoice3.flow overrides, cosyvoice3.hift overrides, other sections' overrides):
# Fish as shipped (one AR step in flight, pieces' calls gathered), and with its steps in order, non-streamed audio
# decoded in pieces as the frames come, streams paced by their listeners with ramped hops, the carried decode
# replayed from graphs on cuDNN's deterministic plans with rows padded to multiples of 8 above 8 exact rows, the
# ramp's chunk sizes as frame buckets and calls split by length, on the lean decoder path, in the engine loop
# between its steps (pieces gathered there, streams' chunks held for their listeners' deadlines);
# CosyVoice3 once with the
# flow's solve and HiFT's calls replayed from graphs (the flex-attention DiT compiled, its block masks built inside
# the graphs), once with the flex DiT compiled and eager, HiFT in fp16, the codec on a share of the SMs and first
# chunks decoded at the backlog calls' Euler steps; streams continued from their flow caches, their new frames
# packed for the varlen kernel (compiled, bf16 autocast), the worker on the loop's stream and playing streams'
# chunks held for their listeners; the same (the worker on its own stream, first chunks at the backlog calls'
# Euler steps) with the streams' whole final hops at fixed sizes, each Euler step replayed from a graph
# (`flow_slots` beside the cache); and the full-response profile with the varlen DiT compiled under
# bf16 autocast (FlashAttention needs half precision), whole responses packed at fixed sizes and replayed from
# graphs (`flow_slots`), HiFT from graphs in calls split by length, the codec worker on the loop's stream.
# A GPU server compiles its fused pieces and captures its graphs before it is ready: on a fresh machine (cold
# inductor cache) one with the shipped Fish profile did not come up within 120 s (session 42, H100).
GPU_START_S = 400

CASES = [("tiny:fish-s2", "fish-s2-high-concurrency", {}, {}, {}, {}),
         ("tiny:fish-s2", "fish-s2-high-concurrency", {"stream_graph_frames": 64, "row_granule": 8,
                                                       "deterministic": True, "split_cost": 256, "overlap": False,
                                                       "gather_ms": 50, "stream_lead_ms": 300, "lean_decode": True,
                                                       "exact_rows": 8, "frame_buckets": [6, 9, 14, 21, 25, 29]},
          {}, {},
          {"ar": {"async_steps": False}, "fish_s2": {"decoder_layout": "channels_first"},  # lean_decode's own
           "chunking": {"whole_chunk_frames": 20, "listener_margin_s": 0.5, "ramp_factor": 1.5}}),
         ("tiny:cosyvoice3", "cosyvoice3-streaming", {},
          {"cuda_graphs": True, "compile": True, "attention": "flex", "cache": False},
          {"cuda_graphs": True}, {}),
         ("tiny:cosyvoice3", "cosyvoice3-streaming", {"sms": 32, "schedule": "preempt"},
          {"compile": True, "attention": "flex", "cache": False}, {"dtype": "float16"}, {}),
         ("tiny:cosyvoice3", "cosyvoice3-streaming", {"stream": "loop", "stream_lead_ms": 300},
          {"compile": True, "attention": "varlen", "autocast": "bfloat16", "cache": True}, {}, {}),
         ("tiny:cosyvoice3", "cosyvoice3-streaming", {},
          {"compile": True, "attention": "varlen", "autocast": "bfloat16", "cache": True, "cuda_graphs": True}, {}, {}),
         ("tiny:cosyvoice3", "cosyvoice3-full-response", {"stream": "loop"},
          {"compile": True, "attention": "varlen", "autocast": "bfloat16", "cuda_graphs": True},
          {"cuda_graphs": True, "graph_frames": 512, "call_cost": 50},
          {})]


@pytest.mark.parametrize("model,profile,codec,flow,hift,sections", CASES)
def test_concurrent_requests_with_their_own_voices_run_on_graphs(model, profile, codec, flow, hift, sections,
                                                                  tiny_cache, tmp_path):
    assert torch.cuda.is_available()
    settings = yaml.safe_load((PROFILE_DIR / f"{profile}.yaml").read_text())
    flow_settings = settings.get("cosyvoice3", {}).get("flow", {})
    flow_settings["compile"] = False  # a tiny DiT: compiling it would only make the test slow
    # Full fp32 (no TF32, no bf16 AR or flow, no fp16 codec): the alone-vs-crowd check below is then
    # bounded by fp32 rounding. Under the shipped bf16 flow, CosyVoice3's request 0 differed by up to
    # 0.059 (H200); under Fish's bf16 AR, batch-dependent rounding of the logits flipped a draw of
    # request 0 (session 12: audio equal up to some frame, then unrelated).
    settings["tf32"] = False
    settings["ar"]["dtype"] = settings["codec"]["dtype"] = "float32"
    settings["codec"].update(codec)
    for section, overrides in sections.items():
        settings.setdefault(section, {}).update(overrides)
    flow_settings["autocast"] = "none"
    flow_settings.update(flow)
    if model == "tiny:cosyvoice3":
        settings.setdefault("cosyvoice3", {})["flow"] = flow_settings
        settings["cosyvoice3"]["hift"] = hift
    codec_graphs = flow_settings.get("cuda_graphs", False) or hift.get("cuda_graphs", False) or \
        codec.get("stream_graph_frames", 0) > 0
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(settings))
    server = start_server(tmp_path, tiny_cache, "--model", model, "--profile", str(path), "--device", "cuda",
                          "--max-reference-seconds", "30", "--trace-frames", str(tmp_path / "frames.jsonl"),
                          timeout=GPU_START_S)
    try:
        # A flow under bf16 autocast (the varlen kernel needs half precision) rounds by the batch its rows share:
        # with the same prompts and tokens (the trace's digests), a stream's audio differed from its solo run by
        # 6.3-8.2% of its RMS (H100, session 40), against ~140% for other tokens.
        half = flow_settings.get("autocast", "none") != "none"
        crowd_then_alone(server, 12, tolerance=0.25 if half else 0.05)
        metrics = httpx.get(server.url("/metrics"), timeout=10).text
        assert metric(metrics, "intone_graph_replays") > 0
        assert metric(metrics, "intone_eager_decode_steps") == 0
        assert metric(metrics, "intone_static_steps") == metric(metrics, "intone_graph_replays")
        assert metric(metrics, "intone_frontend_graph_replays") > 0  # the shipped profiles replay the frontend
        assert metric(metrics, "intone_reference_cache_misses") >= 12
        # where the engine process's GPU memory goes: the KV pool within the peak, the serving peak
        # at least start-up's, the allocator's cache on top of what is allocated
        kv, ready = metric(metrics, "intone_kv_cache_bytes"), metric(metrics, "intone_gpu_allocated_peak_at_ready_bytes")
        peak = metric(metrics, "intone_gpu_allocated_peak_bytes")
        assert 0 < kv <= ready <= peak <= metric(metrics, "intone_gpu_reserved_peak_bytes")
        if codec_graphs:
            assert metric(metrics, "intone_codec_graph_replays") > 0
            assert metric(metrics, "intone_codec_eager_runs") == 0
        log = server.log.read_text()
        assert "cannot capture" not in log and "Traceback" not in log
    finally:
        stop_server(server)


def test_a_profiled_window_ties_the_gpus_work_to_the_threads_that_launched_it(tiny_cache, tmp_path):
    """/start_profile and /stop_profile on a GPU server under concurrent requests with their own voices: every
    kernel's launch is found (CUPTI records the CUDA calls of every thread), and the loop's, the codec
    worker's and the frontend's kernels each show under their thread, on streams no other thread uses."""
    server = start_server(tmp_path, tiny_cache, "--model", "tiny:fish-s2", "--profile", "fish-s2-high-concurrency",
                          "--device", "cuda", "--profile-dir", str(tmp_path / "profiles"), timeout=GPU_START_S)
    try:
        assert httpx.post(server.url("/start_profile"), timeout=60).status_code == 200

        def speak(i: int) -> httpx.Response:
            t = np.arange(int((1.5 + 0.3 * i) * 24000)) / 24000
            wav = server.media / f"voice{i}.wav"
            sf.write(wav, 0.3 * np.sin(2 * np.pi * (150 + 17 * i) * t), 24000)
            return httpx.post(server.url("/v1/audio/speech"), timeout=300, json={
                "input": f"Sentence {i}.", "ref_audio": str(wav), "ref_text": "A voice.", "seed": i,
                "max_new_tokens": 60, "stream": i % 2 == 1, "response_format": "wav" if i % 2 == 0 else "pcm"})

        with ThreadPoolExecutor(8) as pool:
            assert [r.status_code for r in pool.map(speak, range(8))] == [200] * 8
        stopped = httpx.post(server.url("/stop_profile"), timeout=600)
        assert stopped.status_code == 200, stopped.text
        summary = stopped.json()["engines"][0]["summary"]
        gpu, threads = summary["gpu"], {r["thread"]: r for r in summary["threads"]}
        assert gpu["items"] > 0 and 0 < gpu["busy_share"] <= 1
        assert {"engine loop", "intone-codec", "intone-frontend"} <= set(threads), sorted(threads)
        unattributed = threads.get("unattributed", {}).get("items", 0)
        assert unattributed <= 0.05 * gpu["items"], (unattributed, gpu["items"])
        launching = [r for name, r in threads.items() if name != "unattributed"]
        for a, b in itertools.combinations(launching, 2):  # no thread's kernels queue behind another's
            assert not set(a["streams"]) & set(b["streams"]), (a["thread"], b["thread"], a["streams"], b["streams"])
        metrics = httpx.get(server.url("/metrics"), timeout=30).text  # the steps timed on the loop's stream
        assert 0 < metric(metrics, "intone_engine_gpu_timed_steps") <= metric(metrics, "intone_engine_steps")
        assert metric(metrics, "intone_engine_step_gpu_seconds") > 0
        # split by what ran beside each step: every timed step in one company, requests' prefills among them
        # (8 voices encoded and decoded beside them), the seconds adding up to the whole
        split = {c: (metric(metrics, f"intone_engine_step_gpu_seconds_{c}"),
                     metric(metrics, f"intone_engine_gpu_timed_steps_{c}"))
                 for c in ("prefill", "codec_frontend", "codec", "frontend", "alone") if f"_steps_{c}_total" in metrics}
        assert split.get("prefill", (0, 0))[1] >= 1 and len(split) >= 2, split
        assert metric(metrics, "intone_engine_gpu_timed_prefill_tokens") > 10 * split["prefill"][1]  # voice prompts
        assert sum(n for _, n in split.values()) == metric(metrics, "intone_engine_gpu_timed_steps")
        assert abs(sum(s for s, _ in split.values()) - metric(metrics, "intone_engine_step_gpu_seconds")) < 1e-6
        # the allocator's device calls: start-up's cudaMallocs at least, and counts that never fall
        assert metric(metrics, "intone_gpu_device_mallocs") > 0
        assert metric(metrics, "intone_gpu_alloc_retries") >= 0 and metric(metrics, "intone_gpu_device_frees") >= 0
        for thread in launching:  # every thread's gaps and stretch are there, and none is negative
            assert min(thread["gaps"].values()) >= 0 and min(thread["stretch"].values()) >= 0
    finally:
        stop_server(server)
