"""64 concurrent streams, half of them dropped mid-stream: nothing is left in flight."""

import asyncio
import re
import time

import httpx
import pytest

from tests.api.conftest import BootAhead, stop_server

# The tests that end their server, each on its own, in file order (the next one boots meanwhile).
OWN = {"death": (), "drain_stream": ("--drain-seconds", "1"), "death_open": (), "drain_whole": ("--drain-seconds", "1")}


@pytest.fixture(scope="module")
def own_server(tiny_cache, tiny_fish_dir, tmp_path_factory):
    boots = BootAhead(tmp_path_factory, tiny_cache, OWN)
    yield boots.take
    boots.close()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1))


def metrics_once_idle(server, tries: int = 100) -> str:
    """/metrics once nothing runs or is in flight (or after `tries` tenths of a second)."""
    text = ""
    for _ in range(tries):
        text = httpx.get(server.url("/metrics")).text
        if all(metric(text, f"intone_{name}") == 0 for name in ("requests_running", "requests_in_flight",
                                                                 "engine_live_requests")):
            break
        asyncio.run(asyncio.sleep(0.1))
    return text


def test_64_streams_half_disconnected_leave_nothing(server):
    async def one(client, i):
        body = {"input": f"Stream number {i}.", "seed": i, "max_new_tokens": 30, "stream": True,
                "stream_format": "audio", "response_format": "pcm", "initial_codec_chunk_frames": 2}
        received = 0
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200
            async for part in r.aiter_bytes():
                received += len(part)
                if i % 2 and received > 0:
                    return "dropped", received  # leaving the block closes the connection
        return "done", received

    async def scrapes(client, streams):
        """/metrics while the streams run: a Prometheus scrape times out at 10 s."""
        waits = []
        while not streams.done():
            start = time.perf_counter()
            assert (await client.get("/metrics")).status_code == 200
            waits.append(time.perf_counter() - start)
            await asyncio.sleep(0.2)
        return waits

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.base, timeout=300, limits=limits) as client:
            streams = asyncio.gather(*(one(client, i) for i in range(64)))
            waits = await scrapes(client, streams)
            return await streams, waits

    results, waits = asyncio.run(main())
    assert waits and max(waits) < 3.0, waits  # the engine's stats answer within their 2 s timeout
    assert all(kind == ("dropped" if i % 2 else "done") for i, (kind, _) in enumerate(results))
    assert all(n > 0 and n % 4096 == 0 for kind, n in results if kind == "done")
    text = metrics_once_idle(server)
    assert metric(text, "intone_requests_running") == 0
    assert metric(text, "intone_requests_waiting") == 0
    assert metric(text, "intone_requests_in_flight") == 0
    assert metric(text, "intone_kv_cache_blocks_used") == 0
    assert metric(text, "intone_kv_cache_usage_ratio") == 0
    for table in ("live_requests", "preparing_requests", "planner_requests", "kv_tables"):
        assert metric(text, f"intone_engine_{table}") == 0, table
    assert 'intone_requests_total{outcome="disconnect"}' in text


def _engine_pid(server_pid: int) -> int:
    from pathlib import Path

    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat[3]) == server_pid and "intone.engine.process" in cmdline:
            return int(proc.name)
    raise AssertionError("engine core process not found")


