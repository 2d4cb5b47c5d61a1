"""The slowest requests' engine stages: the server's trace joined to the client's records."""

import json

from hypothesis import given
from hypothesis import strategies as st

from intone.bench.tail import burst_breakdown, tail_breakdown, tail_lines, traced_timings


def _trace(tmp_path, rows, cut: bool = False):
    path = tmp_path / "frames.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + ('{"request_id": "x", "fin' if cut else ""))
    return path


def test_segments_sum_under_the_api_id_and_a_cut_off_line_is_skipped(tmp_path):
    rows = [dict(request_id="a", finished=False, start=0, end=4),
            dict(request_id="a", finished=True, start=4, end=9, timings=dict(frontend_s=0.1, total_s=1.0)),
            dict(request_id="b.0", finished=True, timings=dict(frontend_s=0.2, total_s=2.0)),
            dict(request_id="b.1", finished=True, timings=dict(frontend_s=0.0, total_s=1.5))]
    got = traced_timings([_trace(tmp_path, rows, cut=True)])
    assert got["a"] == dict(frontend_s=0.1, total_s=1.0)
    assert got["b"] == dict(frontend_s=0.2, total_s=3.5)


@given(st.lists(st.floats(0.01, 10.0), min_size=5, max_size=60), st.sampled_from([True, False]))
def test_the_slowest_tenth_holds_the_largest_values_and_the_groups_split_the_joined(values, stream):
    metric = "first_audio_s" if stream else "completion_s"
    records = [{"ok": True, metric: v, "server_id": f"r{i}"} for i, v in enumerate(values)]
    records.append({"ok": True, metric: 99.0, "server_id": "not-traced"})  # not in the trace: left out
    timings = {f"r{i}": {"total_s": v * 2} for i, v in enumerate(values)}
    tail = tail_breakdown(records, timings, stream)
    slow, rest = tail["groups"]["slowest"], tail["groups"]["rest"]
    assert tail["joined"] == len(values) == slow["requests"] + rest["requests"]
    assert slow["requests"] == max(1, round(len(values) * 0.1))
    top = sorted(values)[-slow["requests"]:]
    assert abs(slow["metric_mean"] - sum(top) / len(top)) < 1e-9
    assert abs(slow["stages"]["total"] - 2 * slow["metric_mean"]) < 1e-9
    assert rest["metric_mean"] <= slow["metric_mean"]
    assert slow["stages"]["frontend"] == 0.0  # a stage the trace lacks counts 0


def test_the_time_after_the_last_frame_is_the_total_less_the_stages_before_it():
    """after_last: a request's last frame -> its end, its total less frontend, queue, prefill and decode (the
    codec stages overlap decode and are not subtracted); printed as the last column."""
    records = [{"ok": True, "completion_s": 1.0 + i, "server_id": f"r{i}"} for i in range(10)]
    timings = {f"r{i}": dict(frontend_s=0.1, queue_s=0.05, prefill_s=0.05, decode_s=1.0 + i, first_codec_s=0.5,
                             codec_s=0.7, total_s=1.5 + 1.5 * i) for i in range(10)}
    tail = tail_breakdown(records, timings, stream=False)
    assert abs(tail["groups"]["slowest"]["stages"]["after_last"] - (1.5 + 13.5 - 0.2 - 10.0)) < 1e-9  # r9
    assert abs(tail["groups"]["rest"]["stages"]["after_last"] - (0.3 + 0.5 * 4)) < 1e-9  # r0-r8: 0.3 + 0.5 i
    table = tail_lines(tail, 64)
    assert table[2].endswith("| total | after_last |") and table[-2].startswith("| rest | 9 |")
    assert table[-2].endswith(f"| {tail['groups']['rest']['stages']['after_last']:.3f} |")


