"""`intone serve --data-parallel 2`: two real engine core processes (tiny Fish, CPU) behind one real
server; routing by frames owed, affinity for a repeated reference, one core's death, SIGTERM's drain.
The tests share one server, in file order; the last one ends it."""

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf

from intone.bench.server_metrics import scrape
from tests.api.conftest import start_server, stop_server

SAMPLES_PER_FRAME = 2048  # tiny Fish: 44.1 kHz, hop 2048
LONG = {"input": "A long one.", "seed": 1, "max_new_tokens": 2000, "ignore_eos": True}


@pytest.fixture(scope="module")
def dp_server(tiny_cache, tiny_fish_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    s = start_server(tmp, tiny_cache, "--data-parallel", "2", "--drain-seconds", "60",
                     "--profile-dir", str(tmp / "profiles"))
    t = np.arange(24000) / 16000
    sf.write(s.media / "ref.wav", 0.3 * np.sin(2 * np.pi * 170 * t) * (1 + 0.4 * np.sin(2 * np.pi * 4 * t)), 16000)
    yield s
    if s.process.poll() is None:
        stop_server(s)


def routed(s) -> dict[tuple[str, str], float]:
    """{(engine, reason): requests routed so far}."""
    return {(dict(labels)["engine"], dict(labels)["reason"]): v for (name, labels), v in scrape(s.base).items()
            if name == "intone_engine_routed_requests_total"}


def per_engine(s, name: str) -> dict[str, float]:
    return {dict(labels)["engine"]: v for (n, labels), v in scrape(s.base).items() if n == name}


def went_to(before: dict, after: dict) -> list[tuple[str, str]]:
    """The (engine, reason) of each request routed between two readings."""
    out = []
    for key, value in after.items():
        out += [key] * int(value - before.get(key, 0))
    return sorted(out)


class Stream:
    """A raw PCM stream read on a thread; `started` is set once audio arrives."""

    def __init__(self, s, body: dict, sse: bool = False):
        self.s, self.body, self.sse = s, body, sse
        self.started, self.stop = threading.Event(), threading.Event()
        self.bytes, self.events, self.status, self.error = 0, [], None, None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        body = {**self.body, "stream": True, "response_format": "pcm"}
        if not self.sse:
            body["stream_format"] = "audio"
        try:
            with httpx.stream("POST", self.s.url("/v1/audio/speech"), json=body, timeout=120) as r:
                self.status = r.status_code
                parts = r.iter_lines() if self.sse else r.iter_bytes()
                for part in parts:
                    if self.sse and part.startswith("data: "):
                        self.events.append(json.loads(part[6:]))
                    self.bytes += len(part)
                    self.started.set()
                    if self.stop.is_set():
                        return  # leaving the block disconnects
        except httpx.HTTPError as e:
            self.error = type(e).__name__
        finally:
            self.started.set()

    def close(self):
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


def wait_for(predicate, seconds: float, what: str):
    deadline = time.time() + seconds
    while not (value := predicate()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def idle(s) -> bool:
    samples = scrape(s.base)
    return all(samples[(name, ())] == 0 for name in ("intone_requests_in_flight", "intone_requests_running",
                                                     "intone_engine_live_requests", "intone_kv_cache_blocks_used"))


def whole_response_held_open(s, body: dict) -> socket.socket:
    """A non-streamed request on a raw connection: closing the socket is the client leaving."""
    data = json.dumps(body).encode()
    host, port = s.base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_requests_go_to_the_engine_that_owes_the_fewest_frames(dp_server):
    s = dp_server
    health = httpx.get(s.url("/health")).json()
    assert [e["status"] for e in health["engines"]] == ["ok", "ok"] and health["status"] == "ok"
    assert len({e["pid"] for e in health["engines"]}) == 2
    before = routed(s)
    long = whole_response_held_open(s, LONG)  # ~2000 frames, in one chunk at its end
    [(busy, _)] = wait_for(lambda: went_to(before, routed(s)), 30, "the long request to be routed")
    after = routed(s)
    first = wait_for(lambda: per_engine(s, "intone_engine_outstanding_frames")[busy], 10, "frames owed")
    assert first > 1000  # ~2000 frames expected

    def short(i):
        return httpx.post(s.url("/v1/audio/speech"), timeout=60,
                          json={"input": f"Short {i}.", "seed": i, "max_new_tokens": 8, "ignore_eos": True})
    replies = [None] * 4
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, short(i))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r.status_code == 200 and len(r.content) == 44 + 8 * SAMPLES_PER_FRAME * 2 for r in replies)
    other = "1" if busy == "0" else "0"
    # 4 x 8 frames owed stay far under the long one's ~2000: by request count, two would have gone to `busy`
    assert went_to(after, routed(s)) == [(other, "load")] * 4
    # No chunk comes before a whole response's last: its progress is the core's heartbeat (frames generated)
    wait_for(lambda: per_engine(s, "intone_engine_outstanding_frames")[busy] < first - 20, 30, "progress")
    assert scrape(s.base)[("intone_requests_in_flight", ())] == 1  # still open, no chunk yet
    long.close()
    wait_for(lambda: idle(s), 30, "the disconnected stream to be released")
    assert per_engine(s, "intone_engine_outstanding_frames") == {"0": 0, "1": 0}


