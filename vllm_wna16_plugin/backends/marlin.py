"""`marlin`: delegate to vLLM's Marlin MoE kernel, with the plugin's normalised group size.

The kernel layout is converted once (at prepare time) into GPTQ packing and
then through vLLM's own repack/permute helpers. Channel-wise is group -1 here,
whatever the checkpoint wrote (None or -1).
"""

from __future__ import annotations

from vllm_wna16_plugin.backends.base import Backend, KernelTensors, MoEProblem, half_precision_reason
from vllm_wna16_plugin.packing import KernelWeights, from_kernel_layout, pack_along

MARLIN_GROUP_SIZES = (32, 64, 128)


def _marlin_group(gs: int, size_k: int) -> int:
    return -1 if gs == size_k else gs


class MarlinBackend(Backend):
    name = "marlin"
    description = "vLLM's Marlin MoE kernel (int4/int8 symmetric, int4 with zero points)"

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        if problem.platform != "cuda":
            return f"needs an NVIDIA GPU (platform is {problem.platform})"
        if problem.sm is not None and problem.sm < 75:
            return f"needs sm75+, device is sm{problem.sm}"
        if problem.has_g_idx:
            return "act order is not wired to Marlin in this plugin yet"
        if problem.scheme.bits == 8 and problem.scheme.has_zero_point:
            return "Marlin has no int8 kernel with zero points"
        if problem.apply_router_weight_on_input:
            return "Marlin MoE does not apply the router weight on the input"
        if problem.activation not in ("silu", "gelu"):
            return f"activation {problem.activation!r} is not supported"
        if reason := half_precision_reason(problem):
            return reason
        if problem.hidden % 128:
            return f"hidden size {problem.hidden} is not a multiple of 128"
        gs2 = _marlin_group(problem.group_size_w2, problem.intermediate)
        if problem.intermediate % max(64, gs2):
            return f"intermediate size {problem.intermediate} on this rank is not a multiple of {max(64, gs2)}"
        for name, gs, k in (
            ("w13", problem.group_size_w13, problem.hidden),
            ("w2", problem.group_size_w2, problem.intermediate),
        ):
            g = _marlin_group(gs, k)
            if g != -1 and g not in MARLIN_GROUP_SIZES:
                return f"{name} group size {g} is not one of {list(MARLIN_GROUP_SIZES)} or channel-wise"
        if problem.group_size_w13 == problem.hidden and problem.group_size_w2 != problem.intermediate:
            return "mixed channel-wise/group-wise GEMMs"
        if problem.options.plan_only:
            return None
        try:
            from vllm_wna16_plugin import _vllm

            _vllm.marlin_pieces()
            if not _vllm.has_vllm_cuda_ops():
                return "vLLM's CUDA ops are not available"
        except Exception as exc:  # noqa: BLE001
            return f"vLLM's Marlin pieces cannot be imported ({type(exc).__name__}: {exc})"
        return None

    def _repack_one(self, pieces, qweight, scales, qzeros, bits: int):
        """One GEMM's kernel layout -> Marlin's (qweight, scales, zeros)."""
        qw = from_kernel_layout(KernelWeights(qweight, scales, qzeros), bits)
        num_experts, size_n, size_k = qw.q.shape
        gptq_qweight = pack_along(qw.q.transpose(-1, -2), bits, dim=-2, word_bits=32)  # (E, K/pf, N)
        marlin_q = pieces["repack"](gptq_qweight, size_k, size_n, bits)
        group = _marlin_group(qw.group_size, size_k)
        marlin_s = pieces["marlin_moe_permute_scales"](
            s=scales.transpose(-1, -2).contiguous(), size_k=size_k, size_n=size_n, group_size=group
        )
        marlin_z = None
        if qw.zeros is not None:
            packed = pack_along(qw.zeros.transpose(-1, -2), bits, dim=-1, word_bits=32)  # (E, G, N/pf)
            marlin_z = pieces["moe_packed_to_marlin_zero_points"](
                packed, size_k=packed.shape[1], size_n=size_n, num_bits=bits
            )
        return marlin_q, marlin_s, marlin_z

    def prepare(self, problem: MoEProblem, tensors: KernelTensors):
        from vllm_wna16_plugin import _vllm

        pieces = _vllm.marlin_pieces()
        bits = problem.scheme.bits
        w13 = self._repack_one(pieces, tensors.w13_qweight, tensors.w13_scales, tensors.w13_qzeros, bits)
        w2 = self._repack_one(pieces, tensors.w2_qweight, tensors.w2_scales, tensors.w2_qzeros, bits)
        st = pieces["scalar_types"]
        if problem.scheme.has_zero_point:
            quant_type = st.uint4
        else:
            quant_type = st.uint4b8 if bits == 4 else st.uint8b128
        return {
            "w13": w13,
            "w2": w2,
            "quant_type_id": quant_type.id,
            "workspace": pieces["marlin_make_workspace_new"](tensors.w13_qweight.device, 4),
            "pieces": pieces,
        }

    def run(self, problem: MoEProblem, state, x, topk_weights, topk_ids, *, expert_map=None, plan=None):
        pieces = state["pieces"]
        (w1, s1, z1), (w2, s2, z2) = state["w13"], state["w2"]
        return pieces["fused_marlin_moe"](
            x,
            w1,
            w2,
            None,
            None,
            s1,
            s2,
            topk_weights,
            topk_ids,
            quant_type_id=state["quant_type_id"],
            global_num_experts=problem.global_num_experts,
            activation=pieces["MoEActivation"](problem.activation),
            expert_map=expert_map,
            w1_zeros=z1,
            w2_zeros=z2,
            workspace=state["workspace"],
        )
