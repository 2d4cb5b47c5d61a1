"""Diagnostic (GPU): Fish's carried codec decode, channels-first against time-major (`fish_s2.decoder_layout`), real
size in fp16 as served, at a codec call's shapes (rows x chunk frames, each row carrying an earlier 4-frame chunk's
state): ms per call eagerly and replayed from a CUDA graph, audio-s/s, the two layouts' largest difference against
the fp16 decode's own distance from fp32, and (--top N) each graph's top kernels.

    python3 tools/decoder_layouts.py [--shapes 4x25,8x25,8x50,16x50] [--top 8]
"""

import argparse
import copy

import torch

from intone.engine.cuda_graphs import FunctionGraphs
from intone.models.fish_s2.codec import FishCodec
from intone.models.fish_s2.codec_stream import StreamingDecoder
from ar_step_timing import kernel_table  # tools/ is the script's directory
from kernel_timing import timed


def carried(decoder, codes, first):
    """The decode of codes [B, K, T] after each row's first `first` frames (decoded in a call of their own)."""
    rows = codes.shape[0]
    _, states = decoder.decode(codes[:, :, :first].contiguous(), [first] * rows, [None] * rows)
    return codes[:, :, first:].contiguous(), states


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4x25,8x25,8x50,16x50", help="rows x chunk frames")
    ap.add_argument("--top", type=int, default=0, help="the top kernels of each graph (0: none)")
    args = ap.parse_args()
    torch.manual_seed(0)
    codec = FishCodec().cuda().eval().half()
    exact = copy.deepcopy(codec).float()
    for shape in args.shapes.split(","):
        rows, frames = map(int, shape.split("x"))
        codes = torch.randint(0, 1024, (rows, 10, 4 + frames), device="cuda")
        seconds = rows * frames * codec.hop_length / codec.sample_rate
        audio, line = {}, []
        with torch.inference_mode():
            chunk, states = carried(StreamingDecoder(exact), codes, 4)
            reference = StreamingDecoder(exact).decode(chunk, [frames] * rows, states)[0]
        for layout in ("channels_first", "time_major"):
            decoder = StreamingDecoder(codec, time_major=layout == "time_major")
            with torch.inference_mode():
                chunk, states = carried(decoder, codes, 4)
                lengths = [frames] * rows
                audio[layout] = decoder.decode(chunk, lengths, states)[0].float()
                eager = timed(lambda: decoder.decode(chunk, lengths, states), reps=5)
                decoder.capture(FunctionGraphs(), rows, frames, codes.device)
                graphed = timed(lambda: decoder.decode(chunk, lengths, states), reps=10)
                if args.top:
                    kernel_table(f"{layout} graph", lambda: decoder.decode(chunk, lengths, states), args.top)
            error = (audio[layout] - reference).abs().max().item()
            line.append(f"{layout} eager {eager:.2f} ms, graph {graphed:.2f} ms ({seconds / graphed * 1000:.0f} "
                        f"audio-s/s), max |fp16 - fp32| {error:.3g}")
            torch.cuda.empty_cache()
        apart = (audio["channels_first"] - audio["time_major"]).abs().max().item()
        print(f"{shape} ({seconds:.1f} audio s): " + "; ".join(line) + f"; layouts apart {apart:.3g} "
              f"(peak {reference.abs().max().item():.3g})", flush=True)


if __name__ == "__main__":
    main()
