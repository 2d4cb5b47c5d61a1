"""The load client as a server sees it: at most C requests in flight, each slot one keep-alive connection of
its own (as C users would be), every request's JSON body whole. The server is a small recording app on a real
uvicorn socket: what is tested is the client's traffic, which the engine's server cannot report."""

import asyncio
import json
import socket
import threading
import time

import uvicorn

from intone.bench.client import LoadSpec, run_load
from intone.eval.meta import MetaItem


class Recorder:
    """An ASGI app answering each POST with a WAV header after a short wait, noting its connection, when its
    headers came and the POSTs in flight."""

    def __init__(self):
        self.in_flight = self.most_in_flight = 0
        self.peers: list[tuple] = []
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []  # Unix time each request's headers came, in the order of `bodies`

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":  # the client's connect (GET /health): answered, not counted
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.peers.append(tuple(scope["client"]))
        arrived = time.time()
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        self.bodies.append(json.loads(body))
        self.arrivals.append(arrived)
        await asyncio.sleep(0.05)
        self.in_flight -= 1
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"r")]})
        await send({"type": "http.response.body", "body": b"\0" * 44 + b"\1\0" * 100})


def _serve(app) -> tuple[uvicorn.Server, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_each_slot_is_one_reused_connection_and_no_more_than_c_requests_are_in_flight():
    app = Recorder()
    server, url = _serve(app)
    try:
        items = [MetaItem(f"u{i}", f"text {i}") for i in range(12)]
        records, wall = asyncio.run(run_load(url, items, 3, LoadSpec(), sample_rate=44100))
    finally:
        server.should_exit = True
    assert all(r.ok for r in records) and all(r.audio_s == 100 / 44100 for r in records)
    assert app.most_in_flight == 3
    assert len(set(app.peers)) == 3  # three slots, each its connection kept alive for the next request
    assert sorted(b["input"] for b in app.bodies) == sorted(f"text {i}" for i in range(12))
    assert all(r.started_at >= r.sent_at > 0 for r in records)
    assert wall >= 4 * 0.05  # 12 requests, 3 at a time, 50 ms each


def test_two_bursts_of_64_reach_the_server_promptly():
    """64 requests at once, then 64 more on the connections the first kept: they reach the server at a p50 of
    ~0.02-0.05 s after their clocks start here. One httpx client shared by all 64 took 0.35-0.43 s to route the
    second burst (64 connections opened at once held the first ~0.1 s): time the bench would count as the server's."""
    app = Recorder()
    server, url = _serve(app)
    try:
        items = [MetaItem(f"u{i}", f"{i} " + "x" * 200_000) for i in range(128)]  # bodies of ~200 kB, as a clip's
        records, _ = asyncio.run(run_load(url, items, 64, LoadSpec(), sample_rate=44100))
    finally:
        server.should_exit = True
    arrived = {body["input"].split()[0]: t for body, t in zip(app.bodies, app.arrivals)}
    waves = sorted(records, key=lambda r: r.started_at)
    for name, wave in (("first", waves[:64]), ("second", waves[64:])):
        late = sorted(arrived[r.utt_id[1:]] - r.started_at for r in wave)
        print(f"{name} wave: to the server p50 {late[32]:.3f} max {late[-1]:.3f} s")
        # the p50 tells the two apart (the shared client's 0.35-0.43 s); a loaded CI machine's slowest reached 0.31
        assert late[32] < 0.1 and late[-1] < 1.0, name
