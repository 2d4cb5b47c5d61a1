"""Where the slowest requests' time goes: each measured request's engine stages (its terminal chunk's
`timings`, from the server's frame trace) joined by the server's request id (X-Request-Id) to what its
client saw, the slowest tenth by first audio (streams) or completion against the rest, and a closed loop's
opening burst against the requests after it.

The stage means of the whole level say where time goes on average; a p90 far above the p50 comes from
the few requests this splits out. `python -m intone.bench.tail RESULTS_JSON TRACE...` for a run whose
server was started elsewhere (with `--trace-frames`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from intone.bench.metrics import client_metric, opening_split
from intone.protocol import ENGINE_STAGES


def traced_timings(paths) -> dict[str, dict[str, float]]:
    """Per API request id: the engine's stage seconds from its terminal chunks (a request split into
    segments runs as engine requests `<id>.<k>`: their stages are summed)."""
    out: dict[str, dict[str, float]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut off when the server stopped
                continue
            if not row.get("finished") or not row.get("timings"):
                continue
            rid = row["request_id"]
            ids = {rid}
            head, _, k = rid.rpartition(".")
            if head and k.isdigit():
                ids.add(head)
            for key in ids:
                acc = out.setdefault(key, {})
                for stage, seconds in row["timings"].items():
                    acc[stage] = acc.get(stage, 0.0) + seconds
                for mark in WALL_MARKS:  # a segmented request's first arrival / first audio, its last end
                    if row.get(mark) is not None:
                        pick = max if mark == "finished_at" else min
                        acc[mark] = pick(acc.get(mark, row[mark]), row[mark])
    return out


# Derived from a request's stages: its last frame -> its end (the codec's tail, for a non-streamed request
# the wait for its last piece's audio: the AR seat is free, the client still waits).
AFTER_LAST_FRAME = "after_last"
BEFORE_LAST_FRAME = ("frontend", "queue", "prefill", "decode")


def after_last_frame(stages: dict[str, float]) -> float:
    """A request's seconds from its last frame to its end, from its engine stages (`{stage}_s`)."""
    return stages.get("total_s", 0.0) - sum(stages.get(f"{s}_s", 0.0) for s in BEFORE_LAST_FRAME)


# Outside the engine, from the trace's Unix instants (`engine.trace.wall_clock`) and the client's (`started_at`,
# same host): to_engine, the client's clock start -> the engine core has the request (the HTTP upload, the API's
# parse and reference decode, the hop to the core), and to_api, its first part (-> the API has parsed it);
# to_client, the engine's audio sent -> the client has it (its first audio for a stream, its end for a whole
# response: the hop back, encoding, HTTP).
WALL_MARKS = ("arrived_at", "first_audio_at", "finished_at", "received_at")
OUTSIDE = ("to_api", "to_engine", "to_client")


def outside_engine(record: dict, stages: dict[str, float], stream: bool) -> dict[str, float] | None:
    started = record.get("started_at")
    sent = stages.get("first_audio_at" if stream else "finished_at")
    seen = record.get(client_metric(stream))
    if not started or stages.get("arrived_at") is None or sent is None or seen is None:
        return None
    received = stages.get("received_at")
    return dict(to_api=received - started if received else None, to_engine=stages["arrived_at"] - started,
                to_client=started + seen - sent)


def tail_breakdown(records: list[dict], timings: dict[str, dict[str, float]], stream: bool,
                   share: float = 0.1) -> dict | None:
    """The slowest `share` of the joined requests by the client's metric against the rest: per group the
    requests, the metric's mean and each engine stage's mean seconds (and `after_last`, and the time outside the
    engine). None below 5 joined requests."""
    metric = client_metric(stream)
    joined = sorted(_joined(records, timings, stream), key=lambda row: row[0])
    if len(joined) < 5:
        return None
    n = max(1, round(len(joined) * share))
    return dict(metric=metric, split="slowest", share=share, joined=len(joined),
                groups={"slowest": _group(joined[-n:]), "rest": _group(joined[:-n])})


