"""The model's text frontend (CosyVoice3: wetext normalisation, ~7 ms per text) for the API's requests.

wetext holds the interpreter lock while it works, so in the API process's own threads a burst of
requests (a whole-response level finishing together and its clients sending the next requests at
once) queues behind each other's normalisation and behind the event loop (H200, C64: the time from
parsed request to engine grew from 0.05 to 0.27 s when wetext moved into the API). With `workers` > 0
the texts go to that many child processes, each with its own copy of the frontend; with 0, to a
thread of this process (machines without spare cores, and the test suite).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from intone.api.segments import cut
from intone.engine.child import watch_parent
from intone.models import text_frontend

_frontend = None  # a worker process's own frontend


def _load(spec: str, parent: int) -> None:
    global _frontend
    # A worker holds both ends of its own call queue's pipe, so when the API process is killed it
    # would wait on that queue for ever: it leaves when its parent is gone instead.
    watch_parent(parent, [])
    _frontend = text_frontend(spec)


def _in_worker(fn, *args):
    return fn(_frontend, *args)


def _ready(frontend) -> bool:
    return frontend is not None


def normalize_all(frontend, texts: list[str]) -> list[str]:
    return [frontend.normalize(text) for text in texts]


def default_workers() -> int:
    """A quarter of the machine's cores, up to 4; none on a machine of 2-3 cores."""
    return min(4, (os.cpu_count() or 1) // 4)


class TextWorkers:
    def __init__(self, spec: str, frontend, workers: int):
        """frontend: the model's (`models.text_frontend(spec)`), or None (text as sent: no workers)."""
        self.frontend = frontend
        self.workers = workers if frontend is not None else 0
        self._pool = None
        if self.workers:
            # spawn: a fork would copy this process's threads' locks mid-use
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(self.workers, context, initializer=_load, initargs=(spec, os.getpid()))

    async def start(self) -> None:
        """Start every worker and load its frontend now, not on a request."""
        if self._pool is not None:
            await asyncio.gather(*(self._call(_ready) for _ in range(self.workers)))

    async def cut(self, text: str, field: str) -> list[str]:
        """`segments.cut` of the text (InvalidRequestError naming `field` when nothing is left to speak)."""
        return await self._call(cut, text, field)

    async def read_transcripts(self, references: list) -> list:
        """`segments.read_transcripts`: the references with their transcripts read by the frontend."""
        if self.frontend is None or not references:
            return references
        texts = await self._call(normalize_all, [ref.text for ref in references])
        return [dataclasses.replace(ref, text=text) for ref, text in zip(references, texts)]

    async def _call(self, fn, *args):
        """fn(frontend, *args) in a worker process, or (no workers) in a thread of this one."""
        if self._pool is None:
            return await asyncio.to_thread(fn, self.frontend, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, _in_worker, fn, *args)

    def close(self) -> None:
        """Ends the workers and waits for them: uvicorn ends a server by re-raising its signal, so no
        exit handler would, and an orphan would die later without freeing its queues' semaphores."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
