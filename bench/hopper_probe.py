"""Issue 23's prototype on the GPU: the routed-experts layer on CUTLASS's Hopper grouped int4 x bf16 GEMM.

    python3 bench/hopper_probe.py [--out DIR]      # sm90, no vLLM needed
    python3 bench/hopper_probe.py --install-only   # only the build, installed as vllm_wna16_plugin/_hopper.so

--install-only builds the plugin's hopper extension without setup.py (no vLLM, no CUDA ops: a device call that
tests only the hopper kernels, `PYTHONPATH=. python3 -m pytest tests/kernels/test_hopper_gpu.py`, skips the bundle
and the other extension's build).

Builds csrc/hopper/moe_w4a16_grouped.cu with torch's JIT build (CUTLASS headers from the nvidia-cutlass
wheel: $CUTLASS_DIR, else .cutlass-probe/nvidia_cutlass-*.whl unpacked, else the installed cutlass_library),
then for MoE layers of real models' shapes (symmetric int4, group 128, bf16):

    route -> gather -> grouped GEMM1 -> silu(gate) * up -> grouped GEMM2 -> weighted sum over top_k
    (one extension call; the token-tile width by the rows an expert takes: 32, 64, 128 or 256)

checks the layer against the float reference (the plugin's reference.fused_moe_ref on the dequantized
weights), captures it in a CUDA graph and times replays (median, µs per layer call), beside torch's bf16
matmuls of the same GEMMs, one per expert (the dense bar). Not wired into the plugin: docs/perf/hopper-path.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_wna16_plugin import packing  # noqa: E402
from vllm_wna16_plugin.reference import fused_moe_ref  # noqa: E402

# (name, E, top_k, H, I): Mixtral-8x7B and Mixtral-8x22B at TP 4, Qwen3-30B-A3B at TP 1, DeepSeek-V3 at TP 8
SHAPES = [("Mixtral-8x7B@tp4", 8, 2, 4096, 3584), ("Mixtral-8x22B@tp4", 8, 2, 6144, 4096),
          ("Qwen3-30B-A3B@tp1", 128, 8, 2048, 768), ("DeepSeek-V3@tp8", 256, 8, 7168, 256)]  # fmt: skip
M_VALUES = [16, 64, 128, 256, 1024, 4096]
GROUP = 128
TILES = (32, 64, 128, 256)  # the bf16 int4 builds (csrc/hopper/grouped_tile_<N>.cu)
STAGES = ("route", "gather", "GEMM1", "activation", "GEMM2", "sum")


def cutlass_include() -> list[str]:
    """The include directories of CUTLASS's headers and its tools/util headers."""
    root = os.environ.get("CUTLASS_DIR")
    if not root:
        wheels = sorted(glob.glob(str(ROOT / ".cutlass-probe" / "nvidia_cutlass-*.whl")))
        if wheels:
            dest = Path("/tmp/cutlass-wheel")
            if not (dest / "cutlass_library").exists():
                zipfile.ZipFile(wheels[-1]).extractall(dest)
            root = str(dest / "cutlass_library" / "source")
        else:
            import cutlass_library  # noqa: PLC0415

            root = str(Path(cutlass_library.__file__).parent / "source")
    return [f"{root}/include", f"{root}/tools/util/include"]


def build(name: str = "wna16_hopper"):
    from torch.utils.cpp_extension import load

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    t0 = time.time()
    hopper = ROOT / "csrc" / "hopper"
    sources = [hopper / "moe_w4a16_grouped.cu", *sorted(hopper.glob("grouped_tile_*.cu"))]
    # the shared libstdc++ by name, as setup.py links it (a static copy crashed on TORCH_CHECK's messages there)
    ext = load(name=name, sources=[str(p) for p in sources], extra_ldflags=["-l:libstdc++.so.6"],
               extra_include_paths=cutlass_include(),
               # torch's extension flags turn off the half/bf16 operators CUTLASS's types are built on
               extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-DNDEBUG", "-U__CUDA_NO_HALF_OPERATORS__",
                                  "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                                  "-U__CUDA_NO_HALF2_OPERATORS__"],
               build_directory=_build_dir(), verbose=False)  # fmt: skip
    print(f"built the extension in {time.time() - t0:.0f} s", flush=True)
    return ext


def _build_dir() -> str:
    d = Path("/tmp/wna16-hopper-build")
    d.mkdir(exist_ok=True)
    return str(d)


