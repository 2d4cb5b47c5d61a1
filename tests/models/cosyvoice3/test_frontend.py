"""CosyVoice3 reference frontend: feature math, alignment, limits, and the tiny ONNX files.

Reference numbers below were recorded once from the libraries the official frontend uses
(openai-whisper 20250625, torchaudio 2.11.0, librosa 0.11.0, Matcha-TTS `matcha/utils/audio.py`,
kaldi-native-fbank 1.23.0) on the deterministic `_tone` signal; those libraries are not needed here.
Our functions matched them bit for bit on that machine; the tolerances only allow for other CPUs' FFTs.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from intone.errors import InvalidRequestError, ModelLoadError
from intone.models.cosyvoice3 import features as fx
from intone.models.cosyvoice3 import tiny_onnx
from intone.models.cosyvoice3.frontend import (
    ReferenceFeatures,
    SpeakerEncoder,
    SpeechTokenizer,
    extract_reference,
)


def _tone(n: int, rate: int) -> torch.Tensor:
    """Two steady tones plus a chirp from 100 Hz to 0.45 * rate; computed in float64, stored float32."""
    t = torch.arange(n, dtype=torch.float64) / rate
    sweep = (0.45 * rate - 100.0) / (2 * n / rate)
    return (0.5 * torch.sin(2 * math.pi * 440.0 * t) + 0.25 * torch.sin(2 * math.pi * 1234.5 * t)
            + 0.1 * torch.sin(2 * math.pi * (100.0 + sweep * t) * t)).to(torch.float32)


def _frames(x: np.ndarray, size: int, hop: int) -> np.ndarray:
    count = 1 + (len(x) - size) // hop
    return np.stack([x[i * hop: i * hop + size] for i in range(count)])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cosyvoice3-frontend")
    start = time.perf_counter()
    tok = tiny_onnx.export_tiny_speech_tokenizer(root / "speech_tokenizer_v3.onnx", seed=0)
    spk = tiny_onnx.export_tiny_campplus(root / "campplus.onnx", seed=0)
    elapsed = time.perf_counter() - start
    return {"dir": root, "tokenizer": tok, "campplus": spk, "export_s": elapsed}


# --------------------------------------------------------------------------------------------
# mel filter banks


def test_slaney_filters_match_recorded_librosa_values():
    # whisper/assets/mel_filters.npz "mel_128" (= librosa.filters.mel(sr=16000, n_fft=400, n_mels=128))
    w = fx.slaney_mel_filters(16000, 400, 128)
    assert w.shape == (128, 201) and w.dtype == torch.float32
    for (r, c), v in {(0, 1): 0.012373986653983593, (127, 199): 0.0011142801959067583, (10, 14): 0.0}.items():
        assert w[r, c].item() == pytest.approx(v, rel=1e-6, abs=1e-9)
    assert w.double().sum().item() == pytest.approx(3.1909855409403463, rel=1e-6)
    # librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80): Matcha's basis for cosyvoice3.yaml
    m = fx.slaney_mel_filters(24000, 1920, 80)
    assert m.shape == (80, 961)
    for (r, c), v in {(0, 1): 0.007054844405502081, (79, 900): 0.0010178409283980727,
                      (79, 950): 0.0004914540331810713, (40, 160): 0.0}.items():
        assert m[r, c].item() == pytest.approx(v, rel=1e-6, abs=1e-9)
    assert m.double().sum().item() == pytest.approx(6.3991737211076725, rel=1e-6)


# --------------------------------------------------------------------------------------------
# whisper log-mel (speech tokenizer input)


def test_whisper_log_mel_rate_and_silence():
    assert fx.whisper_log_mel(torch.zeros(16000)).shape == (128, 100)  # 100 frames per second
    assert fx.whisper_log_mel(torch.zeros(16159)).shape == (128, 100)
    assert fx.whisper_log_mel(torch.zeros(16160)).shape == (128, 101)
    # silence: log10(1e-10) = -10 everywhere -> (-10 + 4) / 4
    assert torch.equal(fx.whisper_log_mel(torch.zeros(800)), torch.full((128, 5), -1.5))


def test_whisper_log_mel_matches_recorded_whisper():
    feats = fx.whisper_log_mel(_tone(4000, 16000))
    assert feats.shape == (128, 25)
    # whisper.log_mel_spectrogram(audio, n_mels=128): (bin, frame) -> value
    for (b, f), v in {(0, 3): -0.5006392, (20, 10): 1.287397, (40, 20): -0.3373449, (127, 24): -0.0037992,
                      (18, 2): 1.48986, (18, 14): 1.485355}.items():
        assert feats[b, f].item() == pytest.approx(v, abs=1e-4)
    sums = feats.double().sum(0)[[2, 8, 14, 20]].tolist()
    assert sums == pytest.approx([-5.833352, -21.54074, -29.02427, -31.98186], abs=1e-2)
    assert feats.double().mean().item() == pytest.approx(-0.13518291423097253, abs=1e-4)


def test_whisper_log_mel_matches_numpy_stft():
    audio = _tone(4000, 16000)
    x = np.pad(audio.numpy().astype(np.float64), 200, mode="reflect")
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)  # periodic
    power = np.abs(np.fft.rfft(_frames(x, 400, 160)[:-1] * hann, axis=1)) ** 2
    mel = fx.slaney_mel_filters(16000, 400, 128).numpy().astype(np.float64) @ power.T
    ref = np.log10(np.maximum(mel, 1e-10))
    ref = (np.maximum(ref, ref.max() - 8.0) + 4.0) / 4.0
    np.testing.assert_allclose(fx.whisper_log_mel(audio).numpy(), ref, atol=2e-4)


# --------------------------------------------------------------------------------------------
# Kaldi fbank (CAM++ input)


def test_kaldi_fbank_frames_and_dc_frame():
    assert fx.kaldi_fbank(torch.zeros(16000)).shape == (98, 80)  # 1 + (16000 - 400) // 160
    assert fx.kaldi_fbank(torch.zeros(400)).shape == (1, 80)
    assert fx.fbank_frames(399) == 0 and fx.fbank_frames(559) == 1 and fx.fbank_frames(560) == 2
    # a constant frame is all DC: removed, so every bin is floored at ln(float32 eps)
    floor = math.log(torch.finfo(torch.float32).eps)
    assert torch.allclose(fx.kaldi_fbank(torch.full((400,), 0.3)), torch.full((1, 80), floor))


def test_kaldi_fbank_matches_recorded_torchaudio_and_kaldi_native_fbank():
    feats = fx.kaldi_fbank(_tone(4000, 16000))
    assert feats.shape == (23, 80)
    # torchaudio.compliance.kaldi.fbank(wav[None], num_mel_bins=80, dither=0, sample_frequency=16000)
    torchaudio_ref = {(2, 0): -10.56274, (5, 10): -4.576669, (10, 30): 3.364452, (15, 50): -15.94238,
                      (20, 79): -13.69558, (2, 31): 5.15238, (14, 63): 5.404091, (20, 72): 5.9881}
    # kaldi_native_fbank.OnlineFbank, dither 0, 80 bins (differs from torchaudio by up to ~2e-3)
    knf_ref = {(2, 0): -10.56277, (5, 10): -4.57667, (10, 30): 3.364487, (15, 50): -15.94238,
               (20, 79): -13.69562, (2, 31): 5.15238, (14, 63): 5.40409, (20, 72): 5.988102}
    for (f, b), v in torchaudio_ref.items():
        assert feats[f, b].item() == pytest.approx(v, abs=1e-3)
    for (f, b), v in knf_ref.items():
        assert feats[f, b].item() == pytest.approx(v, abs=5e-3)
    sums = feats.double().sum(1)[[2, 8, 14, 20]].tolist()
    assert sums == pytest.approx([-762.7569, -636.0314, -660.7237, -693.181], abs=2e-2)


def test_kaldi_fbank_matches_numpy_reference():
    audio = _tone(4000, 16000)
    frames = _frames(audio.numpy().astype(np.float64), 400, 160)
    frames = frames - frames.mean(1, keepdims=True)
    frames = frames - 0.97 * np.concatenate([frames[:, :1], frames[:, :-1]], 1)
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 399)) ** 0.85
    power = np.abs(np.fft.rfft(frames * povey, n=512, axis=1)) ** 2

    def mel(hz):
        return 1127.0 * np.log(1.0 + hz / 700.0)

    lo, step = mel(20.0), (mel(8000.0) - mel(20.0)) / 81
    bin_mel = mel(np.arange(257) * 16000 / 512)
    banks = np.stack([np.clip(np.minimum((bin_mel - lo - k * step) / step, (lo + (k + 2) * step - bin_mel) / step),
                              0, None) for k in range(80)])
    banks[:, 256] = 0.0
    ref = np.log(np.maximum(power @ banks.T, np.finfo(np.float32).eps))
    loud = ref > ref.max() - 12.0  # float32 vs float64 differ visibly only far below the peak
    assert loud.mean() > 0.2
    np.testing.assert_allclose(fx.kaldi_fbank(audio).numpy()[loud], ref[loud], atol=2e-4)


# --------------------------------------------------------------------------------------------
# Matcha prompt mel (flow condition)


def test_prompt_mel_rate():
    assert fx.prompt_mel(torch.zeros(24000)).shape == (50, 80)  # 50 frames per second
    assert fx.prompt_mel(torch.zeros(24479)).shape == (50, 80)
    assert fx.prompt_mel(torch.zeros(24480)).shape == (51, 80)
    assert fx.prompt_mel_frames(24000) == 50 and fx.prompt_mel_frames(720) == 0
    assert fx.prompt_mel(torch.zeros(960)).dtype == torch.float32


def test_prompt_mel_matches_recorded_matcha():
    feats = fx.prompt_mel(_tone(6000, 24000))
    assert feats.shape == (12, 80)
    # matcha.utils.audio.mel_spectrogram(wav[None], 1920, 80, 24000, 480, 1920, 0, None, center=False): (frame, bin)
    for (f, b), v in {(1, 0): -1.677467, (3, 20): -9.529298, (6, 40): -11.51293, (11, 79): -3.461184,
                      (1, 9): 1.897019, (7, 9): 1.866536}.items():
        assert feats[f, b].item() == pytest.approx(v, abs=1e-3)
    sums = feats.double().sum(1)[[1, 4, 7, 10]].tolist()
    assert sums == pytest.approx([-253.6953, -516.1444, -602.7203, -636.5022], abs=2e-2)


def test_prompt_mel_matches_numpy_stft():
    audio = _tone(6000, 24000)
    x = np.pad(audio.numpy().astype(np.float64), 720, mode="reflect")
    hann = np.sin(np.pi * np.arange(1920) / 1920) ** 2  # periodic Hann
    spec = np.fft.rfft(_frames(x, 1920, 480) * hann, axis=1)
    mag = np.sqrt(spec.real ** 2 + spec.imag ** 2 + 1e-9)
    ref = np.log(np.maximum(fx.slaney_mel_filters(24000, 1920, 80).numpy().astype(np.float64) @ mag.T, 1e-5)).T
    loud = ref > ref.max() - 9.0
    assert loud.mean() > 0.3
    np.testing.assert_allclose(fx.prompt_mel(audio).numpy()[loud], ref[loud], atol=3e-4)


# --------------------------------------------------------------------------------------------
# resampling as the official loader (torchaudio.transforms.Resample)


def test_official_resample_matches_recorded_torchaudio_transform():
    from intone.ops.resample import resample

    audio = _tone(4410, 44100)
    # torchaudio.transforms.Resample(44100, rate)(wav[None])[0] at indices 0, 1, 100, 777, last
    recorded = {16000: [0.01984818, 0.2036931, -0.7325411, 0.2908415, 0.09466276],
                24000: [0.01117614, 0.137795, -0.1637095, 0.3508562, 0.08725885]}
    for rate, values in recorded.items():
        out = fx.official_resample(audio, 44100, rate)
        assert out.shape == (rate // 10,)
        assert out[[0, 1, 100, 777, -1]].tolist() == pytest.approx(values, abs=2e-6)
        # intone.ops.resample.resample (= torchaudio.functional.resample) differs only by float rounding
        assert torch.allclose(out, resample(audio, 44100, rate), atol=5e-5)
    assert torch.equal(fx.official_resample(audio, 16000, 16000), audio)


# --------------------------------------------------------------------------------------------
# tiny ONNX models


def test_tiny_onnx_files_signature_and_size(tiny_models):
    import onnxruntime as ort

    assert tiny_models["export_s"] < 15.0
    for key in ("tokenizer", "campplus"):
        assert tiny_models[key].stat().st_size < 2_000_000
    sess = ort.InferenceSession(str(tiny_models["tokenizer"]), providers=["CPUExecutionProvider"])
    ins, outs = sess.get_inputs(), sess.get_outputs()
    assert [(i.name, i.type) for i in ins] == [("feats", "tensor(float)"), ("feats_length", "tensor(int32)")]
    assert ins[0].shape[1] == 128 and isinstance(ins[0].shape[2], str)  # dynamic frame axis
    assert [(o.name, o.type) for o in outs] == [("indices", "tensor(int32)")]
    sess = ort.InferenceSession(str(tiny_models["campplus"]), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type) for i in sess.get_inputs()] == [("input", "tensor(float)")]
    assert sess.get_inputs()[0].shape[2] == 80 and isinstance(sess.get_inputs()[0].shape[1], str)
    assert [(o.name, o.type, o.shape[1]) for o in sess.get_outputs()] == [("output", "tensor(float)", 192)]


def test_tiny_onnx_round_trip_equals_torch_module(tiny_models):
    tokenizer = SpeechTokenizer(tiny_models["tokenizer"])
    module = tiny_onnx.tiny_speech_tokenizer(seed=0)
    for frames in (1, 4, 5, 100, 101, 437):
        feats = fx.whisper_log_mel(_tone(frames * 160, 16000)) if frames > 1 else torch.randn(128, 1)
        got = tokenizer.tokenize_features(feats)
        with torch.no_grad():
            want = module(feats[None], torch.tensor([feats.shape[1]], dtype=torch.int32))[0]
        assert got.dtype == torch.int64 and got.shape == (math.ceil(frames / 4),)
        assert torch.equal(got, want.long())
        assert int(got.min()) >= 0 and int(got.max()) < 6561
    encoder = SpeakerEncoder(tiny_models["campplus"])
    feats = fx.kaldi_fbank(_tone(8000, 16000))
    feats = feats - feats.mean(0, keepdim=True)
    with torch.no_grad():
        want = tiny_onnx.tiny_campplus(seed=0)(feats[None])[0]
    got = encoder.embed_features(feats)
    assert got.shape == (192,) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5)


def test_tiny_onnx_is_deterministic_per_seed(tmp_path, tiny_models):
    again = tiny_onnx.export_tiny_speech_tokenizer(tmp_path / "a.onnx", seed=0)
    other = tiny_onnx.export_tiny_speech_tokenizer(tmp_path / "b.onnx", seed=1)
    assert again.read_bytes() == tiny_models["tokenizer"].read_bytes()
    feats = fx.whisper_log_mel(_tone(16000, 16000))
    tokens = SpeechTokenizer(again).tokenize_features(feats)
    assert not torch.equal(tokens, SpeechTokenizer(other).tokenize_features(feats))
    assert len(set(tokens.tolist())) > 3  # not a constant code


def test_missing_onnx_file_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match="speech_tokenizer_v3.onnx"):
        SpeechTokenizer(tmp_path / "speech_tokenizer_v3.onnx")
    with pytest.raises(ModelLoadError, match="campplus.onnx"):
        SpeakerEncoder(tmp_path / "campplus.onnx")
    bad = tmp_path / "campplus.onnx"
    bad.write_bytes(b"not an onnx file")
    with pytest.raises(ModelLoadError, match="campplus.onnx"):
        SpeakerEncoder(bad).load()


# --------------------------------------------------------------------------------------------
# extract_reference


@pytest.fixture(scope="module")
def models(tiny_models):
    return SpeechTokenizer(tiny_models["tokenizer"]).load(), SpeakerEncoder(tiny_models["campplus"]).load()


def test_one_second_reference(models):
    ref = extract_reference(_tone(16000, 16000), 16000, *models)
    assert isinstance(ref, ReferenceFeatures)
    assert ref.speech_tokens.shape == (25,) and ref.speech_tokens.dtype == torch.int64
    assert ref.prompt_mel.shape == (50, 80) and ref.prompt_mel.dtype == torch.float32
    assert ref.speaker.shape == (192,) and ref.speaker.dtype == torch.float32
    assert ref.num_tokens == 25


def test_reference_features_are_the_separate_features(models):
    tokenizer, encoder = models
    audio = _tone(int(44100 * 1.37), 44100)
    ref = extract_reference(audio, 44100, tokenizer, encoder)
    a16, a24 = fx.official_resample(audio, 44100, 16000), fx.official_resample(audio, 44100, 24000)
    mel, tokens = fx.prompt_mel(a24), tokenizer(a16)
    n = min(mel.shape[0] // 2, tokens.shape[0])
    assert (mel.shape[0], tokens.shape[0], n) == (68, 35, 34)  # tokens cut to the mel's 2-frame grid
    assert torch.equal(ref.speech_tokens, tokens[:n])
    assert torch.equal(ref.prompt_mel, mel[: 2 * n])
    assert torch.equal(ref.speaker, encoder(a16))  # from the whole recording
    # channels are averaged first, as the official loader does
    stereo = extract_reference(torch.stack([audio, torch.zeros_like(audio)]), 44100, tokenizer, encoder)
    assert torch.equal(stereo.prompt_mel, extract_reference(audio * 0.5, 44100, tokenizer, encoder).prompt_mel)


def test_alignment_when_tokens_are_fewer(models):
    _, encoder = models

    def ten_tokens(audio16k):
        return torch.arange(10)

    ref = extract_reference(_tone(16000, 16000), 16000, ten_tokens, encoder)
    assert ref.speech_tokens.tolist() == list(range(10))
    assert torch.equal(ref.prompt_mel, fx.prompt_mel(fx.official_resample(_tone(16000, 16000), 16000, 24000))[:20])


def test_thirty_second_limit_names_the_field(models):
    tokenizer, encoder = models
    ok = extract_reference(torch.zeros(30 * 16000), 16000, tokenizer, encoder)
    assert ok.num_tokens == 750
    with pytest.raises(InvalidRequestError) as err:
        extract_reference(torch.zeros(30 * 16000 + 1), 16000, tokenizer, encoder, field="voices[2].audio")
    assert err.value.field == "voices[2].audio" and "30 s" in err.value.message
    with pytest.raises(InvalidRequestError, match="30 s"):
        extract_reference(torch.zeros(30 * 48000 + 3), 48000, tokenizer, encoder)


@pytest.mark.parametrize("audio,rate,words", [
    (torch.zeros(0), 16000, "empty"),
    (torch.zeros(879), 16000, "too short"),
    (torch.zeros(1000), 8000, "16000 Hz"),
    (torch.tensor([0.0, float("nan")] * 4000), 16000, "NaN"),
    (torch.zeros(2, 3, 4000), 16000, "channels, samples"),
])
def test_bad_reference_audio_is_rejected(models, audio, rate, words):
    with pytest.raises(InvalidRequestError, match=words) as err:
        extract_reference(audio, rate, *models, field="ref_audio")
    assert err.value.field == "ref_audio"


def test_shortest_accepted_reference(models):
    ref = extract_reference(torch.zeros(880), 16000, *models)  # 55 ms: 4 fbank frames, 1 token
    assert ref.num_tokens == 1 and ref.prompt_mel.shape == (2, 80)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(200, 30000), orig=st.sampled_from([16000, 22050, 44100, 48000]),
       new=st.sampled_from([16000, 24000]))
def test_bucketed_resampling_keeps_every_sample(n, orig, new):
    """Padding the resampler's input to a shape bucket changes none of the samples it returns."""
    audio = torch.randn(n, generator=torch.Generator().manual_seed(n))
    plain, bucketed = fx.official_resample(audio, orig, new), fx.official_resample(audio, orig, new, bucket=orig)
    assert bucketed.shape == plain.shape
    assert torch.allclose(bucketed, plain, atol=1e-6, rtol=0)
