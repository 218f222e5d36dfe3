"""Probe (GPU): do refusals of torch.ops.wna16_plus.moe_wna16_gemm reach Python without a crash?

On 2026-12-03 a TORCH_CHECK thrown inside the op segfaulted the process on the H200 machine (it
raised cleanly on the CPU machine); the op now returns its refusal and never throws. Run:
python3 bench/probe_refusals.py (prints each refusal, exits 0)."""

import faulthandler
import sys

import torch
import vllm_wna16_plugin._C  # noqa: F401

faulthandler.enable()
dev = "cuda"
a = torch.zeros(2, 176, dtype=torch.bfloat16, device=dev)
qw = torch.zeros(4, 64, 88, dtype=torch.uint8, device=dev)
ids = torch.zeros(16, dtype=torch.int32, device=dev)
c = torch.empty(4, 64, dtype=torch.bfloat16, device=dev)
for what, scales, kernel in [
    ("scales dtype", torch.ones(4, 64, 1, dtype=torch.float32, device=dev), "auto"),
    ("mma on K=176", torch.ones(4, 64, 1, dtype=torch.bfloat16, device=dev), "mma"),
]:
    print("probe:", what, flush=True)
    try:
        refusal = torch.ops.wna16_plus.moe_wna16_gemm(
            a, qw, scales, None, None, ids, ids, ids, c, 4, 2, 1, 32, 176, kernel
        )
        print("  refused:" if refusal else "  launched", refusal[:160], flush=True)
    except RuntimeError as exc:
        print("  raised:", str(exc).splitlines()[0][:160], flush=True)
sys.exit(0)
