"""What a spawned child of intone (the engine core, the codec and frontend processes) needs: a watch on
its parent (when the parent is gone, the child goes too) and its pair of sockets to the parent; and, for
the engine's stage processes, both ends: `StageChild` (the engine's side) and `stage_main` (the child's)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import zmq

from intone.engine.config import Profile

log = logging.getLogger(__name__)

PARENT_CHECK_S = 0.5
READY_TIMEOUT_S = 900  # a stage child's load and warm-up
POLL_MS = 500  # how often a wait for a stage child checks that it is alive


def watch_parent(parent: int, sockets: list[str]) -> None:
    """Exit when the process that started this one is gone (killed API server: no orphaned
    engine holding GPU memory), removing the IPC socket files and their directory."""
    def run() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        log.error("the parent process %d is gone; this process exits", parent)
        folders = set()
        for address in sockets:
            path = Path(address.removeprefix("ipc://"))
            path.unlink(missing_ok=True)
            folders.add(path.parent)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(3)
    threading.Thread(target=run, name="intone-parent-watch", daemon=True).start()


@contextlib.contextmanager
def parent_sockets(inbox: str, outbox: str):
    """(pull, push) connected to the parent's addresses; an exception inside is told to the parent
    as ("fatal", traceback) before it propagates; the sockets are closed on the way out."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(inbox)
    push.connect(outbox)
    push.setsockopt(zmq.LINGER, 2000)
    try:
        yield pull, push
    except Exception:
        push.send(pickle.dumps(("fatal", traceback.format_exc())))
        raise
    finally:
        pull.close(0)
        push.close()
        ctx.term()


class StageChild:
    """The engine's side of a stage in a child process (`python -m module`, given the model and the
    profile): the process, and a socket each way (jobs out, results in)."""

    def __init__(self, module: str, model_spec: str, profile: Profile, name: str):
        self.name = name
        self._folder = tempfile.mkdtemp(prefix="intone-stage-")
        jobs, results = (f"ipc://{Path(self._folder) / end}" for end in ("jobs", "results"))
        self._ctx = zmq.Context()
        self.push, self.pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self.push.bind(jobs)
        self.pull.bind(results)
        self.process = subprocess.Popen([
            sys.executable, "-m", module, "--model", model_spec, "--profile-json", json.dumps(profile.model_dump()),
            "--jobs", jobs, "--results", results])

    def wait_ready(self) -> None:
        """Block until the child says ("ready", ...): loaded and warmed up (before the engine's own CUDA graphs
        are captured)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} did not start within {READY_TIMEOUT_S} s")
            if self.pull.poll(POLL_MS) and self.receive()[0] == "ready":
                return

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the {self.name} exited with code {self.process.returncode}")

    def send(self, msg: tuple) -> None:
        """Pickle msg to the child; a child that died raises (a PUSH socket with no peer would block for ever)."""
        while not self.push.poll(POLL_MS, zmq.POLLOUT):
            self.check_alive()
        self.push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)

    def receive(self, flags: int = 0) -> tuple:
        """The next message (zmq.Again with NOBLOCK and none waiting); a child's ("fatal", traceback) raises."""
        msg = pickle.loads(self.pull.recv(flags))
        if msg[0] == "fatal":
            raise RuntimeError(f"the {self.name} failed:\n{msg[1]}")
        return msg

    def close(self) -> None:
        """Ask the child to shut down; killed if it has not within 10 s."""
        try:
            self.push.send(pickle.dumps(("shutdown",)), zmq.NOBLOCK)
            self.process.wait(10)
        except (zmq.ZMQError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.push.close(0)
        self.pull.close(0)
        self._ctx.term()
        shutil.rmtree(self._folder, ignore_errors=True)


def stage_main(module: str, role: str, serve: Callable, argv=None) -> None:
    """A stage child's entry point: serve(model_spec, profile, pull, push) with `StageChild`'s arguments; its
    failure is told to the engine (`parent_sockets`) and ends the process with 1."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}")
    for flag in ("--model", "--profile-json", "--jobs", "--results"):
        ap.add_argument(flag, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    watch_parent(os.getppid(), [])
    try:
        with parent_sockets(args.jobs, args.results) as (pull, push):
            serve(args.model, Profile.model_validate(json.loads(args.profile_json)), pull, push)
    except Exception:
        log.exception("the %s process failed", role)
        sys.exit(1)
