"""The launch plan (vllm_wna16_plugin/launch_plan.py): pure, legal on every real shape, and what runs.

The sweep plans every batch size of doctor's table for the routed-experts layers of public MoE models at
TP 1/2/4/8, int4 and int8, grouped and channel-wise, on the H200 (the device whose tables ship), and
checks each plan against the rules its kernels enforce (the compiled CUDA launch rules where the
extension is built). Under the Triton interpreter a layer's runner is checked to launch exactly what its
plan says, and a `cuda` layer under auto to hand batches outside its crossover to `triton`.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vllm_wna16_plugin import crossover
from vllm_wna16_plugin.backends import KernelTensors, MoEProblem, RunOptions, registry
from vllm_wna16_plugin.backends.base import layer_device
from vllm_wna16_plugin.backends.cuda import layer_ranges
from vllm_wna16_plugin.checkpoint_config import effective_group_size
from vllm_wna16_plugin.kernels.cuda_ops import ALIGN_MAX_PAIRS, CudaLaunch, extension_error, launch_config_error
from vllm_wna16_plugin.kernels.options import PLAN_DEVICES, DeviceSpec, KernelOptions
from vllm_wna16_plugin.kernels.triton.configs import TritonLaunch
from vllm_wna16_plugin.launch_plan import LayerRunner, plan, plan_backends
from vllm_wna16_plugin.oracle import select_backend
from vllm_wna16_plugin.scheme import CHANNELWISE, PackFormat, WNA16Scheme
from vllm_wna16_plugin.tools.doctor import BATCH_SIZES

H200 = PLAN_DEVICES["sm90"]
PLAN_ONLY = RunOptions(plan_only=True)

# (E, top_k, hidden, moe_intermediate) of public config.json files
REAL_MOE_LAYERS = {
    "Qwen3-30B-A3B": (128, 8, 2048, 768),
    "Qwen3-235B-A22B": (128, 8, 4096, 1536),
    "Qwen3-Next-80B-A3B": (512, 10, 2048, 512),
    "Qwen2-57B-A14B": (64, 8, 3584, 2560),
    "Qwen1.5-MoE-A2.7B": (60, 4, 2048, 1408),
    "Mixtral-8x7B": (8, 2, 4096, 14336),
    "Mixtral-8x22B": (8, 2, 6144, 16384),
    "DeepSeek-V2-Lite": (64, 6, 2048, 1408),
    "DeepSeek-V3": (256, 8, 7168, 2048),
    "OLMoE-1B-7B": (64, 8, 2048, 1024),
    "Phi-3.5-MoE": (16, 2, 4096, 6400),
    "granite-3.1-3b-a800m": (40, 8, 1536, 512),
    "Llama-4-Scout": (16, 1, 5120, 8192),
    "GLM-4.5-Air": (128, 8, 4096, 1408),
    "ERNIE-4.5-21B-A3B": (64, 6, 2560, 1536),
    "dbrx": (16, 4, 6144, 10752),
}


def layer_problem(E, top_k, H, inter, tp, bits, gs, device=H200, options=PLAN_ONLY):
    """One rank's MoEProblem as the plugin's layer builds it (effective group sizes per GEMM), or None
    where loading refuses the TP size."""
    scheme = WNA16Scheme(bits, gs, False, PackFormat.GPTQ, source="test")
    if inter % tp:
        return None
    try:
        gs13 = effective_group_size(scheme, H, layer="gate/up")
        gs2 = effective_group_size(scheme, inter // tp, layer="down", tp_size=tp, full_size_k=inter)
    except ValueError:
        return None
    return MoEProblem(scheme=scheme, hidden=H, intermediate=inter // tp, num_experts=E, global_num_experts=E,
                      top_k=top_k, group_size_w13=gs13, group_size_w2=gs2, platform=device.platform, sm=device.sm,
                      options=options)  # fmt: skip


def check_cuda_plan(problem: MoEProblem, p, m: int) -> None:
    launch = p.launch
    assert isinstance(launch, CudaLaunch), p
    opts = problem.options.kernel
    for cfg, k, gs in ((launch.gemm1, problem.hidden, problem.group_size_w13),
                       (launch.gemm2, problem.intermediate, problem.group_size_w2)):  # fmt: skip
        assert cfg.block_size_m == launch.gemm1.block_size_m <= opts.cuda_max_block_m  # one alignment
        if extension_error() is None:  # the compiled rules the launcher checks every launch against
            assert launch_config_error(k, k // gs, cfg, problem.scheme.bits) == "", (problem.describe(), m, cfg)
    assert launch.kernel1 != "stream" or launch.fuse_activation
    assert launch.own_align == (m * problem.top_k <= ALIGN_MAX_PAIRS)
    assert launch.programmatic  # sm90
    assert [g.gemm for g in p.gemms] == ["gate/up", "down"] and all("cuda" in g.kernel for g in p.gemms)


def check_triton_plan(problem: MoEProblem, p) -> None:
    launch = p.launch
    assert isinstance(launch, TritonLaunch), p
    for choice, k, gs in ((launch.gemm1, problem.hidden, problem.group_size_w13),
                          (launch.gemm2, problem.intermediate, problem.group_size_w2)):  # fmt: skip
        choice.config.check_shape(k, gs)
        assert choice.source.startswith(("tuned E=", "default_config heuristic")), choice.source
    for g in p.gemms:
        assert g.source and g.form and g.tensor_descriptors == "off"  # sm90 auto: TD only where a tuned entry says


def test_plans_of_real_models_at_every_tp_and_batch_size_are_legal_and_explain_themselves():
    planned = {"cuda": 0, "triton": 0}
    for name, (E, top_k, H, inter) in REAL_MOE_LAYERS.items():
        for tp in (1, 2, 4, 8):
            for bits, gs in ((4, 128), (4, 32), (4, CHANNELWISE), (8, 64)):
                problem = layer_problem(E, top_k, H, inter, tp, bits, gs)
                if problem is None:
                    continue
                selection = select_backend(problem)
                ranges = layer_ranges(selection.problem, H200)[0]  # measured, else the shape rule
                for m in BATCH_SIZES:
                    p = plan(problem, m, H200, selection=selection)
                    assert p == plan(problem, m, H200)  # pure: the same plan from the same inputs
                    assert p.layer_backend == selection.backend.name and p.num_tokens == m
                    want = "cuda" if selection.backend.name == "cuda" and crossover.in_ranges(m, ranges) else "triton"
                    assert p.backend == want, (name, tp, bits, gs, m, p.why)
                    (check_cuda_plan(problem, p, m) if p.backend == "cuda" else check_triton_plan(problem, p))
                    text = p.describe()
                    assert text.startswith(f"M={m}: {p.backend}") and "why: layer backend" in text
                    planned[p.backend] += 1
    assert planned["triton"] > 2000 and planned["cuda"] > 10, planned  # the shipped crossovers engage somewhere


def test_an_explicit_cuda_layer_plans_cuda_at_every_batch_size():
    problem = layer_problem(8, 2, 4096, 14336, 1, 4, 128, options=RunOptions(plan_only=True, explicit=True))
    selection = select_backend(problem, "cuda", "test")
    assert plan_backends(selection) == ("cuda",)
    for m in BATCH_SIZES:
        p = plan(problem, m, H200, selection=selection)
        assert p.backend == "cuda"
        check_cuda_plan(selection.problem, p, m)
        assert not any("crossover" in w for w in p.why)


def test_kernel_options_reach_the_plan():
    problem = layer_problem(128, 8, 2048, 768, 1, 4, 128)
    tiles = dataclasses.replace(problem, options=RunOptions(plan_only=True, kernel=KernelOptions(cuda_stream=False)))
    assert plan(problem, 16, H200).launch.kernel1 == "stream"  # inside Qwen3-30B-A3B's measured range
    assert plan(tiles, 16, H200).launch.kernel1 == "auto"
    plain = dataclasses.replace(problem, options=RunOptions(plan_only=True, kernel=KernelOptions(own_align=False)))
    assert plan(plain, 16, H200).align == "vLLM moe_align_block_size"
    split = dataclasses.replace(problem, options=RunOptions(plan_only=True, kernel=KernelOptions(dot_nibbles="split")))
    swapped = ", swapped (weights as the MMA's M)"  # a tuned 16x64x128 tile: wgmma's 64 rows (swap_takes_wgmma)
    assert plan(split, 128, H200).gemms[0].form == "split dot" + swapped  # words by default
    assert plan(problem, 128, H200).gemms[0].form == "words dot" + swapped
    plain = dataclasses.replace(problem, options=RunOptions(plan_only=True, kernel=KernelOptions(swap_ab=False)))
    assert plan(plain, 128, H200).gemms[0].form == "words dot"
    assert not any("swapped" in g.form for g in plan(problem, 1, H200).gemms)  # decode: per pair or cuda, no tl.dot
    fused = dataclasses.replace(problem, options=RunOptions(plan_only=True, kernel=KernelOptions(triton_fuse_act=True)))
    gate_up, down = plan(fused, 128, H200).gemms
    assert gate_up.form == "words dot" + swapped + ", silu fused" and "fused" not in down.form  # GEMM2 never fuses
    assert "fused" not in plan(problem, 128, H200).gemms[0].form  # no shipped table fuses


def test_act_order_plans_name_the_gather_the_kernel_runs():
    """An act-order layer (has_g_idx): triton gathers in its loads below 4 tokens and into pair rows from 4
    (configs.act_order_form); cuda keeps the layer's own ranges but M=1 (backends/cuda.act_order_ranges)."""
    mixtral = layer_problem(8, 2, 4096, 14336, 1, 4, 128)
    ao = dataclasses.replace(mixtral, has_g_idx=True)
    assert plan(mixtral, 1, H200).backend == "cuda" and plan(ao, 1, H200).backend == "triton"
    assert plan(ao, 1, H200).gemms[0].form.endswith("A gathered in its loads (act order)")
    assert plan(ao, 16, H200).backend == "cuda" and any("act order" in w for w in plan(ao, 16, H200).why)
    p64 = plan(ao, 64, H200)  # outside Mixtral-8x7B's measured cuda range (1-32): triton, rows first
    assert plan(mixtral, 64, H200).backend == p64.backend == "triton"
    assert p64.gemms[0].form.endswith("A gathered into pair rows first")
    load = dataclasses.replace(ao, options=RunOptions(plan_only=True, kernel=KernelOptions(triton_act_order="load")))
    assert plan(load, 64, H200).gemms[0].form.endswith("A gathered in its loads (act order)")


