"""The `intone` command."""

from __future__ import annotations

import argparse
import sys

from intone.cli import audit_frames, bench, make_tiny, serve, speak
from intone.cli import eval as eval_cmd
from intone.errors import IntoneError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="intone", description="Serve LLM-based text-to-speech models.")
    sub = parser.add_subparsers(dest="command", required=True)

    for module in (speak, serve, bench, eval_cmd, make_tiny, audit_frames):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except IntoneError as e:
        print(f"intone {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
