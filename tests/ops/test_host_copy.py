"""The frontend's and the codec's copies through pinned memory: the bits `.cpu()` and `.to(device)` give, whole
when they return (a later write on the device's stream does not reach the host copy), in pageable memory."""

import pytest
import torch

from intone.ops.host_copy import to_device, to_host


def test_host_tensors_pass_through_untouched():
    a, b = torch.arange(5), torch.ones(2, 3)
    out = to_host(a, b)
    assert out[0] is a and out[1] is b
    assert to_device(a, "cpu") is a


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_device_tensor_comes_back_with_its_bits_and_stays_whole(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(257, 80, device="cuda", generator=g) * 100).to(dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # x is made on the default stream
    with torch.cuda.stream(stream):  # as a frontend worker's or the codec's own stream
        y = x * 1 if dtype != torch.bool else x.clone()
        torch.cuda._sleep(20_000_000)  # the copy waits behind this on the stream
        mixed = to_host(y, torch.arange(3))
        y.zero_()  # after the copy, on the same stream: must not reach it
    host, untouched = mixed
    assert not host.is_cuda and not host.is_pinned() and host.dtype == dtype
    assert torch.equal(host, x.cpu()) and torch.equal(untouched, torch.arange(3))
    back = to_device(host, "cuda")
    assert back.is_cuda and torch.equal(back, x)
