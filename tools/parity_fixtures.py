"""Parity fixtures: the official fish-speech and CosyVoice code, run on intone's tiny checkpoints.

Run by hand, never in CI. It loads the tiny checkpoints (real on-disk layout) into the OFFICIAL modules,
imported from checkouts outside the repository, runs them on fixed inputs and writes what they give to
`tests/fixtures/parity/{fish_s2,cosyvoice3}.{npz,json}`; `tests/models/*/test_parity_official.py` compare
intone with them. No official code is copied into the repository.

Fish runs in float32 (its modules compute norms and RoPE in float32 whatever the model dtype). CosyVoice3
runs in float64 (talker, flow, HiFT; the flow's mel comes out as float32 either way, and the streaming loop
hands it to HiFT as float64, the same values); all is stored as float32. Where the official code samples,
argmax takes its place (Fish: top_k=1; CosyVoice3: the talker's sampling function), so no RNG is involved.
The official modules run as they are; besides that, three things are set from outside (each where it is
done): the tiny HiFT's F0 output layer is scaled (COSY_F0_SCALE), the float32 mel is handed to the float64
HiFT as float64, and `python -O` (below).

Setup (once; the official code's dependencies go into a venv of their own, never into intone's):

    mkdir -p /tmp/official/fish-speech /tmp/official/CosyVoice/third_party/Matcha-TTS
    git --git-dir=<fetched fishaudio/fish-speech> archive 3dd1f85c402ee6f0a17c2971d3b0dd8d881ca139 \
        | tar -x -C /tmp/official/fish-speech
    git --git-dir=<fetched FunAudioLLM/CosyVoice> archive ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40 \
        | tar -x -C /tmp/official/CosyVoice
    git --git-dir=<fetched shivammehta25/Matcha-TTS> archive dd9105b34bf2be2230f4aa1e4769fb586a3c824e \
        | tar -x -C /tmp/official/CosyVoice/third_party/Matcha-TTS      # CosyVoice's submodule commit
    python3.11 -m venv /tmp/parity-venv
    echo <intone venv>/lib/python3.11/site-packages > /tmp/parity-venv/lib/python3.11/site-packages/zz_intone.pth
    P=/tmp/parity-venv/bin/pip     # torch 2.13 (CPU), numpy, scipy, safetensors come from intone's venv
    $P install hyperpyyaml==1.2.3 conformer==0.3.2 diffusers==0.29.0 x-transformers==2.11.24 omegaconf==2.3.0 \
        hydra-core==1.3.2 lightning==2.2.4 transformers==4.51.3 tiktoken loguru loralib gdown==5.1.0 wget==3.2 \
        tensorboard flatten-dict argbind pyloudnorm importlib-resources ffmpy markdown2 randomname wheel "setuptools<81"
    $P install --no-deps --no-build-isolation openai-whisper==20231117 numba llvmlite \
        descript-audio-codec==1.0.0 descript-audiotools==0.7.2 julius torch-stoi pystoi torchaudio==2.11.1
    rm /tmp/parity-venv/lib/python3.11/site-packages/torchaudio/lib/*.so   # CUDA-linked; the pure-Python parts suffice

(the pins are the official requirements'; transformers 4.51.3 is CosyVoice's and within fish-speech's <=4.57.3).

Regenerate (the tiny checkpoints are made by intone's own venv, so they are the ones the tests make):

    intone make-tiny fish-s2 /tmp/parity/fish-s2 && intone make-tiny cosyvoice3 /tmp/parity/cosyvoice3
    /tmp/parity-venv/bin/python -O tools/parity_fixtures.py --fish-speech /tmp/official/fish-speech \
        --cosyvoice /tmp/official/CosyVoice --fish-dir /tmp/parity/fish-s2 --cosy-dir /tmp/parity/cosyvoice3

`-O` is required: the official `CosyVoice3LM.inference` asserts that token 151646 (the real vocabulary's
`<|endofprompt|>`) is in the text, which the tiny vocabulary cannot satisfy; nothing else is changed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src")]
from tests.parity import FIXTURES, checkpoint_digest, save  # noqa: E402

FISH_SPEECH_COMMIT = "3dd1f85c402ee6f0a17c2971d3b0dd8d881ca139"
COSYVOICE_COMMIT = "ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40"
MATCHA_COMMIT = "dd9105b34bf2be2230f4aa1e4769fb586a3c824e"

FISH_TEXT = "Hello world. This is a test of the tiny model."
FISH_REF_TEXT = "The quick brown fox jumps over the lazy dog."
FISH_TAGGED_TEXT = "<|speaker:0|>Hello there. <|speaker:1|>How are you today?"
FISH_MAX_NEW = 12
FISH_LOGIT_STEPS = 3  # slow-AR logits kept for the first steps (prefill + decodes)
FISH_FAST_POSITIONS = 2  # fast-AR logits of the first frame kept for codebooks 1..this
COSY_TEXT = "Hello world, this is a test of the tiny model."
COSY_REF_TEXT = "She said the weather would be fine."
COSY_SYSTEM = "You are a helpful assistant.<|endofprompt|>"
COSY_LOGIT_STEPS = 2
COSY_GREEDY_STEPS = 48  # past the minimum length (2 x 14 text tokens), where the stop ids are allowed
COSY_PROMPT_TOKENS = 24  # the first hop is padded by 1 to reach 25
COSY_FLOW_TOKENS = 12
COSY_STREAM_TOKENS = 81  # hops 26 (25 padded by 1), 50, then a final chunk of 5
# The tiny HiFT's random F0 predictor gives F0 of ~1 Hz, all below the voiced threshold (10 Hz), so the sine
# source would never run. Its output layer (a plain Linear) is scaled by this power of two (exact in every
# dtype) on both sides, for F0 of ~0.3-290 Hz: voiced and unvoiced frames.
COSY_F0_SCALE = 256.0


def with_path(*paths: Path) -> None:
    for p in reversed(paths):
        sys.path.insert(0, str(p))


def record_calls(obj, name: str, log: list, pick=lambda args, kwargs, out: out):
    """Wrap obj.name (an instance attribute now) so every call is logged through `pick`; it still runs."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        log.append(pick(args, kwargs, out))
        return out

    setattr(obj, name, wrapper)


