"""The draws' uniforms are exactly the documented counter hash (ops/sampling.py), checked against a plain
Python-integer version: murmur3's fmix32 of (seed, step, draw, token id).

A request's seed must give the same audio in every batch, on every device (ops/race.py re-implements
the hash in Triton) and from one release to the next. test_sampling checks that draws vary with
every counter and look uniform; any other hash would too, so this pins the hash itself, the int64
wrap-around of its products (seeds up to 2**63 - 1) and the uniforms' float64 grid
(b + 0.5) / 2**24 in (0, 1)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.ops.sampling import request_uniforms, row_keys

M32 = 0xFFFFFFFF


def fmix32(x: int) -> int:
    x &= M32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & M32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def key(seed: int, step: int, draw: int) -> int:
    k = fmix32(fmix32(seed & M32) ^ ((seed >> 32) & M32) ^ 0x9E3779B9)
    k = fmix32(k ^ ((step * 0x27D4EB2F) & M32))
    return fmix32(k ^ (draw * 0x165667B1 + 0x61C88647))


def uniform(seed: int, step: int, draw: int, token: int) -> float:
    k = key(seed, step, draw)
    return ((fmix32(fmix32(k ^ token) + token) >> 8) + 0.5) / 2**24


def test_fmix32_is_murmur3s_finaliser():
    assert [fmix32(x) for x in (0, 1, 0xDEADBEEF)] == [0, 0x514E28B7, 0x0DE5C6A9]


@settings(max_examples=60, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=4), step=st.integers(0, 2**40),
       draw=st.integers(0, 40), tokens=st.lists(st.integers(0, 2**20), min_size=1, max_size=8))
def test_uniforms_are_the_documented_hash(seeds, step, draw, tokens):
    ids = torch.tensor([tokens] * len(seeds))
    steps = torch.full((len(seeds),), step, dtype=torch.int64)
    got = request_uniforms(torch.tensor(seeds, dtype=torch.int64), steps, draw, ids)
    assert got.dtype == torch.float64
    assert got.tolist() == [[uniform(s, step, draw, t) for t in tokens] for s in seeds]
    assert row_keys(torch.tensor(seeds, dtype=torch.int64), steps, draw).tolist() == [key(s, step, draw) for s in seeds]

