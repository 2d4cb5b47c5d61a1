"""CosyVoice3 HiFT vocoder: checkpoint layout, weight-norm folding, lengths, streaming, batching,
float64 F0 and the replayed official noise. Tiny configs; the official code is not imported here
(a separate fidelity check compared against it)."""

from __future__ import annotations

import itertools
import math
import operator

import pytest
import torch
import torch.nn.functional as F

from intone.models.cosyvoice3.hift import CausalHiFT, HiFTConfig, fold_hift_weight_norm
from intone.models.cosyvoice3.hift_source import SourceWindow
from intone.models.cosyvoice3.noise import (
    FLOW_NOISE_KEY,
    HIFT_RAND_INI_KEY,
    HIFT_SINE_NOISE_KEY,
    HIFT_UV_KEY,
    FlowSizes,
    official_noise,
)

TINY = HiFTConfig(base_channels=16, f0_cond_channels=16, noise_samples=160 * 480)
HOP = 480


def official_tree(cfg: HiFTConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Key -> (shape, weight-normed) of the official CausalHiFTGenerator (+ CausalConvRNNF0Predictor),
    written from its module tree. Weight-normed convs appear here as `<conv>.weight`."""
    tree: dict[str, tuple[tuple[int, ...], bool]] = {}

    def conv(name, c_out, c_in, k, wn=True):
        tree[f"{name}.weight"] = ((c_out, c_in, k), wn)
        tree[f"{name}.bias"] = ((c_out,), False)

    def resblock(name, ch, k, dils):
        for j, _ in enumerate(dils):
            conv(f"{name}.convs1.{j}", ch, ch, k)
            conv(f"{name}.convs2.{j}", ch, ch, k)
            tree[f"{name}.activations1.{j}.alpha"] = ((ch,), False)
            tree[f"{name}.activations2.{j}.alpha"] = ((ch,), False)

    base, spec = cfg.base_channels, cfg.n_fft + 2
    tree["m_source.l_linear.weight"] = ((1, cfg.nb_harmonics + 1), False)
    tree["m_source.l_linear.bias"] = ((1,), False)
    conv("conv_pre", base, cfg.in_channels, cfg.conv_pre_look_right + 1)
    for i, k in enumerate(cfg.upsample_kernel_sizes):
        conv(f"ups.{i}", base // 2 ** (i + 1), base // 2**i, k)
    # downsample_rates = [1] + rates[::-1][:-1]; cumulative product, reversed
    cum = list(reversed(list(itertools.accumulate([1, *cfg.upsample_rates[::-1][:-1]], operator.mul))))
    for i, u in enumerate(cum):
        conv(f"source_downs.{i}", base // 2 ** (i + 1), spec, 1 if u == 1 else 2 * u, wn=False)
    for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)):
        resblock(f"source_resblocks.{i}", base // 2 ** (i + 1), k, d)
    n = 0
    for i in range(len(cfg.upsample_rates)):
        for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
            resblock(f"resblocks.{n}", base // 2 ** (i + 1), k, d)
            n += 1
    conv("conv_post", spec, base // 2 ** len(cfg.upsample_rates), 7)
    cond = cfg.f0_cond_channels
    conv("f0_predictor.condnet.0", cond, cfg.in_channels, 4)
    for i in (2, 4, 6, 8):
        conv(f"f0_predictor.condnet.{i}", cond, cond, 3)
    tree["f0_predictor.classifier.weight"] = ((1, cond), False)
    tree["f0_predictor.classifier.bias"] = ((1,), False)
    return tree


def random_official_state(cfg: HiFTConfig, seed: int = 0, legacy: bool = False, prefix: str = "") -> dict:
    """A random official-form state dict: weight-normed convs as (g, v); F0 spread around the
    10 Hz voicing threshold so voiced and unvoiced frames both occur."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, (shape, wn) in official_tree(cfg).items():
        if wn:
            base = key[: -len(".weight")]
            mag_lo, mag_span = (1.0, 2.0) if base.startswith("f0_predictor.") else (0.1, 0.3)
            mag = mag_lo + mag_span * torch.rand(shape[0], 1, 1, generator=g)
            direction = torch.randn(shape, generator=g)
            if legacy:
                g_key, v_key = ".weight_g", ".weight_v"
            else:
                g_key, v_key = ".parametrizations.weight.original0", ".parametrizations.weight.original1"
            state[prefix + base + g_key] = mag
            state[prefix + base + v_key] = direction
        elif key.endswith("alpha"):
            state[prefix + key] = 0.5 + torch.rand(shape, generator=g)
        elif key == "f0_predictor.classifier.weight":
            state[prefix + key] = torch.randn(shape, generator=g) * 4.0 / shape[1] ** 0.5
        elif key == "f0_predictor.classifier.bias":
            state[prefix + key] = torch.full(shape, 87.0)  # about minus the mean of w.x for these weights
        elif len(shape) > 1:
            state[prefix + key] = torch.randn(shape, generator=g) / math.prod(shape[1:]) ** 0.5
        else:
            state[prefix + key] = torch.randn(shape, generator=g) * 0.1
    return state


@pytest.fixture(scope="module")
def tiny_noise():
    # The first TINY.noise_samples of the official buffers; no 260 MB draw.
    return official_noise(FlowSizes(), TINY, include_uv=False)


@pytest.fixture(scope="module")
def official_state():
    return random_official_state(TINY, seed=3)


def make(noise, state, dtype=torch.float64) -> CausalHiFT:
    model = CausalHiFT(TINY, noise=noise).eval()
    model.load_state_dict(fold_hift_weight_norm({k: v.to(dtype) for k, v in state.items()}), strict=True)
    return model.to(dtype)


@pytest.fixture(scope="module")
def hift64(tiny_noise, official_state):
    return make(tiny_noise, official_state, torch.float64)


@pytest.fixture(scope="module")
def hift32(tiny_noise, official_state):
    return make(tiny_noise, official_state, torch.float32)


def mel(frames: int, seed: int = 0, batch: int = 1, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 80, frames, generator=g) * 2 - 4).to(dtype)


