"""64 concurrent streams, half of them dropped mid-stream: nothing is left in flight."""

import asyncio
import re

import httpx


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1))


def test_64_streams_half_disconnected_leave_nothing(server):
    async def one(client, i):
        body = {"input": f"Stream number {i}.", "seed": i, "max_new_tokens": 60, "stream": True,
                "stream_format": "audio", "response_format": "pcm", "initial_codec_chunk_frames": 2}
        received = 0
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200
            async for part in r.aiter_bytes():
                received += len(part)
                if i % 2 and received > 0:
                    return "dropped", received  # leaving the block closes the connection
        return "done", received

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.base, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(kind == ("dropped" if i % 2 else "done") for i, (kind, _) in enumerate(results))
    assert all(n > 0 and n % 4096 == 0 for kind, n in results if kind == "done")
    text = ""
    for _ in range(100):
        text = httpx.get(server.url("/metrics")).text
        if metric(text, "intone_requests_running") == 0 and metric(text, "intone_requests_in_flight") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(text, "intone_requests_running") == 0
    assert metric(text, "intone_requests_waiting") == 0
    assert metric(text, "intone_requests_in_flight") == 0
    assert metric(text, "intone_kv_cache_blocks_used") == 0
    assert metric(text, "intone_kv_cache_usage_ratio") == 0
    assert 'intone_requests_total{outcome="disconnect"}' in text
