"""Functional API over the layout of vLLM's in-tree moe_wna16 method, for every backend.

    out = fused_moe_wna16(x, w13_qweight, w2_qweight, w13_scales, w2_scales,
                          topk_weights, topk_ids, bits=4, group_size=128)

lets any backend be compared with vLLM's own kernels on the same tensors.
"""

from __future__ import annotations

import torch

from vllm_wna16_plugin import _vllm
from vllm_wna16_plugin.backends import KernelTensors, MoEProblem, registry
from vllm_wna16_plugin.oracle import select_backend
from vllm_wna16_plugin.scheme import CHANNELWISE, PackFormat, WNA16Scheme


def _group_size_of(name: str, size_k: int, scales: torch.Tensor, group_size: int) -> int:
    groups = scales.shape[-1]
    if groups <= 0 or size_k % groups:
        raise ValueError(f"{name}: {groups} scale groups do not divide K={size_k}")
    actual = size_k // groups
    if group_size == CHANNELWISE:
        if groups != 1:
            raise ValueError(f"{name}: group_size=-1 (channel-wise) needs a last scale dim of 1, got {groups}")
    elif group_size % actual or actual > group_size:
        raise ValueError(f"{name}: scales imply group size {actual}, inconsistent with group_size={group_size}")
    return actual


def make_problem(
    x, w13_qweight, w2_qweight, w13_scales, w2_scales, topk_ids, *, bits, group_size, has_zero_point,
    activation="silu", apply_router_weight_on_input=False, global_num_experts=-1,
) -> MoEProblem:  # fmt: skip
    """The MoEProblem described by kernel-layout tensors; shape errors are ValueErrors, before any launch."""
    if x.dim() != 2:
        raise ValueError(f"x must be (M, H), got {tuple(x.shape)}")
    e, n13, k13 = w13_qweight.shape
    hidden = k13 * 8 // bits
    if hidden != x.shape[1]:
        raise ValueError(f"w13_qweight (E, 2I, H*bits/8)={tuple(w13_qweight.shape)} does not match x H={x.shape[1]}")
    if n13 % 2:
        raise ValueError(f"w13_qweight rows (2I) must be even, got {n13}")
    inter = n13 // 2
    if tuple(w2_qweight.shape) != (e, hidden, inter * bits // 8):
        raise ValueError(f"w2_qweight must be {(e, hidden, inter * bits // 8)}, got {tuple(w2_qweight.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be (M, top_k) with M={x.shape[0]}, got {tuple(topk_ids.shape)}")
    gne = e if global_num_experts in (-1, None) else int(global_num_experts)
    platform, sm = _vllm.platform_summary() if x.is_cuda else ("cpu", None)
    return MoEProblem(
        scheme=WNA16Scheme(bits, group_size, has_zero_point, PackFormat.GPTQ, source="moe_wna16 layout"),
        hidden=hidden,
        intermediate=inter,
        num_experts=e,
        global_num_experts=gne,
        top_k=topk_ids.shape[1],
        group_size_w13=_group_size_of("w13_scales", hidden, w13_scales, group_size),
        group_size_w2=_group_size_of("w2_scales", inter, w2_scales, group_size),
        act_dtype=x.dtype,
        activation=activation,
        platform=platform,
        sm=sm,
        apply_router_weight_on_input=apply_router_weight_on_input,
    )


def fused_moe_wna16(
    x: torch.Tensor,  # (M, H) bf16/fp16
    w13_qweight: torch.Tensor,  # (E, 2I, H*bits/8) uint8
    w2_qweight: torch.Tensor,  # (E, H, I*bits/8) uint8
    w13_scales: torch.Tensor,  # (E, 2I, H/gs), last dim 1 when channel-wise
    w2_scales: torch.Tensor,  # (E, H, I/gs)
    topk_weights: torch.Tensor,  # (M, top_k) float
    topk_ids: torch.Tensor,  # (M, top_k) int
    *,
    bits: int,
    group_size: int,
    w13_qzeros: torch.Tensor | None = None,  # (E, 2I*bits/8, H/gs) uint8, packed along N
    w2_qzeros: torch.Tensor | None = None,  # (E, H*bits/8, I/gs) uint8
    activation: str = "silu",
    backend: str = "auto",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    global_num_experts: int = -1,
    use_td: bool | None = None,
) -> torch.Tensor:
    """out[t] = sum_j w[t,j] * W2[e] @ act(W13[e] @ x[t]), e = topk_ids[t,j], with W = (q - z) * s.

    backend: "auto" or a name from `backends.registry()` ("triton", "cuda", "marlin",
    "vllm_cuda", "reference"). use_td: the Triton backend's tensor-descriptor
    switch (None: the hardware gate decides). A backend that cannot run the
    problem raises ValueError with the reason (no launch happens).
    """
    if (w13_qzeros is None) != (w2_qzeros is None):
        raise ValueError("give zero points for both GEMMs or for neither")
    if global_num_experts == -1 and expert_map is not None:
        global_num_experts = expert_map.numel()  # topk_ids are global ids: the map's length counts them
    problem = make_problem(
        x, w13_qweight, w2_qweight, w13_scales, w2_scales, topk_ids, bits=bits, group_size=group_size,
        has_zero_point=w13_qzeros is not None, activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input, global_num_experts=global_num_experts,
    )  # fmt: skip
    if use_td is not None:
        problem.extra["use_td"] = use_td
    if backend not in ("auto", *registry()):
        raise ValueError(f"backend={backend!r} is unknown; supported: {['auto', *registry()]}")
    selection = select_backend(problem, backend, "backend=")
    tensors = KernelTensors(w13_qweight, w2_qweight, w13_scales, w2_scales, w13_qzeros, w2_qzeros)
    state = selection.backend.prepare(problem, tensors)
    return selection.backend.run(problem, state, x, topk_weights, topk_ids, expert_map=expert_map)
