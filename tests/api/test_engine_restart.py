"""A supervised engine core: one that dies or hangs is replaced and the server serves again; with
--engine-restart exit the server stops instead (for an outer supervisor). Real servers, real signals."""

import os
import signal
import time

import httpx
import pytest

from tests.api.conftest import BootAhead, stop_server

BODY = {"input": "Back again.", "seed": 1, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def own_server(tiny_cache, tiny_fish_dir, tmp_path_factory):
    """The tests' servers, each ended by its test, in file order: taking the first boots the other two meanwhile
    (these tests mostly wait: for a hang to be noticed, an engine to be replaced, a server to stop; the second
    test lasts too short a time for the third's boot)."""
    profiles = tmp_path_factory.mktemp("restart-profiles")
    boots = BootAhead(tmp_path_factory, tiny_cache, {
        "restart": ("--engine-hang-seconds", "3"),
        "exit": ("--engine-restart", "exit"),
        "profiled": ("--engine-hang-seconds", "2", "--profile-dir", str(profiles)),
    }, ahead=2)
    yield boots.take
    boots.close()


def _engine_pid(api_pid: int) -> int:
    children = open(f"/proc/{api_pid}/task/{api_pid}/children").read().split()
    assert len(children) == 1
    return int(children[0])


def _wait_health(server, status: int, seconds: float) -> httpx.Response:
    deadline = time.time() + seconds
    while True:
        reply = httpx.get(server.url("/health"), timeout=5)
        if reply.status_code == status or time.time() > deadline:
            return reply
        time.sleep(0.2)


def test_a_dead_or_hung_engine_is_replaced_and_serving_resumes(own_server):
    s = own_server("restart")  # --engine-hang-seconds 3
    try:
        first = _engine_pid(s.process.pid)
        os.kill(first, signal.SIGKILL)
        down = _wait_health(s, 503, 10)
        assert down.status_code == 503 and down.json()["status"] in ("dead", "restarting")
        refused = httpx.post(s.url("/v1/audio/speech"), json=BODY, timeout=30)
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        assert _wait_health(s, 200, 90).status_code == 200
        second = _engine_pid(s.process.pid)
        assert second != first
        assert httpx.post(s.url("/v1/audio/speech"), json=BODY, timeout=60).status_code == 200

        os.kill(second, signal.SIGSTOP)  # alive but silent: killed after --engine-hang-seconds, then replaced
        assert _wait_health(s, 503, 10).status_code == 503
        assert _wait_health(s, 200, 90).status_code == 200
        assert _engine_pid(s.process.pid) not in (first, second)
        assert httpx.post(s.url("/v1/audio/speech"), json=BODY, timeout=60).status_code == 200
        metrics = httpx.get(s.url("/metrics"), timeout=10).text
        assert "intone_engine_restarts_total 2.0" in metrics
        assert not os.path.exists(f"/proc/{second}")  # the hung core is gone, not orphaned
    finally:
        stop_server(s)


def test_with_exit_policy_the_server_stops_when_its_engine_dies(own_server):
    s = own_server("exit")  # --engine-restart exit
    try:
        os.kill(_engine_pid(s.process.pid), signal.SIGKILL)
        s.process.wait(30)
        assert "stopping the server" in s.log.read_text()
    finally:
        if s.process.poll() is None:
            stop_server(s)


def test_a_core_with_a_profiler_window_open_is_not_taken_for_hung(own_server):
    """Closing a profiler window pauses the core's loop; while one is open the supervisor allows more silence
    than --engine-hang-seconds (a bounded grace), so the core, and its window, survive the pause."""
    s = own_server("profiled")  # --engine-hang-seconds 2, a --profile-dir
    try:
        assert httpx.post(s.url("/start_profile"), timeout=30).status_code == 200
        core = _engine_pid(s.process.pid)
        os.kill(core, signal.SIGSTOP)  # silent for twice the hang limit
        time.sleep(4.5)
        os.kill(core, signal.SIGCONT)
        stopped = httpx.post(s.url("/stop_profile"), timeout=120)
        assert stopped.status_code == 200, stopped.text
        assert _engine_pid(s.process.pid) == core
        assert "intone_engine_restarts_total 0.0" in httpx.get(s.url("/metrics"), timeout=10).text
    finally:
        stop_server(s)
