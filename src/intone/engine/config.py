"""Deploy profiles: every engine knob in one validated YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from intone.engine.chunk_planner import ChunkPolicy
from intone.errors import IntoneError
from intone.models.cosyvoice3.options import CosyVoice3Options
from intone.models.fish_s2.options import FishS2Options
from intone.protocol import SamplingParams
from intone.sampling_bounds import MAX_SAMPLE_CANDIDATES, SAMPLING_BOUNDS

PROFILE_DIR = Path(__file__).resolve().parents[3] / "profiles"
# Keys that left the shared sections for their family's own (a profile that still has one is told where).
MOVED_KEYS = {
    "codec.autocast": "cosyvoice3.flow.autocast", "codec.flow_dtype": "cosyvoice3.flow.dtype",
    "codec.compile": "cosyvoice3.flow.compile", "codec.compile_unit": "cosyvoice3.flow.compile_unit",
    "codec.flow_attention": "cosyvoice3.flow.attention", "codec.cuda_graphs": "cosyvoice3.flow.cuda_graphs",
    "codec.graph_frames": "cosyvoice3.flow.graph_frames", "codec.call_cost": "cosyvoice3.flow.call_cost",
    "codec.flow_cache": "cosyvoice3.flow.cache", "frontend.speaker_rows": "cosyvoice3.speaker_rows",
    "frontend.speaker_bucket_s": "cosyvoice3.speaker_bucket_s",
}
FAMILY_SECTIONS = {"cosyvoice3": "cosyvoice3", "fish-s2": "fish_s2"}  # model family -> its section of a profile


class ProfileError(IntoneError):
    """A profile file is missing, not YAML, or has an invalid value (named with its path)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ARConfig(_Strict):
    max_num_seqs: int = Field(64, ge=1, description="running requests in the AR stage")
    max_waiting: int = Field(1024, ge=0, description="requests that may wait beyond the seats free now; more are "
                                                     "refused (queue_full, 503)")
    max_num_batched_tokens: int = Field(16384, ge=1, description="tokens in one step (prefills + decodes)")
    block_size: int = Field(16, ge=1)
    kv_cache_tokens: int | None = Field(None, ge=1, description="KV capacity in tokens (default: enough for every seat)")
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = "auto"
    autocast: Literal["none", "float16"] = Field(
        "none", description="the AR as its official code runs under autocast to this dtype (GPU only; CosyVoice3's "
                            "fp16=True: the LLM's GEMMs and attention in fp16, its embeddings, residual stream and "
                            "norms in fp32, the KV cache fp16)")
    cuda_graphs: bool = Field(True, description="replay captured graphs where the model has them (GPU only)")
    static_step: Literal["auto"] | bool = Field(
        "auto", description="the AR step's static form (engine/step_graphs.py: the host writes a step's inputs at "
                            "offsets its bucket fixes, one upload, the decode and the head over fixed buffers, one "
                            "download; the graphs replay it): auto on a GPU where the model's head allows it; true: "
                            "also on a CPU (the same code, no graphs; tests); false: every step eager, so no AR "
                            "graphs at all (prefills packed; a diagnostic, not the graphs' path before session 38)")
    prefix_caching: bool = Field(False, description="a request whose prompt starts as an earlier one's (e.g. the same "
                                                    "voice first, as Fish's prompts put it) takes that prefix's KV "
                                                    "blocks instead of computing them again (whole blocks; kept until "
                                                    "the cache lends them out afresh)")
    fuse_elementwise: bool = Field(False, description="the AR's norms, RoPE and SwiGLU gate through torch.compile, "
                                                      "one kernel each, inside the graphs (GPU only; see ops.fused)")
    decode_splits: Literal[1, 2, 4, 8, 16] = Field(
        1, description="key spans per (row, KV head) in the GPU decode attention, merged after (flash-decoding; "
                       "see ops.paged_decode): more programs for the SMs when a step has few rows x KV heads")
    async_steps: bool = Field(False, description="one step in flight: the next step is built and launched from the "
                                                 "tokens still on the device while the host reads the step before "
                                                 "(its host work then overlaps the GPU's); a request that samples "
                                                 "its stop token runs one more row, discarded. The same tokens")
    min_step_ms: float = Field(0.0, ge=0, le=1000, description="the loop launches a step at most this often, asleep "
                               "meanwhile (GIL and CPU free): fewer, fuller steps, leaving the GPU to the codec and the "
                               "frontend when they bound throughput (0: as soon as the step before is launched)")
    sample_candidates: int = Field(MAX_SAMPLE_CANDIDATES, ge=0, le=MAX_SAMPLE_CANDIDATES, description="a step whose requests' top_k are all at most "
                                   "this sorts only this many tokens per draw (models whose head allows it: Fish); "
                                   "the same tokens (ops.sampling); 0: every token, always")
    token_wait: Literal["spin", "sleep"] = Field(
        "spin", description="how the loop waits for a step's tokens on a GPU: spinning in the driver (the soonest "
                            "back), or asleep on a blocking-sync event (its core free for the other threads, ~tens "
                            "of microseconds later back); the same tokens")
    prompt_row_buckets: list[Annotated[int, Field(ge=1, le=2048)]] = Field(
        default_factory=list, max_length=8, description="more token-row buckets for the static step, beside the "
        "powers of two and their halves (e.g. [640, 896]; each up to 2048): a step that carries prompts pads to the "
        "next bucket, and the slow AR's products are compute-bound at those rows (H100: 2 prompts of 290 tokens and "
        "49 decodes, 629 rows: 12.6 ms at 640, 14.8 at 768). Each bucket is one more graph per KV bucket")
    high_priority: bool = Field(False, description="experimental: the engine loop's CUDA stream (the AR steps and their "
                                                   "graphs) at the highest priority, so its kernels' blocks go before "
                                                   "the codec's waiting ones as SMs free up (GPU)")


