"""Tune the plugin's Triton WNA16 MoE launch configs on the GPU; write them where configs.py loads them.

For each shape (E, H, I, top_k, group size, bits) and each M, both GEMMs are tuned
alone (GEMM1: N=2I, K=H; GEMM2: N=H, K=I) through invoke_wna16_gemm, on real routing:

  stage A  tile shape: BLOCK_SIZE_M from the M bucket ({1} per pair up to 3 tokens
           per expert, {16, 32, 64} by tokens per expert), BLOCK_SIZE_N {32, 64, 128},
           BLOCK_SIZE_K {64, 128, 256} legal for the group size (per pair also 512, 1024:
           wide_block_k); num_warps 4, num_stages 4.
  stage B  around the best 2 tiles: num_warps {4, 8} x num_stages {3, 4, 5} (and 1 per pair), SPLIT_K {2, 4}
           when the grid is short of 2 programs per SM, use_td True where td_gate allows it; for GEMM1
           also the activation fused into it (fuse_act, at BLOCK_SIZE_N and half of it). An unfused GEMM1
           is charged the activation kernel's time at that M, measured here, when the pair is picked.

Every candidate is checked against a float32 torch reference (relative RMS < 1e-2)
before it is timed; a wrong or failing config is dropped and listed. Timing: a CUDA
graph of R back-to-back GEMMs over R rotating weight copies (L2-cold, >= 200 MB
touched per replay), median of --reps replays. Per M the two GEMMs' BLOCK_SIZE_M are
chosen jointly: a second distinct BLOCK_SIZE_M > 1 costs one more alignment launch,
measured here.

Budget: compiles dominate (about 0.5-1.5 s each; runs cost ~10-30 ms). Compiled
kernels are reused across M (no constexpr depends on M), so the cost is about
(#distinct configs per GEMM) x 2 GEMMs x #shapes: about 40-60 configs per GEMM, 3
shapes x 11 M values in ~5-8 minutes. --budget-s (default 240, so that setup fits
bench/gpu_session.sh's 300 s `tune` step; 420 in a dedicated 8-minute call) is shared out equally
over the (shape, M) slots still to come; a slot past its share stops exploring (stage A
runs default_config first, so every slot times at least that) and the log says so.

    python3 bench/tune.py --shapes qwen3-30b-a3b,qwen3.5-35b-a3b,k1344-gs32 \\
        --m 1,2,4,8,16,32,64,128,256,1024,4096 --out vllm_wna16_plugin/kernels/triton/configs
    python3 bench/tune.py --dry-run   # candidates and compile count per GEMM, no GPU needed

Shapes: the names below, or E:H:I:top_k:gs:bits (gs -1 = channel-wise).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_wna16_plugin.kernels.triton.candidates import (  # noqa: E402, F401 - the tuner's candidate space
    PER_PAIR_MAX_TOKENS_PER_EXPERT,
    REGISTER_CAPS,
    block_m_choices,
    grid_programs,
    legal_block_k,
    stage_a,
    stage_b,
    wide_block_k,
)
from vllm_wna16_plugin.kernels.triton.configs import (  # noqa: E402
    config_file_name,
    default_config,
    gemv_bound,
    prefill_tiles_apply,
)


@dataclass(frozen=True)
class Shape:
    name: str
    E: int
    H: int
    I: int  # noqa: E741
    top_k: int
    gs: int  # -1 = channel-wise
    bits: int = 4


NAMED = {
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 128, 2048, 768, 8, 128),
    "qwen3.5-35b-a3b": Shape("qwen3.5-35b-a3b", 256, 2048, 512, 8, 32),
    "k1344-gs32": Shape("k1344-gs32", 8, 1344, 1024, 2, 32),
    "mixtral-8x7b": Shape("mixtral-8x7b", 8, 4096, 14336, 2, 128),
    "deepseek-v2-lite": Shape("deepseek-v2-lite", 64, 2048, 1408, 6, 128),
    "ct-channelwise": Shape("ct-channelwise", 128, 2816, 704, 8, -1),
}
DEFAULT_SHAPES = "qwen3-30b-a3b,qwen3.5-35b-a3b,k1344-gs32"
M_VALUES = "1,2,4,8,16,32,64,128,256,1024,4096"


def parse_shape(spec: str) -> Shape:
    if spec in NAMED:
        return NAMED[spec]
    parts = spec.split(":")
    if len(parts) not in (5, 6):
        raise ValueError(f"shape {spec!r}: use one of {sorted(NAMED)} or E:H:I:top_k:gs[:bits]")
    vals = [int(v) for v in parts]
    return Shape(spec.replace(":", "-"), *vals)


# The candidates (stage_a, stage_b) live in vllm_wna16_plugin/kernels/triton/candidates.py, shared with
# `vllm-wna16 tune` (the user's own tables); tests/test_tune_candidates.py checks them.


# ---------------------------------------------------------------- GPU side


def time_graph(fns, reps: int) -> float:
    """Median µs per call of a CUDA graph that calls every fn once: the layer benchmark's own timing."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_moe import time_graph as graph_timing

    return graph_timing(fns, reps)[0]


