"""POST /v1/audio/speech: validation, the engine round trip, and the four ways to answer."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from dataclasses import dataclass

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from intone.api.encoding import CONTENT_TYPES, encode_file, pcm_headers, stream_encoder, wav_bytes
from intone.api.media import load_reference
from intone.api.schema import SpeechRequest, error_body
from intone.api.segments import generate_segments
from intone.api.voices import resolve_voice
from intone.engine.client import EngineDead
from intone.engine.config import default_params
from intone.errors import InvalidRequestError
from intone.protocol import AudioChunk, SynthesisRequest

DISCONNECT_POLL_S = 0.25  # how often a whole response's handler checks that its client is still there
ERROR_STATUS = {"invalid_request": 400, "too_large": 400, "queue_full": 503, "aborted": 503, "internal": 500}
# What `stream: true` without `stream_format` means, per --sse-dialect
DIALECT_ANSWERS = {"openai": "sse", "sglang": "sglang", "audio": "audio"}


def answer_kind(body: SpeechRequest, dialect: str) -> str:
    """'file', 'audio' (raw bytes), 'sse' (OpenAI's events) or 'sglang' (SGLang-Omni's events).
    An explicit stream_format always wins; the server's dialect only decides a bare `stream: true`."""
    if body.stream_format:
        return body.stream_format
    return DIALECT_ANSWERS[dialect] if body.stream else "file"


