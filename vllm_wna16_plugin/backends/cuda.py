"""`cuda`: the plugin's own CUDA WNA16 MoE GEMM (csrc/, torch.ops.wna16_plus) for decode and small batches.

Its rules: an NVIDIA GPU, the extension built (setup.py), int4 or int8, group sizes the launch-config
module takes (32/64/128) or channel-wise, K % 8 == 0, silu/gelu, act order in the sorted layout with
whole groups (not a tensor-parallel rank's padded one: base.act_order_padded),
and bf16 only from sm80. `auto` takes it for a layer where crossover.py's table (the user's tuned one,
then the shipped one) has a winning range of batch sizes on this device, or, for a shape without an
entry, where the shape rule below takes some batch size; the layer's launch plan (launch_plan.py) then
runs those batch sizes on it and the others on the triton backend. The tables come from bench_moe.py
--write-crossover and vllm-wna16 tune on a GPU (the H200's is shipped). An explicit choice (VLLM_WNA16_PLUS_BACKEND=cuda, or
backend="cuda") always runs the CUDA kernel.
"""

from __future__ import annotations

import dataclasses
import functools

from vllm_wna16_plugin import crossover
from vllm_wna16_plugin.backends.base import (
    Backend,
    KernelTensors,
    MoEProblem,
    half_precision_reason,
    layer_device,
    layer_kwargs,
    sort_act_order,
)
from vllm_wna16_plugin.block_config import cuda_group_reason
from vllm_wna16_plugin.kernels.options import DeviceSpec

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


# Where no crossover was measured for a layer, `auto` runs cuda by a rule of the shape (issue 22 item 2): int4 or
# int8 on sm90, GEMM1 on the tensor-core kernel, a batch of RULE_MIN_M..RULE_MAX_M tokens with at most
# RULE_MAX_TOKENS_PER_EXPERT tokens per expert hit, and a bar that depends on what triton would run there
# (configs.default_config; mean = routed pairs per hit expert, w = pairs of K steps per warp of the stream grid,
# the kernel's own split: cuda_ops.stream_pairs_per_warp):
#   - where triton runs its GEMV (mean <= configs.gemv_bound), which reads each expert's weights `mean` times to
#     cuda's once, cuda takes the batch once the extra reads outweigh its cost of running short of work per warp:
#         (mean - 1) * w >= RULE_MIN_EXTRA_READS[form]
#     (2.2 int4, 5 int4 with zero points, 12 int8: the kernel's zero-point and int8 paths gain less on the GEMV);
#   - where triton runs 16-row tl.dot tiles (its register-latency-bound form) cuda wins from
#     RULE_MIN_PAIRS_PER_WARP_TILE.
# The GEMV bar is fitted on the development set timed on the H100 (bench/results/h100/2026-12-07-d3ec747-h100-gemv-
# dev / -zp / -int8: plugin-cuda, plugin-triton-auto and the GEMV at every M in one run, TP 4, M 2-24), where the
# rule's pick came within 1.11x of the fastest of the three at every point (geomean 1.002; the former bars, under
# the former GEMV bound of 1.15: 1.20, worst 2.0). Checked on the validation set (-val / -zpval / -int8val): geomean
# 1.02, 7 of 147 points beyond 1.10x (granite-3.1-3b-a800m's tiny experts, where the GEMV stays fastest beyond its
# bound; DeepSeek-V3 int8 at M 12-16, 1.13x). The tile bar: the H200 development set (2026-12-05-c410069-dev) and
# the six bench shapes (runs stream3 / 12bbb3a-tuned-full, M 1-4096): cuda 0.59-0.83x triton's time from 1.5 pairs
# per warp, and even (0.92-1.05x) at 16 tokens per expert. tests/kernels/test_cuda_rule.py reads these runs.
RULE_MIN_M, RULE_MAX_M = 2, 64
RULE_MIN_EXTRA_READS = {"int4": 2.2, "int4 zero points": 5.0, "int8": 12.0}
RULE_MIN_PAIRS_PER_WARP_TILE = 1.5
RULE_MAX_TOKENS_PER_EXPERT = 12.0  # between Mixtral M=32 (8: cuda 0.76x) and M=64 (16: 0.92-1.05x)
RULE_SOURCE = "shape rule (backends/cuda.py, fitted on the H100 development set 2026-12-07-d3ec747-gemv)"


def rule_form(problem: MoEProblem) -> str:
    """The key of RULE_MIN_EXTRA_READS for this layer's weights (int8 with zero points takes int8's bar)."""
    if problem.scheme.bits == 8:
        return "int8"
    return "int4 zero points" if problem.scheme.has_zero_point else "int4"


