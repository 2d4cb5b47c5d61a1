"""The codec's convolution and activation kernels: the same values as the torch expressions they replace."""

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from intone.ops.dilated_conv import dilated_conv1d


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 3), c_in=st.integers(1, 5), c_out=st.integers(1, 5), kernel=st.integers(1, 7),
       dilation=st.integers(1, 10), extra=st.integers(1, 40), bias=st.booleans(), lead=st.integers(0, 7))
def test_a_dilated_convolution_folded_into_the_batch_gives_the_dilated_sums(rows, c_in, c_out, kernel, dilation,
                                                                            extra, bias, lead):
    """With `left` zeros (a multiple of the dilation) as the folded subsequences' first places: the sums of
    the explicitly left-padded convolution."""
    g = torch.Generator().manual_seed(rows * 1000 + extra)
    length = (kernel - 1) * dilation + extra  # every output length from 1, any remainder mod the dilation
    x = torch.randn(rows, c_in, length, generator=g, dtype=torch.float64)
    w = torch.randn(c_out, c_in, kernel, generator=g, dtype=torch.float64)
    b = torch.randn(c_out, generator=g, dtype=torch.float64) if bias else None
    left = lead * dilation
    got, want = dilated_conv1d(x, w, b, dilation, left), F.conv1d(F.pad(x, (left, 0)), w, b, dilation=dilation)
    assert got.shape == want.shape and got.is_contiguous()
    assert (got - want).abs().max().item() < 1e-12
    if dilation > 1:
        with pytest.raises(ValueError, match="multiple of the dilation"):
            dilated_conv1d(x, w, b, dilation, left + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_snake_with_a_bias_and_the_biased_residual_return_the_torch_expressions(dtype):
    from intone.ops.snake import bias_residual, snake, snake_reference

    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(3, 96, 5000, device="cuda", generator=g) * 3).to(dtype)
    y = (torch.randn(3, 96, 5000, device="cuda", generator=g) * 3).to(dtype)
    alpha = (torch.rand(1, 96, 1, device="cuda", generator=g) * 2 + 0.05).to(dtype)
    bias = torch.randn(96, device="cuda", generator=g).to(dtype)
    ulp = lambda t: torch.finfo(dtype).eps * t.float().abs().clamp(min=1.0)  # noqa: E731
    got, want = snake(x, alpha, bias), snake_reference(x + bias.view(1, -1, 1), alpha)
    assert got.dtype == dtype and ((got.float() - want.float()).abs() <= 2 * ulp(want)).all()
    assert (got == want).float().mean() > 0.5
    assert torch.equal(bias_residual(x, y, bias), x + (y + bias.view(1, -1, 1)))  # two adds, rounded alike


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_kernels_read_strided_slices_and_write_into_a_buffer_bit_for_bit(dtype):
    """What the lean carried decode (codec.lean_decode) asks of the kernels: Snake reading a slice of a
    longer output (no contiguous copy) with that output's bias, writing after a history in a larger
    buffer; the biased residual reading the slice and adding its bias first. The same bits as the
    kernels on contiguous copies with the bias added as torch adds it."""
    from intone.ops.snake import bias_residual, snake

    g = torch.Generator(device="cuda").manual_seed(6)
    full = (torch.randn(2, 48, 3 + 3000 + 5, device="cuda", generator=g) * 3).to(dtype)
    x = full[..., 3: 3003]  # a slice: rows 3008 apart
    y = (torch.randn(2, 48, 3000, device="cuda", generator=g) * 3).to(dtype)
    alpha = (torch.rand(1, 48, 1, device="cuda", generator=g) * 2 + 0.05).to(dtype)
    bias, x_bias = (torch.randn(48, device="cuda", generator=g).to(dtype) for _ in range(2))
    with_bias = x + x_bias.view(1, -1, 1)  # torch's add, as cuDNN's bias pass rounds it
    buffer = torch.full((2, 48, 7 + 3000), float("nan"), device="cuda", dtype=dtype)
    buffer[..., :7] = 1.5
    out = snake(x, alpha, x_bias, out=buffer[..., 7:])
    assert out.data_ptr() == buffer[..., 7:].data_ptr() and (buffer[..., :7] == 1.5).all()
    assert torch.equal(buffer[..., 7:], snake(with_bias.contiguous(), alpha))
    assert torch.equal(snake(x, alpha), snake(x.contiguous(), alpha))
    assert torch.equal(bias_residual(x, y, bias, x_bias), bias_residual(with_bias.contiguous(), y, bias))


