"""reference.fused_moe_ref: its CUDA-graph-safe form (every expert, masked) equals the eager one."""

from __future__ import annotations

import zlib

import pytest
import torch

from vllm_wna16_plugin.reference import fused_moe_ref


def _problem(dtype, *, seed, with_map):
    g = torch.Generator().manual_seed(seed)
    m, h, i, e_global, top_k = 7, 48, 32, 8, 3
    x = torch.randn(m, h, generator=g).to(dtype)
    w13 = torch.randn(e_global, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e_global, h, i, generator=g) / i**0.5
    logits = torch.randn(m, e_global, generator=g)
    topk_weights, topk_ids = logits.softmax(-1).topk(top_k, dim=-1)
    expert_map = None
    if with_map:  # this rank holds experts 1, 4, 5, 6 as local 0..3; the others are -1
        expert_map = torch.full((e_global,), -1, dtype=torch.int32)
        expert_map[torch.tensor([1, 4, 5, 6])] = torch.arange(4, dtype=torch.int32)
        w13, w2 = w13[:4], w2[:4]
    return x, w13, w2, topk_weights, topk_ids.to(torch.int32), expert_map


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_map", [False, True], ids=["all-local", "expert-map"])
@pytest.mark.parametrize("on_input", [False, True], ids=["weight-after", "weight-on-input"])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_capture_safe_form_equals_the_eager_one(dtype, with_map, on_input, activation):
    x, w13, w2, tw, ids, emap = _problem(dtype, seed=zlib.crc32(f"{dtype}{with_map}{on_input}{activation}".encode()),
                                         with_map=with_map)  # fmt: skip
    kw = dict(activation=activation, apply_router_weight_on_input=on_input, expert_map=emap)
    eager = fused_moe_ref(x, w13, w2, tw, ids, capture_safe=False, **kw)
    masked = fused_moe_ref(x, w13, w2, tw, ids, capture_safe=True, **kw)
    assert eager.abs().max() > 0.05  # fresh random data, not an all-zero output
    # float32: equal to matmul ordering; bf16: the same roundings, at most one ulp from row-batch order
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(masked.float(), eager.float(), rtol=tol, atol=tol * eager.abs().max().item())


def test_eager_form_matches_an_explicit_per_token_sum():
    x, w13, w2, tw, ids, _ = _problem(torch.float32, seed=7, with_map=False)
    want = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            hid = w13[e].double() @ x[t].double()
            gate, up = hid.chunk(2)
            want[t] += tw[t, j].double() * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    for safe in (False, True):
        got = fused_moe_ref(x, w13, w2, tw, ids, capture_safe=safe)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
