"""Several linear layers that read the same input, run as one GEMM.

A decode step at 64 rows is made of small GEMMs whose launches and tails dominate (Qwen2's k and v
projections are 896 x 128). Joining q/k/v, or gate/up, into one weight makes one wider GEMM of each.
The layers keep their own parameters, re-pointed at slices of the joined weight, so checkpoints load
and save by their names and no memory is doubled. Each output element is the same dot product; only
the GEMM's kernel choice (its summation order) may differ, by rounding.

If a layer's weight stops being a slice of the joined one (the module was cast or moved since, or a
test assigned new parameters), the layers run one by one again, so a stale joined weight is never used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class JoinedLinear:
    def __init__(self, *layers: nn.Linear):
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        with torch.no_grad():
            self.weight = torch.cat([layer.weight for layer in layers])
            has_bias = layers[0].bias is not None
            self.bias = torch.cat([layer.bias for layer in layers]) if has_bias else None
            for layer, w, b in zip(layers, self.weight.split(self.sizes), self._bias_parts()):
                layer.weight.data = w
                if b is not None:
                    layer.bias.data = b

    def _bias_parts(self) -> list:
        return list(self.bias.split(self.sizes)) if self.bias is not None else [None] * len(self.layers)

    def joined(self) -> bool:
        """Whether every layer still reads its slice of the joined weight and bias."""
        offset = 0
        row = self.weight.stride(0) * self.weight.element_size()
        for layer, size in zip(self.layers, self.sizes):
            if layer.weight.data_ptr() != self.weight.data_ptr() + offset * row:
                return False
            if self.bias is not None and layer.bias.data_ptr() != self.bias.data_ptr() + offset * self.bias.element_size():
                return False
            offset += size
        return True

    def __call__(self, x: Tensor) -> list[Tensor]:
        if self.joined():
            return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
        return [layer(x) for layer in self.layers]


def join_linears(*layers: nn.Linear) -> JoinedLinear:
    if len({(layer.in_features, layer.bias is not None, layer.weight.dtype, layer.weight.device)
            for layer in layers}) != 1:
        raise ValueError("joined layers must share input size, bias, dtype and device")
    return JoinedLinear(*layers)
