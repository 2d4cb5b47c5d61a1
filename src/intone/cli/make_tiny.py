"""`intone make-tiny FAMILY DIR`: write a small random checkpoint in the real layout."""

from __future__ import annotations

import argparse

from intone.models import TINY_MAKERS, make_tiny


def add_parser(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny random checkpoint in a model's real on-disk layout")
    p.add_argument("family", choices=sorted(TINY_MAKERS))
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    out = make_tiny(args.family, args.out_dir, seed=args.seed)
    print(f"wrote tiny {args.family} checkpoint to {out}")
    return 0
