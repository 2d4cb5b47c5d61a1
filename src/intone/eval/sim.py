"""Speaker similarity (SIM) as Seed-TTS-eval measures it.

The official scorer embeds each (generated wav, prompt wav) pair with UniSpeech's ECAPA-TDNN head
on a fine-tuned WavLM-Large and reports the mean cosine similarity (shared/reference/seedtts_eval.md
§3). Here the backbone is `transformers.WavLMModel`; every tensor, backbone included, comes from the
released checkpoint `wavlm_large_finetune.pth`, whose backbone keys use the original unilm/s3prl
names and are renamed by a fixed one-to-one table. Unlike the official script, pairs that cannot be
scored are kept in the report as failures instead of being skipped.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from intone.errors import ModelLoadError
from intone.eval.ecapa import EcapaTdnnSmall
from intone.eval.meta import MetaItem
from intone.ops.resample import resample

SAMPLE_RATE = 16000
# sha256 of the released wavlm_large_finetune.pth (1,301,926,579 bytes), see the reference §3.2.
CHECKPOINT_SHA256 = "51f07e3b94d9e0262a6a675ef5a087be3dd09e8c62e9d886827f44f82fe7f94b"
BACKBONE_PREFIX = "feature_extract.model."
# The training-time speaker classifier: present in the checkpoint, unused for embeddings.
IGNORED_PREFIX = "loss_calculator"


# ---------------------------------------------------------------- backbone config


def wavlm_large_config():
    """WavLM-Large as the checkpoint was trained (s3prl `wavlm_large`), for inference."""
    from transformers import WavLMConfig

    config = WavLMConfig(
        conv_dim=[512] * 7, conv_kernel=[10, 3, 3, 3, 3, 2, 2], conv_stride=[5, 2, 2, 2, 2, 2, 2],
        conv_bias=False, feat_extract_norm="layer", feat_extract_activation="gelu",
        do_stable_layer_norm=True, hidden_size=1024, intermediate_size=4096, hidden_act="gelu",
        num_hidden_layers=24, num_attention_heads=16, layer_norm_eps=1e-5,
        num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16,
        num_buckets=320, max_bucket_distance=800,
    )
    return _for_inference(config)


def _for_inference(config):
    """Turn off everything stochastic, and make sure the checkpoint's `mask_emb` has a home."""
    for name in ("hidden_dropout", "attention_dropout", "activation_dropout", "feat_proj_dropout",
                 "final_dropout", "layerdrop"):
        setattr(config, name, 0.0)
    # transformers only creates `masked_spec_embed` when masking is configured; the checkpoint
    # carries it (as `mask_emb`), and masking never runs in eval mode, so a non-zero value is inert.
    if not config.mask_time_prob and not config.mask_feature_prob:
        config.mask_time_prob = 0.05
    return config


