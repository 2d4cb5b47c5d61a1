"""First audio of a streamed level's opening burst (requests sent in its first 0.1 s) against the rest.
usage: python opening-burst.py results.json [...]"""
import json
import statistics
import sys


def quantile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


for path in sys.argv[1:]:
    recs = json.load(open(path))["levels"][0]["records"]
    t0 = min(r["sent_at"] for r in recs)
    burst = [r for r in recs if r["sent_at"] - t0 < 0.1]
    rest = [r for r in recs if r["sent_at"] - t0 >= 0.1]
    fa = [r["first_audio_s"] for r in rest]
    print(f"{path}: burst {len(burst)} first audio mean {statistics.mean(r['first_audio_s'] for r in burst):.3f} s, "
          f"stalled {sum(r['underrun_s'] > 0 for r in burst)}; rest {len(rest)} first audio mean {statistics.mean(fa):.3f} "
          f"p50 {quantile(fa, .5):.3f} p90 {quantile(fa, .9):.3f} p99 {quantile(fa, .99):.3f} s, "
          f"stalled {sum(r['underrun_s'] > 0 for r in rest)}")
