"""CAM++ (`campplus.onnx`) in torch: mean-normalised Kaldi fbank [B, T, 80] -> 192-d speaker vector.

The network (public: 3D-Speaker `speakerlab/models/campplus`, the checkpoint CosyVoice exports):

- head: a 2-D ResNet over (frequency, time): conv 3x3, two stages of two residual blocks that
  halve the frequency axis, conv 3x3 halving it again (80 -> 10 bins, time untouched);
- a TDNN (kernel 5, stride 2: T -> ceil(T / 2)), then three densely connected blocks (12, 24, 16
  layers; dilation 1, 2, 2) with a transition that halves the channels after each. A layer is
  BN-ReLU, 1x1 bottleneck, BN-ReLU, then a dilated conv gated by context-aware masking: a sigmoid
  of two 1x1 convs over (the clip's mean + the mean of its 100-frame segment);
- BN-ReLU, mean and (unbiased) std over time, a 1x1 conv to 192 and a BN without affine.

Module names are the 3D-Speaker ones. `folded=False` builds the trained form (each conv followed
by its BatchNorm), which is what gets exported; the exporter folds those BatchNorms into the convs,
so a file holds them as biased convs (the last transition's conv takes the final BN-ReLU's BN),
and that is the form `from_onnx` builds (`folded=True`).
With `lengths`, every conv with a time kernel > 1 sees zeros past a clip's end and every mean
runs over its own frames, so a clip's vector does not depend on what it is batched with.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intone.errors import ModelLoadError
from intone.models.cosyvoice3.onnx_weights import NotThisArchitecture, OnnxGraph, check_shape

SEGMENT = 100  # frames per context segment
INPUTS = ("input",)
OUTPUTS = ("output",)
HEAD_CONVS = 12  # conv1, 2 x (3 + 2) in the residual stages, conv2


@dataclass(frozen=True)
class CamShape:
    feat_dim: int = 80
    head_channels: int = 32
    channels: int = 128
    growth: int = 32
    bottleneck: int = 128
    blocks: tuple = ((12, 3, 1), (24, 3, 2), (16, 3, 2))  # (layers, kernel, dilation)
    embedding: int = 192


def _masked(x: Tensor, keep: Tensor | None) -> Tensor:
    return x if keep is None else x * keep


def _after(conv: nn.Module, norm: nn.Module | None, x: Tensor) -> Tensor:
    x = conv(x)
    return x if norm is None else norm(x)


def _norm(folded: bool, channels: int, two_d: bool = False):
    """The BatchNorm after a conv: kept in the trained form, folded into the conv's bias otherwise."""
    if folded:
        return None
    return nn.BatchNorm2d(channels) if two_d else nn.BatchNorm1d(channels)


class BNReLU(nn.Module):
    def __init__(self, channels: int, affine: bool = True):
        super().__init__()
        self.batchnorm = nn.BatchNorm1d(channels, affine=affine)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.batchnorm(x))


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, folded: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=(stride, 1), padding=1, bias=folded)
        self.bn1 = _norm(folded, cout, True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=folded)
        self.bn2 = _norm(folded, cout, True)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=(stride, 1), bias=folded))
            if not folded:
                self.shortcut.append(nn.BatchNorm2d(cout))

    def forward(self, x: Tensor, keep: Tensor | None) -> Tensor:
        out = F.relu(_after(self.conv1, self.bn1, x))
        out = _after(self.conv2, self.bn2, _masked(out, keep))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class Head(nn.Module):
    def __init__(self, shape: CamShape, folded: bool):
        super().__init__()
        c = shape.head_channels
        self.conv1 = nn.Conv2d(1, c, 3, padding=1, bias=folded)
        self.bn1 = _norm(folded, c, True)
        self.layer1 = nn.Sequential(ResBlock(c, c, 2, folded), ResBlock(c, c, 1, folded))
        self.layer2 = nn.Sequential(ResBlock(c, c, 2, folded), ResBlock(c, c, 1, folded))
        self.conv2 = nn.Conv2d(c, c, 3, stride=(2, 1), padding=1, bias=folded)
        self.bn2 = _norm(folded, c, True)

    def forward(self, x: Tensor, keep: Tensor | None) -> Tensor:
        keep = None if keep is None else keep[:, :, None, :]  # [B, 1, 1, T]
        out = F.relu(_after(self.conv1, self.bn1, _masked(x[:, None], keep)))
        for block in (*self.layer1, *self.layer2):
            out = block(_masked(out, keep), keep)
        out = F.relu(_after(self.conv2, self.bn2, _masked(out, keep)))
        return out.flatten(1, 2)  # [B, C * F / 8, T]


