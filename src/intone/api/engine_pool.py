"""Data parallel on one host: N engine cores behind one API server, shown to the routes as one engine.

Each core is its own process on its own device (`--devices`; several may share one), with its own
supervisor (api/supervisor.py): one that dies or hangs is replaced while the others keep serving.

Routing, per engine request (a long input's segments are routed one by one):
- load: the engine that owes the fewest frames (engine/work.py: the frames its open requests are
  expected to make, less what they have made) among those serving; ties go to the one sent fewer
  requests so far. Queued frames, not request counts: one long utterance outweighs many short ones.
- affinity: a request whose reference clip (blake2b of its float32 samples and rate: the engine's own
  reference-cache key) was last sent to engine k goes to k again, so that k's cache saves the
  encoder pass, unless k owes more than AFFINITY_FACTOR x the least loaded engine's frames plus
  AFFINITY_SLACK_FRAMES. Stored voices carry their features and need no affinity: any engine serves them.
- an engine that is dead, restarting or silent past --engine-silence-seconds gets nothing new (a
  silent one still does if no engine is serving); with none alive the request fails (503).
Requests in flight on an engine that dies end with EngineDead (the routes answer it as a clean error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from intone.api.supervisor import EngineSupervisor
from intone.engine.client import Engine, EngineDead
from intone.protocol import AudioChunk, SynthesisRequest, clip_key

log = logging.getLogger("intone.server")

AFFINITY_FACTOR = 1.5
AFFINITY_SLACK_FRAMES = 256  # ~12 s of Fish audio (21.5 frames/s), ~10 s of CosyVoice3's (25/s)
AFFINITY_KEYS = 8192  # reference clips remembered (least recently sent forgotten first)
STATE_ORDER = ("restarting", "unresponsive", "dead")  # what /health says when no engine serves


@dataclass
class EngineSlot:
    """One place in the pool: the engine now serving it (replaced by its supervisor)."""

    index: int
    device: str
    start: Callable[[], Awaitable[Engine]]
    engine: Engine | None = None
    supervisor: EngineSupervisor | None = None
    routed: int = 0

    @property
    def name(self) -> str:
        return f"engine {self.index}"

    def state(self, silence_s: float) -> str:
        if self.engine.dead:
            return "restarting" if self.supervisor is not None and self.supervisor.restarting else "dead"
        return "unresponsive" if self.engine.silent_for() > silence_s else "ok"


class EnginePool:
    def __init__(self, slots: list[EngineSlot], silence_s: float, metrics):
        self.slots, self.silence_s, self.metrics = slots, silence_s, metrics
        self.info = dict(slots[0].engine.info)
        self._homes: OrderedDict[bytes, int] = OrderedDict()  # reference clip -> the engine last sent it

    @classmethod
    async def start(cls, slots: list[EngineSlot], silence_s: float, metrics) -> "EnginePool":
        """Every engine started at once; if one fails, the others are stopped and the failure raised."""
        started = await asyncio.gather(*(slot.start() for slot in slots), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(r.shutdown() for r in started if isinstance(r, Engine)))
            raise failed[0]
        for slot, engine in zip(slots, started):
            slot.engine = engine
        return cls(slots, silence_s, metrics)

    def supervise(self, policy: str, hang_s: float) -> None:
        for slot in self.slots:
            slot.supervisor = EngineSupervisor(slot, slot.start, lambda i=slot.index: self._restarted(i), policy, hang_s)
            slot.supervisor.begin()

    def _restarted(self, index: int) -> None:
        """A new core has an empty reference cache: clips sent to the old one have no home now."""
        for key in [k for k, home in self._homes.items() if home == index]:
            del self._homes[key]
        self.metrics.engine_restarts.inc()

    # ---- the engine interface the routes use ----------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.info["sample_rate"]

    @property
    def dead(self) -> str | None:
        """None while any engine is alive; else why they are not."""
        if any(not slot.engine.dead for slot in self.slots):
            return None
        return "; ".join(f"{slot.name}: {slot.engine.dead}" for slot in self.slots)

    def silent_for(self) -> float:
        return min(slot.engine.silent_for() for slot in self.slots)

    async def generate(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        keys = await self._clip_keys(request)
        engine = self._route(keys).engine
        # No await between routing and the engine's first step: its account of open work (which the
        # next routing decision reads) includes this request before any other request is routed.
        async with contextlib.aclosing(engine.generate(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def encode_reference(self, audio, sample_rate: int):
        return await self._route([]).engine.encode_reference(audio, sample_rate)

    async def stats(self) -> dict:
        """The counters of every engine that answers, summed (see merge_stats)."""
        return merge_stats([s for s in await self.engine_stats() if s is not None])

    async def engine_stats(self) -> list[dict | None]:
        """Per slot: its core's snapshot, or None (dead, or no answer in time)."""
        async def one(slot: EngineSlot) -> dict | None:
            if slot.engine.dead:
                return None
            try:
                return await slot.engine.stats()
            except (TimeoutError, EngineDead):
                log.warning("%s did not answer a stats request in time", slot.name)
                return None
        return list(await asyncio.gather(*(one(slot) for slot in self.slots)))

    def health(self) -> tuple[int, dict]:
        """(status code, body): 200 while at least one engine serves; each engine's state in `engines`."""
        engines = [dict(engine=slot.index, device=slot.device, status=slot.state(self.silence_s), pid=slot.engine.pid,
                        restarts=slot.supervisor.restarts if slot.supervisor else 0,
                        outstanding_frames=slot.engine.outstanding_frames(), error=slot.engine.dead)
                   for slot in self.slots]
        restarts = sum(e["restarts"] for e in engines)
        serving = sum(e["status"] == "ok" for e in engines)
        if serving:
            return 200, {"status": "ok" if serving == len(engines) else "degraded", "restarts": restarts,
                         "engines": engines}
        status = next(s for s in STATE_ORDER if any(e["status"] == s for e in engines))
        first = next(e for e in engines if e["status"] == status)
        error = first["error"] or f"engine core silent for {self.slots[first['engine']].engine.silent_for():.1f} s"
        return 503, {"status": status, "error": error, "restarts": restarts, "engines": engines}

    async def shutdown(self) -> None:
        await asyncio.gather(*(slot.supervisor.stop() for slot in self.slots if slot.supervisor))
        await asyncio.gather(*(slot.engine.shutdown() for slot in self.slots))

    # ---- routing --------------------------------------------------------------------------------

    async def _clip_keys(self, request: SynthesisRequest) -> list[bytes]:
        clips = [(ref.audio, ref.sample_rate) for ref in request.references if ref.audio is not None]
        if len(self.slots) == 1 or not clips:
            return []
        return await asyncio.to_thread(lambda: [clip_key(audio, rate) for audio, rate in clips])  # ~1 ms per MB

    def _route(self, keys: list[bytes]) -> EngineSlot:
        live = ([s for s in self.slots if s.state(self.silence_s) == "ok"]
                or [s for s in self.slots if not s.engine.dead])
        if not live:
            raise EngineDead(f"every engine core is dead or restarting ({self.dead})")
        owed = {s.index: s.engine.outstanding_frames() for s in live}
        least = min(live, key=lambda s: (owed[s.index], s.routed))
        home = self._home(keys, live, owed)
        near = home is not None and owed[home.index] <= AFFINITY_FACTOR * owed[least.index] + AFFINITY_SLACK_FRAMES
        chosen, reason = (home, "affinity") if near else (least, "load")
        chosen.routed += 1
        self.metrics.routed.labels(str(chosen.index), reason).inc()
        for key in keys:
            self._homes[key] = chosen.index
            self._homes.move_to_end(key)
        while len(self._homes) > AFFINITY_KEYS:
            self._homes.popitem(last=False)
        return chosen

    def _home(self, keys: list[bytes], live: list[EngineSlot], owed: dict[int, int]) -> EngineSlot | None:
        """The live engine last sent most of these clips (the less loaded one of a tie); None if none was."""
        votes: dict[int, int] = {}
        for key in keys:
            if key in self._homes:
                votes[self._homes[key]] = votes.get(self._homes[key], 0) + 1
        candidates = [s for s in live if s.index in votes]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (votes[s.index], -owed[s.index]))


