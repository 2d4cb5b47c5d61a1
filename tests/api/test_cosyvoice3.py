"""The speech API serving CosyVoice3 (tiny), over real HTTP."""

import io

import httpx
import numpy as np
import pytest
import soundfile as sf

from .conftest import start_server, stop_server


@pytest.fixture(scope="module")
def cosy_server(tiny_cache, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("cosy-server"), tiny_cache, "--model", "tiny:cosyvoice3")
    t = np.arange(40000) / 16000
    sf.write(s.media / "ref.wav", 0.3 * np.sin(2 * np.pi * 150 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)), 16000)
    yield s
    stop_server(s)


def speech(server, **body):
    base = dict(input="Hello from the tiny voice.", ref_audio=str(server.media / "ref.wav"),
                ref_text="A short reference sentence.", seed=11, max_new_tokens=70)
    return httpx.post(server.url("/v1/audio/speech"), json={**base, **body}, timeout=120)


def test_streamed_and_whole_audio_are_the_same_24khz_samples(cosy_server):
    whole = speech(cosy_server, response_format="wav")
    assert whole.status_code == 200, whole.text
    audio, rate = sf.read(io.BytesIO(whole.content), dtype="int16")
    assert rate == 24000 and len(audio) > 0 and len(audio) % 960 == 0
    with httpx.stream("POST", cosy_server.url("/v1/audio/speech"), timeout=120, json=dict(
            input="Hello from the tiny voice.", ref_audio=str(cosy_server.media / "ref.wav"),
            ref_text="A short reference sentence.", seed=11, max_new_tokens=70, stream=True,
            stream_format="audio", response_format="pcm")) as r:
        assert r.status_code == 200
        streamed = np.frombuffer(b"".join(r.iter_bytes()), dtype="<i2")
    assert np.array_equal(streamed, audio)


def test_a_request_without_a_reference_is_a_400_naming_ref_audio(cosy_server):
    r = httpx.post(cosy_server.url("/v1/audio/speech"), json=dict(input="No voice given."), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ref_audio"
    assert speech(cosy_server).status_code == 200  # the engine is fine


def test_a_stored_voice_sounds_like_its_reference(cosy_server):
    with open(cosy_server.media / "ref.wav", "rb") as f:
        up = httpx.post(cosy_server.url("/v1/audio/voices"), timeout=60,
                        data=dict(name="tiny-voice", transcript="A short reference sentence."),
                        files=dict(audio=("ref.wav", f, "audio/wav")))
    assert up.status_code == 201, up.text
    by_voice = speech(cosy_server, voice="tiny-voice", ref_audio=None, ref_text=None)
    by_audio = speech(cosy_server)
    assert by_voice.status_code == 200 and by_voice.content == by_audio.content


def test_sampling_modes(cosy_server):
    assert speech(cosy_server, sampling_mode="standard", repetition_penalty=1.21, temperature=0.7).status_code == 200
    bad = speech(cosy_server, sampling_mode="greedy")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_mode"


def test_speed_needs_a_full_response_profile(cosy_server):
    r = speech(cosy_server, speed=1.5)  # this server streams (cosyvoice3-streaming)
    assert r.status_code == 400 and r.json()["error"]["param"] == "speed"


def test_instructions_are_accepted(cosy_server):
    r = speech(cosy_server, instructions="Speak slowly and clearly.")
    assert r.status_code == 200 and len(r.content) > 44
