"""Turns the scheduled requests into one batched model step, and runs it (owning the CUDA graphs).

A step packs the new requests' prompts (prefills) first and the running requests' single new
tokens (decodes) after them. On the GPU the step is static (`step_graphs`): every token is one row
of the model's decode forward (a prompt token attends to its request's keys up to its own position,
which the step has just written) at the shapes of its (token rows, KV length) bucket, and the head
(sampling) takes each request's last row; the host writes the step's inputs into pinned memory and
the step is one upload, two graph replays and one download. With `ar.cuda_graphs` off the same static
functions run eagerly over the same buffers: the same bits. On the CPU (unless `ar.static_step` is true),
with it false, or beyond the buckets, prefills run through the model's packed `forward` and decodes through
`forward_decode` eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from intone.engine.cuda_graphs import CaptureReport, head_bound
from intone.engine.step_graphs import HostStep, StepGraphs, sampling_of_columns
from intone.models.base import Prompt, StepBatch, StepOutput, TTSModel, unpacked
from intone.ops.attention import AttentionMetadata
from intone.ops.kv_cache import KVCache
from intone.ops.sampling import SamplingBatch
from intone.ops.staging import HostStaging
from intone.ops.token_history import TokenHistory
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
                 sample_candidates: int = 64, sleep: bool = False, static_step: str | bool = "auto",
                 token_buckets: tuple = ()):
        """max_seats: requests per step expected (the token history grows beyond it if need be);
        sample_candidates: `ar.sample_candidates`; sleep: a static step's copy of its outputs to the host
        ends on a blocking-sync event, so the host waits for it asleep (`ar.token_wait`); static_step:
        `ar.static_step` (auto: on a GPU; True: also on a CPU); token_buckets: `ar.prompt_row_buckets`."""
        self.model, self.kv, self.sleep, self.token_buckets = model, kv, sleep, tuple(token_buckets)
        # the bounds the head sorts to (`cuda_graphs.head_bound`), each captured; None: every token
        self.head_bounds = (sample_candidates, None) if model.head_takes_candidates and sample_candidates else (None,)
        self.history = TokenHistory(model.device, max_seats)
        self.staging = HostStaging(model.device)
        self.max_graph_tokens = 0
        self.cuda_graphs = cuda_graphs and model.device.type == "cuda"
        # The static step's buffers (and its graphs, once captured), for a model with a static head.
        static = static_step is True or (static_step == "auto" and model.device.type == "cuda")
        self.graphs: StepGraphs | None = self._step_graphs() if static and model.head_is_static else None
        self.eager_steps = 0  # steps beside the static step (none, or beyond its buckets)
        # the last run's packed outputs [rows in the order it ran them, 2 + K] (token, stopped, codes) on the
        # device, and where each of its caller's rows went (for `StepInput.pending`)
        self.previous: torch.Tensor | None = None
        self.previous_rows: list[int] = []

    def _step_graphs(self, max_rows: int | None = None, max_tokens: int | None = None) -> StepGraphs:
        """The static step, sized for max_rows requests and max_tokens token rows a step (default: the
        history's seats, MAX_GRAPH_TOKENS); the head's input shape probed with a one-row dummy decode."""
        model, dev = self.model, self.model.device
        with torch.inference_mode():
            x = model.embed(torch.zeros(1, dtype=torch.long, device=dev),
                            torch.zeros(1, model.num_codebooks, dtype=torch.long, device=dev))
            one = torch.ones(1, dtype=torch.long, device=dev)
            out = model.forward_decode(x, 0 * one, self.kv.scratch_slot * one,
                                       torch.full((1, 1), self.kv.num_blocks, device=dev), one, self.kv)
        return StepGraphs(model, self.kv, self.history, max_rows or self.history.seats, max_tokens or MAX_GRAPH_TOKENS,
                          self.head_bounds, tuple(out.shape[1:]), out.dtype, self.token_buckets)

    def capture(self, max_rows: int, max_kv_tokens: int, max_step_tokens: int | None = None) -> CaptureReport | None:
        """Size the static step and, with cuda_graphs, capture every graph this runner may replay
        (start-up only: nothing else may use the GPU). None where nothing was captured.

        max_rows: requests per step; max_step_tokens: tokens per step (prefills included) the
        static step covers (default: max_rows, i.e. prefills run through the packed forward)."""
        if self.graphs is None:
            return None
        self.max_graph_tokens = max(max_rows, min(max_step_tokens or max_rows, MAX_GRAPH_TOKENS))
        self.graphs = self._step_graphs(max_rows, self.max_graph_tokens)
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
        prefills, decodes = reqs[:n_prefill], reqs[n_prefill:]
        tokens, codes, pending = self._inputs(prefills, decodes)
        pending = pending[sum(len(t) for t in tokens[:n_prefill]):]  # the decodes' (a prompt token's is -1)
        params, steps = [r.params for r in reqs], [r.generated for r in reqs]
        floats, ints = sampling_columns(params, steps)
        seats = self.history.assign([r.request_id for r in reqs], [r.tokens for r in reqs],
                                    [r.pending >= 0 for r in reqs])
        host = dict(tokens=np.concatenate(tokens).astype(np.int64, copy=False),
                    codes=np.concatenate(codes).astype(np.int64, copy=False), sampling_floats=floats,
                    sampling_ints=ints, seats=seats)
        if (pending >= 0).any():
            host["pending"] = pending
        metas = {name: AttentionMetadata.host_arrays(*self._spans(part), self.kv.block_size)
                 for name, part in (("prefill", prefills), ("decode", decodes)) if part}
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

    def _inputs(self, prefills: list[StepInput], decodes: list[StepInput]):
        """Each token row's input (host): (tokens, codes) arrays, the prompts' then one of the decodes' (a decode's
        input is its last frame: one array for all of them, not one per row), and [T] each row's unread frame's
        row in the previous step's outputs (-1: none)."""
        tokens = [r.prompt.tokens[r.cached:].numpy() for r in prefills]
        codes = [r.prompt.codes[r.cached:].numpy() for r in prefills]
        pending = [np.full(len(t), -1, dtype=np.int64) for t in tokens]
        if decodes:
            blank = np.zeros(self.model.num_codebooks, dtype=np.int64)  # a pending frame comes from the device
            tokens.append(np.array([r.tokens[-1] if r.pending < 0 else 0 for r in decodes], dtype=np.int64))
            codes.append(np.stack([r.last_codes if r.pending < 0 else blank for r in decodes]))
            pending.append(np.array([self._previous_row(r) for r in decodes], dtype=np.int64))
        return tokens, codes, np.concatenate(pending) if pending else np.zeros(0, dtype=np.int64)

    def _take_pending(self, dev: dict, first: int) -> None:
        """The decodes' input frames (from token row `first` on) that the previous step made and the host
        has not read, from its output."""
        pending = dev["pending"]
        rows, taken = pending.clamp(min=0), (pending >= 0)
        tokens, codes = dev["tokens"][first:], dev["codes"][first:]
        tokens.copy_(torch.where(taken, self.previous[:, 0].index_select(0, rows), tokens))
        codes.copy_(torch.where(taken[:, None], self.previous[:, 2:].index_select(0, rows), codes))

    def _previous_row(self, r: StepInput) -> int:
        """r's input frame's row in the previous step's packed outputs, or -1 (on the host)."""
        if r.pending < 0:
            return -1
        if self.previous is None or r.pending >= len(self.previous_rows):
            raise ValueError(f"{r.request_id}: a pending frame, but no such row in the previous step")
        return self.previous_rows[r.pending]

    def _spans(self, reqs: list[StepInput]) -> tuple[list[int], list[int], list[list[int]]]:
        """Each request's (new tokens this step, tokens already in its KV, the blocks the step reads): a prefill
        computes its prompt past the cached prefix, a decode one token."""
        q_lens, ctx_lens, tables = [], [], []
        for r in reqs:
            q = len(r.prompt) - r.cached if r.is_prefill else 1
            ctx = r.cached if r.is_prefill else len(r.prompt) + r.generated - 1
            q_lens.append(q)
            ctx_lens.append(ctx)
            # a table lent ahead holds more: the step reads these (host_arrays refuses one too short)
            tables.append(r.block_table[: -(-(ctx + q) // self.kv.block_size)])
        return q_lens, ctx_lens, tables

    # ---- running -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput:
        """The step eagerly at its own shapes (the CPU; a GPU step beyond the static step's buckets)."""
        model = self.model
        x = model.embed(batch.tokens, batch.codes)
        n = batch.num_prefill_tokens
        parts = []
        if batch.prefill is not None:
            parts.append(model.forward(x[:n], batch.prefill, self.kv))
        if batch.decode is not None:
            d = batch.decode
            parts.append(model.forward_decode(x[n:], d.positions, d.slot_mapping, d.block_tables, d.seq_lens, self.kv))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        tokens, codes, stopped = model.head(out, batch.sampling, batch.history,
                                            head_bound(self.head_bounds, batch.sampling.max_top_k))
        if batch.seats is not None:
            self.history.record(batch.seats, batch.sampling.steps, tokens)
        return StepOutput(tokens=tokens, codes=codes, stopped=stopped)

    def run(self, reqs: list[StepInput]):
        """One step for reqs in any order; outputs come back in that order (a `StepOutput`, or a
        `StaticStepOutput` whose copy to the host has started; both `copy_to_host` and `to_host`)."""
        order = sorted(range(len(reqs)), key=lambda i: not reqs[i].is_prefill)
        ordered = [reqs[i] for i in order]
        out = self._run_static(ordered, order) if self.graphs is not None else None
        if out is None:
            out = self._run_eager(ordered, order)
        self.previous_rows = [0] * len(order)
        for row, caller in enumerate(order):
            self.previous_rows[caller] = row
        return out

    def _run_eager(self, ordered: list[StepInput], order: list[int]) -> StepOutput:
        self.eager_steps += 1
        out = self.execute(self.build(ordered))
        packed = out.packed()
        if self.graphs is not None:  # a static step after this one reads its frames there
            self.graphs.out[: packed.shape[0]].copy_(packed)
        self.previous = packed
        if order != list(range(len(order))):
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            inverse = inverse.to(out.tokens.device)
            out = StepOutput(out.tokens[inverse], out.codes[inverse], out.stopped[inverse])
        return out

    def _run_static(self, ordered: list[StepInput], order: list[int]) -> "StaticStepOutput | None":
        """The step through the static step, or None where it lies beyond its buckets."""
        if len(ordered) > self.history.seats:  # the history would grow a new table, which its graphs do not read
            return None
        n_prefill = sum(1 for r in ordered if r.is_prefill)
        prefills, decodes = ordered[:n_prefill], ordered[n_prefill:]
        q_lens, ctx, tables = self._spans(ordered)
        params = [r.params for r in ordered]
        bound = head_bound(self.head_bounds, max(p.top_k for p in params))
        key = self.graphs.key(sum(q_lens), max(q + c for q, c in zip(q_lens, ctx)), len(ordered), bound,
                              sampling_modes(params))
        if key is None:
            return None
        arrays, _, _ = AttentionMetadata.host_arrays(q_lens, ctx, tables, self.kv.block_size)
        tokens, codes, pending = self._inputs(prefills, decodes)
        floats, ints = sampling_columns(params, [r.generated for r in ordered])
        seats = self.history.assign([r.request_id for r in ordered], [r.tokens for r in ordered],
                                    [r.pending >= 0 for r in ordered])
        step = HostStep(tokens=np.concatenate(tokens), codes=np.concatenate(codes), pending=pending,
                        positions=arrays["positions"], slots=arrays["slot_mapping"], tables=arrays["block_tables"],
                        token_request=arrays["token_request"], last=arrays["cu_seqlens_q"][1:] - 1, seats=seats,
                        floats=floats, ints=ints)
        copy = self.graphs.launch(key, step, self.sleep)
        self.previous = self.graphs.out
        return StaticStepOutput(copy, len(ordered), order)


class StaticStepOutput:
    """A static step's outputs, their copy to the host started by the step (so a later step may reuse the
    device buffer); rows come back in the caller's order."""

    def __init__(self, copy, rows: int, order: list[int]):
        self.copy, self.rows, self.order = copy, rows, order
        self._host: tuple[list[int], list[bool], np.ndarray] | None = None

    def copy_to_host(self, asynchronous: bool = False, sleep: bool = False) -> "StaticStepOutput":
        return self  # (already started, as the step asked)

    def wait(self) -> tuple[list[int], list[bool], np.ndarray]:
        """(tokens, stopped, codes [R, K] int64) on the host, as `StepOutput.to_host` gives them."""
        if self._host is None:
            packed = self.copy.wait()[0].numpy()[: self.rows]
            if self.order != list(range(self.rows)):
                packed = packed[np.argsort(self.order)]
            tokens, stopped, codes = unpacked(packed)
            self._host = tokens, stopped, codes.copy()
        return self._host

    to_host = wait

    @property
    def tokens(self) -> torch.Tensor:
        return torch.tensor(self.wait()[0], dtype=torch.int64)

    @property
    def stopped(self) -> torch.Tensor:
        return torch.tensor(self.wait()[1], dtype=torch.bool)

    @property
    def codes(self) -> torch.Tensor:
        return torch.from_numpy(self.wait()[2])


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
    return sampling_of_columns(f, i, max_top_k=max(p.top_k for p in params),
                               has_penalty=any(p.repetition_penalty != 1.0 for p in params),
                               modes=sampling_modes(params))


def sampling_modes(params: list[SamplingParams]) -> str:
    """`SamplingBatch.modes` of these rows."""
    standard = sum(p.mode == "standard" for p in params)
    return "standard" if standard == len(params) else "ras" if standard == 0 else "both"


def sampling_batch(params: list[SamplingParams], steps: list[int], device) -> SamplingBatch:
    f, i = (torch.from_numpy(a).to(device) for a in sampling_columns(params, steps))
    return sampling_from(params, f, i)