@pytest.mark.parametrize(
    "field,value",
    [("dot_nibbles", "nibbles"), ("pair_step_math", "dequant"), ("cuda_kernel", "stream"), ("cuda_max_block_m", 3),
     ("use_td", "yes"), ("cuda_ctas_per_sm", 0)],
)  # fmt: skip
def test_bad_kernel_options_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KernelOptions(**{field: value})


def test_plan_refuses_a_batch_that_is_not_a_positive_int():
    problem = layer_problem(8, 2, 4096, 14336, 1, 4, 128)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_tokens"):
            plan(problem, bad, H200)


def test_layer_device_of_a_described_problem_is_the_plan_device():
    assert layer_device(layer_problem(8, 2, 4096, 14336, 1, 4, 128)) == H200
    sm80 = layer_problem(8, 2, 4096, 14336, 1, 4, 128, device=PLAN_DEVICES["sm80"])
    assert layer_device(sm80).name is None  # no tables: auto never takes cuda there
    named = dataclasses.replace(sm80, options=RunOptions(plan_only=True, device_name="NVIDIA A100"))
    assert layer_device(named).name == "NVIDIA A100"
    assert select_backend(sm80).backend.name == "triton"


# ---------------------------------------------------------------- what runs is what was planned


def test_a_runner_refreshes_every_prepared_tensor_in_place_or_nothing():
    """LayerRunner.refresh_in_place (vLLM's reload_weights, moe_method): every tensor of the layer's weights and of
    each backend's state, nested in dataclasses, dicts and tuples, takes the new runner's values in its own
    storage; a runner of another shape copies nothing."""
    from vllm_wna16_plugin.backends import KernelTensors
    from vllm_wna16_plugin.ops import make_problem

    from .kernels.conftest import make_moe_problem

    def runner(seed, inter=64):
        p = make_moe_problem(M=3, H=128, inter=inter, E=4, top_k=2, bits=4, gs1=32, gs2=32, zp=False,
                             dtype=torch.bfloat16, seed=seed)  # fmt: skip
        args = p.args()
        problem = make_problem(args[0], *args[1:5], args[6], bits=4, group_size=32, has_zero_point=False)
        r = LayerRunner(select_backend(problem, "reference", "test"), KernelTensors(*args[1:5]))
        r.states["reference"] = {"prepared": (r.tensors.w13_scales * 2, {"table": torch.randn(3, 5)}), "n": seed}
        return r

    old, new = runner(1), runner(2)
    tensors = [t for t in (old.tensors.w13_qweight, old.tensors.w2_scales, old.states["reference"]["prepared"][0],
                           old.states["reference"]["prepared"][1]["table"])]  # fmt: skip
    ptrs = [t.data_ptr() for t in tensors]
    assert not torch.equal(old.tensors.w13_qweight, new.tensors.w13_qweight)  # two layers' weights
    assert old.refresh_in_place(new)
    assert [t.data_ptr() for t in tensors] == ptrs
    assert torch.equal(old.tensors.w13_qweight, new.tensors.w13_qweight)
    assert torch.equal(old.tensors.w2_scales, new.tensors.w2_scales)
    assert torch.equal(old.states["reference"]["prepared"][0], new.states["reference"]["prepared"][0])
    assert torch.equal(old.states["reference"]["prepared"][1]["table"], new.states["reference"]["prepared"][1]["table"])
    other = runner(3, inter=96)
    kept = old.tensors.w13_qweight.clone()
    assert not old.refresh_in_place(other) and torch.equal(old.tensors.w13_qweight, kept)
    # a tensor the walk cannot follow (an object's attribute, a partial's argument): no refresh, nothing copied
    import functools
    import types

    for hide in (lambda t: types.SimpleNamespace(table=t), lambda t: functools.partial(torch.add, t)):
        a, b = runner(4), runner(5)
        a.states["reference"]["hidden"], b.states["reference"]["hidden"] = hide(torch.zeros(2)), hide(torch.ones(2))
        kept = a.tensors.w13_qweight.clone()
        assert not a.refresh_in_place(b) and torch.equal(a.tensors.w13_qweight, kept)
    a, b = runner(6), runner(7)  # functions, modules and classes hold none of the layer's tensors
    a.states["reference"]["pieces"] = b.states["reference"]["pieces"] = {"f": torch.add, "m": torch, "t": dict}
    assert a.refresh_in_place(b)


