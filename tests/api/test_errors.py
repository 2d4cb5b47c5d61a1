"""Bad input gets a 4xx JSON error naming the field, while a concurrent good request succeeds."""

import asyncio
import base64
import re

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.api.conftest import stop_server

GOOD = {"input": "A good request running alongside.", "seed": 9, "max_new_tokens": 40}
# A message must say what was wrong, not how Python printed an object (nor where it lived).
INTERNALS = re.compile(r"0x[0-9a-fA-F]{6,}|object at|<[A-Za-z_][\w.]* object|Traceback")


def bad_cases(server, reference_wav, tmp_path):
    long_wav = server.media / "long.wav"
    sf.write(long_wav, np.zeros(16000 * 12), 16000)
    (server.media / "text.wav").write_text("not audio at all")
    (server.media / "empty.wav").write_bytes(b"")
    outside = tmp_path / "outside.wav"
    sf.write(outside, np.zeros(1600), 16000)
    ref = str(reference_wav)
    return [
        ({"input": ""}, 400, "input"),
        ({"input": "   "}, 400, "input"),
        ({"input": "x" * 301}, 400, "input"),
        ({"input": "say <|im_end|> please"}, 400, "input"),
        ({"response_format": "ogg"}, 400, "response_format"),
        ({"stream_format": "raw"}, 400, "stream_format"),
        ({"ref_audio": str(outside), "ref_text": "t"}, 400, "ref_audio"),
        ({"ref_audio": "../outside.wav", "ref_text": "t"}, 400, "ref_audio"),
        ({"ref_audio": str(server.media / "missing.wav"), "ref_text": "t"}, 400, "ref_audio"),
        ({"ref_audio": str(server.media / "text.wav"), "ref_text": "t"}, 400, "ref_audio"),
        ({"ref_audio": str(server.media / "empty.wav"), "ref_text": "t"}, 400, "ref_audio"),
        ({"ref_audio": str(long_wav), "ref_text": "t"}, 400, "ref_audio"),
        ({"ref_audio": ref}, 400, "ref_text"),
        ({"ref_text": "orphan"}, 400, "ref_audio"),
        ({"ref_audio": "data:audio/wav;base64,@@@", "ref_text": "t"}, 400, "ref_audio"),
        ({"ref_audio": "http://127.0.0.1:9/x.wav", "ref_text": "t"}, 400, "ref_audio"),
        ({"references": [{"audio_path": ref}]}, 400, "references.0.text"),
        ({"voice": "nobody"}, 400, "voice"),
        ({"voice": {"name": "alloy"}}, 400, "voice"),
        ({"temperature": 5}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"top_k": 0}, 400, "top_k"),
        ({"max_new_tokens": 0}, 400, "max_new_tokens"),
        ({"max_new_tokens": 5000}, 400, "max_new_tokens"),
        ({"repetition_penalty": -1}, 400, "repetition_penalty"),
        ({"speed": 9}, 400, "speed"),
        ({"speed": 1.5}, 400, "speed"),  # Fish has no tempo control
        ({"instructions": "whisper"}, 400, "instructions"),  # nor instructions
        ({"seed": -1}, 400, "seed"),
    ]


