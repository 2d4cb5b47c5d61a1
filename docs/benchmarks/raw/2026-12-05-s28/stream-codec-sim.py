# Fish streams at C64 with the codec's call cost taken from its padded work (a model, not a measurement):
# session 27's stream model (fixed AR steps, the real ChunkPlanner, 64 closed-loop streams of normal(86, 30)
# frames, playback from the first chunk, a stream underruns when a chunk arrives after the audio before it
# played out) with one codec server whose call takes every waiting chunk, plans it with the real
# WindowVocoder (spans, rounds, `_groups`, `_rows`, `_frames`) and lasts, per call of the plan,
# 26 ms + 0.0375 ms a computed frame-row (session 22's carried decode alone: 4 x 50 frames 33.6 ms, 64 x 50
# 146 ms) times a contention factor for the AR beside it. Run from the repository root.
import random
import statistics
import sys

import torch

sys.path.insert(0, "src")
from intone.engine.chunk_planner import ChunkPlanner, ChunkPolicy
from intone.models.vocoder import WindowVocoder
from intone.ops.batching import bucket_frames

A = 2048 / 44100  # audio per frame


class ShapesOnly:
    num_codebooks = 10
    device = torch.device("cpu")

    def stream_decoder(self, lean=False):
        return None


def call_seconds(vocoder, chunks, factor):
    """The wall time of a codec call over these chunks: each call of its plan, fixed + per computed cell."""
    fits = bucket_frames(max((c.end - c.start for c in chunks), default=1))
    spans, rounds = {}, [[]]
    for c in chunks:
        s0 = spans.get(c.request_id)
        if s0 is not None and s0[1] == c.start and c.end - s0[0] <= fits:
            spans[c.request_id] = (s0[0], c.end)
        else:
            if s0 is not None:
                rounds.append([s0[1] - s0[0]])
            spans[c.request_id] = (c.start, c.end)
    rounds[0] += [e - s for s, e in spans.values()]
    total = 0.0
    for lengths in rounds:
        for group in vocoder._groups(lengths):
            cells = vocoder._rows(len(group)) * vocoder._frames(max(lengths[i] for i in group))
            total += (0.026 + 0.0000375 * cells) * factor
    return total


def run(ramp=0.0, exact=0, buckets=(), step=0.021, factor=1.3, total=400, seed=0):
    rnd = random.Random(seed)
    vocoder = WindowVocoder(ShapesOnly(), 64, 4096, exact_rows=exact, frame_buckets=buckets)
    pol = ChunkPolicy(initial_chunk_frames=4, steady_chunk_frames=25, backlog_chunk_frames=50,
                      backlog_load_threshold=0.75, backlog_min_ready=48, left_context_frames=25, ramp_factor=ramp)
    pl = ChunkPlanner(pol, 64)
    t, codec_free, busy, queue, live, done, under, firsts = 0.0, 0.0, 0.0, [], {}, 0, 0, []

    def new(i):
        live[i] = dict(front=pl.frontier(), gen=0, n=max(20, int(rnd.gauss(86, 30))), start=t + 0.3, play0=None,
                       delivered=0, under=False)

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
            start = max(codec_free, queue[0][0])
            batch, queue = [q for q in queue if q[0] <= start], [q for q in queue if q[0] > start]
            took = call_seconds(vocoder, [c for _, c in batch if c.end > c.start], factor)
            codec_free, busy = start + took, busy + took
            for _, ch in batch:
                s = live[ch.request_id]
                if s["play0"] is None:
                    s["play0"] = codec_free
                    firsts.append(codec_free - s["start"] + 0.3)
                elif codec_free > s["play0"] + s["delivered"] * A + 1e-9:
                    s["under"] = True
                s["delivered"] += ch.end - ch.start
                if ch.finished:
                    under, done = under + s["under"], done + 1
                    del live[ch.request_id]
                    new(nxt)
                    nxt += 1
    firsts.sort()
    return under, done, firsts[len(firsts) // 2], firsts[int(0.9 * len(firsts))], busy / t


print("| variant | contention factor | underrun streams | first audio p50 / p90 s (model) | codec busy share |")
print("|---|---|---|---|---|")
for factor in (1.0, 1.3, 1.6):
    for name, kw in (("shipped", {}), ("exact_rows 16, frame_buckets [25, 29]", dict(exact=16, buckets=(25, 29))),
                     ("ramp 1.5", dict(ramp=1.5)),
                     ("ramp 1.5, exact_rows 16, frame_buckets [6, 9, 14, 21, 25, 29]",
                      dict(ramp=1.5, exact=16, buckets=(6, 9, 14, 21, 25, 29)))):
        u, d, p50, p90, share = run(factor=factor, **kw)
        print(f"| {name} | {factor} | {u}/{d} | {p50:.2f} / {p90:.2f} | {share:.2f} |")
