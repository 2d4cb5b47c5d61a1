"""Time one model step and one codec window at real size with random weights.

    python -m intone.bench.step_time --batch 1,16,64 --context 256,1024 --out step.json

Runs Fish S2 Pro's real-size architecture (or any config.json via --config) on the GPU. The
numbers are the yardstick for the engine's step times; compare them with
shared/tools/roofline-h200.txt. A row times the runner's whole step as the engine runs it (`ModelRunner.run`:
the host's packing, the upload, the decode and head, the download's start); the rows without graphs run the same
static step eagerly at its padded shapes (what an engine without graphs runs on a GPU). Served steps run the
AR's fused pieces (`--fuse-elementwise`); without the flag, as in every step_time row up to session 41, the plain ops.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from intone.engine.model_runner import ModelRunner, StepInput
from intone.models.base import Prompt
from intone.models.fish_s2.model import FishS2, random_s2_pro
from intone.ops import fused
from intone.ops.kv_cache import KVCache
from intone.protocol import SamplingParams

BLOCK = 16


def timed(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of fn() on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def decode_batch(model: FishS2, batch: int, context: int, generated: int = 5) -> tuple[list[StepInput], KVCache]:
    """A decode step for `batch` requests that each have `context` tokens cached (`generated` of them made)."""
    blocks_per_req = -(-(context + 1) // BLOCK)
    kv = KVCache(model.kv_layout, batch * blocks_per_req, BLOCK, model.dtype, model.device)
    n = context + 1 - generated
    prompt = Prompt(tokens=torch.full((n,), model.tokenizer.semantic_begin + 7),
                    codes=torch.zeros(n, model.num_codebooks, dtype=torch.long))
    codes = torch.randint(0, 1024, (batch, model.num_codebooks)).numpy()
    step = [StepInput(f"r{r}", prompt, SamplingParams(seed=r), [model.tokenizer.semantic_begin + 7] * generated,
                      codes[r], list(range(r * blocks_per_req, (r + 1) * blocks_per_req))) for r in range(batch)]
    return step, kv


def step_runner(model: FishS2, kv: KVCache, graphs: bool, max_rows: int, max_kv: int,
                sample_candidates: int = 64) -> ModelRunner:
    runner = ModelRunner(model, kv, cuda_graphs=graphs, sample_candidates=sample_candidates)
    runner.capture(max_rows, max_kv)
    return runner


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--context", default="256,1024")
    ap.add_argument("--sample-candidates", default="64", help="ar.sample_candidates values to time (0: every token)")
    ap.add_argument("--codec-frames", default="50", help="codec window lengths to time ('': none)")
    ap.add_argument("--codec-dtype", default="float32,float16,bfloat16")
    ap.add_argument("--fuse-elementwise", action="store_true",
                    help="the AR's norms, RoPE and gate compiled (`ar.fuse_elementwise`, on in the shipped profiles)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    fused.use_compiled(args.fuse_elementwise)

    model = random_s2_pro(device="cuda", dtype=torch.bfloat16)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "decode": [], "codec": [],
               "fuse_elementwise": args.fuse_elementwise}
    bounds = [int(c) for c in args.sample_candidates.split(",")]
    for graphs, context, bound in [(g, c, b) for g in (False, True) for c in map(int, args.context.split(","))
                                   for b in bounds]:
        for batch in map(int, args.batch.split(",")):
            step, kv = decode_batch(model, batch, context)
            runner = step_runner(model, kv, graphs, batch, context + 1, bound)
            ms = timed(lambda step=step, runner=runner: runner.run(step))
            row = dict(cuda_graphs=graphs, batch=batch, context=context, sample_candidates=bound, step_ms=round(ms, 3),
                       frames_per_s=round(batch * 1000 / ms, 1),
                       audio_s_per_s=round(batch * 1000 / ms / (model.sample_rate / model.samples_per_frame), 2))
            results["decode"].append(row)
            print("decode", row, flush=True)
            del step, kv, runner
            torch.cuda.empty_cache()
    for dtype_name in args.codec_dtype.split(","):
        model.codec.to(getattr(torch, dtype_name))
        for frames in [int(f) for f in args.codec_frames.split(",") if f]:
            for batch in map(int, args.batch.split(",")):
                codes = torch.randint(0, 1024, (batch, model.num_codebooks, frames), device="cuda")
                ms = timed(lambda: model.codec.decode(codes))
                row = dict(dtype=dtype_name, batch=batch, frames=frames, ms=round(ms, 3),
                           audio_s_per_s=round(batch * frames * model.samples_per_frame / model.sample_rate / ms * 1000, 1))
                results["codec"].append(row)
                print("codec", row, flush=True)
    results["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
