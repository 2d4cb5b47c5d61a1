"""The codec stage: grouping bounds, and batched decoding equal to decoding each window alone."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.models.vocoder import CodecJob, CodecWindow, WindowVocoder
from intone.ops.batching import FRAME_BUCKETS, bucket_frames, bucket_rows, group_jobs, row_buckets, with_buckets


def split_cost(groups, lengths, call_cost, padded=lambda rows, longest: rows * longest):
    return sum(call_cost + padded(len(g), max(lengths[i] for i in g)) for g in groups)


def graph_shaped(rows, longest):
    """A call replayed from a graph pays its graph's shape: rows to a power of two, lengths to a multiple of 8."""
    return bucket_rows(rows) * -(-longest // 8) * 8


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 120), min_size=1, max_size=40), st.integers(1, 16), st.integers(1, 400),
       st.one_of(st.none(), st.integers(0, 500)))
def test_groups_cover_every_job_once_within_bounds(lengths, max_batch, max_padded, call_cost):
    groups = group_jobs(lengths, max_batch, max_padded, call_cost)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) <= max_batch
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= max_padded


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=7), st.integers(1, 7), st.integers(1, 200),
       st.integers(0, 100), st.sampled_from([None, graph_shaped]))
def test_the_cheapest_split_beats_greedy_and_every_other_split(lengths, max_batch, max_padded, call_cost, padded):
    """Against brute force over every set partition that keeps the bounds (small inputs), with a call's
    work as rows x longest or as its graph's padded shape."""
    cost = padded or (lambda rows, longest: rows * longest)
    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            yield [[first]] + part
            for k in range(len(part)):
                yield part[:k] + [[first] + part[k]] + part[k + 1:]

    def fits(g):
        return len(g) == 1 or (len(g) <= max_batch and len(g) * max(lengths[i] for i in g) <= max_padded)

    best = min(split_cost(p, lengths, call_cost, cost) for p in partitions(list(range(len(lengths))))
               if all(map(fits, p)))
    cheapest = group_jobs(lengths, max_batch, max_padded, call_cost, padded)
    assert split_cost(cheapest, lengths, call_cost, cost) == best
    assert best <= split_cost(group_jobs(lengths, max_batch, max_padded), lengths, call_cost, cost)


def test_a_spread_of_lengths_splits_into_calls_of_similar_lengths():
    """CosyVoice3's flow jobs: references of 75-200 tokens plus 40-250 spoken ones. One full call pads
    ~30% of its work (two calls, at max_padded_frames); at the profiles' call cost four calls pad ~10%."""
    lengths = [110 + (270 * i * 37 % 271) for i in range(48)]
    useful = sum(lengths)
    waste = {c: 1 - useful / sum(len(g) * max(lengths[i] for i in g) for g in group_jobs(lengths, 64, 16384, c))
             for c in (None, 512)}
    assert waste[None] > 0.25 and waste[512] < 0.12


@given(rows=st.integers(1, 300), granule=st.sampled_from([0, 4, 8, 16]), exact=st.sampled_from([0, 1, 5, 16]))
def test_a_call_is_padded_to_its_rows_bucket_and_warm_up_reaches_every_bucket(rows, granule, exact):
    """codec.row_granule: at most one granule of blank rows above it (a power of two below), never fewer
    rows than the call's; codec.exact_rows: none up to it; `row_buckets` lists each bucket a call of up
    to max_rows can reach, with the fewest rows that reach it (what the warm-up bounds by max_padded_frames)."""
    b = bucket_rows(rows, granule, exact)
    assert b >= rows
    if rows <= exact:
        assert b == rows
    elif granule and b > granule:
        assert b % granule == 0 and b - rows < granule
    else:
        assert b & (b - 1) == 0 and b < 2 * rows
    buckets = row_buckets(rows, granule, exact)
    assert [x for x, _ in buckets] == sorted({bucket_rows(n, granule, exact) for n in range(1, rows + 1)})
    assert all(bucket_rows(n, granule, exact) == x and (n == 1 or bucket_rows(n - 1, granule, exact) < x)
               for x, n in buckets)