def _backbone_config(wavlm_dir: Path | None):
    if wavlm_dir is None:
        return wavlm_large_config()
    from transformers import WavLMConfig

    try:
        config = WavLMConfig.from_pretrained(str(wavlm_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{wavlm_dir}: not a readable WavLM config directory ({e})") from None
    # The key table and the hidden-state convention below assume the pre-norm ("Large") layout.
    if not config.do_stable_layer_norm or config.feat_extract_norm != "layer" or config.add_adapter:
        raise ModelLoadError(
            f"{wavlm_dir}: WavLM config must have do_stable_layer_norm=true, feat_extract_norm='layer' and "
            "no adapter, like WavLM-Large")
    return _for_inference(config)


# ---------------------------------------------------------------- checkpoint key names

# One rule per backbone tensor kind: (name under `feature_extract.model.`, transformers name).
# `{n}` is a layer index, `{p}` weight or bias, `{proj}` one of the four attention projections.
# The checkpoint stores the positional conv with torch's legacy weight-norm names (g and v);
# transformers registers the same two tensors as parametrizations original0 and original1.
_KEY_RULES = (
    ("feature_extractor.conv_layers.{n}.0.weight", "feature_extractor.conv_layers.{n}.conv.weight"),
    ("feature_extractor.conv_layers.{n}.2.1.{p}", "feature_extractor.conv_layers.{n}.layer_norm.{p}"),
    ("layer_norm.{p}", "feature_projection.layer_norm.{p}"),
    ("post_extract_proj.{p}", "feature_projection.projection.{p}"),
    ("mask_emb", "masked_spec_embed"),
    ("encoder.pos_conv.0.weight_g", "encoder.pos_conv_embed.conv.parametrizations.weight.original0"),
    ("encoder.pos_conv.0.weight_v", "encoder.pos_conv_embed.conv.parametrizations.weight.original1"),
    ("encoder.pos_conv.0.bias", "encoder.pos_conv_embed.conv.bias"),
    ("encoder.layer_norm.{p}", "encoder.layer_norm.{p}"),
    ("encoder.layers.{n}.self_attn.{proj}_proj.{p}", "encoder.layers.{n}.attention.{proj}_proj.{p}"),
    ("encoder.layers.{n}.self_attn.grep_linear.{p}", "encoder.layers.{n}.attention.gru_rel_pos_linear.{p}"),
    ("encoder.layers.{n}.self_attn.grep_a", "encoder.layers.{n}.attention.gru_rel_pos_const"),
    ("encoder.layers.{n}.self_attn.relative_attention_bias.weight",
     "encoder.layers.{n}.attention.rel_attn_embed.weight"),
    ("encoder.layers.{n}.self_attn_layer_norm.{p}", "encoder.layers.{n}.layer_norm.{p}"),
    ("encoder.layers.{n}.fc1.{p}", "encoder.layers.{n}.feed_forward.intermediate_dense.{p}"),
    ("encoder.layers.{n}.fc2.{p}", "encoder.layers.{n}.feed_forward.output_dense.{p}"),
    ("encoder.layers.{n}.final_layer_norm.{p}", "encoder.layers.{n}.final_layer_norm.{p}"),
)
_SLOTS = {"n": r"\d+", "p": "weight|bias", "proj": "q|k|v|out"}


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)  # literal, slot, literal, slot, ...
    pattern = "".join(re.escape(s) if i % 2 == 0 else f"(?P<{s}>{_SLOTS[s]})" for i, s in enumerate(parts))
    return re.compile(pattern)


_TO_WAVLM = [(_template_regex(src), dst) for src, dst in _KEY_RULES]
_TO_CHECKPOINT = [(_template_regex(dst), src) for src, dst in _KEY_RULES]


def _rename(key: str, rules) -> str | None:
    for regex, template in rules:
        m = regex.fullmatch(key)
        if m:
            return template.format(**m.groupdict())
    return None


def checkpoint_to_model_key(key: str) -> str | None:
    """A checkpoint key -> the matching `SpeakerSimModel` state-dict key (`backbone.*` or `head.*`);
    None for a backbone name the table does not know."""
    if key.startswith(BACKBONE_PREFIX):
        name = _rename(key[len(BACKBONE_PREFIX):], _TO_WAVLM)
        return None if name is None else "backbone." + name
    return "head." + key  # the head is stored under its own names at the top level


def model_to_checkpoint_key(key: str) -> str:
    """Inverse of `checkpoint_to_model_key`."""
    if key.startswith("head."):
        return key[len("head."):]
    name = _rename(key.removeprefix("backbone."), _TO_CHECKPOINT) if key.startswith("backbone.") else None
    if name is None:
        raise KeyError(f"no checkpoint name for model key {key!r}")
    return BACKBONE_PREFIX + name


# ---------------------------------------------------------------- model


class SpeakerSimModel(nn.Module):
    """WavLM backbone + ECAPA head; `embed` turns one waveform into one speaker embedding."""

    def __init__(self, config):
        super().__init__()
        from transformers import WavLMModel

        self.backbone = WavLMModel(config)
        # The head mixes every hidden state: the input of each layer plus the final output.
        self.head = EcapaTdnnSmall(feat_dim=config.hidden_size, num_states=config.num_hidden_layers + 1)
        # Instance norm over time needs at least two frames.
        self.min_samples = _samples_for_frames(2, config.conv_kernel, config.conv_stride)

    def hidden_states(self, wav: Tensor) -> Tensor:
        """Mono 16 kHz waveform [N] -> stacked hidden states [layers + 1, 1, T, D], s3prl's convention."""
        # s3prl's WavLM-Large upstream (normalize=True) standardizes each waveform over its whole length.
        x = F.layer_norm(wav, wav.shape).unsqueeze(0)
        out = self.backbone(x, output_hidden_states=True)
        layers = self.backbone.config.num_hidden_layers
        if len(out.hidden_states) != layers + 1:
            raise RuntimeError(f"WavLM returned {len(out.hidden_states)} hidden states, expected {layers + 1}")
        # transformers' last entry is the last layer's output before the encoder's final layer
        # norm; s3prl's is the normed encoder output, which is `last_hidden_state`.
        return torch.stack([*out.hidden_states[:layers], out.last_hidden_state])

    @torch.inference_mode()
    def embed(self, wav: Tensor, sample_rate: int) -> Tensor:
        """Mono waveform [N] at any rate -> embedding [emb_dim] (float32, on the model's device)."""
        device = next(self.parameters()).device
        wav = resample(wav.to(device=device, dtype=torch.float32), sample_rate, SAMPLE_RATE)
        if wav.shape[-1] < self.min_samples:
            raise ValueError(f"audio too short: {wav.shape[-1]} samples at 16 kHz, need {self.min_samples}")
        return self.head(self.hidden_states(wav))[0]

    def checkpoint_state_dict(self) -> dict[str, Tensor]:
        """This model's tensors under the checkpoint's key names (for writing test checkpoints)."""
        return {model_to_checkpoint_key(k): v for k, v in self.state_dict().items()}


def _samples_for_frames(frames: int, kernels, strides) -> int:
    """Fewest input samples for which the conv feature extractor yields `frames` frames."""
    span = frames
    for k, s in zip(reversed(list(kernels)), reversed(list(strides))):
        span = (span - 1) * s + k
    return span


def load_sim_model(checkpoint: Path, wavlm_dir: Path | None = None, device: str | torch.device = "cpu") -> SpeakerSimModel:
    """Build the SIM model and load every tensor from `checkpoint` (`torch.load(...)["model"]`).

    Loading is strict: each model tensor must be present with its shape, and only the unused
    `loss_calculator*` tensors may be left over. Upstream loads with strict=False, so a renamed key
    would silently score with random weights; here it is a ModelLoadError naming the key.
    """
    checkpoint = Path(checkpoint)
    config = _backbone_config(wavlm_dir)
    state = _read_state_dict(checkpoint)
    with torch.device("meta"):  # shapes only: every tensor is replaced by the checkpoint's
        model = SpeakerSimModel(config)
    model.load_state_dict(_matched_state(state, model, checkpoint), strict=True, assign=True)
    return model.to(device).eval()


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: SIM checkpoint not found")
    try:
        obj = _torch_load(path)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable torch checkpoint ({e})") from None
    state = obj.get("model") if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ModelLoadError(f"{path}: expected a dict with a 'model' state dict of tensors")
    return state


def _torch_load(path: Path):
    mmap = zipfile.is_zipfile(path)  # torch can only memory-map the zip format
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # Not plain tensors (or not a pickle at all); unpickle fully only the pinned release.
        if _sha256(path) != CHECKPOINT_SHA256:
            # torch wraps the actual refusal ("Unsupported operand ...") in a long generic text.
            detail = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", str(e), re.S)
            reason = detail.group(1).strip() if detail else type(e).__name__
            raise ModelLoadError(f"{path}: cannot be read as plain tensors ({reason}), and it is not the "
                                 f"pinned wavlm_large_finetune.pth (sha256 {CHECKPOINT_SHA256})") from None
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _matched_state(state: dict[str, Tensor], model: SpeakerSimModel, path: Path) -> dict[str, Tensor]:
    """Rename checkpoint tensors to model keys; raise on any missing, unexpected or misshapen one."""
    wanted = model.state_dict()
    renamed, unexpected = {}, []
    for key, tensor in state.items():
        if key.startswith(IGNORED_PREFIX):
            continue
        name = checkpoint_to_model_key(key)
        if name not in wanted:
            unexpected.append(key)
        elif tensor.shape != wanted[name].shape:
            raise ModelLoadError(f"{path}: {key} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(wanted[name].shape)}")
        else:
            # The reference runs in float32 whatever the stored precision.
            renamed[name] = tensor.float() if tensor.is_floating_point() else tensor
    missing = [model_to_checkpoint_key(k) for k in wanted if k not in renamed]
    if missing or unexpected:
        problems = [f"{len(missing)} missing key(s), first {missing[0]!r}" if missing else "",
                    f"{len(unexpected)} unexpected key(s), first {unexpected[0]!r}" if unexpected else ""]
        raise ModelLoadError(f"{path}: checkpoint does not match the SIM model: "
                             + "; ".join(p for p in problems if p))
    return renamed


# ---------------------------------------------------------------- scoring


@dataclass
class SimRecord:
    utt_id: str
    gen_wav: str
    prompt_wav: str | None
    sim: float | None = None  # raw cosine in [-1, 1]
    error: str | None = None


@dataclass
class SimReport:
    records: list[SimRecord] = field(default_factory=list)

    def summary(self) -> dict:
        sims = np.array([r.sim for r in self.records if r.sim is not None], dtype=np.float64)
        mean = float(sims.mean()) if sims.size else None
        return {
            "sim_mean": None if mean is None else round(mean, 4),
            # Papers and leaderboards print SIM x100; the raw mean above is what is stored.
            "sim_mean_x100": None if mean is None else round(mean * 100, 2),
            "sim_var": None if mean is None else round(float(sims.var()), 6),  # population var, as average.py
            "evaluated": int(sims.size),
            "failures": len(self.records) - int(sims.size),
        }

    def to_json(self) -> str:
        body = {"summary": self.summary(), "records": [asdict(r) for r in self.records]}
        return json.dumps(body, indent=2, ensure_ascii=False)


class PairError(Exception):
    """One side of a pair cannot be embedded; the message becomes the record's error."""


def evaluate_sim(audio_dir: Path, items: list[MetaItem], checkpoint: Path, wavlm_dir: Path | None = None,
                 device: str | torch.device = "cpu", progress: bool = True) -> SimReport:
    """Score `<audio_dir>/<utt_id>.wav` against each item's prompt wav with the official SIM model."""
    model = load_sim_model(checkpoint, wavlm_dir, device)
    return score_items(model, Path(audio_dir), items, progress)


def score_items(model: SpeakerSimModel, audio_dir: Path, items: list[MetaItem], progress: bool = True) -> SimReport:
    """Score every item with an already loaded model; each pair is scored or recorded as a failure."""
    prompt_cache: dict[Path, Tensor | PairError] = {}  # prompts repeat across rows
    report = SimReport()
    for item in tqdm(items, desc="SIM", unit="pair", disable=not progress):
        gen = Path(audio_dir) / f"{item.utt_id}.wav"
        record = SimRecord(item.utt_id, str(gen), None if item.prompt_wav is None else str(item.prompt_wav))
        try:
            prompt_emb = _cached_embedding(model, item.prompt_wav, prompt_cache)
            gen_emb = _embed_file(model, gen, "generated")
            record.sim = float(F.cosine_similarity(gen_emb, prompt_emb, dim=0))
        except PairError as e:
            record.error = str(e)
        report.records.append(record)
    return report


def _cached_embedding(model: SpeakerSimModel, prompt: Path | None, cache: dict) -> Tensor:
    if prompt is None:
        raise PairError("no prompt wav in the meta list")
    if prompt not in cache:
        try:
            cache[prompt] = _embed_file(model, prompt, "prompt")
        except PairError as e:
            cache[prompt] = e  # a bad prompt fails each of its rows without being re-read
    hit = cache[prompt]
    if isinstance(hit, PairError):
        raise hit
    return hit


def _embed_file(model: SpeakerSimModel, path: Path, role: str) -> Tensor:
    wav, rate = _read_first_channel(path, role)
    try:
        return model.embed(wav, rate)
    except (ValueError, RuntimeError) as e:
        raise PairError(f"{role} wav {path}: cannot embed ({e})") from None


def _read_first_channel(path: Path, role: str) -> tuple[Tensor, int]:
    """The official loader keeps only the first channel (it never downmixes)."""
    if not path.is_file():
        raise PairError(f"{role} wav missing: {path}")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise PairError(f"{role} wav {path}: unreadable ({e})") from None
    if data.shape[0] == 0:
        raise PairError(f"{role} wav {path}: empty")
    if not np.isfinite(data[:, 0]).all():
        raise PairError(f"{role} wav {path}: NaN or infinite samples")
    return torch.from_numpy(np.ascontiguousarray(data[:, 0])), int(rate)