class CodecStageConfig(_Strict):
    max_batch: int = Field(64, ge=1, description="windows decoded together")
    max_padded_frames: int = Field(256, ge=1, description="batch x longest window, per decode call")
    carry_state: bool = Field(False, description="decode each chunk against the state its request's earlier chunks "
                                                 "left (models with a stream decoder: Fish), so streamed audio equals "
                                                 "the one-pass decode and no left context is re-decoded")
    stream_graph_frames: int = Field(0, ge=0, le=512, description="with carry_state on a GPU: the carried decode "
                                     "replayed from CUDA graphs captured at start-up, for chunks up to this many "
                                     "frames (longer ones run eagerly; 0: all eager)")
    row_granule: int = Field(0, ge=0, le=64, description="the windowed vocoder's calls (Fish) padded to a multiple "
                             "of this many rows above it (0: to a power of two: 33 rows compute 64); more shapes "
                             "to warm at start-up, fewer blank rows computed")
    lean_decode: bool = Field(False, description="with carry_state: the carried decode's Snakes write straight into "
                              "the next convolution's input buffer after its history, and a transposed convolution's "
                              "bias is added by the kernels after it as they read its output in place (no "
                              "concatenations, bias passes or contiguous copies of the decoder's largest tensors; "
                              "the same kernels on the same values: expected bit-equal with codec.deterministic, "
                              "GPU test pending)")
    packed_decode: bool = Field(False, description="with carry_state: the carried decode's layers after its "
                                "transformer run on one row of the call's chunks packed back to back (each after a "
                                "gap its histories fill) instead of right-padded to the longest: no padding frames "
                                "computed (Fish: 42-54% of the decoder's frames in served calls); eager (no "
                                "stream_graph_frames, no lean_decode); off until measured")
    exact_rows: int = Field(0, ge=0, le=64, description="the windowed vocoder's calls (Fish) of at most this many "
                            "chunks run at their own row count, no blank rows (each count a shape of its own, "
                            "warmed at start-up; above it, rows pad as row_granule says); with carry_state, the "
                            "carried decode's calls only")
    frame_buckets: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=list, max_length=32, description="the windowed vocoder's (Fish) padded call lengths in "
        "frames beside the built-in ones (4, 8, 16, 32, 50, 64, ...): a call pads to the smallest that holds its "
        "longest chunk, so the chunk sizes a schedule makes (e.g. 25, and 29 for a first 4 joined with its next "
        "25) pad nothing; each one more shape to warm at start-up")
    split_cost: int | None = Field(None, ge=0, description="the windowed vocoder (Fish) splits a call's chunks into "
                                   "calls of similar lengths where that saves more padded frame-rows than this per "
                                   "extra call (None: one call as full as max_batch and max_padded_frames allow)")
    dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = "auto"
    overlap: bool = Field(True, description="decode on a worker thread (and CUDA stream) of its own, beside "
                                            "the AR steps; false: in the engine loop between its steps, the two "
                                            "taking turns on the GPU (`engine/loop_codec.py`)")
    stream: Literal["own", "loop"] = Field("own", description="the in-process codec worker's CUDA stream: its own, "
                                           "beside the loop's (the GPU runs AR and codec kernels side by side, "
                                           "sharing its SMs), or the engine loop's: the GPU runs them one after "
                                           "the other in launch order, as the in-loop codec does, while the "
                                           "host work of both still overlaps")
    process: bool = Field(False, description="decode in a child process of the engine core, with its own copy of "
                                             "the model and its own interpreter (so no GIL shared with the AR "
                                             "loop); overrides overlap")
    device: str | None = Field(None, description="with process: the codec process's device, e.g. cuda:1 (the stage "
                                                 "on a GPU of its own); default: the profile's device")
    warm_up_frames: int = Field(512, ge=0, description="start-up decodes every bucketed window shape up to this "
                                                       "many frames (whole responses reach the utterance length)")
    cudnn_benchmark: bool = Field(False, description="let cuDNN time its convolution algorithms per shape (GPU; "
                                                     "for codecs whose shapes are bucketed and warmed up at start-up)")
    deterministic: bool = Field(False, description="cuDNN's deterministic algorithms only (GPU; a global switch, "
                                "so the frontend's convolutions too): the same call gives the same bits, which a "
                                "graph of the call can then equal (session 23: the default plans differ by 6e-3 "
                                "on fp16 audio from one call to the next)")
    sms: int | None = Field(None, ge=1, description="the codec worker's share of the GPU's streaming multiprocessors "
                                                 "(a CUDA green context; GPU, in-process worker): the rest stay free "
                                                 "for the AR step's kernels whatever the codec runs (None: all)")
    high_priority: bool = Field(False, description="experimental: the in-process codec worker's CUDA stream (and "
                                "the stream its graphs are captured on) at the highest priority, so its kernels' "
                                "blocks go before the AR step's waiting ones as SMs free up (GPU; no codec.sms, "
                                "codec.stream: loop or codec.process). Fish non-streamed, session 41: -14%")
    gather_ms: float = Field(0.0, ge=0, le=1000, description="the codec (worker, loop or process) starts a call "
                             "made only of non-streamed requests' pieces once the oldest has waited this long (at once "
                             "when max_batch requests wait or any stream's chunk does, which takes them along; in "
                             "the loop also when nothing else runs): fewer, larger calls (0: every call as soon as "
                             "the codec is free; the codec process gathers alike)")
    stream_lead_ms: float | None = Field(None, ge=0, le=10000, description="the in-process codec (worker or loop) "
                                         "holds a stream's chunk between its first and its last until its listener "
                                         "would run "
                                         "out of audio within this many ms without it (the first chunk's planning "
                                         "plus the audio before it), so streams ahead of their listeners gather into "
                                         "fewer, larger calls (None: a stream's chunk never waits; the codec process "
                                         "takes what waits)")
    max_call: int | None = Field(None, ge=1, description="chunks per codec worker call at most (None: every waiting "
                                                         "chunk; with schedule deadline: max_batch). Smaller calls "
                                                         "bound how long a new stream's first chunk waits behind one")
    schedule: Literal["fifo", "deadline", "first", "awaited", "preempt"] = Field(
        "fifo", description="order of the chunks waiting for the codec worker: as handed over (each call takes "
                            "all of them); earliest listener deadline first (each call takes up to max_batch; "
                            "experimental, not measured since the H200 crash that session 10 saw fixed); "
                            "first: as handed over, but while new streams' first chunks wait beside others, a "
                            "call takes only those (a new stream's first audio skips the backlog's call); "
                            "awaited: as first, and a non-streamed request's last piece goes with the first chunks "
                            "(with its request's earlier pieces still waiting): its client waits for it, not for "
                            "the pieces of requests still generating (experimental, off); or "
                            "preempt: as first, and a call over the backlog also stops at each of its pause points "
                            "(CosyVoice3: each Euler step of an eager flow solve, and before HiFT) to decode the "
                            "first chunks that arrived meanwhile (the in-process worker; the codec process "
                            "schedules as first)")

    @property
    def call_size(self) -> int | None:
        """Chunks per codec worker call at most (None: every waiting chunk), in a thread or a process."""
        return self.max_call or (self.max_batch if self.schedule == "deadline" else None)

    @property
    def stream_priority(self) -> int:
        """The codec worker's stream priority (CUDA clamps -100 to its highest)."""
        return -100 if self.high_priority else 0


