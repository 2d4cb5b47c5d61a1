"""The OpenAI-compatible HTTP server. It never touches the GPU: the engine core process does."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable

from fastapi import FastAPI, File, Form, Request, UploadFile, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from intone.api.encoding import CONTENT_TYPES
from intone.api.engine_pool import EnginePool, EngineSlot, merge_stats, place_engines
from intone.api.media import MediaPolicy, reference_decoder
from intone.api.profiling import PROFILE_PATHS, install_profile_routes
from intone.api.metrics import ServerMetrics
from intone.api.schema import ErrorBody, SpeechRequest, error_body
from intone.api.speech import answer
from intone.api.websocket import speech_stream
from intone.api.voices import UnknownVoice, VoiceExists, VoiceStore
from intone.audio import read_audio
from intone.api.text_workers import TextWorkers, default_workers
from intone.engine.client import Engine, EngineDead
from intone.engine.config import load_profile
from intone.models import default_profile, text_frontend
from intone.errors import IntoneError, InvalidRequestError, MediaTooLarge

log = logging.getLogger("intone.server")


@dataclass
class Settings:
    model: str = "tiny:fish-s2"
    profile: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    voices_dir: Path = Path("voices")
    max_input_chars: int = 4096
    max_body_bytes: int = 16 * 1024 * 1024
    sse_dialect: str = "openai"  # what a bare `stream: true` answers: "openai" (SSE), "sglang" or "audio"
    voice_aliases: dict[str, str] = field(default_factory=dict)  # request voice name -> stored voice or "default"
    device: str | None = None
    profile_overrides: dict = field(default_factory=dict)  # dotted profile keys -> values (`serve --set`)
    trace_frames: str | None = None
    engine_silence_s: float = 10.0  # /health turns 503 when the core's loop has been silent this long
    engine_restart: str = "restart"  # a dead core: "restart" it (with back-off) or "exit" the server
    engine_hang_s: float = 60.0  # a core silent this long is killed (then restarted); 0: never
    text_workers: int | None = None  # processes for the text frontend (None: text_workers.default_workers())
    data_parallel: int = 1  # engine cores behind this server (api/engine_pool.py)
    devices: list[str] | None = None  # engine k's device: devices[k % len] ("cpu" or a GPU index); None: the profile's
    profile_dir: Path | None = None  # where /start_profile's windows go (engine k's in engine-k/); None: off


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        overrides = {**settings.profile_overrides, **({"device": settings.device} if settings.device else {})}
        app.state.profile = load_profile(settings.profile or default_profile(settings.model), **overrides)
        frontend = await asyncio.to_thread(text_frontend, settings.model)
        workers = default_workers() if settings.text_workers is None else settings.text_workers
        app.state.text = TextWorkers(settings.model, frontend, workers)

        text_ready = asyncio.ensure_future(app.state.text.start())  # the workers load beside the engines
        try:
            app.state.engine = await EnginePool.start(_engine_slots(settings, app.state.profile),
                                                      settings.engine_silence_s, app.state.metrics)
        except BaseException:
            text_ready.cancel()
            app.state.text.close()
            raise
        try:
            await text_ready
        except BaseException:
            await app.state.engine.shutdown()
            app.state.text.close()
            raise
        for slot in app.state.engine.slots:
            info = slot.engine.info
            log.info("ready: %s: model %s (%s) on %s, profile %s, %d Hz, capacity %d", slot.name, settings.model,
                     info["name"], info["device"], info["profile"], info["sample_rate"], info["capacity"])
        app.state.engine.supervise(settings.engine_restart, settings.engine_hang_s)
        yield
        log.info("shutting down: aborting in-flight requests")
        await app.state.engine.shutdown()
        app.state.text.close()
        app.state.reference_decoder.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="intone", lifespan=lifespan)
    app.state.settings = settings
    # where request texts are read: the model's text frontend from start-up on (before it, or without one: as sent)
    app.state.text = TextWorkers(settings.model, None, 0)
    app.state.metrics = ServerMetrics()
    app.state.reference_decoder = reference_decoder()
    app.state.voices = VoiceStore(settings.voices_dir)
    app.state.model_id = settings.served_model_name or settings.model
    _install_errors(app)
    _document_errors(app)
    _install_guards(app, settings)
    _install_routes(app)
    install_profile_routes(app)
    return app


def _engine_slots(settings: Settings, profile) -> list[EngineSlot]:
    """One slot per engine core, each starting its core on its own device (api/engine_pool.py)."""
    placements = place_engines(settings.data_parallel, settings.devices, dict(os.environ), profile.device)
    slots = []
    for k, place in enumerate(placements):
        engine_profile = profile.model_copy(update={"device": place.device}) if place.device else profile
        trace = settings.trace_frames
        if trace and len(placements) > 1:  # one trace per core: the audit reads each alone
            path = Path(trace)
            trace = str(path.with_name(f"{path.stem}.{k}{path.suffix}"))

        def start(p=engine_profile, t=trace, env=place.env) -> Awaitable[Engine]:
            return Engine.from_profile(p, model=settings.model, trace_frames=t, env=env)
        slots.append(EngineSlot(k, place.label, start))
    return slots


def _document_errors(app: FastAPI) -> None:
    """FastAPI's schema documents a body that fails validation as a 422 with its own body; this
    server answers 400 with the error body every failure uses, and the schema says so."""
    def schema() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            error = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(error.pop("$defs", {}))
            components["ErrorBody"] = error
            documented = {"description": "Invalid request: `error.param` names the field",
                          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
            for operation in (op for path in spec["paths"].values() for op in path.values()):
                if operation.get("responses", {}).pop("422", None) is not None:
                    operation["responses"]["400"] = documented
            app.openapi_schema = spec
        return app.openapi_schema
    app.openapi = schema


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":  # loc is the byte offset, not a field
            return JSONResponse(error_body(f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"), 400)
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return JSONResponse(error_body(f"{param}: {first['msg']}" if param else first["msg"], param), 400)

    @app.exception_handler(InvalidRequestError)
    async def bad_field(request: Request, exc: InvalidRequestError):
        status = 413 if isinstance(exc, MediaTooLarge) else 409 if isinstance(exc, VoiceExists) else 400
        if isinstance(exc, UnknownVoice) and request.method == "DELETE":
            status = 404
        return JSONResponse(error_body(str(exc), exc.field), status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """Starlette's own refusals (no such route, wrong method, a body that is not JSON or not
        multipart) in the error body every failure uses, their headers (e.g. Allow) kept."""
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names the first matching route's methods only
            path = request.url.path
            methods = {m for r in request.app.routes if getattr(r, "methods", None) and r.path_regex.match(path)
                       for m in r.methods}
            headers["Allow"] = ", ".join(sorted(methods))
        return JSONResponse(error_body(str(exc.detail), None, kind), exc.status_code, headers=headers)

    @app.exception_handler(EngineDead)
    async def dead(request: Request, exc: EngineDead):
        return JSONResponse(error_body(str(exc), None, "server_error", "engine_dead"), 503)


def _install_guards(app: FastAPI, settings: Settings) -> None:
    app.add_middleware(Guard, settings=settings)


class Guard:
    """Body size, API key and engine liveness, checked before a route runs.

    A plain ASGI middleware, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hands
    the route a receive channel on which the client's disconnect never shows, so a non-streamed
    request whose client left was never aborted.
    """

    def __init__(self, app, settings: Settings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not self._key_given(Headers(scope=scope), scope["path"]):
            await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
            return
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is None and "content-length" not in Headers(scope=scope):
                receive, refusal = await self._bounded_body(receive)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _bounded_body(self, receive):
        """A body without a declared length (chunked) is read here up to the limit, then replayed
        to the route; over the limit it is a 413 before anything else reads it."""
        limit, parts, size = self.settings.max_body_bytes, [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended
                return _replay([message], receive), None
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > limit:
                return receive, JSONResponse(error_body(f"request body over {limit} bytes"), 413)
            if not message.get("more_body", False):
                body = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                return _replay([body], receive), None

    def _key_given(self, headers: Headers, path: str) -> bool:
        """The API key, when the server has one, guards every /v1/ route (HTTP and WebSocket) and the profiler's."""
        key = self.settings.api_key
        if not key or not (path.startswith("/v1/") or path in PROFILE_PATHS):
            return True
        return hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {key}".encode())

    def _refusal(self, scope) -> JSONResponse | None:
        settings, path = self.settings, scope["path"]
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > settings.max_body_bytes:
            return JSONResponse(error_body(f"request body over {settings.max_body_bytes} bytes"), 413)
        if not self._key_given(headers, path):
            return JSONResponse(error_body("missing or wrong API key", None, "authentication_error"), 401)
        engine = getattr(scope["app"].state, "engine", None)
        if engine is not None and engine.dead and path.startswith("/v1/audio"):
            return JSONResponse(error_body(f"engine is dead: {engine.dead}", None, "server_error", "engine_dead"), 503,
                                headers={"Retry-After": "5"})
        return None


