"""Instructions per weight in the main loop of each WNA16 kernel, from its sm90 SASS (no GPU needed).

A decode GEMM streams every weight once, so a kernel stays bound by HBM only while it issues few
instructions per weight: an H200 issues about 132 SMs x 4 schedulers x 1.98 GHz = 1.05e12 warp
instructions per second, so a GEMM over W weights needs W x (instructions per weight per lane) / 32 /
1.05e12 seconds of issue alone. Mixtral's GEMM1 at M=1 has W = 235e6: 8 instructions per weight
and lane is 56 µs of issue, against 28 µs of weight bytes at 4.2 TB/s.

    python bench/sass_cost.py            # Triton per-pair kernel (tile and folded forms), tl.dot kernel
    python bench/sass_cost.py --cuda vllm_wna16_plugin/_C*.so   # also the CUDA extension's mma kernel

It compiles the Triton kernels for sm90 with the wheel's ptxas (Triton's own nvdisasm reads the
cubin), finds each kernel's K loop (Triton: its largest loop; CUDA: the innermost one with mma), and divides its instruction count by the
weights one lane handles per iteration. A static count: no stalls, no memory; it ranks forms of the
same kernel, it does not time them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRITON_BIN = Path(__import__("triton").__file__).parent / "backends/nvidia/bin"

_COMPILE = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_wna16_plugin.kernels.triton import fused_moe

bits, pair, fold, bm, bn, bk, warps, fuse, out = sys.argv[1:10]
bits, pair, fold, bm, bn, bk, warps, fuse = map(int, (bits, pair, fold, bm, bn, bk, warps, fuse))
kernel = fused_moe._fused_moe_wna16_pair_kernel if pair else fused_moe._fused_moe_wna16_kernel
K, N, gs = 4096, 28672, 128  # Mixtral-8x7B GEMM1
ptrs = dict(a_ptr="*bf16", b_ptr="*u8", c_ptr="*bf16", s_ptr="*bf16", z_ptr="*u8", topk_weights_ptr="*fp32",
            sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32", num_tokens_post_padded_ptr="*i32",
            topk_ids_ptr="*i32", expert_map_ptr="*i32", a_perm_ptr="*i32")
consts = dict(stride_ak=1, stride_cn=1, stride_sg=1, stride_zg=1, N=N, K=K, group_size=gs, NUM_GROUPS=K // gs,
              GROUPS=max(1, bk // gs), top_k=2, BITS=bits, HAS_ZP=False, MUL_ROUTED_WEIGHT=False, EVEN_K=True,
              USE_TD=False, USE_TD_GATHER=False, SPLIT_K=1, HAS_EXPERT_MAP=False, NUM_STAGES=4,
              compute_type=tl.bfloat16, INTERPRET_BF16=False, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
              GROUP_SIZE_M=1, FOLD_SCALES=bool(fold), REDUCE_EACH_STEP=bool(fold) or bk > fused_moe.PAIR_ACC_MAX_K,
              SPLIT_NIBBLES=fold in (1, 4), WORD_NIBBLES=fold in (2, 5), SWAP_AB=fold in (3, 4, 5), HAS_A_PERM=False,
              FUSE_ACT=bool(fuse), ACTIVATION="silu")
# `fold`: the form (per pair: 1 folded; tl.dot: 1 split, 2 words, 3/4/5 interleaved/split/words swapped)
consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
sig, attrs = {}, {}
for i, name in enumerate(kernel.arg_names):
    sig[name] = ptrs.get(name, "constexpr" if name in consts else ("i64" if name.startswith("stride") else "i32"))
    if (name in ptrs or name.startswith("stride_")) and name not in consts:
        attrs[(i,)] = [["tt.divisibility", 16]]
k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=4))
open(out, "wb").write(k.asm["cubin"])
"""


def loops(sass: str) -> list[tuple[str, int, collections.Counter]]:
    """(function, instructions, opcode counts) of every backward-branch loop of every function."""
    found = []
    for func in re.split(r"//-+ \.text\.", sass)[1:]:
        name, pos, seq = func.split()[0].rstrip(":"), {}, []
        for line in func.splitlines():
            label = re.match(r"\.L_x_(\d+):", line.strip())
            if label:
                pos[label.group(1)] = len(seq)
            elif re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
                seq.append(line)
        for i, line in enumerate(seq):
            target = re.search(r"BRA.*\.L_x_(\d+)", line)
            if target and pos.get(target.group(1), i) < i:
                body = seq[pos[target.group(1)] : i + 1]
                ops = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", x).group(1) for x in body)
                found.append((name, len(body), ops))
    return found


