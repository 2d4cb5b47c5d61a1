"""Time CosyVoice3's codec pieces (flow, HiFT) at real size on a GPU, in several precisions.

    python -m intone.bench.cosy_codec_time --batch 1,16 --tokens 150 --prompt 75

Each variant runs the same random-weight flow on the same inputs; `max_abs_vs_fp32` is its
mel's distance from the plain float32 run.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from intone.models.cosyvoice3.flow import FlowRequest
from intone.models.cosyvoice3.model import random_cosyvoice3
from intone.models.cosyvoice3.vocoder import compile_dit


def timed(fn, repeats: int = 3) -> tuple[float, object]:
    out = fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / repeats, out


def flow_requests(batch: int, tokens: int, prompt: int, streaming: bool, device) -> list[FlowRequest]:
    g = torch.Generator().manual_seed(0)
    return [FlowRequest(torch.randint(0, 6561, (tokens,), generator=g).to(device),
                        torch.randint(0, 6561, (prompt,), generator=g).to(device),
                        torch.randn(2 * prompt, 80, generator=g).to(device), torch.randn(192, generator=g).to(device),
                        streaming=streaming, finalize=not streaming) for _ in range(batch)]


def top_kernels(flow, reqs, n: int, autocast: bool = True) -> None:
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast), profile(activities=[ProfilerActivity.CUDA]) as prof:
        flow.inference(reqs)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--prompt", type=int, default=75)
    ap.add_argument("--kernels", type=int, default=0, help="print the top N CUDA kernels of one bf16 flow call")
    ap.add_argument("--compile-unit", choices=["dit", "block"], default="dit",
                    help="what the compiled variant compiles (cosyvoice3.flow.compile_unit)")
    args = ap.parse_args(argv)
    model = random_cosyvoice3("cuda")
    flow, hift = model.flow, model.hift
    variants = {
        "fp32": dict(tf32=False, autocast=None),
        "tf32": dict(tf32=True, autocast=None),
        "autocast_bf16": dict(tf32=False, autocast=torch.bfloat16),
        "bf16_weights": dict(tf32=False, autocast=None, weights=torch.bfloat16),
        "compiled_autocast_bf16": dict(tf32=False, autocast=torch.bfloat16, compiled=args.compile_unit),
    }
    for b in (int(x) for x in args.batch.split(",")):
        reqs = flow_requests(b, args.tokens, args.prompt, False, "cuda")
        reference = None
        for name, v in variants.items():
            torch.backends.cuda.matmul.allow_tf32 = v["tf32"]
            # A variant that changes the flow (weights, compilation) gets a copy: the others stay plain.
            run = copy.deepcopy(flow) if "weights" in v or "compiled" in v else flow
            if "weights" in v:
                run.to(v["weights"])
            if v.get("compiled"):
                compile_dit(run.decoder.estimator, v["compiled"])
                start = time.perf_counter()
                with torch.autocast("cuda", torch.bfloat16):
                    run.inference(reqs)
                torch.cuda.synchronize()
                print(json.dumps(dict(piece="flow", variant=name, compile_s=round(time.perf_counter() - start, 1))))
            with torch.autocast("cuda", v["autocast"] or torch.float32, enabled=v["autocast"] is not None):
                ms, mels = timed(lambda: run.inference(reqs))
            if run is not flow:
                if args.kernels:
                    top_kernels(run, reqs, args.kernels, autocast=v["autocast"] is not None)
                del run
            reference = reference if reference is not None else mels
            diff = max(float((a - r).abs().max()) for a, r in zip(mels, reference))
            print(json.dumps(dict(piece="flow", variant=name, batch=b, tokens=args.tokens, prompt=args.prompt,
                                  ms=round(ms, 1), max_abs_vs_fp32=diff)), flush=True)
        if args.kernels:
            top_kernels(flow, reqs, args.kernels)
        torch.backends.cuda.matmul.allow_tf32 = False
        mels = [m for m in reference]
        for name, finals in (("final", [True] * b), ("stream", [False] * b)):
            ms, _ = timed(lambda: hift.vocode_batch(mels, finals))
            print(json.dumps(dict(piece="hift", variant=name, batch=b, frames=mels[0].shape[1], ms=round(ms, 1))),
                  flush=True)


if __name__ == "__main__":
    main()
