"""Admission and batching: which requests take part in the next step.

Admission is first come, first served, bounded by the AR capacity (`max_num_seqs`), the
tokens one step may carry, and the KV cache. A request is admitted only when the cache can
hold its prompt plus all the frames it may generate, counting what running requests may
still claim; so a running request never runs out of blocks and nothing is ever preempted.
Every step runs the new requests' prefills and all running decodes together; the scheduler
grows each one's block table (a field of the request) to hold the step's tokens, so the batch
it returns is what the model runner executes.
"""

from __future__ import annotations

from collections import deque

from intone.engine.request import EngineRequest, Status
from intone.ops.kv_cache import BlockManager


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_waiting: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.max_num_batched_tokens = max_num_batched_tokens
        # A softer bound on a step's tokens (e.g. what CUDA graphs cover): more prefills wait for
        # the next step, but a step with no prefill yet may still take one up to the hard bound.
        self.step_token_target = max_num_batched_tokens
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.shared_blocks = 0  # KV blocks admitted requests took from earlier prompts (ar.prefix_caching)

    def fits_ever(self, req: EngineRequest) -> bool:
        """Could this request run if it were alone?"""
        return self.blocks.blocks_for(req.kv_tokens_needed) <= self.blocks.num_blocks

    def queue_bound(self) -> int:
        """How many requests may wait: `max_waiting` beyond the seats that are free now (a burst that
        idle seats will take at the next step is not refused for having arrived at once)."""
        return self.max_waiting + max(0, self.max_num_seqs - len(self.running))

    def add(self, req: EngineRequest) -> None:
        if len(self.waiting) >= self.queue_bound():
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        req.status = Status.WAITING
        self.waiting.append(req)

    def remove(self, req: EngineRequest) -> None:
        """Take the request out of whichever queue holds it and free its blocks. Idempotent."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.block_table)
        req.status = Status.FINISHED

    def _unclaimed_blocks(self) -> int:
        """Free blocks less what running requests may still need to reach their maximum."""
        owed = sum(self.blocks.blocks_for(r.kv_tokens_needed) - len(r.block_table) for r in self.running)
        return self.blocks.num_free - owed

    def schedule(self) -> list[EngineRequest]:
        """Admit what fits, then return this step's batch (new prefills first, then decodes), each
        request's block table grown to hold its tokens after the step."""
        budget = self.max_num_batched_tokens - len(self.running)
        soft = self.step_token_target - len(self.running)
        spare = self._unclaimed_blocks()
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            req = self.waiting[0]
            free_before = self.blocks.num_free
            shared = self.blocks.share(req.block_table, req.prefix_hashes) if req.prefix_hashes else 0
            # blocks it takes from the free pool: new ones, and shared ones no running request held
            need = self.blocks.blocks_for(req.kv_tokens_needed) - shared + free_before - self.blocks.num_free
            tokens = len(req.prompt) - shared * self.blocks.block_size
            if need > spare or tokens > budget or (admitted and tokens > soft):
                self.blocks.free(req.block_table)
                break
            req.cached_tokens = shared * self.blocks.block_size
            self.shared_blocks += shared
            soft -= tokens
            self.waiting.popleft()
            req.status = Status.RUNNING
            admitted.append(req)
            spare -= need
            budget -= tokens
        # a request whose step in flight makes its last frame has nothing more to run
        decodes = [r for r in self.running if r.generated < r.params.max_new_tokens]
        self.running.extend(admitted)
        batch = admitted + decodes
        for req in batch:  # within what admission reserved: never fails
            self.blocks.grow(req.block_table, len(req.prompt) + req.generated)
        return batch
