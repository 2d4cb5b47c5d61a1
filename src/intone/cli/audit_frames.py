"""`intone audit-frames FILE`: check a frame trace; exit 1 unless every request is exact."""

from __future__ import annotations

import argparse

from intone.engine.trace import audit_file


def add_parser(sub) -> None:
    p = sub.add_parser("audit-frames", help="check a --trace-frames file: every frame exactly once")
    p.add_argument("trace")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = audit_file(args.trace)
    bad = [a for a in report.values() if not a.exact]
    for a in report.values():
        status = "ok" if a.exact else "NOT EXACT"
        print(f"{a.request_id}: {a.frames} frames, missing {len(a.missing)}, repeated {len(a.repeated)}, "
              f"out of order {a.out_of_order}, terminals {a.terminals}: {status}")
    print(f"{len(report)} requests, {len(report) - len(bad)} exact, {len(bad)} not exact; "
          f"{sum(len(a.missing) for a in report.values())} missing and "
          f"{sum(len(a.repeated) for a in report.values())} repeated frames in all")
    return 1 if bad else 0
