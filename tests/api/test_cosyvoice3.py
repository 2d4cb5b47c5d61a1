"""The speech API serving CosyVoice3 (tiny), over real HTTP."""

import base64
import io
import json
import os

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from .conftest import stop_server


@pytest.fixture(scope="module")
def cosy_server(shared_boots):
    s = shared_boots.take("cosy_server")  # --model tiny:cosyvoice3
    t = np.arange(40000) / 16000
    sf.write(s.media / "ref.wav", 0.3 * np.sin(2 * np.pi * 150 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)), 16000)
    yield s
    stop_server(s)


def speech(server, **body):
    base = dict(input="Hello from the tiny voice.", ref_audio=str(server.media / "ref.wav"),
                ref_text="A short reference sentence.", seed=11, max_new_tokens=70)
    return httpx.post(server.url("/v1/audio/speech"), json={**base, **body}, timeout=120)


def test_whole_audio_is_the_one_pass_decode_and_the_stream_carries_the_same_frames(cosy_server, tiny_cache):
    """A non-streamed answer is the official non-streamed inference (one flow + HiFT pass over all
    tokens); a stream is the official streaming output; both carry the same tokens."""
    from intone.audio import read_audio
    from intone.engine.config import default_params, load_profile
    from intone.engine.core import EngineCore
    from intone.models import resolve_model_dir
    from intone.models.registry import load_model
    from intone.protocol import SynthesisRequest, VoiceReference

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
    assert len(streamed) == len(audio) and not np.array_equal(streamed, audio)

    profile = load_profile("cosyvoice3-streaming", device="cpu")
    core = EngineCore(load_model(str(resolve_model_dir("tiny:cosyvoice3")), device="cpu"), profile)
    ref, ref_rate = read_audio(str(cosy_server.media / "ref.wav"))
    core.add_request(SynthesisRequest("one-pass", "Hello from the tiny voice.",
                                      [VoiceReference("A short reference sentence.", audio=ref, sample_rate=ref_rate)],
                                      default_params(profile, seed=11, max_new_tokens=70), stream=False))
    chunks = []
    threads = torch.get_num_threads()
    # as many threads as the server's engine core (OMP_NUM_THREADS, tests/conftest.py): the same float32 sums
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads)))
    try:
        while core.has_work():
            chunks += core.step()
    finally:
        torch.set_num_threads(threads)
    core.close()
    assert len(chunks) == 1 and chunks[0].finished
    expected = np.clip(np.round(chunks[0].audio * 32767), -32768, 32767)
    assert np.abs(audio.astype(np.int32) - expected).max() <= 1  # PCM16 rounding


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
    ras = speech(cosy_server, response_format="pcm")
    standard = speech(cosy_server, sampling_mode="standard", repetition_penalty=1.21, temperature=0.7,
                      response_format="pcm")
    assert ras.status_code == standard.status_code == 200 and ras.content != standard.content  # the field is read
    bad = speech(cosy_server, sampling_mode="greedy")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_mode"


def test_speed_works_whole_and_is_refused_for_streams_of_a_streaming_profile(cosy_server):
    normal, fast = speech(cosy_server, response_format="wav"), speech(cosy_server, speed=1.5, response_format="wav")
    assert fast.status_code == 200, fast.text
    n_normal = sf.info(io.BytesIO(normal.content)).frames
    n_fast = sf.info(io.BytesIO(fast.content)).frames
    assert abs(n_fast - n_normal / 1.5) < 0.05 * n_normal  # the whole mel stretched, as officially
    streamed = speech(cosy_server, speed=1.5, stream=True, response_format="pcm")  # cosyvoice3-streaming
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "speed"


def test_instructions_change_the_speech(cosy_server):
    plain = speech(cosy_server, response_format="pcm")
    told = speech(cosy_server, instructions="Speak slowly and clearly.", response_format="pcm")
    assert plain.status_code == told.status_code == 200 and len(told.content) > 0
    assert told.content != plain.content  # the instruction is in the prompt (same seed otherwise)


