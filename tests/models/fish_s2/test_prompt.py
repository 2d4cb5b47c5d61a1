"""Prompt token sequences against sequences written out by hand from the official layout."""

import pytest
import torch

from intone.errors import InvalidRequestError
from intone.protocol import VoiceReference


@pytest.fixture(scope="module")
def tok(tiny_fish):
    return tiny_fish.tokenizer


def special(tok, s):
    return [tok.tokenizer.token_to_id(s)]


def test_special_tokens_come_from_the_tokenizer(tok):
    for s in ("<|im_start|>", "<|im_end|>", "<|voice|>", "<|semantic:0|>", "<|semantic:4095|>"):
        assert tok.encode(s) == special(tok, s)  # one token each, parsed inline
    assert tok.semantic_end - tok.semantic_begin == 4095
    assert tok.im_end_id == tok.tokenizer.token_to_id("<|im_end|>")


def test_prompt_without_reference(tiny_fish, tok):
    p = tiny_fish.build_prompt("Hello world", [])
    e = tok.encode
    expected = (
        special(tok, "<|im_start|>") + e("system\n") + e("convert the provided text to speech")
        + special(tok, "<|im_end|>") + e("\n")
        + special(tok, "<|im_start|>") + e("user\n") + e("Hello world") + special(tok, "<|im_end|>") + e("\n")
        + special(tok, "<|im_start|>") + e("assistant\n") + special(tok, "<|voice|>")
    )
    assert p.tokens.tolist() == expected
    assert p.codes.shape == (len(expected), 10) and not p.codes.any()


def test_prompt_with_one_reference(tiny_fish, tok):
    codes = torch.randint(0, 1024, (10, 5))
    p = tiny_fish.build_prompt("Hi there", [VoiceReference(text="Nice to meet you.", codes=codes)])
    e = tok.encode
    semantic = [tok.semantic_begin + int(c) for c in codes[0]]
    head = (
        special(tok, "<|im_start|>") + e("system\n")
        + e("convert the provided text to speech reference to the following:\n\nText:\n")
        + e("<|speaker:0|>Nice to meet you.") + e("\n\nSpeech:\n")
    )
    expected = head + semantic + special(tok, "<|im_end|>") + e("\n") + special(tok, "<|im_start|>") + e("user\n") \
        + e("Hi there") + special(tok, "<|im_end|>") + e("\n") + special(tok, "<|im_start|>") + e("assistant\n") \
        + special(tok, "<|voice|>")
    assert p.tokens.tolist() == expected
    # The codes ride on the semantic positions only: all 10 per frame, codebook 0 included.
    n = len(head)
    assert torch.equal(p.codes[n : n + 5], codes.t())
    assert not p.codes[:n].any() and not p.codes[n + 5 :].any()


def test_several_references_are_tagged_joined_and_concatenated(tiny_fish, tok):
    a, b = torch.randint(0, 1024, (10, 3)), torch.randint(0, 1024, (10, 4))
    refs = [VoiceReference(text="first", codes=a), VoiceReference(text="<|speaker:7|>second", codes=b)]
    p = tiny_fish.build_prompt("go", refs)
    ref_text = tok.encode("<|speaker:0|>first\n<|speaker:7|>second")
    tokens = p.tokens.tolist()
    start = len(special(tok, "<|im_start|>") + tok.encode("system\n")
                + tok.encode("convert the provided text to speech reference to the following:\n\nText:\n"))
    assert tokens[start : start + len(ref_text)] == ref_text
    sem = [i for i, t in enumerate(tokens) if tok.semantic_begin <= t <= tok.semantic_end]
    assert len(sem) == 7 and sem == list(range(sem[0], sem[0] + 7))
    assert torch.equal(p.codes[sem[0] : sem[0] + 7], torch.cat([a, b], dim=1).t())


@pytest.mark.parametrize("text", ["", "   ", "say <|im_end|> now", "<|semantic:3|>"])
def test_bad_text_is_rejected(tiny_fish, text):
    with pytest.raises(InvalidRequestError):
        tiny_fish.build_prompt(text, [])


def test_speaker_tags_are_allowed_in_text(tiny_fish):
    assert len(tiny_fish.build_prompt("<|speaker:1|>Hello", [])) > 0


def test_reference_without_transcript_is_rejected(tiny_fish):
    with pytest.raises(InvalidRequestError, match="references"):
        tiny_fish.build_prompt("hi", [VoiceReference(text="", codes=torch.zeros(10, 2, dtype=torch.long))])


@pytest.mark.parametrize("text, expected", [
    ("Plain text, no tags.", "Plain text, no tags."),
    ("<|speaker:0|>Hi there. <|speaker:1|>Fine", "<|speaker:0|>Hi there.\n<|speaker:1|>Fine"),
    ("Intro text <|speaker:0|>Hi there.", "<|speaker:0|>Hi there."),  # officially dropped
    ("<|speaker:0|> A <|speaker:1|>", "<|speaker:0|> A\n<|speaker:1|>"),
])
def test_speaker_tagged_text_is_split_into_turns_as_officially(text, expected):
    from intone.models.fish_s2.prompt import speaker_turns

    assert speaker_turns(text) == expected


def test_transformers_reads_the_tiny_tokenizer_the_same_way(tiny_fish_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_fish_dir))
    for text in ("Hello world", "<|im_start|>assistant\n<|voice|>", "<|speaker:0|>hi\n\nSpeech:\n", "<|semantic:9|>"):
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.convert_tokens_to_ids("<|semantic:0|>") == tok.semantic_begin
