"""Diagnostic (GPU): the Fish codec decode at the codec stage's call shapes (rows x frames buckets):
eager as served (cuDNN's heuristic algorithms), eager with cuDNN's benchmark mode, and replayed from a
CUDA graph (with each mode), with the time per module of one eager call and its top kernels.

    python3 tools/codec_timing.py [--shapes 8x100,32x100,64x64,64x32] [--no-profile]
"""

import argparse
import time

import torch

from intone.engine.cuda_graphs import capture_graph
from intone.models.registry import load_model
from kernel_timing import timed  # tools/ is the script's directory


def per_module(codec, codes, offsets):
    """ms of each top-level decode piece, synced around it."""
    pieces = [("quantizer lookup + post_module + upsample", codec.quantizer)]
    pieces += [(f"decoder.model[{i}] {type(m).__name__}", m) for i, m in enumerate(codec.decoder.model)]
    spent, marks = {}, {}

    def pre(name):
        def hook(*_):
            torch.cuda.synchronize()
            marks[name] = time.perf_counter()
        return hook

    def post(name):
        def hook(*_):
            torch.cuda.synchronize()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - marks[name]
        return hook

    handles = []
    for name, m in pieces[1:]:
        handles += [m.register_forward_pre_hook(pre(name)), m.register_forward_hook(post(name))]
    torch.cuda.synchronize()
    t = time.perf_counter()
    codec.decode(codes, offsets)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    for h in handles:
        h.remove()
    spent[pieces[0][0]] = total - sum(spent.values())
    return total, spent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x100,32x100,64x64,64x32,16x256")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    model = load_model("random:fish-s2", device="cuda", dtype=torch.bfloat16, codec_dtype=torch.float16)
    codec, k = model.codec, model.num_codebooks
    hop, rate = codec.hop_length, codec.sample_rate
    for shape in args.shapes.split(","):
        rows, frames = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        codes = torch.randint(0, 1024, (rows, k, frames), device="cuda", generator=g)
        offsets = torch.zeros(rows, dtype=torch.long, device="cuda")
        audio_s = rows * frames * hop / rate
        run = lambda: codec.decode(codes, offsets)  # noqa: E731
        line = [f"codec {rows}x{frames} ({audio_s:.1f} audio s)"]
        results = {}
        for bench in (False, True):
            torch.backends.cudnn.benchmark = bench
            with torch.inference_mode():
                t = time.perf_counter()
                ref = run()
                torch.cuda.synchronize()
                first = time.perf_counter() - t
                eager = timed(run, reps=5)
                try:
                    graph, out = capture_graph(run, None, torch.cuda.Stream())
                    graph_ms = timed(graph.replay, reps=5)
                    same = bool(torch.equal(out, ref))
                    del graph, out
                except Exception as e:  # noqa: BLE001 - report and go on
                    graph_ms, same = float("nan"), f"capture failed: {type(e).__name__}"
            results[bench] = ref.float()
            tag = "benchmark" if bench else "heuristic"
            line.append(f"{tag}: first call {1000 * first:.0f} ms, eager {eager:.2f} ms "
                        f"({audio_s / eager * 1000:.0f} a-s/s), graph {graph_ms:.2f} ms "
                        f"({audio_s / graph_ms * 1000:.0f} a-s/s, == eager: {same})")
        diff = (results[True] - results[False]).abs().max().item()
        print(" | ".join(line) + f" | benchmark vs heuristic max diff {diff:.2e}", flush=True)
        torch.backends.cudnn.benchmark = False
        with torch.inference_mode():
            total, spent = per_module(codec, codes, offsets)
        print(f"  eager (heuristic) by piece, {1000 * total:.1f} ms: " + ", ".join(
            f"{name} {1000 * s:.1f}" for name, s in sorted(spent.items(), key=lambda kv: -kv[1])), flush=True)
        if not args.no_profile and shape == args.shapes.split(",")[1]:
            from torch.profiler import ProfilerActivity, profile
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
        del codes, results
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
