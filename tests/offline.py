"""The tests' generation harness: a fixed set of prompts run to completion through the engine's
`ModelRunner` (the same step interface, KV cache and batch descriptors as the core), returning each
request's main tokens and codec frames, which the model tests compare (with the official code, with
each other). No codec: users' synthesis, `intone speak` included, goes through `EngineCore`
(`intone.engine.offline`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from intone.engine.model_runner import ModelRunner, StepInput
from intone.engine.request import resolve_params
from intone.models.base import Prompt, TTSModel
from intone.ops.kv_cache import BlockManager, KVCache
from intone.protocol import SamplingParams

BLOCK_SIZE = 16


@dataclass
class OfflineRequest:
    prompt: Prompt
    params: SamplingParams
    request_id: str = ""
    tokens: list[int] = field(default_factory=list)  # main token of each generated frame
    frames: list[np.ndarray] = field(default_factory=list)  # [K] codes of each frame forwarded to the codec
    last_codes: np.ndarray | None = None
    finished: bool = False
    stop_reason: str = ""
    block_table: list[int] = field(default_factory=list)  # all it may need, lent up front

    @property
    def codes(self) -> torch.Tensor:
        """[K, n] codes of the frames for the codec (the stop step makes no frame)."""
        if not self.frames:
            return torch.zeros(0, 0, dtype=torch.long)
        return torch.from_numpy(np.stack(self.frames, axis=1))


def run_to_completion(model: TTSModel, requests: list[OfflineRequest]) -> list[OfflineRequest]:
    for i, req in enumerate(requests):
        req.request_id = req.request_id or f"req-{i}"
        req.params = resolve_params(req.params, req.prompt, model.max_seq_len)

    num_blocks = sum(-(-(len(r.prompt) + r.params.max_new_tokens) // BLOCK_SIZE) for r in requests)
    blocks = BlockManager(num_blocks, BLOCK_SIZE)
    for r in requests:
        blocks.grow(r.block_table, len(r.prompt) + r.params.max_new_tokens)
    runner = ModelRunner(model, KVCache(model.kv_layout, num_blocks, BLOCK_SIZE, model.dtype, model.device))
    try:
        while active := [r for r in requests if not r.finished]:
            _step(runner, active)
    finally:
        for r in requests:
            blocks.free(r.block_table)
    return requests


def _step(runner: ModelRunner, active: list[OfflineRequest]) -> None:
    out = runner.run([
        StepInput(r.request_id, r.prompt, r.params, r.tokens, r.last_codes, r.block_table) for r in active
    ])
    out_tokens, stopped, out_codes = out.to_host()
    for i, r in enumerate(active):
        if stopped[i]:
            r.finished, r.stop_reason = True, "stop"
            continue
        r.tokens.append(out_tokens[i])
        r.last_codes = out_codes[i]
        if runner.model.forwards_frame(r.tokens):
            r.frames.append(out_codes[i])
        if len(r.tokens) >= r.params.max_new_tokens:
            r.finished, r.stop_reason = True, "length"
