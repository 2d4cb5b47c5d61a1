"""One transfer per step: the host arrays come back as device tensors of the same values, dtypes and
shapes, and the attention descriptor built from arrays is the per-token one."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.ops.attention import AttentionMetadata
from intone.ops.staging import HostStaging

DTYPES = [np.int64, np.float32, np.bool_, np.int32, np.float64, np.uint8]


@st.composite
def arrays(draw):
    out = {}
    for n in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=2)))  # () too
        seed = draw(st.integers(0, 2**31))
        values = np.random.default_rng(seed).integers(0, 100, size=shape)
        out[f"a{n}"] = np.asarray((values % 2 == 0) if dtype is np.bool_ else values.astype(dtype))
    return out


def check_round_trip(staging, host):
    dev = staging.upload(host)
    assert dev.keys() == host.keys()
    for key, a in host.items():
        assert tuple(dev[key].shape) == a.shape and dev[key].dtype == torch.from_numpy(a).dtype
        np.testing.assert_array_equal(dev[key].cpu().numpy(), a)


@settings(max_examples=60, deadline=None)
@given(arrays())
def test_uploaded_arrays_come_back_with_their_values_dtypes_and_shapes(host):
    check_round_trip(HostStaging("cpu"), host)


def test_a_later_upload_leaves_an_earlier_steps_tensors_as_they_were():
    staging = HostStaging("cpu")
    first = staging.upload({"x": np.arange(10, dtype=np.int64)})
    staging.upload({"x": np.full(10, -1, dtype=np.int64)})
    assert first["x"].tolist() == list(range(10))


def reference_descriptor(query_lens, context_lens, block_tables, block_size):
    """The descriptor as the engine built it token by token before (positions, slots, rows, indices)."""
    positions, slots, token_req, token_idx = [], [], [], []
    for r, (q, ctx, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        for i in range(q):
            pos = ctx + i
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            token_req.append(r)
            token_idx.append(i)
    width = max(len(t) for t in block_tables)
    return dict(cu_seqlens_q=np.concatenate([[0], np.cumsum(query_lens)]),
                seq_lens=[q + c for q, c in zip(query_lens, context_lens)],
                block_tables=[t + [0] * (width - len(t)) for t in block_tables], slot_mapping=slots,
                positions=positions, token_request=token_req, token_index=token_idx)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 60)), min_size=1, max_size=8), st.sampled_from([4, 16]),
       st.randoms(use_true_random=False))
def test_the_descriptor_from_arrays_is_the_per_token_one(requests, block_size, rnd):
    q_lens, ctx_lens = [q for q, _ in requests], [c for _, c in requests]
    tables = [rnd.sample(range(500), -(-(q + c) // block_size)) for q, c in requests]
    arrays, max_q, max_k = AttentionMetadata.host_arrays(q_lens, ctx_lens, tables, block_size)
    expected = reference_descriptor(q_lens, ctx_lens, tables, block_size)
    assert arrays.keys() == expected.keys()
    for key, values in expected.items():
        assert arrays[key].dtype == np.int64 and arrays[key].tolist() == np.asarray(values).tolist(), key
    assert (max_q, max_k) == (max(q_lens), max(q + c for q, c in requests))


def test_a_request_without_query_tokens_is_refused():
    with pytest.raises(ValueError, match="at least one query token"):
        AttentionMetadata.host_arrays([3, 0], [0, 5], [[1], [2]], 16)


def test_a_table_too_short_for_its_request_is_refused_though_a_wider_one_pads_it():
    with pytest.raises(ValueError, match="row 0: 1 KV blocks cannot hold 21 tokens"):
        AttentionMetadata.host_arrays([1, 1], [20, 20], [[7], [1, 2]], 16)


def test_every_view_starts_on_a_16_byte_boundary():
    """Triton specializes its kernels on 16-byte pointer alignment: a view off it would compile anew."""
    dev = HostStaging("cpu").upload({"odd": np.arange(3, dtype=np.int64), "b": np.ones(5, dtype=np.bool_),
                                     "tables": np.zeros((2, 3), dtype=np.int64)})
    assert all(t.data_ptr() % 16 == 0 for t in dev.values())


@pytest.mark.gpu
def test_pinned_uploads_in_turn_never_read_a_buffer_being_refilled():
    """Many steps' uploads queued behind a long kernel on the stream: each step's tensors hold that
    step's values once the stream has run (the two pinned buffers are reused only after their copy)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    staging = HostStaging("cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    kept = []
    for step in range(12):
        for _ in range(3):
            busy = busy @ busy / 64  # keeps the stream busy while the host runs ahead
        host = {"tokens": np.full(1000 + step, step, dtype=np.int64), "flags": np.arange(7) % 2 == step % 2,
                "floats": np.full((3, 5), step / 2, dtype=np.float32)}
        kept.append((host, staging.upload(host)))
    torch.cuda.synchronize()
    for host, dev in kept:
        for key, a in host.items():
            np.testing.assert_array_equal(dev[key].cpu().numpy(), a)
