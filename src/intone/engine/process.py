"""The engine core's own process: a loop over ZeroMQ messages and engine steps.

In:  ("add", SynthesisRequest) | ("abort", request_id) | ("stats",) | ("encode", token, audio, rate)
     | ("profile", token, "start" | "stop", directory) | ("shutdown",)
Out: ("ready", info) once, then ("chunks", [AudioChunk, ...]) per step with output,
     ("alive", {request_id: frames generated}) about every second from the loop,
     ("stats", dict) per stats request, ("encoded", (token, features | None, error | None)) per
     encode, ("profiled", (token, result | None, (kind, message) | None)) per profile message
     (engine/profiling.py),
     ("fatal", message) if the loop dies.
Messages are pickled; nothing else is shared with the client.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import sys
import time

import zmq

from intone.engine.child import parent_sockets, watch_parent
from intone.engine.config import Profile
from intone.errors import IntoneError

log = logging.getLogger(__name__)

POLL_IDLE_MS = 100
HEARTBEAT_S = 1.0  # the loop says it is alive at least this often (between steps)


def serve(model_spec: str, profile_data: dict, inbox: str, outbox: str, trace_frames: str | None) -> None:
    """Process entry point (spawned): build the core, answer 'ready', loop until 'shutdown'."""
    if inbox.startswith("ipc://"):
        watch_parent(os.getppid(), [inbox, outbox])
    # After the watch: torch and the models take seconds to import, and a parent that dies
    # meanwhile must still take this process with it.
    from intone.engine.core import EngineCore
    from intone.engine.profiling import WindowProfiler

    with parent_sockets(inbox, outbox) as (pull, push):
        core = EngineCore.build(model_spec, Profile.model_validate(profile_data), trace_frames)
        m = core.model
        push.send(pickle.dumps(("ready", dict(
            model=model_spec, name=m.name, sample_rate=m.sample_rate, samples_per_frame=m.samples_per_frame,
            device=str(m.device), capacity=core.profile.ar.max_num_seqs, profile=core.profile.name,
        ))))
        _loop(core, pull, push, WindowProfiler())


def _loop(core, pull: zmq.Socket, push: zmq.Socket, profiler) -> None:
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    beat = 0.0
    while True:
        if time.monotonic() - beat > HEARTBEAT_S:  # from the loop itself: a hung step stops it
            push.send(pickle.dumps(("alive", core.progress())))
            beat = time.monotonic()
        for reply in profiler.poll():  # after the heartbeat: closing an overdue window pauses the loop
            push.send(pickle.dumps(("profiled", reply)))
        timeout = 0 if core.has_work() else POLL_IDLE_MS
        while poller.poll(timeout):
            msg = pickle.loads(pull.recv())
            if msg[0] == "add":
                core.add_request(msg[1])
            elif msg[0] == "abort":
                core.abort(msg[1])
            elif msg[0] == "stats":
                push.send(pickle.dumps(("stats", core.snapshot())))
            elif msg[0] == "encode":  # encoded by the frontend stage; answered after a later step
                _, token, audio, rate = msg
                core.submit_encode(token, audio, rate)
            elif msg[0] == "profile":  # a stop is answered by profiler.poll once its trace is written
                push.send(pickle.dumps(("alive", core.progress())))  # closing a window may pause the loop
                reply = _profile(profiler, *msg[1:])
                if reply is not None:
                    push.send(pickle.dumps(("profiled", reply)))
            elif msg[0] == "shutdown":
                profiler.close()  # a trace still being written is dropped with the process
                for rid in core.request_ids():
                    core.abort(rid)
                push.send(pickle.dumps(("chunks", core.step())))
                core.close()
                if core.tracer:
                    core.tracer.close()
                return
            timeout = 0
        if core.has_work():
            chunks = core.step()
            if chunks:
                push.send(pickle.dumps(("chunks", chunks)))
            for encoded in core.take_encoded():
                push.send(pickle.dumps(("encoded", encoded)))


def _profile(profiler, token: str, action: str, directory: str | None) -> tuple | None:
    """(token, result, None) or (token, None, (kind, message)): "refused" for a start while a window runs or a
    stop with none, "failed" where the profiler failed (the loop serves on either way); None for a stop taken
    (`WindowProfiler.poll` answers it)."""
    try:
        if action == "stop":
            profiler.stop(token)
            return None
        result = profiler.start(directory)
    except IntoneError as e:
        return token, None, ("refused", str(e))
    except Exception as e:  # noqa: BLE001 - a diagnostic's failure must not end the engine
        log.exception("profile %s failed", action)
        return token, None, ("failed", f"{type(e).__name__}: {e}")
    return token, result, None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m intone.engine.process")
    ap.add_argument("--model", required=True)
    ap.add_argument("--profile-json", required=True)
    ap.add_argument("--inbox", required=True)
    ap.add_argument("--outbox", required=True)
    ap.add_argument("--trace-frames", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    try:
        serve(args.model, json.loads(args.profile_json), args.inbox, args.outbox, args.trace_frames)
    except Exception:
        sys.exit(1)


if __name__ == "__main__":
    main()
