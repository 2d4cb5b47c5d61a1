# A model of Fish streams at C64 (not a measurement): AR steps of a fixed time, the real ChunkPlanner,
# one codec server whose call takes every chunk waiting and lasts fixed + per-row seconds; a stream
# underruns when a chunk arrives after the audio before it has played (playback from its first chunk).
import sys, random, math
sys.path.insert(0, "src")  # run from the repository root
from intone.engine.chunk_planner import ChunkPlanner, ChunkPolicy
A = 2048 / 44100  # audio per frame
def run(initial=4, steady=25, ramp=0.0, backlog=50, margin=0.0, step=0.020, call_fixed=0.030, per_row=0.0015, n_streams=64, total=400, seed=0, lead=None):
    rnd = random.Random(seed)
    pol = ChunkPolicy(initial_chunk_frames=initial, steady_chunk_frames=steady, backlog_chunk_frames=backlog,
                      backlog_load_threshold=0.75, backlog_min_ready=48, left_context_frames=25, ramp_factor=ramp, listener_margin_s=margin, frame_seconds=A)
    pl = ChunkPlanner(pol, 64)
    t = 0.0; codec_free = 0.0; queue = []; seq = 0
    live = {}; done = 0; started = 0; under = 0; firsts = []
    # each stream: frames target, frontier, generated, first arrival, audio delivered end time
    def new(i):
        n = max(20, int(rnd.gauss(86, 30)))
        live[i] = dict(front=pl.frontier(), gen=0, n=n, play0=None, delivered=0, under=False, start=t + 0.3)
    for i in range(n_streams):
        new(i); started += 1
    nxt = n_streams
    while done < total:
        # AR step
        t += step
        streams = {}
        fin = []
        for i, s in live.items():
            if t >= s["start"]:
                s["gen"] = min(s["n"], s["gen"] + 1)
            streams[i] = (s["front"], s["gen"])
            if s["gen"] >= s["n"] and not s["front"].terminated:
                fin.append(i)
        for ch in pl.plan(streams, fin, t):
            queue.append((t, ch))
        # codec: single server; a call starts when free and takes all waiting
        while queue and codec_free <= t:
            start = max(codec_free, queue[0][0])
            batch = [q for q in queue if q[0] <= start]
            queue = [q for q in queue if q[0] > start]
            end = start + call_fixed + per_row * len(batch)
            codec_free = end
            for _, ch in batch:
                s = live[ch.request_id]
                frames = ch.end - ch.start
                if s["play0"] is None:
                    s["play0"] = end; firsts.append(end - s["start"] + 0.3)
                else:
                    # underrun if this chunk arrives after the audio before it played out
                    if end > s["play0"] + s["delivered"] * A + 1e-9:
                        s["under"] = True
                s["delivered"] += frames
                if ch.finished:
                    under += s["under"]; done += 1
                    del live[ch.request_id]
                    new(nxt); nxt += 1
    firsts.sort()
    return under, done, firsts[len(firsts)//2]
for name, kw in [("shipped", {}), ("ramp1.5", dict(ramp=1.5)), ("ramp1.3", dict(ramp=1.3)), ("ramp2", dict(ramp=2.0)),
                 ("init6 ramp1.5", dict(initial=6, ramp=1.5)), ("init8 ramp1.5", dict(initial=8, ramp=1.5))]:
    u, d, f = run(**kw)
    print(f"{name:16s} underrun {u}/{d} first p50 {f:.2f}")
print("--- slow codec (60 ms + 3 ms/row), step 22 ms")
for name, kw in [("shipped", {}), ("ramp1.5", dict(ramp=1.5)), ("ramp1.3", dict(ramp=1.3)), ("ramp2", dict(ramp=2.0))]:
    u, d, f = run(step=0.022, call_fixed=0.06, per_row=0.003, **kw)
    print(f"{name:16s} underrun {u}/{d} first p50 {f:.2f}")

for name, kw in [("ramp1.5 m0.25", dict(ramp=1.5, margin=0.25)), ("ramp1.5 m0.4", dict(ramp=1.5, margin=0.4)), ("m0.3", dict(margin=0.3))]:
    u, d, f = run(step=0.022, call_fixed=0.06, per_row=0.003, **kw)
    print(f"{name:16s} underrun {u}/{d} first p50 {f:.2f}")
print("--- fast codec")
for name, kw in [("ramp1.5 m0.25", dict(ramp=1.5, margin=0.25)), ("m0.3", dict(margin=0.3))]:
    u, d, f = run(**kw)
    print(f"{name:16s} underrun {u}/{d} first p50 {f:.2f}")
