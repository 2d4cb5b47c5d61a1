"""`intone bench`: a concurrency sweep against a server (ours or any compatible one), and the
A/B/B/A protocol. Writes results.json, report.md and plots."""

from __future__ import annotations

import asyncio
import json
import math
import platform
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from intone.bench.client import LoadSpec, ReferencePlan, run_load
from intone.bench.dataset import synthetic_items
from intone.bench.metrics import opening_burst, summarize
from intone.bench.presets import apply_preset
from intone.bench.profile_window import with_profile
from intone.bench.report import after_run_line, write_plots, write_report
from intone.bench.server_metrics import level_breakdown, scrape
from intone.bench.server_process import GpuMemorySampler, ServerProcess
from intone.bench.soak import settle
from intone.bench.tail import burst_breakdown, tail_breakdown, traced_timings
from intone.engine.trace import audit_file
from intone.errors import IntoneError
from intone.eval.meta import MetaItem, parse_meta_list
from intone.eval.wer import evaluate_wer

TRACE, TRACE_SUFFIX = "frames", ".jsonl"  # the server's frame trace; with several engine cores frames.<k>.jsonl


def forced_frames(spec: str | None, n: int, seed: int) -> list[int] | None:
    """'300', 'uniform:100:400' or 'normal:MEAN:STD' -> n frame counts (deterministic in seed)."""
    if not spec:
        return None
    rnd = np.random.default_rng(seed)
    kind, *nums = spec.split(":")
    try:
        if not nums:
            return [int(kind)] * n
        a, b = (float(x) for x in nums)
        if kind == "uniform":
            values = rnd.uniform(a, b, n)
        elif kind == "normal":
            values = rnd.normal(a, b, n)
        else:
            raise ValueError(kind)
    except ValueError:
        raise IntoneError(f"--force-output-frames: expected N, uniform:A:B or normal:MEAN:STD, got {spec!r}") from None
    return [max(1, int(round(v))) for v in values]


def _all_items(args, out_dir: Path) -> list[MetaItem]:
    need = max(args.num_requests + args.warmup, getattr(args, "reference_pool", None) or 0)
    if args.dataset == "synthetic":
        return synthetic_items(need, out_dir / "dataset", seed=args.seed or 0)
    items = parse_meta_list(args.dataset)
    if len(items) < args.num_requests:
        raise IntoneError(f"--num-requests {args.num_requests}: the list has only {len(items)} rows")
    return items


def reference_pool(args, out_dir: Path) -> list[MetaItem] | None:
    """--reference-pool N: the first N distinct reference clips of the dataset; None: no pool."""
    n = getattr(args, "reference_pool", None)
    if not n:
        return None
    if n < 1:
        raise IntoneError(f"--reference-pool: expected N >= 1, got {n}")
    pool, seen = [], set()
    for it in _all_items(args, out_dir):
        if it.prompt_wav is not None and it.prompt_text and it.prompt_wav not in seen:
            seen.add(it.prompt_wav)
            pool.append(it)
    if len(pool) < n:
        raise IntoneError(f"--reference-pool {n}: the dataset has only {len(pool)} distinct reference clips")
    return pool[:n]


def load_items(args, out_dir: Path) -> tuple[list[MetaItem], list[MetaItem]]:
    """(measured, warm-up) items; warm-up items come from outside the measured set when possible
    (when not, ReferencePlan still gives them clips no measured request sends)."""
    need = args.num_requests + args.warmup
    items = _all_items(args, out_dir)
    measured = items[: args.num_requests]
    extra = items[args.num_requests : need]
    warm = extra if len(extra) == args.warmup else (measured * args.warmup)[: args.warmup]
    return measured, warm


def model_sample_rate(base_url: str, headers: dict | None) -> int:
    models = httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()
    rate = models["data"][0].get("sample_rate")
    if not rate:
        raise IntoneError("the server's /v1/models does not report sample_rate; pass --sample-rate")
    return int(rate)


