"""`intone eval wer|sim`: Seed-TTS quality metrics on a directory of generated audio."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from intone.eval.meta import parse_meta_list
from intone.eval.wer import evaluate_wer


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="WER (Whisper) or speaker similarity (WavLM + ECAPA) of generated audio")
    which = p.add_subparsers(dest="metric", required=True)
    wer = which.add_parser("wer", help="Whisper-large-v3 WER, official Seed-TTS normalization")
    wer.add_argument("--asr-model", required=True, metavar="DIR", help="local Whisper model directory")
    wer.add_argument("--batch-size", type=int, default=8)
    wer.add_argument("--lang", default="en", choices=["en"])
    sim = which.add_parser("sim", help="WavLM-Large + ECAPA-TDNN cosine similarity to the prompt audio")
    sim.add_argument("--sim-checkpoint", required=True, metavar="FILE", help="wavlm_large_finetune.pth")
    sim.add_argument("--wavlm", default=None, metavar="DIR", help="WavLM-Large config directory (optional)")
    for sp in (wer, sim):
        sp.add_argument("--audio-dir", required=True, help="generated audio, <utt_id>.wav")
        sp.add_argument("--meta", required=True, help="Seed-TTS meta.lst")
        sp.add_argument("--device", default=None)
        sp.add_argument("--output", default=None, help="write per-utterance records and the summary as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch  # the quality models' own (torch-free until a metric runs)

    items = parse_meta_list(args.meta)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.metric == "wer":
        report = evaluate_wer(Path(args.audio_dir), items, Path(args.asr_model), device=device,
                              lang=args.lang, batch_size=args.batch_size)
    else:
        from intone.eval.sim import evaluate_sim

        report = evaluate_sim(Path(args.audio_dir), items, Path(args.sim_checkpoint),
                              Path(args.wavlm) if args.wavlm else None, device=device)
    summary = report.summary()
    print(json.dumps(summary, indent=2))
    if args.output:
        Path(args.output).write_text(report.to_json())
    return 1 if summary.get("failures") else 0
