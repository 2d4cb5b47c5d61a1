"""The samplers' filters against independent numpy references (docs/design.md, "Sampling").

Which tokens a sampler can draw is found deterministically: `request_uniforms` is replaced so that in
row r only the token whose id is the row's seed gets U ~= 1 (E = -log U ~= 2e-16), all others U ~= 0:
row r draws that token iff the filter left it a probability > 0 (logits bounded: kept gaps / T <= 40).
References, per row: Fish/engine (official logits_to_probs): penalty, top-k and top-p on the
*unscaled* logits (rank < k, cumulative probability including the token <= p, best kept), then / T.
CosyVoice3 `ras`: softmax(logits / T), stable descending sort, keep while the mass before the token
< p and fewer than k are kept. `standard` (vLLM order): penalty, stops masked, / T, top-k, then
top-p on the top-k softmax. Within EPS of a top-p boundary fp32 rounding may go either way ("maybe").
"""

from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import intone.ops.sampling as engine_sampling
import intone.models.cosyvoice3.sampling as cosy_sampling
from intone.engine.model_runner import sampling_batch
from intone.models.fish_s2.model import FishS2
from intone.protocol import SamplingParams

EPS = 1e-5
STOP, VOCAB = cosy_sampling.SPEECH_TOKENS, 6761
TEMPS = [0.3, 0.7, 1.0, 1.3]


@contextmanager
def forced(module, draws=None):
    """The module's request_uniforms as described above (other draws: plain argmax); the engine's race
    must also get finite, non-negative weights, some positive in every row (an all -inf row would give
    NaN): probabilities (CosyVoice3) or softmax's numerators, the best 1 (Fish)."""
    def uniforms(seeds, steps, draw, token_ids):
        if draws is not None and draw not in draws:
            return torch.full(token_ids.shape, 0.5, dtype=torch.float64)
        sure, never = (torch.tensor(u, dtype=torch.float64) for u in (1.0 - 2.0**-52, 1e-300))
        return torch.where(token_ids == seeds.to(token_ids.dtype).unsqueeze(1), sure, never)

    def checked_race(probs, idx, params, draw, race=engine_sampling.race):
        assert torch.isfinite(probs).all() and (probs >= 0).all() and (probs.amax(-1) > 0).all()
        return race(probs, idx, params, draw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "request_uniforms", uniforms)
        mp.setattr(engine_sampling, "race", checked_race)
        yield


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def penalised(x, window, penalty):
    x = np.asarray(x, dtype=np.float32).copy()
    if penalty != 1.0:
        for t in {int(t) for t in window if t >= 0}:
            x[t] = x[t] / np.float32(penalty) if x[t] > 0 else x[t] * np.float32(penalty)
    return x.astype(np.float64)


def split(order, keep, p):
    """keep(eps) -> per-rank mask; the (sure, maybe) sets of kept tokens with probability > 0."""
    sure, maybe = keep(-EPS), keep(EPS)
    sure[0] = maybe[0] = True  # the best token is always kept
    return set(order[sure & (p > 0)].tolist()), set(order[maybe & (p > 0)].tolist())


def fish_reference(x, temperature, top_p, top_k):
    order = np.argsort(-x, kind="stable")
    cum, in_k = np.cumsum(softmax(x)[order]), np.arange(len(x)) < top_k  # unscaled
    return split(order, lambda e: in_k & (cum <= top_p + e), softmax(x[order] / max(temperature, 1e-5)))


def ras_reference(x, temperature, top_p, top_k, below_min=False, ban_stop=False):
    with np.errstate(divide="ignore"):
        s = np.log(softmax(x / max(temperature, 1e-5)))
    s[STOP:STOP + 1 if below_min else STOP] = -np.inf  # the official min-length rule masks sos (6561) only
    s[STOP if ban_stop else VOCAB:] = -np.inf
    p = softmax(s)
    order = np.argsort(-p, kind="stable")
    before, in_k = np.cumsum(p[order]) - p[order], np.arange(len(x)) < top_k
    return split(order, lambda e: in_k & (before < top_p + e), p[order])


