"""The group-128 fault of the hopper kernel, reproduced on the GPU (docs/perf/hopper-path.md): a Qwen3-30B-A3B-shaped
layer at TP 4 (H=2048, I=192, E=128, top_k=8; gate/up in groups of 128, down in 64), each routing run with the
scales in the kernel as groups of 128 (CUTLASS reading each scale row for two K tiles) and repeated to groups of 64
(what the backend runs), each twice and with two token tiles.

    python3 bench/hopper_group_diag.py [--seeds 20] [--m 16,32,48,64,1024]

Prints per routing the relative error against the float reference, whether the two calls agree, and the token rows
off by more than 5% of the output's largest value. On the H100 at d47488b: M=32 seed 0 had one wrong row (19) at
groups of 128 and none at 64.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernels.conftest import make_moe_problem  # noqa: E402
from vllm_wna16_plugin.kernels import hopper_ops  # noqa: E402
from vllm_wna16_plugin.reference import fused_moe_wna16_ref  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--m", default="32,48,64,1024")
    args = ap.parse_args(argv)
    wrong = {128: 0, 64: 0}
    for m in (int(v) for v in args.m.split(",")):
        for seed in range(args.seeds):
            p = make_moe_problem(M=m, H=2048, I=192, E=128, top_k=8, bits=4, gs1=128, gs2=64, seed=seed)
            x, w13, w2, s13, s2, tw, ti = [t.cuda() for t in p.args()]
            ref = fused_moe_wna16_ref(x, w13, w2, s13, s2, tw, ti, bits=4).float()
            cells = []
            for group in (128, 64):
                state = hopper_ops.prepare(w13, w2, s13, s2, 128, 64, kernel_group=group)
                for tile in (32, 128):
                    launch = hopper_ops.HopperLaunch(tile)
                    o1 = hopper_ops.fused_moe_hopper(x, state, tw, ti, launch).float()
                    o2 = hopper_ops.fused_moe_hopper(x, state, tw, ti, launch).float()
                    err = ((o1 - ref).norm() / ref.norm()).item()
                    bad = ((o1 - ref).abs() > 0.05 * ref.abs().max()).any(-1).nonzero().flatten().tolist()
                    wrong[group] += bool(bad)
                    cells.append(f"g{group} t{tile}: err {err:.4f} same {bool(torch.equal(o1, o2))} rows {bad[:6]}")
            print(f"M={m} seed={seed}: " + " | ".join(cells), flush=True)
    print(f"wrong (routing x tile): groups of 128: {wrong[128]}, groups of 64: {wrong[64]}")
    return 1 if wrong[64] else 0


if __name__ == "__main__":
    raise SystemExit(main())