def test_openai_sdk_with_a_reference(cosy_server):
    """CosyVoice3 needs a reference: the SDK passes it in extra_body; 'alloy' means no stored voice."""
    import av
    import openai
    client = openai.OpenAI(base_url=cosy_server.url("/v1"), api_key="unused", max_retries=0)
    extra = dict(ref_audio=str(cosy_server.media / "ref.wav"), ref_text="A short reference sentence.", seed=11,
                 max_new_tokens=70)
    aac = client.audio.speech.create(model="tiny", voice="alloy", input="Hello.", response_format="aac",
                                     extra_body=extra)
    with av.open(io.BytesIO(aac.content)) as f:
        assert f.streams.audio[0].rate == 24000 and sum(fr.samples for fr in f.decode(audio=0)) > 960
    with client.audio.speech.with_streaming_response.create(
            model="tiny", voice="alloy", input="Hello.", response_format="pcm", stream_format="sse",
            extra_body=extra) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-1]["type"] == "speech.audio.done" and len(pcm) > 0 and len(pcm) % (2 * 960) == 0
    with pytest.raises(openai.BadRequestError) as e:  # a preset name is no reference
        client.audio.speech.create(model="tiny", voice="alloy", input="Hello.")
    assert e.value.body["param"] == "ref_audio"


LONG = ("The keeper climbed the stairs at dusk, counting each step. He lit the lamp at 7:45 and "
        "watched 3 ships pass the rocks. When the storm came, the beam swept the water and the boats "
        "found their way home. In the morning he wrote it all down.")  # under the server's 300 characters


def test_a_long_input_is_spoken_segment_by_segment_in_one_response(cosy_server, tiny_cache):
    """The official text frontend cuts the input (normalised: numbers spoken) into segments; one
    response carries them in order, each exactly what it gets sent alone (seed + k), streamed or not."""
    from intone.models import text_frontend

    segments = text_frontend("tiny:cosyvoice3").segments(LONG)
    assert len(segments) >= 2 and "seven forty five" in "".join(segments).lower()
    alone = []
    for k, text in enumerate(segments):
        reply = speech(cosy_server, input=text, seed=5 + k, max_new_tokens=40, response_format="pcm")
        assert reply.status_code == 200, reply.text
        alone.append(np.frombuffer(reply.content, dtype="<i2"))
    whole = speech(cosy_server, input=LONG, seed=5, max_new_tokens=40, response_format="pcm")
    assert whole.status_code == 200, whole.text
    assert np.array_equal(np.frombuffer(whole.content, dtype="<i2"), np.concatenate(alone))
    with httpx.stream("POST", cosy_server.url("/v1/audio/speech"), timeout=120, json=dict(
            input=LONG, ref_audio=str(cosy_server.media / "ref.wav"), ref_text="A short reference sentence.",
            seed=5, max_new_tokens=40, stream=True, stream_format="sse", response_format="pcm")) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    streamed = np.frombuffer(b"".join(deltas), dtype="<i2")
    assert len(streamed) == sum(len(a) for a in alone)  # the same frames; a stream decodes in hops


def test_input_that_is_only_punctuation_is_refused_naming_the_field(cosy_server):
    reply = speech(cosy_server, input="?!...")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"


