"""The engine core's profiler window (engine/profiling.py): one at a time, bounded by itself, its trace
written off the loop and handed to the stop that asked, readable by engine/timeline.py with the host ops of
the threads that ran torch meanwhile."""

import threading
import time

import pytest
import torch

from intone.engine.profiling import ProfileStateError, WindowProfiler
from intone.engine.timeline import read_trace, summarize


def answers(profiler, count=1, timeout=30.0):
    """The loop's view: poll between steps until `count` stops are answered."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += profiler.poll()
        time.sleep(0.01)
    return got


def test_a_window_left_open_ends_by_itself_and_waits_for_the_next_stop(tmp_path):
    profiler, ran, done = WindowProfiler(max_seconds=0.2), threading.Event(), threading.Event()
    profiler.start(str(tmp_path / "w"))

    def work():
        for _ in range(20):
            torch.randn(64, 64) @ torch.randn(64, 64)
        ran.set()
        done.wait(30)
    worker = threading.Thread(target=work, name="intone-codec")  # alive past the window, as the engine's are
    worker.start()
    with pytest.raises(ProfileStateError):
        profiler.start(str(tmp_path / "w"))
    assert ran.wait(30)  # its ops inside the window, however slow the machine
    time.sleep(0.3)
    assert profiler.poll() == [] and not profiler.running  # ended, and no stop asked for it yet
    profiler.stop("a")
    profiler.stop("b")  # a second stop for the same window is refused once the first is answered
    [(token, window, error), (late, none, refused)] = answers(profiler, 2)
    done.set()
    worker.join()
    assert (token, error, late, none) == ("a", None, "b", None) and refused[0] == "refused"
    assert window["ended_by_itself"] and window["wall_s"] > 0.2
    summary = summarize(read_trace(window["trace"]), window["threads"], window["wall_s"])
    assert "intone-codec" in {h["thread"] for h in summary["host"]}
    with pytest.raises(ProfileStateError, match="no profile is running"):
        profiler.stop("c")


def test_a_stopped_window_is_answered_once_written_and_a_closed_one_writes_nothing(tmp_path):
    profiler = WindowProfiler()
    profiler.start(str(tmp_path / "w"))
    torch.randn(8, 8).sum()
    profiler.close()
    assert not profiler.running and list((tmp_path / "w").iterdir()) == []
    with pytest.raises(ProfileStateError):
        profiler.stop("x")
    profiler.start(str(tmp_path / "w"))  # a new window after a closed one
    profiler.stop("y")
    with pytest.raises(ProfileStateError):  # not while its trace is being written or waits for its stop
        profiler.start(str(tmp_path / "w"))
    [(token, window, error)] = answers(profiler)
    assert token == "y" and error is None and window["trace"].endswith(".json.gz") and not window["ended_by_itself"]
    profiler.start(str(tmp_path / "w"))  # free again
    profiler.close()
