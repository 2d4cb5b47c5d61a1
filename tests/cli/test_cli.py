"""The CLI as a user runs it: real subprocesses, real files."""

import json
import os
import subprocess
import sys
import time
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf


def intone(*args, env_cache, timeout=120):
    env = {**os.environ, "INTONE_CACHE": str(env_cache)}
    return subprocess.run([sys.executable, "-m", "intone.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def timed(run):
    """A job's result and the seconds it took (its process start-up included)."""
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def with_reference(tmp_path, env_cache):
    ref = tmp_path / "ref.wav"
    sf.write(ref, 0.2 * np.sin(np.linspace(0, 2000, 24000)), 24000)
    return intone("speak", "Clone me", "-o", str(tmp_path / "o.wav"), "--ref-audio", str(ref),
                  "--ref-text", "A reference.", "--seed", "2", "--max-new-tokens", "20", env_cache=env_cache)


def beside_jobs(selected: set[str], tmp_path_factory, cache) -> dict:
    """The module's `intone` runs (of the tests selected), each its own process: name -> (job, directory).
    tests/conftest.py's `beside` runs them, from the session's start, beside the tests before these (a
    start-up is mostly imports on one core)."""
    jobs = {}

    def job(name, test, make):
        if test in selected:
            d = tmp_path_factory.mktemp(name)
            jobs[name] = (partial(make, d), d)

    job("quick", "test_speak_writes_a_valid_wav_quickly", lambda d: timed(partial(
        intone, "speak", "--model", "tiny:fish-s2", "Hello world", "-o", str(d / "o.wav"), "--seed", "12",
        env_cache=cache)))
    for name in ("same_a", "same_b"):  # two processes, one after the other or side by side
        job(name, "test_speak_is_reproducible_with_a_seed", lambda d: intone(
            "speak", "Same seed", "-o", str(d / "o.wav"), "--seed", "4", "--max-new-tokens", "30", env_cache=cache))
    job("reference", "test_speak_with_a_reference_voice", lambda d: with_reference(d, cache))
    job("errors", "test_speak_errors_are_clear", lambda d: speak_errors_in_one_process(d, cache))
    job("make_tiny", "test_make_tiny_writes_the_layout", lambda d: intone(
        "make-tiny", "fish-s2", str(d / "t"), "--seed", "3", env_cache=cache))
    return jobs


@pytest.fixture
def cli_runs(beside):
    """name -> (the run's result, its directory); each test waits for its own."""
    return partial(beside, __name__)


def test_speak_writes_a_valid_wav_quickly(cli_runs):
    # Seed 12 ends by itself (EOS) after ~48 frames; seed 1 happened to talk for ~420 of the 2048 allowed.
    (r, elapsed), tmp_path = cli_runs("quick")
    assert r.returncode == 0, r.stderr
    audio, rate = sf.read(tmp_path / "o.wav")
    assert rate == 44100
    assert len(audio) > 0 and len(audio) % 2048 == 0
    assert np.sqrt(np.mean(audio**2)) > 0.01  # not silent
    assert elapsed < 60


def test_speak_is_reproducible_with_a_seed(cli_runs):
    outs = []
    for name in ("same_a", "same_b"):
        r, tmp_path = cli_runs(name)
        assert r.returncode == 0, r.stderr
        outs.append(sf.read(tmp_path / "o.wav")[0])
    assert np.array_equal(*outs)
    assert len(outs[0]) <= 30 * 2048


def test_speak_with_a_reference_voice(cli_runs):
    r, _ = cli_runs("reference")
    assert r.returncode == 0, r.stderr


def test_make_tiny_writes_the_layout(cli_runs):
    r, tmp_path = cli_runs("make_tiny")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "t" / "config.json").read_text())["model_type"] == "fish_qwen3_omni"


