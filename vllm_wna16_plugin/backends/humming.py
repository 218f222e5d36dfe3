"""`humming`: delegate to the Humming kernels (humming-kernels 0.1.19), as vLLM 0.34 does for WNA16 MoE on sm90.

What it computes, for each token t routed to experts e_1..e_top_k with router weights w_1..w_top_k:

    y[t] = sum_k w_k * W2[e_k] · act(W13[e_k] · x[t])
    act(h) = silu(h[:I]) * h[I:]   (or gelu(h[:I]) * h[I:]; W13 = [gate; up] along N)

with every weight dequantized per group of K elements:

    w = (q - z) * s               with zero points
    w = (q - 2**(bits-1)) * s     symmetric

The GEMM1 output and the activation are rounded to the activation dtype (Humming's buffers are
bf16/fp16, as vLLM's are); the weighted sum over top_k runs in float32.

How: the plugin's kernel layout (`KernelTensors`) is exactly vLLM's `moe_wna16` layout, so prepare
does what vLLM 0.34 does for it (int_wna16.py `_convert_moe_wna16_humming_tensors`, then
humming's `prepare_and_transform_humming_tensors` with N padded to 256 and K to 128): the uint8
weights are re-viewed as int32 words (no data movement), the zero points re-viewed along N, the
scales cast to the activation dtype; Humming then repacks them once. Channel-wise is Humming's
`weight_scale_group_size=0`. run follows vLLM 0.34's `HummingIndexedExperts.apply`: token
alignment per the tuning table's M block, indexed GEMM1, the gated activation fused into
Humming's input processing, indexed GEMM2, then the weighted sum over top_k. Humming compiles its
kernels (NVRTC) at their first call, every M bucket of a layer at once; prepare runs one tiny
forward so that this never happens inside CUDA-graph capture.

vLLM's `moe_align_block_size` and `moe_fused_mul_sum` are used when they import; otherwise
capture-safe torch equivalents run (slower; results are the same).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_wna16_plugin import _vllm
from vllm_wna16_plugin.backends.base import (
    Backend,
    KernelTensors,
    MoEProblem,
    composition_scope,
    experts_read,
    half_precision_reason,
    pairs_per_expert,
)

logger = _vllm.init_logger(__name__)

HUMMING_REQUIREMENT = "humming-kernels==0.1.19"
# The humming-kernels each vLLM pins (its requirements, 0.26.0-0.34.0 unpacked 2026-12-05), as (humming-kernels,
# vLLM releases). The backend was written and GPU-checked against 0.1.19 only, the pin of vLLM 0.33-0.34, where
# vLLM's own WNA16 MoE oracle puts Humming first on sm90 (0.26-0.32 list it after Marlin and Triton). 0.1.10 and
# 0.1.12 lack names this backend calls; 0.1.16 and 0.1.17 have them, with other kernels and layouts, never run here.
VLLM_HUMMING_PINS = (("0.1.10", "0.26-0.27"), ("0.1.12", "0.28-0.30"), ("0.1.16", "0.31"), ("0.1.17", "0.32"),
                     ("0.1.19", "0.33-0.34"))  # fmt: skip


def _not_the_checked_humming(version: str, detail: str = "") -> str:
    """Why the installed humming-kernels `version` is not taken: the one reason, with what each vLLM pins."""
    pins = ", ".join(f"{h} (vLLM {v})" for h, v in VLLM_HUMMING_PINS)
    return (f"humming-kernels {version} is installed, but this backend is written and checked against "
            f"{HUMMING_REQUIREMENT} only (its humming.forward.humming_forward and humming.transform."
            f"prepare_and_transform_humming_tensors, kernels and layouts), what vLLM 0.33-0.34 install; vLLM pins "
            f"{pins}{'; ' + detail if detail else ''}")  # fmt: skip


PAD_N_TO = 256  # what vLLM 0.34 passes to prepare_and_transform_humming_tensors
PAD_K_TO = 128
MIN_GROUP = 16  # Humming's group scales: >= 256 / 16-bit activations, whole 16-wide MMA K steps

# vLLM 0.34 quantization/utils/humming/activation.py (SILU / GELU rows): compiled into Humming's
# input processing of GEMM2; a = the gate half, b = the up half of GEMM1's output.
_SILU_IMPL = "a / (1.f + expf(-a))"
_GELU_IMPL = "0.5f * a * (1.f + erff(a * 0.7071067811865476f))"
ACTIVATIONS = {
    "silu": {"activation_type": "binary_split", "activation_impl": f"({_SILU_IMPL}) * b"},
    "gelu": {"activation_type": "binary_split", "activation_impl": f"({_GELU_IMPL}) * b"},
}


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _installed_humming_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("humming-kernels")
    except Exception:  # noqa: BLE001
        return None


# What prepare and run call, by module (humming-kernels 0.1.19; 0.1.10 has no humming.forward, 0.1.12 no
# may_process_input or prepare_and_transform_humming_tensors).
_HUMMING_API = {
    "humming.forward": ("humming_forward", "may_process_input"),
    "humming.transform": ("prepare_and_transform_humming_tensors",),
    "humming.tune": ("get_heuristics_config",),
    "humming.schema": ("HummingInputSchema", "HummingWeightSchema"),
    "humming.config": ("GemmType",),
    "humming.dtypes": ("DataType",),
}


def humming_api_error() -> str | None:
    """None when humming imports with the 0.1.19 API this backend calls, else why not (never raises)."""
    try:
        if "humming" in sys.modules:
            installed = sys.modules["humming"] is not None  # None: imports of it are blocked
        else:
            installed = importlib.util.find_spec("humming") is not None
        if not installed:
            return f"humming-kernels is not installed (pip install {HUMMING_REQUIREMENT})"
    except Exception as exc:  # noqa: BLE001
        return f"humming cannot be located ({type(exc).__name__}: {exc})"
    version = _installed_humming_version()
    numbers = tuple(int(x) for x in re.findall(r"\d+", version or "")[:3])
    if numbers and numbers < (0, 1, 19):  # known too old: say so without importing it (an import starts helpers)
        return _not_the_checked_humming(version)
    version = None
    try:
        humming = importlib.import_module("humming")
        version = getattr(humming, "__version__", None) or _installed_humming_version()
        missing = [
            f"{module}.{name}"
            for module, names in _HUMMING_API.items()
            for name in names
            if not hasattr(importlib.import_module(module), name)
        ]
        if missing:
            raise ImportError(f"missing {missing}")
    except Exception as exc:  # noqa: BLE001
        version = version or _installed_humming_version() or "of unknown version"
        return _not_the_checked_humming(version, f"{type(exc).__name__}: {exc}")
    return None


# ------------------------------------------------------------------ alignment and weighted sum


def torch_align(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's moe_align_block_size(..., ignore_invalid_experts=True) in torch, with no host sync
    (so it can be captured in a CUDA graph).

    Returns (sorted_ids, expert_ids, num_tokens_padded): the flat route ids t*top_k+k grouped by
    local expert, each group padded to a multiple of block_size with the sentinel topk_ids.numel();
    the local expert of each block; the padded total as a 1-element int32 tensor. Routes whose
    expert is not local (expert_map -1, or an id outside [0, num_experts) without a map) are left out.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    device = flat.device
    if expert_map is not None:
        local = torch.where(flat >= 0, expert_map.to(torch.int64)[flat.clamp(min=0)], -1)
        num_local = int(expert_map.numel())  # an upper bound of the local ids; empty experts cost nothing
    else:
        local = flat
        num_local = num_experts
    local = torch.where((local >= 0) & (local < num_local), local, num_local)  # num_local: left out
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    counts = counts[:num_local]
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    max_len = _round_up(numel + num_local * (block_size - 1), block_size)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    starts = torch.cat([ends - padded, torch.full_like(zero, max_len)])  # slot of each expert's first route
    firsts = torch.cat([zero, counts.cumsum(0)])  # its first position in sorted order
    order = torch.argsort(local, stable=True)
    sorted_local = local[order]
    rank = torch.arange(numel, device=device) - firsts[sorted_local]
    dest = torch.where(sorted_local < num_local, starts[sorted_local] + rank, max_len)
    sorted_ids = torch.full((max_len + 1,), numel, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))  # left-out routes all land on the extra slot
    block_starts = torch.arange(0, max_len, block_size, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(block_starts < ends[-1], expert_ids, 0).to(torch.int32)  # past the end: never read
    num_tokens_padded = ends[-1:].to(torch.int32)
    return sorted_ids[:max_len], expert_ids, num_tokens_padded


def torch_weighted_sum(
    down: torch.Tensor,  # (M, top_k, H): GEMM2 output per route; rows of left-out routes are garbage
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * down[t,k] over the routes to local experts (float32 sum)."""
    valid = topk_ids >= 0
    if expert_map is not None:
        valid = valid & (expert_map[topk_ids.clamp(min=0).long()] >= 0)
    y = torch.where(valid.unsqueeze(-1), down.float(), 0.0)
    out.copy_((y * topk_weights.float().unsqueeze(-1)).sum(1))
    return out


