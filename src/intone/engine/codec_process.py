"""The codec stage in a process of its own (`codec.process: true`).

Why: the engine loop, the codec worker and the reference frontend are Python threads of one
process, and they take turns on one GIL; the codec's eager launches (CosyVoice3: ten DiT passes
per call) then delay the AR steps, and the other way round. Here the codec runs in a child
process of the engine core with its own interpreter, its own copy of the model and its own CUDA
context; it keeps each request's codec state (invariant 4: dropped on the request's last chunk,
or when the engine says the request ended) and gets, per chunk, the chunk, the request's codes so
far and, once, the codec part of its prompt. The engine side (`CodecProcess`) has the
`CodecWorker` interface, so the core drives either the same way.

Engine -> codec: ("chunks", [Job, ...]) | ("release", request_id) | ("shutdown",)
Codec -> engine: ("ready", None) once its warm-up is done | ("decoded", [(job, audio | error)], seconds,
                 calls, live requests) | ("fatal", traceback)
Deadlines are perf_counter instants: CLOCK_MONOTONIC, the same clock in both processes.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from intone.engine.child import StageChild, stage_main
from intone.engine.codec_worker import ChunkQueue, DecodedBatch, alone_predicate, decode_batch, hold_seconds
from intone.engine.config import Profile
from intone.engine.loading import codec_stage_for, load_for_profile, set_cudnn, warm_up_codec


@dataclass
class Job:
    id: int
    chunk: object  # chunk_planner.Chunk
    codes: object  # Tensor [K, n]: the request's codes so far (CPU)
    prompt: object  # the codec part of the request's Prompt on its first chunk, else None
    speed: float
    deadline: float
    listened: bool | None  # its request's frontier: streamed (True), a non-streamed piece (False), none (None)

    # a queued (request, job) reads as the worker's (request, chunk) to `hold_seconds`' predicates
    @property
    def start(self) -> int:
        return self.chunk.start

    @property
    def finished(self) -> bool:
        return self.chunk.finished

    @property
    def prepare(self) -> bool:
        return self.chunk.prepare


@dataclass
class Listening:
    """The part of a request's frontier the codec's schedule reads."""

    listened: bool


@dataclass
class CodecRequest:
    """A request as the codec stage reads it (the fields it shares with EngineRequest)."""

    request_id: str
    prompt: object
    speed: float
    codes: object = None
    codec_state: object = None
    frontier: Listening | None = None


class CodecProcess:
    """Engine side: spawns the codec process and hands it chunks, with CodecWorker's interface."""

    def __init__(self, model_spec: str, profile: Profile):
        self.max_batch = profile.codec.max_batch
        self._child = StageChild("intone.engine.codec_process", model_spec, profile, "codec process")
        self._deadline_order = profile.codec.schedule == "deadline"
        self._pending: dict[int, tuple] = {}  # job id -> (EngineRequest, Chunk, tokens)
        self._prompted: set[str] = set()  # requests whose prompt the codec process has
        self._next_id = 0
        self._done: list[DecodedBatch] = []
        self.in_flight = 0
        self.calls = 0
        self.live_requests = 0  # requests with state in the codec process (as last reported)

    def wait_ready(self) -> None:
        """Block until the codec process has loaded and warmed up (before the AR graphs are captured)."""
        self._child.wait_ready()

    def submit(self, items: list, tokens: list[int], deadlines: list[float] | None = None) -> None:
        now = time.perf_counter()
        jobs = []
        for (req, chunk), n, deadline in zip(items, tokens, deadlines or [now] * len(items)):
            # clone: a pickled view carries its whole buffer (max_new_tokens frames), the copy only these
            listened = req.frontier.listened if req.frontier is not None else None
            job = Job(self._next_id, chunk, req.codes[:, : req.num_frames].clone(), None, req.speed, deadline, listened)
            if req.request_id not in self._prompted:
                self._prompted.add(req.request_id)
                p = req.prompt
                job.prompt = dataclasses.replace(p, tokens=p.tokens[:0], codes=p.codes[:0])
            self._pending[job.id] = (req, chunk, n)
            self._next_id += 1
            jobs.append(job)
        self.in_flight += len(jobs)
        self._child.send(("chunks", jobs))

    def release(self, request_id: str) -> None:
        """A request ended: the codec process drops its state and any of its chunks still waiting."""
        self._prompted.discard(request_id)
        self._child.send(("release", request_id))

    @property
    def queued(self) -> int:
        """Chunks beyond the one call's worth the codec process may be decoding (an estimate from
        here: the process takes what waits when it starts a call)."""
        return max(0, self.in_flight - self.max_batch)

    def collect(self) -> list[DecodedBatch]:
        self._check_alive()
        while True:
            try:
                self._receive(self._child.receive(zmq.NOBLOCK))
            except zmq.Again:
                break
        done, self._done = self._done, []
        self.in_flight -= sum(len(d.items) for d in done)
        return done

    def wait(self, timeout: float) -> None:
        if not self._done:
            self._child.pull.poll(int(timeout * 1000))

    def close(self) -> None:
        self._child.close()

    @property
    def pid(self) -> int:
        return self._child.process.pid

    def _check_alive(self) -> None:
        self._child.check_alive()

    def _receive(self, msg: tuple) -> None:
        if msg[0] == "decoded":
            _, results, seconds, self.calls, self.live_requests = msg
            entries = [self._pending.pop(job_id) for job_id, _ in results]
            audio = [a if isinstance(a, np.ndarray) else RuntimeError(a) for _, a in results]
            self._done.append(DecodedBatch([(r, c) for r, c, _ in entries], audio, seconds, [n for _, _, n in entries]))


