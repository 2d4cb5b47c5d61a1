"""Long-lived roles never share a CUDA stream, however many streams others drew from torch's pool before.

torch's pool is stood in for by one that behaves as c10's does (32 streams per priority, round-robin), so
the rule is checked on a CPU; on a GPU the profiled server test checks that no two threads' kernels share
a stream."""

import gc

import pytest

from intone.engine.streams import POOL_STREAMS, held_roles, own_stream


class _Stream:
    def __init__(self, handle: int):
        self.cuda_stream = handle


class _Pool:
    """c10's stream pool: each draw the next of POOL_STREAMS streams per priority (a fresh wrapper object)."""

    def __init__(self):
        self.next = {}

    def __call__(self, device, priority=0):
        i = self.next.get(priority, 0)
        self.next[priority] = i + 1
        return _Stream(1000 * (1 - priority) + i % POOL_STREAMS)


def test_roles_get_streams_no_other_live_role_holds_after_any_number_of_draws():
    pool = _Pool()
    loop = own_stream(None, "engine loop", draw=pool)
    codec = own_stream(None, "codec worker", draw=pool)
    for _ in range(POOL_STREAMS - 2):  # start-up's captures: each a stream of its own for a moment
        pool(None)
    frontends = [own_stream(None, "frontend worker", draw=pool) for _ in range(2)]  # the pool has wrapped
    handles = [s.cuda_stream for s in (loop, codec, *frontends)]
    assert len(set(handles)) == 4
    assert {held_roles()[h] for h in handles} == {"engine loop", "codec worker", "frontend worker"}
    urgent = own_stream(None, "graph set's capture", priority=-1, draw=pool)  # another priority: another pool
    assert urgent.cuda_stream not in handles


def test_a_stream_goes_back_when_its_role_ends_and_a_full_pool_names_its_holders():
    pool = _Pool()
    held = [own_stream(None, f"role {i}", draw=pool) for i in range(POOL_STREAMS)]
    with pytest.raises(RuntimeError, match="every stream of torch's pool is held .*role 0, role 1"):
        own_stream(None, "frontend worker", draw=pool)
    freed = held.pop(5).cuda_stream
    again = own_stream(None, "frontend worker", draw=pool)
    assert again.cuda_stream == freed and held_roles()[freed] == "frontend worker"
    gc.disable()
    try:  # a role gone in a reference cycle: only a collection gives its stream back, and a full pool runs one
        cycle = {"stream": held.pop(7)}
        cycle["self"], lost = cycle, cycle["stream"].cuda_stream
        del cycle
        assert lost in held_roles()
        assert own_stream(None, "codec worker", draw=pool).cuda_stream == lost
    finally:
        gc.enable()
    del held, again
    gc.collect()
    assert not set(held_roles()) & {pool(None).cuda_stream for _ in range(POOL_STREAMS)}  # every role gone: none held