@settings(max_examples=300, deadline=None)
@given(frames=st.integers(1, 900), extra=st.lists(st.integers(1, 600), max_size=6))
def test_frames_pad_to_the_smallest_bucket_that_holds_them(frames, extra):
    """codec.frame_buckets join the built-in lengths; a call pads to the smallest that holds it (beyond the
    largest, to a multiple of 256), never less than with the built-in ones alone."""
    buckets = with_buckets(extra)
    padded = bucket_frames(frames, buckets)
    assert padded >= frames and padded <= bucket_frames(frames)
    assert padded in buckets or (padded % 256 == 0 and frames > buckets[-1])
    assert not any(frames <= b < padded for b in buckets)
    assert set(FRAME_BUCKETS) <= set(buckets)


class _ShapesOnly:
    """What the vocoder reads of a model to plan its calls (no decode runs here)."""

    num_codebooks = 10
    device = torch.device("cpu")

    def stream_decoder(self):
        return None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 1024), min_size=1, max_size=70), st.sampled_from([8, 16, 64]),
       st.sampled_from([256, 1024, 4096]), st.sampled_from([0, 8]), st.sampled_from([0, 3, 16]),
       st.sampled_from([(), (25, 29), (6, 12, 40, 75), (600, 1000)]), st.sampled_from([None, 64]),
       st.sampled_from([80, 600, 1024]))
def test_every_call_shape_is_one_the_warm_up_decodes(lengths, max_batch, max_padded, granule, exact, buckets, cost,
                                                     window):
    """A shape first met while serving costs the codec its kernels' plans (milliseconds a convolution):
    whatever chunks wait (windows up to `window` frames; a carried call's spans up to its longest chunk's
    built-in bucket), each call is padded to a (rows, frames) shape that start-up decoded."""
    vocoder = WindowVocoder(_ShapesOnly(), max_batch, max_padded, row_granule=granule, split_cost=cost,
                            exact_rows=exact, frame_buckets=buckets)
    warmed = set(vocoder.warm_shapes(window))
    lengths = [min(n, bucket_frames(window)) for n in lengths]
    for group in vocoder._groups(lengths):
        longest = max(lengths[i] for i in group)
        assert (vocoder._rows(len(group)), vocoder._frames(longest)) in warmed


class _RecordedDecodes(_ShapesOnly):
    """The decodes' shapes, as `WindowVocoder.decode` sends them (zeros back; the planning is what is tested):
    the plain decode's and, through its stream decoder, the carried one's."""

    samples_per_frame = 2

    gap = 3  # codec.packed_decode: the full-size codec's gap

    def __init__(self):
        self.plain, self.carried, self.packed = [], [], []

    def stream_decoder(self, lean=False, packed=False):
        return self

    def packed_length(self, lengths):
        from intone.models.fish_s2.codec_packed import packed_frames

        return packed_frames(sum(lengths) + self.gap * len(lengths))

    def decode(self, codes, *rest):
        if len(rest) == 1:  # the plain decode: (codes, offsets)
            self.plain.append((codes.shape[0], codes.shape[2]))
            return torch.zeros(codes.shape[0], codes.shape[2] * self.samples_per_frame)
        lengths, states = rest  # the stream decoder's: each row's state comes back at its new frame
        self.carried.append((codes.shape[0], codes.shape[2]))
        self.packed.append(self.packed_length(lengths))
        new = [SimpleNamespace(frames=(s.frames if s is not None else 0) + n) for s, n in zip(states, lengths)]
        return torch.zeros(codes.shape[0], codes.shape[2] * self.samples_per_frame), new


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 60), min_size=1, max_size=4), st.booleans()), min_size=1,
                max_size=70),
       st.sampled_from([8, 16, 64]), st.sampled_from([256, 1024, 4096]), st.sampled_from([0, 8]),
       st.sampled_from([0, 3, 16]), st.sampled_from([(), (25, 29), (6, 9, 14, 21)]), st.sampled_from([None, 64]),
       st.sampled_from([4, 25, 50, 60]), st.sampled_from(["padded", "packed", "graphs"]))
