"""The Triton WNA16 MoE kernel (pointer and TD paths) against reference.fused_moe_wna16_ref.

Runs under the Triton interpreter on CPU (conftest sets TRITON_INTERPRET=1), so the
shapes are tiny in M/N but keep real K tails. Each case's comment names its edge.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_wna16_plugin.kernels.align import moe_align_block_size_torch  # noqa: E402
from vllm_wna16_plugin.kernels.options import KernelOptions  # noqa: E402
from vllm_wna16_plugin.kernels.triton import configs, fused_moe  # noqa: E402
from vllm_wna16_plugin.kernels.triton.configs import (  # noqa: E402
    TritonMoEConfig,
    config_file_name,
    default_config,
    get_triton_moe_config,
)
from vllm_wna16_plugin.kernels.triton.fused_moe import fused_moe_wna16_triton, invoke_wna16_gemm  # noqa: E402
from vllm_wna16_plugin.kernels.triton.td_gate import TDDecision  # noqa: E402
from vllm_wna16_plugin.reference import dequantize_ref, fused_moe_wna16_ref  # noqa: E402

from .conftest import assert_close_scaled, make_moe_problem, quantized_experts  # noqa: E402

pytestmark = pytest.mark.interpreter

BF16, FP16 = torch.bfloat16, torch.float16
Cfg = TritonMoEConfig
POINTERS = TDDecision(False, False, "test: pointers")
WORDS = KernelOptions(dot_nibbles="words")


def run_both(p, *, reference_kwargs=None, **kwargs):
    ref = fused_moe_wna16_ref(*p.args(), **p.kwargs(), **(reference_kwargs or {}))
    out = fused_moe_wna16_triton(*p.args(), **p.kwargs(), **kwargs)
    return out, ref


# (M, H, inter, E, top_k, bits, gs1, gs2, zp, dtype, config)
CASES = [
    pytest.param(4, 128, 64, 4, 2, 4, 128, 64, False, BF16, None, id="int4-sym-gs128/64-bf16-default-config"),
    # group size 32, the size vLLM never tests; BLOCK_SIZE_K=64 spans two groups per tile
    pytest.param(3, 128, 64, 4, 2, 4, 32, 32, True, BF16, Cfg(16, 32, 64), id="int4-asym-gs32-2groups/tile"),
    # K=1344 (a TP split) at group 32: BLOCK_SIZE_K=128 leaves a 64-wide K tail in GEMM1
    pytest.param(2, 1344, 32, 4, 2, 4, 32, 32, True, BF16, Cfg(16, 32, 128), id="int4-asym-gs32-K1344-tail"),
    # K=96 (Qwen3-30B-A3B at TP8) with BLOCK_SIZE_K=64: a 32-wide tail, and N=2I=352 not a multiple of 64
    pytest.param(3, 96, 176, 4, 2, 4, 32, 16, False, FP16, Cfg(16, 64, 64), id="int4-sym-K96-tail-N352-fp16"),
    # I=352 (704/2): GEMM2 K=352 tails under BLOCK_SIZE_K=64, GEMM1 N=704
    pytest.param(2, 64, 352, 4, 2, 4, 32, 32, False, BF16, Cfg(16, 64, 64), id="int4-sym-K352-tail-N704"),
    # channel-wise (one group per row) with zero points; BLOCK_SIZE_K > nothing to divide
    pytest.param(4, 128, 96, 4, 2, 4, -1, -1, True, BF16, Cfg(16, 32, 64), id="int4-asym-channelwise-K96-tail"),
    # int8 symmetric (zero 128) at group 64, fp16
    pytest.param(4, 128, 64, 4, 2, 8, 64, 64, False, FP16, Cfg(16, 32, 32), id="int8-sym-gs64-fp16"),
    # int8 with zero points at group 32, BLOCK_SIZE_K=128 spans four groups
    pytest.param(3, 128, 64, 4, 2, 8, 32, 32, True, BF16, Cfg(16, 32, 128), id="int8-asym-gs32-4groups/tile"),
    # int8 channel-wise, K tail on GEMM2 (I=96)
    pytest.param(2, 128, 96, 4, 2, 8, -1, -1, True, BF16, Cfg(16, 32, 64), id="int8-asym-channelwise-K96"),
    # top_k=1, different group sizes per GEMM (gs1=128, gs2=32)
    pytest.param(5, 256, 64, 4, 1, 4, 128, 32, False, BF16, Cfg(16, 32, 64), id="int4-topk1-gs128/32"),
    # top_k=8 of 8 experts: every expert busy; M not a multiple of BLOCK_SIZE_M=4; GROUP_SIZE_M>1 ordering
    pytest.param(
        6, 64, 32, 8, 8, 4, 32, 32, True, FP16, Cfg(4, 16, 32, GROUP_SIZE_M=4), id="int4-topk8-E8-BM4-grouped"
    ),
    # a 128-row tile with a 256-wide N tile (the tuner's prefill candidates): 160 pairs over 2 experts
    pytest.param(
        80,
        64,
        128,
        2,
        2,
        4,
        32,
        32,
        True,
        BF16,
        Cfg(128, 256, 64, GROUP_SIZE_M=8, num_warps=8),
        id="int4-asym-BM128-BN256",
    ),  # fmt: skip
    # a single token (decode), default config
    pytest.param(1, 128, 64, 8, 2, 4, 64, 64, True, BF16, None, id="int4-M1-default-config"),
    # a tuned entry's own int4 form and register cap (bench/tune.py stage B), K=256 over two tiles
    pytest.param(
        5,
        256,
        64,
        4,
        2,
        4,
        64,
        64,
        True,
        BF16,
        Cfg(16, 64, 128, nibbles="split", maxnreg=128),
        id="int4-tuned-split-r128",
    ),
]


@pytest.fixture(params=["auto", "split"])
def dot_nibbles(request):
    """The default policy (words on K tiles >= 128, interleave on narrower ones) and the split form."""
    return KernelOptions(dot_nibbles=request.param)


@pytest.mark.parametrize("M,H,inter,E,top_k,bits,gs1,gs2,zp,dtype,config", CASES)
def test_pointer_path_matches_reference(
    M, H, inter, E, top_k, bits, gs1, gs2, zp, dtype, config, td_decisions, dot_nibbles
):
    p = make_moe_problem(M=M, H=H, inter=inter, E=E, top_k=top_k, bits=bits, gs1=gs1, gs2=gs2, zp=zp, dtype=dtype)
    out, ref = run_both(p, use_td=False, configs=config, options=dot_nibbles)
    assert_close_scaled(out, ref, dtype, "pointer path")
    assert td_decisions and not any(d.use_td_b or d.use_gather for d in td_decisions)


TD_CASES = [
    # B via descriptor + A gather, int4 half-K descriptor with interleave, gs32 two groups per tile
    pytest.param(4, 128, 64, 4, 2, 4, 32, 32, True, BF16, Cfg(16, 32, 64), id="int4-asym-gs32"),
    # int8 B descriptor (full-K bytes), gs64, fp16
    pytest.param(3, 128, 64, 4, 2, 8, 64, 64, False, FP16, Cfg(8, 32, 32), id="int8-sym-gs64-BM8"),
    # N tail on the descriptor (GEMM2 N=H=96 with BLOCK_SIZE_N=64: rows past N zero-filled), channel-wise
    pytest.param(3, 96, 64, 4, 2, 4, -1, -1, True, BF16, Cfg(16, 64, 32), id="int4-channelwise-Ntail"),
    # top_k=8 of 8 experts, fp16, int4 sym
    pytest.param(2, 64, 32, 8, 8, 4, 32, 32, False, FP16, Cfg(8, 16, 32), id="int4-topk8"),
]


@pytest.mark.parametrize("M,H,inter,E,top_k,bits,gs1,gs2,zp,dtype,config", TD_CASES)
def test_td_path_matches_reference_and_pointer_path(
    M, H, inter, E, top_k, bits, gs1, gs2, zp, dtype, config, td_decisions, dot_nibbles
):
    p = make_moe_problem(
        M=M, H=H, inter=inter, E=E, top_k=top_k, bits=bits, gs1=gs1, gs2=gs2, zp=zp, dtype=dtype, seed=1
    )
    out_td, ref = run_both(p, use_td=True, configs=config, options=dot_nibbles)
    assert all(d.use_td_b and d.use_gather for d in td_decisions), td_decisions  # the premise: TD really ran
    assert_close_scaled(out_td, ref, dtype, "TD path")
    out_ptr = fused_moe_wna16_triton(*p.args(), **p.kwargs(), use_td=False, configs=config, options=dot_nibbles)
    # same bytes, same arithmetic: only the way B (and A) reach the registers differs
    torch.testing.assert_close(out_td, out_ptr, atol=0, rtol=0)


def test_td_gather_skipped_below_8_rows_output_still_right(td_decisions):
    # BLOCK_SIZE_M=4: descriptor gather needs >= 8 rows, so A stays on pointers, B keeps TD
    p = make_moe_problem(M=4, H=128, inter=64, E=4, top_k=2, bits=4, gs1=64, zp=True, seed=2)
    out, ref = run_both(p, use_td=True, configs=Cfg(4, 32, 64))
    assert [(d.use_td_b, d.use_gather) for d in td_decisions] == [(True, False), (True, False)]
    assert_close_scaled(out, ref, BF16, "BLOCK_SIZE_M=4 under use_td=True")


def test_td_k_tail_falls_back_to_pointers_off_xpu(td_decisions):
    # K=96 (GEMM1) with BLOCK_SIZE_K=64 is a K tail: no TD off XPU; GEMM2 (K=64) keeps TD
    p = make_moe_problem(M=3, H=96, inter=64, E=4, top_k=2, bits=4, gs1=32, seed=3)
    out, ref = run_both(p, use_td=True, configs=Cfg(16, 32, 64))
    assert [d.use_td_b for d in td_decisions] == [False, True]
    assert "K=96" in td_decisions[0].reason
    assert_close_scaled(out, ref, BF16, "K tail under use_td=True")


def test_td_m1_gemm1_falls_back_gemm2_keeps_td(td_decisions):
    # M=1: GEMM1's A has one row (no TD); GEMM2's A has top_k rows and takes TD (the seed's rule)
    p = make_moe_problem(M=1, H=64, inter=32, E=4, top_k=2, bits=4, gs1=32, seed=4)
    out, ref = run_both(p, use_td=True, configs=Cfg(16, 32, 32))
    assert [d.use_td_b for d in td_decisions] == [False, True]
    assert_close_scaled(out, ref, BF16, "M=1")


@pytest.mark.parametrize(
    "bits,zp",
    [
        pytest.param(4, True, id="int4-asym"),  # half-K descriptor + interleave on a K tail
        pytest.param(8, False, id="int8-sym"),  # full-K descriptor on a K tail
    ],
)
def test_td_on_k_tail_matches_pointer_path_as_xpu_runs_it(bits, zp):
    # XPU keeps TD on a K tail: the descriptor zero-fills past K; force that decision directly
    E, N, K, gs = 3, 48, 96, 32
    gen = torch.Generator().manual_seed(5)
    kw = quantized_experts(E, N, K, bits, gs, zp, BF16, gen)
    a = torch.randn(10, K, generator=gen).to(BF16)
    ids = torch.randint(0, E, (10, 1), generator=gen, dtype=torch.int32)
    cfg = Cfg(8, 32, 64)
    aligned = moe_align_block_size_torch(ids, 8, E)
    outs = []
    for td in (POINTERS, TDDecision(True, True, "test: xpu-like K tail")):
        c = torch.full((10, N), float("nan"), dtype=BF16)
        invoke_wna16_gemm(
            a,
            kw.qweight,
            kw.scales,
            kw.qzeros,
            c,
            None,
            *aligned,
            bits=bits,
            top_k=1,
            mul_routed_weight=False,
            config=cfg,
            td=td,
        )
        outs.append(c)
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    w = dequantize_ref(kw.qweight, kw.scales, kw.qzeros, bits).to(BF16).float()
    ref = torch.einsum("mk,mnk->mn", a.float(), w[ids[:, 0].long()])
    assert_close_scaled(outs[0], ref, BF16, "K-tail GEMM")


@pytest.mark.parametrize(
    "bits,zp,gs,td",
    [
        pytest.param(4, True, 32, False, id="int4-asym-gs32-ptr"),  # nibble order + zero-point nibble per n
        pytest.param(4, False, -1, True, id="int4-sym-channelwise-td"),  # interleave order through the descriptor
        pytest.param(8, True, 64, True, id="int8-asym-gs64-td"),
    ],
)
def test_one_hot_probe_is_exact_dequant(bits, zp, gs, td):
    # x = eye(K) routed to one expert: row k of the output is column k of dequant(W_e), exactly
    E, N, K = 2, 32, 64
    gen = torch.Generator().manual_seed(6)
    kw = quantized_experts(E, N, K, bits, gs, zp, BF16, gen)
    a = torch.eye(K, dtype=BF16)
    ids = torch.full((K, 1), 1, dtype=torch.int32)
    aligned = moe_align_block_size_torch(ids, 16, E)
    c = torch.full((K, N), float("nan"), dtype=BF16)
    invoke_wna16_gemm(
        a,
        kw.qweight,
        kw.scales,
        kw.qzeros,
        c,
        None,
        *aligned,
        bits=bits,
        top_k=1,
        mul_routed_weight=False,
        config=Cfg(16, 32, 32),
        td=TDDecision(td, td, "test") if td else POINTERS,
    )
    want = dequantize_ref(kw.qweight, kw.scales, kw.qzeros, bits)[1].to(BF16).T  # (K, N)
    assert torch.equal(c, want), (c.float() - want.float()).abs().max()


@pytest.mark.parametrize("use_td", [pytest.param(False, id="ptr"), pytest.param(True, id="td")])
def test_expert_map_non_local_experts_contribute_zero_and_out_fully_written(use_td):
    # 8 global experts, 4 local (ids 1,3,4,6 -> 0..3); pairs on the other 4 contribute 0; NaN-poisoned out
    p = make_moe_problem(M=6, H=64, inter=32, E=4, top_k=3, bits=4, gs1=32, zp=True, num_global_experts=8, seed=7)
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[torch.tensor([1, 3, 4, 6])] = torch.arange(4, dtype=torch.int32)
    assert (expert_map[p.topk_ids.long()] == -1).any() and (expert_map[p.topk_ids.long()] >= 0).any()
    out = torch.full((6, 64), float("nan"), dtype=BF16)
    got, ref = run_both(
        p,
        use_td=use_td,
        expert_map=expert_map,
        configs=Cfg(8, 32, 32),
        out=out,
        reference_kwargs=dict(expert_map=expert_map),
    )
    assert got is out
    assert_close_scaled(out, ref, BF16, "expert_map")


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")])
def test_every_output_element_written(dtype):
    # NaN-poisoned out over an N tail (H=80 with BLOCK_SIZE_N=32) and M > BLOCK_SIZE_M
    p = make_moe_problem(M=7, H=80, inter=48, E=4, top_k=2, bits=4, gs1=16, gs2=16, dtype=dtype, seed=8)
    out = torch.full((7, 80), float("nan"), dtype=dtype)
    _, ref = run_both(p, use_td=False, configs=Cfg(4, 32, 16), out=out)
    assert_close_scaled(out, ref, dtype, "NaN-poisoned out")


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_router_weight_on_input_top_k_1(activation):
    # apply_router_weight_on_input: the weight scales GEMM1, GEMM2 is unweighted (top_k=1, as vLLM requires)
    p = make_moe_problem(M=5, H=64, inter=32, E=4, top_k=1, bits=4, gs1=32, seed=9)
    p.topk_weights = torch.rand(p.topk_weights.shape, generator=torch.Generator().manual_seed(9)) + 0.25  # not 1.0
    out, ref = run_both(
        p,
        use_td=False,
        activation=activation,
        apply_router_weight_on_input=True,
        configs=Cfg(16, 32, 32),
        reference_kwargs=dict(activation=activation, apply_router_weight_on_input=True),
    )
    assert_close_scaled(out, ref, BF16, f"router weight on input, {activation}")
    unweighted = fused_moe_wna16_ref(*p.args(), **p.kwargs(), activation=activation)
    assert (out.float() - unweighted.float()).abs().max() > 10 * (out.float() - ref.float()).abs().max()


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")])
def test_arbitrary_scales_stay_within_rounding_noise(dtype):
    # scales with full mantissas: the kernel rounds each dequantized weight to the activation
    # dtype (vLLM's kernel does too); the float32 reference does not, so allow twice the noise
    p = make_moe_problem(
        M=4, H=128, inter=64, E=4, top_k=2, bits=4, gs1=32, zp=True, dtype=dtype, seed=13, exact_scales=False
    )
    out, ref = run_both(p, use_td=False, configs=Cfg(16, 32, 64))
    o, r = out.float(), ref.float()
    rel_rms = ((o - r).norm() / r.norm()).item()
    limit = 2**-7 if dtype == BF16 else 2**-9
    assert rel_rms < limit and (o - r).abs().max() < 4 * limit * r.abs().max(), (rel_rms, (o - r).abs().max())


def test_gelu_top_k_2():
    # the other activation on the weighted-output path
    p = make_moe_problem(M=3, H=64, inter=64, E=4, top_k=2, bits=8, gs1=64, zp=True, seed=10)
    out, ref = run_both(
        p, use_td=False, activation="gelu", configs=Cfg(16, 32, 64), reference_kwargs=dict(activation="gelu")
    )
    assert_close_scaled(out, ref, BF16, "gelu")


@pytest.mark.slow
def test_512_experts_tiny_dims(td_decisions):
    # E=512 (DeepSeek/Kimi-sized routing), top_k=8: most experts empty, the grid is trimmed to live blocks
    p = make_moe_problem(M=3, H=32, inter=16, E=512, top_k=8, bits=4, gs1=16, gs2=16, seed=11)
    out, ref = run_both(p, use_td=None, configs=Cfg(16, 32, 16))
    assert_close_scaled(out, ref, BF16, "E=512")


def test_custom_align_fn_is_used():
    # the GPU caller passes vLLM's moe_align_block_size; any function with its contract works
    calls = []

    def align(topk_ids, block_size, num_experts, expert_map=None):
        calls.append((block_size, num_experts))
        return moe_align_block_size_torch(topk_ids, block_size, num_experts, expert_map)

    p = make_moe_problem(M=2, H=64, inter=32, E=4, top_k=2, bits=4, gs1=32, seed=12)
    out, ref = run_both(p, use_td=False, align_fn=align, configs=Cfg(16, 32, 32))
    assert calls == [(16, 4)]
    assert_close_scaled(out, ref, BF16, "custom align_fn")


def test_empty_batch_returns_empty():
    p = make_moe_problem(M=2, H=64, inter=32, E=4, top_k=2, bits=4, gs1=32)
    p.x, p.topk_ids, p.topk_weights = p.x[:0], p.topk_ids[:0], p.topk_weights[:0]
    assert fused_moe_wna16_triton(*p.args(), **p.kwargs()).shape == (0, 64)


# ---------------------------------------------------------------- per-pair (BLOCK_SIZE_M=1) and split-K

PER_PAIR_CASES = [
    # (M, H, inter, E, top_k, bits, gs1, gs2, zp, dtype, config); the comment names the edge
    # gs32, BLOCK_SIZE_K=256: 8 scale groups per tile, one (BLOCK_N, 8) scale vector per step
    pytest.param(1, 512, 256, 8, 2, 4, 32, 32, True, BF16, Cfg(1, 32, 256), id="int4-asym-gs32-8groups/tile"),
    # gs64, K=1344 tail under BLOCK_SIZE_K=128 (1344 = 10.5 tiles), N tail (2I=96 under BN=64)
    pytest.param(2, 1344, 48, 4, 2, 4, 64, 16, False, FP16, Cfg(1, 64, 128), id="int4-gs64-K1344-tail-fp16"),
    # gs128 spans two K tiles of 64: the same scale vector on consecutive steps
    pytest.param(3, 256, 128, 4, 2, 4, 128, 128, True, BF16, Cfg(1, 32, 64), id="int4-gs128-2tiles/group"),
    # channel-wise, K=96 with BLOCK_SIZE_K=64 (tail), zero points
    pytest.param(2, 96, 96, 4, 2, 4, -1, -1, True, BF16, Cfg(1, 32, 64), id="int4-channelwise-K96-tail"),
    # int8 (bf16: no magic-number path), gs32, split K in 2
    pytest.param(2, 256, 64, 4, 2, 8, 32, 32, True, BF16, Cfg(1, 32, 64, SPLIT_K=2), id="int8-gs32-split2"),
    # int8 fp16 magic path, split 4 over K=1344 tiles that do not split evenly (11 tiles of 128)
    pytest.param(1, 1344, 64, 4, 2, 8, 64, 64, False, FP16, Cfg(1, 32, 128, SPLIT_K=4), id="int8-K1344-split4-uneven"),
    # top_k=1: GEMM2 writes out directly
    pytest.param(3, 128, 64, 4, 1, 4, 32, 32, False, BF16, Cfg(1, 16, 64), id="int4-topk1-direct-out"),
    # K tiles wider than 256 reduce every step: 512-byte int4 rows, gs128 (8 groups per tile); GEMM2's
    # K=128 is a fraction of one tile
    pytest.param(1, 2048, 128, 4, 2, 4, 128, 128, True, BF16, Cfg(1, 32, 1024), id="int4-wideK1024-reduce-each-step"),
    # a wide tile over a K tail (1344 = 2.6 tiles of 512), gs32 (16 groups per tile), fp16
    pytest.param(2, 1344, 64, 4, 2, 4, 32, 32, False, FP16, Cfg(1, 64, 512), id="int4-wideK512-K1344-tail-fp16"),
    # int8 wide tiles split over K
    pytest.param(2, 2048, 64, 4, 2, 8, 64, 64, True, BF16, Cfg(1, 32, 512, SPLIT_K=2), id="int8-wideK512-split2"),
    # int4 split over K (float32 partials) across a K tail, zero points: the folded step's words per slice
    pytest.param(2, 1344, 64, 4, 2, 4, 32, 32, True, BF16, Cfg(1, 32, 128, SPLIT_K=4), id="int4-gs32-K1344-split4"),
    # int4 rows of 50 bytes are not 32-bit aligned: the folded step (32-bit words) gives way to the tile form
    pytest.param(2, 100, 64, 4, 2, 4, -1, -1, True, BF16, Cfg(1, 32, 64), id="int4-channelwise-K100-unaligned-rows"),
]


@pytest.fixture(params=["fold", "tile"])
def pair_step_math(request):
    """Both ways the per-pair kernel multiplies a K step (KernelOptions.pair_step_math)."""
    return KernelOptions(pair_step_math=request.param)


@pytest.mark.parametrize("M,H,inter,E,top_k,bits,gs1,gs2,zp,dtype,config", PER_PAIR_CASES)
def test_per_pair_kernel_matches_reference(M, H, inter, E, top_k, bits, gs1, gs2, zp, dtype, config, pair_step_math):
    # BLOCK_SIZE_M=1 needs no alignment at all: a failing align_fn proves it is never called
    def no_align(*args, **kwargs):
        raise AssertionError("per-pair GEMMs must not align")

    p = make_moe_problem(
        M=M, H=H, inter=inter, E=E, top_k=top_k, bits=bits, gs1=gs1, gs2=gs2, zp=zp, dtype=dtype, seed=20
    )
    out = torch.full((M, H), float("nan"), dtype=dtype)
    got, ref = run_both(p, use_td=False, configs=config, align_fn=no_align, out=out, options=pair_step_math)
    assert_close_scaled(got, ref, dtype, "per pair")


@pytest.mark.parametrize(
    "cfg1,cfg2",
    [
        # split-K partials of both GEMMs (summed by the activation and the top-k sum kernels), K tail
        pytest.param(Cfg(16, 32, 64, SPLIT_K=2), Cfg(16, 32, 32, SPLIT_K=4), id="dot-split2/4"),
        # per-pair GEMM1, tl.dot GEMM2: one alignment, for GEMM2 only
        pytest.param(Cfg(1, 32, 64), Cfg(16, 32, 64), id="pair-then-dot"),
    ],
)
def test_split_k_and_mixed_forms_match_reference(cfg1, cfg2):
    calls = []

    def align(topk_ids, block_size, num_experts, expert_map=None):
        calls.append(block_size)
        return moe_align_block_size_torch(topk_ids, block_size, num_experts, expert_map)

    p = make_moe_problem(M=5, H=160, inter=96, E=4, top_k=2, bits=4, gs1=32, gs2=32, zp=True, seed=21)
    out, ref = run_both(p, use_td=False, configs=(cfg1, cfg2), align_fn=align)
    assert_close_scaled(out, ref, BF16, "split-K / mixed")
    assert calls == sorted({c.BLOCK_SIZE_M for c in (cfg1, cfg2)} - {1})


@pytest.mark.parametrize("use_td", [pytest.param(False, id="ptr"), pytest.param(True, id="td")])
def test_per_pair_expert_map_and_td(use_td, td_decisions, pair_step_math):
    # per pair, the expert_map lookup happens in the kernel: non-local pairs write zeros
    p = make_moe_problem(M=4, H=64, inter=32, E=4, top_k=3, bits=4, gs1=32, zp=True, num_global_experts=8, seed=22)
    expert_map = torch.full((8,), -1, dtype=torch.int64)
    expert_map[torch.tensor([0, 2, 5, 7])] = torch.arange(4)
    assert (expert_map[p.topk_ids.long()] == -1).any() and (expert_map[p.topk_ids.long()] >= 0).any()
    out, ref = run_both(
        p,
        use_td=use_td,
        expert_map=expert_map,
        configs=Cfg(1, 32, 32),
        reference_kwargs=dict(expert_map=expert_map),
        options=pair_step_math,
    )
    assert_close_scaled(out, ref, BF16, "per-pair expert_map")
    # GEMM1's A has M=4 rows and GEMM2's 12: both may take TD for B; a per-pair GEMM never gathers A
    assert [(d.use_td_b, d.use_gather) for d in td_decisions] == [(use_td, False)] * 2


@pytest.mark.parametrize(
    "bits,zp,gs,K,bk,dtype",
    [
        pytest.param(4, True, 32, 96, 64, BF16, id="int4-gs32-K96-tail-bf16"),
        pytest.param(4, True, 64, 192, 128, FP16, id="int4-gs64-K192-tail-fp16-magic"),
        pytest.param(4, False, 128, 256, 256, FP16, id="int4-gs128-2groups-fp16-magic"),
        pytest.param(4, True, -1, 96, 64, BF16, id="int4-channelwise-K96"),
        pytest.param(8, True, 32, 96, 64, FP16, id="int8-gs32-fp16-magic"),
        pytest.param(8, False, -1, 64, 32, BF16, id="int8-channelwise"),
    ],
)
@pytest.mark.parametrize(
    "bm,step_math",
    [
        pytest.param(1, "fold", id="pair-fold"),
        pytest.param(1, "tile", id="pair-tile"),
        pytest.param(16, "interleave", id="dot-interleave"),
        pytest.param(16, "split", id="dot-split"),
    ],
)
def test_one_hot_probe_scale_vectors_every_group_size(bits, zp, gs, K, bk, dtype, bm, step_math):
    # x = eye(K): output row k is column k of dequant(W_e) exactly, so each group's scale/zero
    # vector must land on its own K columns, for groups smaller, equal and larger than the tile
    E, N = 2, 32
    options = KernelOptions(pair_step_math=step_math) if bm == 1 else KernelOptions(dot_nibbles=step_math)
    kw = quantized_experts(E, N, K, bits, gs, zp, dtype, torch.Generator().manual_seed(23))
    ids = torch.full((K, 1), 1, dtype=torch.int32)
    c = torch.full((K, N), float("nan"), dtype=dtype)
    aligned = moe_align_block_size_torch(ids, bm, E) if bm > 1 else (None, None, None)
    invoke_wna16_gemm(
        torch.eye(K, dtype=dtype), kw.qweight, kw.scales, kw.qzeros, c, None, *aligned,
        bits=bits, top_k=1, mul_routed_weight=False, config=Cfg(bm, 32, bk), td=POINTERS, topk_ids=ids.reshape(-1),
        options=options,
    )  # fmt: skip
    want = dequantize_ref(kw.qweight, kw.scales, kw.qzeros, bits)[1].to(dtype).T
    assert torch.equal(c, want), (c.float() - want.float()).abs().max()


@pytest.mark.parametrize(
    "zp,gs,K,bk,dtype",
    [
        pytest.param(True, 32, 320, 128, BF16, id="gs32-K320-tail64-bk128-bf16"),
        pytest.param(False, 64, 192, 128, FP16, id="gs64-K192-tail-fp16"),
        pytest.param(True, 128, 256, 256, FP16, id="gs128-2groups-bk256-fp16"),
        pytest.param(True, -1, 384, 256, BF16, id="channelwise-K384-tail128"),
    ],
)
def test_word_nibbles_one_hot_probe(zp, gs, K, bk, dtype):
    """dot_nibbles="words": x = eye(K) reads back every column of dequant(W_e) exactly, so each of
    the eight (word, nibble) tiles must land on its own k = 8i + 4h + s, with its group's scale."""
    E, N = 2, 32
    kw = quantized_experts(E, N, K, 4, gs, zp, dtype, torch.Generator().manual_seed(29))
    assert configs._use_word_nibbles(4, Cfg(16, 32, bk), K, fused_moe._rows_on_words(kw.qweight), False)
    ids = torch.full((K, 1), 1, dtype=torch.int32)
    c = torch.full((K, N), float("nan"), dtype=dtype)
    invoke_wna16_gemm(
        torch.eye(K, dtype=dtype), kw.qweight, kw.scales, kw.qzeros, c, None, *moe_align_block_size_torch(ids, 16, E),
        bits=4, top_k=1, mul_routed_weight=False, config=Cfg(16, 32, bk), td=POINTERS, options=WORDS,
    )  # fmt: skip
    want = dequantize_ref(kw.qweight, kw.scales, kw.qzeros, 4)[1].to(dtype).T
    assert torch.equal(c, want), (c.float() - want.float()).abs().max()