def standard_reference(x, temperature, top_p, top_k, penalty=1.0, generated=(), below_min=False, ban_stop=False):
    x = penalised(x, generated, penalty)
    x[STOP if below_min or ban_stop else VOCAB:] = -np.inf
    z = x / max(temperature, 1e-5)
    order = np.argsort(-z, kind="stable")[:top_k]
    p = softmax(z[order])
    before = np.cumsum(p) - p
    return split(order, lambda e: before < top_p + e, p)


def params_for(candidates, steps=0, **kw):
    return sampling_batch([SamplingParams(seed=int(t), **kw) for t in candidates], [steps] * len(candidates), "cpu")


def drawable_engine(x, temperature, top_p, top_k, full=False):
    """ops.sampling.sample: every token is a candidate row."""
    v = len(x)
    logits = torch.tensor(np.asarray(x, np.float32)).repeat(v, 1)
    params = params_for(range(v), temperature=temperature, top_p=top_p, top_k=top_k)
    with forced(engine_sampling):
        out = engine_sampling.sample(logits, params, 0, v if full else None)
    return {t for t in range(v) if int(out[t]) == t}


def drawable_cosy(x, candidates, mode, history=(), **kw):
    """sample_speech_tokens over the given candidate ids; `history` is the generated ids."""
    candidates = sorted(candidates)
    logits = torch.tensor(np.asarray(x, np.float32)).repeat(len(candidates), 1)
    params = params_for(candidates, steps=len(history), mode=mode, **kw)
    hist = torch.tensor([list(history) + [-1]]).repeat(len(candidates), 1)
    with forced(engine_sampling):  # its races are the engine's (ops.sampling.race)
        out = cosy_sampling.sample_speech_tokens(logits, params, hist)
    return {t for t, o in zip(candidates, out.tolist()) if o == t}


def check(got, ref):
    sure, maybe = ref
    assert sure <= got, f"over-filtered: {sorted(sure - got)} were dropped"
    assert got <= maybe, f"under-filtered: {sorted(got - maybe)} were kept"


# ---- ops.sampling.sample (Fish's filter) ---------------------------------------------------

ROW = np.array([2.0, 1.1, 0.9, 0.3, 0.0, -0.4, -1.0, -1.5, -2.2, -3.0, -3.7, -4.5])


@pytest.mark.parametrize("temperature", [0.0] + TEMPS)
@pytest.mark.parametrize("top_k", [1, 2, 3, 12, 50])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.8, 0.9, 1.0])
def test_engine_filter_grid_equals_the_reference(temperature, top_k, top_p):
    check(drawable_engine(ROW, temperature, top_p, top_k), fish_reference(ROW, temperature, top_p, top_k))


@settings(max_examples=80, deadline=None)
@given(v=st.integers(2, 40), seed=st.integers(0, 2**32 - 1), spread=st.floats(0.05, 6.0),
       temperature=st.sampled_from(TEMPS), top_p=st.sampled_from([0.02, 0.5, 0.8, 0.95, 1.0]) | st.floats(0.01, 1.0),
       top_k=st.integers(1, 45), full=st.booleans())
def test_engine_filter_on_random_logits_equals_the_reference(v, seed, spread, temperature, top_p, top_k, full):
    x = np.random.default_rng(seed).uniform(-spread, spread, v).astype(np.float32).astype(np.float64)
    assume(len(np.unique(x)) == v)
    check(drawable_engine(x, temperature, top_p, top_k, full), fish_reference(x, temperature, top_p, top_k))


@pytest.mark.parametrize("temperature", TEMPS)
def test_top_k_keeps_exactly_k_also_at_ties(temperature):
    x = np.linspace(1.0, 0.0, 10)  # nearly flat: top-p 1.0 never decides here
    assert [drawable_engine(x, temperature, 1.0, k) for k in range(1, 10)] == [set(range(k)) for k in range(1, 10)]
    x = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])  # a three-way tie at ranks 1..3
    for k in range(1, 6):
        got = drawable_engine(x, temperature, 1.0, k)
        assert len(got) == k and {0} | set(range(4, k)) <= got <= set(range(max(k, 4))), (k, got)


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("top_p, kept", [(0.01, {0}), (0.49, {0}), (0.79, {0}), (0.81, {0, 1}), (0.94, {0, 1}),
                                         (0.96, {0, 1, 2})])  # (at 1.0 the last one is fp32 rounding's call)
