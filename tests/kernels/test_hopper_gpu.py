"""The hopper backend (CUTLASS's sm90 grouped GEMM, kernels/hopper_ops.py) against the float reference on an sm90
GPU with the extension built (skipped elsewhere): every built token tile in bf16 and fp16, int4 symmetric and with
zero points (run as int8 q - z) and symmetric int8, group sizes 64 / 128 and channel-wise, experts with no rows, M from 1 to prefill, vLLM's padding rows,
CUDA-graph capture and replay on new inputs, auto's plan handing it the batches its rule takes, and
compute-sanitizer memcheck / racecheck of its kernels."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.kernels.conftest import assert_close_scaled, make_moe_problem
from vllm_wna16_plugin.backends import KernelTensors, RunOptions
from vllm_wna16_plugin.ops import fused_moe_wna16, make_problem
from vllm_wna16_plugin.reference import fused_moe_wna16_ref

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _skip_without_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    from vllm_wna16_plugin.kernels.hopper_ops import extension_error

    if reason := extension_error():
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _hopper():
    _skip_without_hopper()


def _cuda(p):
    args = [t.cuda() for t in p.args()]
    kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in p.kwargs().items()}
    return args, kw


CASES = [
    # (H, I, E, top_k, gs, gs2)
    pytest.param(1024, 512, 8, 2, 128, 128, id="e8-gs128"),
    pytest.param(2048, 768, 16, 8, 64, 64, id="e16-gs64"),
    pytest.param(1024, 256, 8, 2, -1, -1, id="channelwise"),
    pytest.param(2048, 192, 64, 4, 64, 64, id="e64-i192"),  # many experts without rows at small M
    pytest.param(2048, 192, 128, 8, 128, 64, id="qwen3-30b-tp4"),  # the down projection re-grouped to 64
]


@pytest.mark.parametrize("M", [1, 5, 32, 64, 300, 1024, 1100])
@pytest.mark.parametrize("H, I, E, top_k, gs, gs2", CASES)
def test_hopper_matches_reference(H, I, E, top_k, gs, gs2, M):  # noqa: E741
    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=4, gs1=gs, gs2=gs2, seed=M + E)
    args, kw = _cuda(p)
    ref = fused_moe_wna16_ref(*args, **kw).cpu()
    out = fused_moe_wna16(*args, group_size=gs if gs == gs2 else (gs, gs2), backend="hopper", **kw)
    torch.cuda.synchronize()
    assert_close_scaled(out.cpu(), ref, BF16, f"hopper M={M}")


@pytest.mark.parametrize("M", [1, 64, 1100])
@pytest.mark.parametrize("H, I, E, top_k, gs, gs2", CASES)
def test_hopper_fp16_matches_reference(H, I, E, top_k, gs, gs2, M):  # noqa: E741
    """The fp16 build of each tile (grouped_tile_<N>_fp16.cu) and the glue's fp16 form, at fp16's tolerance."""
    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=4, gs1=gs, gs2=gs2, dtype=torch.float16, seed=M + H)
    args, kw = _cuda(p)
    ref = fused_moe_wna16_ref(*args, **kw).cpu()
    out = fused_moe_wna16(*args, group_size=gs if gs == gs2 else (gs, gs2), backend="hopper", **kw)
    torch.cuda.synchronize()
    assert out.dtype == torch.float16
    assert_close_scaled(out.cpu(), ref, torch.float16, f"hopper fp16 M={M}")


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 64, 1100])
@pytest.mark.parametrize("H, I, E, top_k, gs, gs2", CASES)
def test_hopper_zero_points_match_reference(H, I, E, top_k, gs, gs2, M, dtype):  # noqa: E741
    """int4 with real zero points (AWQ-style, one per group and column), run on the int8 builds as q - z
    (hopper_ops.zero_point_weights: CUTLASS 4.2's grouped scale-and-zero mode faults, grouped_gemm.h)."""
    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=4, gs1=gs, gs2=gs2, zp=True, dtype=dtype, seed=M + I)
    args, kw = _cuda(p)
    assert kw["w13_qzeros"] is not None
    ref = fused_moe_wna16_ref(*args, **kw).cpu()
    out = fused_moe_wna16(*args, group_size=gs if gs == gs2 else (gs, gs2), backend="hopper", **kw)
    torch.cuda.synchronize()
    assert_close_scaled(out.cpu(), ref, dtype, f"hopper zero points {dtype} M={M}")


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 64, 1100])
@pytest.mark.parametrize("H, I, E, top_k, gs, gs2", CASES)
def test_hopper_int8_matches_reference(H, I, E, top_k, gs, gs2, M, dtype):  # noqa: E741
    """The int8 builds (grouped_tile_<N>[_fp16]_int8.cu: CUTLASS's int8_t, weights made signed by XOR 0x80 and
    reordered for its [0,2,1,3] conversion)."""
    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=8, gs1=gs, gs2=gs2, dtype=dtype, seed=M + 3 * E)
    args, kw = _cuda(p)
    ref = fused_moe_wna16_ref(*args, **kw).cpu()
    out = fused_moe_wna16(*args, group_size=gs if gs == gs2 else (gs, gs2), backend="hopper", **kw)
    torch.cuda.synchronize()
    assert_close_scaled(out.cpu(), ref, dtype, f"hopper int8 {dtype} M={M}")


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("zp", "bits"), [(False, 4), (True, 4), (False, 8), (True, 8)], ids=["sym", "zp", "int8", "int8zp"]
)
@pytest.mark.parametrize("tile", [32, 64, 128, 256])
def test_every_token_tile_matches_reference(tile, zp, bits, dtype):
    """Every built (tile, dtype, kernel bits) build (hopper_ops.BUILT_TILES, kernel_bits); the others refuse with the
    reason (int8 with zero points: at prepare)."""
    from vllm_wna16_plugin.kernels import hopper_ops

    p = make_moe_problem(M=200, H=1024, I=512, E=8, top_k=2, bits=bits, gs1=128, zp=zp, dtype=dtype, seed=tile)
    args, kw = _cuda(p)
    x, w13, w2, s13, s2, topk_w, topk_ids = args
    if hopper_ops.kernel_bits(bits, zp) is None:
        with pytest.raises(ValueError, match="no build"):
            hopper_ops.prepare(
                w13, w2, s13, s2, 128, 128, w13_qzeros=kw["w13_qzeros"], w2_qzeros=kw["w2_qzeros"], bits=bits
            )
        return
    state = hopper_ops.prepare(
        w13, w2, s13, s2, 128, 128, w13_qzeros=kw["w13_qzeros"], w2_qzeros=kw["w2_qzeros"], bits=bits
    )
    launch = hopper_ops.HopperLaunch(tile)
    if tile not in hopper_ops.built_tiles(dtype, zp, bits):
        with pytest.raises(RuntimeError, match=f"the {tile}-token tile is not built"):
            hopper_ops.fused_moe_hopper(x, state, topk_w, topk_ids, launch)
        return
    out = hopper_ops.fused_moe_hopper(x, state, topk_w, topk_ids, launch)
    assert_close_scaled(out.cpu(), fused_moe_wna16_ref(*args, **kw).cpu(), dtype, f"tile {tile}")


