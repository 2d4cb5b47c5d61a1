"""Diagnostic (GPU): what a CosyVoice3 reference costs in the real-size frontend, per piece, per clip
and per batch (clips of 3-8 s at 24 kHz, new lengths each time, as the user path has them).

    python3 tools/cosy_frontend_timing.py
"""

import time

import torch

from intone.models.cosyvoice3 import frontend as fe
from intone.models.cosyvoice3.features import official_resample, prompt_mel, whisper_log_mel
from intone.models.cosyvoice3.frontend import random_frontend


def synced(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, 1000 * (time.perf_counter() - t)


def main():
    front = random_frontend("cuda")
    tok, spk = front.tokenizer, front.speaker_encoder
    t = time.perf_counter()
    fe.warm_up(tok, spk)
    print(f"warm-up {time.perf_counter() - t:.1f} s")
    g = torch.Generator().manual_seed(0)
    rate = 24000

    def clip(i):
        return torch.randn(int((3 + 5 * ((i * 0.618) % 1)) * rate) + i, generator=g) * 0.1

    # pieces, one clip of a new length each time
    rows = {k: [] for k in ("resample16", "resample24", "prompt_mel", "whisper_mel", "tokenize", "campplus")}
    for i in range(6):
        a = clip(i).cuda()
        a16, ms = synced(lambda: official_resample(a, rate, 16000, bucket=rate))
        rows["resample16"].append(ms)
        a24, ms = synced(lambda: official_resample(a, rate, 24000, bucket=rate))
        rows["resample24"].append(ms)
        rows["prompt_mel"].append(synced(lambda: prompt_mel(a24))[1])
        rows["whisper_mel"].append(synced(lambda: whisper_log_mel(a16))[1])
        rows["tokenize"].append(synced(lambda: tok.tokenize_batch([a16]))[1])
        rows["campplus"].append(synced(lambda: spk.embed_batch([a16]))[1])
    for k, v in rows.items():
        print(f"{k:12s} one clip (ms): {[round(x, 1) for x in v]}")
    for n in (1, 4, 8, 16, 32):
        clips = [(clip(100 + n + i), rate) for i in range(n)]
        _, ms = synced(lambda: front.extract_batch(clips))
        clips16 = [official_resample(c.cuda(), rate, 16000, bucket=rate) for c, _ in clips]
        _, tok_ms = synced(lambda: tok.tokenize_batch(clips16))
        _, spk_ms = synced(lambda: [spk.embed_batch([c]) for c in clips16])
        _, spk_batch_ms = synced(lambda: spk.embed_batch(clips16))
        print(f"batch of {n:2d}: extract_batch {ms:7.1f} ms ({ms / n:5.1f} per clip); tokenizer batched "
              f"{tok_ms:6.1f} ms; CAM++ one by one {spk_ms:6.1f} ms, batched {spk_batch_ms:6.1f} ms")


if __name__ == "__main__":
    main()
