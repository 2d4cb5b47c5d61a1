"""The slowest requests' engine stages: the server's trace joined to the client's records."""

import json

from hypothesis import given
from hypothesis import strategies as st

from intone.bench.tail import tail_breakdown, traced_timings


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
