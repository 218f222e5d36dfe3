"""packing.py's public helpers (quantize_rtn, to_kernel_layout): the round trip on fresh random
weights, and bad arguments refused with a ValueError naming the argument (fuzzing found a
ZeroDivisionError for group_size=0 and a silent int3 "quantization")."""

from __future__ import annotations

import pytest
import torch

from vllm_wna16_plugin.packing import dequantize, from_kernel_layout, quantize_rtn, to_kernel_layout


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("zp", [False, True])
def test_round_trip_through_the_kernel_layout_is_within_half_a_step(bits, group_size, zp):
    w = torch.randn(3, 16, 128, generator=torch.Generator().manual_seed(bits * 7 + group_size))
    qw = quantize_rtn(w, bits, group_size, has_zero_point=zp)
    back = dequantize(from_kernel_layout(to_kernel_layout(qw), bits))
    step = qw.scales.repeat_interleave(qw.group_size, dim=-1)
    assert torch.all((back - w).abs() <= step * 0.5 + 1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(bits=3), r"bits=3 is not supported; supported: \[4, 8\]"),
        (dict(bits=True), r"bits=True is not supported"),
        (dict(group_size=0), r"group_size=0 is not supported; use a positive int or -1"),
        (dict(group_size="32"), r"group_size='32' is not supported"),
        (dict(group_size=48), r"group_size=48 does not divide K=128"),
        (dict(w=torch.ones(4, 128, dtype=torch.int32)), r"w must be float weights \(\.\.\., N, K\), got \(4, 128\)"),
        (dict(w=torch.full((4, 128), float("nan"))), r"w holds NaN or Inf"),
    ],
)
def test_quantize_rtn_refuses_bad_arguments(kwargs, match):
    args = dict(w=torch.randn(4, 128), bits=4, group_size=32, has_zero_point=False) | kwargs
    with pytest.raises(ValueError, match=match):
        quantize_rtn(**args)


def test_to_kernel_layout_needs_a_float_scale_dtype():
    qw = quantize_rtn(torch.randn(2, 8, 64), 4, 32, has_zero_point=True)
    with pytest.raises(ValueError, match=r"dtype=torch.int32 must be a float dtype"):
        to_kernel_layout(qw, torch.int32)


def test_gptq_v1_refuses_to_write_a_zero_point_of_zero():
    """v1 stores zero - 1; a zero of 0 would wrap to 2**bits - 1, which the loader refuses."""
    from vllm_wna16_plugin.packing import pack_gptq, unpack_gptq

    w = torch.rand(2, 8, 64, generator=torch.Generator().manual_seed(5))  # all >= 0: every zero point is 0
    qw = quantize_rtn(w, 4, 32, has_zero_point=True)
    assert bool((qw.zeros == 0).all())
    with pytest.raises(ValueError, match=r"zero point of 0 cannot be stored in GPTQ v1.*gptq_v2"):
        pack_gptq(qw, zero_point_offset=1)
    v2 = pack_gptq(qw, zero_point_offset=0)
    back = unpack_gptq(v2["qweight"], v2["qzeros"], v2["scales"], 4, zero_point_offset=0, has_zero_point=True)
    assert torch.equal(back.zeros, qw.zeros) and torch.equal(back.q, qw.q)
