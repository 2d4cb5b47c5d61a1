"""The planner tests' bookkeeping: frontiers kept by request id, as the engine core keeps them on its
requests, over a real `ChunkPlanner`."""

from __future__ import annotations

from intone.engine.chunk_planner import ChunkPlanner


class PlannerTables:
    def __init__(self, planner: ChunkPlanner):
        self.planner = planner
        self.frontiers = {}

    def add(self, rid: str, initial_chunk_frames: int | None = None, prompt_frames: int = 0, whole: bool = False,
            one_chunk: bool = False):
        self.frontiers.setdefault(rid, self.planner.frontier(initial_chunk_frames, prompt_frames, whole, one_chunk))

    def remove(self, rid: str) -> None:
        self.frontiers.pop(rid, None)

    def plan(self, frames: dict[str, int], finished=(), now: float = 0.0):
        return self.planner.plan({rid: (f, frames[rid]) for rid, f in self.frontiers.items() if rid in frames},
                                 finished, now)

    def steady_size(self, pending: dict[str, int]) -> int:
        return self.planner.steady_size(pending)

    @property
    def backlog_active(self) -> bool:
        return self.planner.backlog_active

    def __len__(self) -> int:
        return len(self.frontiers)

    def one_chunk(self, initial_chunk_frames: int | None, max_frames: int, whole: bool = False) -> bool:
        return self.planner.one_chunk(initial_chunk_frames, max_frames, whole)
