"""CosyVoice3 checkpoint layout, loading, prompts and request errors on the tiny model."""

import shutil
import sys

import pytest
import soundfile as sf
import torch

from intone.errors import InvalidRequestError, ModelLoadError
from intone.models.cosyvoice3.config import read_model_yaml
from intone.models.cosyvoice3.prompt import SOS, SYSTEM_PROMPT, TASK_ID
from intone.models.registry import load_model
from intone.protocol import SynthesisRequest, VoiceReference

from .conftest import voice_audio

FILES = ["cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v3.onnx",
         "CosyVoice-BlankEN/config.json", "CosyVoice-BlankEN/generation_config.json", "CosyVoice-BlankEN/merges.txt",
         "CosyVoice-BlankEN/model.safetensors", "CosyVoice-BlankEN/tokenizer_config.json", "CosyVoice-BlankEN/vocab.json"]


def test_tiny_checkpoint_has_the_real_layout(tiny_cosy_dir):
    for name in FILES:
        assert (tiny_cosy_dir / name).is_file(), name
    llm = torch.load(tiny_cosy_dir / "llm.pt", weights_only=True)
    assert llm["speech_embedding.weight"].shape[0] == 6761 and llm["llm_decoder.weight"].shape[0] == 6761
    assert "llm_decoder.bias" not in llm and "llm.model.lm_head.weight" in llm
    assert not any(k.startswith(("llm_embedding", "spk_embed_affine_layer")) for k in llm)
    assert {k.split(".")[3] for k in llm if k.startswith("llm.model.model.")} == {"embed_tokens", "layers", "norm"}
    hift = torch.load(tiny_cosy_dir / "hift.pt", weights_only=True)
    assert sum(k.endswith("parametrizations.weight.original0") for k in hift) == 82  # 77 + the F0 predictor's 5
    cfg = read_model_yaml(tiny_cosy_dir / "cosyvoice3.yaml")
    assert cfg["flow"]["decoder"]["estimator"]["static_chunk_size"] == 50  # !ref <chunk_size> * <token_mel_ratio>
    assert cfg["llm"]["sampling"]["top_k"] == 25


def test_a_real_size_yaml_reads_back(tmp_path):
    from intone.models.cosyvoice3.codec_config import flow_config, hift_config, yaml_text

    path = tmp_path / "cosyvoice3.yaml"
    path.write_text(yaml_text(896, dict(dim=1024, depth=22, heads=16, dim_head=64, ff_mult=2, lookahead_channels=1024),
                              dict(base_channels=512, f0_channels=512)))
    cfg = read_model_yaml(path)
    flow, hift = flow_config(cfg), hift_config(cfg)
    assert (flow.dit.dim, flow.dit.depth, flow.dit.heads, flow.dit.static_chunk_size) == (1024, 22, 16, 50)
    assert (hift.base_channels, hift.upsample_rates, hift.hop) == (512, (8, 5, 3), 480)


def test_legacy_weight_norm_keys_and_generator_prefix_load_the_same(tiny_cosy_dir, tmp_path, tiny_cosy):
    copy = tmp_path / "m"
    shutil.copytree(tiny_cosy_dir, copy)
    raw = torch.load(copy / "hift.pt", weights_only=True)
    legacy = {"generator." + k.replace(".parametrizations.weight.original0", ".weight_g")
              .replace(".parametrizations.weight.original1", ".weight_v"): v for k, v in raw.items()}
    torch.save(legacy, copy / "hift.pt")
    other = load_model(str(copy))
    mel = torch.randn(1, 80, 40)
    assert torch.equal(other.hift.inference(mel, finalize=True), tiny_cosy.hift.inference(mel, finalize=True))


@pytest.mark.parametrize("file, damage, message", [
    ("flow.pt", lambda s: s.pop("input_embedding.weight"), "input_embedding.weight"),
    ("llm.pt", lambda s: s.update({"llm_decoder.bias": torch.zeros(6761)}), "llm_decoder.bias"),
    ("hift.pt", lambda s: s.pop("conv_pre.parametrizations.weight.original0"), "conv_pre"),
])
def test_a_damaged_checkpoint_names_the_file_and_tensor(tiny_cosy_dir, tmp_path, file, damage, message):
    copy = tmp_path / "m"
    shutil.copytree(tiny_cosy_dir, copy)
    state = torch.load(copy / file, weights_only=True)
    damage(state)
    torch.save(state, copy / file)
    with pytest.raises((ModelLoadError, KeyError)) as e:
        load_model(str(copy))
    assert message in str(e.value)


