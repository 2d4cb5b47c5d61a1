"""A torch profiler window over the engine core's served load (`intone serve --profile-dir`).

Started and stopped from the core's loop, between steps, by the API's /start_profile and /stop_profile.
It records the GPU's kernels, copies and the CUDA calls that launched them for every thread of the
process (the loop, the codec worker, the frontend workers; `engine.timeline` ties each kernel to its
thread), and the host ops of the threads running torch in it (where torch can record other threads than the
loop's). A window that is never stopped ends by itself after `max_seconds` (30), so its buffers stay bounded; its
trace then waits for the next stop. A trace is written off the loop (a busy GPU's takes seconds, and a loop
silent past --engine-hang-seconds is killed). A codec in a process of its own (`codec.process`) is outside the
window.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from intone.errors import IntoneError

MAX_SECONDS = 30.0  # a window's own end: its trace (and the loop's pause to close it) grows with its length


class ProfileStateError(IntoneError):
    """A start while a window runs, or a stop with none to stop."""


def _all_threads_config():
    """Host ops of threads started during the window too, where this torch can (the GPU side sees every
    thread either way)."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (TypeError, AttributeError):
        return None


def _thread_keys(t: threading.Thread) -> list[int]:
    """The ids a trace may give thread t: its native id (what Kineto calls a thread it registered), and its
    pthread id, whole and as CUPTI's 32 bits (signed as Kineto writes them) for a thread it never registered."""
    keys = [t.native_id] if t.native_id is not None else []
    if t.ident:
        low = t.ident & 0xFFFFFFFF
        keys += [t.ident, low, (low ^ 0x80000000) - 0x80000000]
    return keys


def thread_names() -> dict[int, str]:
    """This process's threads by every id a trace may give them (`_thread_keys`); the main thread is the loop."""
    return {key: "engine loop" if t is threading.main_thread() else t.name
            for t in threading.enumerate() for key in _thread_keys(t)}


def _keep_cupti() -> None:
    """Before CUDA 12.6, tearing CUPTI down after a window can crash a later one in a process that replays
    CUDA graphs (pytorch#112507); torch keeps it up only for its own graphs' sake, so it is asked here."""
    version = torch.version.cuda
    if version and tuple(int(x) for x in version.split(".")[:2]) < (12, 6):
        os.environ.setdefault("TEARDOWN_CUPTI", "0")
        os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")


class WindowProfiler:
    """One window at a time: start, then stop (or its own end after max_seconds). The stop's trace is written
    by a thread of its own, so the loop keeps stepping (and telling the API it is alive) meanwhile; `poll`,
    called from the loop, hands back each stop's answer once its trace is written."""

    def __init__(self, max_seconds: float = MAX_SECONDS):
        self.max_seconds = max_seconds
        self._profile: profile | None = None
        self._directory: Path | None = None
        self._started = 0.0
        self._names: dict[int, str] = {}  # the threads at the window's start (some may end in it)
        self._writer: threading.Thread | None = None  # writing the last window's trace
        self._written: tuple | None = None  # (result, error) of the last window, for the stop that takes it
        self._stops: list[str] = []  # tokens of the stops waiting for the trace being written
        self._windows = 0  # windows started (each trace's name carries its number)

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, directory: str) -> dict:
        """A new window (a finished one that no stop took is dropped: its trace stays on disk)."""
        if self._profile is not None or self._writer is not None:
            raise ProfileStateError("a profile is already running (or its trace is being written): stop it first")
        _keep_cupti()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        config = _all_threads_config()
        window = profile(activities=activities, **({"experimental_config": config} if config is not None else {}))
        self._directory = Path(directory)
        self._directory.mkdir(parents=True, exist_ok=True)
        window.start()
        self._profile, self._started, self._written = window, time.perf_counter(), None
        self._windows += 1
        self._names = thread_names()
        return dict(pid=os.getpid(), max_seconds=self.max_seconds)

    def stop(self, token: str) -> None:
        """Ends the window (or takes the one that ended by itself); `poll` answers the token."""
        if self._profile is None and self._writer is None and self._written is None:
            raise ProfileStateError("no profile is running: start one first")
        if self._profile is not None:
            self._end()
        self._stops.append(token)

    def poll(self) -> list[tuple]:
        """Ends a window that has run for max_seconds; (token, result, None) or (token, None, ("failed", why))
        for each stop whose trace is written (called from the loop between steps)."""
        if self._profile is not None and time.perf_counter() - self._started > self.max_seconds:
            try:
                self._end()
            except Exception as e:  # noqa: BLE001 - a diagnostic's failure must not end the engine
                self._written = (None, ("failed", f"{type(e).__name__}: {e}"))
        if self._writer is not None and not self._writer.is_alive():
            self._writer = None
        if self._writer is not None or self._written is None or not self._stops:
            return []
        (result, error), self._written = self._written, None
        first, *late = self._stops
        self._stops = []
        refused = ("refused", "no profile is running: start one first")
        return [(first, result, error), *((token, None, refused) for token in late)]

    def close(self) -> None:
        """Stops a running window without writing it (the core is shutting down)."""
        window, self._profile = self._profile, None
        if window is not None:
            window.stop()

    def _end(self) -> None:
        window, self._profile = self._profile, None
        window.stop()
        wall = time.perf_counter() - self._started
        path = self._directory / f"engine-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}-{self._windows}.json.gz"
        names = self._names

        def write() -> None:
            try:
                window.export_chrome_trace(str(path))
                self._written = (dict(trace=str(path), wall_s=wall, threads={**names, **thread_names()},
                                      pid=os.getpid(), ended_by_itself=wall > self.max_seconds), None)
            except Exception as e:  # noqa: BLE001 - told to the stop that waits for it
                self._written = (None, ("failed", f"{type(e).__name__}: {e}"))
        self._writer = threading.Thread(target=write, name="intone-profile-writer", daemon=True)
        self._writer.start()
