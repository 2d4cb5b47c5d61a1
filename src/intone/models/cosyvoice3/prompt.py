"""CosyVoice3 text tokenizer and the talker's prompt layout.

The talker sees `[sos][prompt text + target text][task][prompt speech tokens]`; sos, task and
speech tokens are rows of `speech_embedding`, text is Qwen2's `embed_tokens`. In a `Prompt`,
`codes[:, 0]` holds the speech-embedding id (-1 at text positions) and `tokens` the text id.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from intone.errors import InvalidRequestError, ModelLoadError

BLANK_EN = "CosyVoice-BlankEN"  # the checkpoint's folder of the Qwen2 tokenizer and config
SYSTEM_PROMPT = "You are a helpful assistant.<|endofprompt|>"
INSTRUCT_PROMPT = "You are a helpful assistant. {}<|endofprompt|>"  # the official instruct2 form
END_OF_PROMPT = "<|endofprompt|>"
SOS, EOS, TASK_ID = 6561, 6562, 6563
MIN_TOKEN_TEXT_RATIO, MAX_TOKEN_TEXT_RATIO = 2, 20

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


def talker_prompt(tokenizer: CosyTokenizer, text: str, ref_text: str, ref_tokens: Tensor | None,
                  instructions: str | None = None):
    """(tokens [L], codes [L, 1], target text length) for one request.

    With instructions (the official instruct2 mode) the talker's prompt text is the instruction
    and it sees no reference speech (the flow still takes the voice). Otherwise, with a transcript
    the reference is a zero-shot prompt (its text gets the system prompt unless it carries
    `<|endofprompt|>` itself) and its speech tokens go to the talker; without one (cross-lingual)
    the talker sees neither, and the target text gets the system prompt.
    """
    if not text.strip():
        raise InvalidRequestError("input", "must not be empty")
    if instructions is not None and instructions.strip():
        instruction = instructions.strip()
        prompt_text = instruction if END_OF_PROMPT in instruction else INSTRUCT_PROMPT.format(instruction)
        speech = torch.zeros(0, dtype=torch.long)
    elif ref_text.strip():
        prompt_text = ref_text if END_OF_PROMPT in ref_text else SYSTEM_PROMPT + ref_text
        speech = ref_tokens if ref_tokens is not None else torch.zeros(0, dtype=torch.long)
    else:
        prompt_text, speech = "", torch.zeros(0, dtype=torch.long)
        text = text if END_OF_PROMPT in text else SYSTEM_PROMPT + text
    prompt_ids = tokenizer.encode(prompt_text) if prompt_text else []
    target_ids = tokenizer.encode(text)
    text_ids = torch.tensor(prompt_ids + target_ids, dtype=torch.long)
    n_text, n_speech = text_ids.shape[0], speech.shape[0]
    tokens = torch.cat([torch.zeros(1, dtype=torch.long), text_ids, torch.zeros(1 + n_speech, dtype=torch.long)])
    codes = torch.cat([
        torch.tensor([SOS]), torch.full((n_text,), -1), torch.tensor([TASK_ID]), speech.to(torch.long),
    ]).unsqueeze(1)
    return tokens, codes, len(target_ids)
