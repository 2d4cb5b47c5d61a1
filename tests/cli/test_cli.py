"""The CLI as a user runs it: real subprocesses, real files."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import soundfile as sf

from tests.procs import run_all


def intone(*args, env_cache, timeout=120):
    env = {**os.environ, "INTONE_CACHE": str(env_cache)}
    return subprocess.run([sys.executable, "-m", "intone.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def intones(*commands, env_cache, timeout=120) -> list[subprocess.CompletedProcess]:
    """Several independent `intone` runs side by side (each its own process), in the order given."""
    env = {**os.environ, "INTONE_CACHE": str(env_cache)}
    return run_all([[sys.executable, "-m", "intone.cli.main", *args] for args in commands], timeout=timeout, env=env)


def test_speak_writes_a_valid_wav_quickly(tiny_cache, tiny_fish_dir, tmp_path):
    out = tmp_path / "o.wav"
    start = time.perf_counter()
    # Seed 12 ends by itself (EOS) after ~48 frames; seed 1 happened to talk for ~420 of the 2048 allowed.
    r = intone("speak", "--model", "tiny:fish-s2", "Hello world", "-o", str(out), "--seed", "12", env_cache=tiny_cache)
    elapsed = time.perf_counter() - start
    assert r.returncode == 0, r.stderr
    audio, rate = sf.read(out)
    assert rate == 44100
    assert len(audio) > 0 and len(audio) % 2048 == 0
    assert np.sqrt(np.mean(audio**2)) > 0.01  # not silent
    assert elapsed < 60


def test_speak_is_reproducible_with_a_seed(tiny_cache, tiny_fish_dir, tmp_path):
    outs = []
    runs = intones(*[("speak", "Same seed", "-o", str(tmp_path / name), "--seed", "4", "--max-new-tokens", "30")
                     for name in ("a.wav", "b.wav")], env_cache=tiny_cache)
    for name, r in zip(("a.wav", "b.wav"), runs):
        assert r.returncode == 0, r.stderr
        outs.append(sf.read(tmp_path / name)[0])
    assert np.array_equal(*outs)
    assert len(outs[0]) <= 30 * 2048


def test_speak_with_a_reference_voice(tiny_cache, tiny_fish_dir, tmp_path):
    ref = tmp_path / "ref.wav"
    sf.write(ref, 0.2 * np.sin(np.linspace(0, 2000, 24000)), 24000)
    r = intone("speak", "Clone me", "-o", str(tmp_path / "o.wav"), "--ref-audio", str(ref),
               "--ref-text", "A reference.", "--seed", "2", "--max-new-tokens", "20", env_cache=tiny_cache)
    assert r.returncode == 0, r.stderr


def test_make_tiny_writes_the_layout(tiny_cache, tmp_path):
    r = intone("make-tiny", "fish-s2", str(tmp_path / "t"), "--seed", "3", env_cache=tiny_cache)
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


@pytest.fixture(scope="module")
def speak_errors(tiny_cache, tiny_fish_dir, tmp_path_factory) -> dict:
    """Every error case's `intone speak` (a fresh process each, in its own directory), run side by side."""
    cases = [case for case, _ in ERROR_CASES]
    runs = intones(*[error_case_args(case, tmp_path_factory.mktemp(case)) for case in cases], env_cache=tiny_cache)
    return dict(zip(cases, runs))


@pytest.mark.parametrize("case, message", ERROR_CASES)
def test_speak_errors_are_clear(speak_errors, case, message):
    r = speak_errors[case]
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
