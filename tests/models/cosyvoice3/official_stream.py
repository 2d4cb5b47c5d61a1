"""The official streaming loop for one request, re-run directly on the model's flow and HiFT.

`CosyVoice2Model.tts(stream=True)` with `CosyVoice3Model.token2wav`, with its hop kept per
request (the official code keeps it on the shared model object, a known bug): chunks of
hop + 3 available tokens, the first hop padded so that reference + hop is a multiple of 25,
hops doubling to 100; the flow re-run over the whole prefix with the chunk mask, the HiFT over
the whole mel history; the final call with full attention and finalize. The engine batches
all of this across requests and must release exactly these samples.
"""

from __future__ import annotations

import torch

from intone.models.cosyvoice3.flow import FlowRequest, cosine_euler_steps


@torch.inference_mode()
def bounded_final_mel(flow, job: FlowRequest, full_from: int) -> torch.Tensor:
    """`cosyvoice3.flow.final_hop: continued`'s final hop, as a whole-prefix solve under a mask of its own
    (dense, any kernel): frames before `full_from` see up to their chunk's end, the rest every frame.
    -> mel [80, frames after the prompt]."""
    cfm = flow.decoder
    mu, cond, spks, lengths, _ = flow.solve_inputs([job])
    x, mu, cond, spks, lengths, _ = cfm.start(mu, cond, spks, lengths, torch.ones(1, dtype=torch.bool))
    total, chunk = mu.shape[1], cfm.estimator.config.static_chunk_size
    q, k = torch.arange(total, device=mu.device)[:, None], torch.arange(total, device=mu.device)[None]
    valid = k < lengths[:, None]  # [2, T]
    seen = (q >= full_from) | (k < (q // chunk + 1) * chunk) if chunk > 0 else torch.ones_like(q * k, dtype=torch.bool)
    mask = (seen[None] & valid[:, None, :])[:, None]
    for t, dt in cosine_euler_steps(cfm.n_timesteps, mu.device, x.dtype):
        x = cfm._step(x, mu, cond, spks, (mask, valid), t, dt)
    return x[0, job.prompt_mel.shape[0]: int(lengths[0])].T.float()


def _token2wav(model, tokens, features, offset, state, stream: bool, finalize: bool, speed: float = 1.0,
               full_from: int | None = None):
    dev = model.codec_device
    job = FlowRequest(torch.tensor(tokens, dtype=torch.long, device=dev), features.speech_tokens.to(dev),
                      features.prompt_mel.to(dev), features.speaker.to(dev), streaming=stream, finalize=finalize)
    mel = (model.flow.inference([job])[0] if full_from is None else bounded_final_mel(model.flow, job, full_from))
    mel = mel[:, 2 * offset :]
    state["mel"] = mel if state["mel"] is None else torch.cat([state["mel"], mel], dim=1)
    history = state["mel"].unsqueeze(0)
    if speed != 1.0:  # official: only with offset 0 and finalize
        history = torch.nn.functional.interpolate(history, size=int(history.shape[2] / speed), mode="linear")
    speech = model.hift.inference(history, finalize=finalize)[0]
    new = speech[state["released"] :]
    state["released"] += new.shape[0]
    return new.float().cpu()


def official_stream(model, tokens: list[int], features, final_hop: str = "whole") -> list[tuple[int, int, torch.Tensor]]:
    """[(start token, end token, audio)] per chunk, the last one final; final_hop "continued": the final
    hop's flow as `cosyvoice3.flow.final_hop: continued` defines it (`bounded_final_mel`), where the stream
    had earlier hops."""
    pad = -(-features.speech_tokens.shape[0] // 25) * 25 - features.speech_tokens.shape[0]
    offset, hop, state, out = 0, 25, {"mel": None, "released": 0}, []
    for available in range(len(tokens) + 1):
        this_hop = hop + pad if offset == 0 else hop
        if available - offset >= this_hop + 3:
            audio = _token2wav(model, tokens[: offset + this_hop + 3], features, offset, state, True, False)
            out.append((offset, offset + this_hop, audio))
            offset += this_hop
            hop = min(100, 2 * hop)
    if tokens:
        full_from = 2 * (features.speech_tokens.shape[0] + offset) if final_hop == "continued" and offset else None
        out.append((offset, len(tokens), _token2wav(model, tokens, features, offset, state, False, True,
                                                    full_from=full_from)))
    else:
        out.append((0, 0, torch.zeros(0)))
    return out


def official_full(model, tokens: list[int], features, speed: float = 1.0) -> torch.Tensor:
    """Non-stream mode: one token2wav call with full attention and finalize (and the tempo change)."""
    if not tokens:
        return torch.zeros(0)
    return _token2wav(model, tokens, features, 0, {"mel": None, "released": 0}, False, True, speed)