def test_top_p_drops_the_token_crossing_it_on_unscaled_probabilities(temperature, top_p, kept):
    x = np.log([0.5, 0.3, 0.15, 0.05])  # unscaled cumulative: 0.5, 0.8, 0.95, 1.0
    assert drawable_engine(x, temperature, top_p, 4) == kept


# ---- Fish's use of it: penalty window, stop ban, the RAS fallback draw ----------------------------

def fish_stand_in(c):
    """Enough of a FishS2 for _sample_semantic: codebook C = c; column C is im_end, id 7."""
    fish = SimpleNamespace(cfg=SimpleNamespace(codebook_size=c),
                           tokenizer=SimpleNamespace(semantic_begin=1000, semantic_end=999 + c, im_end_id=7))
    fish._to_token_ids = lambda index: FishS2._to_token_ids(fish, index)
    return fish


def drawable_fish(x, history, draw, **kw):
    """FishS2._sample_semantic on a stand-in model (codebook C = len(x) - 1; column C is im_end, id 7):
    the columns that draw 0 (normal) or 1 (RAS fallback) can pick."""
    c, cols = len(x) - 1, range(len(x))
    fish = fish_stand_in(c)
    logits = torch.tensor(np.asarray(x, np.float32)).repeat(len(x), 1)
    with forced(engine_sampling, {draw}):
        out = FishS2._sample_semantic(fish, logits, params_for(cols, steps=30, **kw), torch.tensor([history] * len(x)))
    to_col = {7: c, **{1000 + i: i for i in range(c)}}
    return {i for i, o in zip(cols, out.tolist()) if to_col[o] == i}


@settings(max_examples=40, deadline=None)
@given(c=st.integers(3, 30), seed=st.integers(0, 2**32 - 1), temperature=st.sampled_from(TEMPS),
       top_p=st.sampled_from([0.3, 0.8, 0.95, 1.0]), top_k=st.integers(1, 32),
       penalty=st.sampled_from([1.0, 0.8, 1.3, 2.0]), ban=st.booleans())
def test_fish_semantic_and_ras_fallback_filters_equal_the_reference(c, seed, temperature, top_p, top_k, penalty, ban):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3.0, 3.0, c + 1).astype(np.float32).astype(np.float64)
    window = [int(t) for t in rng.choice(c, min(c, 6), replace=False)]
    pen = [-1] * (14 - len(window)) + [1000 + t for t in window] + [7, 3]  # 7 (im_end), 3: not semantic
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=penalty, ignore_eos=ban)
    xp = penalised(x, window, penalty)
    if ban:
        xp[c] = -np.inf
    assume(len(np.unique(xp)) == c + 1)
    best = int(np.argmax(xp))
    assume(best != c)
    # Normal draw: an empty RAS window, so the normal draw is the answer.
    check(drawable_fish(x, [-1] * 10 + pen, 0, **kw), fish_reference(xp, temperature, top_p, top_k))
    # Fallback: draw 0 takes the best token, which the RAS window holds; draw 1 runs at T=1.0, top-p 0.9.
    ras = [-1] * 9 + [1000 + best]
    check(drawable_fish(x, ras + pen, 1, **kw), fish_reference(xp, 1.0, 0.9, top_k))


@pytest.mark.parametrize("stop, ban, top_k, kept", [
    (-3.0, False, 1, {1}), (-3.0, False, 2, {0, 1}), (-3.0, False, 3, {0, 1, 3}),  # penalised: 1.0, 1.8, -1.0, -0.6
    (3.0, False, 1, {4}), (3.0, False, 3, {0, 1, 4}), (3.0, True, 1, {1}), (3.0, True, 4, {0, 1, 2, 3})])
def test_fish_penalty_window_and_stop_ban(stop, ban, top_k, kept):
    x = np.array([2.0, 1.8, -0.5, -0.6, stop])  # columns 0..3 semantic, 4 = im_end
    history = [-1] * 10 + [-1] * 13 + [1000, 1002, 7]  # empty RAS window; penalty on 0 and 2 (im_end never)
    assert drawable_fish(x, history, 0, temperature=1.0, top_p=1.0, top_k=top_k, repetition_penalty=2.0,
                         ignore_eos=ban) == kept


