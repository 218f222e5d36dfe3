"""Full WNA16 MoE layer (both GEMMs) on the GPU: the plugin's backends vs vLLM's own paths vs bf16 dense.

One process, one run, every provider side by side on the same tensors. Every
provider is checked against the float reference before it is timed (a wrong
kernel is never timed). Timing: a CUDA graph of R back-to-back layer calls over
R rotating weight copies (so the weights are not L2-resident, as in decode),
replayed `--reps` times; the median (and p20/p80) per call is reported.

    python bench/bench_moe.py --out bench/results/h200 [--shapes qwen3-30b-a3b,...] [--m 1,2,4]
    python bench/bench_moe.py --model-config PATH/TO/config.json --tp 1,4 [--bits 4 --group-size 128] [--dry-run]
    python bench/bench_moe.py --shapes qwen3-30b-a3b --zero-points --dtype float16 --tag=-awq-fp16

--zero-points quantizes with zero points (w = (q - z) * s, as AWQ and GPTQ sym=false checkpoints hold them;
default symmetric, z = 2**(bits-1)); --dtype is the activations' and scales' dtype (and bf16-dense's weights'),
bfloat16 by default. Both are stated in the .md header and in the device CSV's run_note column.

--model-config (a config.json, or the model's directory; repeatable) times that model's routed-experts layer
as one vLLM rank runs it at each --tp size (bench/model_shapes.py: I / tp, the checkpoint's bits and group
size, re-grouped as the plugin loads it), in shapes named like "Qwen3-30B-A3B@tp4"; --dry-run prints the
shapes and exits before anything touches a GPU.

Writes <out>/<date>-<commit>.md, .csv and .png, prints the table, and appends the rows, each with the
device, vLLM/torch/Triton versions, commit, run name and date, to the device's CSV (<out>/results.csv;
bench/results_table.py makes tables and plots from it).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # model_shapes, results_table

from model_catalog import SETS, catalog_configs  # noqa: E402
from model_shapes import Shape, model_moe_shape, shapes_from_configs  # noqa: E402

from vllm_wna16_plugin import packing  # noqa: E402
from vllm_wna16_plugin.backends import KernelTensors, MoEProblem, RunOptions  # noqa: E402
from vllm_wna16_plugin.compose import composable_with, compose_with, hopper_composable, with_hopper  # noqa: E402
from vllm_wna16_plugin.kernels.options import KernelOptions  # noqa: E402
from vllm_wna16_plugin.launch_plan import LayerRunner  # noqa: E402
from vllm_wna16_plugin.ops import make_problem  # noqa: E402
from vllm_wna16_plugin.oracle import select_backend  # noqa: E402
from vllm_wna16_plugin.reference import fused_moe_ref  # noqa: E402

SHAPES = [
    Shape("qwen3-30b-a3b", 128, 8, 2048, 768, 128),
    Shape("qwen3.5-35b-a3b", 256, 8, 2048, 512, 32),
    Shape("mixtral-8x7b", 8, 2, 4096, 14336, 128),
    Shape("deepseek-v2-lite", 64, 6, 2048, 1408, 128),
    Shape("ct-channelwise", 128, 8, 2816, 704, -1),
    Shape("k1344-gs32", 8, 2, 1344, 1024, 32),
]
M_VALUES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
# --dtype: the activations' and scales' dtype (and bf16-dense's weights': the provider keeps its name)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def make_weights(s: Shape, bits: int, gen: torch.Generator, zero_points: bool = False, device: str = "cuda"):
    """Random experts quantized round-to-nearest, w = (q - z) * s: z per group with zero_points, else
    2**(bits-1). device: "cpu" for the tests (gen must be that device's generator)."""
    w13 = torch.randn(s.E, 2 * s.I, s.H, generator=gen, device=device) / s.H**0.5
    w2 = torch.randn(s.E, s.H, s.I, generator=gen, device=device) / s.I**0.5
    q13 = packing.quantize_rtn(w13, bits, s.group_w13, zero_points)  # each GEMM's own (effective) group size
    q2 = packing.quantize_rtn(w2, bits, s.group_w2, zero_points)
    return q13, q2


def shape_weights(
    s: Shape, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16, zero_points: bool = False,
    device: str = "cuda",
):  # fmt: skip
    """(kernel-layout w13, w2, their fp32 dequantized weights) of a shape's random experts, scales in dtype
    and packed zeros (KernelWeights.qzeros) with zero_points; the reference sees the scales rounded to dtype,
    as the kernels see them."""
    q13, q2 = make_weights(s, s.bits, gen, zero_points, device)
    kw13, kw2 = packing.to_kernel_layout(q13, dtype), packing.to_kernel_layout(q2, dtype)
    q13.scales, q2.scales = kw13.scales.float(), kw2.scales.float()
    return kw13, kw2, packing.dequantize(q13), packing.dequantize(q2)


def weight_bytes_per_expert(s: Shape, bits: int, dense: bool, zero_points: bool = False) -> float:
    """3HI weights of bits / 8 bytes + (2I * g13 + H * g2) 16-bit scales, and with zero_points as many zeros
    packed bits / 8 bytes each (KernelWeights.qzeros: N * bits / 8 bytes per group column); dense: 3HI * 2."""
    n = 3 * s.H * s.I
    if dense:
        return n * 2.0
    g13 = s.H // s.group_w13
    g2 = s.I // s.group_w2
    groups = 2 * s.I * g13 + s.H * g2
    return n * bits / 8 + groups * 2 + (groups * bits / 8 if zero_points else 0)


def measure_copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the byte floor's denominator)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * (1 << 30) / statistics.median(times)


def measure_matmul_rate(n: int = 8192) -> float:
    """bf16 (n x n) @ (n x n) on the tensor cores, FLOP/s (median of 10): the prefill ceiling '%mm' reads
    against (issue 23: the fraction of bf16 tensor-core peak a layer call reaches at prefill)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * n**3 / statistics.median(times)


def layer_flops(s, m: int) -> float:
    """Multiply-add FLOPs of one layer call of m tokens: each of the m * top_k routed pairs runs GEMM1
    (2I x H) and GEMM2 (H x I), 2 FLOPs per weight: 6 * m * top_k * H * I."""
    return 6.0 * m * s.top_k * s.H * s.I


# Cycles of a sleep kernel queued ahead of each timed graph replay (about 50 µs on an H200), so that the
# GPU is still busy while the host submits the graph: the replay's start event then runs right before the
# graph's first kernel, and the time is the graph's alone. Without it, a graph of one layer call (Mixtral,
# whose 150 MB of L2-cold weights need one copy) also counted the host's graph launch, a gap no layer of a
# served model pays (vLLM replays one graph for all layers of a step). 0: the old timing (--launch-gap).
QUEUE_AHEAD_CYCLES = 100_000


def time_graph(fn_list, reps: int) -> tuple[float, float, float]:
    """Median/p20/p80 µs per call of a graph that calls every fn in fn_list once (device time of the replay:
    see QUEUE_AHEAD_CYCLES)."""
    for fn in fn_list:  # warm up / compile outside capture
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fn_list:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fn_list:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if QUEUE_AHEAD_CYCLES:
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / len(fn_list))
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return statistics.median(times), q(0.2), q(0.8)


class VllmPaths:
    """vLLM 0.26's in-tree paths, driven through its public fused_experts (forced per path for the bench)."""

    def __init__(self):
        import vllm.model_executor.layers.fused_moe.fused_moe as fm
        from vllm.model_executor.layers.fused_moe import fused_experts
        from vllm.model_executor.layers.fused_moe.config import (
            int4_w4a16_moe_quant_config,
            int8_w8a16_moe_quant_config,
        )

        self.fm, self.fused_experts = fm, fused_experts
        self.qc = {4: int4_w4a16_moe_quant_config, 8: int8_w8a16_moe_quant_config}
        self.orig = fm.should_moe_wna16_use_cuda

    def int4(self, path: str, x, w, topk_weights, topk_ids, gs, bits: int = 4):
        forced = {"vllm-triton": False, "vllm-cuda": True}[path]
        orig = self.orig
        self.fm.should_moe_wna16_use_cuda = lambda *a, **kw: forced and orig(*a, **kw)
        try:
            # w1_zp / w2_zp: the plugin's packed zeros as they are. vLLM's moe_wna16 layer holds them in this
            # layout, (E, N * bits / 8, G) uint8, even n in the low nibble (quantization/moe_wna16.py's
            # create_weights and convert_awq_tensor), and hands the same tensors to its Triton kernel and to
            # its CUDA one (fused_moe.py's dispatch_fused_moe_kernel), whose Triton kernel reads zero
            # (e, n, g) at byte n // 2, nibble n % 2, of [e, :, g] (fused_moe_kernel_gptq_awq)
            qc = self.qc[bits](w1_scale=w.scales13, w2_scale=w.scales2, w1_zp=w.qzeros13, w2_zp=w.qzeros2,
                               block_shape=[0, gs])  # fmt: skip
            return self.fused_experts(x, w.q13, w.q2, topk_weights, topk_ids, quant_config=qc)
        finally:
            self.fm.should_moe_wna16_use_cuda = orig

    def dense(self, x, w13, w2, topk_weights, topk_ids):
        return self.fused_experts(x, w13, w2, topk_weights, topk_ids)


@dataclass
class Weights:
    q13: torch.Tensor
    q2: torch.Tensor
    scales13: torch.Tensor
    scales2: torch.Tensor
    dense13: torch.Tensor | None = None
    dense2: torch.Tensor | None = None
    g13: torch.Tensor | None = None  # (E, 2, H) int32: act order (ACT_ORDER providers), gate = up
    g2: torch.Tensor | None = None  # (E, I) int32
    qzeros13: torch.Tensor | None = None  # (E, 2I*bits/8, H/gs) uint8 (--zero-points), packed along N
    qzeros2: torch.Tensor | None = None  # (E, H*bits/8, I/gs) uint8


def int_weights(kw13, kw2) -> Weights:
    """The Weights of a shape's kernel-layout w13 / w2 (KernelWeights), their packed zeros with them."""
    return Weights(kw13.qweight, kw2.qweight, kw13.scales, kw2.scales, qzeros13=kw13.qzeros, qzeros2=kw2.qzeros)


def rotating_copies(base: Weights, n: int) -> list[Weights]:
    """base and n - 1 copies of it, every tensor field cloned (the R rotating weight copies: L2-cold reads)."""
    copies = [base]
    for _ in range(n - 1):
        copies.append(Weights(**{k: None if t is None else t.clone() for k, t in vars(base).items()}))
    return copies


# Providers "<plugin provider>-ao" time the same layer as a GPTQ act-order checkpoint holds it: each expert's
# K rows of both GEMMs in a random order, g_idx naming each row's group (make_act_order), sorted at load as
# the plugin sorts a real one; their twin without "-ao" is the cost's baseline. Every group stays whole (a
# TP=1 checkpoint: no padding rows); channel-wise shapes have no act order.
ACT_ORDER_SUFFIX = "-ao"


def make_act_order(kw13, kw2, d13, d2, s: Shape, bits: int, gen: torch.Generator):
    """(Weights with act order, the dequantized weights as that checkpoint means them).

    A row k of the act-order checkpoint is row P[e, k] of the base weights: q_ao[:, k] = q[:, P[k]] and
    g_idx[k] = P[k] // group, so dequantize(q_ao)[:, k] = W[:, P[k]] and the reference multiplies x by
    W[:, P] (a gather of the base dequantized weights along K). Zero points and scales are per group, named by
    g_idx: they stay as they are. d13 / d2 None: the weights only (None, None for the dequantized ones:
    bench/kernel_breakdown.py times kernels, it checks nothing)."""
    e = s.E
    dev = kw13.qweight.device
    p1 = torch.stack([torch.randperm(s.H, generator=gen, device=dev) for _ in range(e)])
    p2 = torch.stack([torch.randperm(s.I, generator=gen, device=dev) for _ in range(e)])
    g13 = (p1 // s.group_w13).to(torch.int32)[:, None, :].expand(e, 2, s.H).contiguous()
    w = Weights(packing.permute_k(kw13.qweight, p1, bits), packing.permute_k(kw2.qweight, p2, bits),
                kw13.scales, kw2.scales, g13=g13, g2=(p2 // s.group_w2).to(torch.int32).contiguous(),
                qzeros13=kw13.qzeros, qzeros2=kw2.qzeros)  # fmt: skip
    if d13 is None or d2 is None:
        return w, None, None
    d13_ao = torch.gather(d13, -1, p1[:, None, :].expand(-1, d13.shape[1], -1))
    d2_ao = torch.gather(d2, -1, p2[:, None, :].expand(-1, d2.shape[1], -1))
    return w, d13_ao, d2_ao


class NotApplicable(Exception):
    """A provider that does not take this shape (its oracle says why): shown as n/a, not as a crash."""


# Peers that run through the plugin's delegating backend (the same kernels and preparation vLLM runs):
# vLLM's Marlin MoE, and Humming, vLLM 0.33-0.34's default for WNA16 MoE on sm90 (humming-kernels 0.1.19+).
DELEGATED = {"vllm-marlin": "marlin", "vllm-humming": "humming"}
# plugin-auto-composed: auto composed with Humming (compose.py), as a layer loaded on a vLLM with humming-kernels
# runs it when its second copy fits the device's memory; plugin-auto-marlin: composed with Marlin, as on a vLLM
# without Humming (0.26-0.32)
COMPOSED = {"auto-composed": "humming", "auto-marlin": "marlin"}
# plugin-auto-hopper: auto with the hopper kernel's copy (compose.with_hopper), no vLLM partner; -composed-hopper /
# -marlin-hopper: beside that partner (what a layer loaded under auto runs on sm90 where the kernel is built: the
# partner alone where the hopper copy is not kept, e.g. beside Humming, compose.hopper_composable);
# plugin-hopper runs the hopper kernel at every batch size
WITH_HOPPER = ("auto-hopper", "auto-composed-hopper", "auto-marlin-hopper")


def layer_problem(x, w: Weights, topk_ids, gs: int, *, bits: int = 4, gs_w2: int | None = None) -> MoEProblem:
    """The MoEProblem of the bench's tensors (make_problem's); where GEMM2's group size is not GEMM1's (a
    group size re-grouped for I / tp, Shape.gs_w2), the pair of them, as the plugin's layer builds it. Zero
    points when w carries packed zeros (--zero-points); the activations' dtype is x's."""
    group_size = gs if gs_w2 is None else (gs, gs_w2)
    return make_problem(x, w.q13, w.q2, w.scales13, w.scales2, topk_ids, bits=bits, group_size=group_size,
                        has_zero_point=w.qzeros13 is not None, w13_qzeros=w.qzeros13,
                        w2_qzeros=w.qzeros2)  # fmt: skip


def kernel_tensors(w: Weights) -> KernelTensors:
    """The plugin's KernelTensors of the bench's Weights (zeros and act order's g_idx where w has them)."""
    return KernelTensors(w.q13, w.q2, w.scales13, w.scales2, w13_qzeros=w.qzeros13, w2_qzeros=w.qzeros2,
                         w13_g_idx=w.g13, w2_g_idx=w.g2)  # fmt: skip


def plugin_backend(prov: str, x, w: Weights, topk_ids, gs: int, *, bits: int = 4, gs_w2: int | None = None):
    """The LayerRunner of a plugin provider or of a DELEGATED peer (gs: the scheme's group size; bits, gs_w2:
    Shape.bits and Shape.gs_w2, see layer_problem): its selection, prepared states and launch plans, with the
    kernel options the provider names (provider_options). Its `run(x, topk_weights, topk_ids)` is timed."""
    act_order = prov.endswith(ACT_ORDER_SUFFIX)
    prov = prov.removesuffix(ACT_ORDER_SUFFIX)
    name = DELEGATED.get(prov) or prov.removeprefix("plugin-")
    if name.startswith("cuda-"):  # a kernel or launch geometry of CUDA_FORMS
        name = "cuda"
    if name.startswith("triton"):  # plugin-triton-*: a form of TRITON_FORMS, or TD as named / as decided
        name = "triton"
    problem = layer_problem(x, w, topk_ids, gs, bits=bits, gs_w2=gs_w2)
    problem = dataclasses.replace(problem, options=RunOptions(kernel=provider_options(prov)), has_g_idx=act_order)
    hopper = name in WITH_HOPPER
    partner = COMPOSED.get(name.removesuffix("-hopper") if hopper else name)
    name = "auto" if partner or hopper else name
    try:  # each provider but auto is asked for by name; auto is the oracle's pick with the shipped crossover
        selection = select_backend(problem, name, "provider")
    except ValueError as exc:
        raise NotApplicable(f"{name} rejects: {exc}") from None
    if partner:  # what a layer loaded under auto runs where that partner is vLLM's and memory allows
        if reason := composable_with(selection, partner):
            if not hopper:  # a -hopper provider's layer holds the hopper copy alone then, as loading does
                raise NotApplicable(f"not composed with {partner}: {reason}")
        else:
            selection = compose_with(selection, partner)
    if hopper:
        if reason := hopper_composable(selection):
            if not selection.problem.options.compose_with:  # beside a partner the layer keeps it alone, as loading
                raise NotApplicable(f"not composed with the hopper kernel: {reason}")
        else:
            selection = with_hopper(selection)
    return LayerRunner(selection, kernel_tensors(w))


# Providers that time a Triton kernel form other than the default (KernelOptions.pair_step_math, dot_nibbles):
# the dequantize-the-tile GEMV and the interleaved int4 dot (the defaults before 09163a5's measurement),
# the split dot (the default before c5ff782's), and the words dot wherever the tile takes it; plugin-triton
# forces pointer loads, plugin-triton-td forces TD, plugin-triton-auto lets the tuned config and td_gate
# decide (what the plugin runs), plugin-triton-alt reads its tuned configs from --alt-config-dir
TRITON_FORMS = {
    "plugin-triton": {"use_td": False},
    "plugin-triton-td": {"use_td": True},
    "plugin-triton-auto": {},
    "plugin-triton-alt": {},
    "plugin-triton-tile": {"use_td": False, "pair_step_math": "tile", "dot_nibbles": "interleave"},
    "plugin-triton-split": {"use_td": False, "dot_nibbles": "split"},
    "plugin-triton-words": {"use_td": False, "dot_nibbles": "words"},
    # act order's gather forms (KernelOptions.triton_act_order; auto picks by M, configs.act_order_form): time
    # them as plugin-triton-auto-rows-ao / plugin-triton-auto-load-ao
    "plugin-triton-auto-rows": {"triton_act_order": "rows"},
    "plugin-triton-auto-load": {"triton_act_order": "load"},
    # the swapped tl.dot tile (KernelOptions.swap_ab: C.T = dequant(B) @ A.T, wgmma's M from the weights)
    # on every tile config of 16+ rows auto would run
    "plugin-triton-swap": {"swap_ab": True},
    # GEMM1 with the gated activation in its epilogue (KernelOptions.triton_fuse_act) on every unsplit GEMM1
    # auto would run, at the same tiles: one launch fewer, half the programs over N
    "plugin-triton-fused": {"triton_fuse_act": True},
}


# Providers that time the CUDA kernel as another kernel (cuda_kernel), launch geometry (cuda_ctas_per_sm: the
# grid BLOCK_SIZE_N is halved toward; cuda_min_warp_steps: the K steps a warp keeps while it is halved), form
# (cuda_stream), alignment (own_align) or launch kind (programmatic_launch); see KernelOptions
CUDA_FORMS = {
    "plugin-cuda-gemv": {"cuda_kernel": "gemv"},  # the CUDA-core kernel, where the tensor-core one would run
    "plugin-cuda-ctas1": {"cuda_ctas_per_sm": 1},
    "plugin-cuda-ctas4": {"cuda_ctas_per_sm": 4},
    "plugin-cuda-steps4": {"cuda_min_warp_steps": 4},
    "plugin-cuda-steps0": {"cuda_min_warp_steps": 0},  # the halving before the warp-steps floor
    "plugin-cuda-ctas4-steps4": {"cuda_ctas_per_sm": 4, "cuda_min_warp_steps": 4},
    "plugin-cuda-bm16": {"cuda_max_block_m": 16},  # vLLM's min(16, M) (the default before 2026-12-04-bm8a)
    "plugin-cuda-tiles": {"cuda_stream": False},  # the tiled mma kernel for decode blocks (before the stream kernel)
    "plugin-cuda-vllm-align": {"own_align": False},  # vLLM's moe_align_block_size (before csrc/moe_align.cu)
    "plugin-cuda-plain-launch": {"programmatic_launch": False},  # no programmatic dependent launches
}


# plugin-triton-alt reads its tuned configs from the directory --alt-config-dir DIR names, plugin-triton-alt-NAME
# from the one --alt-config-dir NAME=DIR names: candidate entries (or candidate rules written as tables by
# bench/heuristic_tables.py) timed side by side with the shipped ones (plugin-triton-auto) in the same run
ALT_CONFIG_DIRS: dict[str, Path] = {}
ALT_PREFIX = "plugin-triton-alt"


def alt_config_dirs(specs: list[str]) -> dict[str, Path]:
    """--alt-config-dir values ("DIR" or "NAME=DIR") -> {provider name: directory}; ValueError for a NAME used twice
    or one that is not a plain word."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        prov = f"{ALT_PREFIX}-{name}" if sep else ALT_PREFIX
        if sep and not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise ValueError(f"--alt-config-dir {spec!r}: NAME must be letters, digits or _ (NAME=DIR)")
        if prov in out:
            raise ValueError(f"--alt-config-dir {spec!r}: {prov} is named twice")
        out[prov] = Path(path if sep else spec)
    return out


def provider_options(prov: str) -> KernelOptions:
    """The kernel options a provider names (TRITON_FORMS, CUDA_FORMS; the defaults for the others)."""
    prov = prov.removesuffix(ACT_ORDER_SUFFIX)
    form = {**TRITON_FORMS.get(prov, {}), **CUDA_FORMS.get(prov, {})}
    if prov == ALT_PREFIX or prov.startswith(ALT_PREFIX + "-"):
        if prov not in ALT_CONFIG_DIRS:
            want = "DIR" if prov == ALT_PREFIX else f"{prov.removeprefix(ALT_PREFIX + '-')}=DIR"
            raise NotApplicable(f"{prov} needs --alt-config-dir {want}")
        form["config_dir"] = ALT_CONFIG_DIRS[prov]
    return KernelOptions(**form)


def git_commit() -> str:
    """BENCH_COMMIT when set (the GPU machine's copy may carry a stale .git), else git's HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        # it names result files: characters the device tool will not bring back ("+") become "_"
        return re.sub(r"[^\w.-]", "_", os.environ["BENCH_COMMIT"])
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (argparse type: a clear error for anything else)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes",
        default=None,
        help=f"the built-in shapes to time (default: all of them, {','.join(s.name for s in SHAPES)}; "
        "none when --model-config is given)",
    )
    ap.add_argument(
        "--model-config",
        action="append",
        default=[],
        metavar="PATH",
        help="a model's config.json (or its directory): time its routed-experts layer as one vLLM rank runs it "
        "at each --tp size (repeatable; see bench/model_shapes.py for the fields read)",
    )
    ap.add_argument(
        "--catalog",
        choices=SETS,
        default=None,
        help="time the routed-experts layers of bench/model_catalog.py's public models: the development set "
        "(the launch plan's rules are fitted on it), the validation set (never fitted on) or all, at each --tp",
    )
    ap.add_argument(
        "--tp", type=int_list, default=[1], help="tensor-parallel sizes for --model-config / --catalog, e.g. 1,2,4,8"
    )
    ap.add_argument(
        "--ep",
        action="store_true",
        help="expert parallelism across the --tp ranks (vLLM's --enable-expert-parallel): rank 0's experts, "
        "I unsplit; --dry-run only (timing a rank's share of the routed tokens is not implemented)",
    )
    ap.add_argument(
        "--bits", type=int, default=None, help="weight bits for --model-config (default: quantization_config's, else 4)"
    )
    ap.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="group size for --model-config, -1 channel-wise (default: quantization_config's, else 128)",
    )
    ap.add_argument("--name", default=None, help="the model's name in shape names (default: the config's directory)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the shapes (and what each GEMM's group size is), the batch sizes, providers, dtype and zero "
        "points; time nothing",
    )
    ap.add_argument("--m", type=int_list, default=M_VALUES, help="batch sizes (tokens), e.g. 1,4,16")
    ap.add_argument(
        "--providers",
        default="plugin-auto,plugin-triton-auto,plugin-triton,plugin-triton-td,plugin-cuda,vllm-triton,vllm-cuda,"
        "vllm-marlin,vllm-humming,bf16-dense",
        help="plugin-auto: the oracle's pick (cuda inside the shipped crossover, else triton); plugin-auto-composed: "
        "auto composed with Humming where installed; plugin-auto-marlin: composed with Marlin (a vLLM without Humming); "
        "plugin-auto-hopper, -composed-hopper, -marlin-hopper: auto with the hopper kernel's copy (its rule), beside no "
        "partner / Humming / Marlin; plugin-hopper: the hopper kernel at every M; "
        "a plugin provider + '-ao': its act-order twin; plugin-triton-auto: "
        "the Triton backend with tuned TD; plugin-triton-alt: the same with --alt-config-dir's configs; "
        "plugin-triton / -td: pointer / TD loads forced; plugin-triton-split, "
        "-words, -tile: other kernel forms; plugin-cuda, plugin-vllm_cuda, vllm-*: as named (vllm-humming: vLLM 0.34's "
        "default on sm90, n/a where humming-kernels 0.1.19+ is missing); bf16-dense: "
        "vLLM's fused_experts on the dequantized weights (in --dtype)",
    )
    ap.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="bfloat16",
        help="the activations' and scales' dtype (and bf16-dense's weights'); give a float16 run its own --tag: "
        "the result files and the run name are the date, commit and tag",
    )
    ap.add_argument(
        "--zero-points",
        action="store_true",
        help="quantize with zero points, w = (q - z) * s (AWQ, GPTQ sym=false), the packed zeros passed to every "
        "provider and counted in %%bw; default symmetric (z = 2**(bits-1)). Give the run its own --tag as for --dtype",
    )
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--launch-gap",
        action="store_true",
        help="time each replay from an idle GPU, the host's graph launch included (the timing before 2026-12-04's "
        "stream4 run; see QUEUE_AHEAD_CYCLES)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h200"))
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--results-csv",
        default=None,
        metavar="PATH",
        help="the device CSV the rows are appended to (default: <out>/results.csv); 'none' to skip",
    )
    ap.add_argument(
        "--write-crossover",
        nargs="?",
        const=str(ROOT / "vllm_wna16_plugin" / "crossover"),
        default=None,
        metavar="DIR",
        help="record where plugin-cuda beat plugin-triton (both must be among --providers) in DIR/<device>.json "
        "(default DIR: the package's crossover/)",
    )
    ap.add_argument(
        "--alt-config-dir",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="tuned Triton configs for the plugin-triton-alt provider (e.g. a tune.py --out copy), or with NAME= for "
        "plugin-triton-alt-NAME (repeatable: several candidate tables in one run)",
    )
    args = ap.parse_args(argv)
    return args


