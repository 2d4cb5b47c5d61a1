import os
import shutil
from pathlib import Path

import pytest
import torch

# Without a GPU, the processes the tests start (servers and their engine cores, CLI runs, the jobs run beside the
# tests, worker pools, codec and frontend processes) run one torch thread each, unless OMP_NUM_THREADS says
# otherwise: they run beside this process or one another, and a process whose OpenMP team outnumbers the cores
# left to it waits at every parallel op for a thread that is not running (a strict-server stream ran 4-20x slower
# beside one `intone` run on 2 cores). This process keeps its own threads (its model tests compute alone).
if not torch.cuda.is_available():
    _THREADS = torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(_THREADS)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The module's torch ops on one thread (this process's count restored after it). For modules whose engines
    run a loop thread and a codec (or frontend) thread, or whose worker process computes beside them: each with
    two threads of its own, they would contend for the two cores of a CI machine at every parallel op (and the
    tiny models' ops gain little from a second thread); each module measured faster so on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session", autouse=True)
def beside(request, tmp_path_factory):
    """Subprocess runs that test modules declare (a module-level `beside_jobs(selected, tmp_path_factory, cache)`:
    name -> (job, its directory), for the module's tests selected), started as the session begins and run one at
    a time beside the tests before theirs (the API tests mostly wait on one server's core, leaving the other idle;
    two at a time in a session with no shared server). A test waits for its own, starting it at once if its turn
    has not come: beside(module name, job name) -> (result, directory); None when no module declares any."""
    wanted: dict = {}  # module -> its selected tests
    for item in request.session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "beside_jobs"):
            wanted.setdefault(module, set()).add(item.originalname)
    if not wanted:
        yield None
        return
    from tests.procs import Beside

    cache = request.getfixturevalue("tiny_cache")
    request.getfixturevalue("tiny_fish_dir")  # made here once, not by each run
    jobs, dirs = {}, {}
    for module, selected in wanted.items():
        for name, (job, directory) in module.beside_jobs(selected, tmp_path_factory, cache).items():
            jobs[module.__name__, name], dirs[module.__name__, name] = job, directory
    servers = any("shared_boots" in getattr(item, "fixturenames", ()) for item in request.session.items)
    runs = Beside(jobs, workers=1 if servers else 2, wait_s=60 if servers else 0,
                  env={**os.environ, "INTONE_CACHE": str(cache)})
    try:
        yield lambda module, name: (runs.result((module, name)), dirs[module, name])
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
