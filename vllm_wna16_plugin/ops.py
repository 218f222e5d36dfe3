"""Functional API over the layout of vLLM's in-tree moe_wna16 method, for every backend.

    out = fused_moe_wna16(x, w13_qweight, w2_qweight, w13_scales, w2_scales,
                          topk_weights, topk_ids, bits=4, group_size=128)

lets any backend be compared with vLLM's own kernels on the same tensors.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_wna16_plugin import _vllm
from vllm_wna16_plugin.backends import KernelTensors, MoEProblem, registry
from vllm_wna16_plugin.inputs import (
    check_layer_tensors,
    check_routing_values,
    check_weights_contiguous,
    global_expert_count,
    routing_contiguous,
)
from vllm_wna16_plugin.kernels.options import KernelOptions
from vllm_wna16_plugin.launch_plan import LayerRunner
from vllm_wna16_plugin.oracle import select_backend
from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme


def _capturing(x: torch.Tensor) -> bool:
    """A CUDA graph is being captured, or torch.compile is tracing: no host reads of tensor values."""
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)()
    return compiling or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def make_problem(
    x, w13_qweight, w2_qweight, w13_scales, w2_scales, topk_ids, *, bits, group_size, has_zero_point,
    activation="silu", apply_router_weight_on_input=False, global_num_experts=-1, topk_weights=None,
    w13_qzeros=None, w2_qzeros=None, expert_map=None,
) -> MoEProblem:  # fmt: skip
    """The MoEProblem described by kernel-layout tensors; every shape, dtype and device is checked
    (inputs.check_layer_tensors: ValueError naming the argument) before any launch. Metadata only.

    group_size: the checkpoint's (-1: channel-wise), or a (GEMM1, GEMM2) pair where a TP split regrouped
    GEMM2 (the scheme keeps GEMM1's)."""
    activation = getattr(activation, "value", activation)  # vLLM's MoEActivation enum, as the layer path reads it
    if topk_weights is None:  # callers that plan without routing weights (tests, the crossover)
        topk_weights = torch.empty(topk_ids.shape, dtype=torch.float32, device=topk_ids.device)
    shape = check_layer_tensors(
        x, w13_qweight, w2_qweight, w13_scales, w2_scales, topk_weights, topk_ids, bits=bits,
        group_size=group_size, w13_qzeros=w13_qzeros, w2_qzeros=w2_qzeros, expert_map=expert_map,
    )  # fmt: skip
    platform, sm = _vllm.platform_summary() if x.is_cuda else ("cpu", None)
    scheme_group_size = group_size[0] if isinstance(group_size, tuple) else group_size
    return MoEProblem(
        scheme=WNA16Scheme(bits, scheme_group_size, has_zero_point, PackFormat.GPTQ, source="moe_wna16 layout"),
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        num_experts=shape.num_experts,
        global_num_experts=global_expert_count(shape.num_experts, expert_map, global_num_experts),
        top_k=shape.top_k,
        group_size_w13=shape.group_size_w13,
        group_size_w2=shape.group_size_w2,
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
    options: KernelOptions | None = None,
) -> torch.Tensor:
    """out[t] = sum_j w[t,j] * W2[e] @ act(W13[e] @ x[t]), e = topk_ids[t,j], with W = (q - z) * s.

    backend: "auto" or a name from `backends.registry()` ("triton", "cuda", "marlin",
    "vllm_cuda", "reference"). use_td: the Triton backend's tensor-descriptor
    switch (None: the hardware gate decides). options: the kernels' forms
    (kernels.options.KernelOptions; use_td, when given, overrides its use_td). A
    backend that cannot run the problem raises ValueError with the reason (no
    launch happens). Each batch runs on its launch plan (launch_plan.plan).
    """
    if options is not None and not isinstance(options, KernelOptions):
        raise ValueError(
            f"options={options!r} must be a KernelOptions (vllm_wna16_plugin.kernels.options) or None, "
            f"not {type(options).__name__}"
        )
    if not isinstance(apply_router_weight_on_input, bool):
        raise ValueError(
            f"apply_router_weight_on_input={apply_router_weight_on_input!r} must be True or False, "
            f"not {type(apply_router_weight_on_input).__name__}"
        )
    problem = make_problem(
        x, w13_qweight, w2_qweight, w13_scales, w2_scales, topk_ids, bits=bits, group_size=group_size,
        has_zero_point=w13_qzeros is not None, activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input, global_num_experts=global_num_experts,
        topk_weights=topk_weights, w13_qzeros=w13_qzeros, w2_qzeros=w2_qzeros, expert_map=expert_map,
    )  # fmt: skip
    if problem.top_k > problem.global_num_experts:  # duplicate ids in every row: no router routes so
        raise ValueError(
            f"topk_ids has top_k={problem.top_k} columns but there are only {problem.global_num_experts} experts: "
            f"a router picks top_k distinct experts per token, so top_k must be at most the number of experts"
        )
    if apply_router_weight_on_input and problem.top_k != 1:  # the layer path: vLLM's router never asks for it
        raise ValueError(
            f"apply_router_weight_on_input=True with top_k={problem.top_k}: vLLM defines it for top_k == 1 (the one "
            f"routing weight scales the token's input) and its own MoE path refuses other top_k, as the plugin's "
            f"cuda backend does; pass top_k == 1 or apply the weights after the experts"
        )
    check_weights_contiguous(
        w13_qweight=w13_qweight, w2_qweight=w2_qweight, w13_scales=w13_scales, w2_scales=w2_scales,
        w13_qzeros=w13_qzeros, w2_qzeros=w2_qzeros,
    )  # fmt: skip
    if not _capturing(x):  # reading the ids back is a host sync, which CUDA-graph capture forbids
        check_routing_values(
            topk_ids, expert_map, num_experts=problem.num_experts, global_experts=problem.global_num_experts
        )
    x, topk_weights, topk_ids, expert_map = routing_contiguous(x, topk_weights, topk_ids, expert_map)
    kernel = options or problem.options.kernel
    if use_td is not None:
        kernel = dataclasses.replace(kernel, use_td=use_td)
    problem = dataclasses.replace(problem, options=dataclasses.replace(problem.options, kernel=kernel))
    if backend not in ("auto", *registry()):
        raise ValueError(f"backend={backend!r} is unknown; supported: {['auto', *registry()]}")
    selection = select_backend(problem, backend, "backend=")
    tensors = KernelTensors(w13_qweight, w2_qweight, w13_scales, w2_scales, w13_qzeros, w2_qzeros)
    return LayerRunner(selection, tensors).run(x, topk_weights, topk_ids, expert_map)
