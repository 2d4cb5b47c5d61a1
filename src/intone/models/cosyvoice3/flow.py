"""CosyVoice3 flow-matching decoder: speech tokens (+ prompt tokens, prompt mel, speaker) -> mel.

A re-implementation of the official `CausalMaskedDiffWithDiT` + `CausalConditionalCFM` whose module tree
yields exactly the `flow.pt` keys. `CosyFlow.inference` runs a batch of right-padded requests at once;
each row gets what the official batch-1 `inference` gives it, up to floating-point effects of the shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from intone.models.cosyvoice3.dit import FLEX_BLOCK, DiT, DiTConfig
from intone.models.cosyvoice3.packing import Packing, packing
from intone.ops.varlen_attention import RowSpans
from intone.ops.batching import bucket_rows, pad_rows


GRAPH_FRAME_BUCKET = 128  # mel frames: a graphed solve's length is padded to a multiple of this
GRAPH_ROW_STEP = 8  # rows beyond 8 are padded to a multiple of this (a power of two would waste up to half)


def graph_rows(rows: int) -> int:
    """The rows of the graph a solve of `rows` rows replays: a power of two up to GRAPH_ROW_STEP,
    then the next multiple of it (a large call is bound by its arithmetic, so little padding)."""
    if rows <= GRAPH_ROW_STEP:
        return bucket_rows(rows)
    return -(-rows // GRAPH_ROW_STEP) * GRAPH_ROW_STEP


def graph_shape(rows: int, frames: int) -> tuple[int, int]:
    """The (rows, frames) of the graph a solve of this shape replays (`graph_rows`; frames up to a
    multiple of GRAPH_FRAME_BUCKET)."""
    return graph_rows(rows), -(-frames // GRAPH_FRAME_BUCKET) * GRAPH_FRAME_BUCKET


def pad_solve_inputs(mu: Tensor, cond: Tensor, spks: Tensor, lengths: Tensor, streaming: Tensor,
                     rows: int, frames: int) -> tuple[Tensor, ...]:
    """The solve's inputs at (rows, frames): added rows copy row 0 (their output is dropped), added
    frames are zeros past every row's length, which the attention mask hides from every valid frame
    (the DiT's convolutions are causal), so no valid frame's value changes."""
    mu, cond = (F.pad(y, (0, 0, 0, frames - y.shape[1])) for y in (mu, cond))
    return tuple(pad_rows(t, rows) for t in (mu, cond, spks, lengths, streaming))


@dataclass(frozen=True)
class FlowConfig:
    """Defaults are the `flow:` block of the official cosyvoice3.yaml."""

    vocab_size: int = 6561
    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    pre_lookahead_len: int = 3
    pre_lookahead_channels: int = 1024
    token_mel_ratio: int = 2
    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    noise_frames: int = 15000  # 300 s at 50 Hz: caps prompt + output length
    noise_seed: int = 0
    dit: DiTConfig = field(default_factory=DiTConfig)


@dataclass
class FlowRequest:
    tokens: Tensor  # [N] int64 speech tokens, incl. the trailing lookahead tokens when not finalize
    prompt_tokens: Tensor  # [P] int64
    prompt_mel: Tensor  # [M, 80] prompt features; the output starts at mel frame M
    speaker: Tensor  # [192] raw CAM++ embedding, L2-normalised inside
    streaming: bool  # chunk-causal DiT attention
    finalize: bool  # False: the last pre_lookahead_len tokens are lookahead context only
    # a stream's final hop under `cosyvoice3.flow.final_hop: continued`: the mel frames from here on attend to
    # every frame, the earlier ones keep the chunk mask (None: `streaming` decides for every frame); only the
    # continued solve (`flow_cache.solve_continued`) takes it
    full_from: int | None = None


class PreLookaheadLayer(nn.Module):
    """conv1 looks `lookahead` tokens ahead, conv2 looks 2 back, plus a residual. Input [B, N, C]."""

    def __init__(self, channels: int, hidden: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, hidden, lookahead + 1)
        self.conv2 = nn.Conv1d(hidden, channels, 3)

    def forward(self, x: Tensor) -> Tensor:
        """Rows must be zero past their length: a finalized row then looks ahead into zeros, as officially,
        and a non-final row's lookahead context is simply its last tokens (their outputs are dropped later)."""
        y = F.leaky_relu(self.conv1(F.pad(x.transpose(1, 2), (0, self.lookahead))))
        y = self.conv2(F.pad(y, (self.conv2.kernel_size[0] - 1, 0)))
        return y.transpose(1, 2) + x


def cosine_euler_steps(n: int, device: torch.device, dtype: torch.dtype) -> Iterator[tuple[Tensor, Tensor]]:
    """(t, dt) per Euler step on the schedule 1 - cos(pi/2 * k/n), with t accumulated as t + dt and
    dt re-derived from the schedule, in the model dtype and on the device, as officially (bit-exact)."""
    span = 1 - torch.cos(torch.linspace(0, 1, n + 1, device=device, dtype=dtype) * 0.5 * torch.pi)
    t, dt = span[0], span[1] - span[0]
    for step in range(1, n + 1):
        yield t, dt
        t = t + dt
        if step < n:
            dt = span[step + 1] - t


class CausalCFM(nn.Module):
    """Fixed-noise Euler ODE solve with classifier-free guidance (rows doubled: conditioned, then zeroed)."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.n_timesteps = cfg.n_timesteps
        self.cfg_rate = cfg.inference_cfg_rate
        self.estimator = DiT(cfg.dit)
        self.packed = False  # eager solves run the DiT on packed rows (`packing`)
        noise = torch.randn(1, cfg.output_size, cfg.noise_frames, generator=torch.Generator().manual_seed(cfg.noise_seed))
        # Kept as raw fp32 bits: dtype casts of the module (.half(), .double()) then leave it exact.
        self.register_buffer("noise_bits", noise.view(torch.int32), persistent=False)

    @property
    def noise(self) -> Tensor:
        """The official `rand_noise`: fp32 [1, mel, noise_frames], indexed by absolute mel frame."""
        return self.noise_bits.view(torch.float32)

    def forward(self, mu: Tensor, cond: Tensor, spks: Tensor, lengths: Tensor, streaming: Tensor,
                pause=None, packing: Packing | None = None) -> Tensor:
        """mu, cond: [B, T, mel]; spks: [B, mel]; lengths: [B] valid frames; streaming: [B] bool. -> fp32 [B, T, mel].
        pause: called after each Euler step's launches (the codec worker runs urgent calls there).
        packing: of the doubled rows (`packing_of`): the DiT runs on their valid frames only."""
        return self.solve(*self.start(mu, cond, spks, lengths, streaming), pause=pause, packing=packing)

    def solve(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, lengths: Tensor, streaming: Tensor,
              pause=None, graphs=None, packing: Packing | None = None) -> Tensor:
        """`forward` from `start`'s state and doubled inputs; graphs: FunctionGraphs holding `euler_step` at
        these shapes (`capture`), each step replayed."""
        mask = packing  # a replayed step builds its own mask
        if packing is None and graphs is None:
            mask = self.estimator.attention_mask(lengths, streaming, mu.shape[1])
        for t, dt in cosine_euler_steps(self.n_timesteps, mu.device, x.dtype):
            if graphs is not None:
                x = graphs.run("flow_step", self.euler_step, x, mu, cond, spks, lengths, streaming, t, dt)[0]
            else:
                x = self._step(x, mu, cond, spks, mask, t, dt)
            if pause is not None:
                pause()
        return x.float()

    def start(self, mu: Tensor, cond: Tensor, spks: Tensor, lengths: Tensor, streaming: Tensor) -> tuple[Tensor, ...]:
        """The solve's first state (the fixed noise) and its inputs with the rows doubled for CFG
        (conditioned, then zeroed): (x [B, T, mel], mu, cond, spks, lengths, streaming)."""
        b, total, _ = mu.shape
        if total > self.noise.shape[-1]:
            raise ValueError(f"{total} mel frames exceed the {self.noise.shape[-1]}-frame noise buffer")
        # A half-precision estimator keeps the ODE state and its schedule in fp32, as the official
        # fp16 path (autocast) does; fp32 and fp64 models run all in their own dtype.
        state = torch.promote_types(mu.dtype, torch.float32)
        x = self.noise[0, :, :total].T.to(state).expand(b, -1, -1)
        mu, cond, spks = (torch.cat((y, torch.zeros_like(y))) for y in (mu, cond, spks))
        return x, mu, cond, spks, lengths.repeat(2), streaming.repeat(2)

    def euler_step(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, lengths: Tensor, streaming: Tensor,
                   t: Tensor, dt: Tensor) -> Tensor:
        """One Euler step on `start`'s doubled inputs, its attention mask built from the rows' lengths on
        the device: a fixed-shape function, replayable from a CUDA graph (`capture`)."""
        return self._step(x, mu, cond, spks, self.estimator.attention_mask(lengths, streaming, mu.shape[1]), t, dt)

    def capture(self, mu: Tensor, cond: Tensor, spks: Tensor, lengths: Tensor, streaming: Tensor, graphs) -> None:
        """Capture `euler_step` in `graphs` at these inputs' shapes (start-up only)."""
        started = self.start(mu, cond, spks, lengths, streaming)
        graphs.capture("flow_step", self.euler_step, *self.step_inputs(started))

    def step_inputs(self, started: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """`euler_step`'s inputs at the first step, as `capture` and `FunctionGraphs.has` key them."""
        t, dt = next(cosine_euler_steps(self.n_timesteps, started[1].device, started[0].dtype))
        return *started, t, dt

    def slot_step(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, t: Tensor, dt: Tensor, rows: Tensor,
                  positions: Tensor, valid: Tensor, gapped: Tensor, kept: Tensor, starts: Tensor,
                  bound: Tensor) -> Tensor:
        """One Euler step of a call laid out by `flow_slots`: x, mu, cond [S, mel] the conditioned half's frames,
        spks [R, mel] its rows'; then the doubled rows' layout (`flow_slots.layout_tensors`). Fixed shapes and
        no read on the host: replayable from a CUDA graph."""
        xin = x.to(mu.dtype)
        layout = Packing(rows, None, positions, valid, gapped, kept, RowSpans(starts, bound=bound))
        v = self.estimator.forward_slots(
            torch.cat((xin, xin))[None], torch.cat((mu, torch.zeros_like(mu)))[None],
            torch.cat((cond, torch.zeros_like(cond)))[None], torch.cat((spks, torch.zeros_like(spks))),
            t.to(mu.dtype).expand(2 * spks.shape[0]), layout)
        return self.guided(x, *v[0].to(x.dtype).chunk(2), dt)

    def slot_solve(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, *layout: Tensor) -> Tensor:
        """The whole solve of `slot_step`s (its inputs less t and dt, which it derives on the device): one
        fixed-shape function for a call that never pauses."""
        for t, dt in cosine_euler_steps(self.n_timesteps, x.device, x.dtype):
            x = self.slot_step(x, mu, cond, spks, t, dt, *layout)
        return x

    def packing_of(self, lengths: list[int], streaming: list[bool], total: int) -> Packing:
        """The packing of a solve's rows (host lists, before `start` doubles them) padded to `total` frames."""
        dit = self.estimator
        return packing(lengths * 2, streaming * 2, total, dit.config.static_chunk_size,
                       dit.input_embed.conv_pos_embed.pad, dit.attention_kernel, self.noise_bits.device)

    def _step(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, mask, t: Tensor, dt: Tensor) -> Tensor:
        """mask: `attention_mask`'s (mask, valid), or a Packing."""
        xin, t = x.to(mu.dtype), t.to(mu.dtype).expand(mu.shape[0])
        if isinstance(mask, Packing):
            v = self.estimator.forward_packed(torch.cat((xin, xin)), mu, cond, spks, t, mask)
        else:
            v = self.estimator(torch.cat((xin, xin)), mu, cond, spks, t, *mask)
        return self.guided(x, *v.to(x.dtype).chunk(2), dt)

    def guided(self, x: Tensor, v_cond: Tensor, v_uncond: Tensor, dt: Tensor) -> Tensor:
        """One Euler step along the classifier-free-guided velocity."""
        return x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)


class CosyFlow(nn.Module):
    def __init__(self, cfg: FlowConfig | None = None):
        super().__init__()
        cfg = cfg or FlowConfig()
        self.config = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_lookahead_channels, cfg.pre_lookahead_len)
        self.decoder = CausalCFM(cfg)

    def mel_lengths(self, requests: list[FlowRequest]) -> list[int]:
        """Mel frames each request conditions on (prompt + output)."""
        cfg = self.config
        return [
            cfg.token_mel_ratio * (len(r.prompt_tokens) + len(r.tokens) - (0 if r.finalize else cfg.pre_lookahead_len))
            for r in requests
        ]

    def _mu(self, requests: list[FlowRequest], total: int) -> Tensor:
        """Token embeddings -> lookahead layer -> repeated to mel rate: [B, total, mel]."""
        dev = self.input_embedding.weight.device
        seqs = [torch.cat((r.prompt_tokens, r.tokens)).to(dev) for r in requests]
        ids = pad_sequence(seqs, batch_first=True)
        n_tok = torch.tensor([len(s) for s in seqs], device=dev)
        keep = torch.arange(ids.shape[1], device=dev)[None] < n_tok[:, None]
        emb = self.input_embedding(ids.clamp(min=0)) * keep[..., None].to(self.input_embedding.weight.dtype)
        h = self.pre_lookahead_layer(emb)
        return h.repeat_interleave(self.config.token_mel_ratio, dim=1)[:, :total]

    def _speakers(self, requests: list[FlowRequest]) -> Tensor:
        weight = self.spk_embed_affine_layer.weight
        spk = torch.stack([r.speaker.reshape(-1) for r in requests]).to(weight.device)
        # Normalised in fp32 for fp32 and half models (a half model's official path is autocast on fp32
        # weights), in fp64 for an fp64 one (whose official Linear takes no fp32 input).
        spk = spk.to(torch.promote_types(spk.dtype, torch.promote_types(weight.dtype, torch.float32)))
        return self.spk_embed_affine_layer(F.normalize(spk, dim=1).to(weight.dtype))

    def solve_inputs(self, requests: list[FlowRequest]) -> tuple[Tensor, ...]:
        """(mu, cond, spks, lengths, streaming): the ODE solve's inputs, rows right-padded to the longest."""
        lengths = self.mel_lengths(requests)
        for n, r in zip(lengths, requests):
            if not 0 <= r.prompt_mel.shape[0] <= n:
                raise ValueError(f"prompt mel of {r.prompt_mel.shape[0]} frames does not fit {n} conditioned frames")
        mu = self._mu(requests, max(lengths))
        cond = torch.zeros_like(mu)
        prompt = pad_sequence([r.prompt_mel for r in requests], batch_first=True)
        cond[:, : prompt.shape[1]] = prompt.to(cond)  # zero rows past each M_i stay zero
        dev = mu.device
        return (mu, cond, self._speakers(requests), torch.tensor(lengths, device=dev),
                torch.tensor([r.streaming for r in requests], device=dev))

    def _eager_inputs(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """A flex DiT's solve gets two key blocks at least: compiled, it would compile a one-block mask
        apart (a dimension of 1); the added frames change no valid one (pad_solve_inputs)."""
        if self.decoder.estimator.attention_kernel == "flex" and inputs[0].shape[1] <= FLEX_BLOCK:
            return pad_solve_inputs(*inputs, inputs[0].shape[0], FLEX_BLOCK + 1)
        return inputs

    def runs_packed(self, requests: list[FlowRequest]) -> bool:
        """The DiT runs on packed rows: `packed`, or the varlen kernel on a call without chunk masks."""
        by_rows = self.decoder.estimator.attention_kernel == "varlen" and not any(r.streaming for r in requests)
        return self.decoder.packed or by_rows

    def _padded_solve_inputs(self, requests: list[FlowRequest]) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        inputs = self.solve_inputs(requests)
        return inputs, pad_solve_inputs(*inputs, *graph_shape(len(requests), inputs[0].shape[1]))

    @torch.inference_mode()
    def capture_solve(self, requests: list[FlowRequest], graphs) -> None:
        """Capture the ODE solve's Euler step in `graphs` at the padded shape of these requests (start-up only)."""
        self.decoder.capture(*self._padded_solve_inputs(requests)[1], graphs)

    @torch.inference_mode()
    def inference(self, requests: list[FlowRequest], graphs=None, pause=None) -> list[Tensor]:
        """Per request, fp32 mel [80, T_out] with T_out = mel_lengths - M (= 2N, or 2(N-3) when not finalize).

        graphs: an engine's FunctionGraphs: each of the ODE solve's ten Euler steps (a DiT pass with CFG,
        hundreds of launches) is replayed from the graph of the padded shape when one was captured
        (`capture_solve`). pause: called between the solve's Euler steps (`CausalCFM.forward`)."""
        if any(r.full_from is not None for r in requests):
            raise ValueError("a row with full_from is solved by flow_cache.solve_continued")
        if graphs is None:
            inputs = self._eager_inputs(self.solve_inputs(requests))
            packed = self.decoder.packing_of(self.mel_lengths(requests), [r.streaming for r in requests],
                                             inputs[0].shape[1]) if self.runs_packed(requests) else None
            mel = self.decoder(*inputs, pause=pause, packing=packed)
        else:
            inputs, padded = self._padded_solve_inputs(requests)
            started = self.decoder.start(*padded)
            if graphs.has("flow_step", *self.decoder.step_inputs(started)):
                mel = self.decoder.solve(*started, pause=pause, graphs=graphs)
            else:  # a shape without a graph: the solve at its own shape
                graphs.ran_eagerly()
                mel = self.decoder(*self._eager_inputs(inputs), pause=pause)
        ends = self.mel_lengths(requests)
        return [mel[i, r.prompt_mel.shape[0]: n].T.contiguous() for i, (r, n) in enumerate(zip(requests, ends))]
