"""The hopper kernel against the float reference on the layers the GPU runs of 2026-12-06 saw go wrong (H200,
eda7a88: int8 and zero-point layers whose K is not a multiple of 128, an int8 checkpoint's decode batches; and the
group-128 fault of bench/hopper_group_diag.py), each routing run twice with every built token tile:

    python3 bench/hopper_layer_diag.py [--seeds 5] [--cases int8-e2e,int8-qwen3,zp-phi,int4-g128]

Prints per (case, M, seed) the relative error, whether the two calls agree, and the token rows off by more than 5%
of the output's largest value; exits 1 when any row was wrong.
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

# name: (H, I, E, top_k, bits, gs1, gs2, zero points, Ms, kernel group); int8-e2e with scales drawn as a checkpoint's
# (not rounded to be exact in bf16 products)
CASES = {
    "int8-e2e": (2048, 2048, 8, 2, 8, 128, 128, False, (1, 2, 3, 5, 8, 64, 256), 64),
    "int8-qwen3": (2048, 192, 128, 8, 8, 128, 64, False, (16, 64, 256), 64),
    "zp-phi": (4096, 1600, 16, 2, 4, 128, 64, True, (64, 256), 64),
    "int4-qwen3": (2048, 192, 128, 8, 4, 128, 64, False, (4, 32, 64), 64),
    "int4-g128": (2048, 192, 128, 8, 4, 128, 64, False, (32, 48, 64), 128),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    wrong = 0
    for name in args.cases.split(","):
        h, i, e, top_k, bits, gs1, gs2, zp, ms, group = CASES[name]
        for m in ms:
            for seed in range(args.seeds):
                p = make_moe_problem(M=m, H=h, I=i, E=e, top_k=top_k, bits=bits, gs1=gs1, gs2=gs2, zp=zp, seed=seed,
                                     exact_scales=name != "int8-e2e")  # fmt: skip
                x, w13, w2, s13, s2, tw, ti = [t.cuda() for t in p.args()]
                kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in p.kwargs().items()}
                ref = fused_moe_wna16_ref(x, w13, w2, s13, s2, tw, ti, **kw).float()
                zeros = dict(w13_qzeros=kw["w13_qzeros"], w2_qzeros=kw["w2_qzeros"]) if zp else {}
                state = hopper_ops.prepare(w13, w2, s13, s2, gs1, gs2, kernel_group=group, bits=bits, **zeros)
                cells = []
                for tile in hopper_ops.built_tiles(x.dtype, zp, bits):
                    launch = hopper_ops.HopperLaunch(tile)
                    o1 = hopper_ops.fused_moe_hopper(x, state, tw, ti, launch).float()
                    o2 = hopper_ops.fused_moe_hopper(x, state, tw, ti, launch).float()
                    err = ((o1 - ref).norm() / ref.norm()).item()
                    bad = ((o1 - ref).abs() > 0.05 * ref.abs().max()).any(-1).nonzero().flatten().tolist()
                    wrong += bool(bad)
                    cells.append(f"t{tile}: err {err:.4f} same {bool(torch.equal(o1, o2))} rows {bad[:6]}")
                print(f"{name} M={m} seed={seed}: " + " | ".join(cells), flush=True)
    print(f"wrong (routing x tile): {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
