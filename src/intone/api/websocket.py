"""WebSocket /v1/audio/speech/stream: text arrives in pieces, audio leaves segment by segment
(vLLM-Omni's protocol, so its client works unchanged).

Client -> server, JSON text frames:
    {"type": "session.config", ...}   once, first: the speech body's fields except `input`
                                      (voice, ref_audio + ref_text, seed, response_format, ...)
    {"type": "input.text", "text": "..."}   any number of pieces
    {"type": "input.done"}
Server -> client:
    {"type": "audio.start", "sentence_index": k, "sentence_text": "...", "format": "pcm", "sample_rate": sr}
    binary frames: segment k's audio in the session's format, as it is made
    {"type": "audio.done", "sentence_index": k}
    {"type": "session.done", "total_sentences": n}
    {"type": "error", "message": "...", "param": field | null}   (then the server closes)

The text is cut as the speech endpoint cuts a whole input (the model's text frontend; else at
sentence ends): a segment is spoken once no later text can change it, with seed + k as over
HTTP, so a session's audio is the same whatever pieces its text came in. Segments are spoken
one after another while more text arrives; a disconnect aborts the one being spoken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from intone.api.encoding import stream_encoder
from intone.api.schema import SpeechRequest
from intone.api.segments import segment_request
from intone.api.speech import build_request
from intone.engine.client import EngineDead
from intone.errors import InvalidRequestError

SENTENCE_END = re.compile(r"(?<=[.?!;。？！；])\s+|(?<=[。？！；])")
MERGE_UNITS = 20  # the official packer joins a last segment under this many units to the one before


class SessionError(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Segmenter:
    """The final segments of a growing text, as the whole text would be cut."""

    def __init__(self, frontend):
        self.frontend = frontend
        self.text = ""
        self.sent = 0  # segments handed out

    def add(self, piece: str, done: bool) -> list[str]:
        self.text += piece
        if not done and not SENTENCE_END.search(piece + " "):
            return []  # no sentence ended: nothing can have become final
        segments = self._segments()
        final = len(segments) if done else self._final(segments)
        new, self.sent = segments[self.sent:final], max(self.sent, final)
        return new

    def _segments(self) -> list[str]:
        if self.frontend is not None:
            return self.frontend.segments(self.text)
        return [s for s in SENTENCE_END.split(self.text.strip()) if s.strip()]

    def _final(self, segments: list[str]) -> int:
        """Every segment but the last (which may still grow); the one before it too while the last
        is short enough to be merged into it at the end."""
        n = len(segments) - 1
        if self.frontend is not None and n >= 1 and self.frontend.units(segments[-1], self.text) < MERGE_UNITS:
            n -= 1
        return max(n, 0)


async def speech_stream(ws: WebSocket) -> None:
    state, settings = ws.app.state, ws.app.state.settings  # the API key: checked by the server's Guard
    await ws.accept()
    try:
        await _session(ws, state, settings)
    except WebSocketDisconnect:
        pass
    except (SessionError, InvalidRequestError) as e:
        await _refuse(ws, str(e), getattr(e, "param", None) or getattr(e, "field", None), 1008)
    except EngineDead as e:
        await _refuse(ws, f"engine is dead: {e}", None, 1011)


async def _refuse(ws: WebSocket, message: str, param: str | None, code: int) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await ws.send_json({"type": "error", "message": message, "param": param})
        await ws.close(code=code)


async def _session(ws: WebSocket, state, settings) -> None:
    config = await _config(ws)
    synth = await build_request(config, state, streaming=True)
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_read(ws, state, settings, queue)),
             asyncio.create_task(_speak(ws, state, synth, config.response_format, queue))]
    try:
        # The reader ends at input.done; the speaker when it has spoken everything (or either fails).
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure ends the session
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _read(ws: WebSocket, state, settings, queue: asyncio.Queue) -> None:
    segmenter, total = Segmenter(state.text.frontend), 0
    while True:
        msg = await _message(ws)
        kind = msg.get("type")
        if kind not in ("input.text", "input.done"):
            raise SessionError(f"unknown message type {kind!r} (input.text or input.done)", "type")
        piece = msg.get("text", "") if kind == "input.text" else ""
        if not isinstance(piece, str):
            raise SessionError("text must be a string", "text")
        total += len(piece)
        if total > settings.max_input_chars:
            raise SessionError(f"the session's text is over the {settings.max_input_chars} character limit", "text")
        for text in await asyncio.to_thread(segmenter.add, piece, kind == "input.done"):  # wetext: CPU work
            queue.put_nowait(text)
        if kind == "input.done":
            queue.put_nowait(None)
            return


async def _config(ws: WebSocket) -> SpeechRequest:
    msg = await _message(ws)
    if msg.get("type") != "session.config":
        raise SessionError("the first message must be session.config", "type")
    fields = {k: v for k, v in msg.items() if k not in ("type", "input", "stream", "stream_format")}
    try:
        return SpeechRequest(input=" ", **fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise SessionError(f"session.config: {first['msg']}", ".".join(str(p) for p in first["loc"])) from None


async def _message(ws: WebSocket) -> dict:
    raw = await ws.receive_text()
    try:
        msg = json.loads(raw)
    except json.JSONDecodeError:
        raise SessionError("messages are JSON objects") from None
    if not isinstance(msg, dict):
        raise SessionError("messages are JSON objects")
    return msg


async def _speak(ws: WebSocket, state, synth, fmt: str, queue: asyncio.Queue) -> None:
    engine, sr, k = state.engine, state.engine.sample_rate, 0
    session = uuid.uuid4().hex
    while (text := await queue.get()) is not None:
        await ws.send_json({"type": "audio.start", "sentence_index": k, "sentence_text": text, "format": fmt,
                            "sample_rate": sr})
        encoder = stream_encoder(fmt, sr)
        request = segment_request(synth, text, k)
        request.request_id = f"{session}.{k}"
        async with contextlib.aclosing(engine.generate(request)) as chunks:
            async for chunk in chunks:
                if chunk.error:
                    raise SessionError(f"segment {k}: {chunk.error}", chunk.error_field)
                if not len(chunk.audio):
                    continue
                data = encoder.encode(chunk.audio) if encoder.cheap else await asyncio.to_thread(encoder.encode, chunk.audio)
                if data:
                    await ws.send_bytes(data)
        if tail := encoder.finish():
            await ws.send_bytes(tail)
        await ws.send_json({"type": "audio.done", "sentence_index": k})
        k += 1
    await ws.send_json({"type": "session.done", "total_sentences": k})