def test_every_carried_call_shape_is_one_the_warm_up_carries(requests, max_batch, max_padded, granule, exact,
                                                             buckets, cost, longest, mode):
    """The carried decode warms only the shapes up to its longest chunk's bucket (`carried_shapes`): whatever
    chunks of at most `longest` frames wait in one call, several of a request in a row among them (joined into
    spans, decoded in rounds), each carried decode gets a shape start-up carried; a request's only chunk
    (finished from frame 0, up to 120 frames here) takes the plain decode, whose shapes start-up decodes. Packed
    (`codec.packed_decode`), each carried call's packed length is one start-up packs. With the carried decode's
    graphs (up to 50 frames), an only chunk within them goes carried, at a shape start-up captured, and the plain
    decode meets only the shapes longer than the graphs, all that start-up then decodes (`plain_shapes`)."""
    from intone.engine.cuda_graphs import FunctionGraphs

    model = _RecordedDecodes()
    packed, graphs = mode == "packed", mode == "graphs"
    vocoder = WindowVocoder(model, max_batch, max_padded, carry_state=True, row_granule=granule, split_cost=cost,
                            exact_rows=exact, frame_buckets=buckets, packed_decode=packed,
                            graph_frames=50 if graphs else None)
    if graphs:
        vocoder.graphs = FunctionGraphs()  # as `capture_graphs` leaves it (on a CPU nothing is captured)
    windows = []
    for key, (chunks, finished) in enumerate(requests):
        if finished and len(chunks) == 1:  # a whole response
            chunks = [2 * chunks[0]]
        else:
            chunks = [min(n, longest) for n in chunks]
        at = 0
        for i, n in enumerate(chunks):
            last = finished and i == len(chunks) - 1
            windows.append(CodecWindow(key, f"r{key}", torch.zeros(10, at + n, dtype=torch.long), None, at, at + n,
                                       0, last))
            at += n
    vocoder.decode(windows, {})
    if packed:
        assert set(model.packed) <= set(vocoder.packed_lengths(bucket_frames(longest)))
    else:
        assert set(model.carried) <= set(vocoder.carried_shapes(512, longest)) | set(vocoder.graph_shapes())
    assert set(model.plain) <= set(vocoder.plain_shapes(512, graphs))
    only = [2 * c[0] for c, f in requests if f and len(c) == 1]  # the only chunks' lengths
    assert len(model.plain) > 0 or not any(n > (vocoder.graph_bound if graphs else 0) for n in only)