@pytest.mark.gpu
def test_the_codec_on_the_gpu_decodes_what_the_stock_layers_decode_on_the_cpu(tiny_cache):
    """float64 on both sides (the Triton kernels stand aside): the folded dilated convolutions and the
    biases moved out of the convolutions change no sum."""
    from intone.models.registry import load_model

    cpu = load_model("tiny:fish-s2", codec_dtype=torch.float64).codec
    gpu = copy.deepcopy(cpu).cuda()
    codes = torch.randint(0, 8, (2, 10, 37), generator=torch.Generator().manual_seed(1))
    want = cpu.decode(codes)
    got = gpu.decode(codes.cuda()).cpu()
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-9


@settings(max_examples=80, deadline=None)
@given(c_in=st.integers(1, 4), c_out=st.integers(1, 4), kernel=st.integers(1, 9), stride=st.integers(1, 4),
       dilation=st.integers(1, 4), length=st.integers(1, 60), groups_of_one=st.booleans())
def test_the_fish_causal_conv_pads_inside_the_convolution_as_its_explicit_padding(c_in, c_out, kernel, stride,
                                                                                 dilation, length, groups_of_one):
    """CausalConv.forward lets the convolution zero-pad (no padded copy of its input) where that gives the
    explicitly padded convolution's outputs: the same values (float64), any kernel, stride and length."""
    from intone.models.fish_s2.codec_modules import CausalConv

    groups = c_in if groups_of_one and c_in == c_out else 1
    conv = CausalConv(c_in, c_out, kernel, stride=stride, dilation=dilation, groups=groups).double()
    x = torch.randn(2, c_in, length, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    pad = conv.span - conv.stride
    frames = -(-(length - conv.span + pad) // stride) + 1
    extra = (frames - 1) * stride + (conv.span - pad) - length
    if pad < 0 or extra < 0:
        return  # a stride past its kernel: not a layer of the codec
    want = conv.valid(F.pad(x, (pad, extra)))
    got = conv(x)
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-12
    if groups == 1 and stride == 1 and dilation > 1:  # CUDA's folded path, its padding the fold's first places
        conv._folds = lambda _x: True
        folded = conv(x)
        assert folded.shape == want.shape and (folded - want).abs().max().item() < 1e-12


@settings(max_examples=80, deadline=None)
@given(left=st.integers(0, 12), right=st.integers(0, 12), kernel=st.integers(1, 7), stride=st.integers(1, 3),
       dilation=st.integers(1, 3), upsample=st.sampled_from([1, 3]), length=st.integers(1, 40))
def test_hifts_padded_convolution_pads_inside_the_convolution_as_its_explicit_padding(left, right, kernel, stride,
                                                                                     dilation, upsample, length):
    """PaddedConv1d: the convolution's own zero padding where the explicit padding's outputs come first;
    the same values as padding a copy (float64)."""
    from intone.models.cosyvoice3.hift_source import PaddedConv1d

    conv = PaddedConv1d(3, 2, kernel, left=left, right=right, stride=stride, dilation=dilation, upsample=upsample,
                        dtype=torch.float64)
    x = torch.randn(2, 3, length, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    up = F.interpolate(x, scale_factor=float(upsample), mode="nearest") if upsample > 1 else x
    if up.shape[-1] + left + right < (kernel - 1) * dilation + 1:
        return  # shorter than the kernel's span: no output either way
    want = F.conv1d(F.pad(up, (left, right)), conv.weight, conv.bias, stride=stride, dilation=dilation)
    got = conv(x)
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-12