@pytest.mark.parametrize(
    "H,gs,dtype",
    [
        pytest.param(1344, 32, BF16, id="K1344-gs32"),  # a 64-wide K tail under BLOCK_SIZE_K=128
        pytest.param(1408, 128, BF16, id="gs128"),  # one group per 128-wide tile
        pytest.param(1344, -1, FP16, id="channelwise-K1344-fp16"),  # fp16 magic 1024, a tail
    ],
)
def test_word_nibbles_whole_moe_matches_reference(H, gs, dtype):
    """Both GEMMs in the words form, with zero points."""
    p = make_moe_problem(M=3, H=H, inter=128, E=4, top_k=2, bits=4, gs1=gs, gs2=gs, zp=True, dtype=dtype, seed=31)
    out, ref = run_both(p, configs=Cfg(16, 32, 128), use_td=False, options=WORDS)
    assert_close_scaled(out, ref, dtype, f"words form, K={H}, gs{gs}")


def test_word_nibbles_only_where_the_tile_takes_them():
    use = configs._use_word_nibbles  # (bits, config, K, rows_on_words, use_td_b)
    assert use(4, Cfg(16, 32, 128), 128, True, False)
    assert not use(8, Cfg(16, 32, 128), 128, True, False)  # int8: no nibbles
    assert not use(4, Cfg(16, 32, 64), 128, True, False)  # dots of K/8 = 8 < 16
    assert not use(4, Cfg(16, 32, 128), 124, True, False)  # rows end mid-word
    assert not use(4, Cfg(16, 32, 128), 128, True, True)  # B by descriptor
    assert not use(4, Cfg(16, 32, 128), 128, False, False)  # rows off 32-bit words
    # the tensor's own test: a row start one byte past a word
    assert fused_moe._rows_on_words(torch.zeros(2, 32, 64, dtype=torch.uint8))
    assert not fused_moe._rows_on_words(torch.zeros(2, 32, 65, dtype=torch.uint8)[..., 1:])
    # tiles whose A or accumulator passes 32 elements per lane: the eight K/8 dots spill
    assert use(4, Cfg(16, 128, 256), 256, True, False)
    assert not use(4, Cfg(32, 128, 256), 256, True, False)  # A: 32 x 256 over 128 lanes
    assert not use(4, Cfg(32, 256, 128), 256, True, False)  # accumulator: 32 x 256
    assert use(4, Cfg(32, 128, 256, num_warps=8), 256, True, False)  # 256 lanes