# ---------------------------------------------------------------- layout and loading


def test_state_dict_keys_are_the_official_tree(tiny_noise):
    model = CausalHiFT(TINY, noise=tiny_noise)
    expected = official_tree(TINY)
    got = model.state_dict()
    assert set(got) == set(expected)
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: s for k, (s, _) in expected.items()}
    assert len(got) == 246  # 3 stages x 3 kernels: 77 + 5 weight-normed convs (+ biases, alphas, linears)
    assert sum(wn for _, wn in expected.values()) == 82


def test_noise_buffers_are_not_checkpoint_keys(tiny_noise):
    model = CausalHiFT(TINY, noise=tiny_noise)
    assert not any(("rand_ini" in k or "sine_waves" in k or k.endswith("uv")) for k in model.state_dict())
    buffers = dict(model.named_buffers())
    assert buffers["m_source.l_sin_gen.sine_waves"].shape == (1, TINY.noise_samples, 9)
    assert buffers["m_source.l_sin_gen.rand_ini"].shape == (1, 9)
    assert torch.equal(buffers["m_source.l_sin_gen.sine_waves"], tiny_noise[HIFT_SINE_NOISE_KEY])


def test_fold_forms_and_prefix_agree_and_match_torch_weight_norm(official_state):
    legacy = random_official_state(TINY, seed=3, legacy=True, prefix="generator.")
    a = fold_hift_weight_norm(official_state)
    b = fold_hift_weight_norm({"generator." + k: v for k, v in official_state.items()})
    c = fold_hift_weight_norm(legacy)
    assert set(a) == set(b) == set(c) == set(official_tree(TINY))
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k
    # Bit-exact against torch's own weight-norm parametrization (what the official module computes).
    for name, c_in, k in (("conv_pre", 80, 5), ("resblocks.4.convs1.1", 4, 7), ("f0_predictor.condnet.2", 16, 3)):
        c_out = a[name + ".bias"].shape[0]
        conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(c_in, c_out, k))
        if name.startswith("f0_predictor."):
            conv = conv.double()  # the official F0 predictor is cast to float64 before use
        with torch.no_grad():
            conv.parametrizations.weight.original0.copy_(official_state[name + ".parametrizations.weight.original0"])
            conv.parametrizations.weight.original1.copy_(official_state[name + ".parametrizations.weight.original1"])
        assert a[name + ".weight"].dtype == conv.weight.dtype
        assert torch.equal(a[name + ".weight"], conv.weight), name
    # Plain keys pass through untouched.
    assert a["source_downs.0.weight"] is official_state["source_downs.0.weight"]


