"""`hopper`: the plugin's sm90 grouped GEMM (CUTLASS: TMA, wgmma, warp-specialised, persistent over every expert's
tiles; kernels/hopper_ops.py) for batches whose experts take tens of rows or more, up to prefill.

Its rules: sm90 (the extension is built for sm90a only, where setup.py finds CUTLASS's headers), bfloat16 or
float16 activations, int4 weights (symmetric, or with zero points: run as int8 q - z, hopper_ops.kernel_bits) or
symmetric int8, in groups of a multiple of 64 or channel-wise, K (hidden, intermediate) a multiple of 64 and N (2 x intermediate, hidden) of 128, silu, no act order,
no expert parallelism, the router's weights applied after the down projection. It holds its own copy of the experts (signed, reordered for the
wgmma fragment: hopper_copy_bytes).

`auto` never runs it alone: a layer on the plugin's kernels (cuda / triton) also holds the hopper copy, when
memory allows (compose.py, VLLM_WNA16_PLUS_HOPPER), and the launch plan hands it the batches hopper_takes says it
runs faster. Named explicitly (VLLM_WNA16_PLUS_BACKEND=hopper) it runs every batch.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_wna16_plugin import _vllm
from vllm_wna16_plugin.backends.base import (
    Backend,
    KernelTensors,
    MoEProblem,
    expert_bytes,
    layer_device,
    pairs_per_expert,
)
from vllm_wna16_plugin.kernels.hopper_ops import K_TILE, N_TILE

logger = _vllm.init_logger(__name__)
FIRST_RUN = "moe_wna16_plus: the hopper kernel ran its first batch"  # logged once per process

ENV_COMPOSE = "VLLM_WNA16_PLUS_HOPPER"  # auto (default): hold the hopper copy while memory allows; 1: always; 0: never

# ---------------------------------------------------------------- when auto hands a batch to hopper

# Fitted on the development set (bench/model_catalog.py's 8 dev models at TP 4, H100, vLLM 0.34.0, the plugin's
# layer alone (plugin-auto), plugin-hopper, Humming, Marlin and bf16 dense in one run at M 32-4096:
# bench/results/h100/2026-12-06-d23a13c-hopper-dev.md). Times in µs, the plugin alone / hopper:
#     >= 64 rows per hit expert: hopper faster on all 13 points measured (Mixtral-8x7B M=256 300 / 180, M=1024
#         579 / 391; Qwen3-235B-A22B M=1024 486 / 385; OLMoE-1B-7B M=1024 155 / 145; Phi-3.5-MoE M=1024 360 / 236;
#         every M=4096), and faster than Marlin on all of them (Mixtral M=256: Marlin 296)
#     16-32 rows: the plugin's (or Marlin's) on 4 of 6 points (Qwen3-235B M=256 252 / 273, OLMoE M=256 80 / 90,
#         Qwen3-30B M=256 88 / 106; Phi M=256 even 191 / 192; Mixtral M=64 160 / 149 but Marlin 123)
# Humming (vLLM 0.33-0.34's default) led hopper at 16-64 rows (Mixtral M=256: 156 / 180) and on the many-expert
# models at prefill (Qwen3-235B M=4096: 893 / 1036), so a layer composed with Humming hands Humming its batches
# first; one composed with Marlin asks hopper first (HOPPER_BEFORE).
HOPPER_MIN_ROWS = 64.0  # rows per hit expert (base.pairs_per_expert) from which hopper's tiles win
# the layer forms (checkpoint bits, zero points) the rule holds for. int4 with zero points (run as int8 q - z) was
# timed on the H200 (bench/results/h200/2026-12-06-eda7a88-h200-zp.md, Mixtral-8x7B, Qwen3-30B-A3B and Phi-3.5-MoE at
# TP 4, M 16-4096; µs, the plugin alone / hopper / Marlin): at 64+ rows per hit expert hopper was the faster on all 7
# points (Mixtral M=256 317 / 213 / 283, M=1024 593 / 428 / 740; Qwen3-30B M=1024 171 / 163 / 207; Phi M=1024
# 499 / 253 / 410; every M=4096), below 64 rows the slower on every point timed (Mixtral M=64 198 / 232; Qwen3-30B
# M=256 102 / 140): the same threshold. Symmetric int8 is not in it: timed on one model only (Mixtral-8x7B, hopper
# faster from 64 rows: M=256 361 / 219), and an int8 checkpoint run by hopper named left the reference at a decode
# step on the H200 (tests/e2e/test_hopper_compose.py, not yet explained); VLLM_WNA16_PLUS_BACKEND=hopper runs it
HOPPER_RULE_FORMS = ((4, False), (4, True))
# (float16 layers take the same rule as bfloat16 ones: the same wgmma rate and the same bytes; right on the H100
# 2026-12-06, not timed apart)
HOPPER_BEFORE = (None, "marlin")  # the partners (None: no partner) whose rule hopper's goes before
HOPPER_RULE_SOURCE = (
    "hopper rule (backends/hopper.py; H100 dev set 2026-12-06-d23a13c-hopper-dev; "
    "zero points: H200 2026-12-06-eda7a88-h200-zp)"
)


def hopper_scope(problem: MoEProblem, device=None) -> str | None:
    """Why the hopper kernel cannot run this layer (on `device`, default the layer's), or None when it can: what
    the extension is built for (sm90a; bf16 / fp16; int4 and int8 weights, int4 zero points as int8 q - z:
    hopper_ops.BUILT_TILES, kernel_bits; K tile 64, weight tile 128 rows) and the layer forms its launcher takes.
    Never raises."""
    device = device or layer_device(problem)
    if device.platform != "cuda" or device.sm != 90:
        return f"built for sm90 only (device is {device.platform} sm{device.sm})"
    from vllm_wna16_plugin.kernels.hopper_ops import built_tiles

    scheme = problem.scheme
    if problem.has_g_idx:
        return "act order (desc_act) is not supported by the hopper kernel"
    if problem.act_dtype not in (torch.bfloat16, torch.float16):
        return f"bfloat16 or float16 activations only (the layer's are {str(problem.act_dtype).removeprefix('torch.')})"
    if not built_tiles(problem.act_dtype, scheme.has_zero_point, scheme.bits):
        return (
            f"{scheme.describe()}: not built (int4, symmetric or with zero points, and symmetric int8; int8 with zero "
            "points is not: hopper_ops.kernel_bits)"
        )
    if problem.activation != "silu":
        return f"activation {problem.activation!r}: the hopper kernel fuses silu only"
    if problem.use_ep or problem.global_num_experts != problem.num_experts:
        return (
            f"expert parallelism ({problem.num_experts} local of {problem.global_num_experts} experts): the hopper "
            "kernel routes every id to a local expert"
        )
    if problem.apply_router_weight_on_input:
        return "apply_router_weight_on_input (the hopper kernel weights the down projection's output)"
    h, i = problem.hidden, problem.intermediate
    for name, k, n, gs in (("w13", h, 2 * i, problem.group_size_w13), ("w2", i, h, problem.group_size_w2)):
        if k % K_TILE or n % N_TILE:
            return f"{name}: K={k} must be a multiple of {K_TILE} and N={n} of {N_TILE}"
        if gs % K_TILE or k % gs:
            return f"{name}: group size {gs} must be a multiple of {K_TILE} dividing K={k} (or channel-wise)"
    return None


def hopper_rule_gap(problem: MoEProblem) -> str | None:
    """Why auto's rule does not judge this layer (its form, bits and zero points, is not one the rule was timed on:
    HOPPER_RULE_FORMS), or None."""
    from vllm_wna16_plugin.kernels.hopper_ops import kernel_bits

    scheme = problem.scheme
    form = f"int{scheme.bits}" + (" with zero points" if scheme.has_zero_point else "")
    if kernel_bits(scheme.bits, scheme.has_zero_point) is None:
        return f"{form}: the hopper kernel has no form for it (hopper_scope)"
    if (scheme.bits, bool(scheme.has_zero_point)) not in HOPPER_RULE_FORMS:
        return (
            f"{form}: auto's hopper rule is timed on int4 layers (symmetric and with zero points) only ({form} not yet; "
            "VLLM_WNA16_PLUS_BACKEND=hopper runs it)"
        )
    return None


def hopper_takes(problem: MoEProblem, m: int, device) -> bool:
    """Whether auto runs `m` tokens of this layer on hopper: rows per hit expert (base.pairs_per_expert) of at
    least HOPPER_MIN_ROWS, where the kernel's scope (hopper_scope) holds and the rule was fitted (hopper_rule_gap)."""
    if hopper_rule_gap(problem) or hopper_scope(problem, device):
        return False
    return pairs_per_expert(problem, m) >= HOPPER_MIN_ROWS


