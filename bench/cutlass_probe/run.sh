#!/usr/bin/env bash
# CUTLASS 4.2's example 69 (Hopper int4 x bf16 grouped GEMM: TMA, wgmma, warp-specialised cooperative persistent
# kernel; the weights are the MMA's M side: 128 weight rows x 16, 32 or 64 tokens a tile, one binary each) on MoE
# GEMMs, one line each: tokens per expert, N (output rows of the weights), K, experts hit; group scales of 128
# (--mode=1). The example
# checks its result against its own reference ("Disposition") and times 30 launches with CUDA events (no CUDA
# graph: each time includes a launch). Built by bench/cutlass_probe/build.sh; docs/perf/hopper-path.md.
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# Mixtral-8x7B at TP 4 (GEMM1 N=2I=7168 K=4096; GEMM2 N=4096 K=3584) at 16/32/64 tokens per expert (M 64/128/256),
# Mixtral-8x22B at TP 4 at 16, Qwen3-30B-A3B at TP 1 at 16 (M=256), Mixtral-8x7B's GEMM1 at prefill (M=4096)
# PROBE_SPECS="tokens N K experts;..." replaces the list (e.g. prefill shapes for the wide-tile binaries)
default="16 7168 4096 8;16 4096 3584 8;32 7168 4096 8;32 4096 3584 8;64 7168 4096 8;64 4096 3584 8;16 8192 6144 8"
default="$default;16 6144 4096 8;16 1536 2048 128;16 2048 768 128;1024 28672 4096 8"
IFS=';' read -ra specs <<<"${PROBE_SPECS:-$default}"
for spec in "${specs[@]}"; do
  set -- $spec
  for bin in ./ex69_n*; do
    r=$(timeout 60 "$bin" --m="$1" --n="$2" --k="$3" --groups="$4" --c=128 --mode=1 --iterations=30 --warmup=5 2>&1 \
        | grep -E "Disposition|Avg runtime|GFLOPS" | tr -s ' \n' ' ')
    echo "tile 128x${bin#./ex69_n} tokens/expert=$1 N=$2 K=$3 experts=$4: $r"
  done
done
# zero points (mode 2: scale * q + zero) on one shape
r=$(timeout 60 ./ex69_n16 --m=16 --n=7168 --k=4096 --groups=8 --c=128 --mode=2 --iterations=30 --warmup=5 2>&1 \
    | grep -E "Disposition|Avg runtime" | tr -s ' \n' ' ')
echo "mode 2 (zero points) tile 128x16 tokens/expert=16 N=7168 K=4096 experts=8: $r"
# the same GEMMs in bf16 (torch.bmm over the experts, weights dequantized: the dense bar) and the copy bandwidth
python3 - <<'PY' 2>&1 || true
import torch
def t(f, n=30):
    for _ in range(5): f()
    s = [torch.cuda.Event(enable_timing=True) for _ in range(2 * n)]
    for i in range(n):
        s[2 * i].record(); f(); s[2 * i + 1].record()
    torch.cuda.synchronize()
    v = sorted(s[2 * i].elapsed_time(s[2 * i + 1]) for i in range(n)); return v[n // 2] * 1e3
x = torch.empty(2**30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
us = t(lambda: y.copy_(x)); print(f"copy 1 GiB: {us:.0f} us, {2 * 2**30 / us / 1e3:.0f} GB/s")
for m, n, k, e in [(16, 7168, 4096, 8), (16, 4096, 3584, 8), (64, 7168, 4096, 8), (64, 4096, 3584, 8),
                   (16, 1536, 2048, 128), (1024, 28672, 4096, 8)]:
    a = torch.randn(e, m, k, dtype=torch.bfloat16, device="cuda"); w = torch.randn(e, k, n, dtype=torch.bfloat16, device="cuda")
    us = t(lambda: torch.bmm(a, w)); print(f"bf16 bmm tokens/expert={m} N={n} K={k} experts={e}: {us:.1f} us, {2 * m * n * k * e / us / 1e6:.1f} TFLOPS")
PY