# model_shapes.model_moe_shape's note on an asymmetric checkpoint (AWQ, GPTQ sym=false), timed symmetric unless
# --zero-points; with it, the note says so instead
SYMMETRIC_NOTE = "; timed symmetric, without the checkpoint's zero points"
ZERO_POINT_NOTE = "; timed with zero points (--zero-points), as the checkpoint holds them"


def select_shapes(args: argparse.Namespace) -> list[Shape]:
    """--shapes' built-in shapes (all of them when neither --shapes nor --model-config is given) and the
    --model-config shapes; ValueError for an unknown name or a config that cannot be read or sharded."""
    shapes = []
    catalog = getattr(args, "catalog", None)
    if args.shapes is not None or not (args.model_config or catalog):
        names = [n for n in (args.shapes or ",".join(s.name for s in SHAPES)).split(",") if n]
        known = {s.name: s for s in SHAPES}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"--shapes: unknown {', '.join(unknown)}; built-in shapes: {', '.join(known)}")
        shapes += [known[n] for n in names]
    if args.ep and not (args.model_config or catalog):
        raise ValueError("--ep applies to --model-config and --catalog shapes")
    shapes += shapes_from_configs(args.model_config, args.tp, args.bits, args.group_size, ep=args.ep, name=args.name)
    for name, cfg in catalog_configs(catalog) if catalog else ():
        for tp in args.tp:
            try:
                shapes.append(model_moe_shape(cfg, tp, args.bits, args.group_size, ep=args.ep, name=name))
            except ValueError as exc:  # a TP size the model cannot be split at is skipped, with the reason
                print(f"--catalog: {name} at tp={tp} skipped: {exc}", file=sys.stderr)
    if getattr(args, "zero_points", False):  # an asymmetric checkpoint's note says what this run does time
        shapes = [dataclasses.replace(s, note=s.note.replace(SYMMETRIC_NOTE, ZERO_POINT_NOTE)) for s in shapes]
    return shapes