def test_time_outside_the_engine_joins_the_clients_clock_to_the_traces_instants(tmp_path):
    """to_engine: the client's clock start -> the engine core has the request; to_client: the engine sent the
    audio the metric waits for -> the client has it. A segmented request counts from its first arrival and to its
    last end; a record without the instants leaves both out of the table."""
    rows = [dict(request_id="s.0", finished=True, timings=dict(total_s=1.0), arrived_at=100.2, first_audio_at=100.9,
                 finished_at=101.0),
            dict(request_id="s.1", finished=True, timings=dict(total_s=1.0), arrived_at=101.1, first_audio_at=101.5,
                 finished_at=102.5)]
    timings = traced_timings([_trace(tmp_path, rows)])
    assert timings["s"]["arrived_at"] == 100.2 and timings["s"]["first_audio_at"] == 100.9
    assert timings["s"]["finished_at"] == 102.5 and timings["s"]["total_s"] == 2.0
    records = [{"ok": True, "completion_s": 2.7 + i, "first_audio_s": 1.2, "started_at": 100.0 + i,
                "server_id": "s" if i == 0 else f"r{i}"} for i in range(6)]
    for i in range(1, 6):
        timings[f"r{i}"] = dict(total_s=1.0, arrived_at=100.1 + i, first_audio_at=100.5 + i, finished_at=102.0 + 2 * i)
    full = tail_breakdown(records, timings, stream=False)
    assert abs(full["groups"]["slowest"]["outside"]["to_engine"] - 0.1) < 1e-9  # r5: 105.1 - 105.0
    assert abs(full["groups"]["slowest"]["outside"]["to_client"] - (105 + 7.7 - 112)) < 1e-9
    first = tail_breakdown(records, timings, stream=True)
    rest = first["groups"]["rest"]["outside"]
    assert abs(rest["to_engine"] - (0.2 + 4 * 0.1) / 5) < 1e-9  # s and r1-r4 (equal first audio: r5 sorts last)
    assert abs(rest["to_client"] - (0.3 + 4 * 0.7) / 5) < 1e-9  # s: 101.2 - 100.9, its first segment's audio
    table = tail_lines(first, 64)
    assert table[2].endswith("after_last | to_engine | to_client |") and table[3].count("|---") == 14
    assert all(row.count("|") == 15 for row in table[2:-1])  # an older server's trace: no to_api
    timings["s"]["received_at"] = 100.15
    for i in range(1, 6):
        timings[f"r{i}"]["received_at"] = 100.05 + i
    first = tail_breakdown(records, timings, stream=True)
    assert abs(first["groups"]["rest"]["outside"]["to_api"] - (0.15 + 4 * 0.05) / 5) < 1e-9
    table = tail_lines(first, 64)
    assert table[2].endswith("after_last | to_api | to_engine | to_client |")
    assert all(row.count("|") == 16 for row in table[2:-1])
    records[0].pop("started_at")
    assert "to_engine" not in "".join(tail_lines(tail_breakdown(records, timings, stream=True), 64))


@given(st.integers(1, 8), st.integers(1, 20), st.data())
def test_the_opening_burst_is_the_first_c_sent_whatever_their_latency(c, extra, data):
    """The burst split groups by send order, not by the metric: the first C requests sent against the rest, each
    group's stages their own requests' means; none for a level of at most 2 C requests."""
    n = 2 * c + extra
    sent = data.draw(st.permutations(range(n)))
    latency = data.draw(st.lists(st.floats(0.01, 5.0), min_size=n, max_size=n))
    records = [{"ok": True, "first_audio_s": latency[i], "sent_at": float(sent[i]), "server_id": f"r{i}"}
               for i in range(n)]
    timings = {f"r{i}": {"frontend_s": float(sent[i] < c)} for i in range(n)}  # 1 for the burst's, 0 after
    split = burst_breakdown(records, timings, stream=True, concurrency=c)
    burst, after = split["groups"]["burst"], split["groups"]["after it"]
    assert (burst["requests"], after["requests"]) == (c, n - c)
    assert burst["stages"]["frontend"] == 1.0 and after["stages"]["frontend"] == 0.0
    first = [latency[i] for i in range(n) if sent[i] < c]
    assert abs(burst["metric_mean"] - sum(first) / c) < 1e-9
    assert burst_breakdown(records[: 2 * c], timings, stream=True, concurrency=c) is None
    assert tail_lines(split, c)[0].startswith(f"C{c}, the opening burst (the first {c} sent at once)")