@pytest.mark.parametrize("kernel_group", [64, 128])
@pytest.mark.parametrize("M", [16, 32, 48, 64])
def test_many_routings_of_a_many_expert_layer_match_reference(M, kernel_group):
    """20 routings each of the layer whose groups of 128 once gave a wrong row (bench/hopper_group_diag.py):
    E=128, top_k=8, many experts with one to a few rows, with GEMM1's scales in the kernel in groups of 64 (each
    repeated twice) and of 128 (its own: the backend's, hopper_ops.kernel_group_size); GEMM2's stay 64. Every element
    checked."""
    from vllm_wna16_plugin.kernels import hopper_ops

    for seed in range(20):
        p = make_moe_problem(M=M, H=2048, I=192, E=128, top_k=8, bits=4, gs1=128, gs2=64, seed=100 * M + seed)
        args, kw = _cuda(p)
        x, w13, w2, s13, s2, topk_w, topk_ids = args
        state = hopper_ops.prepare(w13, w2, s13, s2, 128, 64, kernel_group=kernel_group)
        out = hopper_ops.fused_moe_hopper(
            x, state, topk_w, topk_ids, hopper_ops.HopperLaunch(hopper_ops.token_tile(M * 8 / 128))
        )
        assert_close_scaled(out.cpu(), fused_moe_wna16_ref(*args, **kw).cpu(), BF16, f"M={M} seed={seed}")


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("zp", "bits"), [(False, 4), (True, 4), (False, 8)], ids=["sym", "zp", "int8"])
@pytest.mark.parametrize("M", [1, 64, 300, 1100])
@pytest.mark.parametrize(
    "H, I, E, top_k", [(1024, 512, 8, 2), (2048, 768, 16, 8), (2048, 256, 64, 4)], ids=["e8", "e16", "e64"]
)
def test_groups_of_128_in_the_kernel_match_reference(H, I, E, top_k, M, zp, bits, dtype):  # noqa: E741
    """Groups of 128 laid out as such in the kernel (CUTLASS's scale reload factor 2), not repeated to groups of 64:
    every form and dtype, the plan's tile for M (hopper_ops.kernel_group_size's evidence, also the backend's default
    since)."""
    from vllm_wna16_plugin.kernels import hopper_ops

    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=bits, gs1=128, zp=zp, dtype=dtype, seed=7 * M + E)
    args, kw = _cuda(p)
    x, w13, w2, s13, s2, topk_w, topk_ids = args
    state = hopper_ops.prepare(w13, w2, s13, s2, 128, 128, w13_qzeros=kw["w13_qzeros"], w2_qzeros=kw["w2_qzeros"],
                               bits=bits, kernel_group=128)  # fmt: skip
    assert state.s13.shape[1] == H // 128 and state.s2.shape[1] == I // 128
    tile = hopper_ops.token_tile(M * top_k / E, hopper_ops.built_tiles(dtype, zp, bits))
    out = hopper_ops.fused_moe_hopper(x, state, topk_w, topk_ids, hopper_ops.HopperLaunch(tile))
    assert_close_scaled(out.cpu(), fused_moe_wna16_ref(*args, **kw).cpu(), dtype, f"groups of 128 M={M}")