def sweep(args, base_url: str, out_dir: Path, tag: str = "") -> dict:
    apply_preset(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    rate = args.sample_rate or model_sample_rate(base_url, headers)
    measured, warm = load_items(args, out_dir)
    plan = ReferencePlan(reference_pool(args, out_dir))
    print(f"reference audio: {plan.summary()['description']}", flush=True)
    levels = []
    for c in [int(x) for x in str(args.concurrency).split(",")]:
        save = _save_dir(args, c)
        frames = forced_frames(args.force_output_frames, len(measured), args.seed or 0)
        if plan.pool:  # the pool cycles on from the warm-up into the measured requests
            warm_refs = plan.assign(warm)
            refs = plan.assign(measured)
        else:  # measured requests take the clips as they are; repeats (warm-up, later levels) re-gained copies
            refs = plan.assign(measured)
            warm_refs = plan.assign(warm)
        spec = LoadSpec(stream=args.stream, seed=args.seed, max_new_tokens=args.max_new_tokens,
                        forced_frames=frames, request_rate=args.request_rate, save_audio=save, references=refs)
        if warm:
            warm_frames = forced_frames(args.force_output_frames, len(warm), (args.seed or 0) + 1)
            warm_spec = LoadSpec(**{**spec.__dict__, "save_audio": None, "references": warm_refs,
                                    "forced_frames": warm_frames})
            records, _ = asyncio.run(run_load(base_url, warm, c, warm_spec, rate, headers, tag=f"{tag}warm{c}-"))
            failed = [r for r in records if not r.ok]
            if failed:
                raise IntoneError(f"warm-up failed ({len(failed)} of {len(records)}): {failed[0].error}")
        before = scrape(base_url, headers)
        load = _measured(base_url, measured, c, spec, rate, headers, f"{tag}c{c}-")
        seconds = getattr(args, "profile_seconds", None)
        if seconds:
            (records, wall), profile = asyncio.run(with_profile(load, base_url, headers, args.profile_delay, seconds))
        else:
            (records, wall), profile = asyncio.run(load), None
        after = scrape(base_url, headers)
        burst = opening_burst(records, c, args.stream) if args.request_rate == float("inf") else None
        levels.append(dict(concurrency=c, summary=summarize(records, wall, args.stream), burst=burst,
                           server=level_breakdown(before, after), profile=profile,
                           records=[r.to_dict() for r in records], audio_dir=str(save) if save else None))
        s = levels[-1]["summary"]
        print(f"concurrency {c}: {s['completed']}/{s['requests']} ok, {s['requests_per_s']:.3f} req/s, "
              f"{s['audio_s_per_s']:.2f} audio-s/s, mean completion {s['completion_s']['mean'] or 0:.2f} s"
              + (f", mean first audio {s['first_audio_s']['mean'] or 0:.2f} s" if s.get("first_audio_s") else ""),
              flush=True)
    return dict(sample_rate=rate, references=plan.summary(), levels=levels)


async def _measured(base_url, items, c, spec, rate, headers, tag):
    with tqdm(total=len(items), desc=f"concurrency {c}", unit="req") as bar:
        return await run_load(base_url, items, c, spec, rate, headers, progress=bar, tag=tag)


def _save_dir(args, c: int) -> Path | None:
    if not args.save_audio:
        return None
    many = len(str(args.concurrency).split(",")) > 1
    path = Path(args.save_audio) / (f"c{c}" if many else "")
    path.mkdir(parents=True, exist_ok=True)
    return path


def serve_args(args) -> list[str]:
    out = ["--model", args.model]
    for flag, value in (("--profile", args.profile), ("--device", args.device), ("--api-key", args.api_key)):
        if value:
            out += [flag, value]
    if getattr(args, "profile_seconds", None):  # our own server: its profiler's windows go beside the report
        out += ["--profile-dir", str(Path(args.output_dir) / "profile")]
    return out + (args.serve_args.split() if args.serve_args else [])


def run(args) -> dict:
    apply_preset(args)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    server, audit = None, getattr(args, "audit", True)
    if not args.base_url:
        if not args.model:
            raise IntoneError("give --base-url URL or --model M")
        for old in out_dir.glob(f"{TRACE}*{TRACE_SUFFIX}"):  # the server appends (a file per engine core)
            old.unlink()
        trace = ["--trace-frames", str(out_dir / f"{TRACE}{TRACE_SUFFIX}")] if audit else []
        server = ServerProcess(serve_args(args) + trace, out_dir / "server.log")
    gpu = GpuMemorySampler()
    try:
        result = sweep(args, args.base_url or server.base_url, out_dir)
        if server:
            result["after_run"] = after_run(server.base_url, out_dir if audit else None, args)
            if audit:
                timings = traced_timings(sorted(out_dir.glob(f"{TRACE}*{TRACE_SUFFIX}")))
                for level in result["levels"]:
                    level["tail"] = tail_breakdown(level["records"], timings, args.stream)
                    if level.get("burst"):  # a closed loop's: its opening burst, stage by stage
                        level["burst_stages"] = burst_breakdown(level["records"], timings, args.stream,
                                                                level["concurrency"])
    finally:
        peak = gpu.stop()
        if server:
            server.stop()
    results = dict(title=args.title or (args.model or args.base_url), run=_provenance(args, peak), **result)
    _evaluate_quality(args, results)
    return _write(results, out_dir)


def after_run(base_url: str, trace_dir: Path | None, args) -> dict:
    """What every run of our own server must leave: each request's chunks cover its frames exactly
    once, in order, with one terminal chunk (the frame audit of the server's traces in trace_dir, one
    per engine core, warm-up included), and the engine's per-request tables empty again once the load
    is gone. A check that cannot be made says why and is not clean; the run's figures stay."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    try:
        tables = {k: None if math.isnan(v) else v for k, v in settle(base_url, headers=headers).items()}
        out: dict = dict(engine_tables=tables, tables_empty=all(v == 0 for v in tables.values()))
        if trace_dir is not None:
            report = {}
            for trace in sorted(trace_dir.glob(f"{TRACE}*{TRACE_SUFFIX}")):
                report.update(audit_file(trace))  # a request runs on one core: ids do not repeat across files
            not_exact = sorted(r for r, a in report.items() if not a.exact)
            out["audit"] = dict(requests=len(report), not_exact=not_exact[:20])
            if not report:
                out["error"] = "the server traced no frames"
    except Exception as e:  # noqa: BLE001 - e.g. the server is gone, or a trace line was cut off
        out = dict(engine_tables={}, tables_empty=False, error=f"{type(e).__name__}: {e}")
    out["clean"] = out["tables_empty"] and "error" not in out and not out.get("audit", {}).get("not_exact")
    print(f"after the run: {after_run_line(out)}", flush=True)
    return out


def _provenance(args, peak_mib) -> dict:
    return dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), target=args.base_url or f"intone serve {' '.join(serve_args(args))}",
                preset=getattr(args, "preset", None), dataset=args.dataset, concurrency=str(args.concurrency),
                reference_pool=getattr(args, "reference_pool", None), num_requests=args.num_requests, warmup=args.warmup, stream=args.stream,
                seed=args.seed, request_rate=args.request_rate, max_new_tokens=args.max_new_tokens,
                force_output_frames=args.force_output_frames, peak_gpu_mib=peak_mib, host=platform.node())


def _evaluate_quality(args, results: dict) -> None:
    if not (args.asr_model or args.sim_checkpoint):
        return
    if not args.save_audio:
        raise IntoneError("--asr-model / --sim-checkpoint need --save-audio")
    items = {it.utt_id: it for it in load_items(args, Path(args.output_dir))[0]}
    for level in results["levels"]:
        audio_dir, quality = Path(level["audio_dir"]), {}
        if args.asr_model:  # the quality models (torch, transformers) load only when asked for
            quality.update(evaluate_wer(audio_dir, list(items.values()), Path(args.asr_model)).summary())
        if args.sim_checkpoint:
            from intone.eval.sim import evaluate_sim

            quality.update(evaluate_sim(audio_dir, list(items.values()), Path(args.sim_checkpoint),
                                        Path(args.wavlm) if args.wavlm else None).summary())
        level["quality"] = quality


def _write(results: dict, out_dir: Path) -> dict:
    results["plots"] = write_plots(results, out_dir)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    write_report(results, out_dir)
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'report.md'} and {len(results['plots'])} plots")
    return results


def run_abba(args) -> dict:
    """A, B, B, A: a fresh server per arm, the same load each time; per-arm and pooled results."""
    apply_preset(args)
    if not (args.a and args.b):
        raise IntoneError("abba needs --a 'serve args' and --b 'serve args'")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = []
    for i, label in enumerate("ABBA"):
        arm_dir = out_dir / f"{i + 1}-{label}"
        arm_dir.mkdir(exist_ok=True)
        server = ServerProcess.from_string(args.a if label == "A" else args.b, arm_dir / "server.log")
        gpu = GpuMemorySampler()
        try:
            result = sweep(args, server.base_url, out_dir, tag=f"{i + 1}{label}-")
        finally:
            peak = gpu.stop()
            server.stop()
        arms.append(dict(label=label, start=i + 1, peak_gpu_mib=peak, **result))
        print(f"arm {i + 1} ({label}) done", flush=True)
    pooled = {label: _pool([a for a in arms if a["label"] == label]) for label in "AB"}
    report = dict(a=args.a, b=args.b, arms=[{k: v for k, v in a.items() if k != "levels"} | {
        "summaries": {lvl["concurrency"]: lvl["summary"] for lvl in a["levels"]}} for a in arms], pooled=pooled)
    (out_dir / "abba.json").write_text(json.dumps(report, indent=2))
    _abba_report(report, out_dir)
    return report


def _pool(arms: list[dict]) -> dict:
    """Per concurrency: the mean of the two starts and their spread (max - min, % of mean)."""
    out = {}
    for lvl in arms[0]["levels"]:
        c = lvl["concurrency"]
        values = [next(x for x in a["levels"] if x["concurrency"] == c)["summary"] for a in arms]
        row = {}
        for key in ("audio_s_per_s", "requests_per_s"):
            v = [s[key] for s in values]
            mean = float(np.mean(v))
            row[key] = dict(mean=mean, spread_pct=100 * (max(v) - min(v)) / mean if mean else None)
        comp = [s["completion_s"]["mean"] for s in values if s["completion_s"]["mean"] is not None]
        row["completion_s_mean"] = float(np.mean(comp)) if comp else None
        out[c] = row
    return out


def _abba_report(report: dict, out_dir: Path) -> None:
    lines = ["# intone bench abba", "", f"- A: `{report['a']}`", f"- B: `{report['b']}`", "",
             "| arm | concurrency | audio-s/s | req/s | mean completion s | peak GPU MiB |", "|---|---|---|---|---|---|"]
    for arm in report["arms"]:
        for c, s in arm["summaries"].items():
            lines.append(f"| {arm['start']}-{arm['label']} | {c} | {s['audio_s_per_s']:.2f} | {s['requests_per_s']:.3f} | "
                         f"{s['completion_s']['mean'] or 0:.2f} | {arm['peak_gpu_mib'] or '—'} |")
    lines += ["", "| pooled | concurrency | audio-s/s | spread % | req/s | spread % |", "|---|---|---|---|---|---|"]
    for label, rows in report["pooled"].items():
        for c, row in rows.items():
            a, r = row["audio_s_per_s"], row["requests_per_s"]
            lines.append(f"| {label} | {c} | {a['mean']:.2f} | {a['spread_pct'] or 0:.1f} | {r['mean']:.3f} | "
                         f"{r['spread_pct'] or 0:.1f} |")
    (out_dir / "abba.md").write_text("\n".join(lines) + "\n")