class FrontendConfig(_Strict):
    cache_mb: int = Field(256, ge=0, description="reference features kept by clip hash (MiB; 0: no cache)")
    cuda_graphs: bool = Field(False, description="capture the frontend's networks per input shape at start-up and "
                                                 "replay them (GPU)")
    workers: int = Field(1, ge=1, le=8, description="frontend threads, each on its own CUDA stream (and, with "
                                                   "cuda_graphs, its own copy of the graphs), taking batches side by side")
    hand_back: Literal["each", "batch"] = Field(
        "each", description="a request goes back to the engine as soon as its own clips are encoded, or with its "
                            "whole batch (the behaviour before session 10; kept to measure the difference)")
    high_priority: bool = Field(False, description="experimental: the frontend's CUDA stream, and the stream its graphs "
                                                   "are captured on, at the highest priority (GPU)")
    sms: int | None = Field(None, ge=1, description="the frontend workers' share of the GPU's streaming multiprocessors "
                                                   "(a green context; a multiple of 8 on Hopper, as codec.sms): their "
                                                   "kernels never hold every SM, so the AR step's always find some free "
                                                   "(None: every SM)")
    process: bool = Field(False, description="each worker's clips encoded in a child process of its own, with its "
                                             "own copy of the model and CUDA context (its graphs too), so the "
                                             "frontend's host work never runs beside the engine loop's; off: its "
                                             "clips took twice as long there, with MPS or without (session 37)")


