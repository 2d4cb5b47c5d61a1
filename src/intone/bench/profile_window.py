"""`intone bench --profile-seconds S`: a profiler window on the server (/start_profile, /stop_profile,
`intone serve --profile-dir`) over part of a measured level, and its summary in the report.

The window opens `--profile-delay` seconds into the level (past its ramp-up) and closes S seconds later
or when the level ends. Profiling slows the engine, so a profiled level's figures are diagnostics: the
report says so beside them.
"""

from __future__ import annotations

import asyncio

import httpx

from intone.engine.timeline import render

STOP_TIMEOUT_S = 600.0  # the server writes the window's trace before it answers


def _error(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"


async def with_profile(load, base_url: str, headers: dict | None, delay_s: float, seconds: float):
    """(the load's result, the server's /stop_profile answer or {"error": why not}) for the coroutine `load`."""
    task = asyncio.ensure_future(load)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=STOP_TIMEOUT_S) as client:
        await asyncio.wait({task}, timeout=delay_s)
        if task.done():
            return task.result(), {"error": f"the level ended within the window's {delay_s} s delay", "ran": False}
        try:
            started = await client.post("/start_profile")
            if started.status_code != 200:
                return await task, {"error": f"/start_profile: {_error(started)}", "ran": False}
            limit = started.json().get("max_seconds")
            if limit is not None and seconds > limit:
                print(f"--profile-seconds {seconds}: the server ends a window after {limit} s", flush=True)
            await asyncio.wait({task}, timeout=seconds)
            stopped = await client.post("/stop_profile")
        except httpx.HTTPError as e:  # the level's own results still count
            return await task, {"error": f"the profiler's request failed: {type(e).__name__}: {e}", "ran": True}
        profile = stopped.json() if stopped.status_code == 200 else \
            {"error": f"/stop_profile: {_error(stopped)}", "ran": True}
    return await task, profile


def profiled_note(results: dict) -> list[str]:
    """A line under the main table for the levels that ran under a profiler window."""
    levels = [f"C{lvl['concurrency']}" for lvl in results["levels"]
              if lvl.get("profile") is not None and lvl["profile"].get("ran", True)]
    return ["", f"**Profiled: {', '.join(levels)} ran under a profiler window (see GPU timeline): diagnostics, "
                "not figures to quote.**"] if levels else []


def profile_lines(level: dict) -> list[str]:
    """The report's section for a level's profiled window (none for a level without one)."""
    profile = level.get("profile")
    if profile is None:
        return []
    head = f"## GPU timeline, C{level['concurrency']}" + \
        (" (a profiled window: this level's figures are diagnostics)" if profile.get("ran", True) else "")
    if "error" in profile:
        return [head, "", f"No timeline: {profile['error']}", ""]
    lines = [head, ""]
    for engine in profile["engines"]:
        if "error" in engine:
            lines += [f"Engine {engine['engine']}: no window ({engine['error']})", ""]
            continue
        ended = " (the window reached the server's limit and ended by itself)" if engine.get("ended_by_itself") else ""
        lines += [f"Engine {engine['engine']}: trace `{engine['trace']}`{ended}", "", "```",
                  render(engine["summary"]), "```", ""]
    return lines
