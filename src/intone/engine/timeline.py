"""Where a profiled window of the served load spent the GPU: a summary of a torch profiler (Kineto)
chrome trace, per launching thread and per CUDA stream.

The engine's loop, codec worker and frontend workers share one GPU. The question a served level
raises is whether the GPU itself is full (then only less work, or cheaper kernels, go faster) or
waits for the host between launches (then host work, the GIL, or the schedule is the bound), and
whose kernels hold it. Each GPU item (kernel, memcpy, memset) is tied to the thread that launched
it through its CUDA runtime or driver call (their `correlation` ids); CUPTI records those calls for
every thread of the process, so the attribution holds for threads the profiler's CPU side never saw.
Host (CPU op) time appears only for the threads whose ops the profiler recorded.

`python -m intone.engine.timeline TRACE.json[.gz] [--threads JSON] [--json FILE]` prints (or writes) the same
summary; the API server runs it so, as a process of its own: reading a big trace holds an interpreter for seconds.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_CATEGORY = "cpu_op"
WAITING_CALLS = ("Synchronize", "cudaMemcpy")  # CUDA calls whose thread waits for the GPU (by name; also memcpys)
TOP_KERNELS = 8


@dataclass(frozen=True)
class Span:
    start: float  # microseconds, the trace's clock
    end: float
    name: str = ""
    stream: int | None = None
    correlation: int | None = None
    tid: int | None = None


def merged(spans: list[Span]) -> list[tuple[float, float]]:
    """The intervals the spans cover, overlapping and touching ones joined, in order."""
    out: list[tuple[float, float]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], s.end))
        else:
            out.append((s.start, s.end))
    return out


def union_seconds(spans: list[Span]) -> float:
    """Seconds covered by at least one span (overlaps counted once)."""
    return sum(end - start for start, end in merged(spans)) / 1e6


def _span(event: dict) -> Span:
    args = event.get("args") or {}
    start = float(event["ts"])
    return Span(start, start + float(event.get("dur", 0.0)), event.get("name", ""), args.get("stream"),
                args.get("correlation"), event.get("tid"))


def read_trace(path: str | Path) -> dict:
    """A chrome trace, gzipped or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def alone_seconds(by_thread: dict[str, list[Span]]) -> dict[str, float]:
    """Per thread, the seconds its GPU items ran while no other thread's did (the rest of its busy time it
    shared the GPU's SMs with another thread's work)."""
    edges = sorted((t, step, name) for name, spans in by_thread.items()
                   for s in spans for t, step in ((s.start, 1), (s.end, -1)))
    active: dict[str, int] = defaultdict(int)
    alone: dict[str, float] = defaultdict(float)
    last = None
    for t, step, name in edges:
        running = [n for n, k in active.items() if k > 0]
        if last is not None and len(running) == 1:
            alone[running[0]] += (t - last) / 1e6
        active[name] += step
        last = t
    return {name: alone.get(name, 0.0) for name in by_thread}


def stream_gaps(spans: list[Span], launches: dict[int, Span]) -> tuple[float, float]:
    """Seconds between the items of one thread on each of its streams (from one's end to the next's start),
    split by the next item's launch: (not yet launched, the host's; launched and waiting for SMs, a shared
    work queue or a dependency). A gap before an item with no launch event counts as waiting."""
    host = waiting = 0.0
    by_stream: dict[int | None, list[Span]] = defaultdict(list)
    for s in spans:
        by_stream[s.stream].append(s)
    for items in by_stream.values():
        reach = None
        for s in sorted(items, key=lambda s: s.start):
            if reach is not None and s.start > reach:
                launch = launches.get(s.correlation)
                late = min(s.start, launch.end) - reach if launch is not None and launch.end > reach else 0.0
                host += late
                waiting += s.start - reach - late
            reach = s.end if reach is None else max(reach, s.end)
    return host / 1e6, waiting / 1e6


