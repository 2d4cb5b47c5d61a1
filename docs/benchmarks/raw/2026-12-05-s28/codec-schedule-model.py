# Fish's codec under the served chunk schedule (a model, not a measurement). 64 closed-loop requests of
# normal(86, 30) frames, fixed AR steps, the real ChunkPlanner, and one codec server whose call takes every
# waiting chunk (non-streamed pieces after a 40 ms gather) and plans it as the carried decode does, with the
# real WindowVocoder (`carried_rounds`, `_groups`, `_rows`, `_frames`).
# - Padding: each call's computed rows x frames split into useful frames, rows padded to the round's longest,
#   that longest padded to its bucket, and blank rows. GPU time a call: 2.9 ms + 0.0435 ms a computed
#   frame-row (session 22's carried decode at 1, 4 and 64 x 50 frames). Start-up: `warm_shapes(512)`.
# - Streams: a call's wall time is 26 ms + 0.0375 ms a computed frame-row per call of its plan (session 22's
#   decode alone: 4 x 50 frames 33.6 ms, 64 x 50 146 ms), times a factor for the AR beside it; a stream
#   underruns when a chunk arrives after the audio before it played out (playback from its first chunk).
# Run from the repository root; the output is codec-schedule-model.txt.
import random
import sys

import torch

sys.path.insert(0, "src")
from intone.engine.chunk_planner import ChunkPlanner, ChunkPolicy
from intone.models.vocoder import CodecWindow, WindowVocoder

A = 2048 / 44100  # audio per frame


class ShapesOnly:
    """What the vocoder reads of a model to plan its calls (nothing is decoded)."""

    num_codebooks = 10
    device = torch.device("cpu")

    def stream_decoder(self, lean=False):
        return None


def planned_calls(vocoder, chunks):
    """Each call of the carried decode's plan over these chunks: (its chunk lengths, rows, padded frames)."""
    windows = [CodecWindow(hash(c.request_id), c.request_id, None, None, c.start, c.end, 0, c.finished)
               for c in chunks]
    for round_ in vocoder.carried_rounds(windows):
        lengths = [w.end - w.start for _, w in round_]
        for group in vocoder._groups(lengths):
            used = [lengths[i] for i in group]
            yield used, vocoder._rows(len(used)), vocoder._frames(max(used))


def run(streamed=True, ramp=0.0, granule=0, exact=0, buckets=(), step=0.020, factor=1.0, total=400, seed=0,
        first=False):
    """first: `codec.schedule: first` (a call takes only the streams' first chunks while others wait too)."""
    rnd = random.Random(seed)
    vocoder = WindowVocoder(ShapesOnly(), 64, 4096, row_granule=granule, exact_rows=exact, frame_buckets=buckets)
    pl = ChunkPlanner(ChunkPolicy(initial_chunk_frames=4, steady_chunk_frames=25, backlog_chunk_frames=50,
                                  backlog_load_threshold=0.75, backlog_min_ready=48, left_context_frames=25,
                                  ramp_factor=ramp, whole_chunk_frames=50), 64)
    t, codec_free, busy, queue, live, done = 0.0, 0.0, 0.0, [], {}, 0
    cells = dict(useful=0, longest=0, bucket=0, blank=0)
    gpu_ms, under, firsts = 0.0, 0, []

    def new(i):
        live[i] = dict(front=pl.frontier(whole=not streamed), gen=0, n=max(20, int(rnd.gauss(86, 30))),
                       start=t + 0.3, play0=None, delivered=0, under=False)

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
            start = max(codec_free, queue[0][0] + (0.0 if streamed else 0.04))
            if start > t:
                break
            batch, queue = [q for q in queue if q[0] <= start], [q for q in queue if q[0] > start]
            firsts_waiting = [q for q in batch if q[1].start == 0 and streamed]
            if first and 0 < len(firsts_waiting) < len(batch):
                queue = sorted([q for q in batch if q not in firsts_waiting] + queue, key=lambda q: q[0])
                batch = firsts_waiting
            took = 0.0
            for used, rows, frames in planned_calls(vocoder, [c for _, c in batch if c.end > c.start]):
                cells["useful"] += sum(used)
                cells["longest"] += sum(max(used) - n for n in used)
                cells["bucket"] += len(used) * (frames - max(used))
                cells["blank"] += (rows - len(used)) * frames
                gpu_ms += 2.9 + 0.0435 * rows * frames
                took += (0.026 + 0.0000375 * rows * frames) * factor
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
    share = {k: 100 * v / sum(cells.values()) for k, v in cells.items()}
    firsts.sort()
    return dict(share=share, gpu=gpu_ms / cells["useful"] * 86, shapes=len(vocoder.warm_shapes(512)),
                under=f"{under}/{done}", p50=firsts[len(firsts) // 2], p90=firsts[int(len(firsts) * 0.9)],
                p99=firsts[int(len(firsts) * 0.99)], busy=busy / t)


def padding_row(name, **kw):
    r = run(**kw)
    s = r["share"]
    print(f"| {name} | {100 - s['useful']:.1f} | {s['longest']:.1f} | {s['bucket']:.1f} | {s['blank']:.1f} | "
          f"{r['gpu']:.1f} | {r['shapes']} |")


HEAD = ("| variant | padding % | to longest | to bucket | blank rows | modelled codec GPU ms per request "
        "(86 frames) | start-up shapes (warm_up 512) |\n|---|---|---|---|---|---|---|")
RAMP_BUCKETS = (6, 9, 14, 21, 25, 29)


def main():
    print("Streams (first chunk 4, steady 25, backlog 50; a call takes every chunk waiting)\n")
    print(HEAD)
    padding_row("shipped")
    padding_row("`row_granule` 8", granule=8)
    padding_row("`frame_buckets` [25, 29]", buckets=(25, 29))
    padding_row("`exact_rows` 16", exact=16)
    padding_row("`exact_rows` 16, `frame_buckets` [25, 29]", exact=16, buckets=(25, 29))
    padding_row("`exact_rows` 64, `frame_buckets` [25, 29]", exact=64, buckets=(25, 29))
    padding_row("`ramp_factor` 1.5", ramp=1.5)
    padding_row("`ramp_factor` 1.5, `exact_rows` 16, `frame_buckets` [6, 9, 14, 21, 25, 29]", ramp=1.5, exact=16,
                buckets=RAMP_BUCKETS)
    print("\nNon-streamed (pieces of 50, gathered 40 ms)\n")
    print(HEAD)
    padding_row("shipped", streamed=False)
    padding_row("`exact_rows` 16", streamed=False, exact=16)
    padding_row("`exact_rows` 64", streamed=False, exact=64)
    print("\nStreams' underruns, AR steps of 21 ms, by the factor the AR slows the codec\n")
    print("| variant | contention factor | underrun streams | first audio p50 s (model) | codec busy share |")
    print("|---|---|---|---|---|")
    for factor in (1.0, 1.3, 1.6):
        for name, kw in (("shipped", {}), ("exact_rows 16, frame_buckets [25, 29]", dict(exact=16, buckets=(25, 29))),
                         ("ramp 1.5", dict(ramp=1.5)),
                         ("ramp 1.5, exact_rows 16, frame_buckets [6, 9, 14, 21, 25, 29]",
                          dict(ramp=1.5, exact=16, buckets=RAMP_BUCKETS))):
            r = run(step=0.021, factor=factor, **kw)
            print(f"| {name} | {factor} | {r['under']} | {r['p50']:.2f} | {r['busy']:.2f} |")


if __name__ == "__main__":
    main()
