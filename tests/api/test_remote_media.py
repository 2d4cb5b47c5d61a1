"""Remote reference audio (`--allow-remote-media`): public hosts only, every redirect checked, one
deadline for the whole download, and failures that do not reveal which internal ports are open.
Real downloads from a real local HTTP server."""

import asyncio
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import soundfile as sf

from intone.api.media import MediaPolicy
from intone.api.remote_media import UNREACHABLE, download, refused
from intone.errors import InvalidRequestError


@pytest.mark.parametrize("address,private_ok", [
    ("127.0.0.1", True), ("::1", True), ("10.1.2.3", True), ("192.168.0.7", True), ("172.16.5.4", True),
    ("::ffff:127.0.0.1", True), ("fd00::1", True),
    ("169.254.169.254", False), ("fe80::1", False), ("0.0.0.0", False), ("::", False), ("224.0.0.1", False),
    ("240.0.0.1", False),
])
def test_internal_addresses_are_refused(address, private_ok):
    assert refused(address, allow_private=False)
    assert refused(address, allow_private=True) is not private_ok


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address):
    assert not refused(address, allow_private=False)


@pytest.fixture(scope="module")
def media_host():
    """A local HTTP server: /voice.wav (a clip), /to-metadata (a redirect to 169.254.169.254), /slow
    (a byte every 0.2 s); `hits` counts the requests it received."""
    buffer = io.BytesIO()
    sf.write(buffer, (0.2 * np.sin(np.arange(16000) / 8)).astype(np.float32), 16000, format="WAV")
    clip, hits = buffer.getvalue(), []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            hits.append(self.path)
            if self.path == "/to-metadata":
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/latest/meta-data")
                self.end_headers()
            elif self.path == "/slow":
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                try:
                    for _ in range(1000):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:
                    pass
            else:
                self.send_response(200)
                self.send_header("Content-Length", str(len(clip)))
                self.end_headers()
                self.wfile.write(clip)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits, clip
    server.shutdown()


def fetch(url: str, **policy) -> bytes:
    return asyncio.run(download(url, "ref_audio", MediaPolicy(allow_remote=True, **policy)))


def test_a_loopback_host_is_refused_before_any_request(media_host):
    base, hits, _ = media_host
    before = len(hits)
    for url in (f"{base}/voice.wav", base.replace("127.0.0.1", "127.1") + "/voice.wav",
                base.replace("127.0.0.1", "localhost") + "/voice.wav"):
        with pytest.raises(InvalidRequestError, match="not a public address") as e:
            fetch(url)
        assert e.value.field == "ref_audio"
    assert len(hits) == before


def test_a_private_media_host_serves_when_allowed(media_host):
    base, _, clip = media_host
    assert fetch(f"{base}/voice.wav", allow_private=True) == clip


def test_a_redirect_to_the_metadata_service_is_refused(media_host):
    base, hits, _ = media_host
    with pytest.raises(InvalidRequestError, match="not a public address"):
        fetch(f"{base}/to-metadata", allow_private=True)
    assert hits[-1] == "/to-metadata"


def test_one_deadline_bounds_a_trickling_download(media_host):
    base, _, _ = media_host
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError) as e:
        fetch(f"{base}/slow", allow_private=True, remote_timeout_s=1.0)
    assert time.perf_counter() - start < 3.0
    assert e.value.message == UNREACHABLE


def test_a_closed_port_reads_like_any_unreachable_host():
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(InvalidRequestError) as e:
        fetch(f"http://127.0.0.1:{port}/voice.wav", allow_private=True)
    assert e.value.message == UNREACHABLE and str(port) not in e.value.message
