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


def test_padded_group_runs_known_answer():
    """Act order on a TP rank: each group's rows sorted (stably), padded to runs of 2, experts to the longest."""
    from vllm_wna16_plugin.packing import padded_group_runs

    g_idx = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 1]])
    rows, chunks = padded_group_runs(g_idx, num_groups=2, run=2)
    # expert 0: group 0 = rows 1, 4; group 1 = rows 0, 2, 3 + 1 pad. expert 1: group 0 = 0..3; group 1 = 4 + 1 pad
    assert rows.tolist() == [[1, 4, 0, 2, 3, -1], [0, 1, 2, 3, 4, -1]]
    assert chunks.tolist() == [[0, 1, 1], [0, 0, 1]]
    rows, chunks = padded_group_runs(torch.tensor([[0, 0, 0, 0], [1, 1, 0, 1]]), num_groups=2, run=4)
    assert rows.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1], [2, -1, -1, -1, 0, 1, 3, -1]]
    assert chunks.tolist() == [[0, 1], [0, 1]]  # expert 0's end padding takes the last group


def test_permute_k_and_n_pad_with_the_given_values_and_zero_rows():
    from vllm_wna16_plugin.packing import pack_along, permute_k, permute_n, unpack_along

    q = torch.arange(2 * 4 * 4).reshape(2, 4, 4) % 16  # (E, N, K) int4 values
    qweight = pack_along(q, 4, dim=-1, word_bits=8)
    perm = torch.tensor([[3, -1, 0, 1, -1, -1], [2, 1, 0, 3, -1, -1]])
    pad = torch.tensor([[[7, 8, 9]] * 4, [[1, 2, 3]] * 4])  # (E, N, 3 chunks of 2 rows)
    out = unpack_along(permute_k(qweight, perm, 4, pad_values=pad), 4, dim=-1, word_bits=8)
    assert out[0, 0].tolist() == [3, 7, 0, 1, 9, 9] and out[1, 2].tolist() == [10, 9, 8, 11, 3, 3]
    scales = torch.rand(2, 4, 1) + 1
    zeros = pack_along(torch.full((2, 4, 1), 5), 4, dim=-2, word_bits=8)
    rows = torch.tensor([[2, -1, 0, -1, 3, 1], [1, 0, -1, 2, 3, -1]])  # (E, 6): N grows with padding rows
    qw, sc, qz = permute_n(qweight, scales, zeros, rows, 4)
    assert torch.equal(unpack_along(qw, 4, dim=-1, word_bits=8)[0, 0], q[0, 2]) and not qw[0, 1].any()
    keep = rows >= 0
    assert torch.equal(sc[..., 0], torch.where(keep, scales[..., 0].gather(1, rows.clamp(min=0)), 0))
    assert torch.equal(unpack_along(qz, 4, dim=-2, word_bits=8)[..., 0], torch.where(keep, 5, 0))


def test_check_packable_names_the_size_and_the_word():
    from vllm_wna16_plugin.packing import check_packable

    check_packable(4, 2048, 1344, "layer")  # multiples of 8
    check_packable(8, 100, 36, "layer")  # int8: 4 per word
    with pytest.raises(ValueError, match=r"layer: the hidden size H is 100, not a positive multiple of 8"):
        check_packable(4, 100, 64, "layer")
    with pytest.raises(ValueError, match=r"the experts' intermediate size I is 38, not a positive multiple of 4"):
        check_packable(8, 64, 38, "layer")
