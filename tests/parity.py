"""The parity fixtures (`tests/fixtures/parity/`), written by `tools/parity_fixtures.py` from the official
fish-speech and CosyVoice code run on the tiny checkpoints: reading them, and the digest that ties them to the
checkpoint they were made from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
WEIGHT_SUFFIXES = (".pt", ".pth", ".safetensors")


def checkpoint_digest(model_dir: str | Path) -> str:
    """sha256 over every file of a checkpoint but the ONNX frontend models (no fixture uses them): weight
    files by their tensors (name, dtype, shape, bytes), so a change in how torch writes files does not
    count, everything else by its bytes."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix != ".onnx"):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(_tensor_digest(path) if path.suffix in WEIGHT_SUFFIXES else hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _tensor_digest(path: Path) -> bytes:
    import torch

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(state[name].shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.digest()


def save(name: str, arrays: dict[str, np.ndarray], meta: dict, out_dir: Path = FIXTURES) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_dir / f"{name}.npz", **arrays)
    (out_dir / f"{name}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


def load(name: str, model_dir: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """The fixture's arrays and metadata; skips the calling test when the tiny checkpoint on disk is not
    the one the fixture was made from (the fixture must then be made again, see tools/parity_fixtures.py)."""
    import pytest

    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    digest = checkpoint_digest(model_dir)
    if digest != meta["checkpoint_digest"]:
        pytest.skip(f"parity fixture {name} was made from another tiny checkpoint (digest "
                    f"{meta['checkpoint_digest'][:12]}, this one {digest[:12]}): the tiny maker changed, or this "
                    f"machine's torch random sampling rounds differently from the fixture machine's (it depends on "
                    f"the CPU's vector unit); "
                    "run tools/parity_fixtures.py again")
    with np.load(FIXTURES / f"{name}.npz") as data:
        return dict(data), meta