def _time_mean(x: Tensor, keep: Tensor | None, lengths: Tensor | None) -> Tensor:
    if keep is None:
        return x.mean(-1, keepdim=True)
    return (x * keep).sum(-1, keepdim=True) / lengths[:, None, None]


def _segment_mean(x: Tensor, keep: Tensor | None, lengths: Tensor | None) -> Tensor:
    """Each frame gets the mean of its 100-frame segment (the last one partial)."""
    frames = x.shape[-1]
    if keep is None:
        seg = F.avg_pool1d(x, kernel_size=SEGMENT, stride=SEGMENT, ceil_mode=True)
    else:
        count = -(-frames // SEGMENT)
        sums = F.pad(x * keep, (0, count * SEGMENT - frames)).unflatten(-1, (count, SEGMENT)).sum(-1)
        starts = torch.arange(count, device=x.device) * SEGMENT
        sizes = (lengths[:, None] - starts[None, :]).clamp(1, SEGMENT).to(x.dtype)
        seg = sums / sizes[:, None, :]
    return seg[..., None].expand(*seg.shape, SEGMENT).flatten(-2)[..., :frames]


class CAMLayer(nn.Module):
    def __init__(self, channels: int, growth: int, kernel: int, dilation: int):
        super().__init__()
        self.linear_local = nn.Conv1d(channels, growth, kernel, padding=(kernel - 1) // 2 * dilation,
                                      dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(channels, channels // 2, 1)
        self.linear2 = nn.Conv1d(channels // 2, growth, 1)

    def forward(self, x: Tensor, keep, lengths) -> Tensor:
        y = self.linear_local(_masked(x, keep))
        context = _time_mean(x, keep, lengths) + _segment_mean(x, keep, lengths)
        return y * torch.sigmoid(self.linear2(F.relu(self.linear1(context))))


class DenseTDNNLayer(nn.Module):
    def __init__(self, cin: int, shape: CamShape, kernel: int, dilation: int, folded: bool):
        super().__init__()
        self.nonlinear1 = BNReLU(cin)
        self.linear1 = nn.Conv1d(cin, shape.bottleneck, 1, bias=folded)
        self.nonlinear2 = None if folded else BNReLU(shape.bottleneck)
        self.cam_layer = CAMLayer(shape.bottleneck, shape.growth, kernel, dilation)

    def forward(self, x: Tensor, keep, lengths) -> Tensor:
        h = self.linear1(self.nonlinear1(x))
        h = F.relu(h) if self.nonlinear2 is None else self.nonlinear2(h)
        return self.cam_layer(h, keep, lengths)


class DenseBlock(nn.Module):
    def __init__(self, cin: int, layers: int, kernel: int, dilation: int, shape: CamShape, folded: bool):
        super().__init__()
        for i in range(layers):
            self.add_module(f"tdnnd{i + 1}", DenseTDNNLayer(cin + i * shape.growth, shape, kernel, dilation, folded))

    def forward(self, x: Tensor, keep, lengths) -> Tensor:
        for layer in self.children():
            x = torch.cat([x, layer(x, keep, lengths)], dim=1)
        return x


class Transit(nn.Module):
    def __init__(self, cin: int, cout: int, bias: bool = False):
        super().__init__()
        self.nonlinear = BNReLU(cin)
        self.linear = nn.Conv1d(cin, cout, 1, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.nonlinear(x))


class TDNN(nn.Module):
    def __init__(self, cin: int, cout: int, folded: bool):
        super().__init__()
        self.linear = nn.Conv1d(cin, cout, 5, stride=2, padding=2, bias=folded)
        self.nonlinear = None if folded else BNReLU(cout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.linear(x)
        return F.relu(x) if self.nonlinear is None else self.nonlinear(x)


class Dense(nn.Module):
    def __init__(self, cin: int, cout: int, folded: bool):
        super().__init__()
        self.linear = nn.Conv1d(cin, cout, 1, bias=False)
        self.nonlinear = nn.Module()
        # the trained BN has no affine; a loaded one takes whatever scale and shift the file holds
        self.nonlinear.batchnorm = nn.BatchNorm1d(cout, affine=folded)

    def forward(self, x: Tensor) -> Tensor:
        return self.nonlinear.batchnorm(self.linear(x[..., None])[..., 0])


class XVector(nn.Module):
    def __init__(self, shape: CamShape, folded: bool):
        super().__init__()
        channels = shape.head_channels * (shape.feat_dim // 8)
        self.tdnn = TDNN(channels, shape.channels, folded)
        channels = shape.channels
        for i, (layers, kernel, dilation) in enumerate(shape.blocks):
            self.add_module(f"block{i + 1}", DenseBlock(channels, layers, kernel, dilation, shape, folded))
            channels += layers * shape.growth
            last = i + 1 == len(shape.blocks)  # its conv takes the final BN once folded
            self.add_module(f"transit{i + 1}", Transit(channels, channels // 2, bias=folded and last))
            channels //= 2
        self.out_nonlinear = None if folded else BNReLU(channels)
        self.dense = Dense(2 * channels, shape.embedding, folded)
        self.depth = len(shape.blocks)

    def forward(self, x: Tensor, keep, lengths) -> Tensor:
        x = self.tdnn(_masked(x, keep))
        if lengths is not None:
            lengths = (lengths - 1) // 2 + 1
            keep = (torch.arange(x.shape[-1], device=x.device)[None, :] < lengths[:, None]).to(x.dtype)[:, None]
        for i in range(1, self.depth + 1):
            x = getattr(self, f"transit{i}")(getattr(self, f"block{i}")(x, keep, lengths))
        x = F.relu(x) if self.out_nonlinear is None else self.out_nonlinear(x)
        mean = _time_mean(x, keep, lengths)
        if keep is None:
            std = x.std(dim=-1)
        else:
            std = (((x - mean) * keep) ** 2).sum(-1).div(lengths[:, None] - 1).sqrt()
        return self.dense(torch.cat([mean[..., 0], std], dim=-1))


class CamPPlusNet(nn.Module):
    """forward(fbank [B, T, feat_dim], lengths [B] or None) -> [B, embedding]."""

    def __init__(self, shape: CamShape = CamShape(), folded: bool = True):
        super().__init__()
        self.shape = shape
        self.head = Head(shape, folded)
        self.xvector = XVector(shape, folded)

    def forward(self, feats: Tensor, lengths: Tensor | None = None) -> Tensor:
        keep = None
        if lengths is not None:
            lengths = lengths.to(torch.int64)
            keep = (torch.arange(feats.shape[1], device=feats.device)[None, :] < lengths[:, None]).to(feats.dtype)
            keep = keep[:, None]  # [B, 1, T]
        x = self.head(feats.transpose(1, 2), keep)
        return self.xvector(x, keep, lengths)


# ---------------------------------------------------------------------------------------------
# weights: random, from the official file, to a file like it


def random_campplus(shape: CamShape = CamShape(), seed: int = 0, device="cpu", folded: bool = True) -> CamPPlusNet:
    """Random weights from `seed`: He-scaled convs, BatchNorms near identity."""
    with torch.device("meta"):
        net = CamPPlusNet(shape, folded)
    net.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(int(seed))

    def noise(t: Tensor) -> Tensor:
        return torch.randn(t.shape, generator=g, device=device)

    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.Conv1d, nn.Conv2d)):
                m.weight.copy_(noise(m.weight) * (2.0 / m.weight[0].numel()) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(0.1 * noise(m.bias))
            elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                if m.affine:
                    m.weight.copy_(1.0 + 0.1 * noise(m.weight))
                    m.bias.copy_(0.1 * noise(m.bias))
                m.running_mean.copy_(0.1 * noise(m.running_mean))
                m.running_var.copy_(0.75 + 0.5 * torch.rand(m.running_var.shape, generator=g, device=device))
                m.num_batches_tracked.zero_()
    return net.eval()


def _param_ops(graph: OnnxGraph) -> list[dict]:
    """The graph's Conv and BatchNormalization nodes in order, a BatchNorm that is the only
    consumer of a Conv folded into it (the file may be exported either way)."""
    ops, by_output = [], {}
    for node in graph.nodes:
        if node.op_type == "Conv":
            w_name, w = graph.input_constant(node, 1, "a convolution weight")
            has_bias = len(node.input) > 2 and node.input[2]
            bias = graph.input_constant(node, 2, "a convolution bias") if has_bias else None
            op = dict(kind="conv", node=node, names=[w_name], weight=w, bias=bias[1] if bias else None,
                      dilation=list(graph.attr(node, "dilations", [1])), stride=list(graph.attr(node, "strides", [1])))
            if bias:
                op["names"].append(bias[0])
            ops.append(op)
            by_output[node.output[0]] = op
        elif node.op_type == "BatchNormalization":
            names, arrays = zip(*(graph.input_constant(node, i, "a batch-norm tensor") for i in range(1, 5)))
            eps = float(graph.attr(node, "epsilon", 1e-5))
            conv = by_output.get(node.input[0])
            if conv is not None and len(graph.consumers(node.input[0])) == 1:
                _fold_into(conv, arrays, eps)
                conv["names"] += list(names)
                by_output[node.output[0]] = conv
                continue
            ops.append(dict(kind="bn", node=node, names=list(names), arrays=arrays, eps=eps))
    return ops


def _fold_into(conv: dict, bn: tuple, eps: float) -> None:
    scale, shift, mean, var = (a.astype(np.float64) for a in bn)
    factor = scale / np.sqrt(var + eps)
    bias = conv["bias"].astype(np.float64) if conv["bias"] is not None else 0.0
    shape = (-1,) + (1,) * (conv["weight"].ndim - 1)
    conv["weight"] = (conv["weight"].astype(np.float64) * factor.reshape(shape)).astype(np.float32)
    conv["bias"] = ((bias - mean) * factor + shift).astype(np.float32)


def _infer_shape(ops: list[dict]) -> CamShape:
    """Read the layer counts and widths off the op sequence; NotThisArchitecture if it is not CAM++."""
    kinds = "".join("c" if op["kind"] == "conv" else "n" for op in ops)
    if not kinds.startswith("c" * (HEAD_CONVS + 1)) or any(op["weight"].ndim != 4 for op in ops[:HEAD_CONVS]):
        raise NotThisArchitecture("the op sequence does not start with CAM++'s 2-D head and TDNN")
    head, tdnn = ops[0]["weight"], ops[HEAD_CONVS]["weight"]
    if tdnn.ndim != 3 or tdnn.shape[2] != 5 or ops[HEAD_CONVS]["stride"] != [2]:
        raise NotThisArchitecture("no kernel-5 stride-2 TDNN after the head")
    blocks, layers, p = [], 0, HEAD_CONVS + 1
    local = bottleneck = None
    while kinds[p:p + 2] == "nc":
        if kinds[p:p + 5] == "ncccc" and ops[p + 1]["bias"] is not None and ops[p + 2]["bias"] is None:
            bottleneck, local = ops[p + 1]["weight"], ops[p + 2]  # a dense layer
            layers, p = layers + 1, p + 5
        elif layers:  # a transition; the last one has the final BatchNorm folded in
            blocks.append((layers, local["weight"].shape[2], local["dilation"][0]))
            layers, p = 0, p + 2
            if ops[p - 1]["bias"] is not None:
                break
        else:
            break
    if not blocks or layers or ops[p - 1]["bias"] is None or kinds[p:] != "cn":
        raise NotThisArchitecture("the op sequence after the TDNN is not CAM++'s dense blocks and pooling")
    feat_dim = tdnn.shape[1] // head.shape[0] * 8
    return CamShape(feat_dim=feat_dim, head_channels=head.shape[0], channels=tdnn.shape[0],
                    growth=local["weight"].shape[0], bottleneck=bottleneck.shape[0], blocks=tuple(blocks),
                    embedding=ops[p]["weight"].shape[0])


def _slots(net: CamPPlusNet) -> list[tuple[str, nn.Module]]:
    """(name, module) of every conv and BatchNorm, in the order a forward pass calls them."""
    order, hooks = [], []
    names = {m: n for n, m in net.named_modules()}
    for module in net.modules():
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d)):
            hooks.append(module.register_forward_hook(lambda m, i, o: order.append((names[m], m))))
    try:
        with torch.no_grad():
            net(torch.zeros(1, 2 * SEGMENT, net.shape.feat_dim))
    finally:
        for h in hooks:
            h.remove()
    return order


def campplus_from_onnx(graph: OnnxGraph) -> CamPPlusNet:
    """The torch port with the weights of `graph`. Raises NotThisArchitecture for another network,
    ModelLoadError naming the file and tensor for a missing or mis-shaped one."""
    if len(graph.input_names) != 1:
        raise NotThisArchitecture(f"{len(graph.input_names)} inputs, CAM++ takes 1")
    ops = _param_ops(graph)
    shape = _infer_shape(ops)
    net = random_campplus(shape, folded=True)  # every tensor is overwritten below
    slots = _slots(net)
    if len(slots) != len(ops):
        raise ModelLoadError(f"{graph.path}: {len(ops)} convolutions and batch norms, the CAM++ of these "
                             f"sizes has {len(slots)}")
    with torch.no_grad():
        for (name, module), op in zip(slots, ops):
            _assign(graph.path, name, module, op)
    return net.eval()


def _assign(path: Path, name: str, module: nn.Module, op: dict) -> None:
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if op["kind"] != "conv" or (op["bias"] is None) != (module.bias is None):
            raise ModelLoadError(f"{path}: node {op['node'].name!r} does not match our {name!r}")
        module.weight.copy_(torch.from_numpy(check_shape(path, op["names"][0], f"{name}.weight", op["weight"],
                                                         module.weight.shape)))
        if module.bias is not None:
            module.bias.copy_(torch.from_numpy(check_shape(path, op["names"][1], f"{name}.bias", op["bias"],
                                                           module.bias.shape)))
        return
    if op["kind"] != "bn":
        raise ModelLoadError(f"{path}: node {op['node'].name!r} does not match our batch norm {name!r}")
    targets = [module.weight, module.bias, module.running_mean, module.running_var]
    for target, onnx_name, array, part in zip(targets, op["names"], op["arrays"], ("weight", "bias", "mean", "var")):
        if target is not None:
            target.copy_(torch.from_numpy(check_shape(path, onnx_name, f"{name}.{part}", array.astype(np.float32),
                                                      target.shape)))
    module.eps = op["eps"]


def export_campplus(net: CamPPlusNet, path: str | Path, frames: int = 150) -> Path:
    """Write `net` (best the trained form, as the official file was) as ONNX with the official
    input and output; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    axes = {"input": {0: "batch", 1: "frames"}, "output": {0: "batch"}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter announces its deprecation
        torch.onnx.export(net.cpu().eval(), (torch.zeros(1, frames, net.shape.feat_dim),), str(path),
                          input_names=list(INPUTS), output_names=list(OUTPUTS), dynamic_axes=axes,
                          opset_version=17, dynamo=False)
    return path