def test_a_websocket_session_speaks_the_official_segments_whatever_the_pieces(cosy_server, tiny_cache):
    import asyncio

    from intone.models import text_frontend

    from .test_websocket import pieces_of, session

    config = dict(ref_audio=str(cosy_server.media / "ref.wav"), ref_text="A short reference sentence.", seed=5,
                  max_new_tokens=40)
    events, audio = asyncio.run(session(cosy_server, pieces_of(LONG, 10), **config))
    whole_events, whole_audio = asyncio.run(session(cosy_server, [LONG], **config))
    spoken = [e["sentence_text"] for e in events if e["type"] == "audio.start"]
    assert spoken == text_frontend("tiny:cosyvoice3").segments(LONG) and events[-1]["type"] == "session.done"
    assert events == whole_events and audio == whole_audio and all(audio[k] for k in range(len(spoken)))


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus", "aac"])
def test_the_openai_sdk_gets_every_format_every_way_from_cosyvoice3(cosy_server, fmt):
    """create, with_streaming_response (raw audio) and stream_format='sse': the same seed, the same
    duration, in the format asked for, at CosyVoice3's 24 kHz (Opus: 48 kHz)."""
    import openai

    from .test_openai_sdk import CONTENT_TYPES, seconds

    client = openai.OpenAI(base_url=cosy_server.url("/v1"), api_key="unused", max_retries=0)
    extra = dict(ref_audio=str(cosy_server.media / "ref.wav"), ref_text="A short reference sentence.", seed=3,
                 max_new_tokens=30, min_new_tokens=30)
    common = dict(model="tiny", voice="alloy", input="Hello there.", response_format=fmt, extra_body=extra)
    whole = client.audio.speech.create(**common)
    assert whole.response.headers["content-type"] == CONTENT_TYPES[fmt]
    with client.audio.speech.with_streaming_response.create(**common, stream_format="audio") as response:
        raw = b"".join(response.iter_bytes())
    with client.audio.speech.with_streaming_response.create(**common, stream_format="sse") as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    sse = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    durations = [seconds(body, fmt, pcm_rate=24000) for body in (whole.content, raw, sse)]
    assert all(rate == (48000 if fmt == "opus" else 24000) for _, rate in durations)
    # mp3 and aac add priming and padding: up to two codec frames (~0.09 s at 24 kHz) beyond the frames' 1.2 s
    assert all(abs(d - 30 * 960 / 24000) < 0.1 for d, _ in durations), durations


def test_a_bare_stream_true_is_raw_pcm_under_the_audio_dialect(cosy_server):
    """Older vLLM-Omni `--stream` clients send `stream: true` with pcm and save the bytes as audio:
    with `--sse-dialect audio` they get raw PCM16 that says its rate; an explicit `sse` still wins."""
    with httpx.stream("POST", cosy_server.url("/v1/audio/speech"), timeout=120, json=dict(
            input="Hello there.", ref_audio=str(cosy_server.media / "ref.wav"), ref_text="A short reference sentence.",
            seed=2, max_new_tokens=20, min_new_tokens=20, stream=True, response_format="pcm")) as r:
        assert r.headers["content-type"].startswith("audio/pcm") and r.headers["x-sample-rate"] == "24000"
        assert len(b"".join(r.iter_bytes())) == 20 * 960 * 2
    sse = speech(cosy_server, input="Hello there.", seed=2, max_new_tokens=20, stream=True, stream_format="sse",
                 response_format="pcm")
    assert sse.headers["content-type"].startswith("text/event-stream")


def test_metrics_show_the_codec_busy_and_the_flow_padding(cosy_server):
    from intone.bench.server_metrics import scrape

    before = scrape(cosy_server.base)
    assert speech(cosy_server, response_format="wav").status_code == 200
    after = scrape(cosy_server.base)

    def grew(name):
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert grew("intone_codec_calls_total") >= 1 and grew("intone_codec_busy_seconds_total") > 0
    useful, padded = grew("intone_codec_useful_tokens_total"), grew("intone_codec_padded_tokens_total")
    assert 0 < useful <= padded
    flow, hift = grew("intone_codec_flow_seconds_total"), grew("intone_codec_vocoder_seconds_total")
    assert flow > 0 and hift > 0 and flow + hift <= grew("intone_codec_busy_seconds_total")
    # a whole response's one chunk opens no stream; a lone stream's first chunk is a call of its own
    assert grew("intone_codec_first_calls_total") == 0
    before = after
    assert speech(cosy_server, response_format="pcm", stream=True, stream_format="audio").status_code == 200
    after = scrape(cosy_server.base)
    assert grew("intone_codec_first_calls_total") == 1 and grew("intone_codec_first_call_chunks_total") == 1
    first_call = grew("intone_codec_first_call_seconds_total")
    assert 0 < first_call < grew("intone_codec_busy_seconds_total")
    gpu = grew("intone_codec_first_call_gpu_seconds_total")
    assert 0 < gpu <= first_call  # its pieces' spans, within the call
    assert 0 < grew("intone_codec_first_call_flow_seconds_total") < gpu  # the flow's part (HiFT the rest)
    assert grew("intone_codec_preempted_calls_total") == 0  # the server's schedule does not preempt
