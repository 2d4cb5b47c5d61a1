"""The parity fixtures' tie to the tiny checkpoint they were made from (`tests/parity.py`)."""

import pytest
import torch

from tests import parity


def checkpoint(path, state, extra=()):
    path.mkdir()
    (path / "config.json").write_text('{"dim": 4}')
    torch.save(state, path / "weights.pt")
    for name in extra:
        (path / name).write_bytes(b"not read")
    return path


def test_the_digest_follows_the_tensors_not_how_the_file_was_written(tmp_path):
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}
    reordered = dict(reversed(list(state.items())))  # other pickle bytes, same tensors
    first = checkpoint(tmp_path / "first", state)
    second = checkpoint(tmp_path / "second", reordered, extra=["campplus.onnx"])  # ONNX models are not used
    assert (first / "weights.pt").read_bytes() != (second / "weights.pt").read_bytes()
    assert parity.checkpoint_digest(first) == parity.checkpoint_digest(second)
    changed = {**state, "a": state["a"].clone().index_fill_(1, torch.tensor([0]), 0.5)}
    assert parity.checkpoint_digest(checkpoint(tmp_path / "changed", changed)) != parity.checkpoint_digest(first)
    cast = {**state, "a": state["a"].double()}
    assert parity.checkpoint_digest(checkpoint(tmp_path / "cast", cast)) != parity.checkpoint_digest(first)


def test_a_fixture_made_from_another_checkpoint_skips_with_the_reason(tmp_path):
    other = checkpoint(tmp_path / "other", {"a": torch.zeros(1)})
    with pytest.raises(pytest.skip.Exception, match="another tiny checkpoint.*parity_fixtures.py"):
        parity.load("fish_s2", other)
