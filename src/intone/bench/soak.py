"""Soak (run by hand, not in CI): many streams against a real server, a share of the clients leaving at a
random moment, then checks that nothing is left behind: the API's gauges and every engine table back
to zero, and the resident memory of both processes back near where it was after a warm-up.

    python -m intone.bench.soak --streams 10000 --concurrency 64 --leave 0.5 \
        --serve "--model tiny:fish-s2 --device cpu" --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from pathlib import Path

import httpx

from intone.bench.server_process import ServerProcess



def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def engine_pid(api_pid: int) -> int:
    return int(Path(f"/proc/{api_pid}/task/{api_pid}/children").read_text().split()[0])


def gauge(metrics: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+-]+)$", metrics, re.M)
    return float(found.group(1)) if found else float("nan")


async def one_stream(client: httpx.AsyncClient, i: int, leave: float, rng: random.Random, counts: dict,
                     tokens: tuple[int, int]) -> None:
    body = {"input": f"Soak stream number {i} says a few words.", "seed": i, "max_new_tokens": rng.randint(*tokens),
            "stream": True, "stream_format": "audio", "response_format": "pcm"}
    quit_after = rng.randint(1, 4) if rng.random() < leave else None  # chunks read before leaving
    try:
        async with client.stream("POST", "/v1/audio/speech", json=body) as reply:
            if reply.status_code != 200:
                counts[f"status {reply.status_code}"] = counts.get(f"status {reply.status_code}", 0) + 1
                return
            seen = 0
            async for _ in reply.aiter_raw():
                seen += 1
                if quit_after is not None and seen >= quit_after:
                    counts["left"] += 1
                    return
        counts["finished"] += 1
    except httpx.HTTPError as e:
        counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1


async def soak(base: str, streams: int, concurrency: int, leave: float, seed: int, tokens: tuple[int, int],
               pids: tuple[int, int] | None = None, samples: list | None = None) -> dict:
    """Run the streams; every `streams // 20` of them, append (streams done, API RSS, engine RSS) to samples."""
    rng, counts = random.Random(seed), {"finished": 0, "left": 0}
    gate = asyncio.Semaphore(concurrency)
    every, done = max(1, streams // 20), [0]
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        async def run(i):
            async with gate:
                await one_stream(client, i, leave, rng, counts, tokens)
            done[0] += 1
            if pids and samples is not None and done[0] % every == 0:
                samples.append((done[0], round(rss_mib(pids[0]), 1), round(rss_mib(pids[1]), 1)))
        await asyncio.gather(*(run(i) for i in range(streams)))
    return counts


def settle(base: str, seconds: float = 30, headers: dict | None = None) -> dict:
    """/metrics once the engine's tables are empty (or after `seconds`)."""
    deadline = time.time() + seconds
    while True:
        text = httpx.get(base + "/metrics", headers=headers, timeout=10).text
        values = {name: gauge(text, f"intone_{name}") for name in (
            "requests_in_flight", "requests_running", "requests_waiting", "kv_cache_blocks_used",
            "engine_live_requests", "engine_preparing_requests", "engine_planner_requests", "engine_kv_tables")}
        if all(v == 0 for v in values.values()) or time.time() > deadline:
            return values
        time.sleep(0.5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m intone.bench.soak")
    ap.add_argument("--serve", default="--model tiny:fish-s2 --device cpu", help="intone serve arguments")
    ap.add_argument("--streams", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--leave", type=float, default=0.5, help="share of clients that leave mid-stream")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", default="8:60", help="MIN:MAX of each stream's max_new_tokens")
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    server = ServerProcess.from_string(args.serve, out.with_suffix(".server.log"))
    try:
        api, engine = server.process.pid, engine_pid(server.process.pid)
        tokens = tuple(int(v) for v in args.tokens.split(":"))
        asyncio.run(soak(server.base_url, args.warmup, args.concurrency, args.leave, args.seed + 1, tokens))
        settle(server.base_url)
        baseline = {"api_rss_mib": rss_mib(api), "engine_rss_mib": rss_mib(engine)}
        start, samples = time.time(), []
        counts = asyncio.run(soak(server.base_url, args.streams, args.concurrency, args.leave, args.seed, tokens,
                                  (api, engine), samples))
        elapsed = time.time() - start
        gauges = settle(server.base_url)
        after = {"api_rss_mib": rss_mib(api), "engine_rss_mib": rss_mib(engine)}
        report = dict(streams=args.streams, concurrency=args.concurrency, leave=args.leave, seconds=round(elapsed, 1),
                      tokens=args.tokens, outcomes=counts, gauges_after=gauges, rss_baseline=baseline,
                      rss_after=after, rss_by_streams_done=samples, clean=all(v == 0 for v in gauges.values()))
    finally:
        server.stop()
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["clean"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
