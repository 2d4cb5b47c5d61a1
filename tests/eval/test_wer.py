"""Seed-TTS WER: normalization and scoring goldens, aggregation, and the Whisper path on a tiny
random model built here (no downloads)."""

import json

import numpy as np
import pytest
import soundfile as sf

from intone.eval.meta import MetaItem
from intone.errors import ModelLoadError
from intone.eval.wer import (
    WerError,
    WerRecord,
    WerReport,
    WhisperASR,
    evaluate_wer,
    normalize,
    resample_to_16k,
    utterance_wer,
)

# --- normalization -------------------------------------------------------------------------

# Expected strings worked out by hand from the rules in seedtts_eval.md §2.3.
NORMALIZE_CASES = [
    ("en", "Don’t stop.", "dont stop"),  # curly apostrophe is punctuation
    ("en", "Don't stop.", "don't stop"),  # ASCII apostrophe is kept
    ("en", "A well-known fact!", "a wellknown fact"),
    ("en", "It costs 50 dollars, in 2024.", "it costs 50 dollars in 2024"),  # digits stay digits
    ("en", "Fifty", "fifty"),
    ("en", "Hello，world！", "helloworld"),  # fullwidth comma and exclamation mark
    ("en", "“Quoted” — text…", "quoted text"),  # em dash leaves a double space, reduced once
    ("en", "a  b", "a b"),
    ("en", "a    b", "a  b"),  # one non-overlapping pass: four spaces become two
    ("en", "Mr. Smith's (big) house", "mr smith's big house"),
    ("zh", "你好，世界。", "你 好 世 界"),
    ("zh", "我用AI", "我 用 A I"),  # Latin letters are split too, and not lowercased
    ("zh", "好 的", "好   的"),  # the space itself becomes a token between spaces
    ("zh", "《书》「引」", "书 引"),
]


@pytest.mark.parametrize("lang,text,expected", NORMALIZE_CASES)
def test_normalize_golden(lang, text, expected):
    assert normalize(text, lang) == expected


def test_normalize_rejects_other_languages():
    with pytest.raises(ValueError):
        normalize("bonjour", "fr")


# --- per-utterance WER ---------------------------------------------------------------------


def test_one_substitution_in_four_words():
    s = utterance_wer("The cat sat down.", "the dog sat down")
    assert s.wer == pytest.approx(0.25)
    assert (s.substitutions, s.deletions, s.insertions, s.hits, s.ref_words) == (1, 0, 0, 3, 4)
    assert s.reference_norm == "the cat sat down"


def test_punctuation_and_case_do_not_count():
    assert utterance_wer("Hello, World!", "hello world").wer == 0.0


def test_insertions_push_wer_above_one():
    s = utterance_wer("yes", "yes yes yes yes")
    assert s.wer == pytest.approx(3.0)
    assert (s.insertions, s.hits, s.ref_words) == (3, 1, 1)


def test_empty_hypothesis_is_total_miss():
    s = utterance_wer("three small words", "")
    assert s.wer == 1.0
    assert (s.deletions, s.ref_words) == (3, 3)
    assert utterance_wer("three small words", " ...").wer == 1.0


def test_numbers_are_not_normalized():
    assert utterance_wer("fifty cats", "50 cats").wer == pytest.approx(0.5)


def test_zh_is_character_error_rate():
    s = utterance_wer("今天天气好。", "今天天汽好", lang="zh")
    assert s.wer == pytest.approx(1 / 5)
    assert s.ref_words == 5


def test_reference_without_words_is_a_failure_not_a_score():
    with pytest.raises(WerError):
        utterance_wer("...", "anything")
    assert WerRecord.scored("u", "—", "x").failure is not None


# --- aggregation ---------------------------------------------------------------------------


def _crafted_report() -> WerReport:
    return WerReport(
        [
            WerRecord.scored("short", "Yes.", "no"),  # 1 error / 1 word: WER 1.0
            WerRecord.scored("long", "one two three four five six seven eight nine",
                             "one two three four five six seven eight nine"),  # 0 / 9
            WerRecord.failed("gone", "Never written.", "missing wav: gone.wav"),
        ]
    )