def test_rows_padded_to_a_granule_give_the_same_audio_with_fewer_blank_rows(tiny_fish_dir):
    """Ten requests' chunks in one carried call: 16 rows computed by default, 12 with a granule of 4;
    each chunk its one-pass decode either way (float64)."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.request import EngineRequest
    from intone.models.registry import load_model
    from intone.protocol import SamplingParams

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    codes = [torch.randint(0, 8, (model.num_codebooks, 6), generator=g) for _ in range(10)]
    spf = model.samples_per_frame
    for granule, rows in ((0, 16), (4, 12)):
        vocoder = WindowVocoder(model, max_batch=16, max_padded_frames=4096, carry_state=True, row_granule=granule)
        reqs = [EngineRequest(f"r{i}", prompt=None, params=SamplingParams()) for i in range(10)]
        for req, c in zip(reqs, codes):
            req.codes = c
        items = [(req, Chunk(req.request_id, 0, 6, 0, False)) for req in reqs]
        out = CodecStage(vocoder).run(items)
        assert vocoder.padded_tokens == rows * 8  # 6 frames: bucket 8
        for (req, chunk), audio in zip(items, out):
            assert abs(audio - model.decode(req.codes[None], 0)[0].numpy()[: 6 * spf]).max() < 1e-6


def test_exact_rows_frame_buckets_and_packing_pad_less_and_give_the_same_audio(tiny_fish_dir):
    """Five streams' 25-frame chunks and a new stream's 4-frame first chunk joined with its next 25 (one
    span of 29) in one carried call: 8 rows x 32 frames by default, 6 x 29 with codec.exact_rows and
    codec.frame_buckets [25, 29], their 154 frames and six gaps packed into 192 with codec.packed_decode; each chunk
    its one-pass decode every way (float64)."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.request import EngineRequest
    from intone.models.registry import load_model
    from intone.protocol import SamplingParams

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    spf = model.samples_per_frame
    from intone.models.fish_s2.codec_packed import PackedStreamingDecoder, packed_frames

    packed = packed_frames(5 * 25 + 29 + 6 * PackedStreamingDecoder(model.codec).gap)  # the gaps and a bucket
    assert packed < 8 * 32
    for options, cells in (({}, 8 * 32), (dict(exact_rows=8, frame_buckets=(25, 29)), 6 * 29),
                           (dict(packed_decode=True), packed)):
        vocoder = WindowVocoder(model, max_batch=16, max_padded_frames=4096, carry_state=True, **options)
        reqs = [EngineRequest(f"r{i}", prompt=None, params=SamplingParams()) for i in range(6)]
        for req in reqs:
            req.codes = torch.randint(0, 8, (model.num_codebooks, 29), generator=g)
        items = [(req, Chunk(req.request_id, 0, 25, 0, False)) for req in reqs[:5]]
        items += [(reqs[5], Chunk("r5", 0, 4, 0, False)), (reqs[5], Chunk("r5", 4, 29, 0, False))]
        out = CodecStage(vocoder).run(items)
        assert (vocoder.calls, vocoder.padded_tokens, vocoder.useful_tokens) == (1, cells, 5 * 25 + 29)
        for (req, chunk), audio in zip(items, out):
            whole = model.decode(req.codes[None, :, : chunk.end], 0)[0].numpy()
            assert abs(audio - whole[chunk.start * spf: chunk.end * spf]).max() < 1e-9


