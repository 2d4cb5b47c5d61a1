"""Turns the scheduled requests into one batched model step, and runs it (owning the CUDA graphs).

A step packs the new requests' prompts (prefills) first and the running requests' single new
tokens (decodes) after them. On the GPU every token of the step is one row of the model's static
decode forward (a prompt token attends to its request's keys up to its own position, which the
step has just written) at the shapes of its (token rows, KV length) bucket; the head (sampling)
then takes each request's last row. With `ar.cuda_graphs` that static step is replayed from its
CUDA graph, else it runs eagerly at the same shapes with the same kernels: the two give the same
bits, and a step that admits new requests stays on the graphs. On the CPU, or beyond the buckets,
prefills run through the model's packed `forward` and decodes through `forward_decode` eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from intone.engine.cuda_graphs import CaptureReport, StepGraphs, head_bound
from intone.models.base import Prompt, StepBatch, StepOutput, TTSModel
from intone.ops import paged_decode
from intone.ops.attention import AttentionMetadata
from intone.ops.kv_cache import KVCache
from intone.ops.sampling import SamplingBatch
from intone.ops.staging import HostStaging
from intone.ops.token_history import CAPACITY, TokenHistory
from intone.protocol import SamplingParams


@dataclass
class StepInput:
    """What the runner needs of a request: its prompt, params, frames so far and KV blocks."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    tokens: list[int]  # main tokens generated so far
    last_codes: np.ndarray | None  # [K] codes of the last generated frame on the host (None before the first)
    block_table: list[int]  # KV blocks holding at least len(prompt) + len(tokens) tokens (the scheduler grew it)
    cached: int = 0  # prompt tokens already in its KV blocks (a shared prefix): its prefill computes the rest (decodes: unread)
    # its row in the previous `run`'s output when that step's token is not on the host yet
    # (ar.async_steps): `tokens` lacks it, and the step reads it, and its codes, on the device
    pending: int = -1

    @property
    def generated(self) -> int:
        return len(self.tokens) + (self.pending >= 0)

    @property
    def is_prefill(self) -> bool:
        return self.generated == 0


MAX_GRAPH_TOKENS = 1024  # the largest step (in tokens) replayed from a graph


