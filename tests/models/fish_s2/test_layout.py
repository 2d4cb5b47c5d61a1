"""The on-disk checkpoint layout: tiny round trip, real-size architecture, strict loading errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from intone.errors import ModelLoadError
from intone.models.fish_s2 import FishS2
from intone.models.fish_s2.codec import CodecConfig, FishCodec, unfold_weight_norm
from intone.models.fish_s2.config import S2_PRO_CONFIG, FishS2Config
from intone.models.fish_s2.loader import read_codec_weights, read_lm_weights
from intone.models.fish_s2.transformer import DualARTransformer
from intone.models.registry import load_model

REAL_CONFIG = S2_PRO_CONFIG


def test_tiny_layout_has_the_real_files(tiny_fish_dir):
    names = {p.name for p in tiny_fish_dir.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "codec.pth", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names
    index = json.loads((tiny_fish_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {n for n in names if n.endswith(".safetensors")}
    lm_keys = set(index["weight_map"])
    assert "text_model.model.embeddings.weight" in lm_keys
    assert "audio_decoder.codebook_embeddings.weight" in lm_keys
    assert not any("lm_head" in k or "project_in" in k for k in lm_keys)
    codec_keys = set(torch.load(tiny_fish_dir / "codec.pth", weights_only=True))
    assert "decoder.model.0.conv.parametrizations.weight.original0" in codec_keys
    assert "quantizer.quantizer.quantizers.0.in_proj.weight_g" in codec_keys


def test_tiny_round_trip_loads_strictly(tiny_fish_dir, tiny_fish):
    state, _ = read_lm_weights(tiny_fish_dir)
    assert set(state) == set(tiny_fish.lm.state_dict())
    for name, tensor in tiny_fish.lm.state_dict().items():
        assert torch.equal(tensor, state[name].float()), name


def test_real_size_architecture_on_meta():
    cfg = FishS2Config.from_dict(REAL_CONFIG)
    assert cfg.fast.qk_norm is False and cfg.slow.qk_norm is True
    with torch.device("meta"):
        lm = DualARTransformer(cfg, 151678, 155773)
        codec = FishCodec(CodecConfig())
    lm_state = lm.state_dict()
    assert len(lm_state) == 358  # 2 + 36 * 9 + 4 + 4 * 7
    assert lm_state["text_model.model.layers.0.attention.wqkv.weight"].shape == (6144, 2560)
    assert lm_state["text_model.model.embeddings.weight"].shape == (155776, 2560)
    assert lm_state["audio_decoder.codebook_embeddings.weight"].shape == (40960, 2560)
    assert lm_state["audio_decoder.output.weight"].shape == (4096, 2560)
    total = sum(t.numel() for t in lm_state.values())
    assert 4.4e9 < total < 4.7e9
    # The official codec class: 535 tensors with its weight-norm keys; ~184.5M decode-path parameters.
    assert len(unfold_weight_norm(codec.state_dict())) == 535
    decode_path = sum(p.numel() for n, p in codec.named_parameters()
                      if not n.startswith(("encoder.", "quantizer.pre_module", "quantizer.downsample")))
    assert abs(decode_path - 184.5e6) < 0.5e6


def test_single_file_safetensors_loads_like_shards(tiny_copy, tiny_fish):
    state, _ = read_lm_weights(tiny_copy)
    for f in tiny_copy.glob("model-*.safetensors"):
        f.unlink()
    (tiny_copy / "model.safetensors.index.json").unlink()
    save_file(state, str(tiny_copy / "model.safetensors"))
    model = FishS2.load(tiny_copy)
    w = model.lm.text_model.model.embeddings.weight
    assert torch.equal(w, tiny_fish.lm.text_model.model.embeddings.weight)


def test_codec_key_forms_and_prefix_give_the_same_codec(tiny_copy, tiny_fish):
    raw = torch.load(tiny_copy / "codec.pth", weights_only=True)
    # Every weight-normed conv in the legacy weight_g/weight_v form, under 'generator.' and 'state_dict'.
    legacy = {}
    for k, v in raw.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g").replace(".parametrizations.weight.original1", ".weight_v")
        legacy["generator." + k] = v
    legacy["discriminator.x"] = torch.zeros(1)  # other training state is ignored
    torch.save({"state_dict": legacy}, tiny_copy / "codec.pth")
    model = FishS2.load(tiny_copy)
    codes = torch.randint(0, 1024, (1, 10, 6))
    assert torch.allclose(model.decode(codes), tiny_fish.decode(codes), atol=1e-6)


@pytest.mark.parametrize("damage, message", [
    ("drop_lm_tensor", "missing tensor 'audio_decoder.norm.weight'"),
    ("extra_lm_tensor", "unexpected tensor 'text_model.model.bogus.weight'"),
    ("reshape_lm_tensor", "tensor 'audio_decoder.norm.weight' has shape (3,)"),
    ("drop_codec_tensor", "missing tensor 'decoder.model.5.alpha'"),
    ("drop_weight_norm_half", "weight-norm"),
    ("no_config", "config.json: file not found"),
    ("bad_config", "config.json: not valid JSON"),
    ("config_missing_key", "missing key 'audio_decoder_config'"),
    ("no_codec", "codec.pth: file not found"),
    ("no_tokenizer", "tokenizer.json"),
    ("no_weights", "no model.safetensors"),
])
def test_load_errors_name_the_file_and_tensor(tiny_copy, damage, message):
    index = json.loads((tiny_copy / "model.safetensors.index.json").read_text())
    shard_of = index["weight_map"]

    def edit_shard(key, fn):
        path = tiny_copy / shard_of[key]
        state = load_file(str(path))
        fn(state)
        save_file(state, str(path))

    def edit_codec(fn):
        state = torch.load(tiny_copy / "codec.pth", weights_only=True)
        fn(state)
        torch.save(state, tiny_copy / "codec.pth")

    if damage == "drop_lm_tensor":
        edit_shard("audio_decoder.norm.weight", lambda s: s.pop("audio_decoder.norm.weight"))
        del index["weight_map"]["audio_decoder.norm.weight"]
        (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    elif damage == "extra_lm_tensor":
        edit_shard("audio_decoder.norm.weight", lambda s: s.update({"text_model.model.bogus.weight": torch.zeros(2)}))
    elif damage == "reshape_lm_tensor":
        edit_shard("audio_decoder.norm.weight", lambda s: s.update({"audio_decoder.norm.weight": torch.zeros(3)}))
    elif damage == "drop_codec_tensor":
        edit_codec(lambda s: s.pop("decoder.model.5.alpha"))
    elif damage == "drop_weight_norm_half":
        edit_codec(lambda s: s.pop("decoder.model.0.conv.parametrizations.weight.original0"))
    elif damage == "no_config":
        (tiny_copy / "config.json").unlink()
    elif damage == "bad_config":
        (tiny_copy / "config.json").write_text("{not json")
    elif damage == "config_missing_key":
        cfg = json.loads((tiny_copy / "config.json").read_text())
        del cfg["audio_decoder_config"]
        (tiny_copy / "config.json").write_text(json.dumps(cfg))
    elif damage == "no_codec":
        (tiny_copy / "codec.pth").unlink()
    elif damage == "no_tokenizer":
        (tiny_copy / "tokenizer.json").unlink()
    elif damage == "no_weights":
        for f in tiny_copy.glob("model*"):
            f.unlink()
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tiny_copy))
    assert message in str(err.value)


def test_codec_reader_accepts_plain_state_dict(tiny_fish_dir):
    state = read_codec_weights(tiny_fish_dir / "codec.pth")
    assert any(k.startswith("decoder.") for k in state)
