"""The speech API over real HTTP against a real server process on the tiny model."""

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.api.conftest import crowd_then_alone, metric

BODY = {"input": "Hello world", "seed": 3, "max_new_tokens": 30}


def speech(server, **fields):
    return httpx.post(server.url("/v1/audio/speech"), json={**BODY, **fields}, timeout=120)


def test_health_and_models(server):
    health = httpx.get(server.url("/health")).json()
    assert health["status"] == "ok"
    assert [(e["engine"], e["status"], e["error"]) for e in health["engines"]] == [(0, "ok", None)]
    models = httpx.get(server.url("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny:fish-s2" and models["data"][0]["sample_rate"] == 44100


def test_wav_is_plain_with_usage_headers(server):
    r = speech(server)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    body = r.content
    assert body[:4] == b"RIFF" and body[36:40] == b"data"  # the plain 44-byte header
    samples = (len(body) - 44) // 2
    assert samples % 2048 == 0 and samples // 2048 == int(r.headers["x-completion-tokens"])
    assert int(r.headers["x-prompt-tokens"]) > 0 and float(r.headers["x-engine-time"]) > 0
    assert len(r.headers["x-request-id"]) == 32 and r.headers["x-request-id"] != speech(server).headers["x-request-id"]


@pytest.mark.parametrize("fmt, kind", [("flac", "FLAC"), ("mp3", "MP3"), ("opus", "OGG")])
def test_compressed_formats_decode(server, fmt, kind):
    r = speech(server, response_format=fmt)
    assert r.status_code == 200
    info = sf.info(io.BytesIO(r.content))
    assert info.format == kind and info.duration > 0.1


def test_pcm_is_the_wav_payload(server):
    wav, pcm = speech(server).content, speech(server, response_format="pcm").content
    assert r_pcm_ok(pcm) and pcm == wav[44:]


def r_pcm_ok(pcm: bytes) -> bool:
    return len(pcm) > 0 and len(pcm) % (2 * 2048) == 0


def close_to(streamed: bytes, whole: bytes, min_snr_db: float = 30.0) -> bool:
    """The same frames: equal length and, sample for sample, within min_snr_db of the whole file.

    A whole file is the one-pass decode; a stream's chunks re-decode 25 frames of left context
    (the reference framework's method), which approximates it (41 dB on the tiny codec) until the
    codec carries its state across chunks.
    """
    a, b = (np.frombuffer(x, dtype="<i2").astype(np.float64) for x in (whole, streamed))
    return len(a) == len(b) and 10 * np.log10((a**2).sum() / max(((a - b) ** 2).sum(), 1e-9)) > min_snr_db


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_raw_stream_carries_the_whole_files_frames(server, fmt):
    whole = speech(server, response_format=fmt).content
    with httpx.stream("POST", server.url("/v1/audio/speech"), timeout=120,
                      json={**BODY, "response_format": fmt, "stream": True, "stream_format": "audio"}) as r:
        assert r.status_code == 200
        streamed = b"".join(r.iter_bytes())
    if fmt == "wav":  # the streaming header says 'unknown length'
        assert streamed[:4] == b"RIFF" and close_to(streamed[44:], whole[44:])
    else:
        assert close_to(streamed, whole)


def test_sse_deltas_rebuild_the_audio(server):
    whole = speech(server, response_format="pcm").content
    events = []
    with httpx.stream("POST", server.url("/v1/audio/speech"), timeout=120,
                      json={**BODY, "response_format": "pcm", "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    assert close_to(b"".join(base64.b64decode(e["audio"]) for e in deltas), whole)
    assert events[-1]["usage"]["output_tokens"] == len(whole) // 4096


def test_openai_sdk(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
    extra = {"seed": 3, "max_new_tokens": 30}
    audio = client.audio.speech.create(model="tiny", voice="default", input="Hello world", response_format="wav",
                                       extra_body=extra)
    assert audio.content == speech(server).content
    with client.audio.speech.with_streaming_response.create(
        model="tiny", voice="default", input="Hello world", response_format="pcm",
        extra_body={**extra, "stream": True, "stream_format": "audio"},
    ) as response:
        streamed = b"".join(response.iter_bytes())
    assert close_to(streamed, speech(server, response_format="pcm").content)


def test_voice_upload_use_list_delete(server, reference_wav):
    files = {"audio": ("ref.wav", reference_wav.read_bytes(), "audio/wav")}
    r = httpx.post(server.url("/v1/audio/voices"), data={"name": "alice", "transcript": "A reference."},
                   files=files, timeout=60)
    assert r.status_code == 201, r.text
    assert r.json()["frames"] == -(-44100 * 2 // 2048)
    names = [v["name"] for v in httpx.get(server.url("/v1/audio/voices")).json()["data"]]
    assert "alice" in names
    by_voice = speech(server, voice="alice")
    assert by_voice.status_code == 200
    by_ref = speech(server, ref_audio=str(reference_wav), ref_text="A reference.")
    assert by_voice.content == by_ref.content  # stored codes == a fresh encode of the same audio
    again = httpx.post(server.url("/v1/audio/voices"), data={"name": "alice", "transcript": "x"}, files=files)
    assert again.status_code == 409
    assert httpx.delete(server.url("/v1/audio/voices/alice")).status_code == 200
    assert httpx.delete(server.url("/v1/audio/voices/alice")).status_code == 404
    gone = speech(server, voice="alice")
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "voice"


def test_reference_forms(server, reference_wav):
    data_url = "data:audio/wav;base64," + base64.b64encode(reference_wav.read_bytes()).decode()
    a = speech(server, ref_audio=data_url, ref_text="A reference.")
    b = speech(server, ref_audio="file://" + str(reference_wav), ref_text="A reference.")
    c = speech(server, references=[{"audio_path": str(reference_wav), "text": "A reference."}])
    assert a.status_code == b.status_code == c.status_code == 200
    assert a.content == b.content == c.content
    assert a.content != speech(server).content  # the reference is in the prompt, however it was sent


def test_metrics_are_exposed(server):
    speech(server)
    text = httpx.get(server.url("/metrics")).text
    for name in ("intone_requests_running", "intone_requests_waiting", "intone_time_to_first_audio_seconds",
                 "intone_request_rtf", "intone_audio_seconds_total", "intone_frames_total",
                 "intone_requests_total", "intone_kv_cache_usage_ratio"):
        assert name in text
    assert 'intone_requests_total{outcome="length"}' in text


def test_concurrent_voices_get_their_audio_alone_through_the_static_step(server):
    """The GPU's step path (its graphs aside) under a crowd of requests, each with its own reference clip."""
    crowd_then_alone(server, 8, tokens=30)
    text = httpx.get(server.url("/metrics")).text
    assert metric(text, "intone_static_steps") > 0 and metric(text, "intone_graph_replays") == 0


def test_bad_reference_audio_still_names_the_field(server, reference_wav):
    """Reference decoding runs off the event loop; its errors are the same 400s."""
    cases = [({"ref_audio": "data:audio/wav;base64,@@@", "ref_text": "t"}, "ref_audio"),
             ({"ref_audio": "data:audio/wav;base64," + base64.b64encode(b"not audio").decode(), "ref_text": "t"},
              "ref_audio"),
             ({"references": [{"audio": "data:audio/wav;base64,AAAA", "text": "t"}]}, "references.0.audio"),
             ({"references": [{"audio_path": str(reference_wav) + ".missing", "text": "t"}]}, "references.0.audio_path")]
    for fields, param in cases:
        r = speech(server, **fields)
        assert r.status_code == 400, (fields, r.text)
        assert r.json()["error"]["param"] == param
    assert speech(server, response_format="mp3").status_code == 200  # and the server still answers
