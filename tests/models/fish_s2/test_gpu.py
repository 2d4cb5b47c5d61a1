"""The same model on CUDA: agreement with the CPU, determinism, a real-size step. Marked gpu."""

import pytest
import torch

from tests.offline import OfflineRequest, run_to_completion
from intone.models.registry import load_model
from intone.protocol import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_fish(tiny_fish_dir):
    return load_model(str(tiny_fish_dir), device="cuda", dtype=torch.float32)


def run(model, seeds, max_new=40, text="Hello world"):
    prompt = model.build_prompt(text, [])
    reqs = [OfflineRequest(prompt, SamplingParams(seed=s, max_new_tokens=max_new)) for s in seeds]
    return run_to_completion(model, reqs)


def test_codec_on_gpu_matches_cpu(tiny_fish, gpu_fish, no_tf32):
    codes = torch.randint(0, 4096, (2, 10, 40))
    assert torch.allclose(gpu_fish.decode(codes).cpu(), tiny_fish.decode(codes), atol=1e-4)


def test_slow_ar_logits_on_gpu_match_cpu(tiny_fish, gpu_fish, no_tf32):
    h = torch.randn(4, tiny_fish.lm.cfg.slow.dim)
    cpu = tiny_fish.lm.full_logits(h)
    gpu = gpu_fish.lm.full_logits(h.cuda()).cpu()
    assert torch.allclose(cpu, gpu, atol=1e-4)


def test_gpu_generation_is_deterministic(gpu_fish):
    a, b = run(gpu_fish, [3]), run(gpu_fish, [3])
    assert torch.equal(a[0].codes, b[0].codes)


def test_gpu_codes_do_not_depend_on_the_batch(gpu_fish):
    alone = [run(gpu_fish, [s])[0].codes for s in (11, 12, 13)]
    together = [r.codes for r in run(gpu_fish, [11, 12, 13])]
    for a, b in zip(alone, together):
        assert torch.equal(a, b)


def test_real_size_step_runs_in_bf16(tiny_fish_dir):
    from intone.bench.step_time import decode_batch, step_runner
    from intone.models.fish_s2.config import S2_PRO_CONFIG, FishS2Config
    from intone.models.fish_s2.model import FishS2

    model = FishS2.random(FishS2Config.from_dict(S2_PRO_CONFIG), tiny_fish_dir, device="cuda")
    step, kv = decode_batch(model, batch=4, context=100)
    out = step_runner(model, kv, True, 4, 101).run(step)
    assert out.codes.shape == (4, 10) and out.tokens.shape == (4,)
    audio = model.decode(out.codes.unsqueeze(-1).repeat(1, 1, 3))
    assert audio.shape == (4, 3 * 2048) and torch.isfinite(audio).all()


def test_the_time_major_encoder_in_half_precision_is_the_channels_first_one_within_its_rounding(tiny_fish_dir):
    """Real size, fp16 as served: the time-major encoder (`fish_s2.encoder_layout: time_major`) against the
    channels-first one on 16 clips of 3-8 s. Its latents are as close to float32's as the channels-first fp16 ones,
    its codes agree with float32's about as often (fp16's own flips where a latent sits between two entries), and
    replayed from a CUDA graph (as the frontend serves it) it gives the same bits as eagerly."""
    from intone.engine.cuda_graphs import FunctionGraphs
    from intone.models.fish_s2.codec import FishCodec
    from intone.models.fish_s2.encoder_tc import encode_tc

    torch.manual_seed(0)
    codec = FishCodec().cuda().eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    hop, rate = codec.hop_length, codec.sample_rate
    audio = torch.zeros(16, 8 * rate // hop * hop, device="cuda")
    for row in range(16):
        n = (3 + 5 * row // 15) * rate // hop * hop
        audio[row, :n] = 0.2 * torch.randn(n, generator=g, device="cuda")
    with torch.inference_mode():
        exact, exact_codes = codec.encoder(audio.unsqueeze(1)).float(), codec.encode(audio)
        codec.half()
        first = codec.encoder(audio.half().unsqueeze(1)).float()
        major = encode_tc(codec.encoder, audio.half().unsqueeze(1)).float()
        err_first, err_major = (first - exact).abs().max().item(), (major - exact).abs().max().item()
        assert err_major <= 2 * err_first + 1e-3, (err_major, err_first)
        agree_first = (codec.encode(audio) == exact_codes).float().mean().item()
        codec.encoder_layout = "time_major"
        codes_major = codec.encode(audio)
        agree_major = (codes_major == exact_codes).float().mean().item()
        assert agree_major >= agree_first - 0.01, (agree_major, agree_first)
        graphs = FunctionGraphs()
        graphs.capture("fish encoder", codec.encode, audio)
        assert torch.equal(graphs.run("fish encoder", codec.encode, audio)[0], codes_major) and graphs.replays == 1
