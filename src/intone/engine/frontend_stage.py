"""The reference frontend as a batched stage: reference audio -> the model's features -> a prompt.

Requests that bring reference audio are handed to a worker thread (one, or `workers`), and so are
voice uploads (which must never pause the engine loop either). A worker takes every job
queued at that moment, looks each clip up in the reference cache (keyed by a hash of its samples
and rate), encodes the misses in one batched call on its own CUDA stream (so running streams
keep stepping meanwhile), and hands each request back to the engine loop, with its prompt, as
soon as its own clips are done (a model may finish the clips of a batch one by one). A clip
that fails refuses its own request only. With `frontend.process` each worker's clips are encoded in
a child process of its own (`engine.frontend_process`); the rest stays here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from intone.engine.activity import Activity
from intone.engine.streams import own_stream, sm_share
from intone.models.base import Prompt, TTSModel
from intone.protocol import VoiceReference, clip_key

log = logging.getLogger(__name__)

MAX_CLIPS_PER_BATCH = 32


class ReferenceCache:
    """Features by clip hash, least recently used first out, bounded in bytes. Thread-safe."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, tuple[dict, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = 0

    def get(self, key: bytes) -> dict | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: bytes, features: dict) -> None:
        size = sum(int(v.numel() * v.element_size()) for v in features.values())
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (features, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, old) = self._items.popitem(last=False)
                self.bytes -= old

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class Prepared:
    """A request whose references are encoded: its prompt, or the error that refuses it."""

    request: object  # SynthesisRequest
    prompt: Prompt | None
    error: Exception | None
    seconds: float  # submitted -> prepared


@dataclass
class _Job:
    request: object  # SynthesisRequest, or None for a voice upload
    voice: tuple | None = None  # (token, audio, sample rate) of a voice upload
    submitted: float = field(default_factory=time.perf_counter)

    def clips(self) -> list:
        """(audio, rate) per reference to encode, None where the reference needs no encoding."""
        if self.voice is not None:
            return [self.voice[1:]]
        return [None if ref.audio is None else (ref.audio, ref.sample_rate) for ref in self.request.references]


