"""The engine core's process dies with the process that started it (issue 15: no orphans)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

PARENT = textwrap.dedent("""
    import asyncio, json, sys
    from intone.engine.client import Engine

    async def main():
        engine = await Engine.from_profile(None, model="tiny:fish-s2", device="cpu")
        print(json.dumps({"pid": engine._process.pid, "dir": engine._tmpdir.name}), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_killing_the_parent_ends_the_engine_and_removes_its_sockets(tiny_cache):
    env = {**os.environ, "INTONE_CACHE": str(tiny_cache)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(parent.stdout.readline())
        assert _alive(info["pid"]) and Path(info["dir"]).exists()
        parent.kill()  # SIGKILL: no clean shutdown reaches the engine
        parent.wait(10)
        deadline = time.time() + 15
        while time.time() < deadline and (_alive(info["pid"]) or Path(info["dir"]).exists()):
            time.sleep(0.2)
        assert not _alive(info["pid"]), "the engine outlived its parent"
        assert not Path(info["dir"]).exists(), "the IPC sockets were left behind"
    finally:
        parent.kill()
