"""Write this checkout's default_config heuristic as tuned-config tables, for bench_moe.py's plugin-triton-alt.

    python bench/heuristic_tables.py OUT_DIR [--catalog dev|validation|all] [--tp 1,4] [--m 1,16,256]
                                            [--device-name "NVIDIA H200" ...]

A heuristic change is timed against the heuristic it replaces in one run: write the former heuristic's tables
from a checkout of the former commit (`git worktree add /tmp/old <rev>`, then this script there), carry the
directory to the GPU machine and time `--providers plugin-triton-auto,plugin-triton-alt --alt-config-dir DIR`
on shapes without shipped tables (where auto runs the heuristic). Each table holds every --m for both GEMMs of
every catalog shape at each TP size and the bench's built-in shapes, under each device name (the lookup keys
files by the device the run finds).

A candidate rule is written the same way: --tile FROM:BMxBNxBK:wW:sS[:swap] replaces the heuristic's entry
wherever the mean of routed pairs per hit expert is >= FROM (the last --tile whose FROM is reached wins; its
BLOCK_SIZE_K is narrowed to one the group size allows), e.g. the swapped 128-token prefill tile from a mean of
128 and the 256-token one from 256:

    python bench/heuristic_tables.py /tmp/s256 --catalog all --tp 1,4 --m 1024,4096 \
        --tile 128:128x128x64:w8:s3:swap --tile 256:256x128x64:w8:s3:swap

A candidate per-pair bound (configs.gemv_bound: the one-pair GEMV form while routed pairs rarely share an expert)
keeps the rest of the heuristic: --gemv-max MEAN, e.g. the GEMV form everywhere it is written:

    python bench/heuristic_tables.py /tmp/gemv --catalog all --tp 4 --m 4,8,16 --bits 4,8 --gemv-max 1e9

A candidate for the middle regime (16-64 pairs per hit expert) keeps the rest of the heuristic (the tile height,
the N tile halving until the grid fills the SMs, split K) and replaces only what that regime asks for
(configs.MID_TILE): --mid BNxBK:wW:sS, e.g. the small-batch regime's 128x256 tile:

    python bench/heuristic_tables.py /tmp/mid128 --catalog all --tp 4 --m 64,128,256,512 --mid 128x256:w4:s4
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_moe import SHAPES, int_list  # noqa: E402
from model_catalog import SETS, catalog_configs  # noqa: E402
from model_shapes import model_moe_shape  # noqa: E402

from vllm_wna16_plugin.kernels.triton.configs import (  # noqa: E402
    MID_TILE,
    RegimeTile,
    TritonMoEConfig,
    _pick_block_k,
    config_file_name,
    default_config,
    expected_experts_hit,
    gemv_bound,
    swap_takes_wgmma,
)

DEFAULT_M = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
DEVICES = ("NVIDIA H200", "NVIDIA H100 80GB HBM3")


@dataclass(frozen=True)
class Tile:
    """--tile FROM:BMxBNxBK:wW:sS[:swap]: the tl.dot tile a candidate rule runs from a mean of FROM pairs per expert."""

    from_mean: float
    config: TritonMoEConfig


def parse_tile(spec: str) -> Tile:
    """'128:128x128x64:w8:s3:swap' -> Tile(128, TritonMoEConfig(128, 128, 64, GROUP_SIZE_M=8, num_warps=8,
    num_stages=3, swap_ab=True)); argparse.ArgumentTypeError naming the part that is wrong."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?):(\d+)x(\d+)x(\d+):w(\d+):s(\d+)(:swap|:plain)?", spec)
    if not m:
        raise argparse.ArgumentTypeError(f"--tile {spec!r}: expected FROM:BMxBNxBK:wW:sS[:swap|:plain]")
    bm, bn, bk, warps, stages = map(int, m.groups()[1:6])
    try:
        cfg = TritonMoEConfig(bm, bn, bk, GROUP_SIZE_M=8, num_warps=warps, num_stages=stages,
                              swap_ab=m.group(7) == ":swap")  # fmt: skip
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--tile {spec!r}: {exc}") from None
    if not cfg.swap_ab and swap_takes_wgmma(cfg):  # swap_form ORs the table's flag with the rule
        raise argparse.ArgumentTypeError(
            f"--tile {spec!r}: the swap rule (configs.swap_takes_wgmma) swaps {bm}-row tiles of {bn} weight rows "
            "whatever a table says, so a plain one cannot be timed through tables; write :swap"
        )
    return Tile(float(m.group(1)), cfg)