def test_macro_mean_differs_from_corpus_micro():
    s = _crafted_report().summary()
    assert s["wer_mean_x100"] == 50.0  # mean(1.0, 0.0), the official headline
    assert s["wer_corpus_x100"] == 10.0  # 1 error / 10 reference words
    assert s["wer_median_x100"] == 50.0
    assert s["over_50_count"] == 1


def test_failures_are_counted_and_scored_strictly():
    s = _crafted_report().summary()
    assert (s["utterances"], s["evaluated"], s["failures"]) == (3, 2, 1)
    assert s["wer_strict_mean_x100"] == pytest.approx(66.667)  # mean(1.0, 0.0, 1.0), rounded


def test_rounding_to_three_decimals():
    report = WerReport([WerRecord.scored("a", "a b c", "a b x"), WerRecord.scored("b", "a b c", "a b c")])
    assert report.summary()["wer_mean_x100"] == 16.667


def test_empty_report_has_no_headline():
    s = WerReport([]).summary()
    assert s["wer_mean_x100"] is None and s["wer_strict_mean_x100"] is None and s["failures"] == 0


def test_to_json_round_trips():
    body = json.loads(_crafted_report().to_json())
    assert body["summary"]["protocol"] == "seedtts-official"
    assert [r["utt_id"] for r in body["records"]] == ["short", "long", "gone"]
    assert body["records"][2]["failure"] == "missing wav: gone.wav"
    assert body["records"][0]["substitutions"] == 1


# --- resampling ----------------------------------------------------------------------------


def test_resample_length_truncates_like_run_wer():
    # 4 samples at 24 kHz is 2.67 at 16 kHz: run_wer.py's int() gives 2, not round()'s 3.
    assert len(resample_to_16k(np.ones(4), 24000)) == 2
    assert len(resample_to_16k(np.ones(24000), 24000)) == 16000
    x = np.arange(5.0)
    assert resample_to_16k(x, 16000) is x


# --- Whisper on a tiny random model --------------------------------------------------------

SPECIAL_TOKENS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>",
                  "<|transcribe|>", "<|notimestamps|>"]


def _write_tiny_whisper(path, dtype="float32"):
    """A random 2-layer Whisper with a byte-level tokenizer written from scratch: 256 byte
    tokens, no merges, and the special tokens that the English decoder prompt needs."""
    import torch
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperProcessor, WhisperTokenizer)

    path.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({tok: len(vocab) + i for i, tok in enumerate(SPECIAL_TOKENS)})
    (path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "WhisperTokenizer", "additional_special_tokens": SPECIAL_TOKENS[1:]}))
    tokenizer = WhisperTokenizer.from_pretrained(path)
    # 5 s windows instead of 30 s keep the CPU test fast; padding to a fixed window still applies.
    features = WhisperFeatureExtractor(feature_size=80, chunk_length=5)
    WhisperProcessor(features, tokenizer).save_pretrained(path)

    eot = vocab["<|endoftext|>"]
    config = WhisperConfig(
        vocab_size=len(vocab), num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=features.nb_max_frames // 2, max_target_positions=448,
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=vocab["<|startoftranscript|>"],
        init_std=1.0,  # large random weights give varied tokens, so batching bugs would show
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    # Shaped like whisper-large-v3's generation_config.json, including its legacy forced ids.
    model.generation_config = GenerationConfig(
        decoder_start_token_id=vocab["<|startoftranscript|>"], bos_token_id=eot, eos_token_id=eot,
        pad_token_id=eot, max_length=448, is_multilingual=True, lang_to_id={"<|en|>": vocab["<|en|>"]},
        task_to_id={"transcribe": vocab["<|transcribe|>"], "translate": vocab["<|translate|>"]},
        no_timestamps_token_id=vocab["<|notimestamps|>"], return_timestamps=False,
        forced_decoder_ids=[[1, None], [2, vocab["<|transcribe|>"]]],
    )
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path, vocab


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory):
    return _write_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))


