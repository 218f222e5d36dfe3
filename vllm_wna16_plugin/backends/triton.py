"""`triton`: the plugin's own Triton fused-MoE WNA16 kernel (pointer path + tensor-descriptor path)."""

from __future__ import annotations

import dataclasses
import os

from vllm_wna16_plugin.backends.base import (
    Backend,
    KernelTensors,
    MoEProblem,
    half_precision_reason,
    layer_kwargs,
    sort_act_order,
)
from vllm_wna16_plugin.kernels.triton.configs import group_size_reason

TRITON_ACTIVATIONS = ("silu", "gelu")


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonBackend(Backend):
    name = "triton"
    sorted_act_order = True
    description = "plugin Triton kernel (int4/int8, groups of a power of two or a multiple of 16, TD path on sm90+/XPU)"

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        on_gpu = problem.platform in ("cuda", "xpu", "rocm")
        if not on_gpu and not (_interpreter_on() and problem.options.explicit):
            return (
                f"needs a CUDA/ROCm/XPU GPU (platform is {problem.platform}); on CPU it runs in Triton's interpreter "
                "(slow) when asked for by name with TRITON_INTERPRET=1 set in the environment"
            )
        if problem.platform == "cuda" and problem.sm is not None and problem.sm < 70:
            return f"needs sm70+, device is sm{problem.sm}"
        if problem.has_g_idx and problem.act_order_issue:
            return f"act order (desc_act with a non-trivial g_idx) cannot be sorted: {problem.act_order_issue}"
        if problem.activation not in TRITON_ACTIVATIONS:
            return f"activation {problem.activation!r} is not one of {list(TRITON_ACTIVATIONS)}"
        if reason := half_precision_reason(problem):
            return reason
        for gemm, gs, k in (("w13", problem.group_size_w13, problem.hidden),
                            ("w2", problem.group_size_w2, problem.intermediate)):  # fmt: skip
            if reason := group_size_reason(gemm, gs, k):
                return reason
        if problem.options.plan_only:  # doctor: judge the device described, not this machine
            return None
        try:
            import triton  # noqa: F401

            from vllm_wna16_plugin.kernels.triton.fused_moe import fused_moe_wna16_triton  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - report, never raise
            return f"the Triton kernel cannot be imported ({type(exc).__name__}: {exc})"
        return None

    def prepare(self, problem: MoEProblem, tensors: KernelTensors) -> KernelTensors:
        """Act order: the sorted layout (base.sort_act_order: new tensors and a_perm, padded on a
        tensor-parallel rank); else as given."""
        if tensors.a_perm is None and (tensors.w13_g_idx is not None or tensors.w2_g_idx is not None):
            return sort_act_order(tensors, problem.scheme.bits)
        return tensors

    def prepared_problem(self, problem: MoEProblem, state: KernelTensors) -> MoEProblem:
        """Act order on a tensor-parallel rank runs padded (base.sort_act_order): GEMM2's K is I_pad, in
        scale groups of the layout's run; the state's shapes say so."""
        if state.a_perm is None:
            return problem
        inter = state.w13_qweight.shape[1] // 2
        group_size_w2 = inter // state.w2_scales.shape[-1]
        if (inter, group_size_w2) == (problem.intermediate, problem.group_size_w2):
            return problem
        return dataclasses.replace(problem, intermediate=inter, group_size_w2=group_size_w2)

    def run(self, problem: MoEProblem, state: KernelTensors, x, topk_weights, topk_ids, *, expert_map=None, plan=None):
        from vllm_wna16_plugin import _vllm
        from vllm_wna16_plugin.kernels.triton.configs import TritonLaunch
        from vllm_wna16_plugin.kernels.triton.fused_moe import fused_moe_wna16_triton

        configs = plan.launch.configs if plan is not None and isinstance(plan.launch, TritonLaunch) else None
        align_fn = _vllm.moe_align_block_size_fn() if x.is_cuda else None
        return fused_moe_wna16_triton(
            x, *state.weights(), topk_weights, topk_ids, **layer_kwargs(problem, state, expert_map),
            global_num_experts=problem.global_num_experts, configs=configs, align_fn=align_fn,
            a_perm=state.a_perm, options=problem.options.kernel,
        )  # fmt: skip
