"""Diagnostic (GPU): the decode attention kernel, the sampling race and the best-candidates sort at the serving
shapes.

    python3 tools/kernel_timing.py [--only best]
"""

import sys

import torch

from intone.ops import sampling
from intone.ops import race as race_kernel
from intone.ops import paged_decode
from intone.ops.attention import decode_attention_reference


def timed(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def attention(rows, length, heads, kv_heads, dim, dtype, bs=16):
    blocks_per_row = -(-length // bs)
    blocks = rows * blocks_per_row + 8
    k = torch.randn(blocks, bs, kv_heads, dim, device="cuda").to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(rows, heads, dim, device="cuda").to(dtype)
    tables = torch.randperm(blocks, device="cuda")[: rows * blocks_per_row].view(rows, blocks_per_row)
    seq_lens = torch.randint(length // 2, length + 1, (rows,), device="cuda")
    seq_lens[0] = 1  # the shortest row: one key

    def run():
        return paged_decode.paged_decode_attention(q, k, v, tables, seq_lens)
    ms = timed(run)
    err = (run().float() - decode_attention_reference(q, k, v, tables, seq_lens).float()).abs().max().item()
    read = 2 * int(seq_lens.sum()) * kv_heads * dim * k.element_size()
    print(f"decode attention rows={rows} L<={length} {heads}/{kv_heads}x{dim} {dtype}: "
          f"{1000 * ms:.0f} us ({read / ms / 1e6:.0f} GB/s of KV), max err vs reference {err:.2e}")


def race(rows, n):
    probs = torch.softmax(torch.randn(rows, n, device="cuda"), -1)
    idx = torch.argsort(torch.rand(rows, n, device="cuda"), -1)
    seeds, steps = torch.arange(rows, device="cuda"), torch.zeros(rows, dtype=torch.long, device="cuda")

    def torch_race():
        u = sampling.request_uniforms(seeds, steps, 3, idx)
        return idx.gather(1, (probs / (-torch.log(u)).to(probs.dtype)).argmax(-1, keepdim=True))
    print(f"race rows={rows} n={n}: torch {1000 * timed(torch_race):.0f} us, "
          f"triton {1000 * timed(lambda: race_kernel.race_argmax(probs, idx, seeds, steps, 3)):.0f} us")


def snake_timing(shape, dtype):
    from intone.ops.snake import snake, snake_reference

    x = torch.randn(*shape, device="cuda").to(dtype)
    alpha = torch.rand(1, shape[1], 1, device="cuda").to(dtype) + 0.1
    print(f"snake {shape} {dtype}: torch {1000 * timed(lambda: snake_reference(x, alpha)):.0f} us, "
          f"triton {1000 * timed(lambda: snake(x, alpha)):.0f} us, "
          f"equal {(snake(x, alpha) == snake_reference(x, alpha)).float().mean().item():.6f}")


def best(rows, width, k):
    """`sampling.best_tokens`: torch's top-k over the order keys against the one-kernel version (ops/top_candidates)."""
    from intone.ops import fused
    from intone.ops.top_candidates import best_tokens_kernel

    logits = torch.randn(rows, width, device="cuda")
    ours = best_tokens_kernel(logits, k)
    keys = lambda: torch.topk(fused.order_keys_eager(logits), k, dim=-1).values  # noqa: E731
    same = torch.equal(ours, (width - 1) - (keys() & 0xFFFFFFFF))
    print(f"best {k} of [{rows}, {width}]: torch top-k {1000 * timed(keys):.1f} us, one kernel "
          f"{1000 * timed(lambda: best_tokens_kernel(logits, k)):.1f} us, the same ids {same}", flush=True)


def main():
    if sys.argv[1:] == ["--only", "best"]:
        for rows, width, k in ((48, 4096, 64), (48, 4097, 64), (64, 4096, 32), (16, 4096, 64), (512, 4096, 64)):
            best(rows, width, k)
        return
    for rows, length in ((64, 256), (64, 1024), (64, 2048), (16, 1024), (512, 512)):
        attention(rows, length, 32, 8, 128, torch.bfloat16)
    for rows, length in ((64, 512), (64, 1024), (16, 512), (1024, 512)):
        attention(rows, length, 14, 2, 64, torch.float32)
    snake_timing((8, 64, 100 * 2048), torch.float16)
    snake_timing((8, 1024, 100 * 8), torch.float16)
    snake_timing((8, 64, 24000 * 5 // 15), torch.float32)
    race(64, 4097)
    race(64, 4096)
    best(48, 4096, 64)


if __name__ == "__main__":
    main()
