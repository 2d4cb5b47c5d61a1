"""Diagnostic (GPU): where one engine step's time goes under the real workload (closed loop at C,
a fresh reference clip per request, staggered lengths). Phases are timed with a device sync at
each boundary (so they add up to the step); a torch.profiler table of the GPU kernels follows.

    python3 tools/step_profile.py --model random:fish-s2 --profile fish-s2-high-concurrency
"""

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

from intone.bench.dataset import synthetic_items
from intone.bench.engine_throughput import Workload
from intone.bench.runner import forced_frames
from intone.engine.config import default_params, load_profile
from intone.engine.core import EngineCore
from intone.protocol import SynthesisRequest
from engine_probe import thread_cpu, value  # tools/ is the script's directory

SPENT = collections.defaultdict(float)


def timed(name, fn):
    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        SPENT[name] += time.perf_counter() - t
        return out
    return wrapper


def instrument(core):
    m, r = core.model, core.runner
    r.build = timed("runner.build (host metadata)", r.build)
    m.embed = timed("embed", m.embed)
    m.forward = timed("prefill forward (eager)", m.forward)
    if r.graphs is not None:
        r.graphs.decode = timed("decode (graph)", r.graphs.decode)
        r.graphs.head = timed("head (graph)", r.graphs.head)
    m.forward_decode = timed("decode (eager)", m.forward_decode)
    m.head = timed("head (eager)", m.head)
    core.codec.run = timed("codec", core.codec.run)
    core._plan = timed("planner", core._plan)
    core._admit_prepared = timed("admit prepared", core._admit_prepared)


