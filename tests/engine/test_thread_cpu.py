"""The engine process's CPU time by thread role (`engine.stats.ThreadCPU`), which the bench report sets against a
step's host time: real threads burning real CPU."""

import threading
import time

import pytest

from intone.engine.stats import ThreadCPU

pytestmark = pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="no per-thread CPU clocks here")


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_each_role_counts_its_threads_cpu_and_keeps_it_after_they_end():
    cpu = ThreadCPU()
    start = cpu.seconds()
    release = threading.Event()  # the workers stay alive until read (a thread born and gone between reads is missed)

    def worker():
        burn(0.2)
        release.wait()

    names = ("intone-codec", "intone-frontend", "intone-frontend-1", "someone-else")
    threads = [threading.Thread(target=worker, name=name, daemon=True) for name in names]
    for t in threads:
        t.start()
    burn(0.2)  # the reader's own thread is the loop
    time.sleep(0.3)  # the workers have burnt theirs (two cores may run them in turn)
    while any(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) < 0.19 for t in threads):
        time.sleep(0.05)
    running = cpu.seconds()
    release.set()
    for t in threads:
        t.join()
    ended, later = cpu.seconds(), cpu.seconds()

    def grown(a, b, key):
        return b[key] - a[key]
    assert 0.19 <= grown(start, running, "loop_cpu_seconds") < 0.5
    assert 0.19 <= grown(start, running, "codec_cpu_seconds") < 0.5
    assert 0.38 <= grown(start, running, "frontend_cpu_seconds") < 0.9  # both workers
    # a thread of no role counts only in the process's total
    assert grown(start, running, "process_cpu_seconds") >= 0.95
    # the workers are gone: their seconds stay (a counter never falls)
    for key in ("codec_cpu_seconds", "frontend_cpu_seconds"):
        assert later[key] >= ended[key] >= running[key]
    # and a new worker's seconds add to theirs
    done, release = threading.Event(), threading.Event()

    def successor():
        burn(0.15)
        done.set()
        release.wait()
    thread = threading.Thread(target=successor, name="intone-codec", daemon=True)
    thread.start()
    done.wait()
    assert grown(later, cpu.seconds(), "codec_cpu_seconds") >= 0.14
    release.set()
    thread.join()
