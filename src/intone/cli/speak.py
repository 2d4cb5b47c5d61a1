"""`intone speak`: synthesize one utterance offline (no server) and write a wav."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import time

import numpy as np
import soundfile as sf

from intone.api.segments import cut, generate_segments, read_transcripts, segment_request
from intone.audio import read_audio, write_wav
from intone.engine.client import Engine
from intone.engine.config import default_params, load_profile
from intone.errors import InvalidRequestError
from intone.protocol import SynthesisRequest, VoiceReference

MAX_REFERENCE_SECONDS = 30.0
PROMPT_TEMPLATE_TOKENS = 512  # a prompt's tokens besides its text, transcripts and reference frames (bound)
# the engine's request fields -> this command's options
OPTION_OF_FIELD = {"speed": "--speed", "instructions": "--instructions", "ref_audio": "--ref-audio",
                   "ref_text": "--ref-text", "input": "text"}


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
    p.add_argument("--temperature", type=float, default=None, help="default: the profile's")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--sampling-mode", choices=["ras", "standard"], default=None,
                   help="the model's sampling mode (default: the profile's)")
    p.add_argument("--instructions", default=None, help="style instruction (CosyVoice3's instruct mode)")
    p.add_argument("--speed", type=float, default=1.0, help="tempo (CosyVoice3, without --stream)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--stream", action="store_true",
                   help="run through the engine (its own process) and write the wav as chunks arrive")
    p.add_argument("--profile", default=None,
                   help="deploy profile (path or name under profiles/): the engine's settings and sampling defaults")
    p.add_argument("--trace-frames", default=None, metavar="FILE", help="with --stream: one JSON line per chunk")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # the engine core and the models bring torch: loaded only when a command runs them
    from intone.engine.core import EngineCore
    from intone.engine.offline import synthesize
    from intone.models import default_profile, text_frontend

    if len(args.ref_audio) != len(args.ref_text):
        missing = "--ref-text" if len(args.ref_audio) > len(args.ref_text) else "--ref-audio"
        raise InvalidRequestError(missing, "give one --ref-text for each --ref-audio")
    profile = load_profile(args.profile or default_profile(args.model),
                           **({"device": args.device} if args.device else {}))
    seed = secrets.randbits(63) if args.seed is None else args.seed  # drawn here, so the output can name it
    params = default_params(
        profile, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, mode=args.sampling_mode,
        repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_new_tokens, seed=seed,
    ).validate()
    references = []
    for path, text in zip(args.ref_audio, args.ref_text):
        audio, rate = read_audio(path, field="--ref-audio", max_seconds=MAX_REFERENCE_SECONDS)
        references.append(VoiceReference(text=text, audio=audio, sample_rate=rate))
    frontend = text_frontend(args.model)  # the text cut as the server cuts it
    segments, references = cut(frontend, args.text, "text"), read_transcripts(frontend, references)

    if args.stream:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return asyncio.run(_stream(args, segments, references, params, device))
    # Seats and KV cache for these segments only (no start-up captures or cache for a batch this run never
    # has): a prompt is at most its text's and transcripts' bytes as tokens, its references' frames (at
    # most 50 a second) and the template, plus the frames it may generate.
    profile.ar.max_num_seqs = len(segments)
    prompt_bound = (max(len(text.encode()) for text in segments) + sum(len(r.text.encode()) for r in references)
                    + sum(50 * len(r.audio) // r.sample_rate for r in references) + PROMPT_TEMPLATE_TOKENS)
    profile.ar.kv_cache_tokens = profile.ar.kv_cache_tokens or len(segments) * (prompt_bound + params.max_new_tokens)
    core = EngineCore.build(args.model, profile)
    try:
        start = time.perf_counter()
        request = SynthesisRequest("speak", args.text, references, params, speed=args.speed,
                                   instructions=args.instructions, stream=False)
        try:
            done = synthesize(core, [segment_request(request, text, k) for k, text in enumerate(segments)])
        except InvalidRequestError as e:  # named as this command's option
            raise InvalidRequestError(OPTION_OF_FIELD.get(e.field, e.field), e.message) from None
        elapsed = time.perf_counter() - start
        sample_rate = core.model.sample_rate
    finally:
        core.close()
    audio = np.concatenate([d.audio for d in done])
    write_wav(args.output, audio, sample_rate)
    seconds = audio.shape[0] / sample_rate
    print(
        f"wrote {args.output}: {sum(d.frames for d in done)} frames in {len(done)} segment(s), "
        f"{seconds:.2f} s at {sample_rate} Hz "
        f"(seed {seed}, stop: {done[-1].stop_reason}, {elapsed:.2f} s, "
        f"RTF {elapsed / seconds if seconds else float('nan'):.2f})"
    )
    if not any(d.frames for d in done):
        print("warning: the model stopped before the first frame; the wav is empty", file=sys.stderr)
    return 0


async def _stream(args, segments: list[str], references, params, device: str) -> int:
    engine = await Engine.from_profile(args.profile, model=args.model, trace_frames=args.trace_frames, device=device)
    start = time.perf_counter()
    first_audio = None
    frames = 0
    try:
        with sf.SoundFile(args.output, "w", samplerate=engine.sample_rate, channels=1, subtype="PCM_16") as out:
            request = SynthesisRequest("speak", segments[0], references, params, speed=args.speed,
                                       instructions=args.instructions)
            chunks = engine.generate(request) if len(segments) == 1 else generate_segments(engine, request, segments)
            async for chunk in chunks:
                if chunk.error:
                    raise InvalidRequestError("request", chunk.error)
                if len(chunk.audio):
                    first_audio = first_audio or time.perf_counter() - start
                    out.write(chunk.audio)
                frames = chunk.end_frame
                if chunk.finished:
                    reason = chunk.stop_reason
    finally:
        await engine.shutdown()
    elapsed = time.perf_counter() - start
    seconds = frames * engine.info["samples_per_frame"] / engine.sample_rate
    first = f"{first_audio:.2f} s" if first_audio is not None else "none"
    print(f"wrote {args.output}: {frames} frames, {seconds:.2f} s at {engine.sample_rate} Hz "
          f"(streamed; first audio after {first}, stop: {reason}, {elapsed:.2f} s)")
    return 0
