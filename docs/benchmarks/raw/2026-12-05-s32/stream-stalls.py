"""Per stream: the engine chunks (HTTP pieces arriving together), when each arrives against when the player needs it."""
import collections
import json
import sys
import statistics as st

def engine_chunks(chunks, tol=0.01):
    out = []
    for t, a in chunks:
        if out and t - out[-1][0] < tol and out[-1][2] < 0.74:  # a split piece of the same engine chunk
            out[-1][1] += a; out[-1][2] = a
        else:
            out.append([t, a, a])
    return [(t, a) for t, a, _ in out]

def analyse(path):
    recs = json.load(open(path))["levels"][0]["records"]
    need_first = []  # audio the first chunk would need to hold so the stream never stalls
    gaps2 = []
    for r in recs:
        ch = engine_chunks(r["chunks"])
        t0 = ch[0][0]
        # the stream never stalls iff for every k: arrival_k - t0 <= audio before k (+ start buffer)
        need = max([t - t0 - sum(a for _, a in ch[:k]) for k, (t, _) in enumerate(ch)] + [0])
        need_first.append(need)
        if len(ch) > 1:
            gaps2.append(ch[1][0] - t0)
    q = lambda xs, p: sorted(xs)[int(p * (len(xs) - 1))]
    print(path.split("/")[-1], "streams", len(recs))
    print("  start buffer (s of audio ahead at first audio) so that no stall: p50 %.3f p90 %.3f p99 %.3f max %.3f; zero for %d"
          % (q(need_first, .5), q(need_first, .9), q(need_first, .99), max(need_first), sum(n == 0 for n in need_first)))
    print("  chunk 2 arrives after first audio: p50 %.3f p90 %.3f p99 %.3f" % (q(gaps2, .5), q(gaps2, .9), q(gaps2, .99)))
    print("  mean first chunk audio %.3f s" % st.mean(engine_chunks(r["chunks"])[0][1] for r in recs))



FR = 2048 / 44100  # a Fish frame's audio


def where_stalls(path):
    """A player that pauses when empty: the stalls by chunk index and the chunk sizes."""
    recs = json.load(open(path))["levels"][0]["records"]
    where, sizes_at, stall_by_k = collections.Counter(), collections.defaultdict(list), collections.Counter()
    for r in recs:
        ch = engine_chunks(r["chunks"])
        end = ch[0][0]
        for k, (t, a) in enumerate(ch):
            if t > end and k > 0:
                stall_by_k[min(k + 1, 8)] += t - end
                where[min(k + 1, 8)] += 1
                end = t
            end += a
            sizes_at[min(k + 1, 8)].append(round(a / FR))
    print("  stalls by chunk (1-based, 8: 8+): count", dict(sorted(where.items())),
          "seconds", {k: round(v, 1) for k, v in sorted(stall_by_k.items())})
    print("  HTTP piece sizes (frames) median by index", {k: sorted(v)[len(v) // 2] for k, v in sorted(sizes_at.items())})


if __name__ == "__main__":
    for p in sys.argv[1:]:
        analyse(p)
        where_stalls(p)
