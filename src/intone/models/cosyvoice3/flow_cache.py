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
chunk-masked hops gave them (not the official output: only the final chunk's audio can differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask

from intone.models.cosyvoice3.dit import FLEX_BLOCK, DiT
from intone.models.cosyvoice3.flow import FlowRequest, cosine_euler_steps
from intone.models.cosyvoice3.packing import continued_packing


@dataclass(eq=False)  # identity: the vocoder keeps a weak set of them
class FlowCache:
    """A stream's solved frames [0, frames): per Euler step, every layer's keys and values
    `kv` [steps, layers, 2 (keys, values), 2 (conditioned, unconditioned rows), heads, frames, head size],
    and the input embedding's last `pad` frames before each of its two convolutions
    `tails` [steps, 2, 2 (rows), pad, dim]."""

    frames: int
    kv: Tensor
    tails: Tensor

    @property
    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.tails.numel() * self.tails.element_size()


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


def _gather(caches: list[FlowCache | None], step: int, width: int, like: Tensor) -> list[tuple]:
    """Per layer, the past (keys, values) [2 * rows, heads, width, head size] of every row at this step
    (rows without a cache: zeros, which the mask hides)."""
    rows = len(caches)
    layers, _, _, heads, _, size = like.shape[1:]
    buf = like.new_zeros(layers, 2, 2 * rows, heads, width, size)
    for b, cache in enumerate(caches):
        if cache is not None:
            buf[:, :, [b, rows + b], :, : cache.frames] = cache.kv[step]
    return [(buf[i, 0], buf[i, 1]) for i in range(layers)]


@torch.inference_mode()
def solve_continued(flow, requests: list, caches: list[FlowCache | None], keep: list[bool], pause=None):
    """Each request's mel from frame max(prompt mel, its cache's frames) to its end, and its new cache
    (None where keep is false, and where the hop does not end on a chunk boundary: a later hop could not
    continue from it). A request's cache must come from its own earlier non-final hop."""
    cfm, dit = flow.decoder, flow.decoder.estimator
    lengths = flow.mel_lengths(requests)
    starts = [c.frames if c is not None else 0 for c in caches]
    chunk = dit.config.static_chunk_size
    chunked = chunked_frames(requests, starts, lengths, chunk)
    for c, r in zip(caches, requests):
        if c is not None and ((not r.streaming and r.full_from is None) or (chunk > 0 and c.frames % chunk)):
            raise ValueError("a flow cache continues only a streamed row or a continued final hop (full_from), "
                             "from a chunk boundary")
    keep = [k and r.streaming and not (chunk > 0 and n % chunk) for k, r, n in zip(keep, requests, lengths)]
    if dit.attention_kernel == "varlen":
        return _solve_packed(flow, requests, caches, keep, lengths, starts, chunked, pause)
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
    like = next((c.kv for c in caches if c is not None), None)
    pad = dit.input_embed.conv_pos_embed.pad
    segments: list[Tensor | None] = [None] * b  # the kept rows' new frames' keys and values, per step
    tails: list[Tensor | None] = [None] * b
    def velocity(step: int, t: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        past = _gather(caches, step, width, like) if like is not None else None
        tail_in = _gather_tails(caches, step, b, pad, dit.config.dim, mu2)
        xin = x.to(mu2.dtype)
        v, kvs, seqs = dit.forward_continued(torch.cat((xin, xin)), mu2, cond2, spks2, t.to(mu2.dtype).expand(2 * b),
                                             mask, valid, rope, past, tail_in)
        _keep_step(kvs, seqs, step, new, keep, segments, tails, pad, cfm.n_timesteps)
        return v.to(state).chunk(2)
    x = _euler(cfm, x, velocity, pause)
    return _results(requests, caches, keep, lengths, starts, [x[i, : new[i]] for i in range(b)], segments, tails)


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


def _gather_tails(caches: list[FlowCache | None], step: int, rows: int, pad: int, dim: int, like: Tensor) -> tuple:
    """The input embedding's context before each row's new frames: (before proj's conv, before the second
    conv) [2 * rows, pad, dim]; zeros for a row without a cache (the convolutions' own zero padding)."""
    dtype = next((c.tails.dtype for c in caches if c is not None), None)
    if dtype is None:
        return None
    buf = torch.zeros(2, 2 * rows, pad, dim, dtype=dtype, device=like.device)
    for b, cache in enumerate(caches):
        if cache is not None:
            buf[:, b], buf[:, rows + b] = cache.tails[step, :, 0], cache.tails[step, :, 1]
    return buf[0], buf[1]


def _keep_step(kvs: list, seqs: tuple, step: int, new: list[int], keep: list[bool], segments: list, tails: list,
               pad: int, steps: int) -> None:
    """Store this step's keys, values and embedding tails of the rows whose cache goes on."""
    rows = len(new)
    kept = [i for i, k in enumerate(keep) if k]
    if not kept:
        return
    both = torch.stack([t for kv in kvs for t in kv]).unflatten(0, (len(kvs), 2))  # [layers, 2, 2 * rows, H, T, d]
    for b in kept:
        n = new[b]
        # seq [2 * rows, pad + frames, dim]: a row's last pad frames end at n (slices: an index list would
        # be copied to the device)
        _store(segments, tails, b, step, steps, both[:, :, b::rows, :, :n],
               torch.stack([seq[b::rows, n: n + pad] for seq in seqs]))


def _store(segments: list, tails: list, b: int, step: int, steps: int, kv: Tensor, tail: Tensor) -> None:
    """Row b's keys and values [layers, 2, 2 (rows), H, n, d] and embedding tails [2, 2 (rows), pad, dim] at
    this step, into its new cache's (made at its first step)."""
    if segments[b] is None:
        segments[b], tails[b] = kv.new_empty(steps, *kv.shape), tail.new_empty(steps, *tail.shape)
    segments[b][step], tails[b][step] = kv, tail


def _results(requests: list, caches: list, keep: list[bool], lengths: list[int], starts: list[int],
             new_mels: list[Tensor], segments: list, tails: list) -> tuple[list, list]:
    """Each request's mel from frame max(prompt mel, its cache's frames) (new_mels: its solved frames [n, mel],
    from its cache's end), and its new cache (None where not kept)."""
    mels, out = [], []
    for i, r in enumerate(requests):
        mels.append(new_mels[i][max(r.prompt_mel.shape[0] - starts[i], 0):].float().T.contiguous())
        kv = segments[i] if caches[i] is None or not keep[i] else torch.cat((caches[i].kv, segments[i]), dim=5)
        out.append(FlowCache(lengths[i], kv, tails[i]) if keep[i] else None)
    return mels, out


def _solve_packed(flow, requests: list, caches: list, keep: list[bool], lengths: list[int], starts: list[int],
                  chunked: list[int], pause=None):
    """`solve_continued` with the varlen kernel: the rows' new frames packed end to end, each attending to its
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
    like = next((c.kv for c in caches if c is not None), None)
    segments: list[Tensor | None] = [None] * b
    tails: list[Tensor | None] = [None] * b
    def velocity(step: int, t: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        past = _packed_past(caches, step) if like is not None else None
        tail_in = _gather_tails(caches, step, b, pad, dit.config.dim, mu2)
        xin = x.to(mu2.dtype)
        v, kvs, layouts = dit.forward_continued_packed(torch.cat((xin, xin))[None], mu_p, cond_p, spks2,
                                                       t.to(mu2.dtype).expand(2 * b), packing, past, tail_in)
        _keep_packed_step(kvs, layouts, packing, step, new, keep, segments, tails, cfm.n_timesteps)
        return v[0].to(state).split(half)
    x = _euler(cfm, x, velocity, pause)
    return _results(requests, caches, keep, lengths, starts, list(x.split(new)), segments, tails)


def _packed_past(caches: list[FlowCache | None], step: int) -> list[tuple[Tensor, Tensor]]:
    """Per layer, the rows' past (keys, values) [P, heads, head size] at this step, packed in the doubled rows'
    order (conditioned rows, then unconditioned; a row without a cache has none)."""
    parts = [c.kv[step][:, :, cfg].transpose(2, 3) for cfg in (0, 1) for c in caches if c is not None]
    both = torch.cat(parts, dim=2)  # [layers, 2, P, heads, size]
    return [(layer[0], layer[1]) for layer in both]


def _keep_packed_step(kvs: list, layouts: list, packing, step: int, new: list[int], keep: list[bool],
                      segments: list, tails: list, steps: int) -> None:
    """`_keep_step` from packed keys and values [S, heads, size] and the convolutions' input layouts."""
    kept = [i for i, k in enumerate(keep) if k]
    if not kept:
        return
    rows, half = len(new), sum(new)
    both = torch.stack([t for kv in kvs for t in kv]).unflatten(0, (len(kvs), 2))  # [layers, 2, S, H, d]
    starts = torch.tensor([0, *new]).cumsum(0).tolist()
    for b in kept:
        kv = [both[:, :, at + starts[b]: at + starts[b] + new[b]].transpose(2, 3) for at in (0, half)]
        _store(segments, tails, b, step, steps, torch.stack(kv, dim=2),
               torch.stack([layout[0, packing.ends[b::rows]] for layout in layouts]))
