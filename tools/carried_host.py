"""Diagnostic (GPU): where one carried Fish codec call's time goes when nothing else runs: the host's part
(from the call until it returns, its launches queued) against the call's whole span (until the GPU is done), the
kernels it launches, and the torch ops that take the host's time; per decoder (padded, lean, packed) and call shape.
Served (session 41) a call of ~8 pieces used ~156 ms of the codec thread's CPU; this says how much of that a call
costs alone.

    python3 tools/carried_host.py [--shapes 8x50,32x25,64x4] [--device cuda] [--top 12]
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from intone.models.fish_s2.codec import CodecConfig, FishCodec
from intone.models.fish_s2.codec_packed import PackedStreamingDecoder
from intone.models.fish_s2.codec_stream import StreamingDecoder


def call(decoder, codes, lengths, states, device):
    """(host ms, whole ms) of one decode: until it returns, and until the device is done."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    decoder.decode(codes, lengths, states)
    host = time.perf_counter() - start
    sync()
    return 1000 * host, 1000 * (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x50,32x25,64x4")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    codec = FishCodec(CodecConfig()).eval().to(device, dtype)
    decoders = {"padded": StreamingDecoder(codec), "lean": StreamingDecoder(codec, fused=True),
                "packed": PackedStreamingDecoder(codec)}
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            rows, frames = map(int, shape.split("x"))
            codes = torch.randint(0, 1024, (rows, codec.cfg.num_codebooks, frames), device=device)
            for name, decoder in decoders.items():
                _, states = decoder.decode(codes, [frames] * rows, [None] * rows)  # a carried call: states exist
                times = [call(decoder, codes, [frames] * rows, states, device) for _ in range(5)]
                host, whole = (sorted(t[i] for t in times)[2] for i in (0, 1))
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with profile(activities=activities) as prof:
                    decoder.decode(codes, [frames] * rows, states)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                events = prof.key_averages()
                kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
                ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
                print(f"{name} {rows}x{frames}: host {host:.1f} ms, whole {whole:.1f} ms, {kernels} kernels", flush=True)
                for e in ops[: args.top]:
                    print(f"    {e.key:40s} {e.count:5d} calls  {e.self_cpu_time_total / 1000:7.2f} ms self CPU")


if __name__ == "__main__":
    main()
