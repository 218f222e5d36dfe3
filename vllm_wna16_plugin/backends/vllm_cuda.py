"""`vllm_cuda`: vLLM's own `moe_wna16_gemm` CUDA kernel, launched with the plugin's legal configs.

vLLM 0.26 picks an illegal BLOCK_SIZE_K for group size 32 (K=2048, K=1344) and
the kernel aborts; here each GEMM gets `block_config.choose_cuda_block_config`,
legal by construction. Channel-wise scales are presented as group
`cuda_group_size(K)` (repeated once, at prepare time).
"""

from __future__ import annotations

import torch

from vllm_wna16_plugin.activation import gated_activation
from vllm_wna16_plugin.backends.base import Backend, KernelTensors, MoEProblem, half_precision_reason
from vllm_wna16_plugin.block_config import choose_cuda_block_config, cuda_group_reason, cuda_group_size


def _expand_channelwise(scales: torch.Tensor, zeros: torch.Tensor | None, size_k: int):
    """(E, N, 1) scales/zeros -> (E, N, K / g): the same values, repeated per CUDA group."""
    if scales.shape[-1] != 1:
        return scales, zeros
    groups = size_k // cuda_group_size(size_k, -1)
    scales = scales.expand(-1, -1, groups).contiguous()
    if zeros is not None:
        zeros = zeros.expand(-1, -1, groups).contiguous()
    return scales, zeros


class VllmCudaBackend(Backend):
    name = "vllm_cuda"
    description = "vLLM's moe_wna16_gemm CUDA kernel with legal launch configs (int4, groups 32/64/128)"

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        if problem.platform != "cuda":
            return f"needs an NVIDIA GPU (platform is {problem.platform})"
        if problem.scheme.bits != 4:
            return f"vLLM's moe_wna16_gemm is used for int4 only (scheme is int{problem.scheme.bits})"
        if problem.has_g_idx:
            return "act order (desc_act) is not supported"
        if problem.activation not in ("silu", "gelu"):
            return f"activation {problem.activation!r} is not supported"
        if reason := half_precision_reason(problem):
            return reason
        if problem.act_dtype == torch.bfloat16 and problem.sm is not None and problem.sm < 80:
            return f"bf16 needs sm80+ (device is sm{problem.sm}); vLLM's kernel returns zeros there"
        for name, gs, k in (
            ("w13", problem.group_size_w13, problem.hidden),
            ("w2", problem.group_size_w2, problem.intermediate),
        ):
            if reason := cuda_group_reason(name, gs, k):
                return reason
        if problem.options.plan_only:
            return None
        try:
            from vllm_wna16_plugin import _vllm

            if not _vllm.has_vllm_cuda_ops():
                return "vLLM's CUDA ops (torch.ops._moe_C.moe_wna16_gemm) are not available"
        except Exception as exc:  # noqa: BLE001
            return f"vLLM's CUDA ops cannot be imported ({type(exc).__name__})"
        return None

    def prepare(self, problem: MoEProblem, tensors: KernelTensors) -> KernelTensors:
        w13_s, w13_z = _expand_channelwise(tensors.w13_scales, tensors.w13_qzeros, problem.hidden)
        w2_s, w2_z = _expand_channelwise(tensors.w2_scales, tensors.w2_qzeros, problem.intermediate)
        return KernelTensors(tensors.w13_qweight, tensors.w2_qweight, w13_s, w2_s, w13_z, w2_z)

    def run(self, problem: MoEProblem, state: KernelTensors, x, topk_weights, topk_ids, *, expert_map=None, plan=None):
        from vllm_wna16_plugin import _vllm

        ops = _vllm.vllm_custom_ops()
        align = _vllm.moe_align_block_size_fn()
        m, top_k = topk_ids.shape
        hidden, inter = problem.hidden, problem.intermediate
        cfg1 = choose_cuda_block_config(
            m, top_k, problem.num_experts, hidden, 2 * inter, hidden // state.w13_scales.shape[-1], 4
        )
        cfg2 = choose_cuda_block_config(
            m, top_k, problem.num_experts, inter, hidden, inter // state.w2_scales.shape[-1], 4
        )
        # Both GEMMs walk the same sorted token list, so they share BLOCK_SIZE_M (= min(16, M)).
        sorted_ids, expert_ids, num_post_pad = align(
            topk_ids, cfg1.block_size_m, problem.global_num_experts, expert_map, ignore_invalid_experts=True
        )
        h1 = torch.zeros(m, top_k, 2 * inter, dtype=x.dtype, device=x.device)
        a = x
        if problem.apply_router_weight_on_input:
            a = (x.float() * topk_weights.float().view(m, 1)).to(x.dtype)  # top_k == 1
        ops.moe_wna16_gemm(
            a, h1, state.w13_qweight, state.w13_scales, state.w13_qzeros, None,
            sorted_ids, expert_ids, num_post_pad, top_k,
            cfg1.block_size_m, cfg1.block_size_n, cfg1.block_size_k, 4,
        )  # fmt: skip
        act = gated_activation(h1.view(m * top_k, 2 * inter), problem.activation)
        h2 = torch.zeros(m, top_k, hidden, dtype=x.dtype, device=x.device)
        weights = None if problem.apply_router_weight_on_input else topk_weights.float()
        ops.moe_wna16_gemm(
            act, h2, state.w2_qweight, state.w2_scales, state.w2_qzeros, weights,
            sorted_ids, expert_ids, num_post_pad, 1,
            cfg2.block_size_m, cfg2.block_size_n, cfg2.block_size_k, 4,
        )  # fmt: skip
        return h2.sum(dim=1, dtype=torch.float32).to(x.dtype)