def parse_mid(spec: str) -> RegimeTile:
    """'128x256:w4:s4' -> RegimeTile(block_n=128, block_k=256, group_m=MID_TILE's, warps=4, stages=4)."""
    m = re.fullmatch(r"(\d+)x(\d+):w(\d+):s(\d+)", spec)
    if not m:
        raise argparse.ArgumentTypeError(f"--mid {spec!r}: expected BNxBK:wW:sS, e.g. 128x256:w4:s4")
    bn, bk, warps, stages = map(int, m.groups())
    try:  # the same checks as a config of that tile
        TritonMoEConfig(16, bn, bk, GROUP_SIZE_M=MID_TILE.group_m, num_warps=warps, num_stages=stages)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--mid {spec!r}: {exc}") from None
    return RegimeTile(block_n=bn, block_k=bk, group_m=MID_TILE.group_m, warps=warps, stages=stages)


def entry(
    m: int, s, N: int, K: int, gs: int, tiles: list[Tile], mid: RegimeTile = MID_TILE, gemv_max: float | None = None
) -> TritonMoEConfig:
    """default_config's entry (with `mid` as its middle regime and `gemv_max` as its per-pair bound), or the last
    tile whose FROM the mean of pairs per hit expert reaches."""
    pairs = m * s.top_k
    mean = pairs / expected_experts_hit(pairs, s.E)
    chosen = [t for t in tiles if mean >= t.from_mean]
    if not chosen:
        bound = gemv_bound(s.bits, s.H, s.I) if gemv_max is None else gemv_max  # the layer's, as triton_launch's
        return default_config(m, s.E, N, K, s.top_k, gs, s.bits, prefill_tiles=True, mid=mid, gemv_max=bound)  # sm90
    cfg = chosen[-1].config
    return replace(cfg, BLOCK_SIZE_K=_pick_block_k(K, gs, cfg.BLOCK_SIZE_K))


def write_tables(
    out: Path,
    shapes,
    ms: list[int],
    devices,
    tiles: list[Tile] = (),
    mid: RegimeTile = MID_TILE,
    gemv_max: float | None = None,
) -> int:
    """One file per GEMM shape and device: {M: default_config(...)} for each M (or a --tile's config where its
    mean is reached); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = set()
    for s in shapes:
        for N, K, gs in ((2 * s.I, s.H, s.group_w13), (s.H, s.I, s.group_w2)):
            gs = K if gs == -1 else gs
            table = {str(m): entry(m, s, N, K, gs, list(tiles), mid, gemv_max).to_dict() for m in ms}
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
    ap.add_argument(
        "--tile",
        type=parse_tile,
        action="append",
        default=[],
        metavar="FROM:BMxBNxBK:wW:sS[:swap]",
        help="a candidate rule's tile from a mean of FROM routed pairs per hit expert (repeatable; the last reached wins)",
    )
    ap.add_argument(
        "--mid",
        type=parse_mid,
        default=MID_TILE,
        metavar="BNxBK:wW:sS",
        help="a candidate for the heuristic's middle regime, 16-64 pairs per hit expert (configs.MID_TILE)",
    )
    ap.add_argument(
        "--gemv-max",
        type=float,
        default=None,
        metavar="MEAN",
        help="a candidate per-pair bound: the GEMV form up to this mean of routed pairs per hit expert "
        "(configs.gemv_bound: by the weight width and the expert size)",
    )
    ap.add_argument("--bits", type=int_list, default=[4], help="weight widths to write tables for, e.g. 4,8")
    args = ap.parse_args(argv)
    shapes = [s for s in SHAPES if s.bits in args.bits]
    for name, cfg in catalog_configs(args.catalog):
        for tp in args.tp:
            for bits in args.bits:
                try:
                    shapes.append(model_moe_shape(cfg, tp, bits, 128, name=name))
                except ValueError:
                    pass  # a TP size the model cannot be split at (bench_moe.py says why)
    n = write_tables(args.out, shapes, args.m, args.device_name or DEVICES, args.tile, args.mid, args.gemv_max)
    print(f"{n} tables for {len(shapes)} shapes in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
