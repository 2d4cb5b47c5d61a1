"""Diagnostic (GPU): the AR step's two graphs (decode forward, head) at serving shapes, as captured
today, with the per-layer elementwise pieces fused (`ops.fused`, the profile's ar.fuse_elementwise),
and with the model's whole functions under torch.compile first (then captured the same way), with
the difference between the outputs.

    python3 tools/ar_step_timing.py [--models fish-s2,cosyvoice3] [--rows 64] [--kv 1024] [--kernels 15]
                                    [--prefill 500 --decodes 49]

--kernels N: the fused variant's top N kernels by GPU time per replay, for the decode graph and the head graph
(torch.profiler over 10 replays of each): where the step's time goes, kernel by kernel.
--prefill 500: the step's first rows one new request's prompt (480+520: two), the rest decode rows, as a served
step with admissions packs them.
"""

import argparse
import time

import torch

from intone.engine.cuda_graphs import capture_graph
from intone.models.registry import load_model
from intone.ops import fused as fused_ops
from intone.ops import paged_decode
from intone.ops.kv_cache import KVCache
from intone.ops.sampling import SamplingBatch
from intone.ops.token_history import CAPACITY
from kernel_timing import timed  # tools/ is the script's directory


def owners(rows: int, prompts: tuple = (), decodes: int | None = None) -> list[int]:
    """Each row's request: prompts' rows first, then `decodes` decode rows (default: the rest), then padding (-1)."""
    own = [i for i, n in enumerate(prompts) for _ in range(n)]
    decodes = rows - len(own) if decodes is None else decodes
    own += [len(prompts) + j for j in range(decodes)]
    return own + [-1] * (rows - len(own))


def fill(kv: KVCache, rows: int, kv_tokens: int, width: int, dtype, out_shape, out_dtype, seed=0,
         prompts: tuple = (), decodes: int | None = None):
    """A decode's and a head's inputs for a realistic batch: rows of lengths kv/2..kv over distinct blocks.
    prompts: the first rows are these prompts' prefills instead (a prompt's rows share its blocks, row i of a
    prompt at position i sees i + 1 keys), then `decodes` decode rows and padding rows (one key, the scratch
    slot), as a served step with new requests packs them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_row = kv_tokens // kv.block_size
    own = torch.tensor(owners(rows, prompts, decodes), device="cuda")
    lens = torch.randint(kv_tokens // 2, kv_tokens, (rows,), generator=g, device="cuda")
    tables = torch.arange((int(own.max()) + 1) * per_row, device="cuda").view(-1, per_row)[own.clamp(min=0)]
    start = 0
    for length in prompts:  # row i of a prompt at position i
        lens[start:start + length] = torch.arange(1, length + 1, device="cuda")
        start += length
    lens[own < 0] = 1
    tables[own < 0] = kv.num_blocks
    slots = tables.gather(1, ((lens - 1) // kv.block_size)[:, None])[:, 0] * kv.block_size + (lens - 1) % kv.block_size
    slots[own < 0] = kv.scratch_slot
    decode = dict(x=torch.randn(rows, width, generator=g, device="cuda").to(dtype) * 0.5, positions=lens - 1,
                  slots=slots, tables=tables, seq_lens=lens)
    ones = torch.ones(rows, device="cuda")
    sampling = SamplingBatch(temperature=0.8 * ones, top_p=0.8 * ones, top_k=torch.full((rows,), 30, device="cuda"),
                             repetition_penalty=ones, seeds=torch.arange(rows, device="cuda"),
                             steps=torch.full((rows,), 5, device="cuda"), max_top_k=30, has_penalty=True,
                             ban_stop=ones.bool() & False, below_min=ones.bool() & False, ras=ones.bool())
    head = dict(hidden=torch.randn(rows, *out_shape, generator=g, device="cuda").to(out_dtype), sampling=sampling,
                history=torch.full((rows, CAPACITY), -1, dtype=torch.long, device="cuda"))
    return decode, head


def variant(model, kv, rows, kv_tokens, compiled: bool, kernels: int = 0, prompts: tuple = (),
            decodes: int | None = None):
    decode_fn, head_fn = model.forward_decode, (model.head if model.head_is_static else None)
    start = time.perf_counter()
    if compiled:
        decode_fn = torch.compile(decode_fn, dynamic=False)
        head_fn = torch.compile(head_fn, dynamic=False) if head_fn is not None else None
    width = model.embed(torch.zeros(1, dtype=torch.long, device="cuda"),
                        torch.zeros(1, model.num_codebooks, dtype=torch.long, device="cuda")).shape[-1]
    probe = model.forward_decode(torch.zeros(1, width, dtype=model.dtype, device="cuda"),
                                 torch.zeros(1, dtype=torch.long, device="cuda"),
                                 torch.full((1,), kv.scratch_slot, device="cuda"),
                                 torch.full((1, 1), kv.num_blocks, device="cuda"),
                                 torch.ones(1, dtype=torch.long, device="cuda"), kv)
    d, h = fill(kv, rows, kv_tokens, width, model.dtype, tuple(probe.shape[1:]), probe.dtype, prompts=prompts,
                decodes=decodes)
    stream = torch.cuda.Stream()
    decode, decode_out = capture_graph(lambda: decode_fn(d["x"], d["positions"], d["slots"], d["tables"],
                                                         d["seq_lens"], kv), None, stream)  # the first run compiles
    if head_fn is not None:
        candidates = 64 if model.head_takes_candidates else None  # the shipped ar.sample_candidates, as served
        head, head_out = capture_graph(lambda: head_fn(h["hidden"], h["sampling"], h["history"], candidates),
                                       decode.pool(), stream)
    setup = time.perf_counter() - start
    out = dict(setup_s=round(setup, 1), decode_ms=timed(lambda: decode.replay()))
    out["decode_out"] = decode_out.float().clone()
    if head_fn is not None:
        out["head_ms"] = timed(lambda: head.replay())
        head.replay()
        out["head_out"] = [t.clone() for t in head_out]
    if kernels:
        kernel_table("decode graph", decode.replay, kernels)
        if head_fn is not None:
            kernel_table("head graph", head.replay, kernels)
    return out


def kernel_table(name: str, replay, top: int, reps: int = 10) -> None:
    """The top kernels of `reps` replays by GPU time, per replay."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / reps / 1000
    print(f"  {name}: {total:.2f} ms of kernels a replay, {sum(e.count for e in events) // reps} kernels", flush=True)
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"    {e.device_time_total / reps / 1000:7.3f} ms {e.count // reps:5d}x  {e.key[:110]}", flush=True)


