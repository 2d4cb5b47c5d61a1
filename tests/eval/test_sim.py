"""SIM (speaker similarity): checkpoint key remap, strict loading, embedding and scoring.

Everything runs on a tiny random WavLM; the real checkpoint is only checked by its key names and
shapes (on the meta device), never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

pytest.importorskip("transformers")

from transformers import WavLMConfig  # noqa: E402

from intone.eval.meta import MetaItem  # noqa: E402
from intone.errors import ModelLoadError  # noqa: E402
from intone.eval import sim  # noqa: E402
from intone.eval.sim import (  # noqa: E402
    SpeakerSimModel,
    checkpoint_to_model_key,
    evaluate_sim,
    load_sim_model,
    model_to_checkpoint_key,
    wavlm_large_config,
)

TINY = dict(
    conv_dim=[16, 16, 16], conv_kernel=[10, 4, 4], conv_stride=[5, 8, 8], conv_bias=False,  # 320x hop, like WavLM
    feat_extract_norm="layer", do_stable_layer_norm=True, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=2, num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
    num_buckets=16, max_bucket_distance=40,
)
LOSS_KEY = "loss_calculator.projection.weight"


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """The tensors here are tiny, so intra-op threading only adds overhead (tens of ms per op
    when the CPU is shared); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randomize_untrained_defaults(model: SpeakerSimModel) -> None:
    """Tensors that start as constants (mixing weights, BN statistics, norms) get random values,
    so a tensor loaded into the wrong slot would show."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if "running_var" in name or "original0" in name:
                t.copy_(torch.rand_like(t) + 0.5)
            elif "running_mean" in name or "feature_weight" in name or "norm" in name or "gru_rel_pos_const" in name:
                t.add_(torch.randn_like(t) * 0.3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny config dir and a checkpoint written under the real unilm/s3prl key names."""
    root = tmp_path_factory.mktemp("sim")
    torch.manual_seed(0)
    config = sim._for_inference(WavLMConfig(**TINY))
    config.save_pretrained(root / "wavlm")
    source = SpeakerSimModel(config).eval()
    _randomize_untrained_defaults(source)
    state = source.checkpoint_state_dict()
    state[LOSS_KEY] = torch.randn(7, 256)
    torch.save({"model": state}, root / "ckpt.pth")
    return root, state


def _save_variant(tmp_path: Path, state: dict) -> Path:
    path = tmp_path / "variant.pth"
    torch.save({"model": state}, path)
    return path


# ---------------------------------------------------------------- loading


def test_load_is_exact_and_tolerates_loss_calculator(tiny):
    root, state = tiny
    model = load_sim_model(root / "ckpt.pth", root / "wavlm")
    assert not model.training
    loaded = model.checkpoint_state_dict()
    assert set(loaded) == set(state) - {LOSS_KEY}
    for key, tensor in loaded.items():
        assert not tensor.is_meta, key
        assert torch.equal(tensor, state[key]), key
    assert model.head.feature_weight.shape == (TINY["num_hidden_layers"] + 1,)


@pytest.mark.parametrize("drop", [
    "feature_extract.model.encoder.layers.1.fc2.bias",
    "feature_extract.model.encoder.pos_conv.0.weight_g",
    "layer3.Res2Conv1dReluBn.bns.6.running_var",
    "feature_weight",
])
def test_missing_key_is_named(tiny, tmp_path, drop):
    _, state = tiny
    path = _save_variant(tmp_path, {k: v for k, v in state.items() if k != drop})
    with pytest.raises(ModelLoadError, match=rf"variant\.pth.*1 missing key\(s\), first '{drop}'"):
        load_sim_model(path, tiny[0] / "wavlm")


@pytest.mark.parametrize("extra", [
    "feature_extract.model.encoder.layers.0.self_attn.bogus.weight",
    "feature_extract.model.final_proj.weight",
    "layer5.conv.weight",
])
def test_unexpected_key_is_named(tiny, tmp_path, extra):
    _, state = tiny
    path = _save_variant(tmp_path, {**state, extra: torch.zeros(3)})
    with pytest.raises(ModelLoadError, match=rf"variant\.pth.*1 unexpected key\(s\), first '{extra}'"):
        load_sim_model(path, tiny[0] / "wavlm")


def test_wrong_shape_is_named(tiny, tmp_path):
    _, state = tiny
    key = "feature_extract.model.post_extract_proj.weight"
    path = _save_variant(tmp_path, {**state, key: torch.zeros(3, 3)})
    with pytest.raises(ModelLoadError, match=rf"{key} has shape \(3, 3\)"):
        load_sim_model(path, tiny[0] / "wavlm")