def test_with_codec_graphs_a_whole_piece_joins_the_carried_call_and_stays_its_one_pass(tiny_fish_dir):
    """Three streams' 8-frame chunks and two requests' whole 6-frame utterances: without graphs the whole
    ones take the plain decode, a call of their own (2 calls); once the carried decode has graphs (none
    captured on a CPU: each replay runs eagerly, the same function) they go carried, in the streams' call
    (1 call). Each piece its one-pass decode either way (float64)."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.cuda_graphs import FunctionGraphs
    from intone.engine.request import EngineRequest
    from intone.models.registry import load_model
    from intone.protocol import SamplingParams

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    spf = model.samples_per_frame
    for graphs, calls in ((None, 2), (FunctionGraphs(), 1)):
        vocoder = WindowVocoder(model, max_batch=16, max_padded_frames=4096, carry_state=True, graph_frames=16)
        if graphs is not None:
            vocoder.capture_graphs(graphs)
        reqs = [EngineRequest(f"r{i}", prompt=None, params=SamplingParams()) for i in range(5)]
        for req in reqs:
            req.codes = torch.randint(0, 8, (model.num_codebooks, 8), generator=g)
        items = [(req, Chunk(req.request_id, 0, 8, 0, False)) for req in reqs[:3]]
        items += [(req, Chunk(req.request_id, 0, 6, 0, True)) for req in reqs[3:]]
        out = CodecStage(vocoder).run(items)
        assert vocoder.calls == calls
        for (req, chunk), audio in zip(items, out):
            whole = model.decode(req.codes[None, :, : chunk.end], 0)[0].numpy()
            assert abs(audio - whole[: chunk.end * spf]).max() < 1e-9


def test_batched_windows_equal_windows_decoded_alone(tiny_fish_dir):
    from intone.models.registry import load_model

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    jobs = [CodecJob(torch.randint(0, 4096, (10, n), generator=g), ctx, first)
            for n, ctx, first in [(29, 25, 4), (4, 0, 0), (50, 25, 29), (7, 7, 100), (31, 25, 200)]]
    vocoder = WindowVocoder(model, max_batch=8, max_padded_frames=256)
    batched = vocoder.decode_jobs(jobs)
    assert vocoder.calls == 1  # one call, four real windows (one is context only)
    for job, audio in zip(jobs, batched):
        if job.length == job.context:
            assert audio.shape == (0,)
            continue
        alone = model.decode(job.codes[None], job.first_frame)[0, job.context * 2048 :]
        assert audio.shape[0] == (job.length - job.context) * 2048
        assert (torch.from_numpy(audio).double() - alone).abs().max() < 1e-7


def test_a_request_that_takes_an_ended_requests_id_decodes_from_a_state_of_its_own(tiny_fish_dir):
    """An aborted request's chunk still queued and a new request under its id in one call (carried codec
    state): each chunk continues from its own request's state and is its one-pass decode."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.request import EngineRequest
    from intone.models.registry import load_model
    from intone.protocol import SamplingParams

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    stage = CodecStage(WindowVocoder(model, max_batch=8, max_padded_frames=4096, carry_state=True))
    g = torch.Generator().manual_seed(0)
    old, new = (EngineRequest("r", prompt=None, params=SamplingParams()) for _ in range(2))
    for req in (old, new):
        req.codes = torch.randint(0, 8, (model.num_codebooks, 12), generator=g)
    stage.run([(old, Chunk("r", 0, 6, 0, False))])
    tail, head = stage.run([(old, Chunk("r", 6, 12, 0, True)), (new, Chunk("r", 0, 6, 0, False))])
    spf = model.samples_per_frame
    one_pass = {id(r): model.decode(r.codes[None], 0)[0].numpy() for r in (old, new)}
    assert abs(tail - one_pass[id(old)][6 * spf : 12 * spf]).max() < 1e-6
    assert abs(head - one_pass[id(new)][: 6 * spf]).max() < 1e-6
    assert old.codec_state.frames == 12 and new.codec_state.frames == 6