def rule_takes(problem: MoEProblem, m: int, device: DeviceSpec) -> bool:
    """Whether the shape rule (above) runs `m` tokens of this layer on cuda on `device`."""
    from vllm_wna16_plugin.kernels.cuda_ops import mma_kernel_fits, stream_pairs_per_warp
    from vllm_wna16_plugin.kernels.triton.configs import expected_experts_hit, gemv_bound

    h, i, e, k, bits = problem.hidden, problem.intermediate, problem.num_experts, problem.top_k, problem.scheme.bits
    if not (RULE_MIN_M <= m <= RULE_MAX_M) or device.platform != "cuda" or device.sm != 90:
        return False
    if bits not in (4, 8) or not mma_kernel_fits(h, h // problem.group_size_w13, bits):
        return False
    per_expert = m * k / expected_experts_hit(m * k, e)
    if per_expert > RULE_MAX_TOKENS_PER_EXPERT:
        return False
    per_warp = stream_pairs_per_warp(m, k, e, h, i, bits, True, min(m, 8), device.sm_count)
    if per_expert <= gemv_bound(bits, h, i):
        return (per_expert - 1.0) * per_warp >= RULE_MIN_EXTRA_READS[rule_form(problem)]
    return per_warp >= RULE_MIN_PAIRS_PER_WARP_TILE


@functools.lru_cache(maxsize=1024)
def rule_ranges(problem: MoEProblem, device: DeviceSpec) -> tuple[tuple[int, int], ...]:
    """The runs [lo, hi] of batch sizes the shape rule gives cuda."""
    ranges: list[list[int]] = []
    for m in range(RULE_MIN_M, RULE_MAX_M + 1):
        if rule_takes(problem, m, device):
            if ranges and ranges[-1][1] == m - 1:
                ranges[-1][1] = m
            else:
                ranges.append([m, m])
    return tuple((lo, hi) for lo, hi in ranges)


# Act order moves the crossover at M=1 only. Each act-order layer call of cuda gathers x once per routed pair
# (cuda_ops.act_order_rows), which costs little beside GEMM1 from a few tokens on, but at M=1 the extra launch
# made cuda-ao 1.14-2.4x triton-ao's time (H200 2026-12-05-c410069-ao), triton gathering in its loads there.
# From 4 tokens triton gathers the pair rows once too (configs.act_order_form), within 1-4% of the layer
# without act order at M 64-256 (H100 2026-12-05-c8ee655-ao2), so the layer's own ranges decide the rest.
# (Before the rows form, act order also ran cuda at M 16-64 everywhere on sm90, which lost Mixtral-8x7B's M=64
# to triton's rows form: 703 against 563 us in the same run.)
ACT_ORDER_SOURCE = "act-order crossover (backends/cuda.py, H200 2026-12-05-c410069-ao, H100 2026-12-05-c8ee655-ao2)"


def act_order_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """A layer's cuda ranges with act order: the same without M=1."""
    return tuple((max(lo, 2), hi) for lo, hi in ranges if hi >= 2)


def layer_ranges(problem: MoEProblem, device: DeviceSpec | None = None) -> tuple[tuple[tuple[int, int], ...], str]:
    """(batch-size ranges where auto runs cuda, where they came from): a measured crossover (the user's own
    tuned table, then the shipped one: crossover.device_ranges), else the shape rule; for a layer with act
    order, moved by act_order_ranges."""
    device = device or layer_device(problem)
    key = layer_key(problem)
    ranges, source = crossover.device_ranges(key, device)
    if not (ranges or crossover.has_entry(key, device)):
        ranges, source = rule_ranges(problem, device), RULE_SOURCE
    if problem.has_g_idx:  # the gather costs the same launch at M=1 whatever the width (int8: not timed)
        return act_order_ranges(ranges), f"{source}, then the {ACT_ORDER_SOURCE}"
    return ranges, source


def measured_ranges(problem: MoEProblem) -> tuple[tuple[int, int], ...]:
    """The batch sizes at which auto runs `cuda` for this layer on its device (layer_ranges)."""
    return layer_ranges(problem)[0]


class CudaBackend(Backend):
    name = "cuda"
    sorted_act_order = True
    description = "plugin CUDA kernel (csrc/): int4/int8, groups 32/64/128 or channel-wise, decode-oriented"

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        if problem.platform != "cuda":
            return f"needs an NVIDIA GPU (platform is {problem.platform})"
        if problem.sm is not None and problem.sm < 80:
            return f"built for sm80+ (device is sm{problem.sm})"
        if problem.has_g_idx and problem.act_order_issue:
            return f"act order (desc_act with a non-trivial g_idx) cannot be sorted: {problem.act_order_issue}"
        if problem.has_g_idx and problem.act_order_padded:
            return (
                "act order on a tensor-parallel rank: its share of each down-projection group is padded to runs "
                "of 16 rows, and the CUDA kernel takes groups of 32, 64 or 128"
            )
        if problem.activation not in CUDA_ACTIVATIONS:
            return f"activation {problem.activation!r} is not one of {list(CUDA_ACTIVATIONS)}"
        if reason := half_precision_reason(problem):
            return reason
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
                "no measured crossover over triton for this shape on this device, and the shape rule takes no "
                "batch size (auto takes cuda where bench_moe.py --write-crossover or vllm-wna16 tune measured it "
                "faster, else by the shape rule of backends/cuda.py)"
            )
        if problem.options.plan_only:
            return None
        from vllm_wna16_plugin.kernels.cuda_ops import extension_error

        return extension_error()

    def prepare(self, problem: MoEProblem, tensors: KernelTensors) -> KernelTensors:
        """The CUDA kernel's copy of the layer (cuda_layout; act order sorted first, base.sort_act_order, unless
        the runner did) and, on a GPU, the stream kernel's workspace."""
        from vllm_wna16_plugin.kernels.cuda_ops import stream_workspace

        if tensors.a_perm is None and (tensors.w13_g_idx is not None or tensors.w2_g_idx is not None):
            tensors = sort_act_order(tensors, problem.scheme.bits)
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
            options=problem.options.kernel, launch=launch, a_perm=state.a_perm,
        )  # fmt: skip
