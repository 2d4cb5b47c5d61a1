"""POST /start_profile and /stop_profile over real HTTP against a real server process (tiny model, CPU):
a window over served requests, its trace and summary; refusals as JSON (the API key's guard: test_errors.py)."""

import gzip
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def post(server, path, **kwargs):
    return httpx.post(server.url(path), timeout=120, **kwargs)


def speak(server, reference_wav, seed):
    # a few frames each: the window's trace, written and summed up at its stop, grows with every step it holds
    body = {"input": "Profiled words", "seed": seed, "max_new_tokens": 8, "ref_audio": str(reference_wav),
            "ref_text": "A reference."}
    return httpx.post(server.url("/v1/audio/speech"), json=body, timeout=120)


def test_a_window_over_served_requests_writes_its_trace_and_summary(server, reference_wav):
    started = post(server, "/start_profile")
    assert started.status_code == 200 and started.json()["profiling"] is True and started.json()["engines"] == 1
    again = post(server, "/start_profile")
    assert again.status_code == 409 and again.json()["error"]["code"] == "profile_state"
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda seed: speak(server, reference_wav, seed), range(3)))
    assert [a.status_code for a in answers] == [200] * 3
    stopped = post(server, "/stop_profile")
    assert stopped.status_code == 200, stopped.text
    [engine] = stopped.json()["engines"]
    trace = json.loads(gzip.decompress(Path(engine["trace"]).read_bytes()))
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
    summary = engine["summary"]
    assert json.loads(Path(engine["summary_file"]).read_text()) == summary
    assert summary["wall_s"] >= 0 and engine["wall_s"] > 0 and not engine["ended_by_itself"]
    loop = [h for h in summary["host"] if h["thread"] == "engine loop"]
    assert loop and loop[0]["ops"] > 0 and 0 < loop[0]["op_s"] <= engine["wall_s"]
    assert summary["gpu"]["items"] == 0 and summary["threads"] == []  # a CPU engine launches no GPU work
    late = post(server, "/stop_profile")
    assert late.status_code == 409 and "no profile is running" in late.json()["error"]["message"]
    assert speak(server, reference_wav, 9).status_code == 200  # the engine serves on after its window