@pytest.mark.interpreter
def test_the_runner_launches_the_configs_its_plan_names(monkeypatch):
    from vllm_wna16_plugin.kernels.triton import fused_moe
    from vllm_wna16_plugin.ops import make_problem
    from vllm_wna16_plugin.reference import fused_moe_wna16_ref

    from .kernels.conftest import assert_close_scaled, make_moe_problem

    p = make_moe_problem(M=5, H=128, inter=64, E=4, top_k=2, bits=4, gs1=32, gs2=32, zp=False, dtype=torch.bfloat16)
    args, kw = p.args(), p.kwargs()
    problem = make_problem(args[0], *args[1:5], args[6], bits=4, group_size=32, has_zero_point=False)
    selection = select_backend(problem, "triton", "test")
    from vllm_wna16_plugin.backends import KernelTensors

    runner = LayerRunner(selection, KernelTensors(*args[1:5]))
    launched = []
    real = fused_moe.invoke_wna16_gemm
    monkeypatch.setattr(fused_moe, "invoke_wna16_gemm", lambda *a, **k: launched.append(k["config"]) or real(*a, **k))
    out = runner.run(args[0], args[5], args[6])
    planned = runner.plan(5)
    assert planned.device == DeviceSpec("interpreter") and planned.backend == "triton"
    assert launched == list(planned.launch.configs)
    assert_close_scaled(out, fused_moe_wna16_ref(*args, **kw), torch.bfloat16, "runner")
    assert runner.plan(5) is planned  # one plan per batch size


