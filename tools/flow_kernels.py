"""Diagnostic (GPU): where a full-response codec call's time goes, alone on the GPU, per variant.

    python3 tools/flow_kernels.py --rows 12 --variant shipped:auto:bfloat16:flex --variant w16:bfloat16:none:flex

One call as the full-response profile's codec worker holds it at C64: `--rows` requests, references
of 75-200 tokens (3-8 s), outputs normal(128, 45) tokens. Per variant (name:flow dtype:autocast:attention,
the DiT compiled as served) the flow's wall ms per call, its GPU time by kernel kind (GEMM,
attention, Triton-fused elementwise, copies/casts, other), the useful TFLOP/s (the DiT's matmuls and
attention on the rows' real frames, CFG included) and the padding; then HiFT on the call's mels, per
HiFT dtype. The served call runs beside the talker; this is the yardstick of its arithmetic alone.
"""

import argparse
import collections
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from intone.models.cosyvoice3.flow import FlowRequest
from intone.models.cosyvoice3.model import random_cosyvoice3
from intone.models.cosyvoice3.vocoder import compile_dit, store_for_autocast


def full_response_jobs(rows: int, device, seed: int = 0) -> list[FlowRequest]:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    jobs = []
    for _ in range(rows):
        prompt, total = rng.randint(75, 200), max(10, int(rng.gauss(128, 45)))
        jobs.append(FlowRequest(torch.randint(0, 6561, (total,), generator=g).to(device),
                                torch.randint(0, 6561, (prompt,), generator=g).to(device),
                                torch.randn(2 * prompt, 80, generator=g).to(device),
                                torch.randn(192, generator=g).to(device), streaming=False, finalize=True))
    return jobs


def kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul", "cublas")):
        return "gemm"
    if any(k in n for k in ("flash", "attention", "flex", "fmha", "sdpa")):
        return "attention"
    if n.startswith("triton"):
        return "triton"
    if any(k in n for k in ("copy", "cast", "to_copy", "fill")):
        return "copy/cast"
    return "other"


def useful_tflop(jobs, dim: int = 1024, ffn: int = 2048, layers: int = 22, steps: int = 10) -> float:
    """The DiT's matmuls and attention on the real frames (each row alone), CFG doubling the rows."""
    total = 0.0
    for j in jobs:
        n = 2 * (j.prompt_tokens.numel() + j.tokens.numel())  # mel frames
        per_layer = n * 2 * (4 * dim * dim + 2 * dim * ffn) + 4 * n * n * dim
        total += 2 * steps * layers * per_layer
    return total / 1e12


def timed(fn, repeats: int) -> tuple[float, dict, int]:
    fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append(1000 * (time.perf_counter() - start))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kind, count = collections.defaultdict(float), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind(e.name)] += e.device_time / 1000
            count += 1
    return min(walls), {k: round(v, 1) for k, v in sorted(by_kind.items())}, count


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[],
                    help="name:flow dtype (auto|bfloat16|float16):autocast (none|bfloat16|float16):attention "
                         "(sdpa|flex|varlen)[:per-pass] (per-pass: autocast casts the DiT's weights in every pass, "
                         "as served before session 25; else they are stored cast, as served now)")
    ap.add_argument("--hift", default="float32,float16", help="HiFT dtypes to time on the call's mels (none: no HiFT)")
    args = ap.parse_args(argv)
    args.hift = "" if args.hift == "none" else args.hift
    device = torch.device("cuda", torch.cuda.current_device())
    jobs = full_response_jobs(args.rows, device)
    frames = [2 * (j.prompt_tokens.numel() + j.tokens.numel()) for j in jobs]
    padding = 1 - sum(frames) / (len(frames) * max(frames))
    tflop = useful_tflop(jobs)
    mels = None
    for spec in args.variant or ["shipped:auto:bfloat16:flex"]:
        name, dtype, autocast, attention, *per_pass = spec.split(":")
        model = random_cosyvoice3(device)
        if dtype != "auto":
            model.flow.to(getattr(torch, dtype))
        if autocast != "none" and not per_pass:  # as `make_vocoder` stores them
            store_for_autocast(model.flow.decoder.estimator, getattr(torch, autocast))
        model.flow.decoder.estimator.attention_kernel = attention
        torch._dynamo.reset()
        compile_dit(model.flow.decoder.estimator, "dit")
        cast = getattr(torch, autocast) if autocast != "none" else None

        def call():
            with torch.inference_mode(), torch.autocast("cuda", cast or torch.bfloat16, enabled=cast is not None,
                                                         cache_enabled=False):
                return model.flow.inference(jobs)

        start = time.perf_counter()
        mels = call()
        first = time.perf_counter() - start
        ms, kinds, kernels = timed(call, args.repeats)
        print(json.dumps(dict(piece="flow", variant=name, rows=args.rows, wall_ms=round(ms, 1),
                              gpu_ms_by_kind=kinds, kernels=kernels, useful_tflop_s=round(tflop / ms * 1000, 1),
                              ms_per_row=round(ms / args.rows, 2),
                              padding=0.0 if model.flow.runs_packed(jobs) else round(padding, 3),
                              first_call_s=round(first, 1))), flush=True)
        if mels is not None and args.hift:
            for dt in args.hift.split(","):
                model.hift.to(getattr(torch, dt))
                model.hift.f0_predictor.to(torch.float64)  # as served: the F0 predictor stays float64

                def vocode():
                    with torch.inference_mode():
                        return model.hift.vocode_batch(mels, [True] * len(mels), None, None)

                ms, kinds, kernels = timed(vocode, args.repeats)
                print(json.dumps(dict(piece="hift", dtype=dt, rows=args.rows, wall_ms=round(ms, 1),
                                      gpu_ms_by_kind=kinds, kernels=kernels, ms_per_row=round(ms / args.rows, 2))),
                      flush=True)
            args.hift = ""  # once: HiFT does not depend on the flow's variant
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