def burst_breakdown(records: list[dict], timings: dict[str, dict[str, float]], stream: bool,
                    concurrency: int) -> dict | None:
    """A closed loop's opening burst (its first `concurrency` requests sent, `metrics.opening_split`) against the
    requests after it, stage by stage as `tail_breakdown`. None unless the level holds more than twice
    `concurrency` requests and both groups are found in the trace."""
    split = opening_split(records, concurrency, lambda r: r.get("sent_at", 0.0))
    if split is None:
        return None
    burst, after = (_joined(rows, timings, stream) for rows in split)
    if not burst or not after:
        return None
    return dict(metric=client_metric(stream), split="burst", joined=len(burst) + len(after),
                groups={"burst": _group(burst), "after it": _group(after)})


def _joined(records: list[dict], timings: dict[str, dict[str, float]], stream: bool) -> list[tuple]:
    """(the client's metric, the engine's stages, the time outside the engine) of each answered, traced request."""
    metric = client_metric(stream)
    return [(r[metric], timings[r["server_id"]], outside_engine(r, timings[r["server_id"]], stream)) for r in records
            if r.get("ok") and r.get(metric) is not None and r.get("server_id") in timings]


def _group(rows: list[tuple]) -> dict:
    return dict(requests=len(rows), metric_mean=_mean([m for m, _, _ in rows]),
                stages={**{s: _mean([t.get(f"{s}_s", 0.0) for _, t, _ in rows]) for s in ENGINE_STAGES},
                        AFTER_LAST_FRAME: _mean([after_last_frame(t) for _, t, _ in rows])},
                # None where a request lacks the instants (an older trace, server or client)
                outside={s: _mean([o[s] for _, _, o in rows]) if all(o and o[s] is not None for _, _, o in rows)
                         else None for s in OUTSIDE})


def tail_lines(tail: dict | None, concurrency) -> list[str]:
    if not tail:
        return []
    metric = tail["metric"].removesuffix("_s").replace("_", " ")
    stages = [*ENGINE_STAGES, AFTER_LAST_FRAME]
    split = (f"the opening burst (the first {concurrency} sent at once) against the requests after it"
             if tail.get("split") == "burst" else f"the slowest {tail['share']:.0%} by {metric} against the rest")
    lines = [f"C{concurrency}, {split} ({tail['joined']} "
             "requests found in the server's trace), engine seconds per request (after_last: last frame -> end):",
             "", f"| group | requests | {metric} s | " + " | ".join(stages) + " |", "|---" * (3 + len(stages)) + "|"]
    outside = [s for s in OUTSIDE if all(g.get("outside", {}).get(s) is not None for g in tail["groups"].values())]
    if outside:
        sent = "first audio" if tail["metric"] == "first_audio_s" else "end"
        lines[0] = lines[0].removesuffix(":") + ("; to_engine: the client's clock start -> the engine has it (to_api: "
                                                 f"-> the API has parsed it); to_client: the engine sent its {sent} "
                                                 "-> the client has it:")
        lines[2] = lines[2] + " " + " | ".join(outside) + " |"
        lines[3] = "|---" * (3 + len(stages) + len(outside)) + "|"
    for name, g in tail["groups"].items():
        lines.append(f"| {name} | {g['requests']} | {g['metric_mean']:.3f} | "
                     + " | ".join(f"{g['stages'][s]:.3f}" for s in stages) + " |"
                     + "".join(f" {g['outside'][s]:.3f} |" for s in outside))
    return lines + [""]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m intone.bench.tail RESULTS_JSON TRACE...")
    results = json.loads(Path(argv[0]).read_text())
    timings = traced_timings(argv[1:])
    stream = bool(results.get("run", {}).get("stream"))
    for level in results["levels"]:
        c = level["concurrency"]
        print("\n".join(tail_lines(tail_breakdown(level["records"], timings, stream), c)
                        + tail_lines(burst_breakdown(level["records"], timings, stream, c), c)))


if __name__ == "__main__":
    main(sys.argv[1:])