def _runner(args, *, hopper: bool, explicit: bool):
    from vllm_wna16_plugin import compose
    from vllm_wna16_plugin.launch_plan import LayerRunner
    from vllm_wna16_plugin.oracle import select_backend

    x, w13, w2, s13, s2, _, topk_ids = args
    problem = make_problem(x, w13, w2, s13, s2, topk_ids, bits=4, group_size=128, has_zero_point=False)
    if explicit:
        selection = select_backend(problem, "hopper", "test")
    else:
        selection = select_backend(dataclasses.replace(problem, options=RunOptions()))
        assert compose.hopper_composable(selection) is None
        selection = compose.with_hopper(selection) if hopper else selection
    return LayerRunner(selection, KernelTensors(w13, w2, s13, s2))


def test_cuda_graph_replays_on_new_inputs():
    M, H, I, E, top_k = 64, 1024, 512, 8, 2  # noqa: E741
    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=4, gs1=128, seed=3)
    args, kw = _cuda(p)
    runner = _runner(args, hopper=True, explicit=True)
    x, topk_w, topk_ids = args[0].clone(), args[5].clone(), args[6].clone()
    runner.run(x, topk_w, topk_ids)  # warm-up outside the capture (workspace, lazy loads)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner.run(x, topk_w, topk_ids)
    q = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=4, gs1=128, seed=4)  # same weights, new inputs
    new = [t.cuda() for t in q.args()]
    x.copy_(new[0])
    topk_w.copy_(new[5])
    topk_ids.copy_(new[6])
    graph.replay()
    torch.cuda.synchronize()
    ref = fused_moe_wna16_ref(x, *args[1:5], topk_w, topk_ids, **kw).cpu()
    assert_close_scaled(out.cpu(), ref, BF16, "graph replay on new inputs")