def _vllm_align_fn(fn: Callable) -> Callable:
    def align(topk_ids, block_size, num_experts, expert_map):
        res = fn(topk_ids, block_size, num_experts, expert_map=expert_map, ignore_invalid_experts=True)
        return res[0], res[1], res[2]

    return align


def _vllm_sum_fn(fn: Callable) -> Callable:
    def weighted_sum(down, topk_weights, topk_ids, expert_map, out):
        return fn(inputs=down, topk_weights=topk_weights, outputs=out, topk_ids=topk_ids, expert_map=expert_map)

    return weighted_sum


# ------------------------------------------------------------------ the backend


@dataclass
class HummingState:
    """Humming's repacked weights and per-GEMM configs of one layer, plus what run needs."""

    num_experts: int  # local experts
    hidden: int
    intermediate: int
    act_dtype: torch.dtype
    configs: dict[str, Any]  # "w13"/"w2" -> humming.config.LayerConfig
    tensors: dict[str, dict[str, torch.Tensor]]  # "w13"/"w2" -> {"weight", "weight_scale", "zero_point"?}
    tuning: dict[str, list]  # "w13"/"w2" -> [[min_m, max_m, tuning dict], ...] (M buckets)
    tuning_str: dict[str, str]
    compute_config_str: str
    locks: torch.Tensor
    humming_forward: Callable
    may_process_input: Callable
    align: Callable = torch_align
    weighted_sum: Callable = torch_weighted_sum
    pieces: str = "torch"  # "vllm" or "torch": which align / weighted sum run
    warmup_s: float = 0.0  # the warm-up forward at prepare (Humming's JIT compile, first time per shape)
    extra: dict[str, Any] = field(default_factory=dict)