@pytest.mark.parametrize(
    "nibbles,bits,cfg,td,want",
    [
        pytest.param("auto", 4, Cfg(16, 128, 256), POINTERS, "words", id="auto-wide-tile-words"),
        pytest.param("auto", 4, Cfg(16, 64, 128), POINTERS, "words", id="auto-128-tile-words"),
        pytest.param("auto", 4, Cfg(32, 64, 64), POINTERS, "interleave", id="auto-64-tile-interleave"),
        pytest.param("auto", 4, Cfg(32, 128, 256), POINTERS, "split", id="auto-spilling-tile-split"),
        pytest.param("auto", 4, Cfg(16, 128, 256), TDDecision(True, False, "test"), "split", id="auto-td-split"),
        pytest.param("auto", 8, Cfg(16, 128, 256), POINTERS, "interleave", id="auto-int8-plain"),
        pytest.param("words", 4, Cfg(16, 64, 64), POINTERS, "split", id="words-narrow-tile-split"),
        pytest.param("words", 4, Cfg(16, 64, 256), POINTERS, "words", id="words-forced"),
        pytest.param("split", 4, Cfg(16, 64, 16), POINTERS, "interleave", id="split-needs-k32"),
        pytest.param("interleave", 4, Cfg(16, 128, 256), POINTERS, "interleave", id="interleave-forced"),
        # a tuned entry's form, under auto only; a forced form (benchmarks, tests) wins over it
        pytest.param("auto", 4, Cfg(16, 128, 256, nibbles="split"), POINTERS, "split", id="tuned-split"),
        pytest.param("auto", 4, Cfg(32, 128, 256, nibbles="words"), POINTERS, "split", id="tuned-words-spills"),
        pytest.param("words", 4, Cfg(16, 128, 256, nibbles="split"), POINTERS, "words", id="forced-over-tuned"),
        pytest.param("auto", 8, Cfg(16, 128, 256, nibbles="split"), POINTERS, "interleave", id="tuned-int8-plain"),
    ],
)
def test_dot_form_policy(nibbles, bits, cfg, td, want):
    assert configs.dot_form(bits, cfg, 256, True, td.use_td_b, nibbles) == want


