"""Diagnostic (GPU): the Fish codec's convolutions one by one, at the shapes the served stateful decode
gives them (rows x chunk frames, each row carrying the state of an earlier 4-frame chunk): cuDNN's
heuristic plan against its benchmarked plan (not a measurement once the heuristic's plan is cached:
cuDNN reuses it), without its bias (cuDNN adds a bias as a pass of its own), and other formulations (a
transposed convolution as one GEMM and an overlap-add; a convolution as a channels-last conv2d; a
dilated one folded into the batch). --hift: the same for CosyVoice3's HiFT on full responses' calls.
--encoder: the same for Fish's reference encoder (rows x frames of 44.1 kHz / 2048 audio, e.g. 16x172: sixteen 8 s
clips, a call the frontend makes of a burst). --whole: only the whole decode's time and top kernels (runs on older
trees too: TREE=.before).

    python3 tools/codec_convs.py [--shapes 64x25,64x50] [--encoder 1x129,16x172] [--hift 12x256] [--top 12] [--whole]
"""

import argparse
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from intone.models.fish_s2.codec_stream import StreamingDecoder
from intone.models.registry import load_model
from kernel_timing import timed  # tools/ is the script's directory


class Call:
    """One convolution as the decode called it (torch.nn.functional's conv1d / conv_transpose1d)."""

    def __init__(self, transposed, x, weight, bias, stride, dilation, groups):
        self.transposed, self.x, self.weight, self.bias = transposed, x.clone(), weight, bias
        self.stride, self.dilation, self.groups = stride, dilation, groups

    def run(self, bias=True):
        b = self.bias if bias else None
        if self.transposed:
            return CONV_T(self.x, self.weight, b, self.stride)
        return CONV(self.x, self.weight, b, self.stride, 0, self.dilation, self.groups)

    def __str__(self):
        c_out = self.weight.shape[1 if self.transposed else 0]
        return (f"{'convT' if self.transposed else 'conv'} {tuple(self.x.shape)} k{self.weight.shape[-1]} s{self.stride}"
                f" d{self.dilation} g{self.groups} -> {c_out}")


CONV, CONV_T = F.conv1d, F.conv_transpose1d
_one = lambda v: v[0] if isinstance(v, (tuple, list)) else v  # noqa: E731


def trans_conv_gemm(call):
    """A transposed convolution (padding 0, kernel 2 x stride or = stride) as one GEMM and an overlap-add."""
    ci, co, k = call.weight.shape
    s, x = call.stride, call.x
    b, _, length = x.shape
    taps = torch.matmul(call.weight.reshape(ci, co * k).t(), x).view(b, co, k, length)  # [B, Co, K, L]
    first = taps[:, :, :s].transpose(2, 3).reshape(b, co, length * s)
    y = first if k == s else F.pad(first, (0, s)) + F.pad(taps[:, :, s:].transpose(2, 3).reshape(b, co, length * s), (s, 0))
    return y + call.bias.view(1, -1, 1)


def conv_channels_last(call):
    w = call.weight.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    x2 = call.x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    return F.conv2d(x2, w, call.bias, stride=(1, call.stride), dilation=(1, call.dilation), groups=call.groups).squeeze(2)


