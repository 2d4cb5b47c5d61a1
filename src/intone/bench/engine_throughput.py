"""Engine throughput on the `intone bench` workload, without HTTP: a diagnostic beside the real number.

    python -m intone.bench.engine_throughput --model tiny:fish-s2 --concurrency 1,8,32
    python -m intone.bench.engine_throughput --model random:fish-s2 --profile fish-s2-high-concurrency \\
        --concurrency 64 --num-requests 1088 --warmup 64 --force-output-frames normal:86:30   # on a GPU

Runs the engine core in this process (no IPC, no API server), so the numbers are the engine's
own. The workload is the preset's: the synthetic dataset's texts, each request with its own 3-8 s
reference clip passed as raw audio (`VoiceReference(text, audio=..., sample_rate=...)`), so the
engine's frontend encodes it as it would for `intone serve`; `--reference-pool N` cycles N clips
(the reference cache is hit); `--stored-voices` passes precomputed features instead (computed
before the clock starts: no frontend work). `--force-output-frames` takes bench's spec (N,
uniform:A:B, normal:MEAN:STD) and forces exact lengths (the stop token is never drawn), as random
weights need. Each level runs `--warmup` requests first (excluded), then the measured ones, in a
closed loop at the concurrency (a finished request is replaced at once; never waves). Per level it
reports the stage means of the terminal chunks' `timings` and the engine counters over the level.
Every run is frame-audited.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from intone.audio import read_audio
from intone.bench.dataset import synthetic_items
from intone.bench.runner import forced_frames
from intone.bench.server_metrics import STAGES, engine_breakdown
from intone.engine.config import default_params, load_profile
from intone.engine.core import EngineCore
from intone.engine.trace import audit_file
from intone.errors import IntoneError
from intone.eval.meta import MetaItem, parse_meta_list
from intone.protocol import SynthesisRequest, VoiceReference

# snapshot counters whose change over a level is reported
COUNTERS = ("reference_cache_hits", "reference_cache_misses", "frontend_batches", "frontend_clips",
            "graph_replays", "eager_decode_steps", "steps", "prefill_steps", "codec_calls")


class Workload:
    """The requests of a run in order: each (text, reference clip) once, or its clip from a pool."""

    def __init__(self, items: list[MetaItem], pool: int | None, stored: bool, model):
        self.items = [it for it in items if it.prompt_wav is not None and it.prompt_text] or items
        self.pool, self.stored, self.model = pool, stored, model
        self.next = 0
        self._features: dict[Path, dict] = {}  # --stored-voices: per clip, computed once

    def take(self, n: int) -> list[tuple[str, list[VoiceReference]]]:
        """The next n requests' (text, references); clips are read here, before the clock starts."""
        out = []
        for _ in range(n):
            text_item = self.items[self.next % len(self.items)]
            ref_item = self.items[self.next % self.pool] if self.pool else text_item
            self.next += 1
            out.append((text_item.target_text, self._reference(ref_item)))
        return out

    def _reference(self, item: MetaItem) -> list[VoiceReference]:
        if item.prompt_wav is None or not item.prompt_text:
            return []
        if self.stored:
            if item.prompt_wav not in self._features:
                audio, rate = read_audio(item.prompt_wav)
                self._features[item.prompt_wav] = self.model.reference_features(audio, rate)
            return [VoiceReference(text=item.prompt_text, features=self._features[item.prompt_wav])]
        audio, rate = read_audio(item.prompt_wav)
        return [VoiceReference(text=item.prompt_text, audio=audio, sample_rate=rate)]