# The swapped tile (TritonMoEConfig.swap_ab, KernelOptions.swap_ab): C.T = dequant(B) @ A.T, transposed back
# before the routed weight and the store. (M, H, inter, E, top_k, bits, gs1, gs2, zp, dtype, config, options)
SWAP = KernelOptions(swap_ab=True)
# fmt: off
SWAP_CASES = [
    # forced by the options on an unswapped config; BLOCK_K 128: "auto" gives the words form, and split
    pytest.param(5, 256, 64, 4, 2, 4, 64, 64, True, BF16, Cfg(16, 64, 128), SWAP, id="int4-asym-gs64-words"),
    pytest.param(5, 256, 64, 4, 2, 4, 64, 64, True, FP16, Cfg(16, 64, 128),
                 KernelOptions(swap_ab=True, dot_nibbles="split"), id="int4-asym-gs64-split-fp16"),
    # K=1344 at gs32 (a 64-wide K tail on GEMM1), the interleaved form
    pytest.param(3, 1344, 32, 4, 2, 4, 32, 32, True, BF16, Cfg(16, 32, 128),
                 KernelOptions(swap_ab=True, dot_nibbles="interleave"), id="int4-asym-gs32-K1344-tail-interleave"),
    # the config's own opinion; int8 channel-wise with zero points, GEMM2's K tail (I=96), fp16
    pytest.param(4, 128, 96, 4, 2, 8, -1, -1, True, FP16, Cfg(16, 32, 64, swap_ab=True), KernelOptions(),
                 id="int8-asym-channelwise-K96-fp16-config"),
    # 32 and 64 token rows (the MMA's N), N tails: GEMM1 N=352 under BLOCK_N 64, 8 warps
    pytest.param(40, 96, 176, 2, 2, 4, 32, 16, False, FP16, Cfg(32, 64, 32, GROUP_SIZE_M=8), SWAP,
                 id="int4-sym-BM32-N352-fp16"),
    pytest.param(70, 64, 128, 2, 2, 4, 32, 32, True, BF16, Cfg(64, 128, 64, GROUP_SIZE_M=8, num_warps=8), SWAP,
                 id="int4-asym-BM64-BN128-w8"),
    # prefill tiles (bench/heuristic_tables.py --tile candidates): 256 token rows (wgmma's widest N), and 256 weight
    # rows over two warpgroups; GEMM2's N=160 tail under BLOCK_N 256
    pytest.param(300, 160, 128, 2, 2, 4, 32, 64, True, BF16, Cfg(256, 128, 64, GROUP_SIZE_M=8, num_warps=8), SWAP,
                 id="int4-asym-BM256-w8"),
    pytest.param(150, 160, 192, 2, 2, 4, 32, 64, False, BF16, Cfg(128, 256, 64, GROUP_SIZE_M=8, num_warps=8), SWAP,
                 id="int4-sym-BM128-BN256-w8"),
    # split K: each slice's float32 partial transposed back
    pytest.param(5, 256, 64, 4, 2, 4, 64, 32, False, BF16, Cfg(16, 64, 64, SPLIT_K=2), SWAP, id="int4-splitk2"),
    # top_k=1 (GEMM2 writes the output rows directly)
    pytest.param(6, 256, 64, 4, 1, 4, 128, 32, False, BF16, Cfg(16, 32, 64), SWAP, id="int4-topk1"),
]
# fmt: on


@pytest.mark.parametrize("M,H,inter,E,top_k,bits,gs1,gs2,zp,dtype,config,options", SWAP_CASES)
def test_swapped_tile_matches_reference(M, H, inter, E, top_k, bits, gs1, gs2, zp, dtype, config, options):
    p = make_moe_problem(M=M, H=H, inter=inter, E=E, top_k=top_k, bits=bits, gs1=gs1, gs2=gs2, zp=zp, dtype=dtype,
                         seed=300 + M + H)  # fmt: skip
    assert configs.swap_form(config, options).swap_ab
    out, ref = run_both(p, use_td=False, configs=config, options=options)
    assert_close_scaled(out, ref, dtype, "swapped tile")


@pytest.mark.parametrize("M,rows,swapped", [(300, 256, True), (140, 128, False)])
def test_default_prefill_tiles_match_reference(M, rows, swapped):
    """default_config's prefill tiles as sm90 runs them: 2 experts, top 2, so every expert gets all M pairs: 256 rows swapped from a mean of 256, 128 plain from 128 (configs.block_m_rule, swap_takes_wgmma),
    with zero points, group 32 and GEMM2's K tail (I=96)."""
    p = make_moe_problem(M=M, H=128, inter=96, E=2, top_k=2, bits=4, gs1=32, gs2=32, zp=True, seed=500 + M)
    # as sm90 runs them (configs.prefill_tiles_apply; the interpreter's own default keeps 64 rows)
    cfgs = [configs.default_config(M, 2, n, k, 2, 32, 4, prefill_tiles=True) for n, k in ((2 * 96, 128), (128, 96))]
    for cfg in cfgs:
        assert cfg.BLOCK_SIZE_M == rows and configs.swap_form(cfg, KernelOptions()).swap_ab == swapped
    out, ref = run_both(p, use_td=False, configs=tuple(cfgs))
    assert_close_scaled(out, ref, BF16, f"default {rows}-row prefill tile")


