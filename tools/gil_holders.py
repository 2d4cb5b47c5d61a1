"""Diagnostic: who held the GIL, from `py-spy record --gil --threads --format raw` of a running engine core
(`PYSPY=1` in `tools/device_run.sh pair`). Per thread: its share of the samples (each sample is the thread that
held the GIL at that instant; instants when none held it are not recorded), then where in the project's code it
was (the deepest frame of `intone`), and the innermost frame of all.

    python3 tools/gil_holders.py pyspy-gil.txt [--rate 100 --seconds 10] [--top 8]
"""

import argparse
import collections
import re

LINE = re.compile(r"^thread \((?P<tid>[0-9a-fx]+)\)(?::\s*(?P<name>[^;]*))?;?(?P<stack>.*?)\s+(?P<count>\d+)$")


def parse(path: str):
    """(thread name, frames root first, samples) per line."""
    for raw in open(path):
        m = LINE.match(raw.rstrip("\n"))
        if m:
            name = (m["name"] or m["tid"]).strip()
            yield name, [f for f in m["stack"].split(";") if f], int(m["count"])


def own_frame(frames: list[str]) -> str:
    for f in reversed(frames):
        if "intone/" in f or "intone." in f:
            return f
    return frames[-1] if frames else "(no frame)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--rate", type=float, default=100, help="py-spy's samples a second")
    ap.add_argument("--seconds", type=float, default=10, help="how long it sampled")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    by_thread, own, leaf = collections.Counter(), collections.defaultdict(collections.Counter), \
        collections.defaultdict(collections.Counter)
    for name, frames, count in parse(args.path):
        thread = re.sub(r"-\d+$", "-N", name)  # a pool's workers together
        by_thread[thread] += count
        own[thread][own_frame(frames)] += count
        leaf[thread][frames[-1] if frames else "(no frame)"] += count
    total = sum(by_thread.values())
    possible = args.rate * args.seconds
    print(f"GIL held in {total} of ~{possible:.0f} samples ({100 * total / possible:.0f}% of the time)")
    for thread, n in by_thread.most_common():
        print(f"== {thread}: {n} samples, {100 * n / possible:.1f}% of the time")
        for frame, c in own[thread].most_common(args.top):
            print(f"   {100 * c / possible:5.1f}%  {frame}")
        print("   innermost:", "; ".join(f"{f} {100 * c / possible:.1f}%" for f, c in leaf[thread].most_common(3)))


if __name__ == "__main__":
    main()
