"""The engine in its own process, through the async client: streams, cancels, death."""

import asyncio
import json
import os
import signal
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import soundfile as sf

from intone.engine.client import Engine, EngineDead
from intone.engine.trace import audit_file
from intone.protocol import SamplingParams, SynthesisRequest


def run(coro):
    return asyncio.run(coro)


def test_streams_and_cancels_leave_nothing_behind(tiny_cache, tiny_fish_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"

    async def main():
        engine = await Engine.from_profile("fish-s2-high-concurrency", model="tiny:fish-s2", trace_frames=str(trace),
                                           device="cpu", **{"ar.max_num_seqs": 4})
        assert engine.sample_rate == 44100 and engine.info["capacity"] == 4

        async def one(i):
            chunks = []
            req = SynthesisRequest(f"q{i}", "Hello there", params=SamplingParams(seed=i, max_new_tokens=40))
            async for c in engine.generate(req):
                chunks.append(c)
                if i % 3 == 0 and len(chunks) == 1:
                    break  # the client goes away mid-stream
            return chunks

        try:
            results = await asyncio.gather(*(one(i) for i in range(9)))
            for _ in range(50):  # aborts travel asynchronously
                stats = await engine.stats()
                if stats["live_requests"] == 0:
                    break
                await asyncio.sleep(0.05)
        finally:
            await engine.shutdown()
        return results, stats

    results, stats = run(main())
    assert stats["live_requests"] == stats["kv_tables"] == stats["planner_requests"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    cancelled = sum(1 for i, chunks in enumerate(results) if i % 3 == 0 and not chunks[0].finished)
    assert cancelled >= 1 and stats["finished"].get("abort", 0) == cancelled
    for i, chunks in enumerate(results):
        if i % 3:
            assert chunks[-1].finished and sum(c.finished for c in chunks) == 1
            audio = np.concatenate([c.audio for c in chunks])
            assert len(audio) == chunks[-1].end_frame * 2048
    assert all(a.exact for a in audit_file(trace).values())


def test_engine_death_is_reported(tiny_cache, tiny_fish_dir):
    async def main():
        engine = await Engine.from_profile(None, model="tiny:fish-s2", device="cpu")
        try:
            os.kill(engine._process.pid, signal.SIGKILL)
            with pytest.raises(EngineDead):
                async for _ in engine.generate(SynthesisRequest("x", "Hello", params=SamplingParams(seed=1))):
                    pass
            assert engine.dead
        finally:
            await engine.shutdown()

    run(main())


def test_bad_model_fails_to_start_clearly(tiny_cache, tmp_path):
    async def main():
        with pytest.raises(EngineDead, match="model directory not found"):
            await Engine.from_profile(None, model=str(tmp_path / "missing"), device="cpu")

    run(main())


def cli(*args, cache):
    return subprocess.run([sys.executable, "-m", "intone.cli.main", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "INTONE_CACHE": str(cache)})


BAD_TRACE = [
    dict(request_id="gap", start=0, end=4, context=0, finished=False),
    dict(request_id="gap", start=29, end=40, context=25, finished=True),
    dict(request_id="replay", start=0, end=29, context=0, finished=False),
    dict(request_id="replay", start=4, end=54, context=0, finished=True),
    dict(request_id="twice", start=0, end=3, context=0, finished=True),
    dict(request_id="twice", start=3, end=3, context=0, finished=True),
    dict(request_id="fine", start=0, end=3, context=0, finished=True),
]


def speak_stream_then_audit(tmp_path, cache):
    out, trace = tmp_path / "s.wav", tmp_path / "t.jsonl"
    r = cli("speak", "Hello world", "-o", str(out), "--seed", "3", "--stream", "--max-new-tokens", "60",
            "--trace-frames", str(trace), "--device", "cpu", cache=cache)
    return r, (cli("audit-frames", str(trace), cache=cache) if r.returncode == 0 else None), out, trace


def audit_bad_trace(tmp_path, cache):
    trace = tmp_path / "bad.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in BAD_TRACE))
    return cli("audit-frames", str(trace), cache=cache)


def beside_jobs(selected: set[str], tmp_path_factory, cache) -> dict:
    """The module's `intone` CLI runs (of the tests selected): name -> (job, directory). tests/conftest.py's
    `beside` runs them, from the session's start, beside the tests before these (their process start-ups
    are mostly imports on one core)."""
    jobs = {}
    if "test_speak_stream_writes_the_wav_and_a_clean_trace" in selected:
        d = tmp_path_factory.mktemp("speak-stream")
        jobs["speak_stream"] = (partial(speak_stream_then_audit, d, cache), d)
    if "test_audit_flags_gaps_repeats_and_missing_terminals" in selected:
        d = tmp_path_factory.mktemp("audit-bad")
        jobs["audit_bad"] = (partial(audit_bad_trace, d, cache), d)
    return jobs


@pytest.fixture
def cli_runs(beside):
    """name -> the run's result; each CLI test waits for its own."""
    return lambda name: beside(__name__, name)[0]


def test_speak_stream_writes_the_wav_and_a_clean_trace(cli_runs):
    r, audit, out, trace = cli_runs("speak_stream")
    assert r.returncode == 0, r.stderr
    audio, rate = sf.read(out)
    assert rate == 44100 and len(audio) % 2048 == 0 and len(audio) > 0
    assert audit.returncode == 0 and "1 exact, 0 not exact" in audit.stdout
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert rows[-1]["finished"] and rows[-1]["end"] * 2048 == len(audio)


def test_audit_flags_gaps_repeats_and_missing_terminals(cli_runs):
    r = cli_runs("audit_bad")
    assert r.returncode == 1
    assert "gap: 40 frames, missing 25" in r.stdout
    assert "replay: 54 frames, missing 0, repeated 25" in r.stdout
    assert "twice: 3 frames, missing 0, repeated 0, out of order 0, terminals 2" in r.stdout
    assert "1 exact, 3 not exact" in r.stdout