def test_a_repeated_reference_returns_to_its_engine_unless_that_one_is_much_busier(dp_server):
    s = dp_server
    body = {"input": "Same voice.", "seed": 3, "max_new_tokens": 6, "ignore_eos": True,
            "ref_audio": str(s.media / "ref.wav"), "ref_text": "A reference."}
    misses0, hits0, before = (per_engine(s, "intone_engine_reference_cache_misses_total"),
                              per_engine(s, "intone_engine_reference_cache_hits_total"), routed(s))
    for _ in range(3):
        assert httpx.post(s.url("/v1/audio/speech"), json=body, timeout=60).status_code == 200
    sent = went_to(before, after := routed(s))
    home = sent[0][0]
    assert sent == [(home, "affinity"), (home, "affinity"), (home, "load")]  # the first by load, then its home
    misses, hits = (per_engine(s, "intone_engine_reference_cache_misses_total"),
                    per_engine(s, "intone_engine_reference_cache_hits_total"))
    away = "1" if home == "0" else "0"
    assert misses[home] - misses0[home] == 1 and hits[home] - hits0[home] == 2  # encoded once, on its home
    assert misses[away] == misses0[away] and hits[away] == hits0[away]

    busy = Stream(s, {**LONG, "ref_audio": body["ref_audio"], "ref_text": body["ref_text"]})
    assert busy.started.wait(60) and busy.status == 200
    assert went_to(after, after2 := routed(s)) == [(home, "affinity")]  # home owed nothing yet: it keeps it
    assert httpx.post(s.url("/v1/audio/speech"), json=body, timeout=60).status_code == 200
    assert went_to(after2, routed(s)) == [(away, "load")]  # home owes ~2000 frames > 1.5 x 0 + 256
    assert per_engine(s, "intone_engine_reference_cache_misses_total")[away] - misses[away] == 1
    busy.close()
    wait_for(lambda: idle(s), 30, "the disconnected stream to be released")


def test_a_stored_voice_is_encoded_once_and_both_engines_speak_it_alike(dp_server):
    s = dp_server
    misses = sum(per_engine(s, "intone_engine_reference_cache_misses_total").values())
    t = np.arange(20000) / 16000
    sf.write(s.media / "voice.wav", 0.3 * np.sin(2 * np.pi * 220 * t), 16000)  # a clip no engine has seen
    with open(s.media / "voice.wav", "rb") as f:
        up = httpx.post(s.url("/v1/audio/voices"), data={"name": "shared", "transcript": "A voice."},
                        files={"audio": ("voice.wav", f, "audio/wav")}, timeout=60)
    assert up.status_code == 201
    assert sum(per_engine(s, "intone_engine_reference_cache_misses_total").values()) == misses + 1  # encoded once
    before = routed(s)
    body = {"input": "One voice.", "voice": "shared", "seed": 7, "max_new_tokens": 10, "ignore_eos": True}
    replies = [None, None]
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(
        i, httpx.post(s.url("/v1/audio/speech"), json=body, timeout=60))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(engine for engine, _ in went_to(before, routed(s))) == ["0", "1"]  # the second: the idle one
    assert all(r.status_code == 200 for r in replies)
    assert replies[0].content == replies[1].content  # the same audio from either engine
    assert sum(per_engine(s, "intone_engine_reference_cache_misses_total").values()) == misses + 1  # never re-encoded