# ---- the codec process ----------------------------------------------------------------------


def serve(model_spec: str, profile: Profile, pull: zmq.Socket, push: zmq.Socket) -> None:
    if profile.codec.device is not None:  # the stage on a device of its own (e.g. a second GPU)
        profile = profile.model_copy(update={"device": profile.codec.device})
    model = load_for_profile(model_spec, profile)
    c = profile.codec
    stage = codec_stage_for(model, profile)
    with torch.inference_mode():
        if model.device.type == "cuda":
            set_cudnn(profile)
            warm_up_codec(stage, profile, model)
        push.send(pickle.dumps(("ready", None)))
        # first and preempt: every chunk from frame 0 goes ahead here, prepares included (design.md); awaited:
        # the worker's predicate, whose reads a queued (request, job) answers as the worker's items do
        first = (lambda item: item[1].chunk.start == 0) if c.schedule in ("first", "preempt") else \
            alone_predicate(c.schedule)
        _loop(stage, ChunkQueue(c.call_size, first), pull, push, call_hold(profile))


def call_hold(profile: Profile):
    """(queue, oldest) -> seconds the process's next call should still wait: the in-process worker's
    `hold_seconds` with the profile's codec section (gathering pieces, a stream's lead)."""
    c = profile.codec
    lead_s = c.stream_lead_ms / 1000 if c.stream_lead_ms is not None else None
    return lambda queue, oldest: hold_seconds(queue, oldest, c.gather_ms / 1000, c.max_batch, lead_s)


def _loop(stage, queue: ChunkQueue, pull: zmq.Socket, push: zmq.Socket, hold=lambda queue, oldest: 0.0) -> None:
    """hold(queue, oldest): seconds the next call should still wait for more chunks (`hold_seconds`: the
    in-process worker's gathering, with the same profile)."""
    requests: dict[str, CodecRequest] = {}
    oldest = None  # when the oldest chunk still waiting arrived
    while True:
        wait = hold(queue, oldest) if len(queue) else None
        timeout = None if wait is None else math.ceil(wait * 1000)  # block only with nothing to decode
        while pull.poll(timeout):
            msg = pickle.loads(pull.recv())
            if msg[0] == "shutdown":
                return
            if msg[0] == "release":
                requests.pop(msg[1], None)
                dropped = queue.drop(lambda item, rid=msg[1]: item[0].request_id != rid)
                if dropped:
                    push.send(pickle.dumps(("decoded", [(j.id, "the request ended") for _, j in dropped],
                                            0.0, stage.calls, len(requests))))
            else:
                for job in msg[1]:
                    rid = job.chunk.request_id
                    if job.prompt is not None:
                        listening = Listening(job.listened) if job.listened is not None else None
                        requests[rid] = CodecRequest(rid, job.prompt, job.speed, frontier=listening)
                    req = requests[rid]
                    req.codes = job.codes
                    oldest = oldest if len(queue) else time.perf_counter()
                    queue.push((req, job), 0, job.deadline)
            timeout = 0
        if len(queue) and hold(queue, oldest) <= 0:
            _decode(stage, queue, requests, push)
            oldest = oldest if len(queue) else None  # a capped call's leftovers stay due


def _decode(stage, queue: ChunkQueue, requests: dict, push: zmq.Socket) -> None:
    taken, _ = queue.take()
    start = time.perf_counter()
    audio = decode_batch(stage, [(req, job.chunk) for req, job in taken])
    seconds = time.perf_counter() - start
    results = []
    for (req, job), samples in zip(taken, audio):
        results.append((job.id, samples if isinstance(samples, np.ndarray) else f"{type(samples).__name__}: {samples}"))
        if job.chunk.finished:
            requests.pop(req.request_id, None)
    push.send(pickle.dumps(("decoded", results, seconds, stage.calls, len(requests)), protocol=pickle.HIGHEST_PROTOCOL))


def main(argv=None) -> None:
    stage_main("intone.engine.codec_process", "codec", serve, argv)


if __name__ == "__main__":
    main()
