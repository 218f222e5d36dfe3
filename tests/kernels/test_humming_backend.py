"""The `humming` backend: its rules and torch fallbacks on CPU; on the GPU, against the float reference.

The GPU tests need humming-kernels 0.1.19 (skipped otherwise). Each weight configuration is
prepared once (Humming JIT-compiles its kernels at prepare's warm-up forward, every M bucket at
once) and then run at M = 1, 5, 64, 300: int4/int8, symmetric/zero points, group sizes
32/64/128 and channel-wise, bf16 and fp16, one shape that Humming pads (H=448, I=320), an
expert-parallel case (expert_map) and a CUDA-graph capture right after prepare.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from tests.kernels.conftest import assert_close_scaled, make_moe_problem
from vllm_wna16_plugin.backends.base import KernelTensors, MoEProblem, RunOptions
from vllm_wna16_plugin.backends.humming import HummingBackend, humming_api_error, torch_align, torch_weighted_sum
from vllm_wna16_plugin.ops import make_problem
from vllm_wna16_plugin.reference import fused_moe_wna16_ref
from vllm_wna16_plugin.scheme import CHANNELWISE, PackFormat, WNA16Scheme

BACKEND = HummingBackend()
REPO = Path(__file__).resolve().parents[2]


def _problem(
    *, bits=4, gs=128, zp=False, H=2048, I=768, E=8, top_k=2, dtype=torch.bfloat16,  # noqa: E741
    platform="cuda", sm=90, plan_only=True, **fields,
) -> MoEProblem:  # fmt: skip
    scheme = WNA16Scheme(bits, gs, zp, PackFormat.GPTQ, source="test")
    return MoEProblem(
        scheme=scheme,
        hidden=H,
        intermediate=I,
        num_experts=E,
        global_num_experts=fields.pop("global_num_experts", E),
        top_k=top_k,
        group_size_w13=scheme.group_size_for(H),
        group_size_w2=scheme.group_size_for(I),
        act_dtype=dtype,
        platform=platform,
        sm=sm,
        options=RunOptions(plan_only=plan_only),
        **fields,
    )


# ------------------------------------------------------------------ rules (CPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "gs, H, I",
    [
        (16, 2048, 768),
        (32, 1344, 1024),  # K=1344 is padded to 1408, a multiple of 32
        (64, 2048, 768),
        (128, 2048, 768),
        (CHANNELWISE, 2816, 352),  # gemma-4 compressed-tensors at TP2
        (CHANNELWISE, 2048, 96),  # Qwen3-30B-A3B at TP8
    ],
)
def test_accepts_what_humming_runs(gs, H, I, bits, zp, dtype):  # noqa: E741
    assert BACKEND.incompatibility_reason(_problem(bits=bits, gs=gs, zp=zp, H=H, I=I, dtype=dtype)) is None


def test_accepts_fp16_on_turing_and_unknown_sm():
    assert BACKEND.incompatibility_reason(_problem(sm=75, dtype=torch.float16)) is None
    assert BACKEND.incompatibility_reason(_problem(sm=None)) is None


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        pytest.param({"platform": "cpu", "sm": None}, "needs an NVIDIA GPU (platform is cpu)", id="cpu"),
        pytest.param({"platform": "rocm", "sm": None}, "needs an NVIDIA GPU (platform is rocm)", id="rocm"),
        pytest.param({"sm": 70, "dtype": torch.float16}, "needs sm75+", id="sm70"),
        pytest.param({"sm": 75}, "bf16 activations need sm80+", id="bf16-sm75"),
        pytest.param({"dtype": torch.float32}, "activations are float32", id="fp32"),
        pytest.param({"has_g_idx": True}, "act order", id="act-order"),
        pytest.param({"apply_router_weight_on_input": True}, "router weight on the input", id="int4-router-on-input"),
        pytest.param(
            {"bits": 8, "zp": True, "apply_router_weight_on_input": True},
            "router weight on the input",
            id="int8-zp-router-on-input",
        ),
        pytest.param({"activation": "relu2"}, "activation 'relu2'", id="relu2"),
        pytest.param({"gs": CHANNELWISE, "H": 1004}, "hidden size 1004 is not a multiple of 8", id="H1004"),
        pytest.param({"gs": CHANNELWISE, "I": 100}, "intermediate size on this rank 100", id="I100"),
        pytest.param({"gs": 8}, "w13 group size 8 is not a multiple of 16", id="gs8"),
        pytest.param({"gs": 24, "H": 2016, "I": 768}, "w13 group size 24 is not a multiple of 16", id="gs24"),
        pytest.param(
            {"gs": 48, "H": 1152, "I": 144}, "w2 group size 48 does not divide K=144 padded to 256", id="gs48"
        ),
    ],
)
def test_refuses_with_a_reason(kwargs, expected):
    reason = BACKEND.incompatibility_reason(_problem(**kwargs))
    assert isinstance(reason, str) and expected in reason, reason


def test_plan_only_skips_the_import_check(monkeypatch):
    monkeypatch.setitem(sys.modules, "humming", None)  # humming cannot be imported
    assert BACKEND.incompatibility_reason(_problem(plan_only=True)) is None
    assert "humming-kernels is not installed" in BACKEND.incompatibility_reason(_problem(plan_only=False))


@pytest.mark.parametrize("version", ["0.1.10", "0.1.17", None])  # None: metadata unreadable, the import decides
def test_refuses_humming_without_the_0_1_19_api(monkeypatch, version):
    """Whatever humming-kernels this environment has (vLLM 0.28-0.32 pin 0.1.12-0.1.17): the installed version
    is faked as well as the module, so the refusal is the one a user of that version sees."""
    import vllm_wna16_plugin.backends.humming as humming

    old = types.ModuleType("humming")  # humming 0.1.10 (vLLM 0.26's pin) has no humming.forward
    old.__version__ = version or "0.1.10"
    monkeypatch.setitem(sys.modules, "humming", old)
    monkeypatch.setitem(sys.modules, "humming.forward", None)
    monkeypatch.setattr(humming, "_installed_humming_version", lambda: version)
    reason = BACKEND.incompatibility_reason(_problem(plan_only=False))
    shown = version or "0.1.10"  # the module's own __version__ where the metadata says nothing
    assert f"humming-kernels {shown} is installed" in reason and "humming-kernels==0.1.19" in reason, reason
    assert "0.1.17 (vLLM 0.32)" in reason and "0.1.19 (vLLM 0.33-0.34)" in reason and "))" not in reason, reason


def test_never_raises_with_the_humming_installed_here():
    """Whatever humming this environment has (none, vLLM 0.26's 0.1.10, 0.1.19): a reason or None."""
    for problem in (_problem(plan_only=False), _problem(plan_only=False, sm=None, dtype=torch.float16)):
        reason = BACKEND.incompatibility_reason(problem)
        assert reason is None or (isinstance(reason, str) and reason)
        if reason is None:
            assert humming_api_error() is None


def test_module_imports_without_humming():
    code = (
        "import sys; sys.modules['humming'] = None\n"
        "import vllm_wna16_plugin.backends.humming as h\n"
        "assert 'humming' not in {m.split('.')[0] for m, v in sys.modules.items() if v is not None}\n"
        "print(h.humming_api_error())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "humming-kernels is not installed" in res.stdout


# ------------------------------------------------------------------ torch fallbacks (CPU)


def _align_by_loop(topk_ids, block_size, num_local, expert_map):
    """Route ids grouped by local expert in route order, each group padded with the sentinel."""
    flat = topk_ids.reshape(-1).long()
    local = flat if expert_map is None else expert_map.long()[flat]
    ids, experts = [], []
    for e in range(num_local):
        part = torch.nonzero(local == e).flatten().tolist()
        blocks = math.ceil(len(part) / block_size)
        ids += part + [flat.numel()] * (blocks * block_size - len(part))
        experts += [e] * blocks
    return ids, experts


@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("ep", [False, True], ids=["all-local", "expert-map"])
@pytest.mark.parametrize("M, top_k", [(1, 2), (5, 4), (300, 8)])
def test_torch_align_groups_routes_by_local_expert(M, top_k, ep, block_size):
    gen = torch.Generator().manual_seed(M * 31 + top_k + block_size)
    e_global, e_local = (32, 8) if ep else (16, 16)
    topk_ids = torch.stack([torch.randperm(e_global, generator=gen)[:top_k] for _ in range(M)]).to(torch.int32)
    expert_map = None
    if ep:
        expert_map = torch.full((e_global,), -1, dtype=torch.int32)
        expert_map[torch.randperm(e_global, generator=gen)[:e_local]] = torch.arange(e_local, dtype=torch.int32)
    sorted_ids, expert_ids, padded = torch_align(topk_ids, block_size, e_global, expert_map)
    ids, experts = _align_by_loop(topk_ids, block_size, e_local, expert_map)
    total = int(padded.item())
    assert padded.dtype == sorted_ids.dtype == expert_ids.dtype == torch.int32
    assert total == len(ids) and total % block_size == 0
    assert sorted_ids.numel() % block_size == 0 and expert_ids.numel() * block_size >= sorted_ids.numel() >= total
    assert sorted_ids[:total].tolist() == ids
    assert expert_ids[: total // block_size].tolist() == experts
    assert (sorted_ids[total:] == topk_ids.numel()).all()


def test_torch_weighted_sum_masks_routes_to_other_ranks():
    gen = torch.Generator().manual_seed(3)
    M, top_k, H = 6, 3, 16
    down = torch.randn(M, top_k, H, generator=gen).bfloat16()
    weights = torch.rand(M, top_k, generator=gen)
    topk_ids = torch.randint(0, 8, (M, top_k), generator=gen, dtype=torch.int32)
    expert_map = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)
    down[(expert_map[topk_ids.long()] < 0)] = float("nan")  # GEMM2 never writes rows of other ranks' routes
    out = torch.empty(M, H, dtype=torch.bfloat16)
    torch_weighted_sum(down, weights, topk_ids, expert_map, out)
    keep = (expert_map[topk_ids.long()] >= 0).float()
    ref = (torch.nan_to_num(down.float()) * (weights * keep).unsqueeze(-1)).sum(1)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------ GPU: against the float reference


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    bits: int
    gs: int
    zp: bool
    dtype: torch.dtype
    H: int = 512
    I: int = 256  # noqa: E741
    E: int = 8
    top_k: int = 2


CASES = [
    Case("int4-g32-zp-bf16", 4, 32, True, torch.bfloat16),
    Case("int4-g64-sym-fp16-padded", 4, 64, False, torch.float16, H=448, I=320),  # N and K both padded
    Case("int4-g128-sym-bf16", 4, 128, False, torch.bfloat16),
    Case("int4-channelwise-zp-fp16", 4, CHANNELWISE, True, torch.float16),
    Case("int8-g32-sym-fp16", 8, 32, False, torch.float16),
    Case("int8-g64-zp-bf16", 8, 64, True, torch.bfloat16),
    Case("int8-g128-zp-fp16", 8, 128, True, torch.float16),
    Case("int8-channelwise-sym-bf16", 8, CHANNELWISE, False, torch.bfloat16),
]
MAIN = CASES[2]
GRAPH = Case("int4-g128-sym-bf16-graph", 4, 128, False, torch.bfloat16, H=768, I=384, E=16, top_k=4)
MS = [1, 5, 64, 300]

_PREPARED: dict[str, tuple[MoEProblem, KernelTensors, object]] = {}


@pytest.fixture(scope="module")
def humming_ready():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    error = humming_api_error()
    if error is not None:
        pytest.skip(error)


def _cuda(t):
    return None if t is None else t.cuda()


def _prepared(case: Case):
    """(problem, kernel-layout tensors, humming state) of a case: prepared once per test session."""
    if case.id not in _PREPARED:
        p = make_moe_problem(
            M=1, H=case.H, I=case.I, E=case.E, top_k=case.top_k, bits=case.bits, gs1=case.gs, zp=case.zp,
            dtype=case.dtype, seed=len(case.id) * 7 + case.bits,
        )  # fmt: skip
        tensors = KernelTensors(
            _cuda(p.w13.qweight), _cuda(p.w2.qweight), _cuda(p.w13.scales), _cuda(p.w2.scales),
            _cuda(p.w13.qzeros), _cuda(p.w2.qzeros),
        )  # fmt: skip
        problem = make_problem(
            _cuda(p.x), tensors.w13_qweight, tensors.w2_qweight, tensors.w13_scales, tensors.w2_scales,
            _cuda(p.topk_ids), bits=case.bits, group_size=case.gs, has_zero_point=case.zp,
        )  # fmt: skip
        reason = BACKEND.incompatibility_reason(problem)
        assert reason is None, reason
        start = time.perf_counter()
        state = BACKEND.prepare(problem, tensors)
        torch.cuda.synchronize()
        print(
            f"\n[humming] prepare {case.id}: {time.perf_counter() - start:.1f} s "
            f"(warm-up forward incl. JIT {state.warmup_s:.1f} s; align/sum: {state.pieces})",
            flush=True,
        )
        _PREPARED[case.id] = (problem, tensors, state)
    return _PREPARED[case.id]


def _routing(M: int, case: Case, num_global_experts: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, case.H, generator=gen).to(case.dtype)
    logits = torch.randn(M, num_global_experts, generator=gen)
    topk_weights, topk_ids = torch.topk(logits.softmax(-1), case.top_k, dim=-1)
    return x.cuda(), topk_weights.cuda(), topk_ids.to(torch.int32).cuda()


def _reference(case: Case, tensors: KernelTensors, x, topk_weights, topk_ids, expert_map=None):
    """float32 torch on the GPU (reference.py): independent of every kernel."""
    return fused_moe_wna16_ref(
        x, *tensors.weights(), topk_weights, topk_ids, bits=case.bits, w13_qzeros=tensors.w13_qzeros,
        w2_qzeros=tensors.w2_qzeros, expert_map=expert_map,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case, M", [pytest.param(c, m, id=f"{c.id}-M{m}") for c in CASES for m in MS])
def test_gpu_humming_matches_reference(humming_ready, case, M):
    problem, tensors, state = _prepared(case)
    x, topk_weights, topk_ids = _routing(M, case, case.E, seed=M * 101 + case.bits)
    out = BACKEND.run(problem, state, x, topk_weights, topk_ids)
    torch.cuda.synchronize()
    assert out.shape == x.shape and out.dtype == case.dtype
    ref = _reference(case, tensors, x, topk_weights, topk_ids)
    assert_close_scaled(out.cpu(), ref.cpu(), case.dtype, f"humming {case.id} M={M}")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [5, 64, 300])
def test_gpu_humming_expert_map(humming_ready, M):
    """Expert parallelism: 8 of 32 global experts on this rank; routes to the others add nothing."""
    problem, tensors, state = _prepared(MAIN)
    e_global = 32
    gen = torch.Generator().manual_seed(M)
    expert_map = torch.full((e_global,), -1, dtype=torch.int32)
    expert_map[torch.randperm(e_global, generator=gen)[: MAIN.E]] = torch.arange(MAIN.E, dtype=torch.int32)
    expert_map = expert_map.cuda()
    ep_problem = dataclasses.replace(problem, global_num_experts=e_global, use_ep=True)
    assert BACKEND.incompatibility_reason(ep_problem) is None
    x, topk_weights, topk_ids = _routing(M, MAIN, e_global, seed=M + 7)
    to_local0 = int((expert_map == 0).nonzero()[0])  # token 0 reaches this rank at least once
    if to_local0 not in topk_ids[0].tolist():
        topk_ids[0, 0] = to_local0
    out = BACKEND.run(ep_problem, state, x, topk_weights, topk_ids, expert_map=expert_map)
    torch.cuda.synchronize()
    ref = _reference(MAIN, tensors, x, topk_weights, topk_ids, expert_map)
    assert_close_scaled(out.cpu(), ref.cpu(), MAIN.dtype, f"humming expert_map M={M}")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 64, 200])
def test_gpu_humming_captures_in_cuda_graph_right_after_prepare(humming_ready, M):
    """A shape no other test compiles, captured with no eager run after prepare (the first M right after
    its warm-up; each M likely uses M buckets of kernels that the warm-up compiled but never launched)."""
    problem, tensors, state = _prepared(GRAPH)
    x, topk_weights, topk_ids = _routing(M, GRAPH, GRAPH.E, seed=M)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = BACKEND.run(problem, state, x, topk_weights, topk_ids)
    for seed in (M + 1, M + 2):  # fresh inputs in the captured buffers
        new_x, new_w, new_ids = _routing(M, GRAPH, GRAPH.E, seed=seed)
        x.copy_(new_x)
        topk_weights.copy_(new_w)
        topk_ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(GRAPH, tensors, x, topk_weights, topk_ids)
        assert_close_scaled(out.cpu(), ref.cpu(), GRAPH.dtype, f"humming graph M={M} replay seed={seed}")
