"""The CPU widening of DeepSeek-V4 attention's products (hetmoe/layers/compressed_attention.py ``matmul``,
``einsum``, ``GroupedLinear`` for a prefill's rows): the same values as PyTorch's bf16 products, within the one
rounding both make (fp32 sums in another order)."""

from __future__ import annotations

import pytest
import torch

from hetmoe.layers.compressed_attention import WIDEN_ROWS, GroupedLinear, einsum, matmul


def _close(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape
    # one bf16 rounding of an fp32 sum: half an ulp of each value, 2^-8 relative
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-8 + 1e-6).all()


def test_matmul_and_einsum_equal_the_bf16_products():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(2, 4, 40, 64, generator=g).bfloat16()
    b = torch.randn(2, 1, 64, 33, generator=g).bfloat16()  # broadcast over the heads, as the window keys are
    _close(matmul(a, b), torch.matmul(a, b))
    e = torch.randn(2, 40, 7, 64, generator=g).bfloat16()  # per-query entries
    _close(einsum("bhsd,bskd->bhsk", a, e), torch.einsum("bhsd,bskd->bhsk", a, e))
    f = torch.randn(3, 5, dtype=torch.float32, generator=g)
    assert torch.equal(matmul(f, f.T), torch.matmul(f, f.T))  # fp32: PyTorch's own product


@pytest.mark.parametrize("rows", [1, WIDEN_ROWS - 1, WIDEN_ROWS, 3 * WIDEN_ROWS + 5])
def test_grouped_linear_rows_either_side_of_the_widening(rows):
    g = torch.Generator().manual_seed(rows)
    layer = GroupedLinear(64, 4 * 24, 4)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4 * 24, 64, generator=g))
    layer = layer.bfloat16()
    x = torch.randn(rows, 4, 64, generator=g).bfloat16()
    w = layer.weight.view(4, 24, 64)
    want = torch.einsum("rgi,goi->rgo", x.float(), w.float())  # each group's block of rows, in fp32
    with torch.no_grad():
        got = layer(x)
    assert got.shape == (rows, 4, 24) and got.dtype == torch.bfloat16
    if rows >= WIDEN_ROWS:  # fp32 sums rounded once
        _close(got, want.bfloat16())
    else:  # PyTorch's bf16 product, which may round more than once
        assert (got.float() - want).abs().max() <= 2**-7 * want.abs().max()
