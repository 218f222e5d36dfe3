"""Probe (GPU machine): why does a refusal of the plugin's CUDA op crash the process there?

Each case runs in its own process (a segfault ends only that case) and prints how it ended:
  our-cuda-op    torch.ops.wna16_plus.moe_wna16_gemm refusing (a non-empty returned string)
  our-cpu-op     torch.ops.wna16_plus.check_launch_config with an illegal config (CPU op, a string)
  inline-str     a fresh load_inline op returning a long std::string (same compiler, torch's flags)
  inline-throw   a fresh load_inline op raising TORCH_CHECK
The inline module installs a SIGSEGV handler that prints the native backtrace (execinfo).
Then: the toolchain and ABI facts, and gdb's backtrace of the first crashing case if gdb is there.
Run: python3 bench/probe_abi.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

INLINE_SRC = r"""
#include <torch/extension.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>
static void on_segv(int) { void* f[48]; int n = backtrace(f, 48); backtrace_symbols_fd(f, n, 2); _exit(139); }
void install() { signal(SIGSEGV, on_segv); }  // native frames of a crash, gdb or not
std::string say(const at::Tensor& t, int64_t n) {
  if (n == 0) return "";
  if (n == 1) return "short";
  if (n == 2) return std::string(100, 'x');
  return c10::str("a message long enough for the heap, number ", n, " for sizes ", t.sizes());
}
std::string say_int(int64_t n) { return n == 0 ? std::string() : std::string(100, 'y'); }
void boom(int64_t n) { TORCH_CHECK(n == 0, "boom ", n); }
TORCH_LIBRARY(probe_abi, m) {
  m.def("install() -> ()", &install);
  m.def("say(Tensor t, int n) -> str", &say);
  m.def("say_int(int n) -> str", &say_int);
  m.def("boom(int n) -> ()", &boom);
}
"""
INLINE = (
    "import torch, torch.utils.cpp_extension as ext\n"
    f"ext.load_inline('probe_abi', [{INLINE_SRC!r}], is_python_module=False, verbose=False)\n"
    "torch.ops.probe_abi.install()\n"
)
OUR_CUDA_OP = """
import vllm_wna16_plugin._C
a = torch.zeros(2, 176, dtype=torch.bfloat16, device="cuda")
qw = torch.zeros(4, 64, 88, dtype=torch.uint8, device="cuda")
ids = torch.zeros(16, dtype=torch.int32, device="cuda")
c = torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")
s = torch.ones(4, 64, 1, dtype=torch.float32, device="cuda")
r = torch.ops.wna16_plus.moe_wna16_gemm(a, qw, s, None, None, ids, ids, ids, c, 4, 2, 1, 32, 176, "auto", "none")
print(repr(r)[:120])
"""
CASES = {
    "our-cpu-op (ints in, long str out)": "import torch, vllm_wna16_plugin._C\n"
    "print(repr(torch.ops.wna16_plus.check_launch_config(2048, 64, 16, 32, 512, 4))[:100])",
    "inline say_int (ints in, long str)": INLINE + "print(repr(torch.ops.probe_abi.say_int(1))[:40])",
    "inline say('') (tensor in)": INLINE + "print(repr(torch.ops.probe_abi.say(torch.zeros(3), 0)))",
    "inline say('short')": INLINE + "print(repr(torch.ops.probe_abi.say(torch.zeros(3), 1)))",
    "inline say(100 x)": INLINE + "print(repr(torch.ops.probe_abi.say(torch.zeros(3), 2))[:40])",
    "inline say(c10::str sizes)": INLINE + "print(repr(torch.ops.probe_abi.say(torch.zeros(3), 7)))",
    "inline TORCH_CHECK throw": INLINE + "try:\n    torch.ops.probe_abi.boom(1)\nexcept RuntimeError as e:\n"
    "    print('raised', str(e).splitlines()[0])",
    "our-cuda-op refusal": INLINE + OUR_CUDA_OP,
}


def run(name: str, code: str, gdb: bool = False) -> int:
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    if gdb:
        cmd = ["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 25", "--args", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Extension modules" not in ln]
    keep = lines if gdb else [ln for ln in lines if not ln.startswith('  File "/opt')][-30:]
    print(f"== {name}{' (gdb)' if gdb else ''}: rc {proc.returncode}")
    print("\n".join(("   " + ln)[:240] for ln in (keep[-45:] if gdb else keep)))
    return proc.returncode


def facts() -> None:
    import torch

    print("== facts")
    print("   torch", torch.__version__, "cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI, "cuda", torch.version.cuda)
    for cmd in (["g++", "--version"], ["nvcc", "--version"]):
        if shutil.which(cmd[0]):
            out = subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()
            print("  ", " ".join(cmd), "->", out[0] if cmd[0] == "g++" else out[-1])
    import vllm_wna16_plugin

    so = [f for f in os.listdir(os.path.dirname(vllm_wna16_plugin.__file__)) if f.startswith("_C")]
    print("   extension", so)
    if so and shutil.which("ldd"):
        path = os.path.join(os.path.dirname(vllm_wna16_plugin.__file__), so[0])
        ldd = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        print("  ", " | ".join(ln.strip() for ln in ldd.splitlines() if "stdc++" in ln or "c10" in ln or "gcc" in ln))
        nm = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True).stdout
        print("   undefined std::string symbols: cxx11", nm.count("__cxx11"), "| old-ABI Ss", nm.count("Ss"))
    print("   LD_PRELOAD", os.environ.get("LD_PRELOAD"))


if __name__ == "__main__":
    facts()
    run("inline build", INLINE)  # compiles once; the cases load it from torch's extension cache
    rcs = {name: run(name, code) for name, code in CASES.items()}
    crashed = [n for n, rc in rcs.items() if rc != 0]
    if crashed and shutil.which("gdb"):
        run(crashed[0], CASES[crashed[0]], gdb=True)
    elif crashed:
        print("no gdb on this machine: no native backtrace")