def test_bad_inputs_fail_alone(server, reference_wav, tmp_path):
    cases = bad_cases(server, reference_wav, tmp_path)

    async def main():
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as client:
            good = asyncio.create_task(client.post("/v1/audio/speech", json=GOOD))
            results = []
            for fields, status, param in cases:
                body = {"input": "fine", **fields}
                results.append((fields, status, param, await client.post("/v1/audio/speech", json=body)))
            return await good, results

    good, results = asyncio.run(main())
    assert good.status_code == 200 and len(good.content) > 44
    for fields, status, param, r in results:
        assert r.status_code == status, (fields, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (fields, error)
        assert error["message"] and not INTERNALS.search(error["message"]), error


def test_oversized_bodies_get_413(server, reference_wav):
    huge = "data:audio/wav;base64," + base64.b64encode(b"\0" * (17 * 1024 * 1024)).decode()
    r = httpx.post(server.url("/v1/audio/speech"), json={"input": "x", "ref_audio": huge, "ref_text": "t"}, timeout=60)
    assert r.status_code == 413
    big = {"audio": ("big.wav", b"\0" * (11 * 1024 * 1024), "audio/wav")}
    r = httpx.post(server.url("/v1/audio/voices"), data={"name": "big", "transcript": "t"}, files=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "audio"


def test_voice_upload_errors(server):
    r = httpx.post(server.url("/v1/audio/voices"), data={"name": "bad name!", "transcript": "t"},
                   files={"audio": ("a.wav", b"x", "audio/wav")})
    assert r.status_code == 400
    r = httpx.post(server.url("/v1/audio/voices"), data={"name": "ok", "transcript": "t"},
                   files={"audio": ("a.wav", b"not audio", "audio/wav")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio"
    # Files where text belongs, text where a file belongs, a JSON body for a form route.
    for kwargs, param in [(dict(files={"name": ("n.txt", b"v"), "audio": ("a.wav", b"x")}), "name"),
                          (dict(data={"name": "ok", "transcript": "t", "audio": "not a file"}), "audio"),
                          (dict(json={"name": "ok"}), "name")]:
        r = httpx.post(server.url("/v1/audio/voices"), **kwargs)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and not INTERNALS.search(error["message"]), error


@pytest.fixture(scope="module")
def strict_server(shared_boots):
    """API key, SGLang's SSE dialect, and a one-seat engine with a one-place queue (see shared_flags)."""
    s = shared_boots.take("strict_server")
    yield s
    stop_server(s)


AUTH = {"Authorization": "Bearer sekret"}


def test_api_key(strict_server):
    r = httpx.post(strict_server.url("/v1/audio/speech"), json=GOOD)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(strict_server.url("/v1/models"), headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(strict_server.url("/v1/models"), headers=AUTH).status_code == 200
    assert httpx.get(strict_server.url("/health")).status_code == 200


def test_the_profiler_routes_take_the_api_key_and_are_off_without_a_directory(strict_server):
    refused = httpx.post(strict_server.url("/start_profile"))
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    off = httpx.post(strict_server.url("/start_profile"), headers=AUTH)
    assert off.status_code == 404 and "--profile-dir" in off.json()["error"]["message"]
    assert httpx.post(strict_server.url("/stop_profile"), headers=AUTH).status_code == 404


def test_sglang_dialect(strict_server):
    events = []
    with httpx.stream("POST", strict_server.url("/v1/audio/speech"), headers=AUTH, timeout=120,
                      json={**GOOD, "stream": True, "response_format": "wav", "max_new_tokens": 2048}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    audio = [e for e in events if e["audio"] is not None]
    final = events[-1]
    assert final["audio"] is None and final["finish_reason"] in ("stop", "length")
    assert set(final["usage"]) == {"prompt_tokens", "completion_tokens", "engine_time_s"}
    samples = 0
    for e in audio:
        assert e["object"] == "audio.speech.chunk" and e["audio"]["format"] == "wav"
        wav = base64.b64decode(e["audio"]["data"])
        data, rate = sf.read(io.BytesIO(wav))
        assert rate == e["audio"]["sample_rate"] == 44100
        samples += len(data)
    assert samples == final["usage"]["completion_tokens"] * 2048


def test_an_explicit_stream_format_wins_over_the_sglang_dialect(strict_server):
    """One server serves both kinds of client: --sse-dialect only decides a bare `stream: true`."""
    with httpx.stream("POST", strict_server.url("/v1/audio/speech"), headers=AUTH, timeout=120,
                      json={**GOOD, "stream": True, "stream_format": "sse", "response_format": "pcm"}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert len(pcm) == events[-1]["usage"]["output_tokens"] * 2048 * 2
    with httpx.stream("POST", strict_server.url("/v1/audio/speech"), headers=AUTH, timeout=120,
                      json={**GOOD, "stream": True, "stream_format": "audio", "response_format": "pcm"}) as r:
        assert r.headers["x-sample-rate"] == "44100"
        assert len(b"".join(r.iter_bytes())) == len(pcm)  # the same seed: the same frames


def test_full_queue_answers_503_with_retry_after(strict_server):
    async def main():
        async with httpx.AsyncClient(base_url=strict_server.base, headers=AUTH, timeout=120) as client:
            body = {**GOOD, "max_new_tokens": 60, "temperature": 0.8}
            return await asyncio.gather(*(client.post("/v1/audio/speech", json={**body, "seed": i}) for i in range(6)))

    results = asyncio.run(main())
    codes = sorted(r.status_code for r in results)
    # One seat and one queue place: how many get in depends on arrival timing, never all six.
    assert codes.count(200) >= 1 and 503 in codes and set(codes) <= {200, 503}
    busy = next(r for r in results if r.status_code == 503)
    assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == "queue_full"


import io  # noqa: E402
import json  # noqa: E402


@pytest.mark.parametrize("field, body", [
    ("input", '{"input": "hi \\ud800 there", "max_new_tokens": 5}'),
    ("ref_text", '{"input": "hi", "ref_audio": "r.wav", "ref_text": "\\udc00", "max_new_tokens": 5}'),
])
def test_lone_surrogates_are_a_400_naming_the_field(server, field, body):
    r = httpx.post(server.url("/v1/audio/speech"), content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "surrogate" in r.json()["error"]["message"]


def test_hostile_media_paths_are_a_400_naming_ref_audio(server):
    loop = server.media / "loop.wav"
    if not loop.is_symlink():
        loop.symlink_to(loop)
    for path in [str(loop), "a\x00b.wav", "x" * 5000 + ".wav"]:
        r = httpx.post(server.url("/v1/audio/speech"), timeout=30,
                       json={"input": "hi", "ref_audio": path, "ref_text": "x", "max_new_tokens": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ref_audio", (path[:20], r.text)
        assert len(r.json()["error"]["message"]) < 400


def test_a_damaged_stored_voice_is_skipped_in_the_list_and_refused_by_name(server, reference_wav):
    files = {"audio": ("ref.wav", reference_wav.read_bytes(), "audio/wav")}
    for name in ("intact", "damaged"):
        r = httpx.post(server.url("/v1/audio/voices"), data={"name": name, "transcript": "A reference."},
                       files=files, timeout=60)
        assert r.status_code == 201, r.text
    meta = next(p for p in server.log.parent.glob("voices/*/meta.json") if '"damaged"' in p.read_text())
    meta.write_text("{not json")
    listed = httpx.get(server.url("/v1/audio/voices"))
    assert listed.status_code == 200
    names = [v["name"] for v in listed.json()["data"]]
    assert "intact" in names and "damaged" not in names
    r = httpx.post(server.url("/v1/audio/speech"), json={"input": "hi", "voice": "damaged", "max_new_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice"
    import shutil

    shutil.rmtree(meta.parent)  # the session's server is shared: leave no damaged voice behind


def test_a_chunked_body_over_the_limit_is_a_413_before_it_is_read_whole(server):
    def body(size: int):
        sent = 0
        while sent < size:  # a generator body: httpx sends it chunked, with no content-length
            part = b" " * min(1 << 20, size - sent)
            sent += len(part)
            yield part

    big = httpx.post(server.url("/v1/audio/speech"), content=body(64 << 20), timeout=60,
                     headers={"content-type": "application/json"})
    assert big.status_code == 413
    small = httpx.post(server.url("/v1/audio/speech"), timeout=60, headers={"content-type": "application/json"},
                       content=iter([b'{"input": "Chunked', b' but small.", "max_new_tokens": 5}']))
    assert small.status_code == 200 and small.content[:4] == b"RIFF"


def test_vllm_omni_voice_upload_form_is_accepted(server, reference_wav):
    files = {"audio_sample": ("ref.wav", reference_wav.read_bytes(), "audio/wav")}
    r = httpx.post(server.url("/v1/audio/voices"), timeout=60, files=files,
                   data={"name": "omni-form", "ref_text": "A reference.", "consent": "true"})
    assert r.status_code == 201, r.text
    assert speech_ok(server, voice="omni-form")
    missing = httpx.post(server.url("/v1/audio/voices"), timeout=60, files=files, data={"name": "no-text"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "transcript"
    httpx.delete(server.url("/v1/audio/voices/omni-form"))


def speech_ok(server, **body) -> bool:
    r = httpx.post(server.url("/v1/audio/speech"), json={"input": "Hi.", "max_new_tokens": 5, **body}, timeout=60)
    return r.status_code == 200 and r.content[:4] == b"RIFF"


def test_the_openapi_schema_documents_the_400_the_server_answers(server):
    from intone.api.schema import ErrorBody

    spec = httpx.get(server.url("/openapi.json"), timeout=30).json()
    operations = [op for path in spec["paths"].values() for op in path.values()]
    assert all("422" not in op["responses"] for op in operations)
    speech = spec["paths"]["/v1/audio/speech"]["post"]["responses"]["400"]
    assert speech["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ErrorBody"
    assert "ErrorBody" in spec["components"]["schemas"] and "HTTPValidationError" not in spec["components"]["schemas"]
    bad = httpx.post(server.url("/v1/audio/speech"), json={"input": "Hi.", "temperature": "hot"}, timeout=30)
    assert bad.status_code == 400
    assert ErrorBody.model_validate(bad.json()).error.param == "temperature"


def test_the_websocket_route_needs_the_api_key_too(strict_server):
    import websockets
    from websockets.exceptions import InvalidStatus

    url = strict_server.url("/v1/audio/speech/stream").replace("http://", "ws://")

    async def first_event(headers) -> dict:
        async with websockets.connect(url, additional_headers=headers) as ws:
            await ws.send(json.dumps({"type": "input.text", "text": "Hi."}))
            return json.loads(await ws.recv())

    with pytest.raises(InvalidStatus) as refused:
        asyncio.run(first_event({}))
    assert refused.value.response.status_code == 403
    assert asyncio.run(first_event(AUTH))["param"] == "type"  # let in: the session's own error
