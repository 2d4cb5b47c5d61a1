"""Diagnostic (GPU): Fish's reference encode, channels-first against time-major (`fish_s2.encoder_layout`), real
size in fp16 as served: ms per call eagerly and replayed from a CUDA graph, audio-s/s, and how many codes agree.

    python3 tools/encoder_layouts.py [--shapes 1x129,4x172,16x172]
"""

import argparse

import torch

from intone.engine.cuda_graphs import FunctionGraphs
from intone.models.fish_s2.codec import FishCodec
from kernel_timing import timed  # tools/ is the script's directory


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x129,4x172,16x172", help="rows x frames (2048 samples at 44.1 kHz each)")
    args = ap.parse_args()
    torch.manual_seed(0)
    codec = FishCodec().cuda().eval().half()
    for shape in args.shapes.split(","):
        rows, frames = map(int, shape.split("x"))
        audio = 0.2 * torch.randn(rows, frames * codec.hop_length, device="cuda")
        seconds = rows * frames * codec.hop_length / codec.sample_rate
        codes, line = {}, []
        for layout in ("channels_first", "time_major"):
            codec.encoder_layout = layout
            with torch.inference_mode():
                codes[layout] = codec.encode(audio)
                eager = timed(lambda: codec.encode(audio), reps=5)
                graphs = FunctionGraphs()
                graphs.capture("fish encoder", codec.encode, audio)
                graphed = timed(lambda: graphs.run("fish encoder", codec.encode, audio), reps=10)
            line.append(f"{layout} eager {eager:.2f} ms, graph {graphed:.2f} ms ({seconds / graphed * 1000:.0f} audio-s/s)")
            torch.cuda.empty_cache()
        same = (codes["channels_first"] == codes["time_major"]).float().mean().item()
        print(f"{shape} ({seconds:.1f} audio s): " + "; ".join(line) + f"; codes equal {same:.4f}", flush=True)


if __name__ == "__main__":
    main()
