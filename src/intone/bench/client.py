"""The load generator: sends speech requests to a server and times every audio chunk."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from intone.bench.metrics import RequestRecord
from intone.eval.meta import MetaItem


@dataclass(frozen=True)
class ClipUse:
    """The reference one request sends. variant 0: the clip's file as is; variant k > 0: the same
    clip at a gain of 1 - k/1000 (re-encoded PCM16), so that its bytes and samples differ from
    every other use of the clip and no server cache can serve it, while the frontend's work is
    the same."""

    wav: Path
    text: str
    variant: int = 0

    @property
    def label(self) -> str:
        return self.wav.name + (f"#{self.variant}" if self.variant else "")


class ReferencePlan:
    """Which clip each request of a run sends.

    Default (pool None): every request of the run, warm-up and every sweep level included, its
    own clip: a clip used again gets the next variant. With a pool of N clips, requests cycle
    through those N (variant 0) so a server's reference cache is hit after the first N."""

    def __init__(self, pool: list[MetaItem] | None = None):
        self.pool = [it for it in pool if it.prompt_wav is not None and it.prompt_text] if pool else None
        self._uses: Counter = Counter()
        self._sent = 0

    def assign(self, items: list[MetaItem]) -> list[ClipUse | None]:
        out = []
        for item in items:
            src = self.pool[self._sent % len(self.pool)] if self.pool else item
            self._sent += 1
            if src.prompt_wav is None or not src.prompt_text:
                out.append(None)
                continue
            variant = 0 if self.pool else self._uses[src.prompt_wav]
            self._uses[src.prompt_wav] += 1
            out.append(ClipUse(src.prompt_wav, src.prompt_text, variant))
        return out

    def summary(self) -> dict:
        sent = sum(self._uses.values())
        distinct = len(self.pool) if self.pool else sent
        mode = (f"pool of {len(self.pool)} clips cycled (a server's reference cache is hit)" if self.pool
                else "a distinct clip for every request (warm-up included; no reference cache can hit)")
        return dict(mode="pool" if self.pool else "unique", description=mode, requests_with_reference=sent,
                    distinct_clips=min(distinct, sent), pool=len(self.pool) if self.pool else None)


@dataclass
class LoadSpec:
    stream: bool = False
    seed: int | None = 0  # request i gets seed + i; None: unseeded
    max_new_tokens: int | None = None
    forced_frames: list[int] | None = None  # per request: exact frame counts (stop token never drawn)
    request_rate: float = float("inf")  # Poisson arrivals per second; inf: all at once (closed loop)
    timeout_s: float = 600.0
    save_audio: Path | None = None
    references: list[ClipUse | None] | None = None  # per request; None: each item's own clip as is


def clip_bytes(use: ClipUse) -> bytes:
    data = use.wav.read_bytes()
    if not use.variant:
        return data
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    buf = io.BytesIO()
    sf.write(buf, samples * (1.0 - use.variant / 1000.0), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def reference_fields(item: MetaItem | ClipUse | None) -> dict:
    if isinstance(item, MetaItem):
        item = ClipUse(item.prompt_wav, item.prompt_text) if item.prompt_wav is not None and item.prompt_text else None
    if item is None:
        return {}
    data = base64.b64encode(clip_bytes(item)).decode()
    return {"ref_audio": f"data:audio/wav;base64,{data}", "ref_text": item.text}


def _reference(item: MetaItem, i: int, spec: LoadSpec) -> MetaItem | ClipUse | None:
    return spec.references[i] if spec.references is not None else item


async def run_load(base_url: str, items: list[MetaItem], concurrency: int, spec: LoadSpec, sample_rate: int,
                   headers: dict | None = None, progress=None, tag: str = "") -> tuple[list[RequestRecord], float]:
    """Run all items with at most `concurrency` in flight; returns the records and the wall time.

    Each of the `concurrency` slots is a client of its own (one keep-alive connection), as that many users
    would be, connected before the clock starts: one httpx client shared by 64 requests took 0.35-0.43 s (p50; up
    to 0.8 s) of its own to route a burst of them onto its kept connections before the server saw them, which the
    bench counted as the server's (`tests/bench/test_client.py`, a CPU machine; 0.02 s with a client per slot)."""
    free: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
    rnd = random.Random(spec.seed or 0)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=base_url, timeout=spec.timeout_s, headers=headers, limits=ONE_CONNECTION))
            for _ in range(concurrency)]
        await asyncio.gather(*(_connect(c) for c in clients))
        for client in clients:
            free.put_nowait(client)
        start = time.perf_counter()
        tasks = []
        for i, item in enumerate(items):
            if spec.request_rate != float("inf") and i:
                await asyncio.sleep(rnd.expovariate(spec.request_rate))
            client = await free.get()
            task = asyncio.create_task(_one(client, item, i, spec, sample_rate, f"{tag}{i}"))
            task.add_done_callback(lambda _t, c=client: (free.put_nowait(c), progress.update(1) if progress else None))
            tasks.append(task)
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