class ChunkingConfig(_Strict):
    initial_chunk_frames: int = Field(4, ge=0)
    steady_chunk_frames: int = Field(25, ge=1)
    backlog_chunk_frames: int = Field(0, ge=0)
    backlog_load_threshold: float = Field(0.75, gt=0, le=1)
    backlog_min_ready: int | None = Field(None, ge=1, description="default: max(2, 3/4 of capacity)")
    left_context_frames: int = Field(25, ge=0)
    lookahead_frames: int = Field(0, ge=0, description="frames needed beyond a streamed chunk's end")
    ramp_factor: float = Field(0.0, ge=0, le=8, description="a stream's hops after its first chunk: initial x "
                               "ramp^k frames until they reach the steady size (4, 6, 9, 14, 21, 25 at 1.5), so each "
                               "arrives before its listener runs out while the stream runs faster than ramp x real "
                               "time (0: off, the steady size at once)")
    growth_factor: int = Field(1, ge=1, description="each chunk's hop is the previous one's times this")
    max_chunk_frames: int = Field(0, ge=0, description="cap for grown hops (0: none)")
    align_first_chunk: int = Field(0, ge=0, description="pad the first hop so prompt + hop is a multiple")
    whole_chunk_frames: int = Field(0, ge=0, description="a non-streamed request's audio decoded as its frames come, "
                                    "this many at a time against its carried codec state (needs codec.carry_state; "
                                    "0: one pass after its last frame)")
    listener_margin_s: float = Field(0.0, ge=0, le=10, description="a stream's pending frames are also due, however "
                                     "few, once its listener (counted from its first chunk's release) would run out "
                                     "of audio within this many seconds; should exceed the codec's latency plus a "
                                     "step (needs codec.carry_state: chunk boundaries then follow timing; 0: off)")

    def policy(self, capacity: int, frame_seconds: float = 0.0) -> ChunkPolicy:
        """frame_seconds: the model's audio per frame (what listener_margin_s counts in)."""
        min_ready = self.backlog_min_ready or max(2, min(capacity, int(0.75 * capacity)))
        return ChunkPolicy(
            initial_chunk_frames=self.initial_chunk_frames, steady_chunk_frames=self.steady_chunk_frames,
            backlog_chunk_frames=self.backlog_chunk_frames, backlog_load_threshold=self.backlog_load_threshold,
            backlog_min_ready=min_ready, left_context_frames=self.left_context_frames,
            lookahead_frames=self.lookahead_frames, ramp_factor=self.ramp_factor, growth_factor=self.growth_factor,
            max_chunk_frames=self.max_chunk_frames, align_first_chunk=self.align_first_chunk,
            whole_chunk_frames=self.whole_chunk_frames, listener_margin_s=self.listener_margin_s,
            frame_seconds=frame_seconds,
        )