def stretch(mine: list[Span], others: list[Span]) -> dict:
    """How much longer `mine`'s items ran beside `others`' than alone: over each kernel name that ran both
    ways, the seconds of its items that overlapped another's (shared_s) and what as many items took on
    average when none did (as_alone_s)."""
    union = merged(others)
    ends = [e for _, e in union]
    alone: dict[str, list[float]] = defaultdict(list)
    shared: dict[str, list[float]] = defaultdict(list)
    for s in mine:
        i = bisect.bisect_right(ends, s.start)  # the first merged span that ends after this item starts
        beside = i < len(union) and union[i][0] < s.end
        (shared if beside else alone)[s.name].append(s.end - s.start)
    both = [n for n in shared if n in alone]
    shared_s = sum(sum(shared[n]) for n in both) / 1e6
    as_alone_s = sum(len(shared[n]) * sum(alone[n]) / len(alone[n]) for n in both) / 1e6
    return dict(shared_s=shared_s, as_alone_s=as_alone_s)


def _thread_rows(items: list[Span], owners: list[str], launches: dict[int, Span]) -> list[dict]:
    by_thread: dict[str, list[Span]] = defaultdict(list)
    for item, owner in zip(items, owners):
        by_thread[owner].append(item)
    alone = alone_seconds(by_thread)
    rows = []
    for thread, spans in by_thread.items():
        first: dict[int, float] = {}  # per launch, its first item's start: how long the work queued
        for s in spans:
            if s.correlation in launches:
                first[s.correlation] = min(first.get(s.correlation, s.start), s.start)
        waits = [max(0.0, start - launches[c].end) / 1e3 for c, start in first.items()]
        kernels: dict[str, list[float]] = defaultdict(list)
        for s in spans:
            kernels[s.name].append((s.end - s.start) / 1e6)
        top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
        host_gap_s, waiting_gap_s = stream_gaps(spans, launches)
        others = [s for name, theirs in by_thread.items() if name != thread for s in theirs]
        rows.append(dict(
            gaps=dict(host_s=host_gap_s, waiting_s=waiting_gap_s), stretch=stretch(spans, others),
            thread=thread, items=len(spans), item_s=sum(s.end - s.start for s in spans) / 1e6,
            busy_s=union_seconds(spans), alone_s=alone[thread],
            streams=sorted({s.stream for s in spans if s.stream is not None}), launches=len(first),
            queue_ms=dict(mean=sum(waits) / len(waits), p50=_percentile(waits, 0.5), p90=_percentile(waits, 0.9))
            if waits else None,
            top=[dict(name=name[:120], s=sum(d), items=len(d)) for name, d in top]))
    return sorted(rows, key=lambda r: -r["item_s"])


def _stream_rows(items: list[Span], owners: list[str]) -> list[dict]:
    by_stream: dict[int | None, list[tuple[Span, str]]] = defaultdict(list)
    for item, owner in zip(items, owners):
        by_stream[item.stream].append((item, owner))
    rows = []
    for stream, pairs in by_stream.items():
        counts = Counter(owner for _, owner in pairs)
        rows.append(dict(stream=stream, items=len(pairs), busy_s=union_seconds([s for s, _ in pairs]),
                         thread=counts.most_common(1)[0][0]))
    return sorted(rows, key=lambda r: -r["busy_s"])


def summarize(trace: dict, threads: dict[int, str] | None = None, wall_s: float | None = None) -> dict:
    """The trace's GPU items and host ops, per thread and stream. threads: native thread id -> name
    (the profiled process's own names; others show as `thread <id>`); wall_s: the window's length
    (default: from its first event to its last)."""
    names = {int(k): v for k, v in (threads or {}).items()}

    def name_of(tid) -> str:
        return names.get(tid, f"thread {tid}") if isinstance(tid, int) else str(tid)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    items = [_span(e) for e in events if e.get("cat") in GPU_CATEGORIES]
    calls = [_span(e) for e in events if e.get("cat") in LAUNCH_CATEGORIES]
    launches = {s.correlation: s for s in calls if s.correlation is not None}
    host = [_span(e) for e in events if e.get("cat") == HOST_CATEGORY]
    # each GPU item's thread: the one whose CUDA call launched it
    owners = [name_of(launches[s.correlation].tid) if s.correlation in launches else "unattributed" for s in items]
    if wall_s is None:
        spans = [*items, *host, *launches.values()]
        wall_s = (max(s.end for s in spans) - min(s.start for s in spans)) / 1e6 if spans else 0.0
    busy = union_seconds(items)
    item_s = sum(s.end - s.start for s in items) / 1e6
    return dict(
        wall_s=wall_s,
        gpu=dict(items=len(items), busy_s=busy, busy_share=busy / wall_s if wall_s > 0 else None,
                 item_s=item_s, concurrency=item_s / busy if busy > 0 else None),
        threads=_thread_rows(items, owners, launches),
        streams=_stream_rows(items, owners),
        host=_host_rows(host, calls, name_of))