# ---- Fish S2 Pro ------------------------------------------------------------------------------

def fish_lm(model_dir: Path):
    from fish_speech.models.text2semantic.llama import DualARTransformer, _remap_fish_qwen3_omni_keys
    from safetensors.torch import load_file

    model = DualARTransformer.from_pretrained(str(model_dir), load_weights=True)
    # The official load is lenient (strict=False); check that every tensor was read.
    weights = {}
    for shard in sorted(model_dir.glob("model-*.safetensors")):
        weights.update(load_file(str(shard)))
    model.load_state_dict(_remap_fish_qwen3_omni_keys(weights), strict=True)
    return model.to(dtype=torch.float32).eval()


def fish_generate(inference, model, text: str, max_new: int, refs: tuple[list, list] | None = None):
    """Official generate_long, greedy (top_k=1). Returns (prompt [1+K, T], generate's output [1+K, T+n],
    slow logits per step [steps, V], fast logits per step and codebook 1..K-1 [steps, K-1, codebook])."""
    calls, slow, fast = [], [], []
    original = inference.generate
    record_calls(inference, "generate", calls, lambda a, k, out: (k["prompt"].clone(), out.clone()))
    record_calls(model, "forward_generate", slow, lambda a, k, out: out.logits[0, -1].clone())
    record_calls(model, "forward_generate_fast", fast, lambda a, k, out: (int(a[1][0]), out[0, -1].clone()))
    try:
        prompt_text, prompt_tokens = refs if refs else (None, None)
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the prompt, coloured
            list(inference.generate_long(model=model, device="cpu", decode_one_token=inference.decode_one_token_ar,
                                         text=text, max_new_tokens=max_new, top_k=1, top_p=0.9, temperature=0.7,
                                         prompt_text=prompt_text, prompt_tokens=prompt_tokens))
    finally:
        inference.generate = original
        del model.forward_generate, model.forward_generate_fast
    (prompt, out), = calls
    fast = torch.stack([logits for pos, logits in fast if pos > 0]).unflatten(0, (len(slow), -1))
    return prompt, out, torch.stack(slow), fast


