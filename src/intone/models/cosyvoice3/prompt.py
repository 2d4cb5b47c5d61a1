"""The CosyVoice3 talker's prompt layout (its tokenizer is in `tokenizer.py`).

The talker sees `[sos][prompt text + target text][task][prompt speech tokens]`; sos, task and
speech tokens are rows of `speech_embedding`, text is Qwen2's `embed_tokens`. In a `Prompt`,
`codes[:, 0]` holds the speech-embedding id (-1 at text positions) and `tokens` the text id.
"""

from __future__ import annotations

import torch
from torch import Tensor

from intone.errors import InvalidRequestError
from intone.models.cosyvoice3.tokenizer import END_OF_PROMPT, CosyTokenizer

SYSTEM_PROMPT = "You are a helpful assistant.<|endofprompt|>"
INSTRUCT_PROMPT = "You are a helpful assistant. {}<|endofprompt|>"  # the official instruct2 form
SOS, EOS, TASK_ID = 6561, 6562, 6563
MIN_TOKEN_TEXT_RATIO, MAX_TOKEN_TEXT_RATIO = 2, 20


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
