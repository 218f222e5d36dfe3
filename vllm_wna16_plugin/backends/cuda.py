"""`cuda`: the plugin's own CUDA WNA16 MoE GEMM (csrc/, torch.ops.wna16_plus) for decode and small batches.

Its rules: an NVIDIA GPU, the extension built (setup.py), int4 or int8, group sizes the launch-config
module takes (32/64/128) or channel-wise, K % 8 == 0, no act order, silu/gelu,
and bf16 only from sm80. `auto` takes it only for a layer shape for which crossover.py's table has
a winning range of batch sizes on this device; the layer's launch plan (launch_plan.py) then runs the
batches inside those measured ranges on it and the others on the triton backend. The table comes from bench_moe.py
--write-crossover on a GPU (the H200's is shipped). An explicit choice (VLLM_WNA16_PLUS_BACKEND=cuda, or
backend="cuda") always runs the CUDA kernel.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_wna16_plugin import crossover
from vllm_wna16_plugin.backends.base import Backend, KernelTensors, MoEProblem, layer_device, layer_kwargs
from vllm_wna16_plugin.block_config import cuda_group_reason

CUDA_ACTIVATIONS = ("silu", "gelu")


def cuda_layout(tensors: KernelTensors) -> KernelTensors:
    """The CUDA kernel's copy of a layer: the packed weights shared, the scales and zero points group-major
    (cuda_ops.group_major: one more copy of those tables, a few percent of the int4 weights at gs128)."""
    from vllm_wna16_plugin.kernels.cuda_ops import group_major

    return dataclasses.replace(
        tensors,
        w13_scales=group_major(tensors.w13_scales),
        w2_scales=group_major(tensors.w2_scales),
        w13_qzeros=group_major(tensors.w13_qzeros),
        w2_qzeros=group_major(tensors.w2_qzeros),
    )


def layer_key(problem: MoEProblem) -> str:
    """The crossover table's key of this layer (per rank)."""
    gs = -1 if problem.scheme.is_channelwise else problem.scheme.group_size
    return crossover.layer_key(problem.num_experts, problem.hidden, problem.intermediate, gs, problem.scheme.bits)


def measured_ranges(problem: MoEProblem) -> tuple[tuple[int, int], ...]:
    """The batch sizes at which `cuda` measured faster than `triton` for this layer on its device (the
    user's own tuned table first: crossover.device_ranges)."""
    return crossover.device_ranges(layer_key(problem), layer_device(problem))[0]


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
            if gs != k and (reason := cuda_group_reason(name, gs, k)):  # channel-wise: any K % 8 == 0
                return reason
        if not problem.options.explicit and not measured_ranges(problem):
            return (
                "no measured crossover over triton for this shape on this device "
                "(auto takes cuda only where bench_moe.py --write-crossover measured it faster)"
            )
        if problem.options.plan_only:
            return None
        from vllm_wna16_plugin.kernels.cuda_ops import extension_error

        return extension_error()

    def prepare(self, problem: MoEProblem, tensors: KernelTensors) -> KernelTensors:
        """The CUDA kernel's copy of the layer (cuda_layout) and, on a GPU, the stream kernel's workspace."""
        from vllm_wna16_plugin.kernels.cuda_ops import stream_workspace

        if tensors.w13_qweight.is_cuda:
            stream_workspace(tensors.w13_qweight.device)  # allocated here, before any CUDA-graph capture
        return cuda_layout(tensors)

    def run(self, problem: MoEProblem, state: KernelTensors, x, topk_weights, topk_ids, *, expert_map=None, plan=None):
        from vllm_wna16_plugin import _vllm
        from vllm_wna16_plugin.kernels.cuda_ops import CudaLaunch, fused_moe_wna16_cuda

        launch = plan.launch if plan is not None and isinstance(plan.launch, CudaLaunch) else None
        return fused_moe_wna16_cuda(
            x, *state.weights(), topk_weights, topk_ids, **layer_kwargs(problem, state, expert_map),
            global_num_experts=problem.global_num_experts, align_fn=_vllm.moe_align_block_size_fn(),
            options=problem.options.kernel, launch=launch,
        )  # fmt: skip