class Layer:
    """One layer's prepared tensors for the extension and the float weights for the reference."""

    def __init__(self, ext, E, top_k, H, inter, gen):  # noqa: N803
        self.ext, self.E, self.top_k, self.H, self.inter = ext, E, top_k, H, inter
        w13 = torch.randn(E, 2 * inter, H, generator=gen, device="cuda") / H**0.5
        w2 = torch.randn(E, H, inter, generator=gen, device="cuda") / inter**0.5
        q13, q2 = packing.quantize_rtn(w13, 4, GROUP, False), packing.quantize_rtn(w2, 4, GROUP, False)
        k13, k2 = packing.to_kernel_layout(q13, torch.bfloat16), packing.to_kernel_layout(q2, torch.bfloat16)
        q13.scales, q2.scales = k13.scales.float(), k2.scales.float()  # the reference sees the bf16 scales
        self.dense13, self.dense2 = packing.dequantize(q13), packing.dequantize(q2)
        self.w13 = ext.prepare_weights(k13.qweight.contiguous(), 4)
        self.w2 = ext.prepare_weights(k2.qweight.contiguous(), 4)
        self.s13 = k13.scales.transpose(1, 2).contiguous()  # (E, G, N)
        self.s2 = k2.scales.transpose(1, 2).contiguous()
        self.consts = ext.layer_constants(
            E, 2 * inter, H, H, inter, H // GROUP, inter // GROUP, 4, torch.device("cuda")
        )

    def tile(self, m: int) -> int:
        """The token-tile width for m tokens: the narrowest of TILES that holds the rows an expert hit takes
        on average (m * top_k pairs over the experts hit, uniform routing)."""
        hit = self.E * (1 - (1 - 1 / self.E) ** (m * self.top_k))
        rows = m * self.top_k / max(hit, 1.0)
        return next((t for t in TILES if t >= rows), TILES[-1])

    def __call__(self, x, topk_w, topk_ids, stages: int = 6, tile: int | None = None):
        t = tile or self.tile(x.shape[0])
        return self.ext.moe_forward(x, topk_ids, topk_w, self.w13, self.s13, self.w2, self.s2, None, None,
                                    self.consts, 4, GROUP, GROUP, t, t, stages)  # fmt: skip


def routing(m, E, top_k, gen):  # noqa: N803
    logits = torch.randn(m, E, generator=gen, device="cuda")
    w, ids = torch.topk(torch.softmax(logits, -1), top_k)
    return (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32).contiguous()


def graph_time(fn, reps: int = 10, calls: int = 10) -> float:
    """Median µs per call of `calls` calls of fn captured in one CUDA graph, over `reps` replays (tune's timer)."""
    from vllm_wna16_plugin.tools.tune import graph_time_us

    return graph_time_us([fn] * calls, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--m", default=",".join(map(str, M_VALUES)))
    ap.add_argument("--breakdown", action="store_true", help="also time each stage (by prefixes of the layer)")
    ap.add_argument("--all-tiles", action="store_true", help="also time the layer with every tile width")
    ap.add_argument("--install-only", action="store_true", help="build as vllm_wna16_plugin/_hopper.so and exit")
    args = ap.parse_args(argv)
    if args.install_only:
        import shutil

        ext = build("_hopper")
        shutil.copy(ext.__file__, ROOT / "vllm_wna16_plugin" / "_hopper.so")
        print(f"installed {ext.__file__} as vllm_wna16_plugin/_hopper.so", flush=True)
        return 0
    ms = [int(v) for v in args.m.split(",")]
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    ext = build()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, E, top_k, H, inter in SHAPES:  # noqa: N806
        layer = Layer(ext, E, top_k, H, inter, gen)
        dense13 = layer.dense13.to(torch.bfloat16)
        dense2 = layer.dense2.to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, H, generator=gen, device="cuda").to(torch.bfloat16)
            topk_w, topk_ids = routing(m, E, top_k, gen)
            got = layer(x, topk_w, topk_ids).float()
            ref = fused_moe_ref(x, layer.dense13, layer.dense2, topk_w, topk_ids).float()
            err = ((got - ref).norm() / ref.norm()).item()
            ok = err < 2e-2 and bool(torch.isfinite(got).all())
            us = graph_time(lambda: layer(x, topk_w, topk_ids)) if ok else float("nan")  # noqa: B023
            # the dense bar: the same two GEMMs as bf16 matmuls over each expert's rows (torch, eager loop)
            counts = torch.bincount(topk_ids.flatten().long(), minlength=E).tolist()
            a1 = [torch.randn(c, H, device="cuda", dtype=torch.bfloat16) for c in counts]
            a2 = [torch.randn(c, inter, device="cuda", dtype=torch.bfloat16) for c in counts]

            def dense(a1=a1, a2=a2):
                for e in range(E):
                    if a1[e].shape[0]:
                        torch.matmul(a1[e], dense13[e].t())
                        torch.matmul(a2[e], dense2[e].t())

            dense_us = graph_time(dense, reps=5, calls=3)
            weight_mb = (sum(c > 0 for c in counts) * 3 * H * inter / 2) / 1e6
            row = dict(shape=name, M=m, tile=layer.tile(m), rel_err=round(err, 5), ok=ok, cutlass_us=round(us, 1),
                       bf16_matmuls_us=round(dense_us, 1), weights_mb=round(weight_mb, 1),
                       tflops=round(6 * m * top_k * H * inter / us / 1e6, 1) if ok else None)  # fmt: skip
            if ok and args.breakdown:
                prefix = [graph_time(lambda k=k: layer(x, topk_w, topk_ids, stages=k)) for k in range(1, 7)]
                row["stages_us"] = {
                    s: round(b - a, 1) for s, a, b in zip(STAGES, [0.0, *prefix[:-1]], prefix, strict=True)
                }
            if ok and args.all_tiles:
                row["tiles_us"] = {t: round(graph_time(lambda t=t: layer(x, topk_w, topk_ids, tile=t)), 1)
                                   for t in TILES}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        layer = None  # its weights freed before the next shape
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "hopper-probe.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
