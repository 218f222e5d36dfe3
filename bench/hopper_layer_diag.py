"""The hopper kernel against the float reference on the layers the GPU runs of 2026-12-06 saw go wrong (H200,
eda7a88: int8 and zero-point layers whose K is not a multiple of 128, an int8 checkpoint's decode batches; and the
group-128 fault of bench/hopper_group_diag.py), each routing run twice with every built token tile:

    python3 bench/hopper_layer_diag.py [--seeds 5] [--cases int8-e2e,int8-qwen3,zp-phi,int4-g128] [--controls triton,marlin]

Prints per (case, M, seed) the relative error, whether the two calls agree, and the token rows off by more than 5%
of the output's largest value; exits 1 when any row was wrong. --controls runs the same routing through other
backends named as a user names them (oracle.select_backend: the plugin's triton / cuda, vLLM's marlin / humming), so
the hopper kernel's error is read beside theirs on the same weights; a control that does not take the layer says
why. The last line is each backend's mean relative error per case.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernels.conftest import make_moe_problem  # noqa: E402
from vllm_wna16_plugin.backends.base import KernelTensors  # noqa: E402
from vllm_wna16_plugin.kernels import hopper_ops  # noqa: E402
from vllm_wna16_plugin.launch_plan import LayerRunner  # noqa: E402
from vllm_wna16_plugin.ops import make_problem  # noqa: E402
from vllm_wna16_plugin.oracle import select_backend  # noqa: E402
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
    ap.add_argument("--controls", default="", help="backends to run beside hopper, e.g. triton,marlin")
    args = ap.parse_args(argv)
    controls = [c for c in args.controls.split(",") if c]
    wrong = 0
    errors: dict[tuple[str, str], list[float]] = {}
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
                    errors.setdefault((name, f"hopper-t{tile}"), []).append(err)
                for backend in controls:
                    tensors = (x, w13, w2, s13, s2, tw, ti, kw)
                    cells.append(
                        f"{backend}: {control_error(backend, (bits, gs1, gs2, zp), tensors, ref, errors, name)}"
                    )
                print(f"{name} M={m} seed={seed}: " + " | ".join(cells), flush=True)
    for (name, backend), errs in sorted(errors.items()):
        print(f"mean relative error {name} {backend}: {sum(errs) / len(errs):.4f} over {len(errs)} routings")
    print(f"wrong (routing x tile): {wrong}")
    return 1 if wrong else 0


def control_error(backend, form, tensors, ref, errors, name) -> str:
    """The layer run by a named backend on the same tensors: its relative error against the reference."""
    bits, gs1, gs2, zp = form
    x, w13, w2, s13, s2, tw, ti, kw = tensors
    zeros = dict(w13_qzeros=kw["w13_qzeros"], w2_qzeros=kw["w2_qzeros"]) if zp else {}
    problem = make_problem(x, w13, w2, s13, s2, ti, bits=bits, group_size=(gs1, gs2),
                           has_zero_point=zp, topk_weights=tw, **zeros)  # fmt: skip
    try:
        runner = LayerRunner(select_backend(problem, backend, "provider"), KernelTensors(w13, w2, s13, s2, **zeros))
    except ValueError as exc:
        return f"n/a ({str(exc)[:80]})"
    out = runner.run(x, tw, ti).float()
    err = ((out - ref).norm() / ref.norm()).item()
    errors.setdefault((name, backend), []).append(err)
    return f"err {err:.4f}"


if __name__ == "__main__":
    raise SystemExit(main())
