"""Engine throughput at several concurrencies (closed loop), with a frame audit of every run.

    python -m intone.bench.engine_throughput --model tiny:fish-s2 --concurrency 1,8,32
    python -m intone.bench.engine_throughput --model random:fish-s2 --concurrency 8 \\
        --forced-frames 300 --profile fish-s2-high-concurrency      # real size, on a GPU

Runs the engine core in this process (no IPC), so the numbers are the engine's own. Audio
seconds come from the model's sample rate. With --forced-frames every request generates
exactly that many frames (the stop token is never drawn), as random weights need.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from intone.engine.config import load_profile
from intone.engine.core import EngineCore, default_params
from intone.engine.request import SynthesisRequest
from intone.engine.trace import audit_file
import torch

from intone.models.base import VoiceReference

TEXTS = [
    "Hello world, this is a test of the engine.",
    "The quick brown fox jumps over the lazy dog.",
    "Streaming audio arrives in chunks, frame after frame.",
    "Numbers like one, two and three appear in speech too.",
]


def bench_references(model) -> list[VoiceReference]:
    """A stored voice (features computed once, as a server caches them) for models that need one."""
    if not getattr(model, "requires_reference", False):
        return []
    t = torch.arange(3 * 16000) / 16000
    f0 = 130 * (1 + 0.1 * torch.sin(2 * math.pi * 0.7 * t))
    phase = 2 * math.pi * torch.cumsum(f0, 0) / 16000
    audio = 0.1 * sum(torch.sin(k * phase) / k for k in range(1, 8))
    return [VoiceReference(text="A three second reference voice for the benchmark.",
                           features=model.reference_features(audio.float(), 16000))]


def run_once(core: EngineCore, concurrency: int, num_requests: int, max_new: int, forced: bool,
             tag: str = "") -> dict:
    start = time.perf_counter()
    submitted, done, frames = 0, 0, 0
    refs = bench_references(core.model)
    added_at, first_audio = {}, {}
    steps0, step_s0 = core.stats.steps, core.stats.step_seconds
    while done < num_requests:
        while submitted < num_requests and submitted - done < concurrency:
            rid = f"{tag or f'c{concurrency}'}-{submitted}"
            params = default_params(core.profile, seed=submitted, max_new_tokens=max_new, ignore_eos=forced or None)
            core.add_request(SynthesisRequest(rid, TEXTS[submitted % len(TEXTS)], refs, params=params))
            added_at[rid] = time.perf_counter()
            submitted += 1
        for chunk in core.step():
            if len(chunk.audio) and chunk.request_id not in first_audio:
                first_audio[chunk.request_id] = time.perf_counter() - added_at[chunk.request_id]
            if chunk.error:
                raise RuntimeError(f"{chunk.request_id}: {chunk.error}")
            if chunk.finished:
                done += 1
                frames += chunk.end_frame
    wall = time.perf_counter() - start
    audio_s = frames * core.model.samples_per_frame / core.model.sample_rate
    steps = core.stats.steps - steps0
    ttfa = sorted(first_audio.values())
    return dict(
        concurrency=concurrency, requests=num_requests, frames=frames, wall_s=round(wall, 3),
        requests_per_s=round(num_requests / wall, 3), audio_s_per_s=round(audio_s / wall, 3),
        mean_step_ms=round(1000 * (core.stats.step_seconds - step_s0) / max(steps, 1), 2), steps=steps,
        first_audio_mean_s=round(statistics.mean(ttfa), 3) if ttfa else None,
        first_audio_p50_s=round(ttfa[len(ttfa) // 2], 3) if ttfa else None,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny:fish-s2")
    ap.add_argument("--profile", default="fish-s2-high-concurrency")
    ap.add_argument("--device", default=None)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: 2 x concurrency (at least 4)")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--forced-frames", type=int, default=None, help="exactly this many frames per request")
    ap.add_argument("--out", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="profile override, e.g. codec.autocast=bfloat16 (repeatable)")
    args = ap.parse_args(argv)

    levels = [int(c) for c in args.concurrency.split(",")]
    overrides = {"ar.max_num_seqs": max(levels), "codec.max_batch": max(levels)}
    if args.device:
        overrides["device"] = args.device
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    profile = load_profile(args.profile, **overrides)
    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    core = EngineCore.build(args.model, profile, str(trace))
    model = core.model
    max_new = args.forced_frames or args.max_new_tokens
    run_once(core, 1, 1, min(max_new, 8), bool(args.forced_frames), tag="warmup")
    results = []
    for c in levels:
        n = args.requests_per_level or max(4, 2 * c)
        row = run_once(core, c, n, max_new, bool(args.forced_frames))
        results.append(row)
        print(json.dumps(row), flush=True)
    core.tracer.close()
    report = audit_file(trace)
    bad = [a.request_id for a in report.values() if not a.exact]
    summary = dict(model=args.model, device=str(model.device), profile=profile.name, results=results,
                   audit=dict(requests=len(report), not_exact=bad), kv=core.snapshot()["kv_blocks_free"] == core.kv.num_blocks)
    print(json.dumps(summary["audit"]), "kv pool empty again:", summary["kv"])
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