def apart(model, run):
    """run() with the joined projections (ops.joined_linear, the default) undone, then redone."""
    joined = {}
    for module in (model.talker if hasattr(model, "talker") else model.lm).modules():
        for name in ("qkv", "gate_up", "w13"):
            if getattr(module, name, None) is not None:
                joined[module, name] = getattr(module, name)
                setattr(module, name, None)
    try:
        run()
    finally:
        for (module, name), value in joined.items():
            setattr(module, name, value)


def report(family, rows, name, base, other):
    diff = (other["decode_out"] - base["decode_out"]).abs().max().item()
    scale = base["decode_out"].abs().max().item()
    line = (f"  {name}: decode {other['decode_ms']:.2f} ms (max diff {diff:.3g} of {scale:.3g}), "
            f"compile+capture {other['setup_s']} s")
    if "head_ms" in other:
        same = [round(float((a == b).float().mean()), 4) for a, b in zip(base["head_out"], other["head_out"])]
        line += f"; head {other['head_ms']:.2f} ms (outputs equal: {same})"
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="fish-s2,cosyvoice3")
    ap.add_argument("--rows", default="64")
    ap.add_argument("--kv", type=int, default=1024)
    ap.add_argument("--cosy-bf16", action="store_true", help="also the CosyVoice3 talker in bf16")
    ap.add_argument("--kernels", type=int, default=0, help="the fused variant's top kernels per graph")
    ap.add_argument("--prefill", default="", help="prompts packed first in each step, e.g. 500 or 480+520 (tokens)")
    ap.add_argument("--decodes", type=int, default=0, help="decode rows a step (0: every row not a prompt's); "
                    "the rest are padding rows")
    ap.add_argument("--whole", action="store_true", help="also torch.compile the whole decode step and head")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    prompts = tuple(int(n) for n in args.prefill.split("+") if n)
    runs = [(f, torch.bfloat16 if f == "fish-s2" else torch.float32) for f in args.models.split(",")]
    if args.cosy_bf16:  # the talker in bf16 too (the profiles keep the official fp32)
        runs.append(("cosyvoice3", torch.bfloat16))
    for family, dtype in runs:
        print(f"== {family} {dtype}", flush=True)
        model = load_model(f"random:{family}", device="cuda", dtype=dtype, codec_dtype=torch.float16)
        for rows in map(int, args.rows.split(",")):
            fits = prompts if sum(prompts) < rows else ()  # a step of fewer rows: decodes only
            decodes = min(args.decodes, rows - sum(fits)) if args.decodes else None
            blocks = (max(owners(rows, fits, decodes)) + 1) * (args.kv // 16) + 4
            kv = KVCache(model.kv_layout, blocks, 16, model.dtype, model.device)
            with torch.inference_mode():
                base = variant(model, kv, rows, args.kv, compiled=False, prompts=fits, decodes=decodes)
                fused_ops.use_compiled(True)
                try:
                    helpers = variant(model, kv, rows, args.kv, compiled=False, kernels=args.kernels,
                                      prompts=fits, decodes=decodes)
                    report(family, rows, "fused elementwise", base, helpers)
                    if fits:  # the same step with one program per row (the kernel before prompt runs)
                        paged_decode.use_prompt_runs(False)
                        try:
                            report(family, rows, "prompt rows one program each", base,
                                   variant(model, kv, rows, args.kv, compiled=False, kernels=args.kernels,
                                           prompts=fits, decodes=decodes))
                        finally:
                            paged_decode.use_prompt_runs(True)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{family} rows={rows}: prompt rows variant failed: {type(e).__name__}: {e}"[:2000])
                fused_ops.use_compiled(False)
                apart(model, lambda: report(family, rows, "projections apart (not joined)", base,
                                            variant(model, kv, rows, args.kv, False, prompts=fits, decodes=decodes)))
                fused = None
                if args.whole:  # inductor cannot compile the paged_decode kernel called directly (2026-12-01)
                    try:
                        fused = variant(model, kv, rows, args.kv, compiled=True, prompts=fits, decodes=decodes)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(f"{family} rows={rows}: compiled variant failed: {type(e).__name__}: {e}"[:2000])
            line = f"{family} rows={rows} kv={args.kv}: decode graph {base['decode_ms']:.2f} ms"
            if "head_ms" in base:
                line += f", head graph {base['head_ms']:.2f} ms"
            print(line, flush=True)
            if fused is not None:
                report(family, rows, "whole step compiled", base, fused)
            del kv
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