def run_once(core: EngineCore, concurrency: int, requests: list[tuple[str, list[VoiceReference]]],
             frames: list[int] | None, max_new: int, tag: str, seed: int = 0, stream: bool = False) -> dict:
    """A closed loop: at most `concurrency` in flight; each finished request is replaced at once.
    stream=False asks for whole responses, as `intone bench` does without --stream."""
    n = len(requests)
    before = core.snapshot()
    start = time.perf_counter()
    submitted, done, total_frames = 0, 0, 0
    added_at, first_audio, finished_at, timings = {}, {}, {}, []
    while done < n:
        while submitted < n and submitted - done < concurrency:
            rid = f"{tag}-{submitted}"
            text, refs = requests[submitted]
            forced = frames[submitted % len(frames)] if frames else None
            params = default_params(core.profile, seed=seed + submitted, max_new_tokens=forced or max_new,
                                    ignore_eos=True if forced else None)
            core.add_request(SynthesisRequest(rid, text, refs, params=params, stream=stream))
            added_at[rid] = time.perf_counter()
            submitted += 1
        for chunk in core.step():
            now = time.perf_counter()
            if chunk.error:
                raise RuntimeError(f"{chunk.request_id}: {chunk.error}")
            if len(chunk.audio) and chunk.request_id not in first_audio:
                first_audio[chunk.request_id] = now - added_at[chunk.request_id]
            if chunk.finished:
                done += 1
                total_frames += chunk.end_frame
                finished_at[chunk.request_id] = now - added_at[chunk.request_id]
                if getattr(chunk, "timings", None):
                    timings.append(chunk.timings)
    wall = time.perf_counter() - start
    after = core.snapshot()
    audio_s = total_frames * core.model.samples_per_frame / core.model.sample_rate
    steps = after["steps"] - before["steps"]
    ttfa, completion = sorted(first_audio.values()), sorted(finished_at.values())
    step_ms = (after["mean_step_ms"] * after["steps"] - before["mean_step_ms"] * before["steps"]) / max(steps, 1)
    return dict(
        concurrency=concurrency, requests=n, frames=total_frames, wall_s=round(wall, 3),
        requests_per_s=round(n / wall, 3), audio_s_per_s=round(audio_s / wall, 3),
        mean_step_ms=round(step_ms, 2), steps=steps,
        completion_mean_s=round(statistics.mean(completion), 3) if completion else None,
        first_audio_mean_s=round(statistics.mean(ttfa), 3) if ttfa else None,
        first_audio_p50_s=round(ttfa[len(ttfa) // 2], 3) if ttfa else None,
        stages=engine_breakdown(timings),
        counters={k: after[k] - before[k] for k in COUNTERS if isinstance(after.get(k), (int, float))
                  and isinstance(before.get(k), (int, float))},
    )


def stage_line(row: dict) -> str:
    st = row["stages"]
    if not st["available"]:
        return f"concurrency {row['concurrency']}: {st['reason']}"
    parts = [f"{s} {st['stages'][s]['mean_s']:.4f}" for s in STAGES if st["stages"][s]["mean_s"] is not None]
    k = row["counters"]
    return (f"concurrency {row['concurrency']} mean s per request: " + ", ".join(parts)
            + f" | cache {k.get('reference_cache_hits', '—')} hits / {k.get('reference_cache_misses', '—')} misses"
            + f" | graph replays {k.get('graph_replays', '—')}, eager steps {k.get('eager_decode_steps', '—')}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny:fish-s2")
    ap.add_argument("--profile", default="fish-s2-high-concurrency")
    ap.add_argument("--device", default=None)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--dataset", default="synthetic", help="'synthetic' (default) or a Seed-TTS meta.lst")
    ap.add_argument("--num-requests", "--requests-per-level", dest="num_requests", type=int, default=None,
                    help="measured requests per level (default: 2 x concurrency, at least 4)")
    ap.add_argument("--stream", action="store_true", help="streamed requests (chunked audio), not whole responses")
    ap.add_argument("--warmup", type=int, default=4, help="requests run first at each level, excluded")
    ap.add_argument("--reference-pool", type=int, default=None, metavar="N",
                    help="cycle through N reference clips (cache hits); default: a distinct clip per request")
    ap.add_argument("--stored-voices", action="store_true",
                    help="pass precomputed reference features (no frontend work in the run)")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--force-output-frames", default=None, metavar="SPEC", help="N, uniform:A:B or normal:MEAN:STD")
    ap.add_argument("--forced-frames", type=int, default=None, help=argparse.SUPPRESS)  # old spelling of N
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset-dir", default=None, help="where synthetic clips are written (default: a temp dir)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="profile override, e.g. cosyvoice3.flow.autocast=bfloat16 (repeatable)")
    args = ap.parse_args(argv)
    spec = args.force_output_frames or (str(args.forced_frames) if args.forced_frames else None)
    if args.reference_pool is not None and args.reference_pool < 1:
        raise IntoneError(f"--reference-pool: expected N >= 1, got {args.reference_pool}")

    levels = [int(c) for c in args.concurrency.split(",")]
    sizes = [(args.num_requests or max(4, 2 * c), args.warmup) for c in levels]
    overrides = {"ar.max_num_seqs": max(levels), "codec.max_batch": max(levels)}
    if args.device:
        overrides["device"] = args.device
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    profile = load_profile(args.profile, **overrides)
    trace = Path(tempfile.mkdtemp()) / "trace.jsonl"
    core = EngineCore.build(args.model, profile, str(trace))
    need = max(sum(n + w for n, w in sizes), args.reference_pool or 0)
    if args.dataset == "synthetic":
        data_dir = Path(args.dataset_dir) if args.dataset_dir else Path(tempfile.mkdtemp())
        items = synthetic_items(need, data_dir, seed=args.seed)
    else:
        items = parse_meta_list(args.dataset)
    workload = Workload(items, args.reference_pool, args.stored_voices, core.model)
    if args.reference_pool and len(workload.items) < args.reference_pool:
        raise IntoneError(f"--reference-pool {args.reference_pool}: the dataset has {len(workload.items)} clips")
    mode = ("stored voices (precomputed features)" if args.stored_voices else "raw reference audio") + ", " + (
        f"pool of {args.reference_pool} clips (cache hits)" if args.reference_pool else "a distinct clip per request")
    print(f"reference audio: {mode}", flush=True)
    results = []
    try:
        for c, (n, warm) in zip(levels, sizes):
            if warm:
                frames = forced_frames(spec, warm, args.seed + 1)
                run_once(core, c, workload.take(warm), frames, args.max_new_tokens, f"warm{c}", seed=10**6, stream=args.stream)
            frames = forced_frames(spec, n, args.seed)
            row = run_once(core, c, workload.take(n), frames, args.max_new_tokens, f"c{c}", seed=args.seed, stream=args.stream)
            row["warmup"] = warm
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "stages"}), flush=True)
            print(stage_line(row), flush=True)
    finally:
        core.tracer.close()
        close = getattr(core, "close", None)
        if close:
            close()
    report = audit_file(trace)
    bad = [a.request_id for a in report.values() if not a.exact]
    summary = dict(model=args.model, device=str(core.model.device), profile=profile.name, references=mode,
                   force_output_frames=spec, results=results, audit=dict(requests=len(report), not_exact=bad),
                   kv=core.snapshot()["kv_blocks_free"] == core.kv.num_blocks)
    print(json.dumps(summary["audit"]), "kv pool empty again:", summary["kv"])
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
