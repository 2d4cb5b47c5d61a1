"""The load generator: sends speech requests to a server and times every audio chunk."""

from __future__ import annotations

import asyncio
import base64
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from intone.bench.dataset import MetaItem
from intone.bench.metrics import RequestRecord


@dataclass
class LoadSpec:
    stream: bool = False
    seed: int | None = 0  # request i gets seed + i; None: unseeded
    max_new_tokens: int | None = None
    forced_frames: list[int] | None = None  # per request: exact frame counts (stop token never drawn)
    request_rate: float = float("inf")  # Poisson arrivals per second; inf: all at once (closed loop)
    timeout_s: float = 600.0
    save_audio: Path | None = None


def reference_fields(item: MetaItem) -> dict:
    if item.prompt_wav is None or not item.prompt_text:
        return {}
    data = base64.b64encode(item.prompt_wav.read_bytes()).decode()
    return {"ref_audio": f"data:audio/wav;base64,{data}", "ref_text": item.prompt_text}


async def run_load(base_url: str, items: list[MetaItem], concurrency: int, spec: LoadSpec, sample_rate: int,
                   headers: dict | None = None, progress=None, tag: str = "") -> tuple[list[RequestRecord], float]:
    """Run all items with at most `concurrency` in flight; returns the records and the wall time."""
    limit = asyncio.Semaphore(concurrency)
    rnd = random.Random(spec.seed or 0)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=spec.timeout_s, headers=headers, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i, item in enumerate(items):
            if spec.request_rate != float("inf") and i:
                await asyncio.sleep(rnd.expovariate(spec.request_rate))
            await limit.acquire()
            task = asyncio.create_task(_one(client, item, i, spec, sample_rate, f"{tag}{i}"))
            task.add_done_callback(lambda _t: (limit.release(), progress.update(1) if progress else None))
            tasks.append(task)
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


def _body(item: MetaItem, i: int, spec: LoadSpec) -> dict:
    body = {"input": item.target_text, "response_format": "pcm" if spec.stream else "wav", **reference_fields(item)}
    if spec.stream:
        body.update(stream=True, stream_format="audio")
    if spec.seed is not None:
        body["seed"] = spec.seed + i
    if spec.forced_frames:
        body.update(max_new_tokens=spec.forced_frames[i % len(spec.forced_frames)], ignore_eos=True)
    elif spec.max_new_tokens:
        body["max_new_tokens"] = spec.max_new_tokens
    return body


async def _one(client: httpx.AsyncClient, item: MetaItem, i: int, spec: LoadSpec, sample_rate: int,
               request_id: str) -> RequestRecord:
    rec = RequestRecord(request_id=request_id, utt_id=item.utt_id, sent_at=time.time())
    start = time.perf_counter()
    pcm = bytearray()
    try:
        async with client.stream("POST", "/v1/audio/speech", json=_body(item, i, spec)) as r:
            if r.status_code != 200:
                await r.aread()
                rec.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return rec
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
    import soundfile as sf

    samples = np.frombuffer(bytes(pcm), dtype="<i2").astype(np.float32) / 32767.0
    sf.write(path, samples, sample_rate, subtype="PCM_16")
