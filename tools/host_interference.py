"""Diagnostic (GPU): how a neighbour thread's host work stretches an engine-loop-like thread's launches.

The loop thread launches a chain of small kernels per step (as the AR loop builds and launches a step) and waits
for the step before (spinning, as the loop's token wait does); two neighbour threads, each on a stream of its
own, run "clips" of GPU work and read small results back to the host, as the reference frontend does. Per
neighbour variant, the loop's launch time per step and the neighbours' clips per second:

    none      no neighbours
    pageable  results read with .cpu() / .tolist() (the frontend before ops.host_copy)
    pinned    results read with ops.host_copy.to_host (pinned memory, a blocking-sync event)
    python    no GPU work: pure Python stretches of ~1 ms (holding the GIL), then a short sleep

    python3 tools/host_interference.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from intone.ops.host_copy import to_host

LOOP_OPS = 60  # small kernels per loop step (the AR step's eager ops and replays are of this order)


def loop(stop: threading.Event, launch_ms: list[float], step_ms: list[float]) -> None:
    x = torch.zeros(64, 1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        before = None
        while not stop.is_set():
            start = time.perf_counter()
            for _ in range(LOOP_OPS):
                x = x * 1.0001 + 1.0
            done = torch.cuda.Event()
            done.record()
            launched = time.perf_counter()
            if before is not None:
                before.synchronize()  # spins, as the loop's wait for its tokens
            before = done
            launch_ms.append(1000 * (launched - start))
            step_ms.append(1000 * (time.perf_counter() - start))


def neighbour(variant: str, stop: threading.Event, clips: list[int]) -> None:
    a = torch.randn(512, 1024, device="cuda")
    w = torch.randn(1024, 1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        while not stop.is_set():
            if variant == "python":
                end = time.perf_counter() + 0.001
                n = 0
                while time.perf_counter() < end:
                    n += 1
                time.sleep(0.002)
            else:
                h = a
                for _ in range(20):
                    h = torch.tanh(h @ w)
                mel, speaker, counts = h[:400, :80], h[0, :192], (h[:4, 0] > 0).long()
                for _ in range(2):  # the tokenizer's read, then each clip's speaker and mel
                    if variant == "pageable":
                        mel.cpu(), speaker.cpu(), counts.tolist()
                    else:
                        m, s, c = to_host(mel, speaker, counts)
                        c.tolist()
            clips.append(1)


def run(variant: str, seconds: float) -> dict:
    stop = threading.Event()
    launch_ms, step_ms, clips = [], [], []
    threads = [threading.Thread(target=loop, args=(stop, launch_ms, step_ms))]
    if variant != "none":
        threads += [threading.Thread(target=neighbour, args=(variant, stop, clips)) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    launch_ms, step_ms = launch_ms[10:], step_ms[10:]  # past the first steps' allocations
    q = statistics.quantiles(launch_ms, n=10)
    return dict(variant=variant, steps=len(step_ms), launch_ms=statistics.mean(launch_ms), launch_p90=q[-1],
                step_ms=statistics.mean(step_ms), clips_per_s=len(clips) / seconds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--variants", default="none,pageable,pinned,python,none")
    args = ap.parse_args()
    for variant in args.variants.split(","):
        r = run(variant, args.seconds)
        print(f"{r['variant']:9s} loop: launch {r['launch_ms']:.3f} ms a step (p90 {r['launch_p90']:.3f}), "
              f"step {r['step_ms']:.3f} ms, {r['steps']} steps; neighbours {r['clips_per_s']:.0f} clips/s", flush=True)


if __name__ == "__main__":
    main()
