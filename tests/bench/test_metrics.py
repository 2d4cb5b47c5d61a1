"""Metric definitions on hand-made timelines."""

import pytest

from intone.bench.metrics import RequestRecord, opening_burst, stalls, summarize, underrun


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


def test_the_opening_burst_is_each_clients_first_request_whatever_the_records_order():
    """Two clients: their first requests (sent together) slow and stalling, the later ones quick; the records
    come in completion order, not send order."""
    def sent(at, first_audio, stalls_after=False, ok=True):
        chunks = [(first_audio, 0.2), (first_audio + (1.0 if stalls_after else 0.1), 1.0)]
        r = rec(chunks, first_audio + 1.0, ok=ok)
        r.sent_at = at
        return r

    later = [sent(1.0 + i, 0.3 + 0.01 * i) for i in range(4)] + [sent(9.0, 0.0, ok=False)]
    first = [sent(0.0, 1.2, stalls_after=True), sent(0.001, 1.4)]
    records = later[:2] + first[:1] + later[2:] + first[1:]
    b = opening_burst(records, concurrency=2, stream=True)
    assert b["metric"] == "first_audio_s"
    assert b["burst"]["requests"] == 2 and b["burst"]["stats"]["mean"] == pytest.approx(1.3)
    assert b["burst"]["streams_with_underrun"] == 1
    assert b["rest"]["requests"] == 5 and b["rest"]["stats"]["p50"] == pytest.approx(0.315)  # the failed one not timed
    assert b["rest"]["streams_with_underrun"] == 0
    assert opening_burst(records, concurrency=2, stream=False)["burst"]["stats"]["mean"] == pytest.approx(2.3)
    assert opening_burst(records[:4], concurrency=2, stream=True) is None  # no steady state to tell it from
