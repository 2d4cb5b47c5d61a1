# Where the Fish codec's padding comes from (a model, not a measurement): 64 closed-loop streams (or
# non-streamed requests in 50-frame pieces, gathered 40 ms) of normal(86, 30) frames, AR steps of a fixed
# time, the real ChunkPlanner, and one codec server whose call takes every chunk waiting and plans it
# with the real WindowVocoder (`_decode_carried`'s spans and rounds, `_groups`, `_rows`, `_frames`).
# Each call's computed rows x frames are split into the useful frames, the padding of rows to the
# round's longest chunk, of that longest to its bucket, and blank rows. GPU time per call is modelled
# from session 22's carried-decode sizes (1 x 50: 4.8 ms, 4 x 50: 11.6 ms, 64 x 50: 142 ms of CUDA time):
# 2.9 ms + 0.0435 ms per computed frame-row. Start-up: the shapes `warm_shapes` lists. Run from the
# repository root: python docs/benchmarks/raw/2026-12-05-s28/codec-padding-sim.py
import random
import sys
from collections import Counter

import torch

sys.path.insert(0, "src")
from intone.engine.chunk_planner import ChunkPlanner, ChunkPolicy
from intone.models.vocoder import WindowVocoder
from intone.ops.batching import bucket_frames

A = 2048 / 44100
GPU_FIXED_MS, GPU_CELL_MS = 2.9, 0.0435


class ShapesOnly:
    num_codebooks = 10
    device = torch.device("cpu")

    def stream_decoder(self):
        return None


def run(streamed=True, ramp=0.0, granule=0, exact=0, buckets=(), step=0.020, call_fixed=0.030, per_row=0.0015,
        total=400, seed=0, gather=0.04):
    rnd = random.Random(seed)
    vocoder = WindowVocoder(ShapesOnly(), 64, 4096, row_granule=granule, exact_rows=exact, frame_buckets=buckets)
    pol = ChunkPolicy(initial_chunk_frames=4, steady_chunk_frames=25, backlog_chunk_frames=50,
                      backlog_load_threshold=0.75, backlog_min_ready=48, left_context_frames=25, ramp_factor=ramp,
                      whole_chunk_frames=50)
    pl = ChunkPlanner(pol, 64)
    t, codec_free, queue, live, done = 0.0, 0.0, [], {}, 0
    parts, gpu_ms = Counter(), 0.0

    def new(i):
        live[i] = dict(front=pl.frontier(whole=not streamed), gen=0, n=max(20, int(rnd.gauss(86, 30))), start=t + 0.3)

    for i in range(64):
        new(i)
    nxt = 64
    while done < total:
        t += step
        streams, fin = {}, []
        for i, s in live.items():
            if t >= s["start"]:
                s["gen"] = min(s["n"], s["gen"] + 1)
            streams[i] = (s["front"], s["gen"])
            if s["gen"] >= s["n"] and not s["front"].terminated:
                fin.append(i)
        queue += [(t, ch) for ch in pl.plan(streams, fin, t)]
        while queue and codec_free <= t:
            start = max(codec_free, queue[0][0] + (0.0 if streamed else gather))
            if start > t:
                break
            batch, queue = [q for q in queue if q[0] <= start], [q for q in queue if q[0] > start]
            chunks = [c for _, c in batch if c.end > c.start]
            fits = bucket_frames(max((c.end - c.start for c in chunks), default=1))  # as _decode_carried caps spans
            spans, rounds = {}, [[]]
            for c in chunks:  # a request's chunks that continue one another join while within `fits`
                s0 = spans.get(c.request_id)
                if s0 is not None and s0[1] == c.start and c.end - s0[0] <= fits:
                    spans[c.request_id] = (s0[0], c.end)
                else:
                    if s0 is not None:
                        rounds.append([s0[1] - s0[0]])
                    spans[c.request_id] = (c.start, c.end)
            rounds[0] += [e - s for s, e in spans.values()]
            calls = 0
            for lengths in rounds:
                for group in vocoder._groups(lengths):
                    ls = [lengths[g] for g in group]
                    rows, longest = vocoder._rows(len(ls)), max(ls)
                    frames = vocoder._frames(longest)
                    parts["useful"] += sum(ls)
                    parts["to longest"] += sum(longest - n for n in ls)
                    parts["to bucket"] += len(ls) * (frames - longest)
                    parts["blank rows"] += (rows - len(ls)) * frames
                    gpu_ms += GPU_FIXED_MS + GPU_CELL_MS * rows * frames
                    calls += 1
            codec_free = start + calls * call_fixed + per_row * len(chunks)
            for _, ch in batch:
                if ch.finished:
                    done += 1
                    del live[ch.request_id]
                    new(nxt)
                    nxt += 1
    cells = sum(parts.values())
    return ({k: 100 * v / cells for k, v in parts.items()}, gpu_ms / parts["useful"] * 86,
            len(vocoder.warm_shapes(512)))


def show(name, **kw):
    share, gpu, shapes = run(**kw)
    print(f"| {name} | {100 - share['useful']:.1f} | {share['to longest']:.1f} | {share['to bucket']:.1f} | "
          f"{share['blank rows']:.1f} | {gpu:.1f} | {shapes} |")


HEAD = ("| variant | padding % | to longest | to bucket | blank rows | modelled codec GPU ms per request "
        "(86 frames) | start-up shapes (warm_up 512) |\n|---|---|---|---|---|---|---|")
print("Streams (first chunk 4, steady 25, backlog 50; fifo: a call takes every chunk waiting)\n")
print(HEAD)
show("shipped", streamed=True)
show("`row_granule` 8", streamed=True, granule=8)
show("`frame_buckets` [25, 29]", streamed=True, buckets=(25, 29))
show("`exact_rows` 16", streamed=True, exact=16)
show("`exact_rows` 16, `frame_buckets` [25, 29]", streamed=True, exact=16, buckets=(25, 29))
show("`exact_rows` 64, `frame_buckets` [25, 29]", streamed=True, exact=64, buckets=(25, 29))
show("`ramp_factor` 1.5", streamed=True, ramp=1.5)
show("`ramp_factor` 1.5, `exact_rows` 16, `frame_buckets` [6, 9, 14, 21, 25]", streamed=True, ramp=1.5, exact=16,
     buckets=(6, 9, 14, 21, 25))
print("\nNon-streamed (pieces of 50, gathered 40 ms)\n")
print(HEAD)
show("shipped", streamed=False)
show("`exact_rows` 16", streamed=False, exact=16)
show("`exact_rows` 64", streamed=False, exact=64)
