"""Run one MoE layer's kernels a few times for Nsight Compute (GPU): the plugin's `cuda` (mma) and
`triton` backends and vLLM's Marlin, on one benchmark shape and batch size.

    ncu --kernel-name regex:'moe_wna16_mma|moe_wna16_gemv|_fused_moe_wna16|^Marlin' --launch-count 18 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section Occupancy python3 bench/profile_kernels.py --shape mixtral-8x7b --m 1

(`bench/gpu_session.sh profile` runs that.) The point is the question docs/perf-notes.md leaves
open: is the mma kernel bound by DRAM, by L1/L2 requests, or by instruction issue at M = 1?
"""

from __future__ import annotations

import argparse

import torch
from bench_moe import SHAPES, Weights, make_weights, plugin_backend  # bench/ is on sys.path as the script's folder

from vllm_wna16_plugin import packing


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="mixtral-8x7b", choices=[s.name for s in SHAPES])
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--providers", default="plugin-cuda,plugin-triton,vllm-marlin")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    s = next(s for s in SHAPES if s.name == args.shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q13, q2 = make_weights(s, 4, gen)
    kw13, kw2 = packing.to_kernel_layout(q13, torch.bfloat16), packing.to_kernel_layout(q2, torch.bfloat16)
    w = Weights(kw13.qweight, kw2.qweight, kw13.scales, kw2.scales)
    x = torch.randn(args.m, s.H, generator=gen, device="cuda").to(torch.bfloat16)
    tw, ids = torch.topk(torch.randn(args.m, s.E, generator=gen, device="cuda").softmax(-1), s.top_k, dim=-1)
    ids = ids.to(torch.int32)
    for prov in args.providers.split(","):
        runner = plugin_backend(prov, x, w, ids, s.gs)
        for _ in range(args.iters):
            runner.run(x, tw, ids)
        torch.cuda.synchronize()
        print(f"profile_kernels: ran {prov} x{args.iters} on {s.name} M={args.m}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
