"""Time CosyVoice3's flow over a served mix of jobs: how calls are split and which attention kernel.

    python -m intone.bench.cosy_flow_calls --jobs 48 --call-cost 512 --kernels sdpa,flex [--sms 96] [--continued]

The jobs are what a streamed C64 codec worker call holds: references of 75-200 tokens, each job
at one of its request's hops (25 + alignment, then 50, 100... tokens, or the final one at a
normal(128, 45) length). Per attention kernel the DiT is compiled as the streaming profile runs it
(whole, bf16 autocast without the cast cache), then the same jobs run in calls as full as the
bounds allow and in the cheapest split (`cosyvoice3.flow.call_cost`). `--sms` runs everything on a stream of a
green context of that many SMs (`codec.sms`), to price the codec's share alone. `--continued` also times
the full calls as `cosyvoice3.flow.cache` runs them: each streamed job solves only its new frames, against the
state its request's earlier hops kept (solved beforehand, untimed); `--profile` then shows where the time of
both kinds of call goes (GPU busy against wall, the ops that take it). `--first-chunks N` times one call of N new
streams' first hops (what a served first-chunk call holds), the flow and then HiFT on its mels: wall time, the
GPU's busy time in it (profiler) and its kernel count, to tell launch-bound from GPU-bound; `--graphs` times it
again replayed from CUDA graphs (the flow per Euler step, HiFT per call).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from intone.engine.codec_worker import codec_stream
from intone.engine.cuda_graphs import FunctionGraphs
from intone.models.cosyvoice3.flow import FlowRequest
from intone.models.cosyvoice3.flow_cache import solve_continued
from intone.models.cosyvoice3.flow_cache_pool import FlowCachePool
from intone.models.cosyvoice3.hift import graph_shape as hift_graph_shape
from intone.models.cosyvoice3.model import random_cosyvoice3
from intone.models.cosyvoice3.vocoder import compile_dit, store_for_autocast
from intone.ops.batching import group_jobs


def served_job_lengths(n: int, seed: int = 0) -> list[tuple[int, int, bool]]:
    """(prompt tokens, tokens, streamed) per job, as a streamed C64 mix holds them."""
    return [job[:3] for job in served_jobs(n, seed)]


def served_jobs(n: int, seed: int = 0) -> list[tuple[int, int, bool, list[int]]]:
    """(prompt tokens, tokens, streamed, the tokens of its request's earlier hops) per job."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        prompt, total = rng.randint(75, 200), max(10, int(rng.gauss(128, 45)))
        ends, end, hop = [], 25 + (-prompt) % 25, 25
        while end + 3 < total:
            ends.append((end + 3, True))
            hop = min(100, 2 * hop)
            end += hop
        ends.append((total, False))
        at = rng.randrange(len(ends))
        jobs.append((prompt, *ends[at], [tokens for tokens, _ in ends[:at]]))
    return jobs


def flow_jobs(lengths, device) -> list[FlowRequest]:
    g = torch.Generator().manual_seed(0)
    return [FlowRequest(torch.randint(0, 6561, (n,), generator=g).to(device),
                        torch.randint(0, 6561, (p,), generator=g).to(device),
                        torch.randn(2 * p, 80, generator=g).to(device), torch.randn(192, generator=g).to(device),
                        streaming=s, finalize=not s) for p, n, s in lengths]


def run_calls(flow, jobs, groups, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda", cache_enabled=False):
        for group in groups:
            flow.inference([jobs[i] for i in group])
    sync()
    return 1000 * (time.perf_counter() - start)


def earlier_caches(flow, jobs, earlier, device, pool) -> list:
    """Each streamed job's flow cache after its request's earlier hops (`solve_continued`, bf16 autocast)."""
    caches = []
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda", cache_enabled=False):
        for job, hops in zip(jobs, earlier):
            cache = None
            for n in hops if job.streaming else []:
                cache = solve_continued(flow, [replace(job, tokens=job.tokens[:n])], [cache], [True],
                                        pool=pool)[1][0]
            caches.append(cache)
    return caches


def run_continued(flow, jobs, caches, groups, device, pool) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda", cache_enabled=False):
        for group in groups:
            # kept as served (a stream's next hop goes on from it); dropped at once, as the next call's would be
            solve_continued(flow, [jobs[i] for i in group], [caches[i] for i in group],
                            [jobs[i].streaming for i in group], pool=pool)
    sync()
    return 1000 * (time.perf_counter() - start)


def where_the_time_goes(fn, device, rows: int = 14) -> str:
    """One run of fn under the profiler: its wall time against the GPU's busy time (launch-bound or not), and
    the ops that took the most GPU time and the most host time."""
    start = time.perf_counter()
    prof, busy, kernels = profiled(fn, device)
    wall = 1000 * (time.perf_counter() - start)
    table = prof.key_averages()
    by_gpu = table.table(sort_by="device_time_total" if device.type == "cuda" else "cpu_time_total", row_limit=rows)
    by_host = table.table(sort_by="self_cpu_time_total", row_limit=rows)
    return f"wall {wall:.1f} ms (profiled), GPU busy {busy:.1f} ms, {kernels} kernels\n{by_gpu}\n{by_host}"


def profiled(fn, device):
    """One run of fn (synchronized) under the profiler -> (the profile, the GPU's busy ms in it, its kernels)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return prof, sum(e.device_time for e in kernels) / 1000, len(kernels)


def first_chunk_jobs(n: int) -> list[tuple[int, int, bool]]:
    """(prompt tokens, tokens, streamed) of n new streams' first hops: 25 tokens plus the pad to the
    25-token grid, plus the 3 lookahead tokens."""
    rng = random.Random(1)
    prompts = [rng.randint(75, 200) for _ in range(n)]
    return [(p, 25 + (-p) % 25 + 3, True) for p in prompts]


def time_first_chunks(model, n: int, device, repeats: int, graphed: bool = False) -> dict:
    """One call of n first hops as the stage runs it (compiled DiT, bf16 autocast): wall ms, GPU busy ms
    and kernels, for the flow and for HiFT on its mels; `graphed`: both replayed from CUDA graphs captured
    at the call's shapes (`cosyvoice3.flow.cuda_graphs`, `cosyvoice3.hift.cuda_graphs`)."""
    jobs = flow_jobs(first_chunk_jobs(n), device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    graphs = FunctionGraphs() if graphed else None

    def under_autocast():
        return torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda", cache_enabled=False)

    def flow_call():
        with under_autocast():
            return model.flow.inference(jobs, graphs)

    if graphed:
        with under_autocast():
            model.flow.capture_solve(jobs, graphs)
    mels = flow_call()
    if graphed:
        model.hift.capture(*hift_graph_shape(n, max(m.shape[1] for m in mels)), graphs)
    pieces = {"flow": flow_call, "hift": lambda: model.hift.vocode_batch(mels, [False] * n, None, graphs)}
    out = dict(rows=n, frames=[m.shape[1] for m in mels])
    for name, fn in pieces.items():
        fn()
        sync()
        walls = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            walls.append(1000 * (time.perf_counter() - start))
        _, busy, kernels = profiled(fn, device)
        out[name] = dict(wall_ms=round(min(walls), 1), gpu_busy_ms=round(busy, 1), kernels=kernels)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=48, help="0: no whole-call rows (e.g. only --first-chunks)")
    ap.add_argument("--call-cost", type=int, default=512)
    ap.add_argument("--kernels", default="sdpa,flex")
    ap.add_argument("--sms", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--continued", action="store_true")
    ap.add_argument("--first-chunks", type=int, default=0, help="also time one call of this many first hops")
    ap.add_argument("--graphs", action="store_true", help="with --first-chunks: also replayed from CUDA graphs")
    ap.add_argument("--cache-gb", type=float, default=40.0, help="with --continued: the flow cache pool's bound")
    ap.add_argument("--profile", action="store_true", help="with --continued: where a continued and a whole "
                                                           "call's time goes (profiler tables)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    model = random_cosyvoice3(device)
    flow = model.flow
    if device.type == "cuda":  # as served under bf16 autocast
        store_for_autocast(flow.decoder.estimator, torch.bfloat16)
    stream, _context = codec_stream(device, args.sms)
    served = served_jobs(args.jobs)
    lengths = [job[:3] for job in served]
    jobs = flow_jobs(lengths, device)
    sizes = [p + n for p, n, _ in lengths]
    splits = {"full": group_jobs(sizes, 64, 16384), "split": group_jobs(sizes, 64, 16384, args.call_cost)}
    compile_dit(flow.decoder.estimator, "dit")
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for kernel in args.kernels.split(","):
            flow.decoder.estimator.attention_kernel = kernel
            torch._dynamo.reset()
            start = time.perf_counter()
            for groups in splits.values():
                run_calls(flow, jobs, groups, device)  # compiles, then meets each call's shape once
            compile_s = time.perf_counter() - start
            for name, groups in splits.items() if args.jobs else ():
                ms = min(run_calls(flow, jobs, groups, device) for _ in range(args.repeats))
                padded = sum(len(g) * max(sizes[i] for i in g) for g in groups)
                print(json.dumps(dict(kernel=kernel, calls=name, n_calls=len(groups), jobs=args.jobs, sms=args.sms,
                                      ms=round(ms, 1), padding=round(1 - sum(sizes) / padded, 3),
                                      first_pass_s=round(compile_s, 1))), flush=True)
            if args.continued and args.jobs:
                pool = FlowCachePool(int(args.cache_gb * 1e9))
                caches = earlier_caches(flow, jobs, [job[3] for job in served], device, pool)  # compiles both too
                ms = min(run_continued(flow, jobs, caches, splits["full"], device, pool) for _ in range(args.repeats))
                gib = sum(c.bytes for c in caches if c is not None) / 2**30
                print(json.dumps(dict(kernel=kernel, calls="full, continued", n_calls=len(splits["full"]),
                                      jobs=args.jobs, ms=round(ms, 1), cache_gib=round(gib, 2),
                                      refused=pool.refused)), flush=True)
                if args.profile:
                    print(where_the_time_goes(lambda: run_continued(flow, jobs, caches, splits["full"], device, pool),
                                              device), flush=True)
                    print(where_the_time_goes(lambda: run_calls(flow, jobs, splits["full"], device), device), flush=True)
                del caches
            if args.first_chunks:
                for graphed in (False, True) if args.graphs else (False,):
                    print(json.dumps(dict(kernel=kernel, calls="first chunks" + (", graphed" if graphed else ""),
                                          **time_first_chunks(model, args.first_chunks, device, args.repeats,
                                                              graphed))), flush=True)


if __name__ == "__main__":
    main()