def _block_m(tuning: list, valid_shape_m: int) -> int:
    """The M block of the bucket that holds valid_shape_m (vLLM 0.34 prepare_humming_moe_kwargs)."""
    for lo, hi, cfg in tuning:
        if lo < valid_shape_m <= hi:
            return int(cfg["block_shape"][0])
    return 64


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.storage_offset() % 4:
        t = t.clone()
    return t.view(torch.int32)


def _to_humming(qweight, scales, qzeros, dtype) -> dict[str, torch.Tensor]:
    """Kernel layout -> Humming's tensors (vLLM 0.34 `_convert_moe_wna16_humming_tensors`): views only."""
    out = {"weight": _as_int32(qweight), "weight_scale": scales.to(dtype).contiguous()}  # (E, N, K*b/32) int32
    if qzeros is not None:  # (E, N*b/8, G) uint8 -> (E, N*b/32, G) int32, packed along N
        out["zero_point"] = _as_int32(qzeros.transpose(-1, -2)).transpose(-1, -2).contiguous()
    return out


# ---------------------------------------------------------------- composing auto with Humming

# Where `auto` hands a batch to Humming on a layer the plugin's kernels also run (launch_plan composes
# them; the layer then holds a second copy of its experts' weights in Humming's layout, compose_decision).
# Fitted on the development set of bench/model_catalog.py (8 models at TP 1 and 4, M 1/4/16/64/256; H200,
# vLLM 0.34.0, humming-kernels 0.1.19, bench/results/h200/2026-12-05-c410069-dev.md): Humming streams a
# call's weights faster once the call reads more than a few tens of MB, while the plugin's decode kernels
# win on small reads (less fixed cost per expert). The plugin's best kernel over Humming's time:
#     M=1: faster on every dev shape whose experts hit read <= 44 MB (1.12-2.77x), slower on every one
#          reading >= 69 MB (0.85-0.96x)
#     M>=4: faster where the call reads <= 20 MB (1.08-1.65x), slower or even (<= 1.01x) on 27 of 28 others
#          (Qwen1.5-MoE-A2.7B at TP1, M=4, 62 MB: 1.15x the one miss)
# Checked on the validation set (2026-12-05-c410069-val4.md, -val-mixtral8x22b.csv; never fitted on):
# bench/rule_report.py. Measured for int4, symmetric, groups 32-128 on sm90 only (int8 and zero points: below):
# elsewhere auto never composes.
# Raised from 20 to 35 MB after the plugin's GEMV bound (kernels/triton/configs.gemv_bound, 070a73f) made its M 2-24
# kernels faster (H100, vLLM 0.34.0; the plugin's time from bench/results/h100/2026-12-07-d3ec747-h100-gemv-dev.csv,
# the fastest of its kernels there, Humming's from 2026-12-07-21a66c2-h100-dev-composed.csv: two runs on the same
# kind of GPU, not one): at M=4 the two dev points reading 21-23 MB turned to the plugin's (DeepSeek-V2-Lite at TP 4
# 24.6 / 34.1 µs, OLMoE-1B-7B 21.1 / 31.8), the other 14 points at M 4-16 (45-197 MB, or under 20 MB) keep their side.
# Where the bar sits between 23 and 45 MB (no dev point reads between): each dev model's two points (M=4, 16) give
# each kernel's time as a line in the bytes read, and those lines cross at 35 MB (Qwen1.5-MoE-A2.7B), 41-44 MB
# (DeepSeek-V2-Lite, OLMoE-1B-7B, Qwen3-30B-A3B) and 58-60 MB (Qwen3-235B-A22B, GLM-4.5-Air): the bar is the
# lowest crossing, so the change only hands batches to the plugin where it was measured or modelled faster. Zero
# points agree (the plugin from -gemv-zp.csv, Humming from 2026-12-07-d59df80-h100-zp-small.csv): at M=8 Qwen3-30B-A3B
# (31 MB) 30.0 / 38.2 µs and Qwen1.5-MoE-A2.7B (29 MB) 29.6 / 39.8 now go to the plugin, Qwen3-235B-A22B (123 MB)
# 84.2 / 71.1 stays Humming's. On the validation set (H100, 2026-12-05-c8ee655-composed.csv / -composed2.csv: the
# plugin's former kernels, never fitted on) the only points reading 20-35 MB beyond M=2 were the plugin's, both missed
# by the 20 MB bar (ERNIE-4.5-21B-A3B at TP 4, M=4, 31 MB: 36.8 / 39.0 µs; Qwen3-Next-80B-A3B M=8, 30 MB: 26.2 / 33.6).
# Re-timed in one run each at M 2-32 (H100, b542b3f-h100-compose-dev / -zp, 4 of the dev models): every choice within
# 4% of the faster side, 12% with zero points; on the validation run (-val / -zpval, not fitted on) Humming was taken
# at 1.1-1.3 rows per hit expert and 42-83 MB where the plugin led by 7-26% (docs/perf/any-model.md, last section).
HUMMING_M1_MIN_BYTES = 56e6
HUMMING_MIN_BYTES = 35e6
# M=2 was not timed beside Humming: its bar is M=1's, since Humming's times bracket M=2 between its M=1 and
# M=4 ones and the plugin's own M=2 times (run stream3) sit nearer its M=1 ones (Qwen3-30B-A3B: 20 / 29 / 48 µs
# at M=1 / 2 / 4 against Humming's 29 / - / 46)
HUMMING_M1_BAR_UP_TO = 2
# Prefill, whatever the call reads: from 64 rows per hit expert (base.pairs_per_expert) Humming was the faster on
# every development point timed (H100, vLLM 0.34.0, bench/results/h100/2026-12-07-21a66c2-h100-dev-composed.md, the
# 8 dev models at TP 4, M=1024 and 4096, 64-1024 rows on each): faster than the plugin's own kernels on all 16
# (plugin / Humming µs: Qwen3-235B-A22B M=1024 472 / 298, Qwen3-30B-A3B M=4096 459 / 429) and than the hopper
# kernel on 7 of the 10 it can run (Qwen3-235B M=4096 1052 / 898; hopper ahead by at most 7%: Phi-3.5-MoE M=1024
# 236 / 253). The bytes bar above (20 MB then) alone left the prefill of layers reading less than 20 MB to the plugin: on the
# validation set (H200, bench/results/h200/2026-12-06-eda7a88-h200-val-composed.md: where the miss was seen, so not
# an independent check) granite-3.1-3b-a800m at TP 4 (12 MB) ran M=1024 / 4096 on the hopper copy in 90.9 / 261 µs
# against Humming's 72.3 / 242.
HUMMING_PREFILL_ROWS = 64.0


