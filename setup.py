"""Builds the plugin's CUDA ops (csrc/ -> vllm_wna16_plugin._C) when a CUDA torch and nvcc are present.

Project metadata lives in pyproject.toml. The extension compiles against the torch of the
environment it is installed into, so install with `--no-build-isolation` once vLLM (and
with it torch) is there; README.md's set-up does that. When torch is not importable at
build time (pip's default isolated build), or it has no CUDA, or nvcc is missing, the
package still installs without the extension (Triton and reference backends only) and
says so in the build log. WNA16_PLUS_REQUIRE_CUDA=1 turns that into an error (CI, so a
build break cannot land); WNA16_PLUS_SKIP_CUDA=1 skips the build.
TORCH_CUDA_ARCH_LIST picks the architectures; unset, the build targets the GPUs this machine has
(e.g. "9.0" on an H100/H200), or "8.0;9.0;10.0" when it has none (about three times the build time).

Where the architectures include sm90 and CUTLASS's headers are found (CUTLASS_DIR, else the nvidia-cutlass
package, pinned in README.md's set-up), a second extension, vllm_wna16_plugin._hopper (csrc/hopper/: the
`hopper` backend's grouped GEMM on TMA and wgmma), is built for sm90a only: about 2.5 minutes per translation
unit on one core. WNA16_PLUS_SKIP_HOPPER=1 skips it; without CUTLASS it is skipped with a note.

The build takes minutes (sm90 alone: about 4.5 min on 2 cores, 1 min on 16). pip hides a build's
output unless run with -v, so the line before and the line after the build also go to the terminal
(/dev/tty) when there is one.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


DEFAULT_ARCHS = "8.0;9.0;10.0"
MIN_ARCH = (8, 0)  # the CUDA kernels use sm80 instructions (cp.async, bf16 mma)


def _note(msg: str, *, to_terminal: bool = False) -> None:
    line = f"vllm-wna16-plugin: {msg}"
    print(line, file=sys.stderr, flush=True)
    if to_terminal:  # pip captures the build's stdout/stderr; the terminal still shows this line
        try:
            with open("/dev/tty", "w") as tty:
                tty.write(line + "\n")
        except OSError:
            pass


def local_cuda_archs(capabilities: list[tuple[int, int]]) -> str | None:
    """TORCH_CUDA_ARCH_LIST for the GPUs given as (major, minor): "9.0" for one H200, None for none.

    GPUs below sm80 are left out (the CUDA backend cannot run there); all below: None as well."""
    usable = sorted({cap for cap in capabilities if cap >= MIN_ARCH})
    return ";".join(f"{major}.{minor}" for major, minor in usable) or None


def _visible_capabilities(torch) -> list[tuple[int, int]]:
    try:
        return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no driver, no device: build for the defaults
        return []


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


CUTLASS_PACKAGE = "nvidia-cutlass==4.2.0.0"  # headers only (README.md's set-up installs it with --no-deps)


def cutlass_root() -> tuple[Path | None, str]:
    """(CUTLASS's source root: include/ and tools/util/include/ under it, where it came from), or (None, why
    not): $CUTLASS_DIR, else the installed nvidia-cutlass package's cutlass_library/source (found, not imported)."""
    import importlib.util

    if env := os.environ.get("CUTLASS_DIR"):
        root = Path(env)
        if (root / "include" / "cutlass" / "cutlass.h").exists():
            return root, f"CUTLASS_DIR={env}"
        return None, f"CUTLASS_DIR={env} has no include/cutlass/cutlass.h"
    spec = importlib.util.find_spec("cutlass_library")
    if spec and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations))) / "source"
        if (root / "include" / "cutlass" / "cutlass.h").exists():
            return root, f"the nvidia-cutlass package ({root})"
    return None, f"no CUTLASS headers (pip install --no-deps {CUTLASS_PACKAGE}, or set CUTLASS_DIR)"


CUTLASS_MIN_VERSION = (4, 2)  # the mixed-input grouped GEMM as csrc/hopper/ uses it (example 69's kernel)


