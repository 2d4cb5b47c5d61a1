"""What a spawned child of intone (the engine core, the codec process) needs: a watch on its
parent (when the parent is gone, the child goes too) and its pair of sockets to the parent."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import threading
import time
import traceback
from pathlib import Path

import zmq

log = logging.getLogger(__name__)

PARENT_CHECK_S = 0.5


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