@pytest.mark.parametrize("top_p", [0.5, 1.0])
def test_fish_ras_fallback_filters_at_top_p_0_9_whatever_the_request_says(top_p):
    x = np.array([2.0, 1.0, 0.5, -3.0, -3.0])  # cumulative: .623, .852, .991, .996, 1
    history = [-1] * 9 + [1000] + [-1] * 16  # the normal draw (column 0, the best) is in the RAS window
    assert drawable_fish(x, history, 1, temperature=0.7, top_p=top_p, top_k=5) == {0, 1}


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.3])
def test_fish_ras_fallback_draws_at_temperature_1_whatever_the_request_says(temperature):
    """Fish filters the unscaled logits, so the allowed sets above do not show T; the probabilities the
    race gets do: p0 / p1 = exp((x0 - x1) / T), with the request's T for the normal draw, 1.0 for RAS."""
    x = np.array([2.0, 1.0, 0.5, -3.0, -3.0])
    history = [-1] * 9 + [1000] + [-1] * 16
    seen, race = {}, engine_sampling.race

    def spy(probs, idx, params, draw):
        seen[draw] = dict(zip(idx[0].tolist(), probs[0].double().tolist()))
        return race(probs, idx, params, draw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_sampling, "race", spy)
        FishS2._sample_semantic(fish_stand_in(len(x) - 1), torch.tensor(x, dtype=torch.float32).unsqueeze(0),
                                params_for([0], steps=30, temperature=temperature, top_p=0.95, top_k=5),
                                torch.tensor([history]))
    normal, ras = seen[0], seen[1]  # DRAW_SEMANTIC, DRAW_RAS
    assert normal[0] / normal[1] == pytest.approx(np.exp(1.0 / temperature), rel=1e-4)
    assert ras[0] / ras[1] == pytest.approx(np.exp(1.0), rel=1e-4)
    assert ras[2] == 0.0  # and its top-p is 0.9 (cumulative .623, .852, .991), not the request's 0.95


# ---- CosyVoice3: ras and standard ----------------------------------------------------------------

def cosy_logits(seed, head, spread, stops_in_head):
    """6761 distinct logits: a few head tokens (stop ids among them if asked) above a long tail."""
    rng = np.random.default_rng(seed)
    x = -4.0 * rng.permutation(VOCAB) / VOCAB  # distinct in fp32
    ids = rng.choice(STOP, head, replace=False)
    if stops_in_head:
        ids[:2] = [STOP, STOP + 39]
    x[ids] = rng.uniform(0.0, spread, head)
    return x.astype(np.float32).astype(np.float64), ids


def candidates(x, ref, rng):
    """The reference's tokens, the next best ones, stop ids and a few others: where a filter bug shows."""
    nxt = np.argsort(-x, kind="stable")[: len(ref[1]) + 6]
    return ref[1] | set(nxt.tolist()) | {STOP, STOP + 1, VOCAB - 1} | set(rng.choice(VOCAB, 3).tolist())


@settings(max_examples=45, deadline=None)
@given(mode=st.sampled_from(["ras", "standard"]), seed=st.integers(0, 2**32 - 1), head=st.integers(2, 30),
       spread=st.floats(1.0, 8.0), temperature=st.sampled_from(TEMPS),
       top_p=st.sampled_from([0.05, 0.5, 0.8, 0.95, 1.0]), top_k=st.sampled_from([1, 2, 3, 10, 25, 50]),
       penalty=st.sampled_from([1.0, 1.5, 0.7]), stops=st.booleans(), below_min=st.booleans(), ban=st.booleans())
def test_cosy_ras_and_standard_equal_their_references(mode, seed, head, spread, temperature, top_p, top_k, penalty,
                                                      stops, below_min, ban):
    x, ids = cosy_logits(seed, head, spread, stops)
    generated = [int(t) for t in ids[1:4]] + [5]  # the penalty applies in `standard` only (ras has none)
    history = generated if mode == "standard" else []  # ras: the nucleus alone (no repeat to redraw)
    assume(len(np.unique(penalised(x, generated, penalty))) == VOCAB)
    ref = (ras_reference(x, temperature, top_p, top_k, below_min, ban) if mode == "ras" else
           standard_reference(x, temperature, top_p, top_k, penalty, generated, below_min, ban))
    got = drawable_cosy(x, candidates(x, ref, np.random.default_rng(seed)), mode, history=history,
                        temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=penalty,
                        min_new_tokens=len(history) + 1 if below_min else 0, ignore_eos=ban)
    check(got, ref)


