"""The codec stage: decode many requests' windows together, then trim each to its new frames.

Windows are sorted by length and grouped so that a group holds at most `max_batch` windows
and `max_batch * longest <= max_padded_frames` (at least one window per group). Shorter
windows are right-padded with code 0: the codec is causal, so padding after a window cannot
change its samples, and each row is decoded at its own absolute frame positions. Each call's
shape is padded further, frames to a bucket and rows to a power of two (padding rows are
zeros and dropped), so the codec meets few distinct shapes: its kernels choose their plans
once per shape, and a new shape costs more than the decode.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from intone.models.base import TTSModel
from intone.ops.batching import FRAME_BUCKETS, bucket_frames, bucket_rows, group_jobs


@dataclass
class CodecJob:
    codes: Tensor  # [K, context + new] window codes
    context: int  # leading frames that are context only
    first_frame: int  # absolute index of codes[:, 0]

    @property
    def length(self) -> int:
        return self.codes.shape[1]


class CodecStage:
    """The default stage: each chunk is a window of codes decoded by `model.decode`.

    A model with its own codec pipeline (e.g. CosyVoice3's flow + vocoder) returns another
    stage from `TTSModel.make_codec_stage` with the same `run`, `calls` and `gpu_seconds`.
    """

    gpu_seconds = 0.0  # this stage does not time its calls on the GPU

    def __init__(self, model: TTSModel, max_batch: int, max_padded_frames: int, carry_state: bool = False):
        """carry_state: decode each chunk's new frames against its request's state (the model's
        stream decoder, which it must have), not a window with re-decoded context."""
        self.model = model
        self.max_batch = max_batch
        self.max_padded_frames = max_padded_frames
        self.stream = model.stream_decoder() if carry_state else None
        self.calls = 0  # decode calls made, for tests and metrics
        self._counting = threading.Lock()  # the counters are read by the engine loop's thread

    def warm_up(self, max_window_frames: int) -> int:
        """Decode silence once per (rows, frames) bucket up to these bounds (start-up); returns the count."""
        k, shapes = self.model.num_codebooks, 0
        frames = [b for b in FRAME_BUCKETS if b < max_window_frames] + [bucket_frames(max_window_frames)]
        for t in frames:
            rows = 1
            # a group of n windows is padded to bucket_rows(n) rows: warm every bucket a group can reach
            while rows <= bucket_rows(self.max_batch) and (rows // 2 + 1) * t <= max(self.max_padded_frames, t):
                codes = torch.zeros(rows, k, t, dtype=torch.long)
                if self.stream is not None:  # streamed chunks; whole utterances take the plain decode
                    self.stream.decode(codes.to(self.model.device), [t] * rows, [None] * rows)
                self.model.decode(codes, torch.zeros(rows, dtype=torch.long))
                shapes += 1
                rows *= 2
        return shapes

    def run(self, items: list, pause=None) -> list[np.ndarray]:
        """items: (EngineRequest, Chunk) pairs -> the audio each chunk releases. pause: called between
        the call's decodes; it may run whole calls of its own, on other requests."""
        if self.stream is None:
            return self._run_windows(items, pause)
        # A chunk that is its request's whole utterance (a full response) is the one-pass decode
        # either way, and the plain decode is cheaper (H200, Fish C64 full responses: 64.8 audio-s/s
        # plain in session 7, 59.8 carried in session 8).
        whole = [c.start == 0 and c.finished and req.codec_state is None for req, c in items]
        out: list[np.ndarray] = [None] * len(items)
        for wanted, run in ((True, self._run_windows), (False, self._run_carried)):
            idx = [i for i, w in enumerate(whole) if w is wanted]
            for i, samples in zip(idx, run([items[i] for i in idx], pause) if idx else []):
                out[i] = samples
        return out

    def _run_windows(self, items: list, pause=None) -> list[np.ndarray]:
        jobs = []
        for req, chunk in items:
            lo, hi = chunk.window
            jobs.append(CodecJob(req.codes[:, lo:hi], chunk.context, lo))
        return self.decode(jobs, pause)

    def decode(self, jobs: list[CodecJob], pause=None) -> list[np.ndarray]:
        """Audio of each job's new frames (float32), in the order of `jobs`; pause: called after each decode."""
        spf = self.model.samples_per_frame
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(jobs)
        live = [i for i, j in enumerate(jobs) if j.length > j.context]
        lengths = [jobs[i].length for i in live]
        for group in group_jobs(lengths, self.max_batch, self.max_padded_frames):
            idx = [live[g] for g in group]
            longest = bucket_frames(max(jobs[i].length for i in idx))
            codes = torch.zeros(bucket_rows(len(idx)), jobs[idx[0]].codes.shape[0], longest, dtype=torch.long)
            offsets = torch.zeros(codes.shape[0], dtype=torch.long)
            for row, i in enumerate(idx):
                codes[row, :, : jobs[i].length] = jobs[i].codes
                offsets[row] = jobs[i].first_frame
            dev = self.model.device
            audio = self.model.decode(codes.to(dev), offsets.to(dev)).cpu().numpy()
            with self._counting:
                self.calls += 1
            for row, i in enumerate(idx):
                job = jobs[i]
                out[i] = np.ascontiguousarray(audio[row, job.context * spf : job.length * spf], dtype=np.float32)
            if pause is not None:
                pause()
        return out

    def _run_carried(self, items: list, pause=None) -> list[np.ndarray]:
        """Each chunk's new frames against its request's state. A request's chunks in one call go in
        successive rounds (each needs the state the one before leaves); the states are committed to
        the requests only when the whole call succeeded, so a failed call can be retried chunk by chunk."""
        spf = self.model.samples_per_frame
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(items)
        states = {id(req): req.codec_state for req, _ in items}
        pending = [i for i, (_, c) in enumerate(items) if c.end > c.start]
        while pending:
            round_, later, seen = [], [], set()
            for i in pending:
                req = items[i][0]
                (later if id(req) in seen else round_).append(i)
                seen.add(id(req))
            lengths = [items[i][1].end - items[i][1].start for i in round_]
            for group in group_jobs(lengths, self.max_batch, self.max_padded_frames):
                idx = [round_[g] for g in group]
                self._decode_carried([items[i] for i in idx], states, idx, out, spf)
                if pause is not None:
                    pause()
            pending = later
        for req, _ in items:
            req.codec_state = states[id(req)]
        return out

    def _decode_carried(self, items: list, states: dict, idx: list[int], out: list, spf: int) -> None:
        lengths = [c.end - c.start for _, c in items]
        for req, c in items:
            state = states[id(req)]
            at = state.frames if state is not None else 0
            if at != c.start:
                raise RuntimeError(f"{c.request_id}: chunk from frame {c.start}, but the codec state is at {at}")
        rows = bucket_rows(len(items))
        codes = torch.zeros(rows, items[0][0].codes.shape[0], bucket_frames(max(lengths)), dtype=torch.long)
        for row, (req, c) in enumerate(items):
            codes[row, :, : c.end - c.start] = req.codes[:, c.start : c.end]
        pad = rows - len(items)
        audio, new = self.stream.decode(codes.to(self.model.device), lengths + [0] * pad,
                                        [states[id(req)] for req, _ in items] + [None] * pad)
        with self._counting:
            self.calls += 1
        audio = audio.float().cpu().numpy()
        for row, ((req, _), n, i) in enumerate(zip(items, lengths, idx)):
            out[i] = np.ascontiguousarray(audio[row, : n * spf], dtype=np.float32)
            states[id(req)] = new[row]