class SamplingDefaults(_Strict):
    temperature: float = Field(0.8, **SAMPLING_BOUNDS["temperature"])
    top_p: float = Field(0.8, **SAMPLING_BOUNDS["top_p"])
    top_k: int = Field(30, **SAMPLING_BOUNDS["top_k"])
    repetition_penalty: float = Field(1.0, **SAMPLING_BOUNDS["repetition_penalty"])
    max_new_tokens: int = Field(2048, **SAMPLING_BOUNDS["max_new_tokens"])
    mode: Literal["ras", "standard"] | None = Field(None, description="the model's sampling mode (None: its default)")


class Profile(_Strict):
    name: str = "default"
    device: str = "auto"
    tf32: bool = Field(False, description="allow TF32 for float32 matmuls on CUDA (faster, ~1e-3 relative error)")
    host_threads: int | None = Field(None, ge=1, description="torch's CPU threads in an engine process on a GPU "
                                                            "(None: torch's default, one per core)")
    host_switch_interval_ms: float | None = Field(
        None, gt=0, le=100, description="Python's GIL switch interval in an engine process (None: Python's own, "
                                        "5 ms): how long a thread back from a torch call may wait for the GIL")
    cuda_connections: int | None = Field(
        None, ge=1, le=32, description="experimental: hardware work queues of an engine process's CUDA context "
                                       "(CUDA_DEVICE_MAX_CONNECTIONS; None: CUDA's default, 8). Streams beyond "
                                       "their number share them, and work on a shared queue may wait behind "
                                       "another stream's; more queues, fewer streams sharing one")
    ar: ARConfig = ARConfig()
    codec: CodecStageConfig = CodecStageConfig()
    frontend: FrontendConfig = FrontendConfig()
    chunking: ChunkingConfig = ChunkingConfig()
    sampling: SamplingDefaults = SamplingDefaults()
    cosyvoice3: CosyVoice3Options = CosyVoice3Options()  # that family's own knobs (models/cosyvoice3/options.py)
    fish_s2: FishS2Options = FishS2Options()  # Fish S2's (models/fish_s2/options.py)

    @model_validator(mode="after")
    def _sections_agree(self):
        c = self.chunking
        if c.initial_chunk_frames > c.steady_chunk_frames:
            raise ValueError("chunking.initial_chunk_frames must be <= chunking.steady_chunk_frames")
        if c.ramp_factor and (c.ramp_factor <= 1 or c.growth_factor > 1):
            raise ValueError("chunking.ramp_factor must be > 1 (or 0: off), and excludes chunking.growth_factor")
        if self.codec.device is not None and not self.codec.process:
            raise ValueError("codec.device needs codec.process: true (the stage runs in a process of its own)")
        if self.codec.sms is not None and (self.codec.process or not self.codec.overlap):
            raise ValueError("codec.sms needs the in-process codec worker (codec.overlap, no codec.process)")
        if self.frontend.sms is not None and self.frontend.process:
            raise ValueError("frontend.sms needs the in-process frontend workers (no frontend.process)")
        if self.codec.high_priority and (self.codec.process or not self.codec.overlap or self.codec.sms
                                         or self.codec.stream == "loop"):
            raise ValueError("codec.high_priority is the in-process codec worker's own stream: no codec.process, "
                             "codec.overlap false, codec.sms or codec.stream loop")
        if self.codec.stream == "loop" and (self.codec.process or not self.codec.overlap or self.codec.sms):
            raise ValueError("codec.stream loop needs the in-process codec worker (codec.overlap, no codec.process) "
                             "and no codec.sms (its SM share is a stream of its own)")
        if self.codec.packed_decode and (self.codec.stream_graph_frames or self.codec.lean_decode):
            raise ValueError("codec.packed_decode runs eagerly on its own path: no codec.stream_graph_frames or "
                             "codec.lean_decode")
        if self.fish_s2.decoder_layout == "time_major" and (self.codec.packed_decode or self.codec.lean_decode):
            raise ValueError("fish_s2.decoder_layout time_major is a carried decode of its own: with "
                             "codec.packed_decode or codec.lean_decode set fish_s2.decoder_layout channels_first")
        # each works on the carried decode, whose audio does not depend on where its chunks begin
        for name, value in (("codec.stream_graph_frames", self.codec.stream_graph_frames),
                            ("codec.lean_decode", self.codec.lean_decode),
                            ("codec.packed_decode", self.codec.packed_decode),
                            ("chunking.listener_margin_s", c.listener_margin_s),
                            ("chunking.whole_chunk_frames", c.whole_chunk_frames)):
            if value and not self.codec.carry_state:
                raise ValueError(f"{name} needs codec.carry_state")
        return self

    def options_for(self, family: str):
        """The family's own section (None for a family without one); refuses a profile that sets
        another family's section off its defaults, which would otherwise be ignored without a word."""
        for other, section in FAMILY_SECTIONS.items():
            if other != family and getattr(self, section) != type(getattr(self, section))():
                raise ProfileError(f"{self.name}: section {section} is for {other} models, not {family}")
        section = FAMILY_SECTIONS.get(family)
        return getattr(self, section) if section else None


def load_profile(source: str | Path | None, **overrides) -> Profile:
    """A profile from a path or a name under profiles/, with dotted overrides like ar.max_num_seqs=8."""
    data: dict = {}
    if source:
        path = Path(source)
        if not path.exists() and (PROFILE_DIR / f"{source}.yaml").exists():
            path = PROFILE_DIR / f"{source}.yaml"
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise ProfileError(f"{path}: profile not found") from None
        except yaml.YAMLError as e:
            raise ProfileError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: a profile is a mapping of sections")
        data.setdefault("name", path.stem)
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            raise ProfileError(f"{source or 'profile'}: {old} is now {new}")
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "profile"
        raise ProfileError(f"{source or 'profile'}: {where}: {first['msg']}") from None


def default_params(profile: Profile, **overrides) -> SamplingParams:
    """The profile's sampling defaults, with the overrides that are not None."""
    s = profile.sampling
    values = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                  repetition_penalty=s.repetition_penalty, max_new_tokens=s.max_new_tokens, mode=s.mode)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**values)