def test_a_graph_captured_on_padding_replays_a_real_batch():
    """vLLM 0.34 captures its decode graphs on dummy batches whose rows are all padding (router ids -1): the
    captured layer must then run the real batches replayed into it."""
    M, H, I, E, top_k = 8, 1024, 512, 8, 2  # noqa: E741
    p = make_moe_problem(M=M, H=H, I=I, E=E, top_k=top_k, bits=4, gs1=128, seed=5)
    args, kw = _cuda(p)
    runner = _runner(args, hopper=True, explicit=True)
    x, topk_w, topk_ids = args[0].clone(), args[5].clone(), args[6].clone().fill_(-1)
    runner.run(x, topk_w, topk_ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner.run(x, topk_w, topk_ids)
    topk_ids.copy_(args[6])
    topk_ids[-1] = -1  # the last row still padding
    graph.replay()
    torch.cuda.synchronize()
    ref = fused_moe_wna16_ref(x[:-1], *args[1:5], topk_w[:-1], args[6][:-1], **kw).cpu()
    assert_close_scaled(out[:-1].cpu(), ref, BF16, "graph captured on padding, replayed on a real batch")
    assert not out[-1].any(), "the padding row is not zero"


def test_auto_with_hopper_hands_it_the_batches_its_rule_takes(monkeypatch):
    from vllm_wna16_plugin.backends import hopper

    ran = []
    real = hopper.HopperBackend.run
    monkeypatch.setattr(hopper.HopperBackend, "run", lambda self, *a, **k: ran.append("hopper") or real(self, *a, **k))
    for M in (2, 512):
        p = make_moe_problem(M=M, H=1024, I=512, E=8, top_k=2, bits=4, gs1=128, seed=M)
        args, kw = _cuda(p)
        runner = _runner(args, hopper=True, explicit=False)
        taken = runner.plan(M).backend == "hopper"
        assert taken == hopper.hopper_takes(runner.problem, M, runner.device)
        out = runner.run(args[0], args[5], args[6])
        assert_close_scaled(out.cpu(), fused_moe_wna16_ref(*args, **kw).cpu(), BF16, f"auto+hopper M={M}")
    assert ran == ["hopper"]  # M=2: 0.5 rows per expert (the plugin's); M=512: 128 rows (hopper's)


SANITIZED = textwrap.dedent(
    """
    import torch
    from tests.kernels.conftest import make_moe_problem
    from vllm_wna16_plugin.kernels import hopper_ops
    p = make_moe_problem(M=40, H=1024, I=256, E=8, top_k=2, bits=4, gs1=128, seed=1)
    x, w13, w2, s13, s2, w, ids = [t.cuda() for t in p.args()]
    ids[-3:] = -1  # vLLM's padding rows
    state = hopper_ops.prepare(w13, w2, s13, s2, 128, 128)
    for tile in hopper_ops.TILE_WIDTHS:
        hopper_ops.fused_moe_hopper(x, state, w, ids, hopper_ops.HopperLaunch(tile))
    z = make_moe_problem(M=40, H=1024, I=256, E=8, top_k=2, bits=4, gs1=128, zp=True, dtype=torch.float16, seed=2)
    x, w13, w2, s13, s2, w, ids = [t.cuda() for t in z.args()]
    state = hopper_ops.prepare(w13, w2, s13, s2, 128, 128, w13_qzeros=z.w13.qzeros.cuda(), w2_qzeros=z.w2.qzeros.cuda())
    hopper_ops.fused_moe_hopper(x, state, w, ids, hopper_ops.HopperLaunch(128))
    q = make_moe_problem(M=40, H=1024, I=256, E=8, top_k=2, bits=8, gs1=128, seed=3)
    x, w13, w2, s13, s2, w, ids = [t.cuda() for t in q.args()]
    ids[:2] = -1
    state = hopper_ops.prepare(w13, w2, s13, s2, 128, 128, bits=8)
    hopper_ops.fused_moe_hopper(x, state, w, ids, hopper_ops.HopperLaunch(256))
    for bits in (4, 8):  # K=192: not a multiple of CUTLASS's reorder copy (kReorderK), which wrote past the expert
        r = make_moe_problem(M=24, H=1024, I=192, E=4, top_k=2, bits=bits, gs1=64, seed=4 + bits)
        x, w13, w2, s13, s2, w, ids = [t.cuda() for t in r.args()]
        state = hopper_ops.prepare(w13, w2, s13, s2, 64, 64, bits=bits)
        hopper_ops.fused_moe_hopper(x, state, w, ids, hopper_ops.HopperLaunch(128))
    torch.cuda.synchronize()
    """
)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_is_clean(tool):
    exe = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer" if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None
    )
    if exe is None:
        pytest.skip("compute-sanitizer is not on PATH")
    # memcheck: 64 KiB of padding after every allocation, so that a write up to that far past one (the reorder's was
    # N * 64 * bits / 8 bytes) lands in no neighbour
    padding = ["--padding=65536"] if tool == "memcheck" else []
    cmd = [exe, f"--tool={tool}", *padding, "--error-exitcode=99", sys.executable, "-c", SANITIZED]
    # every tensor its own allocation, so that a write past one is outside any (PyTorch's caching allocator would
    # hide it inside its segment)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout + proc.stderr
    assert "ERROR SUMMARY: 0 errors" in summary or "(0 errors, 0 warnings)" in summary, summary[-2000:]
