"""CosyVoice3's section of a deploy profile (`cosyvoice3:`): the knobs only this family has.

Torch-free (the API process validates profiles); the model reads it in `configure_frontend` and
`make_vocoder`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FlowOptions(_Strict):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the flow's weights in this dtype (GPU only; its ODE state stays fp32)")
    autocast: Literal["none", "bfloat16", "float16"] = Field(
        "none", description="run the flow's DiT under autocast (GPU only): its weights stored in that dtype (the "
                            "same bits as autocast casting them in every pass), the rest of the flow unchanged")
    compile: bool = Field(False, description="torch.compile the DiT at start-up (GPU only; minutes)")
    compile_unit: Literal["dit", "block"] = Field(
        "dit", description="with compile: the whole DiT as one graph, or each transformer block (the same code "
                           "compiled once: start-up ~10x shorter, the kernels between blocks eager)")
    compile_wrapper: Literal["python", "cpp"] = Field(
        "python", description="with compile: the compiled DiT's launches from inductor's Python wrapper, or from its "
                              "C++ wrapper (inductor's cpp_wrapper), which launches a whole pass from C++ with the GIL "
                              "released, where the Python wrapper spends Python time and takes the GIL back on every "
                              "kernel: shorter codec calls when they are host-bound (longer start-up: the wrapper's "
                              "C++ build)")
    attention: Literal["sdpa", "flex", "varlen"] = Field(
        "sdpa", description="the DiT's attention as SDPA under a dense mask, flex attention under a block mask "
                            "that skips the key blocks padding and the chunk mask hide (GPU: with compile only), "
                            "or varlen: a call of whole responses (no chunk mask) runs on its rows' frames packed "
                            "end to end, each row attending to itself through FlashAttention's variable-length "
                            "kernel (GPU, half precision: autocast or dtype), no work on padding; calls with "
                            "streamed hops as sdpa, unless the flow cache continues them (then packed too, each "
                            "new frame over its row's past and its chunk)")
    cuda_graphs: bool = Field(False, description="replay each Euler step of the flow's ODE solve (a DiT pass with CFG) "
                                                 "from CUDA graphs captured at start-up, one per (rows, frames) bucket "
                                                 "(GPU); a solve keeps its pause points between steps. With the varlen "
                                                 "kernel: calls of whole rows, packed, at (rows, frames in all) buckets "
                                                 "(`flow_slots`: frames padded to buckets 256 apart up to 2048, then 4 an "
                                                 "octave), the others eagerly; with the flow cache too, a stream's "
                                                 "whole final hops so (its continued hops eagerly)")
    graph_frames: int = Field(1024, ge=128, le=4096,
                              description="with cuda_graphs: the longest flow call (reference + output, mel frames "
                                          "at 50 per second; with varlen: the longest row) with a graph; longer ones "
                                          "run eagerly")
    call_cost: int | None = Field(None, ge=0, description="split the flow's waiting jobs into calls of similar "
                                                        "lengths, a call worth this many padded tokens of work (None: "
                                                        "each call as full as codec.max_batch and "
                                                        "codec.max_padded_frames allow)")
    packed: bool = Field(False, description="the DiT runs on the rows' valid frames packed end to end instead of "
                                            "right-padded to the call's longest (each frame's attention limited "
                                            "to its own row): the same mel, no work on padding (not with "
                                            "cuda_graphs or cache, whose solves it leaves padded; the varlen "
                                            "kernel packs the cache's)")
    cache: bool = Field(False, description="streaming: each stream keeps its flow's keys and values (per Euler step "
                                           "and layer) and its input embedding's last frames across its non-final "
                                           "hops, and a hop solves only its new frames: the official whole-prefix "
                                           "solve's mel, with less work; ~1.8 MB a mel frame in bf16 at real size "
                                           "(not with cuda_graphs, except with the varlen kernel, which packs "
                                           "the continued hops)")
    cache_gb: float = Field(32.0, gt=0, description="with cache: the most GB of the streams' flow cache pool, "
                            "allocated at the first served hop (on a GPU, never more than was free then less 10% of "
                            "the device; ~1.8 MB a mel frame of a stream in bf16 at real size; a minute-long stream "
                            "~5 GB). A hop the pool has no room for keeps no cache: its stream's next hop solves its "
                            "whole prefix again, the same mel at more work")
    reference_ahead: bool = Field(False, description="streaming, with cache: at admission, solve the whole chunks of "
                                  "a stream's reference that no generated token reaches (~3/4 of its first hop's "
                                  "flow work at the preset's lengths) while its first tokens are generated, so the "
                                  "first hop solves only the rest: the official mel, less work after the talker")
    final_hop: Literal["whole", "continued"] = Field(
        "whole", description="streaming, with cache: `whole` re-solves a stream's final hop over the whole utterance "
                             "with full attention, as officially; `continued` solves only its new frames against the "
                             "cache, attending to every frame (the earlier frames keep their chunk-masked states): "
                             "the flow's work per stream becomes a full response's, and only the final chunk's "
                             "audio differs from the official output")

    @model_validator(mode="after")
    def _not_with_graphs(self):
        if self.reference_ahead and not self.cache:
            raise ValueError("cosyvoice3.flow.reference_ahead needs cosyvoice3.flow.cache (the first hop goes on "
                             "from the reference's kept state)")
        if self.final_hop == "continued" and not self.cache:
            raise ValueError("cosyvoice3.flow.final_hop continued needs cosyvoice3.flow.cache (it goes on from "
                             "the stream's kept state)")
        if self.cuda_graphs and self.cache and self.attention != "varlen":
            raise ValueError("cosyvoice3.flow.cache with cosyvoice3.flow.cuda_graphs needs cosyvoice3.flow.attention "
                             "varlen (the padded graphs replay the whole-prefix solve)")
        if self.packed and (self.cuda_graphs or self.cache):
            raise ValueError("cosyvoice3.flow.packed needs cosyvoice3.flow.cuda_graphs and cosyvoice3.flow.cache off "
                             "(their solves are padded)")
        return self


class HiFTOptions(_Strict):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="HiFT's convolutions in this dtype (GPU only; its F0 predictor stays float64, its "
                            "excitation and iSTFT float32; the official runs float32)")
    cuda_graphs: bool = Field(False, description="replay HiFT's calls from CUDA graphs captured at start-up, one per "
                                                 "(rows, frames) bucket (GPU): its ~1100 launches a call are the "
                                                 "host's work while the GPU waits")
    graph_frames: int = Field(256, ge=32, le=1024, description="with cuda_graphs: the longest HiFT window with a graph "
                                                                "(mel frames; a streamed window is at most ~250); "
                                                                "longer ones run eagerly")
    call_cost: int | None = Field(None, ge=0, description="split HiFT's waiting windows into calls of similar "
                                  "lengths, a call worth this many tokens of computed rows x frames (its graph's "
                                  "shape with cuda_graphs); None: each call as full as codec.max_batch and "
                                  "codec.max_padded_frames allow (a full-response call of ~12 windows of 90-420 "
                                  "mel frames then computes ~35% padding)")


class CosyVoice3Options(_Strict):
    flow: FlowOptions = FlowOptions()
    hift: HiFTOptions = HiFTOptions()
    speaker_rows: int = Field(1, ge=1, le=32, description="clips per CAM++ call, always this many rows (padded), so "
                                                         "same-bucket clips share a call and each gets what it gets "
                                                         "alone")
    speaker_bucket_s: int = Field(1, ge=1, le=30, description="CAM++'s length bucket in seconds (coarser: more clips "
                                                              "share a call, each padded further)")
    tokenizer_rows: int | None = Field(None, ge=1, le=64, description="clips per speech-tokenizer call, always this "
                                       "many rows, in tokenizer_bucket_s buckets (None: the waiting clips in calls of "
                                       "similar lengths, each padded to its call's longest and, with graphs, to a "
                                       "power of two of rows: ~40% padding at ~3 clips a call)")
    tokenizer_bucket_s: int = Field(1, ge=1, le=30, description="with tokenizer_rows: the tokenizer's length bucket in "
                                                                "seconds")