def channels_last_ready(call):
    """The convolution as a decoder kept channels-last would run it: conv2d (transposed too) on an input and
    a weight already in that layout, so no conversion is timed; a dilated one undilated over the input viewed
    [N, C, L / d, d] (its interleaved subsequences side by side in W: no fold, no dilation for cuDNN).
    (the timed function, its output back in [N, C, L] for the error check, untimed)"""
    cl = torch.channels_last
    x, w, d = call.x, call.weight, call.dilation
    n, c, length = x.shape
    if call.transposed:
        x4, w4 = x.unsqueeze(2).contiguous(memory_format=cl), w.unsqueeze(2).contiguous(memory_format=cl)
        return (lambda: F.conv_transpose2d(x4, w4, call.bias, stride=(1, call.stride))), (lambda y: y.squeeze(2))
    if d == 1:
        x4, w4 = x.unsqueeze(2).contiguous(memory_format=cl), w.unsqueeze(2).contiguous(memory_format=cl)
        return (lambda: F.conv2d(x4, w4, call.bias, stride=(1, call.stride), groups=call.groups)), \
            (lambda y: y.squeeze(2))
    m = -(-length // d)
    x4 = F.pad(x, (0, m * d - length)).view(n, c, m, d).contiguous(memory_format=cl)
    w4 = w.unsqueeze(3).contiguous(memory_format=cl)
    valid = length - (w.shape[-1] - 1) * d
    return (lambda: F.conv2d(x4, w4, call.bias, groups=call.groups)), \
        (lambda y: y.reshape(n, y.shape[1], -1)[..., :valid])


@contextmanager
def recording(seen: list):
    """Every F.conv1d / F.conv_transpose1d call inside, appended to seen as a Call."""
    def conv(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
        seen.append(Call(False, x, w, b, _one(stride), _one(dilation), groups))
        return CONV(x, w, b, stride, padding, dilation, groups)

    def conv_t(x, w, b=None, stride=1, *rest):
        seen.append(Call(True, x, w, b, _one(stride), 1, 1))
        return CONV_T(x, w, b, stride, *rest)

    F.conv1d, F.conv_transpose1d = conv, conv_t
    try:
        yield seen
    finally:
        F.conv1d, F.conv_transpose1d = CONV, CONV_T


def fish_calls(codec, shape, k):
    """Every convolution of one stateful decode of a rows x frames chunk (after a 4-frame one)."""
    rows, frames = map(int, shape.split("x"))
    device = next(codec.parameters()).device
    g = torch.Generator(device=device).manual_seed(0)
    decoder = StreamingDecoder(codec)
    first = torch.randint(0, 8, (rows, k, 4), device=device, generator=g)
    _, states = decoder.decode(first, [4] * rows, [None] * rows)
    codes = torch.randint(0, 8, (rows, k, frames), device=device, generator=g)
    run = lambda: decoder.decode(codes, [frames] * rows, states)  # noqa: E731
    with recording([]) as seen:
        run()
    return f"Fish stateful decode {shape}", seen, run, rows * frames * codec.hop_length / codec.sample_rate


def encoder_calls(codec, shape):
    """Every convolution of one reference encode of rows x frames (noise at the codec's rate, as padded clips)."""
    rows, frames = map(int, shape.split("x"))
    device = next(codec.parameters()).device
    g = torch.Generator(device=device).manual_seed(0)
    audio = 0.1 * torch.randn(rows, frames * codec.hop_length, device=device, generator=g)
    run = lambda: codec.encode(audio)  # noqa: E731
    with recording([]) as seen:
        run()
    return f"Fish reference encode {shape}", seen, run, rows * frames * codec.hop_length / codec.sample_rate


def hift_calls(shape, device="cuda"):
    """Every convolution of one CosyVoice3 HiFT call as a full response makes it: rows x mel frames
    (each row its whole utterance, finalized), float32 with TF32 as `tf32: true` serves."""
    from hift_timing import build  # tools/
    from intone.models.cosyvoice3.hift_source import SourceWindow

    rows, frames = map(int, shape.split("x"))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    hift = build(torch.device(device), torch.float32)
    g = torch.Generator().manual_seed(0)
    lengths = [max(32, frames - 8 * i) // 2 * 2 for i in range(rows)]  # staggered, as a call's rows are
    mels = [torch.randn(80, n, generator=g).to(device) for n in lengths]
    harm = hift.cfg.nb_harmonics + 1

    def run():
        window = SourceWindow([0] * rows, [0] * rows, torch.zeros(rows, harm, dtype=torch.float64, device=device),
                              [0] * rows)
        return hift.vocode_batch(mels, [True] * rows, window)
    with recording([]) as seen:
        run()
    return f"CosyVoice3 HiFT {shape} (full responses)", seen, run, sum(lengths) / 50


def variants(call):
    """(name, the timed function, cuDNN benchmark mode, the output as the call's for the error check)."""
    same = lambda y: y  # noqa: E731
    out = [("as called", call.run, False, same), ("benchmark", call.run, True, same),
           ("no bias", lambda: call.run(False), False, same)]
    if call.transposed:
        out.append(("gemm+overlap-add", lambda: trans_conv_gemm(call), False, same))
    else:
        if call.dilation > 1 and call.groups == 1:
            from intone.ops.dilated_conv import dilated_conv1d
            out.append(("folded", lambda: dilated_conv1d(call.x, call.weight, call.bias, call.dilation), False, same))
        if call.weight.shape[-1] * call.dilation < 20:  # channels-last is ~60x slower at dilation 9
            out.append(("channels-last conv2d", lambda: conv_channels_last(call), False, same))
    if call.x.dtype != torch.float64:  # cuDNN never takes float64 channels-last
        ready, back = channels_last_ready(call)
        out.append(("channels-last ready", ready, False, back))
    return out


def report(label, seen, run, audio_s, args) -> None:
    torch.backends.cudnn.benchmark = False
    whole = timed(run, reps=5)
    print(f"== {label} ({audio_s:.1f} audio s): {whole:.1f} ms ({audio_s / whole * 1000:.0f} audio-s/s), "
          f"{len(seen)} convolutions", flush=True)
    rows = []
    for call in [] if args.whole else seen:
        times, ref = {}, None
        for name, fn, bench, back in variants(call):
            torch.backends.cudnn.benchmark = bench
            t = time.perf_counter()
            y = fn()
            torch.cuda.synchronize()
            first = 1000 * (time.perf_counter() - t)
            ms = timed(fn, reps=10)
            y = back(y)
            ref = y.float() if ref is None else ref
            err = (y.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            times[name] = (ms, first, err)
        torch.backends.cudnn.benchmark = False
        rows.append((times["as called"][0], str(call), times))
    total = sum(r[0] for r in rows) if rows else float("nan")
    best = sum(min(t[0] for t in r[2].values()) for r in rows) if rows else float("nan")
    ready = sum(r[2].get("channels-last ready", r[2]["as called"])[0] for r in rows) if rows else float("nan")
    print(f"   convolutions alone: as called {total:.1f} ms, best variant each {best:.1f} ms, channels-last ready "
          f"{ready:.1f} ms", flush=True)
    for _, desc, times in sorted(rows, key=lambda r: -r[0])[:args.top]:
        cells = ", ".join(f"{n} {ms:.2f} ms (first {first:.0f} ms, rel err {err:.1e})"
                          for n, (ms, first, err) in times.items())
        print(f"   {desc}: {cells}", flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x25,64x50", help="Fish: streams x chunk frames")
    ap.add_argument("--encoder", default="", help="Fish reference encoder: rows x frames, e.g. 1x129,16x172")
    ap.add_argument("--hift", default="", help="CosyVoice3 HiFT: rows x mel frames, e.g. 12x256,48x256")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--whole", action="store_true")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    encodes = [s for s in args.encoder.split(",") if s]
    if shapes or encodes:
        model = load_model("random:fish-s2", device="cuda", dtype=torch.bfloat16, codec_dtype=torch.float16)
        calls = [lambda s=s: fish_calls(model.codec, s, model.num_codebooks) for s in shapes] + \
            [lambda s=s: encoder_calls(model.codec, s) for s in encodes]
        for call in calls:
            with torch.inference_mode():
                report(*call(), args)
            torch.cuda.empty_cache()
        del model
    for shape in [s for s in args.hift.split(",") if s]:
        with torch.inference_mode():
            report(*hift_calls(shape), args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
