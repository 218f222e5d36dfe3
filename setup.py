"""Builds the plugin's CUDA ops (csrc/ -> vllm_wna16_plugin._C) when a CUDA torch and nvcc are present.

Project metadata lives in pyproject.toml. The extension compiles against the torch of the
environment it is installed into, so install with `--no-build-isolation` once vLLM (and
with it torch) is there; README.md's set-up does that. When torch is not importable at
build time (pip's default isolated build), or it has no CUDA, or nvcc is missing, the
package still installs without the extension (Triton and reference backends only) and
says so in the build log. WNA16_PLUS_REQUIRE_CUDA=1 turns that into an error (CI, so a
build break cannot land); WNA16_PLUS_SKIP_CUDA=1 skips the build.
TORCH_CUDA_ARCH_LIST picks the architectures (default "8.0;9.0;10.0").
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _note(msg: str) -> None:
    print(f"vllm-wna16-plugin: {msg}", file=sys.stderr, flush=True)


def _skip(reason: str):
    if os.environ.get("WNA16_PLUS_REQUIRE_CUDA") == "1":
        raise RuntimeError(f"WNA16_PLUS_REQUIRE_CUDA=1 but the CUDA ops cannot be built: {reason}")
    _note(f"building WITHOUT the CUDA ops ({reason}); the Triton and reference backends work without them")
    return [], {}


def _torch_cxx_standard() -> str:
    """The C++ standard torch's BuildExtension compiles extensions with ("17", "20"), read from its source."""
    import re

    import torch.utils.cpp_extension as cpp

    found = re.search(r"cpp_flag_prefix \+ 'c\+\+(\d\d)'", Path(cpp.__file__).read_text())
    return found.group(1) if found else "?"


def cuda_extension():
    """([CUDAExtension], cmdclass), or ([], {}) with a log line saying why not."""
    if os.environ.get("WNA16_PLUS_SKIP_CUDA") == "1":
        return _skip("WNA16_PLUS_SKIP_CUDA=1")
    if not os.environ.get("CUDA_HOME") and Path("/usr/local/cuda/include/cuda_runtime.h").exists():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"  # a `nvcc` wrapper on PATH can mislead torch's lookup
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as exc:
        return _skip(f"torch is not importable at build time ({exc}); install with --no-build-isolation")
    if torch.version.cuda is None:
        return _skip(f"torch {torch.__version__} has no CUDA")
    if CUDA_HOME is None or not (shutil.which("nvcc") or Path(CUDA_HOME, "bin", "nvcc").exists()):
        return _skip("no CUDA toolkit (nvcc) found; set CUDA_HOME")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0;10.0")
    _note(f"building the CUDA ops for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']} "
          f"(torch {torch.__version__}, C++{_torch_cxx_standard()}, CUDA_HOME={CUDA_HOME})")  # fmt: skip
    # torch 2.11's cpp_extension no longer passes the C++ ABI; pass torch's, whatever the compiler's default
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    # Link the shared libstdc++ by name. On the GPU machine's image (2026-12-03) g++ linked libstdc++
    # statically into the extension: that private copy's locale was never set up, and every message
    # formatted with std::ostream (c10::str, TORCH_CHECK) crashed the process (bench/probe_abi.py,
    # bench/probe_toolchain.sh). Naming libstdc++.so.6 resolves those symbols to the process's one copy.
    link = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []
    ext = CUDAExtension(
        name="vllm_wna16_plugin._C",
        sources=[
            "csrc/torch_bindings.cpp",
            "csrc/gemm_args.cpp",
            "csrc/moe_wna16_gemm.cu",
            "csrc/moe_wna16_gemv.cu",
            "csrc/moe_wna16_mma.cu",
            "csrc/moe_wna16_stream.cu",
            "csrc/moe_align.cu",
        ],
        include_dirs=[str(ROOT / "csrc")],
        # No -std flag of ours: torch's BuildExtension adds the standard its headers need (C++17 up to
        # torch 2.12, C++20 from 2.13) when none is given, and nvcc refuses two -std flags.
        extra_compile_args={"cxx": ["-O3", abi], "nvcc": ["-O3", "-lineinfo", abi]},
        extra_link_args=link,
        py_limited_api=False,
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
