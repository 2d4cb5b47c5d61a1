"""Start and stop an `intone serve` subprocess for a benchmark arm."""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from intone.errors import IntoneError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, serve_args: list[str], log_path: Path, startup_timeout_s: float = 900):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "intone.cli.main", "serve", *serve_args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout_s)

    @classmethod
    def from_string(cls, args: str, log_path: Path) -> "ServerProcess":
        return cls(shlex.split(args), log_path)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise IntoneError(f"server exited during start-up; see {self.log_path}:\n"
                                  + self.log_path.read_text()[-2000:])
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise IntoneError(f"server did not become ready in {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


class GpuMemorySampler:
    """Peak GPU memory in use (MiB) while it runs, from nvidia-smi; None without a GPU."""

    def __init__(self, interval_s: float = 0.5):
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread = None
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
            self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                used = sum(float(x) for x in out.split())
                self.peak_mib = max(self.peak_mib or 0.0, used)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return
            self._stop.wait(interval_s)

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        return self.peak_mib
