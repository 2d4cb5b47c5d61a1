# Session 43: session 41's head-kernel-count.py, with `sampling.filtered_race` (one Triton kernel on a GPU, after
# a logsumexp) counted as one kernel and its logsumexp as another. Its race inside is counted too (KERNEL:race, a
# double count of 11). Run from the repository root: PYTHONPATH=src python docs/benchmarks/raw/2026-12-06-s43/head-kernel-count.py
from pathlib import Path

PATCH = '''
_fr = smp.filtered_race
def fr_gpu(logits, idx, params, draw):
    C.c["KERNEL:filtered_race"] += 1; C.c["logsumexp"] += 1; C.mute += 1
    try: return _fr(logits, idx, params, draw)
    finally: C.mute -= 1
smp.filtered_race = fr_gpu
'''
source = (Path(__file__).parent.parent / "2026-12-06-s41" / "head-kernel-count.py").read_text()
exec(source.replace("smp.race = race_gpu\n", "smp.race = race_gpu\n" + PATCH, 1))
