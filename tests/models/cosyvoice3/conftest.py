import math

import numpy as np
import pytest
import torch

from intone.models.cosyvoice3.vocoder import StreamState  # noqa: F401  (import check)
from intone.protocol import VoiceReference


@pytest.fixture(scope="session")
def tiny_cosy_dir(tiny_cache):
    from intone.models import resolve_model_dir

    return resolve_model_dir("tiny:cosyvoice3")


@pytest.fixture(scope="session")
def tiny_cosy(tiny_cosy_dir):
    from intone.models.registry import load_model

    return load_model(str(tiny_cosy_dir))


@pytest.fixture(scope="session")
def cosy64(tiny_cosy_dir):
    """float64 talker, flow and HiFT, so batching can never flip a sample and audio compares exactly."""
    from intone.models.registry import load_model

    return load_model(str(tiny_cosy_dir), dtype=torch.float64, codec_dtype=torch.float64)


def voice_audio(seconds: float = 2.0, rate: int = 16000, pitch: float = 140.0) -> torch.Tensor:
    """A voiced, speech-like test signal (harmonics with a slow pitch glide and some noise)."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = pitch * (1 + 0.1 * np.sin(2 * math.pi * 0.7 * t))
    phase = 2 * math.pi * np.cumsum(f0) / rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * math.pi * 2.5 * t) ** 2)
    wave += 0.01 * np.random.default_rng(0).standard_normal(t.shape)
    return torch.tensor(0.2 * wave, dtype=torch.float32)


@pytest.fixture(scope="session")
def voice() -> VoiceReference:
    return VoiceReference(text="The quick brown fox jumps over the lazy dog.", audio=voice_audio(), sample_rate=16000)
