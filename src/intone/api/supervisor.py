"""Keeps an engine core behind the API (one supervisor per core of the pool): a core that dies, or whose loop stays silent past
`hang_s` (it is then killed), is replaced by a fresh one, after a back-off that doubles while
starts keep failing; or, with policy "exit", the API process stops so that the deployment's own
supervisor (systemd, Kubernetes) restarts the whole server.

Requests in flight on a dead core have already ended with an error (EngineDead); while the new
core starts, the pool's other cores take the new requests; with none left, /v1/audio answers 503
with Retry-After and /health says "restarting".
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Awaitable, Callable

from intone.engine.client import Engine

log = logging.getLogger("intone.server")
POLL_S = 0.25
PROFILE_GRACE_S = 120.0  # more silence allowed while a profiler window is open or closing (its loop pauses)


class EngineSupervisor:
    """Watches `slot.engine` (an object with an `engine` attribute and a `name` for the logs) and
    replaces it there; `on_restart` is called after each replacement."""

    def __init__(self, slot, start: Callable[[], Awaitable[Engine]], on_restart: Callable[[], None] = lambda: None,
                 policy: str = "restart", hang_s: float = 60.0, backoff_s: float = 1.0, max_backoff_s: float = 60.0):
        self.slot, self.start, self.on_restart = slot, start, on_restart
        self.policy, self.hang_s = policy, hang_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.restarts = 0
        self.restarting = False
        self._task: asyncio.Task | None = None

    def begin(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _watch(self) -> None:
        name = self.slot.name
        while True:
            engine: Engine = self.slot.engine
            while not engine.dead:
                await asyncio.sleep(POLL_S)
                # a core closing a profiler window pauses its loop for a while: not a hang, up to a bound
                limit = self.hang_s + (PROFILE_GRACE_S if engine.profile_open or engine.profile_stops else 0)
                if self.hang_s > 0 and engine.silent_for() > limit and not engine.dead:
                    log.error("%s: engine core silent for %.0f s: killing it", name, engine.silent_for())
                    engine.kill()
            if self.policy == "exit":
                log.critical("%s: engine core died (%s); stopping the server (--engine-restart exit)", name, engine.dead)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            self.restarting = True
            await engine.shutdown(timeout=5)
            self.slot.engine = await self._fresh(engine.dead)
            self.restarts += 1
            self.on_restart()
            self.restarting = False

    async def _fresh(self, reason: str) -> Engine:
        delay = self.backoff_s
        while True:
            log.error("%s: engine core died (%s); starting a new one in %.1f s", self.slot.name, reason, delay)
            await asyncio.sleep(delay)
            try:
                engine = await self.start()
                log.info("%s: engine core restarted (%d restarts so far)", self.slot.name, self.restarts + 1)
                return engine
            except Exception as e:  # noqa: BLE001 - a failed start is retried after a longer wait
                reason = f"start failed: {e}"
                delay = min(2 * delay, self.max_backoff_s)
