"""Act order (GPTQ desc_act, compressed-tensors actorder "group") on the `triton` backend.

The backend sorts each expert's K by its g_idx at prepare (backends.base.sort_act_order) and the
kernel reads GEMM1's A through the column table a_perm; GEMM2 needs no gather (w13's rows are in
w2's sorted K order). Under tensor parallelism a rank's intermediate rows hold partial groups: each
group is padded to whole runs (ActOrderLayout), and the ranks' outputs must sum to the unsharded layer.
Every case is checked against the float reference on the ORIGINAL checkpoint layout with its g_idx
(reference.fused_moe_wna16_ref -> dequantize_ref), an independent path.
Runs under the Triton interpreter (TRITON_INTERPRET=1, set by conftest).
"""

import dataclasses
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from vllm_wna16_plugin import _vllm, packing  # noqa: E402
from vllm_wna16_plugin.backends import KernelTensors, MoEProblem, RunOptions, registry  # noqa: E402
from vllm_wna16_plugin.backends.base import (  # noqa: E402
    MIN_RUN,
    act_order_issue,
    act_order_layout,
    act_order_split_issue,
    sort_act_order,
)
from vllm_wna16_plugin.kernels.options import KernelOptions  # noqa: E402
from vllm_wna16_plugin.kernels.triton.configs import TritonMoEConfig as Cfg  # noqa: E402
from vllm_wna16_plugin.kernels.triton.fused_moe import fused_moe_wna16_triton  # noqa: E402
from vllm_wna16_plugin.launch_plan import LayerRunner  # noqa: E402
from vllm_wna16_plugin.oracle import select_backend  # noqa: E402
from vllm_wna16_plugin.reference import dequantize_ref, fused_moe_ref, fused_moe_wna16_ref  # noqa: E402
from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme  # noqa: E402

from .conftest import assert_close_scaled, quantized_experts  # noqa: E402

pytestmark = pytest.mark.interpreter

BF16, FP16 = torch.bfloat16, torch.float16