def hopper_tile(problem: MoEProblem, rows_per_expert: float) -> int:
    """The token tile of a batch whose experts take `rows_per_expert` rows: hopper_ops.token_tile over the widths
    built for the layer's activation dtype, zero points and bits (hopper_ops.BUILT_TILES)."""
    from vllm_wna16_plugin.kernels.hopper_ops import built_tiles, token_tile

    scheme = problem.scheme
    return token_tile(rows_per_expert, built_tiles(problem.act_dtype, scheme.has_zero_point, scheme.bits))


def hopper_copy_bytes(problem: MoEProblem) -> int:
    """Bytes of the hopper copy of a layer: both GEMMs' weights in the kernel's bits (hopper_ops.kernel_bits: int4 with
    zero points as int8) and 16-bit scales of every local expert, the scales in the kernel's groups
    (hopper_ops.kernel_group_size)."""
    from vllm_wna16_plugin.kernels.hopper_ops import kernel_bits, kernel_group_size

    scheme = problem.scheme
    run = kernel_bits(scheme.bits, scheme.has_zero_point) or scheme.bits
    kernel = dataclasses.replace(
        problem,
        group_size_w13=kernel_group_size(problem.group_size_w13),
        group_size_w2=kernel_group_size(problem.group_size_w2),
        scheme=dataclasses.replace(scheme, bits=run, has_zero_point=False),
    )
    return int(problem.num_experts * expert_bytes(kernel))