def test_swapped_tile_on_the_td_path_with_a_gather(td_decisions):
    p = make_moe_problem(M=9, H=128, inter=64, E=4, top_k=2, bits=4, gs1=32, gs2=32, zp=True, seed=31)
    out, ref = run_both(p, use_td=True, configs=Cfg(16, 64, 64), options=SWAP)
    assert_close_scaled(out, ref, BF16, "swapped tile, TD")
    assert any(d.use_td_b and d.use_gather for d in td_decisions)


def test_swapped_tile_is_a_transpose_not_another_product():
    """One GEMM of one expert, checked element by element against dequant(B) @ A.T's transpose: a swap
    that dropped the final transpose would write C.T into C (the shapes here are not square)."""
    p = make_moe_problem(M=3, H=64, inter=48, E=1, top_k=1, bits=4, gs1=32, gs2=16, seed=41)
    sorted_ids, expert_ids, npp = moe_align_block_size_torch(p.topk_ids, 16, 1)
    c = torch.full((3, 96), float("nan"), dtype=BF16)
    invoke_wna16_gemm(p.x, p.w13.qweight, p.w13.scales, None, c, None, sorted_ids, expert_ids, npp, bits=4, top_k=1,
                      mul_routed_weight=False, config=Cfg(16, 32, 64, swap_ab=True), td=POINTERS)  # fmt: skip
    w = dequantize_ref(p.w13.qweight, p.w13.scales, None, 4)[0]  # (96, 64)
    assert_close_scaled(c, (p.x.float() @ w.float().T).to(BF16), BF16, "one expert's GEMM1, swapped")


def test_swap_policy():
    swap = configs.swap_form
    assert swap(Cfg(16, 64, 128), KernelOptions()).swap_ab  # the rule: 64 weight rows, wgmma's M (swap_takes_wgmma)
    assert swap(Cfg(16, 32, 128), KernelOptions()) == Cfg(16, 32, 128)  # 32 weight rows: the plain tile won
    assert not swap(Cfg(16, 64, 128), KernelOptions(swap_ab=False)).swap_ab
    assert swap(Cfg(16, 32, 128, swap_ab=True), KernelOptions()).swap_ab  # a tuned opinion beyond the rule
    assert not swap(Cfg(16, 64, 128, swap_ab=True), KernelOptions(swap_ab=False)).swap_ab
    assert swap(Cfg(32, 64, 64), SWAP).swap_ab
    assert not swap(Cfg(1, 64, 128), SWAP).swap_ab  # per pair: no tl.dot
    assert not swap(Cfg(8, 32, 64), SWAP).swap_ab  # 8 token rows: below the dot's 16
    with pytest.raises(ValueError, match="swap_ab=True needs BLOCK_SIZE_M >= 16"):
        Cfg(8, 32, 64, swap_ab=True)
    with pytest.raises(ValueError, match="swap_ab=1 must be True or False"):
        Cfg(16, 32, 64, swap_ab=1)
    with pytest.raises(ValueError, match="swap_ab='yes' must be None, True or False"):
        KernelOptions(swap_ab="yes")
    # the dot form is chosen as for the plain tile (each form's dots swap alike)
    for form in ("auto", "words", "split", "interleave"):
        plain = configs.dot_form(4, Cfg(16, 64, 256), 256, True, False, form)
        assert configs.dot_form(4, Cfg(16, 64, 256, swap_ab=True), 256, True, False, form) == plain
    # the JSON entry names it only when set, and reads back
    assert "swap_ab" not in Cfg(16, 64, 128).to_dict()
    entry = Cfg(16, 64, 128, swap_ab=True).to_dict()
    assert entry["swap_ab"] is True and Cfg(**entry) == Cfg(16, 64, 128, swap_ab=True)


# GEMM1 with the gated activation in its epilogue (TritonMoEConfig.fuse_act, KernelOptions.triton_fuse_act): one
# program reads gate rows n and up rows I + n against one A tile. (M, H, inter, E, top_k, bits, gs1, gs2, zp, dtype,
# config, options, activation)
FUSE = KernelOptions(triton_fuse_act=True)
# fmt: off
FUSED_CASES = [
    # decode, per pair: the folded int4 step and the tile step (K tail H=320 under BLOCK_K 128), int8, gelu
    pytest.param(1, 320, 96, 4, 2, 4, 32, 32, True, BF16, Cfg(1, 32, 128), FUSE, "silu", id="pair-fold-int4-asym"),
    pytest.param(2, 320, 96, 4, 2, 4, 32, 32, False, FP16, Cfg(1, 64, 128),
                 KernelOptions(triton_fuse_act=True, pair_step_math="tile"), "gelu", id="pair-tile-int4-gelu-fp16"),
    pytest.param(1, 256, 64, 8, 2, 8, 64, 64, True, BF16, Cfg(1, 32, 512), FUSE, "silu", id="pair-int8-wideK"),
    # tl.dot: words (BLOCK_K 128), split, interleave; N = I = 176 not a multiple of BLOCK_N 64 (wrapped rows)
    pytest.param(5, 256, 176, 4, 2, 4, 64, 16, True, BF16, Cfg(16, 64, 128), FUSE, "silu", id="dot-words-I176"),
    pytest.param(5, 256, 64, 4, 2, 4, 64, 64, True, FP16, Cfg(16, 32, 128),
                 KernelOptions(triton_fuse_act=True, dot_nibbles="split"), "gelu", id="dot-split-gelu-fp16"),
    pytest.param(3, 1344, 32, 4, 2, 4, 32, 32, True, BF16, Cfg(16, 32, 128),
                 KernelOptions(triton_fuse_act=True, dot_nibbles="interleave"), "silu", id="dot-interleave-K1344"),
    # channel-wise int8 with zero points; the config's own opinion (no option)
    pytest.param(4, 128, 96, 4, 2, 8, -1, -1, True, FP16, Cfg(16, 32, 64, fuse_act=True), KernelOptions(), "silu",
                 id="dot-int8-channelwise-config"),
    # swapped tile, 32 token rows
    pytest.param(40, 96, 176, 2, 2, 4, 32, 16, False, FP16, Cfg(32, 64, 32, GROUP_SIZE_M=8),
                 KernelOptions(triton_fuse_act=True, swap_ab=True), "silu", id="dot-swapped-BM32"),
    # top_k 1: GEMM2 writes the output rows directly
    pytest.param(6, 256, 64, 4, 1, 4, 128, 32, False, BF16, Cfg(16, 32, 64), FUSE, "silu", id="dot-topk1"),
]
# fmt: on


@pytest.mark.parametrize("M,H,inter,E,top_k,bits,gs1,gs2,zp,dtype,config,options,activation", FUSED_CASES)
def test_fused_activation_matches_reference_and_the_unfused_layer(
    M, H, inter, E, top_k, bits, gs1, gs2, zp, dtype, config, options, activation
):
    p = make_moe_problem(M=M, H=H, inter=inter, E=E, top_k=top_k, bits=bits, gs1=gs1, gs2=gs2, zp=zp, dtype=dtype,
                         seed=700 + M + H + inter)  # fmt: skip
    assert configs.fuse_form(config, options).fuse_act
    out, ref = run_both(p, use_td=False, configs=config, options=options, activation=activation,
                        reference_kwargs=dict(activation=activation))  # fmt: skip
    assert_close_scaled(out, ref, dtype, f"fused {activation}")
    # the same tiles unfused, then the activation kernel: the same roundings in the same order, bit for bit
    unfused = fused_moe_wna16_triton(*p.args(), **p.kwargs(), use_td=False, configs=replace(config, fuse_act=False),
                                     options=replace(options, triton_fuse_act=False), activation=activation)  # fmt: skip
    assert torch.equal(out, unfused), (out.float() - unfused.float()).abs().max()


@pytest.mark.parametrize("bm", [1, 16])
def test_fused_activation_with_router_weight_on_input_td_and_ep(td_decisions, bm):
    """The routed weight scales both halves before the activation (apply_router_weight_on_input, top_k 1); the
    B descriptor spans the 2I rows; experts of another rank write zeros."""
    p = make_moe_problem(M=6, H=128, inter=64, E=4, top_k=1, bits=4, gs1=32, gs2=32, zp=True, seed=77,
                         num_global_experts=8)  # fmt: skip
    p.topk_weights = torch.rand(p.topk_weights.shape, generator=torch.Generator().manual_seed(7)) + 0.25
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)
    kw = dict(apply_router_weight_on_input=True, expert_map=emap)
    out, ref = run_both(p, use_td=True, configs=Cfg(bm, 32, 64), options=FUSE, global_num_experts=8, **kw,
                        reference_kwargs=kw)  # fmt: skip
    assert_close_scaled(out, ref, BF16, "fused, weight on input, TD, EP")
    assert any(d.use_td_b for d in td_decisions)


def test_one_fused_gemm_is_the_activation_of_the_unfused_one():
    """invoke_wna16_gemm with an activation writes act(g[:, :I]) * g[:, I:] of the plain GEMM's output g, I columns
    wide: a kernel that paired the wrong rows (gate n with up n + 1, or up from another expert) fails here."""
    from vllm_wna16_plugin.activation import gated_activation

    p = make_moe_problem(M=3, H=64, inter=48, E=1, top_k=1, bits=4, gs1=32, gs2=16, zp=True, seed=43)
    sorted_ids, expert_ids, npp = moe_align_block_size_torch(p.topk_ids, 16, 1)
    args = (p.x, p.w13.qweight, p.w13.scales, p.w13.qzeros)
    g = torch.full((3, 96), float("nan"), dtype=BF16)
    invoke_wna16_gemm(*args, g, None, sorted_ids, expert_ids, npp, bits=4, top_k=1, mul_routed_weight=False,
                      config=Cfg(16, 32, 64), td=POINTERS)  # fmt: skip
    c = torch.full((3, 48), float("nan"), dtype=BF16)
    invoke_wna16_gemm(*args, c, None, sorted_ids, expert_ids, npp, bits=4, top_k=1, mul_routed_weight=False,
                      config=Cfg(16, 32, 64), td=POINTERS, activation="silu")  # fmt: skip
    assert torch.equal(c, gated_activation(g, "silu"))
    with pytest.raises(ValueError, match="c has 96 columns, the GEMM writes N=48"):
        invoke_wna16_gemm(*args, g, None, sorted_ids, expert_ids, npp, bits=4, top_k=1, mul_routed_weight=False,
                          config=Cfg(16, 32, 64), td=POINTERS, activation="silu")  # fmt: skip
    with pytest.raises(ValueError, match="SPLIT_K=1"):
        invoke_wna16_gemm(*args, c, None, sorted_ids, expert_ids, npp, bits=4, top_k=1, mul_routed_weight=False,
                          config=Cfg(16, 32, 32, SPLIT_K=2), td=POINTERS, activation="silu")  # fmt: skip


