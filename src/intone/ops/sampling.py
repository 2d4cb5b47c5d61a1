"""Batched sampling whose randomness belongs to the request, not to the batch.

Order of operations for each row (the official Fish order, plus an optional penalty):
  1. repetition penalty (only if != 1): for tokens in the row's penalty window, a positive
     logit is divided by the penalty and a negative one multiplied by it;
  2. top-k and top-p are decided on the *unscaled* logits: sort descending (equal logits: the
     lower token id first), keep rank < k and tokens whose cumulative probability (including
     themselves) is <= top_p; the best token is always kept;
  3. the kept logits are divided by max(temperature, 1e-5);
  4. softmax, then an exponential race: argmax(p_i / E_i) with E_i = -log(U_i). The race needs
     no normalisation, so it runs on softmax's numerators exp(z_i - z_max).

Only the best `candidates` tokens are sorted; a row whose top_k is within them gets the same token
whatever their number (the order is total, and no step sums over the candidates but the cumulative
probability, which reads the ranks before a token only), so a batch may sort as few as its largest
top_k needs.

U_i is a counter-based hash of (request seed, step, draw index, token index), so a
request's draws never depend on which other requests share the batch (invariant 3).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from intone.ops import fused
from intone.ops import race as race_kernel
from intone.ops import top_candidates
from intone.sampling_bounds import MAX_SAMPLE_CANDIDATES

_M32 = 0xFFFFFFFF
_kernel_failed = False  # set once `race.filtered_race` has failed in this process (its torch ops run instead)
_best_kernel_failed = False  # likewise `top_candidates.best_tokens_kernel` (torch's top-k runs instead)
log = logging.getLogger(__name__)


def _mix32(x: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding 32-bit values.

    Products of two 32-bit values may wrap in int64; the low 32 bits stay right.
    """
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _M32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: Tensor, steps: Tensor, draw: int) -> Tensor:
    """Each row's 32-bit key for one draw: f(seed_r, step_r, draw) [R]."""
    seeds = seeds.to(torch.int64)
    key = _mix32(_mix32(seeds & _M32) ^ ((seeds >> 32) & _M32) ^ 0x9E3779B9)
    key = _mix32(key ^ ((steps.to(torch.int64) * 0x27D4EB2F) & _M32))
    return _mix32(key ^ race_kernel.draw_salt(draw))


def request_uniforms(seeds: Tensor, steps: Tensor, draw: int, token_ids: Tensor) -> Tensor:
    """Uniforms in (0, 1), shaped like token_ids [R, N]: U = f(seed_r, step_r, draw, token id)."""
    key = row_keys(seeds, steps, draw)
    bits = _mix32(_mix32(key.unsqueeze(1) ^ token_ids) + token_ids)
    return ((bits >> 8).to(torch.float64) + 0.5) / float(1 << 24)