@pytest.mark.interpreter
def test_a_tuned_config_dir_in_the_options_is_what_the_plan_and_the_launch_use(tmp_path, monkeypatch):
    from vllm_wna16_plugin.backends import KernelTensors
    from vllm_wna16_plugin.kernels.triton import configs, fused_moe
    from vllm_wna16_plugin.ops import make_problem

    from .kernels.conftest import make_moe_problem

    p = make_moe_problem(M=3, H=128, inter=64, E=4, top_k=2, bits=4, gs1=32, gs2=32, zp=False, dtype=torch.bfloat16)
    args = p.args()
    # the interpreter has no device name; a plan for a named device reads that device's tuned files
    entry = configs.TritonMoEConfig(16, 32, 32, num_warps=2)
    for n, k in ((128, 128), (128, 64)):
        (tmp_path / configs.config_file_name(4, n, k, 32, 4, "GPU X")).write_text(json.dumps({"3": entry.to_dict()}))
    options = RunOptions(explicit=True, device_name="GPU X", kernel=KernelOptions(config_dir=tmp_path))
    problem = dataclasses.replace(
        make_problem(args[0], *args[1:5], args[6], bits=4, group_size=32, has_zero_point=False), options=options
    )
    runner = LayerRunner(select_backend(problem, "triton", "test"), KernelTensors(*args[1:5]))
    planned = runner.plan(3)
    assert planned.launch.configs == (entry, entry)
    assert all(g.source.startswith("tuned E=4") and "at M=3" in g.source for g in planned.gemms)
    launched = []
    real = fused_moe.invoke_wna16_gemm
    monkeypatch.setattr(fused_moe, "invoke_wna16_gemm", lambda *a, **k: launched.append(k["config"]) or real(*a, **k))
    runner.run(args[0], args[5], args[6])
    assert launched == [entry, entry]


