"""`intone speak`: synthesize one utterance offline (no server) and write a wav."""

from __future__ import annotations

import argparse
import sys
import time

from intone.errors import InvalidRequestError

MAX_REFERENCE_SECONDS = 30.0


def add_parser(sub) -> None:
    p = sub.add_parser("speak", help="synthesize text to a wav file, offline")
    p.add_argument("text", help="the text to speak")
    p.add_argument("-o", "--output", required=True, help="output .wav path")
    p.add_argument("--model", default="tiny:fish-s2", help="checkpoint directory or tiny:<family>")
    p.add_argument("--ref-audio", action="append", default=[], metavar="FILE",
                   help="reference audio for voice cloning (repeat for several references)")
    p.add_argument("--ref-text", action="append", default=[], metavar="TEXT",
                   help="transcript of each --ref-audio, in the same order")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=2048, help="cap on generated frames")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=30)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from intone.audio import read_audio, write_wav
    from intone.engine.offline import OfflineRequest, run_to_completion
    from intone.models import load_model
    from intone.models.base import SamplingParams, VoiceReference

    if len(args.ref_audio) != len(args.ref_text):
        missing = "--ref-text" if len(args.ref_audio) > len(args.ref_text) else "--ref-audio"
        raise InvalidRequestError(missing, "give one --ref-text for each --ref-audio")
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_new_tokens, seed=args.seed,
    ).validate()
    references = []
    for path, text in zip(args.ref_audio, args.ref_text):
        audio, rate = read_audio(path, field="--ref-audio", max_seconds=MAX_REFERENCE_SECONDS)
        references.append(VoiceReference(text=text, audio=audio, sample_rate=rate))

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.model, device=device)
    start = time.perf_counter()
    prompt = model.build_prompt(args.text, references)
    request = run_to_completion(model, [OfflineRequest(prompt, params)])[0]
    audio = model.decode(request.codes.unsqueeze(0))[0] if request.frames else torch.zeros(0)
    elapsed = time.perf_counter() - start
    write_wav(args.output, audio, model.sample_rate)

    seconds = audio.shape[0] / model.sample_rate
    print(
        f"wrote {args.output}: {len(request.frames)} frames, {seconds:.2f} s at {model.sample_rate} Hz "
        f"(seed {request.params.seed}, stop: {request.stop_reason}, {elapsed:.2f} s, "
        f"RTF {elapsed / seconds if seconds else float('nan'):.2f})"
    )
    if not request.frames:
        print("warning: the model stopped before the first frame; the wav is empty", file=sys.stderr)
    return 0
