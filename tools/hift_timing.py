"""Diagnostic (GPU): CosyVoice3's HiFT alone on served batch shapes, per precision.

    python3 tools/hift_timing.py [--repeats 5]

Two batches as the streamed codec worker gives them: a first-chunk call (6 new streams, 50-98 mel
frames each, nothing carried) and a backlog call (48 windows of 40 context frames plus 50, 100 or
200 new ones, phase carried). Per precision of the network (the F0 predictor stays float64), and float32 replayed from a CUDA
graph captured at the batch's graph shape: wall
ms (min over repeats), the GPU's busy ms and kernel count in one call (profiler), and the audio's
distance from the float32 run (max abs, SNR dB). Real-size architecture, random weights.
"""

import argparse
import json
import math
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from intone.models.cosyvoice3.codec_config import flow_sizes
from intone.models.cosyvoice3.flow import FlowConfig
from intone.engine.cuda_graphs import FunctionGraphs
from intone.models.cosyvoice3.hift import CausalHiFT, HiFTConfig, graph_shape
from intone.models.cosyvoice3.hift_source import SourceWindow
from intone.models.cosyvoice3.noise import official_noise


def build(device, dtype) -> CausalHiFT:
    torch.manual_seed(0)
    cfg = HiFTConfig()
    hift = CausalHiFT(cfg, noise=official_noise(flow_sizes(FlowConfig()), cfg, include_uv=False))
    with torch.no_grad():
        for name, p in hift.named_parameters():
            p.normal_(0.0, 0.02 if p.dim() > 1 else 0.0) if not name.endswith("alpha") else p.fill_(1.0)
    hift = hift.to(device).to(dtype).eval()
    hift.f0_predictor.to(torch.float64)
    return hift


def batches(cfg: HiFTConfig, device):
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    harm = cfg.nb_harmonics + 1
    first = [torch.randn(80, 2 * rng.randint(25, 49), generator=g).to(device) for _ in range(6)]
    yield "first chunks x6", first, SourceWindow([0] * 6, [0] * 6, torch.zeros(6, harm, dtype=torch.float64), [0] * 6)
    context = cfg.stream_context_frames
    mels, starts, at = [], [], []
    for _ in range(48):
        new = rng.choice([50, 100, 200])
        start = rng.randint(1, 200)
        mels.append(torch.randn(80, context + new, generator=g).to(device))
        starts.append(start)
        at.append(start + cfg.f0_history_frames)
    carried = torch.rand(48, harm, generator=g, dtype=torch.float64)
    yield "backlog x48", mels, SourceWindow(starts, at, carried, at)


def time_call(fn, repeats, device) -> dict:
    fn()
    torch.cuda.synchronize(device)
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        walls.append(1000 * (time.perf_counter() - start))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return dict(wall_ms=round(min(walls), 1), gpu_busy_ms=round(sum(e.device_time for e in kernels) / 1000, 1),
                kernels=len(kernels))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,float32+graphs,bfloat16,float16")
    args = ap.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as `tf32: true` serves
    reference = {}
    for name in args.dtypes.split(","):
        dtype, graphed = name.split("+")[0], name.endswith("+graphs")
        hift = build(device, getattr(torch, dtype))
        for label, mels, window in batches(hift.cfg, device):
            graphs = FunctionGraphs() if graphed else None
            if graphed:  # captured at the batch's graph shape, as the codec stage does at start-up
                hift.capture(*graph_shape(len(mels), max(m.shape[1] for m in mels)), graphs)

            def call():
                w = SourceWindow(window.first, window.carried_at, window.carried, window.record_at)
                return hift.vocode_batch(mels, [False] * len(mels), w, graphs)
            row = dict(dtype=name, batch=label, frames=sum(m.shape[1] for m in mels), **time_call(call, args.repeats, device))
            audio = torch.cat([a.double() for a in call()])
            ref = reference.setdefault(label, audio)
            noise = (audio - ref).pow(2).mean().item()
            row.update(max_abs=float((audio - ref).abs().max()),
                       snr_db=round(10 * math.log10(ref.pow(2).mean().item() / noise), 1) if noise else None)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
