"""The plugin's CUDA kernel (csrc/) on the GPU: against the float reference, every config kind, graphs, errors.

Skipped without CUDA or without the built extension. The reference is
reference.fused_moe_wna16_ref (float32 torch) and dequantize_ref, independent of every kernel.
The data is fresh random data for each case.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.kernels.conftest import assert_close_scaled, make_moe_problem, quantized_experts
from vllm_wna16_plugin.kernels.cuda_ops import extension_error, fused_moe_wna16_cuda, invoke_moe_wna16_gemm
from vllm_wna16_plugin.kernels.options import KernelOptions
from vllm_wna16_plugin.ops import fused_moe_wna16
from vllm_wna16_plugin.reference import dequantize_ref, fused_moe_wna16_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(extension_error() is not None, reason=str(extension_error())),
]
BF16, FP16 = torch.bfloat16, torch.float16


def _align():
    from vllm_wna16_plugin import _vllm

    fn = _vllm.moe_align_block_size_fn()
    if fn is None:
        pytest.skip("vLLM's moe_align_block_size is not importable")
    return fn


def _cuda(p):
    args = [t.cuda() for t in p.args()]
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in p.kwargs().items()}
    return args, kw


CASES = [
    # (M, H, I, E, top_k, bits, gs1, gs2, zp, dtype)
    pytest.param(1, 2048, 512, 32, 8, 4, 32, 32, False, BF16, id="gs32-k2048-decode"),  # vLLM's ratio-16 crash
    pytest.param(5, 1344, 1024, 8, 2, 4, 32, 32, True, BF16, id="gs32-k1344-zp"),  # vLLM's ratio-3 crash
    pytest.param(3, 2048, 96, 16, 8, 4, 128, 32, False, FP16, id="k96-tp8-fp16"),
    pytest.param(16, 2816, 352, 16, 8, 4, -1, -1, False, BF16, id="channelwise-352"),
    # bf16 int4 with whole-step groups or channel-wise, symmetric and with zero points; K=384 (GEMM2) ends in
    # a half pair (12 chunks), K=288 one chunk into its second pair
    pytest.param(4, 1024, 384, 16, 4, 4, 128, 128, False, BF16, id="gs128-sym-bf16-k384"),
    pytest.param(3, 768, 512, 8, 2, 4, 128, 128, True, BF16, id="gs128-zp-bf16"),
    pytest.param(6, 1024, 288, 8, 2, 4, -1, -1, True, BF16, id="channelwise-zp-bf16-k288"),
    pytest.param(64, 1024, 512, 8, 2, 8, 128, 128, True, BF16, id="int8-gs128-zp"),
    pytest.param(7, 1024, 176, 8, 2, 4, -1, -1, True, FP16, id="channelwise-K176-tp4"),  # 704/4: 8-byte vectors
    pytest.param(2, 1024, 200, 8, 2, 4, -1, -1, False, BF16, id="channelwise-K200"),  # 4-byte vectors
    pytest.param(33, 512, 256, 64, 6, 4, 64, 64, True, FP16, id="gs64-zp-fp16"),
    pytest.param(17, 1024, 512, 16, 4, 8, 32, 32, False, FP16, id="int8-sym-gs32-fp16"),
    pytest.param(2, 768, 384, 8, 2, 8, -1, -1, False, BF16, id="int8-sym-channelwise"),
]


def _layer_options(kernel: str) -> KernelOptions:
    """The layer's kernel options for a test's kernel id: "stream" / "tiles" are "auto" with the tensor-core
    kernel's persistent / tiled form for every decode block (cuda_stream_min_pairs_per_warp 0 / cuda_stream
    off); "auto" / "gemv" / "mma" are cuda_kernel."""
    if kernel == "stream":
        return KernelOptions(cuda_stream_min_pairs_per_warp=0)
    if kernel == "tiles":
        return KernelOptions(cuda_stream=False)
    return KernelOptions(cuda_kernel=kernel)


# "auto": the tensor-core kernel wherever rows split into 16-byte chunks inside a group (K=176 and K=200
# do not: their GEMM falls back to the CUDA-core kernel), its persistent or tiled form by the work per warp;
# "stream" / "tiles": that form for every block of <= 8 pairs (every case: KernelOptions.cuda_max_block_m);
# "gemv": the CUDA-core kernel everywhere
@pytest.mark.parametrize("kernel", ["auto", "stream", "tiles", "gemv"])
@pytest.mark.parametrize("M, H, I, E, top_k, bits, gs1, gs2, zp, dtype", CASES)
def test_cuda_layer_matches_reference(M, H, I, E, top_k, bits, gs1, gs2, zp, dtype, kernel):  # noqa: E741
    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=bits, gs1=gs1, gs2=gs2, zp=zp, dtype=dtype, seed=M)
    args, kw = _cuda(p)
    out = fused_moe_wna16_cuda(*args, **kw, align_fn=_align(), options=_layer_options(kernel))
    ref = fused_moe_wna16_ref(*args, **kw)
    assert_close_scaled(out.cpu(), ref.cpu(), dtype, f"cuda layer ({kernel})")


@pytest.mark.parametrize("kernel", ["stream", "tiles", "gemv"])
@pytest.mark.parametrize("M, H, I, E, top_k, bits, gs1, gs2, zp, dtype", CASES[:9])
def test_group_major_scales_and_zero_points(M, H, I, E, top_k, bits, gs1, gs2, zp, dtype, kernel):  # noqa: E741
    # the layout the cuda backend prepares (cuda_ops.group_major): same values, each group's rows adjacent
    from vllm_wna16_plugin.kernels.cuda_ops import group_major

    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=bits, gs1=gs1, gs2=gs2, zp=zp, dtype=dtype, seed=M + 1)
    args, kw = _cuda(p)
    ref = fused_moe_wna16_ref(*args, **kw)
    args[3], args[4] = group_major(args[3]), group_major(args[4])
    kw.update(w13_qzeros=group_major(kw.get("w13_qzeros")), w2_qzeros=group_major(kw.get("w2_qzeros")))
    out = fused_moe_wna16_cuda(*args, **kw, align_fn=_align(), options=_layer_options(kernel))
    assert_close_scaled(out.cpu(), ref.cpu(), dtype, f"cuda layer, group-major tables ({kernel})")


# the activation fused in the tensor-core kernel (both forms), or apart
@pytest.mark.parametrize("kernel", ["stream", "tiles", "gemv"])
def test_gelu_gated_activation(kernel):
    p = make_moe_problem(M=5, H=1024, I=384, E=8, top_k=2, bits=4, gs1=64, zp=True, seed=21)
    args, kw = _cuda(p)
    out = fused_moe_wna16_cuda(*args, **kw, align_fn=_align(), activation="gelu", options=_layer_options(kernel))
    ref = fused_moe_wna16_ref(*args, **kw, activation="gelu")
    assert_close_scaled(out.cpu(), ref.cpu(), BF16, f"gelu ({kernel})")


@pytest.mark.parametrize("kernel", ["stream", "tiles"])
def test_expert_map_and_router_weight_on_input(kernel):
    p = make_moe_problem(M=6, H=512, I=128, E=4, top_k=1, bits=4, gs1=32, zp=True, num_global_experts=8, seed=3)
    args, kw = _cuda(p)
    kw["options"] = _layer_options(kernel)
    expert_map = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    expert_map[torch.tensor([1, 2, 5, 6])] = torch.arange(4, dtype=torch.int32, device="cuda")
    for on_input in (False, True):
        out = fused_moe_wna16_cuda(*args, **kw, align_fn=_align(), expert_map=expert_map,
                                   apply_router_weight_on_input=on_input)  # fmt: skip
        ref = fused_moe_wna16_ref(*args, **{k: v for k, v in kw.items() if k != "options"}, expert_map=expert_map,
                                  apply_router_weight_on_input=on_input)  # fmt: skip
        assert_close_scaled(out.cpu(), ref.cpu(), BF16, f"expert_map, weight on input={on_input}")


def _check_one_gemm(E, N, K, M, top_k, bits, gs, zp, dtype, cfg, kernel, seed, group_major=False):
    """One grouped GEMM through invoke_moe_wna16_gemm against einsum on the float32 dequantized weights.
    group_major: the scale and zero-point tables in the layout the cuda backend prepares (cuda_ops.group_major)."""
    from vllm_wna16_plugin.kernels import cuda_ops

    gen = torch.Generator().manual_seed(seed)
    kw = quantized_experts(E, N, K, bits, gs, zp, dtype, gen)
    a = torch.randn(M, K, generator=gen).to(dtype).cuda()
    ids = torch.randint(0, E, (M, top_k), generator=gen, dtype=torch.int32).cuda()
    weights = torch.rand(M * top_k, generator=gen).cuda()
    sorted_ids, expert_ids, npp = _align()(ids, cfg.block_size_m, E, None, ignore_invalid_experts=True)
    c = torch.full((M * top_k, N), float("nan"), dtype=dtype, device="cuda")
    layout = cuda_ops.group_major if group_major else (lambda t: t)
    scales = layout(kw.scales.cuda())
    qzeros = layout(kw.qzeros.cuda()) if kw.qzeros is not None else None
    invoke_moe_wna16_gemm(a, kw.qweight.cuda(), scales, qzeros, c, weights, sorted_ids,
                          expert_ids, npp, bits=bits, top_k=top_k, config=cfg, kernel=kernel)  # fmt: skip
    w = dequantize_ref(kw.qweight, kw.scales, kw.qzeros, bits).cuda()  # (E, N, K) float32
    pairs = torch.arange(M * top_k, device="cuda")
    ref = torch.einsum("pk,pnk->pn", a.float()[pairs // top_k], w[ids.reshape(-1).long()]) * weights[:, None]
    assert_close_scaled(c.cpu(), ref.cpu(), dtype, f"{kernel} BLOCK {cfg.block_size_m}x{cfg.block_size_n}, N={N} K={K}")
    return c


@pytest.mark.parametrize("kernel", ["mma", "stream", "gemv"])
@pytest.mark.parametrize("block_m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("block_n", [32, 128, 256, 1024])
@pytest.mark.parametrize("bits,gs,block_k", [(4, 32, 256), (4, 128, 128), (8, -1, 64)])
def test_every_config_kind_computes_the_gemm(block_m, block_n, bits, gs, block_k, kernel):
    # one GEMM (N=1536, K=1024) under each BLOCK_SIZE_M / BLOCK_SIZE_N the module can produce
    from vllm_wna16_plugin.block_config import BlockConfig

    if kernel == "stream" and (block_m > 8 or block_n != 32):
        pytest.skip("the stream kernel takes blocks of <= 8 pairs and ignores BLOCK_SIZE_N")

    cfg = BlockConfig(block_m, block_n, block_k, 1024, 32 if gs == -1 else gs)
    _check_one_gemm(16, 1536, 1024, 9, 4, bits, gs, True, BF16, cfg, kernel, seed=block_m * 7 + block_n)


@pytest.mark.parametrize(
    "N, K, bits, gs, zp, dtype, block_m, block_n, M",
    [
        (200, 1344, 4, 32, True, BF16, 1, 48, 3),  # 3 column tiles (ksplit 2), a half 16-row tile, K a half step
        (200, 1344, 4, 32, False, FP16, 9, 200, 40),  # two 8-token tiles per pass, a partial last tile
        (208, 96, 4, 32, True, BF16, 64, 16, 100),  # 4 passes of 16 tokens, 1 tile (ksplit 8), K < one step
        (96, 704, 8, -1, True, FP16, 16, 32, 20),  # int8 channel-wise, 22 chunks
        (64, 2048, 8, 64, False, BF16, 3, 64, 7),  # int8 symmetric, 4 tiles
        (512, 2048, 4, 128, True, FP16, 16, 512, 64),  # 32 tiles: each warp 4 tiles, no K split
    ],
)
def test_mma_kernel_tails_and_work_splits(N, K, bits, gs, zp, dtype, block_m, block_n, M):
    from vllm_wna16_plugin.block_config import BlockConfig

    cfg = BlockConfig(block_m, block_n, K if gs == -1 else gs, K, K if gs == -1 else gs)
    _check_one_gemm(8, N, K, M, 2, bits, gs, zp, dtype, cfg, "mma", seed=N + K + block_m)


@pytest.mark.parametrize(
    "N, K, bits, gs, zp, dtype, block_m, M, slots, splits",
    [
        (64, 4096, 4, 128, False, BF16, 2, 3, None, True),  # 2 units of 16 pairs per expert: every one split
        (200, 1344, 4, 32, True, FP16, 1, 5, None, False),  # a half unit at N's end, K a half pair (42 chunks)
        (96, 704, 8, -1, True, BF16, 8, 20, 9, False),  # one block: 8 warps cross many units; int8 channel-wise
        (520, 2048, 4, 64, True, BF16, 4, 11, 17, True),  # two blocks (16 warps), gs64 (groups shorter than a step)
        (48, 256, 4, 128, False, FP16, 8, 64, None, False),  # K = one pair: a warp's range is whole units or a pair
        (40, 384, 4, 128, True, BF16, 2, 6, 17, False),  # gs128 with zero points, K a half pair; N a partial unit
    ],
)
def test_stream_kernel_splits_units_between_warps_and_resets_its_counters(N, K, bits, gs, zp, dtype, block_m, M,
                                                                        slots, splits, monkeypatch):  # fmt: skip
    # stream-K: units split between warps meet in the workspace; `slots` limits the grid ((slots - 1) // 8 blocks)
    from vllm_wna16_plugin.block_config import BlockConfig
    from vllm_wna16_plugin.kernels import cuda_ops

    workspace = torch.zeros((slots or 2 * 132 * 8 + 1) * cuda_ops.STREAM_SLOT_WORDS, device="cuda")
    monkeypatch.setattr(cuda_ops, "stream_workspace", lambda device: workspace)
    cfg = BlockConfig(block_m, 32, K if gs == -1 else gs, K, K if gs == -1 else gs)
    for seed in range(2):  # a second launch on the workspace the first one left
        c = _check_one_gemm(8, N, K, M, 2, bits, gs, zp, dtype, cfg, "stream", seed=N + K + seed, group_major=True)
        again = _check_one_gemm(8, N, K, M, 2, bits, gs, zp, dtype, cfg, "stream", seed=N + K + seed, group_major=True)
        assert torch.equal(c, again), "split units are summed in warp order: the same bits every launch"
        torch.cuda.synchronize()
        slots = workspace.numel() // cuda_ops.STREAM_SLOT_WORDS
        counters = workspace[slots * (cuda_ops.STREAM_SLOT_WORDS - 1) :]  # after the partial sums
        assert int(torch.count_nonzero(counters)) == 0, "the stream kernel left a unit's counter set"
        if splits:  # split units left partial sums in the workspace
            assert int(torch.count_nonzero(workspace[: slots * (cuda_ops.STREAM_SLOT_WORDS - 1)])) > 0


def test_stream_kernel_refuses_blocks_of_more_than_8_pairs_and_a_missing_workspace():
    from vllm_wna16_plugin.block_config import BlockConfig

    with pytest.raises(RuntimeError, match="kernel=stream takes blocks of at most 8 pairs"):
        _check_one_gemm(4, 64, 512, 20, 2, 4, 128, False, BF16, BlockConfig(16, 32, 128, 512, 128), "stream", seed=0)
    a = torch.zeros(2, 512, dtype=BF16, device="cuda")
    ids = torch.zeros(8, dtype=torch.int32, device="cuda")
    refusal = torch.ops.wna16_plus.moe_wna16_gemm(
        a, torch.zeros(4, 64, 256, dtype=torch.uint8, device="cuda"), torch.ones(4, 64, 4, dtype=BF16, device="cuda"),
        None, None, ids, ids, ids[:1], torch.empty(2, 64, dtype=BF16, device="cuda"), 4, 1, 2, 32, 128, "stream", "none",
    )  # fmt: skip
    assert "kernel=stream needs its workspace" in refusal


@pytest.mark.parametrize("E, block_m", [(8, 1), (8, 8), (64, 2), (64, 8), (128, 4), (256, 16), (60, 8)])
@pytest.mark.parametrize("M", [1, 3, 16, 300])
@pytest.mark.parametrize("with_map", [False, True])
def test_own_alignment_matches_vllms(E, block_m, M, with_map):
    # csrc/moe_align.cu against vLLM's moe_align_block_size: the same padded total, the same expert per
    # block, and per expert the same pairs (their order within an expert is the atomics' and free)
    from vllm_wna16_plugin.kernels.cuda_ops import align_block_size

    gen = torch.Generator().manual_seed(E * 1000 + M * 10 + block_m)
    top_k = min(8, E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(M)]).to(torch.int32).cuda()
    expert_map = None
    if with_map:  # this rank holds every other expert, in a shuffled local order
        local = torch.randperm(E // 2, generator=gen).to(torch.int32)
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[::2] = local
        expert_map = expert_map.cuda()
    ours = align_block_size(ids, block_m, E, expert_map, align_fn=None)
    theirs = _align()(ids, block_m, E, expert_map, ignore_invalid_experts=True)
    total = int(ours[2][0])
    assert total == int(theirs[2][0]) and total % block_m == 0
    blocks = total // block_m
    assert torch.equal(ours[1][:blocks].cpu(), theirs[1][:blocks].cpu()), "expert of each block"
    assert (ours[1][blocks:].cpu() == -1).all()
    mine, vllm = ours[0][:total].cpu().view(blocks, block_m), theirs[0][:total].cpu().view(blocks, block_m)
    for e in ours[1][:blocks].unique().tolist():
        rows = (ours[1][:blocks] == e).cpu()
        assert torch.equal(mine[rows].flatten().sort().values, vllm[rows].flatten().sort().values), f"expert {e}"
    assert (ours[0][total:].cpu() == M * top_k).all(), "the list past the padded total is padding"


def test_mma_kernel_is_refused_where_chunks_straddle():
    from vllm_wna16_plugin.block_config import BlockConfig

    cfg = BlockConfig(1, 32, 176, 176, 176)  # K=176 int4: 88-byte rows, no 16-byte chunks
    with pytest.raises(RuntimeError, match="the mma kernel needs 16-byte chunks"):
        _check_one_gemm(4, 64, 176, 2, 2, 4, -1, False, BF16, cfg, "mma", seed=0)


@pytest.mark.parametrize("kernel", ["stream", "tiles"])
def test_decode_step_captures_in_a_cuda_graph(kernel):
    p = make_moe_problem(M=4, H=2048, I=512, E=32, top_k=8, bits=4, gs1=32, seed=11)
    args, kw = _cuda(p)
    align, options = _align(), _layer_options(kernel)
    fused_moe_wna16_cuda(*args, **kw, align_fn=align, options=options)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_wna16_cuda(*args, **kw, align_fn=align, options=options)
    args[0].copy_(torch.randn_like(args[0]))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_scaled(out.cpu(), fused_moe_wna16_ref(*args, **kw).cpu(), BF16, "graph replay")


# A chain of layer calls, each one's output the next one's input: every kernel of a call reads what the one
# before it wrote (the alignment's ids aside), so a programmatic launch (KernelOptions.programmatic_launch) that
# read before its wait would see stale data. Eager and captured in a CUDA graph, each layer matches the
# reference on its input, and the bits equal those of plain launches.
@pytest.mark.parametrize("kernel", ["stream", "tiles", "gemv"])
def test_programmatic_launches_chain_layers_as_plain_launches_do(kernel):
    p = make_moe_problem(M=3, H=1024, I=512, E=8, top_k=2, bits=4, gs1=128, zp=True, seed=31)
    args, kw = _cuda(p)
    align, options = _align(), _layer_options(kernel)
    assert options.programmatic_launch  # the default; the H200 is sm90, so the launches are programmatic

    def chain(x, layers=4, options=options):
        outs = []
        for _ in range(layers):
            x = fused_moe_wna16_cuda(x, *args[1:], **kw, align_fn=align, options=options)
            outs.append(x)
        return outs

    x0 = args[0].clone()
    plain = [t.clone() for t in chain(x0, options=dataclasses.replace(options, programmatic_launch=False))]
    eager = chain(x0)
    torch.cuda.synchronize()
    for i, (e, want) in enumerate(zip(eager, plain, strict=True)):
        assert torch.equal(e, want), f"layer {i}: programmatic launches changed the result"
        layer_in = x0 if i == 0 else plain[i - 1]
        ref = fused_moe_wna16_ref(layer_in, *args[1:], **kw)
        assert_close_scaled(e.cpu(), ref.cpu(), BF16, f"layer {i} of the chain ({kernel})")
    x = torch.zeros_like(x0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    x.copy_(x0)
    graph.replay()
    torch.cuda.synchronize()
    for i, (c, want) in enumerate(zip(captured, plain, strict=True)):
        assert torch.equal(c, want), f"layer {i}: the graph's programmatic launches changed the result"


# act order on the CUDA kernel: the sorted layout (backends.base.sort_act_order) with GEMM1's A gathered per
# pair (cuda_ops.act_order_rows), every kernel form, against the float reference of the unsorted checkpoint
@pytest.mark.parametrize("kernel", ["stream", "tiles", "gemv"])
@pytest.mark.parametrize("M, gs, zp, bits", [(1, 128, False, 4), (7, 32, True, 4), (24, 64, True, 8)])
def test_act_order_runs_sorted_on_the_cuda_kernel(M, gs, zp, bits, kernel):
    from vllm_wna16_plugin.backends import KernelTensors
    from vllm_wna16_plugin.backends.base import sort_act_order
    from vllm_wna16_plugin.backends.cuda import cuda_layout

    gen = torch.Generator().manual_seed(M + gs)
    E, H, inter, top_k = 16, 1024, 512, 4  # noqa: N806
    w13 = quantized_experts(E, 2 * inter, H, bits, gs, zp, BF16, gen)
    w2 = quantized_experts(E, H, inter, bits, gs, zp, BF16, gen)
    g13 = torch.stack([torch.randperm(H, generator=gen) // gs for _ in range(E)]).to(torch.int32)
    g2 = torch.stack([torch.randperm(inter, generator=gen) // gs for _ in range(E)]).to(torch.int32)
    t = KernelTensors(*(None if v is None else v.cuda() for v in (
        w13.qweight, w2.qweight, w13.scales, w2.scales, w13.qzeros, w2.qzeros, torch.stack([g13, g13], 1), g2)))  # fmt: skip
    x = torch.randn(M, H, generator=gen).to(BF16).cuda()
    w, ids = torch.topk(torch.randn(M, E, generator=gen).softmax(-1), top_k, dim=-1)
    w, ids = w.cuda(), ids.to(torch.int32).cuda()
    ref = fused_moe_wna16_ref(x, *t.weights(), w, ids, bits=bits, w13_qzeros=t.w13_qzeros, w2_qzeros=t.w2_qzeros,
                              w13_g_idx=t.w13_g_idx, w2_g_idx=t.w2_g_idx)  # fmt: skip
    s = cuda_layout(sort_act_order(t, bits))
    out = fused_moe_wna16_cuda(x, *s.weights(), w, ids, bits=bits, align_fn=_align(), w13_qzeros=s.w13_qzeros,
                               w2_qzeros=s.w2_qzeros, options=_layer_options(kernel), a_perm=s.a_perm)  # fmt: skip
    assert_close_scaled(out.cpu(), ref.cpu(), BF16, f"act order on cuda ({kernel})")


def test_bad_input_is_refused_before_the_launch():
    p = make_moe_problem(M=2, H=256, I=128, E=4, top_k=2, bits=4, gs1=32, seed=5)
    args, kw = _cuda(p)
    bad_ids = args[6].clone()
    bad_ids[0, 0] = 4  # E = 4: out of range; checked by the functional API (inputs.py), not per launch
    with pytest.raises(ValueError, match=r"topk_ids holds expert id 4, outside \[0, 4\)"):
        fused_moe_wna16(*args[:6], bad_ids, **kw, group_size=32, backend="cuda")
    wrong_dtype = list(args)
    wrong_dtype[3] = args[3].float()  # scales in float32, activations in bf16
    with pytest.raises(RuntimeError, match=r"scales must be an \(E=4, N=256, G\) tensor in a's dtype"):
        fused_moe_wna16_cuda(*wrong_dtype, **kw, align_fn=_align())


SANITIZED = textwrap.dedent(
    """
    import torch
    from tests.kernels.conftest import make_moe_problem
    from vllm_wna16_plugin import _vllm
    from vllm_wna16_plugin.kernels.cuda_ops import fused_moe_wna16_cuda
    from vllm_wna16_plugin.kernels.options import KernelOptions
    p = make_moe_problem(M=3, H=1344, I=256, E=8, top_k=2, bits=4, gs1=32, zp=True, seed=1)
    args = [t.cuda() for t in p.args()]
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in p.kwargs().items()}
    for kernel in ("auto", "mma", "gemv"):  # auto: the stream kernel (blocks of <= 8 pairs), the own alignment
        options = KernelOptions(cuda_kernel=kernel, cuda_stream_min_pairs_per_warp=0)
        fused_moe_wna16_cuda(*args, **kw, align_fn=_vllm.moe_align_block_size_fn(), options=options)
    torch.cuda.synchronize()
    """
)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_is_clean(tool):
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer is not on PATH")
    # only our kernel: torch's and Triton's own kernels are not ours to vouch for
    cmd = [exe, f"--tool={tool}", "--error-exitcode=99", "--kernel-name", "kns=moe_wna16",
           sys.executable, "-c", SANITIZED]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout + proc.stderr  # memcheck: "ERROR SUMMARY: 0 errors"; racecheck: "... (0 errors, 0 warnings)"
    assert "ERROR SUMMARY: 0 errors" in summary or "(0 errors, 0 warnings)" in summary, summary[-2000:]


def test_auto_runs_cuda_up_to_the_measured_crossover_and_triton_above(tmp_path, monkeypatch):
    from vllm_wna16_plugin import crossover
    from vllm_wna16_plugin.backends import triton as triton_backend
    from vllm_wna16_plugin.kernels import cuda_ops
    from vllm_wna16_plugin.ops import fused_moe_wna16

    monkeypatch.setattr(crossover, "CROSSOVER_DIR", tmp_path)
    key = crossover.layer_key(8, 512, 256, 32, 4)
    crossover.write_crossovers({key: {"cuda_max_m": 2}}, torch.cuda.get_device_name(), tmp_path)
    ran = []
    real_cuda, real_triton = cuda_ops.fused_moe_wna16_cuda, triton_backend.TritonBackend.run
    monkeypatch.setattr(cuda_ops, "fused_moe_wna16_cuda", lambda *a, **k: ran.append("cuda") or real_cuda(*a, **k))
    monkeypatch.setattr(triton_backend.TritonBackend, "run",
                        lambda self, *a, **k: ran.append("triton") or real_triton(self, *a, **k))  # fmt: skip
    for M in (1, 2, 5):
        p = make_moe_problem(M=M, H=512, I=256, E=8, top_k=2, bits=4, gs1=32, seed=M)
        args, kw = _cuda(p)
        out = fused_moe_wna16(*args, **kw, group_size=32, backend="auto")
        assert_close_scaled(out.cpu(), fused_moe_wna16_ref(*args, **kw).cpu(), BF16, f"auto M={M}")
    assert ran == ["cuda", "cuda", "triton"]
