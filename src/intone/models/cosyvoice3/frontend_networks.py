"""The two networks of CosyVoice3's reference frontend as callables: `speech_tokenizer_v3.onnx` and
`campplus.onnx`, each through its torch port (batched, on any device, optionally replayed from CUDA
graphs) or an onnxruntime CPU session, with inputs padded to 1 s shape buckets.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from intone.errors import ModelLoadError
from intone.models.cosyvoice3.campplus_net import campplus_from_onnx
from intone.models.cosyvoice3.features import fbank_frames, kaldi_fbank, whisper_log_mel
from intone.models.cosyvoice3.onnx_weights import NotThisArchitecture, OnnxGraph
from intone.models.cosyvoice3.speech_tokenizer_net import speech_tokenizer_from_onnx
from intone.ops.batching import bucket_rows, pad_rows
from intone.ops.host_copy import to_host

log = logging.getLogger(__name__)

TOKENIZER_RATE = 16000
BACKENDS = ("auto", "torch", "onnxruntime")
MAX_BATCH_CLIPS = 64
MAX_BATCH_FRAMES = 64 * 1000  # padded feature frames (100 per second) in one network call
# Network inputs are zero-padded (with their true lengths, so results are unchanged to float
# rounding) to a multiple of this many feature frames (1 s): on a GPU every new input shape makes
# the convolutions build new plans (hundreds of ms for CAM++), and unique clip lengths would make
# every request pay that; with buckets the shapes repeat, and start-up warms them.
FRAME_BUCKET = 100
PROBE_SECONDS = 3.0
PROBE_TOKEN_AGREEMENT = 0.9  # FSQ rounding may flip a few codes between runtimes, not more
PROBE_VECTOR_RTOL = 1e-3


def _probe_audio() -> Tensor:
    """A fixed 16 kHz clip (noise and two tones) on which a port is checked against onnxruntime."""
    n = int(PROBE_SECONDS * TOKENIZER_RATE)
    g = torch.Generator().manual_seed(1234)
    t = torch.arange(n, dtype=torch.float64) / TOKENIZER_RATE
    tones = 0.3 * torch.sin(2 * math.pi * 180.0 * t) + 0.2 * torch.sin(2 * math.pi * 1130.0 * t * (1 + t / 6))
    return (tones + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)).to(torch.float32)


def _groups(lengths: list[int]) -> list[list[int]]:
    """Indices in batches of similar length, each within MAX_BATCH_CLIPS and MAX_BATCH_FRAMES (padded)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g is None or len(g) >= MAX_BATCH_CLIPS or (len(g) + 1) * lengths[g[0]] > MAX_BATCH_FRAMES:
            groups.append([i])
        else:
            g.append(i)
    return groups