def test_unreadable_checkpoint_and_config(tiny, tmp_path):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="bad.pth"):
        load_sim_model(bad, tiny[0] / "wavlm")
    with pytest.raises(ModelLoadError, match="not found"):
        load_sim_model(tmp_path / "absent.pth", tiny[0] / "wavlm")
    WavLMConfig(**{**TINY, "do_stable_layer_norm": False}).save_pretrained(tmp_path / "post_norm")
    with pytest.raises(ModelLoadError, match="do_stable_layer_norm"):
        load_sim_model(tiny[0] / "ckpt.pth", tmp_path / "post_norm")


# ---------------------------------------------------------------- the real checkpoint's layout


def test_full_size_model_has_the_checkpoint_key_set():
    config = wavlm_large_config()
    with torch.device("meta"):
        model = SpeakerSimModel(config)
    names = model.checkpoint_state_dict()
    expected = {**{k: tuple(v.shape) for k, v in names.items()}, LOSS_KEY: None}
    backbone = [k for k in expected if k.startswith("feature_extract.model.")]
    head = [k for k in expected if not k.startswith(("feature_extract.", "loss_calculator", "feature_weight"))]
    print(f"\nSIM checkpoint keys: {len(expected)} = {len(backbone)} backbone + 1 feature_weight"
          f" + {len(head)} head + 1 loss_calculator")
    assert len(backbone) == 488
    assert len(head) == 221
    assert len(expected) == 711
    # Names and shapes quoted from the checkpoint's description (reference §3.2).
    shapes = {
        "feature_weight": (25,),
        "feature_extract.model.mask_emb": (1024,),
        "feature_extract.model.feature_extractor.conv_layers.0.0.weight": (512, 1, 10),
        "feature_extract.model.feature_extractor.conv_layers.6.2.1.bias": (512,),
        "feature_extract.model.layer_norm.weight": (512,),
        "feature_extract.model.post_extract_proj.weight": (1024, 512),
        "feature_extract.model.encoder.pos_conv.0.weight_g": (1, 1, 128),
        "feature_extract.model.encoder.pos_conv.0.weight_v": (1024, 64, 128),
        "feature_extract.model.encoder.layers.0.self_attn.relative_attention_bias.weight": (320, 16),
        "feature_extract.model.encoder.layers.23.self_attn.grep_linear.weight": (8, 64),
        "feature_extract.model.encoder.layers.23.self_attn.grep_a": (1, 16, 1, 1),
        "feature_extract.model.encoder.layers.23.fc1.weight": (4096, 1024),
        "feature_extract.model.encoder.layer_norm.bias": (1024,),
        "layer1.conv.weight": (512, 1024, 5),
        "layer4.Res2Conv1dReluBn.convs.6.weight": (64, 64, 3),
        "layer2.SE_Connect.linear1.weight": (128, 512),
        "conv.weight": (1536, 1536, 1),
        "pooling.linear1.weight": (128, 1536, 1),
        "pooling.linear2.weight": (1536, 128, 1),
        "bn.running_var": (3072,),
        "bn.num_batches_tracked": (),
        "linear.weight": (256, 3072),
    }
    for key, shape in shapes.items():
        assert expected.get(key) == shape, key
    # Relative position embeddings live in the first layer only.
    assert sum("relative_attention_bias" in k for k in backbone) == 1
    assert not any("shortcut" in k for k in head)


def test_key_remap_is_one_to_one():
    with torch.device("meta"):
        model = SpeakerSimModel(wavlm_large_config())
    model_keys = list(model.state_dict())
    checkpoint_keys = [model_to_checkpoint_key(k) for k in model_keys]
    assert len(set(checkpoint_keys)) == len(model_keys)
    assert [checkpoint_to_model_key(k) for k in checkpoint_keys] == model_keys
    assert checkpoint_to_model_key("feature_extract.model.encoder.layers.0.self_attn.nope") is None
    with pytest.raises(KeyError):
        model_to_checkpoint_key("backbone.encoder.nope")


# ---------------------------------------------------------------- embedding and scoring


@pytest.fixture(scope="module")
def tiny_model(tiny):
    root, _ = tiny
    return load_sim_model(root / "ckpt.pth", root / "wavlm")


def test_hidden_states_follow_s3prl(tiny_model):
    wav = torch.randn(8000) * 0.1
    with torch.inference_mode():
        states = tiny_model.hidden_states(wav)
        out = tiny_model.backbone(torch.nn.functional.layer_norm(wav, wav.shape)[None], output_hidden_states=True)
    assert states.shape[0] == TINY["num_hidden_layers"] + 1
    # Layer inputs first, then the encoder's final layer-normed output (not the raw last layer).
    assert torch.equal(states[0], out.hidden_states[0])
    assert torch.equal(states[-1], out.last_hidden_state)


