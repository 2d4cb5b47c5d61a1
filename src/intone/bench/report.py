"""report.md and PNG plots from a benchmark's results."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from intone.bench.profile_window import profile_lines, profiled_note
from intone.bench.tail import tail_lines
from intone.protocol import REQUEST_STAGES as STAGES, STEP_COMPANY

STAGE_NOTE = ("Mean seconds per request in each stage, from the server's own `intone_request_stage_seconds` over "
              "the level (warm-up excluded). api_in: HTTP request parsed -> handed to the engine (reference "
              "loading); frontend: reference features; queue: features ready -> first AR step; prefill: the "
              "step that ran its prefill; first_hop: end of that step -> first chunk handed to the codec; first_codec: "
              "that -> its audio delivered; decode: end of the prefill step -> last frame; codec: every codec call that "
              "carried its chunks, each in full; api_out: terminal chunk -> response handed over (encoding); "
              "total: the engine core's whole span. Stages overlap; they do not add up.")

COLUMNS = ["concurrency", "WER %", "SIM", "mean audio s", "req/s", "audio-s/s", "mean completion s",
           "mean first audio s", "failed"]


def _fmt(value, digits=3) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table_row(level: dict) -> list[str]:
    s = level["summary"]
    quality = level.get("quality", {})
    first = s["first_audio_s"]["mean"] if s.get("first_audio_s") else None
    return [
        str(level["concurrency"]), _fmt(quality.get("wer_mean_x100"), 2), _fmt(quality.get("sim_mean_x100"), 1),
        _fmt(s["mean_audio_s"], 2), _fmt(s["requests_per_s"]), _fmt(s["audio_s_per_s"], 2),
        _fmt(s["completion_s"]["mean"]), _fmt(first), str(s["failed"]),
    ]


def reference_line(results: dict) -> str:
    refs = results.get("references")
    if not refs:
        return ""
    if refs["mode"] == "pool":
        return (f"**Reference audio: CACHED VARIANT, {refs['description']}; not comparable with the "
                f"unique-reference numbers.**")
    return f"**Reference audio: {refs['description']} ({refs['distinct_clips']} distinct clips).**"


def stage_tables(results: dict) -> list[str]:
    levels = results["levels"]
    lines = ["## Where the time goes", ""]
    if not any(lvl.get("server", {}).get("available") for lvl in levels):
        reason = next((lvl["server"].get("reason") for lvl in levels if lvl.get("server")), None)
        return lines + [f"No per-stage breakdown: {reason or 'the server exports no per-stage metrics'}.", ""]
    lines += [STAGE_NOTE, "", "| concurrency | " + " | ".join(f"{s} s" for s in STAGES) + " | requests |",
              "|" + "---|" * (len(STAGES) + 2)]
    for lvl in levels:
        srv = lvl.get("server") or {}
        if not srv.get("available"):
            lines.append(f"| {lvl['concurrency']} | " + " | ".join("—" for _ in STAGES) + " | — |")
            continue
        st = srv["stages"]
        lines.append(f"| {lvl['concurrency']} | " + " | ".join(_fmt(st[s]["mean_s"], 4) for s in STAGES)
                     + f" | {st['total']['requests'] or st['api_in']['requests']} |")
    lines += ["", "| concurrency | reference cache hits | misses | frontend clips | frontend batches | "
              "frontend busy s | queued s per job | graph replays | eager decode steps | codec graph replays / "
              "eager | engine steps | mean step ms | rows per step | codec calls | codec busy s | flow s | HiFT s | codec padding % | HiFT padding % | "
              "first-chunk calls | s per first-chunk call | GPU s per first-chunk call | flow s of it | chunks per first-chunk call "
              "| preempted calls | prefix-cache blocks | compiles |",
              "|" + "---|" * 27]
    for lvl in levels:
        srv = lvl.get("server") or {}
        k = srv.get("counters") or {}
        lines.append(f"| {lvl['concurrency']} | " + " | ".join(_count(k.get(key)) for key in (
            "reference_cache_hits", "reference_cache_misses", "frontend_clips", "frontend_batches"))
            + f" | {_fmt(k.get('frontend_busy_seconds'), 2)} | {_fmt(_per(k, 'frontend_queued_seconds'), 3)} | "
            + " | ".join(_count(k.get(key)) for key in ("graph_replays", "eager_decode_steps"))
            + f" | {_count(k.get('codec_graph_replays'))} / {_count(k.get('codec_eager_runs'))} | "
            + _count(k.get("engine_steps"))
            + f" | {_fmt(srv.get('mean_step_ms'), 2)} | {_fmt(_rows_per_step(k), 1)} | {_count(k.get('codec_calls'))}"
            + f" | {_fmt(k.get('codec_busy_seconds'), 2)} | {_fmt(k.get('codec_flow_seconds'), 2)}"
            + f" | {_fmt(k.get('codec_vocoder_seconds'), 2)} | {_fmt(_padding(k), 1)} | {_fmt(_padding(k, 'hift'), 1)}"
            + f" | {_count(k.get('codec_first_calls'))} | {_fmt(_per_call(k, 'codec_first_call_seconds'), 3)}"
            + f" | {_fmt(_per_call(k, 'codec_first_call_gpu_seconds'), 3)}"
            + f" | {_fmt(_per_call(k, 'codec_first_call_flow_seconds'), 3)}"
            + f" | {_fmt(_per_call(k, 'codec_first_call_chunks'), 1)} | {_count(k.get('codec_preempted_calls'))}"
            + f" | {_count(k.get('prefix_cache_blocks'))} | {_count(k.get('compiled_graphs'))} |")
    level_lines = _ahead_lines(levels) + _step_lines(levels)
    lines += [""] + level_lines if level_lines else []
    return lines + ["rows per step: frames made per AR step over the level (its seats filled, of ar.max_num_seqs). "
                    "frontend busy s: the workers' time on batches over the level, summed over the workers (near "
                    "workers x the level's wall time: saturated); queued: a request's wait for a worker before its "
                    "batch began. codec busy s: the codec's time in decode calls over the level (near the level's wall time: the "
                    "codec is saturated); flow s, HiFT s: CosyVoice3's two pieces on the codec's stream; codec padding: the share of the codec's computed rows x length that was padding (CosyVoice3: the flow's token rows; Fish: the decoder's frames); HiFT padding: CosyVoice3's HiFT calls' share (rows x mel frames, their graphs' shapes when replayed). "
                    "first-chunk calls: codec calls made only of streams' first chunks (`schedule: first` or "
                    "`preempt`, the latter's made at a backlog call's pause points too); their length against first_codec is how long a first chunk waited for "
                    "its call to start; their GPU span (CosyVoice3) against their length, how much of a call was "
                    "host time; flow s of it: the flow's part of that span (the rest is HiFT). preempted calls: made at a backlog call's pause points. compiles: graphs torch.compile "
                    "compiled during the level (a request waited for each; 0 when start-up compiled everything).", ""]


def _step_lines(levels: list[dict]) -> list[str]:
    """Where an AR step's time went: the loop waiting for its tokens (the rest is host work), and the step's span
    on the GPU (the loop's stream; it stretches when other streams' kernels hold the SMs)."""
    out = []
    for lvl in levels:
        srv = lvl.get("server") or {}
        k, step = srv.get("counters") or {}, srv.get("mean_step_ms")
        wait, steps = k.get("step_wait_seconds"), k.get("engine_steps")
        if step is None or wait is None or not steps:
            continue
        line = f"- C{lvl['concurrency']}: an AR step {step:.2f} ms, {1000 * wait / steps:.2f} ms of it the loop " \
               "waiting for its tokens"
        paced = k.get("step_pace_seconds") or 0.0
        if paced:
            line += f", {1000 * paced / steps:.2f} ms asleep before its launch (ar.min_step_ms)"
        line += " (the rest host work)"
        gpu, timed = k.get("step_gpu_seconds"), k.get("gpu_timed_steps")
        if gpu is not None and (timed or 0) > 0:
            line += f"; on the GPU {1000 * gpu / timed:.2f} ms a step (the loop's stream, SM waits included)"
        out.append(line)
        out += _company_line(lvl["concurrency"], k)
        out += _host_line(lvl["concurrency"], k, steps)
        out += _frontend_process_line(lvl["concurrency"], k)
    return out


def _company_line(concurrency: int, k: dict) -> list[str]:
    """The steps' GPU span by what ran beside them (`STEP_COMPANY`): the step alone against the step beside the
    codec's calls, the frontend's batches, or carrying a prefill."""
    parts = []
    for c in STEP_COMPANY:
        gpu, timed = k.get(f"step_gpu_seconds_{c}"), k.get(f"gpu_timed_steps_{c}")
        if gpu is not None and timed:
            tokens = k.get("gpu_timed_prefill_tokens") if c == "prefill" else None
            each = f", {tokens / timed:.0f} prompt tokens a step" if tokens else ""
            parts.append(f"{c} {1000 * gpu / timed:.2f} ({int(timed)}{each})")
    if not parts:
        return []
    return [f"- C{concurrency}: the step on the GPU by what ran beside it, ms (steps): " + ", ".join(parts)]


def _frontend_process_line(concurrency: int, k: dict) -> list[str]:
    """With `frontend.process`: a clip's time in the frontend processes against the workers' busy time for it."""
    inside, busy, clips = k.get("frontend_process_seconds"), k.get("frontend_busy_seconds"), k.get("frontend_clips")
    if inside is None or busy is None or not clips:
        return []
    return [f"- C{concurrency}: the frontend processes encoded for {1000 * inside / clips:.1f} ms a clip, of the "
            f"workers' {1000 * busy / clips:.1f} ms busy a clip (the rest: messages, and their prompts here)"]


def _host_line(concurrency: int, k: dict, steps: float) -> list[str]:
    """Whose CPU the steps' host time was: the loop's launching, and each thread's CPU time per step (a loop
    whose host time is well above its CPU time waited off the CPU: for the GIL, or blocked)."""
    launch = k.get("step_launch_seconds")
    cpu = {name: k.get(f"{key}_cpu_seconds") for key, name in
           (("loop", "the loop"), ("codec", "the codec worker"), ("frontend", "the frontend workers"),
            ("process", "the whole process"))}
    if launch is None or cpu["the loop"] is None:
        return []
    per_step = ", ".join(f"{name} {1000 * v / steps:.2f}" for name, v in cpu.items() if v is not None)
    return [f"- C{concurrency}: building and launching a step {1000 * launch / steps:.2f} ms of its host work; "
            f"CPU time per step, ms: {per_step}"]


def _ahead_lines(levels: list[dict]) -> list[str]:
    """CosyVoice3 with `cosyvoice3.flow.reference_ahead`: how many streams' references were solved ahead of their
    first hops, and how many prepares were left undone (their first hops came first)."""
    out = []
    for lvl in levels:
        k = (lvl.get("server") or {}).get("counters") or {}
        ahead, skipped = k.get("codec_references_ahead"), k.get("codec_prepares_skipped")
        if ahead or skipped:
            out.append(f"- C{lvl['concurrency']}: references solved ahead {_count(ahead)}, prepares skipped "
                       f"{_count(skipped)} (their first hops came first)")
    return out


MEMORY_GAUGES = ("kv_cache_bytes", "gpu_allocated_peak_at_ready_bytes", "gpu_allocated_peak_bytes",
                 "gpu_reserved_bytes", "gpu_reserved_peak_bytes")


def memory_table(results: dict) -> list[str]:
    """The engine process's GPU memory after each level (torch's allocator; peaks since start-up)."""
    rows = [(lvl["concurrency"], (lvl.get("server") or {}).get("gauges") or {}) for lvl in results["levels"]]
    if not any(g.get("gpu_allocated_peak_bytes") is not None for _, g in rows):
        return []
    lines = ["GPU memory of the engine process after the level, GiB (torch's allocator; the device's own peak is "
             "peak_gpu_mib above, all processes and the CUDA context included):", "",
             "| concurrency | KV cache pool | allocated peak at ready | allocated peak | reserved | reserved peak |",
             "|---|---|---|---|---|---|"]
    for concurrency, g in rows:
        lines.append(f"| {concurrency} | " + " | ".join(
            _fmt(g[key] / 2**30 if g.get(key) is not None else None, 1) for key in MEMORY_GAUGES) + " |")
    return lines + [""] + _allocator_lines(results["levels"])


def _allocator_lines(levels: list[dict]) -> list[str]:
    """The allocator's device calls over each level (each of them stalls the GPU's streams)."""
    out = []
    for lvl in levels:
        k = (lvl.get("server") or {}).get("counters") or {}
        retries, mallocs, frees = (k.get(key) for key in ("gpu_alloc_retries", "gpu_device_mallocs", "gpu_device_frees"))
        if None in (retries, mallocs, frees):
            continue
        out.append(f"- C{lvl['concurrency']}: over the level the allocator retried {_count(retries)} allocations (each "
                   f"after freeing its cache, waiting for every stream), and made {_count(mallocs)} cudaMalloc and "
                   f"{_count(frees)} cudaFree calls (each cudaFree waits for the whole device)")
    return out + [""] if out else []


def _per(counters: dict, key: str) -> float | None:
    """A summed counter per frontend job (request or voice upload) of the level."""
    total, jobs = counters.get(key), counters.get("frontend_jobs")
    return total / jobs if total is not None and jobs else None


def _per_call(counters: dict, key: str) -> float | None:
    """A summed counter per first-chunk codec call of the level."""
    total, calls = counters.get(key), counters.get("codec_first_calls")
    return total / calls if total is not None and calls else None


def _rows_per_step(k: dict) -> float | None:
    frames, steps = k.get("engine_frames"), k.get("engine_steps")
    return frames / steps if frames is not None and steps else None


def _padding(counters: dict, piece: str = "") -> float | None:
    """The share of the codec's computed rows x length that was padding: the flow's (CosyVoice3) or
    decoder's (Fish) token rows, or (piece "hift") HiFT's mel frames."""
    unit = "hift_{}_frames" if piece == "hift" else "{}_tokens"
    padded, useful = (counters.get("codec_" + unit.format(kind)) for kind in ("padded", "useful"))
    return 100 * (1 - useful / padded) if padded and useful is not None else None


def _count(value) -> str:
    return "—" if value is None else str(int(round(value)))


def after_run_line(after: dict) -> str:
    """The after-run check (runner.after_run) in one line."""
    audit = after.get("audit")
    if after.get("error"):
        frames = f"the check failed: {after['error']}"
    elif audit is None:
        frames = "no frame trace (--no-audit)"
    elif audit["not_exact"]:
        frames = f"frame audit of {audit['requests']} requests: NOT EXACT: {', '.join(audit['not_exact'])}"
    else:
        frames = f"frame audit of {audit['requests']} requests: every one exact"
    tables = ", ".join(f"{name} {'—' if value is None else f'{value:g}'}"
                       for name, value in after["engine_tables"].items())
    return f"{'clean' if after['clean'] else '**NOT CLEAN**'}: {frames}; after the load: {tables}"


def stall_lines(results: dict) -> list[str]:
    """Streamed levels: which chunk the streams that stalled first waited for, and for how long in all."""
    lines = []
    for level in results["levels"]:
        s = level["summary"]
        firsts, stalled = s.get("first_stall_chunk"), s.get("underrun_s") or {}
        if firsts and s.get("streams_with_underrun"):
            lines.append(f"- C{level['concurrency']}: streams first stalled at chunk 2 / 3 / 4 / 5+: "
                         f"{firsts['2']} / {firsts['3']} / {firsts['4']} / {firsts['5+']}; stalled seconds per "
                         f"stream mean {_fmt(stalled.get('mean'))}, p90 {_fmt(stalled.get('p90'))}, "
                         f"p99 {_fmt(stalled.get('p99'))}")
    return ["", *lines] if lines else []


def burst_lines(results: dict) -> list[str]:
    """Closed-loop levels: the opening burst (every client's first request at once) against the rest."""
    lines = []
    for level in results["levels"]:
        b = level.get("burst")
        if not b:
            continue
        metric = b["metric"].removesuffix("_s").replace("_", " ")
        burst, rest = b["burst"], b["rest"]
        lines.append(f"- C{level['concurrency']}: the opening burst ({burst['requests']} sent at once) {metric} "
                     f"mean {_fmt(burst['stats']['mean'])} s{_stalled(burst)}; the {rest['requests']} after it: "
                     f"p50 {_fmt(rest['stats']['p50'])}, p90 {_fmt(rest['stats']['p90'])}, "
                     f"p99 {_fmt(rest['stats']['p99'])} s{_stalled(rest)}")
    return ["", *lines] if lines else []


def _stalled(group: dict) -> str:
    n = group["streams_with_underrun"]
    return f", {n} streams stalled" if n is not None else ""


def write_report(results: dict, out_dir: Path) -> Path:
    lines = [f"# intone bench: {results['title']}", ""]
    if reference_line(results):
        lines += [reference_line(results), ""]
    meta = results["run"]
    lines += [f"- {k}: `{v}`" for k, v in meta.items()]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for level in results["levels"]:
        lines.append("| " + " | ".join(table_row(level)) + " |")
    lines += profiled_note(results)
    lines += ["", "Latency percentiles (s):", "",
              "| concurrency | completion p50 | p90 | p99 | first audio p50 | p90 | p99 | RTF p50 | underrun streams |",
              "|---|---|---|---|---|---|---|---|---|"]
    for level in results["levels"]:
        s = level["summary"]
        c, f = s["completion_s"], s.get("first_audio_s") or {}
        lines.append(f"| {level['concurrency']} | {_fmt(c['p50'])} | {_fmt(c['p90'])} | {_fmt(c['p99'])} | "
                     f"{_fmt(f.get('p50'))} | {_fmt(f.get('p90'))} | {_fmt(f.get('p99'))} | "
                     f"{_fmt(s['rtf']['p50'])} | {_fmt(s.get('streams_with_underrun'))} |")
    lines += stall_lines(results) + burst_lines(results)
    if results.get("after_run"):
        lines += ["", "After the run: " + after_run_line(results["after_run"])]
    lines += [""] + stage_tables(results) + memory_table(results)
    for level in results["levels"]:
        lines += tail_lines(level.get("tail"), level["concurrency"])
        lines += tail_lines(level.get("burst_stages"), level["concurrency"])
    for level in results["levels"]:
        lines += profile_lines(level)
    lines += ["Plots: " + ", ".join(f"`{p}`" for p in results.get("plots", [])), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def write_plots(results: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for key, title, fname in (("completion_s", "Completion time", "completion_cdf.png"),
                              ("first_audio_s", "Time to first audio", "first_audio_cdf.png")):
        series = [(lvl["concurrency"], sorted(r[key] for r in lvl["records"] if r["ok"] and r[key] is not None))
                  for lvl in results["levels"]]
        series = [(c, v) for c, v in series if v]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for c, values in series:
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=f"concurrency {c}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{title} (CDF)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=120)
        plt.close(fig)
        made.append(fname)
    if len(results["levels"]) > 1:
        c = [lvl["concurrency"] for lvl in results["levels"]]
        fig, ax1 = plt.subplots(figsize=(6, 4))
        ax1.plot(c, [lvl["summary"]["audio_s_per_s"] for lvl in results["levels"]], "o-", label="audio-s/s")
        ax1.set_xlabel("concurrency")
        ax1.set_ylabel("audio seconds per second")
        ax2 = ax1.twinx()
        ax2.plot(c, [lvl["summary"]["requests_per_s"] for lvl in results["levels"]], "s--", color="C1", label="req/s")
        ax2.set_ylabel("requests per second")
        ax1.set_xscale("log", base=2)
        ax1.set_title("Throughput against concurrency")
        ax1.grid(alpha=0.3)
        fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
        fig.tight_layout()
        fig.savefig(out_dir / "throughput.png", dpi=120)
        plt.close(fig)
        made.append("throughput.png")
    return made
