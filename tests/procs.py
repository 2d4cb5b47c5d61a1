"""Independent subprocesses run side by side.

Each `intone` process spends seconds importing torch and loading a model on one core; on a
machine of few cores, running independent ones together (a few at a time) is most of what a
test that starts several of them can save. Results come back in the order the commands were given.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
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
