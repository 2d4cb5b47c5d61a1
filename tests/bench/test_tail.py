"""The slowest requests' engine stages: the server's trace joined to the client's records."""

import json

from hypothesis import given
from hypothesis import strategies as st

from intone.bench.tail import tail_breakdown, tail_lines, traced_timings


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