def _fixed_rows(rows: int, padded_frames: int) -> int:
    """Rows of every call over this padded length: `rows`, fewer where they would pass MAX_BATCH_FRAMES."""
    return max(1, min(rows, MAX_BATCH_FRAMES // max(padded_frames, 1)))


def _fixed_groups(lengths: list[int], rows: int, bucket: int) -> list[list[int]]:
    """Indices grouped by length bucket, at most `_fixed_rows` a group, in order of each group's first index."""
    by_bucket: dict[int, list[list[int]]] = {}
    for i, n in enumerate(lengths):
        padded = -(-n // bucket) * bucket
        groups = by_bucket.setdefault(padded, [[]])
        if len(groups[-1]) == _fixed_rows(rows, padded):
            groups.append([])
        groups[-1].append(i)
    return sorted((g for groups in by_bucket.values() for g in groups), key=lambda g: g[0])


def _padded(items: list[Tensor], dim: int, bucket: int = FRAME_BUCKET) -> tuple[Tensor, Tensor]:
    """Stack along a new first axis, zero-padding axis `dim` to a multiple of `bucket`; (batch, lengths)."""
    lengths = [int(x.shape[dim]) for x in items]
    longest = -(-max(lengths) // bucket) * bucket
    pads = []
    for x, n in zip(items, lengths):
        pad = [0, 0] * x.dim()
        pad[2 * (x.dim() - 1 - dim % x.dim()) + 1] = longest - n
        pads.append(torch.nn.functional.pad(x.to(torch.float32), pad))
    return torch.stack(pads), torch.tensor(lengths, device=items[0].device)


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class _FrontendModel:
    """One of the two frontend files: a torch port of its network, or an onnxruntime CPU session.

    The file's existence is checked at construction; the backend is chosen by `load()` (or the
    first call). backend: "auto" (the port when the file's graph is its network, else
    onnxruntime), "torch" (the port or ModelLoadError) or "onnxruntime". With verify, "auto"
    also runs the port and onnxruntime on a probe clip at load and keeps onnxruntime if they
    disagree. Results are CPU tensors; inputs may be on any device.
    """

    what = "ONNX model"
    # A network whose results must not depend on a clip's company runs every call at one shape per
    # length bucket: `fixed_rows` rows (padded with copies of the first) and frames padded to a
    # multiple of `frame_bucket`. At a fixed shape each row's arithmetic is the same whatever the
    # other rows hold, so several clips share a call and each gets what it gets alone.
    fixed_rows: int | None = None
    frame_bucket: int = FRAME_BUCKET

    def set_batching(self, rows: int, bucket_seconds: int) -> None:
        """Clips per call (always this many rows) and the length bucket in seconds. More rows let
        same-bucket clips share a call; one-row calls compute no other clip's padding."""
        self.fixed_rows, self.frame_bucket = rows, bucket_seconds * FRAME_BUCKET

    def __init__(self, onnx_path: str | Path, num_threads: int = 1, *, backend: str = "auto", verify: bool = True):
        self.path = Path(onnx_path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file (the CosyVoice3 {self.what})")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.num_threads = int(num_threads)
        self.requested, self.verify = backend, verify
        self.net: nn.Module | None = None
        self.backend: str | None = None  # "torch" or "onnxruntime", once loaded
        self._session = None
        self._device = torch.device("cpu")
        self._lock = threading.Lock()
        self.graphs, self._capturing = None, False

    @classmethod
    def from_net(cls, net: nn.Module):
        """A model around a torch network that did not come from a file (random weights)."""
        self = cls.__new__(cls)
        self.path, self.num_threads, self.requested, self.verify = None, 1, "torch", False
        self.net, self.backend, self._session = net.eval(), "torch", None
        self._device = next(net.parameters()).device
        self._lock = threading.Lock()
        self.graphs, self._capturing = None, False
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    def to(self, device) -> _FrontendModel:
        """Run on `device` (the torch backend; onnxruntime stays on the CPU). Returns self."""
        self.load()
        with self._lock:
            if self.net is not None:
                self.net.to(device)
            self._device = torch.device(device)
        return self

    def load(self) -> _FrontendModel:
        """Choose the backend and read the file now (it is otherwise done by the first call). Returns self."""
        if self.backend is None:
            with self._lock:
                if self.backend is None:
                    self._choose()
        return self

    def _choose(self) -> None:
        net = self._port() if self.requested != "onnxruntime" else None
        if net is not None:
            self.net = net.to(self._device).eval()
        else:
            self._session = self._open()
        self.backend = "torch" if net is not None else "onnxruntime"
        log.info("%s: the CosyVoice3 %s runs on %s", self.path, self.what,
                 "the torch port" if net is not None else "onnxruntime (CPU, one clip at a time)")

    def _port(self) -> nn.Module | None:
        try:
            net = self._from_onnx(OnnxGraph(self.path))
        except NotThisArchitecture as e:
            if self.requested == "torch":
                raise ModelLoadError(f"{self.path}: the torch port cannot read this {self.what}: {e}") from None
            log.info("%s: the graph is not the network of the torch port (%s)", self.path, e)
            return None
        if self.verify and self.requested == "auto":
            with torch.no_grad():
                problem = self._disagreement(net, self._open())
            if problem:
                log.warning("%s: the torch port disagrees with onnxruntime on a probe clip (%s)", self.path, problem)
                return None
        return net

    def _open(self):
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise ModelLoadError(f"{self.path}: reading the CosyVoice3 {self.what} needs onnxruntime ({e})") from None
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = self.num_threads  # the official frontend runs both models on 1 thread
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        try:
            return ort.InferenceSession(str(self.path), sess_options=options, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - onnxruntime's errors (InvalidProtobuf, Fail, ...) subclass Exception
            raise ModelLoadError(f"{self.path}: not a loadable {self.what} ({type(e).__name__}: {e})") from None

    def _run(self, session, *arrays: np.ndarray) -> np.ndarray:
        """Feed `arrays` to the model's inputs in order (by the names the file declares); first output."""
        names = [i.name for i in session.get_inputs()]
        if len(names) != len(arrays):
            raise ModelLoadError(f"{self.path}: the {self.what} takes {len(names)} inputs, expected {len(arrays)}")
        return np.asarray(session.run(None, dict(zip(names, arrays)))[0])

    def use_graphs(self, graphs) -> None:
        """Replay the network from `graphs` (an engine's FunctionGraphs) for the shapes captured in it."""
        self.graphs = graphs

    def _batched(self, feats: list[Tensor], dim: int, split, run_session) -> list[Tensor]:
        """Per item, the network on padded batches (torch; `split(outputs, rows)` cuts them per
        item) or run_session one at a time (onnxruntime). With graphs, rows are padded to a
        power of two (copies of row 0) so that every batch has a captured shape."""
        self.load()
        if self.net is None:
            return [run_session(f) for f in feats]
        out: list[Tensor | None] = [None] * len(feats)
        for group in self.call_groups([int(f.shape[dim]) for f in feats]):
            x, lengths = _padded([feats[i].to(self._device) for i in group], dim, self.frame_bucket)
            if self.fixed_rows:  # the bucket's one shape
                rows = _fixed_rows(self.fixed_rows, x.shape[dim + 1 if dim >= 0 else dim])
                x, lengths = pad_rows(x, rows), pad_rows(lengths, rows)
            elif self.graphs is not None:  # a power of two: a captured shape
                rows = bucket_rows(len(group))
                x, lengths = pad_rows(x, rows), pad_rows(lengths, rows)
            with torch.no_grad():
                if self._capturing:
                    self.graphs.capture(self.what, self._forward, x, lengths)
                outputs = self.graphs.run(self.what, self._forward, x, lengths) if self.graphs is not None \
                    else list(_as_tuple(self._forward(x, lengths)))
            for row, i in zip(split(outputs, len(group)), group):
                out[i] = row
        return out

    def call_groups(self, lengths: list[int]) -> list[list[int]]:
        """How items of these lengths (in input frames) are grouped into network calls."""
        if self.fixed_rows:
            return _fixed_groups(lengths, self.fixed_rows, self.frame_bucket)
        return _groups(lengths)

    def _forward(self, x: Tensor, lengths: Tensor):
        raise NotImplementedError

    def _from_onnx(self, graph: OnnxGraph) -> nn.Module:
        raise NotImplementedError

    def _disagreement(self, net: nn.Module, session) -> str | None:
        raise NotImplementedError


class SpeechTokenizer(_FrontendModel):
    """`speech_tokenizer_v3.onnx`: 16 kHz audio [N] -> int64 speech tokens [ceil((N // 160) / 4)], ids < 6561.

    The file's inputs are the whisper log-mel [B, 128, T] float32 and its length [B] int32, in
    that order; its first output is the tokens (as the official `_extract_speech_token`).
    """

    what = "speech tokenizer"

    def __call__(self, audio16k: Tensor) -> Tensor:
        return self.tokenize_batch([audio16k])[0]

    def tokenize_batch(self, clips: list[Tensor]) -> list[Tensor]:
        """16 kHz mono clips -> per clip its int64 tokens (CPU), each equal to the clip alone."""
        self.load()
        return self.tokenize_features_batch([whisper_log_mel(c.to(self._device)) for c in clips])

    def tokenize_features(self, feats: Tensor) -> Tensor:
        """[128, T] whisper log-mel -> int64 [T_tok]."""
        return self.tokenize_features_batch([feats])[0]

    def tokenize_features_batch(self, feats: list[Tensor]) -> list[Tensor]:
        def split(outputs: list[Tensor], rows: int) -> list[Tensor]:
            tokens, counts = to_host(outputs[0][:rows], outputs[1][:rows])
            counts = counts.tolist()
            return [tokens[r, :n].clone() for r, n in enumerate(counts)]

        return self._batched(feats, -1, split, self._session_tokens)

    def _forward(self, x: Tensor, lengths: Tensor):
        return self.net.tokenize(x, lengths)

    def _session_tokens(self, feats: Tensor, session=None) -> Tensor:
        mel = feats.detach().to("cpu", torch.float32).numpy()[None]
        length = np.array([mel.shape[2]], dtype=np.int32)
        tokens = self._run(session or self._session, np.ascontiguousarray(mel), length)
        return torch.from_numpy(tokens.reshape(-1).astype(np.int64))

    def _from_onnx(self, graph: OnnxGraph) -> nn.Module:
        return speech_tokenizer_from_onnx(graph)

    def _disagreement(self, net: nn.Module, session) -> str | None:
        feats = whisper_log_mel(_probe_audio())
        ours = net.tokenize(feats[None], torch.tensor([feats.shape[1]]))[0][0]
        theirs = self._session_tokens(feats, session)
        if ours.shape != theirs.shape:
            return f"{ours.numel()} tokens against {theirs.numel()}"
        agree = float((ours == theirs).double().mean())
        return None if agree >= PROBE_TOKEN_AGREEMENT else f"{agree:.1%} of the tokens agree"


class SpeakerEncoder(_FrontendModel):
    """`campplus.onnx`: 16 kHz audio -> 192-d speaker vector (float32), from the mean-normalised fbank."""

    what = "speaker encoder (CAM++)"
    fixed_rows = 1  # the x-vector conditions every flow frame: a clip's must not depend on its company

    def embed_groups(self, clips16k: list[Tensor]) -> list[list[int]]:
        """The indices of 16 kHz clips that `embed_batch` would embed in one call each."""
        return self.call_groups([fbank_frames(int(c.shape[-1])) for c in clips16k])

    def __call__(self, audio16k: Tensor) -> Tensor:
        return self.embed_batch([audio16k])[0]

    def embed_batch(self, clips: list[Tensor]) -> list[Tensor]:
        """16 kHz mono clips -> per clip its float32 [192] vector (CPU), each equal to the clip alone."""
        self.load()
        feats = [kaldi_fbank(c.to(self._device)) for c in clips]
        return self.embed_features_batch([f - f.mean(dim=0, keepdim=True) for f in feats])

    def embed_features(self, feats: Tensor) -> Tensor:
        """[T, 80] fbank, already mean-normalised -> float32 [192]."""
        return self.embed_features_batch([feats])[0]

    def embed_features_batch(self, feats: list[Tensor]) -> list[Tensor]:
        def split(outputs: list[Tensor], rows: int) -> list[Tensor]:
            return list(to_host(outputs[0][:rows].float())[0].unbind(0))

        return self._batched(feats, 0, split, self._session_vector)

    def _forward(self, x: Tensor, lengths: Tensor):
        return self.net(x, lengths)

    def _session_vector(self, feats: Tensor, session=None) -> Tensor:
        x = np.ascontiguousarray(feats.detach().to("cpu", torch.float32).numpy()[None])
        return torch.from_numpy(self._run(session or self._session, x).reshape(-1).astype(np.float32))

    def _from_onnx(self, graph: OnnxGraph) -> nn.Module:
        return campplus_from_onnx(graph)

    def _disagreement(self, net: nn.Module, session) -> str | None:
        feats = kaldi_fbank(_probe_audio())
        feats = feats - feats.mean(dim=0, keepdim=True)
        ours, theirs = net(feats[None])[0], self._session_vector(feats, session)
        if ours.shape != theirs.shape:
            return f"vectors of {ours.numel()} and {theirs.numel()} values"
        diff = float((ours - theirs).abs().max())
        return None if diff <= PROBE_VECTOR_RTOL * max(1.0, float(theirs.abs().max())) else f"max |diff| {diff:.3g}"
