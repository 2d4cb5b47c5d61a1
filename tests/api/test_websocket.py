"""vLLM-Omni's WebSocket protocol at /v1/audio/speech/stream, with the real `websockets` client
against a real server: text in pieces, audio segment by segment, the same audio whatever the
pieces, the same as the HTTP stream of each sentence, and an abort when the client leaves."""

import asyncio
import json
import re
import time

import httpx
import numpy as np
import websockets

TEXT = "The first sentence is short. A second one follows it! Does the third ask a question?"


def ws_url(server) -> str:
    return server.url("/v1/audio/speech/stream").replace("http://", "ws://")


async def session(server, pieces: list[str], **config) -> tuple[list[dict], dict[int, bytes]]:
    events, audio, current = [], {}, None
    async with websockets.connect(ws_url(server), max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", **config}))
        for piece in pieces:
            await ws.send(json.dumps({"type": "input.text", "text": piece}))
        await ws.send(json.dumps({"type": "input.done"}))
        async for message in ws:
            if isinstance(message, bytes):
                audio[current] = audio.get(current, b"") + message
                continue
            event = json.loads(message)
            events.append(event)
            if event["type"] == "audio.start":
                current = event["sentence_index"]
            if event["type"] in ("session.done", "error"):
                break
    return events, audio


def pieces_of(text: str, n: int) -> list[str]:
    cuts = np.linspace(0, len(text), n + 1).astype(int)
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def test_three_sentences_in_ten_pieces_sound_as_sent_whole(server):
    config = dict(seed=7, max_new_tokens=24)
    events, audio = asyncio.run(session(server, pieces_of(TEXT, 10), **config))
    whole_events, whole_audio = asyncio.run(session(server, [TEXT], **config))
    kinds = [e["type"] for e in events]
    assert kinds == ["audio.start", "audio.done"] * 3 + ["session.done"], kinds
    assert [e["sentence_text"] for e in events if e["type"] == "audio.start"] == re.split(r"(?<=[.!?]) ", TEXT)
    assert events[-1]["total_sentences"] == 3 and events == whole_events
    assert all(len(audio[k]) > 0 for k in range(3)) and audio == whole_audio
    # sentence k is what the HTTP stream of that sentence alone gives with seed 7 + k
    with httpx.stream("POST", server.url("/v1/audio/speech"), timeout=120, json=dict(
            input="A second one follows it!", seed=8, max_new_tokens=24, stream=True, stream_format="audio",
            response_format="pcm")) as r:
        assert b"".join(r.iter_bytes()) == audio[1]


def test_bad_sessions_get_an_error_naming_the_field(server):
    async def first_event(messages: list[dict]) -> dict:
        async with websockets.connect(ws_url(server)) as ws:
            for m in messages:
                await ws.send(json.dumps(m))
            return json.loads(await ws.recv())

    bad_config = asyncio.run(first_event([{"type": "session.config", "temperature": 9}]))
    assert bad_config["type"] == "error" and bad_config["param"] == "temperature"
    no_config = asyncio.run(first_event([{"type": "input.text", "text": "Hi."}]))
    assert no_config["type"] == "error" and no_config["param"] == "type"


def test_a_client_that_leaves_mid_sentence_frees_the_engine(server):
    async def leave_after_first_audio():
        async with websockets.connect(ws_url(server)) as ws:
            await ws.send(json.dumps({"type": "session.config", "response_format": "pcm", "seed": 1,
                                      "max_new_tokens": 4000, "ignore_eos": True}))  # ~190 s to finish on a CPU
            await ws.send(json.dumps({"type": "input.text", "text": "A long sentence that keeps going."}))
            await ws.send(json.dumps({"type": "input.done"}))
            while not isinstance(await ws.recv(), bytes):
                pass

    asyncio.run(leave_after_first_audio())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url("/metrics"), timeout=10).text
        used = re.search(r"^intone_kv_cache_blocks_used ([0-9.e+]+)$", metrics, re.M)
        if used and float(used.group(1)) == 0:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the engine still holds the request's KV blocks 30 s after the client left")


def test_segments_do_not_depend_on_where_the_pieces_were_cut():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from intone.api.websocket import Segmenter
    from intone.models.cosyvoice3.text import CosyTextFrontend

    frontend = CosyTextFrontend(lambda text: len(text.split()))  # one unit per word
    words = st.text(alphabet=st.sampled_from("abcdef "), min_size=1, max_size=40).map(str.strip).filter(bool)
    texts = st.lists(st.tuples(words, st.sampled_from(".!?")), min_size=1, max_size=30).map(
        lambda parts: " ".join(w + m for w, m in parts))

    @settings(max_examples=30, deadline=None)
    @given(texts, st.lists(st.integers(0, 10_000), max_size=12), st.booleans())
    def check(text, cuts, fish):
        whole = Segmenter(None if fish else frontend)
        expected = whole.add(text, done=True)
        pieces = Segmenter(None if fish else frontend)
        bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
        got = [s for a, b in zip(bounds, bounds[1:]) for s in pieces.add(text[a:b], done=False)]
        got += pieces.add("", done=True)
        assert got == expected

    check()
