"""Fish S2 Pro behind the TTSModel interface: one batched Dual-AR step, codec decode and encode."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from intone.errors import InvalidRequestError, ModelLoadError
from intone.models.base import Prompt, TTSModel
from intone.models.checkpoint import load_strict
from intone.models.fish_s2.codec import CONFIG_FILE as CODEC_CONFIG_FILE
from intone.models.fish_s2.codec import CodecConfig, FishCodec, config_from_state, fold_weight_norm, with_config_file
from intone.models.fish_s2.codec_packed import PackedStreamingDecoder
from intone.models.fish_s2.codec_stream import StreamingDecoder
from intone.models.fish_s2.config import S2_PRO_CONFIG, FishS2Config
from intone.models.fish_s2.loader import read_codec_weights, read_lm_weights
from intone.models.fish_s2.prompt import FishTokenizer, Reference, build_prompt
from intone.models.fish_s2.options import FishS2Options
from intone.models.fish_s2.reference import ReferencePlan, encode_batch, warm_up_encoder
from intone.models.fish_s2.transformer import DualARTransformer
from intone.models.paths import resolve_model_dir
from intone.ops.attention import AttentionMetadata
from intone.ops.kv_cache import KVCache, KVLayout
from intone.ops.resample import resample
from intone.ops.sampling import SamplingBatch, apply_repetition_penalty, best_tokens, sample
from intone.ops.token_history import last_tokens
from intone.protocol import VoiceReference

# Repetition-aware sampling (official): if the normal draw repeats one of the last 10 main
# tokens, take a second draw made at temperature 1.0 / top-p 0.9 instead.
RAS_WINDOW, RAS_TEMPERATURE, RAS_TOP_P = 10, 1.0, 0.9
PENALTY_WINDOW = 16

# Draw indices within one step (see ops.sampling): 0 normal, 1 RAS fallback, 2.. codebooks.
DRAW_SEMANTIC, DRAW_RAS, DRAW_FIRST_CODEBOOK = 0, 1, 2


class FishS2(TTSModel):
    name = "fish-s2"

    def __init__(self, lm: DualARTransformer, codec: FishCodec, tokenizer: FishTokenizer, cfg: FishS2Config):
        self.lm, self.codec, self.tokenizer, self.cfg = lm, codec, tokenizer, cfg
        lm.join_projections()
        self.sample_rate = codec.sample_rate
        self.samples_per_frame = codec.hop_length
        self.num_codebooks = cfg.num_codebooks
        self.max_seq_len = cfg.max_seq_len
        self.kv_layout = KVLayout(cfg.slow.n_layer, cfg.slow.n_kv_head, cfg.slow.head_dim)
        self.device = lm.slow_rope.device
        self.dtype = lm.text_model.model.norm.weight.dtype
        self._encoder_graphs = None  # the engine's FunctionGraphs, once warm_up_frontend captured in it
        self._reference_plan = ReferencePlan()  # clips per encoder call and their bucket (`configure_frontend`)
        self._decoder_time_major = False  # the carried decoder's layout (`make_vocoder`: fish_s2.decoder_layout)

    @classmethod
    def load(cls, model_dir: str | Path, device="cpu", dtype: torch.dtype | None = None,
             codec_dtype: torch.dtype = torch.float32) -> "FishS2":
        model_dir = Path(model_dir)
        device = torch.device(device)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        cfg = FishS2Config.from_file(model_dir / "config.json")
        tokenizer = FishTokenizer(model_dir)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ModelLoadError(
                f"{model_dir}: tokenizer has {tokenizer.vocab_size} tokens but config vocab_size is {cfg.vocab_size}"
            )
        lm_state, source = read_lm_weights(model_dir)
        with torch.device("meta"):
            lm = DualARTransformer(cfg, tokenizer.semantic_begin, tokenizer.semantic_end)
        load_strict(lm, lm_state, source, dtype, device)
        lm.make_buffers(device)

        codec_path = model_dir / "codec.pth"
        codec_state, codec_cfg = _codec_state(codec_path)
        with torch.device("meta"):
            codec = FishCodec(codec_cfg)
        load_strict(codec, codec_state, str(codec_path), codec_dtype, device)
        return cls(lm.eval(), codec.eval(), tokenizer, cfg)

    @classmethod
    def random(cls, cfg: FishS2Config, tokenizer_dir: str | Path, codec_cfg: CodecConfig = CodecConfig(),
               device="cuda", dtype=torch.bfloat16, codec_dtype=torch.float32, seed: int = 0) -> "FishS2":
        """A model of any size with random weights, for speed measurements (no checkpoint needed).

        The tokenizer only has to carry the control tokens; its ids need not be the real ones.
        """
        device = torch.device(device)
        tokenizer = FishTokenizer(Path(tokenizer_dir))
        torch.manual_seed(seed)
        with torch.device("meta"):
            lm = DualARTransformer(cfg, tokenizer.semantic_begin, tokenizer.semantic_end)
            codec = FishCodec(codec_cfg)
        lm.to_empty(device=device).to(dtype)
        codec.to_empty(device=device).to(codec_dtype)
        with torch.no_grad():
            for module in (lm, codec):
                for name, p in module.named_parameters():
                    if name.endswith(("norm.weight", "alpha")):
                        p.fill_(1.0)
                    else:
                        p.normal_(0.0, 0.02)
        lm.make_buffers(device)
        return cls(lm.eval(), codec.eval(), tokenizer, cfg)

    # ---- prompting --------------------------------------------------------------------------

    def build_prompt(self, text: str, references: list[VoiceReference], instructions: str | None = None) -> Prompt:
        if instructions:
            raise InvalidRequestError("instructions", "fish-s2 takes no instructions")
        refs = []
        for i, ref in enumerate(references):
            codes = ref.codes
            if codes is None and ref.features is not None:
                if "codes" not in ref.features:
                    raise InvalidRequestError("voice", "this voice was stored for another model; upload it again")
                codes = ref.features["codes"]
            if codes is None:
                if ref.audio is None or ref.sample_rate is None:
                    raise InvalidRequestError(f"references[{i}]", "needs audio (with its sample rate) or codes")
                codes = self.encode_reference(torch.as_tensor(ref.audio), ref.sample_rate)
            refs.append(Reference(text=ref.text, codes=torch.as_tensor(codes).cpu()))
        return build_prompt(self.tokenizer, text, refs, self.num_codebooks)

    def encode_reference(self, audio: Tensor, sample_rate: int) -> Tensor:
        codes = self.reference_features_batch([(audio, sample_rate)])[0]
        if isinstance(codes, Exception):
            raise codes
        return codes["codes"]

    def reference_features_batch(self, clips: list[tuple[Tensor, int]], field: str = "ref_audio") -> list:
        """Clips resampled to 44.1 kHz on the CPU, then encoded together on the codec's device
        (lengths and rows padded to buckets: the encoder is causal, so padding after a clip
        cannot change its codes, and repeated shapes reuse the convolutions' plans)."""
        wavs: list[Tensor | Exception] = []
        for audio, rate in clips:
            try:
                if audio.numel() == 0:
                    raise InvalidRequestError(field, "audio is empty")
                wavs.append(resample(audio.float().cpu(), int(rate), self.sample_rate))
            except Exception as e:  # noqa: BLE001 - that clip's request is refused alone
                wavs.append(e)
        live = [i for i, w in enumerate(wavs) if not isinstance(w, Exception)]
        codes = encode_batch(self.codec, [wavs[i] for i in live], self._encoder_graphs, self._reference_plan) \
            if live else []
        out: list = list(wavs)
        for i, c in zip(live, codes):
            out[i] = {"codes": c}
        return out

    def configure_frontend(self, options: FishS2Options | None) -> None:
        options = options or FishS2Options()
        self._reference_plan = ReferencePlan.of(options.reference_rows, options.reference_bucket_s,
                                                self.codec.sample_rate, self.codec.hop_length)
        self.codec.encoder_layout = options.encoder_layout

    def warm_up_frontend(self, graphs=None) -> None:
        if self.codec_device_type == "cuda":
            warm_up_encoder(self.codec, graphs, self._reference_plan)
            self._encoder_graphs = graphs

    @property
    def codec_device_type(self) -> str:
        return next(self.codec.parameters()).device.type

    def sampler_windows(self, history: Tensor, counts: Tensor) -> Tensor:
        """[RAS window | penalty window] of each row's last generated tokens, right-aligned, -1 padded.

        The official loop never puts the first sampled token (the prefill step's) in the RAS
        window; we keep that so the same draws give the same choices.
        """
        return torch.cat([last_tokens(history, counts, RAS_WINDOW, first=1),
                          last_tokens(history, counts, PENALTY_WINDOW)], dim=1)

    # ---- one AR step: embed -> slow AR -> head (semantic draw + fast AR) -------------------

    def embed(self, tokens: Tensor, codes: Tensor) -> Tensor:
        return self.lm.embed(tokens, codes)

    def forward(self, x: Tensor, meta: AttentionMetadata, kv: KVCache) -> Tensor:
        return self.lm.forward_slow(x, meta, kv)

    def forward_decode(self, x, positions, slots, tables, seq_lens, kv: KVCache) -> Tensor:
        return self.lm.decode_slow(x, positions, slots, tables, seq_lens, kv)

    head_is_static = True
    head_takes_candidates = True

    def head(self, hidden: Tensor, sampling: SamplingBatch, history: Tensor,
             candidates: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.lm.semantic_logits(hidden, self.tokenizer.im_end_id).float()
        tokens = self._sample_semantic(logits, sampling, self.sampler_windows(history, sampling.steps), candidates)
        codes = self._fast_codes(hidden, tokens, sampling, candidates)
        return tokens, codes, tokens == self.tokenizer.im_end_id

    def _to_token_ids(self, index: Tensor) -> Tensor:
        """Index into the restricted logits -> vocabulary id."""
        stop = torch.full_like(index, self.tokenizer.im_end_id)
        return torch.where(index == self.cfg.codebook_size, stop, index + self.tokenizer.semantic_begin)

    def _sample_semantic(self, logits: Tensor, params: SamplingBatch, history: Tensor,
                         candidates: int | None = None) -> Tensor:
        ras_window, pen_window = history[:, :RAS_WINDOW], history[:, RAS_WINDOW:]
        begin = self.tokenizer.semantic_begin
        pen_idx = torch.where(
            (pen_window >= begin) & (pen_window <= self.tokenizer.semantic_end), pen_window - begin, -1
        )
        logits = apply_repetition_penalty(logits, pen_idx, params, always=True)
        bans = [b for b in (params.ban_stop, params.below_min) if b is not None]
        if bans:
            ban = bans[0] if len(bans) == 1 else bans[0] | bans[1]
            stop_col = logits[:, self.cfg.codebook_size]
            logits[:, self.cfg.codebook_size] = torch.where(ban, float("-inf"), stop_col)
        # candidates: the caller's bound on every row's top_k (a captured head's is fixed; None: all);
        # both draws filter the same logits with the same top_k, so they share one sort
        order = best_tokens(logits, min(candidates or logits.shape[-1], logits.shape[-1]))
        normal = self._to_token_ids(sample(logits, params, DRAW_SEMANTIC, idx=order))
        fallback = self._to_token_ids(
            sample(logits, params.with_overrides(RAS_TEMPERATURE, RAS_TOP_P), DRAW_RAS, idx=order)
        )
        repeated = (ras_window == normal.unsqueeze(1)).any(dim=1)
        if params.ras is not None:
            repeated &= params.ras
        is_semantic = normal != self.tokenizer.im_end_id
        return torch.where(repeated & is_semantic, fallback, normal)

    def _fast_codes(self, hidden: Tensor, tokens: Tensor, params: SamplingBatch,
                    candidates: int | None = None) -> Tensor:
        """Codebooks 1..K-1 for each row, conditioned on the slow AR's normed hidden state.

        Position 0 sees the hidden state (its logits are unused); position k sees the
        embedding of code k-1. Residual codes are drawn over all 4096 logits, as officially.
        Positions 0 and 1 go through the layers together (the official code runs them one after the
        other; the same sums, one pass of the fast layers' weights fewer a step).
        """
        lm = self.lm
        cache = lm.new_fast_cache(hidden.shape[0], hidden.dtype, hidden.device)
        code = (tokens - self.tokenizer.semantic_begin).clamp(0, self.cfg.codebook_size - 1)
        codes = [code]
        x = torch.stack([lm.audio_decoder.project(hidden), lm.audio_decoder.embeddings(code)], dim=1)
        for k in range(1, self.num_codebooks):
            h = lm.fast_step(x, 0, cache) if k == 1 else lm.fast_step(lm.audio_decoder.embeddings(code), k, cache)
            logits = lm.fast_logits(h).float()
            code = sample(logits, params, DRAW_FIRST_CODEBOOK + k - 1, candidates or logits.shape[-1])
            codes.append(code)
        return torch.stack(codes, dim=1)

    # ---- codec ------------------------------------------------------------------------------

    def decode(self, codes: Tensor, position_offset: int | Tensor = 0) -> Tensor:
        return self.codec.decode(codes.to(self.device), position_offset).float()

    def make_vocoder(self, config, options: FishS2Options | None = None):
        self._decoder_time_major = (options or FishS2Options()).decoder_layout == "time_major"
        return super().make_vocoder(config, options)

    def stream_decoder(self, lean: bool = False, packed: bool = False) -> StreamingDecoder:
        if packed and self._decoder_time_major:
            raise ValueError("codec.packed_decode has no time-major variant (fish_s2.decoder_layout)")
        return PackedStreamingDecoder(self.codec) if packed else \
            StreamingDecoder(self.codec, lean, self._decoder_time_major)


def _codec_state(path: Path):
    try:
        state = fold_weight_norm(read_codec_weights(path))
        cfg = config_from_state(state)
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing tensor or weight-norm part: {e.args[0]}") from None
    config_file = path.parent / CODEC_CONFIG_FILE
    if config_file.exists():
        try:
            cfg = with_config_file(cfg, config_file)
        except (ValueError, TypeError, OSError) as e:
            raise ModelLoadError(f"{config_file}: {e}") from None
    if cfg.latent_dim % cfg.head_dim:
        raise ModelLoadError(f"{path}: codec width {cfg.latent_dim} is not a multiple of head_dim {cfg.head_dim}")
    return state, cfg


def random_s2_pro(device="cuda", dtype: torch.dtype | None = None, codec_dtype=torch.float32) -> FishS2:
    """The real S2 Pro architecture with random weights; the tiny checkpoint lends its tokenizer."""
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    return FishS2.random(FishS2Config.from_dict(S2_PRO_CONFIG), resolve_model_dir("tiny:fish-s2"),
                         device=device, dtype=dtype, codec_dtype=codec_dtype)
