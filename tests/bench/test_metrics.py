"""Metric definitions on hand-made timelines."""

import pytest

from intone.bench.metrics import RequestRecord, stalls, summarize, underrun


def rec(chunks, completion, ok=True):
    return RequestRecord("r", "u", ok=ok, completion_s=completion, chunks=chunks, audio_s=sum(d for _, d in chunks))


def test_a_stream_that_stays_ahead_never_underruns():
    # chunks of 1 s audio arriving every 0.5 s: the buffer only grows
    r = rec([(0.2, 1.0), (0.7, 1.0), (1.2, 1.0)], 1.2)
    assert r.first_audio_s == 0.2
    assert r.gaps == pytest.approx([0.5, 0.5])
    assert r.underrun_s == 0.0
    assert r.rtf == pytest.approx(1.2 / 3.0)


def test_late_chunks_stall_the_player():
    # play 0.1-0.6, next arrives at 1.0 (stall 0.4), plays to 1.5; next at 1.5 (no stall), plays to 2.0;
    # last at 2.6 (stall 0.6)
    chunks = [(0.1, 0.5), (1.0, 0.5), (1.5, 0.5), (2.6, 0.5)]
    assert underrun(chunks) == pytest.approx(1.0)
    assert [(i, round(s, 6)) for i, s in stalls(chunks)] == [(2, 0.4), (4, 0.6)]
    assert underrun([]) == 0.0 and stalls([]) == []


def test_the_chunk_each_stream_first_stalled_at_is_counted():
    late_second = rec([(0.1, 0.2), (0.5, 1.0), (1.0, 1.0)], 1.0)  # plays 0.1-0.3, waits for chunk 2
    late_fourth = rec([(0.1, 1.0), (0.5, 0.2), (0.9, 0.2), (2.0, 1.0)], 2.0)  # plays to 1.5, waits for chunk 4
    ahead = rec([(0.1, 1.0), (0.5, 1.0)], 0.5)
    s = summarize([late_second, late_fourth, ahead, late_second], wall_s=3.0, stream=True)
    assert s["streams_with_underrun"] == 3
    assert s["first_stall_chunk"] == {"2": 2, "3": 0, "4": 1, "5+": 0}


def test_summary_counts_failures_and_uses_the_measured_wall_time():
    records = [rec([(0.5, 2.0)], 1.0), rec([(1.0, 4.0)], 3.0), rec([], None, ok=False)]
    s = summarize(records, wall_s=4.0, stream=True)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["requests_per_s"] == pytest.approx(0.5)
    assert s["audio_s_per_s"] == pytest.approx(6.0 / 4.0)
    assert s["mean_audio_s"] == pytest.approx(3.0)
    assert s["completion_s"]["mean"] == pytest.approx(2.0)
    assert s["first_audio_s"]["p50"] == pytest.approx(0.75)
    assert s["streams_with_underrun"] == 0
    assert summarize(records, 4.0, stream=False)["first_audio_s"] is None