class FrontendStage:
    def __init__(self, model: TTSModel, cache_bytes: int, priority: int = 0, each: bool = True, workers: int = 1,
                 sms: int | None = None, encoders: list | None = None):
        """priority: of the stage's CUDA streams (lower is more urgent, as CUDA counts). each: hand a
        request back as soon as its own clips are done (else when its whole batch is). workers:
        threads taking batches from the queue, each on a CUDA stream of its own (several let the
        frontend's chains of small kernels run side by side on the GPU). sms: the workers' streams in
        a green context of that many SMs (`frontend.sms`; GPU). encoders: one per worker, each
        encoding that worker's clips in a process of its own (`engine.frontend_process`), instead of
        the model here; the stage closes them."""
        if encoders is not None and len(encoders) != max(1, workers):
            raise ValueError(f"{len(encoders)} frontend processes for {workers} workers")
        self.each, self.workers, self.priority = each, max(1, workers), priority
        self._encoders = encoders
        # made now, so an SM share the GPU cannot give fails before start-up's warm-ups
        self._share = sm_share(model.device, sms, "frontend.sms") if sms is not None and model.device.type == "cuda" \
            else None
        self.model = model
        self.cache = ReferenceCache(cache_bytes)
        self._inbox: queue.Queue = queue.Queue()
        self._done: list[Prepared] = []
        self._encoded: list[tuple] = []  # (token, features as numpy | None, error message | None)
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._threads: list[threading.Thread] = []
        self._local = threading.local()  # each thread's CUDA stream
        self.batches = self.clips = 0
        # Seconds the workers spent on batches, and jobs spent queued before their batch began
        # (summed): busy near the wall time means the stage is saturated; queued says what it costs.
        self.busy_s = self.queued_s = 0.0
        self.jobs = 0  # requests and voice uploads taken by the workers
        self.activity = Activity()  # its batches (the AR loop's split of its steps' GPU time)
        self.pending_encodes = 0  # voice uploads submitted, not yet collected

    # ---- engine side ------------------------------------------------------------------------

    @property
    def encoders(self) -> list:
        """The frontend processes encoding the workers' clips (none: the model here)."""
        return list(self._encoders or ())

    def graph_counters(self, graphs) -> dict:
        """The networks' calls replayed from graphs or run eagerly: those of `graphs` (the engine's FunctionGraphs,
        or None), or with frontend processes theirs, summed, with their seconds encoding."""
        if not self._encoders:
            return dict(frontend_graph_replays=graphs.replays if graphs is not None else 0,
                        frontend_eager_runs=graphs.eager if graphs is not None else 0)
        return dict(frontend_graph_replays=sum(e.graph_replays for e in self._encoders),
                    frontend_eager_runs=sum(e.eager_runs for e in self._encoders),
                    frontend_process_seconds=sum(e.encode_seconds for e in self._encoders))

    def submit(self, request) -> None:
        self._put(_Job(request))

    def submit_encode(self, token: str, audio, sample_rate: int) -> None:
        """A voice upload: its features come back from `collect_encoded` (through the cache)."""
        self.pending_encodes += 1
        self._put(_Job(None, (token, audio, sample_rate)))

    def _put(self, job: _Job) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True,
                                              name="intone-frontend" + (f"-{i}" if i else ""))
                             for i in range(self.workers)]
            for thread in self._threads:
                thread.start()
        self._inbox.put(job)

    def collect_encoded(self) -> list[tuple]:
        with self._lock:
            done, self._encoded = self._encoded, []
        self.pending_encodes -= len(done)
        return done

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def collect(self) -> list[Prepared]:
        """The requests prepared since the last call, in the order they were prepared (cancelled
        ones dropped). A frontend process that died fails the engine (RuntimeError), as a dead codec
        process does: its supervisor restarts it, rather than every later voice being refused."""
        for encoder in self._encoders or ():
            encoder.check_alive()
        with self._lock:
            done, self._done = self._done, []
            self._ready.clear()
            out = [p for p in done if p.request.request_id not in self._cancelled]
            for p in done:
                self._cancelled.discard(p.request.request_id)
        return out

    def wait(self, timeout: float) -> None:
        self._ready.wait(timeout)

    def ready(self) -> int:
        """Requests prepared and not yet collected."""
        with self._lock:
            return len(self._done)

    def close(self) -> None:
        for _ in self._threads:
            self._inbox.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []
        for encoder in self._encoders or ():
            encoder.close()
        self._encoders = None

    def features(self, audio, sample_rate: int) -> dict:
        """One clip's features through the cache (for stored voices); raises what encoding raises."""
        key = clip_key(audio, sample_rate)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        (_, result), = self._encode([(torch.as_tensor(audio, dtype=torch.float32), int(sample_rate))])
        if isinstance(result, Exception):
            raise result
        self.cache.put(key, result)
        return result

    # ---- worker -----------------------------------------------------------------------------

    def _work(self, index: int) -> None:
        self._local.encoder = self._encoders[index] if self._encoders else None
        while True:
            job = self._inbox.get()
            if job is None:
                return
            jobs = [job]
            while len(jobs) < MAX_CLIPS_PER_BATCH:
                try:
                    nxt = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._inbox.put(None)
                    break
                jobs.append(nxt)
            published: set[int] = set()
            began = time.perf_counter()
            try:
                with self.activity:
                    self._prepare(jobs, published)
            except Exception as e:  # a bug here must refuse these requests, not kill the thread
                log.exception("reference frontend failed")
                for j, job in enumerate(jobs):
                    if j not in published:
                        self._publish(job, Prepared(job.request, None, e, time.perf_counter() - job.submitted)
                                      if job.voice is None else (job.voice[0], None, str(e)))
            with self._lock:
                self.busy_s += time.perf_counter() - began
                self.jobs += len(jobs)
                self.queued_s += sum(began - job.submitted for job in jobs)

    def _publish(self, job: _Job, result) -> None:
        """Hand one job's result to the engine loop (a Prepared request or an encoded voice)."""
        with self._lock:
            (self._done if job.voice is None else self._encoded).append(result)
            self._ready.set()

    def _prepare(self, jobs: list[_Job], published: set[int]) -> None:
        """Encode the jobs' uncached clips in one batch and publish each job as soon as all of its
        clips are known (cached, encoded or failed), adding its index to `published`."""
        keys: dict[tuple[int, int], bytes] = {}
        found: dict[bytes, dict | Exception] = {}
        wanted: dict[bytes, tuple[torch.Tensor, int]] = {}
        waiting: dict[int, set[bytes]] = {}  # job index -> keys it still needs
        for j, job in enumerate(jobs):
            if job.voice is None and job.request.request_id in self._cancelled:
                with self._lock:
                    self._cancelled.discard(job.request.request_id)
                published.add(j)  # dropped: the engine forgot it already
                continue
            waiting[j] = set()
            for r, clip in enumerate(job.clips()):
                if clip is None:
                    continue
                audio, rate = clip
                key = keys[j, r] = clip_key(audio, rate)
                if key not in found and key not in wanted:
                    cached = self.cache.get(key)
                    if cached is not None:
                        found[key] = cached
                    else:
                        wanted[key] = (torch.as_tensor(audio, dtype=torch.float32), int(rate or 0))
                if key not in found:
                    waiting[j].add(key)

        def release(ready: list[int]) -> None:
            for j in ready:
                del waiting[j]
                job = jobs[j]
                self._publish(job, self._build(job, j, keys, found) if job.voice is None
                              else _encoded(job.voice[0], found[keys[j, 0]]))
                published.add(j)

        if self.each:
            release([j for j, need in waiting.items() if not need])
        order = list(wanted)
        for i, result in self._encode(list(wanted.values())):
            key = order[i]
            found[key] = result
            if not isinstance(result, Exception):
                self.cache.put(key, result)
            for need in waiting.values():
                need.discard(key)
            if self.each:
                release([j for j, need in waiting.items() if not need])
        release([j for j, need in waiting.items() if not need])
        if waiting:  # a model that gave no result for some clip
            raise RuntimeError(f"the reference frontend returned no features for {len(waiting)} request(s)")

    def _encode(self, clips: list):
        """(index, features or exception) per clip, as the model finishes each; nothing for no clips."""
        if not clips:
            return
        with self._lock:  # several workers (and the loop, for stored voices) count here
            self.batches += 1
            self.clips += len(clips)
        if self._encoders:  # a worker's own process (the loop, for a stored voice, the first's)
            yield from (getattr(self._local, "encoder", None) or self._encoders[0]).encode(clips)
            return
        with torch.inference_mode():  # thread-local: the loop's mode does not reach this thread
            stream = self._stream()
            if stream is None:
                yield from self.model.reference_features_as_ready(clips)
                return
            with torch.cuda.stream(stream):
                yield from self.model.reference_features_as_ready(clips)

    def _stream(self) -> torch.cuda.Stream | None:
        """The calling thread's CUDA stream for the frontend's work (None on a CPU)."""
        if self.model.device.type != "cuda":
            return None
        stream = getattr(self._local, "stream", None)
        if stream is None:
            self._local.stream = stream = own_stream(self.model.device, "frontend worker", self.priority) \
                if self._share is None else self._share.Stream()  # each worker a stream of the share's own
        return stream

    def _build(self, job: _Job, j: int, keys: dict, found: dict) -> Prepared:
        request = job.request
        try:
            refs = []
            for r, ref in enumerate(request.references):
                if (j, r) not in keys:
                    refs.append(ref)
                    continue
                result = found[keys[j, r]]
                if isinstance(result, Exception):
                    raise result
                refs.append(VoiceReference(text=ref.text, features=features_as_numpy(result)))  # views, no copy
            prompt = self.model.prepare(request, refs)
            return Prepared(replace(request, references=refs), prompt, None, time.perf_counter() - job.submitted)
        except Exception as e:  # noqa: BLE001 - refuses this request alone
            return Prepared(request, None, e, time.perf_counter() - job.submitted)


def features_as_numpy(features: dict) -> dict:
    """Reference features as numpy arrays by name (what the API stores for a voice)."""
    return {name: value.cpu().numpy() for name, value in features.items()}


def _encoded(token: str, result) -> tuple:
    if isinstance(result, Exception):
        return token, None, str(result)
    return token, features_as_numpy(result), None
