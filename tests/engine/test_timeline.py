"""engine.timeline: a profiled window's GPU items tied to the threads that launched them, and the time
the GPU was busy, against brute force over traces in Kineto's chrome-trace layout."""

import gzip
import json
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from intone.engine.timeline import render, summarize

THREADS = {101: "engine loop", 202: "intone-codec", 303: "intone-frontend"}


@st.composite
def traces(draw):
    """Launches from three threads (and some with no launch event), each of one to three GPU items
    (a graph replay is one launch of several kernels) on one of three streams; integer microseconds."""
    events, launches = [], draw(st.integers(1, 25))
    for correlation in range(launches):
        tid = draw(st.sampled_from(sorted(THREADS)))
        at = draw(st.integers(0, 400))
        launch_end = at + draw(st.integers(1, 20))
        if draw(st.booleans()) or correlation % 5:  # most launches are in the trace
            kind = draw(st.sampled_from(["cuda_runtime", "cuda_driver"]))
            events.append({"ph": "X", "cat": kind, "name": "cudaLaunchKernel", "ts": at, "dur": launch_end - at,
                           "pid": 7, "tid": tid, "args": {"correlation": correlation}})
        stream = draw(st.sampled_from([7, 13, 21]))
        start = launch_end + draw(st.integers(0, 50))
        for _ in range(draw(st.integers(1, 3))):
            dur = draw(st.integers(1, 60))
            events.append({"ph": "X", "cat": draw(st.sampled_from(["kernel", "gpu_memcpy", "gpu_memset"])),
                           "name": draw(st.sampled_from(["gemm", "attn", "copy"])), "ts": start, "dur": dur,
                           "pid": 0, "tid": stream, "args": {"stream": stream, "correlation": correlation}})
            start += dur + draw(st.integers(0, 5))
    for other in range(draw(st.integers(0, 6))):  # calls that launch nothing, some of them waiting for the GPU
        at = draw(st.integers(0, 400))
        events.append({"ph": "X", "cat": "cuda_runtime", "ts": at, "dur": draw(st.integers(1, 80)), "pid": 7,
                       "name": draw(st.sampled_from(["cudaStreamSynchronize", "cudaMemcpyAsync", "cudaEventRecord"])),
                       "tid": draw(st.sampled_from(sorted(THREADS))), "args": {"correlation": 10_000 + other}})
    events.append({"ph": "M", "name": "thread_name", "pid": 7, "tid": 101, "args": {"name": "thread 101"}})
    return {"traceEvents": events}


def covered(events) -> set[int]:
    return {t for e in events for t in range(e["ts"], e["ts"] + e["dur"])}


def covered_us(events) -> int:
    return len(covered(events))


