"""The Triton kernel's tuning candidates: the configs a tuner times for one GEMM at one batch size.

    stage_a(M, E, N, K, top_k, gs, bits)    tile shapes at 4 warps / 4 stages, default_config first (with
        the layer's GEMV bound where the caller passes it):
        BLOCK_SIZE_M from the tokens per expert ({1} per pair up to 3 tokens per expert, the two largest
        row tiles they fill, up to 256), BLOCK_SIZE_N {32, 64, 128} (256 for 64-128-row tiles), BLOCK_SIZE_K
        {64, 128, 256} legal for the group (per pair also 512 and 1024: wide_block_k)
    stage_b(base, M, E, N, K, top_k, td_ok, bits)   around one tile: warps {4, 8} x stages, SPLIT_K
        {2, 4} where the grid is short of 2 programs per SM, TD where td_gate allows it, the split
        int4 dot form, register caps and the swapped tile (swap_worth_timing)

Pure and GPU-blind (tests/test_tune_candidates.py checks every candidate is legal). Two tuners use it:
bench/tune.py, which writes the shipped tables, and `vllm-wna16 tune` (tools/tune.py), which writes the
user's own (user_tables.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

from vllm_wna16_plugin.kernels.triton.configs import (
    MIN_PROGRAMS,
    TritonMoEConfig,
    default_config,
    expected_experts_hit,
    swap_takes_wgmma,
)


def legal_block_k(K: int, gs: int) -> list[int]:
    g = K if gs == -1 else gs
    out = [bk for bk in (64, 128, 256) if g == K or bk % g == 0 or g % bk == 0]
    return [bk for bk in out if bk <= max(64, 2 * K)]


def wide_block_k(K: int, gs: int, block_n: int) -> list[int]:
    """Per-pair K tiles past 256 (the kernel then reduces every step): longer contiguous runs of each
    weight row per step, at most 32K dequantized elements per tile, and at least one whole tile of K."""
    g = K if gs == -1 else gs
    return [bk for bk in (512, 1024) if bk <= K and block_n * bk <= 32768 and (g == K or bk % g == 0 or g % bk == 0)]


PER_PAIR_MAX_TOKENS_PER_EXPERT = 3.0


def block_m_choices(M: int, E: int, top_k: int) -> list[int]:
    pairs = M * top_k
    hit = expected_experts_hit(pairs, E)
    tpe = pairs / hit
    out = []
    # Per pair re-reads an expert's weights for each of its tokens (from L2 after the first). With the
    # folded step it measured level with or ahead of tl.dot up to M=8 (09163a5), so it is timed
    # up to 3 tokens per expert and the measurement decides.
    if tpe <= PER_PAIR_MAX_TOKENS_PER_EXPERT:
        out.append(1)
    if tpe > 1.05:
        # 128- and 256-row tiles only where an expert gets that many tokens (prefill: vLLM's own Triton configs
        # use 128 there; 256 swapped is default_config's tile from 256, configs.block_m_rule)
        allowed = [bm for bm in (16, 32, 64, 128, 256) if bm <= max(16, 2 * 2 ** math.ceil(math.log2(max(tpe, 1))))]
        allowed = [bm for bm in allowed if bm < 128 or tpe >= bm]
        out += allowed[-2:]  # the two largest row tiles the tokens per expert can fill
    return out


def grid_programs(M: int, E: int, N: int, top_k: int, cfg: TritonMoEConfig) -> int:
    pairs = M * top_k
    if cfg.per_pair:
        blocks = pairs
    else:
        hit = expected_experts_hit(pairs, E)
        blocks = hit * math.ceil(pairs / hit / cfg.BLOCK_SIZE_M)
    return int(blocks * -(-N // cfg.BLOCK_SIZE_N) * cfg.SPLIT_K)


def stage_a(
    M: int,
    E: int,
    N: int,
    K: int,
    top_k: int,
    gs: int,
    bits: int,
    prefill_tiles: bool = False,
    gemv_max: float | None = None,
) -> list[TritonMoEConfig]:
    """Tile shapes at warps 4 / stages 4, default_config first (with prefill_tiles: configs.prefill_tiles_apply;
    gemv_max: the layer's configs.gemv_bound, as triton_launch passes it)."""
    first = default_config(M, E, N, K, top_k, gs, bits, prefill_tiles, gemv_max=gemv_max)
    out = [first]
    for bm in block_m_choices(M, E, top_k):
        for bn in (32, 64, 128) + ((256,) if 64 <= bm <= 128 else ()):  # 256x256 spills (254 registers at 256x128)
            for bk in legal_block_k(K, gs) + (wide_block_k(K, gs, bn) if bm == 1 else []):
                if bm >= 64 and bk > 128 or bm * bn >= 128 * 128 and bk > 64:
                    continue  # big row tiles: shared memory for wide K stages is better spent on stages
                cfg = TritonMoEConfig(bm, bn, bk, GROUP_SIZE_M=1 if bm <= 16 else 8, num_warps=4, num_stages=4)
                if cfg not in out:
                    out.append(cfg)
    return out


REGISTER_CAPS = (128, 168)  # 4 and 3 programs of 4 warps per SM by registers (65536 / (128 x cap))


def stage_b(
    base: TritonMoEConfig,
    M: int,
    E: int,
    N: int,
    K: int,
    top_k: int,
    td_ok: bool,
    bits: int = 4,
    fuse: bool = False,
) -> list[TritonMoEConfig]:
    """Warps / stages / split-K / TD around one tile; for tl.dot tiles also the split int4 form and
    register caps (a 16x128x256 words tile takes 212 registers a thread on sm90: 2 programs per SM).
    fuse (GEMM1 only): also the tile with the activation fused (TritonMoEConfig.fuse_act), at its BLOCK_SIZE_N
    (twice the weight rows per program) and at half of it (the same rows per program); callers time a fused
    candidate against an unfused one plus the activation kernel."""
    out = []
    for warps in (4, 8):
        for stages in (1, 3, 4, 5) if base.per_pair else (3, 4, 5):  # per pair, 1 = register loads, no pipeline
            out.append(replace(base, num_warps=warps, num_stages=stages, SPLIT_K=1, use_td=None))
    one = replace(base, SPLIT_K=1)
    if grid_programs(M, E, N, top_k, one) < MIN_PROGRAMS:
        for split in (2, 4):
            if -(-K // base.BLOCK_SIZE_K) >= 2 * split:
                out.append(replace(base, SPLIT_K=split))
    if td_ok:
        out.append(replace(base, use_td=True))
    if not base.per_pair:
        if bits == 4 and base.nibbles is None:
            out.append(replace(base, nibbles="split"))
            out.append(replace(base, nibbles="split", maxnreg=REGISTER_CAPS[0]))
        out += [replace(base, maxnreg=cap) for cap in REGISTER_CAPS if base.maxnreg is None]
        if swap_worth_timing(base):
            out.append(replace(base, swap_ab=True))
    if fuse and base.SPLIT_K == 1 and not base.fuse_act:
        out.append(replace(base, fuse_act=True))
        if base.BLOCK_SIZE_N >= 32:
            out.append(replace(base, fuse_act=True, BLOCK_SIZE_N=base.BLOCK_SIZE_N // 2))
    return [c for c in out if c != base]


def swap_worth_timing(cfg: TritonMoEConfig) -> bool:
    """The swapped tile (TritonMoEConfig.swap_ab) is timed where it can reach wgmma (a tl.dot tile of >= 16
    token rows, the MMA's N, and >= 64 weight rows, its M: one warpgroup's 64 per m64 instruction) and the
    rule (configs.swap_takes_wgmma) does not already swap it: the 128-row tiles, which the rule keeps plain (swapped
    they lost at prefill on the H100, 2026-12-05-23a2f37-pf; a tuned entry may still find one faster)."""
    return not cfg.swap_ab and cfg.BLOCK_SIZE_M >= 16 and cfg.BLOCK_SIZE_N >= 64 and not swap_takes_wgmma(cfg)


__all__ = [
    "block_m_choices",
    "grid_programs",
    "legal_block_k",
    "stage_a",
    "stage_b",
    "swap_worth_timing",
    "wide_block_k",
]
