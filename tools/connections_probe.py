"""Diagnostic (GPU): does a short-kernel loop (the AR step's shape of work) wait behind another stream's
long kernels because the two streams share one of CUDA's hardware work queues?

torch's pool hands out 32 streams per priority; CUDA maps streams onto CUDA_DEVICE_MAX_CONNECTIONS queues
(default 8) round robin, and a queue runs its kernels' launches in order, whatever their streams. This
times a "step" of many small GEMMs on one pool stream, alone and while another thread keeps big GEMMs
queued on a second pool stream, for a second stream on the same queue residue (pool index + 8) and on
another (pool index + 1). Run it twice, with and without CUDA_DEVICE_MAX_CONNECTIONS=32:

    python tools/connections_probe.py; CUDA_DEVICE_MAX_CONNECTIONS=32 python tools/connections_probe.py
"""

import json
import os
import threading

import torch


def pool_streams(n: int) -> list[torch.cuda.Stream]:
    """The pool's streams in the order torch hands them out (its round robin starts where it is)."""
    return [torch.cuda.Stream() for _ in range(n)]


def step(stream: torch.cuda.Stream, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """ms of one "step": a GEMM per weight, on `stream`, between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        y = x
        for w in weights:
            y = torch.tanh(y @ w)
        end.record()
    end.synchronize()
    return start.elapsed_time(end)


def busy(stream: torch.cuda.Stream, stop: threading.Event) -> None:
    """Back-to-back large GEMMs on `stream` (the codec's kind of kernel), never more than a few queued."""
    a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(stream):
        while not stop.is_set():
            for _ in range(8):
                a[:, :2048].copy_((a @ b)[:, :2048] * 1e-3)
            stream.synchronize()


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    streams = pool_streams(32)
    loop = streams[3]
    x = torch.randn(64, 896, device="cuda")
    weights = [torch.randn(896, 896, device="cuda") * 0.03 for _ in range(200)]
    for _ in range(5):
        step(loop, x, weights)
    result = {"connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default (8)"),
              "alone_ms": sorted(step(loop, x, weights) for _ in range(20))[10]}
    urgent = torch.cuda.Stream(priority=-100)  # CUDA clamps it to its highest
    cases = [("same residue (pool +8)", loop, streams[11]), ("other residue (pool +1)", loop, streams[4]),
             ("loop at the highest priority", urgent, streams[4])]
    if os.environ.get("PROBE_SMS"):  # the other stream in a green context of that many SMs (codec.sms)
        from torch.cuda import green_contexts
        for sms in map(int, os.environ["PROBE_SMS"].split(",")):
            context = green_contexts.GreenContext.create(num_sms=sms, device_id=0)
            cases.append((f"other in a green context of {sms} SMs", loop, context.Stream()))
    for name, mine, other in cases:
        stop = threading.Event()
        worker = threading.Thread(target=busy, args=(other, stop))
        worker.start()
        times = [step(mine, x, weights) for _ in range(30)]
        stop.set()
        worker.join()
        result[name + " ms"] = round(sorted(times)[15], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
