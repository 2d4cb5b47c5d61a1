"""The AR step's static form (GPU), owned by the model runner: every input of a step in one staged buffer, the
decode and the head replayed from CUDA graphs captured at start-up (invariant 2), every output in one packed
buffer.

Why: the engine loop shares its GIL with the frontend's and the codec's threads, and a torch call gives the GIL
up and must win it back. A step built from some two hundred small calls (an upload and its views, pads, copies
into each graph's buffers, sampling columns) was stretched by the others' host work by ~5 ms a step under load
(session 37), and a loop-like thread's launches grew 1.0 -> 2.9-3.9 ms beside busy neighbours whatever they did
(`tools/host_interference.py`, session 38). Here the host writes a step into pinned memory with numpy, and the
step is a handful of torch calls: one upload, the decode's graph, the head's graph, one download and its event.

Layout. A step's inputs live in one device buffer at byte offsets fixed by its bucket, so a graph captured for a
bucket reads them where the host puts them: the head's region (rows bucket H) first, sized for the largest H,
then the decode's (token rows bucket R, KV width W). Padding is written by the host each step: decode rows past
the step's write the cache's scratch slot and attend to one key; head rows past the step's are row 0's values
with the history's scratch seat. The graphs hand their results on through persistent buffers: the decode writes
its output rows (`hidden`), the head gathers each request's last row from them and writes (token, stopped,
codes) per row into `out`, which the next step's decode reads a frame from when the host has not read it yet
(`ar.async_steps`). One stream runs the steps in order, so each buffer is read before the next step rewrites it.

Decode keys are (token rows, KV tokens); head keys are (rows, the bound the draws sort to, sampling modes): see
`cuda_graphs.head_bound`. A key without a graph (its capture failed; graphs off) runs the same function eagerly
over the same buffers: the same kernels on the same shapes, the same bits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from intone.engine.cuda_graphs import KV_BUCKETS, ROW_BUCKETS, CaptureReport, bucket, capture_graph
from intone.engine.streams import own_stream
from intone.models.base import StepOutput
from intone.ops.host_copy import PinnedCopy
from intone.ops.kv_cache import KVCache
from intone.ops.sampling import SamplingBatch
from intone.ops.token_history import TokenHistory

log = logging.getLogger(__name__)

ALIGN = 16  # bytes: every array starts where any dtype may, and as Triton's kernels like (it specializes on 16)


class Layout:
    """Named arrays at 16-byte aligned byte offsets from `start`, for numpy views of a host buffer and torch views
    of a device buffer alike."""

    def __init__(self, start: int, fields: list[tuple[str, np.dtype, tuple[int, ...]]]):
        self.fields, offset = [], start
        for name, dtype, shape in fields:
            dtype = np.dtype(dtype)
            self.fields.append((name, dtype, shape, offset))
            offset += -(-int(np.prod(shape)) * dtype.itemsize // ALIGN) * ALIGN
        self.end = offset

    def numpy(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        return {name: raw[off: off + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)
                for name, dt, shape, off in self.fields}

    def torch(self, raw: Tensor) -> dict[str, Tensor]:
        return {name: raw[off: off + int(np.prod(shape)) * dt.itemsize].view(_TORCH[dt]).view(shape)
                for name, dt, shape, off in self.fields}


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}
I64, F32 = np.dtype(np.int64), np.dtype(np.float32)
SAMPLING_FLOATS = 3  # temperature, top_p, repetition_penalty (`model_runner.sampling_columns`)
SAMPLING_INTS = 6  # top_k, seed, step, ban_stop, below_min, ras


def sampling_of_columns(f: Tensor, i: Tensor, max_top_k: int, has_penalty: bool, modes: str) -> SamplingBatch:
    """The sampling batch over the per-row columns (floats [R, SAMPLING_FLOATS], ints [R, SAMPLING_INTS]) and
    the host-side bounds."""
    return SamplingBatch(
        temperature=f[:, 0], top_p=f[:, 1], top_k=i[:, 0], repetition_penalty=f[:, 2], seeds=i[:, 1], steps=i[:, 2],
        ban_stop=i[:, 3].bool(), below_min=i[:, 4].bool(), ras=i[:, 5].bool(), max_top_k=max_top_k,
        has_penalty=has_penalty, modes=modes)


def head_layout(rows: int) -> Layout:
    return Layout(0, [("last", I64, (rows,)), ("seats", I64, (rows,)), ("floats", F32, (rows, SAMPLING_FLOATS)),
                      ("ints", I64, (rows, SAMPLING_INTS))])


def decode_layout(start: int, rows: int, width: int, codebooks: int) -> Layout:
    return Layout(start, [("tokens", I64, (rows,)), ("codes", I64, (rows, codebooks)), ("pending", I64, (rows,)),
                          ("positions", I64, (rows,)), ("slots", I64, (rows,)), ("seq_lens", I64, (rows,)),
                          ("tables", I64, (rows, width))])


@dataclass(frozen=True)
class StepKey:
    rows: int  # token rows (a bucket)
    kv_tokens: int  # the KV bucket, a whole number of blocks
    head_rows: int  # requests (a bucket)
    bound: int | None  # the head's candidates bound (None: every token)
    modes: str  # the head graph's sampling modes

    @property
    def decode(self) -> tuple[int, int]:
        return self.rows, self.kv_tokens

    @property
    def head(self) -> tuple[int, int | None, str]:
        return self.head_rows, self.bound, self.modes


@dataclass
class HostStep:
    """One step's inputs on the host, row by row (token rows: prefills' tokens first, then one per decode;
    requests in the same order)."""

    tokens: np.ndarray  # [T] int64
    codes: np.ndarray  # [T, K] int64
    pending: np.ndarray  # [T] int64: the row of `out` holding this row's input frame, or -1
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T]
    tables: np.ndarray  # [n, width] each request's blocks (a row's width may exceed its need)
    token_request: np.ndarray  # [T] each token row's request
    last: np.ndarray  # [n] each request's last token row
    seats: np.ndarray  # [n] token-history seats
    floats: np.ndarray  # [n, 3] float32 sampling columns
    ints: np.ndarray  # [n, 6] int64


class StepGraphs:
    """The static step of one model runner: its staged buffers, its graphs, its packed outputs."""

    def __init__(self, model, kv: KVCache, history: TokenHistory, max_rows: int, max_tokens: int,
                 head_bounds: tuple = (None,), out_shape: tuple = (), out_dtype=torch.float32, token_buckets=()):
        """max_rows: requests a step (head rows); max_tokens: token rows a step (prefill tokens included);
        out_shape / out_dtype: forward_decode's output row (the head's input); token_buckets: token-row buckets
        beside ROW_BUCKETS (`ar.prompt_row_buckets`)."""
        self.model, self.kv, self.history = model, kv, history
        self.head_bounds, self.head_modes = head_bounds, model.head_modes
        self.token_buckets = tuple(sorted(set(ROW_BUCKETS) | set(token_buckets)))
        self.max_rows = bucket(max_rows) or ROW_BUCKETS[-1]
        self.max_tokens = bucket(max_tokens, self.token_buckets) or self.token_buckets[-1]
        self.max_kv = KV_BUCKETS[-1]
        dev, k = kv.k.device, model.num_codebooks
        self.decode_start = head_layout(self.max_rows).end
        size = decode_layout(self.decode_start, self.max_tokens, -(-self.max_kv // kv.block_size), k).end
        self.device_buffer = torch.zeros(size, dtype=torch.uint8, device=dev)
        pinned = dev.type == "cuda"
        self.host_buffers = [torch.zeros(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._uploaded = [torch.cuda.Event() for _ in range(2)] if pinned else None
        self._recorded = [False, False]
        self._turn = 0
        self.hidden = torch.zeros(self.max_tokens, *out_shape, dtype=out_dtype, device=dev)
        self.out = torch.zeros(self.max_rows, 2 + k, dtype=torch.int64, device=dev)  # token, stopped, codes
        self.table = history.table  # the one the graphs read (a grown history leaves the static step)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph | None] = {}
        self._views: dict[tuple, dict] = {}
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None  # this set's own (see capture_graph)
        self.replays = 0  # steps whose decode ran from a graph
        self.eager = 0  # static steps whose decode had no graph for its key
        self.report = CaptureReport()

    # ---- keys -----------------------------------------------------------------------------------

    def key(self, token_rows: int, max_seqlen_k: int, rows: int, bound: int | None, modes: str) -> StepKey | None:
        """The step's key, or None where it lies beyond the static step."""
        r, h, kv_tokens = bucket(token_rows, self.token_buckets), bucket(rows), bucket(max_seqlen_k, KV_BUCKETS)
        if r is None or h is None or kv_tokens is None or r > self.max_tokens or h > self.max_rows:
            return None
        if self.history.table is not self.table:
            return None
        modes = modes if modes in self.head_modes else "both"
        return StepKey(r, -(-kv_tokens // self.kv.block_size) * self.kv.block_size, h, bound, modes)

    def _decode_layout(self, rows: int, kv_tokens: int) -> Layout:
        return decode_layout(self.decode_start, rows, kv_tokens // self.kv.block_size, self.model.num_codebooks)

    def _device_views(self, name: str, rows: int, kv_tokens: int = 0) -> dict[str, Tensor]:
        key = ("device", name, rows, kv_tokens)
        if key not in self._views:
            layout = head_layout(rows) if name == "head" else self._decode_layout(rows, kv_tokens)
            self._views[key] = layout.torch(self.device_buffer)
        return self._views[key]

    def _host_views(self, turn: int, key: StepKey) -> tuple[dict[str, np.ndarray], Tensor, Tensor]:
        """The host buffer's views for this key, and the host and device bytes its upload copies."""
        cache = ("host", turn, key.head_rows, key.rows, key.kv_tokens)
        if cache not in self._views:
            host, decode = self.host_buffers[turn], self._decode_layout(key.rows, key.kv_tokens)
            views = {**head_layout(key.head_rows).numpy(host.numpy()), **decode.numpy(host.numpy())}
            self._views[cache] = (views, host[:decode.end], self.device_buffer[:decode.end])
        return self._views[cache]

    # ---- the static functions (captured) ---------------------------------------------------------

    def _decode(self, rows: int, kv_tokens: int) -> None:
        v = self._device_views("decode", rows, kv_tokens)
        taken, previous = v["pending"] >= 0, v["pending"].clamp(min=0)
        tokens = torch.where(taken, self.out[:, 0].index_select(0, previous), v["tokens"])
        codes = torch.where(taken[:, None], self.out[:, 2:].index_select(0, previous), v["codes"])
        x = self.model.embed(tokens, codes)
        out = self.model.forward_decode(x, v["positions"], v["slots"], v["tables"], v["seq_lens"], self.kv)
        self.hidden[:rows].copy_(out)

    def _head(self, rows: int, bound: int | None, modes: str) -> None:
        v = self._device_views("head", rows)
        # max_top_k is a placeholder (a static head never reads it); the graph runs the samplers of `modes`
        sampling = sampling_of_columns(v["floats"], v["ints"], max_top_k=1, has_penalty=True, modes=modes)
        history = self.history.rows(v["seats"], sampling.steps)
        tokens, codes, stopped = self.model.head(self.hidden.index_select(0, v["last"]), sampling, history, bound)
        self.history.record(v["seats"], sampling.steps, tokens)
        self.out[:rows].copy_(StepOutput(tokens, codes, stopped).packed())

    def _run(self, graph_key: tuple) -> None:
        graph = self._graphs.get(graph_key)
        if graph is not None:
            graph.replay()
        elif graph_key[0] == "head":
            self._head(*graph_key[1:])
        else:
            self._decode(*graph_key)

    # ---- serving ----------------------------------------------------------------------------------

    def launch(self, key: StepKey, step: HostStep, sleep: bool = False) -> PinnedCopy:
        """Stage the step, run it, and start copying its packed outputs to the host (rows: the step's
        requests, in its order; `sleep`: the copy's wait sleeps on a blocking-sync event)."""
        turn = self._turn = self._turn ^ 1
        if self._recorded[turn]:
            self._uploaded[turn].synchronize()  # the upload that last read this host buffer (two steps ago) is done
        views, host, device = self._host_views(turn, key)
        self._write(views, step)
        device.copy_(host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded[turn].record()
            self._recorded[turn] = True
        if self._graphs.get(key.decode) is not None:
            self.replays += 1
        else:
            self.eager += 1
        with torch.inference_mode():
            self._run(key.decode)
            self._run(("head", *key.head))
        return PinnedCopy([self.out], sleep) if self.out.is_cuda else _HostResult(self.out.clone())

    def _write(self, v: dict[str, np.ndarray], s: HostStep) -> None:
        """The step's rows and the bucket's padding rows into the host views."""
        t, n = len(s.tokens), len(s.last)
        v["tokens"][:t], v["tokens"][t:] = s.tokens, 0
        v["codes"][:t], v["codes"][t:] = s.codes, 0
        v["pending"][:t], v["pending"][t:] = s.pending, -1
        v["positions"][:t], v["positions"][t:] = s.positions, 0
        v["slots"][:t], v["slots"][t:] = s.slots, self.kv.scratch_slot
        v["seq_lens"][:t], v["seq_lens"][t:] = s.positions + 1, 1
        tables, width = v["tables"], s.tables.shape[1]
        tables.fill(self.kv.num_blocks)  # the scratch block: columns and rows past the step's are never read
        tables[:t, :width] = s.tables[s.token_request]
        v["last"][:n], v["last"][n:] = s.last, s.last[0]  # padding rows: row 0's values, the scratch seat
        v["seats"][:n], v["seats"][n:] = s.seats, self.history.scratch_seat
        v["floats"][:n], v["floats"][n:] = s.floats, s.floats[0]
        v["ints"][:n], v["ints"][n:] = s.ints, s.ints[0]

    # ---- start-up ---------------------------------------------------------------------------------

    def capture_all(self, max_rows: int, max_kv_tokens: int, max_tokens: int) -> CaptureReport:
        """Capture every decode key (token rows up to max_tokens, KV up to max_kv_tokens) and every head key
        (rows up to max_rows), largest first (the shared memory pool is sized once, by the largest)."""
        start = time.perf_counter()
        decode = self.decode_keys(max_kv_tokens, max_tokens)
        head = [("head", r, c, m) for r in sorted(ROW_BUCKETS, reverse=True)
                if r <= min(bucket(max_rows) or self.max_rows, self.max_rows)
                for c in self.head_bounds for m in self.head_modes]
        torch.cuda.synchronize()
        with torch.inference_mode():
            for graph_key in decode + head:
                self._capture(graph_key)
        torch.cuda.synchronize()
        self.report.seconds = time.perf_counter() - start
        return self.report

    def decode_keys(self, max_kv_tokens: int, max_tokens: int) -> list[tuple[int, int]]:
        """Every (token rows, KV tokens) key a step up to these bounds can meet, largest first."""
        kv_top = bucket(max_kv_tokens, KV_BUCKETS) or KV_BUCKETS[-1]
        top = min(bucket(max_tokens, self.token_buckets) or self.max_tokens, self.max_tokens)
        return sorted({(r, -(-kv // self.kv.block_size) * self.kv.block_size)
                       for r in self.token_buckets if r <= top for kv in KV_BUCKETS if kv <= kv_top}, reverse=True)

    def _pad_inputs(self, graph_key: tuple) -> None:
        """Valid inputs for a capture's warm-up run: every row a padding row."""
        if graph_key[0] == "head":
            v = self._device_views("head", graph_key[1])
            v["last"].zero_(), v["seats"].fill_(self.history.scratch_seat), v["floats"].fill_(1.0)
            v["ints"].zero_(), v["ints"][:, :2].fill_(1)  # top_k 1, seed 1
        else:
            v = self._device_views("decode", *graph_key)
            for name in ("tokens", "codes", "positions"):
                v[name].zero_()
            v["pending"].fill_(-1), v["slots"].fill_(self.kv.scratch_slot), v["seq_lens"].fill_(1)
            v["tables"].fill_(self.kv.num_blocks)

    def _capture(self, graph_key: tuple) -> None:
        try:
            if self._capture_stream is None:
                self._capture_stream = own_stream(None, "AR graphs' capture")
            self._pad_inputs(graph_key)
            graph, _ = capture_graph(lambda: self._run(graph_key), self._pool, self._capture_stream)
            self._graphs[graph_key] = graph
            self._pool = graph.pool()
            self.report.graphs += 1
        except Exception:  # e.g. out of memory: this key runs eagerly instead of failing the engine
            log.exception("cannot capture a CUDA graph for %s; it will run eagerly", graph_key)
            self._graphs[graph_key] = None
            self.report.failed += 1
            torch.cuda.synchronize()

    @property
    def captured(self) -> list:
        keys = [k for k, g in self._graphs.items() if g is not None]
        decode = sorted(k for k in keys if k[0] != "head")
        head = sorted((k for k in keys if k[0] == "head"), key=lambda k: (k[1], k[2] is None, k[2] or 0, k[3]))
        return decode + head


class _HostResult:
    """A static step's outputs already on the host (a CPU runner: tests)."""

    def __init__(self, packed: Tensor):
        self.packed = packed

    def wait(self) -> list[Tensor]:
        return [self.packed]
