"""CosyVoice3's codec stage: speech tokens -> mel (flow) -> audio (HiFT), batched across requests.

Per chunk it does what the official streaming loop (`CosyVoice2Model.tts` with
`CosyVoice3Model.token2wav`) does for one request, with the state kept on the request:
  - flow over the reference tokens plus *all* tokens up to the chunk's end (+3 lookahead
    tokens, read as context) with the chunk-causal mask; the final chunk runs with full
    attention and no lookahead, as officially;
  - the chunk's new mel frames (2 per token) are appended to the request's mel history;
  - HiFT over the whole history (finalize only on the last chunk); the samples beyond those
    already released are the chunk's audio.
So the audio a request receives is the official streaming output for the same tokens and
the same hop schedule (the planner's); the test suite checks this against a plain
re-run of that loop, request by request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from intone.models.cosyvoice3.flow import FlowRequest
from intone.ops.batching import group_jobs


@dataclass
class StreamState:
    mel: Tensor  # [80, n] mel frames handed to HiFT so far
    released: int = 0  # audio samples sent so far


def stretch(mel: Tensor, speed: float) -> Tensor:
    """Official tempo change: linear interpolation of the mel [80, T] to int(T / speed) frames."""
    return F.interpolate(mel.unsqueeze(0), size=int(mel.shape[1] / speed), mode="linear")[0]


class CosyCodecStage:
    def __init__(self, model, max_batch: int, max_padded_frames: int, autocast: str = "none"):
        self.model = model
        self.max_batch = max_batch
        self.max_padded_frames = max_padded_frames
        # Half-precision autocast is for GPUs; on a CPU it is slower and only loses precision.
        gpu = model.codec_device.type == "cuda"
        self.autocast = getattr(torch, autocast) if autocast != "none" and gpu else None
        self.calls = 0  # batched flow calls (each followed by HiFT work), for tests and metrics

    def compile_flow(self) -> None:
        """torch.compile the DiT (dynamic shapes) and compile it now, on a small dummy batch, so
        no request pays for it. Fuses the elementwise work around the GEMMs: 2.3x at 64 rows."""
        estimator = self.model.flow.decoder.estimator
        estimator.forward = torch.compile(estimator.forward, dynamic=True)
        dev = self.model.codec_device
        dummy = [FlowRequest(torch.zeros(40 + 10 * i, dtype=torch.long, device=dev),
                             torch.zeros(30, dtype=torch.long, device=dev), torch.zeros(60, 80, device=dev),
                             torch.ones(192, device=dev), streaming=bool(i), finalize=not i) for i in range(2)]
        with torch.autocast(dev.type, self.autocast or torch.float32, enabled=self.autocast is not None):
            self.model.flow.inference(dummy)

    def run(self, items: list) -> list[np.ndarray]:
        """items: (EngineRequest, Chunk) pairs -> the audio each chunk releases."""
        new_mel = self._flow(items)
        # Histories are built aside and committed only once the batch succeeded, so a failed batch
        # can be retried chunk by chunk. A request may have two chunks here (regular + terminal).
        latest: dict[int, Tensor] = {}
        histories = []
        for (req, chunk), mel in zip(items, new_mel):
            state = req.codec_state
            before = latest.get(id(req), state.mel if state is not None else mel.new_zeros(mel.shape[0], 0))
            latest[id(req)] = torch.cat([before, mel], dim=1)
            histories.append(latest[id(req)])
            if req.speed != 1.0:  # one whole-utterance chunk (checked at admission): stretch as officially
                histories[-1] = stretch(histories[-1], req.speed)
        audio = self._hift(histories, [c.finished for _, c in items])
        out = []
        for (req, _), history, wav in zip(items, histories, audio):
            state = req.codec_state = req.codec_state or StreamState(history)
            out.append(np.ascontiguousarray(wav[state.released :].float().cpu().numpy(), dtype=np.float32))
            state.mel, state.released = history, max(state.released, wav.shape[0])
        return out

    def _flow(self, items: list) -> list[Tensor]:
        """The new mel frames [80, 2 * (end - start)] of each chunk."""
        model = self.model
        jobs = [model.flow_request(req.prompt, req.codes[0], chunk.end, chunk.finished) for req, chunk in items]
        empty = model.mel_zeros()
        out: list[Tensor] = [empty] * len(items)
        live = [i for i, job in enumerate(jobs) if job is not None]
        lengths = [jobs[i].prompt_tokens.shape[0] + jobs[i].tokens.shape[0] for i in live]
        for group in group_jobs(lengths, self.max_batch, self.max_padded_frames):
            idx = [live[g] for g in group]
            with torch.autocast(model.codec_device.type, self.autocast, enabled=self.autocast is not None):
                mels = model.flow.inference([jobs[i] for i in idx])
            self.calls += 1
            for i, mel in zip(idx, mels):
                out[i] = mel[:, model.flow.config.token_mel_ratio * items[i][1].start :]
        return out

    def _hift(self, mels: list[Tensor], finalize: list[bool]) -> list[Tensor]:
        out: list[Tensor] = [mels[0].new_zeros(0)] * len(mels)
        live = [i for i, m in enumerate(mels) if m.shape[1] > 0]
        lengths = [mels[i].shape[1] // self.model.flow.config.token_mel_ratio for i in live]
        for group in group_jobs(lengths, self.max_batch, self.max_padded_frames):
            idx = [live[g] for g in group]
            audio = self.model.hift.vocode_batch([mels[i] for i in idx], [finalize[i] for i in idx])
            for i, wav in zip(idx, audio):
                out[i] = wav
        return out
