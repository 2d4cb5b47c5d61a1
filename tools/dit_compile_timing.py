"""Diagnostic (GPU): CosyVoice3's flow at real size under bf16 autocast, eager against a compiled DiT
(`codec.compile_unit`): compile seconds and ms per flow call at a few batch shapes.

    python3 tools/dit_compile_timing.py --unit block
"""

import argparse
import time

import torch

from intone.models.cosyvoice3.flow import CosyFlow, FlowConfig, FlowRequest
from intone.models.cosyvoice3.vocoder_stage import compile_dit


def requests(rows: int, tokens: int, prompt: int, dev) -> list[FlowRequest]:
    g = torch.Generator().manual_seed(rows)
    return [FlowRequest(torch.randint(0, 6561, (tokens + 3 * i,), generator=g).to(dev),
                        torch.randint(0, 6561, (prompt,), generator=g).to(dev), torch.randn(2 * prompt, 80).to(dev),
                        torch.randn(192).to(dev), streaming=True, finalize=False) for i in range(rows)]


def timed(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--unit", default="block", choices=["dit", "block"])
    ap.add_argument("--shapes", default="16x100,64x60,8x240", help="rows x new tokens (prompt 140 tokens)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flow = CosyFlow(FlowConfig()).to(dev).eval()
    with torch.no_grad():
        for p in flow.parameters():
            p.normal_(0.0, 0.02 if p.dim() > 1 else 0.0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    batches = {s: requests(s[0], s[1], 140, dev) for s in shapes}
    with torch.autocast("cuda", torch.bfloat16):
        eager = {s: timed(lambda b=b: flow.inference(b)) for s, b in batches.items()}
        compile_dit(flow.decoder.estimator, args.unit)
        start = time.perf_counter()
        flow.inference(batches[shapes[0]][:2])
        torch.cuda.synchronize()
        print(f"compile ({args.unit}): {time.perf_counter() - start:.1f} s", flush=True)
        for s, b in batches.items():
            start = time.perf_counter()
            flow.inference(b)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            print(f"{s[0]} rows x {140 + s[1]} tokens: eager {eager[s]:.1f} ms, compiled {timed(lambda b=b: flow.inference(b)):.1f} ms "
                  f"(first call {first:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
