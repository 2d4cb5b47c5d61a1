"""Independent subprocesses run side by side.

Each `intone` process spends seconds importing torch and loading a model on one core; on a
machine of few cores, running independent ones together (a few at a time) is most of what a
test that starts several of them can save. Results come back in the order the commands were given.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


def run(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """subprocess.run, capturing text output (the child is killed if it outlives `timeout`)."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def run_all(commands: list[list[str]], workers: int = 3, timeout: float = 300, **kw) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(run, cmd, timeout, **kw) for cmd in commands]
        return [f.result() for f in futures]


class Background:
    """Jobs started now, `workers` at a time: a command (run as by `run`) or a callable each;
    `result(name)` waits for one of them (and raises what it raised)."""

    def __init__(self, jobs: dict[str, list[str] | Callable[[], Any]], workers: int = 2, timeout: float = 600, **kw):
        self._pool = ThreadPoolExecutor(max(1, workers))
        self._futures: dict[str, Future] = {
            name: self._pool.submit(job) if callable(job) else self._pool.submit(run, job, timeout, **kw)
            for name, job in jobs.items()}

    def result(self, name: str):
        return self._futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# Set once the session's shared servers are up (tests/api/conftest.py): jobs run `Beside` the tests wait for it
# (at most `Beside`'s `wait_s`), so as not to slow those servers' boots.
SERVERS_UP = threading.Event()


class Beside:
    """Jobs (a command, run as by `run`, or a callable each) run in the order given, `workers` at a time, on
    threads of their own, beside whatever the session does meanwhile (tests that wait on a server's core leave the
    other idle), from when SERVERS_UP is set (or `wait_s` has passed). `result(name)` waits for one, starting it
    at once, beside the others, if its turn has not come yet."""

    def __init__(self, jobs: dict[Any, list[str] | Callable[[], Any]], workers: int = 1, timeout: float = 600,
                 wait_s: float = 60, **kw):
        self._jobs, self._timeout, self._kw, self._wait_s = dict(jobs), timeout, kw, wait_s
        self._lock = threading.Lock()
        self._futures: dict[Any, Future] = {}
        self._closed = False
        self._queues = [threading.Thread(target=self._run_in_turn, daemon=True, name=f"beside-{i}")
                        for i in range(max(1, workers))]
        for queue in self._queues:
            queue.start()

    def _claim(self, name) -> Future | None:
        """The job's future, new (the caller runs it) or None if it was claimed already."""
        with self._lock:
            if name in self._futures or self._closed:
                return None
            self._futures[name] = Future()
            return self._futures[name]

    def _run(self, name, future: Future) -> None:
        job = self._jobs[name]
        try:
            future.set_result(job() if callable(job) else run(job, self._timeout, **self._kw))
        except BaseException as e:  # noqa: BLE001 - handed to whoever asks for the result
            future.set_exception(e)

    def _run_in_turn(self) -> None:
        SERVERS_UP.wait(self._wait_s)
        for name in self._jobs:
            future = self._claim(name)
            if future is not None:
                self._run(name, future)

    def result(self, name):
        future = self._claim(name)
        if future is not None:  # not begun yet: now, beside the others
            threading.Thread(target=self._run, args=(name, future), daemon=True).start()
        return self._futures[name].result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for queue in self._queues:
            queue.join()
        for future in list(self._futures.values()):
            future.exception()  # wait for the ones begun out of turn


@contextlib.contextmanager
def frame_audit_alongside(trace):
    """`intone audit-frames TRACE` runs while the block does; on leaving, it must have found the
    trace exact (killed if the block raises)."""
    audit = subprocess.Popen([sys.executable, "-m", "intone.cli.main", "audit-frames", str(trace)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield
        stdout, _ = audit.communicate(timeout=120)
    finally:
        if audit.poll() is None:
            audit.kill()
            audit.wait()
    assert audit.returncode == 0, stdout
    assert "0 missing and 0 repeated frames" in stdout
