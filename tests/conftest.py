import os
import shutil
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A private INTONE_CACHE for the session, so `tiny:` models are made once, here."""
    cache = tmp_path_factory.mktemp("intone-cache")
    os.environ["INTONE_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_fish_dir(tiny_cache) -> Path:
    from intone.models import resolve_model_dir

    return resolve_model_dir("tiny:fish-s2")


@pytest.fixture(scope="session")
def tiny_fish(tiny_fish_dir):
    from intone.models.registry import load_model

    return load_model(str(tiny_fish_dir))


@pytest.fixture
def tiny_copy(tiny_fish_dir, tmp_path) -> Path:
    """A writable copy of the tiny checkpoint, for tests that damage it."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_fish_dir, dst)
    return dst


@pytest.fixture
def no_tf32():
    """CUDA matmuls and convolutions may use TF32 (~1e-3 off); compare true fp32 against the CPU."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield
    torch.backends.cuda.matmul.allow_tf32 = matmul
