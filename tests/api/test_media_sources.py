"""Reference audio from every kind of source, in-process: data: URLs, the http(s) switch, other schemes,
the transcript check, the length limit and what each refusal names.

The server tests (test_speech, test_errors) send some of these through a real server; these call
`load_reference` directly, so they are fast and kill mutants of `api/media.py` (tools/mutation_run.sh),
which a test that reaches the code only through a server subprocess cannot."""

import asyncio
import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import soundfile as sf

from intone.api.media import MediaPolicy, load_reference, reference_decoder
from intone.errors import InvalidRequestError, MediaTooLarge

FIELDS = ["ref_audio", "references.1.audio_path"]
RATE = 16000


def wav_bytes(value: float, seconds: float = 0.1) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.full(int(RATE * seconds), value, dtype=np.float32), RATE, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def data_url(data: bytes, header: str = "data:audio/wav;base64") -> str:
    return header + "," + base64.b64encode(data).decode()


def load(source, field="ref_audio", policy=MediaPolicy(), text="the transcript", decoder=None):
    return asyncio.run(load_reference(source, text, field, policy, decoder))


def refused(source, field="ref_audio", policy=MediaPolicy(), text="the transcript", kind=InvalidRequestError):
    with pytest.raises(InvalidRequestError) as e:
        load(source, field, policy, text)
    assert type(e.value) is kind and e.value.field == field, (e.value.field, e.value.message)
    assert isinstance(e.value.message, str), e.value.message
    return e.value.message


