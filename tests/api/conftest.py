import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base: str, process: subprocess.Popen, log: Path, media: Path):
        self.base, self.process, self.log, self.media = base, process, log, media

    def url(self, path: str) -> str:
        return self.base + path


def start_server(tmp: Path, cache: Path, *extra: str) -> Server:
    port = free_port()
    media = tmp / "media"
    media.mkdir(exist_ok=True)
    log = tmp / "server.log"
    cmd = [sys.executable, "-m", "intone.cli.main", "serve", "--model", "tiny:fish-s2", "--port", str(port),
           "--device", "cpu", "--voices-dir", str(tmp / "voices"), "--allowed-local-media-path", str(media),
           "--max-input-chars", "300", "--max-reference-seconds", "10", *extra]
    process = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "INTONE_CACHE": str(cache)})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return Server(base, process, log, media)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError("server did not come up")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture(scope="session")
def server(tiny_cache, tiny_fish_dir, tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("server"), tiny_cache)
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def reference_wav(server) -> Path:
    """2 s of a voiced-like signal inside the allowed media directory."""
    path = server.media / "ref.wav"
    t = np.arange(32000) / 16000
    sf.write(path, 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)), 16000)
    return path