def _tone(freq, seconds, rate):
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_evaluate_wer_end_to_end(tiny_whisper, tmp_path):
    model_dir, _ = tiny_whisper
    audio = tmp_path / "gen"
    audio.mkdir()
    sf.write(audio / "u16k.wav", _tone(220, 1.0, 16000), 16000)
    stereo = np.stack([_tone(440, 0.7, 24000), _tone(660, 0.7, 24000)], axis=1)
    sf.write(audio / "u24k_stereo.wav", stereo, 24000)  # exercises resampling and channel 0
    (audio / "broken.wav").write_bytes(b"not a wav file")
    items = [MetaItem("u16k", "The first sentence."), MetaItem("absent", "Never generated."),
             MetaItem("u24k_stereo", "A second one."), MetaItem("broken", "Bad file.")]

    report = evaluate_wer(audio, items, model_dir, batch_size=2, progress=False, max_new_tokens=8)

    assert [r.utt_id for r in report.records] == ["u16k", "absent", "u24k_stereo", "broken"]
    ok = [r for r in report.records if r.failure is None]
    assert [r.utt_id for r in ok] == ["u16k", "u24k_stereo"]
    for r in ok:
        assert isinstance(r.hypothesis, str) and r.wer is not None and r.ref_words == 3
    assert report.records[1].failure.startswith("missing wav")
    assert report.records[3].failure.startswith("unreadable wav")
    s = report.summary()
    assert (s["utterances"], s["evaluated"], s["failures"]) == (4, 2, 2)
    assert s["wer_strict_mean_x100"] == round((ok[0].wer + ok[1].wer + 2) / 4 * 100, 3)
    json.loads(report.to_json())


def test_batched_equals_unbatched(tiny_whisper):
    model_dir, _ = tiny_whisper
    audios = [(_tone(f, s, 16000), 16000) for f, s in ((220, 1.0), (880, 0.5), (330, 2.0))]
    audios.append((_tone(500, 1.0, 22050), 22050))
    batched = WhisperASR(model_dir, batch_size=3, max_new_tokens=8).transcribe(audios)
    single = WhisperASR(model_dir, batch_size=1, max_new_tokens=8).transcribe(audios)
    assert batched == single
    assert len(set(batched)) > 1  # the random model does respond to its input


def test_decoder_prompt_is_english_transcribe_without_timestamps(tiny_whisper):
    model_dir, vocab = tiny_whisper
    asr = WhisperASR(model_dir, max_new_tokens=2)
    seen = []
    forward = asr.model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs["decoder_input_ids"][0].tolist())
        return forward(*args, **kwargs)

    asr.model.forward = spy
    asr.transcribe([(_tone(220, 1.0, 16000), 16000)])
    expected = [vocab[t] for t in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>")]
    assert seen[0] == expected


def test_fp16_checkpoint_is_loaded_in_fp32(tmp_path):
    import torch

    model_dir, _ = _write_tiny_whisper(tmp_path / "fp16", dtype="float16")
    assert WhisperASR(model_dir).model.dtype == torch.float32


def test_missing_model_dir_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError):
        WhisperASR(tmp_path / "nowhere")


def test_zh_asr_is_refused_clearly(tmp_path):
    with pytest.raises(WerError, match="zh"):
        evaluate_wer(tmp_path, [MetaItem("u", "你好")], tmp_path, lang="zh", progress=False)


def test_eval_wer_cli(tiny_whisper, tmp_path):
    """`intone eval wer` wires the list, the audio directory and the model together; a missing
    output file makes it exit 1 and is reported as a failure, not skipped."""
    import json
    import subprocess
    import sys

    audio_dir = tmp_path / "gen"
    audio_dir.mkdir()
    sf.write(audio_dir / "u1.wav", _tone(440, 1.0, 16000), 16000)
    meta = tmp_path / "meta.lst"
    meta.write_text("u1|prompt|p.wav|hello world\nu2|prompt|p.wav|missing output\n")
    out = tmp_path / "wer.json"
    model_dir, _ = tiny_whisper
    r = subprocess.run([sys.executable, "-m", "intone.cli.main", "eval", "wer", "--asr-model", str(model_dir),
                        "--audio-dir", str(audio_dir), "--meta", str(meta), "--device", "cpu", "--output", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["failures"] == 1 and summary["evaluated"] == 1
    assert json.loads(out.read_text())["summary"]["failures"] == 1