# int8's own bar, in place of the two above for (8, False) up to 64 tokens: against the plugin's int8 kernels as the
# GEMV bound and the cuda rule run them (070a73f), Humming's int8 was the slower side on 26 of the 31 development
# points reading less than 170 MB (H100, vLLM 0.34.0, bench/results/h100/2026-12-07-b542b3f-h100-compose-int8.csv: the
# 8 dev models at TP 4, M 4-64, plugin-auto and Humming in the same run): on the small experts (Qwen3-30B-A3B,
# Qwen1.5-MoE-A2.7B, DeepSeek-V2-Lite; 32-151 MB) the plugin led at every M up to 48, by up to 1.73x
# (Qwen1.5-MoE-A2.7B M=4 24.9 / 43.0 µs; DeepSeek-V2-Lite M=4 30.4 / 48.9), and on the large ones at M=4
# (Qwen3-235B-A22B 136 MB, 69.3 / 75.9; Phi-3.5-MoE 130 MB, 69.2 / 72.3). Above 200 MB (no dev point reads 152-206 MB)
# Humming led on 22 of 25 points (Qwen3-235B-A22B M=8, 242 MB, 123.5 / 119.3; Mixtral-8x7B M=64 264 / 148); the three
# others within 8% (GLM-4.5-Air M=8, 225 MB, 110.5 / 119.3; Mixtral-8x7B M=4, 235 MB, 110.7 / 114.1; Phi-3.5-MoE
# M=48 even). Per model, each side's time as a line in the bytes read between the two points that bracket the
# crossing: 171 MB (Phi-3.5-MoE), 201 (Qwen3-235B-A22B), 251 (Mixtral-8x7B), 294 (GLM-4.5-Air); the bar is the lowest,
# as for int4. Left over: OLMoE-1B-7B (1.6 MB experts) at M 16-32 and 64 (89-102 MB), the plugin's where Humming led
# by 1-12% (M=64: 75.1 / 67.4). Above 64 tokens (not timed here) the bars above apply again, as they did before. Not
# timed: int8 at M 1-2 beside Humming (this bar applies there too: M=1's bar is the higher one for int4), the
# validation set in int8 beside Humming, the H200.
@dataclass(frozen=True)
class BytesBar:
    """A (bits, zero points) form's own bytes bar: Humming takes a batch of at most `up_to_tokens` tokens when it
    reads more than `min_bytes` of experts (base.experts_read), in place of HUMMING_M1_MIN_BYTES / HUMMING_MIN_BYTES."""

    min_bytes: float
    up_to_tokens: int


