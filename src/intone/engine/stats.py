"""The engine core's counters, read by `EngineCore.snapshot` for /metrics and the bench report."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from intone.engine.codec_worker import DecodedBatch, opens_a_stream


ROLES = (("codec", "intone-codec"), ("frontend", "intone-frontend"))  # thread name prefixes; the loop is the caller's


class ThreadCPU:
    """CPU seconds of the engine process's Python threads by role, for telling a loop that computes from one
    that waits: the loop (the thread that reads them: the engine core's), the codec worker, the frontend workers,
    and the whole process (native threads too). A thread's seconds stay counted after it ends (the sums only
    grow, as counters must)."""

    def __init__(self):
        self._seen: dict[int, tuple[str, float]] = {}  # thread ident -> (role, CPU seconds last read)
        self._ended = Counter()  # role -> seconds of threads gone since
        self._given: dict[str, float] = {}  # role -> the last sum given (sums in another order may round lower)

    def seconds(self) -> dict[str, float]:
        """{loop,codec,frontend}_cpu_seconds (where the platform can read a thread's CPU clock) and
        process_cpu_seconds."""
        out = {"process_cpu_seconds": time.process_time()}
        if not hasattr(time, "pthread_getcpuclockid"):
            return out
        me, alive = threading.current_thread(), {}
        for t in threading.enumerate():
            role = "loop" if t is me else next((r for r, prefix in ROLES if t.name.startswith(prefix)), None)
            if role is None or t.ident is None:
                continue
            try:
                alive[t.ident] = role, time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):  # it ended between enumerate and the read
                continue
        for ident, (role, seconds) in self._seen.items():
            if ident not in alive:
                self._ended[role] += seconds
        self._seen = alive
        totals = Counter(self._ended)
        for role, seconds in alive.values():
            totals[role] += seconds
        for role in ("loop", *dict(ROLES)):
            self._given[role] = max(self._given.get(role, 0.0), totals[role])
            out[f"{role}_cpu_seconds"] = self._given[role]
        return out


@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0
    step_wait_seconds: float = 0.0  # the loop waiting for its steps' tokens (the rest of a step is host work)
    step_launch_seconds: float = 0.0  # building a step's inputs and launching it (host; its waits excluded)
    step_pace_seconds: float = 0.0  # the loop asleep before a launch (`ar.min_step_ms`)
    # the steps' spans on the loop's CUDA stream (GPU; SM waits included) by the step's company on the GPU
    # (`intone.protocol.STEP_COMPANY`): seconds and steps
    step_gpu_by: Counter = field(default_factory=Counter)
    gpu_timed_by: Counter = field(default_factory=Counter)
    gpu_timed_prefill_tokens: int = 0  # the prompt tokens of the timed steps that carried prefills
    frames: int = 0
    backlog_steps: int = 0
    chunk_sizes: Counter = field(default_factory=Counter)
    finished: Counter = field(default_factory=Counter)  # by stop reason
    prefill_steps: int = 0  # steps that carried at least one prefill
    codec_seconds: float = 0.0
    # calls made only of streams' first chunks (`schedule: first` or `preempt`): their length against
    # a stream's first_codec says how much of it was the wait for a call; their GPU span, how host-bound
    first_calls: int = 0
    first_call_seconds: float = 0.0
    first_call_gpu_seconds: float = 0.0
    first_call_flow_seconds: float = 0.0  # CosyVoice3: the flow's part of their GPU span (the rest is HiFT)
    first_call_chunks: int = 0
    preempted_calls: int = 0  # calls made at a pause point of a call over the backlog
    captured_graphs: int = 0
    capture_seconds: float = 0.0
    warm_up_seconds: float = 0.0
    ready_allocated_peak_bytes: int | None = None  # the allocator's peak when start-up ended (GPU)
    cpu: ThreadCPU = field(default_factory=ThreadCPU)

    @property
    def step_gpu_seconds(self) -> float:
        return sum(self.step_gpu_by.values())

    @property
    def gpu_timed_steps(self) -> int:
        return sum(self.gpu_timed_by.values())

    def count_step_gpu(self, seconds: float, company: str, prefill_tokens: int = 0) -> None:
        self.gpu_timed_prefill_tokens += prefill_tokens
        self.step_gpu_by[company] += seconds
        self.gpu_timed_by[company] += 1

    def step_company(self) -> dict:
        """step_gpu_seconds_<company> and gpu_timed_steps_<company> (snapshot keys) for each company seen."""
        out = {"gpu_timed_prefill_tokens": self.gpu_timed_prefill_tokens} if self.gpu_timed_steps else {}
        for name, steps in self.gpu_timed_by.items():
            out[f"step_gpu_seconds_{name}"], out[f"gpu_timed_steps_{name}"] = self.step_gpu_by[name], steps
        return out

    def count_codec_call(self, decoded: DecodedBatch) -> None:
        if decoded.dropped:
            return
        self.codec_seconds += decoded.seconds
        self.preempted_calls += decoded.preempted
        if all(opens_a_stream(item) for item in decoded.items):
            self.first_calls += 1
            self.first_call_seconds += decoded.seconds
            self.first_call_gpu_seconds += decoded.gpu_seconds
            self.first_call_flow_seconds += decoded.flow_seconds
            self.first_call_chunks += len(decoded.items)


# torch's allocator counters of device calls that stall the GPU: a retry (no free block: it freed its cache and
# tried again), its cudaMalloc and cudaFree calls (cudaFree waits for the whole device), and its waits for every
# stream before freeing
ALLOCATOR_COUNTERS = {"gpu_alloc_retries": "num_alloc_retries", "gpu_device_mallocs": "num_device_alloc",
                      "gpu_device_frees": "num_device_free", "gpu_sync_all_streams": "num_sync_all_streams"}


def gpu_memory(device: torch.device) -> dict:
    """What torch's caching allocator holds in this process on a CUDA device, in bytes (now and at
    its peak; reserved: allocated plus its cache), and its counts of device calls (`ALLOCATOR_COUNTERS`,
    those this torch keeps); {} on other devices."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)  # one read: what memory_allocated() and its kin each read again
    return dict(gpu_allocated_bytes=stats.get("allocated_bytes.all.current", 0),
                gpu_allocated_peak_bytes=stats.get("allocated_bytes.all.peak", 0),
                gpu_reserved_bytes=stats.get("reserved_bytes.all.current", 0),
                gpu_reserved_peak_bytes=stats.get("reserved_bytes.all.peak", 0),
                **{key: stats[name] for key, name in ALLOCATOR_COUNTERS.items() if name in stats})


def gib_so_far(device: torch.device) -> str:
    """The allocator's peak so far, for start-up log lines."""
    peak = gpu_memory(device).get("gpu_allocated_peak_bytes")
    return "n/a" if peak is None else f"{peak / 2**30:.1f} GiB"
