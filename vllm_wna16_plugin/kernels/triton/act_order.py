"""The activations of an act-order layer in each routed pair's expert K order, one Triton launch:

    out[p, k] = a[p // top_k, a_perm[e_p, k]],   e_p = expert_map[topk_ids[p]] (or topk_ids[p]),

for every routed pair p < M * top_k; a pair routed off this rank (e_p = -1) reads expert 0's order (the
alignment never hands it to a GEMM). It feeds the CUDA kernel's GEMM1 on the sorted act-order layout
(backends/base.sort_act_order, cuda_ops.fused_moe_wna16_cuda), which reads one row per pair. The torch
form it replaces took eight small launches (about 20 µs a layer call on the H200, whatever M: bench/
results/h200/2026-12-05-c410069-vllm034-catalog.md); this is one, and it writes each row once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _act_order_rows_kernel(
    a_ptr,  # (M, H)
    perm_ptr,  # (E, H) int32
    ids_ptr,  # (M * top_k,) int32 global (or local) expert ids
    map_ptr,  # (E_global,) int32 global -> local (-1: off this rank); unused without HAS_MAP
    out_ptr,  # (M * top_k, H)
    stride_am,
    stride_pe,
    stride_om,
    H,
    TOP_K: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid: (M * top_k, cdiv(H, BLOCK)). One pair's row segment of BLOCK columns per program."""
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if HAS_MAP:  # an id of -1 (no expert) never indexes the map
        mapped = tl.load(map_ptr + tl.maximum(expert, 0)).to(tl.int64)
        expert = tl.where(expert >= 0, mapped, 0)
    expert = tl.maximum(expert, 0)
    cols = tl.load(perm_ptr + expert * stride_pe + offs, mask=mask, other=0).to(tl.int64)
    vals = tl.load(a_ptr + (pair // TOP_K) * stride_am + cols, mask=mask, other=0.0)
    tl.store(out_ptr + pair * stride_om + offs, vals, mask=mask)


def act_order_rows_triton(
    a: torch.Tensor, a_perm: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """(M*top_k, H): out[p] = a[p // top_k, a_perm[e_p]] (above). a: (M, H) with unit column stride;
    a_perm: (E, H) int32; topk_ids: (M, top_k) int32; expert_map: (E_global,) int32 or None."""
    m, top_k = topk_ids.shape
    h = a.shape[1]
    if a.stride(1) != 1 or a_perm.stride(1) != 1 or tuple(a_perm.shape[1:]) != (h,):
        raise ValueError(f"a {tuple(a.shape)} and a_perm {tuple(a_perm.shape)} need unit column strides and one H")
    out = torch.empty((m * top_k, h), dtype=a.dtype, device=a.device)
    if m * top_k == 0:
        return out
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    emap = expert_map if expert_map is not None else ids  # a placeholder pointer when HAS_MAP is off
    if expert_map is not None and (expert_map.dtype != torch.int32 or not expert_map.is_contiguous()):
        emap = expert_map.to(torch.int32).contiguous()
    block = min(1024, triton.next_power_of_2(h))
    _act_order_rows_kernel[(m * top_k, triton.cdiv(h, block))](
        a, a_perm, ids, emap, out,
        a.stride(0), a_perm.stride(0), out.stride(0), h,
        TOP_K=top_k, HAS_MAP=expert_map is not None, BLOCK=block, num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
    return out


__all__ = ["act_order_rows_triton"]
