"""Seed-TTS list parsing and the synthetic dataset."""

import pytest
import soundfile as sf

from intone.bench.dataset import synthetic_items
from intone.eval.meta import MetaListError, parse_meta_list, write_meta_list
from intone.bench.runner import forced_frames


def write(tmp_path, text):
    path = tmp_path / "sub" / "meta.lst"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_four_field_lines_with_relative_and_absolute_paths(tmp_path):
    path = write(tmp_path, "a|prompt one|prompt-wavs/a.wav|target one\n\n"
                           f"b|prompt two|{tmp_path}/b.wav|target two\r\n   \n")
    a, b = parse_meta_list(path)
    assert (a.utt_id, a.prompt_text, a.target_text) == ("a", "prompt one", "target one")
    assert a.prompt_wav == tmp_path / "sub" / "prompt-wavs" / "a.wav"
    assert b.prompt_wav == tmp_path / "b.wav" and b.target_text == "target two"
    assert a.line == 1 and b.line == 3


def test_the_other_official_shapes(tmp_path):
    two, three, five = parse_meta_list(write(tmp_path, "x|just text\ny|text|p.wav\nz|pt|p.wav|tt|src.wav\n"))
    assert two.prompt_wav is None and two.target_text == "just text"
    assert three.target_text == "text" and three.prompt_wav.name == "p.wav"
    assert five.target_text == "tt" and five.prompt_text == "pt"


@pytest.mark.parametrize("text, message", [
    ("only-one-field\n", ":1: expected 2 to 5"),
    ("a|b|c|d|e|f\n", ":1: expected 2 to 5"),
    ("a|p|w.wav|\n", ":1: empty target text"),
    ("|p|w.wav|t\n", ":1: empty utterance id"),
    ("a|t\na|u\n", ":2: duplicate utterance id"),
    ("\n\n", "no utterances"),
])
def test_malformed_lists_name_the_line(tmp_path, text, message):
    with pytest.raises(MetaListError, match=message):
        parse_meta_list(write(tmp_path, text))


def test_missing_list(tmp_path):
    with pytest.raises(MetaListError, match="not found"):
        parse_meta_list(tmp_path / "nope.lst")


def test_synthetic_set_is_deterministic_and_seed_tts_shaped(tmp_path):
    a = synthetic_items(12, tmp_path / "a", seed=3)
    b = synthetic_items(12, tmp_path / "b", seed=3)
    assert [x.target_text for x in a] == [x.target_text for x in b]
    for item in a:
        assert 8 <= len(item.target_text.split()) <= 30
        info = sf.info(item.prompt_wav)
        assert 3.0 <= info.duration <= 8.0
    path = tmp_path / "a" / "meta.lst"
    write_meta_list(a, path)
    assert [x.target_text for x in parse_meta_list(path)] == [x.target_text for x in a]


def test_forced_frame_specs():
    assert forced_frames("300", 3, 0) == [300, 300, 300]
    u = forced_frames("uniform:100:200", 50, 1)
    assert len(u) == 50 and all(100 <= v <= 200 for v in u) and u == forced_frames("uniform:100:200", 50, 1)
    assert all(v >= 1 for v in forced_frames("normal:5:50", 100, 0))
    assert forced_frames(None, 3, 0) is None
    with pytest.raises(Exception, match="force-output-frames"):
        forced_frames("zipf:1:2", 3, 0)
