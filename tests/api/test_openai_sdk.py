"""The official `openai` SDK against a real server on the tiny Fish model: every response format,
whole and streamed, the SSE and raw dialects per request, and the voice names clients send."""

import base64
import io
import json

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

RATE = 44100
EXTRA = {"seed": 5, "max_new_tokens": 16}
FORMATS = ["wav", "pcm", "flac", "mp3", "opus", "aac"]
CONTENT_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
                 "opus": "audio/ogg", "aac": "audio/aac"}


VOICES = ("house", "nova")  # 'nova' is also an OpenAI voice name: the stored voice wins


@pytest.fixture(scope="module")
def sdk_server(server):
    """The session's server (its aliases: 'narrator' names a stored voice, 'ghost' a voice nobody
    stored), with this module's stored voices, removed again afterwards."""
    t = np.arange(24000) / 16000
    ref = 0.3 * np.sin(2 * np.pi * 200 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    buf = io.BytesIO()
    sf.write(buf, ref, 16000, format="WAV")
    try:
        for name in VOICES:
            r = httpx.post(server.url("/v1/audio/voices"), data={"name": name, "transcript": "A reference."},
                           files={"audio": ("ref.wav", buf.getvalue(), "audio/wav")}, timeout=60)
            assert r.status_code == 201, r.text
        yield server
    finally:
        for name in VOICES:  # the session's server is shared: leave no voice behind
            httpx.delete(server.url(f"/v1/audio/voices/{name}"))


@pytest.fixture(scope="module")
def client(sdk_server):
    return openai.OpenAI(base_url=sdk_server.url("/v1"), api_key="unused", max_retries=0)


def create(client, **kw):
    kw = {"model": "tiny", "voice": "alloy", "input": "Hello world", "extra_body": EXTRA, **kw}
    return client.audio.speech.create(**kw)


def seconds(data: bytes, fmt: str, pcm_rate: int = RATE) -> tuple[float, int]:
    """Decoded duration and sample rate of a response body."""
    if fmt == "pcm":
        return len(data) / 2 / pcm_rate, pcm_rate
    with av.open(io.BytesIO(data)) as f:
        stream = f.streams.audio[0]
        samples = sum(frame.samples for frame in f.decode(stream))
        return samples / stream.rate, stream.rate


def sse_events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def expected_rate(fmt: str) -> int:
    return 48000 if fmt == "opus" else RATE


@pytest.fixture(scope="module")
def reference_seconds(client):
    """The duration every format must carry (same seed, same frames): the WAV's."""
    return seconds(create(client, response_format="wav").content, "wav")[0]


# mp3 and aac add encoder priming and padding (a frame or two); the frames themselves are all there.
def close_to(got: float, want: float) -> bool:
    return want > 0.1 and abs(got - want) < 0.06


@pytest.mark.parametrize("fmt", FORMATS)
def test_create_every_format(client, reference_seconds, fmt):
    audio = create(client, response_format=fmt)
    assert audio.response.headers["content-type"] == CONTENT_TYPES[fmt]
    duration, rate = seconds(audio.content, fmt)
    assert rate == expected_rate(fmt) and close_to(duration, reference_seconds)


@pytest.mark.parametrize("fmt", FORMATS)
def test_streaming_response_raw_audio_every_format(client, reference_seconds, fmt):
    with client.audio.speech.with_streaming_response.create(
            model="tiny", voice="alloy", input="Hello world", response_format=fmt, stream_format="audio",
            extra_body={**EXTRA, "initial_codec_chunk_frames": 4}) as response:
        assert response.headers["content-type"] == CONTENT_TYPES[fmt]
        body = b"".join(response.iter_bytes())
    duration, rate = seconds(body, fmt)
    assert rate == expected_rate(fmt) and close_to(duration, reference_seconds)


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "opus", "aac"])
def test_sse_without_stream_flag(client, reference_seconds, fmt):
    """The SDK sends stream_format='sse' and no `stream`; the deltas concatenate to a playable file."""
    with client.audio.speech.with_streaming_response.create(
            model="tiny", voice="alloy", input="Hello world", response_format=fmt, stream_format="sse",
            extra_body={**EXTRA, "initial_codec_chunk_frames": 4}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["output_tokens"] == EXTRA["max_new_tokens"]
    duration, rate = seconds(b"".join(base64.b64decode(e["audio"]) for e in deltas), fmt)
    assert rate == expected_rate(fmt) and close_to(duration, reference_seconds)


def test_raw_pcm_says_what_it_is(client, sdk_server):
    whole = create(client, response_format="pcm").response.headers
    with httpx.stream("POST", sdk_server.url("/v1/audio/speech"), timeout=60, json={
            "input": "Hello world", "response_format": "pcm", "stream_format": "audio", **EXTRA}) as r:
        streamed = r.headers
    for headers in (whole, streamed):
        assert (headers["x-sample-rate"], headers["x-channels"], headers["x-bit-depth"]) == (str(RATE), "1", "16")


def test_bare_stream_true_is_openai_sse_by_default(sdk_server):
    with httpx.stream("POST", sdk_server.url("/v1/audio/speech"), timeout=60, json={
            "input": "Hello world", "response_format": "mp3", "stream": True, **EXTRA}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"


def pcm(client, voice) -> bytes:
    return create(client, voice=voice, response_format="pcm").content


def test_voice_names(client):
    default = pcm(client, "default")
    for preset in ("alloy", "Echo", "cedar", "vivian"):  # OpenAI's built-ins and vLLM-Omni's default
        assert pcm(client, preset) == default
    stored = pcm(client, "house")
    assert stored != default
    assert pcm(client, {"id": "house"}) == stored  # the SDK's custom-voice object
    assert pcm(client, "narrator") == stored  # --voice-alias narrator=house
    assert pcm(client, "nova") == stored  # a stored voice shadows the preset name


@pytest.mark.parametrize("voice, words", [("nobody", "unknown voice 'nobody'"), ("ghost", "alias of 'nobody'")])
def test_unknown_voice_is_a_400_naming_voice(client, voice, words):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, voice=voice)
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == "voice"
    assert "voice" in error["message"] and words in error["message"]


@pytest.mark.parametrize("fields, dialect, kind", [
    ({"stream": True}, "openai", "sse"),
    ({"stream": True}, "sglang", "sglang"),
    ({"stream": True}, "audio", "audio"),  # what older vLLM-Omni `--stream` clients expect
    ({"stream": True, "stream_format": "sse"}, "sglang", "sse"),
    ({"stream": True, "stream_format": "audio"}, "openai", "audio"),
    ({"stream_format": "sse"}, "sglang", "sse"),
    ({"stream_format": "audio"}, "sglang", "audio"),
    ({}, "audio", "file"),
])
def test_dialects_per_request(fields, dialect, kind):
    from intone.api.schema import SpeechRequest
    from intone.api.speech import answer_kind
    assert answer_kind(SpeechRequest(input="x", **fields), dialect) == kind
