"""The API's text frontend in worker processes reads texts exactly as in the API's own threads."""

import asyncio
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from intone.api.text_workers import TextWorkers
from intone.engine.child import PARENT_CHECK_S
from intone.errors import InvalidRequestError
from intone.models import text_frontend
from intone.protocol import VoiceReference

TEXT = "He lit the lamp at 7:45 and watched 3 ships pass. When the storm came, the boats found their way home."


async def read_all(workers: TextWorkers):
    await workers.start()
    try:
        segments = await workers.cut(TEXT, "input")
        ref = VoiceReference(text="Call me at 5 pm.", audio=torch.zeros(16000), sample_rate=16000)
        (read,) = await workers.read_transcripts([ref])
        with pytest.raises(InvalidRequestError) as refused:
            await workers.cut("?!...", "input")
        return segments, read, refused.value
    finally:
        workers.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_cosyvoice3_texts_are_read_the_same_in_a_worker_process_as_in_a_thread(workers, tiny_cache):
    frontend = text_frontend("tiny:cosyvoice3")
    segments, read, refused = asyncio.run(read_all(TextWorkers("tiny:cosyvoice3", frontend, workers)))
    assert segments == frontend.segments(TEXT) and "seven forty five" in " ".join(segments).lower()
    assert read.text == frontend.normalize("Call me at 5 pm.") and np.array_equal(read.audio, torch.zeros(16000))
    assert refused.field == "input" and "punctuation" in refused.message  # the error crosses the process whole


def test_without_a_text_frontend_the_text_goes_as_sent_and_no_worker_starts(tiny_cache):
    workers = TextWorkers("tiny:fish-s2", None, 4)
    ref = VoiceReference(text="At 5 pm.")

    async def run():
        await workers.start()
        return await workers.cut(TEXT, "input"), await workers.read_transcripts([ref])

    assert asyncio.run(run()) == ([TEXT], [ref]) and workers.workers == 0


PARENT = """
import asyncio, sys, time
from intone.api.text_workers import TextWorkers
from intone.engine.child import PARENT_CHECK_S
from intone.models import text_frontend
workers = TextWorkers("tiny:cosyvoice3", text_frontend("tiny:cosyvoice3"), 1)
asyncio.run(workers.start())
print(*workers._pool._processes, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running or sleeping: not gone and not a zombie (an orphan's zombie waits for PID 1 to reap it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line for line in f if line.startswith("State:")).split()[1] != "Z"
    except FileNotFoundError:
        return False


def killed_parent():
    """PARENT started and SIGKILLed once its worker runs: (the worker pids, whether each ran, whether each is
    still alive 15 s after the parent's death at most)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 120)
        assert ready, "the parent never started its worker"
        pids = [int(p) for p in parent.stdout.readline().split()]
        ran = [_alive(p) for p in pids]
    finally:
        parent.kill()
        parent.wait(10)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids, ran, [_alive(p) for p in pids]


CLOSING = """
import asyncio, os, signal
from intone.api.text_workers import TextWorkers
from intone.engine.child import PARENT_CHECK_S
from intone.models import text_frontend
workers = TextWorkers("tiny:cosyvoice3", text_frontend("tiny:cosyvoice3"), 2)
asyncio.run(workers.start())
pids = list(workers._pool._processes)
print(asyncio.run(workers.cut("Two words.", "input")), flush=True)
workers.close()
print(*pids, flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # as uvicorn ends a server: its signal re-raised, so no exit handlers run
"""


def closing_parent():
    """CLOSING run to its end: (its result, its workers' pids, whether each is alive once an orphan would
    have noticed its parent gone)."""
    done = subprocess.run([sys.executable, "-c", CLOSING], capture_output=True, text=True, timeout=120)
    time.sleep(2 * PARENT_CHECK_S)  # an orphan would have noticed its parent gone by now
    pids = [int(p) for p in done.stdout.splitlines()[-1].split()] if done.stdout.strip() else []
    return done, pids, [_alive(p) for p in pids]


def beside_jobs(selected: set[str], tmp_path_factory, cache) -> dict:
    """The two real-subprocess scenarios (of the tests selected): name -> (job, None). tests/conftest.py's
    `beside` runs them, from the session's start, beside the tests (each is mostly process start-ups: imports
    on one core)."""
    scenarios = (("killed", killed_parent, "test_a_killed_api_process_leaves_no_text_worker_behind"),
                 ("closing", closing_parent, "test_closing_the_text_workers_ends_them_before_their_parent_exits"))
    linux = sys.platform.startswith("linux")  # they read /proc
    return {name: (job, None) for name, job, test in scenarios if test in selected and linux}


@pytest.fixture
def parents(beside):
    """name -> the scenario's result; each test waits for its own."""
    return lambda name: beside(__name__, name)[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_api_process_leaves_no_text_worker_behind(parents):
    """SIGKILL gives the API no shutdown: its text workers notice their parent is gone and exit."""
    pids, ran, alive = parents("killed")
    assert pids and all(ran)
    assert not any(alive), pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_closing_the_text_workers_ends_them_before_their_parent_exits(parents):
    """A server's shutdown (close) ends its workers itself: none is left to find its parent gone, and
    no semaphore of their queues is left for the resource tracker to clean up."""
    done, pids, alive = parents("closing")
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert len(pids) == 2 and not any(alive)
    assert "is gone" not in done.stderr and "leaked" not in done.stderr, done.stderr