def options_note(args: argparse.Namespace) -> str:
    """A run's --dtype / --zero-points as the device CSV's run_note: "" for bfloat16 and symmetric (what every
    run before these options timed), else "(<dtype>, zero points|symmetric)", also written after the run name
    in the .md header, where results_table.split_commit keeps a trailing "(...)" as the note (consolidate)."""
    if args.dtype == "bfloat16" and not args.zero_points:
        return ""
    return f"({args.dtype}, {'zero points' if args.zero_points else 'symmetric'})"


def describe_options(args: argparse.Namespace) -> str:
    """--dtype and --zero-points in words (the .md header's)."""
    zp = "zero points (w = (q - z) * s, packed zeros read beside the weights)" if args.zero_points else (
        "symmetric (no zero points)")  # fmt: skip
    return f"{args.dtype} activations and scales (bf16-dense: {args.dtype} weights), {zp}"


def dry_run(shapes: list[Shape], args: argparse.Namespace) -> str:
    """What a run would time, without a GPU: each shape, where it came from, its weight bytes, the Ms, the
    activations' dtype and zero points."""
    lines = []
    for s in shapes:
        int_gb = s.E * weight_bytes_per_expert(s, s.bits, False, args.zero_points) / 1e9
        dense_gb = s.E * weight_bytes_per_expert(s, s.bits, True) / 1e9
        lines.append(s.describe())
        if s.note:
            lines.append(f"  from {s.note}")
        lines.append(
            f"  experts' weights per copy: int{s.bits} {int_gb:.2f} GB, {DTYPE_SHORT[args.dtype]} {dense_gb:.2f} GB"
        )
    lines.append(f"M: {','.join(map(str, args.m))}")
    lines.append(f"providers: {args.providers}")
    lines.append(f"dtype: {args.dtype}; zero points: {'yes' if args.zero_points else 'no (symmetric)'}")
    return "\n".join(lines)


