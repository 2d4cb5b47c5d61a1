"""A child process's watch on its parent: when the parent is gone, the child goes too."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

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
