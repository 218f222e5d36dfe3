"""The plugin's CUDA ops (csrc/) without a GPU: the build, and the launch rules the kernel enforces.

CI compiles csrc/ (nvcc 13, sm90) as part of the README's set-up. These tests check that the
extension loads. They also check that every launch config the launch-config module can produce,
over real models' shapes and their TP splits, is one the compiled kernel accepts. The rules are
asked of the compiled code (csrc/launch_rules.h through torch.ops.wna16_plus.check_launch_config),
not of a Python copy of them. The kernel's results are checked on the GPU, in
tests/kernels/test_cuda_ops_gpu.py.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_wna16_plugin.backends import KernelTensors, RunOptions, registry
from vllm_wna16_plugin.block_config import choose_cuda_block_config
from vllm_wna16_plugin.kernels.cuda_ops import extension_error, gemm_config, launch_config_error
from vllm_wna16_plugin.kernels.options import DEFAULT_OPTIONS
from vllm_wna16_plugin.ops import make_problem
from vllm_wna16_plugin.scheme import CHANNELWISE

BUILDABLE = shutil.which("nvcc") is not None and torch.version.cuda is not None
needs_extension = pytest.mark.skipif(extension_error() is not None, reason=str(extension_error()))

# (K, N) of real MoE GEMMs per rank: gate/up (K=H, N=2I/tp) and down (K=I/tp, N=H)
MODELS = {  # H, I, E, top_k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3.5-35b-a3b": (2048, 512, 256, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "ct-channelwise": (2816, 704, 128, 8),
    "k1344": (1344, 1024, 8, 2),
}
TOKENS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


def test_extension_is_built_where_it_can_be():
    if not BUILDABLE:
        pytest.skip("no nvcc or no CUDA torch here: the package installs without the CUDA ops")
    assert extension_error() is None, extension_error()
    assert hasattr(torch.ops.wna16_plus, "moe_wna16_gemm")


def _fatbin(*entries: tuple[int, int, int]) -> bytes:
    """A fatbin container of (kind, arch, payload bytes) entries, laid out as nvcc writes one."""
    import struct

    body = b""
    for kind, arch, size in entries:
        header = struct.pack("<HHIQIIHHI", kind, 0x0101, 64, size, 0, 0, 0, 0, arch).ljust(64, b"\0")
        body += header + bytes(range(size % 256))[:size].ljust(size, b"\1")
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_fatbin_archs_reads_the_architectures_of_every_container():
    from vllm_wna16_plugin.kernels.cuda_ops import FATBIN_ELF, FATBIN_PTX, fatbin_archs

    so = b"\x7fELF" + bytes(40) + _fatbin((FATBIN_ELF, 90, 200), (FATBIN_PTX, 90, 33)) + bytes(8)
    so += _fatbin((FATBIN_ELF, 80, 100), (FATBIN_ELF, 100, 8)) + b"trailing"
    assert fatbin_archs(so) == ["sm_80", "compute_90", "sm_90", "sm_100"]
    assert fatbin_archs(b"no gpu code here") == []
    assert fatbin_archs(_fatbin((7, 90, 10))) == []  # an unknown entry kind ends the container


def test_the_built_extension_reports_the_architecture_it_was_built_for():
    from vllm_wna16_plugin.kernels.cuda_ops import extension_archs

    archs = extension_archs()
    if archs is None:
        pytest.skip("the CUDA ops are not built here")
    wanted = os.environ.get("TORCH_CUDA_ARCH_LIST")  # CI builds 9.0
    assert archs, "the extension carries no GPU code"
    if wanted and ";" not in wanted and "+" not in wanted:
        assert f"sm_{wanted.replace('.', '')}" in archs, archs


def _gemms(H, I, tp):  # noqa: E741
    return [(H, 2 * I // tp), (I // tp, H)]


@needs_extension
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128, CHANNELWISE], ids=["gs32", "gs64", "gs128", "channel"])
def test_every_config_of_the_module_is_accepted_by_the_kernel(gs, bits):
    checked = 0
    for (H, I, E, top_k), tp, m in itertools.product(MODELS.values(), (1, 2, 4, 8), TOKENS):  # noqa: E741
        for K, N in _gemms(H, I, tp):
            if (gs != CHANNELWISE and K % gs) or K % 8:
                continue  # the checkpoint regroups or the backend refuses before any launch
            num_groups = 1 if gs == CHANNELWISE else K // gs
            # what the cuda backend launches: GEMM1 with the activation fused (N/2 output columns) or not
            configs = [
                gemm_config(m, top_k, E, K, N, num_groups, bits),
                gemm_config(m, top_k, E, K, N // 2, num_groups, bits, True),
            ]
            if gs != CHANNELWISE or K % 32 == 0:  # the module's own (vLLM-kernel) presentation
                configs.append(choose_cuda_block_config(m, top_k, E, K, N, gs, bits))
            for cfg in configs:
                err = launch_config_error(K, num_groups, cfg, bits)
                assert err == "", f"K={K} N={N} gs={gs} int{bits} M={m}: {cfg} refused: {err}"
                checked += 1
    assert checked > 500


def test_block_n_is_halved_for_the_grid_only_while_warps_keep_their_k_steps():
    from vllm_wna16_plugin.kernels import cuda_ops
    from vllm_wna16_plugin.kernels.options import PLAN_DEVICES, KernelOptions

    # Qwen3-30B-A3B GEMM1 at M=1 (8 experts, I=768 gated, K=2048: 16 K steps): 48 blocks at BLOCK_SIZE_N 128.
    # Halving to 64 leaves each warp 8 steps (4 two-tile units, K split in 2); 32 would leave 4.
    assert cuda_ops.warp_k_steps(2048, 4, 1, 64, gated=True) == 8
    assert cuda_ops.warp_k_steps(2048, 4, 1, 32, gated=True) == 4
    assert cuda_ops.gemm_config(1, 8, 128, 2048, 768, 16, 4, gated=True).block_size_n == 64
    grid_only = KernelOptions(cuda_min_warp_steps=0)  # the grid alone: down to 16 (384 blocks >= 264)
    h200 = PLAN_DEVICES["sm90"]
    assert cuda_ops.gemm_config(1, 8, 128, 2048, 768, 16, 4, True, h200, grid_only).block_size_n == 16
    # the grid target is per SM: a GPU of 40 SMs stops halving one step earlier (192 blocks >= 4 * 40)
    small = dataclasses.replace(h200, sm_count=40)
    assert cuda_ops.gemm_config(1, 8, 128, 2048, 768, 16, 4, True, small, grid_only).block_size_n == 32
    # blocks of more than 8 tokens take one tile per warp; a block of 16-column tiles without gating
    assert cuda_ops.warp_k_steps(14336, 4, 16, 128, gated=False) == 112  # 8 tiles, one per warp
    assert cuda_ops.warp_k_steps(14336, 4, 8, 128, gated=False) == 56  # 4 two-tile units, K split in 2
    # warps are dealt pairs of steps: K=704 is 22 chunks, 3 pairs (the last one short); split in 2, the
    # first warp streams 2 pairs (4 steps), where a split by steps would have given it 3
    assert cuda_ops.warp_k_steps(704, 4, 8, 128, gated=False) == 4


def test_layer_aligns_to_blocks_of_at_most_eight_tokens():
    from vllm_wna16_plugin.kernels import cuda_ops
    from vllm_wna16_plugin.kernels.options import PLAN_DEVICES, KernelOptions

    # blocks of <= 8 tokens run the two-tile warps; vLLM's own rule would give 16 from M=16
    for m in (1, 4, 8, 16, 64, 512):
        assert cuda_ops.gemm_config(m, 2, 8, 4096, 14336, 32, 4, gated=True).block_size_m == min(m, 8)
    vllm_rule = KernelOptions(cuda_max_block_m=16)  # the bench's other form: vLLM's rule
    assert cuda_ops.gemm_config(64, 2, 8, 4096, 14336, 32, 4, True, PLAN_DEVICES["sm90"], vllm_rule).block_size_m == 16


@needs_extension
@pytest.mark.parametrize(
    "K, groups, cfg, bits, match",
    [
        (2048, 64, (1, 128, 512), 4, r"BLOCK_SIZE_K // group_size must be one of \[1, 2, 4, 8\]"),  # vLLM's gs32
        (1344, 42, (16, 128, 96), 4, r"BLOCK_SIZE_K // group_size must be one of"),  # vLLM's K=1344
        (2048, 16, (16, 128, 384), 4, r"BLOCK_SIZE_K=384 does not divide K=2048"),
        (1004, 1, (1, 128, 1004), 4, r"K=1004 is not a multiple of 8"),
        (2048, 16, (128, 128, 128), 4, r"BLOCK_SIZE_M=128 is outside \[1, 64\]"),
        (2048, 16, (1, 128, 128), 3, r"bits=3 is not supported"),
        (768, 1, (1, 128, 96 * 5), 4, r"BLOCK_SIZE_K=480 does not divide K=768"),
    ],
)
def test_kernel_refuses_configs_outside_its_rules(K, groups, cfg, bits, match):
    # BlockConfig checks the module's own rules when built: a plain namespace asks the kernel alone
    config = SimpleNamespace(block_size_m=cfg[0], block_size_n=cfg[1], block_size_k=cfg[2])
    assert re.search(match, launch_config_error(K, groups, config, bits))


def _problem(platform="cuda", sm=90, gs=32, bits=4, H=2048, I=512, explicit=False, plan_only=True):  # noqa: E741
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    w13 = torch.zeros(8, 2 * I, H * bits // 8, dtype=torch.uint8)
    w2 = torch.zeros(8, H, I * bits // 8, dtype=torch.uint8)
    g13, g2 = (1, 1) if gs == CHANNELWISE else (H // gs, I // gs)
    s13, s2 = torch.zeros(8, 2 * I, g13, dtype=torch.bfloat16), torch.zeros(8, H, g2, dtype=torch.bfloat16)
    p = make_problem(x, w13, w2, s13, s2, torch.zeros(1, 2, dtype=torch.int32), bits=bits, group_size=gs,
                     has_zero_point=False)  # fmt: skip
    return dataclasses.replace(p, platform=platform, sm=sm, options=RunOptions(explicit=explicit, plan_only=plan_only))


@needs_extension
@pytest.mark.parametrize(
    "K,G,bits,fits",
    [
        pytest.param(2048, 16, 4, True, id="gs128-int4: 4 chunks per group"),
        pytest.param(2048, 64, 4, True, id="gs32-int4: 1 chunk"),
        pytest.param(2048, 64, 8, True, id="gs32-int8: 2 chunks"),
        pytest.param(1344, 1, 4, True, id="channelwise-K1344: 42 chunks, one group"),
        pytest.param(2304, 24, 4, False, id="gs96-int4: 3 chunks, not a power of two"),
        pytest.param(176, 1, 4, False, id="K176: 5.5 chunks"),
        pytest.param(2048, 128, 4, False, id="gs16-int4: chunks straddle groups"),
    ],
)
def test_mma_kernel_takes_power_of_two_chunks_per_group(K, G, bits, fits):
    # the mma kernel finds a chunk's scale group by a shift; other shapes go to the gemv kernel
    assert torch.ops.wna16_plus.mma_kernel_fits(K, G, bits) is fits
    from vllm_wna16_plugin.kernels import cuda_ops

    assert cuda_ops.mma_kernel_fits(K, G, bits) is fits  # the launch plan's GPU-blind mirror


@needs_extension
def test_python_mirror_of_the_mma_rule_agrees_with_the_compiled_one():
    # the launch plan decides the fused activation and the stream kernel with cuda_ops.mma_kernel_fits
    # (no extension needed); the layer launches what the compiled rule allows: the two must never differ
    from vllm_wna16_plugin.kernels import cuda_ops

    checked = 0
    for bits in (4, 8):
        for k in range(8, 4097, 8):
            for g in {1, 2, 3, 4, 6, 8, 16, 24, 32, 64, 128, k // 32 or 1, k // 64 or 1, k // 128 or 1}:
                if k % g:
                    continue
                want = torch.ops.wna16_plus.mma_kernel_fits(k, g, bits)
                assert cuda_ops.mma_kernel_fits(k, g, bits) is want, (k, g, bits)
                checked += 1
    assert checked > 5000


def test_cuda_backend_rules():
    cuda = registry()["cuda"]
    assert cuda.incompatibility_reason(_problem(explicit=True)) is None
    assert cuda.incompatibility_reason(_problem(gs=CHANNELWISE, bits=8, explicit=True)) is None
    # auto takes it only on a measured crossover (tests/test_crossover.py) or by the shape rule (sm90 only,
    # tests/kernels/test_cuda_rule.py): E=8, top 2, H=2048, I=512 at gs32 has no crossover, and the rule gives it
    # M 32-47 on sm90, nothing on sm80
    assert cuda.incompatibility_reason(_problem()) is None
    assert "no measured crossover over triton" in cuda.incompatibility_reason(_problem(sm=80))
    assert "NVIDIA GPU" in cuda.incompatibility_reason(_problem(platform="cpu", explicit=True))
    assert "sm80+" in cuda.incompatibility_reason(_problem(sm=75, explicit=True))
    assert "group size 16" in cuda.incompatibility_reason(_problem(gs=16, explicit=True))
    assert "K=1004 is not a multiple of 8" in cuda.incompatibility_reason(
        _problem(gs=CHANNELWISE, H=1004, explicit=True)
    )
    assert cuda.incompatibility_reason(_problem(gs=CHANNELWISE, I=176, explicit=True)) is None  # 704 at TP4


def _gemm_args(K=256, N=64, E=4, M=3, top_k=2, gs=32, bm=16, bn=32, bk=128):
    """Valid arguments of one moe_wna16_gemm on CPU tensors (random data: only the metadata is checked)."""
    gen = torch.Generator().manual_seed(K + N)
    pairs, G = M * top_k, K // gs
    em = pairs + E * (bm - 1)
    return dict(
        a=torch.randn(M, K, generator=gen).bfloat16(),
        qweight=torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.uint8),
        scales=torch.rand(E, N, G, generator=gen).bfloat16(),
        qzeros=torch.randint(0, 256, (E, N // 2, G), generator=gen, dtype=torch.uint8),
        topk_weights=torch.rand(pairs, generator=gen),
        sorted_token_ids=torch.randint(0, pairs, (em,), generator=gen, dtype=torch.int32),
        expert_ids=torch.randint(0, E, (em // bm,), generator=gen, dtype=torch.int32),
        num_tokens_post_padded=torch.tensor([bm * 2], dtype=torch.int32),
        c=torch.empty(pairs, N, dtype=torch.bfloat16),
        bits=4, top_k=top_k, block_size_m=bm, block_size_n=bn, block_size_k=bk, kernel="auto", activation="none",
    )  # fmt: skip


def _misaligned(t: torch.Tensor, elems: int) -> torch.Tensor:
    """A contiguous copy of t that starts `elems` elements into its storage."""
    flat = torch.empty(t.numel() + elems, dtype=t.dtype)
    view = flat[elems:].view(t.shape)
    view.copy_(t)
    return view


BAD_GEMM_ARGS = {  # name -> (change to the valid arguments, what the refusal must say)
    "a fp32": (lambda k: dict(a=k["a"].float()), r"a must be float16 or bfloat16, got Float"),
    "a K-strided": (lambda k: dict(a=k["a"].t().contiguous().t()), r"a must be \(rows, K\) with K contiguous, got \[3, 256\]"),
    "bits 3": (lambda k: dict(bits=3), r"bits=3 is not supported \(4 or 8\)"),
    "qweight half rows": (lambda k: dict(qweight=k["qweight"][..., :64].contiguous()), r"qweight has 64 bytes per row but K=256 int4 needs 128"),
    "qweight int8 dtype": (lambda k: dict(qweight=k["qweight"].to(torch.int8)), r"uint8 tensor, got \[4, 64, 128\] Char"),
    "scales fp32": (lambda k: dict(scales=k["scales"].float()), r"scales must be an \(E=4, N=64, G\) tensor in a's dtype, got \[4, 64, 8\] Float"),
    "BLOCK_SIZE_K 512 at gs32": (lambda k: dict(block_size_k=512, a=torch.zeros(3, 1024).bfloat16(), qweight=torch.zeros(4, 64, 512, dtype=torch.uint8), scales=torch.zeros(4, 64, 32).bfloat16(), qzeros=None), r"BLOCK_SIZE_K // group_size must be one of \[1, 2, 4, 8\]"),
    "qzeros shape": (lambda k: dict(qzeros=k["qzeros"][:, :16].contiguous()), r"qzeros must be an \(E, N\*bits/8, G\) uint8 tensor, got \[4, 16, 8\]"),
    "scales strided": (lambda k: dict(scales=torch.zeros(4, 64, 16).bfloat16()[..., ::2]), r"scales must be contiguous \(E, N, G\) or the \(E, N, G\) view of a contiguous \(E, G, N\) tensor \(group-major, see cuda_ops.group_major\), got strides \[1024, 16, 2\]"),
    "qzeros strided": (lambda k: dict(qzeros=torch.zeros(4, 32, 16, dtype=torch.uint8)[..., ::2]), r"qzeros must be contiguous \(E, N\*bits/8, G\) or the view of a contiguous \(E, G, N\*bits/8\) tensor \(group-major\), got strides \[512, 16, 2\]"),
    "activation relu": (lambda k: dict(activation="relu"), r"activation must be none, silu or gelu, got relu"),
    "c wrong width": (lambda k: dict(c=k["c"][:, :32].contiguous()), r"c must be a contiguous \(num_pairs, 64\) tensor in a's dtype, got \[6, 32\]"),
    "gated c full width": (lambda k: dict(activation="silu"), r"c must be a contiguous \(num_pairs, 32\)"),
    "too few rows": (lambda k: dict(c=torch.empty(20, 64, dtype=torch.bfloat16)), r"a has 3 rows, too few for 20 pairs at top_k=2"),
    "topk_weights short": (lambda k: dict(topk_weights=k["topk_weights"][:5]), r"topk_weights must be num_pairs=6 contiguous float32"),
    "ids int64": (lambda k: dict(sorted_token_ids=k["sorted_token_ids"].long()), r"must be int32 \(moe_align_block_size's\)"),
    "expert_ids short": (lambda k: dict(expert_ids=k["expert_ids"][:2]), r"the alignment does not match BLOCK_SIZE_M=16 \(66 sorted ids, 2 expert ids\)"),
    "kernel name": (lambda k: dict(kernel="tc"), r"kernel must be auto, mma, stream or gemv, got tc"),
    "stream, 16-pair blocks": (lambda k: dict(kernel="stream", workspace=torch.zeros(9 * 513)), r"kernel=stream takes blocks of at most 8 pairs, got BLOCK_SIZE_M=16"),
    "stream, no workspace": (lambda k: dict(kernel="stream", block_size_m=8, expert_ids=torch.zeros(8, dtype=torch.int32)), r"kernel=stream needs its workspace \(cuda_ops.stream_workspace\)"),
    "stream, fp16 workspace": (lambda k: dict(kernel="stream", block_size_m=8, expert_ids=torch.zeros(8, dtype=torch.int32), workspace=torch.zeros(9 * 513).half()), r"the stream workspace must be a contiguous float32 tensor on cpu, got Half on cpu"),
    "stream, small workspace": (lambda k: dict(kernel="stream", block_size_m=8, expert_ids=torch.zeros(8, dtype=torch.int32), workspace=torch.zeros(8 * 513)), r"the stream workspace holds 4104 floats; one block of 8 warps needs 4617"),
    "qweight odd offset": (lambda k: dict(qweight=_misaligned(k["qweight"], 3)), r"qweight must start on a 16-byte boundary"),
    "scales odd offset, mma": (lambda k: dict(scales=_misaligned(k["scales"], 1)), r"scales and qzeros must start on 4-byte boundaries"),
    "gelu on gemv": (lambda k: dict(activation="gelu", kernel="gemv", c=k["c"][:, :32].contiguous()), r"activation=gelu is fused only in the mma kernel \(K=256, G=8, int4, kernel=gemv\)"),
    "mma where chunks straddle": (lambda k: dict(kernel="mma", a=torch.zeros(3, 176).bfloat16(), qweight=torch.zeros(4, 64, 88, dtype=torch.uint8), scales=torch.zeros(4, 64, 1).bfloat16(), qzeros=None, block_size_k=176), r"the mma kernel needs 16-byte chunks of a weight row inside one scale group, a power-of-two number of them per group; K=176, G=1, int4"),
}  # fmt: skip


@needs_extension
def test_the_op_takes_group_major_scales_and_zero_points():
    # cuda_ops.group_major's (E, N, G) views of (E, G, N) tables: the layout the cuda backend hands the kernel
    from vllm_wna16_plugin.kernels.cuda_ops import group_major

    kw = _gemm_args()
    kw.update(scales=group_major(kw["scales"]), qzeros=group_major(kw["qzeros"]))
    assert not kw["scales"].is_contiguous() and not kw["qzeros"].is_contiguous()
    assert torch.ops.wna16_plus.check_gemm_args(**kw) == ""


@needs_extension
@pytest.mark.parametrize("case", list(BAD_GEMM_ARGS))
def test_the_op_refuses_each_bad_argument_with_its_reason(case):
    # The op's own check (csrc/gemm_args.cpp) on CPU tensors: every message is built and returned as
    # text (no std::ostream: it crashed on the GPU machine's image); the valid arguments pass.
    kw = _gemm_args()
    assert torch.ops.wna16_plus.check_gemm_args(**kw) == ""
    change, match = BAD_GEMM_ARGS[case]
    kw.update(change(kw))
    refusal = torch.ops.wna16_plus.check_gemm_args(**kw)
    assert re.search(match, refusal), f"{case}: {refusal!r}"


@needs_extension
def test_the_op_takes_the_stream_kernel_with_its_workspace():
    # kernel "stream": blocks of <= 8 pairs and a float32 workspace of at least one block's slots
    kw = _gemm_args(bm=8)
    assert torch.ops.wna16_plus.check_gemm_args(**kw, workspace=None) == ""  # not needed by the other kernels
    kw.update(kernel="stream", workspace=torch.zeros(9 * 513))
    assert torch.ops.wna16_plus.check_gemm_args(**kw) == ""


def _align_args(pairs=24, E=64, bm=8):
    longest = min(pairs * bm, pairs + E * (bm - 1))
    return dict(
        topk_ids=torch.randint(0, E, (pairs // 8, 8), dtype=torch.int32), block_size=bm, num_experts=E,
        expert_map=None, sorted_token_ids=torch.empty(longest, dtype=torch.int32),
        expert_ids=torch.empty(-(-longest // bm), dtype=torch.int32), num_tokens_post_padded=torch.empty(1, dtype=torch.int32),
    )  # fmt: skip


BAD_ALIGN_ARGS = {
    "int64 ids": (lambda k: dict(topk_ids=k["topk_ids"].long()), r"must be contiguous int32 tensors on one device, got Long on cpu"),
    "block 0": (lambda k: dict(block_size=0), r"block_size=0 is outside \[1, 64\]"),
    "too many experts": (lambda k: dict(num_experts=5000), r"num_experts=5000 is outside \[1, 4096\]"),
    "short map": (lambda k: dict(expert_map=torch.zeros(32, dtype=torch.int32)), r"expert_map must be a contiguous int32 \(num_experts=64,\) tensor on cpu, got \[32\] Int"),
    "short list": (lambda k: dict(sorted_token_ids=k["sorted_token_ids"][:100]), r"sorted_token_ids holds 100 ids; 24 pairs over 64 experts in blocks of 8 may need 192"),
    "few expert ids": (lambda k: dict(expert_ids=k["expert_ids"][:3]), r"expert_ids must hold one id per block of sorted_token_ids \(24\)"),
}  # fmt: skip


@needs_extension
@pytest.mark.parametrize("case", list(BAD_ALIGN_ARGS))
def test_the_alignment_refuses_each_bad_argument_with_its_reason(case):
    kw = _align_args()
    assert torch.ops.wna16_plus.check_align_args(**kw) == ""
    change, match = BAD_ALIGN_ARGS[case]
    kw.update(change(kw))
    refusal = torch.ops.wna16_plus.check_align_args(**kw)
    assert re.search(match, refusal), f"{case}: {refusal!r}"


# bench_moe.py's shapes: (E, top_k, H, I)
BENCH_SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3.5-35b-a3b": (256, 8, 2048, 512), "mixtral-8x7b": (8, 2, 4096, 14336),
    "deepseek-v2-lite": (64, 6, 2048, 1408), "ct-channelwise": (128, 8, 2816, 704), "k1344-gs32": (8, 2, 1344, 1024),
}  # fmt: skip


def test_the_stream_rule_keeps_the_faster_form_of_its_measured_run():
    # cuda_ops picks the stream kernel by GEMM1's expected pairs per warp (KernelOptions.cuda_stream_min_pairs_per_warp). The run
    # it was read from timed both forms at every point (H200, 132 SMs): plugin-cuda ran the stream kernel for
    # every decode block, plugin-cuda-tiles the tiled one. The rule's pick is within 5% of the faster there.
    from vllm_wna16_plugin.kernels import cuda_ops

    root = Path(__file__).resolve().parents[2]
    times: dict[tuple[str, int], dict[str, float]] = {}
    with open(root / "bench/results/h200/2026-12-04-stream2.csv") as f:
        for r in csv.DictReader(f):
            if r["provider"] in ("plugin-cuda", "plugin-cuda-tiles") and r["median_us"]:
                times.setdefault((r["shape"], int(r["M"])), {})[r["provider"]] = float(r["median_us"])
    assert len(times) == 42
    minimum = DEFAULT_OPTIONS.cuda_stream_min_pairs_per_warp
    for (shape, m), t in sorted(times.items()):
        E, top_k, H, I = BENCH_SHAPES[shape]  # noqa: N806, E741
        bm = cuda_ops.gemm_config(m, top_k, E, H, I, 16, 4, gated=True).block_size_m
        per_warp = cuda_ops.stream_pairs_per_warp(m, top_k, E, H, I, 4, True, bm, sms=132)
        picked = t["plugin-cuda"] if per_warp >= minimum else t["plugin-cuda-tiles"]
        assert picked <= 1.05 * min(t.values()), f"{shape} M={m}: {per_warp:.1f} pairs per warp, {t}"


@needs_extension
def test_the_op_checks_the_device_only_when_launching():
    # the CUDA op is registered for CUDA tensors only; its check passes CPU tensors to the other rules
    kw = _gemm_args()
    no_pairs = {**kw, "a": kw["a"][:0], "c": kw["c"][:0], "topk_weights": None}
    assert torch.ops.wna16_plus.check_gemm_args(**no_pairs) == ""
    with pytest.raises(NotImplementedError):
        torch.ops.wna16_plus.moe_wna16_gemm(**kw)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_an_extension_with_its_own_static_libstdcxx_is_not_used(tmp_path):
    # the GPU machine's image linked libstdc++ statically into the extension, and its std::ostream
    # crashed the process on the first error message: such a build is refused with the reason
    import subprocess

    from vllm_wna16_plugin.kernels.cuda_ops import static_libstdcxx_error

    src = tmp_path / "f.cpp"
    src.write_text('#include <sstream>\nextern "C" int f(long n) { std::ostringstream s; s << n; return 0; }\n')
    for name, flags in (("static", ["-static-libstdc++"]), ("shared", [])):
        subprocess.run(["g++", "-shared", "-fPIC", *flags, str(src), "-o", str(tmp_path / f"{name}.so")], check=True)
    assert "linked with a static libstdc++" in static_libstdcxx_error(str(tmp_path / "static.so"))
    assert static_libstdcxx_error(str(tmp_path / "shared.so")) is None


# ---------------------------------------------------------------- act order through the layer launcher (CPU)


def _emulated_gemm(a, qweight, scales, qzeros, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                   *, bits, top_k, config, kernel="auto", activation="none", programmatic=False,
                   weights_before_wait=False):  # fmt: skip
    """torch.ops.wna16_plus.moe_wna16_gemm's contract in float32 torch (csrc/moe_wna16_gemm.cu): for each
    pair p of each block of sorted_token_ids, c[p] = [w_p *] act(a[p // top_k] @ dequant(W[e]).T), with
    rows n and N/2 + n of W the gate and up of column n when the activation is fused."""
    from vllm_wna16_plugin.reference import dequantize_ref

    w = dequantize_ref(qweight, scales.contiguous(), None if qzeros is None else qzeros.contiguous(), bits)
    bm, num_pairs = config.block_size_m, c.shape[0]
    for block in range(int(num_tokens_post_padded[0]) // bm):
        e = int(expert_ids[block])
        for p in sorted_token_ids[block * bm : (block + 1) * bm].tolist():
            if e < 0 or p >= num_pairs:
                continue
            y = a[p // top_k].float() @ w[e].T
            if activation != "none":
                gate, up = y.chunk(2)
                y = (torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate)) * up
            c[p] = (y if topk_weights is None else y * topk_weights[p]).to(c.dtype)
    return c


@pytest.mark.interpreter
@pytest.mark.parametrize("zp, gs, emap", [(True, 32, False), (False, 64, True)])
def test_act_order_layer_reads_x_in_each_experts_k_order(zp, gs, emap, monkeypatch):
    # the launcher's part of act order on `cuda` (cuda_ops.act_order_rows, GEMM1 read by pair), with the CUDA
    # op emulated by its contract on CPU: the sorted layout must give the unsorted checkpoint's layer
    from tests.kernels.conftest import assert_close_scaled, quantized_experts
    from vllm_wna16_plugin.backends.base import sort_act_order
    from vllm_wna16_plugin.backends.cuda import cuda_layout
    from vllm_wna16_plugin.kernels import cuda_ops
    from vllm_wna16_plugin.kernels.align import moe_align_block_size_torch
    from vllm_wna16_plugin.reference import fused_moe_wna16_ref

    gen = torch.Generator().manual_seed(41)
    E, H, inter, top_k, m = 4, 256, 128, 2, 5  # noqa: N806
    w13 = quantized_experts(E, 2 * inter, H, 4, gs, zp, torch.bfloat16, gen)
    w2 = quantized_experts(E, H, inter, 4, gs, zp, torch.bfloat16, gen)
    g13 = torch.stack([torch.randperm(H, generator=gen) // gs for _ in range(E)]).to(torch.int32)
    g2 = torch.stack([torch.randperm(inter, generator=gen) // gs for _ in range(E)]).to(torch.int32)
    t = KernelTensors(w13.qweight, w2.qweight, w13.scales, w2.scales, w13.qzeros, w2.qzeros,
                      torch.stack([g13, g13], 1), g2)  # fmt: skip
    n_global = 2 * E if emap else E
    expert_map = None
    if emap:  # this rank holds experts 1, 3, 4, 6 of 8
        expert_map = torch.full((n_global,), -1, dtype=torch.int32)
        expert_map[torch.tensor([1, 3, 4, 6])] = torch.arange(E, dtype=torch.int32)
    x = torch.randn(m, H, generator=gen).bfloat16()
    w, ids = torch.topk(torch.randn(m, n_global, generator=gen).softmax(-1), top_k, dim=-1)
    ids = ids.to(torch.int32)
    ref = fused_moe_wna16_ref(x, *t.weights(), w, ids, bits=4, w13_qzeros=t.w13_qzeros, w2_qzeros=t.w2_qzeros,
                              w13_g_idx=t.w13_g_idx, w2_g_idx=t.w2_g_idx, expert_map=expert_map)  # fmt: skip

    monkeypatch.setattr(cuda_ops, "extension_error", lambda: None)
    monkeypatch.setattr(cuda_ops, "invoke_moe_wna16_gemm", _emulated_gemm)
    monkeypatch.setattr(cuda_ops, "align_block_size",
                        lambda ids, bm, n, emap, *a, **k: moe_align_block_size_torch(ids, bm, n, emap))  # fmt: skip
    s = cuda_layout(sort_act_order(t, 4))
    kw = dict(bits=4, align_fn=None, w13_qzeros=s.w13_qzeros, w2_qzeros=s.w2_qzeros, expert_map=expert_map,
              global_num_experts=n_global)  # fmt: skip
    out = cuda_ops.fused_moe_wna16_cuda(x, *s.weights(), w, ids, **kw, a_perm=s.a_perm)
    assert_close_scaled(out, ref, torch.bfloat16, "cuda layer, act order (op emulated)")
    # the premise: without the gather the sorted weights meet x in the wrong order
    wrong = cuda_ops.fused_moe_wna16_cuda(x, *s.weights(), w, ids, **kw)
    assert (wrong.float() - ref.float()).abs().max() > 0.1 * ref.float().abs().max()


@pytest.mark.interpreter
@pytest.mark.parametrize("emap, dtype", [(False, torch.bfloat16), (True, torch.float16)])
def test_the_act_order_gather_kernel_is_the_torch_gather(emap, dtype, monkeypatch):
    """kernels/triton/act_order.py against the torch form and a loop of plain indexing, on fresh random data:
    H not a power of two (a masked tail), pairs routed off the rank (expert_map -1: expert 0's order), padding
    pairs (id -1: expert 0's order)."""
    from vllm_wna16_plugin.kernels import cuda_ops
    from vllm_wna16_plugin.kernels.triton.act_order import act_order_rows_triton

    gen = torch.Generator().manual_seed(5)
    m, top_k, E, H = 7, 3, 4, 1200  # noqa: N806
    a = torch.randn(m, H, generator=gen).to(dtype)
    a_perm = torch.stack([torch.randperm(H, generator=gen) for _ in range(E)]).to(torch.int32)
    n_global = 2 * E if emap else E
    expert_map = None
    if emap:
        expert_map = torch.full((n_global,), -1, dtype=torch.int32)
        expert_map[torch.tensor([0, 2, 5, 7])] = torch.arange(E, dtype=torch.int32)
    ids = torch.randint(0, n_global, (m, top_k), generator=gen, dtype=torch.int32)
    ids[-1, 1:] = -1  # vLLM 0.34's padding pairs: expert 0's order, the map never indexed with -1
    got = act_order_rows_triton(a, a_perm, ids, expert_map)
    want = torch.stack([a[p // top_k, a_perm[max(0, int(expert_map[e]) if emap and e >= 0 else int(e))].long()]
                        for p, e in enumerate(ids.reshape(-1))])  # fmt: skip
    assert torch.equal(got, want)
    monkeypatch.setattr(cuda_ops, "ACT_ORDER_GATHER_PAIRS", 4)  # the torch form's 21 pairs in 6 steps
    assert torch.equal(cuda_ops.act_order_rows_torch(a, a_perm, ids, expert_map), want)
    assert torch.equal(cuda_ops.act_order_rows(a, a_perm, ids, expert_map), want)  # the interpreter: the kernel
    assert act_order_rows_triton(a, a_perm, ids[:0], expert_map).shape == (0, H)