def disassemble(cubin: str) -> str:
    return subprocess.run(
        [str(TRITON_BIN / "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
    ).stdout


def triton_rows(tmp: str) -> list[str]:
    rows = []
    # (label, bits, per pair, form (per pair: 1 folded; tl.dot: 1 split nibbles, 2 word nibbles, 3/4/5 the
    # interleaved/split/words forms swapped: TritonMoEConfig.swap_ab), BLOCK_M, BLOCK_N, BLOCK_K, warps)
    for label, *cfg in [
        ("per-pair tile 1x64x256", 4, 1, 0, 1, 64, 256, 4),
        ("per-pair folded 1x64x256", 4, 1, 1, 1, 64, 256, 4),
        ("per-pair folded 1x64x1024", 4, 1, 1, 1, 64, 1024, 4),
        ("per-pair tile 1x32x256 int8", 8, 1, 0, 1, 32, 256, 4),
        ("per-pair folded 1x32x256 int8", 8, 1, 1, 1, 32, 256, 4),
        ("tl.dot interleaved 16x128x256", 4, 0, 0, 16, 128, 256, 4),
        ("tl.dot split nibbles 16x128x256", 4, 0, 1, 16, 128, 256, 4),
        ("tl.dot word nibbles 16x128x256", 4, 0, 2, 16, 128, 256, 4),
        ("tl.dot split nibbles 16x64x128", 4, 0, 1, 16, 64, 128, 4),
        ("tl.dot word nibbles 16x64x128", 4, 0, 2, 16, 64, 128, 4),
        ("tl.dot split nibbles 16x128x128", 4, 0, 1, 16, 128, 128, 4),
        ("tl.dot word nibbles 16x128x128", 4, 0, 2, 16, 128, 128, 4),
        # the swapped tile: wgmma (HGMMA) where Triton takes the dequantized weights as a register operand
        ("tl.dot interleaved 16x128x128", 4, 0, 0, 16, 128, 128, 4),
        ("tl.dot swapped interleaved 16x128x128", 4, 0, 3, 16, 128, 128, 4),
        ("tl.dot swapped split 16x128x128", 4, 0, 4, 16, 128, 128, 4),
        ("tl.dot swapped words 16x128x128", 4, 0, 5, 16, 128, 128, 4),
        ("tl.dot swapped words 16x128x256", 4, 0, 5, 16, 128, 256, 4),
        ("tl.dot swapped interleaved 16x64x128", 4, 0, 3, 16, 64, 128, 4),
        ("tl.dot swapped interleaved 32x128x64", 4, 0, 3, 32, 128, 64, 4),
        ("tl.dot interleaved 64x128x64 (8 warps)", 4, 0, 0, 64, 128, 64, 8),
        ("tl.dot swapped interleaved 64x128x64 (8 warps)", 4, 0, 3, 64, 128, 64, 8),
        ("tl.dot swapped interleaved 16x128x128 int8", 8, 0, 3, 16, 128, 128, 4),
        # GEMM1 with the activation fused (TritonMoEConfig.fuse_act): gate and up tiles per K step
        ("per-pair folded 1x32x256 fused", 4, 1, 1, 1, 32, 256, 4, 1),
        ("per-pair folded 1x64x256 fused", 4, 1, 1, 1, 64, 256, 4, 1),
        ("tl.dot word nibbles 16x64x128 fused", 4, 0, 2, 16, 64, 128, 4, 1),
        ("tl.dot swapped words 16x64x128 fused", 4, 0, 5, 16, 64, 128, 4, 1),
    ]:
        cfg = (*cfg, 0) if len(cfg) == 7 else tuple(cfg)  # the last field: the activation fused
        bits, pair, fold, bm, bn, bk, warps, fuse = cfg
        out = os.path.join(tmp, f"{label.replace(' ', '_')}.cubin")
        # ROOT first; a PYTHONPATH of the caller's (e.g. another Triton: PYTHONPATH=/tmp/triton36) after it
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT),
               os.environ.get("PYTHONPATH"))))}  # fmt: skip
        args = [sys.executable, "-c", _COMPILE, *map(str, cfg), out]
        res = subprocess.run(args, capture_output=True, text=True, env=env)
        if res.returncode:
            rows.append(f"| Triton {label} | compile failed: {res.stderr.strip().splitlines()[-1]} | | | |")
            continue
        _, n, ops = max(loops(disassemble(out)), key=lambda f: f[1])
        per_lane = (2 if fuse else 1) * bn * bk / (32 * warps)  # weights a lane handles per K step (M rows share them)
        mma = ", ".join(f"{o} {ops[o]}" for o in ("HGMMA", "HMMA") if ops[o]) or "none"
        rows.append(
            f"| Triton {label} | {n} | {n / per_lane:.2f} | {mma} | "
            f"{', '.join(f'{o} {c}' for o, c in ops.most_common(6))} |"
        )
    return rows


def cuda_rows(so: str, tmp: str) -> list[str]:
    subprocess.run(
        [str(TRITON_BIN / "cuobjdump"), "-xelf", "all", os.path.abspath(so)], cwd=tmp, check=True, capture_output=True
    )
    rows = []
    for cubin in sorted(glob.glob(os.path.join(tmp, "*mma*.cubin"))):
        inner = {}  # the innermost loop with tensor-core work of each bf16 kernel: its K loop
        for name, n, ops in loops(disassemble(cubin)):
            if "bfloat16" in name and ops.get("HMMA") and (name not in inner or n < inner[name][0]):
                inner[name] = (n, ops)
        for name, (n, ops) in inner.items():
            m = re.search(r"kernelI13__nv_bfloat16Li(\d)ELi(\d)E", name)
            # m16n8k16: 256 weights per warp (8 per lane), shared by the token column tiles of 8
            per_lane = ops["HMMA"] * 8 / (int(m.group(2)) if m else 1)
            label = f"mma int{m.group(1)}, {8 * int(m.group(2))} token columns" if m else name[:40]
            rows.append(
                f"| CUDA {label} | {n} | {n / per_lane:.2f} | HMMA {ops['HMMA']} | "
                f"{', '.join(f'{o} {c}' for o, c in ops.most_common(6))} |"
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", help="the built extension (.so) whose mma kernel to count as well")
    args = ap.parse_args()
    print(
        "| kernel (sm90) | loop instructions | per weight and lane | tensor-core ops | top opcodes |\n|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as tmp:
        rows = triton_rows(tmp) + (cuda_rows(args.cuda, tmp) if args.cuda else [])
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
