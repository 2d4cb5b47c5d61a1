"""The static-shape decode steps that CUDA graphs capture, against the eager paged steps."""

import pytest
import torch

from intone.models.registry import load_model
from intone.ops.attention import AttentionMetadata
from intone.ops.kv_cache import BlockManager, KVCache


def _model(name, tiny_cache, device="cpu", dtype=torch.float64):
    from intone.models import resolve_model_dir

    return load_model(str(resolve_model_dir(f"tiny:{name}")), device=device, dtype=dtype, codec_dtype=torch.float32)


def _paths(model):
    """(embed, eager step -> per-row output, static decode fn) for a model."""
    if model.name == "fish-s2":
        lm = model.lm
        return (lambda ids: lm.embed(ids, torch.zeros(len(ids), model.num_codebooks, dtype=torch.long,
                                                      device=ids.device)),
                lm.forward_slow, lm.decode_slow)
    t = model.talker
    return lambda ids: t.embed(ids, torch.full_like(ids, -1)), t.forward, t.decode_step


def _prefilled(model, lens, device):
    embed, eager, _ = _paths(model)
    blocks, tables = BlockManager(64, 16), [[] for _ in lens]
    kv = KVCache(model.kv_layout, 64, 16, model.dtype, device)
    torch.manual_seed(0)
    for table, n in zip(tables, lens):
        meta = AttentionMetadata.build([n], [0], [blocks.grow(table, n)], 16, device)
        eager(embed(torch.randint(0, 50, (n,), device=device)), meta, kv)
    meta = AttentionMetadata.build([1] * len(lens), lens, [blocks.grow(t, n + 1) for t, n in zip(tables, lens)],
                                   16, device)
    return kv, meta, tables


@pytest.mark.parametrize("name", ["fish-s2", "cosyvoice3"])
def test_static_decode_equals_eager_and_padding_rows_touch_only_the_scratch_block(name, tiny_cache):
    model = _model(name, tiny_cache)
    embed, eager, static = _paths(model)
    lens = [5, 40, 17]
    kv, meta, tables_of = _prefilled(model, lens, "cpu")
    x = embed(torch.tensor([7, 8, 9]))
    k0, v0 = kv.k.clone(), kv.v.clone()
    expected = eager(x, meta, kv)
    kv.k.copy_(k0), kv.v.copy_(v0)
    rows, width = 4, 5  # one padding row; tables padded with the scratch block
    tables = torch.full((rows, width), kv.num_blocks)
    tables[:3, : meta.block_tables.shape[1]] = meta.block_tables
    got = static(torch.cat([x, x[:1]]), torch.cat([meta.positions, torch.zeros(1, dtype=torch.long)]),
                 torch.cat([meta.slot_mapping, torch.tensor([kv.scratch_slot])]), tables,
                 torch.cat([meta.seq_lens, torch.ones(1, dtype=torch.long)]), kv)
    assert torch.allclose(got[:3].double(), expected.double(), atol=1e-10, rtol=0)
    owned = {b for table in tables_of for b in table}
    changed = (kv.k[:, : kv.num_blocks] != k0[:, : kv.num_blocks]).any(dim=(0, 2, 3, 4)).nonzero().flatten()
    assert set(changed.tolist()) <= owned


def test_the_static_step_reads_only_the_blocks_a_step_needs(tiny_cache):
    """The GPU's static step (padded buffers per (rows, KV) bucket; run here on the CPU) given block tables
    lent far ahead, as a harness may lend them: the tokens of the runner's dynamic steps, and no error
    from tables wider than the step's KV bucket."""
    from intone.engine.model_runner import ModelRunner, StepInput
    from intone.models.base import Prompt
    from intone.protocol import SamplingParams

    model = _model("fish-s2", tiny_cache)
    g = torch.Generator().manual_seed(3)
    prompts = [Prompt(torch.randint(0, 50, (n,), generator=g), torch.zeros(n, model.num_codebooks, dtype=torch.long))
               for n in (38, 9)]
    tokens = {}
    for static in (False, True):
        kv = KVCache(model.kv_layout, 64, 16, model.dtype, "cpu")
        blocks, runner = BlockManager(64, 16), ModelRunner(model, kv)
        if static:
            runner.graphs = runner._step_graphs()  # what a GPU builds, graphs or not
        reqs = [StepInput(f"r{i}", p, SamplingParams(seed=i), [], None, blocks.grow([], len(p) + 300))
                for i, p in enumerate(prompts)]
        for _ in range(4):
            out, _, codes = runner.run(reqs).to_host()
            reqs = [StepInput(r.request_id, r.prompt, r.params, r.tokens + [t], c, r.block_table)
                    for r, t, c in zip(reqs, out, codes)]
        tokens[static] = [r.tokens for r in reqs]
        if static:
            assert runner.graphs.eager == 4  # the prefill (its prompts as rows) and the three decodes ran static
    assert tokens[True] == tokens[False]
