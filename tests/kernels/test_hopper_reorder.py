"""CUTLASS's weight reorder run on the host as its kernel runs on the GPU (tests/kernels/hopper_reorder_host.cu, built
here by nvcc against csrc/hopper/grouped_gemm.cuh): prepare_weights' reorder, padded to reorder_k(K), places every
value where the hopper kernel's layout reads it and writes nothing past an expert; the raw reorder writes past the
expert exactly where K is not a multiple of kReorderK (128 values, int4 and int8: the fault the padding is for, which
corrupted memory after the layer's copy on the H200 runs of 2026-12-06). Needs nvcc and CUTLASS's headers (the
README's set-up installs them); skipped without."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_setup import _load

ROOT = Path(__file__).resolve().parents[2]
HOST = Path(__file__).with_name("hopper_reorder_host.cu")

# (bits, N, K): K tile counts of real layers after a TP split (192: Qwen3-30B-A3B's down projection at TP 4, 1600:
# Phi-3.5-MoE's, 384: Qwen3-30B-A3B's at TP 2, 320: an odd tile count) and aligned ones
CASES = [(4, 128, 64), (4, 256, 192), (4, 128, 320), (4, 128, 384), (4, 128, 1600), (4, 128, 2048), (4, 256, 3584),
         (8, 128, 64), (8, 256, 192), (8, 128, 384), (8, 128, 1600), (8, 128, 2048)]  # fmt: skip


def _toolkit() -> tuple[str | None, str | None]:
    """(nvcc, the CUDA toolkit's root) as setup.py finds them: $CUDA_HOME, else /usr/local/cuda where it has the
    runtime's headers (a `nvcc` wrapper on PATH can mislead torch's lookup), else the nvcc on PATH."""
    home = os.environ.get("CUDA_HOME")
    if not home and Path("/usr/local/cuda/include/cuda_runtime.h").exists():
        home = "/usr/local/cuda"
    if home and Path(home, "bin", "nvcc").exists():
        return str(Path(home, "bin", "nvcc")), home
    nvcc = shutil.which("nvcc")
    return nvcc, home or (str(Path(nvcc).resolve().parents[1]) if nvcc else None)


@pytest.fixture(scope="module")
def host_reorder(tmp_path_factory) -> Path:
    nvcc, cuda_home = _toolkit()
    scope = _load("cutlass_root", "cutlass_version", "curand_include")
    scope.update(os=os, Path=Path, CUTLASS_PACKAGE="nvidia-cutlass==4.2.0.0")
    root, why = scope["cutlass_root"]()
    if nvcc is None or root is None:
        pytest.skip(f"needs nvcc and CUTLASS's headers ({'no nvcc' if nvcc is None else why})")
    if (scope["cutlass_version"](root) or (0, 0)) < (4, 2):
        pytest.skip(f"CUTLASS at {root} is older than 4.2 (the hopper kernels' version)")
    import torch

    # where setup.py looks: the toolkit's own curand, else torch's nvidia wheels beside torch
    curand, own = scope["curand_include"](cuda_home, Path(torch.__file__).resolve().parents[1])
    if curand is None:
        pytest.skip("CUTLASS's utility headers need curand_kernel.h, found neither in the toolkit nor in nvidia wheels")
    exe = tmp_path_factory.mktemp("reorder") / "host_reorder"
    cmd = [nvcc, "-std=c++20", "-O1", "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc' / 'hopper'}",
           f"-I{root / 'include'}", f"-I{root / 'tools' / 'util' / 'include'}", str(HOST), "-o", str(exe)]  # fmt: skip
    if not own:
        cmd[1:1] = ["-Xcompiler", f"-idirafter,{curand}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def test_the_padded_reorder_places_every_value_and_stays_inside_the_expert(host_reorder):
    args = [str(v) for case in CASES for v in case]
    out = subprocess.run([str(host_reorder), *args], capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [tuple(int(v) for v in line.split()) for line in out.splitlines()]
    assert [r[:3] for r in rows] == CASES
    for bits, n, k, past_raw, past_padded, misplaced in rows:
        case = f"int{bits} N={n} K={k}"
        assert misplaced == 0, f"{case}: {misplaced} values not where the kernel's layout reads them"
        assert past_padded == 0, f"{case}: the padded reorder wrote {past_padded} bytes past the expert"
        # CUTLASS's own copy writes past the expert exactly where K is not a multiple of its copy width (128 values,
        # grouped_gemm.cuh's kReorderK): one K tile of 64 values a row, N * 64 * bits / 8 bytes (a few of them may
        # happen to equal the canary)
        overreach = k % 128 != 0
        assert (past_raw > 0) == overreach, f"{case}: raw reorder wrote {past_raw} bytes past the expert"
        if overreach:
            assert 0.95 * n * 64 * bits / 8 < past_raw <= n * 64 * bits / 8
