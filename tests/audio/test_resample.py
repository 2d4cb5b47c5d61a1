"""Reference audio at any rate costs bounded memory, and rates outside sane bounds get a 400."""

import io
import resource
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import given, settings, strategies as st

from intone.audio import read_audio
from intone.errors import InvalidRequestError
from intone.ops.resample import bank_fits, resample, resample_direct


def _wav(rate: int, seconds: float = 1.0) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


@settings(max_examples=20, deadline=None)
@given(orig=st.sampled_from([8000, 16000, 22050, 24000, 32000, 44100, 48000]),
       new=st.sampled_from([16000, 24000, 44100, 48000]), n=st.integers(50, 20000))
def test_direct_resampling_equals_the_polyphase_bank(orig, new, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    a, b = resample(x, orig, new), resample_direct(x, orig, new)
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=1e-4, rtol=0)


def test_an_odd_rate_resamples_in_bounded_memory(tmp_path):
    """44,101 Hz once made the resampler build a 7.8 GB bank; run in a fresh process to read its peak RSS."""
    path = tmp_path / "odd.wav"
    path.write_bytes(_wav(44101))
    code = (
        "import resource, torch; from intone.audio import read_audio; from intone.ops.resample import resample;"
        f"audio, rate = read_audio({str(path)!r});"
        "y = resample(torch.from_numpy(audio), rate, 44100); assert y.shape[0] == 44100, y.shape;"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    peak_mb = int(out.stdout.strip()) / 1024
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # this process has torch loaded too
    assert peak_mb < max(2000, 2 * baseline), peak_mb
    assert not bank_fits(44101, 44100) and bank_fits(44100, 16000)


def test_a_resampled_odd_rate_sounds_like_its_neighbour():
    audio, rate = read_audio(_wav(44101))
    near, _ = read_audio(_wav(44100))
    y = resample(torch.from_numpy(audio), rate, 16000)
    z = resample(torch.from_numpy(near), 44100, 16000)
    assert abs(y.shape[0] - z.shape[0]) <= 1
    n = min(y.shape[0], z.shape[0]) - 200
    assert torch.allclose(y[100:n], z[100:n], atol=0.02)  # the same 440 Hz tone, 0.002% slower


@pytest.mark.parametrize("rate", [1000, 2**31 - 1, 400000])
def test_rates_outside_the_bounds_are_refused_naming_the_field(rate):
    wav = io.BytesIO()
    sf.write(wav, np.zeros(4000, np.float32), rate, format="WAV")
    with pytest.raises(InvalidRequestError) as e:
        read_audio(wav.getvalue(), field="ref_audio")
    assert e.value.field == "ref_audio" and "Hz" in str(e.value)


def test_cosyvoice3_resampler_takes_odd_rates_without_a_bank():
    from intone.models.cosyvoice3.features import official_resample

    x = torch.randn(16001 * 2, generator=torch.Generator().manual_seed(0))
    y = official_resample(x, 16001, 24000)
    assert y.shape == (48000,) and torch.isfinite(y).all()


def test_a_long_compressed_reference_is_refused_by_its_header_before_decoding(tmp_path):
    import time

    path = tmp_path / "long.flac"
    sf.write(path, np.zeros(16000 * 60 * 60, np.float32), 16000, format="FLAC")  # an hour of silence
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError) as e:
        read_audio(path.read_bytes(), field="ref_audio", max_seconds=30)
    assert e.value.field == "ref_audio" and "3600.0 s" in str(e.value)
    assert time.perf_counter() - start < 0.1  # the header only: decoding it all takes ~1 s
