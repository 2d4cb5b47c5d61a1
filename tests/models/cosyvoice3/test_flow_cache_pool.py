"""`FlowCachePool`: the streams' flow caches in fixed memory. Blocks are never held by two streams that do
not share them, never lost (cancel, error, a stream's end), and a hop the pool cannot hold keeps no cache
but its mel is unchanged."""

import gc
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.models.cosyvoice3.flow_cache import solve_continued
from intone.models.cosyvoice3.flow_cache_pool import FlowCachePool

from .test_flow import CHUNK, TINY, make_flow, request
from .test_flow_cache import assert_close, hop_ends, part

SHAPE = (2, 1, 1, 2, 4)  # steps, layers, heads, head size, chunk


def small_pool(blocks: int) -> FlowCachePool:
    pool = FlowCachePool((blocks + 1) * FlowCachePool.block_bytes_of(*SHAPE, torch.float32))  # + the zero block
    pool.ensure(*SHAPE, torch.float32, "cpu")
    assert pool.blocks == blocks
    return pool


def hop(pool: FlowCachePool, old, n: int):
    """A stream's next cache: n new blocks a row, after its old cache's (None: no room, none kept)."""
    got = pool.allocate(2 * n)
    if got is None:
        return None
    cond, uncond = got[:n], got[n:]
    if old is not None:
        pool.retain(old.cond + old.uncond)
        cond, uncond = old.cond + cond, old.uncond + uncond
    return pool.cache(old.frames + n if old else n, cond, uncond, torch.zeros(0))


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["start", "hop", "end"]), st.integers(0, 7), st.integers(1, 3)),
                    max_size=40))
def test_blocks_are_held_by_their_streams_alone_and_all_come_back(ops):
    """Streams start, continue (a hop's cache shares its earlier blocks and replaces the cache it continues)
    and end in any order: a block is free exactly when no live cache holds it, two streams never hold the
    same block, and when every stream has ended the whole pool is free."""
    # What was alive before the example is not the example's: frozen, it is left out of the collection below,
    # which then walks only what the example made (a whole session's heap, walked per example, cost seconds).
    gc.freeze()
    try:
        pool = small_pool(12)
        streams: dict[int, object] = {}
        for op, key, n in ops:
            if op == "end":
                streams.pop(key, None)
            else:
                streams[key] = hop(pool, streams.get(key) if op == "hop" else None, n)
            # no collection needed: a cache is freed when its last reference goes (it is in no reference cycle)
            held = [b for c in streams.values() if c is not None for b in c.cond + c.uncond]
            assert len(held) == len(set(held))
            assert pool.used_bytes == len(held) * pool.block_bytes <= 12 * pool.block_bytes
        streams.clear()
        gc.collect()
        assert pool.used_bytes == 0
    finally:
        gc.unfreeze()


def test_a_solve_that_fails_gives_its_blocks_back_and_a_full_pool_keeps_no_cache_but_the_same_mel():
    flow = make_flow()
    g = torch.Generator().manual_seed(31)
    fulls = [request(g, prompt=p, tokens=90, finalize=True) for p in (6, 13)]
    jobs = [part(f, hop_ends(len(f.prompt_tokens), 90, CHUNK // 2)[0], False) for f in fulls]
    frames = flow.mel_lengths(jobs)
    dit = TINY.dit
    block = FlowCachePool.block_bytes_of(flow.decoder.n_timesteps, dit.depth, dit.heads, dit.dim_head, CHUNK,
                                         torch.float64)
    pool = FlowCachePool((2 * frames[0] // CHUNK + 1) * block)  # room for the first stream's cache only

    def fail():
        raise RuntimeError("cancelled mid-solve")
    with pytest.raises(RuntimeError, match="mid-solve"):
        solve_continued(flow, jobs, [None, None], [True, True], pause=fail, pool=pool)
    assert pool.used_bytes == 0
    mels, kept = solve_continued(flow, jobs, [None, None], [True, True], pool=pool)
    assert kept[0] is not None and kept[1] is None and pool.refused == 2  # the second stream, each time
    for job, mel in zip(jobs, mels):
        assert_close(mel, flow.inference([job])[0])
    del kept
    gc.collect()
    assert pool.used_bytes == 0


def test_a_cache_collected_while_the_pool_is_locked_gives_its_blocks_back_without_hanging():
    """A garbage collection can run while a thread holds the pool's lock (inside `allocate`) and collect a cache
    there: its finalizer must not wait for that lock."""
    pool = small_pool(4)

    def collect_inside_the_lock():
        cache = hop(pool, None, 1)
        with pool._lock:
            del cache
            gc.collect()
    worker = threading.Thread(target=collect_inside_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    assert pool.used_bytes == 0
