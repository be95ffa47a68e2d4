"""oneDNN-packed linears (model/cpu_linear.py): the same function as nn.Linear, only where it is meant to apply."""

import pytest
import torch
from torch import nn

from model.cpu_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_large_weight_equals_nn_linear(rows):
    torch.manual_seed(0)
    linear = nn.Linear(640, 4096, bias=False)  # 10 MiB, past any cache
    x = torch.randn(rows, 640)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=1e-4, rtol=1e-4)


def test_pack_linears_replaces_plain_linears_only():
    class RowParallel(nn.Linear):  # stands for RowParallelLinear: it all-reduces, so it must stay
        pass

    model = nn.Sequential(nn.Linear(8, 8), RowParallel(8, 8), nn.Sequential(nn.Linear(8, 4)))
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and type(model[1]) is RowParallel
    assert isinstance(model[2][0], PackedLinear)


def test_packing_applies_to_float32_on_cpu_within_the_memory_limit():
    model = nn.Sequential(nn.Linear(8, 8))
    assert can_pack(model, torch.device("cpu"), torch.float32)
    assert not can_pack(model, torch.device("cpu"), torch.float64)
    assert not can_pack(model, torch.device("cuda"), torch.float32)