def test_a_missing_onnx_model_is_named(tiny_cosy_dir, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(tiny_cosy_dir, copy)
    (copy / "campplus.onnx").unlink()
    with pytest.raises(ModelLoadError, match="campplus.onnx"):
        load_model(str(copy))


def test_zero_shot_prompt_layout(tiny_cosy, voice):
    prompt = tiny_cosy.build_prompt("Hello world.", [voice])
    tok = tiny_cosy.tokenizer
    text_ids = tok.encode(SYSTEM_PROMPT + voice.text) + tok.encode("Hello world.")
    speech = prompt.conditioning.speech_tokens
    n = len(text_ids)
    assert prompt.codes[0, 0] == SOS and prompt.codes[n + 1, 0] == TASK_ID
    assert torch.equal(prompt.codes[n + 2 :, 0], speech) and (prompt.codes[1 : n + 1, 0] == -1).all()
    assert prompt.tokens[1 : n + 1].tolist() == text_ids and len(prompt) == n + 2 + len(speech)
    assert tok.end_of_prompt_id in text_ids
    target = len(tok.encode("Hello world."))
    assert (prompt.min_new_tokens, prompt.max_new_tokens) == (2 * target, 20 * target)
    assert prompt.codec_prompt_frames == len(speech) and prompt.conditioning.prompt_mel.shape == (2 * len(speech), 80)


def test_instructions_replace_the_reference_text_and_speech_for_the_talker(tiny_cosy, voice):
    prompt = tiny_cosy.build_prompt("Hello.", [voice], instructions="Speak slowly.")
    tok = tiny_cosy.tokenizer
    text_ids = tok.encode("You are a helpful assistant. Speak slowly.<|endofprompt|>") + tok.encode("Hello.")
    assert prompt.tokens[1 : 1 + len(text_ids)].tolist() == text_ids
    assert len(prompt) == len(text_ids) + 2 and prompt.codes[-1, 0] == TASK_ID  # no reference speech
    assert prompt.conditioning.speech_tokens.numel() > 0  # the flow still takes the voice
    assert prompt.max_new_tokens == 20 * len(tok.encode("Hello."))


def test_without_a_transcript_the_talker_gets_no_reference_speech(tiny_cosy):
    ref = VoiceReference(text="", audio=voice_audio(), sample_rate=16000)
    prompt = tiny_cosy.build_prompt("Bonjour.", [ref])
    text_ids = tiny_cosy.tokenizer.encode(SYSTEM_PROMPT + "Bonjour.")
    assert len(prompt) == len(text_ids) + 2 and prompt.codes[-1, 0] == TASK_ID
    assert prompt.max_new_tokens == 20 * len(text_ids)
    assert prompt.conditioning.speech_tokens.numel() > 0  # the flow still gets the voice


@pytest.mark.parametrize("refs, text, field", [
    ([], "hi", "ref_audio"),
    ("two", "hi", "ref_audio"),
    ([VoiceReference(text="x", codes=torch.zeros(1, 5, dtype=torch.long))], "hi", "voice"),
    ([VoiceReference(text="x", features={"codes": torch.zeros(10, 5, dtype=torch.long)})], "hi", "voice"),
    ([VoiceReference(text="x", features={"speech_tokens": torch.zeros(5, dtype=torch.long),
                                         "prompt_mel": torch.zeros(9, 80), "speaker": torch.zeros(192)})], "hi", "voice"),
    ([VoiceReference(text="x", audio=voice_audio(31.0), sample_rate=16000)], "hi", "ref_audio"),
    ([VoiceReference(text="x", audio=torch.zeros(100), sample_rate=16000)], "hi", "ref_audio"),
    ("one", "   ", "input"),
])
def test_bad_requests_name_the_field(tiny_cosy, voice, refs, text, field):
    refs = {"two": [voice, voice], "one": [voice]}.get(refs, refs) if isinstance(refs, str) else refs
    with pytest.raises(InvalidRequestError) as e:
        tiny_cosy.build_prompt(text, refs)
    assert e.value.field == field


def test_prepare_checks_speed_and_says_a_tempo_change_needs_one_chunk(tiny_cosy, voice):
    """`prepare`: the model's own options checked before its prompt is built; a tempo change marks the
    prompt as needing its audio in one chunk (the engine refuses it where chunks would split it)."""
    assert tiny_cosy.prepare(SynthesisRequest("a", "Hi.", [voice], speed=1.0)).one_chunk_for is None
    assert tiny_cosy.prepare(SynthesisRequest("b", "Hi.", [voice], speed=1.5)).one_chunk_for == "speed"
    with pytest.raises(InvalidRequestError) as e:
        tiny_cosy.prepare(SynthesisRequest("c", "Hi.", [voice], speed=9.0))
    assert e.value.field == "speed"


def test_stored_features_give_the_same_prompt_as_the_audio(tiny_cosy, voice):
    features = tiny_cosy.reference_features(voice.audio, voice.sample_rate)
    again = tiny_cosy.build_prompt("Hi.", [VoiceReference(text=voice.text, features=features)])
    direct = tiny_cosy.build_prompt("Hi.", [voice])
    assert torch.equal(again.codes, direct.codes) and torch.equal(again.tokens, direct.tokens)
    assert torch.equal(again.conditioning.prompt_mel, direct.conditioning.prompt_mel)


def test_silent_runs_beyond_five_are_not_vocoded(tiny_cosy):
    keep = [tiny_cosy.forwards_frame([7, 1, 2, 28, 29, 55][: i + 1]) for i in range(6)]
    assert keep == [True] * 6  # five silent tokens in a row still go to the flow
    assert not tiny_cosy.forwards_frame([7, 1, 2, 28, 29, 55, 248])
    assert tiny_cosy.forwards_frame([1, 2, 28, 29, 55, 248, 9])


SPEEDS = ("1.0", "1.5")


def beside_jobs(selected: set[str], tmp_path_factory, cache) -> dict:
    """The speak test's four `intone speak` runs (if it is selected): name -> (command, directory).
    tests/conftest.py's `beside` runs them, from the session's start, beside the tests before this one."""
    if "test_speak_writes_24khz_audio_speed_stretches_the_same_tokens_and_refusals_are_clear" not in selected:
        return {}
    from intone.models import resolve_model_dir

    tmp_path, model = tmp_path_factory.mktemp("cosy-speak"), resolve_model_dir("tiny:cosyvoice3")
    ref = tmp_path / "ref.wav"
    sf.write(ref, voice_audio(2.0, rate=16000).numpy(), 16000)
    base = [sys.executable, "-m", "intone.cli.main", "speak", "--device", "cpu", "--seed", "5",
            "--max-new-tokens", "60", "Hello there."]
    cosy = base + ["--model", str(model), "--ref-audio", str(ref), "--ref-text", "A short reference."]
    commands = {**{speed: cosy + ["--speed", speed, "-o", str(tmp_path / f"s{speed}.wav")] for speed in SPEEDS},
                "bare": base + ["--model", str(model), "-o", str(tmp_path / "x.wav")],
                "fish": base + ["--model", "tiny:fish-s2", "--speed", "1.5", "-o", str(tmp_path / "f.wav")]}
    return {name: (command, tmp_path) for name, command in commands.items()}


def test_speak_writes_24khz_audio_speed_stretches_the_same_tokens_and_refusals_are_clear(beside):
    """`intone speak` with CosyVoice3: 24 kHz audio of whole tokens; --speed 1.5 stretches the same tokens
    (same seed) as the official mel interpolation; no reference, or --speed with Fish, is a clear error.
    (Its runs: `beside_jobs` above.)"""
    speeds = SPEEDS
    runs = [beside(__name__, speed)[0] for speed in speeds]
    (bare, tmp_path), (fish, _) = beside(__name__, "bare"), beside(__name__, "fish")
    lengths = {}
    for speed, done in zip(speeds, runs):
        assert done.returncode == 0, done.stderr
        audio, rate = sf.read(tmp_path / f"s{speed}.wav")
        assert rate == 24000 and len(audio) > 0
        lengths[speed] = len(audio)
    assert lengths["1.0"] % 960 == 0
    frames = lengths["1.0"] // 960
    assert lengths["1.5"] == int(2 * frames / 1.5) * 480
    assert bare.returncode == 2 and "reference" in bare.stderr and "Traceback" not in bare.stderr
    assert fish.returncode == 2 and "--speed" in fish.stderr
