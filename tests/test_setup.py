"""setup.py's architecture choice, a pure function read out of setup.py (importing setup.py would run
setup()): the build targets this machine's GPUs, sm80 and up, and falls back to the defaults without one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


def _load(*names: str) -> dict:
    tree = ast.parse(SETUP.read_text())
    keep = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in names)
        or (
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") in ("MIN_ARCH", "DEFAULT_ARCHS") for t in node.targets)
        )
    ]
    scope: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(SETUP), "exec"), scope)  # noqa: S102
    return scope


@pytest.mark.parametrize(
    ("capabilities", "want"),
    [
        ([(9, 0)], "9.0"),  # one H100/H200
        ([(9, 0)] * 8, "9.0"),
        ([(8, 0), (8, 6)], "8.0;8.6"),
        ([(10, 0), (9, 0)], "9.0;10.0"),
        ([(7, 5), (8, 9)], "8.9"),  # a T4 beside an L4: the T4 cannot run the CUDA kernels
        ([(7, 0)], None),
        ([], None),
    ],
)
def test_the_build_targets_this_machines_gpus(capabilities, want):
    assert _load("local_cuda_archs")["local_cuda_archs"](capabilities) == want


def test_defaults_cover_ampere_hopper_blackwell():
    assert _load()["DEFAULT_ARCHS"] == "8.0;9.0;10.0"


@pytest.mark.parametrize(
    ("archs", "want"),
    [
        ("9.0", True),
        ("8.0;9.0;10.0", True),
        ("9.0a", True),
        ("9.0+PTX", True),
        ("8.0", False),
        ("8.0;10.0", False),
        ("8.9 9.0", True),
    ],  # fmt: skip
)
def test_the_hopper_kernels_build_where_sm90_is_asked_for(archs, want):
    assert _load("builds_sm90")["builds_sm90"](archs) is want


def test_cutlass_is_found_from_cutlass_dir_or_refused_with_its_fix(tmp_path, monkeypatch):
    scope = _load("cutlass_root")
    scope.update(os=__import__("os"), Path=Path, CUTLASS_PACKAGE="nvidia-cutlass==4.2.0.0")
    cutlass_root = scope["cutlass_root"]
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path))
    root, why = cutlass_root()
    assert root is None and "include/cutlass/cutlass.h" in why
    (tmp_path / "include" / "cutlass").mkdir(parents=True)
    (tmp_path / "include" / "cutlass" / "cutlass.h").write_text("// header")
    assert cutlass_root() == (tmp_path, f"CUTLASS_DIR={tmp_path}")


def test_cutlass_older_than_the_kernels_need_is_refused_by_its_version(tmp_path):
    scope = _load("cutlass_version")
    version = scope["cutlass_version"]
    assert version(tmp_path) is None
    (tmp_path / "include" / "cutlass").mkdir(parents=True)
    (tmp_path / "include" / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 3\n#define CUTLASS_MINOR 5\n")
    assert version(tmp_path) == (3, 5) < (4, 2)


def test_curand_comes_from_the_toolkit_else_from_torchs_nvidia_wheels(tmp_path):
    """CUTLASS's utility headers include curand_kernel.h, which CI's toolkit lacks (its first build with the hopper
    kernels failed there); torch's nvidia-curand wheel has it."""
    scope = _load("curand_include")
    scope["Path"] = Path
    curand_include = scope["curand_include"]
    toolkit, site = tmp_path / "cuda", tmp_path / "site"
    (toolkit / "include").mkdir(parents=True)
    assert curand_include(str(toolkit), site) == (None, False)
    (site / "nvidia" / "cu13" / "include").mkdir(parents=True)
    (site / "nvidia" / "cu13" / "include" / "curand_kernel.h").write_text("")
    assert curand_include(str(toolkit), site) == (str(site / "nvidia" / "cu13" / "include"), False)
    (toolkit / "include" / "curand_kernel.h").write_text("")
    assert curand_include(str(toolkit), site) == (str(toolkit / "include"), True)
