"""The interface between the engine and a TTS model.

The engine owns scheduling, KV blocks and per-request state; a model turns a scheduled
batch into one frame per request, and frames into audio. Nothing per-request is stored
on a model object.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from intone.errors import InvalidRequestError
from intone.models.vocoder import Vocoder, WindowVocoder
from intone.ops.attention import AttentionMetadata
from intone.ops.host_copy import PinnedCopy
from intone.ops.kv_cache import KVCache, KVLayout
from intone.ops.sampling import SamplingBatch
from intone.protocol import SynthesisRequest, VoiceReference
from intone.sampling_bounds import describe, within


@dataclass
class StepBatch:
    """One AR step for R requests: first the prefills, then the decodes (one token each).

    Their new tokens are packed along one axis in that order; `prefill` describes the first
    `prefill.num_reqs` requests' tokens and `decode` the rest (either may be None).
    """

    tokens: Tensor  # [T] int64
    codes: Tensor  # [T, K] int64 (zero where a token carries no codes)
    prefill: AttentionMetadata | None
    decode: AttentionMetadata | None
    sampling: SamplingBatch  # [R], rows in the same order
    history: Tensor  # [R, C] every generated main token of each row (ops.token_history), -1 beyond
    seats: Tensor | None = None  # [R] each row's seat in the runner's token history

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.prefill is None else int(self.prefill.slot_mapping.shape[0])


@dataclass
class StepOutput:
    tokens: Tensor  # [R] main token of the new frame (or the stop token)
    codes: Tensor  # [R, K] codes of the new frame (meaningless where stopped)
    stopped: Tensor  # [R] bool: the stop token was sampled; this step made no frame

    def to_host(self) -> tuple[list[int], list[bool], np.ndarray]:
        """(tokens, stopped, codes [R, K] int64) on the host through one device-to-host copy: the
        loop then reads them without a torch call per row (each call would give up the GIL)."""
        return self.copy_to_host(asynchronous=False).wait()

    def packed(self) -> Tensor:
        """[R, 2 + K] int64: each row's token, stopped, codes (one tensor for one copy to the host)."""
        return torch.cat((self.tokens.view(-1, 1).long(), self.stopped.view(-1, 1).long(), self.codes.long()), 1)

    def copy_to_host(self, asynchronous: bool, sleep: bool = False) -> "HostCopy":
        """`to_host`'s copy, made (or, asynchronous on a GPU, started): `wait()` gives what `to_host` gives.
        sleep: on a GPU, `wait()` sleeps on a blocking-sync event instead of spinning (`ar.token_wait`)."""
        return HostCopy(self.packed(), asynchronous, sleep)


def unpacked(packed: np.ndarray) -> tuple[list[int], list[bool], np.ndarray]:
    """`StepOutput.packed` rows on the host -> (tokens, stopped, codes [R, K])."""
    return packed[:, 0].tolist(), (packed[:, 1] != 0).tolist(), packed[:, 2:]


class HostCopy:
    """A step's packed outputs copied to the host: at once, or on a GPU asynchronously into pinned memory
    (also when the wait is to sleep: the copy then ends with a blocking-sync event)."""

    def __init__(self, packed: Tensor, asynchronous: bool, sleep: bool = False):
        self.copy = PinnedCopy([packed], sleep) if packed.is_cuda and (asynchronous or sleep) else None
        self.host = packed.cpu() if self.copy is None else None

    def wait(self) -> tuple[list[int], list[bool], np.ndarray]:
        return unpacked((self.host if self.copy is None else self.copy.wait()[0]).numpy())


