"""Tokens the CosyVoice3 flow solves per stream (x2 = mel frames) under each flow mode, on the preset's workload:
references of 75-200 tokens (uniform), outputs normal(128, 45) tokens (at least 10), the official hops (25 +
alignment so that reference + hop is a multiple of 25, then 50, 100, 100...; 3 lookahead tokens). 20000 draws.
Also the first hop's tokens (its new frames / 2) with and without `cosyvoice3.flow.reference_ahead`.
Output: flow-work-count.txt."""
import random

rng = random.Random(0)
tot = {"official": 0, "cache": 0, "bounded": 0, "full response": 0}
hops, n = 0, 20000
first = {"first hop": 0, "first hop after reference_ahead": 0}
for _ in range(n):
    P, T = rng.randint(75, 200), max(10, int(rng.gauss(128, 45)))
    ends, end, hop = [], 25 + (-P) % 25, 25
    while end + 3 < T:
        ends.append(end)
        hop = min(100, 2 * hop)
        end += hop
    hops += len(ends) + 1
    if ends:  # the first hop's tokens solved once its tokens exist (on the first audio's path)
        ahead = (2 * (P - 3)) // 50 * 25  # whole 50-frame chunks of the reference the lookahead does not reach
        first["first hop"] += P + ends[0]
        first["first hop after reference_ahead"] += P + ends[0] - ahead
    prev = cont = 0
    for i, e in enumerate(ends):
        cont += (P + e) if i == 0 else (e - prev)
        prev = e
    tot["official"] += sum(P + e for e in ends) + (P + T)  # every hop re-solves reference + tokens so far
    tot["cache"] += cont + (P + T)  # non-final hops continue; the final re-solves everything
    tot["bounded"] += (cont + (T - prev)) if ends else P + T  # the final hop continues too
    tot["full response"] += P + T
for k, v in tot.items():
    print(f"{k:14s} {v / n:7.1f} tokens per stream, {v / tot['official']:.3f} of the official")
print(f"hops per stream {hops / n:.2f}")
for k, v in first.items():
    print(f"{k:32s} {v / n:6.1f} tokens per stream")
