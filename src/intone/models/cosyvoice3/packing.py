"""The flow's rows packed end to end for the DiT (`cosyvoice3.flow.packed`).

A padded solve runs every row at the longest row's length: at C64 a fifth to a quarter of the DiT's
work is padding (session 20). Packed, the rows' valid frames lie end to end in one sequence; every
per-frame piece of the DiT (projections, norms, feed-forward) then computes only real frames. Each
frame attends to an interval of that sequence: its own row, up to the end of its chunk for a
streamed row (`DiT.attention_mask`'s pattern); the input embedding's causal convolutions run on a
layout with `pad` zeros before each row, as the padded solve's own zero padding gives them. A call of
whole rows only (no chunk mask) with the `varlen` kernel attends row by row (`ops.varlen_attention`);
with the flow cache, that kernel's calls hold rows' new frames after their cached past
(`continued_packing`: the past's keys and the convolutions' context come from the cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from intone.models.cosyvoice3.dit import FLEX_BLOCK, block_lists
from intone.ops.varlen_attention import RowSpans


@dataclass
class Packing:
    """Slots of the packed sequence (S of them; the last ones unused where flex wants a longer one):
    `rows` [S] each slot's (doubled) row, `frames` [S] its frame in the padded rows' [rows * total]
    (unused: rows * total, a frame of none), `positions` [S] its index in its row (RoPE), `valid` [1, S];
    `gapped` [S] its place in the convolutions' layout, `kept` [1, G, 1] 1 where a frame lies there
    (zeros before each row; unused slots all go to its last place, never kept); `mask` the attention
    pattern (flex BlockMask, RowSpans for the varlen kernel, or boolean [1, 1, S, S] for SDPA). No Python
    numbers: compiled code sees tensors only, so one compile serves every packing. Continued rows
    (`continued_packing`): `context` [R, pad] the places of the `pad` slots before each row, which hold its
    earlier frames' inputs to each convolution, and `ends` [R, pad] those of the last `pad` of [context | row]
    (the next hop's context)."""

    rows: Tensor
    frames: Tensor
    positions: Tensor
    valid: Tensor
    gapped: Tensor
    kept: Tensor
    mask: Tensor | BlockMask | RowSpans
    context: Tensor | None = None
    ends: Tensor | None = None

    def pack(self, y: Tensor) -> Tensor:
        """Padded [rows, total, C] -> packed [1, S, C] (unused slots: zeros)."""
        flat = torch.cat((y.reshape(-1, y.shape[-1]), y.new_zeros(1, y.shape[-1])))
        return flat[self.frames][None]

    def unpack(self, y: Tensor, rows: int, total: int) -> Tensor:
        """Packed [1, S, C] -> padded [rows, total, C], zero where no frame is."""
        out = y.new_zeros(rows * total + 1, y.shape[-1]).index_copy(0, self.frames, y[0])
        return out[:-1].view(rows, total, -1)


def packing(lengths: list[int], streaming: list[bool], total: int, chunk: int, pad: int, kernel: str,
            device: torch.device) -> Packing:
    """The packing of rows of these valid lengths (host lists: no read from the device), padded to
    `total` frames each; chunk: the DiT's static chunk (<= 0: none); pad: its convolutions' context;
    kernel: the DiT's attention kernel (`varlen` with a streamed row under a chunk mask: SDPA's mask)."""
    flex = kernel == "flex"
    by_rows = kernel == "varlen" and not (chunk > 0 and any(streaming))
    starts = torch.tensor([0, *lengths]).cumsum(0)
    used = int(starts[-1])
    size = max(used, FLEX_BLOCK + 1) if flex else used  # flex: two blocks at least (one would compile apart)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.arange(used) - starts[rows]
    length, begin = torch.tensor(lengths)[rows], starts[rows]
    chunk_end = (positions // chunk + 1) * chunk if chunk > 0 else length
    seen = torch.where(torch.tensor(streaming)[rows], torch.minimum(chunk_end, length), length)
    lo, hi = torch.zeros(size, dtype=torch.long), torch.zeros(size, dtype=torch.long)
    lo[:used], hi[:used] = begin, begin + seen
    gapped_len = used + pad * len(lengths) + 1  # + the unused slots' place
    kept = torch.zeros(gapped_len, dtype=torch.bool)
    gapped = torch.full((size,), gapped_len - 1)
    gapped[:used] = torch.arange(used) + pad * (rows + 1)
    kept[gapped[:used]] = True
    frames = torch.full((size,), len(lengths) * total)
    frames[:used] = rows * total + positions
    unused = torch.zeros(size - used, dtype=torch.long)
    host = (torch.cat((rows, unused)), frames, torch.cat((positions, unused)), gapped, lo, hi,
            (torch.arange(size) < used).long(), kept.long(), starts)
    # one transfer (each from pageable memory waits for the stream), split into its pieces
    rows, frames, positions, gapped, lo, hi, valid, kept, starts = \
        torch.cat(host).to(device).split([len(t) for t in host])
    if by_rows:
        mask = RowSpans(starts.int())
    else:
        mask = _block_mask(lo, hi, size) if flex else _dense_mask(lo, hi, size)
    return Packing(rows, frames, positions, valid.bool()[None], gapped, kept.bool()[None, :, None], mask)


def _dense_mask(lo: Tensor, hi: Tensor, size: int) -> Tensor:
    k = torch.arange(size, device=lo.device)[None]
    seen = (k >= lo[:, None]) & (k < hi[:, None])
    return (seen | ~seen.any(1, keepdim=True))[None, None]  # an unused slot sees all (SDPA: no empty row)


def _block_mask(lo: Tensor, hi: Tensor, size: int) -> BlockMask:
    """Each query slot sees the key interval [lo, hi) (empty for an unused slot), so a block of queries
    sees at most [its least lo, its largest hi) and every key of [its largest lo, its least hi)."""
    blocks = -(-size // FLEX_BLOCK)
    fill = blocks * FLEX_BLOCK - size  # the last block's slots past the sequence: unused
    lo, hi = (torch.cat((t, t.new_zeros(fill))) for t in (lo, hi))  # mask_mod may be asked about them

    def visible(b, h, q, k):
        return (k >= lo[q]) & (k < hi[q])

    lo_b, hi_b = lo.view(blocks, FLEX_BLOCK), hi.view(blocks, FLEX_BLOCK)
    used = hi_b > lo_b
    big = torch.iinfo(torch.long).max
    least_lo = torch.where(used, lo_b, big).amin(1)[:, None]
    most_hi = torch.where(used, hi_b, 0).amax(1)[:, None]
    k0 = (torch.arange(blocks, device=lo.device) * FLEX_BLOCK)[None]
    some = used.any(1)[:, None] & (least_lo < k0 + FLEX_BLOCK) & (most_hi > k0)
    every = used.all(1)[:, None] & (lo_b.amax(1)[:, None] <= k0) & (hi_b.amin(1)[:, None] >= k0 + FLEX_BLOCK)
    return BlockMask.from_kv_blocks(*block_lists((some & ~every)[None]), *block_lists(every[None]),
                                    BLOCK_SIZE=FLEX_BLOCK, mask_mod=visible, seq_lengths=(size, size))


def continued_packing(past: list[int], new: list[int], chunked: list[int], width: int, chunk: int, pad: int,
                      device: torch.device) -> Packing:
    """The new frames of rows that continue `past` solved frames (from a chunk boundary), packed end to end
    (host lists; `frames` indexes the solve's inputs padded to `width` frames a row, from frame 0). Attention
    by query segments (`RowSpans` with keys apart): a row's first `chunked` new frames (a streamed row's all)
    chunk by chunk, each over the row's past and its new frames to the chunk's end; the rest all at once
    over all of them. Keys are laid out once per row, its past then its new frames, from (the rows' past keys
    packed in row order, the new frames' keys): `key_index`; a segment reads the first of its row's keys,
    up to its own end (`RowSpans.key_used`), so a row of several chunks gathers its keys once, not per chunk."""
    rows_n = len(new)
    starts = torch.tensor([0, *new]).cumsum(0).tolist()
    past_starts = torch.tensor([0, *past]).cumsum(0).tolist()
    used, past_total = starts[-1], past_starts[-1]
    rows = torch.repeat_interleave(torch.arange(rows_n), torch.tensor(new))
    offsets = torch.arange(used) - torch.tensor(starts[:-1])[rows]
    positions = torch.tensor(past)[rows] + offsets
    segments = query_segments(new, chunked, chunk)
    # a row's keys: its past keys, then its new frames' keys; a segment's, the first of them to its own end
    key_index = concatenated_ranges([s for r in range(rows_n) for s in (past_starts[r], past_total + starts[r])],
                                    [n for r in range(rows_n) for n in (past[r], new[r])])
    row_keys = [p + s for p, s in zip(past_starts, starts)]  # where each row's keys begin
    q_starts = [0, *(starts[r] + end for r, _, end in segments)]
    k_starts = torch.tensor([*(row_keys[r] for r, _, _ in segments), row_keys[-1]])
    k_used = torch.tensor([past[r] + end for r, _, end in segments], dtype=torch.long)
    longest = max([1, *(end - lo for _, lo, end in segments)])
    gapped = offsets + torch.tensor(starts[:-1])[rows] + pad * (rows + 1)
    kept = torch.zeros(used + pad * rows_n, dtype=torch.bool)
    kept[gapped] = True
    first = torch.tensor(starts[:-1]) + pad * torch.arange(rows_n)  # each row's first context slot
    context = first[:, None] + torch.arange(pad)[None]
    ends = (first + torch.tensor(new))[:, None] + torch.arange(pad)[None]
    frames = rows * width + positions
    host = (rows, frames, positions, gapped, kept.long(), context.flatten(), ends.flatten(),
            key_index, torch.tensor(q_starts), k_starts, k_used)
    rows, frames, positions, gapped, kept, context, ends, key_index, q_starts, k_starts, k_used = \
        torch.cat(host).to(device).split([len(t) for t in host])
    # the kernel's query bound, rounded up to its block: few distinct lengths (the compiled code's symbols)
    bound = torch.empty(-(-longest // FLEX_BLOCK) * FLEX_BLOCK, 0, device=device)
    spans = RowSpans(q_starts.int(), key_starts=k_starts.int(), key_index=key_index, bound=bound,
                     key_used=k_used.int())
    return Packing(rows, frames, positions, torch.ones(1, used, dtype=torch.bool, device=device), gapped,
                   kept.bool()[None, :, None], spans, context.view(rows_n, pad), ends.view(rows_n, pad))


def query_segments(new: list[int], chunked: list[int], chunk: int) -> list[tuple[int, int, int]]:
    """(row, first, end) of each query segment of `continued_packing`, new frames counted from the row's first:
    a row's first `chunked` new frames chunk by chunk (ends on the chunk grid, the last at `chunked`), then the
    rest at once; no empty segment."""
    out = []
    for r, n in enumerate(new):
        masked = min(chunked[r], n) if chunk > 0 else 0
        lo = 0
        for end in [*range(chunk, masked, chunk), masked, n] if masked else [n]:
            if end > lo:
                out.append((r, lo, end))
                lo = end
    return out


def concatenated_ranges(starts: list[int], lengths: list[int]) -> Tensor:
    """range(starts[i], starts[i] + lengths[i]) for each i, end to end, as one int64 tensor (no Python list of
    every element: a C64 call's keys are ~160 thousand)."""
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    before = lengths_t.cumsum(0) - lengths_t
    return torch.repeat_interleave(torch.tensor(starts, dtype=torch.long) - before, lengths_t) + \
        torch.arange(int(lengths_t.sum()))
