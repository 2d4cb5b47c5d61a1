"""The engine core: one loop per device that steps the AR model, plans chunks and runs the codec.

`EngineCore` is synchronous and single-threaded; `engine.process` runs it in its own process
and `engine.client.Engine` talks to it by messages.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from intone.engine.ar_loop import ARLoop
from intone.engine.chunk_planner import Chunk, ChunkPlanner
from intone.engine.codec_process import CodecProcess
from intone.engine.codec_worker import CodecWorker, DecodedBatch, alone_predicate
from intone.engine.config import Profile
from intone.engine.cuda_graphs import FunctionGraphs
from intone.engine.device_lost import check_device
from intone.engine.frontend_process import FrontendProcess
from intone.engine.frontend_stage import FrontendStage, Prepared, features_as_numpy
from intone.engine.loading import chunk_policy, codec_stage_for, load_for_profile, set_cudnn, warm_up_codec
from intone.engine.loop_codec import LoopCodec
from intone.engine.model_runner import ModelRunner
from intone.engine.request import EngineRequest, Status, resolve_params
from intone.engine.scheduler import QueueFull, Scheduler
from intone.engine.stats import EngineStats, gib_so_far, gpu_memory
from intone.engine.trace import FrameTracer, prompt_digest, wall_clock
from intone.errors import IntoneError, InvalidRequestError
from intone.models.base import TTSModel
from intone.ops import fused, paged_decode
from intone.ops.compiling import compiled_graphs
from intone.ops.kv_cache import BlockManager, KVCache, prefix_hashes
from intone.protocol import AudioChunk, SamplingParams, SynthesisRequest

log = logging.getLogger(__name__)

# a vocoder's own counters (CosyVoice3's), exported as codec_<name>
CODEC_PIECE_COUNTERS = ("padded_tokens", "useful_tokens", "flow_seconds", "vocoder_seconds", "hift_padded_frames",
                        "hift_useful_frames", "flow_cache_bytes", "flow_cache_pool_bytes",
                        "flow_cache_refused", "references_ahead")

DEFAULT_CPU_KV_TOKENS_PER_SEAT = 4096
CUDA_KV_MEMORY_FRACTION = 0.5  # of the memory free after loading, when the profile sets no size
IDLE_WAIT_S = 0.01  # with only references being encoded, wait this long for one to finish


class TooLarge(IntoneError):
    """The request can never fit this engine (prompt or KV need beyond its capacity)."""


class EngineCore:
    def __init__(self, model: TTSModel, profile: Profile, tracer: FrameTracer | None = None,
                 codec_process: CodecProcess | None = None, frontend_processes: list[FrontendProcess] | None = None):
        """codec_process: the codec stage in a process of its own (started and warmed up by `build`), else a
        stage here, on a worker thread (`codec.overlap`) or in the loop. frontend_processes: one per
        frontend worker (`frontend.process`, started by `build`), encoding its clips."""
        self.model, self.profile, self.tracer = model, profile, tracer
        ar = profile.ar
        fused.use_compiled(ar.fuse_elementwise and model.device.type == "cuda")  # before any AR forward
        paged_decode.use_splits(ar.decode_splits)
        kv_tokens = ar.kv_cache_tokens or self._default_kv_tokens()
        num_blocks = max(1, kv_tokens // ar.block_size)
        self.blocks = BlockManager(num_blocks, ar.block_size)
        self.kv = KVCache(model.kv_layout, num_blocks, ar.block_size, model.dtype, model.device)
        self.runner = ModelRunner(model, self.kv, cuda_graphs=ar.cuda_graphs, max_seats=ar.max_num_seqs,
                                  sample_candidates=ar.sample_candidates, sleep=ar.token_wait == "sleep",
                                  static_step=ar.static_step, token_buckets=ar.prompt_row_buckets)
        self.scheduler = Scheduler(self.blocks, ar.max_num_seqs, ar.max_waiting, ar.max_num_batched_tokens)
        self.stats = EngineStats()
        self.ar = ARLoop(self.runner, self.scheduler, self.stats, model.forwards_frame, self._fail, ar.async_steps,
                         min_step_s=ar.min_step_ms / 1000)
        self.policy = chunk_policy(profile, model)
        self.planner = ChunkPlanner(self.policy, ar.max_num_seqs)
        if profile.codec.carry_state and model.stream_decoder() is None:
            raise ValueError(f"codec.carry_state: {model.name} has no stream decoder")
        self.codec = None if codec_process else codec_stage_for(model, profile)
        self.codec_worker: CodecWorker | CodecProcess | LoopCodec = codec_process
        # Most urgent: the frontend's small kernels otherwise wait behind the codec's for every SM.
        self.frontend_priority = -100 if profile.frontend.high_priority else 0  # CUDA clamps it to its highest
        model.configure_frontend(profile.options_for(model.name))
        self.frontend = FrontendStage(model, profile.frontend.cache_mb * 2**20, self.frontend_priority,
                                      each=profile.frontend.hand_back == "each", workers=profile.frontend.workers,
                                      sms=profile.frontend.sms, encoders=frontend_processes)
        self.requests: dict[str, EngineRequest] = {}
        self._preparing: dict[str, float] = {}  # request id -> when it arrived
        self._outbox: list[AudioChunk] = []
        self._encoded: list[tuple] = []  # finished voice uploads: (token, features | None, error | None)
        codec = profile.codec
        self._lead_s = codec.stream_lead_ms / 1000 if codec.stream_lead_ms is not None else None
        if codec_process is None and codec.overlap:
            # Before the start-up's minutes of warm-ups and captures, so a codec.sms the GPU cannot
            # give fails at once; its threads stay idle until the first chunk.
            self.codec_worker = CodecWorker(self.codec, model.device, codec.call_size,
                                            alone=alone_predicate(codec.schedule), sms=codec.sms,
                                            preempt=codec.schedule == "preempt",
                                            gather_s=codec.gather_ms / 1000, full=codec.max_batch,
                                            shared_stream=codec.stream == "loop", lead_s=self._lead_s,
                                            priority=codec.stream_priority)
        elif codec_process is None:
            self.codec_worker = LoopCodec(self.codec, codec.call_size, codec.gather_ms / 1000, codec.max_batch,
                                          self._lead_s)
        self.ar.watch(codec=self.codec_worker, frontend=self.frontend)
        self._start_up()

    def _start_up(self) -> None:
        """Everything that needs the GPU alone, before the first request: the frontend's shapes,
        then every CUDA graph the runner will replay (captures must see no other GPU work)."""
        start = time.perf_counter()
        gpu = self.model.device.type == "cuda"
        self.frontend_graphs: FunctionGraphs | None = None
        if gpu:
            set_cudnn(self.profile)
            log.info("start-up: warming the reference frontend's shapes")
            # Graphs of the frontend's networks: their eager launches (thousands of small kernels
            # per clip) would hold the GIL the engine loop needs.
            in_process = not self.frontend.encoders  # else each frontend process warms its own up
            self.frontend_graphs = FunctionGraphs(self.frontend_priority, self.profile.frontend.workers) \
                if self.profile.frontend.cuda_graphs and in_process else None
            if in_process:
                self.model.warm_up_frontend(self.frontend_graphs)
            if self.codec is not None:
                log.info("start-up: warming the codec's shapes (%.1f s so far; GPU memory peak %s)",
                         time.perf_counter() - start, gib_so_far(self.model.device))
                warm_up_codec(self.codec, self.profile, self.model)
            log.info("start-up: capturing CUDA graphs (%.1f s so far; GPU memory peak %s)",
                     time.perf_counter() - start, gib_so_far(self.model.device))
        self.stats.warm_up_seconds = time.perf_counter() - start
        max_kv = min(self.model.max_seq_len, self.kv.num_blocks * self.kv.block_size)
        report = self.runner.capture(self.profile.ar.max_num_seqs, max_kv, self.profile.ar.max_num_batched_tokens)
        if self.runner.graphs is not None:
            # Steps stay within what the static step covers, unless one prompt alone is larger
            # (with graphs or without, so both batch alike).
            self.scheduler.step_token_target = self.runner.max_graph_tokens
        self.stats.ready_allocated_peak_bytes = gpu_memory(self.model.device).get("gpu_allocated_peak_bytes")
        if report is not None:
            self.stats.captured_graphs, self.stats.capture_seconds = report.graphs, report.seconds
            front = self.frontend_graphs.report if self.frontend_graphs is not None else None
            log.info("captured %d CUDA graphs in %.1f s (%d failed and run eagerly); frontend warm-up %.1f s "
                     "(%d frontend graphs, %d failed); GPU memory peak %s", report.graphs, report.seconds,
                     report.failed, self.stats.warm_up_seconds, front.graphs if front else 0,
                     front.failed if front else 0, gib_so_far(self.model.device))

    def _default_kv_tokens(self) -> int:
        seats = self.profile.ar.max_num_seqs
        if self.model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.model.device)
            per_token = self.model.kv_layout.bytes_per_token(self.model.dtype)
            return int(free * CUDA_KV_MEMORY_FRACTION) // per_token
        return seats * min(self.model.max_seq_len, DEFAULT_CPU_KV_TOKENS_PER_SEAT)

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: SynthesisRequest) -> None:
        """Queue a request; a bad one is answered with an error chunk and harms nothing.

        Reference audio is encoded by the frontend stage (its own thread and CUDA stream, many
        clips per call, cached), so the running streams do not pause for it; the request is
        admitted by the first step after that.
        """
        rid = request.request_id
        arrived = time.perf_counter()
        if rid in self.requests or rid in self._preparing:
            self._refuse(rid, f"{rid!r} is already in use", "invalid_request", "request_id")
            return
        if any(ref.audio is not None for ref in request.references):
            if len(self._preparing) + len(self.scheduler.waiting) >= self.scheduler.queue_bound():
                self._refuse(rid, f"{len(self.scheduler.waiting)} requests are already waiting", "queue_full")
                return
            self._preparing[rid] = arrived
            self.frontend.submit(request)
            return
        try:
            prompt, error = self.model.prepare(request), None
        except Exception as e:  # noqa: BLE001 - refused below, naming the field where it can
            prompt, error = None, e
        self._admit(Prepared(request, prompt, error, 0.0), arrived)

    def _check_one_chunk(self, request: SynthesisRequest, prompt, params: SamplingParams) -> None:
        """A prompt that needs its audio in one chunk (`Prompt.one_chunk_for`) must get it so here."""
        field = prompt.one_chunk_for
        if field and not self.planner.one_chunk(request.initial_chunk_frames, params.max_new_tokens,
                                                not request.stream):
            raise InvalidRequestError(field, "needs a non-streamed request or a full-response profile")

    def _admit_prepared(self) -> None:
        """Admit the requests whose references are encoded, in the order they were encoded."""
        for prepared in self.frontend.collect():
            arrived = self._preparing.pop(prepared.request.request_id, None)
            if arrived is not None:  # else aborted meanwhile
                self._admit(prepared, arrived)

    def _admit(self, prepared: Prepared, arrived: float) -> None:
        request = prepared.request
        rid = request.request_id
        try:
            if prepared.error is not None:
                raise prepared.error
            prompt = prepared.prompt
            params = resolve_params(request.params, prompt, self.model.max_seq_len)
            req = EngineRequest(rid, prompt, params, request.initial_chunk_frames, speed=request.speed)
            self._check_one_chunk(request, prompt, params)
            if len(prompt) > self.scheduler.max_num_batched_tokens:
                raise TooLarge(f"prompt of {len(prompt)} tokens exceeds max_num_batched_tokens")
            if not self.scheduler.fits_ever(req):
                raise TooLarge(f"request needs {req.kv_tokens_needed} tokens of KV cache, "
                                  f"more than the cache holds ({self.kv.num_blocks * self.kv.block_size})")
            if self.profile.ar.prefix_caching:  # whole blocks, short of the last token (its step makes the first frame)
                req.prefix_hashes = prefix_hashes(prompt.tokens, prompt.codes, self.blocks.block_size, len(prompt) - 1)
            self.scheduler.add(req)
        except InvalidRequestError as e:
            self._refuse(rid, str(e), "invalid_request", e.field)
            return
        except QueueFull as e:
            self._refuse(rid, str(e), "queue_full")
            return
        except TooLarge as e:
            self._refuse(rid, str(e), "too_large", "input")
            return
        except IntoneError as e:
            self._refuse(rid, str(e), "invalid_request")
            return
        except Exception as e:  # a bug in preparing one request must not take the engine down
            check_device(e)
            log.error("cannot prepare request %s: %r", rid, e)
            self._refuse(rid, f"cannot prepare the request: {e}", "internal")
            return
        req.allocate_codes(self.model.num_codebooks)
        req.times.arrived, req.times.frontend_s = arrived, prepared.seconds
        req.times.received_at = request.received_at
        req.times.ready = time.perf_counter()
        self.requests[rid] = req
        req.frontier = self.planner.frontier(request.initial_chunk_frames, prompt.codec_prompt_frames,
                                             whole=not request.stream, one_chunk=bool(prompt.one_chunk_for))
        if request.stream and not prompt.one_chunk_for and self.model.prepares_codec(prompt):
            self._prepare_codec(req)

    def _prepare_codec(self, req: EngineRequest) -> None:
        """Hand the codec a stream's `prepare` chunk (no frames) while its first frames are generated; its
        result is a codec state, not audio (`_deliver` sends nothing for it)."""
        req.codec_in_flight += 1
        self._submit([(req, Chunk(req.request_id, 0, 0, 0, False, prepare=True))], [0])

    def _refuse(self, rid: str, message: str, code: str, field: str | None = None) -> None:
        chunk = self._terminal(rid, 0, "error", error=message)
        chunk.error_code, chunk.error_field = code, field
        self._outbox.append(chunk)

    def encode_reference(self, audio, sample_rate: int) -> dict:
        """Reference audio -> the model's reference features (numpy), so a stored voice is encoded
        once (through the reference cache, which requests share)."""
        return features_as_numpy(self.frontend.features(audio, sample_rate))

    def submit_encode(self, token: str, audio, sample_rate: int) -> None:
        """A voice upload, encoded by the frontend stage beside the running streams; the result
        comes back from `take_encoded` (a step collects it)."""
        self.frontend.submit_encode(token, audio, sample_rate)

    def take_encoded(self) -> list[tuple]:
        done, self._encoded = self._encoded, []
        return done

    def abort(self, request_id: str) -> None:
        """Cancel: free everything; the client gets one terminal chunk unless it already had one."""
        if self._preparing.pop(request_id, None) is not None:  # its encoding result is dropped
            self.frontend.cancel(request_id)
            self._send(self._terminal(request_id, 0, "abort"))
            return
        req = self.requests.get(request_id)
        if req is None:
            return
        self._end(req, "abort")

    def snapshot(self) -> dict:
        """Counters and occupancy, for metrics and for tests that check nothing is left behind."""
        cache, graphs, front = self.frontend.cache, self.runner.graphs, self.frontend_graphs
        vocoder = getattr(self.codec, "vocoder", None)  # in this process (not with codec.process)
        codec_graphs = getattr(vocoder, "graphs", None)
        return dict(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            live_requests=len(self.requests), preparing=len(self._preparing),
            planner_requests=sum(1 for r in self.requests.values() if r.frontier and not r.frontier.terminated),
            kv_blocks_total=self.kv.num_blocks, kv_blocks_free=self.blocks.num_free,
            kv_cache_bytes=self.kv.k.nbytes + self.kv.v.nbytes,
            **gpu_memory(self.model.device), gpu_allocated_peak_at_ready_bytes=self.stats.ready_allocated_peak_bytes,
            kv_tables=self.blocks.tables, prefix_cache_blocks=self.scheduler.shared_blocks,
            compiled_graphs=compiled_graphs(),
            steps=self.stats.steps, frames=self.stats.frames,
            mean_step_ms=1000 * self.stats.step_seconds / max(self.stats.steps, 1),
            step_seconds=self.stats.step_seconds, step_wait_seconds=self.stats.step_wait_seconds,
            step_launch_seconds=self.stats.step_launch_seconds, step_pace_seconds=self.stats.step_pace_seconds,
            **self.stats.cpu.seconds(),
            step_gpu_seconds=self.stats.step_gpu_seconds, gpu_timed_steps=self.stats.gpu_timed_steps,
            **self.stats.step_company(),
            backlog_steps=self.stats.backlog_steps, chunk_sizes=dict(self.stats.chunk_sizes),
            finished=dict(self.stats.finished), codec_calls=self.codec_worker.calls,
            prefill_steps=self.stats.prefill_steps, codec_seconds=self.stats.codec_seconds,
            codec_first_calls=self.stats.first_calls, codec_first_call_seconds=self.stats.first_call_seconds,
            codec_first_call_gpu_seconds=self.stats.first_call_gpu_seconds,
            codec_first_call_flow_seconds=self.stats.first_call_flow_seconds,
            codec_first_call_chunks=self.stats.first_call_chunks, codec_preempted_calls=self.stats.preempted_calls,
            codec_prepares_skipped=getattr(self.codec_worker, "prepares_skipped", 0),
            reference_cache_hits=cache.hits, reference_cache_misses=cache.misses,
            reference_cache_entries=len(cache), reference_cache_bytes=cache.bytes,
            frontend_batches=self.frontend.batches, frontend_clips=self.frontend.clips,
            frontend_jobs=self.frontend.jobs, frontend_busy_seconds=self.frontend.busy_s,
            frontend_queued_seconds=self.frontend.queued_s,
            graph_replays=graphs.replays if graphs else 0,
            eager_decode_steps=(graphs.eager if graphs else 0) + self.runner.eager_steps,
            static_steps=graphs.replays + graphs.eager if graphs else 0,
            captured_graphs=self.stats.captured_graphs, capture_seconds=self.stats.capture_seconds,
            **self.frontend.graph_counters(front),
            codec_graph_replays=codec_graphs.replays if codec_graphs is not None else 0,
            codec_eager_runs=codec_graphs.eager if codec_graphs is not None else 0,
            # CosyVoice3's vocoder in this process only: absent keys export no series
            **{f"codec_{key}": getattr(vocoder, key) for key in CODEC_PIECE_COUNTERS if hasattr(vocoder, key)},
        )

    def close(self) -> None:
        """Stop the frontend and codec workers (the process is ending)."""
        self.frontend.close()
        self.codec_worker.close()

    def has_work(self) -> bool:
        return (bool(self.requests) or bool(self._outbox) or bool(self._preparing) or bool(self._encoded)
                or bool(self.frontend.pending_encodes) or bool(self.codec_worker.in_flight)
                or self.ar.busy)

    def progress(self) -> dict[str, int]:
        """Frames generated so far per admitted request (for the client's account of open work)."""
        return {rid: r.num_frames for rid, r in self.requests.items()}

    def request_ids(self) -> list[str]:
        """Every live request, admitted or still having its reference encoded."""
        return [*self.requests, *self._preparing]

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[AudioChunk]:
        if self._preparing or self.frontend.pending_encodes:
            if not self.requests and not self._outbox:  # nothing else to do: wait for an encoding
                self.frontend.wait(IDLE_WAIT_S)
            self._admit_prepared()
            encoded = self.frontend.collect_encoded()
            for _, _, error in encoded:
                if error:
                    check_device(error)
            self._encoded += encoded
        worker = self.codec_worker
        if worker.in_flight and not self.scheduler.running and not self.scheduler.waiting:
            worker.wait(IDLE_WAIT_S)  # only the codec has work: wait for it rather than spin
        finished = self.ar.step(self.scheduler.schedule())
        done = set(finished)
        live = {rid: (r.frontier, r.num_frames) for rid, r in self.requests.items()
                if r.status is Status.RUNNING or rid in done}
        self._emit(self._plan(live, finished))
        for decoded in worker.collect():
            self._deliver(decoded)
        out, self._outbox = self._outbox, []
        return out

    def _plan(self, live: dict, finished: list[str]) -> list[Chunk]:
        chunks = self.planner.plan(live, finished, time.perf_counter())
        if self.planner.backlog_active:
            self.stats.backlog_steps += 1
        return chunks

    def _emit(self, chunks: list[Chunk]) -> None:
        """Hand the step's due chunks to the codec: its worker (beside the next AR steps), its
        process, or the loop's own (`LoopCodec`, decoding at this step's collect)."""
        if not chunks:
            return
        items = [(self.requests[c.request_id], c) for c in chunks]
        tokens = [len(req.tokens) for req, _ in items]  # as of planning, so chunks never depend on timing
        now = time.perf_counter()
        for req, _ in items:
            req.codec_in_flight += 1
            if req.times.first_planned is None:
                req.times.first_planned = now
        # Backpressure: the loop waits only while a full codec call's worth of chunks is already
        # queued, so the worker's next call is full (large batches are what make the codec fast),
        # and the queue stays bounded.
        while self.codec_worker.queued >= self.profile.codec.max_batch:
            self.codec_worker.wait(1.0)
            for decoded in self.codec_worker.collect():
                self._deliver(decoded)
        self._submit(items, tokens)

    def _submit(self, items: list, tokens: list[int]) -> None:
        """Hand chunks to the codec worker, with their deadlines where its schedule reads them."""
        by_deadline = self.profile.codec.schedule == "deadline" or self._lead_s is not None
        self.codec_worker.submit(items, tokens, [self._deadline(req, c) for req, c in items] if by_deadline else None)

    def _deadline(self, req: EngineRequest, chunk: Chunk) -> float:
        """When the listener runs out of audio without this chunk: a first chunk is due since the
        request arrived; a later one when the audio before it, played from the first chunk's
        planning on, ends."""
        if chunk.start == 0:
            return req.times.arrived or req.times.first_planned
        return req.times.first_planned + chunk.start * self.model.samples_per_frame / self.model.sample_rate

    def _deliver(self, decoded: DecodedBatch) -> None:
        """Send the decoded chunks of live requests, in order; a request's last chunk releases it."""
        self.stats.count_codec_call(decoded)
        for req in {id(r): r for r, _ in decoded.items}.values():
            req.times.codec_s += decoded.seconds
        for (req, c), samples, generated in zip(decoded.items, decoded.audio, decoded.tokens):
            req.codec_in_flight -= 1
            if self.requests.get(c.request_id) is not req:  # ended meanwhile (abort, error)
                continue
            if c.prepare:  # a state, no audio; if it failed, the first chunk solves without it
                if isinstance(samples, Exception):
                    check_device(samples)
                    log.warning("preparing the codec state of %s failed: %r", c.request_id, samples)
                continue
            if isinstance(samples, Exception):
                check_device(samples)
                self._fail(req, f"codec failed: {samples}")
                continue
            self.stats.chunk_sizes[c.end - c.start] += 1
            if req.times.first_delivered is None:
                req.times.first_delivered = time.perf_counter()
            self._send(AudioChunk(
                request_id=c.request_id, seq=req.seq, start_frame=c.start, end_frame=c.end, audio=samples,
                sample_rate=self.model.sample_rate, finished=c.finished,
                stop_reason=req.stop_reason if c.finished else None,
                prompt_tokens=len(req.prompt), completion_tokens=generated,
                timings=req.times.summary(time.perf_counter()) if c.finished else None,
            ), context=c.context, req=req)
            req.seq += 1
            req.delivered = c.end
            if c.finished:
                self._release(req, req.stop_reason)

    # ---- endings --------------------------------------------------------------------------------

    def _fail(self, req: EngineRequest, message: str) -> None:
        self._end(req, "error", error=message, code="internal")

    def _end(self, req: EngineRequest, reason: str, error: str | None = None, code: str | None = None) -> None:
        """End a request early: release it, then one terminal chunk at its frontier."""
        self._release(req, reason)
        chunk = self._terminal(req.request_id, req.delivered, reason, error=error, req=req)
        chunk.error_code = code
        chunk.timings = req.times.summary(time.perf_counter())
        self._send(chunk, req=req)

    def _release(self, req: EngineRequest, reason: str | None) -> None:
        """The one cleanup for every exit path; idempotent."""
        self.scheduler.remove(req)
        if self.requests.pop(req.request_id, None) is not None:
            self.stats.finished[reason or "unknown"] += 1
        self.codec_worker.release(req.request_id)
        if not req.codec_in_flight:  # else the codec worker still reads them; they go with the request
            req.codes = req.codec_state = None

    def _terminal(self, rid: str, emitted: int, reason: str, error: str | None = None,
                  req: EngineRequest | None = None) -> AudioChunk:
        return AudioChunk(
            request_id=rid, seq=req.seq if req else 0, start_frame=emitted, end_frame=emitted,
            audio=np.zeros(0, dtype=np.float32), sample_rate=self.model.sample_rate, finished=True,
            stop_reason=reason, error=error, prompt_tokens=len(req.prompt) if req else 0,
            completion_tokens=len(req.tokens) if req else 0,
        )

    def _send(self, chunk: AudioChunk, context: int = 0, req: EngineRequest | None = None) -> None:
        if self.tracer is not None:
            extra = dict(timings=chunk.timings) if chunk.finished and chunk.timings else {}
            if chunk.finished and req is not None:  # what invariant 3 compares: the same prompt, the same tokens
                extra.update(tokens=req.tokens, prompt_digest=prompt_digest(req.prompt), **wall_clock(req.times))
            self.tracer.record(chunk.request_id, chunk.start_frame, chunk.end_frame, context, chunk.finished,
                               stop_reason=chunk.stop_reason, backlog=self.planner.backlog_active, **extra)
        self._outbox.append(chunk)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def build(cls, model_spec: str, profile: Profile, trace_frames: str | None = None) -> "EngineCore":
        # The codec and frontend processes load their own copies of the model meanwhile.
        codec_process, frontend_processes = None, []
        try:
            if profile.codec.process:
                codec_process = CodecProcess(model_spec, profile)
            for i in range(profile.frontend.workers if profile.frontend.process else 0):
                frontend_processes.append(FrontendProcess(model_spec, profile, i))
            model = load_for_profile(model_spec, profile)
            # Their warm-ups are GPU work (none may run during the captures) and hold GPU memory that the KV
            # cache, sized from what is free, must leave them (session 42: sized first, it took the codec
            # process's and its warm-up ran out of memory on an 80 GB card).
            for child in [codec_process, *frontend_processes]:
                if child is not None:
                    child.wait_ready()
            return cls(model, profile, FrameTracer(trace_frames) if trace_frames else None, codec_process,
                       frontend_processes or None)
        except BaseException:
            for child in [codec_process, *frontend_processes]:
                if child is not None:
                    child.close()
            raise

