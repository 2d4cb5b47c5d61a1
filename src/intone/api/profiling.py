"""POST /start_profile and /stop_profile (vLLM's names): a torch profiler window over the served load in
every engine core, on servers started with `--profile-dir`.

A stop answers, per engine, its trace file (chrome trace, gzipped) and the window's summary
(`engine.timeline`: how busy the GPU was and whose kernels held it), also written beside the trace.
The summary is computed here, off the engine's loop. Profiling slows the engine: a profiled window's
speeds are diagnostics, not figures to quote.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from intone.api.schema import error_body
from intone.engine.client import ProfileRefused
from intone.engine.timeline import read_trace, summarize
from intone.errors import IntoneError

PROFILE_PATHS = ("/start_profile", "/stop_profile")  # guarded by the API key like /v1/


def _off() -> JSONResponse:
    return JSONResponse(error_body("profiling is off: start the server with --profile-dir DIR"), 404)


def _refused(e: Exception) -> JSONResponse:
    if isinstance(e, ProfileRefused):
        return JSONResponse(error_body(str(e), None, "invalid_request_error", "profile_state"), 409)
    return JSONResponse(error_body(f"the profiler failed: {e}", None, "server_error"), 500)


def summarized(window: dict) -> dict:
    """The window's summary, also written beside its trace (TRACE -> TRACE's stem + .summary.json)."""
    summary = summarize(read_trace(window["trace"]), window["threads"], window["wall_s"])
    trace = Path(window["trace"])
    path = trace.with_name(trace.name.removesuffix(".gz").removesuffix(".json") + ".summary.json")
    path.write_text(json.dumps(summary, indent=1))
    return dict(trace=window["trace"], summary_file=str(path), wall_s=window["wall_s"],
                ended_by_itself=window["ended_by_itself"], summary=summary)


def install_profile_routes(app: FastAPI) -> None:
    @app.post("/start_profile")
    async def start_profile(request: Request):
        directory = request.app.state.settings.profile_dir
        if directory is None:
            return _off()
        slots = request.app.state.engine.slots
        started = await asyncio.gather(*(s.engine.profile_window("start", str(Path(directory) / f"engine-{s.index}"))
                                         for s in slots), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:  # all or none: the engines that did start are stopped again
            await asyncio.gather(*(s.engine.profile_window("stop") for s, r in zip(slots, started)
                                   if not isinstance(r, BaseException)), return_exceptions=True)
            if not isinstance(failed[0], IntoneError):
                raise failed[0]
            return _refused(failed[0])
        return {"profiling": True, "engines": len(slots), "directory": str(directory),
                "max_seconds": started[0]["max_seconds"]}

    @app.post("/stop_profile")
    async def stop_profile(request: Request):
        if request.app.state.settings.profile_dir is None:
            return _off()
        slots = request.app.state.engine.slots
        stopped = await asyncio.gather(*(s.engine.profile_window("stop") for s in slots), return_exceptions=True)
        windows = [(s, r) for s, r in zip(slots, stopped) if not isinstance(r, BaseException)]
        if not windows:
            if not isinstance(stopped[0], IntoneError):
                raise stopped[0]
            return _refused(stopped[0])
        out = []
        for slot, window in windows:
            out.append({"engine": slot.index, **await asyncio.to_thread(summarized, window)})
        return {"engines": out}