def gpu_events(trace):
    return [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def owner(trace):
    """correlation -> the name of the thread that launched it."""
    return {e["args"]["correlation"]: THREADS[e["tid"]] for e in trace["traceEvents"]
            if e.get("cat") in ("cuda_runtime", "cuda_driver")}


def brute_gaps(mine, launch_ends) -> tuple[int, int]:
    """Per stream, each microsecond between a thread's first item and its last that none of its items there
    covers: the host's when the item that next starts was launched later, else waiting."""
    host = waiting = 0
    for stream in {e["args"]["stream"] for e in mine}:
        items = [e for e in mine if e["args"]["stream"] == stream]
        busy = covered(items)
        for t in range(min(e["ts"] for e in items), max(e["ts"] + e["dur"] for e in items)):
            if t in busy:
                continue
            following = min((e for e in items if e["ts"] > t), key=lambda e: e["ts"])
            end = launch_ends.get(following["args"]["correlation"])
            if end is not None and t < end:
                host += 1
            else:
                waiting += 1
    return host, waiting


def brute_stretch(mine, others) -> tuple[float, float]:
    """Over names with items both overlapping another thread's item and not: those items' time, and as many
    items at the mean duration of the others."""
    def beside(e):
        return any(o["ts"] < e["ts"] + e["dur"] and o["ts"] + o["dur"] > e["ts"] for o in others)
    shared_s = as_alone_s = 0.0
    for name in {e["name"] for e in mine}:
        shared = [e["dur"] for e in mine if e["name"] == name and beside(e)]
        alone = [e["dur"] for e in mine if e["name"] == name and not beside(e)]
        if shared and alone:
            shared_s += sum(shared)
            as_alone_s += len(shared) * sum(alone) / len(alone)
    return shared_s, as_alone_s


@settings(max_examples=150, deadline=None)
@given(traces())
def test_busy_time_and_attribution_match_brute_force(trace):
    s = summarize(trace, THREADS, wall_s=1.0)
    items, owners = gpu_events(trace), owner(trace)
    assert s["gpu"]["items"] == len(items)
    assert abs(s["gpu"]["busy_s"] - covered_us(items) / 1e6) < 1e-9
    assert s["gpu"]["busy_s"] <= s["gpu"]["item_s"] + 1e-12 and s["gpu"]["busy_share"] == s["gpu"]["busy_s"]
    by_thread = {r["thread"]: r for r in s["threads"]}
    assert sum(r["items"] for r in s["threads"]) == len(items) == sum(r["items"] for r in s["streams"])
    for name in {*owners.values(), "unattributed"}:
        mine = [e for e in items if owners.get(e["args"]["correlation"], "unattributed") == name]
        if not mine:
            assert name not in by_thread
            continue
        row = by_thread[name]
        assert row["items"] == len(mine) and abs(row["busy_s"] - covered_us(mine) / 1e6) < 1e-9
        others = [e for e in items if owners.get(e["args"]["correlation"], "unattributed") != name]
        only_mine = len(covered(mine) - covered(others))
        assert abs(row["alone_s"] - only_mine / 1e6) < 1e-9
        assert row["streams"] == sorted({e["args"]["stream"] for e in mine})
        assert sum(k["items"] for k in row["top"]) == len(mine)  # three names: all of them within the top
        launch_ends = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in trace["traceEvents"]
                       if e.get("cat") in ("cuda_runtime", "cuda_driver")}
        firsts = {}
        for e in mine:
            c = e["args"]["correlation"]
            if c in launch_ends:
                firsts[c] = min(firsts.get(c, e["ts"]), e["ts"])
        waits = [max(0, t - launch_ends[c]) / 1e3 for c, t in firsts.items()]
        assert row["launches"] == len(firsts)
        assert (row["queue_ms"] is None) == (not waits)
        if waits:
            assert abs(row["queue_ms"]["mean"] - sum(waits) / len(waits)) < 1e-9
        host, waiting = brute_gaps(mine, launch_ends)
        assert abs(row["gaps"]["host_s"] - host / 1e6) < 1e-9 and abs(row["gaps"]["waiting_s"] - waiting / 1e6) < 1e-9
        shared_s, as_alone_s = brute_stretch(mine, others)
        assert abs(row["stretch"]["shared_s"] - shared_s / 1e6) < 1e-9
        assert abs(row["stretch"]["as_alone_s"] - as_alone_s / 1e6) < 1e-9
    for row in s["streams"]:
        mine = [e for e in items if e["args"]["stream"] == row["stream"]]
        assert abs(row["busy_s"] - covered_us(mine) / 1e6) < 1e-9
    calls = [e for e in trace["traceEvents"] if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    assert {r["thread"] for r in s["host"]} == {THREADS[e["tid"]] for e in calls}
    for row in s["host"]:
        mine = [e for e in calls if THREADS[e["tid"]] == row["thread"]]
        waits = [e for e in mine if e["name"] in ("cudaStreamSynchronize", "cudaMemcpyAsync")]
        assert abs(row["cuda_call_s"] - covered_us(mine) / 1e6) < 1e-9
        assert abs(row["wait_s"] - covered_us(waits) / 1e6) < 1e-9


def test_the_command_line_reads_a_gzipped_trace(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 10, "pid": 7, "tid": 202,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "flow_gemm", "ts": 30, "dur": 500, "pid": 0, "tid": 7,
         "args": {"stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100, "pid": 7, "tid": 101}]}
    path = tmp_path / "engine.json.gz"
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    out = subprocess.run([sys.executable, "-m", "intone.engine.timeline", str(path), "--threads",
                          json.dumps({"202": "intone-codec", "101": "engine loop"})],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "GPU busy 0.00 s (94.3%)" in out  # 500 us of the 530 us from the first event to the last
    assert "intone-codec: busy 0.00 s (0.00 s with no other thread's work), 1 items in 1 launches on streams [7], " \
        "queued mean 0.02" in out
    assert "host engine loop: 0.00 s in 1 ops; CUDA calls 0.00 s, 0.00 s of them waiting for the GPU" in out
    assert render(summarize(trace)).startswith("window 0.00 s")