@dataclass
class Placement:
    """Where one engine core runs: its label, the profile's device for it, its process environment."""

    label: str
    device: str | None  # None: the profile's own
    env: dict[str, str]


def place_engines(count: int, devices: list[str] | None, env: dict[str, str], profile_device: str) -> list[Placement]:
    """Engine k runs on devices[k % len(devices)]: "cpu", or a GPU index ("1" or "cuda:1") which the core
    sees alone (CUDA_VISIBLE_DEVICES, an index into the server's own CUDA_VISIBLE_DEVICES when it has
    one). Without `devices` every core takes the profile's device. Several cores on the CPU share
    its threads (OMP_NUM_THREADS, unless set)."""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    placements = []
    for k in range(count):
        name = devices[k % len(devices)] if devices else None
        if name is None:
            placements.append(Placement(profile_device, None, dict(env)))
        elif name == "cpu":
            placements.append(Placement("cpu", "cpu", dict(env)))
        else:
            index = int(name.removeprefix("cuda:"))
            physical = visible[index] if visible else str(index)
            placements.append(Placement(f"cuda:{index}", "cuda", {**env, "CUDA_VISIBLE_DEVICES": physical}))
    on_cpu = [p for p in placements if (p.device or profile_device) == "cpu"]
    if len(on_cpu) > 1 and "OMP_NUM_THREADS" not in env:
        threads = str(max(1, (os.cpu_count() or 1) // len(on_cpu)))
        for p in on_cpu:
            p.env["OMP_NUM_THREADS"] = threads
    return placements


def parse_device(text: str) -> str:
    """A --devices entry: "cpu", "N" or "cuda:N" (N a GPU index) -> "cpu" or "N"; ValueError otherwise."""
    name = text.strip().lower()
    index = name.removeprefix("cuda:")
    if name == "cpu":
        return name
    if not index.isdigit():
        raise ValueError(f"{text!r}: use cpu, a GPU index (0, 1, ...) or cuda:N")
    return index


def merge_stats(snapshots: list[dict]) -> dict:
    """Several cores' snapshots as one: numbers summed, dicts of numbers summed by key, the mean
    step time weighted by steps."""
    merged: dict = {}
    for snap in snapshots:
        for key, value in snap.items():
            if isinstance(value, dict):
                into = merged.setdefault(key, {})
                for k, v in value.items():
                    into[k] = into.get(k, 0) + v
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
    steps = sum(s.get("steps", 0) for s in snapshots)
    if snapshots and "mean_step_ms" in merged:
        merged["mean_step_ms"] = sum(s.get("mean_step_ms", 0) * s.get("steps", 0) for s in snapshots) / max(steps, 1)
    return merged
