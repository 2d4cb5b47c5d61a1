# Fish's reference encoder at C64 (a model, not a measurement): session 26's shipped row encoded 320 clips in
# 103 calls (~3 a call). A call's clips pad to its longest clip's length bucket and its rows to a power of
# two (`fish_s2.reference_rows` 16, `reference_bucket_s` 2 as shipped); clips uniform in 3-8 s. The
# encoder's work grows with rows x padded frames. Run from the repository root.
import math
import random
import sys

sys.path.insert(0, "src")
from intone.models.fish_s2.reference import ReferencePlan
from intone.ops.batching import bucket_rows

RATE, HOP = 44100, 2048
rnd = random.Random(0)


def padding(clips_a_call: int, plan: ReferencePlan, trials: int = 20000) -> float:
    useful = computed = 0
    for _ in range(trials):
        frames = [math.ceil(rnd.uniform(3, 8) * RATE / HOP) for _ in range(clips_a_call)]
        for call in plan.calls(frames):
            useful += sum(frames[i] for i in call)
            computed += bucket_rows(len(call)) * plan.frames(max(frames[i] for i in call))
    return 100 * (1 - useful / computed)


print("| clips waiting a call | shipped (16 rows, 2 s) | 16 rows, 1 s | 1 row, 2 s | 1 row, 1 s | 1 row, 0.5 s |")
print("|---|---|---|---|---|---|")
for n in (1, 2, 3, 4, 8):
    cells = [padding(n, ReferencePlan.of(rows, s, RATE, HOP)) for rows, s in ((16, 2), (16, 1), (1, 2), (1, 1), (1, 0.5))]
    print(f"| {n} | " + " | ".join(f"{c:.1f}%" for c in cells) + " |")
print("start-up shapes:", {f"{r} rows, {s} s": len(ReferencePlan.of(r, s, RATE, HOP).shapes(RATE, HOP))
                           for r, s in ((16, 2), (1, 1), (1, 0.5))})