def test_engine_death_gives_503_and_a_log_line(own_server):
    import os
    import signal
    import time

    s = own_server("death")
    try:
        os.kill(_engine_pid(s.process.pid), signal.SIGKILL)
        for _ in range(100):
            if httpx.get(s.url("/health")).status_code == 503:
                break
            time.sleep(0.1)
        assert httpx.get(s.url("/health")).status_code == 503
        r = httpx.post(s.url("/v1/audio/speech"), json={"input": "hello"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "engine core died" in s.log.read_text()
    finally:
        stop_server(s)


def test_shutdown_ends_in_flight_streams_cleanly(own_server):
    import signal
    import threading

    s = own_server("drain_stream")  # --drain-seconds 1
    got, streaming = {}, threading.Event()

    def listen():
        body = {"input": "A long stream.", "seed": 1, "max_new_tokens": 2000, "stream": True, "ignore_eos": True,
                "stream_format": "audio", "response_format": "pcm", "temperature": 0.8}
        try:
            with httpx.stream("POST", s.url("/v1/audio/speech"), json=body, timeout=60) as r:
                got["status"] = r.status_code
                got["bytes"] = 0
                for p in r.iter_bytes():
                    got["bytes"] += len(p)
                    streaming.set()
        except httpx.HTTPError as e:
            got["error"] = type(e).__name__
        finally:
            streaming.set()

    t = threading.Thread(target=listen)
    t.start()
    assert streaming.wait(30)  # audio is arriving: the stream is in flight (2000 frames take far longer)
    s.process.send_signal(signal.SIGTERM)
    # uvicorn re-raises the signal once its shutdown is complete
    assert s.process.wait(40) in (0, -signal.SIGTERM)
    t.join(30)
    assert not t.is_alive() and got.get("status") == 200
    assert got.get("error") == "RemoteProtocolError"  # cut, so the client knows the audio is not whole
    log = s.log.read_text()
    assert "aborting in-flight requests" in log and "Application shutdown complete" in log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert not errors, errors  # a clean shutdown is no failure (the core's exit logs at INFO)


def test_a_non_streamed_request_is_aborted_when_its_client_leaves(server):
    """The client gives up (a read timeout) long before the audio is ready: the engine stops working on it."""
    body = {"input": "A long answer that nobody will wait for.", "seed": 1, "max_new_tokens": 2000, "ignore_eos": True}
    try:
        httpx.post(server.url("/v1/audio/speech"), json=body, timeout=httpx.Timeout(60, read=1.5))
        raise AssertionError("the request finished before the client left")
    except httpx.ReadTimeout:
        pass
    text = metrics_once_idle(server)
    assert metric(text, "intone_requests_running") == 0, "the engine still generates for a departed client"
    assert metric(text, "intone_requests_in_flight") == 0
    assert metric(text, "intone_kv_cache_blocks_used") == 0
    assert 'intone_requests_total{outcome="disconnect"}' in text


def test_engine_death_reaches_every_open_request_as_an_error(own_server):
    """SSE gets speech.audio.error, a raw stream is cut (no clean end of body), a whole response gets 503."""
    import json
    import os
    import signal
    import threading

    s = own_server("death_open")
    body = {"input": "Keep going for a long while.", "seed": 2, "max_new_tokens": 2000, "ignore_eos": True}
    started, results = threading.Barrier(3), {}

    def sse():
        events = []
        with httpx.stream("POST", s.url("/v1/audio/speech"), timeout=120,
                          json={**body, "stream": True, "response_format": "pcm"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        started.wait(30)
        results["sse"] = events

    def raw():
        try:
            with httpx.stream("POST", s.url("/v1/audio/speech"), timeout=120,
                              json={**body, "stream": True, "stream_format": "audio", "response_format": "pcm"}) as r:
                for i, _ in enumerate(r.iter_bytes()):
                    if i == 0:
                        started.wait(30)
            results["raw"] = "ended cleanly"
        except httpx.RemoteProtocolError:
            results["raw"] = "cut"

    def whole():
        results["whole"] = httpx.post(s.url("/v1/audio/speech"), json=body, timeout=120)

    try:
        threads = [threading.Thread(target=f) for f in (sse, raw, whole)]
        for t in threads:
            t.start()
        started.wait(60)  # both streams have audio; the whole response is being made
        os.kill(_engine_pid(s.process.pid), signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert results["sse"][-1]["type"] == "speech.audio.error"
        assert results["sse"][-1]["error"]["code"] == "engine_dead"
        assert results["raw"] == "cut"
        assert results["whole"].status_code == 503 and results["whole"].json()["error"]["code"] == "engine_dead"
    finally:
        stop_server(s)


def test_a_hung_engine_turns_health_to_503_and_metrics_still_answer(server):
    """The session's server (--engine-silence-seconds 2): stopped, then resumed, it is whole again."""
    import os
    import signal
    import time

    s = server
    engine = _engine_pid(s.process.pid)
    try:
        assert httpx.get(s.url("/health")).status_code == 200
        os.kill(engine, signal.SIGSTOP)  # alive but not stepping: a hung GPU call looks like this
        deadline = time.time() + 10
        while time.time() < deadline and httpx.get(s.url("/health")).status_code == 200:
            time.sleep(0.2)
        health = httpx.get(s.url("/health"))
        assert health.status_code == 503 and health.json()["status"] == "unresponsive"
        start = time.time()
        metrics = httpx.get(s.url("/metrics"), timeout=10)
        assert metrics.status_code == 200 and time.time() - start < 5  # bounded, not hanging with the core
        os.kill(engine, signal.SIGCONT)
        deadline = time.time() + 10
        while time.time() < deadline and httpx.get(s.url("/health")).status_code != 200:
            time.sleep(0.2)
        assert httpx.get(s.url("/health")).status_code == 200  # it recovered, and /health says so
    finally:
        os.kill(engine, signal.SIGCONT)


def test_a_whole_response_cut_by_shutdown_is_a_503_to_retry(own_server):
    import signal
    import threading
    import time

    s = own_server("drain_whole")  # --drain-seconds 1
    got = {}

    def ask():
        body = {"input": "A long answer.", "seed": 1, "max_new_tokens": 2000, "ignore_eos": True}
        got["r"] = httpx.post(s.url("/v1/audio/speech"), json=body, timeout=60)

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.time() + 30  # until the engine runs it (2000 frames take far longer than the drain)
    while time.time() < deadline and metric(httpx.get(s.url("/metrics")).text, "intone_requests_running") < 1:
        time.sleep(0.1)
    s.process.send_signal(signal.SIGTERM)
    t.join(40)
    assert s.process.wait(40) in (0, -signal.SIGTERM)
    r = got["r"]
    assert r.status_code == 503 and r.headers.get("retry-after") and r.json()["error"]["code"] == "aborted"
