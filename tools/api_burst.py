"""Diagnostic (CPU): the API's own work on a burst of requests, each with its own reference clip, without HTTP or
an engine: `build_synthesis` (JSON validation, the reference's base64 and audio decode, the text) for N bodies at
once, the time each is ready to hand to the engine. With the server's reference decoder (its own threads) and with
asyncio's default threads (`--default-threads`).

    python3 tools/api_burst.py [--requests 64] [--repeats 3] [--default-threads]
"""

import argparse
import asyncio
import base64
import io
import json
import statistics
import time

import numpy as np
import soundfile as sf

from intone.api.schema import SpeechRequest
from intone.api.server import Settings, create_app
from intone.api.speech import build_synthesis
from intone.engine.config import load_profile


def bodies(n: int, seed: int = 0) -> list[str]:
    """n request bodies, each a clip of its own of 3-8 s at 16 kHz as a base64 WAV data: URL (as the preset's)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        wav = io.BytesIO()
        sf.write(wav, 0.1 * rng.standard_normal(int(16000 * rng.uniform(3, 8))).astype(np.float32), 16000,
                 format="WAV", subtype="PCM_16")
        out.append(json.dumps({"model": "fish", "input": "A sentence to say, of the length the preset sends.",
                               "ref_audio": "data:audio/wav;base64," + base64.b64encode(wav.getvalue()).decode(),
                               "ref_text": "The reference clip's words.", "stream": True}))
    return out


async def burst(app, texts: list[str]) -> list[float]:
    """Seconds from the burst's start until each request is ready for the engine, sorted."""
    start, ready = time.perf_counter(), []

    async def one(text: str) -> None:
        await build_synthesis(SpeechRequest.model_validate_json(text), app.state, streaming=True)
        ready.append(time.perf_counter() - start)

    await asyncio.gather(*(one(t) for t in texts))
    return sorted(ready)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--default-threads", action="store_true", help="decode on asyncio's default threads")
    args = ap.parse_args()
    app = create_app(Settings(model="tiny:fish-s2"))  # no lifespan: no engine, no text workers
    app.state.profile = load_profile("fish-s2-high-concurrency", device="cpu")
    if args.default_threads:
        app.state.reference_decoder = None
    texts = bodies(args.requests)
    for _ in range(args.repeats):
        ready = asyncio.run(burst(app, texts))
        print(f"{args.requests} at once: ready first {ready[0] * 1e3:.1f} ms, "
              f"median {statistics.median(ready) * 1e3:.1f}, last {ready[-1] * 1e3:.1f}", flush=True)


if __name__ == "__main__":
    main()