@pytest.mark.parametrize("header", ["data:audio/wav;base64", "data:;base64", "data:application/octet-stream;base64"])
def test_a_data_url_loads_its_audio(header):
    ref = load(data_url(wav_bytes(0.25), header), text="  a transcript  ")
    assert ref.sample_rate == RATE and ref.audio.shape == (RATE // 10,) and float(ref.audio[0]) == 0.25
    assert ref.text == "  a transcript  "


def test_the_servers_decoder_threads_give_the_same_audio_and_refusals():
    """The server decodes on threads of its own (`reference_decoder`): the same audio as asyncio's default
    threads, the same refusal naming the field."""
    decoder = reference_decoder()
    try:
        ours = load(data_url(wav_bytes(0.25)), decoder=decoder)
        with pytest.raises(InvalidRequestError, match="references.1.audio_path"):
            load(data_url(b"not audio"), field="references.1.audio_path", decoder=decoder)
    finally:
        decoder.shutdown()
    plain = load(data_url(wav_bytes(0.25)))
    assert np.array_equal(ours.audio, plain.audio) and ours.sample_rate == plain.sample_rate == RATE


@pytest.mark.parametrize("field", FIELDS)
def test_data_urls_must_be_valid_base64(field):
    b64 = base64.b64encode(wav_bytes(0.25)).decode()
    assert "must be base64-encoded" in refused("data:audio/wav," + b64, field)
    for payload in ("@@@", b64[:40] + "!" + b64[40:], b64[:-2] + " " + b64[-2:], b64[:-1]):
        assert "not valid base64" in refused("data:audio/wav;base64," + payload, field), payload


@pytest.mark.parametrize("field, text_field", [("ref_audio", "ref_text"),
                                               ("references.1.audio_path", "references.1.text"),
                                               ("references.0.audio", "references.0.text")])
@pytest.mark.parametrize("text", [None, "", "   ", "\n\t"])
def test_a_reference_without_its_transcript_is_refused_naming_the_text_field(field, text_field, text):
    with pytest.raises(InvalidRequestError) as e:
        load(data_url(wav_bytes(0.25)), field, text=text)
    assert e.value.field == text_field and e.value.message == f"required with {field}"


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("url", ["http://example.com/a.wav", "https://example.com/a.wav", "HTTPS://example.com/a.wav"])
def test_http_urls_are_refused_while_remote_media_is_off(tmp_path, field, url):
    message = refused(url, field, MediaPolicy(allowed_local_dir=tmp_path))  # local files on: still refused
    assert "disabled" in message and "--allow-remote-media" in message


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("url", ["ftp://host/a.wav", "s3://bucket/a.wav", "gopher://host/a.wav"])
def test_other_url_schemes_are_refused(tmp_path, field, url):
    scheme = url.split(":")[0]
    assert refused(url, field, MediaPolicy(allowed_local_dir=tmp_path)) == f"unsupported URL scheme {scheme!r}"


@pytest.fixture(scope="module")
def media_host():
    """A local HTTP server: /voice.wav (0.1 s of 0.5), /long.wav (1 s), /not-audio."""
    bodies = {"/voice.wav": wav_bytes(0.5), "/long.wav": wav_bytes(0.5, seconds=1.0), "/not-audio": b"not audio" * 10}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = bodies[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


REMOTE = MediaPolicy(allow_remote=True, allow_private=True)


@pytest.mark.parametrize("field", FIELDS)
def test_an_allowed_http_url_is_downloaded_and_decoded_with_the_same_checks(media_host, field):
    ref = load(f"{media_host}/voice.wav", field, REMOTE)
    assert ref.sample_rate == RATE and ref.audio.shape == (RATE // 10,) and float(ref.audio[0]) == 0.5
    assert "not a readable audio file" in refused(f"{media_host}/not-audio", field, REMOTE)
    short = MediaPolicy(allow_remote=True, allow_private=True, max_seconds=0.5)
    assert "over the 0.5 s limit" in refused(f"{media_host}/long.wav", field, short)


@pytest.mark.parametrize("field", FIELDS)
def test_a_refused_download_names_the_field(media_host, field):
    message = refused(f"{media_host}/voice.wav", field, MediaPolicy(allow_remote=True))  # loopback: not public
    assert "not a public address" in message


@pytest.mark.parametrize("field", FIELDS)
def test_the_length_and_size_limits_hold_for_data_urls_and_local_files(tmp_path, field):
    long = wav_bytes(0.5, seconds=1.0)
    (tmp_path / "long.wav").write_bytes(long)
    for source in (data_url(long), "long.wav"):
        short = MediaPolicy(allowed_local_dir=tmp_path, max_seconds=0.5)
        assert "over the 0.5 s limit" in refused(source, field, short)
        assert float(load(source, field, MediaPolicy(allowed_local_dir=tmp_path, max_seconds=1.0)).audio[0]) == 0.5
    small = MediaPolicy(max_bytes=len(long) - 1)
    assert "byte limit" in refused(data_url(long), field, small, kind=MediaTooLarge)
    assert float(load(data_url(long), field, MediaPolicy(max_bytes=len(long))).audio[0]) == 0.5  # at the limit


@pytest.mark.parametrize("field", FIELDS)
def test_unreadable_audio_names_the_field(tmp_path, field):
    (tmp_path / "notes.wav").write_text("not audio at all")
    policy = MediaPolicy(allowed_local_dir=tmp_path)
    for source in (data_url(b"not audio at all"), "notes.wav", f"file://{tmp_path}/notes.wav"):
        assert "not a readable audio file" in refused(source, field, policy)


@pytest.mark.parametrize("name", ["take#2.wav", "50%.wav", "a%20b.wav", "why?.wav", "x;y.wav"])
def test_plain_paths_are_file_names_not_urls(tmp_path, name):
    """Only file:// URLs are percent-decoded; a plain path is the file's own name, '#', '?' and '%' included."""
    (tmp_path / name).write_bytes(wav_bytes(0.25))
    policy = MediaPolicy(allowed_local_dir=tmp_path)
    assert float(load(name, policy=policy).audio[0]) == 0.25
    assert float(load(str(tmp_path / name), policy=policy).audio[0]) == 0.25


@pytest.mark.parametrize("field", FIELDS)
def test_path_refusals_say_why_and_shorten_long_paths(tmp_path, field):
    (tmp_path / "dir").mkdir()
    (tmp_path / "big.wav").write_bytes(wav_bytes(0.25))
    policy = MediaPolicy(allowed_local_dir=tmp_path, max_bytes=100)
    assert refused("dir", field, policy) == "dir: no such file"
    assert refused("missing.wav", field, policy) == "missing.wav: no such file"
    assert refused("big.wav", field, policy, kind=MediaTooLarge) == "big.wav: over the 100 byte limit"
    assert refused("a\x00.wav", field, policy) == "a\x00.wav: not a usable file path"
    at_limit, over = "a" * 196 + ".wav", "b" * 197 + ".wav"  # 200 and 201 characters
    assert refused(at_limit, field, policy) == f"{at_limit}: no such file"
    assert refused(over, field, policy) == f"{over[:200]}...: no such file"
    assert "local files are disabled" in refused("big.wav", field, MediaPolicy())