class frontend_pieces:
    """Wall time of the reference frontend's batches and of the model's pieces inside them, on the
    frontend thread as it serves (no added syncs: a piece's time includes what it waits for)."""

    def __init__(self, core):
        from intone.models.cosyvoice3 import frontend as cosy_frontend
        from intone.models.cosyvoice3 import frontend_networks as cosy_networks

        self.spent, self.clips, self.batches = collections.defaultdict(float), 0, 0
        stage, model = core.frontend, core.model
        encode = stage._encode

        def timed_encode(clips):  # a generator (each clip as it is ready): timed until it is drained
            self.batches, self.clips = self.batches + 1, self.clips + len(clips)
            t = time.perf_counter()
            yield from encode(clips)
            self.spent["batch (whole)"] += time.perf_counter() - t
        stage._encode = timed_encode
        if hasattr(model, "speech_tokenizer"):  # CosyVoice3: its pieces, by name
            tok, spk = model.speech_tokenizer, model.speaker_encoder
            tok.tokenize_batch = self.wrap("speech tokenizer (batched)", tok.tokenize_batch)
            spk.embed_batch = self.wrap("CAM++ (embed_batch calls)", spk.embed_batch)
            for name in ("official_resample", "prompt_mel"):
                setattr(cosy_frontend, name, self.wrap(name, getattr(cosy_frontend, name)))
            for name in ("kaldi_fbank", "whisper_log_mel"):  # inside CAM++'s and the tokenizer's calls
                setattr(cosy_networks, name, self.wrap(f"  {name} (in the call above)", getattr(cosy_networks, name)))

    def wrap(self, name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            self.spent[name] += time.perf_counter() - t
            return out
        return wrapper

    def report(self, steps):
        if not self.clips:
            return
        print(f"  frontend: {self.batches} batches, {self.clips} clips over {steps} steps; wall ms per clip:")
        for name, s in sorted(self.spent.items(), key=lambda kv: -kv[1]):
            print(f"    {name:36s} {1000 * s / self.clips:7.2f}")


class codec_pieces:
    """CosyVoice3's codec calls as they serve, on the codec thread: per flow call and per HiFT call,
    the wall time until the call returns (no added syncs: mostly the host's launches, which CUDA
    graphs of the flow's solve take away; a call that waits for the GPU shows that too)."""

    def __init__(self, core):
        self.spent, self.calls, self.rows = collections.defaultdict(float), collections.Counter(), collections.Counter()
        model = core.model
        if not hasattr(model, "hift"):
            return
        model.flow.inference = self.wrap("flow", model.flow.inference)
        model.hift.vocode_batch = self.wrap("hift", model.hift.vocode_batch)

    def wrap(self, name, fn):
        def wrapper(items, *a, **k):
            t = time.perf_counter()
            out = fn(items, *a, **k)
            self.spent[name] += time.perf_counter() - t
            self.calls[name] += 1
            self.rows[name] += len(items)
            return out
        return wrapper

    def report(self, steps):
        for name in ("flow", "hift"):
            if self.calls[name]:
                print(f"  codec {name}: {self.calls[name]} calls, {self.rows[name] / self.calls[name]:.1f} rows per call, "
                      f"{1000 * self.spent[name] / self.calls[name]:.2f} ms per call until it returns, "
                      f"{1000 * self.spent[name] / steps:.2f} ms per step")


def overlapped(core, run, steps):
    """The loop as it serves (no added syncs): wall per step, and the parts that block it."""
    spent = collections.defaultdict(float)
    rows = [0]

    def wall(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            spent[name] += time.perf_counter() - t
            return out
        return wrapper

    originals = core.ar.step, core._emit, core._deliver, core._admit_prepared
    runner_originals = core.runner.build, core.runner.execute
    # (with ar.async_steps: launching this step and waiting for the one before)
    run_ar = wall("AR step (until tokens on host)", core.ar.step)
    # Within the AR step: host metadata, kernel launches (graph replays return at once), and the
    # rest = waiting for the GPU to give the tokens back, plus the per-request bookkeeping.
    core.runner.build = wall("  of which runner.build (host metadata)", core.runner.build)
    core.runner.execute = wall("  of which execute (launches)", core.runner.execute)

    def counted(batch):
        rows[0] += len(batch)
        return run_ar(batch)
    core.ar.step = counted
    # The step's kernels on the loop's stream, from the first launch to the last (graph replays
    # included): against the wall step, the time the stream waited for the host (GIL, launches).
    marks = []
    launch = core.runner.execute

    def execute_marked(batch):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = launch(batch)
        end.record()
        marks.append((begin, end))
        return out
    if torch.cuda.is_available():
        core.runner.execute = execute_marked
    core._emit = wall("emit (incl. codec backpressure waits)", core._emit)
    front, codec = frontend_pieces(core), codec_pieces(core)
    core._deliver = wall("deliver", core._deliver)
    core._admit_prepared = wall("admit prepared", core._admit_prepared)
    s0, f0 = core.stats.steps, core.stats.frames
    cpu0 = thread_cpu()
    t = time.perf_counter()
    run(steps)
    elapsed = time.perf_counter() - t
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in thread_cpu().items()}
    n, frames = core.stats.steps - s0, core.stats.frames - f0
    core.ar.step, core._emit, core._deliver, core._admit_prepared = originals
    core.runner.build, core.runner.execute = runner_originals
    print(f"as served (switch interval {1000 * sys.getswitchinterval():.2f} ms): {n} steps in {elapsed:.2f} s = {1000 * elapsed / n:.1f} ms per step, "
          f"{rows[0] / n:.1f} rows per step, {frames * core.model.samples_per_frame / core.model.sample_rate / elapsed:.1f} audio-s/s of frames")
    for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {1000 * s / n:7.2f} ms/step")
    if marks:
        torch.cuda.synchronize()
        gpu = sum(b.elapsed_time(e) for b, e in marks)
        print(f"  {'AR kernels on the GPU (first to last)':40s} {gpu / len(marks):7.2f} ms/step over {len(marks)} launches")
    outer = sum(v for k, v in spent.items() if not k.startswith(" "))
    print(f"  {'other (loop, planner, host)':40s} {1000 * (elapsed - outer) / n:7.2f} ms/step")
    front.report(n)
    codec.report(n)
    # Threads whose CPU seconds add up to about the wall time take turns on the GIL.
    print(f"  CPU ms per step by thread: " + ", ".join(
        f"{k} {1000 * v / n:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v > 0))


def busy_ms(intervals) -> float:
    """Length of the union of [start, end) intervals (ns), in ms."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total / 1e6


GAPS = ((0.05, "<50us"), (0.5, "50-500us"), (5.0, "0.5-5ms"), (float("inf"), ">5ms"))


def gap_ms(spans) -> dict:
    """A stream's idle time between consecutive kernels, summed by the gap's length (ms): short gaps
    inside a burst of launches mean the host launches slower than the GPU runs them (launch-bound);
    long ones, that the stream had no work (waiting for its thread or for other work)."""
    out = dict.fromkeys((label for _, label in GAPS), 0.0)
    spans = sorted(spans)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        gap = max(0, start - end) / 1e6
        out[next(label for bound, label in GAPS if gap < bound)] += gap
    return out


def gpu_timeline(prof, wall_s: float, steps: int) -> None:
    """Per CUDA stream: the kernels' busy time (union) and count; then the union over every stream
    against the window's wall time: near 100% the GPU is saturated, well below it the host holds it up."""
    kernels = [e for e in prof.profiler.kineto_results.events()
               if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
               and not e.name().startswith(("Memcpy", "Memset"))]
    streams, names = collections.defaultdict(list), collections.defaultdict(collections.Counter)
    for e in kernels:
        streams[e.device_resource_id()].append((e.start_ns(), e.end_ns()))
        names[e.device_resource_id()][e.name()[:40]] += e.duration_ns() / 1e6
    print(f"GPU timeline over {steps} steps ({1000 * wall_s:.0f} ms of wall time):")
    for stream, spans in sorted(streams.items(), key=lambda kv: -len(kv[1])):
        gaps, busy = gap_ms(spans), busy_ms(spans)
        print(f"  stream {stream}: {len(spans)} kernels, busy {busy:.1f} ms "
              f"({100 * busy / (1000 * wall_s):.0f}% of wall); idle between kernels: "
              + ", ".join(f"{label} {ms:.1f} ms" for label, ms in gaps.items()) + "; longest: "
              + ", ".join(f"{n} {ms:.1f}" for n, ms in names[stream].most_common(3)))
    every = [span for spans in streams.values() for span in spans]
    busy = busy_ms(every)
    print(f"  any stream busy: {busy:.1f} ms ({100 * busy / (1000 * wall_s):.0f}% of wall); "
          f"kernel time summed over streams {sum(e - s for s, e in every) / 1e6:.1f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:fish-s2")
    ap.add_argument("--profile", default="fish-s2-high-concurrency")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--frames", default="normal:86:30")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--timeline-steps", type=int, default=40, help="steps under torch.profiler (kernel table, GPU timeline)")
    ap.add_argument("--stream", action="store_true", help="streamed requests (chunks), not whole responses")
    ap.add_argument("--switch-intervals", default="", help="comma-separated seconds: the served window again with "
                    "each as sys.setswitchinterval (how long a thread holds the GIL before handing it over)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="profile overrides")
    args = ap.parse_args()
    overrides = {k: value(v) for k, v in (s.split("=", 1) for s in args.set)}
    core = EngineCore.build(args.model, load_profile(args.profile, **overrides))
    items = synthetic_items(600, Path("/tmp/step-profile"), seed=3)
    work = Workload(items, None, False, core.model)
    lengths = forced_frames(args.frames, 600, 0)
    submitted = done = 0
    inflight = set()

    def top_up():
        nonlocal submitted
        while len(inflight) < args.concurrency:
            (text, refs), = work.take(1)
            p = default_params(core.profile, seed=submitted, max_new_tokens=lengths[submitted % 600], ignore_eos=True)
            rid = f"r{submitted}"
            core.add_request(SynthesisRequest(rid, text, refs, params=p, stream=args.stream))
            inflight.add(rid)
            submitted += 1

    def run(steps):
        nonlocal done
        for _ in range(steps):
            top_up()
            for c in core.step():
                if c.finished:
                    inflight.discard(c.request_id)
                    done += 1

    for _ in range(2000):  # reach steady state: the first wave done, the seats refilled
        run(10)
        if done >= args.concurrency and len(core.scheduler.running) >= 0.9 * args.concurrency:
            break
    overlapped(core, run, args.steps)
    for interval in filter(None, args.switch_intervals.split(",")):
        default = sys.getswitchinterval()
        sys.setswitchinterval(float(interval))
        overlapped(core, run, args.steps)
        sys.setswitchinterval(default)
    instrument(core)
    s0 = core.stats.steps
    t = time.perf_counter()
    run(args.steps)
    wall = time.perf_counter() - t
    steps = core.stats.steps - s0
    print(f"{steps} steps in {wall:.2f} s = {1000 * wall / steps:.1f} ms per step (synced phases), "
          f"{len(core.scheduler.running)} running")
    for name, s in sorted(SPENT.items(), key=lambda kv: -kv[1]):
        print(f"  {name:32s} {1000 * s / steps:7.2f} ms/step")
    print(f"  {'other (host: loop, append, sync)':32s} {1000 * (wall - sum(SPENT.values())) / steps:7.2f} ms/step")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run(args.timeline_steps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    gpu_timeline(prof, wall, args.timeline_steps)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