def fish_codec(fish_checkout: Path, model_dir: Path):
    """The official modded DAC built from its own yaml with the tiny checkpoint's sizes, loaded strictly."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    # intone reads the sizes only; were they wrong, the strict load below would fail
    from intone.models.fish_s2.codec import config_from_state, fold_weight_norm

    state = torch.load(model_dir / "codec.pth", map_location="cpu", weights_only=True)
    size = config_from_state(fold_weight_norm(state))
    cfg = OmegaConf.load(fish_checkout / "fish_speech" / "configs" / "modded_dac_vq.yaml")
    cfg.encoder_dim, cfg.decoder_dim = size.encoder_dim, size.decoder_dim
    cfg.encoder_rates, cfg.decoder_rates = list(size.encoder_rates), list(size.decoder_rates)
    cfg.encoder_transformer_layers = list(size.encoder_transformer_layers)
    q = cfg.quantizer
    q.input_dim, q.n_codebooks, q.codebook_size = size.latent_dim, size.n_codebooks, size.codebook_size
    q.semantic_codebook_size, q.codebook_dim = size.semantic_codebook_size, size.codebook_dim
    q.downsample_factor = list(size.downsample_factor)
    for module in (q.post_module, q.pre_module):
        module.input_dim, module.window_size = size.latent_dim, size.quantizer_window
        module.config.update(n_layer=size.quantizer_layers, dim=size.latent_dim, n_head=size.latent_dim // 64,
                             intermediate_size=3 * size.latent_dim)
    codec = instantiate(cfg)
    codec.load_state_dict(state, strict=True)
    return codec.float().eval()


def fish_fixtures(checkout: Path, model_dir: Path) -> tuple[dict, dict]:
    with_path(checkout)
    from loguru import logger

    logger.remove()
    import fish_speech.models.text2semantic.inference as inference

    torch.manual_seed(0)
    model = fish_lm(model_dir)
    gen = torch.Generator().manual_seed(0)
    ref_codes = torch.cat([torch.randint(0, 4096, (1, 12), generator=gen),  # semantic, then residual codes
                           torch.randint(0, 1024, (9, 12), generator=gen)])
    prompt, out, slow, fast = fish_generate(inference, model, FISH_TEXT, FISH_MAX_NEW, ([FISH_REF_TEXT], [ref_codes]))
    plain, _, _, _ = fish_generate(inference, model, FISH_TAGGED_TEXT, 2)
    tok = model.tokenizer
    begin, end, stop = tok.semantic_begin_id, tok.semantic_end_id, tok.get_token_id("<|im_end|>")
    frames = out[:, prompt.shape[1]:]
    allowed = torch.cat([slow[:, begin:end + 1], slow[:, stop:stop + 1]], 1)  # constrained decoding's columns

    codec = fish_codec(checkout, model_dir)
    decode_codes = torch.cat([torch.randint(0, 4096, (1, 1, 4), generator=gen),  # residuals past 1023: clamped
                              torch.randint(0, 4096, (1, 9, 4), generator=gen)], dim=1)
    clip = (0.3 * torch.sin(torch.arange(11025) * (2 * torch.pi * 220 / 44100)) * 32767).round().short()
    with torch.inference_mode():
        audio = codec.from_indices(decode_codes.clone())[0, 0]
        codes, lengths = codec.encode(clip.float()[None, None] / 32768)
    arrays = dict(
        ref_codes=ref_codes.numpy(), prompt=prompt.numpy(), prompt_plain=plain.numpy(), frames=frames.numpy(),
        slow_logits=allowed[:FISH_LOGIT_STEPS].numpy(),
        fast_logits=fast[0, :FISH_FAST_POSITIONS].numpy(), decode_codes=decode_codes.numpy(),
        decode_audio=audio.numpy(), encode_clip=clip.numpy(), encode_codes=codes[0, :, : lengths[0]].numpy(),
    )
    meta = dict(text=FISH_TEXT, ref_text=FISH_REF_TEXT, tagged_text=FISH_TAGGED_TEXT, max_new_tokens=FISH_MAX_NEW,
                sampling="top_k=1 (greedy), top_p=0.9, temperature=0.7", dtype="float32",
                official="fishaudio/fish-speech", official_commit=FISH_SPEECH_COMMIT,
                stopped=bool(frames[0, -1] == stop), min_top2_margin_slow=top2_margin(allowed),
                min_top2_margin_fast=top2_margin(fast.flatten(0, 1)))
    return arrays, meta


def top2_margin(logits: torch.Tensor) -> float:
    """Smallest gap between the best and the second-best logit over the rows (greedy steps): a near-tie
    would make the greedy choice hang on float rounding."""
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


# ---- CosyVoice3 -------------------------------------------------------------------------------

def cosy_model(model_dir: Path):
    from hyperpyyaml import load_hyperpyyaml

    from cosyvoice.cli.model import CosyVoice3Model

    with open(model_dir / "cosyvoice3.yaml") as f:  # as the official CosyVoice3 class reads it
        cfg = load_hyperpyyaml(f, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN")})
    model = CosyVoice3Model(cfg["llm"], cfg["flow"], cfg["hift"], False)
    model.load(str(model_dir / "llm.pt"), str(model_dir / "flow.pt"), str(model_dir / "hift.pt"))
    for module in (model.llm, model.flow, model.hift):
        module.double()
    return model


def cosy_talker(model, model_dir: Path, prompt_tokens: torch.Tensor, speaker: torch.Tensor) -> tuple[dict, float]:
    """Official CosyVoice3LM.inference with argmax for its sampling function: the tokenizer's ids, the first
    steps' choices (the last one the stop id, if it stopped) and the first steps' logits; and the smallest
    top-2 gap of those choices."""
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer

    tokenizer = get_qwen_tokenizer(str(model_dir / "CosyVoice-BlankEN"), True, "cosyvoice3")
    text = torch.tensor([tokenizer.encode(COSY_TEXT)])
    prompt_text = torch.tensor([tokenizer.encode(COSY_SYSTEM + COSY_REF_TEXT)])
    llm, logits, chosen, scores_seen = model.llm, [], [], []

    def argmax(scores, decoded, k):  # the sampling function's signature; scores: log-probs, ignore_eos applied
        scores_seen.append(scores.clone())
        chosen.append(int(scores.argmax()))
        return chosen[-1]

    hook = llm.llm_decoder.register_forward_hook(lambda m, i, out: logits.append(out[0].clone()))
    llm.sampling = argmax
    try:
        steps = llm.inference(text=text, text_len=torch.tensor([text.shape[1]]), prompt_text=prompt_text,
                              prompt_text_len=torch.tensor([prompt_text.shape[1]]), prompt_speech_token=prompt_tokens,
                              prompt_speech_token_len=torch.tensor([prompt_tokens.shape[1]]), embedding=speaker)
        list(itertools.islice(steps, COSY_GREEDY_STEPS))
    finally:
        hook.remove()
    margin = top2_margin(torch.stack(scores_seen))
    return dict(text_ids=text[0].numpy(), prompt_text_ids=prompt_text[0].numpy(), talker_tokens=np.array(chosen),
                talker_logits=torch.stack(logits[:COSY_LOGIT_STEPS]).float().numpy()), margin


def cosy_flow_hift(model, prompt_tokens, prompt_mel, speaker, tokens) -> dict:
    def flow(streaming: bool, finalize: bool):
        mel, _ = model.flow.inference(
            token=tokens.int(), token_len=torch.tensor([tokens.shape[1]]), prompt_token=prompt_tokens,
            prompt_token_len=torch.tensor([prompt_tokens.shape[1]]), prompt_feat=prompt_mel,
            prompt_feat_len=torch.tensor([prompt_mel.shape[1]]), embedding=speaker, streaming=streaming,
            finalize=finalize)
        return mel

    with torch.inference_mode():
        full = flow(False, True)
        chunk = flow(True, False)
        audio, _ = model.hift.inference(speech_feat=full.double(), finalize=True)
    return dict(flow_tokens=tokens[0].numpy(), flow_mel=full[0].float().numpy(),
                flow_mel_streaming=chunk[0].float().numpy(), hift_audio=audio[0].float().numpy())


def cosy_stream(model, prompt_tokens, prompt_mel, speaker, tokens) -> dict:
    """The official streaming loop (CosyVoice2Model.tts, stream=True, with CosyVoice3Model.token2wav) on
    fixed tokens through its voice-conversion entry (which hands the tokens over as they are)."""
    # The official flow returns its mel as float32 whatever its own dtype, which a float64 HiFT refuses:
    # HiFT gets the same values as float64.
    hift_inference = model.hift.inference
    model.hift.inference = lambda speech_feat, finalize=True: hift_inference(speech_feat.double(), finalize)
    calls = []
    lookahead = model.flow.pre_lookahead_len
    record_calls(model, "token2wav", calls,  # the span of new tokens each call releases
                 lambda a, k, out: (k["token_offset"], k["token"].shape[1] - (0 if k["finalize"] else lookahead)))
    model.token_hop_len = 25  # the hop lives on the shared model object; start from the official initial value
    chunks = [c["tts_speech"][0].float() for c in model.tts(
        source_speech_token=tokens, flow_embedding=speaker, flow_prompt_speech_token=prompt_tokens,
        prompt_speech_feat=prompt_mel, stream=True)]
    del model.token2wav, model.hift.inference
    return dict(stream_tokens=tokens[0].numpy(), stream_spans=np.array(calls),
                stream_sizes=np.array([c.shape[0] for c in chunks]), stream_audio=torch.cat(chunks).numpy())


def cosy_fixtures(checkout: Path, model_dir: Path) -> tuple[dict, dict]:
    with_path(checkout, checkout / "third_party" / "Matcha-TTS")
    model = cosy_model(model_dir)
    with torch.no_grad():  # see COSY_F0_SCALE
        for p in model.hift.f0_predictor.classifier.parameters():
            p.mul_(COSY_F0_SCALE)
    gen = torch.Generator().manual_seed(0)
    prompt_tokens = torch.randint(0, 6561, (1, COSY_PROMPT_TOKENS), generator=gen).int()
    prompt_mel = torch.randn(1, 2 * COSY_PROMPT_TOKENS, 80, generator=gen, dtype=torch.float64)
    speaker = torch.randn(1, 192, generator=gen, dtype=torch.float64)
    arrays = dict(prompt_tokens=prompt_tokens[0].numpy(), prompt_mel=prompt_mel[0].float().numpy(),
                  speaker=speaker[0].float().numpy())
    # The stored inputs are float32; the official modules get exactly those values (in float64).
    prompt_mel, speaker = prompt_mel.float().double(), speaker.float().double()
    talker, margin = cosy_talker(model, model_dir, prompt_tokens, speaker)
    arrays |= talker
    flow_tokens = torch.randint(0, 6561, (1, COSY_FLOW_TOKENS), generator=gen)
    arrays |= cosy_flow_hift(model, prompt_tokens, prompt_mel, speaker, flow_tokens)
    stream_tokens = torch.randint(0, 6561, (1, COSY_STREAM_TOKENS), generator=gen)
    arrays |= cosy_stream(model, prompt_tokens, prompt_mel, speaker, stream_tokens)
    meta = dict(text=COSY_TEXT, ref_text=COSY_REF_TEXT, official_prompt_text=COSY_SYSTEM + COSY_REF_TEXT,
                sampling="argmax in place of the talker's sampling function",
                dtype="float64 (the flow's mel is float32, as officially), stored as float32",
                official="FunAudioLLM/CosyVoice", official_commit=COSYVOICE_COMMIT,
                matcha_tts_commit=MATCHA_COMMIT, talker_min_top2_margin=margin, hift_f0_scale=COSY_F0_SCALE)
    return arrays, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fish-speech", type=Path, help="checkout of fishaudio/fish-speech at FISH_SPEECH_COMMIT")
    p.add_argument("--cosyvoice", type=Path, help="checkout of FunAudioLLM/CosyVoice at COSYVOICE_COMMIT")
    p.add_argument("--fish-dir", type=Path, help="`intone make-tiny fish-s2` output")
    p.add_argument("--cosy-dir", type=Path, help="`intone make-tiny cosyvoice3` output")
    p.add_argument("--out", type=Path, default=FIXTURES)
    args = p.parse_args()
    if not sys.flags.optimize:
        sys.exit("run with python -O (see the docstring: the official CosyVoice3 talker asserts a real-vocabulary id)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    jobs = [("fish_s2", fish_fixtures, args.fish_speech, args.fish_dir),
            ("cosyvoice3", cosy_fixtures, args.cosyvoice, args.cosy_dir)]
    for name, make, checkout, model_dir in jobs:
        if checkout is None or model_dir is None:
            continue
        arrays, meta = make(checkout.resolve(), model_dir.resolve())
        meta |= dict(checkpoint_digest=checkpoint_digest(model_dir), torch=torch.__version__,
                     made_by="tools/parity_fixtures.py")
        save(name, arrays, meta, args.out)
        print(name, {k: v.shape for k, v in arrays.items()})


if __name__ == "__main__":
    main()