class ModelRunner:
    def __init__(self, model: TTSModel, kv: KVCache, cuda_graphs: bool = False, max_seats: int = 64,
                 sample_candidates: int = 64):
        """max_seats: requests per step expected (the token history grows beyond it if need be);
        sample_candidates: `ar.sample_candidates`."""
        self.model, self.kv = model, kv
        # the bounds the head sorts to (`cuda_graphs.head_bound`), each captured; None: every token
        self.head_bounds = (sample_candidates, None) if model.head_takes_candidates and sample_candidates else (None,)
        self.history = TokenHistory(model.device, max_seats)
        self.staging = HostStaging(model.device)
        self.max_graph_tokens = 0
        self.cuda_graphs = cuda_graphs
        # The static step's buffers per bucket (and its graphs, once captured); GPU only.
        self.graphs: StepGraphs | None = self._step_graphs() if model.device.type == "cuda" else None
        self.previous: StepOutput | None = None  # the last run's output, in its order (for `StepInput.pending`)

    def _step_graphs(self) -> StepGraphs:
        """Probe the model's output and history shapes with a one-row dummy decode."""
        model, dev = self.model, self.model.device
        head = model.head if model.head_is_static else None
        with torch.inference_mode():
            width = model.embed(torch.zeros(1, dtype=torch.long, device=dev),
                                torch.zeros(1, model.num_codebooks, dtype=torch.long, device=dev)).shape[-1]
            x = torch.zeros(1, width, dtype=model.dtype, device=dev)
            one = torch.ones(1, dtype=torch.long, device=dev)
            out = model.forward_decode(x, 0 * one, self.kv.scratch_slot * one,
                                       torch.full((1, 1), self.kv.num_blocks, device=dev), one, self.kv)
        return StepGraphs(model.forward_decode, head, self.kv, width, model.dtype, tuple(out.shape[1:]), out.dtype,
                          CAPACITY, self.head_bounds, model.head_modes)

    def capture(self, max_rows: int, max_kv_tokens: int, max_step_tokens: int | None = None) -> CaptureReport | None:
        """Size the static step and, with cuda_graphs, capture every graph this runner may replay
        (start-up only: nothing else may use the GPU). None where nothing was captured.

        max_rows: requests per step; max_step_tokens: tokens per step (prefills included) the
        static step covers (default: max_rows, i.e. prefills run through the packed forward)."""
        if self.graphs is None:
            return None
        self.max_graph_tokens = max(max_rows, min(max_step_tokens or max_rows, MAX_GRAPH_TOKENS))
        if not self.cuda_graphs:
            return None
        return self.graphs.capture_all(max_rows, max_kv_tokens, self.max_graph_tokens)

    # ---- building ------------------------------------------------------------------------------

    def build(self, reqs: list[StepInput]) -> StepBatch:
        """reqs must come prefills (no frames yet) first, then decodes. The step's host data (tokens,
        codes, attention descriptors, sampling values, token-history seats) reach the device in one
        transfer (`ops.staging`)."""
        n_prefill = sum(1 for r in reqs if r.is_prefill)
        if any(r.is_prefill for r in reqs[n_prefill:]):
            raise ValueError("prefills must come before decodes")
        # A decode's input is its last frame: one array for all of them, not one per row.
        prefills, decodes = reqs[:n_prefill], reqs[n_prefill:]
        tokens = [r.prompt.tokens[r.cached:].numpy() for r in prefills]
        codes = [r.prompt.codes[r.cached:].numpy() for r in prefills]
        pending = np.array([r.pending for r in decodes], dtype=np.int64)
        if decodes:
            blank = np.zeros(self.model.num_codebooks, dtype=np.int64)  # a pending frame comes from the device
            tokens.append(np.array([r.tokens[-1] if r.pending < 0 else 0 for r in decodes], dtype=np.int64))
            codes.append(np.stack([r.last_codes if r.pending < 0 else blank for r in decodes]))
        params, steps = [r.params for r in reqs], [r.generated for r in reqs]
        floats, ints = sampling_columns(params, steps)
        seats = self.history.assign([r.request_id for r in reqs], [r.tokens for r in reqs],
                                    [r.pending >= 0 for r in reqs])
        host = dict(tokens=np.concatenate(tokens).astype(np.int64, copy=False),
                    codes=np.concatenate(codes).astype(np.int64, copy=False), sampling_floats=floats,
                    sampling_ints=ints, seats=seats)
        if (pending >= 0).any():
            host["pending"] = pending
        metas = {name: self._meta_arrays(part, prefill)
                 for name, part, prefill in (("prefill", prefills, True), ("decode", decodes, False)) if part}
        for name, (arrays, _, _) in metas.items():
            host.update({f"{name}.{k}": v for k, v in arrays.items()})
        dev = self.staging.upload(host)
        if "pending" in dev:
            self._take_pending(dev, sum(len(t) for t in tokens[:n_prefill]))

        def meta(name):
            if name not in metas:
                return None
            arrays, max_q, max_k = metas[name]
            return AttentionMetadata.of({k: dev[f"{name}.{k}"] for k in arrays}, max_q, max_k)
        sampling = sampling_from(params, dev["sampling_floats"], dev["sampling_ints"])
        return StepBatch(tokens=dev["tokens"], codes=dev["codes"], prefill=meta("prefill"), decode=meta("decode"),
                         sampling=sampling, history=self.history.rows(dev["seats"], sampling.steps), seats=dev["seats"])

    def _take_pending(self, dev: dict, first: int) -> None:
        """The decodes' input frames (from token row `first` on) that the previous step made and the host
        has not read, from its output."""
        if self.previous is None:
            raise ValueError("a pending frame, but no previous step")
        pending = dev["pending"]
        rows, taken = pending.clamp(min=0), (pending >= 0)
        tokens, codes = dev["tokens"][first:], dev["codes"][first:]
        tokens.copy_(torch.where(taken, self.previous.tokens.index_select(0, rows).to(tokens.dtype), tokens))
        codes.copy_(torch.where(taken[:, None], self.previous.codes.index_select(0, rows).to(codes.dtype), codes))

    def _meta_arrays(self, reqs: list[StepInput], prefill: bool):
        q_lens, ctx_lens, tables = [], [], []
        for r in reqs:
            q = len(r.prompt) - r.cached if prefill else 1
            ctx = r.cached if prefill else len(r.prompt) + r.generated - 1
            q_lens.append(q)
            ctx_lens.append(ctx)
            # a table lent ahead holds more: the step reads these (host_arrays refuses one too short)
            tables.append(r.block_table[: -(-(ctx + q) // self.kv.block_size)])
        return AttentionMetadata.host_arrays(q_lens, ctx_lens, tables, self.kv.block_size)

    # ---- running -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput:
        model = self.model
        x = model.embed(batch.tokens, batch.codes)
        n = batch.num_prefill_tokens
        out = self._as_rows(x, batch) if n else None
        if out is None:
            out = self._split(x, batch, n)
        result = self.graphs.head(out, batch.sampling, batch.history) if self.graphs is not None else None
        if result is None:  # eagerly, at the bound a graph would take (the same shapes: the same bits)
            result = model.head(out, batch.sampling, batch.history,
                                head_bound(self.head_bounds, batch.sampling.max_top_k))
        tokens, codes, stopped = result
        if batch.seats is not None:
            self.history.record(batch.seats, batch.sampling.steps, tokens)
        return StepOutput(tokens=tokens, codes=codes, stopped=stopped)

    def _split(self, x: torch.Tensor, batch: StepBatch, n: int) -> torch.Tensor:
        """Prefills through the packed forward, decodes through the decode forward."""
        parts = []
        if batch.prefill is not None:
            parts.append(self.model.forward(x[:n], batch.prefill, self.kv))
        if batch.decode is not None:
            parts.append(self._decode(x[n:], batch.decode))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _as_rows(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """Every token of the step as one decode row (graphs only); None where that does not apply."""
        if self.graphs is None or not paged_decode.available(x) or x.shape[0] > self.max_graph_tokens:
            return None
        p, d = batch.prefill, batch.decode
        tables = p.block_tables.index_select(0, p.token_request)
        positions, slots = p.positions, p.slot_mapping
        if d is not None:
            width = max(tables.shape[1], d.block_tables.shape[1])
            tables = torch.cat([_widen(tables, width), _widen(d.block_tables, width)])
            positions, slots = torch.cat([positions, d.positions]), torch.cat([slots, d.slot_mapping])
        rows = AttentionMetadata(
            cu_seqlens_q=torch.arange(x.shape[0] + 1, device=x.device), seq_lens=positions + 1, block_tables=tables,
            slot_mapping=slots, positions=positions, token_request=torch.arange(x.shape[0], device=x.device),
            token_index=torch.zeros_like(positions), max_seqlen_q=1,
            max_seqlen_k=max(p.max_seqlen_k, d.max_seqlen_k if d is not None else 0))
        out = self.graphs.decode(x, rows)
        if out is None:
            return None
        last = p.last_token_rows
        if d is not None:
            last = torch.cat([last, torch.arange(p.slot_mapping.shape[0], x.shape[0], device=x.device)])
        return out.index_select(0, last)

    def _decode(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = self.graphs.decode(x, meta) if self.graphs is not None else None
        if out is None:
            out = self.model.forward_decode(x, meta.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                            self.kv)
        return out

    def run(self, reqs: list[StepInput]) -> StepOutput:
        """One step for reqs in any order; outputs come back in that order."""
        order = sorted(range(len(reqs)), key=lambda i: not reqs[i].is_prefill)
        out = self.execute(self.build([reqs[i] for i in order]))
        if order != list(range(len(reqs))):
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            inverse = inverse.to(out.tokens.device)
            out = StepOutput(out.tokens[inverse], out.codes[inverse], out.stopped[inverse])
        self.previous = out
        return out


def _widen(tables: torch.Tensor, width: int) -> torch.Tensor:
    """Pad block tables with block 0 (never read: masked by the row's length)."""
    if tables.shape[1] == width:
        return tables
    return torch.nn.functional.pad(tables, (0, width - tables.shape[1]))


def sampling_columns(params: list[SamplingParams], steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every per-row sampling field on the host: floats [R, 3] (temperature, top_p, repetition_penalty)
    and ints [R, 6] (top_k, seed, step, ban_stop, below_min, ras)."""
    floats = np.array([[p.temperature, p.top_p, p.repetition_penalty] for p in params], dtype=np.float32)
    ints = np.array([[p.top_k, p.seed, s, p.ignore_eos, s < p.min_new_tokens, p.mode != "standard"]
                     for p, s in zip(params, steps)], dtype=np.int64)
    return floats, ints


def sampling_from(params: list[SamplingParams], f: torch.Tensor, i: torch.Tensor) -> SamplingBatch:
    """The batch over `sampling_columns`' arrays as tensors (every per-row field, ban_stop, below_min and
    ras too, so a static head can take it), with the host-side bounds from the params."""
    return SamplingBatch(
        temperature=f[:, 0], top_p=f[:, 1], top_k=i[:, 0], repetition_penalty=f[:, 2], seeds=i[:, 1], steps=i[:, 2],
        max_top_k=max(p.top_k for p in params),
        has_penalty=any(p.repetition_penalty != 1.0 for p in params),
        ban_stop=i[:, 3].bool(), below_min=i[:, 4].bool(), ras=i[:, 5].bool(),
        modes=sampling_modes(params),
    )


def sampling_modes(params: list[SamplingParams]) -> str:
    """`SamplingBatch.modes` of these rows."""
    standard = sum(p.mode == "standard" for p in params)
    return "standard" if standard == len(params) else "ras" if standard == 0 else "both"


def sampling_batch(params: list[SamplingParams], steps: list[int], device) -> SamplingBatch:
    f, i = (torch.from_numpy(a).to(device) for a in sampling_columns(params, steps))
    return sampling_from(params, f, i)