@dataclass
class Outcome:
    """What one request produced, for headers and metrics."""

    start: float  # handed to the engine
    parsed: float | None = None  # the HTTP request parsed (before references were loaded)
    first_audio: float | None = None
    frames: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    end: float | None = None
    reason: str = "abort"  # until the terminal chunk says otherwise
    timings: dict | None = None  # the engine's per-stage seconds, from the terminal chunk

    @property
    def engine_s(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def see(self, chunk: AudioChunk) -> None:
        if len(chunk.audio) and self.first_audio is None:
            self.first_audio = time.perf_counter() - self.start
        self.frames = chunk.end_frame
        if chunk.finished:
            self.end = time.perf_counter()
            self.reason = chunk.stop_reason or "stop"
            self.prompt_tokens, self.completion_tokens = chunk.prompt_tokens, chunk.completion_tokens
            self.timings = getattr(chunk, "timings", None)

    @property
    def completed(self) -> bool:
        """The engine finished it normally (stop or length) and it was answered."""
        return self.end is not None and self.reason in ("stop", "length")


def refuse(chunk: AudioChunk) -> JSONResponse:
    status = ERROR_STATUS.get(chunk.error_code or "internal", 500)
    headers = {"Retry-After": "1"} if chunk.error_code in ("queue_full", "aborted") else None
    param = chunk.error_field if chunk.error_code != "internal" else None
    kind = "invalid_request_error" if status < 500 else "server_error"  # queue full: the server's state
    return JSONResponse(error_body(chunk.error, param, kind, code=chunk.error_code), status, headers=headers)


async def build_synthesis(body: SpeechRequest, app_state, streaming: bool) -> tuple[SynthesisRequest, list[str]]:
    """Everything that can be checked before the engine sees the request: the request, and the
    input as the segments to speak one after another (the model's text frontend; else as sent)."""
    settings = app_state.settings
    if not body.input.strip():
        raise InvalidRequestError("input", "must not be empty")
    if len(body.input) > settings.max_input_chars:
        raise InvalidRequestError("input", f"is {len(body.input)} characters, over the {settings.max_input_chars} limit")
    synth = await build_request(body, app_state, streaming)
    # CPU work of up to ~1 s for a long input: off the event loop (and, with text workers, this interpreter)
    segments = await app_state.text.cut(body.input, "input")
    synth.text = segments[0]
    return synth, segments


async def build_request(body: SpeechRequest, app_state, streaming: bool) -> SynthesisRequest:
    """The request's voice, references and sampling settings (its text: `body.input` as sent)."""
    settings = app_state.settings
    if body.ref_text and not body.ref_audio:
        raise InvalidRequestError("ref_audio", "ref_text was given without ref_audio")
    references = []
    voice = await asyncio.to_thread(resolve_voice, body.voice, app_state.voices, settings.voice_aliases)  # reads files
    if voice is not None:
        references.append(voice)
    if body.ref_audio:
        references.append(await load_reference(body.ref_audio, body.ref_text, "ref_audio", settings.media,
                                               app_state.reference_decoder))
    for i, ref in enumerate(body.references or []):
        field = f"references.{i}.{'audio' if ref.audio else 'audio_path'}"
        references.append(await load_reference(ref.audio or ref.audio_path, ref.text, field, settings.media,
                                               app_state.reference_decoder))
    references = await app_state.text.read_transcripts(references)
    params = default_params(
        app_state.profile, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        repetition_penalty=body.repetition_penalty, max_new_tokens=body.max_new_tokens, seed=body.seed,
        ignore_eos=body.ignore_eos or None, mode=body.sampling_mode, min_new_tokens=body.min_new_tokens,
    ).validate()
    return SynthesisRequest(uuid.uuid4().hex, body.input, references, params, body.initial_codec_chunk_frames,
                            speed=body.speed, instructions=body.instructions, stream=streaming)


async def answer(body: SpeechRequest, request: Request) -> Response:
    state = request.app.state
    parsed, received_at = time.perf_counter(), time.time()
    kind = answer_kind(body, state.settings.sse_dialect)
    synth, segments = await build_synthesis(body, state, streaming=kind != "file")
    synth.received_at = received_at
    outcome = Outcome(start=time.perf_counter(), parsed=parsed)
    stream = state.engine.generate(synth) if len(segments) == 1 else generate_segments(state.engine, synth, segments)
    state.metrics.in_flight.inc()
    handed_over = False
    try:
        if kind != "file":
            first = await stream.__anext__()
        else:  # a whole response's first chunk is its last: watch the client meanwhile
            first = await _first_unless_gone(stream, request)
            if first is None:
                outcome.reason = "disconnect"
                return Response(status_code=499)
        first = _cut_if_aborted(first)
        if first.error:
            state.metrics.finished("rejected")
            return refuse(first)
        outcome.see(first)
        sr = state.engine.sample_rate
        if kind == "file":
            return await _whole_file(body, request, first, stream, outcome, sr)
        headers = {"X-Request-Id": synth.request_id, "Cache-Control": "no-cache"}
        if kind == "audio":
            gen = _raw_stream(body.response_format, first, stream, outcome, sr)
            media = CONTENT_TYPES[body.response_format]
            if body.response_format == "pcm":
                headers.update(pcm_headers(sr))
        elif kind == "sglang":
            gen, media = _sglang_events(first, stream, outcome, sr), "text/event-stream"
        else:
            gen, media = _openai_events(body.response_format, first, stream, outcome, sr), "text/event-stream"
        handed_over = True
        return StreamingResponse(_finishing(gen, stream, outcome, state), media_type=media, headers=headers)
    except EngineDead as e:
        state.metrics.finished("error")
        return JSONResponse(error_body(str(e), None, "server_error", "engine_dead"), 503)
    finally:
        if not handed_over:
            await stream.aclose()
            state.metrics.in_flight.dec()
            if outcome.end is not None or outcome.reason == "disconnect":
                _record(state, outcome)


def _record(state, outcome: Outcome) -> None:
    seconds = outcome.frames * state.engine.info["samples_per_frame"] / state.engine.sample_rate
    if outcome.first_audio is not None:
        state.metrics.ttfa.observe(outcome.first_audio)
    state.metrics.finished(outcome.reason, seconds, outcome.frames, outcome.engine_s)


def _record_stages(state, outcome: Outcome) -> None:
    """Where a completed request's time went; called once the response is handed to the server."""
    if outcome.completed:
        state.metrics.stage_times(outcome.timings, api_in=outcome.start - outcome.parsed if outcome.parsed else None,
                                  api_out=time.perf_counter() - outcome.end)


def _encode_whole(parts: list[np.ndarray], sr: int, fmt: str) -> bytes:
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return wav_bytes(audio, sr) if fmt == "wav" else encode_file(audio, sr, fmt)


_GONE, _SHUT = object(), object()  # what _unless_gone returns when the client left / the drain deadline passed


async def _unless_gone(awaitable, request: Request):
    """awaitable's result, while watching the client: _GONE (and the work cancelled, so the engine
    stream aborts its request) if the client disconnects first; _SHUT if the server cancels this
    handler meanwhile (its drain deadline passed)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                await _stop(task)
                return _GONE
    except asyncio.CancelledError:
        await _stop(task)
        return _SHUT
    return task.result()


async def _first_unless_gone(stream, request: Request):
    """The stream's next chunk; None if the client disconnects first; a 503 chunk at shutdown."""
    first = await _unless_gone(stream.__anext__(), request)
    return None if first is _GONE else _shutdown_chunk() if first is _SHUT else first


async def _stop(task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await task  # the engine stream's cleanup (its abort) has run


def _shutdown_chunk() -> AudioChunk:
    chunk = AudioChunk(request_id="", seq=-1, start_frame=0, end_frame=0, audio=np.zeros(0, np.float32),
                       sample_rate=0, finished=True, stop_reason="abort")
    return _cut_if_aborted(chunk)


async def _whole_file(body, request: Request, first, stream, outcome: Outcome, sr: int) -> Response:
    """Collect every chunk; a client that goes away meanwhile aborts the request."""
    chunks = [first]

    async def collect():
        async for chunk in stream:
            outcome.see(chunk)
            chunks.append(_cut_if_aborted(chunk))

    if not first.finished:
        done = await _unless_gone(collect(), request)
        if done is _GONE:
            outcome.reason = "disconnect"
            return Response(status_code=499)
        if done is _SHUT:
            return refuse(_shutdown_chunk())
    last = chunks[-1]
    if last.error:
        return refuse(last)
    # Encoding a whole file (mp3, opus: tens of ms) runs off the event loop.
    data = await asyncio.to_thread(_encode_whole, [c.audio for c in chunks], sr, body.response_format)
    state = request.app.state

    async def handed_over():  # runs after the body was sent
        _record_stages(state, outcome)

    headers = {
        "X-Request-Id": first.request_id,
        "X-Prompt-Tokens": str(outcome.prompt_tokens), "X-Completion-Tokens": str(outcome.completion_tokens),
        "X-Engine-Time": f"{outcome.engine_s:.4f}", "X-Stop-Reason": outcome.reason,
    }
    if body.response_format == "pcm":
        headers.update(pcm_headers(sr))
    return Response(data, media_type=CONTENT_TYPES[body.response_format], headers=headers,
                    background=BackgroundTask(handed_over))


class StreamCut(Exception):
    """Raised inside a raw audio body that cannot be finished, so that the server drops the
    connection without the body's proper end: the client cannot mistake cut audio for all of it."""


def _cut_if_aborted(chunk: AudioChunk) -> AudioChunk:
    """An abort the client did not ask for (the server is shutting down) ends the answer as an error:
    the audio so far is not the whole utterance."""
    if chunk.finished and chunk.stop_reason == "abort" and not chunk.error:
        chunk.error, chunk.error_code = "the server stopped this request (shutting down); retry", "aborted"
    return chunk


async def _chunks(first, stream, outcome: Outcome):
    """The request's chunks; if the engine dies meanwhile, a terminal error chunk says so."""
    yield first
    if first.finished:
        return
    try:
        async for chunk in stream:
            outcome.see(chunk)
            yield _cut_if_aborted(chunk)
    except EngineDead as e:
        outcome.reason = "error"
        yield AudioChunk(request_id=first.request_id, seq=-1, start_frame=0, end_frame=0,
                         audio=np.zeros(0, np.float32), sample_rate=first.sample_rate, finished=True,
                         stop_reason="error", error=str(e), error_code="engine_dead")


async def _encoded(chunks, encoder):
    """Each chunk's encoded bytes (possibly empty), then the encoder's tail after the terminal chunk.
    Compressed formats encode off the event loop."""
    async for chunk in chunks:
        if chunk.error:
            yield chunk, b""
            return
        audio = chunk.audio
        yield chunk, encoder.encode(audio) if encoder.cheap else await asyncio.to_thread(encoder.encode, audio)
    yield None, encoder.finish() if encoder.cheap else await asyncio.to_thread(encoder.finish)


async def _raw_stream(fmt: str, first, stream, outcome: Outcome, sr: int):
    async for chunk, data in _encoded(_chunks(first, stream, outcome), stream_encoder(fmt, sr)):
        if chunk is not None and chunk.error:
            raise StreamCut(chunk.error)  # a raw byte stream has no way to say more
        if data:
            yield data


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _openai_events(fmt: str, first, stream, outcome: Outcome, sr: int):
    async for chunk, data in _encoded(_chunks(first, stream, outcome), stream_encoder(fmt, sr)):
        if chunk is not None and chunk.error:
            yield _sse({"type": "speech.audio.error", "error": error_body(chunk.error, code=chunk.error_code)["error"]})
            return
        if data:
            yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    yield _sse({"type": "speech.audio.done", "usage": {
        "input_tokens": outcome.prompt_tokens, "output_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }})


async def _sglang_events(first, stream, outcome: Outcome, sr: int):
    """SGLang-Omni's dialect: each chunk a self-contained WAV, a null-audio final event, [DONE]."""
    index = 0
    async for chunk in _chunks(first, stream, outcome):
        if chunk.error:
            yield _sse({"object": "audio.speech.chunk", "index": index, "audio": None, "finish_reason": "error",
                        "error": chunk.error})
            yield b"data: [DONE]\n\n"
            return
        if len(chunk.audio):
            data = base64.b64encode(wav_bytes(chunk.audio, sr)).decode()
            yield _sse({"object": "audio.speech.chunk", "index": index,
                        "audio": {"data": data, "format": "wav", "sample_rate": sr}})
            index += 1
    yield _sse({"object": "audio.speech.chunk", "index": index, "audio": None, "finish_reason": outcome.reason,
                "usage": {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
                          "engine_time_s": round(outcome.engine_s, 4)}})
    yield b"data: [DONE]\n\n"


async def _finishing(gen, stream, outcome: Outcome, state):
    """Runs the body; on completion or disconnect, closes the engine stream (which aborts it)."""
    try:
        async for part in gen:
            yield part
        _record_stages(state, outcome)  # the last part has been taken by the server
    finally:
        await stream.aclose()
        state.metrics.in_flight.dec()
        if outcome.end is None:
            outcome.reason = "disconnect"
        _record(state, outcome)
