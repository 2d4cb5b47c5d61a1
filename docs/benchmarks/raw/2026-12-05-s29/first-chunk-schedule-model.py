# Fish streams' first audio under `codec.schedule: first` (a model, not a measurement): session 28's codec
# schedule model (`../2026-12-05-s28/codec-schedule-model.py`, its `run`), where a call now takes only the
# streams' first chunks while later chunks wait beside them. First audio = the model's request start (0.3 s
# after the previous request of its seat ended) to the end of the call that carried its first chunk.
# Run from the repository root; the output is first-chunk-schedule-model.txt.
import importlib.util
import sys

sys.path.insert(0, "src")
spec = importlib.util.spec_from_file_location("s28", "docs/benchmarks/raw/2026-12-05-s28/codec-schedule-model.py")
s28 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(s28)

NEW = dict(ramp=1.5, exact=16, buckets=(6, 9, 14, 21, 25, 29))
print("| variant | contention factor | first audio p50 / p90 / p99 s (model) | underrun streams | codec busy share |")
print("|---|---|---|---|---|")
for factor in (1.0, 1.3, 1.6):
    for name, kw in (("shipped", {}), ("schedule first", dict(first=True)), ("ramp 1.5, exact_rows 16, buckets", NEW),
                     ("the same + schedule first", dict(NEW, first=True))):
        rows = [s28.run(step=0.021, factor=factor, seed=seed, **kw) for seed in range(3)]
        p = [sum(r[q] for r in rows) / 3 for q in ("p50", "p90", "p99")]
        under = ", ".join(r["under"] for r in rows)
        print(f"| {name} | {factor} | {p[0]:.2f} / {p[1]:.2f} / {p[2]:.2f} | {under} | "
              f"{sum(r['busy'] for r in rows) / 3:.2f} |")
