"""The flow's whole-response calls at fixed sizes (`flow_slots`, what `cosyvoice3.flow.cuda_graphs` replays with
the varlen kernel): every row gets the padded solve's mel, and start-up captures every shape the codec's calls
take."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.engine.cuda_graphs import FunctionGraphs
from intone.models.cosyvoice3.flow import graph_rows
from intone.models.cosyvoice3.flow_slots import (MIN_ROW_FRAMES, SLOT_BUCKETS, SlotLayout, captured_shapes,
                                                 layout_tensors, slot_bucket, slot_layout, solve_slots)

from .test_flow import make_flow, request


@pytest.fixture(scope="module")
def varlen_flow():
    flow = make_flow()
    flow.decoder.estimator.attention_kernel = "varlen"
    return flow


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(4, 90), st.booleans()), min_size=1, max_size=5),
       st.integers(0, 9), st.integers(0, 2), st.booleans())
def test_a_call_at_fixed_sizes_gives_each_row_the_padded_mel(varlen_flow, rows, more_rows, more_buckets, paused):
    """Whole rows of any lengths (finalized or not), their rows bucket padded further with empty rows and their
    frames by a padding row up to a larger bucket: each row's mel is the padded SDPA solve's (float64, to 1e-12),
    from one call of the fixed-shape solve, or (paused between steps) one call of the fixed-shape step a step
    (eager on a CPU, where nothing is captured)."""
    g = torch.Generator().manual_seed(len(rows) * 10 + more_rows)
    reqs = [request(g, prompt=p, tokens=n, streaming=False, finalize=f) for p, n, f in rows]
    lengths = varlen_flow.mel_lengths(reqs)
    layout = slot_layout(lengths, 4096)
    bucket = SLOT_BUCKETS.index(layout.slots) + more_buckets
    layout = SlotLayout(layout.lengths, graph_rows(len(reqs) + more_rows), SLOT_BUCKETS[bucket], layout.longest)
    graphs, pauses = FunctionGraphs(), []
    got = solve_slots(varlen_flow, reqs, layout, graphs, (lambda: pauses.append(1)) if paused else None)
    varlen_flow.decoder.estimator.attention_kernel = "sdpa"
    try:
        want = varlen_flow.inference(reqs)
    finally:
        varlen_flow.decoder.estimator.attention_kernel = "varlen"
    steps = varlen_flow.decoder.n_timesteps
    assert (graphs.eager, len(pauses)) == ((steps, steps) if paused else (1, 0)) and graphs.replays == 0
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_layout_doubles_rows_and_hides_the_padding_row():
    """Each half: the real rows, the empty rows, the padding row; its frames valid except the padding row's."""
    layout = SlotLayout((5, 3), rows=4, slots=12, longest=8)
    rows, positions, valid, gapped, kept, starts, bound = layout_tensors(layout, 2, torch.device("cpu"))
    assert starts.tolist() == [0, 5, 8, 8, 8, 12, 17, 20, 20, 20, 24]
    assert rows.tolist() == [0] * 5 + [1] * 3 + [4] * 4 + [5] * 5 + [6] * 3 + [9] * 4
    assert positions.tolist()[:12] == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert valid[0].tolist() == ([True] * 8 + [False] * 4) * 2
    assert bound.shape == (8, 0) and kept.shape[1] == 24 + 2 * 10 + 1 and gapped.shape == (24,)


def test_buckets_pad_little():
    assert all(a < b <= a + max(256, a // 4) for a, b in zip(SLOT_BUCKETS, SLOT_BUCKETS[1:]))
    assert slot_bucket(1) == 512 and slot_bucket(513) == 768 and slot_bucket(SLOT_BUCKETS[-1] + 1) is None
    assert slot_layout([300, 1100], 1024) is None  # a row beyond the graphs' bound
    assert slot_layout([1000] * 33, 1024) is None  # beyond the largest bucket


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(MIN_ROW_FRAMES, 1024), min_size=1, max_size=64))
def test_start_up_captures_every_shape_a_call_of_whole_rows_takes(lengths):
    """A call of up to 64 rows (codec.max_batch), each of at least MIN_ROW_FRAMES and at most graph_frames mel
    frames, within 2 x max_padded_frames frames (its tokens' bound) has a captured shape."""
    shapes = set(captured_shapes(64, 1024, 2 * 16384))
    layout = slot_layout(lengths, 1024)
    if sum(lengths) <= 2 * 16384:
        assert (layout.rows, layout.slots) in shapes
    assert len(shapes) < 160


@pytest.mark.gpu
def test_steps_replayed_from_their_graphs_give_the_eager_steps_and_the_sdpa_mel(no_tf32):
    """As the full-response stage runs it (compiled DiT, bf16 autocast without the cast cache, FlashAttention's
    variable-length kernel): two calls of whole rows, each captured at its layout's shape (the whole solve, and its
    step for a codec that pauses) after the start-up's compile calls. A replayed solve, whole or step by step,
    gives the eager fixed-size solve's mel bit for bit, and the dense-mask SDPA flow's on padded rows to bf16
    rounding; no replay compiles anything."""
    from intone.models.cosyvoice3.flow_slots import capture_slots
    from intone.models.cosyvoice3.vocoder import compile_batches, compile_dit

    from .test_flow import gpu_batches

    flow = make_flow(torch.float32).cuda()
    g = torch.Generator().manual_seed(13)
    batches = gpu_batches(g, (((8, 60, False), (12, 41, False), (5, 97, False)), ((20, 130, False), (3, 33, False))))
    graphs, steps = FunctionGraphs(), flow.decoder.n_timesteps
    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
        dense = [flow.inference(b) for b in batches]
        flow.decoder.estimator.attention_kernel = "varlen"
        torch._dynamo.reset()
        compile_dit(flow.decoder.estimator, "dit")
        for batch in compile_batches(flow, torch.device("cuda")):
            flow.inference(batch)
        layouts = [slot_layout(flow.mel_lengths(b), 512) for b in batches]
        for layout in layouts:
            for whole in (True, False):
                assert capture_slots(flow, layout.rows, layout.slots, 512, graphs, whole)
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        replayed = [solve_slots(flow, b, layout, graphs) for b, layout in zip(batches, layouts)]
        stepped = [solve_slots(flow, b, layout, graphs, lambda: None) for b, layout in zip(batches, layouts)]
        eager = [solve_slots(flow, b, layout, FunctionGraphs()) for b, layout in zip(batches, layouts)]
    assert len(graphs) == 4 and graphs.replays == 2 + 2 * steps and graphs.eager == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
    for replayed_batch, stepped_batch, eager_batch, dense_batch in zip(replayed, stepped, eager, dense):
        for a, s, b, c in zip(replayed_batch, stepped_batch, eager_batch, dense_batch):
            assert torch.equal(a, b) and torch.equal(s, b)
            assert a.shape == c.shape and (a - c).abs().max() < 5e-2