def test_fuse_policy():
    fuse = configs.fuse_form
    assert fuse(Cfg(16, 64, 128), KernelOptions()) == Cfg(16, 64, 128)  # the config's own opinion: unfused
    assert fuse(Cfg(16, 64, 128, fuse_act=True), KernelOptions()).fuse_act
    assert not fuse(Cfg(16, 64, 128, fuse_act=True), KernelOptions(triton_fuse_act=False)).fuse_act
    assert fuse(Cfg(1, 64, 128), FUSE).fuse_act  # per pair too
    assert not fuse(Cfg(16, 64, 64, SPLIT_K=2), FUSE).fuse_act  # split partials: the activation kernel sums them
    with pytest.raises(ValueError, match="fuse_act=True needs SPLIT_K=1"):
        Cfg(16, 64, 64, SPLIT_K=2, fuse_act=True)
    with pytest.raises(ValueError, match="fuse_act=1 must be True or False"):
        Cfg(16, 32, 64, fuse_act=1)
    with pytest.raises(ValueError, match="triton_fuse_act='on' must be None, True or False"):
        KernelOptions(triton_fuse_act="on")
    assert "fuse_act" not in Cfg(16, 64, 128).to_dict()
    entry = Cfg(16, 64, 128, fuse_act=True).to_dict()
    assert entry["fuse_act"] is True and Cfg(**entry) == Cfg(16, 64, 128, fuse_act=True)


def test_pair_step_policy():
    assert configs.pair_step(4, True, "fold") == "fold"
    assert configs.pair_step(4, False, "fold") == "tile"  # the folded step reads int4 rows as words
    assert configs.pair_step(8, False, "fold") == "fold"
    assert configs.pair_step(4, True, "tile") == "tile"


# ---------------------------------------------------------------- activation and top-k sum kernels


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")])
@pytest.mark.parametrize("split", [pytest.param(1, id="plain"), pytest.param(3, id="partials3")])
def test_gated_activation_kernel_matches_torch(activation, dtype, split):
    from vllm_wna16_plugin.activation import gated_activation
    from vllm_wna16_plugin.kernels.triton.activation import gated_activation_triton

    gen = torch.Generator().manual_seed(30)
    T, inter = 5, 1100  # I > the 1024-column block: two programs per row, a column tail
    if split == 1:
        h = (3 * torch.randn(T, 2 * inter, generator=gen)).to(dtype)
        want = gated_activation(h, activation)
    else:
        h = 3 * torch.randn(split, T, 2 * inter, generator=gen)
        want = gated_activation(h.sum(0).to(dtype), activation)  # partials summed, rounded, then act
    out = torch.full((T, inter), float("nan"), dtype=dtype)
    got = gated_activation_triton(h, activation, out=out)
    assert got is out
    assert_close_scaled(out, want, dtype, f"{activation} split={split}")
    # float32 math then one rounding: within one unit in the last place of torch's result
    # away from gelu's far negative tail, where 1 + erf(x) cancels in any float32 erf (1e-4 of the max)
    ulp = 2**-7 if dtype == BF16 else 2**-10
    err = (out.float() - want.float()).abs()
    assert (err <= ulp * want.float().abs() + 1e-4 * want.float().abs().max()).all(), err.max()


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")])
@pytest.mark.parametrize("split", [pytest.param(1, id="plain"), pytest.param(2, id="partials2")])
def test_moe_sum_kernel_matches_torch(dtype, split):
    from vllm_wna16_plugin.kernels.triton.activation import moe_sum_triton

    gen = torch.Generator().manual_seed(31)
    T, top_k, H = 3, 8, 1300
    if split == 1:
        y = torch.randn(T * top_k, H, generator=gen).to(dtype)
        per_pair = y.float()
    else:
        y = torch.randn(split, T * top_k, H, generator=gen)
        per_pair = y.sum(0).to(dtype).float()  # each pair rounded once, as an unsplit GEMM2 stores it
    want = per_pair.view(T, top_k, H).sum(1).to(dtype)
    out = torch.full((T, H), float("nan"), dtype=dtype)
    moe_sum_triton(y, out, top_k)
    torch.testing.assert_close(out, want, atol=0, rtol=2**-7 if dtype == BF16 else 2**-10)


def test_activation_and_sum_errors():
    from vllm_wna16_plugin.kernels.triton.activation import gated_activation_triton, moe_sum_triton

    with pytest.raises(ValueError, match=r"activation='relu' is not supported"):
        gated_activation_triton(torch.zeros(2, 8, dtype=BF16), "relu")
    with pytest.raises(ValueError, match=r"need out= or dtype="):
        gated_activation_triton(torch.zeros(2, 2, 8), "silu")
    with pytest.raises(ValueError, match=r"must be float32"):
        moe_sum_triton(torch.zeros(2, 4, 8, dtype=BF16), torch.empty(2, 8, dtype=BF16), 2)


def test_launch_plan_per_layer_call(monkeypatch):
    # the GPU work of one call: GEMMs, one activation, one sum, and alignments only for BLOCK_SIZE_M > 1
    launches = []
    for name in ("invoke_wna16_gemm", "gated_activation_triton", "moe_sum_triton"):
        real = getattr(fused_moe, name)
        monkeypatch.setattr(fused_moe, name, lambda *a, _r=real, _n=name, **k: launches.append(_n) or _r(*a, **k))

    def align(*args, **kwargs):
        launches.append("align")
        return moe_align_block_size_torch(*args, **kwargs)

    p = make_moe_problem(M=1, H=64, inter=32, E=8, top_k=2, bits=4, gs1=32, seed=32)
    fused_moe_wna16_triton(*p.args(), **p.kwargs(), align_fn=align)  # default configs: per pair at M=1
    assert launches == ["invoke_wna16_gemm", "gated_activation_triton", "invoke_wna16_gemm", "moe_sum_triton"]
    launches.clear()
    fused_moe_wna16_triton(*p.args(), **p.kwargs(), align_fn=align, configs=Cfg(16, 32, 32))
    assert launches == ["align", "invoke_wna16_gemm", "gated_activation_triton", "invoke_wna16_gemm", "moe_sum_triton"]


# ---------------------------------------------------------------- errors (messages are API)


def test_errors_name_the_field():
    p = make_moe_problem(M=2, H=64, inter=32, E=4, top_k=2, bits=4, gs1=32)
    with pytest.raises(ValueError, match=r"bits=3 is not supported"):
        fused_moe_wna16_triton(*p.args(), bits=3)
    with pytest.raises(ValueError, match=r"activation='relu' is not supported"):
        fused_moe_wna16_triton(*p.args(), bits=4, activation="relu")
    with pytest.raises(
        ValueError,
        match=r"w13_qweight has 32 bytes per row but x's H=64 int8 values need 64 \(it holds int4 values: bits=4\?\)",
    ):
        fused_moe_wna16_triton(*p.args(), bits=8)
    with pytest.raises(ValueError, match=r"out must be \(M=2, H=64\)"):
        fused_moe_wna16_triton(*p.args(), bits=4, out=torch.empty(2, 63, dtype=BF16))
    with pytest.raises(ValueError, match=r"BLOCK_SIZE_K=64 and group_size=48"):
        Cfg(16, 32, 64).check_shape(K=96, group_size=48)


@pytest.mark.parametrize(
    "field,kwargs,match",
    [
        pytest.param(
            "BLOCK_SIZE_K",
            dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=48),
            "power of two >= 16",
            id="bk-not-pow2",
        ),
        pytest.param(
            "BLOCK_SIZE_K",
            dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=8),
            "power of two >= 16",
            id="bk-too-small",
        ),
        pytest.param(
            "BLOCK_SIZE_M", dict(BLOCK_SIZE_M=12, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32), "power of two", id="bm-not-pow2"
        ),
        pytest.param(
            "num_warps",
            dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, num_warps=3),
            "must be one of",
            id="warps",
        ),
        pytest.param(
            "nibbles", dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, nibbles="auto"), "one of", id="nibbles"
        ),
        pytest.param(
            "maxnreg",
            dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, maxnreg=512),
            r"\[24, 255\]",
            id="maxnreg",
        ),
    ],
)
def test_config_validation(field, kwargs, match):
    with pytest.raises(ValueError, match=f"{field}=.*{match}"):
        Cfg(**kwargs)


# ---------------------------------------------------------------- configs (pure python)


