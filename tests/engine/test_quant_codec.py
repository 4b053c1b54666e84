"""The lossy codes (lightning_incremental.core.codecs.quant): error bounds of int8 absmax and log8
blocks, bf16 rounding like torch, bit-stable decoding, payload round trips and rejections."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_incremental.core.codecs import quant


def _data(n: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


@pytest.mark.parametrize("block", [1, 7, 256, 2048])
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 5000])
def test_int8_error_is_at_most_half_a_step(block, n):
    x = _data(n, seed=n + block)
    codes, scales = quant.quantize_int8_blockwise(x, block)
    assert codes.dtype == np.int8 and codes.size == n
    assert scales.dtype == np.float32 and scales.size == -(-n // block)
    assert codes.size == 0 or np.abs(codes.astype(int)).max() <= 127
    y = quant.dequantize_int8_blockwise(codes, scales, block)
    step = np.repeat(scales, block)[:n].astype(np.float64)
    assert np.all(np.abs(y.astype(np.float64) - x) <= step / 2 * (1 + 1e-6) + 1e-45)


def test_int8_absmax_element_and_zero_block_are_exact():
    x = np.zeros(512, np.float32)
    x[:256] = _data(256, seed=1)
    codes, scales = quant.quantize_int8_blockwise(x, 256)
    y = quant.dequantize_int8_blockwise(codes, scales, 256)
    assert scales[1] == 0 and np.all(y[256:] == 0)
    i = np.argmax(np.abs(x[:256]))
    assert abs(codes[i]) == 127
    assert np.isclose(y[i], x[i], rtol=1e-6, atol=0)


def test_int8_non_finite_is_refused():
    x = _data(100)
    x[5] = np.inf
    assert quant.quantize_int8_blockwise(x, 32) is None
    x[5] = np.nan
    assert quant.quantize_int8_blockwise(x, 32) is None


def test_dequantize_is_bit_stable_and_matches_an_exact_reference():
    x = _data(10_000, seed=3)
    codes, scales = quant.quantize_int8_blockwise(x, 256)
    a = quant.dequantize_int8_blockwise(codes, scales, 256)
    b = quant.dequantize_int8_blockwise(codes.copy(), scales.copy(), 256)
    assert a.tobytes() == b.tobytes()
    # reference: exact rational product, rounded once to float32
    ref = np.array(
        [np.float32(float(c) * float(s)) for c, s in zip(codes, np.repeat(scales, 256))],
        dtype=np.float32,
    )
    assert a.tobytes() == ref.tobytes()


def test_wrong_scale_count_raises():
    with pytest.raises(ValueError):
        quant.dequantize_int8_blockwise(np.zeros(10, np.int8), np.ones(2, np.float32), 4)
    with pytest.raises(ValueError):
        quant.quantize_int8_blockwise(np.zeros(4, np.float32), 0)


@pytest.mark.parametrize(
    "value",
    [1.0, -2.5, 1e-30, 3.0e38, 0.0, -0.0, 1e-40, 1.00390625, 1.01171875, 65504.0, 1.0000001],
)
def test_bf16_rounds_like_torch(value):
    x = np.float32([value, np.nextafter(np.float32(value), np.float32(np.inf))])
    ours = quant.float32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert ours.tolist() == theirs.tolist()


def test_bf16_random_values_match_torch_and_decode_exactly():
    x = np.random.default_rng(1).standard_normal(100_000).astype(np.float32) * 1e3
    ours = quant.float32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    back = quant.bf16_to_float32(ours)
    assert np.array_equal(back, torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_bf16_ties_to_even_and_special_values():
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: ties to the even (1.0)
    assert quant.float32_to_bf16(np.float32([1 + 2**-8])).tolist() == [0x3F80]
    assert quant.float32_to_bf16(np.float32([1 + 3 * 2**-8])).tolist() == [0x3F82]
    special = quant.float32_to_bf16(np.float32([np.inf, -np.inf, np.nan, -np.nan]))
    assert special[0] == 0x7F80 and special[1] == 0xFF80
    assert np.all(np.isnan(quant.bf16_to_float32(special[2:])))
    big = quant.float32_to_bf16(np.float32([3.4028235e38]))  # rounds up to infinity, as torch
    assert big.tolist() == [0x7F80]


def test_chunk_codec_refuses_what_it_cannot_code():
    assert quant.encode_lossy(np.zeros(6, np.uint8), "int8") is None  # not whole float32s
    assert quant.encode_lossy(np.float32([1, np.inf]).view(np.uint8), "bf16") is None
    assert quant.encode_lossy(np.float32([1, np.nan]).view(np.uint8), "int8") is None
    with pytest.raises(ValueError):
        quant.encode_lossy(np.zeros(8, np.uint8), "fp4")


def test_chunk_codec_rejects_bad_payloads():
    raw = _data(1000).view(np.uint8)
    payload = quant.encode_lossy(raw, "int8")
    out = np.empty(raw.size, np.uint8)
    with pytest.raises(ValueError):
        quant.decode_lossy_into(payload[:-1], out)
    with pytest.raises(ValueError):
        quant.decode_lossy_into(b"XXXX" + payload[4:], out)
    with pytest.raises(ValueError):
        quant.decode_lossy_into(payload, np.empty(raw.size - 4, np.uint8))


@pytest.mark.parametrize("n", [0, 1, 300, 4096])
def test_log8_relative_error_is_uniform_and_zero_is_exact(n):
    rng = np.random.default_rng(n)
    v = (10.0 ** rng.uniform(-6, 0, n)).astype(np.float32)
    if n > 10:
        v[::7] = 0.0
    codes, lo, span = quant.quantize_log8_blockwise(v, 256)
    y = quant.dequantize_log8_blockwise(codes, lo, span, 256)
    assert y.dtype == np.float32 and y.size == n
    assert np.all((y == 0) == (v == 0))
    nz = v > 0
    rel = np.abs(y[nz] - v[nz]) / v[nz]
    assert rel.size == 0 or rel.max() < 0.04  # 6 decades / 254 steps: <= 2.8% each way


def test_log8_floor_rounds_tiny_values_up_never_to_zero():
    v = np.float32([1.0, 1e-30, 0.5])
    codes, lo, span = quant.quantize_log8_blockwise(v, 4, max_binades=24)
    y = quant.dequantize_log8_blockwise(codes, lo, span, 4)
    assert y[1] >= 2.0**-24 * 0.99 and y[0] == 1.0
    assert quant.quantize_log8_blockwise(np.float32([1, -1]), 4) is None
    assert quant.quantize_log8_blockwise(np.float32([1, np.inf]), 4) is None


def test_log8_decode_is_integer_exact():
    v = np.abs(_data(5000, seed=9)) ** 2
    codes, lo, span = quant.quantize_log8_blockwise(v, 512)
    a = quant.dequantize_log8_blockwise(codes, lo, span, 512)
    # the same bits from plain Python integers
    ref = []
    for i, c in enumerate(codes.tolist()):
        b = i // 512
        bits = 0 if c == 0 else int(lo[b]) + ((c - 1) * int(span[b]) + 127) // 254
        ref.append(bits)
    assert a.view(np.uint32).tolist() == ref