ONE_CONNECTION = httpx.Limits(max_connections=1, max_keepalive_connections=1)


async def _connect(client: httpx.AsyncClient) -> None:
    """Open the slot's connection before any clock starts (a user keeps one open): 64 clients connecting at once
    held every request of an opening burst ~0.1 s in one client process (a CPU machine), and each user's own
    connection costs it about a millisecond. The answer does not matter (a server without /health keeps the
    connection too)."""
    with contextlib.suppress(httpx.HTTPError):
        await client.get("/health")


def _body(item: MetaItem, i: int, spec: LoadSpec) -> dict:
    body = {"input": item.target_text, "response_format": "pcm" if spec.stream else "wav",
            **reference_fields(_reference(item, i, spec))}
    if spec.stream:
        body.update(stream=True, stream_format="audio")
    if spec.seed is not None:
        body["seed"] = spec.seed + i
    if spec.forced_frames:
        body.update(max_new_tokens=spec.forced_frames[i % len(spec.forced_frames)], ignore_eos=True)
    elif spec.max_new_tokens:
        body["max_new_tokens"] = spec.max_new_tokens
    return body


JSON_HEADERS = {"Content-Type": "application/json"}


def _json_body(item: MetaItem, i: int, spec: LoadSpec) -> bytes:
    return json.dumps(_body(item, i, spec)).encode()


async def _one(client: httpx.AsyncClient, item: MetaItem, i: int, spec: LoadSpec, sample_rate: int,
               request_id: str) -> RequestRecord:
    ref = _reference(item, i, spec)
    label = ref.label if isinstance(ref, ClipUse) else (ref.prompt_wav.name if ref and ref.prompt_wav else None)
    rec = RequestRecord(request_id=request_id, utt_id=item.utt_id, sent_at=time.time(), reference=label)
    # file read, re-gain, base64 and the JSON text, before the clock starts: one client process stands for C clients,
    # and its encoding ~1 MB bodies on its event loop would delay a burst's later requests, not the server's answers
    payload = await asyncio.to_thread(_json_body, item, i, spec)
    start, rec.started_at = time.perf_counter(), time.time()
    pcm = bytearray()
    try:
        async with client.stream("POST", "/v1/audio/speech", content=payload, headers=JSON_HEADERS) as r:
            if r.status_code != 200:
                await r.aread()
                rec.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return rec
            rec.server_id = r.headers.get("x-request-id")
            if spec.stream:
                async for part in r.aiter_bytes():
                    if part:
                        pcm += part
                        rec.chunks.append((time.perf_counter() - start, len(part) / 2 / sample_rate))
            else:
                body = await r.aread()
                pcm += body[44:]  # the server's WAV header is the plain 44-byte one
                rec.prompt_tokens = int(r.headers.get("x-prompt-tokens", 0))
                rec.completion_tokens = int(r.headers.get("x-completion-tokens", 0))
        rec.completion_s = time.perf_counter() - start
        rec.audio_s = len(pcm) / 2 / sample_rate
        rec.ok = True
        if spec.save_audio is not None:
            _save(spec.save_audio / f"{item.utt_id}.wav", pcm, sample_rate)
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


def _save(path: Path, pcm: bytearray, sample_rate: int) -> None:
    samples = np.frombuffer(bytes(pcm), dtype="<i2").astype(np.float32) / 32767.0
    sf.write(path, samples, sample_rate, subtype="PCM_16")
