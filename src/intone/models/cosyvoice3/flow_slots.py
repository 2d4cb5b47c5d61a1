"""A full-response flow call at fixed sizes, replayable from CUDA graphs (`cosyvoice3.flow.cuda_graphs` with
the varlen kernel).

The varlen solve (`packing`) lays a call's rows end to end: no work on padding, but every call has a shape
of its own, so none can replay a graph, and its ten DiT passes launch ~5,700 kernels from the codec's thread,
which served beside the engine loop and the frontend workers waits for the interpreter between them (a call
took ~2.4x its time alone, session 47). Here a call's shape is two buckets: its rows padded with empty ones
to `graph_rows`, its frames to the next of SLOT_BUCKETS by one padding row. Each half of the CFG-doubled
call (the conditioned rows, then the same rows with conditions zeroed) has that layout, so the velocity's
halves are the two halves. The padding row attends only to itself and its attention output is zeroed; the
empty rows hold no frame; no real frame sees either, so each row gets the varlen solve's mel. Each Euler
step is one fixed-shape function (`CausalCFM.slot_step`), and so is the whole solve (`slot_solve`), which
start-up captures per (rows, slots) (the steps instead where the codec pauses between them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from intone.models.cosyvoice3.flow import FlowRequest, cosine_euler_steps, graph_rows
from intone.models.cosyvoice3.packing import packing

# frames of a call (reference + output, mel frames at 50 a second): 256 apart up to 2048, then 4 an octave
SLOT_BUCKETS = (512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192,
                10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768)
MIN_ROW_FRAMES = 64  # captured shapes: rows of at least this many frames on average (fewer: computed eagerly)
STEP_GRAPH, SOLVE_GRAPH = "flow_slot_step", "flow_slot_solve"  # a call that pauses between steps; one that does not


def slot_bucket(frames: int) -> int | None:
    return next((b for b in SLOT_BUCKETS if b >= frames), None)


@dataclass(frozen=True)
class SlotLayout:
    """lengths: the call's rows' mel frames (reference + output); rows: their count padded with empty rows;
    slots: their frames padded by one padding row; longest: the attention kernel's row bound (every real row
    is at most this long; a longer padding row leaves its extra queries uncomputed, and zeroed)."""

    lengths: tuple[int, ...]
    rows: int
    slots: int
    longest: int


def slot_layout(lengths: list[int], longest: int) -> SlotLayout | None:
    """The layout of a call of whole rows (None: a row longer than `longest`, or beyond the largest bucket)."""
    slots = slot_bucket(sum(lengths))
    if slots is None or max(lengths) > longest:
        return None
    return SlotLayout(tuple(lengths), graph_rows(len(lengths)), slots, longest)


def captured_shapes(max_rows: int, longest: int, max_slots: int) -> list[tuple[int, int]]:
    """(rows, slots) of the graphs captured at start-up, most slots first: every rows bucket up to max_rows,
    with the slot buckets from MIN_ROW_FRAMES a row up to the bucket of what its rows can hold."""
    shapes = []
    for rows in sorted({graph_rows(n) for n in range(1, max_rows + 1)}):
        top = slot_bucket(min(rows * longest, max_slots)) or SLOT_BUCKETS[-1]
        shapes += [(rows, s) for s in SLOT_BUCKETS if rows * MIN_ROW_FRAMES <= s <= top]
    return sorted(shapes, key=lambda shape: (shape[1], shape[0]), reverse=True)


def layout_tensors(layout: SlotLayout, pad: int, device: torch.device) -> tuple[Tensor, ...]:
    """(rows, positions, valid, gapped, kept, starts, bound) of the CFG-doubled rows (`packing.Packing`'s
    tensors; each half: the real rows, the empty ones, the padding row); bound: an empty tensor `longest` long."""
    half = [*layout.lengths, *[0] * (layout.rows - len(layout.lengths)), layout.slots - sum(layout.lengths)]
    p = packing(half * 2, [False] * 2 * len(half), 1, 0, pad, "varlen", device)
    valid = p.rows % len(half) != len(half) - 1  # not the padding row
    bound = torch.empty(layout.longest, 0, device=device)
    return p.rows, p.positions, valid[None], p.gapped, p.kept, p.mask.starts, bound


def frame_inputs(flow, requests: list[FlowRequest], layout: SlotLayout) -> tuple[Tensor, ...]:
    """(x, mu, cond, spks): the solve's first state (the fixed noise at each frame's position) and the
    conditioned half's inputs, [slots, mel] each (the padding row zeros), spks [rows + 1, mel]."""
    mu, cond, spks, _, _ = flow.solve_inputs(requests)
    n, total = mu.shape[:2]
    lengths = torch.tensor(layout.lengths)
    row = torch.repeat_interleave(torch.arange(n), lengths)
    position = torch.arange(row.numel()) - (lengths.cumsum(0) - lengths)[row]
    fill = layout.slots - row.numel()
    where = torch.cat((row * total + position, torch.full((fill,), n * total),  # the padding row: a zero frame
                       position, torch.zeros(fill, dtype=torch.long))).to(mu.device)
    frame, noise_at = where.split(layout.slots)

    def slots(y: Tensor) -> Tensor:
        return torch.cat((y.reshape(-1, y.shape[-1]), y.new_zeros(1, y.shape[-1])))[frame]

    x = flow.decoder.noise[0].T[noise_at].to(torch.promote_types(mu.dtype, torch.float32))
    return x, slots(mu), slots(cond), F.pad(spks, (0, 0, 0, layout.rows + 1 - n))


