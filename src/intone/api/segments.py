"""One response spoken as several engine requests, one per text segment, one after another.

A long input is cut by the model's text frontend into sentences-or-so (CosyVoice3: the official
rules); each runs as its own engine request (same voice and settings; seed + k for segment k, so
a seeded request stays reproducible) and the chunks are re-based into one stream: frames and
sequence numbers continue across segments, and only the last segment's terminal chunk is
terminal. A segment that ends early (error, abort) ends the response there. Closing the stream
aborts the segment that is running.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import AsyncIterator

from intone.errors import InvalidRequestError
from intone.protocol import AudioChunk, SynthesisRequest

SEED_MODULUS = 2**63


def cut(frontend, text: str, field: str) -> list[str]:
    """The text as the segments to speak (the model's text frontend; without one, as sent)."""
    if frontend is None:
        return [text]
    segments = frontend.segments(text)
    if not segments:
        raise InvalidRequestError(field, "has nothing to speak (only punctuation)")
    return segments


def read_transcripts(frontend, references: list) -> list:
    """The references with their transcripts read through the frontend's rules, unsplit (as the
    official client reads a prompt text); without a frontend, as they are."""
    if frontend is None:
        return references
    return [dataclasses.replace(ref, text=frontend.normalize(ref.text)) for ref in references]


def segment_params(params, k: int):
    """Segment k's sampling settings: the request's, with seed + k when it has a seed."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + k) % SEED_MODULUS)


def segment_request(synth: SynthesisRequest, text: str, k: int) -> SynthesisRequest:
    return dataclasses.replace(synth, request_id=f"{synth.request_id}.{k}", text=text,
                               params=segment_params(synth.params, k))


async def generate_segments(engine, synth: SynthesisRequest, texts: list[str]) -> AsyncIterator[AudioChunk]:
    frames = seq = prompt_tokens = completion_tokens = 0
    timings: dict[str, float] = {}
    for k, text in enumerate(texts):
        last = k == len(texts) - 1
        async with contextlib.aclosing(engine.generate(segment_request(synth, text, k))) as stream:
            async for chunk in stream:
                ended_early = chunk.finished and (chunk.error is not None or chunk.stop_reason not in ("stop", "length"))
                if chunk.finished:
                    prompt_tokens += chunk.prompt_tokens
                    completion_tokens += chunk.completion_tokens
                    for stage, seconds in (chunk.timings or {}).items():
                        timings[stage] = timings.get(stage, 0.0) + seconds
                terminal = chunk.finished and (last or ended_early)
                yield dataclasses.replace(
                    chunk, request_id=synth.request_id, seq=seq, start_frame=chunk.start_frame + frames,
                    end_frame=chunk.end_frame + frames, finished=terminal,
                    stop_reason=chunk.stop_reason if terminal else None,
                    prompt_tokens=prompt_tokens if terminal else chunk.prompt_tokens,
                    completion_tokens=completion_tokens if terminal else chunk.completion_tokens,
                    timings=dict(timings) if terminal else None)
                seq += 1
                if ended_early:
                    return
                if chunk.finished:
                    frames += chunk.end_frame
