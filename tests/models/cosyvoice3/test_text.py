"""CosyVoice3's text frontend against the official rules (frontend.text_normalize): what is
normalised, where sentences end, how they are packed, and that nothing is lost on the way."""

from hypothesis import given, settings
from hypothesis import strategies as st

from intone.models.cosyvoice3.text import CosyTextFrontend, keep_ascii_spaces, pack, sentences

WORDS = CosyTextFrontend(lambda text: len(text.split()))  # one unit per word: thresholds in plain sight


def test_sentences_end_at_marks_keep_closing_quotes_and_get_a_full_stop():
    assert sentences('He said "go." Then: left', frozenset(".?!;:"), ".") == ['He said "go."', " Then:", " left."]
    assert sentences("a.. b", frozenset("."), ".") == ["a.", " b."]  # a bare mark adds nothing


def test_packing_cuts_only_past_80_units_with_over_60_and_merges_a_short_tail():
    units = len
    parts = ["x" * 50, "y" * 20, "z" * 15, "w" * 10]
    # 50 + 20 = 70 (<= 80) stays; +15 = 85 > 80 with 70 > 60: cut; the tail 15 + 10 = 25 stands alone
    assert pack(parts, units) == ["x" * 50 + "y" * 20, "z" * 15 + "w" * 10]
    assert pack(["x" * 70, "y" * 30, "z" * 5], units) == ["x" * 70, "y" * 30 + "z" * 5]
    assert pack(["x" * 65, "y" * 30, "z" * 10], units) == ["x" * 65, "y" * 30 + "z" * 10]
    assert pack(["x" * 65, "y" * 30], units) == ["x" * 65, "y" * 30]
    assert pack(["x" * 65, "y" * 10], units) == ["x" * 65 + "y" * 10]  # never past 80 needed: no cut


def test_english_is_normalised_and_spoken_as_written():
    assert WORDS.normalize("I have 2 cats.") == "I have two cats."
    assert WORDS.segments("Hello") == ["Hello."]
    assert WORDS.segments("<|endofprompt|> 12 x") == ["<|endofprompt|> 12 x"]  # control tokens: as sent
    assert WORDS.segments("?!...") == []  # nothing to speak


def test_chinese_rules():
    assert keep_ascii_spaces("你 好 a b 中 c") == "你好a b中c"
    text = WORDS.normalize("面积是5m²（大约）。")
    assert "五" in text and "平方" in text and "（" not in text
    assert WORDS.normalize("好的，") .endswith("。")
    segments = WORDS.segments("今天天气很好。" * 30)  # 210 characters of 7-character sentences
    assert all(60 < len(s) <= 80 for s in segments[:-1]) and "".join(segments) == "今天天气很好。" * 30


sentence = st.text(alphabet=st.sampled_from("abcdefgh "), min_size=1, max_size=30).map(str.strip).filter(bool)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(sentence, st.sampled_from(".?!;:")), min_size=1, max_size=25))
def test_segments_lose_and_reorder_nothing(parts):
    text = " ".join(words + mark for words, mark in parts)
    segments = WORDS.segments(text)
    assert "".join(segments) == WORDS.normalize(text)
    assert all(s[-1] in ".?!;:" for s in segments)
    ends = frozenset(".?!;:")
    for before, after in zip(segments, segments[1:]):  # a cut only where the official rule makes one
        first = sentences(after, ends, ".")[0]
        assert len(before.split()) > 60 and len((before + first).split()) > 80