def _replay(messages: list, receive):
    """A receive channel that hands out `messages` first, then the client's own (its disconnect)."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()
    return replayed


def _install_routes(app: FastAPI) -> None:
    @app.post("/v1/audio/speech", responses={200: {"description": "The audio (a file, raw bytes as made, or events)",
                                                   "content": {**{t: {} for t in sorted(set(CONTENT_TYPES.values()))},
                                                               "text/event-stream": {}}}})
    async def speech(body: SpeechRequest, request: Request):
        return await answer(body, request)

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream_route(ws: WebSocket):
        await speech_stream(ws)

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [
            {"id": request.app.state.model_id, "object": "model", "owned_by": "intone",
             "sample_rate": request.app.state.engine.sample_rate},
        ]}

    @app.get("/health")
    async def health(request: Request):
        """200 while at least one engine core serves; each core's state under `engines`."""
        status, body = request.app.state.engine.health()
        return JSONResponse(body, status)

    @app.get("/metrics")
    async def metrics(request: Request):
        state, pool = request.app.state, request.app.state.engine
        snapshots = await pool.engine_stats()  # a hung core's is None: the API's own metrics still answer
        rows = [(slot.index, slot.state(pool.silence_s) == "ok", slot.engine.outstanding_frames(), stats)
                for slot, stats in zip(pool.slots, snapshots)]
        state.metrics.engine_states(rows, merge_stats([s for s in snapshots if s is not None]))
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/audio/voices", status_code=201)
    async def add_voice(request: Request, name: str = Form(...), transcript: str | None = Form(None),
                        ref_text: str | None = Form(None), consent: str | None = Form(None),
                        audio: UploadFile | None = File(None), audio_sample: UploadFile | None = File(None)):
        """Ours (audio, transcript) or vLLM-Omni's upload form (audio_sample, ref_text, consent)."""
        state = request.app.state
        upload = audio or audio_sample
        if upload is None:
            raise InvalidRequestError("audio", "a file is required")
        transcript = transcript if transcript is not None else ref_text
        if not transcript:
            raise InvalidRequestError("transcript", "the reference's transcript is required (or ref_text)")
        limit = state.settings.media.max_bytes
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise MediaTooLarge("audio", f"over the {limit} byte limit")
        samples, rate = await asyncio.to_thread(read_audio, data, "audio", state.settings.media.max_seconds)
        try:
            features = await state.engine.encode_reference(samples, rate)
        except EngineDead:
            raise
        except IntoneError as e:
            raise InvalidRequestError("audio", str(e)) from None
        info = state.voices.add(name, transcript, samples, rate, features)
        return info.__dict__

    @app.get("/v1/audio/voices")
    async def list_voices(request: Request):
        return {"object": "list", "data": [v.__dict__ for v in request.app.state.voices.list()]}

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str, request: Request):
        request.app.state.voices.delete(name)
        return {"name": name, "deleted": True}
