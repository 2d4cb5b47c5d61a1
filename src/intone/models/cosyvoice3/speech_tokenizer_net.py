"""S3Tokenizer v3 (`speech_tokenizer_v3.onnx`) in torch: whisper log-mel [B, 128, T] -> 25 Hz speech tokens.

The network (public: the v2 encoder of xingchensong/S3Tokenizer; v3 has 12 blocks instead of 6):

- two convolutions (kernel 3, stride 2, padding 1, GELU) on the length-masked input: T -> ceil(T / 4);
- pre-norm blocks, x + attn(LN(x)) then x + MLP(LN(x)) (GELU, 4x), where attention has rotary
  positions (half rotation, head size 64, base 10000) on queries and keys, no key bias, and an
  FSMN memory added to its output: a centred depthwise convolution (kernel 31) over the masked
  values, plus the values, masked again;
- FSQ: a projection to 8 numbers, tanh * 0.999, rounded to {-1, 0, 1}, read as 8 base-3 digits.

Padding frames are masked before every convolution and as attention keys, so a clip's tokens do
not depend on what it is batched with. Module names follow the exported graph (`/blocks.N/attn/
query/MatMul`, `quantizer.project_in`), so `from_onnx` can read the official file and `export`
writes a file with the same naming.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intone.errors import ModelLoadError
from intone.models.checkpoint import load_strict
from intone.models.cosyvoice3.onnx_weights import NotThisArchitecture, OnnxGraph, check_shape

FSQ_DIGITS = 8
FSQ_LEVELS = 3
HEAD_DIM = 64  # fixed by the rotary table of the official code
ROPE_BASE = 10000.0
INPUTS = ("feats", "feats_length")
OUTPUTS = ("indices",)


@dataclass(frozen=True)
class TokenizerShape:
    n_mels: int = 128
    dim: int = 1280
    layers: int = 12
    mlp: int = 5120
    fsmn_kernel: int = 31

    @property
    def heads(self) -> int:
        return self.dim // HEAD_DIM


class _Linear(nn.Linear):
    """Weights follow the input's dtype, as the official layers do (their exported weights get
    generated `onnx::MatMul_*` / `onnx::Add_*` names because of that cast)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class _Conv1d(nn.Conv1d):
    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def _valid(lengths: Tensor, frames: int) -> Tensor:
    """[B, frames] bool, True on each clip's own frames."""
    return torch.arange(frames, device=lengths.device)[None, :] < lengths.to(torch.int64)[:, None]


def _halved(lengths: Tensor) -> Tensor:
    return (lengths - 1) // 2 + 1  # kernel 3, stride 2, padding 1


