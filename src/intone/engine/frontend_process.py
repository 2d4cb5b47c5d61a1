"""The reference frontend's networks in processes of their own (`frontend.process: true`).

Why: the frontend workers are threads of the engine process, and with a fresh voice per request
their work (the clips' features, the networks' launches and replays, the waits for their results)
runs beside the engine loop's all the time; measured over HTTP (session 37), the loop's host time per
step was twice what it was with cached references. Here each frontend worker thread hands its clips
to a child process of its own (its own interpreter and CUDA context, its own copy of the model, its
own frontend graphs) and waits on a socket, off the GIL; the thread keeps the rest (the reference
cache, the request's prompt, handing it back to the loop). A clip gets the same features as in the
thread: the same model, the same code, one clip's result does not depend on its company. Off by default: the
loop's step shortened, but a clip took twice as long here (session 37; docs/design.md).

Engine -> frontend: ("encode", batch, [(audio, sample rate), ...]) | ("shutdown",)
Frontend -> engine: ("ready", None) once warmed up | ("clip", batch, index, features | error) as each
                    clip is done | ("done", batch, seconds encoding it, graph replays, eager runs) |
                    ("fatal", traceback)
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time

import numpy as np
import torch
import zmq

from intone.engine.child import POLL_MS, StageChild, stage_main
from intone.engine.config import Profile
from intone.engine.cuda_graphs import FunctionGraphs
from intone.engine.frontend_stage import features_as_numpy
from intone.engine.loading import load_for_profile, set_cudnn
from intone.engine.streams import own_stream

log = logging.getLogger(__name__)


class FrontendProcess:
    """Engine side: spawns one frontend process and encodes clips there (one batch at a time)."""

    def __init__(self, model_spec: str, profile: Profile, index: int = 0):
        self._child = StageChild("intone.engine.frontend_process", model_spec, profile, f"frontend process {index}")
        self._lock = threading.Lock()  # a worker thread, or the loop for a stored voice: one batch at a time
        self._batches = 0
        # as the process measured them: its seconds encoding (the rest of a worker's wait is messages and
        # queueing there), and its networks' calls replayed from a graph or run eagerly
        self.encode_seconds = 0.0
        self.graph_replays = self.eager_runs = 0

    def wait_ready(self) -> None:
        """Block until the process has loaded the model and warmed up its frontend (before the engine's
        own CUDA graphs are captured)."""
        self._child.wait_ready()

    def encode(self, clips: list[tuple[torch.Tensor, int]]):
        """(index, features by name as CPU tensors, or the exception) per clip, as the process finishes
        each (`TTSModel.reference_features_as_ready` there)."""
        with self._lock:
            self._batches += 1
            batch = self._batches
            payload = [(np.ascontiguousarray(torch.as_tensor(a, dtype=torch.float32).numpy()), int(r))
                       for a, r in clips]
            self._child.send(("encode", batch, payload))
            while True:
                while not self._child.pull.poll(POLL_MS):
                    self.check_alive()
                msg = self._child.receive()
                if msg[1] != batch:  # the rest of a batch whose reader stopped early
                    continue
                if msg[0] == "done":
                    _, _, seconds, self.graph_replays, self.eager_runs = msg
                    self.encode_seconds += seconds
                    return
                _, _, index, result = msg
                yield index, result if isinstance(result, Exception) else \
                    {name: torch.from_numpy(value) for name, value in result.items()}

    def check_alive(self) -> None:
        self._child.check_alive()

    def close(self) -> None:
        self._child.close()

    @property
    def pid(self) -> int:
        return self._child.process.pid


# ---- the frontend process ---------------------------------------------------------------------


def serve(model_spec: str, profile: Profile, pull: zmq.Socket, push: zmq.Socket) -> None:
    model = load_for_profile(model_spec, profile)
    if model.device.type == "cuda" and profile.host_threads is None:
        # Its host ops are a clip's checks and copies: a pool of OpenMP threads per core in every frontend
        # process, beside the engine's own, would only oversubscribe the cores its parallel regions wait for.
        torch.set_num_threads(1)
    model.configure_frontend(profile.options_for(model.name))
    stream = graphs = None
    if model.device.type == "cuda":
        set_cudnn(profile)
        priority = -100 if profile.frontend.high_priority else 0  # CUDA clamps it to its highest
        graphs = FunctionGraphs(priority) if profile.frontend.cuda_graphs else None
        # captured here, before the first clip: nothing else of this process uses the GPU meanwhile
        model.warm_up_frontend(graphs)
        stream = own_stream(model.device, "frontend process", priority)
        if graphs is not None:
            log.info("captured %d frontend graphs in %.1f s (%d failed and run eagerly)", graphs.report.graphs,
                     graphs.report.seconds, graphs.report.failed)
    push.send(pickle.dumps(("ready", None)))
    while True:
        msg = pickle.loads(pull.recv())
        if msg[0] == "shutdown":
            return
        _, batch, clips = msg
        start = time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for index, result in model.reference_features_as_ready([(torch.from_numpy(a), r) for a, r in clips]):
                push.send(pickle.dumps(("clip", batch, index, _portable(result)), protocol=pickle.HIGHEST_PROTOCOL))
        push.send(pickle.dumps(("done", batch, time.perf_counter() - start, graphs.replays if graphs else 0,
                                graphs.eager if graphs else 0)))


def _portable(result):
    """Features as numpy arrays by name, or the clip's exception as it can cross the socket (its own
    type where it pickles, e.g. InvalidRequestError with its field; else a RuntimeError saying what it was)."""
    if not isinstance(result, Exception):
        return features_as_numpy(result)
    try:
        pickle.loads(pickle.dumps(result))
        return result
    except Exception:  # noqa: BLE001 - any exception type a model may raise
        return RuntimeError(f"{type(result).__name__}: {result}")


def main(argv=None) -> None:
    stage_main("intone.engine.frontend_process", "frontend", serve, argv)


if __name__ == "__main__":
    main()
