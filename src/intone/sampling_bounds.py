"""The allowed ranges of the sampling parameters and of a request's speed, declared once: the API's
request schema, the deploy profiles' defaults and the engine's and the model's checks of every request
all read them (torch-free)."""

from __future__ import annotations

SAMPLING_BOUNDS: dict[str, dict] = {
    "temperature": dict(ge=0.0, le=2.0),
    "top_p": dict(gt=0.0, le=1.0),
    "top_k": dict(ge=1, le=4096),
    "repetition_penalty": dict(gt=0.0, le=10.0),
    "max_new_tokens": dict(ge=1, le=4096),
    "min_new_tokens": dict(ge=0, le=4096),
    "seed": dict(ge=0, lt=2**63),
}

# The most candidates a draw may sort short of every token (`ar.sample_candidates`): the running totals of
# that many ranks are summed in order on every device (`ops.sampling.running_total`), so any bound up to it
# draws what sorting every token draws.
MAX_SAMPLE_CANDIDATES = 64

SPEED_BOUNDS: dict = dict(ge=0.25, le=4.0)  # the OpenAI speech API's tempo range
_BOUNDS = {**SAMPLING_BOUNDS, "speed": SPEED_BOUNDS}

_OK = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b, "lt": lambda v, b: v < b}


def within(name: str, value) -> bool:
    return all(_OK[op](value, bound) for op, bound in _BOUNDS[name].items())


def describe(name: str) -> str:
    """e.g. 'must be in (0, 1]'."""
    b = _BOUNDS[name]
    low = f"[{_num(b['ge'])}" if "ge" in b else f"({_num(b['gt'])}"
    high = f"{_num(b['le'])}]" if "le" in b else f"{_num(b['lt'])})"
    return f"must be in {low}, {high}"


def _num(x) -> str:
    return "2^63" if x == 2**63 else f"{x:g}"
