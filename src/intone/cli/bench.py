"""`intone bench [abba]`: load a speech server and report throughput, latency and quality."""

from __future__ import annotations

import argparse

from intone.bench.presets import PRESETS, apply_preset
from intone.bench.runner import run as run_sweep
from intone.bench.runner import run_abba


def _describe(preset: dict) -> str:
    return (f"{preset['dataset']}, {preset['num_requests']} requests, concurrency {preset['concurrency']}, "
            f"warm-up {preset['warmup']}, output frames {preset['force_output_frames']}")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a server: concurrency sweep, or 'abba' to compare two servers")
    p.add_argument("mode", nargs="?", choices=["run", "abba"], default="run")
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="an already running server")
    target.add_argument("--model", default=None, help="start (and stop) our own server with this model")
    target.add_argument("--profile", default=None)
    target.add_argument("--device", default=None)
    target.add_argument("--serve-args", default=None, help="more `intone serve` arguments, as one string")
    target.add_argument("--api-key", default=None)
    target.add_argument("--no-audit", dest="audit", action="store_false",
                        help="with --model: skip the frame trace and its audit (by default every chunk the server "
                             "sends is traced and audited after the run, and the engine's tables must be empty)")
    target.add_argument("--a", default=None, help="abba: `intone serve` arguments of arm A")
    target.add_argument("--b", default=None, help="abba: `intone serve` arguments of arm B")
    load = p.add_argument_group("load (a flag given here overrides the preset's value)")
    load.add_argument("--preset", default=None, choices=sorted(PRESETS),
                      help="the workload of our quoted numbers: " + "; ".join(
                          f"{k}: {_describe(v)}" for k, v in sorted(PRESETS.items())))
    load.add_argument("--dataset", default=None, help="'synthetic' (default) or a Seed-TTS meta.lst")
    load.add_argument("--num-requests", type=int, default=None, help="measured requests per level (default 64)")
    load.add_argument("--concurrency", default=None, help="one level or a comma list, a sweep (default 1)")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    load.add_argument("--warmup", type=int, default=None,
                      help="requests run first at each level and excluded from the figures (default 4)")
    load.add_argument("--reference-pool", type=int, default=None, metavar="N",
                      help="cycle every request through N distinct reference clips, so a server's reference "
                           "cache is hit (default: a distinct clip for every request, warm-up included)")
    load.add_argument("--stream", action="store_true", help="stream raw PCM and time every chunk")
    load.add_argument("--seed", type=int, default=0, help="request i gets seed + i")
    load.add_argument("--max-new-tokens", type=int, default=None)
    load.add_argument("--force-output-frames", default=None, metavar="SPEC",
                      help="exact output lengths for random-weight runs: N, uniform:A:B or normal:MEAN:STD")
    load.add_argument("--profile-seconds", type=float, default=None, metavar="S",
                      help="a profiler window of S seconds on the server during each measured level (the server "
                           "needs `intone serve --profile-dir`; given with --model, it gets one): the report's GPU "
                           "timeline says how busy the GPU was and whose kernels held it (the level's figures are "
                           "then diagnostics: profiling slows the engine)")
    load.add_argument("--profile-delay", type=float, default=2.0, metavar="S",
                      help="with --profile-seconds: the window opens this long into the level")
    load.add_argument("--sample-rate", type=int, default=None, help="if the server does not report one")
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", required=True)
    out.add_argument("--save-audio", default=None, metavar="DIR", help="write <utt_id>.wav per request")
    out.add_argument("--title", default=None)
    quality = p.add_argument_group("quality (needs --save-audio)")
    quality.add_argument("--asr-model", default=None, metavar="DIR", help="local Whisper directory for WER")
    quality.add_argument("--sim-checkpoint", default=None, metavar="FILE", help="wavlm_large_finetune.pth for SIM")
    quality.add_argument("--wavlm", default=None, metavar="DIR", help="local WavLM-Large config directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    apply_preset(args)
    if args.mode == "abba":
        run_abba(args)
    else:
        results = run_sweep(args)
        if any(level["summary"]["failed"] for level in results["levels"]):
            return 1
    return 0
