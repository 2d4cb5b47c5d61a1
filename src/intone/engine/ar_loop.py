"""The AR stage of an engine step: run the scheduled batch and give each request its new frame.

In order (the default), a step's tokens reach the host before the next step is built. With
`ar.async_steps` one step stays in flight: step N+1 is built and launched while the host has not read
step N's tokens yet (they wait on the device, and N+1 takes each request's last frame from there),
then the host reads step N's and applies them while the GPU runs N+1, so the loop's host work (the
next build, the frames, the chunks) overlaps the GPU instead of leaving it idle. Draws depend only
on (seed, step), so the tokens are the same. What changes: a request is seen to stop one step
later, so one that samples its stop token runs one more row, whose output is dropped (its KV and
token-history writes land in its own blocks and seat before any later step can be lent them: one
stream runs the steps in order); one that reaches max_new_tokens is known to and not run again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from intone.engine.activity import Activity, company
from intone.engine.device_lost import check_device
from intone.engine.model_runner import ModelRunner, StepInput
from intone.engine.request import EngineRequest, Status
from intone.engine.scheduler import Scheduler
from intone.engine.stats import EngineStats
from intone.models.base import HostCopy

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read."""

    batch: list[EngineRequest]  # in the order of the step's output rows
    copy: HostCopy
    start: float
    span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # the step's kernels on the loop's stream (GPU)
    prefill_tokens: int = 0  # the prompt tokens it computed (its prefills')
    marks: dict | None = None  # each side stage's `Activity.mark` at its launch


class ARLoop:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, stats: EngineStats, forwards_frame,
                 fail: Callable[[EngineRequest, str], None], in_flight: bool = False, min_step_s: float = 0.0):
        """fail(request, message): end a request whose step failed. in_flight: ar.async_steps. min_step_s:
        launch a step at most this often (ar.min_step_ms), asleep until then. The tokens are waited for as the
        runner says (`ModelRunner.sleep`, ar.token_wait)."""
        self.runner, self.scheduler, self.stats = runner, scheduler, stats
        self.forwards_frame, self.fail = forwards_frame, fail
        self.keep_in_flight = in_flight
        self.pending: InFlight | None = None
        self.min_step_s, self.last_launch = min_step_s, 0.0
        self.timed = runner.model.device.type == "cuda"  # the steps' GPU spans (events on the loop's stream)
        self.beside: dict[str, Activity] = {}  # the side stages whose work a step's GPU span is split by (role ->)

    def watch(self, **stages) -> None:
        """Split the steps' GPU spans by these side stages' work (role=stage; those with an `activity`)."""
        self.beside = {role: stage.activity for role, stage in stages.items() if hasattr(stage, "activity")}

    @property
    def busy(self) -> bool:
        """A step is in flight (its frames are still to come)."""
        return self.pending is not None

    def step(self, batch: list[EngineRequest]) -> list[str]:
        """Run the batch (in flight: launch it, then apply the step before); the requests that stopped."""
        finished: list[str] = []
        start = time.perf_counter()
        paced = self._pace(start) if batch else 0.0
        waited = self.stats.step_wait_seconds
        done = self._launch(batch, start) if batch else None
        if batch:  # building and launching it (in order, the copy's wait is the step's wait, not this)
            self.stats.step_launch_seconds += \
                time.perf_counter() - start - paced - (self.stats.step_wait_seconds - waited)
        if self.keep_in_flight:  # this step stays in flight; the one before is applied
            done, self.pending = self.pending, done
        if done is not None:
            self._collect(done, finished)
        if batch:
            self.stats.steps += 1
        if batch or done is not None:  # a call with no batch that applies the last step is that step's time too
            self.stats.step_seconds += time.perf_counter() - start
        return finished

    def _pace(self, now: float) -> float:
        """Asleep until min_step_s after the last launch (the GIL and a core free meanwhile); the seconds slept."""
        pause = self.last_launch + self.min_step_s - now
        if pause > 0:
            time.sleep(pause)
            self.stats.step_pace_seconds += pause
        self.last_launch = max(now, self.last_launch + self.min_step_s)
        return max(pause, 0.0)

    def _launch(self, batch: list[EngineRequest], start: float) -> InFlight | None:
        rows = {r.request_id: i for i, r in enumerate(self.pending.batch)} if self.pending is not None else {}
        span = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.timed else None
        try:
            if span:
                span[0].record()  # reached once the step before is done: the span is this step's own
            out = self.runner.run([
                StepInput(r.request_id, r.prompt, r.params, r.tokens, r.last_codes, r.block_table, r.cached_tokens,
                          rows.get(r.request_id, -1))
                for r in batch
            ])
            if span:
                span[1].record()  # after the static step's output copy, which its launch enqueued (see _collect)
            waited = time.perf_counter()
            copy = out.copy_to_host(asynchronous=self.keep_in_flight, sleep=self.runner.sleep)
            self.stats.step_wait_seconds += time.perf_counter() - waited  # in order: the copy waits for the step
        except Exception as e:  # a failed step fails its batch, never the engine (unless the GPU is gone)
            self._failed(batch, e)
            return None
        prefill_tokens = sum(len(r.prompt) - r.cached_tokens for r in batch if r.generated == 0)
        for req in batch:
            req.steps_in_flight += 1
        marks = {role: activity.mark() for role, activity in self.beside.items()} if span else None
        return InFlight(batch, copy, start, span, prefill_tokens, marks)

    def _collect(self, step: InFlight, finished: list[str]) -> None:
        for req in step.batch:
            req.steps_in_flight -= 1
        waited = time.perf_counter()
        try:
            tokens, stopped, codes = step.copy.wait()
        except Exception as e:
            self._failed(step.batch, e)
            return
        now = time.perf_counter()
        self.stats.step_wait_seconds += now - waited
        if step.span:
            # The tokens' copy can finish a moment before the span's end event (recorded after it): read the
            # span once that event is done too (elapsed_time raises on an incomplete event; it killed a core).
            step.span[1].synchronize()
            beside = {role for role, mark in step.marks.items() if self.beside[role].ran_since(mark)}
            self.stats.count_step_gpu(step.span[0].elapsed_time(step.span[1]) / 1000,
                                      company(step.prefill_tokens > 0, beside), step.prefill_tokens)
        prefilled = False
        for i, req in enumerate(step.batch):
            if req.status is not Status.RUNNING:  # ended while its step ran (in flight: a stop seen one step late)
                continue
            if not req.tokens and req.times.prefill_s is None:
                req.times.scheduled, req.times.prefill_s = step.start, now - step.start
                prefilled = True
                self.scheduler.blocks.publish(req.block_table, req.prefix_hashes)  # later steps run after its writes
            if stopped[i]:
                req.stop_reason = "stop"
            else:
                req.append_frame(tokens[i], codes[i], self.forwards_frame)
                self.stats.frames += 1
                if len(req.tokens) >= req.params.max_new_tokens:
                    req.stop_reason = "length"
            if req.stop_reason:
                req.times.last_frame = now
                self.scheduler.remove(req)  # its AR is done (KV freed); the codec may still have chunks
                finished.append(req.request_id)
        self.stats.prefill_steps += prefilled

    def _failed(self, batch: list[EngineRequest], error: Exception) -> None:
        check_device(error)
        log.exception("model step failed")
        for req in batch:
            if req.status is Status.RUNNING:
                self.fail(req, f"model step failed: {error}")
