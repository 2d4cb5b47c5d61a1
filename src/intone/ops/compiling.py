"""Process-wide settings for the code intone compiles with torch.compile (the DiT, the AR's fused pieces),
and the count of what it compiled."""

from __future__ import annotations

import sys

import torch


def compile_settings() -> None:
    """Python floats reaching compiled code become constants, guarded (every such float in intone is a
    model constant, e.g. a norm's epsilon). With symbolic floats dynamo traced the real-size DiT,
    failed to turn one into a tensor and traced it all again, and the discarded trace missed the AOT
    cache: on a CPU, start-up compile 119 -> 101 s cold and 36 -> 17 s with a warm cache."""
    torch._dynamo.config.specialize_float = True
    # The AR's fused pieces compile once per (dtype, epsilon, compute dtype) they meet: two or three in a
    # server, more in a process that loads several models (the GPU tests hit the default 8, and fullgraph
    # makes that an error).
    torch._dynamo.config.recompile_limit = 64


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process (0 where nothing imported its compiler)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0
