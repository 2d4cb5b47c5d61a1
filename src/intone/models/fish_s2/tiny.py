"""`intone make-tiny fish-s2 DIR`: a small random checkpoint in the real on-disk layout.

File names, tensor names, config keys, weight-norm key forms and special-token strings are
those of the real checkpoint; only the sizes shrink. The loader has no tiny-specific path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from intone.models.fish_s2.codec import CodecConfig, FishCodec, unfold_weight_norm
from intone.models.fish_s2.config import FishS2Config
from intone.models.fish_s2.prompt import NUM_SEMANTIC, SEMANTIC_TEMPLATE
from intone.models.fish_s2.transformer import DualARTransformer

# Qwen3's own specials (ids 151643..151668 in the real vocabulary), then the Fish specials.
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
FISH_SPECIALS = [
    "<|pad|>", "<|phoneme_start|>", "<|phoneme_end|>", "<|text|>", "<|voice|>", "<|interleave|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
]
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = """\
Hello world. This is a tiny text to speech model, made of random numbers, for tests.
The quick brown fox jumps over the lazy dog while the rain falls on the quiet town.
Convert the provided text to speech reference to the following: text and speech.
She said that the weather would be fine tomorrow, and we believed her every word.
Numbers like 1, 2, 3 and 2048 appear in speech too; so do questions, don't they?
Streaming audio arrives in chunks, frame after frame, exactly once and in order.
"""

TINY_TEXT = dict(dim=128, n_layer=2, n_head=4, n_local_heads=2, head_dim=32, intermediate_size=256)
TINY_FAST = dict(dim=128, n_layer=2, n_head=4, n_local_heads=2, head_dim=32, intermediate_size=256)
TINY_CODEC = CodecConfig(encoder_dim=8, decoder_dim=64, encoder_transformer_layers=(0, 0, 0, 1), quantizer_layers=2)
TINY_MAX_SEQ_LEN = 4096
FIXTURE_PRE_TANH_RMS = 16.226707458496094  # the random codec's output RMS before its last conv is scaled


def make_tiny_fish_s2(out_dir: str | Path, seed: int = 0) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tokenizer = _write_tokenizer(out)
    config = _config(tokenizer)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    cfg = FishS2Config.from_dict(config)
    lm = DualARTransformer(cfg, config["semantic_start_token_id"], config["semantic_end_token_id"])
    _init_lm(lm)
    # Random weights almost never pick <|im_end|> (1 of 4097). A longer stop embedding makes
    # generations end after a few seconds, like speech does, and lengths vary per seed.
    with torch.no_grad():
        lm.text_model.model.embeddings.weight[config["eos_token_id"]] *= 2.5
    _write_sharded(out, {k: v.contiguous() for k, v in lm.state_dict().items()})
    codec = FishCodec(TINY_CODEC)
    _init_codec(codec)
    torch.save(unfold_weight_norm(codec.state_dict()), out / "codec.pth")
    return out


def _write_tokenizer(out: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    specials = QWEN_SPECIALS + FISH_SPECIALS
    tok.add_special_tokens(specials + [SEMANTIC_TEMPLATE.format(i) for i in range(NUM_SEMANTIC)])
    tok.save(str(out / "tokenizer.json"))

    # Like a Hugging Face save: every added token listed, semantic ones included.
    added = {
        str(tok.token_to_id(t)): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
        for t in specials + [SEMANTIC_TEMPLATE.format(i) for i in range(NUM_SEMANTIC)]
    }
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        add_bos_token=False, add_prefix_space=False, added_tokens_decoder=added, bos_token=None,
        clean_up_tokenization_spaces=False, eos_token="<|im_end|>", errors="replace",
        model_max_length=TINY_MAX_SEQ_LEN, pad_token="<|pad|>", split_special_tokens=False,
        tokenizer_class="Qwen2Tokenizer", unk_token=None,
    ), indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(dict(
        additional_special_tokens=FISH_SPECIALS[1:], eos_token="<|im_end|>", pad_token="<|pad|>",
    ), indent=2) + "\n")
    return tok


def _config(tok: Tokenizer) -> dict:
    vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab = math.ceil((vocab + 2) / 64) * 64  # the real table also has spare rows
    common = dict(rope_base=1000000.0, norm_eps=1e-6, attention_qkv_bias=False, attention_o_bias=False)
    return dict(
        architectures=["FishQwen3OmniForCausalLM"],
        model_type="fish_qwen3_omni",
        dtype="bfloat16",
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
        audio_pad_token_id=tok.token_to_id("<|audio_pad|>"),
        semantic_start_token_id=tok.token_to_id(SEMANTIC_TEMPLATE.format(0)),
        semantic_end_token_id=tok.token_to_id(SEMANTIC_TEMPLATE.format(NUM_SEMANTIC - 1)),
        text_config=dict(
            model_type="fish_qwen3", **TINY_TEXT, vocab_size=vocab, max_seq_len=TINY_MAX_SEQ_LEN,
            tie_word_embeddings=True, attention_qk_norm=True, **common,
        ),
        audio_decoder_config=dict(
            model_type="fish_qwen3_audio_decoder", **TINY_FAST, max_seq_len=11, num_codebooks=10,
            vocab_size=NUM_SEMANTIC, text_dim=TINY_TEXT["dim"], attention_qk_norm=False, **common,
        ),
    )


def _init_lm(lm: nn.Module) -> None:
    for module in lm.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)  # the official initializer_range
        if isinstance(module, nn.RMSNorm) or type(module).__name__ == "RMSNorm":
            nn.init.normal_(module.weight, mean=1.0, std=0.1)


def _init_codec(codec: nn.Module) -> None:
    """Scaled so that random codes decode to audible, not silent, audio."""
    for module in codec.modules():
        if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)):
            fan_in = module.weight[0].numel() if isinstance(module, nn.Conv1d) else module.weight.shape[1] * (
                module.weight.shape[-1] if module.weight.dim() == 3 else 1)
            nn.init.normal_(module.weight, std=1.0 / math.sqrt(fan_in))
            if module.bias is not None:
                nn.init.normal_(module.bias, std=0.01)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight)
    for name, p in codec.named_parameters():
        if name.endswith("alpha"):
            nn.init.uniform_(p, 0.5, 1.5)
    _calibrate_loudness(codec)


@torch.no_grad()
def _calibrate_loudness(codec: FishCodec, target_rms: float = 0.1) -> None:
    """Scale the last conv so random codes decode to ~target RMS, clear of tanh saturation."""
    codes = torch.randint(0, codec.cfg.codebook_size, (1, codec.cfg.num_codebooks, 32))
    z = codec.quantizer.decode(codes)
    pre_tanh = codec.decoder.model[:-1](z)
    last = codec.decoder.model[-2].conv
    rms = pre_tanh.pow(2).mean().sqrt().item()
    # The convolutions' float32 rounding differs between CPUs in the last bit; taking the value measured
    # where the parity fixtures were made keeps the checkpoint (and their digest) the same everywhere.
    if abs(rms / FIXTURE_PRE_TANH_RMS - 1) < 1e-5:
        rms = FIXTURE_PRE_TANH_RMS
    scale = target_rms / rms
    last.weight *= scale
    last.bias *= scale


def _write_sharded(out: Path, state: dict[str, torch.Tensor]) -> None:
    """Two shards and an index, as the real checkpoint is stored."""
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    total = 0
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, str(out / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
        total += sum(state[n].numel() * state[n].element_size() for n in part)
    index = dict(metadata=dict(total_size=total), weight_map=weight_map)
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