def test_fold_rejects_unpaired_weight_norm():
    with pytest.raises(KeyError):
        fold_hift_weight_norm({"conv_pre.weight_g": torch.ones(2, 1, 1)})
    with pytest.raises(KeyError):
        fold_hift_weight_norm({"conv_pre.parametrizations.weight.original1": torch.ones(2, 3, 1)})


# ---------------------------------------------------------------- lengths and streaming


@pytest.mark.parametrize("frames", [1, 8, 9, 23])
def test_output_lengths(hift64, frames):
    x = mel(frames)
    assert hift64.inference(x, True).shape == (1, frames * HOP)
    assert hift64.inference(x, False).shape == (1, max(frames - 8, 0) * HOP)
    assert TINY.held_back_frames == 8 and TINY.hop == HOP
    assert TINY.output_samples(frames, False) == max(frames - 8, 0) * HOP


def test_streaming_emits_each_sample_once_and_matches_one_call(hift64):
    """The official rule: vocode the whole mel history with finalize=False, emit only past what was
    already emitted; the last call uses finalize=True. Every call's audio is a prefix of every later
    call's, so the stream neither repeats nor drops a sample and equals one final call on the whole
    mel. Float64: equal to 1e-12, not bit for bit (calls of different lengths round differently in
    the convolutions; observed <= 2.5e-16)."""
    full = mel(70, seed=1)
    reference = hift64.inference(full, True)
    pieces, emitted = [], 0
    for end in (20, 21, 35, 50, 62):
        audio = hift64.inference(full[:, :, :end], False)
        assert audio.shape[1] == (end - 8) * HOP
        if pieces:
            torch.testing.assert_close(audio[:, :emitted], torch.cat(pieces, 1), rtol=0, atol=1e-12)
        pieces.append(audio[:, emitted:])
        emitted = audio.shape[1]
    pieces.append(hift64.inference(full, True)[:, emitted:])
    stream = torch.cat(pieces, 1)
    assert [p.shape[1] for p in pieces] == [12 * HOP, 1 * HOP, 14 * HOP, 15 * HOP, 12 * HOP, 16 * HOP]
    assert stream.shape == reference.shape == (1, 70 * HOP)
    torch.testing.assert_close(stream, reference, rtol=0, atol=1e-12)


def _phase_before(hift, mel_rows, frame: int) -> torch.Tensor:
    """The excitation's phase sum over the frames before `frame`, from one call on the whole mel."""
    window = SourceWindow([0], [0], torch.zeros(1, TINY.nb_harmonics + 1, dtype=torch.float64), [frame])
    hift.vocode_batch([mel_rows], [True], window)
    return window.recorded[0]


def test_a_window_with_the_carried_phase_gives_the_whole_calls_samples(hift64):
    """CosyVoice3's streamed HiFT runs over a window: `stream_context_frames` before the first
    sample wanted, with the phase carried from the stream's earlier frames. Rows of one batch may be
    windows of different streams or whole streams; a window that starts too late is visibly wrong."""
    full = mel(120, seed=5)[0]
    whole = hift64.inference(full[None], True)[0]
    context, history = TINY.stream_context_frames, TINY.f0_history_frames
    got = {}
    for wanted in (context, 64, 80):
        first = wanted - context
        at = first + history if first else 0
        carried = _phase_before(hift64, full, at)
        window = SourceWindow([first, 0], [at, 0], torch.stack([carried, torch.zeros_like(carried)]), [at + 10, 30])
        rows = hift64.vocode_batch([full[:, first:], full[:, :100]], [True, False], window)
        got[wanted] = rows[0][(wanted - first) * HOP :]
        torch.testing.assert_close(got[wanted], whole[wanted * HOP :], rtol=0, atol=1e-12)
        torch.testing.assert_close(rows[1], whole[: 92 * HOP], rtol=0, atol=1e-12)
        torch.testing.assert_close(window.recorded[0], _phase_before(hift64, full, at + 10), rtol=0, atol=1e-12)
        torch.testing.assert_close(window.recorded[1], _phase_before(hift64, full, 30), rtol=0, atol=1e-12)
    late = 80 - context // 2  # half the context: the window's edge reaches the samples wanted
    window = SourceWindow([late], [late + history], _phase_before(hift64, full, late + history)[None], [late + history])
    short = hift64.vocode_batch([full[:, late:]], [True], window)[0][(80 - late) * HOP :]
    assert (short - whole[80 * HOP :]).abs().max() > 1e-10  # far outside the 1e-12 the windows above keep