HUMMING_FORM_BARS = {(8, False): BytesBar(min_bytes=170e6, up_to_tokens=64)}  # int8: b542b3f-h100-compose-int8
HUMMING_RULE_SOURCE = (
    "Humming rule (backends/humming.py; H200 dev set 2026-12-05-c410069-dev, validated on -val4; int8 and zero "
    "points: 2026-12-06-eda7a88-h200-int8 / -zp, H100 2026-12-07-d59df80-h100-zp-small; the 35 MB bar: H100 "
    "d3ec747-h100-gemv-dev against 21a66c2-h100-dev-composed, re-timed b542b3f-h100-compose-dev; int8's 170 MB bar: H100 "
    "b542b3f-h100-compose-int8, not validated)"
)
ENV_COMPOSE = "VLLM_WNA16_PLUS_HUMMING"  # auto (default): compose while memory allows; 1: always; 0: never


def humming_copy_bytes(problem: MoEProblem) -> int:
    """Bytes of Humming's copy of a layer: its weights with N padded to PAD_N_TO and K to PAD_K_TO (as
    prepare_and_transform_humming_tensors lays them out), the scales in the activation dtype and the zero
    points, for both GEMMs."""
    e, h, i, bits = problem.num_experts, problem.hidden, problem.intermediate, problem.scheme.bits
    total = 0
    for n, k, gs in ((2 * i, h, problem.group_size_w13), (h, i, problem.group_size_w2)):
        n_pad, k_pad = _round_up(n, PAD_N_TO), _round_up(k, PAD_K_TO)
        groups = 1 if gs == k else k_pad // gs
        total += (
            n_pad * k_pad * bits // 8
            + n_pad * groups * 2
            + (n_pad * groups * bits // 8 if problem.scheme.has_zero_point else 0)
        )
    return e * total


# Symmetric int8 and int4 with zero points (AWQ, GPTQ sym=false) under the same rule: the plugin's own kernels
# against Humming on three dev models at TP 4, M 16-4096 (H200, vLLM 0.34.0, bench/results/h200/
# 2026-12-06-eda7a88-h200-zp.md and -h200-int8.md): Humming was faster on 22 of the 23 points measured right
# (plugin / Humming µs, zero points: Mixtral-8x7B M=64 198 / 113, Qwen3-30B-A3B M=4096 455 / 430; int8: Phi-3.5-MoE
# M=16 266 / 98), the 23rd even (int8 Qwen3-30B-A3B M=16, 70.0 / 70.8); all read more than the bytes bar (48 MB and
# up), so the rule gives all 23 to Humming. What auto ran before on the zero-point layers' 64+-row batches was the
# hopper copy (HOPPER_RULE_FORMS), and there Humming, which goes first (HOPPER_BEFORE), is not always faster: the
# hopper layer led on 5 of those 7 points by 3-15% (Mixtral-8x7B M=4096 1165 / 1338) and trailed on 2 by 15-19%
# (Mixtral-8x7B M=256 213 / 178, Qwen3-30B-A3B M=1024 163 / 141): even in geomean (1.00), Humming's copy kept as for
# int4. Below M=16 zero points were timed on three dev models at TP 4 (two of them new), M 1-8 (H100, bench/results/
# h100/2026-12-07-d59df80-h100-zp-small.md, cut short after three models): the bars' choice was the faster side on
# all 12 points (the plugin at M 1-4, by 1.08-2.5x, Qwen3-30B-A3B M=1 12.4 / 30.9 µs; Humming at M=8, Qwen3-30B-A3B
# 54.5 / 38.2; Qwen3-235B-A22B M=4 even, 49.9 / 49.8). int8 below M=16, first timed at b542b3f beside the
# GEMV-bound kernels, has its own bar since (HUMMING_FORM_BARS, above). int8 with zero points was never measured:
# outside the rule.
HUMMING_RULE_FORMS = ((4, False), (4, True), (8, False))  # (bits, zero points)


def humming_rule_applies(problem: MoEProblem, device) -> str | None:
    """Why the Humming rule does not speak for a layer on a device (None: it does): the composition scope with
    the forms measured beside Humming (HUMMING_RULE_FORMS)."""
    return composition_scope(problem, device, HUMMING_RULE_FORMS)


def humming_takes(problem: MoEProblem, m: int, device) -> bool:
    """Whether auto runs `m` tokens of this layer on Humming (the rule above): the expert weights a call
    of m tokens reads (experts_read) above HUMMING_M1_MIN_BYTES (m <= 2) or HUMMING_MIN_BYTES (for int8 up to
    64 tokens, HUMMING_FORM_BARS' 170 MB instead), or at least HUMMING_PREFILL_ROWS rows per hit expert (prefill)."""
    if humming_rule_applies(problem, device):
        return False
    if pairs_per_expert(problem, m) >= HUMMING_PREFILL_ROWS:
        return True
    form_bar = HUMMING_FORM_BARS.get((problem.scheme.bits, problem.scheme.has_zero_point))
    if form_bar is not None and m <= form_bar.up_to_tokens:
        return experts_read(problem, m) > form_bar.min_bytes
    return experts_read(problem, m) > (HUMMING_M1_MIN_BYTES if m <= HUMMING_M1_BAR_UP_TO else HUMMING_MIN_BYTES)


class HummingBackend(Backend):
    name = "humming"
    description = (
        "Humming kernels (humming-kernels 0.1.19; vLLM 0.33-0.34's default WNA16 MoE on sm90): "
        "int4/int8, symmetric or zero points, groups >= 16 or channel-wise"
    )

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        if problem.platform != "cuda":
            return f"needs an NVIDIA GPU (platform is {problem.platform})"
        if problem.sm is not None and problem.sm < 75:
            return f"needs sm75+, device is sm{problem.sm}"
        if reason := half_precision_reason(problem):
            return reason
        if problem.act_dtype == torch.bfloat16 and problem.sm is not None and problem.sm < 80:
            return f"bf16 activations need sm80+, device is sm{problem.sm}"
        if problem.scheme.bits not in (4, 8):
            return f"int{problem.scheme.bits} is not supported (int4 or int8)"
        if problem.has_g_idx:
            return "act order (g_idx) is not supported by Humming"
        if problem.apply_router_weight_on_input:
            return "Humming MoE does not apply the router weight on the input"
        if problem.activation not in ACTIVATIONS:
            return f"activation {problem.activation!r} is not one of {list(ACTIVATIONS)}"
        for what, size in (("hidden size", problem.hidden), ("intermediate size on this rank", problem.intermediate)):
            if size % 8:
                return f"{what} {size} is not a multiple of 8"
        for name, gs, k in (
            ("w13", problem.group_size_w13, problem.hidden),
            ("w2", problem.group_size_w2, problem.intermediate),
        ):
            if gs == k:
                continue  # channel-wise (Humming's group size 0)
            if gs < MIN_GROUP or gs % MIN_GROUP:
                return f"{name} group size {gs} is not a multiple of {MIN_GROUP} (nor channel-wise)"
            if _round_up(k, PAD_K_TO) % gs:
                return f"{name} group size {gs} does not divide K={k} padded to {_round_up(k, PAD_K_TO)}"
        # zero points: the scheme's one flag covers both GEMMs; prepare checks the tensors agree
        if problem.options.plan_only:
            return None
        return humming_api_error()

    def prepare(self, problem: MoEProblem, tensors: KernelTensors) -> HummingState:
        from humming import dtypes
        from humming.config import GemmType
        from humming.forward import humming_forward, may_process_input
        from humming.schema import HummingInputSchema, HummingWeightSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config

        if sys.byteorder != "little":
            raise NotImplementedError("the uint8 -> int32 re-view of the weights needs a little-endian host")
        has_zp = tensors.w13_qzeros is not None
        if has_zp != (tensors.w2_qzeros is not None) or has_zp != problem.scheme.has_zero_point:
            raise ValueError(
                f"zero points: scheme says {problem.scheme.has_zero_point}, w13 has "
                f"{tensors.w13_qzeros is not None}, w2 has {tensors.w2_qzeros is not None}"
            )
        bits, dtype = problem.scheme.bits, problem.act_dtype
        num_experts, hidden, inter = problem.num_experts, problem.hidden, problem.intermediate
        device = tensors.w13_qweight.device
        configs, humming_tensors, tuning = {}, {}, {}
        with torch.cuda.device(device):
            for name, qweight, scales, qzeros, shape_n, shape_k in (
                ("w13", tensors.w13_qweight, tensors.w13_scales, tensors.w13_qzeros, 2 * inter, hidden),
                ("w2", tensors.w2_qweight, tensors.w2_scales, tensors.w2_qzeros, hidden, inter),
            ):
                groups = scales.shape[-1]
                schema = HummingWeightSchema(
                    b_dtype=dtypes.DataType.from_str(f"uint{bits}"),
                    weight_scale_group_size=0 if groups == 1 else shape_k // groups,  # 0: channel-wise
                    has_zero_point=has_zp,
                )
                configs[name], humming_tensors[name] = prepare_and_transform_humming_tensors(
                    tensors=_to_humming(qweight, scales, qzeros, dtype),
                    shape_n=shape_n,
                    shape_k=shape_k,
                    pad_n_to_multiple=PAD_N_TO,
                    pad_k_to_multiple=PAD_K_TO,
                    input_schema=HummingInputSchema(),
                    weight_schema=schema,
                    has_bias=False,
                    num_experts=num_experts,
                    torch_dtype=dtype,
                    device=device,
                )
                tuning[name] = get_heuristics_config(
                    layer_config=configs[name],
                    use_f16_accum=False,
                    use_batch_invariant=False,
                    gemm_type=GemmType.INDEXED,
                    device=device,
                )
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            state = HummingState(
                num_experts=num_experts,
                hidden=hidden,
                intermediate=inter,
                act_dtype=dtype,
                configs=configs,
                tensors=humming_tensors,
                tuning=tuning,
                tuning_str={k: json.dumps(v) for k, v in tuning.items()},
                compute_config_str=json.dumps(
                    {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": GemmType.INDEXED.value}
                ),
                locks=torch.zeros(num_sms * 8, dtype=torch.int32, device=device),  # vLLM's create_humming_locks
                humming_forward=humming_forward,
                may_process_input=may_process_input,
            )
            self._warm_up(problem, state)
        return state

    def _warm_up(self, problem: MoEProblem, state: HummingState) -> None:
        """One forward of one token: Humming compiles every M bucket's kernels now, not under graph capture."""
        device = state.locks.device
        pieces = _vllm.align_and_weighted_sum_pieces()
        top_k = problem.top_k
        x = torch.randn(1, state.hidden, device=device).to(state.act_dtype)
        ids = (torch.arange(top_k, device=device, dtype=torch.int32) % state.num_experts).view(1, top_k)
        weights = torch.full((1, top_k), 1.0 / top_k, device=device)
        start = time.perf_counter()
        if pieces["moe_align_block_size"] is not None and pieces["moe_fused_mul_sum"] is not None:
            state.align = _vllm_align_fn(pieces["moe_align_block_size"])
            state.weighted_sum = _vllm_sum_fn(pieces["moe_fused_mul_sum"])
            state.pieces = "vllm"
            try:
                self._forward(state, x, weights, ids, problem.activation, None, state.num_experts)
            except Exception as exc:  # noqa: BLE001 - vLLM installed without working ops: torch's
                logger.warning(
                    "humming: warm-up with vLLM's align/sum failed (%s: %s); retrying with torch's",
                    type(exc).__name__,
                    exc,
                )
                state.align, state.weighted_sum, state.pieces = torch_align, torch_weighted_sum, "torch"
        if state.pieces == "torch":
            self._forward(state, x, weights, ids, problem.activation, None, state.num_experts)
        self._warm_up_input_processing(problem, state)
        torch.cuda.synchronize(device)
        state.warmup_s = time.perf_counter() - start
        logger.info("humming: %s prepared, warm-up forward %.1f s", problem.describe(), state.warmup_s)

    @staticmethod
    def _warm_up_input_processing(problem: MoEProblem, state: HummingState) -> None:
        """Humming picks programmatic dependent launch for its activation kernel by M on some GPUs
        (never on sm90) and compiles each choice apart: compile every choice it can make now."""
        try:
            from humming.tune import get_heuristics_class

            heuristics = get_heuristics_class(state.locks.device)
            choices = {bool(heuristics.should_use_pdl_for_input(state.configs["w2"], m)) for m in (1, 1 << 20)}
        except Exception:  # noqa: BLE001 - a later humming may decide otherwise; the forward warmed its default
            return
        if len(choices) < 2:
            return
        device = state.locks.device
        gate_up = torch.randn(1, 2 * state.intermediate, device=device).to(state.act_dtype)
        act = torch.empty(1, state.intermediate, device=device, dtype=state.act_dtype)
        for use_pdl in sorted(choices):
            state.may_process_input(
                state.configs["w2"],
                inputs=gate_up,
                outputs=act,
                hadamard_block_size=0,
                layout="normal",
                use_pdl=use_pdl,
                **ACTIVATIONS[problem.activation],
            )

    def run(self, problem: MoEProblem, state: HummingState, x, topk_weights, topk_ids, *, expert_map=None, plan=None):
        if problem.apply_router_weight_on_input:
            raise ValueError("humming: apply_router_weight_on_input is not supported")
        global_num_experts = state.num_experts if expert_map is None else int(expert_map.numel())
        return self._forward(state, x, topk_weights, topk_ids, problem.activation, expert_map, global_num_experts)

    @staticmethod
    def _forward(
        state: HummingState,
        x: torch.Tensor,  # (..., H) in state.act_dtype
        topk_weights: torch.Tensor,  # (M, top_k)
        topk_ids: torch.Tensor,  # (M, top_k), global ids when expert_map is given
        activation: str,
        expert_map: torch.Tensor | None,  # (global E,) local id or -1
        global_num_experts: int,
    ) -> torch.Tensor:
        """vLLM 0.34 HummingIndexedExperts.apply, without its workspace manager."""
        hidden, inter = state.hidden, state.intermediate
        lead = x.shape[:-1]
        x = x.reshape(-1, hidden).contiguous()
        m = x.shape[0]
        if m == 0:
            return x.new_empty((*lead, hidden))
        top_k = topk_ids.shape[-1]
        topk_ids = topk_ids.reshape(m, top_k).to(torch.int32).contiguous()
        topk_weights = topk_weights.reshape(m, top_k).contiguous()
        # estimate_local_valid_shape_m: picks the M bucket (kernel and alignment block) of both GEMMs
        valid_shape_m = math.ceil(m * top_k * state.num_experts / global_num_experts)
        bs13 = _block_m(state.tuning["w13"], valid_shape_m)
        bs2 = _block_m(state.tuning["w2"], valid_shape_m)
        sorted13, experts13, padded13 = state.align(topk_ids, bs13, global_num_experts, expert_map)
        if bs2 == bs13:
            sorted2, experts2, padded2 = sorted13, experts13, padded13
        else:
            sorted2, experts2, padded2 = state.align(topk_ids, bs2, global_num_experts, expert_map)

        gate_up = torch.empty((m * top_k, 2 * inter), dtype=x.dtype, device=x.device)
        act = torch.empty((m * top_k, inter), dtype=x.dtype, device=x.device)
        down = torch.empty((m * top_k, hidden), dtype=x.dtype, device=x.device)
        common = dict(
            bias=None,
            weight_scale_2=None,
            input_scale=None,
            input_scale_2=None,
            locks=state.locks,
            compute_config=state.compute_config_str,
            valid_shape_m=valid_shape_m,
        )
        t13, t2 = state.tensors["w13"], state.tensors["w2"]
        state.humming_forward(
            state.configs["w13"],
            inputs=x,
            weight=t13["weight"],
            weight_scale=t13["weight_scale"],
            zero_point=t13.get("zero_point"),
            outputs=gate_up,
            sorted_ids=sorted13,
            expert_ids=experts13,
            num_tokens_padded=padded13,
            top_k=top_k,
            tuning_config=state.tuning_str["w13"],
            **common,
        )
        act, _, _ = state.may_process_input(
            state.configs["w2"],
            inputs=gate_up,
            outputs=act,
            token_scales=None,
            hadamard_block_size=0,
            layout="normal",
            expert_tokens=None,
            scatter_idx=None,
            num_valid_tokens=None,
            **ACTIVATIONS[activation],
        )
        state.humming_forward(
            state.configs["w2"],
            inputs=act,
            weight=t2["weight"],
            weight_scale=t2["weight_scale"],
            zero_point=t2.get("zero_point"),
            outputs=down,
            sorted_ids=sorted2,
            expert_ids=experts2,
            num_tokens_padded=padded2,
            top_k=1,
            tuning_config=state.tuning_str["w2"],
            **common,
        )
        out = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
        state.weighted_sum(down.view(m, top_k, hidden), topk_weights, topk_ids, expert_map, out)
        return out.view(*lead, hidden)
