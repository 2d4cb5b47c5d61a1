"""ECAPA-TDNN speaker-embedding head of the Seed-TTS SIM metric (UniSpeech's "small" variant).

The head reads a weighted sum of every hidden state of a WavLM backbone and returns a 256-d
speaker embedding. Module and parameter names follow the key names of the released checkpoint
(`wavlm_large_finetune.pth`), so its head tensors load without renaming; that is why some
attribute names below are CamelCase.

Written from the architecture description in shared/reference/seedtts_eval.md §3.1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ConvReluBn(nn.Module):
    """Conv1d, then ReLU, then BatchNorm (norm after the activation, as the checkpoint was trained)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int = 1, dilation: int = 1):
        super().__init__()
        # "same" padding for odd kernels keeps every block at the input's frame count.
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, padding=dilation * (kernel - 1) // 2, dilation=dilation)
        self.bn = nn.BatchNorm1d(out_ch)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(F.relu(self.conv(x)))


class Res2Conv(nn.Module):
    """Res2Net-style multi-scale conv: the channels are cut into `scale` groups; each group but the
    last is convolved after adding the previous group's output, which widens the receptive field
    step by step. The last group passes through unchanged."""

    def __init__(self, channels: int, kernel: int, dilation: int, scale: int):
        super().__init__()
        if channels % scale:
            raise ValueError(f"channels ({channels}) must be divisible by scale ({scale})")
        self.width = channels // scale
        pad = dilation * (kernel - 1) // 2
        self.convs = nn.ModuleList(
            nn.Conv1d(self.width, self.width, kernel, padding=pad, dilation=dilation) for _ in range(scale - 1)
        )
        self.bns = nn.ModuleList(nn.BatchNorm1d(self.width) for _ in range(scale - 1))

    def forward(self, x: Tensor) -> Tensor:
        groups = torch.split(x, self.width, dim=1)
        outs, carry = [], None
        for group, conv, bn in zip(groups, self.convs, self.bns):
            carry = group if carry is None else carry + group
            carry = bn(F.relu(conv(carry)))
            outs.append(carry)
        outs.append(groups[-1])
        return torch.cat(outs, dim=1)


class SqueezeExcite(nn.Module):
    """Channel gating from the time-averaged activations (two linear layers, sigmoid gate)."""

    def __init__(self, channels: int, bottleneck: int):
        super().__init__()
        self.linear1 = nn.Linear(channels, bottleneck)
        self.linear2 = nn.Linear(bottleneck, channels)

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.sigmoid(self.linear2(F.relu(self.linear1(x.mean(dim=2)))))
        return x * gate.unsqueeze(2)


class SERes2Block(nn.Module):
    """1x1 conv, dilated Res2 conv, 1x1 conv, squeeze-excite, plus the block input (same width,
    so the residual needs no projection)."""

    def __init__(self, channels: int, kernel: int, dilation: int, scale: int, se_bottleneck: int):
        super().__init__()
        # Attribute names are fixed by the checkpoint's keys (e.g. `layer2.SE_Connect.linear1.weight`).
        self.Conv1dReluBn1 = ConvReluBn(channels, channels)
        self.Res2Conv1dReluBn = Res2Conv(channels, kernel, dilation, scale)
        self.Conv1dReluBn2 = ConvReluBn(channels, channels)
        self.SE_Connect = SqueezeExcite(channels, se_bottleneck)

    def forward(self, x: Tensor) -> Tensor:
        y = self.Conv1dReluBn2(self.Res2Conv1dReluBn(self.Conv1dReluBn1(x)))
        return self.SE_Connect(y) + x


class AttentiveStatsPool(nn.Module):
    """Per-channel attention over frames, then the attention-weighted mean and standard deviation
    concatenated ([B, C, T] -> [B, 2C]). The attention sees only the frame itself (no global
    context), matching the checkpoint (`linear1` takes C inputs, not 3C)."""

    def __init__(self, channels: int, attention: int):
        super().__init__()
        # 1x1 convs act as per-frame linear layers without transposing [B, C, T].
        self.linear1 = nn.Conv1d(channels, attention, kernel_size=1)
        self.linear2 = nn.Conv1d(attention, channels, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        weights = torch.softmax(self.linear2(torch.tanh(self.linear1(x))), dim=2)
        mean = (weights * x).sum(dim=2)
        second_moment = (weights * x * x).sum(dim=2)
        # The clamp keeps sqrt finite where rounding makes the variance slightly negative.
        std = (second_moment - mean * mean).clamp(min=1e-9).sqrt()
        return torch.cat([mean, std], dim=1)


class EcapaTdnnSmall(nn.Module):
    """Hidden-state mixer plus ECAPA-TDNN head.

    `feat_dim` is the backbone's hidden size and `num_states` the number of hidden states it
    exposes (layers + 1); WavLM-Large gives 1024 and 25. `forward` takes the stacked hidden
    states [num_states, B, T, feat_dim] and returns embeddings [B, emb_dim].
    """

    def __init__(self, feat_dim: int = 1024, num_states: int = 25, channels: int = 512, emb_dim: int = 256,
                 scale: int = 8, se_bottleneck: int = 128, attention: int = 128, cat_channels: int = 1536):
        super().__init__()
        self.num_states = num_states
        # Softmax-normalized mixing weights over the hidden states; trained, so read from the checkpoint.
        self.feature_weight = nn.Parameter(torch.zeros(num_states))
        # No affine parameters and no running statistics: per-utterance normalization only.
        self.instance_norm = nn.InstanceNorm1d(feat_dim)
        self.layer1 = ConvReluBn(feat_dim, channels, kernel=5)
        self.layer2 = SERes2Block(channels, 3, 2, scale, se_bottleneck)
        self.layer3 = SERes2Block(channels, 3, 3, scale, se_bottleneck)
        self.layer4 = SERes2Block(channels, 3, 4, scale, se_bottleneck)
        self.conv = nn.Conv1d(3 * channels, cat_channels, kernel_size=1)
        self.pooling = AttentiveStatsPool(cat_channels, attention)
        self.bn = nn.BatchNorm1d(2 * cat_channels)
        self.linear = nn.Linear(2 * cat_channels, emb_dim)

    def mix_states(self, states: Tensor) -> Tensor:
        """[num_states, B, T, D] -> normalized features [B, D, T]."""
        if states.shape[0] != self.num_states:
            raise ValueError(f"expected {self.num_states} hidden states, got {states.shape[0]}")
        weights = torch.softmax(self.feature_weight, dim=0).view(-1, 1, 1, 1)
        mixed = (weights * states).sum(dim=0).transpose(1, 2)
        # The reference adds 1e-6 before normalizing; kept for parity, although it nearly cancels out.
        return self.instance_norm(mixed + 1e-6)

    def forward(self, states: Tensor) -> Tensor:
        x = self.mix_states(states)
        out1 = self.layer1(x)
        out2 = self.layer2(out1)
        out3 = self.layer3(out2)
        out4 = self.layer4(out3)
        # Multi-layer aggregation: the three SE-Res2 outputs feed the pooling together.
        x = F.relu(self.conv(torch.cat([out2, out3, out4], dim=1)))
        return self.linear(self.bn(self.pooling(x)))
