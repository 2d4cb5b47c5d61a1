"""`sampling.best_tokens` on a GPU runs one Triton kernel per call (`ops/top_candidates.py`); it must pick the ids
torch's top-k over the same order keys picks, in the same order, so every draw is the one it was."""

import pytest
import torch

from intone.ops import fused


def _torch_best(logits: torch.Tensor, k: int) -> torch.Tensor:
    keys = torch.topk(fused.order_keys_eager(logits), k, dim=-1).values
    return (logits.shape[-1] - 1) - (keys & 0xFFFFFFFF)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width", [(48, 4096), (48, 4097), (1, 4097), (300, 4096), (7, 100), (3, 8192)])
@pytest.mark.parametrize("k", [1, 30, 64])
def test_the_kernel_picks_torchs_best_ids_in_torchs_order(rows, width, k):
    """Rows of many ties (runs of equal logits, 0.0 beside -0.0), -inf and +inf, a NaN, fp16-rounded values (as the
    fast AR's logits are before their float32 cast): the kernel's ids equal torch's, order included."""
    from intone.ops.sampling import best_tokens
    from intone.ops.top_candidates import available

    g = torch.Generator(device="cuda").manual_seed(rows * 1000 + width + k)
    logits = torch.randn(rows, width, device="cuda", generator=g).half().float()  # many exact ties
    logits[0, : width // 2] = 0.0
    logits[0, width // 2: width // 2 + 5] = -0.0
    logits[-1, 3::7] = float("-inf")
    logits[rows // 2, 11 % width] = float("inf")
    logits[rows // 2, 13 % width] = float("nan")
    k = min(k, width)
    assert available(logits, k)
    assert torch.equal(best_tokens(logits, k), _torch_best(logits, k))
