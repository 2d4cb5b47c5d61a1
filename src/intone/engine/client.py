"""The in-process API: `Engine` starts an engine-core process and streams its audio chunks.

    engine = await Engine.from_profile("fish-s2-high-concurrency", model="tiny:fish-s2")
    async for chunk in engine.generate(SynthesisRequest("id-1", "Hello")):
        ...
    await engine.shutdown()

Leaving the `async for` early (break, exception, task cancellation) aborts the request, so
its KV blocks and state are freed in the core.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import AsyncIterator

import zmq
import zmq.asyncio

from intone.engine.config import Profile, load_profile
from intone.engine.work import OpenWork, expected_frames
from intone.errors import IntoneError
from intone.models import default_profile
from intone.protocol import AudioChunk, SynthesisRequest

log = logging.getLogger("intone.engine")
STARTUP_TIMEOUT_S = 600
STATS_TIMEOUT_S = 2.0
PROFILE_TIMEOUT_S = 300.0  # a stop writes the window's trace: seconds to minutes for a busy GPU's


class ProfileRefused(IntoneError):
    """The core refused a profile action (a start while a window runs, a stop with none)."""


class EngineDead(IntoneError):
    pass


class Engine:
    def __init__(self, process, ctx, push, pull, info: dict, tmpdir: tempfile.TemporaryDirectory):
        self._process, self._ctx, self._push, self._pull = process, ctx, push, pull
        self.info = info
        self._tmpdir = tmpdir
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._encode_waiters: dict[str, asyncio.Future] = {}
        self._profile_waiters: dict[str, asyncio.Future] = {}
        self.profile_stops = 0  # stops waiting for their trace: the core's loop may pause to close a window
        self.profile_open = False  # a window started and no stop answered yet (it may close by itself)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self.dead: str | None = None
        self._closed = False
        self.last_heard = time.monotonic()  # any message from the core, heartbeats included
        self.work = OpenWork()  # frames the open requests still owe (engine/work.py)

    @property
    def sample_rate(self) -> int:
        return self.info["sample_rate"]

    @property
    def frames_per_second(self) -> float:
        return self.info["sample_rate"] / self.info["samples_per_frame"]

    @property
    def pid(self) -> int:
        return self._process.pid

    def outstanding_frames(self) -> int:
        """Frames this engine still owes its open requests (estimated; see engine/work.py)."""
        return self.work.owed()

    @classmethod
    async def from_profile(cls, profile: Profile | str | None = None, model: str = "tiny:fish-s2",
                           trace_frames: str | None = None, env: dict[str, str] | None = None,
                           **overrides) -> "Engine":
        """env: the core process's environment (default: this one's), e.g. its CUDA_VISIBLE_DEVICES."""
        if not isinstance(profile, Profile):
            profile = load_profile(profile or default_profile(model), **overrides)
        tmpdir = tempfile.TemporaryDirectory(prefix="intone-")
        inbox = f"ipc://{Path(tmpdir.name) / 'in'}"
        outbox = f"ipc://{Path(tmpdir.name) / 'out'}"
        ctx = zmq.asyncio.Context()
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(inbox)
        pull.bind(outbox)
        cmd = [sys.executable, "-m", "intone.engine.process", "--model", model,
               "--profile-json", json.dumps(profile.model_dump()), "--inbox", inbox, "--outbox", outbox]
        if trace_frames:
            cmd += ["--trace-frames", str(trace_frames)]
        process = subprocess.Popen(cmd, env=env)
        try:
            kind, payload = await asyncio.wait_for(_recv(pull, process), STARTUP_TIMEOUT_S)
        except BaseException:
            process.kill()
            raise
        if kind != "ready":
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:  # the reason is in the payload; a slow teardown must not hide it
                process.kill()
            raise EngineDead(f"engine core failed to start:\n{payload}")
        return cls(process, ctx, push, pull, payload, tmpdir)

    async def _read(self) -> None:
        try:
            while True:
                kind, payload = await _recv(self._pull, self._process)
                self.last_heard = time.monotonic()
                if kind == "fatal":
                    raise EngineDead(payload)
                if kind == "alive":
                    for rid, frames in (payload or {}).items():
                        self.work.progress(rid, frames)
                    continue
                if kind == "stats":
                    if self._stats_waiters:
                        self._stats_waiters.pop(0).set_result(payload)
                    continue
                if kind in ("encoded", "profiled"):
                    token, result, error = payload
                    waiters = self._encode_waiters if kind == "encoded" else self._profile_waiters
                    waiter = waiters.pop(token, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result((result, error))
                    continue
                for chunk in payload:
                    queue = self._queues.get(chunk.request_id)
                    if queue is not None:
                        self.work.progress(chunk.request_id, chunk.end_frame)
                        queue.put_nowait(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the core is gone: every waiting stream ends with an error
            self.dead = str(e) or type(e).__name__
            if self._closed:  # shutdown() asked it to stop: its exit is the expected end, not a failure
                log.info("engine core stopped: %s", self.dead)
            else:
                log.error("engine core died: %s", self.dead)
            for queue in self._queues.values():
                queue.put_nowait(e)
            for waiter in [*self._stats_waiters, *self._encode_waiters.values(), *self._profile_waiters.values()]:
                if not waiter.done():
                    waiter.set_exception(EngineDead(self.dead))

    async def generate(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        if self.dead:
            raise EngineDead(f"engine core is dead: {self.dead}")
        rid = request.request_id
        if rid in self._queues:
            raise IntoneError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self.work.open(rid, expected_frames(request, self.frames_per_second))
        finished = False
        try:
            self._post(("add", request))
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise EngineDead(f"engine core died: {item}")
                finished = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            self.work.close(rid)
            if not finished and not self.dead:
                self._post(("abort", rid))  # no await: this may run while the generator closes

    def _post(self, msg: tuple) -> None:
        self._push.send(pickle.dumps(msg))

    def silent_for(self) -> float:
        """Seconds since the core last said anything (it says it is alive about every second)."""
        return time.monotonic() - self.last_heard

    async def stats(self, timeout: float = STATS_TIMEOUT_S) -> dict:
        """The core's counters and occupancy (see EngineCore.snapshot); TimeoutError if a hung
        core does not answer in time."""
        if self.dead:
            raise EngineDead(f"engine core is dead: {self.dead}")
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(waiter)
        self._post(("stats",))
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            if waiter in self._stats_waiters:  # a late answer must not go to the next caller
                self._stats_waiters.remove(waiter)
            raise

    def _ask(self, waiters: dict, kind: str, *args) -> tuple[str, asyncio.Future]:
        """Post (kind, token, *args) under a fresh token; the future gets the core's (result, error) for it."""
        if self.dead:
            raise EngineDead(f"engine core is dead: {self.dead}")
        token = uuid.uuid4().hex
        waiter = waiters[token] = asyncio.get_running_loop().create_future()
        self._post((kind, token, *args))
        return token, waiter

    async def encode_reference(self, audio, sample_rate: int):
        """Mono float32 audio -> the model's reference features (numpy arrays by name)."""
        _, waiter = self._ask(self._encode_waiters, "encode", audio, sample_rate)
        features, error = await waiter
        if error:
            raise IntoneError(f"cannot encode the reference audio: {error}")
        return features

    async def profile_window(self, action: str, directory: str | None = None,
                             timeout: float = PROFILE_TIMEOUT_S) -> dict:
        """action "start" (a torch profiler window, its trace to go in `directory`) or "stop" (the window's
        trace file, length and thread names; engine/profiling.py). ProfileRefused: a start while a window
        runs, a stop with none; IntoneError: the profiler failed."""
        token, waiter = self._ask(self._profile_waiters, "profile", action, directory)
        self.profile_stops += action == "stop"
        try:
            result, error = await asyncio.wait_for(waiter, timeout)
        finally:
            self._profile_waiters.pop(token, None)
            self.profile_stops -= action == "stop"
        self.profile_open = action == "start" and error is None
        if error is not None:
            kind, message = error
            raise (ProfileRefused if kind == "refused" else IntoneError)(message)
        return result

    def kill(self) -> None:
        """Stop a hung core at once: the reader then sees it exit and ends every stream with EngineDead."""
        if self._process.poll() is None:
            self._process.kill()

    async def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    async def shutdown(self, timeout: float = 30) -> None:
        """Abort what is in flight, stop the core process, release the sockets (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self._process.poll() is None:
            self._post(("shutdown",))
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._process.wait, timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
        self._reader.cancel()
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        self._tmpdir.cleanup()


async def _recv(sock: zmq.asyncio.Socket, process) -> tuple:
    """Next message; notices a core that died without a word."""
    while True:
        if await sock.poll(1000):
            return pickle.loads(await sock.recv())
        if process.poll() is not None:
            raise EngineDead(f"engine core exited with code {process.returncode}")


def new_request_id() -> str:
    return uuid.uuid4().hex