def _rope(frames: int, device) -> tuple[Tensor, Tensor]:
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    angles = torch.outer(torch.arange(frames, device=device).float(), inv)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1)[None, :, None, :], torch.cat([sin, sin], -1)[None, :, None, :]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class FsmnAttention(nn.Module):
    def __init__(self, shape: TokenizerShape):
        super().__init__()
        d = shape.dim
        self.heads = shape.heads
        self.query, self.key = _Linear(d, d), _Linear(d, d, bias=False)
        self.value, self.out = _Linear(d, d), _Linear(d, d)
        self.fsmn_block = nn.Conv1d(d, d, shape.fsmn_kernel, groups=d, bias=False)
        left = (shape.fsmn_kernel - 1) // 2
        self.pads = (left, shape.fsmn_kernel - 1 - left)

    def forward(self, x: Tensor, keep: Tensor, attend: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        b, t, d = x.shape
        q = _rotate(self.query(x).view(b, t, self.heads, -1), *rope)
        k = _rotate(self.key(x).view(b, t, self.heads, -1), *rope)
        v = self.value(x)
        masked = v * keep
        memory = (self.fsmn_block(F.pad(masked.transpose(1, 2), self.pads)).transpose(1, 2) + masked) * keep
        heads = [z.transpose(1, 2) for z in (q, k, v.view(b, t, self.heads, -1))]
        att = F.scaled_dot_product_attention(*heads, attn_mask=attend)
        return self.out(att.transpose(1, 2).reshape(b, t, d)) + memory


class Block(nn.Module):
    def __init__(self, shape: TokenizerShape):
        super().__init__()
        self.attn = FsmnAttention(shape)
        self.attn_ln = nn.LayerNorm(shape.dim, eps=1e-6)
        self.mlp = nn.Sequential(_Linear(shape.dim, shape.mlp), nn.GELU(), _Linear(shape.mlp, shape.dim))
        self.mlp_ln = nn.LayerNorm(shape.dim, eps=1e-5)

    def forward(self, x: Tensor, keep: Tensor, attend: Tensor, rope) -> Tensor:
        x = x + self.attn(self.attn_ln(x), keep, attend, rope)
        return x + self.mlp(self.mlp_ln(x))


class Fsq(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.project_in = nn.Linear(dim, FSQ_DIGITS)

    def forward(self, x: Tensor) -> Tensor:
        digits = torch.round(torch.tanh(self.project_in(x).float()) * 0.999) + 1.0
        place = FSQ_LEVELS ** torch.arange(FSQ_DIGITS, device=x.device, dtype=torch.float32)
        return (digits * place).sum(-1)  # exact in float32: < 3 ** 8


class SpeechTokenizerNet(nn.Module):
    """forward(feats [B, n_mels, T], feats_length [B]) -> int32 indices [B, ceil(T / 4)] (the file's
    signature); `tokenize` also returns each clip's token count."""

    def __init__(self, shape: TokenizerShape = TokenizerShape()):
        super().__init__()
        self.shape = shape
        self.conv1 = _Conv1d(shape.n_mels, shape.dim, 3, stride=2, padding=1)
        self.conv2 = _Conv1d(shape.dim, shape.dim, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.quantizer = Fsq(shape.dim)

    def forward(self, feats: Tensor, feats_length: Tensor) -> Tensor:
        return self.tokenize(feats, feats_length)[0].to(torch.int32)

    def tokenize(self, feats: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        x = feats * _valid(lengths, feats.shape[-1])[:, None, :].to(feats.dtype)
        lengths = _halved(lengths)
        x = F.gelu(self.conv1(x))
        x = x * _valid(lengths, x.shape[-1])[:, None, :].to(x.dtype)
        lengths = _halved(lengths)
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, T', dim]
        valid = _valid(lengths, x.shape[1])
        keep, attend = valid[:, :, None].to(x.dtype), valid[:, None, None, :]
        rope = _rope(x.shape[1], x.device)
        for block in self.blocks:
            x = block(x, keep, attend, rope)
        return self.quantizer(x).to(torch.int64), lengths


# ---------------------------------------------------------------------------------------------
# weights: random, from the official file, to a file like it


def random_speech_tokenizer(shape: TokenizerShape = TokenizerShape(), seed: int = 0,
                            device="cpu") -> SpeechTokenizerNet:
    """Random weights from `seed` (scaled so activations stay O(1) and the codes vary)."""
    with torch.device("meta"):
        net = SpeechTokenizerNet(shape)
    net.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(int(seed))
    with torch.no_grad():
        for name, p in net.named_parameters():
            noise = torch.randn(p.shape, generator=g, device=device)
            if name.endswith("_ln.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                gain = 2.0 if "quantizer" in name else 1.0
                p.copy_(noise * (gain / p[0].numel() ** 0.5))
    return net.eval()


_BLOCK = re.compile(r"^/blocks\.(\d+)/")


def _block_count(graph: OnnxGraph) -> int:
    found = {int(m.group(1)) for n in graph.nodes if (m := _BLOCK.match(n.name))}
    if not found or len(graph.input_names) != 2:
        raise NotThisArchitecture("no /blocks.N/ nodes of the S3Tokenizer encoder")
    missing = sorted(set(range(max(found) + 1)) - found)
    if missing:
        raise ModelLoadError(f"{graph.path}: the speech tokenizer has no nodes for block {missing[0]}")
    return max(found) + 1


def _input_convs(graph: OnnxGraph) -> list:
    convs = [n for n in graph.nodes
             if n.op_type == "Conv" and not _BLOCK.match(n.name) and graph.attr(n, "group", 1) == 1]
    if len(convs) != 2:
        raise NotThisArchitecture(f"{len(convs)} convolutions before the blocks, expected 2")
    for n in convs:
        if (list(graph.attr(n, "strides", [1])), list(graph.attr(n, "pads", [0, 0]))) != ([2], [1, 1]):
            raise NotThisArchitecture(f"convolution {n.name!r} is not kernel 3 / stride 2 / padding 1")
    return convs


def _quantizer_nodes(graph: OnnxGraph) -> tuple:
    """(MatMul, Add) of the FSQ projection: the Add of `quantizer.project_in.bias` (or in the
    /quantizer/ scope) whose other input is a MatMul."""
    found = []
    for n in graph.nodes:
        if n.op_type != "Add" or not ("quantizer.project_in.bias" in n.input or n.name.startswith("/quantizer/")):
            continue
        made = [graph.producer(i) for i in n.input if not graph.is_constant(i)]
        if len(made) == 1 and made[0] is not None and made[0].op_type == "MatMul":
            found.append((made[0], n))
    if len(found) != 1:
        raise ModelLoadError(f"{graph.path}: cannot find the quantizer projection (tensor "
                             "'quantizer.project_in.bias' and its MatMul)")
    return found[0]


def _named(graph: OnnxGraph, node_name: str, torch_name: str):
    node = graph.node(node_name)
    if node is None:
        raise ModelLoadError(f"{graph.path}: no node {node_name!r}, which holds tensor {torch_name!r}")
    return node


def _block_entries(graph: OnnxGraph, i: int):
    """(torch name, onnx name, array, transpose) for block i, and its two LayerNorm epsilons."""
    out, eps = [], {}
    for proj in ("query", "key", "value", "out"):
        out.append(("matmul", f"blocks.{i}.attn.{proj}.weight", f"/blocks.{i}/attn/{proj}/MatMul"))
        if proj != "key":
            out.append(("add", f"blocks.{i}.attn.{proj}.bias", f"/blocks.{i}/attn/{proj}/Add"))
    out.append(("conv", f"blocks.{i}.attn.fsmn_block.weight", f"/blocks.{i}/attn/fsmn_block/Conv"))
    for layer in ("mlp.0", "mlp.2"):
        out.append(("matmul", f"blocks.{i}.{layer}.weight", f"/blocks.{i}/mlp/{layer}/MatMul"))
        out.append(("add", f"blocks.{i}.{layer}.bias", f"/blocks.{i}/mlp/{layer}/Add"))
    entries = []
    for kind, torch_name, node_name in out:
        node = _named(graph, node_name, torch_name)
        if kind == "conv":
            entries.append((torch_name, *graph.input_constant(node, 1, torch_name), False))
        else:
            entries.append((torch_name, *graph.only_constant_input(node, torch_name), kind == "matmul"))
    for ln in ("attn_ln", "mlp_ln"):
        node = _named(graph, f"/blocks.{i}/{ln}/LayerNormalization", f"blocks.{i}.{ln}.weight")
        entries.append((f"blocks.{i}.{ln}.weight", *graph.input_constant(node, 1, f"blocks.{i}.{ln}.weight"), False))
        entries.append((f"blocks.{i}.{ln}.bias", *graph.input_constant(node, 2, f"blocks.{i}.{ln}.bias"), False))
        eps[f"blocks.{i}.{ln}"] = float(graph.attr(node, "epsilon", 1e-5))
    return entries, eps


def speech_tokenizer_from_onnx(graph: OnnxGraph) -> SpeechTokenizerNet:
    """The torch port with the weights of `graph`. Raises NotThisArchitecture for another network,
    ModelLoadError naming the file and tensor for a missing or mis-shaped one."""
    layers = _block_count(graph)
    entries, eps = [], {}
    for conv, name in zip(_input_convs(graph), ("conv1", "conv2")):
        entries.append((f"{name}.weight", *graph.input_constant(conv, 1, f"{name}.weight"), False))
        entries.append((f"{name}.bias", *graph.input_constant(conv, 2, f"{name}.bias"), False))
    for i in range(layers):
        block, block_eps = _block_entries(graph, i)
        entries += block
        eps.update(block_eps)
    matmul, add = _quantizer_nodes(graph)
    for node, part, transpose in ((matmul, "weight", True), (add, "bias", False)):
        name = f"quantizer.project_in.{part}"
        entries.append((name, *graph.only_constant_input(node, name), transpose))

    arrays = {t: (o, a.T if transpose and a.ndim == 2 else a) for t, o, a, transpose in entries}
    dim = arrays["conv1.weight"][1].shape[0]
    if dim % HEAD_DIM:
        raise NotThisArchitecture(f"width {dim} is not a multiple of the head size {HEAD_DIM}")
    shape = TokenizerShape(dim=dim, layers=layers, mlp=arrays["blocks.0.mlp.0.weight"][1].shape[0],
                           fsmn_kernel=arrays["blocks.0.attn.fsmn_block.weight"][1].shape[-1])
    with torch.device("meta"):
        net = SpeechTokenizerNet(shape)
    state = {}
    for name, param in net.state_dict().items():
        onnx_name, array = arrays[name]
        state[name] = torch.from_numpy(check_shape(graph.path, onnx_name, name, array, param.shape).astype(np.float32))
    load_strict(net, state, str(graph.path), torch.float32, "cpu")
    for name, value in eps.items():
        net.get_submodule(name).eps = value
    return net.eval()


def export_speech_tokenizer(net: SpeechTokenizerNet, path: str | Path, frames: int = 40) -> Path:
    """Write `net` as an ONNX file with the official inputs, output and naming; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    feats = torch.zeros(1, net.shape.n_mels, frames)
    length = torch.tensor([frames], dtype=torch.int32)
    axes = {"feats": {0: "batch", 2: "frames"}, "feats_length": {0: "batch"}, "indices": {0: "batch", 1: "tokens"}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter announces its deprecation
        torch.onnx.export(net.cpu().eval(), (feats, length), str(path), input_names=list(INPUTS),
                          output_names=list(OUTPUTS), dynamic_axes=axes, opset_version=17, dynamo=False)
    return path
