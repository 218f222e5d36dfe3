"""`cuda`: the plugin's own CUDA WNA16 MoE GEMM (csrc/, torch.ops.wna16_plus) for decode and small batches.

Its rules: an NVIDIA GPU, the extension built (setup.py), int4 or int8, group sizes the launch-config
module takes (32/64/128, or channel-wise with K % 32 == 0), K % 8 == 0, no act order, silu/gelu,
and bf16 only from sm80. `auto` takes it only where a measured crossover says it beats the Triton
kernel. No measurement exists yet, so `auto` never picks it today; ask for it with
VLLM_WNA16_PLUS_BACKEND=cuda or backend="cuda".
"""

from __future__ import annotations

import torch

from vllm_wna16_plugin.backends.base import Backend, KernelTensors, MoEProblem, layer_kwargs
from vllm_wna16_plugin.block_config import CUDA_GROUP_SIZES

CUDA_ACTIVATIONS = ("silu", "gelu")


class CudaBackend(Backend):
    name = "cuda"
    description = "plugin CUDA kernel (csrc/): int4/int8, groups 32/64/128 or channel-wise, decode-oriented"

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        if problem.platform != "cuda":
            return f"needs an NVIDIA GPU (platform is {problem.platform})"
        if problem.sm is not None and problem.sm < 80:
            return f"built for sm80+ (device is sm{problem.sm})"
        if problem.has_g_idx:
            return "act order (desc_act with a non-trivial g_idx) is not supported"
        if problem.activation not in CUDA_ACTIVATIONS:
            return f"activation {problem.activation!r} is not one of {list(CUDA_ACTIVATIONS)}"
        if problem.act_dtype not in (torch.bfloat16, torch.float16):
            return f"activations must be bfloat16 or float16, not {problem.act_dtype}"
        if problem.apply_router_weight_on_input and problem.top_k != 1:
            return "apply_router_weight_on_input needs top_k == 1"
        for name, gs, k in (("w13", problem.group_size_w13, problem.hidden),
                            ("w2", problem.group_size_w2, problem.intermediate)):  # fmt: skip
            if k % 8:
                return f"{name} K={k} is not a multiple of 8"
            if gs == k:
                if k % min(CUDA_GROUP_SIZES):
                    return f"channel-wise {name} K={k} is not a multiple of 32"
            elif gs not in CUDA_GROUP_SIZES:
                return f"{name} group size {gs} is not one of {list(CUDA_GROUP_SIZES)}"
        if not problem.extra.get("explicit"):
            return "not measured faster than the triton backend yet (auto takes it only on a measured crossover)"
        if problem.extra.get("plan_only"):
            return None
        from vllm_wna16_plugin.kernels.cuda_ops import extension_error

        return extension_error()

    def run(self, problem: MoEProblem, state: KernelTensors, x, topk_weights, topk_ids, *, expert_map=None):
        from vllm_wna16_plugin import _vllm
        from vllm_wna16_plugin.kernels.cuda_ops import fused_moe_wna16_cuda

        return fused_moe_wna16_cuda(
            x, *state.weights(), topk_weights, topk_ids, **layer_kwargs(problem, state, expert_map),
            global_num_experts=problem.global_num_experts, align_fn=_vllm.moe_align_block_size_fn(),
        )  # fmt: skip
