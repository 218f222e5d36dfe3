"""The plugin's CUDA ops (csrc/) without a GPU: the build, and the launch rules the kernel enforces.

CI compiles csrc/ (nvcc 13, sm90) as part of the README's set-up. These tests check that the
extension loads. They also check that every launch config the launch-config module can produce,
over real models' shapes and their TP splits, is one the compiled kernel accepts. The rules are
asked of the compiled code (csrc/launch_rules.h through torch.ops.wna16_plus.check_launch_config),
not of a Python copy of them. The kernel's results are checked on the GPU, in
tests/kernels/test_cuda_ops_gpu.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from vllm_wna16_plugin.backends import registry
from vllm_wna16_plugin.block_config import choose_cuda_block_config
from vllm_wna16_plugin.kernels.cuda_ops import extension_error, gemm_config, launch_config_error
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
            configs = [gemm_config(m, top_k, E, K, N, num_groups, bits)]  # what the cuda backend launches
            if gs != CHANNELWISE or K % 32 == 0:  # the module's own (vLLM-kernel) presentation
                configs.append(choose_cuda_block_config(m, top_k, E, K, N, gs, bits))
            for cfg in configs:
                err = launch_config_error(K, num_groups, cfg, bits)
                assert err == "", f"K={K} N={N} gs={gs} int{bits} M={m}: {cfg} refused: {err}"
                checked += 1
    assert checked > 500


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
    return dataclasses.replace(p, platform=platform, sm=sm, extra={"explicit": explicit, "plan_only": plan_only})


def test_cuda_backend_rules():
    cuda = registry()["cuda"]
    assert cuda.incompatibility_reason(_problem(explicit=True)) is None
    assert cuda.incompatibility_reason(_problem(gs=CHANNELWISE, bits=8, explicit=True)) is None
    # auto takes it only on a measured crossover (tests/test_crossover.py); none is shipped
    assert "no measured crossover over triton" in cuda.incompatibility_reason(_problem())
    assert "NVIDIA GPU" in cuda.incompatibility_reason(_problem(platform="cpu", explicit=True))
    assert "sm80+" in cuda.incompatibility_reason(_problem(sm=75, explicit=True))
    assert "group size 16" in cuda.incompatibility_reason(_problem(gs=16, explicit=True))
    assert "K=1004 is not a multiple of 8" in cuda.incompatibility_reason(
        _problem(gs=CHANNELWISE, H=1004, explicit=True)
    )
    assert cuda.incompatibility_reason(_problem(gs=CHANNELWISE, I=176, explicit=True)) is None  # 704 at TP4