def test_embedding_resamples_and_is_scale_invariant(tiny_model):
    t = np.arange(24000) / 24000
    wav = torch.from_numpy((0.3 * np.sin(2 * np.pi * 180 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32))
    emb = tiny_model.embed(wav, 24000)
    assert emb.shape == (256,) and torch.isfinite(emb).all()
    # The per-waveform layer norm makes the embedding independent of loudness.
    louder = tiny_model.embed(wav * 3, 24000)
    assert torch.nn.functional.cosine_similarity(emb, louder, dim=0) > 1 - 1e-5
    with pytest.raises(ValueError, match="too short"):
        tiny_model.embed(torch.zeros(50), 16000)


def _voice(seconds: float, pitch: float, rate: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    voiced = sum(np.sin(2 * np.pi * k * pitch * t) / k for k in range(1, 5))
    return (0.2 * voiced * np.abs(np.sin(2 * np.pi * 3 * t)) + 0.01 * g.standard_normal(t.size)).astype(np.float32)


def test_evaluate_sim_end_to_end(tiny, tmp_path, monkeypatch):
    root, _ = tiny
    prompts, gen = tmp_path / "prompt-wavs", tmp_path / "gen"
    prompts.mkdir()
    gen.mkdir()
    voice_a, voice_b = _voice(1.0, 120, 24000, 1), _voice(0.8, 210, 24000, 2)
    sf.write(prompts / "a.wav", voice_a, 24000)
    sf.write(prompts / "b.wav", voice_b, 24000)
    sf.write(gen / "same.wav", voice_a, 24000)
    # A stereo file is read as its first channel, like the official loader.
    sf.write(gen / "stereo.wav", np.stack([voice_a, voice_b[: voice_a.size // 2].repeat(2)], axis=1), 24000)
    sf.write(gen / "other.wav", voice_b, 24000)
    sf.write(gen / "tiny.wav", np.zeros(20, np.float32), 16000)
    sf.write(gen / "bad_prompt.wav", voice_a, 24000)
    sf.write(gen / "no_prompt.wav", voice_a, 24000)
    (gen / "garbage.wav").write_bytes(b"RIFF garbage")
    items = [
        MetaItem("same", "t", "p", prompts / "a.wav", 1),
        MetaItem("stereo", "t", "p", prompts / "a.wav", 2),
        MetaItem("other", "t", "p", prompts / "a.wav", 3),
        MetaItem("missing", "t", "p", prompts / "a.wav", 4),
        MetaItem("tiny", "t", "p", prompts / "b.wav", 5),
        MetaItem("bad_prompt", "t", "p", prompts / "absent.wav", 6),
        MetaItem("no_prompt", "t", None, None, 7),
        MetaItem("garbage", "t", "p", prompts / "b.wav", 8),
    ]
    calls = []
    embed = SpeakerSimModel.embed
    monkeypatch.setattr(SpeakerSimModel, "embed", lambda self, wav, rate: calls.append(rate) or embed(self, wav, rate))

    report = evaluate_sim(gen, items, root / "ckpt.pth", wavlm_dir=root / "wavlm", progress=False)

    by_id = {r.utt_id: r for r in report.records}
    assert [r.utt_id for r in report.records] == [it.utt_id for it in items]
    assert by_id["same"].sim == pytest.approx(1.0, abs=1e-5)
    assert by_id["stereo"].sim == pytest.approx(1.0, abs=1e-5)
    assert by_id["other"].sim < 0.999
    assert "generated wav missing" in by_id["missing"].error
    assert "too short" in by_id["tiny"].error
    assert "prompt wav missing" in by_id["bad_prompt"].error
    assert "no prompt wav" in by_id["no_prompt"].error
    assert "unreadable" in by_id["garbage"].error
    # Prompt a is embedded once for three rows; prompt b once for two.
    assert len(calls) == 2 + 4  # prompts a, b + generated same, stereo, other, tiny

    sims = [by_id[u].sim for u in ("same", "stereo", "other")]
    summary = report.summary()
    assert summary == {
        "sim_mean": round(float(np.mean(sims)), 4),
        "sim_mean_x100": round(float(np.mean(sims)) * 100, 2),
        "sim_var": round(float(np.var(sims)), 6),
        "evaluated": 3,
        "failures": 5,
    }
    body = json.loads(report.to_json())
    assert body["summary"] == summary and len(body["records"]) == len(items)


def test_empty_report_summary():
    summary = sim.SimReport().summary()
    assert summary["sim_mean"] is None and summary["evaluated"] == 0 and summary["failures"] == 0