def race(probs: Tensor, idx: Tensor, params: "SamplingBatch", draw: int) -> Tensor:
    """The exponential race over candidates: idx [R, N] token ids with probabilities probs (or weights
    proportional to them) -> [R]."""
    if race_kernel.available(probs):
        return race_kernel.race_argmax(probs, idx, params.seeds, params.steps, draw)
    u = request_uniforms(params.seeds, params.steps, draw, idx)
    score = probs / (-torch.log(u)).to(probs.dtype)
    return idx.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, all [R]."""

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor  # int64; values >= vocabulary mean "no top-k"
    repetition_penalty: Tensor
    seeds: Tensor  # int64
    steps: Tensor  # int64: the request's step index (frames generated before this one)
    max_top_k: int  # host-side bound on top_k, so no device sync is needed to size the top-k
    has_penalty: bool = False  # host-side: any row with repetition_penalty != 1
    ban_stop: Tensor | None = None  # [R] bool: rows that must not sample the stop token
    below_min: Tensor | None = None  # [R] bool: rows still short of their min_new_tokens
    ras: Tensor | None = None  # [R] bool: rows in the model's repetition-aware mode (the default)
    # host-side: which of a two-mode head's samplers the rows need ("standard", "ras" or "both"); a head
    # may skip the other's kernels (the draws are per row, so the tokens stay the same)
    modes: str = "both"

    def with_overrides(self, temperature: float | None = None, top_p: float | None = None) -> "SamplingBatch":
        def fill(t, value):
            return t if value is None else torch.full_like(t, value)

        return dataclasses.replace(self, temperature=fill(self.temperature, temperature), top_p=fill(self.top_p, top_p))


def apply_repetition_penalty(logits: Tensor, window: Tensor, params: SamplingBatch, always: bool = False) -> Tensor:
    """window: [R, W] token indices into logits' last axis, -1 for empty slots.

    always: apply it whatever `has_penalty` says (static shapes for graph capture; a penalty
    of 1.0 leaves every logit bit for bit as it was)."""
    if not (always or params.has_penalty):
        return logits
    vocab = logits.shape[-1]
    # Empty slots go to a spare column that is dropped; duplicates just count twice.
    slots = torch.where(window >= 0, window, vocab)
    hits = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.int32, device=logits.device)
    hits.scatter_add_(1, slots, torch.ones_like(slots, dtype=torch.int32))
    p = params.repetition_penalty.unsqueeze(1).to(logits.dtype)
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(hits[:, :vocab] > 0, penalised, logits)


def sample(logits: Tensor, params: SamplingBatch, draw: int, candidates: int | None = None,
           idx: Tensor | None = None) -> Tensor:
    """logits [R, V] float32 -> token index [R] (int64).

    Only the `candidates` best tokens (default: max_top_k) can survive, so the filter works on those,
    sorted; the cumulative probabilities still use the softmax over all V. Rows whose top_k is at most
    `candidates` draw the same token for any such bound (module docstring), so a graph-captured caller
    may pass a fixed bound at least the batch's max_top_k. idx: `best_tokens(logits, k)` when the caller has
    them (another draw on the same logits; k is then theirs).
    """
    global _kernel_failed
    if idx is None:
        idx = best_tokens(logits, min(candidates or params.max_top_k, logits.shape[-1]))
    if race_kernel.available(logits) and idx.shape[-1] <= MAX_SAMPLE_CANDIDATES and not _kernel_failed:
        try:  # one kernel for the ~15 of filtered_race
            return race_kernel.filtered_race(logits, idx, torch.logsumexp(logits, dim=-1), params, draw)
        except Exception:  # it compiles at its first call (a warm-up, before any capture): the same ops in torch
            log.exception("the filtered race kernel failed; sampling runs its torch ops instead")
            _kernel_failed = True
    return filtered_race(logits, idx, params, draw)


def filtered_race(logits: Tensor, idx: Tensor, params: SamplingBatch, draw: int) -> Tensor:
    """The draw among each row's sorted candidates idx [R, K]: steps 2-4 of the module docstring."""
    k = idx.shape[-1]
    top = logits.gather(1, idx)
    cum = running_total(torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True)))
    rank = torch.arange(k, device=logits.device)
    remove = (cum > params.top_p.to(cum.dtype).unsqueeze(1)) | (rank >= params.top_k.unsqueeze(1))
    remove[:, 0] = False
    scaled = torch.where(remove, float("-inf"), top) / torch.clamp(params.temperature.to(top.dtype), min=1e-5).unsqueeze(1)
    return race(torch.exp(scaled - scaled[:, :1]), idx, params, draw)


def running_total(p: Tensor, exact: int = MAX_SAMPLE_CANDIDATES) -> Tensor:
    """Cumulative sums along the last axis of p [R, K]. On CUDA the first `exact` (the most candidates
    `ar.sample_candidates` may ask for) are each a plain
    left-to-right sum, whatever R and K: the innermost-axis scan sums in tiles whose width depends on
    both, so a prefix's last bits would depend on how many candidates are sorted and on the batch's rows
    (a column scan runs each row in order; one row alone would take CUB's scan, so it goes as two). The
    rest (ranks that only a top_k above `exact` keeps) carry on from them."""
    if not p.is_cuda:
        return torch.cumsum(p, dim=-1)  # one row at a time, in order
    rows, head = p.shape[0], p[:, :exact]
    front = (head if rows > 1 else torch.cat([head, head])).t().contiguous().cumsum(0).t()[:rows]
    if p.shape[1] <= exact:
        return front
    return torch.cat([front, front[:, -1:] + torch.cumsum(p[:, exact:], dim=-1)], dim=-1)


def best_tokens(logits: Tensor, k: int) -> Tensor:
    """The ids of each row's k largest float32 logits [R, k], in descending order, equal logits by
    ascending id: one int64 key per logit (its bits made to order as signed integers, above its
    reversed id: `fused.order_keys`) makes every key distinct, so the first k do not depend on k or on
    topk's ties."""
    global _best_kernel_failed
    if logits.dtype != torch.float32:
        raise TypeError(f"best_tokens needs float32 logits, got {logits.dtype}")
    if top_candidates.available(logits, k) and not _best_kernel_failed:
        try:  # the same keys in one kernel (`ops/top_candidates.py`)
            return top_candidates.best_tokens_kernel(logits, k)
        except Exception:  # it compiles at its first call (a warm-up, before any capture): torch's top-k instead
            log.exception("the best-candidates kernel failed; sampling sorts with torch's top-k instead")
            _best_kernel_failed = True
    keys = torch.topk(fused.order_keys(logits), k, dim=-1).values
    return (logits.shape[-1] - 1) - (keys & _M32)
