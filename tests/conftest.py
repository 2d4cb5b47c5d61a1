import os
import shutil
import sys
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


BENCH_TESTS = {"abba": "test_abba", "sweep": "test_sweep_writes_results_report_and_plots",
               "forced": "test_forced_lengths_and_failures_are_counted"}


@pytest.fixture(scope="session", autouse=True)
def bench_runs(request, tmp_path_factory):
    """tests/bench/test_bench_cli.py's `intone bench` runs (of the tests selected: each starts its own servers),
    started as the session begins and run one at a time beside the tests before them (the API tests mostly
    wait on one server's core, leaving the other idle); a bench test waits for its own, starting it at once if
    its turn has not come. -> name: (result, its directory), or None when no bench test is selected."""
    names = {getattr(item, "originalname", None) for item in request.session.items if item.path.name == "test_bench_cli.py"}
    wanted = [name for name, test in BENCH_TESTS.items() if test in names]
    if not wanted:
        yield None
        return
    from tests.bench.test_bench_cli import bench_args
    from tests.procs import Beside

    cache = request.getfixturevalue("tiny_cache")
    request.getfixturevalue("tiny_fish_dir")  # made here once, not by each run's server
    dirs = {name: tmp_path_factory.mktemp(name) for name in wanted}
    runs = Beside({name: [sys.executable, "-m", "intone.cli.main", "bench", *bench_args(name, d)]
                   for name, d in dirs.items()}, timeout=600, env={**os.environ, "INTONE_CACHE": str(cache)})
    try:
        yield lambda name: (runs.result(name), dirs[name])
    finally:
        runs.close()


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
