"""Turns the scheduled requests into one batched model step (and its batch descriptor)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from intone.engine.attention import AttentionMetadata
from intone.engine.kv_cache import BlockManager, KVCache
from intone.engine.sampling import SamplingBatch
from intone.models.base import Prompt, SamplingParams, StepBatch, StepOutput, TTSModel


@dataclass
class StepInput:
    """What the runner needs of a request: its prompt, params and frames so far."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    tokens: list[int]  # main tokens generated so far
    last_codes: torch.Tensor | None  # [K] codes of the last generated frame (None before the first)
    generated: np.ndarray | None = None  # the same tokens as int64 (kept by the request; else built here)


class ModelRunner:
    def __init__(self, model: TTSModel, kv: KVCache, blocks: BlockManager):
        self.model, self.kv, self.blocks = model, kv, blocks

    def build(self, reqs: list[StepInput]) -> StepBatch:
        """Prefill (whole prompt) for requests with no frames yet, one token for the others."""
        device = self.model.device
        tokens, codes, q_lens, ctx_lens, tables, history = [], [], [], [], [], []
        for r in reqs:
            if not r.tokens:
                tokens.append(r.prompt.tokens.to(device))
                codes.append(r.prompt.codes.to(device))
                ctx = 0
            else:
                tokens.append(torch.tensor(r.tokens[-1:], device=device))
                codes.append(r.last_codes.to(device).view(1, -1))
                ctx = len(r.prompt) + len(r.tokens) - 1
            q_lens.append(tokens[-1].shape[0])
            ctx_lens.append(ctx)
            tables.append(self.blocks.ensure(r.request_id, ctx + q_lens[-1]))
            generated = r.generated if r.generated is not None else np.asarray(r.tokens, dtype=np.int64)
            history.append(self.model.history_row(generated, r.params))
        return StepBatch(
            tokens=torch.cat(tokens),
            codes=torch.cat(codes),
            meta=AttentionMetadata.build(q_lens, ctx_lens, tables, self.blocks.block_size, device),
            sampling=sampling_batch([r.params for r in reqs], [len(r.tokens) for r in reqs], device),
            history=_history_tensor(history, device),
        )

    def run(self, reqs: list[StepInput]) -> StepOutput:
        return self.model.step(self.build(reqs), self.kv)


def _history_tensor(rows: list[np.ndarray], device) -> torch.Tensor:
    batch = np.full((len(rows), max(len(r) for r in rows)), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = row
    return torch.from_numpy(batch).to(device)


def sampling_batch(params: list[SamplingParams], steps: list[int], device) -> SamplingBatch:
    def col(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return SamplingBatch(
        temperature=col([p.temperature for p in params], torch.float32),
        top_p=col([p.top_p for p in params], torch.float32),
        top_k=col([p.top_k for p in params], torch.int64),
        repetition_penalty=col([p.repetition_penalty for p in params], torch.float32),
        seeds=col([p.seed for p in params], torch.int64),
        steps=col(steps, torch.int64),
        max_top_k=max(p.top_k for p in params),
        has_penalty=any(p.repetition_penalty != 1.0 for p in params),
        ban_stop=col([p.ignore_eos for p in params], torch.bool),
        below_min=col([s < p.min_new_tokens for p, s in zip(params, steps)], torch.bool),
        ras=col([p.mode != "standard" for p in params], torch.bool),
        has_standard=any(p.mode == "standard" for p in params),
        all_standard=all(p.mode == "standard" for p in params),
    )
