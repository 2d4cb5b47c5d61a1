"""intone on Ray Serve (`intone.deploy.ray`): two replicas on the CPU under a local Ray, traffic
through Ray's HTTP proxy reaching both. Skipped where ray[serve] is not installed (the default
install and CI: `pip install 'intone[ray]'` brings it)."""

import os
import socket
import threading

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

SAMPLES_PER_FRAME = 2048  # tiny Fish


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def proxy(tiny_cache, tiny_fish_dir, tmp_path_factory):
    from intone.deploy.ray import app_builder

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {
        "INTONE_CACHE": str(tiny_cache), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        voices = tmp_path_factory.mktemp("ray-voices")
        serve.run(app_builder({"model": "tiny:fish-s2", "device": "cpu", "num_replicas": "2", "num_cpus": "1",
                               "voices_dir": str(voices), "text_workers": "0", "drain_seconds": "10"}),
                  name="intone", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_serve_the_same_api_through_rays_proxy(proxy):
    replies: list[httpx.Response] = []

    def speak(i: int):
        replies.append(httpx.post(proxy + "/v1/audio/speech", timeout=120, json={
            "input": f"Replica test {i}.", "seed": i, "max_new_tokens": 30, "ignore_eos": True}))

    for _ in range(3):  # Ray's proxy picks the less busy of two replicas: concurrent requests spread
        threads = [threading.Thread(target=speak, args=(len(replies) + i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        if len({r.headers["x-intone-replica"] for r in replies}) == 2:
            break
    assert all(r.status_code == 200 and len(r.content) == 44 + 30 * SAMPLES_PER_FRAME * 2 for r in replies)
    served = {name: sum(r.headers["x-intone-replica"] == name for r in replies)
              for name in {r.headers["x-intone-replica"] for r in replies}}
    print("requests per replica:", served)
    assert len(served) == 2  # both replicas served

    with httpx.stream("POST", proxy + "/v1/audio/speech", timeout=120, json={
            "input": "Streamed through the proxy.", "seed": 1, "max_new_tokens": 40, "ignore_eos": True,
            "stream": True, "stream_format": "audio", "response_format": "pcm"}) as r:
        assert r.status_code == 200 and r.headers["x-sample-rate"] == "44100"
        assert sum(len(part) for part in r.iter_bytes()) == 40 * SAMPLES_PER_FRAME * 2
    bad = httpx.post(proxy + "/v1/audio/speech", json={"input": "x", "voice": "nobody"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "voice"
    health = httpx.get(proxy + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["engines"][0]["status"] == "ok"
    models = httpx.get(proxy + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "tiny:fish-s2"