def act_order_g_idx(E, K, gs, gen):
    """(E, K) int32: each expert's K rows dealt into groups of gs in a random order (as GPTQ writes it)."""
    return torch.stack([torch.randperm(K, generator=gen) // gs for _ in range(E)]).to(torch.int32)


def make_case(*, M, H, inter, E, top_k, bits, gs, zp, dtype=BF16, seed, global_experts=None, same_gate_up=True):
    gen = torch.Generator().manual_seed(seed)
    w13 = quantized_experts(E, 2 * inter, H, bits, gs, zp, dtype, gen)
    w2 = quantized_experts(E, H, inter, bits, gs, zp, dtype, gen)
    g_gate = act_order_g_idx(E, H, gs, gen)
    g_up = g_gate.clone() if same_gate_up else act_order_g_idx(E, H, gs, gen)
    g2 = act_order_g_idx(E, inter, gs, gen)
    tensors = KernelTensors(
        w13.qweight, w2.qweight, w13.scales, w2.scales, w13.qzeros, w2.qzeros, torch.stack([g_gate, g_up], 1), g2
    )
    x = torch.randn(M, H, generator=gen).to(dtype)
    n_global = global_experts or E
    logits = torch.randn(M, n_global, generator=gen)
    expert_map = None
    if global_experts:  # EP: this rank holds E of the global experts, in a shuffled placement
        expert_map = torch.full((n_global,), -1, dtype=torch.int32)
        local = torch.randperm(n_global, generator=gen)[:E]
        expert_map[local] = torch.arange(E, dtype=torch.int32)
        logits[0, local[0]] += 10.0  # token 0 picks a local expert: the output is never all zeros
    topk_weights, topk_ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return tensors, x, topk_weights, topk_ids.to(torch.int32), expert_map


def reference(tensors, x, topk_weights, topk_ids, expert_map, bits):
    """The float reference on the checkpoint's own (unsorted) layout and g_idx."""
    return fused_moe_wna16_ref(
        x, *tensors.weights(), topk_weights, topk_ids, bits=bits, w13_qzeros=tensors.w13_qzeros,
        w2_qzeros=tensors.w2_qzeros, expert_map=expert_map, w13_g_idx=tensors.w13_g_idx, w2_g_idx=tensors.w2_g_idx,
    )  # fmt: skip


LOAD = KernelOptions(triton_act_order="load")  # the in-load gather (the default picks it only below 4 tokens)


def run_sorted(tensors, x, topk_weights, topk_ids, expert_map, bits, options=LOAD, **kwargs):
    s = sort_act_order(tensors, bits)
    assert s.a_perm is not None and s.a_perm.dtype == torch.int32
    return fused_moe_wna16_triton(
        x, *s.weights(), topk_weights, topk_ids, bits=bits, w13_qzeros=s.w13_qzeros, w2_qzeros=s.w2_qzeros,
        expert_map=expert_map, a_perm=s.a_perm, options=options, **kwargs,
    )  # fmt: skip


# (M, H, inter, E, top_k, bits, gs, zp, dtype, config, global_experts)
CASES = [
    # decode (pair kernel, folded int4 step), K tails: H=320 and I=96 under BLOCK_SIZE_K=128
    pytest.param(1, 320, 96, 4, 2, 4, 32, True, BF16, Cfg(1, 32, 128), None, id="M1-int4-asym-gs32-H320-tails"),
    pytest.param(1, 320, 64, 4, 1, 8, 64, False, FP16, Cfg(1, 32, 128), None, id="M1-int8-sym-gs64-top1-fp16"),
    pytest.param(1, 384, 128, 4, 2, 4, 128, False, BF16, Cfg(1, 32, 256), 8, id="M1-int4-sym-gs128-ep"),
    # tl.dot kernel: words form (BLOCK_K 128), a 64-wide K tail on GEMM1 (320) and a 32-wide one on GEMM2 (96)
    pytest.param(5, 320, 96, 4, 2, 4, 32, False, BF16, Cfg(16, 32, 128), None, id="M5-int4-sym-gs32-H320"),
    pytest.param(33, 704, 64, 4, 2, 4, 64, True, BF16, Cfg(16, 32, 128), None, id="M33-int4-asym-gs64-H704"),
    pytest.param(5, 384, 128, 4, 1, 4, 128, True, BF16, Cfg(16, 32, 256), None, id="M5-int4-asym-gs128-top1"),
    pytest.param(33, 384, 128, 4, 2, 8, 128, False, FP16, Cfg(16, 32, 128), None, id="M33-int8-sym-gs128-fp16"),
    pytest.param(5, 320, 96, 4, 2, 8, 32, True, BF16, Cfg(16, 32, 64), 8, id="M5-int8-asym-gs32-ep"),
    # split K: GEMM1's slices read their own a_perm columns
    pytest.param(5, 256, 64, 4, 2, 4, 64, True, BF16, Cfg(16, 32, 64, SPLIT_K=2), None, id="M5-int4-splitk2"),
    pytest.param(1, 256, 64, 4, 2, 4, 64, False, BF16, Cfg(1, 32, 64, SPLIT_K=2), 8, id="M1-int4-splitk2-ep"),
]


@pytest.mark.parametrize("M,H,inter,E,top_k,bits,gs,zp,dtype,config,global_experts", CASES)
def test_sorted_act_order_matches_reference_on_original_g_idx(
    M, H, inter, E, top_k, bits, gs, zp, dtype, config, global_experts
):
    seed = 100 + M * 7 + H + bits * 3 + gs + top_k
    t, x, w, ids, emap = make_case(
        M=M, H=H, inter=inter, E=E, top_k=top_k, bits=bits, gs=gs, zp=zp, dtype=dtype, seed=seed,
        global_experts=global_experts,
    )  # fmt: skip
    ref = reference(t, x, w, ids, emap, bits)
    out = run_sorted(t, x, w, ids, emap, bits, configs=config, use_td=False)
    assert_close_scaled(out, ref, dtype, "act order, sorted layout")
    # the premise: the g_idx is far from trivial, so ignoring it gives a wrong answer
    plain = fused_moe_wna16_ref(
        x, *t.weights(), w, ids, bits=bits, w13_qzeros=t.w13_qzeros, w2_qzeros=t.w2_qzeros, expert_map=emap
    )
    assert (plain.float() - ref.float()).abs().max() > 0.1 * ref.float().abs().max()


@pytest.mark.parametrize(
    "M,H,inter,E,top_k,bits,gs,zp,dtype,config,global_experts",
    [CASES[0], CASES[2], CASES[3], CASES[7], CASES[8]],  # the pair kernel, EP, tails, tl.dot, split K
)
def test_the_rows_form_gathers_once_and_gives_the_same_layer(
    M, H, inter, E, top_k, bits, gs, zp, dtype, config, global_experts
):
    """KernelOptions(triton_act_order="rows"): the routed pairs' rows gathered first (kernels/triton/act_order.py),
    GEMM1 without a_perm: the float reference of the unsorted checkpoint, like the in-load gather."""
    t, x, w, ids, emap = make_case(M=M, H=H, inter=inter, E=E, top_k=top_k, bits=bits, gs=gs, zp=zp, dtype=dtype,
                                   seed=500 + M + H + gs, global_experts=global_experts)  # fmt: skip
    out = run_sorted(t, x, w, ids, emap, bits, configs=config, use_td=False,
                     options=KernelOptions(triton_act_order="rows"))  # fmt: skip
    assert_close_scaled(out, reference(t, x, w, ids, emap, bits), dtype, "act order, rows form")


@pytest.mark.parametrize("M, form", [(1, "load"), (3, "load"), (4, "rows"), (33, "rows")])
def test_auto_picks_the_measured_form_by_token_count(M, form):
    """KernelOptions(triton_act_order="auto") (the default) runs configs.act_order_form's pick: the same numbers
    as that form asked for by name."""
    from vllm_wna16_plugin.kernels.triton.configs import ACT_ORDER_ROWS_FROM_M, act_order_form

    assert act_order_form(M, "auto") == form and act_order_form(M, "load") == "load"
    assert (M >= ACT_ORDER_ROWS_FROM_M) == (form == "rows")
    t, x, w, ids, emap = make_case(M=M, H=320, inter=96, E=4, top_k=2, bits=4, gs=32, zp=True, dtype=BF16,
                                   seed=700 + M)  # fmt: skip
    cfg = Cfg(16, 32, 128) if M > 1 else Cfg(1, 32, 128)
    auto = run_sorted(t, x, w, ids, emap, 4, configs=cfg, use_td=False, options=KernelOptions())
    named = run_sorted(t, x, w, ids, emap, 4, configs=cfg, use_td=False,
                       options=KernelOptions(triton_act_order=form))  # fmt: skip
    assert torch.equal(auto, named)
    assert_close_scaled(auto, reference(t, x, w, ids, emap, 4), BF16, f"act order, auto form at M={M}")


def test_the_act_order_form_is_checked():
    with pytest.raises(ValueError, match="triton_act_order='gather' is not one of"):
        KernelOptions(triton_act_order="gather")


@pytest.mark.parametrize("form", ["split", "interleave", "swap"])
def test_other_int4_dot_forms_read_the_permuted_a(form):
    """The split and interleaved dots, and the swapped tile (KernelOptions.swap_ab: its A operand is the B tile)."""
    t, x, w, ids, emap = make_case(M=5, H=320, inter=96, E=4, top_k=2, bits=4, gs=32, zp=True, seed=11)
    options = KernelOptions(swap_ab=True) if form == "swap" else KernelOptions(dot_nibbles=form)
    options = dataclasses.replace(options, triton_act_order="load")
    out = run_sorted(t, x, w, ids, emap, 4, configs=Cfg(16, 32, 64), use_td=False, options=options)
    assert_close_scaled(out, reference(t, x, w, ids, emap, 4), BF16, form)


def test_td_keeps_b_descriptor_but_never_gathers_permuted_a(td_decisions):
    t, x, w, ids, emap = make_case(M=9, H=256, inter=64, E=4, top_k=2, bits=4, gs=32, zp=True, seed=12)
    out = run_sorted(t, x, w, ids, emap, 4, configs=Cfg(16, 32, 64), use_td=True)
    gemm1, gemm2 = td_decisions
    assert gemm1.use_td_b and not gemm1.use_gather and "act order" in gemm1.reason
    assert gemm2.use_td_b and gemm2.use_gather  # GEMM2 reads the activation in order: no a_perm
    assert_close_scaled(out, reference(t, x, w, ids, emap, 4), BF16, "TD B-load with a_perm")


def test_sorted_layout_keeps_group_order_and_a_perm_sorts_g_idx():
    t, *_ = make_case(M=1, H=128, inter=64, E=3, top_k=1, bits=4, gs=32, zp=True, seed=13)
    s = sort_act_order(t, 4)
    gs = 32
    for e in range(3):
        # a_perm[e] sorts the gate (= up) g_idx into k // gs: every group one contiguous run
        assert torch.equal(t.w13_g_idx[e, 0][s.a_perm[e].long()], torch.arange(128, dtype=torch.int32) // gs)
    assert s.w2_scales is t.w2_scales and s.w2_qzeros is t.w2_qzeros  # GEMM2's tables untouched
    assert s.w13_g_idx is None and s.w2_g_idx is None


def _problem(**kw):
    scheme = WNA16Scheme(4, 32, True, PackFormat.GPTQ, desc_act=True, source="test")
    base = dict(
        scheme=scheme, hidden=128, intermediate=64, num_experts=4, global_num_experts=4, top_k=2,
        group_size_w13=32, group_size_w2=32, platform="cpu", has_g_idx=True,
    )  # fmt: skip
    return MoEProblem(**{**base, **kw})


def test_triton_backend_accepts_sortable_act_order_and_runs_it():
    t, x, w, ids, emap = make_case(M=3, H=128, inter=64, E=4, top_k=2, bits=4, gs=32, zp=True, seed=14)
    problem = _problem(act_order_issue=act_order_issue(t.w13_g_idx, t.w2_g_idx, t.w13_scales, t.w2_scales))
    assert problem.act_order_issue is None
    selection = select_backend(problem, "triton", "test")
    assert selection.backend.name == "triton"
    state = selection.backend.prepare(problem, t)
    assert state.a_perm is not None
    out = selection.backend.run(problem, state, x, w, ids)
    assert_close_scaled(out, reference(t, x, w, ids, None, 4), BF16, "triton backend, act order")
    # on an H200 both kernels take whole-group act order (cuda when asked: this shape has no crossover), and
    # cuda refuses a tensor-parallel rank's padded layout (runs of 16 rows)
    h200 = dataclasses.replace(problem, platform="cuda", sm=90, options=RunOptions(plan_only=True))
    assert registry()["triton"].incompatibility_reason(h200) is None
    named = dataclasses.replace(h200, options=RunOptions(plan_only=True, explicit=True))
    assert registry()["cuda"].incompatibility_reason(named) is None
    padded = dataclasses.replace(named, act_order_padded=True)
    assert "act order on a tensor-parallel rank" in registry()["cuda"].incompatibility_reason(padded)
    assert registry()["triton"].incompatibility_reason(padded) is None


def test_a_cuda_layer_under_auto_sorts_act_order_once_for_both_kernels():
    # the runner sorts (sort_act_order) once; the cuda state shares the sorted packed weights and a_perm
    from vllm_wna16_plugin.launch_plan import plan_backends

    t, *_ = make_case(M=3, H=128, inter=64, E=4, top_k=2, bits=4, gs=32, zp=True, seed=16)
    problem = dataclasses.replace(_problem(), platform="cuda", sm=90, options=RunOptions(plan_only=True))
    selection = select_backend(problem, "cuda", "test")
    selection = dataclasses.replace(selection, problem=dataclasses.replace(selection.problem, options=RunOptions(
        plan_only=True)))  # fmt: skip
    assert plan_backends(selection) == ("cuda", "triton")
    runner = LayerRunner(selection, t)
    assert runner.tensors.a_perm is not None
    cuda, triton = runner.states["cuda"], runner.states["triton"]
    assert triton is runner.tensors and cuda.w13_qweight is triton.w13_qweight and cuda.a_perm is triton.a_perm
    assert torch.equal(cuda.w13_scales, triton.w13_scales)  # the same values, group-major (cuda_layout)


def test_gate_and_up_with_different_act_orders_are_refused_on_triton_auto_falls_back():
    t, *_ = make_case(M=1, H=128, inter=64, E=4, top_k=1, bits=4, gs=32, zp=False, seed=15, same_gate_up=False)
    issue = act_order_issue(t.w13_g_idx, t.w2_g_idx, t.w13_scales, t.w2_scales)
    assert issue and "gate_proj and up_proj have different g_idx" in issue
    problem = _problem(act_order_issue=issue)
    reason = registry()["triton"].incompatibility_reason(dataclasses.replace(problem, platform="cuda", sm=90))
    assert reason and "cannot be sorted" in reason and "gate_proj and up_proj" in reason
    with pytest.raises(ValueError, match="gate_proj and up_proj have different g_idx"):
        select_backend(problem, "triton", "test")
    assert select_backend(problem, "auto", "auto").backend.name == "reference"
    with pytest.raises(ValueError, match="gate_proj and up_proj"):
        sort_act_order(t, 4)


def test_unequal_groups_along_hidden_are_refused_with_the_group_named():
    # GEMM1's K (hidden) is never split: unequal groups there are a broken checkpoint
    t, *_ = make_case(M=1, H=128, inter=64, E=2, top_k=1, bits=4, gs=32, zp=False, seed=16)
    g13 = t.w13_g_idx.clone()
    g13[1, :, (g13[1, 0] == 1).nonzero()[0]] = 0  # expert 1: group 0 gets 33 rows, group 1 31
    issue = act_order_issue(g13, t.w2_g_idx, t.w13_scales, t.w2_scales)
    assert issue.startswith("gate/up (K=hidden): local expert 1: group 0 has 33 of K=128 rows, not group_size=32")


def test_unequal_groups_along_intermediate_are_padded_not_refused():
    # the old rule refused them ("down (K=intermediate): ... group 0 has 33 of K=64 rows"); a TP rank's
    # slice always has them, and the padded layout runs them exactly (the TP tests below)
    t, *_ = make_case(M=1, H=128, inter=64, E=2, top_k=1, bits=4, gs=32, zp=False, seed=16)
    g2 = t.w2_g_idx.clone()
    g2[1, (g2[1] == 1).nonzero()[0]] = 0  # expert 1: group 0 gets 33 rows, group 1 31
    assert act_order_issue(t.w13_g_idx, g2, t.w13_scales, t.w2_scales) is None
    layout = act_order_layout(dataclasses.replace(t, w2_g_idx=g2), 4)
    assert layout.padded and layout.run == MIN_RUN and layout.rows2.shape == (2, 80)  # 48 + 32 rows of expert 1
    g2[0, 0] = 2  # a group the scale table does not have is still refused
    assert "down (K=intermediate): local expert 0: g_idx names a group outside the 2" in act_order_issue(
        t.w13_g_idx, g2, t.w13_scales, t.w2_scales
    )


def test_launcher_checks_a_perm():
    t, x, w, ids, _ = make_case(M=1, H=128, inter=64, E=2, top_k=1, bits=4, gs=32, zp=False, seed=17)
    s = sort_act_order(t, 4)
    with pytest.raises(ValueError, match=r"a_perm must be \(E=2, H=128\) int32"):
        fused_moe_wna16_triton(x, *s.weights(), w, ids, bits=4, a_perm=s.a_perm.long())


# ---------------------------------------------------------------- tensor parallelism: padded groups


def shard(t: KernelTensors, rank: int, tp: int, bits: int) -> KernelTensors:
    """Rank `rank` of `tp` as vLLM's FusedMoE shards the layer (weight_loading.shard_logical), in plain
    unpack/pack: w13's gate and up rows of the rank's intermediate slice (full-K g_idx), w2's K rows of the
    slice with their g_idx and the scale and zero-point tables of every group."""
    inter = t.w13_qweight.shape[1] // 2
    own = torch.arange(rank * inter // tp, (rank + 1) * inter // tp)
    rows = torch.cat([own, own + inter])
    w13 = packing.from_kernel_layout(packing.KernelWeights(t.w13_qweight, t.w13_scales, t.w13_qzeros), bits)
    z13 = None if w13.zeros is None else w13.zeros[:, rows]
    kw = packing.to_kernel_layout(packing.QuantizedWeight(w13.q[:, rows], w13.scales[:, rows], z13, bits, 1))
    q2 = packing.unpack_along(t.w2_qweight, bits, dim=-1, word_bits=8)[..., own]
    return KernelTensors(
        kw.qweight, packing.pack_along(q2, bits, dim=-1, word_bits=8), kw.scales, t.w2_scales, kw.qzeros,
        t.w2_qzeros, t.w13_g_idx, t.w2_g_idx[:, own].contiguous(),
    )  # fmt: skip


def _rank_problem(t: KernelTensors, bits, gs, dtype):
    scheme = WNA16Scheme(bits, gs, t.w13_qzeros is not None, PackFormat.GPTQ, desc_act=True, source="test")
    inter = t.w13_qweight.shape[1] // 2
    return MoEProblem(
        scheme=scheme, hidden=t.w2_qweight.shape[1], intermediate=inter, num_experts=t.w13_qweight.shape[0],
        global_num_experts=t.w13_qweight.shape[0], top_k=2, group_size_w13=gs, group_size_w2=math.gcd(gs, inter),
        act_dtype=dtype, platform="cpu", has_g_idx=True,
    )  # fmt: skip


# (tp, M, H, inter, bits, gs, zp, dtype, config): config None runs the layer's own plan (LayerRunner)
TP_CASES = [
    # K tails: H=320 on BLOCK_SIZE_K 128, and a padded I that is no multiple of it
    pytest.param(2, 5, 320, 192, 4, 32, True, BF16, Cfg(16, 32, 128), id="tp2-int4-asym-gs32-H320-M5"),
    pytest.param(2, 1, 320, 192, 4, 32, False, BF16, Cfg(1, 32, 128), id="tp2-int4-sym-gs32-pair"),
    pytest.param(4, 3, 256, 512, 4, 128, False, BF16, None, id="tp4-int4-sym-gs128-plan"),
    pytest.param(2, 33, 192, 256, 8, 64, True, FP16, Cfg(16, 32, 64), id="tp2-int8-asym-gs64-fp16-M33"),
    pytest.param(4, 1, 128, 256, 8, 64, False, BF16, None, id="tp4-int8-sym-gs64-plan"),
    # I per rank 192 with group 128 (Qwen3-30B-A3B's down projection at TP4): no whole group on any rank
    pytest.param(4, 5, 256, 768, 4, 128, True, BF16, Cfg(16, 64, 64, SPLIT_K=2), id="tp4-int4-asym-gs128-I768-splitk"),
]


@pytest.mark.parametrize("tp,M,H,inter,bits,gs,zp,dtype,config", TP_CASES)
def test_tp_ranks_run_padded_act_order_and_sum_to_the_unsharded_layer(tp, M, H, inter, bits, gs, zp, dtype, config):
    t, x, w, ids, _ = make_case(M=M, H=H, inter=inter, E=4, top_k=2, bits=bits, gs=gs, zp=zp, dtype=dtype,
                                seed=300 + tp + M + gs + bits)  # fmt: skip
    total = torch.zeros(M, H)
    for rank in range(tp):
        rt = shard(t, rank, tp, bits)
        assert act_order_issue(rt.w13_g_idx, rt.w2_g_idx, rt.w13_scales, rt.w2_scales) is None
        layout = act_order_layout(rt, bits)
        assert layout.padded, "a rank's slice of a random act order holds partial groups"
        if config is None:  # the layer's path: prepare pads, the plan is made for K = I_pad and group = run
            problem = _rank_problem(rt, bits, gs, dtype)
            runner = LayerRunner(select_backend(problem, "triton", "test"), rt)
            assert (runner.problem.intermediate, runner.problem.group_size_w2) == (layout.rows2.shape[1], layout.run)
            gemm2 = runner.plan(M).launch.gemm2.config
            gemm2.check_shape(layout.rows2.shape[1], layout.run)
            out = runner.run(x, w, ids)
        else:
            s = sort_act_order(rt, bits)
            out = fused_moe_wna16_triton(
                x, *s.weights(), w, ids, bits=bits, w13_qzeros=s.w13_qzeros, w2_qzeros=s.w2_qzeros,
                a_perm=s.a_perm, configs=config, use_td=False, out=torch.full_like(x, float("nan")),
            )  # fmt: skip
        assert_close_scaled(out, reference(rt, x, w, ids, None, bits), dtype, f"rank {rank} of {tp}")
        total += out.float()
    # every partial output is rounded to the compute dtype once: the sum carries tp roundings
    assert_close_scaled(total, reference(t, x, w, ids, None, bits).float(), dtype, f"sum of {tp} ranks")


@pytest.mark.parametrize("bits,zp", [(4, True), (4, False), (8, True)])
def test_padded_rank_weights_reassemble_the_ranks_permuted_weights(bits, zp):
    # dequantized, the padded layout is the rank's weight with rows moved (GEMM1's K by perm1, the
    # intermediate by rows2) and padding rows of exactly 0; every chunk of `run` rows lies in one group
    t, *_ = make_case(M=1, H=192, inter=384, E=3, top_k=1, bits=bits, gs=64, zp=zp, seed=31)
    for rank in range(4):
        rt = shard(t, rank, 4, bits)
        layout = act_order_layout(rt, bits)
        s = sort_act_order(rt, bits)
        rows, pad = layout.rows2, layout.rows2 < 0
        i_pad = rows.shape[1]
        assert i_pad % layout.run == 0 and layout.chunk_groups.shape == (3, i_pad // layout.run)
        for e in range(3):  # each of the rank's 96 rows once, the rest padding
            assert torch.equal(rows[e][~pad[e]].sort().values, torch.arange(96))
            g = rt.w2_g_idx[e].long()[rows[e].clamp(min=0)]
            chunk = layout.chunk_groups[e].repeat_interleave(layout.run)
            assert torch.equal(g[~pad[e]], chunk[~pad[e]])
        w2 = dequantize_ref(rt.w2_qweight, rt.w2_scales, rt.w2_qzeros, bits, rt.w2_g_idx)  # (E, H, 96)
        w2_pad = dequantize_ref(s.w2_qweight, s.w2_scales, s.w2_qzeros, bits)  # (E, H, I_pad), groups of run
        expected = torch.gather(w2, -1, rows.clamp(min=0)[:, None, :].expand(-1, 192, -1)).masked_fill(pad[:, None], 0)
        assert torch.equal(w2_pad, expected)
        w13 = dequantize_ref(rt.w13_qweight, rt.w13_scales, rt.w13_qzeros, bits, rt.w13_g_idx)  # (E, 192, H)
        w13 = torch.gather(w13, -1, layout.perm1[:, None, :].expand(-1, 192, -1))  # GEMM1's sorted K
        rows13 = torch.cat([rows, torch.where(pad, rows, rows + 96)], 1)
        pad13 = torch.cat([pad, pad], 1)
        expected = torch.gather(w13, 1, rows13.clamp(min=0)[:, :, None].expand(-1, -1, 192))
        w13_pad = dequantize_ref(s.w13_qweight, s.w13_scales, s.w13_qzeros, bits)
        assert torch.equal(w13_pad, expected.masked_fill(pad13[:, :, None], 0))
        assert bool((s.w13_scales[pad13] == 0).all())  # 0 whatever the padded rows' weights and zeros


def test_act_order_is_no_longer_refused_before_loading_at_any_tp():
    scheme = WNA16Scheme(4, 128, False, PackFormat.GPTQ, desc_act=True, source="test")
    assert all(act_order_split_issue(scheme, tp) is None for tp in (1, 2, 4, 8))


# ---------------------------------------------------------------- through the plugin's loader


E, H, I, TOP_K, GS = 4, 128, 64, 2, 32

RAW_GPTQ_ACT = {"quant_method": "gptq", "bits": 4, "group_size": GS, "sym": False, "desc_act": True,
                "checkpoint_format": "gptq_v2"}  # fmt: skip


def _act_order_experts(n, k, gen, g_idx):
    """GPTQ-style act order for E experts: quantized in g_idx's order, stored in the original K order.

    Returns (float weights the checkpoint means (E, n, k), per-expert GPTQ tensors)."""
    w = torch.randn(E, n, k, generator=gen) * 0.05
    dense, tensors = [], []
    for e in range(E):
        order = torch.sort(g_idx[e].long(), stable=True).indices  # column j of the sorted view is row order[j]
        qw = packing.quantize_rtn(w[e][:, order], 4, GS, has_zero_point=True)
        qw.scales = qw.scales.half().float()
        inv = torch.argsort(order)
        q = qw.q[:, inv]  # back to the checkpoint's K order
        w_sorted = packing.dequantize(qw)
        dense.append(w_sorted[:, inv])
        tensors.append(packing.QuantizedWeight(q, qw.scales, qw.zeros, 4, GS))
    return torch.stack(dense), tensors


def _gptq_checkpoint(gen, g_idx=None):
    # gate and up share the input's act order (GPTQ sorts by x's Hessian)
    g_h, g_i = g_idx or (act_order_g_idx(E, H, GS, gen), act_order_g_idx(E, I, GS, gen))
    w_gate, q_gate = _act_order_experts(I, H, gen, g_h)
    w_up, q_up = _act_order_experts(I, H, gen, g_h)
    w_down, q_down = _act_order_experts(H, I, gen, g_i)
    weights = []
    for e in range(E):
        for proj, qw, g in (("gate_proj", q_gate[e], g_h[e]), ("up_proj", q_up[e], g_h[e]),
                            ("down_proj", q_down[e], g_i[e])):  # fmt: skip
            # GPTQ stores one scale row per group id, so the group tables are as quantized (sorted order)
            for key, t in packing.pack_gptq(qw, zero_point_offset=0).items():
                weights.append((f"{e}.{proj}.{key}", t.half() if key == "scales" else t))
            weights.append((f"{e}.{proj}.g_idx", g.clone()))
    return torch.cat([w_gate, w_up], 1), w_down, weights


def test_gptq_desc_act_layer_loads_sorted_and_runs_on_triton(vllm_cpu, monkeypatch):
    from tests.conftest import build_moe_layer

    monkeypatch.setenv("VLLM_WNA16_PLUS_BACKEND", "triton")
    gen = torch.Generator().manual_seed(18)
    w13, w2, weights = _gptq_checkpoint(gen)
    layer = build_moe_layer(vllm_cpu, RAW_GPTQ_ACT, E=E, H=H, I=I, top_k=TOP_K)
    list(layer.load_weights(weights))
    method = layer.quant_method
    method.process_weights_after_loading(layer)
    assert method.problem.has_g_idx and method.problem.act_order_issue is None
    assert method.selection.backend.name == "triton"
    state = method.runner.states["triton"]
    assert state.a_perm is not None
    # the layer's parameters now hold the sorted tensors (one copy in memory)
    for gemm, kind in (("w13", "qweight"), ("w13", "scales"), ("w13", "qzeros"), ("w2", "qweight")):
        param = getattr(layer, method.param_names[(gemm, kind)])
        assert param.data_ptr() == getattr(state, f"{gemm}_{kind}").data_ptr()
    x = torch.randn(6, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)])
    w = torch.rand(6, TOP_K, generator=gen)
    out = method.apply(layer, x, w, ids, None, None)
    ref = fused_moe_ref(x, w13, w2, w, ids)
    assert_close_scaled(out, ref, BF16, "GPTQ desc_act through the loader on triton")


def _tp_layer(vllm_cpu, monkeypatch, rank, tp, backend):
    from tests.conftest import build_moe_layer

    monkeypatch.setattr(_vllm, "layer_tp", lambda layer: (rank, tp))
    monkeypatch.setenv("VLLM_WNA16_PLUS_BACKEND", backend)
    return build_moe_layer(vllm_cpu, RAW_GPTQ_ACT, E=E, H=H, I=I, top_k=TOP_K, tp_size=tp)


def test_gptq_desc_act_under_tp2_runs_padded_on_triton_and_ranks_sum_to_the_layer(vllm_cpu, monkeypatch):
    # Under TP the down projection's K is split: a rank holds an uneven share of each act-order group. The
    # old code refused triton here (before any weight was read) and auto fell back to reference.
    gen = torch.Generator().manual_seed(19)
    w13, w2, weights = _gptq_checkpoint(gen)
    x = torch.randn(6, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)])
    w = torch.rand(6, TOP_K, generator=gen)
    total = torch.zeros(6, H)
    for rank in range(2):
        auto = _tp_layer(vllm_cpu, monkeypatch, rank, 2, "auto")  # on CPU auto plans reference, as at TP=1
        assert auto.quant_method.problem.act_order_issue is None
        layer = _tp_layer(vllm_cpu, monkeypatch, rank, 2, "triton")  # an explicit triton is no longer refused
        list(layer.load_weights(weights))
        method = layer.quant_method
        method.process_weights_after_loading(layer)
        assert method.problem.has_g_idx and method.problem.act_order_issue is None
        assert method.selection.backend.name == "triton"
        # on an H200, auto picks triton for the loaded rank (the cuda backend still refuses act order)
        h200 = dataclasses.replace(method.problem, platform="cuda", sm=90, options=RunOptions(plan_only=True))
        assert select_backend(h200).backend.name == "triton"
        assert "act order" in registry()["cuda"].incompatibility_reason(h200)
        state = method.runner.states["triton"]
        i_pad = state.w13_qweight.shape[1] // 2
        assert i_pad > I // 2 and method.runner.problem.intermediate == i_pad
        assert method.runner.problem.group_size_w2 == i_pad // state.w2_scales.shape[-1]
        # the padded tensors replace the parameters' data: one copy in memory
        for (gemm, kind), name in method.param_names.items():
            if kind in ("qweight", "scales", "qzeros"):
                assert getattr(layer, name).data_ptr() == getattr(state, f"{gemm}_{kind}").data_ptr(), name
        total += method.apply(layer, x, w, ids, None, None).float()
    assert_close_scaled(total, fused_moe_ref(x, w13, w2, w, ids), BF16, "GPTQ desc_act, TP=2, sum of ranks")


def test_padded_act_order_reloads_through_vllms_layerwise_reload(vllm_cpu, monkeypatch):
    # vLLM's reload_weights restores the created (checkpoint-layout) shapes, loads, processes and copies the
    # result into the layer's tensors: the padded parameters keep their storage and take the new weights.
    # A plain load into the processed (padded) parameters is refused instead of writing the wrong rows.
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    gen = torch.Generator().manual_seed(21)
    g_h, g_i = act_order_g_idx(E, H, GS, gen), act_order_g_idx(E, I, GS, gen)
    layer = _tp_layer(vllm_cpu, monkeypatch, 1, 2, "triton")
    record_metadata_for_reloading(layer)
    list(layer.load_weights(_gptq_checkpoint(gen, g_idx=(g_h, g_i))[2]))
    layer.quant_method.process_weights_after_loading(layer)
    name = layer.quant_method.param_names[("w13", "qweight")]
    before = getattr(layer, name)
    assert before.shape[1] > I  # 2 * I_pad rows on this rank, not 2 * I / 2
    with pytest.raises(ValueError, match=r"holds the processed act-order layout .* reload_weights"):
        list(layer.load_weights(_gptq_checkpoint(gen, g_idx=(g_h, g_i))[2]))
    w13, w2, weights = _gptq_checkpoint(gen, g_idx=(g_h, g_i))  # new weights, the same act order
    initialize_layerwise_reload(layer)
    list(layer.load_weights(weights))
    finalize_layerwise_reload(layer, vllm_cpu.model_config)
    after = getattr(layer, name)
    assert after is before and after.data_ptr() == before.data_ptr()
    x = torch.randn(6, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)])
    w = torch.rand(6, TOP_K, generator=gen)
    out = layer.quant_method.apply(layer, x, w, ids, None, None)
    own = slice(I // 2, I)
    exact = fused_moe_ref(x, torch.cat([w13[:, :I][:, own], w13[:, I:][:, own]], 1), w2[:, :, own], w, ids)
    assert_close_scaled(out, exact, BF16, "rank 1 after reload")


def test_a_reload_with_another_padded_act_order_is_refused_by_name(vllm_cpu, monkeypatch):
    # a tensor-parallel rank's padded size follows the act order; vLLM's reload copies the new layout into the
    # loaded layer's tensors, so another size failed inside vLLM (a shape mismatch in its copy). Named now.
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    own = slice(I // 2, I)

    def i_pad(g_i):  # rank 1's rows of each group, padded to runs of 16 (sort_act_order's padding at this shape)
        counts = torch.stack([torch.bincount(g_i[e, own].long(), minlength=I // GS) for e in range(E)])
        return int(((counts + 15) // 16 * 16).sum(-1).max())

    gen = torch.Generator().manual_seed(5)
    orders = [(act_order_g_idx(E, H, GS, gen), act_order_g_idx(E, I, GS, gen)) for _ in range(400)]
    first = orders[0]
    other = next(o for o in orders[1:] if i_pad(o[1]) != i_pad(first[1]))
    layer = _tp_layer(vllm_cpu, monkeypatch, 1, 2, "triton")
    record_metadata_for_reloading(layer)
    list(layer.load_weights(_gptq_checkpoint(gen, g_idx=first)[2]))
    layer.quant_method.process_weights_after_loading(layer)
    initialize_layerwise_reload(layer)
    with pytest.raises(ValueError, match=r"another act order, which pads this tensor-parallel rank's down "
                                         r"projection .* Restart the engine"):  # fmt: skip
        list(layer.load_weights(_gptq_checkpoint(gen, g_idx=other)[2]))
        finalize_layerwise_reload(layer, vllm_cpu.model_config)


# ---------------------------------------------------------------- GPU code generation, without a GPU


@pytest.mark.slow
@pytest.mark.parametrize("pair", [0, 1], ids=["tl.dot-words", "per-pair-fold"])
@pytest.mark.parametrize("even_k", [1, 0], ids=["K2048", "K1344-tail"])
def test_act_order_kernels_compile_for_sm90_with_b_loads_unchanged(pair, even_k):
    # HAS_A_PERM changes only A's addresses: B still arrives by 16-byte loads (cp.async into the
    # pipeline for the tl.dot kernel, vector loads per pair), and the default forms stay free of
    # per-weight int->float converts
    from .test_triton_fused_moe import _compile_for_gpu

    tags = _compile_for_gpu(90, 4, 0, 0, even_k, pair, 0, a_perm=True)
    assert ("LDV4" if pair else "CPASYNC16") in tags, tags
    # (per pair: the folded step's few converts are the zero points, as without act order)
    assert int(next(t for t in tags if t.startswith("I2F=")).split("=")[1]) <= (8 if pair else 0), tags


def test_gptq_desc_act_under_ep2_keeps_each_experts_order_and_ranks_sum_to_the_layer(vllm_cpu, monkeypatch):
    """Expert parallelism holds whole experts, so act order needs no padding there: each EP rank sorts its own
    experts by their g_idx (local ids, not global ones) on triton, and the ranks sum to the full layer."""
    from tests.conftest import build_moe_layer, simulate_ep_rank

    monkeypatch.setenv("VLLM_WNA16_PLUS_BACKEND", "triton")
    gen = torch.Generator().manual_seed(21)
    w13, w2, weights = _gptq_checkpoint(gen)
    x = torch.randn(6, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)])
    w = torch.rand(6, TOP_K, generator=gen)
    ref = fused_moe_ref(x, w13, w2, w, ids).float()
    total = torch.zeros(6, H)
    for rank in range(2):
        simulate_ep_rank(monkeypatch, vllm_cpu, rank)
        layer = build_moe_layer(vllm_cpu, RAW_GPTQ_ACT, E=E, H=H, I=I, top_k=TOP_K, tp_size=2)
        list(layer.load_weights(weights))
        method = layer.quant_method
        method.process_weights_after_loading(layer)
        assert method.problem.has_g_idx and not method.problem.act_order_padded
        assert method.runner.states["triton"].w13_qweight.shape[0] == E // 2
        out = method.apply(layer, x, w, ids, None, None).float()
        mine = torch.tensor([g for g in range(E) if _vllm.layer_local_expert_id(layer, g) >= 0])
        alone = fused_moe_ref(x, w13, w2, w * torch.isin(ids, mine), ids).float()
        assert_close_scaled(out, alone, BF16, f"GPTQ desc_act, EP rank {rank} of 2")
        total += out
    assert_close_scaled(total, ref, BF16, "GPTQ desc_act, EP=2, sum of ranks")
