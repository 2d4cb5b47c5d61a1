"""How far `cosyvoice3.flow.final_hop: continued` moves a stream's audio, and how much flow work it saves.

    python tools/final_hop_difference.py --model PATH_OR_SPEC [--requests 8] [--device cuda] [--tokens 128:45]

The same streamed requests (synthetic 3-8 s references, seeds fixed, output lengths forced to a normal
draw) run through the engine twice with the flow cache on: once with the official final hop (`whole`),
once `continued`. The tokens are the same both times (the talker never sees the codec), so every chunk but a
stream's last is the same up to the batch shape's rounding (the calls differ), and the last chunk's
difference is the mode's whole effect. Printed per
request and summed: the final chunk's SNR against the official one (dB) and its largest difference, the
whole stream's SNR, and the flow's solved tokens per run (its work). With real weights this is the number
design.md's deliberate difference 10 asks for; with `random:` or `tiny:` weights only the work is meaningful.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf

from intone.bench.dataset import synthetic_items
from intone.engine.config import load_profile
from intone.engine.core import EngineCore
from intone.models.registry import load_model
from intone.protocol import SamplingParams, SynthesisRequest, VoiceReference


def requests(n: int, tokens: tuple[float, float], seed: int) -> list[SynthesisRequest]:
    rng = random.Random(seed)
    out = []
    for i, item in enumerate(synthetic_items(n, Path(tempfile.mkdtemp()), seed=seed)):
        audio, rate = sf.read(item.prompt_wav, dtype="float32")
        length = max(8, int(rng.gauss(*tokens)))
        params = SamplingParams(seed=seed + i, min_new_tokens=length, max_new_tokens=length)
        out.append(SynthesisRequest(f"r{i}", item.target_text, [VoiceReference(item.prompt_text, audio=audio,
                                                                        sample_rate=rate)], params))
    return out


def run(model, device: str, final_hop: str, reqs: list[SynthesisRequest]) -> tuple[dict, int]:
    """Each request's chunks' audio, and the flow's solved tokens."""
    profile = load_profile("cosyvoice3-streaming", device=device, **{
        "cosyvoice3.flow.cache": True, "cosyvoice3.flow.final_hop": final_hop, "cosyvoice3.flow.cuda_graphs": False,
        "cosyvoice3.flow.compile": False, "cosyvoice3.hift.cuda_graphs": False, "ar.cuda_graphs": False,
        "frontend.cuda_graphs": False})
    core = EngineCore(model, profile)
    for r in reqs:
        core.add_request(r)
    chunks: dict[str, list[np.ndarray]] = {}
    while core.has_work():
        for c in core.step():
            if c.error:
                raise RuntimeError(f"{c.request_id}: {c.error}")
            chunks.setdefault(c.request_id, []).append(c.audio)
    return chunks, core.codec.vocoder.useful_tokens


def snr_db(signal: np.ndarray, other: np.ndarray) -> float:
    noise = float(np.sum((signal.astype(np.float64) - other) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(signal.astype(np.float64) ** 2)) / noise)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny:cosyvoice3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", default="128:45", help="output tokens: mean:sd of a normal draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    model = load_model(args.model, device=args.device)
    reqs = requests(args.requests, tuple(float(x) for x in args.tokens.split(":")), args.seed)
    whole, whole_work = run(model, args.device, "whole", reqs)
    cont, cont_work = run(model, args.device, "continued", reqs)
    rows = []
    for r in reqs:
        a, b = whole[r.request_id], cont[r.request_id]
        assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b)), r.request_id
        earlier = max((float(np.abs(x - y).max(initial=0)) for x, y in zip(a[:-1], b[:-1])), default=0.0)
        rows.append(dict(request=r.request_id, chunks=len(a), final_samples=int(a[-1].shape[0]),
                         earlier_chunks_max_diff=earlier, final_snr_db=snr_db(a[-1], b[-1]),
                         final_max_diff=float(np.abs(a[-1] - b[-1]).max(initial=0)),
                         stream_snr_db=snr_db(np.concatenate(a), np.concatenate(b))))
        print(json.dumps(rows[-1]))
    streamed = [row for row in rows if row["chunks"] > 1]
    summary = dict(model=args.model, requests=len(rows), streams_of_several_hops=len(streamed),
                   flow_tokens_whole=whole_work, flow_tokens_continued=cont_work,
                   flow_work_ratio=round(cont_work / max(whole_work, 1), 3),
                   final_snr_db_median=float(np.median([row["final_snr_db"] for row in streamed])) if streamed else None,
                   final_snr_db_min=min((row["final_snr_db"] for row in streamed), default=None),
                   earlier_chunks_max_diff=max(row["earlier_chunks_max_diff"] for row in rows))
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps(dict(summary=summary, requests=rows), indent=1))


if __name__ == "__main__":
    main()