def cutlass_version(root: Path) -> tuple[int, int] | None:
    """(major, minor) from CUTLASS's include/cutlass/version.h, or None where it cannot be read."""
    import re

    try:
        text = (root / "include" / "cutlass" / "version.h").read_text()
    except OSError:
        return None
    found = [re.search(rf"#define CUTLASS_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
    return (int(found[0].group(1)), int(found[1].group(1))) if all(found) else None


def curand_include(cuda_home: str | None, site_packages: Path) -> tuple[str | None, bool]:
    """(a directory holding curand_kernel.h, whether it is the toolkit's own): CUTLASS's utility headers (the
    weights' reorder, cutlass/util/mixed_dtype_utils.hpp) include it. A toolkit without curand (CI's, 2026-12-06)
    takes the nvidia-curand wheel's that torch installs (site-packages/nvidia/<cu13|curand>/include), added after
    the toolkit's headers; None where neither has it."""
    home = Path(cuda_home or "/usr/local/cuda")
    own = [home / "include" / "curand_kernel.h", *sorted(home.glob("targets/*/include/curand_kernel.h"))]
    if found := [f for f in own if f.exists()]:
        return str(found[0].parent), True
    found = sorted((site_packages / "nvidia").glob("*/include/curand_kernel.h"))
    return (str(found[0].parent), False) if found else (None, False)


def builds_sm90(archs: str) -> bool:
    """Whether TORCH_CUDA_ARCH_LIST ("8.0;9.0;10.0", "9.0a", "9.0+PTX") names sm90."""
    return any(a.strip().split("+")[0].rstrip("a") == "9.0" for a in archs.replace(" ", ";").split(";"))


def hopper_extension(CUDAExtension, archs: str, abi: str, link: list[str]):  # noqa: N803
    """The `hopper` backend's extension (csrc/hopper/, sm90a only), or None with a log line saying why not."""
    if os.environ.get("WNA16_PLUS_SKIP_HOPPER") == "1":
        _note("not building the hopper kernels (WNA16_PLUS_SKIP_HOPPER=1)")
        return None
    if not builds_sm90(archs):
        _note(f"not building the hopper kernels: they are sm90a only and TORCH_CUDA_ARCH_LIST is {archs}")
        return None
    import torch

    if int((torch.version.cuda or "0").split(".")[0]) < 12:
        _note(f"not building the hopper kernels: sm90a needs CUDA 12 or newer (torch has CUDA {torch.version.cuda})")
        return None
    root, where = cutlass_root()
    if root is not None and (version := cutlass_version(root) or (0, 0)) < CUTLASS_MIN_VERSION:
        root, where = None, (f"CUTLASS {version[0]}.{version[1]} in {where} is older than "
                             f"{CUTLASS_MIN_VERSION[0]}.{CUTLASS_MIN_VERSION[1]} ({CUTLASS_PACKAGE})")  # fmt: skip
    if root is None:
        if os.environ.get("WNA16_PLUS_REQUIRE_CUDA") == "1":
            raise RuntimeError(f"WNA16_PLUS_REQUIRE_CUDA=1 but the hopper kernels cannot be built: {where} "
                               "(WNA16_PLUS_SKIP_HOPPER=1 builds without them)")  # fmt: skip
        _note(f"not building the hopper kernels: {where}")
        return None
    from torch.utils.cpp_extension import CUDA_HOME

    curand, own = curand_include(CUDA_HOME, Path(torch.__file__).resolve().parents[1])
    if curand is None:
        why = "CUTLASS's utility headers need curand_kernel.h: neither the CUDA toolkit nor torch's nvidia wheels have it"
        if os.environ.get("WNA16_PLUS_REQUIRE_CUDA") == "1":
            raise RuntimeError(f"WNA16_PLUS_REQUIRE_CUDA=1 but the hopper kernels cannot be built: {why}")
        _note(f"not building the hopper kernels: {why}")
        return None
    after = [] if own else ["-Xcompiler", f"-idirafter,{curand}"]  # after the toolkit's own headers
    _note(f"building the hopper kernels for sm90a (CUTLASS from {where}{'' if own else f'; curand from {curand}'})")
    hopper = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "hopper").glob("*.cu"))
    return CUDAExtension(
        name="vllm_wna16_plugin._hopper",
        sources=hopper,
        include_dirs=[str(ROOT / "csrc" / "hopper"), str(root / "include"), str(root / "tools" / "util" / "include")],
        # an -gencode of our own: torch then adds none from TORCH_CUDA_ARCH_LIST for this extension. torch's
        # flags turn off the half/bf16 operators CUTLASS's types are built on: turned back on.
        extra_compile_args={
            "cxx": ["-O3", abi],
            "nvcc": ["-O3", abi, "-DNDEBUG", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
                     "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                     "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__", *after],
        },  # fmt: skip
        extra_link_args=link,
        py_limited_api=False,
    )


def cuda_extension():
    """([CUDAExtension, ...], cmdclass), or ([], {}) with a log line saying why not."""
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
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        why = "TORCH_CUDA_ARCH_LIST"
    else:
        caps = _visible_capabilities(torch)
        local = local_cuda_archs(caps)
        if caps and local is None:
            return _skip(f"this machine's GPUs are below sm80 ({caps}); set TORCH_CUDA_ARCH_LIST to build anyway")
        os.environ["TORCH_CUDA_ARCH_LIST"] = local or DEFAULT_ARCHS
        why = "this machine's GPUs" if local else "no GPU here: the default architectures"
    archs = os.environ["TORCH_CUDA_ARCH_LIST"]
    _note(f"building the CUDA ops for {archs} ({why}; torch {torch.__version__}, C++{_torch_cxx_standard()}, "
          f"CUDA_HOME={CUDA_HOME})")  # fmt: skip
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
    exts = [ext]
    if hopper := hopper_extension(CUDAExtension, archs, abi, link):
        exts.append(hopper)

    class TimedBuildExtension(BuildExtension):
        """BuildExtension that tells the user, on the terminal, when the long build starts and ends."""

        def build_extension(self, ext):
            """The hopper kernels are best effort: a failed build leaves them out (the log says why), unless
            WNA16_PLUS_REQUIRE_CUDA=1."""
            if not ext.name.endswith("._hopper") or os.environ.get("WNA16_PLUS_REQUIRE_CUDA") == "1":
                return super().build_extension(ext)
            try:
                return super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - the CUDA ops and Triton work without them
                _note(f"the hopper kernels failed to build ({type(exc).__name__}: {exc}); the plugin works without "
                      "them (WNA16_PLUS_REQUIRE_CUDA=1 makes this an error)", to_terminal=True)  # fmt: skip

        def build_extensions(self):
            jobs = os.environ.get("MAX_JOBS") or os.cpu_count()
            _note(f"compiling the CUDA ops for {archs} with {jobs} jobs: several minutes on a small machine "
                  "(WNA16_PLUS_SKIP_CUDA=1 skips them; the Triton backend works without)", to_terminal=True)  # fmt: skip
            start = time.monotonic()
            super().build_extensions()
            _note(f"CUDA ops built in {time.monotonic() - start:.0f} s", to_terminal=True)

    return exts, {"build_ext": TimedBuildExtension}


ext_modules, cmdclass = cuda_extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
