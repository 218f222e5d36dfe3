"""Write this checkout's default_config heuristic as tuned-config tables, for bench_moe.py's plugin-triton-alt.

    python bench/heuristic_tables.py OUT_DIR [--catalog dev|validation|all] [--tp 1,4] [--m 1,16,256]
                                            [--device-name "NVIDIA H200" ...]

A heuristic change is timed against the heuristic it replaces in one run: write the former heuristic's tables
from a checkout of the former commit (`git worktree add /tmp/old <rev>`, then this script there), carry the
directory to the GPU machine and time `--providers plugin-triton-auto,plugin-triton-alt --alt-config-dir DIR`
on shapes without shipped tables (where auto runs the heuristic). Each table holds every --m for both GEMMs of
every catalog shape at each TP size and the bench's built-in shapes, under each device name (the lookup keys
files by the device the run finds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_moe import SHAPES, int_list  # noqa: E402
from model_catalog import SETS, catalog_configs  # noqa: E402
from model_shapes import model_moe_shape  # noqa: E402

from vllm_wna16_plugin.kernels.triton.configs import config_file_name, default_config  # noqa: E402

DEFAULT_M = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
DEVICES = ("NVIDIA H200", "NVIDIA H100 80GB HBM3")


def write_tables(out: Path, shapes, ms: list[int], devices) -> int:
    """One file per GEMM shape and device: {M: default_config(...)} for each M; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = set()
    for s in shapes:
        for N, K, gs in ((2 * s.I, s.H, s.group_w13), (s.H, s.I, s.group_w2)):
            gs = K if gs == -1 else gs
            table = {str(m): default_config(m, s.E, N, K, s.top_k, gs, s.bits).to_dict() for m in ms}
            for device in devices:
                path = out / config_file_name(s.E, N, K, gs, s.bits, device)
                path.write_text(json.dumps(table, indent=1) + "\n")
                written.add(path)
    return len(written)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory for the tables (bench_moe.py --alt-config-dir)")
    ap.add_argument("--catalog", choices=SETS, default="all", help="catalog models to cover (bench/model_catalog.py)")
    ap.add_argument("--tp", type=int_list, default=[1, 2, 4, 8], help="tensor-parallel sizes, e.g. 1,4")
    ap.add_argument("--m", type=int_list, default=int_list(DEFAULT_M), help="token counts of each table")
    ap.add_argument("--device-name", action="append", help=f"device names to key the files by (default: {DEVICES})")
    args = ap.parse_args(argv)
    shapes = list(SHAPES)
    for name, cfg in catalog_configs(args.catalog):
        for tp in args.tp:
            try:
                shapes.append(model_moe_shape(cfg, tp, 4, 128, name=name))
            except ValueError:
                pass  # a TP size the model cannot be split at (bench_moe.py says why)
    n = write_tables(args.out, shapes, args.m, args.device_name or DEVICES)
    print(f"{n} tables for {len(shapes)} shapes in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