ERROR_CASES = [
    ("missing_model", "model directory not found"),
    ("malformed_model", "config.json: not valid JSON"),
    ("unreadable_ref", "no such file"),
    ("empty_ref", "not a readable audio file"),
    ("silent_zero_length_ref", "audio is empty"),
    ("non_audio_ref", "not a readable audio file"),
    ("ref_without_text", "--ref-text"),
    ("text_without_ref", "--ref-audio"),
    ("empty_text", "must not be empty"),
]


def error_case_args(case, tmp_path) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    args = ["speak", "Hello", "-o", str(tmp_path / "o.wav")]
    if case == "missing_model":
        args += ["--model", str(tmp_path / "nope")]
    elif case == "malformed_model":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text("{")
        args += ["--model", str(tmp_path / "m")]
    elif case == "unreadable_ref":
        args += ["--ref-audio", str(tmp_path / "missing.wav"), "--ref-text", "x"]
    elif case == "empty_ref":
        (tmp_path / "e.wav").write_bytes(b"")
        args += ["--ref-audio", str(tmp_path / "e.wav"), "--ref-text", "x"]
    elif case == "silent_zero_length_ref":
        sf.write(tmp_path / "z.wav", np.zeros(0), 16000)
        args += ["--ref-audio", str(tmp_path / "z.wav"), "--ref-text", "x"]
    elif case == "non_audio_ref":
        (tmp_path / "n.wav").write_text("this is text, not audio")
        args += ["--ref-audio", str(tmp_path / "n.wav"), "--ref-text", "x"]
    elif case == "ref_without_text":
        sf.write(tmp_path / "r.wav", np.zeros(4000), 16000)
        args += ["--ref-audio", str(tmp_path / "r.wav")]
    elif case == "text_without_ref":
        args += ["--ref-text", "orphan transcript"]
    elif case == "empty_text":
        args[1] = " "
    return args


# Each case as `python -m intone.cli.main ARGS` runs it (`sys.exit(main())`: its exit status, an uncaught
# exception's traceback), its stderr (file descriptor 2, whoever writes it) and status apart from the others'.
ONE_PROCESS = """
import json, os, sys, tempfile, traceback
from intone.cli.main import main

def status(e):
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1

out = {}
for case, argv in json.loads(sys.argv[1]).items():
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err:
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            try:
                code = main(argv)
            except SystemExit as e:
                code = status(e)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        out[case] = {"returncode": code, "stderr": err.read()}
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
"""


def speak_errors_in_one_process(tmp_path, env_cache) -> dict:
    """Every error case's `intone speak` (each in its own directory), one after another in one fresh
    process: the cases start no engine, so one interpreter's start-up serves them all."""
    cases = {case: error_case_args(case, tmp_path / case) for case, _ in ERROR_CASES}
    r = subprocess.run([sys.executable, "-c", ONE_PROCESS, json.dumps(cases), str(tmp_path / "errors.json")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "INTONE_CACHE": str(env_cache)})
    assert r.returncode == 0, r.stderr
    return {case: SimpleNamespace(**run) for case, run in json.loads((tmp_path / "errors.json").read_text()).items()}


@pytest.mark.parametrize("case, message", ERROR_CASES)
def test_speak_errors_are_clear(cli_runs, case, message):
    r = cli_runs("errors")[0][case]
    assert r.returncode != 0
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_set_overrides_profile_values_and_refuses_unknown_keys():
    import argparse

    from intone.cli.serve import profile_override
    from intone.engine.config import ProfileError, load_profile

    pairs = dict(profile_override(a) for a in ("codec.process=true", "ar.max_num_seqs=8", "device=cpu"))
    assert pairs == {"codec.process": True, "ar.max_num_seqs": 8, "device": "cpu"}
    profile = load_profile("fish-s2-high-concurrency", **pairs)
    assert profile.codec.process is True and profile.ar.max_num_seqs == 8
    with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
        profile_override("codec.process")
    with pytest.raises(ProfileError, match="bogus"):
        load_profile("fish-s2-high-concurrency", **{"codec.bogus": 1})
