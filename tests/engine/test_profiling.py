"""The engine core's profiler window (engine/profiling.py): bounded by itself, one at a time, and
its trace readable by engine/timeline.py, with host ops of the threads that ran torch meanwhile."""

import threading
import time

import pytest
import torch

from intone.engine.profiling import ProfileStateError, WindowProfiler
from intone.engine.timeline import read_trace, summarize


def test_a_window_left_open_ends_by_itself_and_waits_for_the_next_stop(tmp_path):
    profiler, done = WindowProfiler(max_seconds=0.2), threading.Event()
    profiler.start(str(tmp_path / "w"))

    def work():
        for _ in range(20):
            torch.randn(64, 64) @ torch.randn(64, 64)
        done.wait(10)
    worker = threading.Thread(target=work, name="intone-codec")  # alive past the window, as the engine's are
    worker.start()
    with pytest.raises(ProfileStateError):
        profiler.start(str(tmp_path / "w"))
    time.sleep(0.3)
    profiler.poll()
    assert not profiler.running
    window = profiler.stop()
    done.set()
    worker.join()
    assert window["ended_by_itself"] and window["wall_s"] > 0.2
    summary = summarize(read_trace(window["trace"]), window["threads"], window["wall_s"])
    assert "intone-codec" in {h["thread"] for h in summary["host"]}  # a thread started in the window
    with pytest.raises(ProfileStateError, match="no profile is running"):
        profiler.stop()


def test_closing_a_running_window_writes_nothing(tmp_path):
    profiler = WindowProfiler()
    profiler.start(str(tmp_path / "w"))
    torch.randn(8, 8).sum()
    profiler.close()
    assert not profiler.running and list((tmp_path / "w").iterdir()) == []
    with pytest.raises(ProfileStateError):
        profiler.stop()
    profiler.start(str(tmp_path / "w"))  # a new window after a closed one
    assert profiler.stop()["trace"].endswith(".json.gz")