def test_a_failed_call_commits_no_state_and_its_chunks_retried_alone_get_their_own_audio(tiny_fish_dir):
    """Carried codec state: a call fails in its second round, after its first round had advanced states;
    nothing of it was committed, so each chunk retried alone (`decode_batch`) continues from its request's
    committed state and is its one-pass decode, and only the bad chunk gets an exception."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.codec_worker import decode_batch
    from intone.engine.request import EngineRequest
    from intone.models.registry import load_model
    from intone.protocol import SamplingParams

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    stage = CodecStage(WindowVocoder(model, max_batch=8, max_padded_frames=4096, carry_state=True))
    g = torch.Generator().manual_seed(1)
    a, b, c = (EngineRequest(rid, prompt=None, params=SamplingParams()) for rid in "abc")
    for req in (a, b, c):
        req.codes = torch.randint(0, 8, (model.num_codebooks, 12), generator=g)
    stage.run([(a, Chunk("a", 0, 6, 0, False)), (b, Chunk("b", 0, 6, 0, False))])
    items = [(a, Chunk("a", 6, 9, 0, False)), (b, Chunk("b", 6, 12, 0, True)), (c, Chunk("c", 0, 3, 0, False)),
             (a, Chunk("a", 9, 12, 0, True)), (c, Chunk("c", 5, 8, 0, False))]  # c's second skips frames 3-4
    out = decode_batch(stage, items)
    spf = model.samples_per_frame
    one_pass = {id(r): model.decode(r.codes[None], 0)[0].numpy() for r in (a, b, c)}
    for (req, chunk), audio in zip(items[:4], out[:4]):
        assert abs(audio - one_pass[id(req)][chunk.start * spf : chunk.end * spf]).max() < 1e-6
    assert isinstance(out[4], RuntimeError) and "codec state is at 3" in str(out[4])
    assert (a.codec_state.frames, b.codec_state.frames, c.codec_state.frames) == (12, 12, 3)


def test_a_requests_chunks_that_continue_one_another_decode_as_one_span(tiny_fish_dir):
    """Carried state: three chunks of one request waiting in one call (a listener-paced stream) and
    another request's chunk decode in one device call, not three rounds, and each chunk gets its own
    part of the one-pass decode."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.request import EngineRequest
    from intone.models.registry import load_model
    from intone.protocol import SamplingParams

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    vocoder = WindowVocoder(model, max_batch=8, max_padded_frames=4096, carry_state=True)
    stage = CodecStage(vocoder)
    g = torch.Generator().manual_seed(2)
    a, b = (EngineRequest(rid, prompt=None, params=SamplingParams()) for rid in "ab")
    for req in (a, b):
        req.codes = torch.randint(0, 8, (model.num_codebooks, 14), generator=g)
    items = [(a, Chunk("a", 0, 4, 0, False)), (b, Chunk("b", 0, 9, 0, False)), (a, Chunk("a", 4, 5, 0, False)),
             (a, Chunk("a", 5, 5, 0, False)), (a, Chunk("a", 5, 11, 0, True))]
    out = stage.run(items)
    assert vocoder.calls == 1
    spf = model.samples_per_frame
    one_pass = {id(r): model.decode(r.codes[None], 0)[0].numpy() for r in (a, b)}
    for (req, chunk), audio in zip(items, out):
        assert audio.shape == ((chunk.end - chunk.start) * spf,)
        assert abs(audio - one_pass[id(req)][chunk.start * spf: chunk.end * spf]).max(initial=0) < 1e-6
    assert (a.codec_state.frames, b.codec_state.frames) == (11, 9)