def test_a_profiled_window_covers_both_engines(dp_server):
    s = dp_server
    started = httpx.post(s.url("/start_profile"), timeout=60)
    assert started.status_code == 200 and started.json()["engines"] == 2
    body = {"input": "Profiled.", "seed": 3, "max_new_tokens": 6, "ignore_eos": True}  # the trace grows with each step
    with ThreadPoolExecutor(2) as pool:
        assert [r.status_code for r in pool.map(lambda _: httpx.post(s.url("/v1/audio/speech"), json=body,
                                                                     timeout=60), range(2))] == [200, 200]
    stopped = httpx.post(s.url("/stop_profile"), timeout=300)
    assert stopped.status_code == 200, stopped.text
    rows = stopped.json()["engines"]
    assert [r["engine"] for r in rows] == [0, 1]
    for r in rows:  # each core's window in its own folder, its loop's host ops in its summary
        assert f"engine-{r['engine']}" in r["trace"] and "error" not in r
        assert "engine loop" in {h["thread"] for h in r["summary"]["host"]}
    assert httpx.post(s.url("/stop_profile"), timeout=60).status_code == 409


def test_one_engine_dies_its_requests_fail_cleanly_the_other_serves_and_it_returns(dp_server):
    s = dp_server
    streams = [Stream(s, {**LONG, "seed": i}, sse=True) for i in range(2)]
    for st in streams:
        assert st.started.wait(60) and st.status == 200
    wait_for(lambda: all(v > 0 for v in per_engine(s, "intone_engine_outstanding_frames").values()), 10,
             "both engines to hold a stream")
    victim = httpx.get(s.url("/health")).json()["engines"][0]["pid"]
    assert str(victim) in open(f"/proc/{s.process.pid}/task/{s.process.pid}/children").read().split()
    os.kill(victim, signal.SIGKILL)
    dead = wait_for(lambda: [st for st in streams if st.events and st.events[-1]["type"] == "speech.audio.error"], 20,
                    "the dead engine's stream to end")
    assert len(dead) == 1 and dead[0].events[-1]["error"]["code"] == "engine_dead"
    alive = next(st for st in streams if st is not dead[0])
    health = httpx.get(s.url("/health"))
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert health.json()["engines"][0]["status"] in ("dead", "restarting")
    heard = alive.bytes
    r = httpx.post(s.url("/v1/audio/speech"), json={"input": "Still here.", "max_new_tokens": 5}, timeout=60)
    assert r.status_code == 200
    bad = httpx.post(s.url("/v1/audio/speech"), json={"input": "x", "ref_audio": "/nowhere.wav", "ref_text": "t"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ref_audio"
    wait_for(lambda: alive.bytes > heard, 20, "the other engine's stream to go on")
    assert alive.error is None and alive.events[-1]["type"] == "speech.audio.delta"

    back = wait_for(lambda: (h := httpx.get(s.url("/health")).json())["status"] == "ok" and h, 90,
                    "the dead engine to be replaced")
    assert back["engines"][0]["pid"] != victim and back["engines"][0]["restarts"] == 1 and back["restarts"] == 1
    assert scrape(s.base)[("intone_engine_restarts_total", ())] == 1
    before = routed(s)
    assert httpx.post(s.url("/v1/audio/speech"), json={"input": "Back.", "max_new_tokens": 5}, timeout=60).status_code == 200
    assert went_to(before, routed(s)) == [("0", "load")]  # the other still owes its stream: the new core takes it
    alive.close()
    dead[0].close()
    wait_for(lambda: idle(s), 30, "the disconnected stream to be released")


def test_sigterm_drains_the_requests_of_both_engines(dp_server):
    s = dp_server
    frames = 120
    streams = [Stream(s, {"input": f"Drained {i}.", "seed": i, "max_new_tokens": frames, "ignore_eos": True})
               for i in range(2)]
    for st in streams:
        assert st.started.wait(60) and st.status == 200
    owed = per_engine(s, "intone_engine_outstanding_frames")
    assert all(v > 0 for v in owed.values()), owed  # one stream on each engine
    logged = len(s.log.read_text())
    s.process.send_signal(signal.SIGTERM)
    assert s.process.wait(90) in (0, -signal.SIGTERM)
    for st in streams:
        st.thread.join(30)
        assert st.error is None and st.bytes == frames * SAMPLES_PER_FRAME * 2  # whole, not cut
    log = s.log.read_text()[logged:]
    assert "Waiting for connections to close" in log  # the streams were still open at SIGTERM: drained
    assert "aborting in-flight requests" in log and "Application shutdown complete" in log
    assert not [line for line in log.splitlines() if " ERROR " in line]
