"""Every sampling and length field of the speech request reaches the engine: with the same seed,
changing one field changes the audio (or its length, as the field says), and the same body gives the
same audio. A field the API dropped on its way to the engine would leave the audio as it was.

"The same audio" is the same tokens decoded: requests decoded in one batch with others round in float32
by the batch's shape, so a sample may differ by an LSB (bit-equal needs batch-invariant kernels);
other tokens give other audio altogether."""

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

BASE = {"input": "Hello world, how are you today?", "seed": 3, "max_new_tokens": 30, "response_format": "pcm"}
FRAME_BYTES = 2048 * 2  # samples per frame x 2 bytes (PCM16)

CHANGED = {  # field -> a value that changes which tokens are drawn
    "seed": 4,
    "temperature": 1.6,
    "top_k": 1,
    "repetition_penalty": 3.0,
}


def same_audio(a: httpx.Response, b: httpx.Response) -> bool:
    x, y = (np.frombuffer(r.content, dtype="<i2").astype(np.int32) for r in (a, b))
    return x.shape == y.shape and int(np.abs(x - y).max(initial=0)) <= 2


def frames(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    assert len(response.content) % FRAME_BYTES == 0
    return len(response.content) // FRAME_BYTES


def test_each_sampling_and_length_field_changes_the_audio(server):
    bodies = {"base": BASE, "again": BASE,
              **{name: {**BASE, name: value} for name, value in CHANGED.items()},
              # top-p cuts inside the top-k candidates (30 by default: ~1% of a flat distribution's mass)
              "all_candidates": {**BASE, "top_k": 4096}, "top_p": {**BASE, "top_k": 4096, "top_p": 0.05},
              "max_new_tokens": {**BASE, "max_new_tokens": 6},
              "min_new_tokens": {**BASE, "max_new_tokens": 40, "min_new_tokens": 40},
              "ignore_eos": {**BASE, "max_new_tokens": 17, "ignore_eos": True}}
    with ThreadPoolExecutor(len(bodies)) as pool:  # together: a request's audio does not depend on its batch
        futures = {name: pool.submit(httpx.post, server.url("/v1/audio/speech"), json=body, timeout=120)
                   for name, body in bodies.items()}
        got = {name: f.result() for name, f in futures.items()}
    assert frames(got["base"]) > 0 and same_audio(got["again"], got["base"])
    for name in CHANGED:
        assert frames(got[name]) > 0 and not same_audio(got[name], got["base"]), f"{name} did not change the audio"
    assert not same_audio(got["top_p"], got["all_candidates"]), "top_p did not change the audio"
    assert 0 < frames(got["max_new_tokens"]) <= 6
    assert frames(got["min_new_tokens"]) == 40  # no stop before 40 frames, none after the cap
    assert frames(got["ignore_eos"]) == 17


def test_initial_codec_chunk_frames_sets_the_first_chunk_of_a_stream(server):
    def first_chunk_frames(n: int) -> int:
        body = {**BASE, "stream": True, "stream_format": "sse", "initial_codec_chunk_frames": n}
        with httpx.stream("POST", server.url("/v1/audio/speech"), json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"speech.audio.delta"' in line:
                    return len(base64.b64decode(json.loads(line[6:])["audio"])) // FRAME_BYTES
        raise AssertionError("no audio delta")

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(first_chunk_frames, (2, 9))) == [2, 9]