@dataclass
class Prompt:
    tokens: Tensor  # [L] int64
    codes: Tensor  # [L, K] int64
    # Model-defined codec conditioning (e.g. a reference's mel and speaker embedding); it lives
    # with the request and is dropped with it.
    conditioning: object = None
    codec_prompt_frames: int = 0  # frames of reference the codec sees before frame 0 (chunk alignment)
    min_new_tokens: int = 0  # the model's own length rules for this prompt
    max_new_tokens: int | None = None
    # The request field that needs the whole audio in one codec chunk (e.g. speed: a tempo change
    # stretches the utterance at once); the engine refuses such a request where chunks would split it.
    one_chunk_for: str | None = None

    def __post_init__(self):
        self._length = int(self.tokens.shape[0])  # read per request every step: a Python int, not a tensor call

    def __len__(self) -> int:
        return self._length


class TTSModel(abc.ABC):
    name: str
    sample_rate: int
    samples_per_frame: int
    num_codebooks: int
    kv_layout: KVLayout
    max_seq_len: int
    codec_lookahead_frames: int = 0  # frames the codec reads beyond a non-final chunk's end
    supports_speed: bool = False  # speed != 1 in a single full-response chunk
    device: torch.device
    dtype: torch.dtype

    @abc.abstractmethod
    def build_prompt(self, text: str, references: list[VoiceReference], instructions: str | None = None) -> Prompt:
        """instructions: a style instruction for models that take one (else refused, naming the field).

        A reference's arrays are numpy as they crossed the process boundary (`intone.protocol`);
        the model makes the tensors it needs of them (tensors are taken too)."""

    def prepare(self, request: SynthesisRequest, references: list[VoiceReference] | None = None) -> Prompt:
        """The request's prompt, its model-specific options checked (an error names the field): speed
        (the model's range; a tempo change needs the audio in one chunk: `Prompt.one_chunk_for`),
        instructions and references (`build_prompt`). references: the request's with their audio
        encoded (default: as sent)."""
        self.check_speed(request.speed)
        prompt = self.build_prompt(request.text, request.references if references is None else references,
                                   request.instructions)
        if request.speed != 1.0:
            prompt.one_chunk_for = "speed"
        return prompt

    @abc.abstractmethod
    def encode_reference(self, audio: Tensor, sample_rate: int) -> Tensor:
        """Mono audio [N] -> codes [K, T]."""

    def reference_features(self, audio: Tensor, sample_rate: int) -> dict[str, Tensor]:
        """What a stored voice keeps so that its audio is never encoded again.

        The first entry's last axis is the reference's length in frames.
        """
        return {"codes": self.encode_reference(audio, sample_rate)}

    def reference_features_batch(self, clips: list[tuple[Tensor, int]], field: str = "ref_audio") -> list:
        """Several clips at once (audio [N], rate) -> per clip its features (CPU tensors) or the
        exception that clip raised; one bad clip never fails the others. Default: one at a time."""
        out = []
        for audio, rate in clips:
            try:
                out.append({k: v.cpu() for k, v in self.reference_features(audio, rate).items()})
            except Exception as e:  # noqa: BLE001 - the caller refuses that request alone
                out.append(e)
        return out

    def reference_features_as_ready(self, clips: list[tuple[Tensor, int]], field: str = "ref_audio"):
        """(index, features or exception) per clip, each as soon as the model has it, so a request
        whose clip is done need not wait for the rest of the batch. Default: the batch's results."""
        yield from enumerate(self.reference_features_batch(clips, field))

    def use_ar_autocast(self, dtype: torch.dtype) -> None:
        """Run the AR as its official code does under autocast to `dtype` (`ar.autocast`); `dtype` then says
        what its KV cache holds. Default: not supported."""
        raise ValueError(f"ar.autocast: {self.name} has no autocast mode")

    def configure_frontend(self, options) -> None:
        """Take the settings of the family's own profile section (`Profile.options_for`) that concern
        the model's reference networks (before `warm_up_frontend`; default: none)."""

    def warm_up_frontend(self, graphs=None) -> None:
        """Run the reference frontend once per shape it will see, at start-up (default: nothing).

        graphs: the engine's FunctionGraphs (GPU, graphs on), in which the model may capture
        those shapes and through which it then runs them."""

    def prepares_codec(self, prompt) -> bool:
        """Whether a stream's codec state is worth preparing from its reference alone, while its first frames
        are generated: the engine then hands the codec a `prepare` chunk at admission (default: no)."""
        return False

    def forwards_frame(self, generated: list[int]) -> bool:
        """Whether the newest generated frame goes to the codec (all do, unless a model trims some)."""
        return True

    def stream_decoder(self, lean: bool = False, packed: bool = False):
        """A stateful decoder (`decode(codes, lengths, states) -> (audio, states)`, see
        fish_s2/codec_stream.py) whose chunks join into the one-pass decode, or None: windows are
        decoded with re-decoded left context through `decode`. lean: `codec.lean_decode`; packed:
        `codec.packed_decode` (a decoder with `packed_length(lengths)`)."""
        return None

    def make_vocoder(self, config, options=None) -> Vocoder:
        """The model's vocoder (`models.vocoder`). config: the profile's `codec` section; options: the
        family's own section (`Profile.options_for`). Default: windows through `decode`, or (with
        `codec.carry_state`) streamed chunks through `stream_decoder`."""
        return WindowVocoder(self, config.max_batch, config.max_padded_frames, config.carry_state,
                             config.stream_graph_frames or None, config.row_granule, config.split_cost,
                             config.exact_rows, config.frame_buckets, config.lean_decode, config.packed_decode)

    # ---- the AR step, in the pieces the engine's model runner drives (it owns CUDA graphs) ----

    @abc.abstractmethod
    def embed(self, tokens: Tensor, codes: Tensor) -> Tensor:
        """Packed tokens [T] and their codes [T, K] -> input embeddings [T, D]."""

    @abc.abstractmethod
    def forward(self, x: Tensor, meta: AttentionMetadata, kv: KVCache) -> Tensor:
        """Packed embeddings of any batch (prefills) -> the output [R, ...] of each request's last token."""

    @abc.abstractmethod
    def forward_decode(self, x: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, seq_lens: Tensor,
                       kv: KVCache) -> Tensor:
        """One new token per row, static shapes (captured as a CUDA graph): x [B, D] -> [B, ...],
        the same output as `forward`. Rows attend to their first seq_lens keys in blocks `tables`."""

    @abc.abstractmethod
    def head(self, out: Tensor, sampling: SamplingBatch, history: Tensor,
             candidates: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """forward's output [R, ...] -> (main token [R], codes [R, K], stopped [R] bool) of the new frame.

        history [R, C]: each row's generated main tokens so far (sampling.steps of them), -1 beyond.
        candidates: at least every row's top_k; a head may then sort only that many tokens per draw, and
        must draw the same tokens for any such bound (None: every token)."""

    # head() has static shapes for a given row count (no host sync, no shape from the values),
    # so the runner may capture it per row bucket; padding rows are copies of row 0.
    head_is_static: bool = False
    # head() sorts only `candidates` tokens per draw when given a bound (else it ignores it)
    head_takes_candidates: bool = False
    # the `SamplingBatch.modes` for which head() runs fewer kernels than for "both" (each gets a graph)
    head_modes: tuple[str, ...] = ("both",)

    def check_speed(self, speed: float) -> None:
        """Refuse a tempo this model cannot give (the range is the OpenAI API's)."""
        if not within("speed", speed):
            raise InvalidRequestError("speed", f"{describe('speed')}, got {speed}")
        if speed != 1.0 and not self.supports_speed:
            raise InvalidRequestError("speed", f"{self.name} supports only 1.0")

    @abc.abstractmethod
    def decode(self, codes: Tensor, position_offset: int | Tensor = 0) -> Tensor:
        """codes [B, K, T] -> audio [B, T * samples_per_frame].

        position_offset: absolute frame index of the first code, for the batch or per row [B].
        """
