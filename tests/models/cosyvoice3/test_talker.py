"""The CosyVoice3 talker against transformers' Qwen2 (what the official code runs), and the
static-shape decode step (the CUDA-graph path) against the eager paged step."""

import pytest
import torch

from intone.ops.attention import AttentionMetadata
from intone.ops.kv_cache import BlockManager, KVCache
from intone.protocol import VoiceReference

from .conftest import voice_audio


def hf_qwen(model):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = model.talker.shape
    cfg = Qwen2Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                      num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                      num_key_value_heads=s.num_key_value_heads, rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta,
                      max_position_embeddings=s.max_position_embeddings, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    hf = Qwen2ForCausalLM(cfg).to(torch.float64).eval()
    hf.load_state_dict(model.talker.llm.model.state_dict())
    return hf


def run_steps(model, prompt, continuation: list[int]):
    """Our engine path: prefill, then one decode step per continuation token; logits per step."""
    blocks, table = BlockManager(64, 16), []
    kv = KVCache(model.kv_layout, 64, 16, model.dtype, "cpu")
    out, ctx = [], 0
    tokens, codes = prompt.tokens, prompt.codes[:, 0]
    for step in range(len(continuation) + 1):
        q = tokens.shape[0]
        meta = AttentionMetadata.build([q], [ctx], [blocks.grow(table, ctx + q)], 16)
        out.append(model.talker(model.talker.embed(tokens, codes), meta, kv)[0])
        ctx += q
        if step < len(continuation):
            tokens, codes = torch.tensor([continuation[step]]), torch.tensor([continuation[step]])
    return out


def test_logits_equal_transformers_qwen2_fed_the_official_layout(cosy64):
    model = cosy64
    prompt = model.build_prompt("Hello there.", [VoiceReference(text="A reference.", audio=voice_audio(),
                                                                sample_rate=16000)])
    continuation = [17, 4000, 6560, 3]
    ours = run_steps(model, prompt, continuation)
    hf = hf_qwen(model)
    t = model.talker
    with torch.no_grad():
        emb = t.embed(prompt.tokens, prompt.codes[:, 0])
        speech = t.speech_embedding.weight
        # The official layout built by hand: sos row, text rows, task row, prompt speech rows.
        n_text = int((prompt.codes[:, 0] == -1).sum())
        manual = torch.cat([speech[6561:6562], hf.model.embed_tokens(prompt.tokens[1 : 1 + n_text]),
                            speech[6563:6564], speech[prompt.codes[n_text + 2 :, 0]]])
        assert torch.equal(manual, emb)
        seq = torch.cat([emb, speech[torch.tensor(continuation)]]).unsqueeze(0)
        hidden = hf(inputs_embeds=seq, output_hidden_states=True).hidden_states[-1][0]
        expected = t.llm_decoder(hidden[len(prompt) - 1 :])
    for i, logits in enumerate(ours):
        assert torch.allclose(logits.double(), expected[i].double(), atol=1e-9, rtol=0), i


def test_autocast_fp16_follows_the_official_fp16_talker_and_differs_from_a_half_cast(tiny_cosy_dir):
    """`ar.autocast: float16` is the official `fp16=True` talker: transformers' Qwen2 (fp32 weights) under fp16
    autocast. Our steps (prefill, then decodes over an fp16 KV cache) give its logits within fp16 rounding of the
    sums' order, and closer than the same weights cast whole to fp16 (the residual stream and norms in fp16)."""
    from intone.models.registry import load_model

    model = load_model(str(tiny_cosy_dir), dtype=torch.float32)
    hf = hf_qwen(model).float()
    prompt = model.build_prompt("Hello there.", [VoiceReference(text="A reference.", audio=voice_audio(),
                                                                sample_rate=16000)])
    continuation = [17, 4000, 6560, 3]
    t = model.talker
    with torch.no_grad():
        seq = torch.cat([t.embed(prompt.tokens, prompt.codes[:, 0]), t.speech_embedding.weight[continuation]])
        with torch.autocast("cpu", dtype=torch.float16):
            hidden = hf(inputs_embeds=seq[None], output_hidden_states=True).hidden_states[-1][0]
            expected = t.llm_decoder(hidden[len(prompt) - 1:]).float()
    halved = load_model(str(tiny_cosy_dir), dtype=torch.float16)
    model.use_ar_autocast(torch.float16)
    assert model.dtype == torch.float16 and t.speech_embedding.weight.dtype == torch.float32
    ours = torch.stack(run_steps(model, prompt, continuation))
    cast = torch.stack(run_steps(halved, prompt, continuation)).float()
    scale = expected.abs().max()
    assert ours.dtype == torch.float32
    err, cast_err = (ours - expected).abs().max() / scale, (cast - expected).abs().max() / scale
    assert err < 2e-3, err
    assert err < cast_err / 2, (err, cast_err)