def _host_rows(ops: list[Span], calls: list[Span], name_of) -> list[dict]:
    """Per thread, the seconds of its recorded ops, of its CUDA calls, and of those that waited for the GPU
    (synchronizations, copies): a thread that is always "busy" but whose kernels leave the GPU idle is either
    waiting here or running Python between its calls."""
    by_thread: dict[str, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
    for s in ops:
        by_thread[name_of(s.tid)][0].append(s)
    for s in calls:
        mine = by_thread[name_of(s.tid)]
        mine[1].append(s)
        if any(w in s.name for w in WAITING_CALLS):
            mine[2].append(s)
    rows = [dict(thread=t, ops=len(o), op_s=union_seconds(o), cuda_call_s=union_seconds(c), wait_s=union_seconds(w))
            for t, (o, c, w) in by_thread.items()]
    return sorted(rows, key=lambda r: -(r["op_s"] + r["cuda_call_s"]))


def render(summary: dict) -> str:
    """The summary as text: the GPU's use of the window, then per thread and per stream."""
    gpu, wall = summary["gpu"], summary["wall_s"]
    lines = [f"window {wall:.2f} s: GPU busy {gpu['busy_s']:.2f} s"
             + (f" ({100 * gpu['busy_share']:.1f}%)" if gpu["busy_share"] is not None else "")
             + f", {gpu['items']} GPU items, {gpu['item_s']:.2f} s of item time"
             + (f" (x{gpu['concurrency']:.2f} overlap)" if gpu["concurrency"] else "")]
    for r in summary["threads"]:
        queue = r["queue_ms"]
        lines.append(f"  {r['thread']}: busy {r['busy_s']:.2f} s ({r['alone_s']:.2f} s with no other thread's work), "
                     f"{r['items']} items in {r['launches']} launches "
                     f"on streams {r['streams']}" + (f", queued mean {queue['mean']:.2f} / p90 {queue['p90']:.2f} ms"
                                                     if queue else ""))
        gaps, beside = r["gaps"], r["stretch"]
        lines.append(f"      between its items on its streams: {gaps['host_s']:.2f} s before the next was launched (host), "
                     f"{gaps['waiting_s']:.2f} s launched and waiting; beside other threads' work its kernels took "
                     f"{beside['shared_s']:.2f} s against {beside['as_alone_s']:.2f} s at their alone durations")
        lines += [f"      {k['s']:8.3f} s {k['items']:7d}x  {k['name']}" for k in r["top"]]
    lines += [f"  stream {r['stream']}: busy {r['busy_s']:.2f} s, {r['items']} items, mostly {r['thread']}"
              for r in summary["streams"]]
    lines += [f"  host {r['thread']}: {r['op_s']:.2f} s in {r['ops']} ops; CUDA calls {r['cuda_call_s']:.2f} s, "
              f"{r['wait_s']:.2f} s of them waiting for the GPU" for r in summary["host"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m intone.engine.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--threads", default=None, help="JSON object: native thread id -> name")
    ap.add_argument("--wall-s", type=float, default=None, help="the window's length (default: its events' span)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the summary as JSON there instead")
    args = ap.parse_args(argv)
    summary = summarize(read_trace(args.trace), json.loads(args.threads) if args.threads else None, args.wall_s)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    else:
        print(render(summary))


if __name__ == "__main__":
    main()
