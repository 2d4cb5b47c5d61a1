"""The Qwen2 tokenizer of CosyVoice3 with its special tokens. Importing this module loads no torch (the
API's text frontend counts tokens with it); making a tokenizer loads transformers, which does."""

from __future__ import annotations

from pathlib import Path

from intone.errors import ModelLoadError

BLANK_EN = "CosyVoice-BlankEN"  # the checkpoint's folder of the Qwen2 tokenizer and config
END_OF_PROMPT = "<|endofprompt|>"

_ARPABET = ("AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH "
            "EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG OW OW0 "
            "OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH")
_PINYIN = ("a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng "
           "ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang "
           "ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng "
           "uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng "
           "òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo "
           "ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ")
# The official CosyVoice3 additional special tokens, in the official order (their ids follow
# from this order): markup and events, ARPABET phones, pinyin initials and finals.
SPECIAL_TOKENS = [
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]", "<|endofsystem|>",
] + [f"[{p}]" for p in _ARPABET.split()] + [f"[{p}]" for p in _PINYIN.split()]


class CosyTokenizer:
    """The Qwen2 tokenizer of `CosyVoice-BlankEN` plus the CosyVoice3 special tokens."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot load the Qwen2 tokenizer ({e})") from None
        self.hf.add_special_tokens({
            "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "additional_special_tokens": SPECIAL_TOKENS,
        })
        self.end_of_prompt_id = self.hf.convert_tokens_to_ids(END_OF_PROMPT)

    def __len__(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf([text])["input_ids"][0]
