"""CosyVoice3 behind the TTSModel interface: talker steps, reference frontend, flow + HiFT codec."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from intone.errors import InvalidRequestError
from intone.models.base import Prompt, TTSModel
from intone.models.cosyvoice3.codec_config import flow_sizes
from intone.models.cosyvoice3.flow import CosyFlow, FlowConfig, FlowRequest
from intone.models.cosyvoice3.flow_cache import reference_ahead
from intone.models.cosyvoice3.frontend import (
    ReferenceFeatures, SpeakerEncoder, SpeechTokenizer, extract_each, extract_reference, random_frontend,
    warm_up as frontend_warm_up,
)
from intone.models.cosyvoice3.hift import CausalHiFT, HiFTConfig
from intone.models.cosyvoice3.loader import install_noise, load_cosyvoice3
from intone.models.cosyvoice3.noise import official_noise
from intone.models.cosyvoice3.options import CosyVoice3Options
from intone.models.cosyvoice3.prompt import MAX_TOKEN_TEXT_RATIO, MIN_TOKEN_TEXT_RATIO, talker_prompt
from intone.models.cosyvoice3.sampling import SPEECH_TOKENS, sample_speech_tokens
from intone.models.cosyvoice3.talker import CosyTalker, QwenShape
from intone.models.cosyvoice3.tokenizer import BLANK_EN, CosyTokenizer
from intone.models.cosyvoice3.vocoder import CosyVocoder, store_for_autocast
from intone.models.paths import resolve_model_dir
from intone.ops.attention import AttentionMetadata
from intone.ops.kv_cache import KVCache, KVLayout
from intone.ops.sampling import SamplingBatch
from intone.protocol import VoiceReference

# FSQ codes of silence and breath: after 5 in a row, further ones are not vocoded (official).
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT_RUN = 5


class CosyVoice3(TTSModel):
    name = "cosyvoice3"
    num_codebooks = 1
    requires_reference = True
    supports_speed = True
    solves_reference_ahead = False  # cosyvoice3.flow.reference_ahead (`configure_frontend`)

    def __init__(self, talker: CosyTalker, flow, hift, tokenizer: CosyTokenizer,
                 speech_tokenizer: SpeechTokenizer, speaker_encoder: SpeakerEncoder, sample_rate: int = 24000):
        self.talker, self.flow, self.hift, self.tokenizer = talker, flow, hift, tokenizer
        talker.join_projections()
        self.speech_tokenizer, self.speaker_encoder = speech_tokenizer, speaker_encoder
        self.sample_rate = sample_rate
        self.samples_per_frame = flow.config.token_mel_ratio * hift.cfg.hop  # one token = 2 mel frames
        s = talker.shape
        self.kv_layout = KVLayout(s.num_hidden_layers, s.num_key_value_heads, s.head_dim)
        self.max_seq_len = s.max_position_embeddings
        self.codec_lookahead_frames = flow.config.pre_lookahead_len
        self.device = talker.llm_decoder.weight.device
        self.dtype = talker.llm_decoder.weight.dtype
        self.codec_device = next(flow.parameters()).device

    @classmethod
    def load(cls, model_dir: str | Path, device="cpu", dtype: torch.dtype | None = None,
             codec_dtype: torch.dtype = torch.float32) -> "CosyVoice3":
        return load_cosyvoice3(cls, Path(model_dir), torch.device(device), dtype or torch.float32, codec_dtype)

    def use_ar_autocast(self, dtype: torch.dtype) -> None:
        """The official `fp16=True` talker (fp16 autocast; `CosyTalker.use_autocast`), its KV cache in fp16."""
        if dtype != torch.float16:
            raise ValueError("ar.autocast: CosyVoice3's official code autocasts its LLM to float16 only")
        self.talker.use_autocast(dtype)
        self.dtype = self.talker.kv_dtype

    # ---- references and prompts -------------------------------------------------------------

    def reference_features(self, audio: Tensor, sample_rate: int, field: str = "ref_audio") -> dict[str, Tensor]:
        f = extract_reference(audio, sample_rate, self.speech_tokenizer, self.speaker_encoder, field=field)
        return {"speech_tokens": f.speech_tokens, "prompt_mel": f.prompt_mel, "speaker": f.speaker}

    def configure_frontend(self, options: CosyVoice3Options | None) -> None:
        options = options or CosyVoice3Options()
        self.solves_reference_ahead = options.flow.cache and options.flow.reference_ahead
        if hasattr(self.speaker_encoder, "set_batching"):
            self.speaker_encoder.set_batching(options.speaker_rows, options.speaker_bucket_s)
        if options.tokenizer_rows and hasattr(self.speech_tokenizer, "set_batching"):
            self.speech_tokenizer.set_batching(options.tokenizer_rows, options.tokenizer_bucket_s)

    def warm_up_frontend(self, graphs=None) -> None:
        if getattr(self.speech_tokenizer, "device", torch.device("cpu")).type == "cuda":
            frontend_warm_up(self.speech_tokenizer, self.speaker_encoder, graphs)

    def reference_features_batch(self, clips: list[tuple[Tensor, int]], field: str = "ref_audio") -> list:
        out: list = [None] * len(clips)
        for i, features in self.reference_features_as_ready(clips, field):
            out[i] = features
        return out

    def reference_features_as_ready(self, clips: list[tuple[Tensor, int]], field: str = "ref_audio"):
        """Many clips through the frontend's networks together (on the model's device when they
        were ported to torch), each clip's (index, features) given as soon as it is done; a bad
        clip gets its own error."""
        for i, r in extract_each(clips, self.speech_tokenizer, self.speaker_encoder, field=field):
            yield i, r if isinstance(r, Exception) else {
                "speech_tokens": r.speech_tokens, "prompt_mel": r.prompt_mel, "speaker": r.speaker}

    def encode_reference(self, audio: Tensor, sample_rate: int) -> Tensor:
        return self.reference_features(audio, sample_rate)["speech_tokens"].unsqueeze(0)

    def _features(self, ref: VoiceReference, field: str) -> ReferenceFeatures:
        if ref.audio is not None and ref.sample_rate is not None:
            f = self.reference_features(torch.as_tensor(ref.audio), ref.sample_rate, field)
        elif ref.features is not None and {"speech_tokens", "prompt_mel", "speaker"} <= ref.features.keys():
            f = ref.features
        elif ref.features is not None:
            raise InvalidRequestError(field, "this voice was stored for another model; upload it again")
        else:
            raise InvalidRequestError(field, "CosyVoice3 needs the reference audio (or a stored voice), "
                                             "not codes alone")
        out = ReferenceFeatures(torch.as_tensor(f["speech_tokens"]).long(), torch.as_tensor(f["prompt_mel"]).float(),
                                torch.as_tensor(f["speaker"]).float())
        n = out.speech_tokens.shape[0]
        if out.speech_tokens.dim() != 1 or out.prompt_mel.shape != (2 * n, 80) or out.speaker.shape != (192,):
            raise InvalidRequestError(field, "stored voice features have the wrong shapes; upload it again")
        return out

    def build_prompt(self, text: str, references: list[VoiceReference], instructions: str | None = None) -> Prompt:
        if len(references) != 1:
            raise InvalidRequestError("ref_audio", "CosyVoice3 needs exactly one reference voice "
                                                   f"(ref_audio or voice), got {len(references)}")
        ref = references[0]
        features = self._features(ref, "ref_audio" if ref.audio is not None else "voice")
        tokens, codes, target_len = talker_prompt(self.tokenizer, text, ref.text, features.speech_tokens, instructions)
        # The flow's fixed noise covers noise_frames mel frames, reference included.
        room = ((self.flow.config.noise_frames - features.prompt_mel.shape[0]) // self.flow.config.token_mel_ratio
                - self.codec_lookahead_frames)
        return Prompt(
            tokens=tokens, codes=codes, conditioning=features,
            codec_prompt_frames=int(features.speech_tokens.shape[0]),
            min_new_tokens=MIN_TOKEN_TEXT_RATIO * target_len,
            max_new_tokens=min(MAX_TOKEN_TEXT_RATIO * target_len, room),
        )

    # ---- talker -----------------------------------------------------------------------------

    def forwards_frame(self, generated: list[int]) -> bool:
        tail = generated[-(MAX_SILENT_RUN + 1):]
        return not (len(tail) > MAX_SILENT_RUN and all(t in SILENT_TOKENS for t in tail))

    def embed(self, tokens: Tensor, codes: Tensor) -> Tensor:
        return self.talker.embed(tokens, codes[:, 0])

    def forward(self, x: Tensor, meta: AttentionMetadata, kv: KVCache) -> Tensor:
        return self.talker(x, meta, kv)

    def forward_decode(self, x, positions, slots, tables, seq_lens, kv: KVCache) -> Tensor:
        return self.talker.decode_step(x, positions, slots, tables, seq_lens, kv)

    head_is_static = True  # no host sync or value-dependent shape: the runner captures it per row bucket
    head_modes = ("standard", "ras", "both")  # a batch of one mode skips the other sampler

    def head(self, logits: Tensor, sampling: SamplingBatch, history: Tensor,
             candidates: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        ids = sample_speech_tokens(logits, sampling, history)  # its candidates: the top-k bound's (sampling.py)
        return ids, ids.clamp(max=SPEECH_TOKENS - 1).unsqueeze(1), ids >= SPEECH_TOKENS

    # ---- codec ------------------------------------------------------------------------------

    def make_vocoder(self, config, options: CosyVoice3Options | None = None) -> CosyVocoder:
        """The flow + HiFT vocoder; `cosyvoice3.flow.dtype` and `cosyvoice3.hift.dtype` recast this model's
        flow and HiFT (the model belongs to one engine), `cosyvoice3.flow.compile` compiles its DiT now."""
        flow = (options or CosyVoice3Options()).flow
        gpu = self.codec_device.type == "cuda"
        if flow.attention == "flex" and gpu and not flow.compile:
            raise ValueError("cosyvoice3.flow.attention flex needs cosyvoice3.flow.compile on a GPU "
                             "(flex attention is fast only compiled)")
        weights = self.flow.input_embedding.weight.dtype if flow.dtype == "auto" else getattr(torch, flow.dtype)
        half = flow.autocast != "none" or weights in (torch.float16, torch.bfloat16)
        if flow.attention == "varlen" and gpu and not half:
            raise ValueError("cosyvoice3.flow.attention varlen needs half precision on a GPU "
                             "(cosyvoice3.flow.autocast or cosyvoice3.flow.dtype): FlashAttention has no fp32 kernel")
        self.flow.decoder.estimator.attention_kernel = flow.attention
        self.flow.decoder.packed = flow.packed
        if flow.dtype != "auto" and gpu:
            self.flow.to(getattr(torch, flow.dtype))
        if flow.autocast != "none" and gpu:
            store_for_autocast(self.flow.decoder.estimator, getattr(torch, flow.autocast))
        hift = (options or CosyVoice3Options()).hift
        if hift.dtype != "auto" and gpu:
            self.hift.to(getattr(torch, hift.dtype))  # the F0 predictor and the noise keep their dtypes
        vocoder = CosyVocoder(self, config.max_batch, config.max_padded_frames, flow.autocast, flow.call_cost,
                               flow.cache, flow.graph_frames if flow.cuda_graphs else None,
                               hift.graph_frames if hift.cuda_graphs else None, hift.call_cost,
                               flow.final_hop == "continued", int(flow.cache_gb * 1e9), config.schedule == "preempt")
        if flow.compile and gpu:
            vocoder.compile_flow(flow.compile_unit, flow.compile_wrapper)
        return vocoder

    def mel_zeros(self) -> Tensor:
        return torch.zeros(self.flow.config.output_size, 0, device=self.codec_device)

    def prepares_codec(self, prompt) -> bool:
        """With `cosyvoice3.flow.reference_ahead`: a stream whose reference has a whole chunk to solve ahead."""
        f = prompt.conditioning
        return self.solves_reference_ahead and isinstance(f, ReferenceFeatures) and \
            reference_ahead(self.flow, f.speech_tokens, f.prompt_mel, f.speaker) is not None

    def flow_requests(self, windows) -> list:
        """The flow input of each chunk (a `CodecWindow`: ending at token `end`; the last chunk:
        `finished`), or None where there are no tokens at all. The chunks' tokens reach the device in
        one transfer (each transfer waits for the stream, and its thread then for the interpreter)."""
        counts = []
        for w in windows:
            n = 0 if w.prepare else w.end if w.finished else w.end + self.codec_lookahead_frames
            if n > w.codes.shape[1]:
                raise ValueError(f"a chunk ending at {w.end} needs {n} tokens, {w.codes.shape[1]} exist")
            counts.append(n)
        dev = self.codec_device
        tokens = torch.cat([w.codes[0, :n] for w, n in zip(windows, counts)]).to(dev).split(counts)
        out = []
        for w, n, t in zip(windows, counts, tokens):
            f: ReferenceFeatures = w.prompt.conditioning
            if f.speaker.device != dev:  # moved once per request, not per chunk
                f = w.prompt.conditioning = ReferenceFeatures(f.speech_tokens.to(dev), f.prompt_mel.to(dev),
                                                              f.speaker.to(dev))
            if w.prepare:
                out.append(reference_ahead(self.flow, f.speech_tokens, f.prompt_mel, f.speaker))
                continue
            out.append(FlowRequest(tokens=t, prompt_tokens=f.speech_tokens, prompt_mel=f.prompt_mel, speaker=f.speaker,
                                   streaming=not w.finished, finalize=w.finished) if n else None)
        return out

    def decode(self, codes: Tensor, position_offset: int | Tensor = 0) -> Tensor:
        raise NotImplementedError("CosyVoice3 decodes through its vocoder (it needs the reference)")


def random_cosyvoice3(device="cuda", dtype: torch.dtype | None = None, codec_dtype=torch.float32) -> CosyVoice3:
    """The real Fun-CosyVoice3-0.5B architecture with random weights, for speed measurements.

    The tiny checkpoint lends its text tokenizer and nothing else.
    """
    tiny = resolve_model_dir("tiny:cosyvoice3")
    device = torch.device(device)
    dtype = dtype or torch.float32
    fcfg, hcfg = FlowConfig(), HiFTConfig()
    noise = official_noise(flow_sizes(fcfg), hcfg, include_uv=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        talker = CosyTalker(QwenShape())
        flow = CosyFlow(fcfg)
        hift = CausalHiFT(hcfg, noise={k: v.to("meta") for k, v in noise.items()})
    for module, dt in ((talker, dtype), (flow, codec_dtype), (hift, codec_dtype)):
        module.to_empty(device=device)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.endswith("norm.weight") or name.endswith("alpha"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02 if p.dim() > 1 else 0.0)
        module.to(dt).eval()
    hift.f0_predictor.to(torch.float64)
    flow.decoder.estimator.rotary_embed.inv_freq.copy_(
        1.0 / (fcfg.dit.rope_base ** (torch.arange(0, fcfg.dit.dim_head, 2, device=device).float() / fcfg.dit.dim_head)))
    install_noise(flow, hift, noise, device)
    frontend = random_frontend(device)  # real-size networks, so benchmarks price the frontend honestly
    return CosyVoice3(talker, flow, hift, CosyTokenizer(tiny / BLANK_EN), frontend.tokenizer,
                      frontend.speaker_encoder)
