from concurrent.futures import ThreadPoolExecutor
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.procs import SERVERS_UP


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base: str, process: subprocess.Popen, log: Path, media: Path, trace: Path | None = None):
        self.base, self.process, self.log, self.media = base, process, log, media
        self.trace = trace  # its --trace-frames file, if it writes one

    def url(self, path: str) -> str:
        return self.base + path


def launch_server(tmp: Path, cache: Path, *extra: str) -> Server:
    """Start `intone serve` and return at once; `wait_ready` waits for its /health."""
    port = free_port()
    media = tmp / "media"
    media.mkdir(exist_ok=True)
    log = tmp / "server.log"
    cmd = [sys.executable, "-m", "intone.cli.main", "serve", "--model", "tiny:fish-s2", "--port", str(port),
           "--device", "cpu", "--voices-dir", str(tmp / "voices"), "--allowed-local-media-path", str(media),
           "--max-input-chars", "300", "--max-reference-seconds", "10", *extra]
    process = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               env={**os.environ, "INTONE_CACHE": str(cache)})
    trace = Path(extra[extra.index("--trace-frames") + 1]) if "--trace-frames" in extra else None
    return Server(f"http://127.0.0.1:{port}", process, log, media, trace)


def wait_ready(server: Server, timeout: float = 120) -> Server:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited: {server.log.read_text()[-3000:]}")
        try:
            if httpx.get(server.url("/health"), timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.process.kill()
    raise RuntimeError(f"server did not come up within {timeout} s: {server.log.read_text()[-3000:]}")


def start_server(tmp: Path, cache: Path, *extra: str, timeout: float = 120) -> Server:
    return wait_ready(launch_server(tmp, cache, *extra), timeout)


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()


class BootAhead:
    """Servers for tests that each end their own, in the order the tests take them: taking one
    launches the next, so it boots while this test runs (a boot is mostly imports, one core at a time);
    with `ahead` > 1, the ones after it too, once the server taken is up (its boot not slowed by theirs)."""

    def __init__(self, tmp_path_factory, cache: Path, plans: dict[str, tuple[str, ...]], ahead: int = 1):
        self.tmp_path_factory, self.cache, self.plans, self.ahead = tmp_path_factory, cache, plans, ahead
        self.launched: dict[str, Server] = {}

    def _launch(self, name: str) -> None:
        if name not in self.launched:
            self.launched[name] = launch_server(self.tmp_path_factory.mktemp(name), self.cache, *self.plans[name])

    def take(self, name: str) -> Server:
        self._launch(name)
        names = list(self.plans)
        following = names[names.index(name) + 1:][:self.ahead]
        for later in following[:1]:
            self._launch(later)
        server = wait_ready(self.launched[name])
        for later in following[1:]:
            self._launch(later)
        return server

    def close(self) -> None:
        for s in self.launched.values():
            if s.process.poll() is None:
                stop_server(s)


def shared_flags(name: str, tmp: Path) -> tuple[str, ...]:
    """`intone serve` flags of the servers that tests share, by fixture name."""
    if name == "server":
        # A short --engine-silence-seconds, for the hung-engine test (/health is all it changes); the
        # OpenAI SDK tests' voice aliases ('narrator' names a voice they store, 'ghost' one nobody stores); the
        # profiler's routes on; the AR step's static form, one step in flight (the shipped GPU path, its graphs
        # aside) on the CPU; its frames traced (the crowd's tokens compared); streamed chunks decoded against their
        # carried states on packed rows (codec.carry_state, codec.packed_decode; the shipped padded rows run under
        # the GPU server test and the engine tests).
        return ("--engine-silence-seconds", "2", "--voice-alias", "narrator=house", "--voice-alias", "ghost=nobody",
                "--profile-dir", str(tmp / "profiles"), "--set", "ar.static_step=true", "--set", "ar.async_steps=true",
                "--trace-frames", str(tmp / "frames.jsonl"), "--set", "codec.carry_state=true",
                "--set", "codec.packed_decode=true")
    if name == "strict_server":
        # API key, SGLang's SSE dialect, and a one-seat engine with a one-place queue; its codec in the engine
        # loop, pieces gathered and playing streams' chunks held for their listeners (engine/loop_codec.py).
        profile = tmp / "tight.yaml"
        profile.write_text("ar: {max_num_seqs: 1, max_waiting: 1}\nchunking: {initial_chunk_frames: 4}\n"
                           "codec: {overlap: false, gather_ms: 50, stream_lead_ms: 300}\n")
        return ("--api-key", "sekret", "--sse-dialect", "sglang", "--profile", str(profile))
    if name == "cosy_server":
        # The raw-audio dialect: what older vLLM-Omni `--stream` clients expect of a bare `stream: true`;
        # the texts read in a worker process (what a server of 4+ cores does by default).
        return ("--model", "tiny:cosyvoice3", "--sse-dialect", "audio", "--text-workers", "1")
    raise KeyError(name)


SHARED = ("cosy_server", "server", "strict_server")


class SharedBoots:
    """The shared servers the collected tests use, all launched when the first is needed: each boots
    while the others do, or while tests run. Whoever takes one stops it."""

    def __init__(self, session, tmp_path_factory, cache: Path):
        wanted = {name for item in session.items for name in item.fixturenames if name in SHARED}
        self.launched: dict[str, Server] = {}
        for name in SHARED:
            if name in wanted:
                tmp = tmp_path_factory.mktemp(name.replace("_", "-"))
                self.launched[name] = launch_server(tmp, cache, *shared_flags(name, tmp))

    def take(self, name: str) -> Server:
        server = wait_ready(self.launched[name])
        SERVERS_UP.set()  # the jobs run beside the tests (tests/procs.py) may start
        return server

    def close(self) -> None:
        for s in self.launched.values():
            if s.process.poll() is None:
                stop_server(s)


@pytest.fixture(scope="session")
def shared_boots(request, tiny_cache, tiny_fish_dir, tmp_path_factory):
    boots = SharedBoots(request.session, tmp_path_factory, tiny_cache)
    yield boots
    boots.close()


@pytest.fixture(scope="session")
def server(shared_boots):
    """The server every test shares that leaves it whole."""
    s = shared_boots.take("server")
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def reference_wav(server) -> Path:
    """2 s of a voiced-like signal inside the allowed media directory."""
    path = server.media / "ref.wav"
    t = np.arange(32000) / 16000
    sf.write(path, 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)), 16000)
    return path


