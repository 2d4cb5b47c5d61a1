# Session 28's Fish codec schedule model (`../2026-12-05-s28/codec-schedule-model.py`, its `run`) against this
# session's measured streamed rows (H100, call 2): the contention factor (how much slower a served call runs
# than the decode alone) at which the model's codec busy share meets the measured one, what the model then
# says of underruns, and its prediction for the next session's variants. A model, not a measurement.
# Run from the repository root; the output is codec-model-calibrated.txt.
import importlib.util
import sys

sys.path.insert(0, "src")
spec = importlib.util.spec_from_file_location("s28", "docs/benchmarks/raw/2026-12-05-s28/codec-schedule-model.py")
s28 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(s28)

# measured (call 2): mean step, codec busy / the level's wall time, padding, streams that stalled of 320
MEASURED = {"shipped": (0.0215, 14.44 / 15.52, 54.4, 265 / 320), "ramp 1.5": (0.0231, 15.87 / 16.55, 67.0, 239 / 320)}
VARIANTS = {"shipped": {}, "ramp 1.5": dict(ramp=1.5),
            "ramp 1.5, frame_buckets [6, 9, 14, 21, 25, 29]": dict(ramp=1.5, buckets=s28.RAMP_BUCKETS),
            "ramp 1.5, exact_rows 16, the same buckets": dict(ramp=1.5, exact=16, buckets=s28.RAMP_BUCKETS)}


def row(name, kw, step, factor, seeds=8):
    runs = [s28.run(step=step, factor=factor, seed=seed, **kw) for seed in range(seeds)]
    under = sum(int(r["under"].split("/")[0]) for r in runs) / sum(int(r["under"].split("/")[1]) for r in runs)
    busy = sum(r["busy"] for r in runs) / seeds
    pad = sum(100 - r["share"]["useful"] for r in runs) / seeds
    return busy, pad, under


print("| variant | step ms | factor | codec busy share (measured) | padding % (measured) | streams that stall (measured) |")
print("|---|---|---|---|---|---|")
for name, (step, busy_m, pad_m, under_m) in MEASURED.items():
    for factor in (1.6, 2.2, 2.8, 3.4):
        busy, pad, under = row(name, VARIANTS[name], step, factor)
        print(f"| {name} | {1000 * step:.1f} | {factor} | {busy:.2f} ({busy_m:.2f}) | {pad:.1f} ({pad_m:.1f}) | "
              f"{100 * under:.0f}% ({100 * under_m:.0f}%) |")
print("\nPredictions at the step the ramp measured (23.1 ms)\n")
print("| variant | factor | codec busy share | padding % | streams that stall |")
print("|---|---|---|---|---|")
for factor in (2.2, 2.8):
    for name, kw in VARIANTS.items():
        busy, pad, under = row(name, kw, 0.0231, factor)
        print(f"| {name} | {factor} | {busy:.2f} | {pad:.1f} | {100 * under:.0f}% |")
