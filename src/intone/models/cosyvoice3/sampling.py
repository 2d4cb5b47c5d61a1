"""CosyVoice3 speech-token sampling, batched, with per-request randomness.

`ras` is the official repetition-aware sampling (cosyvoice.utils.common.ras_sampling, run
on the log-softmax of the 6761 logits):
  1. nucleus: probabilities sorted descending (stable); a token is kept while the mass
     before it is < top_p and fewer than top_k are kept (so the token crossing top_p is
     kept); draw among the kept ones in proportion to their probability;
  2. if the drawn id occurs even once among the last 10 generated tokens, its score is set
     to -inf and a second draw is made from the full remaining distribution (stop ids too).
  The official min-length rule masks id 6561 (sos) rather than the stop ids; kept as is.
`standard` is the usual serving sampler (vLLM order): repetition penalty over the tokens
generated so far, all 200 stop ids masked below min length, temperature, top-k, then top-p
on the top-k distribution.

Draws are exponential races on counter-hash uniforms (ops.sampling), so a request's
choices depend only on its seed, its step and its logits. Shapes never depend on the rows'
values (a batch of both modes computes both for every row, one of a single mode only its own,
which the runner captures apart; candidates are cut at the top-k bound, not at the batch's largest
top_k), so the runner captures this head in CUDA graphs and a row's draw never depends on its
neighbours' parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from intone.ops.sampling import SamplingBatch, apply_repetition_penalty, race
from intone.ops.token_history import last_tokens
from intone.sampling_bounds import SAMPLING_BOUNDS

SPEECH_TOKENS = 6561  # ids 0..6560 are speech; 6561..6760 all end generation
RAS_WINDOW = 10
MAX_TOP_K = SAMPLING_BOUNDS["top_k"]["le"]  # every top_k a request may set stays within these candidates
DRAW_NUCLEUS, DRAW_REDRAW, DRAW_STANDARD = 0, 1, 2


def _exclusive_cumsum(p: Tensor) -> Tensor:
    return torch.cat([torch.zeros_like(p[:, :1]), torch.cumsum(p[:, :-1], dim=-1)], dim=-1)


def _mask_stops(scores: Tensor, rows: Tensor | None, first_only: bool) -> Tensor:
    if rows is None:
        return scores
    cols = slice(SPEECH_TOKENS, SPEECH_TOKENS + 1) if first_only else slice(SPEECH_TOKENS, None)
    scores[:, cols] = torch.where(rows.unsqueeze(1), float("-inf"), scores[:, cols])
    return scores


def ras_sample(logits: Tensor, params: SamplingBatch, recent: Tensor) -> Tensor:
    """logits [R, V] fp32; recent [R, 10] last generated ids (-1 = none) -> ids [R]."""
    temperature = params.temperature.clamp(min=1e-5).unsqueeze(1).to(logits.dtype)
    scores = torch.log_softmax(logits / temperature, dim=-1)
    scores = _mask_stops(scores, params.below_min, first_only=True)
    scores = _mask_stops(scores, params.ban_stop, first_only=False)
    probs = torch.softmax(scores, dim=-1)
    k = min(MAX_TOP_K, probs.shape[-1])
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    sorted_p, order = sorted_p[:, :k], order[:, :k]
    mass_before = _exclusive_cumsum(sorted_p)
    rank = torch.arange(k, device=logits.device)
    keep = (mass_before < params.top_p.unsqueeze(1).to(sorted_p.dtype)) & (rank < params.top_k.unsqueeze(1))
    keep[:, 0] = True
    first = race(torch.where(keep, sorted_p, 0.0), order, params, DRAW_NUCLEUS)

    repeated = (recent == first.unsqueeze(1)).any(dim=1)
    rest = torch.softmax(scores.scatter(1, first.unsqueeze(1), float("-inf")), dim=-1)
    ids = torch.arange(rest.shape[-1], device=logits.device).expand_as(rest)
    second = race(rest, ids, params, DRAW_REDRAW)
    return torch.where(repeated, second, first)


def standard_sample(logits: Tensor, params: SamplingBatch, generated: Tensor) -> Tensor:
    """logits [R, V] fp32; generated [R, W] ids generated so far (-1 = none) -> ids [R]."""
    scores = apply_repetition_penalty(logits.clone(), generated, params, always=True)
    scores = _mask_stops(scores, params.below_min, first_only=False)
    scores = _mask_stops(scores, params.ban_stop, first_only=False)
    scores = scores / params.temperature.clamp(min=1e-5).unsqueeze(1).to(scores.dtype)
    k = min(MAX_TOP_K, scores.shape[-1])
    top, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    top, idx = top[:, :k], idx[:, :k]
    rank = torch.arange(k, device=logits.device)
    top = torch.where(rank < params.top_k.unsqueeze(1), top, float("-inf"))
    probs = torch.softmax(top, dim=-1)
    mass_before = _exclusive_cumsum(probs)
    keep = mass_before < params.top_p.unsqueeze(1).to(probs.dtype)
    keep[:, 0] = True
    return race(torch.where(keep, probs, 0.0), idx, params, DRAW_STANDARD)


def sample_speech_tokens(logits: Tensor, params: SamplingBatch, history: Tensor) -> Tensor:
    """history [R, C]: every generated id of each row, -1 beyond its count (params.steps). A batch of
    one mode (`params.modes`) runs that sampler alone; a row draws the same token either way."""
    if params.modes == "standard":
        return standard_sample(logits, params, history)
    ras = ras_sample(logits, params, last_tokens(history, params.steps, RAS_WINDOW))
    if params.ras is None or params.modes == "ras":
        return ras
    return torch.where(params.ras, ras, standard_sample(logits, params, history))
