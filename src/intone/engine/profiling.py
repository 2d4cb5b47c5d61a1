"""A torch profiler window over the engine core's served load (`intone serve --profile-dir`).

Started and stopped from the core's loop, between steps, by the API's /start_profile and /stop_profile.
It records the GPU's kernels, copies and the CUDA calls that launched them for every thread of the
process (the loop, the codec worker, the frontend workers; `engine.timeline` ties each kernel to its
thread), and the host ops of the loop's thread. A window that is never stopped ends by itself after
`max_seconds`, so its buffers stay bounded; its trace then waits for the next stop. A codec in a process
of its own (`codec.process`) is outside the window.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from intone.errors import IntoneError

MAX_SECONDS = 120.0


class ProfileStateError(IntoneError):
    """A start while a window runs, or a stop with none to stop."""


def _all_threads_config():
    """Host ops of threads started during the window too, where this torch can (the GPU side sees every
    thread either way)."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (TypeError, AttributeError):
        return None


def thread_names() -> dict[int, str]:
    """This process's threads by native id; the main thread is the engine's loop."""
    return {t.native_id: "engine loop" if t is threading.main_thread() else t.name
            for t in threading.enumerate() if t.native_id is not None}


class WindowProfiler:
    def __init__(self, max_seconds: float = MAX_SECONDS):
        self.max_seconds = max_seconds
        self._profile: profile | None = None
        self._directory: Path | None = None
        self._started = 0.0
        self._finished: dict | None = None  # a window that ended by itself, for the next stop
        self._names: dict[int, str] = {}  # the threads at the window's start (some may end in it)

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, directory: str) -> dict:
        if self._profile is not None:
            raise ProfileStateError("a profile is already running: stop it first")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        config = _all_threads_config()
        window = profile(activities=activities, **({"experimental_config": config} if config is not None else {}))
        self._directory = Path(directory)
        self._directory.mkdir(parents=True, exist_ok=True)
        window.start()
        self._profile, self._started, self._finished = window, time.perf_counter(), None
        self._names = thread_names()
        return dict(pid=os.getpid(), max_seconds=self.max_seconds)

    def poll(self) -> None:
        """Ends a window that has run for max_seconds (called from the loop between steps)."""
        if self._profile is not None and time.perf_counter() - self._started > self.max_seconds:
            self._finished = self._finish()

    def stop(self) -> dict:
        """The window's trace file, its length and the process's thread names."""
        if self._profile is None:
            if self._finished is None:
                raise ProfileStateError("no profile is running: start one first")
            finished, self._finished = self._finished, None
            return finished
        return self._finish()

    def close(self) -> None:
        """Stops a running window without writing it (the core is shutting down)."""
        window, self._profile = self._profile, None
        if window is not None:
            window.stop()

    def _finish(self) -> dict:
        window, self._profile = self._profile, None
        window.stop()
        wall = time.perf_counter() - self._started
        path = self._directory / f"engine-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.json.gz"
        window.export_chrome_trace(str(path))
        return dict(trace=str(path), wall_s=wall, threads={**self._names, **thread_names()}, pid=os.getpid(),
                    ended_by_itself=wall > self.max_seconds)