def test_a_cuda_layer_under_auto_hands_batches_outside_its_crossover_to_triton(tmp_path, monkeypatch):
    # the composition is the plan's: the cuda backend never calls triton itself
    from vllm_wna16_plugin.backends import KernelTensors
    from vllm_wna16_plugin.backends.cuda import CudaBackend
    from vllm_wna16_plugin.backends.triton import TritonBackend

    monkeypatch.setattr(crossover, "CROSSOVER_DIR", tmp_path)
    E, top_k, H, inter = 4, 2, 256, 128
    crossover.write_crossovers({crossover.layer_key(E, H, inter, 32, 4): {"cuda_m_ranges": [[2, 4]]}}, "GPU X",
                               tmp_path)  # fmt: skip
    problem = layer_problem(E, top_k, H, inter, 1, 4, 32, options=RunOptions(plan_only=True, device_name="GPU X"))
    selection = select_backend(problem)
    assert selection.backend.name == "cuda" and plan_backends(selection) == ("cuda", "triton")
    ran = []
    for cls in (CudaBackend, TritonBackend):
        monkeypatch.setattr(cls, "run", lambda self, *a, plan=None, **k: ran.append((self.name, plan.num_tokens)))
    g = torch.Generator().manual_seed(3)
    tensors = KernelTensors(
        torch.randint(0, 255, (E, 2 * inter, H // 2), dtype=torch.uint8, generator=g),
        torch.randint(0, 255, (E, H, inter // 2), dtype=torch.uint8, generator=g),
        torch.rand(E, 2 * inter, H // 32, generator=g).bfloat16(),
        torch.rand(E, H, inter // 32, generator=g).bfloat16(),
    )
    runner = LayerRunner(selection, tensors)
    assert set(runner.states) == {"cuda", "triton"}
    assert runner.states["cuda"].w13_qweight is tensors.w13_qweight  # the packed weights are shared
    for m in (1, 2, 4, 5):
        ids = torch.randint(0, E, (m, top_k), generator=g, dtype=torch.int32)
        runner.run(torch.randn(m, H).bfloat16(), torch.rand(m, top_k), ids)
    assert ran == [("triton", 1), ("cuda", 2), ("cuda", 4), ("triton", 5)]
    assert set(registry()) >= {"cuda", "triton"}


def test_float32_activations_never_reach_a_half_precision_kernel():
    """vLLM lets a float32 model ask for moe_wna16_plus (get_supported_act_dtypes); every GPU kernel computes in
    bf16/fp16, so auto runs such a layer on reference, and an explicit GPU backend is refused at load."""
    problem = dataclasses.replace(layer_problem(128, 8, 2048, 768, 1, 4, 128), act_dtype=torch.float32)
    selection = select_backend(problem)
    assert selection.backend.name == "reference"
    refused = {v.backend: v.reason for v in selection.verdicts if not v.ok}
    for name in ("triton", "cuda", "marlin", "vllm_cuda", "humming"):
        assert name in refused and "activations are float32" in refused[name], (name, refused)
    with pytest.raises(ValueError, match="activations are float32; this kernel takes bfloat16 or float16"):
        select_backend(problem, "triton", "test")


@pytest.mark.parametrize(
    "H, inter, tp, gs, gemm, group",
    [
        pytest.param(96, 48, 1, 24, "w13", 24, id="gs24"),  # neither a power of two nor a multiple of 16
        pytest.param(240, 80, 1, 40, "w13", 40, id="gs40"),
        pytest.param(96, 144, 2, 48, "w2", 24, id="gs48-tp2-regrouped-24"),  # 72 rows per rank: gcd(48, 72) = 24
    ],
)
def test_groups_no_triton_tile_can_hold_go_to_reference_with_the_reason(H, inter, tp, gs, gemm, group):
    # they load (the regrouping only needs g >= 16); before, triton took them and failed at the first forward
    problem = layer_problem(4, 2, H, inter, tp, 4, gs)
    assert problem is not None
    reason = registry()["triton"].incompatibility_reason(problem)
    assert reason and f"{gemm} group size {group} " in reason and "power of two nor a multiple of 16" in reason
    selection = select_backend(problem)
    assert selection.backend.name == "reference", selection.explain()
    assert f"group size {group}" in selection.explain()
    # a power of two below 16 and multiples of 16 that are not powers of two keep the kernel
    for fine in (8, 48):
        ok = dataclasses.replace(problem, hidden=96, intermediate=48, group_size_w13=fine, group_size_w2=fine)
        assert registry()["triton"].incompatibility_reason(ok) is None


# ---------------------------------------------------------------- odd shapes no table was tuned for

# Hidden sizes and per-rank intermediate sizes of real MoE models after tensor-parallel splits, biased to the
# K and N tails no tuned table covers (a shape sweep of 2026-12-06: every plan legal on sm90, sm80 and the
# interpreter, every interpreter run within the tolerance below).
ODD_HIDDEN = (1536, 2048, 2560, 2880, 3584, 4096, 5120, 6144, 7168)
ODD_INTER = (64, 96, 128, 176, 192, 320, 352, 384, 704, 720, 768, 1408, 2816)
ODD_GROUPS = (32, 64, 128, CHANNELWISE)


def _odd_layer(rng, hidden, inter, bits=None, gs=None, act_order=None):
    """A random layer of the given sizes as the plugin builds it for one rank (or None where loading refuses it):
    (scheme, tp, MoEProblem kwargs without E and the device). bits, gs, act_order: drawn unless given."""
    tp, bits, gs = rng.choice((1, 1, 2, 4)), bits or rng.choice((4, 8)), gs or rng.choice(ODD_GROUPS)
    act_order = gs != CHANNELWISE and (rng.random() < 0.25 if act_order is None else act_order)
    scheme = WNA16Scheme(bits, gs, rng.random() < 0.5, PackFormat.GPTQ, desc_act=act_order, source="test")
    try:
        gs13 = effective_group_size(scheme, hidden, layer="gate/up")
        gs2 = effective_group_size(scheme, inter, layer="down", tp_size=tp, full_size_k=inter * tp)
    except ValueError as exc:  # refused at build, with the TP sizes that would work
        assert "tensor-parallel sizes that work" in str(exc) or "at any tensor-parallel size" in str(exc)
        return None
    kw = dict(scheme=scheme, hidden=hidden, intermediate=inter, group_size_w13=gs13, group_size_w2=gs2,
              act_dtype=rng.choice((torch.bfloat16, torch.float16)), has_g_idx=act_order,
              act_order_padded=act_order and tp > 1)  # fmt: skip
    return scheme, tp, kw


@pytest.mark.interpreter
def test_odd_real_shapes_plan_legally_everywhere_and_run_right_in_the_interpreter():
    import random

    from vllm_wna16_plugin.kernels.triton.fused_moe import fused_moe_wna16_triton
    from vllm_wna16_plugin.reference import fused_moe_wna16_ref

    from .kernels.conftest import assert_close_scaled, quantized_experts

    rng = random.Random(20261206)
    planned = 0
    for _ in range(40):  # plans: any E, top_k and expert-parallel split, every device, every batch size of the sweep
        layer = _odd_layer(rng, rng.choice(ODD_HIDDEN), rng.choice(ODD_INTER))
        if layer is None:
            continue
        top_k = rng.choice((1, 2, 4, 6, 8, 10))
        e_global = rng.choice([e for e in (8, 16, 40, 60, 64, 128, 256, 512) if e >= top_k])
        e_local = e_global // rng.choice((1, 1, 2, 4))
        for name in ("sm90", "sm80", "interpreter"):
            device = PLAN_DEVICES.get(name, DeviceSpec("interpreter"))
            problem = MoEProblem(**layer[2], num_experts=e_local, global_num_experts=e_global, top_k=top_k,
                                 use_ep=e_local < e_global, platform="cpu" if name == "interpreter" else "cuda",
                                 sm=device.sm, options=PLAN_ONLY if name != "interpreter" else RunOptions())  # fmt: skip
            for requested in ("auto", "triton", "cuda"):
                try:
                    selection = select_backend(problem, requested, "test")
                except ValueError as exc:  # an explicit backend that cannot run it says why
                    assert requested != "auto" and "cannot run" in str(exc)
                    continue
                for m in (1, 2, 3, 5, 17, 33, 65, 130, 257):
                    p = plan(problem, m, device, selection=selection)
                    assert "why: layer backend" in p.describe()
                    if p.backend == "triton":
                        for choice, k, gs in ((p.launch.gemm1, problem.hidden, problem.group_size_w13),
                                              (p.launch.gemm2, problem.intermediate, problem.group_size_w2)):  # fmt: skip
                            choice.config.check_shape(k, gs)  # what the launcher checks
                    elif p.backend == "cuda" and extension_error() is None:
                        for cfg, k, gs in ((p.launch.gemm1, problem.hidden, problem.group_size_w13),
                                           (p.launch.gemm2, problem.intermediate, problem.group_size_w2)):  # fmt: skip
                            assert launch_config_error(k, k // gs, cfg, problem.scheme.bits) == ""
                    planned += 1
    assert planned > 1000, planned

    ran = 0
    kinds = ((4, 32, True), (8, 64, False), (4, 128, False), (4, CHANNELWISE, False))  # (bits, group, act order)
    while ran < len(kinds):  # the interpreter: small E and few tokens, the real K and N tails
        layer = _odd_layer(rng, rng.choice(ODD_HIDDEN[:4]), rng.choice((96, 176, 320, 352)), *kinds[ran])
        if layer is None or layer[1] > 1 and layer[0].desc_act:  # act order on a TP rank: tests/kernels/test_act_order
            continue
        scheme, _, kw = layer
        bits, dtype, E, m = scheme.bits, kw["act_dtype"], 4, rng.choice((1, 2, 3))
        top_k = rng.choice((1, 2)) if m == 1 else 1  # at most 3 routed pairs: the interpreter runs a program at a time
        gen = torch.Generator().manual_seed(ran)
        w13 = quantized_experts(E, 2 * kw["intermediate"], kw["hidden"], bits, kw["group_size_w13"],
                                scheme.has_zero_point, dtype, gen)  # fmt: skip
        w2 = quantized_experts(E, kw["hidden"], kw["intermediate"], bits, kw["group_size_w2"], scheme.has_zero_point,
                               dtype, gen)  # fmt: skip
        g13 = g2 = None
        if scheme.desc_act:
            g = torch.stack([torch.randperm(kw["hidden"], generator=gen) // kw["group_size_w13"] for _ in range(E)])
            g13 = torch.stack([g, g], 1).to(torch.int32)
            g2 = torch.stack([torch.randperm(kw["intermediate"], generator=gen) // kw["group_size_w2"]
                              for _ in range(E)]).to(torch.int32)  # fmt: skip
        tensors = KernelTensors(w13.qweight, w2.qweight, w13.scales, w2.scales, w13.qzeros, w2.qzeros, g13, g2)
        e_global = 2 * E if rng.random() < 0.5 else E  # expert-parallel: half the experts elsewhere
        expert_map = None
        logits = torch.randn(m, e_global, generator=gen)
        if e_global > E:
            expert_map = torch.full((e_global,), -1, dtype=torch.int32)
            local = torch.randperm(e_global, generator=gen)[:E]
            expert_map[local] = torch.arange(E, dtype=torch.int32)
            logits[0, local[0]] += 10.0  # token 0 picks a local expert
        weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
        ids = ids.to(torch.int32)
        x = torch.randn(m, kw["hidden"], generator=gen).to(dtype)
        ref = fused_moe_wna16_ref(x, *tensors.weights(), weights, ids, bits=bits, w13_qzeros=w13.qzeros,
                                  w2_qzeros=w2.qzeros, expert_map=expert_map, w13_g_idx=g13, w2_g_idx=g2)  # fmt: skip
        problem = MoEProblem(**kw, num_experts=E, global_num_experts=e_global, top_k=top_k, use_ep=e_global > E)
        runner = LayerRunner(select_backend(problem, "triton", "test"), tensors)
        what = f"{problem.describe()}, M={m}"
        ran += 1
        if ran % 2:
            assert_close_scaled(runner.run(x, weights, ids, expert_map), ref, dtype, f"interpreter plan: {what}")
            continue
        # the tiles an H200 plans for the model's own expert count (tuned tables or the heuristic)
        real = dataclasses.replace(problem, num_experts=128, global_num_experts=128, platform="cuda", sm=90,
                                   options=PLAN_ONLY)  # fmt: skip
        configs = plan(real, m, H200, selection=select_backend(real, "triton", "test")).launch.configs
        s = runner.tensors
        out = fused_moe_wna16_triton(x, *s.weights(), weights, ids, bits=bits, w13_qzeros=s.w13_qzeros,
                                     w2_qzeros=s.w2_qzeros, expert_map=expert_map, global_num_experts=e_global,
                                     a_perm=s.a_perm, configs=configs, use_td=False)  # fmt: skip
        assert_close_scaled(out, ref, dtype, f"sm90 plan {configs}: {what}")


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    "m, top_k, zp, ep", [(3, 2, False, False), (5, 1, True, False), (4, 2, False, True)], ids=["m3", "m5-zp", "m4-ep"]
)
def test_vllm_padding_rows_add_nothing_to_the_real_rows(backend, m, top_k, zp, ep):
    """vLLM 0.34's routers give CUDA-graph and DP padding rows expert id -1 (VLLM_MOE_SKIP_PADDING, on by default;
    a graph capture's dummy batch is all padding). The runner (the hot path: it trusts the router, no validation)
    must skip those pairs, with an expert_map too (expert parallelism: -1 must not index the map), and the real
    rows must come out as the reference computes them without the padding. (The GPU backends:
    tests/kernels/test_backends_gpu.py.)"""
    from tests.kernels.conftest import assert_close_scaled, make_moe_problem
    from vllm_wna16_plugin.ops import make_problem
    from vllm_wna16_plugin.reference import fused_moe_wna16_ref

    e_local = 4
    p = make_moe_problem(M=m, H=64, I=64, E=e_local, top_k=top_k, bits=4, gs1=32, zp=zp, seed=m,
                         num_global_experts=2 * e_local if ep else None)  # fmt: skip
    x, w13, w2, s13, s2, topk_w, topk_ids = p.args()
    zeros = dict(w13_qzeros=p.w13.qzeros, w2_qzeros=p.w2.qzeros)
    expert_map = None
    if ep:  # the odd global experts on this rank, the even ones elsewhere; token 0 keeps a local one
        expert_map = torch.full((2 * e_local,), -1, dtype=torch.int32)
        expert_map[1::2] = torch.arange(e_local, dtype=torch.int32)
        topk_ids[0, 0] = 1 if topk_ids[0, 1:].ne(1).all() else 3
    problem = make_problem(x, w13, w2, s13, s2, topk_ids, bits=4, group_size=32, has_zero_point=zp,
                           expert_map=expert_map, **zeros)  # fmt: skip
    runner = LayerRunner(select_backend(problem, backend, "test"), KernelTensors(w13, w2, s13, s2, **zeros))
    real = m - 2
    padded = topk_ids.clone()
    padded[real:] = -1
    out = runner.run(x, topk_w, padded, expert_map)
    ref = fused_moe_wna16_ref(x[:real], w13, w2, s13, s2, topk_w[:real], topk_ids[:real], bits=4,
                              expert_map=expert_map, **zeros)  # fmt: skip
    assert_close_scaled(out[:real], ref, torch.bfloat16, f"{backend}: M={m}, 2 padding rows")
    if backend == "reference":  # it adds nothing for a padding pair: a row of padding only is zero
        assert not out[real:].any(), "reference: a padding row is not zero"
    runner.run(x, topk_w, padded.fill_(-1), expert_map)  # a capture's dummy batch: all padding
