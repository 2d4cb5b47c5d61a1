"""A model as a profile asks for it (device, precisions, streams), for each process that needs one."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch

from intone.engine.chunk_planner import ChunkPolicy
from intone.engine.codec_stage import CodecStage
from intone.engine.config import Profile
from intone.engine.cuda_graphs import FunctionGraphs
from intone.engine.streams import own_stream
from intone.models import cache_dir, family_of, resolve_model_dir
from intone.models.registry import load_model

log = logging.getLogger(__name__)

_loop_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}  # held while the process lives


def _loop_stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    """The engine loop's stream on this device (one per process and priority: a later load reuses it)."""
    key = (device, priority)
    if key not in _loop_streams:
        _loop_streams[key] = own_stream(device, "engine loop", priority)
    return _loop_streams[key]


def load_for_profile(model_spec: str, profile: Profile):
    """The model on the profile's device, with the profile's AR and codec precisions, this
    process's CUDA state set up (TF32, a stream of its own for the calling thread)."""
    set_cuda_connections(profile.cuda_connections)
    device = profile.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = None if profile.ar.dtype == "auto" else getattr(torch, profile.ar.dtype)
    codec_dtype = torch.float32 if profile.codec.dtype == "auto" else getattr(torch, profile.codec.dtype)
    if device == "cpu" and {dtype, codec_dtype} & {torch.float16, torch.bfloat16}:
        dtype, codec_dtype = torch.float32, torch.float32  # half precision is for GPUs: slow on CPUs
    # torch.compile's caches (the DiT's and the AR's fused pieces) outlive /tmp: a restart compiles
    # only what changed (`ops.compiling`; on a CPU the real-size DiT compiles in 101 s cold, 17 s warm).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    if profile.host_switch_interval_ms is not None:
        # The loop, the frontend and the codec are Python threads; one that holds the GIL through
        # a stretch of pure Python (the step's metadata, the planner) keeps the others waiting up
        # to one switch interval each time they come back from a torch call.
        sys.setswitchinterval(profile.host_switch_interval_ms / 1000)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = profile.tf32
        if profile.host_threads is not None:
            # The host side of a GPU engine is small tensors and Python; idle OpenMP workers spin on
            # cores that the loop, the frontend and the codec threads (and the API) need.
            torch.set_num_threads(profile.host_threads)
        # A stream of its own, so the other threads' streams can overlap it (the legacy default
        # stream would serialise them); CUDA clamps -100 to its highest priority.
        torch.cuda.set_stream(_loop_stream(torch.device(device), -100 if profile.ar.high_priority else 0))
    if not model_spec.startswith(("tiny:", "random:")):
        resolve_model_dir(model_spec)  # a path that is not there is named as such, before anything else
    profile.options_for(family_of(model_spec))  # another family's section is refused before the load
    model = load_model(model_spec, device=device, dtype=dtype, codec_dtype=codec_dtype)
    if profile.ar.autocast != "none" and device.startswith("cuda"):  # as half precision above: GPUs only
        model.use_ar_autocast(getattr(torch, profile.ar.autocast))
    return model


def set_cuda_connections(connections: int | None) -> None:
    """`cuda_connections`: read by CUDA when this process's context is made, so before its first CUDA call
    (an engine process's is this load); a process whose context exists already keeps its queues."""
    if connections is None:
        return
    if torch.cuda.is_initialized():
        log.warning("cuda_connections %d: this process's CUDA context exists already; it keeps its queues",
                    connections)
        return
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(connections)


def set_cudnn(profile: Profile) -> None:
    """cuDNN's process-wide switches as the codec section asks (GPU; before the warm-ups, whose
    shapes then keep the plans they chose)."""
    torch.backends.cudnn.benchmark = profile.codec.cudnn_benchmark
    torch.backends.cudnn.deterministic = profile.codec.deterministic


def codec_stage_for(model, profile: Profile) -> CodecStage:
    """The codec stage over the model's vocoder (given the profile's codec section and the family's own)."""
    return CodecStage(model.make_vocoder(profile.codec, profile.options_for(model.name)))


def chunk_policy(profile: Profile, model) -> ChunkPolicy:
    """The engine's chunk policy: the profile's, with the frames a codec reads beyond a chunk (CosyVoice3's
    flow) as its lookahead, whatever the profile says."""
    policy = profile.chunking.policy(profile.ar.max_num_seqs, model.samples_per_frame / model.sample_rate)
    return dataclasses.replace(policy, lookahead_frames=max(policy.lookahead_frames, model.codec_lookahead_frames))


def warm_up_codec(stage, profile: Profile, model) -> None:
    """Decode every bucketed window shape the profile's chunks can reach, and capture the codec's
    graphs where the profile asks for them (start-up, GPU: nothing else may use it meanwhile)."""
    vocoder, c = stage.vocoder, profile.chunking
    chunk = max(c.steady_chunk_frames, c.backlog_chunk_frames, c.whole_chunk_frames, c.max_chunk_frames) \
        + c.left_context_frames
    window = min(max(chunk, profile.codec.warm_up_frames), model.max_seq_len)
    vocoder.warm_up(window, chunk_policy(profile, model).longest_chunk())
    if vocoder.captures_graphs:
        graphs = FunctionGraphs(profile.codec.stream_priority)  # replayed on the worker's stream, captured alike
        vocoder.capture_graphs(graphs)
        r = graphs.report
        log.info("captured %d codec graphs in %.1f s (%d failed and run eagerly)", r.graphs, r.seconds, r.failed)
