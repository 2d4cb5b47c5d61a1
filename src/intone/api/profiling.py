"""POST /start_profile and /stop_profile (vLLM's names): a torch profiler window over the served load in
every engine core, on servers started with `--profile-dir`.

A stop answers, per engine, its trace file (chrome trace, gzipped) and the window's summary
(`engine.timeline`: how busy the GPU was and whose kernels held it), also written beside the trace; the
summary is computed off the engine's loop and off this server's, in a process of its own. Profiling slows
the engine: a profiled window's speeds are diagnostics, not figures to quote.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from intone.api.schema import error_body
from intone.engine.client import EngineDead, ProfileRefused
from intone.errors import IntoneError

PROFILE_PATHS = ("/start_profile", "/stop_profile")  # guarded by the API key like /v1/
SUMMARY_TIMEOUT_S = 600.0


def _off() -> JSONResponse:
    return JSONResponse(error_body("profiling is off: start the server with --profile-dir DIR"), 404)


def _refused(e: BaseException) -> JSONResponse:
    """A refusal (409), a timeout (504) or a failure (500) as JSON; an engine that died goes to the app's 503."""
    if isinstance(e, EngineDead) or not isinstance(e, (IntoneError, TimeoutError)):
        raise e
    if isinstance(e, ProfileRefused):
        return JSONResponse(error_body(str(e), None, "invalid_request_error", "profile_state"), 409)
    if isinstance(e, TimeoutError):
        return JSONResponse(error_body("the engine did not answer the profiler in time", None, "server_error"), 504)
    return JSONResponse(error_body(f"the profiler failed: {e}", None, "server_error"), 500)


async def summarized(window: dict) -> dict:
    """The window's summary, written beside its trace (TRACE -> TRACE's stem + .summary.json) by a process of
    its own (`engine.timeline`): parsing a busy GPU's trace holds an interpreter for seconds, and this one
    serves the streams."""
    trace = Path(window["trace"])
    path = trace.with_name(trace.name.removesuffix(".gz").removesuffix(".json") + ".summary.json")
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "intone.engine.timeline", str(trace), "--threads", json.dumps(window["threads"]),
        "--wall-s", str(window["wall_s"]), "--json", str(path), stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(child.communicate(), SUMMARY_TIMEOUT_S)
    finally:  # timed out, or the request was cancelled
        if child.returncode is None:
            child.kill()
            await child.wait()
    if child.returncode != 0:
        raise IntoneError(f"summarizing {trace.name} failed: {err.decode(errors='replace')[-500:]}")
    return dict(trace=window["trace"], summary_file=str(path), wall_s=window["wall_s"],
                ended_by_itself=window["ended_by_itself"], summary=json.loads(path.read_text()))


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
            return _refused(failed[0])
        return {"profiling": True, "engines": len(slots), "directory": str(directory),
                "max_seconds": started[0]["max_seconds"]}

    @app.post("/stop_profile")
    async def stop_profile(request: Request):
        if request.app.state.settings.profile_dir is None:
            return _off()
        slots = request.app.state.engine.slots
        stopped = await asyncio.gather(*(s.engine.profile_window("stop") for s in slots), return_exceptions=True)
        if all(isinstance(r, BaseException) for r in stopped):
            return _refused(stopped[0])
        async def row(slot, window) -> dict:  # an engine whose window failed (or had none) says so in its row
            try:
                if isinstance(window, BaseException):
                    raise window
                return {"engine": slot.index, **await summarized(window)}
            except (IntoneError, TimeoutError, OSError, ValueError) as e:
                return {"engine": slot.index, "error": str(e) or type(e).__name__}
        return {"engines": list(await asyncio.gather(*(row(s, w) for s, w in zip(slots, stopped))))}
