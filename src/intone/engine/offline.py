"""A plain synchronous loop that runs a fixed set of requests to completion.

It drives a model through the same step interface, KV cache and batch descriptors the
serving engine uses, without admission control or streaming. `intone speak` and the model
tests use it.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

import torch
from torch import Tensor

from intone.engine.attention import AttentionMetadata
from intone.engine.kv_cache import BlockManager, KVCache
from intone.engine.sampling import SamplingBatch
from intone.errors import InvalidRequestError
from intone.models.base import Prompt, SamplingParams, StepBatch, TTSModel

BLOCK_SIZE = 16


@dataclass
class OfflineRequest:
    prompt: Prompt
    params: SamplingParams
    request_id: str = ""
    tokens: list[int] = field(default_factory=list)  # main token of each generated frame
    frames: list[Tensor] = field(default_factory=list)  # [K] codes of each generated frame
    finished: bool = False
    stop_reason: str = ""

    @property
    def codes(self) -> Tensor:
        """[K, n] codes of the frames generated (the stop step makes no frame)."""
        if not self.frames:
            return torch.zeros(0, 0, dtype=torch.long)
        return torch.stack(self.frames, dim=1)


def resolve_seed(params: SamplingParams) -> SamplingParams:
    if params.seed is None:
        params = dataclasses.replace(params, seed=secrets.randbits(63))
    return params


def run_to_completion(model: TTSModel, requests: list[OfflineRequest]) -> list[OfflineRequest]:
    for i, req in enumerate(requests):
        req.request_id = req.request_id or f"req-{i}"
        budget = model.max_seq_len - len(req.prompt)
        if budget < 1:
            raise InvalidRequestError("input", f"prompt is {len(req.prompt)} tokens; the model allows {model.max_seq_len} in all")
        params = resolve_seed(req.params.validate())
        req.params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, budget))

    num_blocks = sum(-(-(len(r.prompt) + r.params.max_new_tokens) // BLOCK_SIZE) for r in requests)
    kv = KVCache(model.kv_layout, num_blocks, BLOCK_SIZE, model.dtype, model.device)
    blocks = BlockManager(num_blocks, BLOCK_SIZE)
    try:
        while active := [r for r in requests if not r.finished]:
            _step(model, active, kv, blocks)
    finally:
        for r in requests:
            blocks.free(r.request_id)
    return requests


def _step(model: TTSModel, active: list[OfflineRequest], kv: KVCache, blocks: BlockManager) -> None:
    tokens, codes, q_lens, ctx_lens, tables, history = [], [], [], [], [], []
    for r in active:
        if not r.tokens:  # prefill
            tokens.append(r.prompt.tokens)
            codes.append(r.prompt.codes)
            ctx = 0
        else:
            tokens.append(torch.tensor(r.tokens[-1:]))
            codes.append(r.frames[-1].unsqueeze(0))
            ctx = len(r.prompt) + len(r.tokens) - 1
        q_lens.append(tokens[-1].shape[0])
        ctx_lens.append(ctx)
        tables.append(blocks.ensure(r.request_id, ctx + q_lens[-1]))
        history.append(model.history_row(r.tokens))
    device = model.device
    batch = StepBatch(
        tokens=torch.cat(tokens).to(device),
        codes=torch.cat(codes).to(device),
        meta=AttentionMetadata.build(q_lens, ctx_lens, tables, BLOCK_SIZE, device),
        sampling=_sampling_batch([r.params for r in active], [len(r.tokens) for r in active], device),
        history=torch.tensor(history, dtype=torch.long, device=device).view(len(active), -1),
    )
    out = model.step(batch, kv)
    out_tokens, out_codes, stopped = out.tokens.tolist(), out.codes.cpu(), out.stopped.tolist()
    for i, r in enumerate(active):
        if stopped[i]:
            r.finished, r.stop_reason = True, "stop"
            continue
        r.tokens.append(out_tokens[i])
        r.frames.append(out_codes[i])
        if len(r.tokens) >= r.params.max_new_tokens:
            r.finished, r.stop_reason = True, "length"


def _sampling_batch(params: list[SamplingParams], steps: list[int], device) -> SamplingBatch:
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
    )