class HopperBackend(Backend):
    name = "hopper"
    _ran = False  # whether this process logged FIRST_RUN
    description = (
        "plugin sm90 grouped GEMM (csrc/hopper/, CUTLASS: TMA + wgmma, warp-specialised): int4 (zero points as int8) and int8, "
        "bf16 / fp16, "
        "for tens of rows per expert up to prefill"
    )

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        if problem.platform != "cuda":
            return f"needs an NVIDIA GPU (platform is {problem.platform})"
        if reason := hopper_scope(problem):
            return reason
        if not problem.options.explicit:
            return "auto runs it beside the plugin's other kernels for the batches its rule takes, not alone"
        if problem.options.plan_only:
            return None
        from vllm_wna16_plugin.kernels.hopper_ops import extension_error

        return extension_error()

    def prepare(self, problem: MoEProblem, tensors: KernelTensors):
        from vllm_wna16_plugin.kernels import hopper_ops

        if (tensors.w13_qzeros is not None) != problem.scheme.has_zero_point:  # the plan's tiles follow the scheme
            raise ValueError(
                f"hopper: the layer's scheme ({problem.scheme.describe()}) and its tensors disagree on zero points"
            )

        return hopper_ops.prepare(
            *tensors.weights(), problem.group_size_w13, problem.group_size_w2, w13_qzeros=tensors.w13_qzeros,
            w2_qzeros=tensors.w2_qzeros, dtype=problem.act_dtype, bits=problem.scheme.bits,
        )  # fmt: skip

    def run(self, problem: MoEProblem, state, x, topk_weights, topk_ids, *, expert_map=None, plan=None):
        from vllm_wna16_plugin.kernels.hopper_ops import HopperLaunch, fused_moe_hopper

        if expert_map is not None:  # hopper_scope refuses expert parallelism: an expert_map here is a caller's bug
            raise ValueError("the hopper backend takes no expert_map (expert parallelism); use triton or cuda")
        launch = plan.launch if plan is not None and isinstance(plan.launch, HopperLaunch) else None
        if launch is None:
            launch = HopperLaunch(hopper_tile(problem, pairs_per_expert(problem, max(1, x.shape[0]))))
        if not self._ran:
            HopperBackend._ran = True
            logger.info("%s (M=%d tokens, %d-token tiles)", FIRST_RUN, x.shape[0], launch.tile)
        return fused_moe_hopper(x, state, topk_weights, topk_ids, launch)