def test_a_span_never_pads_the_call_beyond_its_longest_chunk(tiny_fish_dir):
    """Carried state: a request's two waiting chunks that together outgrow the call's padded length
    (a backlog of whole responses' pieces) decode in two rounds, not as one longer row that every
    row of the call would be padded to; each chunk still gets its part of the one-pass decode."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.request import EngineRequest
    from intone.models.registry import load_model
    from intone.protocol import SamplingParams

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    vocoder = WindowVocoder(model, max_batch=8, max_padded_frames=4096, carry_state=True)
    g = torch.Generator().manual_seed(3)
    a, b = (EngineRequest(rid, prompt=None, params=SamplingParams()) for rid in "ab")
    for req in (a, b):
        req.codes = torch.randint(0, 8, (model.num_codebooks, 16), generator=g)
    items = [(a, Chunk("a", 0, 8, 0, False)), (b, Chunk("b", 0, 8, 0, False)), (a, Chunk("a", 8, 16, 0, True))]
    out = CodecStage(vocoder).run(items)
    assert vocoder.calls == 2 and vocoder.padded_tokens == 2 * 8 + 1 * 8  # rows x frames: [a, b] then [a]
    spf = model.samples_per_frame
    for (req, chunk), audio in zip(items, out):
        one_pass = model.decode(req.codes[None], 0)[0].numpy()
        assert abs(audio - one_pass[chunk.start * spf: chunk.end * spf]).max() < 1e-6


@pytest.mark.parametrize("split_cost, calls, padded", [(None, 1, 8 * 50), (100, 2, 8 * 4 + 2 * 50)])
def test_a_split_cost_keeps_long_chunks_from_padding_many_short_ones(tiny_fish_dir, split_cost, calls, padded):
    """codec.split_cost: six streams' 4-frame chunks beside two 50-frame ones go in two calls of their
    own lengths when the padding saved exceeds the cost of a call; each chunk its one-pass decode."""
    from intone.engine.chunk_planner import Chunk
    from intone.engine.codec_stage import CodecStage
    from intone.engine.request import EngineRequest
    from intone.models.registry import load_model
    from intone.protocol import SamplingParams

    model = load_model(str(tiny_fish_dir), dtype=torch.float64, codec_dtype=torch.float64)
    vocoder = WindowVocoder(model, max_batch=16, max_padded_frames=4096, carry_state=True, split_cost=split_cost)
    g = torch.Generator().manual_seed(6)
    items = []
    for i, n in enumerate([4] * 6 + [50] * 2):
        req = EngineRequest(f"r{i}", prompt=None, params=SamplingParams())
        req.codes = torch.randint(0, 8, (model.num_codebooks, n), generator=g)
        items.append((req, Chunk(req.request_id, 0, n, 0, False)))
    out = CodecStage(vocoder).run(items)
    assert (vocoder.calls, vocoder.padded_tokens) == (calls, padded)
    spf = model.samples_per_frame
    for (req, chunk), audio in zip(items, out):
        assert abs(audio - model.decode(req.codes[None], 0)[0].numpy()[: chunk.end * spf]).max() < 1e-6


def test_exact_rows_keep_the_carried_calls_rows_and_leave_the_plain_decodes_shapes_as_they_were():
    """codec.exact_rows with the carried decode (Fish's shipped profile): a carried call of five chunks is five
    rows, a plain decode of five whole utterances (beyond the graphs) eight, so start-up decodes the same plain
    shapes as without exact rows (61, not 101); without carry_state, every call keeps its own rows."""
    from intone.engine.cuda_graphs import FunctionGraphs

    def vocoder(exact, carry=True):
        model = _RecordedDecodes()
        v = WindowVocoder(model, 64, 4096, carry_state=carry, graph_frames=50 if carry else None, exact_rows=exact,
                          frame_buckets=(6, 9, 12, 14, 20, 21, 25, 29, 40))
        v.graphs = FunctionGraphs() if carry else None
        return v, model

    shipped, model = vocoder(8)
    assert shipped.plain_shapes(512, True) == vocoder(0)[0].plain_shapes(512, True) and \
        len(shipped.plain_shapes(512, True)) == 61
    assert (5, 25) in shipped.graph_shapes() and (5, 25) not in vocoder(0)[0].graph_shapes()
    chunks = [CodecWindow(k, f"c{k}", torch.zeros(10, 25, dtype=torch.long), None, 0, 25, 0, False) for k in range(5)]
    whole = [CodecWindow(k, f"w{k}", torch.zeros(10, 90, dtype=torch.long), None, 0, 90, 0, True) for k in range(5, 10)]
    shipped.decode(chunks + whole, {})
    assert model.carried == [(5, 25)] and model.plain == [(8, 100)]
    plain, model = vocoder(8, carry=False)
    plain.decode(whole, {})
    assert model.plain == [(5, 100)]


def test_start_up_carries_the_shapes_chunks_reach_and_decodes_every_window_shape(tiny_fish_dir):
    """Chunks of at most 25 frames against windows of up to 128 (Fish's shipped profile: 50 against 512): the
    carried decode warms the shapes up to 25 frames' bucket, the plain decode (a request's only chunk: up to its
    utterance) all of them."""
    from intone.models.registry import load_model

    model = load_model(str(tiny_fish_dir))
    vocoder = WindowVocoder(model, max_batch=4, max_padded_frames=256, carry_state=True)
    carried, plain = [], []
    stream_decode, model_decode = vocoder.stream.decode, model.decode
    vocoder.stream.decode = lambda codes, *a: carried.append(tuple(codes.shape[::2])) or stream_decode(codes, *a)
    model.decode = lambda codes, *a: plain.append(tuple(codes.shape[::2])) or model_decode(codes, *a)
    assert vocoder.warm_up(128, 25) == len(plain) == len(vocoder.warm_shapes(128))
    assert sorted(carried) == sorted(vocoder.carried_shapes(128, 25)) and max(t for _, t in carried) == 32
    assert set(carried) < set(plain) == set(vocoder.warm_shapes(128))