def metric(text: str, name: str) -> float:
    """One sample of `name` (or `name_total`) in a /metrics page, whatever its labels."""
    found = re.search(rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def _samples(reply: httpx.Response, i: int) -> np.ndarray:
    """Even requests asked for a WAV file, odd ones for streamed 16-bit PCM; both as floats in [-1, 1]."""
    if i % 2 == 0:
        return sf.read(io.BytesIO(reply.content), dtype="float32")[0]
    return np.frombuffer(reply.content, dtype=np.int16) / 32768.0


def traced_ends(trace: Path) -> dict[str, dict]:
    """The terminal row of each request in a server's frame trace (`--trace-frames`), by request id."""
    rows = (json.loads(line) for line in trace.read_text().splitlines())
    return {row["request_id"]: row for row in rows if row["finished"]}


def crowd_then_alone(server: Server, voices: int, alone: tuple[int, ...] = (0, 1), tokens: int = 40,
                     tolerance: float = 0.05) -> None:
    """`voices` concurrent requests, each with a reference clip of its own length (no cache hit, many shapes),
    half whole WAV files, half streamed PCM; all answered with audio, and the `alone` ones asked again one at a
    time get the crowd's audio (invariant 3: the same tokens; the codec's batches round differently, while
    other tokens would give unrelated audio, an error near 1.4x its RMS; `tolerance`: the RMS error allowed, as a
    share of the audio's RMS). Where the server traces its frames, also the same prompt and the same tokens exactly."""
    clips = []
    for i in range(voices):
        seconds = 1.2 + 0.37 * i
        t = np.arange(int(seconds * 24000)) / 24000
        wav = server.media / f"crowd-voice{i}.wav"
        sf.write(wav, 0.3 * np.sin(2 * np.pi * (150 + 17 * i) * t) * (1 + 0.4 * np.sin(2 * np.pi * 3 * t)), 24000)
        clips.append(wav)

    def speak(i: int) -> httpx.Response:
        body = {"input": f"Sentence number {i} for the voice.", "ref_audio": str(clips[i]),
                "ref_text": "A reference voice.", "seed": i, "max_new_tokens": tokens + 5 * i,
                "stream": i % 2 == 1, "response_format": "wav" if i % 2 == 0 else "pcm",
                **({"stream_format": "audio"} if i % 2 else {})}
        return httpx.post(server.url("/v1/audio/speech"), json=body, timeout=300)

    with ThreadPoolExecutor(voices) as pool:
        replies = list(pool.map(speak, range(voices)))
    for i, reply in enumerate(replies):
        assert reply.status_code == 200, reply.text
        audio = _samples(reply, i)
        assert audio.size > 0 and np.abs(audio).max() > 0
    for i in alone:
        again = speak(i)
        assert again.status_code == 200, again.text
        if server.trace is not None:
            ends = traced_ends(server.trace)
            crowd, single = (ends[r.headers["X-Request-Id"]] for r in (replies[i], again))
            assert crowd["prompt_digest"] == single["prompt_digest"], i
            assert crowd["tokens"] == single["tokens"], i
        a, b = _samples(again, i), _samples(replies[i], i)
        rms = float(np.sqrt(np.mean(b**2)))
        assert a.shape == b.shape and np.sqrt(np.mean((a - b) ** 2)) <= tolerance * rms, (i, np.abs(a - b).max(), rms)
