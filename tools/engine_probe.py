"""Diagnostic: the engine in-process under the user path's load (N requests at once, each with its own
reference clip of 3-8 s, streamed and not), with a progress line every few seconds and, if it has not
finished by --dump-after seconds, every thread's stack (faulthandler), so a stall shows where it waits.

    python3 tools/engine_probe.py --model random:cosyvoice3 --profile cosyvoice3-full-response \
        --set frontend.cuda_graphs=true --set codec.schedule=deadline --requests 64
"""

import argparse
import faulthandler
import os
import threading
import time

import numpy as np
import torch

from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.protocol import SamplingParams, SynthesisRequest, VoiceReference


def value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each of this process's threads, by Python thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        name = names.get(int(tid))
        if name is None:  # a native thread (OpenMP, CUDA, compile workers): its kernel name
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = "native:" + f.read().strip()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:cosyvoice3")
    ap.add_argument("--profile", default="cosyvoice3-full-response")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dump-after", type=float, default=90)
    args = ap.parse_args()
    overrides = {k: value(v) for k, v in (s.split("=", 1) for s in args.set)}
    t0 = time.perf_counter()
    core = EngineCore.build(args.model, load_profile(args.profile, **overrides))
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    faulthandler.dump_traceback_later(args.dump_after, exit=True)
    rng = np.random.default_rng(0)
    for i in range(args.requests):
        seconds = 3 + 5 * rng.random()
        audio = (0.1 * rng.standard_normal(int(seconds * 24000))).astype(np.float32)
        ref = VoiceReference(text="A reference voice for this request.", audio=torch.from_numpy(audio), sample_rate=24000)
        params = SamplingParams(seed=i, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
        core.add_request(SynthesisRequest(f"r{i}", f"Request number {i} speaks a sentence.", references=[ref],
                                          params=params, stream=bool(i % 2)))
    cpu0 = thread_cpu()
    start, last, done = time.perf_counter(), time.perf_counter(), 0
    while core.has_work():
        for chunk in core.step():
            done += chunk.finished
            if chunk.error:
                print(f"{chunk.request_id}: {chunk.error_code} {chunk.error}", flush=True)
        if time.perf_counter() - last > 5:
            snap = core.snapshot()
            print(f"{time.perf_counter() - start:6.1f} s: finished {done}, preparing {snap['preparing']}, "
                  f"running {snap['running']}, waiting {snap['waiting']}, steps {snap['steps']}, "
                  f"frontend batches {snap['frontend_batches']}, codec calls {snap['codec_calls']}", flush=True)
            last = time.perf_counter()
    faulthandler.cancel_dump_traceback_later()
    elapsed = time.perf_counter() - start
    print(f"all {done} finished in {elapsed:.1f} s; {core.snapshot()}", flush=True)
    # If the threads' CPU seconds add up to about the wall time, they take turns on the GIL.
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in thread_cpu().items()}
    print(f"CPU seconds per thread over {elapsed:.1f} s of wall time (sum {sum(cpu.values()):.1f}): "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])), flush=True)
    core.close()


if __name__ == "__main__":
    main()
