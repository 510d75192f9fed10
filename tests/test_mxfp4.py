"""MXFP4 dequantize/quantize (spec §2.6) against a bit-level reading of the format."""
from __future__ import annotations

import math

import pytest
import torch

from k3_trtllm.mxfp4 import check_mxfp4_pair, dequantize_mxfp4, quantize_mxfp4

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def spec_value(packed_byte: int, high: bool, scale_byte: int) -> float:
    """One element, written from the spec text: pick the nibble, bit 3 is the sign,
    bits 0-2 index the magnitudes, times 2**(scale - 127); scale byte 255 is NaN."""
    nibble = (packed_byte >> 4) if high else (packed_byte & 0xF)
    magnitude = MAGNITUDES[nibble & 0b111]
    sign = -1.0 if nibble & 0b1000 else 1.0
    if scale_byte == 255:
        return math.nan
    return sign * magnitude * 2.0 ** (scale_byte - 127)


def spec_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows_p = packed.reshape(-1, packed.shape[-1]).tolist()
    rows_s = scale.reshape(-1, scale.shape[-1]).tolist()
    out = []
    for row_p, row_s in zip(rows_p, rows_s):
        n = 2 * len(row_p)
        out.append([spec_value(row_p[i // 2], i % 2 == 1, row_s[i // 32]) for i in range(n)])
    return torch.tensor(out, dtype=torch.float64).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


SPECIAL_SCALES = [0, 1, 127, 200, 252, 253, 254, 255]


def every_code_under_special_scales() -> tuple[torch.Tensor, torch.Tensor]:
    """[2, 8, 256] packed: each row holds all 256 byte values (both nibbles take all 16
    codes against every other code), 16 groups per row, scales from SPECIAL_SCALES and
    random bytes; the leading dim checks that batch dims pass through."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.stack([torch.randperm(256, generator=gen) for _ in range(16)]).to(torch.uint8)
    scale = torch.randint(0, 256, (16, 16), generator=gen).to(torch.uint8)
    scale[:8, :] = torch.tensor(SPECIAL_SCALES, dtype=torch.uint8).unsqueeze(-1)
    return packed.view(2, 8, 256), scale.view(2, 8, 16)


def test_dequantize_matches_bit_level_spec():
    packed, scale = every_code_under_special_scales()
    expected = spec_dequantize(packed, scale)
    # fp32: every product is exact in fp32 except the overflow of 3/4/6 * 2**127-ish
    # at bytes 253/254, which the fp64 -> fp32 cast turns into inf as well.
    torch.testing.assert_close(dequantize_mxfp4(packed, scale, torch.float32), expected.to(torch.float32),
                               rtol=0, atol=0, equal_nan=True)
    # bf16 reproduces the fp64 value exactly for every scale byte <= 252 (spec claim).
    bf16 = dequantize_mxfp4(packed, scale, torch.bfloat16).to(torch.float64)
    exact = (scale <= 252).repeat_interleave(32, dim=-1)
    assert torch.equal(bf16[exact], expected[exact])
    assert torch.equal(bf16[~exact].isnan(), expected[~exact].isnan())


def test_dequantize_special_scale_bytes():
    packed = torch.full((1, 16), 0x21, dtype=torch.uint8)  # even: code 1 (0.5), odd: code 2 (1.0)
    for byte, expected_even in ((0, 2.0 ** -128), (127, 0.5), (200, 2.0 ** 72)):
        out = dequantize_mxfp4(packed, torch.tensor([[byte]], dtype=torch.uint8), torch.bfloat16)
        # byte 0 is 2**-127, not zero: 0.5 * 2**-127 is a (nonzero) bf16 subnormal
        assert out[0, 0].item() == expected_even > 0 and out[0, 1].item() == 2 * expected_even
    nan = dequantize_mxfp4(torch.zeros(1, 16, dtype=torch.uint8), torch.tensor([[255]], dtype=torch.uint8))
    assert nan.isnan().all()  # NaN scale poisons even zero codes


def test_quantize_rounding_rule():
    # Group max 7 -> e = floor(log2 7) - 2 = 0, so the grid is E2M1 itself: check ties
    # to even, saturation and the sign of values that round to zero.
    values = [7.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.5, 0.0, -0.0, 0.3, 2.9]
    expected_codes = [7, 0, 2, 2, 4, 4, 6, 6, 8, 15, 0, 8, 1, 5]
    w = torch.zeros(32, dtype=torch.float32)
    w[: len(values)] = torch.tensor(values)
    packed, scale = quantize_mxfp4(w)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(32)
    assert scale.tolist() == [127]
    assert codes[: len(values)].tolist() == expected_codes
    # An all-zero group takes the smallest scale (e clamps at -127); tiny groups clamp too.
    assert quantize_mxfp4(torch.zeros(2, 32))[1].tolist() == [[0], [0]]
    tiny_packed, tiny_scale = quantize_mxfp4(torch.full((32,), 2.0 ** -140, dtype=torch.float32))
    assert tiny_scale.tolist() == [0] and (tiny_packed == 0).all()  # 2**-140 / 2**-127 rounds to 0


def test_values_on_the_grid_round_trip_exactly():
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (6, 4, 64), generator=gen).to(torch.uint8)
    scale = torch.randint(10, 241, (6, 4, 4), generator=gen).to(torch.uint8)
    grid_values = dequantize_mxfp4(packed, scale, torch.float32)
    again = dequantize_mxfp4(*quantize_mxfp4(grid_values), torch.float32)
    assert torch.equal(again, grid_values)


def half_step(scaled_magnitude: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around a magnitude in units of the scale."""
    spacing = torch.where(scaled_magnitude < 2, 0.5, torch.where(scaled_magnitude < 4, 1.0, 2.0))
    return spacing.to(torch.float64) / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_values_within_half_a_step(dtype):
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(8, 3, 128, generator=gen) * torch.logspace(-30, 30, 8).view(8, 1, 1)).to(dtype)
    packed, scale = quantize_mxfp4(w)
    got = dequantize_mxfp4(packed, scale, torch.float64)
    unit = torch.pow(2.0, scale.to(torch.float64) - 127).repeat_interleave(32, dim=-1)
    scaled = w.to(torch.float64).abs() / unit
    inside = scaled <= 6
    err = (got - w.to(torch.float64)).abs()
    assert (err[inside] <= half_step(scaled[inside]) * unit[inside]).all()
    # Beyond 6 * scale the value saturates (OCP clamps; the group max may be up to 8 * scale).
    assert torch.equal(got[~inside], torch.sign(w.to(torch.float64)[~inside]) * 6 * unit[~inside])
    assert inside.float().mean() > 0.9  # most values exercise the rounding branch
    assert (scaled.amax(-1) >= 4).all()  # the scale puts every group max in [4, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_requantizing_dequantized_weights_gives_identical_bytes(dtype):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5, 7, 96, generator=gen) * 0.02
    w[0, 0, :32] = 0.0  # all-zero group
    w[0, 1, :32] = -1e-3 * torch.rand(32, generator=gen)  # many negative values rounding to -0
    packed, scale = quantize_mxfp4(w)
    packed2, scale2 = quantize_mxfp4(dequantize_mxfp4(packed, scale, dtype))
    assert torch.equal(packed2, packed) and torch.equal(scale2, scale)


def test_shape_and_dtype_errors():
    ok_p, ok_s = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    assert check_mxfp4_pair(ok_p, ok_s) == 64
    with pytest.raises(ValueError, match="w13_packed: expected dtype uint8"):
        check_mxfp4_pair(ok_p.to(torch.int32), ok_s, "w13_packed", "w13_scale")
    with pytest.raises(ValueError, match="w2_scale: expected dtype uint8"):
        check_mxfp4_pair(ok_p, ok_s.float(), "w2_packed", "w2_scale")
    with pytest.raises(ValueError, match="packed: last dim 24 unpacks to N = 48"):
        dequantize_mxfp4(torch.zeros(4, 24, dtype=torch.uint8), ok_s)
    with pytest.raises(ValueError, match=r"scale: expected shape \[4, 2\]"):
        dequantize_mxfp4(ok_p, torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scale: expected shape \[4, 2\]"):
        dequantize_mxfp4(ok_p, torch.zeros(5, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="w: last dim must be a multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="w: expected a floating-point tensor"):
        quantize_mxfp4(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="w: contains inf or NaN"):
        quantize_mxfp4(torch.full((32,), math.inf))
