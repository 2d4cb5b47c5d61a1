# HiFT's padding in CosyVoice3 full-response codec calls (a model, not a measurement): a call holds ~12
# requests (session 26's varlen row: 31 calls for 384 requests), HiFT vocodes each one's generated mel
# (2 frames a token, tokens normal(128, 45) as the preset forces) as one right-padded batch, or split by
# `group_jobs` at `cosyvoice3.hift.call_cost`. GPU time per HiFT call from session 19's HiFT alone
# (fp32: 6 first chunks, 448 mel frames, 8.3 ms; 48 windows, 6820 frames, 109.9 ms): 1.2 ms + 0.016 ms a
# computed frame-row. Eager HiFT also costs ~20 ms of host launches a call (its ~1100 kernels), graphed
# HiFT ~1 ms. Run from the repository root.
import random
import sys

sys.path.insert(0, "src")
from intone.ops.batching import group_jobs

FIXED_MS, FRAME_MS, HOST_EAGER_MS = 1.2, 0.016, 20.0
rnd = random.Random(0)
calls_modelled = 2000
print("| hift.call_cost (tokens) | padding % | HiFT calls per codec call | HiFT GPU ms per codec call | "
      "+ eager host ms |\n|---|---|---|---|---|")
for cost in (None, 25, 50, 100, 200):
    padded = useful = calls = gpu = 0
    for _ in range(calls_modelled):
        tokens = [max(10, int(rnd.gauss(128, 45))) for _ in range(12)]
        for group in group_jobs(tokens, 64, 16384, cost):
            t = [tokens[i] for i in group]
            padded += 2 * len(t) * max(t)
            useful += 2 * sum(t)
            calls += 1
            gpu += FIXED_MS + FRAME_MS * 2 * len(t) * max(t)
    n = calls / calls_modelled
    print(f"| {cost} | {100 * (1 - useful / padded):.1f} | {n:.2f} | {gpu / calls_modelled:.1f} | "
          f"{gpu / calls_modelled + HOST_EAGER_MS * n:.1f} |")
