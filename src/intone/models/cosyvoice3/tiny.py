"""`intone make-tiny cosyvoice3 DIR`: a small random checkpoint in the real on-disk layout.

cosyvoice3.yaml (HyperPyYAML, the official structure with small sizes), llm.pt, flow.pt,
hift.pt (weight norm in the `parametrizations` form the released file uses),
CosyVoice-BlankEN/ (Qwen2 config, vocab.json + merges.txt + tokenizer_config.json,
model.safetensors) and the two ONNX frontend models. The loader has no tiny-specific path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from intone.models.cosyvoice3.codec_config import tiny_codec, yaml_text
from intone.models.cosyvoice3.talker import CosyTalker, QwenShape
from intone.models.cosyvoice3.tiny_onnx import export_tiny_campplus, export_tiny_speech_tokenizer
from intone.models.cosyvoice3.tokenizer import SPECIAL_TOKENS
from intone.models.fish_s2.tiny import CORPUS, QWEN_SPLIT

QWEN_OWN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_QWEN = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192)
TINY_FLOW = dict(dim=64, depth=2, heads=4, dim_head=16, ff_mult=2, lookahead_channels=32)
TINY_HIFT = dict(base_channels=16, f0_channels=16)
# The tiny talker's head is scaled so that random utterances run for a while (mostly 1-6 s)
# before one of the 200 stop ids wins, like real speech.
HEAD_STD, STOP_ROW_SCALE = 0.3, 0.6


def make_tiny_cosyvoice3(out_dir: str | Path, seed: int = 0) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab_size = _write_blank_en(out / "CosyVoice-BlankEN")
    shape = QwenShape(vocab_size=vocab_size, tie_word_embeddings=True, **TINY_QWEN)
    _write_talker(out, shape)
    _write_codec(out)
    export_tiny_speech_tokenizer(out / "speech_tokenizer_v3.onnx", seed=seed)
    export_tiny_campplus(out / "campplus.onnx", seed=seed)
    (out / "cosyvoice3.yaml").write_text(model_yaml(TINY_QWEN["hidden_size"], TINY_FLOW, TINY_HIFT))
    (out / "configuration.json").write_text(json.dumps({"framework": "pytorch", "task": "text-to-speech"}) + "\n")
    return out


def _write_blank_en(folder: Path) -> int:
    """A byte-level BPE in Qwen2's files; returns the embedding rows (vocab + specials, rounded up)."""
    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(CORPUS.splitlines(), trainer)
    bpe.model.save(str(folder))
    base = bpe.get_vocab_size()
    added = {str(base + i): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False,
                                 special=True) for i, t in enumerate(QWEN_OWN_SPECIALS)}
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="Qwen2Tokenizer", added_tokens_decoder=added, additional_special_tokens=QWEN_OWN_SPECIALS[1:],
        bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None, errors="replace",
        model_max_length=32768, split_special_tokens=False, clean_up_tokenization_spaces=False,
    ), indent=2) + "\n")
    total = base + len(QWEN_OWN_SPECIALS) + len(SPECIAL_TOKENS)
    return -(-total // 64) * 64


def _write_talker(out: Path, shape: QwenShape) -> None:
    folder = out / "CosyVoice-BlankEN"
    config = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", torch_dtype="bfloat16",
                  bos_token_id=None, eos_token_id=None, use_sliding_window=False, sliding_window=None,
                  attention_dropout=0.0, initializer_range=0.02, use_cache=True, max_window_layers=shape.num_hidden_layers,
                  **{k: getattr(shape, k) for k in QwenShape.__dataclass_fields__})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 2048}) + "\n")
    talker = CosyTalker(shape)
    with torch.no_grad():
        for name, p in talker.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 if "proj" in name else 1.0)
        talker.llm_decoder.weight.normal_(0.0, HEAD_STD)
        talker.llm_decoder.weight[6561:] *= STOP_ROW_SCALE
    state = talker.state_dict()
    torch.save(state, out / "llm.pt")
    backbone = {k[len("llm.model."):]: v.to(torch.bfloat16).contiguous() for k, v in state.items()
                if k.startswith("llm.model.") and not k.endswith("lm_head.weight")}
    save_file(backbone, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_codec(out: Path) -> None:
    flow_state, hift_state = tiny_codec(TINY_FLOW, TINY_HIFT)
    torch.save(flow_state, out / "flow.pt")
    torch.save(hift_state, out / "hift.pt")


def model_yaml(llm_size: int, flow: dict, hift: dict) -> str:
    return yaml_text(llm_size, flow, hift)