def solve_inputs(flow, requests: list[FlowRequest], layout: SlotLayout) -> tuple[Tensor, tuple, tuple]:
    """(the first state, the conditions (mu, cond, spks), the layout's tensors): `CausalCFM.slot_solve`'s
    inputs in that order; `slot_step` takes the step's t and dt between the conditions and the layout."""
    x, *conditions = frame_inputs(flow, requests, layout)
    pad = flow.decoder.estimator.input_embed.conv_pos_embed.pad
    return x, tuple(conditions), layout_tensors(layout, pad, x.device)


@torch.inference_mode()
def solve_slots(flow, requests: list[FlowRequest], layout: SlotLayout, graphs, pause=None,
                stepped: bool = False) -> list[Tensor]:
    """Per request the mel [80, T_out] that `CosyFlow.inference` gives it: the whole solve replayed from the
    graph of the layout's shape, or (pause: called after each Euler step; stepped: the steps' graphs are the
    ones captured, `capture_slots(whole=False)`) each step from its own; computed eagerly where none was
    captured."""
    x, conditions, layout_inputs = solve_inputs(flow, requests, layout)
    if pause is None and not stepped:
        x = graphs.run(SOLVE_GRAPH, flow.decoder.slot_solve, x, *conditions, *layout_inputs)[0]
    else:
        for t, dt in cosine_euler_steps(flow.decoder.n_timesteps, x.device, x.dtype):
            x = graphs.run(STEP_GRAPH, flow.decoder.slot_step, x, *conditions, t, dt, *layout_inputs)[0]
            if pause is not None:
                pause()
    out, start = [], 0
    for r, n in zip(requests, layout.lengths):
        out.append(x[start + r.prompt_mel.shape[0]: start + n].T.float().contiguous())
        start += n
    return out


@torch.inference_mode()
def capture_slots(flow, rows: int, slots: int, longest: int, graphs, whole: bool = True) -> bool:
    """Capture the whole solve (whole) or its Euler step at (rows, slots) in `graphs` (start-up only): one real
    row, the rest padding. -> whether a graph now replays that shape."""
    ratio = flow.config.token_mel_ratio
    frames = min(slots, longest) // ratio * ratio
    dev = flow.decoder.noise_bits.device
    dummy = FlowRequest(torch.zeros(frames // ratio - 1, dtype=torch.long, device=dev),
                        torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(ratio, 80, device=dev),
                        torch.ones(192, device=dev), streaming=False, finalize=True)
    x, conditions, layout_inputs = solve_inputs(flow, [dummy], SlotLayout((frames,), rows, slots, longest))
    if whole:
        name, fn, inputs = SOLVE_GRAPH, flow.decoder.slot_solve, (x, *conditions, *layout_inputs)
    else:
        t, dt = next(cosine_euler_steps(flow.decoder.n_timesteps, x.device, x.dtype))
        name, fn, inputs = STEP_GRAPH, flow.decoder.slot_step, (x, *conditions, t, dt, *layout_inputs)
    graphs.capture(name, fn, *inputs)
    return graphs.has(name, *inputs)
