"""Reference audio from a request: data: URLs, local paths under an allowed directory, or
http(s) URLs when the server allows them (`remote_media`: public hosts only). Every failure names the field.

Decoding (base64, file reads, soundfile) runs in a worker thread: a few megabytes of reference
audio per request must never stall the event loop that serves every other request's chunks. The
server gives it threads of its own (`reference_decoder`), few of them: the work holds the interpreter
lock, so a burst of references decoded side by side all finish at the end of the burst's work (64
clips: ~0.2 s on an H100 host, each waiting for all), while two threads take them nearly in turn
and hand the first on to the engine's encoder after its own few milliseconds."""

from __future__ import annotations

import asyncio
import base64
import binascii
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from intone.audio import read_audio
from intone.api.remote_media import download
from intone.errors import InvalidRequestError, MediaTooLarge
from intone.protocol import VoiceReference


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_dir: Path | None = None
    allow_remote: bool = False
    allow_private: bool = False  # remote media from loopback / private networks too (never link-local)
    max_bytes: int = 10 * 1024 * 1024
    max_seconds: float = 30.0
    remote_timeout_s: float = 10.0


def reference_decoder() -> ThreadPoolExecutor:
    """The threads `load_reference` decodes on (the server's, shut down with it)."""
    return ThreadPoolExecutor(2, thread_name_prefix="reference-decode")


async def load_reference(source: str, text: str | None, field: str, policy: MediaPolicy,
                         decoder: Executor | None = None) -> VoiceReference:
    """decoder: where the decode runs (None: asyncio's default threads)."""
    if not text or not text.strip():
        raise InvalidRequestError(_text_field(field), f"required with {field}")
    if not source.startswith("data:") and urlparse(source).scheme in ("http", "https"):
        if not policy.allow_remote:
            raise InvalidRequestError(field, "http(s) URLs are disabled on this server (see --allow-remote-media)")
        data = await download(source, field, policy)
        audio, rate = await asyncio.get_running_loop().run_in_executor(decoder, _decode, data, field, policy)
    else:  # one hop to a worker thread for the whole fetch + decode
        audio, rate = await asyncio.get_running_loop().run_in_executor(decoder, _load_sync, source, field, policy)
    return VoiceReference(text=text, audio=audio, sample_rate=rate)


def _text_field(field: str) -> str:
    if field == "ref_audio":
        return "ref_text"
    return field.rsplit(".", 1)[0] + ".text"


def _load_sync(source: str, field: str, policy: MediaPolicy):
    """A data: URL or a local path -> (audio, rate); blocking, so run off the event loop."""
    return _decode(_fetch_sync(source, field, policy), field, policy)


def _decode(data: bytes, field: str, policy: MediaPolicy):
    if len(data) > policy.max_bytes:
        raise MediaTooLarge(field, f"audio is {len(data)} bytes, over the {policy.max_bytes} byte limit")
    return read_audio(data, field=field, max_seconds=policy.max_seconds)


def _fetch_sync(source: str, field: str, policy: MediaPolicy) -> bytes:
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise InvalidRequestError(field, "data: URLs must be base64-encoded")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(field, "data: URL is not valid base64") from None
    scheme = urlparse(source).scheme
    if scheme not in ("", "file") and not Path(source).is_absolute():
        raise InvalidRequestError(field, f"unsupported URL scheme {scheme!r}")
    return _read_local(unquote(urlparse(source).path) if scheme == "file" else source, field, policy)


def _read_local(path_text: str, field: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_dir is None:
        raise InvalidRequestError(field, "local files are disabled on this server (see --allowed-local-media-path)")
    root = policy.allowed_local_dir.resolve()
    shown = path_text if len(path_text) <= 200 else path_text[:200] + "..."
    try:
        path = Path(path_text)
        path = (path if path.is_absolute() else root / path).resolve()
        if not path.is_relative_to(root):
            raise InvalidRequestError(field, f"{shown}: outside the allowed media directory")
        if not path.is_file():
            raise InvalidRequestError(field, f"{shown}: no such file")
        if path.stat().st_size > policy.max_bytes:
            raise MediaTooLarge(field, f"{shown}: over the {policy.max_bytes} byte limit")
        return path.read_bytes()
    except (ValueError, RuntimeError, OSError):  # a NUL byte, a symlink loop, a name too long, ...
        raise InvalidRequestError(field, f"{shown}: not a usable file path") from None
