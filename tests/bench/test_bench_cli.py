"""`intone bench` end to end on the tiny model (its own server), and the A/B/B/A protocol."""

import json
import sys
from functools import partial

import pytest


def bench_args(name: str, tmp_path) -> list[str]:
    """Each test's `intone bench` command line: its own server(s), its own output directory."""
    if name == "sweep":
        return ["--model", "tiny:fish-s2", "--device", "cpu", "--dataset", "synthetic", "--num-requests", "6",
                "--concurrency", "1,3", "--stream", "--warmup", "1", "--max-new-tokens", "24",
                "--output-dir", str(tmp_path / "out"), "--save-audio", str(tmp_path / "wavs")]
    if name == "forced":
        return ["--model", "tiny:fish-s2", "--device", "cpu", "--num-requests", "3", "--concurrency", "3",
                "--force-output-frames", "7", "--warmup", "0", "--output-dir", str(tmp_path / "out"),
                "--profile-seconds", "60", "--profile-delay", "0"]
    arm = "--model tiny:fish-s2 --device cpu"
    return ["abba", "--a", arm, "--b", arm + " --profile fish-s2-default", "--num-requests", "2",
            "--concurrency", "2", "--warmup", "0", "--max-new-tokens", "8", "--output-dir", str(tmp_path / "abba")]


TESTS = {"abba": "test_abba", "sweep": "test_sweep_writes_results_report_and_plots",
         "forced": "test_forced_lengths_and_failures_are_counted"}


def beside_jobs(selected: set[str], tmp_path_factory, cache) -> dict:
    """The module's three independent `intone bench` runs (of the tests selected): name -> (command, directory).
    tests/conftest.py's `beside` runs them, from the session's start, beside the tests before these."""
    dirs = {name: tmp_path_factory.mktemp(name) for name, test in TESTS.items() if test in selected}
    return {name: ([sys.executable, "-m", "intone.cli.main", "bench", *bench_args(name, d)], d)
            for name, d in dirs.items()}


@pytest.fixture
def benches(beside):
    """name -> (the run's result, its directory); each test waits for its own."""
    return partial(beside, __name__)


def test_sweep_writes_results_report_and_plots(benches):
    r, tmp_path = benches("sweep")
    out = tmp_path / "out"
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((out / "results.json").read_text())
    assert [lvl["concurrency"] for lvl in results["levels"]] == [1, 3]
    for lvl in results["levels"]:
        assert lvl["summary"]["completed"] == 6 and len(lvl["records"]) == 6
        assert lvl["summary"]["first_audio_s"]["mean"] > 0
        assert all(r["audio_s"] > 0 and r["first_audio_s"] <= r["completion_s"] for r in lvl["records"])
    assert results["sample_rate"] == 44100
    report = (out / "report.md").read_text()
    assert "| WER % | SIM | mean audio s | req/s | audio-s/s | mean completion s | mean first audio s |" in report
    assert "| 1 | — | — |" in report
    for lvl in results["levels"]:  # a frame per request a step (not its stop token's): at most C seats filled
        k = lvl["server"]["counters"]
        rows = k["engine_frames"] / k["engine_steps"]
        assert 0.9 < rows <= 1.0 if lvl["concurrency"] == 1 else 1.2 < rows <= 3.0, (lvl["concurrency"], rows)
    assert "| rows per step |" in report
    # C1's first request alone is its opening burst; C3's 6 requests are too few to tell a burst from the rest
    assert results["levels"][0]["burst"]["burst"]["requests"] == 1 and results["levels"][1]["burst"] is None
    assert "- C1: the opening burst (1 sent at once) first audio mean" in report and "- C3: the opening" not in report
    for lvl in results["levels"]:  # every stream that stalled is counted at the chunk it first waited for
        s = lvl["summary"]
        assert sum(s["first_stall_chunk"].values()) == s["streams_with_underrun"]
        assert (f"- C{lvl['concurrency']}: streams first stalled at chunk" in report) == (s["streams_with_underrun"] > 0)
    for plot in ("completion_cdf.png", "first_audio_cdf.png", "throughput.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"
    assert len(list((tmp_path / "wavs" / "c3").glob("*.wav"))) == 6
    # Every request the server answered (2 levels x (1 warm-up + 6)) was traced and audited exact, and
    # the engine's per-request tables were empty once the load was gone.
    after = results["after_run"]
    assert after["audit"] == {"requests": 14, "not_exact": []} and after["tables_empty"] and after["clean"]
    assert after["engine_tables"]["engine_kv_tables"] == 0 and after["engine_tables"]["engine_live_requests"] == 0
    assert "After the run: clean: frame audit of 14 requests: every one exact" in report
    for lvl in results["levels"]:  # each measured request found in the trace by the id its reply carried
        tail, firsts = lvl["tail"], sorted(r["first_audio_s"] for r in lvl["records"])
        assert tail["joined"] == 6 and tail["groups"]["slowest"]["requests"] == 1
        assert tail["groups"]["slowest"]["metric_mean"] == firsts[-1]
        assert tail["groups"]["slowest"]["stages"]["total"] > 0
        # the server's trace and the client share a clock (one host): the time outside the engine is there,
        # positive and within the request's own time
        for g in tail["groups"].values():
            assert 0 < g["outside"]["to_api"] < g["outside"]["to_engine"] and 0 < g["outside"]["to_client"]
            assert g["outside"]["to_engine"] + g["outside"]["to_client"] < g["metric_mean"]
        assert f"C{lvl['concurrency']}, the slowest 10% by first audio against the rest (6 requests" in report
    # C1's opening burst (its first request) against the 5 after it, stage by stage; C3's 6 are too few
    burst, none = results["levels"][0]["burst_stages"], results["levels"][1].get("burst_stages")
    assert none is None and burst["groups"]["burst"]["requests"] == 1 and burst["groups"]["after it"]["requests"] == 5
    first_sent = min(results["levels"][0]["records"], key=lambda r: r["sent_at"])
    assert burst["groups"]["burst"]["metric_mean"] == first_sent["first_audio_s"]
    assert "C1, the opening burst (the first 1 sent at once) against the requests after it (6 requests" in report


def test_forced_lengths_and_failures_are_counted(benches):
    r, tmp_path = benches("forced")
    out = tmp_path / "out"
    assert r.returncode == 0, r.stdout + r.stderr
    level = json.loads((out / "results.json").read_text())["levels"][0]
    assert all(rec["completion_tokens"] == 7 for rec in level["records"])
    assert len({rec["server_id"] for rec in level["records"]}) == 3  # a whole file's reply names its request too
    assert level["summary"]["mean_audio_s"] == 7 * 2048 / 44100
    # the level ran under a profiler window on the server (its own, given --profile-dir): the window's trace
    # beside the report, its summary in it, and the level's figures marked as diagnostics
    [engine] = level["profile"]["engines"]
    assert engine["trace"].startswith(str(out / "profile" / "engine-0")) and engine["wall_s"] > 0
    assert "engine loop" in [h["thread"] for h in engine["summary"]["host"]]
    report = (out / "report.md").read_text()
    assert "**Profiled: C3 ran under a profiler window" in report and "## GPU timeline, C3" in report
    assert "host engine loop:" in report


def test_abba(benches):
    r, tmp_path = benches("abba")
    out = tmp_path / "abba"
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "abba.json").read_text())
    assert [a["label"] for a in report["arms"]] == list("ABBA")
    assert set(report["pooled"]) == {"A", "B"} and "spread_pct" in report["pooled"]["A"]["2"]["audio_s_per_s"]
    assert "pooled" in (out / "abba.md").read_text()