def test_nonfinal_call_is_prefix_of_longer_calls_fp32(hift32):
    full = mel(48, seed=2, dtype=torch.float32)
    final = hift32.inference(full, True)
    for end in (9, 17, 40):
        part = hift32.inference(full[:, :, :end], False)
        torch.testing.assert_close(part, final[:, : part.shape[1]], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- batching


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_vocode_batch_equals_rows_alone(tiny_noise, official_state, dtype, atol):
    model = make(tiny_noise, official_state, dtype)
    lengths = [30, 12, 45, 5, 45, 9, 0]
    finals = [True, False, True, False, False, True, True]
    rows = [mel(t, seed=10 + i, dtype=dtype)[0] for i, t in enumerate(lengths)]
    outs = model.vocode_batch(rows, finals)
    for row, fin, out in zip(rows, finals, outs):
        alone = model.inference(row[None], fin)[0]
        assert out.shape == alone.shape == (TINY.output_samples(row.shape[-1], fin),)
        torch.testing.assert_close(out, alone, rtol=0, atol=atol)


def test_vocode_batch_of_equal_rows_is_the_batched_call(hift64):
    x = mel(25, seed=5, batch=3)
    outs = hift64.vocode_batch(list(x), [False] * 3)
    whole = hift64.inference(x, False)
    for i, out in enumerate(outs):
        assert torch.equal(out, whole[i])


def test_right_padding_does_not_leak_into_rows(hift64):
    """A final row padded with zeros is the official final call (zero look-ahead); a non-final row
    never looks at frames past its own. Garbage-free: changing another row changes nothing."""
    a, b = mel(30, seed=6)[0], mel(50, seed=7)[0]
    base = hift64.vocode_batch([a, b], [True, False])
    other = hift64.vocode_batch([a, b * 0.5 + 1.0], [True, False])
    torch.testing.assert_close(base[0], other[0], rtol=0, atol=1e-12)


def _streams_batch(hift, dtype=torch.float64, device="cpu"):
    """Rows as a streamed codec call holds them: windows of two streams with their phases carried (one
    non-final, one final), a new stream's first chunk, a whole utterance; and the window state."""
    full = mel(120, seed=5, dtype=dtype)[0]
    context, history = TINY.stream_context_frames, TINY.f0_history_frames
    first = 64 - context
    carried = _phase_before(hift, full, first + history)
    rows = [full[:, first:100], mel(37, seed=8, dtype=dtype)[0], full[:, first:], mel(23, seed=9, dtype=dtype)[0]]
    window = SourceWindow([first, 0, first, 0], [first + history, 0, first + history, 0],
                          torch.stack([carried, 0 * carried, carried, 0 * carried]),
                          [first + history + 5, 20, first + history, 0])
    return [r.to(device) for r in rows], [False, False, True, True], window


def test_a_batch_padded_to_its_graph_shape_gives_every_row_what_it_gets_unpadded(hift64):
    """`vocode_batch` with graphs pads the batch to its graph shape (rows repeated, frames in buckets of
    32); on a CPU nothing is captured and the padded batch runs eagerly: every row's samples and the
    phases it records are those of the unpadded call."""
    from intone.engine.cuda_graphs import FunctionGraphs
    from intone.models.cosyvoice3.hift import graph_shape

    rows, finals, window = _streams_batch(hift64)
    assert graph_shape(len(rows), max(r.shape[1] for r in rows)) == (4, 96)
    plain = hift64.vocode_batch(rows, finals, window)
    take = [0, 1, 3]  # 3 rows of up to 73 frames -> the (4, 96) shape
    three = window.rows(take)
    padded = hift64.vocode_batch([rows[i] for i in take], [finals[i] for i in take], three, FunctionGraphs())
    for i, b in zip(take, padded):
        assert b.shape == plain[i].shape
        torch.testing.assert_close(b, plain[i], rtol=0, atol=1e-12)
    torch.testing.assert_close(three.recorded, window.recorded[take], rtol=0, atol=1e-12)
    assert not torch.equal(window.recorded[0], window.carried[0])  # the phase moved on past the carried one


# ---------------------------------------------------------------- precision


def test_f0_predictor_runs_in_float64(tiny_noise, official_state):
    model = make(tiny_noise, official_state, torch.float32).to(torch.bfloat16)
    assert all(p.dtype == torch.float64 for p in model.f0_predictor.parameters())
    assert model.conv_pre.weight.dtype == torch.bfloat16
    assert model.m_source.l_sin_gen.sine_waves.dtype == torch.float32
    seen = []
    hook = model.f0_predictor.condnet[0].register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
    model.inference(mel(12, dtype=torch.bfloat16), True)
    hook.remove()
    assert seen == [(torch.float64, torch.float64)]
    # The F0 weights kept full float64 precision through the bf16 cast (folded from float64 g and v).
    ref = fold_hift_weight_norm(official_state)["f0_predictor.condnet.0.weight"]
    assert ref.dtype == torch.float64 and torch.equal(model.f0_predictor.condnet[0].weight, ref)


def test_f0_values_are_the_float64_formula(hift64):
    x = mel(15, seed=8)
    f0 = hift64.f0_predictor(x, pad=True)
    h = x
    for i, layer in enumerate(hift64.f0_predictor.condnet):
        if i == 0:
            h = F.conv1d(F.pad(h, (0, 3)), layer.weight, layer.bias)
        elif i % 2 == 0:
            h = F.conv1d(F.pad(h, (2, 0)), layer.weight, layer.bias)
        else:
            h = F.elu(h)
    expected = (h.transpose(1, 2) @ hift64.f0_predictor.classifier.weight.T + hift64.f0_predictor.classifier.bias).abs()
    torch.testing.assert_close(f0, expected.squeeze(-1), rtol=1e-12, atol=1e-9)
    voiced = (f0 > TINY.nsf_voiced_threshold).double().mean()
    assert 0.0 < voiced < 1.0  # the test weights exercise both branches of the source


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs_close_to_fp32(tiny_noise, official_state, dtype):
    ref_model = make(tiny_noise, official_state, torch.float32)
    model = make(tiny_noise, official_state, torch.float32).to(dtype)
    x = mel(20, seed=9, dtype=torch.float32)
    ref = ref_model.inference(x, True)
    out = model.inference(x.to(dtype), True)
    assert out.dtype == torch.float32 and out.shape == ref.shape and torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 0.1
    batch = model.vocode_batch([x[0].to(dtype), x[0, :, :14].to(dtype)], [True, False])
    assert batch[1].shape == ((14 - 8) * HOP,)


def test_too_long_input_is_rejected(hift64):
    with pytest.raises(ValueError):
        hift64.inference(mel(TINY.max_frames + 1), True)
    # a window late in its stream reads noise from its first frame on: past the fixed noise is refused too
    late = TINY.max_frames - 10
    window = SourceWindow([late], [late], torch.zeros(1, TINY.nb_harmonics + 1, dtype=torch.float64), [late])
    with pytest.raises(ValueError, match="noise"):
        hift64.vocode_batch([mel(20)[0]], [True], window)
    assert hift64.vocode_batch([mel(10)[0]], [True], window)[0].shape == (10 * HOP,)  # up to its end is fine


# ---------------------------------------------------------------- noise replay


def test_official_noise_matches_a_torch_module_replay():
    """official_noise draws from a private generator with hand-written init calls; replay the same
    construction order with real torch modules on the global RNG and compare bit for bit."""
    sizes, cfg = FlowSizes(vocab_size=50, input_size=80, spk_embed_dim=12, output_size=80), TINY
    state = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        flow_noise = torch.randn(1, 80, 15000)
        torch.nn.Embedding(sizes.vocab_size, sizes.input_size)
        torch.nn.Linear(sizes.spk_embed_dim, sizes.output_size)
        wn = torch.nn.utils.parametrizations.weight_norm
        wn(torch.nn.Conv1d(cfg.in_channels, cfg.f0_cond_channels, 4))
        for _ in range(4):
            wn(torch.nn.Conv1d(cfg.f0_cond_channels, cfg.f0_cond_channels, 3))
        torch.nn.Linear(cfg.f0_cond_channels, 1)
        rand_ini = torch.rand(1, 9)
        rand_ini[:, 0] = 0
        sine = torch.rand(1, 300 * 24000, 9)
        torch.nn.Linear(cfg.nb_harmonics + 1, 1)
        uv = torch.rand(1, 300 * 24000, 1)
    finally:
        torch.set_rng_state(state)
    before = torch.get_rng_state()
    full = official_noise(sizes, cfg, noise_samples=300 * 24000)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is untouched
    assert torch.equal(full[FLOW_NOISE_KEY], flow_noise)
    assert torch.equal(full[HIFT_RAND_INI_KEY], rand_ini)
    assert torch.equal(full[HIFT_SINE_NOISE_KEY], sine)
    assert torch.equal(full[HIFT_UV_KEY], uv)
    del full
    short = official_noise(sizes, cfg, noise_samples=5000)  # prefix draw + chunked skip
    assert torch.equal(short[HIFT_SINE_NOISE_KEY], sine[:, :5000])
    assert torch.equal(short[HIFT_UV_KEY], uv[:, :5000])
    assert torch.equal(short[FLOW_NOISE_KEY], flow_noise)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_matches_cpu_and_batches(tiny_noise, official_state, hift32, no_tf32):
    model = make(tiny_noise, official_state, torch.float32).to("cuda")
    assert model.m_source.l_sin_gen.sine_waves.is_cuda
    assert model.f0_predictor.condnet[0].weight.dtype == torch.float64
    x = mel(40, seed=11, dtype=torch.float32)
    for fin in (True, False):
        torch.testing.assert_close(model.inference(x.cuda(), fin).cpu(), hift32.inference(x, fin), rtol=0, atol=1e-4)
    rows = [mel(t, seed=20 + t, dtype=torch.float32)[0].cuda() for t in (33, 18, 40)]
    finals = [False, True, False]
    for row, fin, out in zip(rows, finals, model.vocode_batch(rows, finals)):
        torch.testing.assert_close(out, model.inference(row[None], fin)[0], rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_low_precision(tiny_noise, official_state, hift32, dtype):
    model = make(tiny_noise, official_state, torch.float32).to("cuda", dtype)
    assert model.f0_predictor.condnet[0].weight.dtype == torch.float64
    x = mel(30, seed=12, dtype=torch.float32)
    ref = hift32.inference(x, True)
    out = model.inference(x.to("cuda", dtype), True).cpu()
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out - ref).norm() / ref.norm() < 0.1


@pytest.mark.gpu
def test_hift_replayed_from_its_graphs_gives_the_eager_samples(tiny_noise, official_state, hift64, no_tf32):
    """HiFT's calls captured at their graph shapes (`capture`, as the codec stage does at start-up with
    `cosyvoice3.hift.cuda_graphs`) and replayed for a streamed call's mix of rows (windows with carried
    phases, first chunks, a final row): the eager call's samples and recorded phases, and a replay of
    other rows at the same shape is theirs, not the captured ones'."""
    from intone.engine.cuda_graphs import FunctionGraphs

    model = make(tiny_noise, official_state, torch.float32).to("cuda")
    graphs = FunctionGraphs()
    for rows_bucket in (4, 2):
        for frames in (96, 64):
            model.capture(rows_bucket, frames, graphs)
    assert len(graphs) == 4
    rows, finals, window = _streams_batch(hift64, torch.float32, "cuda")
    window.carried = window.carried.float()
    for take in ([0, 1, 2, 3], [1, 3], [2, 0, 1]):
        pick = [rows[i] for i in take]
        eager_window, graph_window = window.rows(take), window.rows(take)
        eager = model.vocode_batch(pick, [finals[i] for i in take], eager_window)
        replayed = model.vocode_batch(pick, [finals[i] for i in take], graph_window, graphs)
        for a, b in zip(eager, replayed):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        torch.testing.assert_close(graph_window.recorded, eager_window.recorded, rtol=0, atol=1e-5)
    assert graphs.replays == 3 and graphs.eager == 0
