"""`marlin`: delegate to vLLM's Marlin MoE kernel, with the plugin's normalised group size.

The kernel layout is converted once (at prepare time) into GPTQ packing and
then through vLLM's own repack/permute helpers. Channel-wise is group -1 here,
whatever the checkpoint wrote (None or -1).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_wna16_plugin.backends.base import (
    Backend,
    KernelTensors,
    MoEProblem,
    composition_scope,
    experts_read,
    half_precision_reason,
    pairs_per_expert,
)
from vllm_wna16_plugin.packing import KernelWeights, from_kernel_layout, pack_along

MARLIN_GROUP_SIZES = (32, 64, 128)

# ---------------------------------------------------------------- composing auto with Marlin

# Where `auto` hands a batch to Marlin (vLLM 0.26-0.32's default for WNA16 MoE) on a layer the plugin's kernels
# also run, where Humming is not installed (compose.py; the layer then holds a second copy of its experts in
# Marlin's layout). Fitted on the development set of bench/model_catalog.py (8 models at TP 1 and 4, H200, vLLM
# 0.34.0: bench/results/h200/2026-12-05-c410069-dev.md at M 1/4/16/64/256, and 2026-12-06-3038a96-mid.md at
# M 64-512 for the Triton layer): Marlin's tensor-core tiles win once each hit expert takes enough rows and the
# call reads enough weights to fill the GPU, while the plugin's decode kernels win at few rows per expert and its
# prefill tiles from about 512 tokens. Marlin's time over the plugin's (auto), on the dev set:
#     rows per hit expert < 8 (M <= 16 everywhere, M=64 on the 64-128-expert models): 0.90-1.11 (the plugin's)
#          but for the largest reads: >= 4 rows and >= 600 MB read, 0.96-0.99 on all three points (GLM-4.5-Air
#          and Qwen3-235B-A22B at TP 1, M=64; Mixtral-8x7B at TP 1, M=16): Marlin's
#     >= 8 rows and >= 100 MB read: 0.59-0.93 on all 16 points (Marlin faster)
#     >= 16 rows and 40-100 MB: 0.85 and 0.99 (OLMoE-1B-7B and Qwen3-30B-A3B at TP 4, M=256)
#     8 rows, 52 MB (OLMoE-1B-7B at TP 4, M=64): 1.15 (the plugin's)
#     M=512 (Triton layer): 1.06-1.17 on four of five dev shapes (0.91 on Qwen3-235B-A22B at TP 4): the plugin's
# Checked on the validation set (never fitted on): bench/rule_report.py over -val4 / -mid and the composed run.
# Measured for int4, symmetric, groups 32-128 on sm90 only (int8 and zero points: below): elsewhere auto never
# composes with Marlin.
MARLIN_MIN_ROWS = 8  # rows per hit expert (base.pairs_per_expert) ...
MARLIN_MIN_BYTES = 100e6  # ... with this much of the experts read (base.experts_read)
MARLIN_MIN_ROWS_SMALL = 16  # or, for smaller reads, this many rows ...
MARLIN_MIN_BYTES_SMALL = 40e6  # ... and this much read
MARLIN_MIN_ROWS_LARGE = 4  # or, for the largest reads, this many rows ...
MARLIN_MIN_BYTES_LARGE = 600e6  # ... and this much read
MARLIN_MAX_TOKENS = 256  # the dev set's last point where Marlin led; the plugin's from 512
MARLIN_RULE_SOURCE = (
    "Marlin rule (backends/marlin.py; H200 dev set 2026-12-05-c410069-dev and 2026-12-06-3038a96-mid; int8 and zero "
    "points: 2026-12-06-eda7a88-h200-int8 / -zp, H100 2026-12-07-d59df80-h100-zp-small; their few-row bars: H100 "
    "2026-12-07-d3ec747-h100-gemv-zp / -int8)"
)
ENV_COMPOSE = "VLLM_WNA16_PLUS_MARLIN"  # auto (default): compose while memory allows; 1: always; 0: never


def marlin_copy_bytes(problem: MoEProblem) -> int:
    """Bytes of Marlin's copy of a layer (MarlinBackend.prepare): the weights at the same bits, the scales in
    the activation dtype and the zero points, for both GEMMs, plus its workspace (a few KB)."""
    e, h, i, bits = problem.num_experts, problem.hidden, problem.intermediate, problem.scheme.bits
    total = 0
    for n, k, gs in ((2 * i, h, problem.group_size_w13), (h, i, problem.group_size_w2)):
        groups = k // gs
        total += n * k * bits // 8 + n * groups * 2 + (n * groups * bits // 8 if problem.scheme.has_zero_point else 0)
    return e * total


# int8 and zero points (AWQ, GPTQ sym=false) under the same rule: the plugin's layer against Marlin on three dev
# models at TP 4, M 16-256 (H200, vLLM 0.34.0's Marlin, bench/results/h200/2026-12-06-eda7a88-h200-zp.md and
# -h200-int8.md): the symmetric int4 bars take 8 of the 15 points and Marlin was the faster on all 8 (plugin /
# Marlin µs: zero points Mixtral-8x7B M=64 198 / 122, int8 Phi-3.5-MoE M=64 315 / 120). The other 7 (M=16 on all
# three, and zero points on Qwen3-30B-A3B at M=64: 1.58-4.1 rows per hit expert, 50-353 MB read) were Marlin's too,
# by 1.12-2.73x (int8 Phi-3.5-MoE M=16 266 / 97; zero points Qwen3-30B-A3B M=16, 50 MB, 56.7 / 50.5): the plugin's
# int8 and zero-point kernels at a few rows per expert had none of the int4 decode kernels' lead (int8 ran the
# Triton tiles then: the CUDA kernel's rule was int4's until 070a73f). At decode the order turns: zero points on three more dev models at
# TP 4, M 1-8 (H100, vLLM 0.34.0, bench/results/h100/2026-12-07-d59df80-h100-zp-small.md, cut short after three
# models; Marlin ran two of them): at M 1-4 (1.03-1.13 rows per hit expert) the plugin's kernels were the faster on
# all 6 points (Qwen3-30B-A3B M=1 12.4 / 30.3 µs, Qwen3-235B-A22B M=4 49.9 / 56.9), at M=8 (1.27 rows, 31 and
# 123 MB) Marlin on both (Qwen3-30B-A3B 54.5 / 41.8, Qwen3-235B-A22B 95.2 / 82.9). So for these forms Marlin also
# took a batch of at least 8 tokens with 1.2 rows per hit expert and 30 MB read (until the refit below): every one
# of the 23 points above on its faster side (int8 below M=16, zero points at M 5-15 and the validation set were
# untimed then: the d3ec747 runs below time them).
# Marlin has no int8 kernel with zero points (incompatibility_reason), nor was it timed.
MARLIN_RULE_FORMS = ((4, False), (4, True), (8, False))  # (bits, zero points)
#
# Refitted per form after the plugin's GEMV bound (configs.gemv_bound, 070a73f) and the cuda rule's int8 / zero-point
# forms made its M 2-24 kernels faster: the plugin's fastest kernel against Marlin in the same runs (H100, vLLM
# 0.34.0, bench/results/h100/2026-12-07-d3ec747-h100-gemv-zp.csv and -int8.csv: the 8 dev models at TP 4, M 2-24).
# int8: the plugin was the faster on every dev point of M 8-24 the former bar gave Marlin (20 points, 1.01-1.49x:
# Qwen3-30B-A3B M=8 37.9 / 56.3 µs, Mixtral-8x7B M=24 180.1 / 181.2), so int8's few-row batches go to Marlin only from
# 32 tokens, where the former bar's evidence (M=64) lies. Zero points: Marlin led from 6 tokens where a hit expert
# takes 1.3+ rows and the call reads 55+ MB (Mixtral-8x7B and Phi-3.5-MoE from M=6, 1.08-1.22x; Qwen3-235B-A22B from
# M=12; Qwen3-30B-A3B at M=24, 61 MB, 1.02x), the plugin below (OLMoE-1B-7B at M 8-24 and Qwen3-30B-A3B at M 8-16,
# 31-50 MB, 1.02-1.44x; Qwen3-235B-A22B M=6, 1.20 rows, 1.04x): every dev point on its faster side but Qwen3-235B-A22B M=8
# (1.27 rows, even: 84.2 / 83.5). Checked on the validation set (-zpval.csv, -int8val.csv; never fitted on):
# tests/kernels/test_marlin_rule.py.


@dataclass(frozen=True)
class FormBar:
    """The few-row batches Marlin also takes for one (bits, zero points) form: at least `min_tokens` tokens with
    `min_rows` rows per hit expert (base.pairs_per_expert) and `min_bytes` of experts read (base.experts_read)."""

    min_tokens: int
    min_rows: float
    min_bytes: float


MARLIN_FORM_BARS = {
    (4, True): FormBar(min_tokens=6, min_rows=1.3, min_bytes=55e6),  # zero points: d3ec747-h100-gemv-zp
    (8, False): FormBar(min_tokens=32, min_rows=1.2, min_bytes=30e6),  # int8: the plugin's at M 8-24 (-int8)
}


def marlin_rule_applies(problem: MoEProblem, device) -> str | None:
    """Why the Marlin rule does not speak for a layer on a device (None: it does): the composition scope with the
    forms measured beside Marlin (MARLIN_RULE_FORMS)."""
    return composition_scope(problem, device, MARLIN_RULE_FORMS)


def marlin_takes(problem: MoEProblem, m: int, device) -> bool:
    """Whether auto runs `m` tokens of this layer on Marlin (the rule above): m <= MARLIN_MAX_TOKENS and

        (rows, read) >= (MARLIN_MIN_ROWS, MARLIN_MIN_BYTES), (MARLIN_MIN_ROWS_SMALL, MARLIN_MIN_BYTES_SMALL) or
        (MARLIN_MIN_ROWS_LARGE, MARLIN_MIN_BYTES_LARGE), each pair compared element-wise, and for int8 and
        zero-point layers of at least their form's FormBar.min_tokens (MARLIN_FORM_BARS) also (min_rows, min_bytes)

    rows = base.pairs_per_expert(problem, m), read = base.experts_read(problem, m)."""
    if m > MARLIN_MAX_TOKENS or marlin_rule_applies(problem, device):
        return False
    rows, read = pairs_per_expert(problem, m), experts_read(problem, m)
    bars = (
        (MARLIN_MIN_ROWS, MARLIN_MIN_BYTES),
        (MARLIN_MIN_ROWS_SMALL, MARLIN_MIN_BYTES_SMALL),
        (MARLIN_MIN_ROWS_LARGE, MARLIN_MIN_BYTES_LARGE),
    )
    form = MARLIN_FORM_BARS.get((problem.scheme.bits, bool(problem.scheme.has_zero_point)))
    if form is not None and m >= form.min_tokens:
        bars += ((form.min_rows, form.min_bytes),)
    return any(rows >= min_rows and read >= min_bytes for min_rows, min_bytes in bars)


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
