"""The plugin's CUDA kernel (csrc/) on the GPU: against the float reference, every config kind, graphs, errors.

Skipped without CUDA or without the built extension. The reference is
reference.fused_moe_wna16_ref (float32 torch) and dequantize_ref, independent of every kernel.
The data is fresh random data for each case.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.kernels.conftest import assert_close_scaled, make_moe_problem, quantized_experts
from vllm_wna16_plugin.kernels.cuda_ops import extension_error, fused_moe_wna16_cuda, invoke_moe_wna16_gemm
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
    pytest.param(64, 1024, 512, 8, 2, 8, 128, 128, True, BF16, id="int8-gs128-zp"),
    pytest.param(7, 1024, 176, 8, 2, 4, -1, -1, True, FP16, id="channelwise-K176-tp4"),  # 704/4: 8-byte vectors
    pytest.param(2, 1024, 200, 8, 2, 4, -1, -1, False, BF16, id="channelwise-K200"),  # 4-byte vectors
    pytest.param(33, 512, 256, 64, 6, 4, 64, 64, True, FP16, id="gs64-zp-fp16"),
    pytest.param(17, 1024, 512, 16, 4, 8, 32, 32, False, FP16, id="int8-sym-gs32-fp16"),
    pytest.param(2, 768, 384, 8, 2, 8, -1, -1, False, BF16, id="int8-sym-channelwise"),
]


@pytest.mark.parametrize("M, H, I, E, top_k, bits, gs1, gs2, zp, dtype", CASES)
def test_cuda_layer_matches_reference(M, H, I, E, top_k, bits, gs1, gs2, zp, dtype):  # noqa: E741
    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=bits, gs1=gs1, gs2=gs2, zp=zp, dtype=dtype, seed=M)
    args, kw = _cuda(p)
    out = fused_moe_wna16_cuda(*args, **kw, align_fn=_align())
    ref = fused_moe_wna16_ref(*args, **kw)
    assert_close_scaled(out.cpu(), ref.cpu(), dtype, "cuda layer")


def test_expert_map_and_router_weight_on_input():
    p = make_moe_problem(M=6, H=512, I=128, E=4, top_k=1, bits=4, gs1=32, zp=True, num_global_experts=8, seed=3)
    args, kw = _cuda(p)
    expert_map = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    expert_map[torch.tensor([1, 2, 5, 6])] = torch.arange(4, dtype=torch.int32, device="cuda")
    for on_input in (False, True):
        out = fused_moe_wna16_cuda(*args, **kw, align_fn=_align(), expert_map=expert_map,
                                   apply_router_weight_on_input=on_input)  # fmt: skip
        ref = fused_moe_wna16_ref(*args, **kw, expert_map=expert_map, apply_router_weight_on_input=on_input)
        assert_close_scaled(out.cpu(), ref.cpu(), BF16, f"expert_map, weight on input={on_input}")


@pytest.mark.parametrize("block_m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("block_n", [32, 128, 256, 1024])
@pytest.mark.parametrize("bits,gs,block_k", [(4, 32, 256), (4, 128, 128), (8, -1, 64)])
def test_every_config_kind_computes_the_gemm(block_m, block_n, bits, gs, block_k):
    # one GEMM (N=1536, K=1024) under each BLOCK_SIZE_M / BLOCK_SIZE_N the module can produce
    from vllm_wna16_plugin.block_config import BlockConfig

    E, N, K, M, top_k = 16, 1536, 1024, 9, 4
    gen = torch.Generator().manual_seed(block_m * 7 + block_n)
    kw = quantized_experts(E, N, K, bits, gs, True, BF16, gen)
    a = torch.randn(M, K, generator=gen).to(BF16).cuda()
    ids = torch.randint(0, E, (M, top_k), generator=gen, dtype=torch.int32).cuda()
    weights = torch.rand(M * top_k, generator=gen).cuda()
    cfg = BlockConfig(block_m, block_n, block_k, K, 32 if gs == -1 else gs)
    sorted_ids, expert_ids, npp = _align()(ids, block_m, E, None, ignore_invalid_experts=True)
    c = torch.full((M * top_k, N), float("nan"), dtype=BF16, device="cuda")
    invoke_moe_wna16_gemm(a, kw.qweight.cuda(), kw.scales.cuda(), kw.qzeros.cuda(), c, weights, sorted_ids,
                          expert_ids, npp, bits=bits, top_k=top_k, config=cfg)  # fmt: skip
    w = dequantize_ref(kw.qweight, kw.scales, kw.qzeros, bits).cuda()  # (E, N, K) float32
    pairs = torch.arange(M * top_k, device="cuda")
    ref = torch.einsum("pk,pnk->pn", a.float()[pairs // top_k], w[ids.reshape(-1).long()]) * weights[:, None]
    assert_close_scaled(c.cpu(), ref.cpu(), BF16, f"BLOCK {block_m}x{block_n}x{block_k}")


def test_decode_step_captures_in_a_cuda_graph():
    p = make_moe_problem(M=4, H=2048, I=512, E=32, top_k=8, bits=4, gs1=32, seed=11)
    args, kw = _cuda(p)
    align = _align()
    fused_moe_wna16_cuda(*args, **kw, align_fn=align)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_wna16_cuda(*args, **kw, align_fn=align)
    args[0].copy_(torch.randn_like(args[0]))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_scaled(out.cpu(), fused_moe_wna16_ref(*args, **kw).cpu(), BF16, "graph replay")


def test_bad_input_is_refused_before_the_launch():
    p = make_moe_problem(M=2, H=256, I=128, E=4, top_k=2, bits=4, gs1=32, seed=5)
    args, kw = _cuda(p)
    bad_ids = args[6].clone()
    bad_ids[0, 0] = 4  # E = 4: out of range
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        fused_moe_wna16_cuda(*args[:6], bad_ids, **kw, align_fn=_align())
    wrong_dtype = list(args)
    wrong_dtype[3] = args[3].float()  # scales in float32, activations in bf16
    with pytest.raises(RuntimeError, match="scales must be a contiguous"):
        fused_moe_wna16_cuda(*wrong_dtype, **kw, align_fn=_align())


SANITIZED = textwrap.dedent(
    """
    import torch
    from tests.kernels.conftest import make_moe_problem
    from vllm_wna16_plugin import _vllm
    from vllm_wna16_plugin.kernels.cuda_ops import fused_moe_wna16_cuda
    p = make_moe_problem(M=3, H=1344, I=256, E=8, top_k=2, bits=4, gs1=32, zp=True, seed=1)
    args = [t.cuda() for t in p.args()]
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in p.kwargs().items()}
    fused_moe_wna16_cuda(*args, **kw, align_fn=_vllm.moe_align_block_size_fn())
    torch.cuda.synchronize()
    """
)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_is_clean(tool):
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer is not on PATH")
    # only our kernel: torch's and Triton's own kernels are not ours to vouch for
    cmd = [exe, f"--tool={tool}", "--error-exitcode=99", "--kernel-name", "kns=moe_wna16_gemv",
           sys.executable, "-c", SANITIZED]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr


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