class GemmBench:
    """One GEMM of one shape on the GPU: weights (+ rotating copies), reference, and a timer per (M, config)."""

    def __init__(self, E, N, K, gs, bits, top_k, dtype, gen):
        import torch

        from vllm_wna16_plugin.reference import dequantize_ref

        self.E, self.N, self.K, self.gs, self.bits, self.top_k = E, N, K, gs, bits, top_k
        groups = 1 if gs == -1 else K // gs
        self.q = torch.randint(0, 256, (E, N, K * bits // 8), dtype=torch.uint8, device="cuda", generator=gen)
        s = (0.5 + torch.rand(E, N, groups, device="cuda", generator=gen)) / (K**0.5 * 2 ** (bits - 1))
        self.s = s.to(dtype)
        self.w_ref = dequantize_ref(self.q, self.s, None, bits).to(dtype)  # (E, N, K), as the kernel rounds it
        self.per_copy = self.q.numel() + self.s.numel() * 2
        self.copies = {}

    def weights(self, n):
        if n not in self.copies:
            self.copies = {n: [(self.q, self.s)] + [(self.q.clone(), self.s.clone()) for _ in range(n - 1)]}
        return self.copies[n]


def run_shape(shape: Shape, ms, args, log, deadline, slots_after):
    import torch

    from vllm_wna16_plugin.kernels.align import moe_align_block_size_torch
    from vllm_wna16_plugin.kernels.triton.activation import gated_activation_triton
    from vllm_wna16_plugin.kernels.triton.fused_moe import invoke_wna16_gemm
    from vllm_wna16_plugin.kernels.triton.td_gate import decide_td

    try:
        from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size as align
    except Exception:  # noqa: BLE001 - the torch stand-in when vLLM is missing
        align = moe_align_block_size_torch
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    major, minor = torch.cuda.get_device_capability()
    sm = major * 10 + minor
    prefill = prefill_tiles_apply("cuda", sm)  # default_config's prefill tiles on this device
    gemms = {
        "gemm1": GemmBench(shape.E, 2 * shape.I, shape.H, shape.gs, shape.bits, shape.top_k, dtype, gen),
        "gemm2": GemmBench(shape.E, shape.H, shape.I, shape.gs, shape.bits, shape.top_k, dtype, gen),
    }
    results = {}  # (gemm, M) -> {cfg: us}
    rejected = []
    align_us = {}  # (M, BLOCK_SIZE_M) -> µs of one alignment; (M, "act") -> µs of the activation kernel
    for i, M in enumerate(ms):
        # an equal share of what is left for every (shape, M) still to come: none is starved
        slot_end = time.time() + (deadline - time.time()) / (len(ms) - i + slots_after)
        logits = torch.randn(M, shape.E, device="cuda", generator=gen)
        topk_w, topk_ids = torch.topk(logits.softmax(-1), shape.top_k, dim=-1)
        topk_ids = topk_ids.to(torch.int32)
        pairs = M * shape.top_k
        ids_flat, w_flat = topk_ids.reshape(-1), topk_w.reshape(-1).contiguous()
        hit = int(torch.unique(topk_ids).numel())
        aligns = {}
        for gi, (name, g) in enumerate(gemms.items()):
            gemm_end = time.time() + (slot_end - time.time()) / (len(gemms) - gi)
            rows = M if name == "gemm1" else pairs
            a = torch.randn(rows, g.K, device="cuda", generator=gen).to(dtype)
            a_div = shape.top_k if name == "gemm1" else 1
            ref = torch.empty(pairs, g.N, device="cuda")
            for e in torch.unique(topk_ids).tolist():  # setup only, outside any timing
                p = (ids_flat == e).nonzero().squeeze(1)
                ref[p] = a[p // a_div].float() @ g.w_ref[e].float().T
            half = g.N // 2
            ref_act = torch.nn.functional.silu(ref[:, :half]) * ref[:, half:]  # a fused GEMM1's output
            touched = hit * g.per_copy / shape.E
            n_copies = max(1, min(16, math.ceil(200e6 / touched), int(16e9 // g.per_copy)))
            copies = g.weights(n_copies)
            timed = results.setdefault((name, M), {})

            def measure(cfg, a=a, g=g, ref=ref, ref_act=ref_act, copies=copies, a_div=a_div, timed=timed, name=name,
                        gemm_end=gemm_end):  # fmt: skip
                if cfg in timed or (time.time() > gemm_end and timed):
                    return  # past this M's share: keep what is timed (at least the default)
                if cfg.BLOCK_SIZE_M > 1 and cfg.BLOCK_SIZE_M not in aligns:
                    aligns[cfg.BLOCK_SIZE_M] = align(topk_ids, cfg.BLOCK_SIZE_M, shape.E, None)
                al = aligns.get(cfg.BLOCK_SIZE_M, (None, None, None))
                td = decide_td(requested=bool(cfg.use_td), platform="cuda", sm=sm, block_size_m=cfg.BLOCK_SIZE_M,
                               block_size_k=cfg.BLOCK_SIZE_K, M=a.shape[0], K=g.K, bits=g.bits)  # fmt: skip
                if cfg.use_td and not td.use_td_b:
                    return
                n_out = g.N // 2 if cfg.fuse_act else g.N
                shape_c = (pairs, n_out) if cfg.SPLIT_K == 1 else (cfg.SPLIT_K, pairs, n_out)
                c = torch.empty(shape_c, dtype=dtype if cfg.SPLIT_K == 1 else torch.float32, device="cuda")
                act = "silu" if cfg.fuse_act else None

                def call(q, s, c=c):
                    invoke_wna16_gemm(a, q, s, None, c, w_flat, *al, bits=g.bits, top_k=a_div, mul_routed_weight=False,
                                      config=cfg, td=td, topk_ids=ids_flat, activation=act)  # fmt: skip

                try:
                    call(*copies[0])
                    got = (c if cfg.SPLIT_K == 1 else c.sum(0)).float()
                    want = ref_act if cfg.fuse_act else ref
                    err = ((got - want).norm() / want.norm()).item()
                    if not err < 1e-2:
                        rejected.append((shape.name, name, M, cfg, f"rel err {err:.3g}"))
                        return
                    timed[cfg] = time_graph([lambda q=q, s=s: call(q, s) for q, s in copies], args.reps)
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile/launch is dropped
                    rejected.append((shape.name, name, M, cfg, f"{type(exc).__name__}: {str(exc)[:80]}"))
                    torch.cuda.synchronize()

            bound = gemv_bound(shape.bits, shape.H, shape.I)
            for cfg in stage_a(M, shape.E, g.N, g.K, shape.top_k, shape.gs, shape.bits, prefill, bound):
                measure(cfg)
            ranked = sorted(timed, key=timed.get)
            bases = ranked[:2] + [min((c for c in timed if c.BLOCK_SIZE_M == bm), key=timed.get)
                                  for bm in {c.BLOCK_SIZE_M for c in timed}]  # fmt: skip
            for base in dict.fromkeys(bases):  # the best two, and the best per BLOCK_SIZE_M (joint pick)
                td_ok = sm >= 90 and g.K % base.BLOCK_SIZE_K == 0 and a.shape[0] > 1
                for cfg in stage_b(base, M, shape.E, g.N, g.K, shape.top_k, td_ok, g.bits, fuse=name == "gemm1"):
                    measure(cfg)
            if name == "gemm1":  # what an unfused GEMM1 costs on top: the activation kernel on its output
                h = torch.randn(pairs, g.N, device="cuda", generator=gen).to(dtype)
                align_us[(M, "act")] = time_graph([lambda h=h: gated_activation_triton(h, "silu")], args.reps)
        for bm in aligns:
            align_us[(M, bm)] = time_graph([lambda bm=bm: align(topk_ids, bm, shape.E, None)], args.reps)
        log(f"{shape.name} M={M}: " + ", ".join(f"{n} {len(results[(n, M)])} timed" for n in gemms))
    return gemms, results, align_us, rejected


def pick_joint(t1: dict, t2: dict, align_us: dict, M: int):
    """(cfg1, cfg2, total µs): the best pair, charging one align launch per distinct BLOCK_SIZE_M > 1 and an
    unfused GEMM1 the activation kernel (align_us[(M, "act")])."""
    best = None
    for c1, u1 in t1.items():
        for c2, u2 in t2.items():
            bms = {c1.BLOCK_SIZE_M, c2.BLOCK_SIZE_M} - {1}
            total = u1 + u2 + sum(align_us.get((M, bm), 3.0) for bm in bms)
            total += 0.0 if c1.fuse_act else align_us.get((M, "act"), 0.0)
            if best is None or total < best[2]:
                best = (c1, c2, total)
    return best


def merge_entries(kept: dict, tuned: dict) -> dict:
    """A config file's {M: entry} after a run: this run's entries over the kept ones, keys in M order
    (a run at M 1024-8192 leaves the decode entries of an earlier run in place)."""
    merged = {**kept, **tuned}
    return {m: merged[m] for m in sorted(merged, key=int)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--m", default=M_VALUES)
    ap.add_argument("--out", default=str(ROOT / "vllm_wna16_plugin" / "kernels" / "triton" / "configs"))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=240.0, help="exploration seconds, shared over (shape, M)")
    ap.add_argument("--dry-run", action="store_true", help="list candidates and compile counts; no GPU")
    ap.add_argument(
        "--replace",
        action="store_true",
        help="write only this run's M entries (default: keep a file's entries for the M not tuned here)",
    )
    args = ap.parse_args()
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.m.split(",")]

    if args.dry_run:
        for s in shapes:
            for name, N, K in (("gemm1", 2 * s.I, s.H), ("gemm2", s.H, s.I)):
                distinct = set()
                for M in ms:
                    a = stage_a(M, s.E, N, K, s.top_k, s.gs, s.bits, True, gemv_bound(s.bits, s.H, s.I))  # sm90
                    b = [c for base in a[:3] for c in stage_b(base, M, s.E, N, K, s.top_k, True, fuse=name == "gemm1")]
                    distinct |= set(a) | set(b)
                    print(f"{s.name} {name} M={M}: stage A {len(a)}, stage B <= {len(b)}; default {a[0]}")
                print(f"{s.name} {name}: <= {len(distinct)} distinct configs to compile")
        return 0

    import torch
    import triton

    t0 = time.time()
    deadline = t0 + args.budget_s
    dev = torch.cuda.get_device_name()
    prefill = prefill_tiles_apply(
        "cuda", 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1]
    )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)  # noqa: E731
    log(f"{dev} · torch {torch.__version__} · triton {triton.__version__} · budget {args.budget_s:.0f}s")
    table = ["| shape | M | GEMM1 config | µs | GEMM2 config | µs | default µs (1+act+2) | tuned µs (1+act+2+align) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    all_rejected = []
    for si, s in enumerate(shapes):
        gemms, results, align_us, rejected = run_shape(s, ms, args, log, deadline, (len(shapes) - si - 1) * len(ms))
        all_rejected += rejected
        files = {n: {} for n in gemms}
        for M in ms:
            t1, t2 = results.get(("gemm1", M), {}), results.get(("gemm2", M), {})
            if not t1 or not t2:
                log(f"{s.name} M={M}: nothing timed (budget spent); no entry written")
                continue
            c1, c2, total = pick_joint(t1, t2, align_us, M)
            files["gemm1"][str(M)], files["gemm2"][str(M)] = c1.to_dict(), c2.to_dict()
            bound = gemv_bound(s.bits, s.H, s.I)  # the layer's, as triton_launch passes it
            d1 = default_config(
                M, s.E, 2 * s.I, s.H, s.top_k, s.gs if s.gs != -1 else s.H, s.bits, prefill, gemv_max=bound
            )
            d2 = default_config(M, s.E, s.H, s.I, s.top_k, s.gs if s.gs != -1 else s.I, s.bits, prefill, gemv_max=bound)
            dflt = t1.get(d1, float("nan")) + align_us.get((M, "act"), 0.0) + t2.get(d2, float("nan"))
            fmt = lambda c: (f"{c.BLOCK_SIZE_M}x{c.BLOCK_SIZE_N}x{c.BLOCK_SIZE_K} w{c.num_warps} s{c.num_stages}"  # noqa: E731
                             f"{' k' + str(c.SPLIT_K) if c.SPLIT_K > 1 else ''}{' td' if c.use_td else ''}"
                             f"{' ' + c.nibbles if c.nibbles else ''}{f' r{c.maxnreg}' if c.maxnreg else ''}"
                             f"{' swap' if c.swap_ab else ''}{' fused' if c.fuse_act else ''}")  # fmt: skip
            table.append(f"| {s.name} | {M} | {fmt(c1)} | {t1[c1]:.1f} | {fmt(c2)} | {t2[c2]:.1f} | {dflt:.1f} | "
                         f"{total:.1f} |")  # fmt: skip
        for name, g in gemms.items():
            if files[name]:
                gs = g.K if s.gs == -1 else s.gs
                path = out_dir / config_file_name(s.E, g.N, g.K, gs, s.bits, dev)
                kept = {} if args.replace or not path.is_file() else json.loads(path.read_text())
                path.write_text(json.dumps(merge_entries(kept, files[name]), indent=1) + "\n")
                log(f"wrote {path} ({len(files[name])} entries tuned, {len(set(kept) - set(files[name]))} kept)")
        del gemms
        torch.cuda.empty_cache()
    print("\n".join(table))
    if all_rejected:
        print(f"\n{len(all_rejected)} candidates rejected (wrong or failed), first 20:")
        for r in all_rejected[:20]:
            print("  ", *r)
    if time.time() > deadline - 1:
        print(f"\nbudget of {args.budget_s:.0f}s spent: each (shape, M) kept what fit its share (raise --budget-s)")
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
