"""The codec stage on a worker thread of its own (and its own CUDA stream), beside the AR loop.

The engine loop plans chunks and hands each step's batch of them to this worker; the next AR steps
run while the codec decodes. Batches are decoded in the order they were handed over, so a request's
chunks still come out in order, and the chunk contents do not depend on timing (the windows were
fixed when the batch was planned); batches waiting when the worker turns to them are decoded
together, in order, so the codec's calls grow with the backlog. A batch that raises is retried
chunk by chunk; only a chunk that fails alone gets its exception as its result.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class DecodedBatch:
    items: list  # (EngineRequest, Chunk) pairs, as handed over
    audio: list  # per item: the samples (np.ndarray) or the exception its decode raised
    seconds: float  # wall time of the decode calls that carried this batch
    tokens: list[int]  # per item: the request's generated tokens when the chunk was planned
    share: float = 1.0  # this batch's part of those calls (batches decoded together split them)


def decode_batch(stage, items: list) -> list:
    """The stage's audio for items; on failure, each item alone (failing ones get their exception)."""
    try:
        return stage.run(items)
    except Exception:  # noqa: BLE001 - retried one by one, so only the failing chunk's request ends
        log.exception("codec batch failed; retrying its chunks one by one")
    out = []
    for item in items:
        try:
            out.append(stage.run([item])[0])
        except Exception as e:  # noqa: BLE001
            log.exception("codec failed for %s", item[0].request_id)
            out.append(e)
    return out


class CodecWorker:
    def __init__(self, stage, device: torch.device):
        self.stage = stage
        self._inbox: queue.Queue = queue.Queue()
        self._done: list[DecodedBatch] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.in_flight = 0  # batches handed over and not yet collected
        self._queued = 0  # chunks handed over that no decode call has taken yet
        self._thread = threading.Thread(target=self._work, name="intone-codec", daemon=True)
        self._thread.start()

    def submit(self, items: list, tokens: list[int]) -> None:
        self.in_flight += 1
        with self._lock:
            self._queued += len(items)
        self._inbox.put((items, tokens))

    @property
    def queued(self) -> int:
        """Chunks waiting for the worker (not yet in a decode call)."""
        return self._queued

    def collect(self) -> list[DecodedBatch]:
        with self._lock:
            done, self._done = self._done, []
            self._ready.clear()
        self.in_flight -= len(done)
        return done

    def wait(self, timeout: float) -> None:
        self._ready.wait(timeout)

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        stop = False
        while not stop and (job := self._inbox.get()) is not None:
            jobs = [job]
            while True:  # everything handed over meanwhile goes into the same decode calls
                try:
                    more = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
            self._decode(jobs)

    def _decode(self, jobs: list) -> None:
        items = [item for batch, _ in jobs for item in batch]
        with self._lock:
            self._queued -= len(items)
        start = time.perf_counter()
        with torch.inference_mode():  # thread-local: the loop's mode does not reach this thread
            if self._stream is None:
                audio = decode_batch(self.stage, items)
            else:
                with torch.cuda.stream(self._stream):
                    audio = decode_batch(self.stage, items)
        seconds = time.perf_counter() - start
        done, at = [], 0
        for batch, tokens in jobs:
            done.append(DecodedBatch(batch, audio[at : at + len(batch)], seconds, tokens, len(batch) / len(items)))
            at += len(batch)
        with self._lock:
            self._done.extend(done)
            self._ready.set()
