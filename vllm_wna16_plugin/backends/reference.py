"""`reference` (vLLM's `--moe-backend emulation`): the float32 torch reference. Any device, slow."""

from __future__ import annotations

from vllm_wna16_plugin.backends.base import Backend, KernelTensors, MoEProblem, layer_kwargs
from vllm_wna16_plugin.reference import ACTIVATIONS, fused_moe_wna16_ref


class ReferenceBackend(Backend):
    name = "reference"
    description = "pure-torch dequantize + matmul (float32); for testing and CPU"

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        if problem.activation not in ACTIVATIONS:
            return f"activation {problem.activation!r} is not one of {list(ACTIVATIONS)}"
        return None

    def run(self, problem: MoEProblem, state: KernelTensors, x, topk_weights, topk_ids, *, expert_map=None, plan=None):
        return fused_moe_wna16_ref(
            x, *state.weights(), topk_weights, topk_ids, **layer_kwargs(problem, state, expert_map),
            w13_g_idx=state.w13_g_idx, w2_g_idx=state.w2_g_idx,
        )  # fmt: skip