def logits_row(logits):
    x = -80.0 - np.arange(VOCAB) / VOCAB  # the rest: < 1e-35 each, never kept below (distinct: fast sorts)
    x[list(logits)] = list(logits.values())
    return x


def probs_row(probs):
    return logits_row({t: np.log(p) for t, p in probs.items()})


@pytest.mark.parametrize("mode", ["ras", "standard"])
@pytest.mark.parametrize("temperature, top_p, kept", [
    (1.0, 0.01, {10}), (1.0, 0.49, {10}), (1.0, 0.51, {10, 20}), (1.0, 0.79, {10, 20}),  # mass before: 0, .5, .8, .95
    (1.0, 0.81, {10, 20, 30}), (1.0, 0.96, {10, 20, 30, 40}),
    (0.3, 0.8, {10}), (0.3, 0.9, {10, 20}), (0.3, 0.99, {10, 20, 30}),  # at T=0.3: 0, .832, .984, .9996
    (1.3, 0.8, {10, 20, 30}), (1.3, 0.9, {10, 20, 30}), (1.3, 0.93, {10, 20, 30, 40})])  # T=1.3: 0, .446, .747, .924
def test_cosy_keeps_the_token_crossing_top_p_after_temperature(mode, temperature, top_p, kept):
    x = probs_row({10: 0.5, 20: 0.3, 30: 0.15, 40: 0.05})
    assert drawable_cosy(x, {10, 20, 30, 40, 50}, mode, temperature=temperature, top_p=top_p, top_k=25) == kept


STOPS = {STOP: np.log(0.4), STOP + 39: np.log(0.3), 42: np.log(0.3)}
PEN = {5: 3.0, 6: 2.9, 7: -0.1, 8: -0.15}  # 5 and 7 generated, penalty 2: 1.5 and -0.2
THREE = {10: np.log(0.5), 20: np.log(0.3), 30: np.log(0.2)}


@pytest.mark.parametrize("mode, logits, kw, kept", [
    ("ras", STOPS, {}, {STOP, STOP + 39, 42}), ("standard", STOPS, {}, {STOP, STOP + 39, 42}),
    ("ras", STOPS, dict(min_new_tokens=1), {STOP + 39, 42}),  # officially min length masks sos (6561) only
    ("ras", STOPS, dict(ignore_eos=True), {42}), ("standard", STOPS, dict(min_new_tokens=1), {42}),
    ("standard", THREE, dict(top_k=2, top_p=0.6), {10}),  # top-p on the top-2 softmax: mass before 20 is .625
    ("ras", THREE, dict(top_k=2, top_p=0.6), {10, 20}),  # ras: on the full softmax, .5
    *[("standard", PEN, dict(top_k=k, repetition_penalty=2.0, history=[5, 7]), kept)
      for k, kept in [(1, {6}), (2, {5, 6}), (3, {5, 6, 8}), (4, {5, 6, 7, 8})]]])
def test_cosy_stop_ids_top_k_mass_and_penalty(mode, logits, kw, kept):
    kw = {"temperature": 1.0, "top_p": 1.0, "top_k": 25, **kw}
    assert drawable_cosy(logits_row(logits), set(logits) | {50}, mode, **kw) == kept


@pytest.mark.parametrize("mode", ["ras", "standard"])
@pytest.mark.parametrize("temperature", TEMPS)
def test_cosy_top_k_keeps_exactly_k_and_ties_go_to_the_lower_id(mode, temperature):
    x = probs_row({5: 0.4, 9: 0.15, 3: 0.15, 7: 0.15, 1: 0.15})
    cands = {1, 3, 5, 7, 9, 11}
    for k in range(1, 6):
        got = drawable_cosy(x, cands, mode, temperature=temperature, top_p=1.0, top_k=k)
        assert len(got) == k and 5 in got and got <= {1, 3, 5, 7, 9}, (k, got)
        if mode == "ras":  # the official sort is stable: ties in id order
            assert got == {5, *[1, 3, 7, 9][: k - 1]}
