"""The fixed random buffers of an official CosyVoice3 instance, replayed without the official code.

None of them is a checkpoint key: the official modules draw them from the global torch RNG while
being built. Building the flow's CausalConditionalCFM reseeds with 0 and draws the flow noise
randn(1, 80, 15000); every RNG draw after it, up to HiFT's SineGen2, shifts the HiFT buffers.
In the order hyperpyyaml builds cosyvoice3.yaml (nested `!new:` nodes before their parent; the
DiT estimator and pre-lookahead layer come before the CFM, so before the reseed) those draws are:

1. the rest of the flow (`CausalMaskedDiffWithDiT.__init__`): `input_embedding`
   Embedding(vocab_size, input_size) and `spk_embed_affine_layer` Linear(spk_embed_dim, output_size);
2. the `hift:` node's nested F0 predictor: 5 convs (kernel 4, then 4 x kernel 3; weight norm draws
   nothing) and its Linear(cond_channels, 1) classifier;
3. CausalHiFTGenerator: SineGen2 draws `rand_ini` = rand(1, 9) (channel 0 then zeroed) and
   `sine_waves` = rand(1, 7_200_000, 9); then the source module's Linear(harmonics + 1, 1) is
   initialised and `m_source.uv` = rand(1, 7_200_000, 1) is drawn.

The replay uses a private generator seeded with 0 (the same stream as the global one after
`torch.manual_seed(0)`), so the caller's RNG state is neither used nor changed. Memory: the flow
noise is 4.8 MB; a full `sine_waves` is 259.2 MB and `uv` 28.8 MB (float32). Only those returned
are kept: a shorter `noise_samples` keeps only that prefix, and the draws past it are made through
a 4 MB scratch buffer. `uv` is drawn only when asked for (CausalHiFT does not use it: the official
generator discards the noise branch of its source module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from intone.models.cosyvoice3.hift_config import RAND_INI_KEY, SINE_NOISE_KEY, HiFTConfig
from intone.models.cosyvoice3.hift_source import OFFICIAL_NOISE_SAMPLES

FLOW_NOISE_KEY = "flow.decoder.rand_noise"
HIFT_RAND_INI_KEY = "hift." + RAND_INI_KEY
HIFT_SINE_NOISE_KEY = "hift." + SINE_NOISE_KEY
HIFT_UV_KEY = "hift.m_source.uv"
FLOW_NOISE_SHAPE = (1, 80, 50 * 300)  # hard-coded in the official CFM
SINE_NOISE_CHANNELS = 9  # hard-coded in the official SineGen2, whatever nb_harmonics is
_SCRATCH = 1 << 20


@dataclass(frozen=True)
class FlowSizes:
    """The flow sizes that decide how many draws its construction makes (official yaml values)."""

    vocab_size: int = 6561
    input_size: int = 80
    spk_embed_dim: int = 192
    output_size: int = 80


def _linear_like_init(gen: torch.Generator, weight_shape: tuple[int, ...]) -> None:
    """What nn.Linear / nn.Conv1d reset_parameters draw: kaiming-uniform weight, uniform bias."""
    weight = torch.empty(weight_shape)
    fan_in = math.prod(weight_shape[1:])
    bound = math.sqrt(6.0 / ((1 + 5) * fan_in))  # kaiming_uniform_ with a = sqrt(5)
    weight.uniform_(-bound, bound, generator=gen)
    torch.empty(weight_shape[0]).uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in), generator=gen)


def _skip_uniform(gen: torch.Generator, count: int) -> None:
    scratch = torch.empty(min(count, _SCRATCH))
    while count > 0:
        n = min(count, _SCRATCH)
        scratch[:n].uniform_(generator=gen)
        count -= n


def official_noise(
    flow_sizes: FlowSizes = FlowSizes(),
    hift_cfg: HiFTConfig | None = None,
    *,
    noise_samples: int | None = None,
    include_uv: bool = True,
) -> dict[str, Tensor]:
    """The official instance's fixed noise, bit for bit, keyed by attribute path:
    `flow.decoder.rand_noise` [1, 80, 15000] (normal), `hift.m_source.l_sin_gen.rand_ini` [1, 9],
    `hift.m_source.l_sin_gen.sine_waves` [1, N, 9] and, with include_uv, `hift.m_source.uv`
    [1, N, 1] (uniform), float32 on the CPU. N is `noise_samples` (default hift_cfg.noise_samples,
    at most 7.2 M): the first N samples of the official 7.2 M-sample buffers. hift_cfg (default
    HiFTConfig()) matters through the F0 predictor's sizes and nb_harmonics.
    """
    hift_cfg = HiFTConfig() if hift_cfg is None else hift_cfg
    n = hift_cfg.noise_samples if noise_samples is None else noise_samples
    if not 0 < n <= OFFICIAL_NOISE_SAMPLES:
        raise ValueError(f"noise_samples must be in 1..{OFFICIAL_NOISE_SAMPLES}, got {n}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0)
    out: dict[str, Tensor] = {}

    # CausalConditionalCFM.__init__ after set_all_random_seed(0).
    out[FLOW_NOISE_KEY] = torch.randn(FLOW_NOISE_SHAPE, generator=gen)
    # CausalMaskedDiffWithDiT.__init__: Embedding (normal init), then the speaker Linear.
    torch.empty(flow_sizes.vocab_size, flow_sizes.input_size).normal_(generator=gen)
    _linear_like_init(gen, (flow_sizes.output_size, flow_sizes.spk_embed_dim))
    # The hift node's nested CausalConvRNNF0Predictor.
    cond = hift_cfg.f0_cond_channels
    _linear_like_init(gen, (cond, hift_cfg.in_channels, hift_cfg.f0_look_right + 1))
    for _ in range(4):
        _linear_like_init(gen, (cond, cond, 3))
    _linear_like_init(gen, (1, cond))
    # CausalHiFTGenerator.__init__ -> SourceModuleHnNSF -> SineGen2.
    rand_ini = torch.rand(1, SINE_NOISE_CHANNELS, generator=gen)
    rand_ini[:, 0] = 0
    out[HIFT_RAND_INI_KEY] = rand_ini
    out[HIFT_SINE_NOISE_KEY] = torch.rand(1, n, SINE_NOISE_CHANNELS, generator=gen)
    if include_uv:
        # The uniform stream is consumed one value per element in order, so the rest of the
        # sine buffer can be skipped in chunks (tests check this against a full draw).
        _skip_uniform(gen, (OFFICIAL_NOISE_SAMPLES - n) * SINE_NOISE_CHANNELS)
        _linear_like_init(gen, (1, hift_cfg.nb_harmonics + 1))  # SourceModuleHnNSF.l_linear
        out[HIFT_UV_KEY] = torch.rand(1, n, 1, generator=gen)
    return out