def run_header(args: argparse.Namespace, shapes: list[Shape], dev: str, bw: float, mm_rate: float,
               versions: tuple[str, str, str]) -> str:  # fmt: skip
    """The run's .md header (results_table.parse_header reads its metadata back: the commit field's trailing
    "(...)", options_note, is the run_note). versions: vLLM's, torch's, Triton's."""
    opts_note = options_note(args)
    return (
        f"# WNA16 MoE layer benchmark\n\n{datetime.date.today()} · {dev} · torch {versions[1]} · "
        f"triton {versions[2]} · vLLM {versions[0]} · commit {git_commit()}{args.tag}"
        f"{' ' + opts_note if opts_note else ''}\n\n"
        f"Measured device copy bandwidth: {bw / 1e12:.2f} TB/s (read+write); bf16 matmul (8192³): "
        f"{mm_rate / 1e12:.0f} TFLOP/s. CUDA-graph replay of R calls over "
        f"R rotating weight copies (L2-cold), median of {args.reps} replays, µs per layer call"
        f"{', host launch included' if args.launch_gap else ' (GPU kept busy while the host launches the graph)'}. "
        f"'%bw' = weight bytes of the experts hit / time / copy bandwidth; '%mm' = the layer's 6·M·top_k·H·I "
        f"FLOPs / time / the bf16 matmul rate. int4 (unless a shape says otherwise), "
        f"{describe_options(args)}.\n"
        + "".join(f"\n- {s.describe()}; from {s.note}" for s in shapes if s.note)
        + ("\n" if any(s.note for s in shapes) else "")
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        shapes = select_shapes(args)
    except ValueError as exc:
        print(f"bench_moe.py: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dry_run(shapes, args))
        return 0
    if args.ep:
        print("bench_moe.py: error: --ep shapes are printed by --dry-run, not timed (the rank's share of the "
              "routed tokens needs the expert_map path)", file=sys.stderr)  # fmt: skip
        return 2
    if args.write_crossover and options_note(args):  # the table's key (crossover.layer_key) has neither
        print("bench_moe.py: error: --write-crossover records bfloat16 symmetric layers only (a crossover entry's "
              "key names no dtype or zero points)", file=sys.stderr)  # fmt: skip
        return 2
    global QUEUE_AHEAD_CYCLES
    if args.launch_gap:
        QUEUE_AHEAD_CYCLES = 0
    try:
        ALT_CONFIG_DIRS.clear()
        ALT_CONFIG_DIRS.update(alt_config_dirs(args.alt_config_dir))
    except ValueError as exc:
        print(f"bench_moe.py: error: {exc}", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    bw = measure_copy_bandwidth()
    mm_rate = measure_matmul_rate()
    ms = args.m
    providers = args.providers.split(",")
    dtype = DTYPES[args.dtype]
    opts_note = options_note(args)
    vllm = VllmPaths()
    import triton
    import vllm as vllm_pkg

    header = run_header(args, shapes, dev, bw, mm_rate, (vllm_pkg.__version__, torch.__version__, triton.__version__))
    print(header, flush=True)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    partial = Path(args.out) / f"{datetime.date.today()}-{git_commit()}{args.tag}.partial.csv"
    for s in shapes:
        try:
            kw13, kw2, d13, d2 = shape_weights(s, gen, dtype, args.zero_points)
        except torch.cuda.OutOfMemoryError:  # a shape too large for the device: said, and the run goes on
            kw13 = None
        if kw13 is None:  # outside the except: its traceback no longer holds the half-built tensors
            print(f"{s.name}: skipped, its weights and fp32 reference do not fit the device's memory (e.g. "
                  "DeepSeek-V3 at TP 1 on 139 GiB: time it at a larger --tp)", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
            continue
        per_copy_int4 = s.E * weight_bytes_per_expert(s, s.bits, False, args.zero_points)
        per_copy_bf16 = s.E * weight_bytes_per_expert(s, s.bits, True)
        copies = {}
        act_order = None  # (Weights, d13, d2) of the act-order twin, made when an -ao provider first runs

        def get_act_order():
            nonlocal act_order
            if act_order is None:
                act_order = make_act_order(kw13, kw2, d13, d2, s, s.bits, gen)
            return act_order

        def get_copies(kind: str, n: int):
            key = (kind, n)
            if key not in copies:
                if kind == "int4":
                    base = int_weights(kw13, kw2)
                elif kind == "ao":
                    base = get_act_order()[0]
                else:
                    base = Weights(None, None, None, None, d13.to(dtype), d2.to(dtype))
                copies[key] = rotating_copies(base, n)
            return copies[key]

        for m in ms:
            xc = torch.randn(m, s.H, generator=gen, device="cuda").to(dtype)
            logits = torch.randn(m, s.E, generator=gen, device="cuda")
            twc, tic = torch.topk(logits.softmax(-1), s.top_k, dim=-1)
            tic = tic.to(torch.int32)
            hit = len(torch.unique(tic))
            ref = fused_moe_ref(xc, d13, d2, twc, tic).float()
            ref_ao = None
            results = {}
            for prov in providers:
                dense = prov == "bf16-dense"
                ao = prov.endswith(ACT_ORDER_SUFFIX)
                if ao and s.gs == -1:
                    results[prov] = ("n/a", "channel-wise: no act order")
                    continue
                if ao and ref_ao is None:
                    ref_ao = fused_moe_ref(xc, *get_act_order()[1:], twc, tic).float()
                touched = hit * weight_bytes_per_expert(s, s.bits, dense, args.zero_points)
                per_copy = per_copy_bf16 if dense else per_copy_int4
                n_copies = max(1, min(8, math.ceil(150e6 / touched), int(20e9 // per_copy)))
                ws = get_copies("bf16" if dense else "ao" if ao else "int4", n_copies)

                prepared = {}

                def call(w, prov=prov, prepared=prepared):
                    if prov.startswith("plugin-") or prov in DELEGATED:
                        # Backends prepare once (Marlin repacks): only `run` is timed, as in serving.
                        if id(w) not in prepared:
                            prepared[id(w)] = plugin_backend(prov, xc, w, tic, s.gs, bits=s.bits, gs_w2=s.gs_w2)
                        return prepared[id(w)].run(xc, twc, tic)
                    if dense:
                        return vllm.dense(xc, w.dense13, w.dense2, twc, tic)
                    return vllm.int4(prov, xc, w, twc, tic, s.gs, s.bits)

                try:
                    if prov.startswith("vllm-") and prov not in DELEGATED:
                        if s.gs == -1 or s.group_w13 != s.group_w2:
                            raise NotApplicable("vLLM's int4 paths take one group size for both GEMMs")
                        if prov == "vllm-cuda" and s.bits != 4:
                            raise NotApplicable("vLLM's CUDA WNA16 MoE kernel is int4 only")
                    out = call(ws[0]).float()
                    want = ref_ao if ao else ref
                    err = ((out - want).norm() / want.norm()).item()
                    if not (err < 2e-2):
                        results[prov] = ("WRONG", f"rel err {err:.3g}")
                        continue
                    med, p20, p80 = time_graph([lambda w=w: call(w) for w in ws], args.reps)
                    results[prov] = (med, p20, p80, touched / (med * 1e-6) / bw)
                except NotApplicable as exc:
                    results[prov] = ("n/a", str(exc))
                except Exception as exc:  # noqa: BLE001 - a crash is a result (vLLM's gs32 bug)
                    msg = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
                    results[prov] = ("crash", msg)
                    torch.cuda.synchronize()
            for prov, r in results.items():
                rows.append((s.name, m, prov, r))
            line = " | ".join(
                f"{p}={r[0]:.1f}" if isinstance(r[0], float) else f"{p}={r[0]}" for p, r in results.items()
            )
            print(f"{s.name} M={m}: {line}", flush=True)
        copies.clear()
        act_order = kw13 = kw2 = d13 = d2 = None  # freed before the next shape's weights are made
        torch.cuda.empty_cache()
        write_run_csv(rows, partial)

    flops = {(s.name, m): layer_flops(s, m) for s in shapes for m in ms}
    table = render(rows, providers, flops, mm_rate)
    stamp = f"{datetime.date.today()}-{git_commit()}{args.tag}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stamp}.md").write_text(header + "\n" + table)
    write_run_csv(rows, out / f"{stamp}.csv")
    partial.unlink(missing_ok=True)
    plot(rows, providers, out / f"{stamp}.png")
    if args.results_csv != "none":
        path = append_to_device_csv(
            rows,
            Path(args.results_csv) if args.results_csv else None,
            out,
            date=str(datetime.date.today()),
            device=dev,
            versions=(vllm_pkg.__version__, torch.__version__, triton.__version__),
            run=f"{git_commit()}{args.tag}",
            copy_bw=bw,
            reps=args.reps,
            timing="launch-included" if args.launch_gap else "queued",
            source=out / f"{stamp}.csv",
            run_note=opts_note,
        )
        print(f"{len(rows)} rows appended to {path}")
    print(table)
    if args.write_crossover:
        # the Triton side as auto runs it (tuned TD) when that column ran
        column = "plugin-triton-auto" if "plugin-triton-auto" in providers else "plugin-triton"
        print(record_crossovers(rows, shapes, dev, Path(args.write_crossover), out / f"{stamp}.md", column))
    return 0


def write_run_csv(rows, path: Path) -> None:
    """The run's own CSV (also rewritten after every shape, so a run cut short keeps what it timed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["shape", "M", "provider", "median_us", "p20_us", "p80_us", "frac_copy_bw", "note"])
        for shape, m, prov, r in rows:
            if isinstance(r[0], float):
                wr.writerow([shape, m, prov, f"{r[0]:.2f}", f"{r[1]:.2f}", f"{r[2]:.2f}", f"{r[3]:.4f}", ""])
            else:
                wr.writerow([shape, m, prov, "", "", "", "", f"{r[0]}: {r[1]}"])


def append_to_device_csv(
    rows, path, out, *, date, device, versions, run, copy_bw, reps, timing, source, run_note: str = ""
) -> Path:
    """Append a run's rows to the device CSV (bench/results_table.py's columns, the run's metadata on each).
    run_note (options_note: --dtype / --zero-points where not the default) is added to the run's note: the
    rows of a float16 or zero-point run are told apart from bfloat16 symmetric ones without a new column or
    a changed shape name."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import results_table

    commit, _, note = results_table.split_commit(run)
    note = " ".join(n for n in (note, run_note) if n)
    meta = {
        "date": date,
        "device": device,
        "vllm": versions[0],
        "torch": versions[1],
        "triton": versions[2],
        "commit": commit,
        "run": run,
        "run_note": note,
        "copy_bw_tbs": f"{copy_bw / 1e12:.2f}",
        "reps": reps,
        "timing": timing,
        "source": str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source),
    }
    out_rows = []
    for shape, m, prov, r in rows:
        if isinstance(r[0], float):
            vals = {"median_us": f"{r[0]:.2f}", "p20_us": f"{r[1]:.2f}", "p80_us": f"{r[2]:.2f}"}
            vals |= {"frac_copy_bw": f"{r[3]:.4f}", "note": ""}
        else:
            vals = {"note": f"{r[0]}: {r[1]}"}
        out_rows.append({**meta, "shape": shape, "M": m, "provider": prov, **vals})
    path = path or results_table.device_csv(out)
    results_table.append_rows(path, out_rows)
    return path


def record_crossovers(
    rows,
    shapes: list[Shape],
    device_name: str,
    crossover_dir: Path,
    source: Path,
    triton_column: str = "plugin-triton",
    cuda_column: str = "plugin-cuda",
) -> str:
    """Write each shape's measured cuda-over-triton ranges (crossover.measured_ranges) for this device.

    triton_column / cuda_column: the source table's columns that timed the Triton kernel and the CUDA
    kernel as the plugin runs them (recorded when they are not plugin-triton / plugin-cuda, e.g. a form
    or launch geometry measured before it became the default)."""
    from vllm_wna16_plugin import crossover

    entries, lines = {}, []
    for s in shapes:
        times = {}
        for shape, m, prov, r in rows:
            if shape == s.name and prov in (cuda_column, triton_column) and isinstance(r[0], float):
                times.setdefault(m, {})[prov] = r[0]
        pairs = {m: (t[cuda_column], t[triton_column]) for m, t in times.items() if len(t) == 2}
        if not pairs:
            lines.append(f"{s.name}: {cuda_column} and {triton_column} were not both timed; no crossover")
            continue
        ranges = crossover.measured_ranges(pairs)
        key = crossover.layer_key(s.E, s.H, s.I, s.gs, s.bits)
        entries[key] = {
            "cuda_m_ranges": ranges,
            "source": str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source),
        }
        if triton_column != "plugin-triton":
            entries[key]["triton_provider"] = triton_column
        if cuda_column != "plugin-cuda":
            entries[key]["cuda_provider"] = cuda_column
        won = ", ".join(f"M={lo}..{hi}" for lo, hi in ranges) or "nowhere"
        lines.append(f"{s.name}: cuda beats triton at {won} of M={sorted(pairs)} ({key})")
    path = crossover.write_crossovers(entries, device_name, crossover_dir)
    return "\n".join(lines + [f"crossovers written to {path}"])


def plot(rows, providers, path: Path) -> None:
    """µs per layer call vs M, one panel per shape, log-log (skipped when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(dict.fromkeys(r[0] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        for prov in providers:
            pts = [(m, r[0]) for sh, m, p, r in rows if sh == shape and p == prov and isinstance(r[0], float)]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=prov)
        ax.set(xscale="log", yscale="log", title=shape, xlabel="M (tokens)", ylabel="µs per MoE layer")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(rows, providers, flops: dict | None = None, mm_rate: float | None = None) -> str:
    """Markdown: one row per (shape, M), µs per provider, and the plugin's best vs each peer. With flops
    ({(shape, M): layer_flops}) and mm_rate (FLOP/s), also '%mm': the share of that rate the ratio's basis reached."""
    by = {}
    for shape, m, prov, r in rows:
        by.setdefault((shape, m), {})[prov] = r
    ours = [p for p in providers if p.startswith("plugin-")]
    peers = [p for p in providers if not p.startswith("plugin-")]
    # the ratios are of what a user gets (plugin-auto) when it ran, else of the plugin's best provider
    basis = "plugin-auto" if "plugin-auto" in providers else None
    ratio_name = "auto" if basis else "best"
    mm = bool(flops) and bool(mm_rate)
    head = ["shape", "M", *providers, "best plugin", f"%bw ({ratio_name})", *([f"%mm ({ratio_name})"] if mm else []),
            *[f"× vs {p}" for p in peers]]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (shape, m), res in by.items():
        cells = [shape, str(m)]
        for p in providers:
            r = res.get(p)
            cells.append("-" if r is None else (f"{r[0]:.1f}" if isinstance(r[0], float) else str(r[0])))
        timed = {p: res[p] for p in ours if p in res and isinstance(res[p][0], float)}
        if timed:
            best = min(timed, key=lambda p: timed[p][0])
            ref = timed.get(basis) if basis else timed[best]
            cells += [best.removeprefix("plugin-"), f"{100 * ref[3]:.0f}%" if ref else "-"]
            if mm:
                f = flops.get((shape, m))
                cells.append(f"{100 * f / (ref[0] * 1e-6) / mm_rate:.0f}%" if ref and f else "-")
            for p in peers:
                r = res.get(p)
                cells.append(f"{r[0] / ref[0]:.2f}" if ref and r and isinstance(r[0], float) else "-")
        else:
            cells += ["-", "-"] + ["-"] * (len(peers) + mm)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
