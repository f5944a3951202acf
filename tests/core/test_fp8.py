"""``core.fp8``: row-wise e4m3 quantization against a reference written from the dtype's definition
(the 256 bit patterns enumerated, the nearest value taken, ties to the even mantissa), and the
emulated scaled matmul against PyTorch's own ``torch._scaled_mm`` (its CPU kernel)."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.core import fp8


def _reference_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` (|x| <= 448) -> the nearest finite e4m3fn value; a tie goes to the pattern
    whose last mantissa bit is 0; the sign of a zero is kept."""
    bits = torch.arange(256, dtype=torch.uint8)
    values = bits.view(torch.float8_e4m3fn).double()
    finite = values.isfinite()
    values, bits = values[finite], bits[finite]
    dist = (x.reshape(-1, 1) - values).abs()
    best = dist.min(dim=1, keepdim=True).values
    ties = dist == best
    even = ties & (bits % 2 == 0)
    pick = torch.where(even.any(dim=1, keepdim=True), even, ties).float().argmax(dim=1)
    out = values[pick].reshape(x.shape)
    return torch.where(out == 0, x * 0, out)


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 96, generator=g, dtype=torch.float64) * torch.logspace(-5, 3, 12, dtype=torch.float64)[:, None]
    x[2] = 0
    x[3, :4] = torch.tensor([-1e-12, 1e-12, -0.0, 3.0])
    return x.float()


def test_quantize_rows_equals_the_definition():
    x = _rows()
    q, scale_inv = fp8.quantize_rows(x)
    amax = x.double().abs().amax(dim=1)
    scale = torch.where(amax > 0, 448 / amax, torch.ones_like(amax)).float()  # one float32 division
    assert torch.equal(scale_inv, scale.reciprocal())
    scaled = (x * scale[:, None]).double().clamp(-448, 448)  # the float32 product, as the path forms it
    expected = _reference_e4m3(scaled)
    assert torch.equal(q.double(), expected)
    assert torch.equal(q.double().signbit(), expected.signbit())
    assert q.float().abs().amax(dim=1)[torch.arange(12) != 2].eq(448).all()  # each row's max is 448


def test_ties_round_to_even():
    values = torch.tensor([1.0, 1.125, 1.25, 448.0])
    mids = torch.tensor([[1.0625, 1.1875, 448.0]])  # 1.0625: between 1 (even) and 1.125 (odd)
    q, _ = fp8.quantize_rows(mids)
    assert q.float().tolist() == [[1.0, 1.25, 448.0]]
    assert values.to(torch.float8_e4m3fn).float().tolist() == values.tolist()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_emulated_matmul_is_torch_scaled_mm(out_dtype):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 64, generator=g), torch.randn(48, 64, generator=g) * 0.05
    xq, sx = fp8.quantize_rows(x)
    wq, sw = fp8.quantize_rows(w)
    emulated = fp8.scaled_mm_emulated(xq, sx, wq, sw, out_dtype)
    scaled = fp8.scaled_mm_torch(xq, sx, wq, sw, out_dtype)
    assert emulated.dtype == scaled.dtype == out_dtype
    torch.testing.assert_close(emulated, scaled, rtol=1e-6, atol=1e-6)
    exact = (xq.double() * sx.double()[:, None]) @ (wq.double() * sw.double()[:, None]).t()
    torch.testing.assert_close(emulated.double(), exact, rtol=1e-5 if out_dtype == torch.float32 else 8e-3, atol=1e-6)
    assert (emulated.double() - x.double() @ w.double().t()).abs().max() > 1e-4  # FP8 is not exact


def test_fp8_linear_shapes_bias_and_error():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 5, 32, generator=g), torch.randn(16, 32, generator=g), torch.randn(16, generator=g)
    wq, sw = fp8.quantize_rows(w)
    out = fp8.fp8_linear(x.bfloat16(), wq, sw, b.bfloat16(), fp8.scaled_mm_emulated)
    assert out.shape == (3, 5, 16) and out.dtype == torch.bfloat16
    ref = x @ w.t() + b
    rel = (out.float() - ref).norm() / ref.norm()
    assert 1e-3 < rel < 0.08, rel  # two e4m3 roundings (2^-4 relative at most) on random data
    assert fp8.scaled_mm_fits(torch.Size([48, 64]), torch.device("cpu"))
    assert fp8.scaled_mm_fits(torch.Size([40, 24]), torch.device("cpu"))
    assert not fp8.scaled_mm_fits(torch.Size([40, 24]), torch.device("cuda"))
