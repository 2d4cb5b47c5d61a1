"""A side stage's work in progress (the codec worker's calls, the frontend's batches), so the AR loop can split its
steps' GPU time by what else ran on the GPU meanwhile: the served step is longer than the step alone, and the
split says which neighbour (or a prefill) the difference goes with."""

from __future__ import annotations

import threading


class Activity:
    """Entered for each piece of work (`with activity:`), from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.active = 0  # pieces running now
        self.began = 0  # pieces begun, ever

    def __enter__(self) -> "Activity":
        with self._lock:
            self.active += 1
            self.began += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.active -= 1

    def mark(self) -> tuple[bool, int]:
        """Where it stands now, for `ran_since`."""
        return self.active > 0, self.began

    def ran_since(self, mark: tuple[bool, int]) -> bool:
        """Whether any piece ran between `mark` and now: one was running then or is now, or one began since."""
        was_active, began = mark
        return was_active or self.active > 0 or self.began != began


def company(prefill: bool, beside: set[str]) -> str:
    """The step's `intone.protocol.STEP_COMPANY`: beside, the side stages whose work ran during it."""
    if prefill:
        return "prefill"
    if {"codec", "frontend"} <= beside:
        return "codec+frontend"
    return next((role for role in ("codec", "frontend") if role in beside), "alone")
