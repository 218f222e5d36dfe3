"""Load-time value checks of weight_loading.py on single checkpoint tensors (random data, no vLLM).

The refusals on whole on-disk checkpoints are in test_checkpoint_loading.py; here: the edges of each
range (the last legal value loads and is read right, the first illegal one is refused), and the cast
of a float32 scale to a float16 layer.
"""

from __future__ import annotations

import re

import pytest
import torch

from vllm_wna16_plugin import packing
from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme
from vllm_wna16_plugin.weight_loading import TensorName, unpack_checkpoint_tensor

N, K, GS = 64, 128, 32
G = K // GS
NAME = TensorName("model.layers.5.mlp.experts", 17, "down_proj", "scales")
WHERE = re.escape(
    "checkpoint tensor model.layers.5.mlp.experts.17.down_proj.scales (expert 17 of model.layers.5.mlp.experts)"
)


def _scheme(fmt: PackFormat, bits: int = 4, *, zp: bool = True, desc_act: bool = False, v1: bool = False):
    return WNA16Scheme(bits, GS, zp, fmt, desc_act=desc_act, zero_point_offset=int(v1))


def _random(seed: int, *shape: int, lo: int, hi: int) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def test_scale_that_overflows_the_layers_float16_is_refused():
    scales = torch.rand(G, N, generator=torch.Generator().manual_seed(0)) * 1e-2  # float32, GPTQ (G, N)
    scales[2, 9] = 7e4  # finite in float32 and bfloat16, inf in float16 (max 65504)
    scheme = _scheme(PackFormat.GPTQ, zp=False)
    for dtype in (torch.float32, torch.bfloat16):
        out = unpack_checkpoint_tensor(scheme, "scales", scales, N, K, NAME, dtype)
        assert torch.equal(out, scales.T)  # logical (N, G); the cast to the layer's dtype comes later
    msg = rf"{WHERE}: scale 70000 at output channel 9, group 2 overflows torch.float16 .*65504.*bfloat16 or float32"
    with pytest.raises(ValueError, match=msg):
        unpack_checkpoint_tensor(scheme, "scales", scales, N, K, NAME, torch.float16)


def test_zero_and_negative_scales_are_legal():
    # w = (q - z) * s holds for any finite s: a group of zeros, or a sign flip, is not refused.
    scales = torch.randn(N, G, generator=torch.Generator().manual_seed(1)).bfloat16()  # CT (N, G), both signs
    scales[3] = 0.0
    out = unpack_checkpoint_tensor(_scheme(PackFormat.CT_PACKED, zp=False), "scales", scales, N, K, NAME, torch.float16)
    assert torch.equal(out, scales)


@pytest.mark.parametrize("desc_act", [True, False])
def test_g_idx_edges(desc_act):
    scheme = _scheme(PackFormat.GPTQ, desc_act=desc_act)
    name = TensorName("model.layers.0.mlp.experts", 3, "up_proj", "g_idx")
    g_idx = torch.arange(K, dtype=torch.int32) // GS  # both ends of [0, G) are legal
    if desc_act:  # act order: the rows dealt into the groups in another order, group_size rows each
        g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(2))]
    out = unpack_checkpoint_tensor(scheme, "g_idx", g_idx.long(), N, K, name)
    assert out.dtype == torch.int32 and torch.equal(out, g_idx)
    for bad in (-1, G):
        corrupt = g_idx.clone()
        corrupt[77] = bad
        with pytest.raises(ValueError, match=rf"g_idx\[77\]={bad} is outside \[0, {G}\).*groups 0\.\.{G - 1}"):
            unpack_checkpoint_tensor(scheme, "g_idx", corrupt, N, K, name)


def test_act_order_g_idx_counts_are_checked():
    scheme = _scheme(PackFormat.GPTQ, desc_act=True)
    name = TensorName("model.layers.0.mlp.experts", 3, "up_proj", "g_idx")
    g_idx = (torch.arange(K, dtype=torch.int32) // GS)[torch.randperm(K, generator=torch.Generator().manual_seed(3))]
    unpack_checkpoint_tensor(scheme, "g_idx", g_idx, N, K, name)
    row = int((g_idx == G - 1).nonzero()[0])
    g_idx[row] = 0  # in range, but group 0 now has GS + 1 rows
    with pytest.raises(ValueError, match=rf"g_idx puts {GS + 1} of K={K} rows into group 0, but act order keeps {GS}"):
        unpack_checkpoint_tensor(scheme, "g_idx", g_idx, N, K, name)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_zero_points_up_to_the_last_representable_load(bits):
    # v1 stores zero - 1: stored 0..2**bits - 2 are zeros 1..2**bits - 1; stored 2**bits - 1 is refused.
    top = (1 << bits) - 1
    stored = _random(bits, N, G, lo=0, hi=top)
    stored[5, 1] = top - 1  # zero 2**bits - 1: the largest legal
    qzeros = packing.pack_along(stored.T, bits, dim=-1, word_bits=32)  # GPTQ (G, N / pf)
    scheme = _scheme(PackFormat.GPTQ, bits, v1=True)
    out = unpack_checkpoint_tensor(scheme, "qzeros", qzeros, N, K, "qzeros")
    assert torch.equal(out, stored + 1)
    stored[40, 3] = top
    qzeros = packing.pack_along(stored.T, bits, dim=-1, word_bits=32)
    with pytest.raises(ValueError, match=rf"qzeros: stored zero point {top} at output channel 40, group 3"):
        unpack_checkpoint_tensor(scheme, "qzeros", qzeros, N, K, "qzeros")
    # gptq_v2 stores the zero itself: every field is a legal zero point
    v2 = unpack_checkpoint_tensor(_scheme(PackFormat.GPTQ, bits), "qzeros", qzeros, N, K, "qzeros")
    assert torch.equal(v2, stored)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32])
def test_ct_unpacked_signed_zero_point_edges(dtype):
    signed = _random(3, N, G, lo=-8, hi=8)
    signed[0, 0], signed[1, 1] = -8, 7
    scheme = _scheme(PackFormat.CT_PACKED)
    out = unpack_checkpoint_tensor(scheme, "qzeros", signed.to(dtype), N, K, "weight_zero_point")
    assert torch.equal(out, signed + 8)
    for bad in (-9, 8):
        corrupt = signed.clone()
        corrupt[10, 2] = bad
        with pytest.raises(ValueError, match=rf"zero point {bad} at output channel 10, group 2 is outside int4"):
            unpack_checkpoint_tensor(scheme, "qzeros", corrupt.to(dtype), N, K, "weight_zero_point")