@pytest.mark.parametrize("K,gs", [(2048, 32), (1344, 32), (96, 32), (352, 32), (4096, 128), (768, -1), (1344, -1)])
@pytest.mark.parametrize("M", [1, 16, 256, 8192])
def test_default_config_is_legal_and_k_tail_is_small(K, gs, M):
    # the real crash shapes of vLLM's heuristic (ratio 16 at gs32, K=1344, K=96) get a legal config
    cfg = get_triton_moe_config(M, 128, 1536, K, 8, gs, 4, device_name="NVIDIA H200")
    cfg.check_shape(K, K if gs == -1 else gs)
    bk = cfg.BLOCK_SIZE_K
    assert (-(-K // bk) * bk - K) / K <= 0.125  # at most 1/8 of the K loop is tail
    if M == 1:
        assert cfg.BLOCK_SIZE_M == 1 and cfg.GROUP_SIZE_M == 1  # per pair: no alignment launch


@pytest.mark.parametrize(
    "M,E,N,K,top_k,want",
    [
        # decode, Qwen3-30B-A3B GEMM1: per pair, 128-byte int4 rows, >= 2 programs per SM
        pytest.param(1, 128, 1536, 2048, 8, dict(BLOCK_SIZE_M=1, BLOCK_SIZE_K=256, SPLIT_K=1), id="qwen3-m1"),
        # Mixtral GEMM2 at decode: 2 pairs x 4096/32 columns is short of 264 programs: split K in two
        pytest.param(1, 8, 4096, 14336, 2, dict(BLOCK_SIZE_M=1, BLOCK_SIZE_N=32, SPLIT_K=2), id="mixtral-w2-m1"),
        # M=16 at E=128 top8: pairs share experts, tl.dot tiles of 16 rows
        pytest.param(16, 128, 1536, 2048, 8, dict(BLOCK_SIZE_M=16, BLOCK_SIZE_K=256, num_stages=4), id="qwen3-m16"),
        # 24 tokens per expert (DeepSeek-V2-Lite at M=256): the H200 tuner's 32x64x64 tile at this load
        pytest.param(256, 64, 2816, 2048, 6, dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64), id="dsv2-m256"),
        # 64 tokens per expert (Qwen3-30B-A3B at M=1024): 64-row tiles (block_m_rule), as the tuner's
        pytest.param(1024, 128, 1536, 2048, 8, dict(BLOCK_SIZE_M=64, BLOCK_SIZE_K=64), id="qwen3-m1024"),
        # prefill: 1024 pairs per expert, 256-row tiles (block_m_rule; run swapped: swap_takes_wgmma)
        pytest.param(4096, 8, 4096, 4096, 2, dict(BLOCK_SIZE_M=256, BLOCK_SIZE_N=128, SPLIT_K=1), id="prefill"),
        # 128 pairs per expert (DeepSeek-V3 at TP 4, M=4096): 128-row plain tiles
        pytest.param(4096, 256, 1024, 7168, 8, dict(BLOCK_SIZE_M=128, num_warps=8, num_stages=3), id="prefill-128"),
        # a short grid (16 experts, 160 columns) keeps the 256-row tile as timed: N 128, no split
        pytest.param(
            4096, 16, 160, 5120, 1, dict(BLOCK_SIZE_M=256, BLOCK_SIZE_N=128, SPLIT_K=1), id="prefill-256-short"
        ),
        # without the prefill tiles (a device they were not timed on) the same grid narrows BLOCK_N as before
        pytest.param(4096, 16, 160, 5120, 1, dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=32), id="prefill-64-short"),
    ],
)
def test_default_config_regimes(request, M, E, N, K, top_k, want):
    sm90 = "prefill-64" not in request.node.callspec.id  # as on sm90 (configs.prefill_tiles_apply), but that case
    cfg = default_config(M, E, N, K, top_k, 128, 4, prefill_tiles=sm90)
    assert {k: getattr(cfg, k) for k in want} == want, cfg


def test_default_config_spreads_decode_over_n():
    # decode: few M-blocks, so BLOCK_SIZE_N shrinks (and SPLIT_K grows) toward >= 264 programs
    small = default_config(1, 8, 4096, 4096, 2, 128, 4)
    assert small.BLOCK_SIZE_N == 32 and small.SPLIT_K == 2
    assert default_config(4096, 8, 4096, 4096, 2, 128, 4).BLOCK_SIZE_N == 128


def test_split_k_must_be_a_power_of_two():
    with pytest.raises(ValueError, match=r"SPLIT_K=3 must be a power of two"):
        Cfg(16, 32, 64, SPLIT_K=3)


def test_tuned_json_entry_wins_nearest_m(tmp_path):
    name = config_file_name(8, 256, 512, 32, 4, "NVIDIA H200")
    assert name == "E=8,N=256,K=512,group_size=32,bits=4,device_name=NVIDIA_H200.json"
    (tmp_path / name).write_text(
        '{"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "use_td": true},'
        ' "64": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8}}'
    )
    small = get_triton_moe_config(3, 8, 256, 512, 2, 32, 4, "NVIDIA H200", config_dir=tmp_path)
    big = get_triton_moe_config(100, 8, 256, 512, 2, 32, 4, "NVIDIA H200", config_dir=tmp_path)
    assert (small.BLOCK_SIZE_N, small.use_td) == (64, True)
    assert big.BLOCK_SIZE_M == 64
    other = get_triton_moe_config(3, 8, 256, 512, 2, 32, 4, "NVIDIA B200", config_dir=tmp_path)
    assert other == default_config(3, 8, 256, 512, 2, 32, 4)


def test_bad_tuned_json_raises(tmp_path):
    name = config_file_name(8, 256, 512, 32, 4, "X")
    (tmp_path / name).write_text('{"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 24}}')
    with pytest.raises(ValueError, match="bad tuned config"):
        get_triton_moe_config(1, 8, 256, 512, 2, 32, 4, "X", config_dir=tmp_path)


def test_kernels_import_no_vllm():
    import re
    from pathlib import Path

    root = Path(fused_moe.__file__).parents[1]
    for path in root.rglob("*.py"):
        src = path.read_text()
        assert not re.search(r"^\s*(import vllm\b|from vllm(\.| import))", src, re.M), path


# ---------------------------------------------------------------- GPU code generation, without a GPU

_AOT_SCRIPT = r"""
import os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_wna16_plugin.kernels.triton import fused_moe

sm, bits, td, gather, even_k, pair = (int(v) for v in sys.argv[1:7])
kernel = fused_moe._fused_moe_wna16_pair_kernel if pair else fused_moe._fused_moe_wna16_kernel
K, N, gs, bk = (2048, 1536, 32, 256) if even_k else (1344, 1536, 32, 128)
bk = int(sys.argv[7]) if len(sys.argv) > 7 and int(sys.argv[7]) else bk  # a K tile wider than the default
# the form: per pair 1 = the folded step; tl.dot 1 = split nibbles, 2 = word nibbles; else the module
# default (per pair: KernelOptions().pair_step_math; tl.dot: "auto" gives words on these K tiles of >= 128)
from vllm_wna16_plugin.kernels.options import DEFAULT_OPTIONS
forms = {"split": 1, "words": 2, "auto": 2}
default_form = (DEFAULT_OPTIONS.pair_step_math == "fold") if pair else forms.get(DEFAULT_OPTIONS.dot_nibbles, 0)
form = int(sys.argv[8]) if len(sys.argv) > 8 else int(default_form)
bm, bn, warps = (int(v) for v in sys.argv[9:12]) if len(sys.argv) > 11 else (16, 64, 4)
stages = int(sys.argv[12]) if len(sys.argv) > 12 else 4
fold = bool(form)
ptrs = dict(a_ptr="*bf16", b_ptr="*u8", c_ptr="*bf16", s_ptr="*bf16", z_ptr="*u8", topk_weights_ptr="*fp32",
            sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32", num_tokens_post_padded_ptr="*i32",
            topk_ids_ptr="*i32", expert_map_ptr="*i32", a_perm_ptr="*i32")
consts = dict(stride_ak=1, stride_cn=1, stride_sg=1, stride_zg=1, N=N, K=K, group_size=gs,
              NUM_GROUPS=K // gs, GROUPS=bk // gs, top_k=8, BITS=bits, HAS_ZP=True, MUL_ROUTED_WEIGHT=True,
              EVEN_K=bool(even_k), USE_TD=bool(td), USE_TD_GATHER=bool(gather), SPLIT_K=1, HAS_EXPERT_MAP=False, NUM_STAGES=4,
              compute_type=tl.bfloat16, INTERPRET_BF16=False, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
              GROUP_SIZE_M=1, FOLD_SCALES=fold, REDUCE_EACH_STEP=fold or bk > fused_moe.PAIR_ACC_MAX_K,
              SPLIT_NIBBLES=form == 1, WORD_NIBBLES=form == 2,
              HAS_A_PERM=os.environ.get("AOT_A_PERM") == "1",  # act order: A's columns through a_perm
              SWAP_AB=os.environ.get("AOT_SWAP") == "1",  # the swapped tile (TritonMoEConfig.swap_ab)
              FUSE_ACT=os.environ.get("AOT_FUSE") == "1", ACTIVATION="silu")  # GEMM1 with the activation fused
consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
divisible = ("stride_am", "stride_be", "stride_bn", "stride_cm", "stride_cs", "stride_se", "stride_ze", "stride_zn")
sig, attrs = {}, {}
for i, name in enumerate(kernel.arg_names):
    sig[name] = ptrs.get(name, "constexpr" if name in consts else ("i64" if name.startswith("stride") else "i32"))
    if name in ptrs or name in divisible:
        attrs[(i,)] = [["tt.divisibility", 16]]  # what the JIT infers for 16-divisible launch arguments
src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
compiled = triton.compile(src, target=GPUTarget("cuda", sm, 32), options=dict(num_warps=warps, num_stages=stages))
ptx = compiled.asm["ptx"]
tags = ["SHARED=%d" % compiled.metadata.shared]
if len(sys.argv) > 11:  # local-memory stores and loads (register spills) in the SASS, by Triton's nvdisasm
    import subprocess, tempfile
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"]); f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    tags.append("LOCAL=%d" % len(re.findall(r"\b(?:STL|LDL)\b", sass)))
if "cp.async.bulk.tensor" in ptx: tags.append("TMA")
if "wgmma.mma_async" in ptx: tags.append("WGMMA")  # sm90's warpgroup MMA
if re.search(r"\bmma[.]sync", ptx): tags.append("MMASYNC")
if "gather4" in ptx: tags.append("GATHER4")
if re.search(r"cp[.]async[.]cg[.]shared[.]global[^;]*, 0x10", ptx): tags.append("CPASYNC16")
if "ld.global.v4" in ptx or "CPASYNC16" in tags: tags.append("LDV4")  # 16-byte B loads, direct or async
if re.search(r"mul(?:[.]rn)?[.]bf16", ptx): tags.append("BF16MATH")  # dequant in bf16, no f32 round trip
tags.append("I2F=%d" % len(re.findall(r"cvt[.]rn[.]f32[.][us](?:8|16|32)", ptx)))  # int->float (quarter rate)
# scale/zero loads per thread per K step: 16-bit scalar global loads, counted
b16 = re.findall(r"ld[.]global(?:[.]nc)?(?:[.]L1::evict_[a-z_]+)?[.]b16", ptx)
tags.append("B16LOADS=%d" % len(b16))
print(*tags)
"""


