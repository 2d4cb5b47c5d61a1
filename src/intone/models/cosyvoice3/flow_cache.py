"""The flow's solve continued from a stream's earlier hops (`cosyvoice3.flow.cache`).

Officially every streamed hop re-solves the flow over the reference and *all* tokens so far. Under the
chunk mask a frame sees only frames before the end of its 50-frame chunk, and the DiT's convolutions are
causal, so at every Euler step a completed chunk's frames get the same state, and each layer the same
keys and values, in every later non-final hop (their inputs, noise included, are the same). A non-final
hop ends on a chunk boundary. So each stream keeps, per Euler step, the keys and values of every layer for
the frames it has solved, and the input embedding's last frames (its causal convolutions' context); the
next hop solves only its new frames against them: the same mel, with the prefix's work (its keys,
values and the rest of its DiT pass) done once. The final hop attends to every frame, so it re-solves
the whole utterance, as officially; under `cosyvoice3.flow.final_hop: continued` (a request's `full_from`) it
too goes on from the cache: its new frames attend to every frame, the earlier ones keep the states their
chunk-masked hops gave them (not the official output: only the final chunk's audio can differ). The caches
live in a `FlowCachePool` (fixed memory, in blocks of a chunk).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask

from intone.models.cosyvoice3.dit import FLEX_BLOCK, DiT
from intone.models.cosyvoice3.flow import FlowRequest, cosine_euler_steps
from intone.models.cosyvoice3.flow_cache_pool import FlowCache, FlowCachePool
from intone.models.cosyvoice3.packing import concatenated_ranges, continued_packing

DEFAULT_POOL_BYTES = 2**30  # a flow's own pool, where the caller gives none (tests, tools)


def continued_mask(dit: DiT, past: Tensor, new: Tensor, chunked: Tensor, rows: int, width: int):
    """The attention pattern of `rows` query frames over [past keys (padded to `width`) | new frames]:
    a row's past frames are all visible (they lie in earlier chunks); of its new frames, counted from the
    row's first (a chunk boundary), the first `chunked` see up to their chunk's end, as `attention_mask`
    sets a streamed row's, and the rest see all. Boolean SDPA mask [B, 1, Q, K], or a flex BlockMask."""
    chunk, total = dit.config.static_chunk_size, width + rows

    def visible(b, h, q, k):
        here = k - width
        seen = (here >= 0) & (here < new[b])
        if chunk > 0:
            seen = seen & ((here < (q // chunk + 1) * chunk) | (q >= chunked[b]))
        return (q < new[b]) & ((k < past[b]) | seen)

    if dit.attention_kernel == "flex":
        return create_block_mask(visible, past.shape[0], None, rows, total, device=past.device,
                                 BLOCK_SIZE=FLEX_BLOCK)
    b, q, k = (torch.arange(n, device=past.device) for n in (past.shape[0], rows, total))
    seen = visible(b[:, None, None], None, q[None, :, None], k[None, None, :])
    # padded queries see their row's keys, so SDPA never meets a fully hidden row (their outputs are zeroed)
    keys = (k[None] < past[:, None]) | ((k[None] >= width) & (k[None] - width < new[:, None]))
    return torch.where((q[None, :, None] < new[:, None, None]), seen, keys[:, None, :])[:, None]


def _padded_past(pool: FlowCachePool, index: Tensor | None, step: int, rows: int, width: int) -> list[tuple] | None:
    """Per layer, the past (keys, values) [2 * rows, heads, width, head size] of every row at this step (rows
    without a cache: zeros, which the mask hides; index: `past_index`, padded); None when no row has a cache."""
    if index is None:
        return None
    both = pool.past(step, index).unflatten(2, (2 * rows, width)).transpose(3, 4)
    return [(layer[0], layer[1]) for layer in both]


class _Tails:
    """The input embedding's context of a call's rows: the caches' (`given`, [steps, 2 (convolutions),
    2 * rows, pad, dim], zeros for a row without a cache: the convolutions' own zero padding; None when no row
    has one), gathered once per call, and the kept rows' new ones, written once per step for all of them."""

    def __init__(self, caches: list, keep: list[bool], steps: int, pad: int, like: Tensor):
        rows, have = len(caches), [(b, c) for b, c in enumerate(caches) if c is not None]
        self.given = None
        if have:
            t = have[0][1].tails
            buf = t.new_zeros(steps, 2, 2, rows, pad, t.shape[-1])
            for b, c in have:
                buf[:, :, :, b] = c.tails
            self.given = buf.flatten(2, 3)
        self.kept = [b for b, k in enumerate(keep) if k]
        self.doubled = torch.tensor(self.kept + [rows + b for b in self.kept], dtype=torch.long, device=like.device)
        self.new = None
        self.steps = steps

    def at(self, step: int) -> tuple[Tensor, Tensor] | None:
        return None if self.given is None else (self.given[step, 0], self.given[step, 1])

    def store(self, step: int, tails: Tensor) -> None:
        """The kept rows' tails at this step [2 (convolutions), 2 * kept (conditioned, then unconditioned), pad, dim]."""
        if self.new is None:
            self.new = tails.new_empty(self.steps, 2, 2, len(self.kept), *tails.shape[2:])
        self.new[step] = tails.unflatten(1, (2, len(self.kept)))

    def of(self) -> dict[int, Tensor]:
        """Each kept row's tails [steps, 2, 2 (rows), pad, dim]."""
        return {b: self.new[:, :, :, k].clone() for k, b in enumerate(self.kept)} if self.new is not None else {}


class _Blocks:
    """A call's new cache blocks: per kept row its conditioned and unconditioned blocks (None: not kept), and
    every kept row's in the order a step stores them (conditioned rows, then unconditioned), on the device."""

    def __init__(self, pool: FlowCachePool, keep: list[bool], new: list[int], chunk: int):
        self.pool = pool
        rows = [pool.allocate(2 * n // chunk) if k else None for k, n in zip(keep, new)]
        self.halves = [(b[: len(b) // 2], b[len(b) // 2:]) if b is not None else None for b in rows]
        self.keep = [h is not None for h in self.halves]
        order = [i for h in (0, 1) for half in self.halves if half is not None for i in half[h]]
        try:
            self.order = torch.tensor(order, dtype=torch.long, device=pool.kv.device)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for half in self.halves:
            if half is not None:
                self.pool.release(half[0] + half[1])


def _pool_for(flow, pool: FlowCachePool | None, requests: list) -> FlowCachePool:
    """The pool the call keeps its caches in (the flow's own where none is given), allocated for the DiT's
    keys and values in the dtype they are computed in."""
    if pool is None:
        if getattr(flow, "cache_pool", None) is None:
            flow.cache_pool = FlowCachePool(DEFAULT_POOL_BYTES)
        pool = flow.cache_pool
    dit = flow.decoder.estimator
    device = requests[0].speaker.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) \
        else next(dit.parameters()).dtype
    cfg = dit.config
    pool.ensure(flow.decoder.n_timesteps, cfg.depth, cfg.heads, cfg.dim_head, cfg.static_chunk_size, dtype, device)
    return pool


@torch.inference_mode()
def solve_continued(flow, requests: list, caches: list[FlowCache | None], keep: list[bool], pause=None,
                    pool: FlowCachePool | None = None):
    """Each request's mel from frame max(prompt mel, its cache's frames) to its end, and its new cache
    (None where keep is false, where the hop does not end on a chunk boundary (a later hop could not
    continue from it), and where the pool has no room). A request's cache must come from its own earlier
    non-final hop, in this pool (None: the flow's own)."""
    dit = flow.decoder.estimator
    lengths = flow.mel_lengths(requests)
    starts = [c.frames if c is not None else 0 for c in caches]
    chunk = dit.config.static_chunk_size
    chunked = chunked_frames(requests, starts, lengths, chunk)
    for c, r in zip(caches, requests):
        if c is not None and ((not r.streaming and r.full_from is None) or (chunk > 0 and c.frames % chunk)):
            raise ValueError("a flow cache continues only a streamed row or a continued final hop (full_from), "
                             "from a chunk boundary")
    pool = _pool_for(flow, pool, requests)
    if any(c is not None and c.pool is not pool for c in caches):
        raise ValueError("a flow cache continues only in its own pool")
    # no chunk mask: an earlier frame's state changes with later frames, so there is nothing to keep
    keep = [k and r.streaming and chunk > 0 and not n % chunk for k, r, n in zip(keep, requests, lengths)]
    blocks = _Blocks(pool, keep, [n - s for n, s in zip(lengths, starts)], chunk)
    solve = _solve_packed if dit.attention_kernel == "varlen" else _solve_padded
    try:
        mels, tails = solve(flow, requests, caches, blocks, lengths, starts, chunked, pause)
    except BaseException:
        blocks.release()
        raise
    return mels, _results(pool, caches, blocks, lengths, tails)


def _solve_padded(flow, requests: list, caches: list, blocks: _Blocks, lengths: list[int], starts: list[int],
                  chunked: list[int], pause=None) -> tuple[list, list]:
    """`solve_continued` with the rows right-padded (the sdpa and flex kernels): (mels, new tails per row)."""
    cfm, dit = flow.decoder, flow.decoder.estimator
    mu, cond, spks, _, _ = flow.solve_inputs(requests)
    new = [n - s for n, s in zip(lengths, starts)]
    rows = max(max(new), FLEX_BLOCK + 1 if dit.attention_kernel == "flex" else 1)  # flex: two blocks at least
    width = max(starts)
    dev, b = mu.device, len(requests)
    pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(rows, device=dev)[None]
    index = pos.clamp(max=mu.shape[1] - 1)[..., None].expand(-1, -1, mu.shape[2])
    in_row = (torch.arange(rows, device=dev)[None] < torch.tensor(new, device=dev)[:, None])
    mu, cond = (torch.gather(y, 1, index) * in_row[..., None] for y in (mu, cond))
    state = torch.promote_types(mu.dtype, torch.float32)
    if int(pos.max()) >= cfm.noise.shape[-1]:
        raise ValueError(f"{int(pos.max()) + 1} mel frames exceed the {cfm.noise.shape[-1]}-frame noise buffer")
    x = cfm.noise[0].T[pos.clamp(max=cfm.noise.shape[-1] - 1)].to(state)
    past_t, new_t = torch.tensor(starts, device=dev).repeat(2), torch.tensor(new, device=dev).repeat(2)
    mask = continued_mask(dit, past_t, new_t, torch.tensor(chunked, device=dev).repeat(2), rows, width)
    valid = in_row.repeat(2, 1)
    rope = dit.rotary_embed.at(pos.repeat(2, 1))
    mu2, cond2, spks2 = (torch.cat((y, torch.zeros_like(y))) for y in (mu, cond, spks))
    pad = dit.input_embed.conv_pos_embed.pad
    tails = _Tails(caches, blocks.keep, cfm.n_timesteps, pad, mu)
    # the kept rows' last pad frames (ending at their new frames' end) in each convolution's input [2 * rows, pad + T]
    ends = torch.tensor([new[k] for k in tails.kept] * 2, dtype=torch.long, device=dev)
    tail_frames = ends[:, None] + torch.arange(pad, device=dev)[None]
    index = blocks.pool.past_index(caches, width // dit.config.static_chunk_size) if width else None
    def velocity(step: int, t: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        past = _padded_past(blocks.pool, index, step, b, width)
        xin = x.to(mu2.dtype)
        v, kvs, seqs = dit.forward_continued(torch.cat((xin, xin)), mu2, cond2, spks2, t.to(mu2.dtype).expand(2 * b),
                                             mask, valid, rope, past, tails.at(step))
        _keep_step(kvs, seqs, step, new, blocks, tails, tail_frames)
        return v.to(state).chunk(2)
    x = _euler(cfm, x, velocity, pause)
    return _mels(requests, starts, [x[i, : new[i]] for i in range(b)]), tails.of()


def reference_ahead(flow, prompt_tokens: Tensor, prompt_mel: Tensor, speaker: Tensor) -> FlowRequest | None:
    """The solve of a stream's reference alone (`cosyvoice3.flow.reference_ahead`): its whole chunks whose
    frames depend on no generated token (the lookahead layer reads `pre_lookahead_len` tokens ahead), as a
    non-final hop that keeps its cache; None when no whole chunk qualifies. Every hop's chunk-masked solve
    gives those frames the same states, so the first hop going on from this cache gives the official mel."""
    cfg, chunk = flow.config, flow.decoder.estimator.config.static_chunk_size
    if chunk <= 0:
        return None
    frames = min(cfg.token_mel_ratio * (len(prompt_tokens) - cfg.pre_lookahead_len), prompt_mel.shape[0])
    frames -= frames % chunk
    if frames <= 0:
        return None
    tokens = frames // cfg.token_mel_ratio
    # the reference's first `tokens` as its prompt, the next ones as the hop's lookahead context: mel to `frames`
    return FlowRequest(prompt_tokens[tokens: tokens + cfg.pre_lookahead_len], prompt_tokens[:tokens],
                       prompt_mel[:frames], speaker, streaming=True, finalize=False)


def chunked_frames(requests: list, starts: list[int], lengths: list[int], chunk: int) -> list[int]:
    """Per row, how many of its new frames (from `starts`) keep the chunk mask: a streamed row's all, a
    whole row's none, a continued final hop's those before its `full_from` (a chunk boundary)."""
    out = []
    for r, start, n in zip(requests, starts, lengths):
        if r.full_from is None:
            out.append(n - start if r.streaming else 0)
        elif r.streaming or r.full_from < start or (chunk > 0 and (r.full_from - start) % chunk):
            raise ValueError(f"full_from {r.full_from} must be a chunk boundary at or after the row's cache "
                             f"({start} frames), on a final row")
        else:
            out.append(min(r.full_from, n) - start)
    return out


def _euler(cfm, x: Tensor, velocity, pause=None) -> Tensor:
    """The solve's Euler steps from x (the official schedule, in x's dtype); velocity(step, t, x) -> the
    conditioned and unconditioned velocities; pause: called after each step."""
    for step, (t, dt) in enumerate(cosine_euler_steps(cfm.n_timesteps, x.device, x.dtype)):
        x = cfm.guided(x, *velocity(step, t, x), dt)
        if pause is not None:
            pause()
    return x


def _keep_step(kvs: list, seqs: tuple, step: int, new: list[int], blocks: _Blocks, tails: _Tails,
               tail_frames: Tensor) -> None:
    """Store this step's keys, values and embedding tails of the rows whose cache goes on (tail_frames
    [2 * kept, pad]: where each kept doubled row's last pad frames lie in the convolutions' inputs)."""
    rows = len(new)
    kept = tails.kept
    if not kept:
        return
    both = _stacked(kvs)  # [layers, 2, 2 * rows, H, T, d]
    parts = [both[:, :, at + b, :, : new[b]].transpose(2, 3) for at in (0, rows) for b in kept]
    blocks.pool.store(step, blocks.order, torch.cat(parts, dim=2))
    tails.store(step, torch.stack([seq[tails.doubled[:, None], tail_frames] for seq in seqs]))


def _stacked(kvs: list) -> Tensor:
    """Each layer's (keys, values) as one tensor [layers, 2, ...]."""
    return torch.stack([t for kv in kvs for t in kv]).unflatten(0, (len(kvs), 2))


def _mels(requests: list, starts: list[int], new_mels: list[Tensor]) -> list[Tensor]:
    """Each request's mel [mel, frames] from frame max(prompt mel, its cache's frames) (new_mels: its solved
    frames [n, mel], from its cache's end)."""
    return [m[max(r.prompt_mel.shape[0] - s, 0):].float().T.contiguous() for r, s, m in zip(requests, starts, new_mels)]


def _results(pool: FlowCachePool, caches: list, blocks: _Blocks, lengths: list[int], tails: list) -> list:
    """Each row's new cache: its earlier hops' blocks (one more reference each) and this hop's (None where
    not kept)."""
    out = []
    for i, half in enumerate(blocks.halves):
        if half is None:
            out.append(None)
            continue
        cond, uncond, old = half[0], half[1], caches[i]
        if old is not None:
            pool.retain(old.cond + old.uncond)
            cond, uncond = old.cond + cond, old.uncond + uncond
        out.append(pool.cache(lengths[i], cond, uncond, tails[i]))
    return out


def _solve_packed(flow, requests: list, caches: list, blocks: _Blocks, lengths: list[int], starts: list[int],
                  chunked: list[int], pause=None) -> tuple[list, list]:
    """`_solve_padded` with the varlen kernel: the rows' new frames packed end to end, each attending to its
    past keys and its new frames (`packing.continued_packing`): no padding computed, no mask read."""
    cfm, dit = flow.decoder, flow.decoder.estimator
    b, pad = len(requests), dit.input_embed.conv_pos_embed.pad
    mu, cond, spks, _, _ = flow.solve_inputs(requests)
    new = [n - s for n, s in zip(lengths, starts)]
    dev, state = mu.device, torch.promote_types(mu.dtype, torch.float32)
    if max(lengths) > cfm.noise.shape[-1]:
        raise ValueError(f"{max(lengths)} mel frames exceed the {cfm.noise.shape[-1]}-frame noise buffer")
    packing = continued_packing(starts * 2, new * 2, chunked * 2, mu.shape[1],
                                dit.config.static_chunk_size, pad, dev)
    half = sum(new)  # the conditioned rows' slots come first, then the unconditioned rows' (the same frames)
    mu2, cond2, spks2 = (torch.cat((y, torch.zeros_like(y))) for y in (mu, cond, spks))
    mu_p, cond_p = (y.reshape(-1, y.shape[-1])[packing.frames][None] for y in (mu2, cond2))
    x = cfm.noise[0].T[packing.positions[:half]].to(state)
    index = blocks.pool.past_index(caches) if any(c is not None for c in caches) else None
    if index is not None:  # each layer reads its past straight from the pool's blocks (`DiT._laid_out`)
        packing = replace(packing, mask=replace(packing.mask, past_frames=blocks.pool.frames_of(index)))
    slots = _kept_slots(new, blocks.keep, dev)
    tails = _Tails(caches, blocks.keep, cfm.n_timesteps, pad, mu)
    tail_slots = packing.ends[tails.doubled]  # [2 * kept, pad]: the kept rows' last pad slots of each layout
    def velocity(step: int, t: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        past = blocks.pool.layers_at(step) if index is not None else None
        xin = x.to(mu2.dtype)
        v, kvs, layouts = dit.forward_continued_packed(torch.cat((xin, xin))[None], mu_p, cond_p, spks2,
                                                       t.to(mu2.dtype).expand(2 * b), packing, past, tails.at(step))
        _keep_packed_step(kvs, layouts, step, blocks, slots, tails, tail_slots)
        return v[0].to(state).split(half)
    x = _euler(cfm, x, velocity, pause)
    return _mels(requests, starts, list(x.split(new))), tails.of()


def _kept_slots(new: list[int], keep: list[bool], device) -> Tensor:
    """The packed slots of the kept rows' new frames, in the order their blocks are stored (`_Blocks.order`):
    the conditioned rows', then the unconditioned rows' (a row's at the same offset in the second half)."""
    starts, half = torch.tensor([0, *new]).cumsum(0).tolist(), sum(new)
    kept = [b for b, k in enumerate(keep) if k]
    return concatenated_ranges([at + starts[b] for at in (0, half) for b in kept],
                               [new[b] for _ in (0, half) for b in kept]).to(device)


def _keep_packed_step(kvs: list, layouts: list, step: int, blocks: _Blocks, slots: Tensor, tails: _Tails,
                      tail_slots: Tensor) -> None:
    """`_keep_step` from packed keys and values [S, heads, size] and the convolutions' input layouts."""
    if not tails.kept:
        return
    both = _stacked(kvs)  # [layers, 2, S, H, d]
    blocks.pool.store(step, blocks.order, both.index_select(2, slots))
    tails.store(step, torch.stack([layout[0, tail_slots] for layout in layouts]))
