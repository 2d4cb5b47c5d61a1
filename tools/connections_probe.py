"""Diagnostic (GPU): what stretches a chain of small kernels (the AR step's kind of work) while another
stream runs the codec's kind: its SMs, the memory bandwidth, or a shared hardware work queue?

The chain is the CosyVoice3 talker's decode step in shape: 24 layers of fp32 (TF32) GEMMs at 64 rows
over ~60 MB of weights each. It is timed between two events, alone and while another thread keeps
either large bf16 GEMMs (compute-bound, as the DiT's) or large elementwise passes (bandwidth-bound, as
HiFT's and the DiT's fused kernels) queued on a second stream: a pool stream on the same hardware-queue
residue (pool index + 8) or another (+1); the chain's stream at CUDA's highest priority; the other
stream in green contexts of PROBE_SMS SMs (codec.sms, frontend.sms). CUDA_DEVICE_MAX_CONNECTIONS
(cuda_connections) sets the queues:

    PROBE_SMS=112,96 python tools/connections_probe.py
"""

import json
import os
import threading

import torch

LAYER = ((896, 1152), (896, 896), (896, 9728), (4864, 896))  # q/k/v, o, gate/up, down


def chain_weights() -> list[torch.Tensor]:
    return [torch.randn(k, n, device="cuda") * k ** -0.5 for _ in range(24) for k, n in LAYER]


def step(stream: torch.cuda.Stream, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """ms of one "step": the chain's GEMMs on `stream`, between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for w in weights:  # each layer's widths chain: a GEMM's output is at least as wide as the next input
            x = torch.tanh(x[:, : w.shape[0]] @ w)
        end.record()
    end.synchronize()
    return start.elapsed_time(end)


def busy(kind: str, stream: torch.cuda.Stream, stop: threading.Event) -> None:
    """Back-to-back work on `stream`, a few kernels queued at a time: `gemm` (bf16, compute-bound) or
    `stream` (elementwise over 1 GiB, bandwidth-bound)."""
    with torch.cuda.stream(stream):
        if kind == "gemm":
            a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
        else:
            a = torch.randn(2**28, device="cuda")
            b = torch.empty_like(a)
        while not stop.is_set():
            for _ in range(8):
                if kind == "gemm":
                    a[:, :2048].copy_((a @ b)[:, :2048] * 1e-3)
                else:
                    torch.mul(a, 1.0001, out=b)
            stream.synchronize()


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    streams = [torch.cuda.Stream() for _ in range(32)]  # the pool's streams, in the order torch hands them out
    loop, urgent = streams[3], torch.cuda.Stream(priority=-100)  # CUDA clamps -100 to its highest
    x = torch.randn(64, 896, device="cuda")
    weights = chain_weights()
    for _ in range(5):
        step(loop, x, weights)
    result = {"connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default (8)"),
              "alone ms": round(sorted(step(loop, x, weights) for _ in range(20))[10], 2)}
    others = [("same queue residue", loop, streams[11]), ("other residue", loop, streams[4]),
              ("chain at the highest priority", urgent, streams[4])]
    from torch.cuda import green_contexts
    contexts = []  # kept alive while their streams run
    for sms in [int(n) for n in os.environ.get("PROBE_SMS", "").split(",") if n]:
        contexts.append(green_contexts.GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device()))
        others.append((f"other in a green context of {sms} SMs", loop, contexts[-1].Stream()))
    for kind in ("gemm", "stream"):
        for name, mine, other in others:
            stop = threading.Event()
            worker = threading.Thread(target=busy, args=(kind, other, stop))
            worker.start()
            times = [step(mine, x, weights) for _ in range(30)]
            stop.set()
            worker.join()
            result[f"{kind}: {name} ms"] = round(sorted(times)[15], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