def _compile_for_gpu(*args, a_perm: bool = False, swap: bool = False, fuse: bool = False) -> set[str]:
    """Run _AOT_SCRIPT (sm, bits, td, gather, even_k, pair[, block_k]) and return the PTX's tags;
    a_perm: the act-order variant (HAS_A_PERM); swap: the swapped tile (SWAP_AB); fuse: GEMM1 with the
    activation fused (FUSE_ACT)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(fused_moe.__file__).parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root), "AOT_A_PERM": "1" if a_perm else "0",
           "AOT_SWAP": "1" if swap else "0", "AOT_FUSE": "1" if fuse else "0"}  # fmt: skip
    res = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, *map(str, args)], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    if res.returncode and "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    return set(res.stdout.split())


@pytest.mark.slow
@pytest.mark.parametrize(
    "sm,bits,td,gather,even_k,pair,want",
    [
        # dot path: B by 16-byte cp.async into the pipeline stages, dequant in bf16 math
        pytest.param(90, 4, 0, 0, 1, 0, {"CPASYNC16", "BF16MATH"}, id="sm90-int4-pointer: 16-byte async B loads"),
        pytest.param(90, 4, 0, 0, 0, 0, {"CPASYNC16"}, id="sm90-int4-pointer-K1344-tail"),
        # per-pair GEMV: 128-byte int4 rows as 16-byte vector loads (the folded form is checked below)
        pytest.param(90, 4, 0, 0, 1, 1, {"LDV4", "BF16MATH"}, id="sm90-int4-per-pair-tile: 16-byte vector B loads"),
        pytest.param(90, 4, 0, 0, 0, 1, {"LDV4"}, id="sm90-int4-per-pair-tile-K1344-tail"),
        pytest.param(90, 4, 1, 0, 1, 0, {"TMA"}, id="sm90-int4-td-load"),
        pytest.param(90, 8, 1, 0, 1, 0, {"TMA"}, id="sm90-int8-td-load"),
        pytest.param(90, 4, 1, 0, 1, 1, {"TMA"}, id="sm90-int4-per-pair-td-load"),
        pytest.param(100, 4, 1, 1, 1, 0, {"TMA", "GATHER4"}, id="sm100-int4-td-gather"),
    ],
)
def test_kernel_compiles_for_gpu_targets(sm, bits, td, gather, even_k, pair, want):
    # triton.compile with the wheel's ptxas: the GPU code paths build (TMA on sm90, gather4 on sm100)
    tags = _compile_for_gpu(sm, bits, td, gather, even_k, pair, 0, 0)
    assert want <= tags, tags
    # scales and zeros: a (BLOCK_N, GROUPS) vector per K step, not one load per B element
    # (64 x 256 elements per tile over 128 threads would be 128 scalar loads per thread)
    b16 = int(next(t for t in tags if t.startswith("B16LOADS=")).split("=")[1])
    assert b16 <= 16, tags


@pytest.mark.slow
@pytest.mark.parametrize("even_k", [1, 0])
def test_wide_k_per_pair_kernel_compiles_for_sm90(even_k):
    # BLOCK_SIZE_K = 1024 (512-byte int4 rows per step, reduced every step) still loads B as
    # 16-byte vectors with a (BLOCK_N, GROUPS) scale vector per step
    tags = _compile_for_gpu(90, 4, 0, 0, even_k, 1, 1024, 0)
    assert "LDV4" in tags, tags
    assert int(next(t for t in tags if t.startswith("B16LOADS=")).split("=")[1]) <= 64, tags


@pytest.mark.slow
@pytest.mark.parametrize(
    "bm,bn,form",
    [
        pytest.param(16, 128, 0, id="16x128-interleave"),
        pytest.param(16, 128, 1, id="16x128-split"),
        pytest.param(16, 128, 2, id="16x128-words"),
        pytest.param(32, 64, 0, id="32x64-interleave"),
    ],
)
def test_swapped_tile_runs_on_wgmma_where_the_plain_tile_cannot(bm, bn, form):
    """The point of TritonMoEConfig.swap_ab: with 16-32 token rows the plain tile (tokens as the MMA's M)
    compiles to mma.sync, the swapped one (weights as M, dequantized in registers) to sm90's wgmma; both
    keep the 16-byte async B loads. K=1344 (a tail) as well as K=2048."""
    for even_k in (1, 0):
        plain = _compile_for_gpu(90, 4, 0, 0, even_k, 0, 128, form, bm, bn, 4)
        swapped = _compile_for_gpu(90, 4, 0, 0, even_k, 0, 128, form, bm, bn, 4, swap=True)
        assert "MMASYNC" in plain and "WGMMA" not in plain, plain
        assert "WGMMA" in swapped and "CPASYNC16" in swapped, swapped


@pytest.mark.slow
@pytest.mark.parametrize(
    "pair,td,bk,form,bm,bn,want",
    [
        pytest.param(0, 0, 128, 2, 16, 64, "CPASYNC16", id="dot-words-16x64x128"),
        pytest.param(0, 0, 128, 0, 32, 64, "CPASYNC16", id="dot-interleave-32x64x128"),
        pytest.param(0, 1, 128, 0, 16, 64, "TMA", id="dot-td-16x64x128"),
        pytest.param(1, 0, 256, 1, 1, 32, "LDV4", id="pair-fold-1x32x256"),
        pytest.param(1, 1, 256, 1, 1, 32, "TMA", id="pair-fold-td-1x32x256"),
    ],
)
def test_fused_activation_kernels_compile_for_sm90_without_spills(pair, td, bk, form, bm, bn, want):
    """GEMM1 with the activation fused reads two B tiles per K step (gate and up rows) into two accumulators: on
    sm90 it keeps the plain kernel's B loads (16-byte async / vector, or TMA) and spills no registers at the
    tile sizes the default configs use at decode and small M. K tails too."""
    for even_k in (1, 0):
        tags = _compile_for_gpu(90, 4, td, 0, even_k, pair, bk, form, bm, bn, 4, fuse=True)
        local = int(next(t for t in tags if t.startswith("LOCAL=")).split("=")[1])
        assert want in tags and local <= 4, tags


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bm,swap", [(256, True), (128, False)], ids=["256-swapped", "128-plain"])
def test_prefill_tiles_compile_for_sm90_on_wgmma_without_spills(bm, swap, bits):
    """default_config's prefill tiles on sm90 (configs.block_m_rule with prefill_tiles: 128x128x64 plain, 256x128x64
    swapped, 8 warps, 3 stages), int4 and int8 with zero points at group 32, K tails too: wgmma, no register spill
    worth a load, and shared memory within sm90's 227 KB per block (the 256-row tile takes 104-115 KB)."""
    for even_k in (1, 0):
        tags = _compile_for_gpu(90, bits, 0, 0, even_k, 0, 64, 0, bm, 128, 8, 3, swap=swap)
        local = int(next(t for t in tags if t.startswith("LOCAL=")).split("=")[1])
        shared = int(next(t for t in tags if t.startswith("SHARED=")).split("=")[1])
        assert "WGMMA" in tags and local <= 4 and shared <= 227 * 1024, tags


@pytest.mark.slow
@pytest.mark.parametrize("even_k", [1, 0])
def test_split_nibble_dot_kernel_compiles_for_sm90(even_k):
    # two half-K dots per step (no interleave): still 16-byte async B loads into the pipeline
    tags = _compile_for_gpu(90, 4, 0, 0, even_k, 0, 0, 1)
    assert "CPASYNC16" in tags, tags


@pytest.mark.slow
@pytest.mark.parametrize("even_k", [1, 0])
def test_word_nibble_dot_kernel_compiles_for_sm90(even_k):
    # eight dots of K/8 per step from 32-bit words: still 16-byte async B loads, no int->float
    # converts per weight, dequant in bf16 math
    tags = _compile_for_gpu(90, 4, 0, 0, even_k, 0, 0, 2)
    assert "CPASYNC16" in tags, tags
    assert int(next(t for t in tags if t.startswith("I2F=")).split("=")[1]) == 0, tags
    assert "BF16MATH" in tags, tags


@pytest.mark.slow
@pytest.mark.parametrize(
    "bm,bn,bk,warps",
    [
        pytest.param(16, 128, 256, 4, id="16x128x256"),  # the small-M tile of the tuned entries
        pytest.param(32, 64, 128, 4, id="32x64x128"),
        pytest.param(32, 128, 256, 4, id="32x128x256-spills"),  # past the bound: the control
    ],
)
def test_word_nibble_tiles_within_the_register_bound_do_not_spill(bm, bn, bk, warps):
    # word_tile_fits is a rule fitted to the sm90 SASS; this checks it against ptxas on both sides:
    # a tile it takes compiles without register spills, and the one it refuses does spill
    fits = configs.word_tile_fits(Cfg(bm, bn, bk, num_warps=warps))
    tags = _compile_for_gpu(90, 4, 0, 0, 1, 0, bk, 2, bm, bn, warps)
    local = int(next(t for t in tags if t.startswith("LOCAL=")).split("=")[1])
    assert (local <= 4) == fits, (fits, tags)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("even_k", [1, 0])
def test_folded_per_pair_kernel_compiles_for_sm90_without_int_to_float_converts(bits, even_k):
    # the folded GEMV step turns the weights into float32 by the magic-number OR, not by cvt (a
    # quarter-rate instruction): the few converts left are the zero points, one per (row, group)
    # value a thread holds (64 x 8 over 128 threads at gs32), not its 128+ weights per step
    tags = _compile_for_gpu(90, bits, 0, 0, even_k, 1, 0, 1)
    count = {t.split("=")[0]: int(t.split("=")[1]) for t in tags if "=" in t}
    assert "LDV4" in tags and count["I2F"] <= 8, tags
    assert count["B16LOADS"] <= 16, tags
