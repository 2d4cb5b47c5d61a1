"""Diagnostic (GPU): what a Fish reference encode costs, per clip and per batch, for new and repeated shapes.

    python3 tools/encoder_timing.py
"""

import time

import torch

from intone.models.fish_s2.model import random_s2_pro
from intone.models.fish_s2.reference import warm_up_encoder


def timed(fn, n=3):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1000 * (time.perf_counter() - t))
    return [round(x, 1) for x in out]


def main():
    model = random_s2_pro(device="cuda", codec_dtype=torch.float16)
    rng = torch.Generator().manual_seed(0)
    clip = lambda s: (torch.randn(int(s * 16000), generator=rng) * 0.1, 16000)  # noqa: E731
    print("resample+encode one 5.5 s clip, same shape x3 (ms):", timed(lambda: model.reference_features_batch([clip(5.5)])))
    print("one clip, a new length each time (ms):",
          [timed(lambda s=s: model.reference_features_batch([clip(s)]), 1)[0] for s in (3.1, 4.7, 6.3, 7.9)])
    codec = model.codec
    direct = torch.zeros(1, 242 * 1024, device="cuda")
    print("codec.encode only, fixed shape (ms):", timed(lambda: codec.encode(direct)))
    t = time.perf_counter()
    shapes = warm_up_encoder(codec)
    print(f"warm-up of {shapes} bucket shapes: {time.perf_counter() - t:.1f} s")
    print("after warm-up, one clip of a new length (ms):",
          [timed(lambda s=s: model.reference_features_batch([clip(s)]), 1)[0] for s in (3.3, 4.9, 6.1, 7.7)])
    for n in (4, 16, 32):
        clips = [clip(3 + 5 * i / n) for i in range(n)]
        ms = timed(lambda: model.reference_features_batch(clips), 2)
        print(f"batch of {n} clips of 3-8 s: {ms} ms, {min(ms) / n:.1f} ms per clip")
    # batched == alone
    clips = [clip(3 + i) for i in range(4)]
    together = model.reference_features_batch(clips)
    alone = [model.reference_features_batch([c])[0] for c in clips]
    same = [float((a["codes"] == b["codes"]).float().mean()) for a, b in zip(together, alone)]
    print("batched codes == alone (fraction per clip):", same)
    for dt in (torch.float32,):
        codec.to(dt)
        print(f"{dt} one 5.5 s clip (ms):", timed(lambda: model.reference_features_batch([clip(5.5)])))


if __name__ == "__main__":
    main()
