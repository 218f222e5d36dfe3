"""Launch configs of the Triton WNA16 MoE kernel: the value object, a JSON loader
for tuned entries, and a GPU-blind fallback heuristic.

`get_triton_moe_config(M, E, N, K, top_k, group_size, bits, device_name)` returns
the config for one GEMM of shape (N, K) (GEMM1: N = 2I, K = H; GEMM2: N = H, K = I).
It reads configs/<config_file_name(...)>, whose keys are token counts M (as in
vLLM's fused_moe config files; the nearest key wins, within a factor of
TUNED_M_REACH of the tuned range), and falls back to `default_config`. Tuned entries
are measured on the GPU and committed with the script that made them (bench/tune.py;
the H200 entries and the log of their run are listed in configs/README.md).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("configs")
_WARPS = (1, 2, 4, 8, 16)
NIBBLE_FORMS = ("interleave", "split", "words")


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class TritonMoEConfig:
    """One GEMM's launch config; self-checking when built, `check_shape` for K/group rules."""

    BLOCK_SIZE_M: int
    BLOCK_SIZE_N: int
    BLOCK_SIZE_K: int
    GROUP_SIZE_M: int = 1
    num_warps: int = 4
    num_stages: int = 2
    use_td: bool | None = None  # a tuned opinion on tensor descriptors; None = let td_gate decide
    SPLIT_K: int = 1  # K slices per output tile; > 1 writes float32 partials that the next kernel sums
    # a tuned int4 dot form (KernelOptions.dot_nibbles: "interleave", "split", "words"); None = the auto policy
    nibbles: str | None = None
    # a tuned cap on registers per thread (ptxas .maxnreg, CUDA only): more programs per SM for a tile
    # whose registers, not its shared memory, bound the occupancy; None = the compiler's choice
    maxnreg: int | None = None
    # a tuned opinion on the swapped tile (dequant._tile_dot): the weight tile as the MMA's M operand,
    # the token rows as its N (wgmma on sm90 at 16-64 tokens per expert); BLOCK_SIZE_M >= 16 only
    swap_ab: bool = False
    # a tuned opinion on GEMM1 with the gated activation in its epilogue (fuse_form; GEMM2 never fuses):
    # BLOCK_SIZE_N then counts output columns of I, and a program reads 2 * BLOCK_SIZE_N weight rows (gate and
    # up); one launch and the (M * top_k, 2I) round trip fewer. The activation needs whole sums: SPLIT_K == 1
    fuse_act: bool = False

    @property
    def per_pair(self) -> bool:
        """BLOCK_SIZE_M == 1: one routed pair per program, no token alignment, no tl.dot (decode GEMV)."""
        return self.BLOCK_SIZE_M == 1

    def __post_init__(self) -> None:
        for name in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages",
                     "SPLIT_K"):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int:  # noqa: E721 - bool and float are refused, as a tuned JSON may hold them
                raise ValueError(f"{name}={value!r} must be an int, not {type(value).__name__}")
        for name, most in (("BLOCK_SIZE_M", 256), ("BLOCK_SIZE_N", 512), ("BLOCK_SIZE_K", 2048)):
            if getattr(self, name) > most:
                raise ValueError(f"{name}={getattr(self, name)} is above {most}: no tile that large fits an SM")
        if self.num_stages > 8 or self.GROUP_SIZE_M > 64:
            raise ValueError(
                f"num_stages={self.num_stages} (at most 8) or GROUP_SIZE_M={self.GROUP_SIZE_M} (at most 64) out of range"
            )
        if not _is_pow2(self.BLOCK_SIZE_M):
            raise ValueError(f"BLOCK_SIZE_M={self.BLOCK_SIZE_M} must be a power of two")
        if not _is_pow2(self.BLOCK_SIZE_N) or self.BLOCK_SIZE_N < 16:
            raise ValueError(f"BLOCK_SIZE_N={self.BLOCK_SIZE_N} must be a power of two >= 16")
        if not _is_pow2(self.BLOCK_SIZE_K) or self.BLOCK_SIZE_K < 16:
            raise ValueError(f"BLOCK_SIZE_K={self.BLOCK_SIZE_K} must be a power of two >= 16")
        if self.GROUP_SIZE_M < 1:
            raise ValueError(f"GROUP_SIZE_M={self.GROUP_SIZE_M} must be >= 1")
        if self.num_warps not in _WARPS:
            raise ValueError(f"num_warps={self.num_warps} must be one of {list(_WARPS)}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")
        if not _is_pow2(self.SPLIT_K) or self.SPLIT_K > 16:
            raise ValueError(f"SPLIT_K={self.SPLIT_K} must be a power of two in [1, 16]")
        if self.use_td is not None and not isinstance(self.use_td, bool):
            raise ValueError(f"use_td={self.use_td!r} must be None, true or false")
        if self.nibbles not in (None, *NIBBLE_FORMS):
            raise ValueError(f"nibbles={self.nibbles!r} must be None or one of {list(NIBBLE_FORMS)}")
        if not isinstance(self.swap_ab, bool):
            raise ValueError(f"swap_ab={self.swap_ab!r} must be True or False")
        if self.swap_ab and self.BLOCK_SIZE_M < 16:
            raise ValueError(
                f"swap_ab=True needs BLOCK_SIZE_M >= 16 (the token rows are the dot's N), got {self.BLOCK_SIZE_M}"
            )
        if not isinstance(self.fuse_act, bool):
            raise ValueError(f"fuse_act={self.fuse_act!r} must be True or False")
        if self.fuse_act and self.SPLIT_K != 1:
            raise ValueError(
                f"fuse_act=True needs SPLIT_K=1 (the activation needs GEMM1's whole sums), got SPLIT_K={self.SPLIT_K}"
            )
        if self.maxnreg is not None and not (isinstance(self.maxnreg, int) and 24 <= self.maxnreg <= 255):
            raise ValueError(f"maxnreg={self.maxnreg!r} must be None or an int in [24, 255] (registers per thread)")

    def check_shape(self, K: int, group_size: int) -> None:
        """Raise ValueError unless this config is legal for a GEMM with reduction size K.

        group_size is the GEMM's effective group (K // scales.shape[-1]); channel-wise
        (group_size == K or -1) has one group and accepts any BLOCK_SIZE_K.
        """
        if group_size == -1 or group_size == K:
            return
        bk = self.BLOCK_SIZE_K
        if bk % group_size and group_size % bk:
            raise ValueError(
                f"BLOCK_SIZE_K={bk} and group_size={group_size} (K={K}): need BLOCK_SIZE_K % group_size == 0 "
                f"or group_size % BLOCK_SIZE_K == 0; use a power of two that divides or is a multiple of {group_size}"
            )

    def to_dict(self) -> dict:
        """The JSON entry; the optional tuned fields (nibbles, maxnreg, swap_ab, fuse_act) only when set."""
        return {
            k: v
            for k, v in asdict(self).items()
            if (v is not None or k not in ("nibbles", "maxnreg")) and (v or k not in ("swap_ab", "fuse_act"))
        }


def config_file_name(E: int, N: int, K: int, group_size: int, bits: int, device_name: str) -> str:
    """Tuned-config file of one GEMM shape: E=128,N=1536,K=2048,group_size=128,bits=4,device_name=NVIDIA_H200.json."""
    device = device_name.replace(" ", "_")
    return f"E={E},N={N},K={K},group_size={group_size},bits={bits},device_name={device}.json"


@functools.cache
def _load(path: Path) -> dict[int, TritonMoEConfig] | None:
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    try:
        if not isinstance(raw, dict):
            raise TypeError(f"the table is a JSON {type(raw).__name__}, not an object")
        table = {}
        for m, entry in raw.items():
            if not str(m).isdigit() or int(m) < 1:
                raise ValueError(f"key {m!r} is not a token count >= 1")
            if not isinstance(entry, dict):
                raise TypeError(f"entry {m!r} is a {type(entry).__name__}, not an object")
            table[int(m)] = TritonMoEConfig(**entry)
        return table
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{path.name}: bad tuned config ({exc}); each key is a token count M, each value the "
            f"fields of TritonMoEConfig"
        ) from exc


def load_tuned_configs(
    E: int, N: int, K: int, group_size: int, bits: int, device_name: str, config_dir: Path | None = None
) -> dict[int, TritonMoEConfig] | None:
    """The tuned {M: config} table for a GEMM shape, or None when there is no file."""
    return _load((config_dir or CONFIG_DIR) / config_file_name(E, N, K, group_size, bits, device_name))


TILE_BLOCK_K = (256, 128, 64, 32, 16)  # the K tiles a config may have (tl.dot needs K >= 16; powers of two)
# Groups below 8 columns: the per-pair GEMV's group fold (dequant._group_fold) reshapes int4 nibble halves into
# groups of group_size / 2 columns, which Triton cannot shape below 4 (found at group sizes 1, 2, 4: an
# interpreter / compile error at the first decode)
MIN_GROUP_SIZE = 8


def group_size_reason(gemm: str, group_size: int, K: int) -> str | None:
    """Why no K tile of the Triton kernel serves this GEMM's scale groups (None: one does). A tile must hold
    whole groups or lie inside one (check_shape), so a group size needs to be a power of two or a multiple of
    16, and at least MIN_GROUP_SIZE; channel-wise (group_size -1 or K) takes any tile. A checkpoint's group 24 or 48 regrouped to 24 on a
    tensor-parallel rank would otherwise load and fail at its first forward."""
    if group_size in (-1, K):
        return None
    if group_size < MIN_GROUP_SIZE:
        return (
            f"{gemm} group size {group_size} (K={K}) is below {MIN_GROUP_SIZE}: the kernel's per-group folds "
            f"need groups of at least {MIN_GROUP_SIZE} columns"
        )
    if any(bk % group_size == 0 or group_size % bk == 0 for bk in TILE_BLOCK_K):
        return None
    return (
        f"{gemm} group size {group_size} (K={K}) is neither a power of two nor a multiple of 16: no K tile of the "
        f"Triton kernel ({', '.join(map(str, sorted(TILE_BLOCK_K)))}) holds whole groups or lies inside one"
    )


def _pick_block_k(K: int, group_size: int, wish: int) -> int:
    """Largest power of two <= wish (>= 16) legal for the group size whose K tail wastes <= 1/8 of
    the K loop (K=1344: 128, not 256; K=2048: 256), else the legal one that wastes least."""
    legal = [
        bk
        for bk in TILE_BLOCK_K
        if bk <= wish and (group_size in (-1, K) or bk % group_size == 0 or group_size % bk == 0)
    ]
    if not legal:
        return 16  # only reachable for group sizes that are not multiples of 16: check_shape reports it
    waste = {bk: (-(-K // bk) * bk - K) / K for bk in legal}
    for bk in legal:
        if waste[bk] <= 0.125:
            return bk
    return min(legal, key=lambda bk: (waste[bk], -bk))


NUM_SMS_HINT = 132  # H100/H200; the heuristic only needs the order of magnitude
MIN_PROGRAMS = 2 * NUM_SMS_HINT  # two programs per SM: one streams while the other dequantizes


# default_config's GEMV regime (one routed pair per program, no tl.dot) while the mean of routed pairs per hit
# expert is at most gemv_bound(bits, H, I). The GEMV reads an expert's weights once per pair routed to it, `mean`
# times in all, where the 16-row tl.dot tile reads them once but runs its tiles 1-2 rows full. Timed side by side
# (H100, vLLM 0.34, Triton 3.6, bench/results/h100/2026-12-07-d3ec747-h100-gemv-*: plugin-triton-auto, the former
# bound of 1.15, against plugin-triton-alt, the GEMV at every M; the catalog at TP 4, M 2-24, int4, int4 with zero
# points and int8), the tile took 1.01-2.5x the GEMV's time at means of 1.15-1.55 on every model of both sets.
# Fitted on the development set (tests/kernels/test_cuda_rule.py reads the runs):
#   int4 (zero points too): up to a mean of 1.56 (Mixtral-8x7B at 1.52: 0.81x the tile's time, Phi-3.5-MoE at 1.553:
#     0.90-0.94x; GLM-4.5-Air and Qwen3-235B-A22B at 1.58: 1.04-1.06x int4), and up to 2.0 where one expert's gate/up
#     weights (2*I*H*bits/8) are under GEMV_SMALL_EXPERT_BYTES (Qwen3-30B-A3B, OLMoE, Qwen1.5-MoE, DeepSeek-V2-Lite
#     at TP 4, 0.39-0.72 MB: at most 1.04x up to 1.93; 0.90-1.24x at 2.3-3.2);
#   int8: up to 2.8 (its tiles are slower still: the GEMV took 0.53-0.83x their time up to 2.5, 0.88-1.18x at 3.1).
# On the validation set (not fitted on), every point inside the bounds was faster on the GEMV or even (int4 at most
# 0.97x the tile's time, zero points 0.90x, int8 0.83x). Above them the GEMV was still faster on granite-3.1-3b-
# a800m's tiny experts (0.2 MB: 0.58-0.97x up to a mean of 4.8) and at four more points by 1-15% (Qwen2-57B-A14B
# at M=8, Mixtral-8x22B at M 6-12). Where the cuda rule (backends/cuda.py) takes a batch, this bound decides nothing.
GEMV_MAX_PAIRS_PER_EXPERT = 1.56  # int4, experts of at least GEMV_SMALL_EXPERT_BYTES
GEMV_MAX_PAIRS_SMALL_EXPERTS = 2.0  # int4, smaller experts
GEMV_MAX_PAIRS_INT8 = 2.8
GEMV_SMALL_EXPERT_BYTES = 1 << 20  # one expert's gate/up weights


def gemv_bound(bits: int, H: int | None = None, I: int | None = None) -> float:  # noqa: E741
    """The mean of routed pairs per hit expert up to which default_config runs the GEMV (above): by the weight
    width and, for int4, the layer's expert size (2*I*H*bits/8 bytes of gate/up; unknown: a large expert)."""
    if bits == 8:
        return GEMV_MAX_PAIRS_INT8
    small = H is not None and I is not None and 2 * I * H * bits // 8 < GEMV_SMALL_EXPERT_BYTES
    return GEMV_MAX_PAIRS_SMALL_EXPERTS if small else GEMV_MAX_PAIRS_PER_EXPERT


def expected_experts_hit(pairs: int, E: int) -> float:
    """E * (1 - (1 - 1/E)**pairs): distinct experts hit by `pairs` uniform routed pairs."""
    return E * (1.0 - (1.0 - 1.0 / E) ** pairs) if E > 1 else 1.0


# default_config's tile height (block_m_rule): where an expert gets 16-64 tokens on average, 32-row tiles
# unless they would read a hit expert's weights more than BLOCK_M_MAX_REREAD times on average (then 64 rows)
BLOCK_M_MAX_REREAD = 1.1


def expected_block_reads(M: int, E: int, top_k: int, block_m: int) -> float:
    """E[sum_e ceil(n_e / block_m)] / E[experts hit], n_e ~ Binomial(M, top_k / E) (uniform routing, top_k
    distinct experts per token): how many times, on average, a hit expert's weights are read by tiles of
    block_m routed pairs (1.0: one tile holds all of an expert's pairs)."""
    p = min(1.0, top_k / E)
    if p >= 1.0:
        return float(math.ceil(M / block_m))
    mean, sd = M * p, math.sqrt(M * p * (1.0 - p))
    hi = min(M, int(mean + 12.0 * sd + block_m) + 1)  # the mass beyond is below 1e-30
    log_q, log_1q = math.log(p), math.log1p(-p)
    log_m = math.lgamma(M + 1)
    reads, p_zero = 0.0, math.exp(M * log_1q)
    for n in range(1, hi + 1):
        pmf = math.exp(log_m - math.lgamma(n + 1) - math.lgamma(M - n + 1) + n * log_q + (M - n) * log_1q)
        reads += pmf * -(-n // block_m)
    return reads / (1.0 - p_zero)


# default_config's prefill tile heights (block_m_rule): (from a mean of pairs per hit expert, rows), largest first
BLOCK_M_PREFILL = ((256, 256), (128, 128))


def prefill_tiles_apply(platform: str, sm: int | None) -> bool:
    """Whether block_m_rule's prefill heights (BLOCK_M_PREFILL) apply on a device: NVIDIA sm90, where they were
    measured (H100) and where the 256-row swapped tile's 104 KB of shared memory fit. Elsewhere prefill keeps
    64-row tiles: ROCm's 64 KB of LDS cannot hold the 256-row tile (80 KB on gfx942, from the CPU compile),
    and no other device has timed them."""
    return platform == "cuda" and sm == 90


def block_m_rule(M: int, E: int, top_k: int, prefill_tiles: bool = False) -> int:
    """BLOCK_SIZE_M of default_config's tl.dot tiles for M tokens (the GEMV regime aside), by mean = pairs /
    experts hit: 16 rows up to a mean of 16; 32 up to 64 unless 32-row tiles would read a hit expert's weights
    more than BLOCK_M_MAX_REREAD times (expected_block_reads), then 64; 64 beyond, except with prefill_tiles
    (prefill_tiles_apply: sm90) BLOCK_M_PREFILL: 128 rows (plain) from a mean of 128, 256 rows (swapped:
    swap_takes_wgmma) from 256.

    The re-read test is the one change to the former thresholds (16 / 32 / 64 rows by the mean alone). Timed on
    the validation set it was not fitted on (H100, vLLM 0.34, Triton 3.6; bench/results/h100/2026-12-05-
    332769e-bm.md, plugin-triton-auto against the former heuristic's tables): 64-row tiles at means of 32-64
    took 0.82-0.95x the 32-row tiles' layer time on all 8 such points (Mixtral-8x22B, DeepSeek-V3, Qwen2-57B,
    Llama-4-Scout, ERNIE-4.5 at TP 4, M 128-1024). 32-row tiles from a mean of ~12.5 lost there (granite at
    M=64: 1.56x) and are not taken.

    Prefill (H100, vLLM 0.34, Triton 3.6, commit 23a2f37, bench/results/h100/2026-12-05-23a2f37-pf.md: each
    candidate written as tables by bench/heuristic_tables.py --tile and timed beside the 64-row tile, 8 warps,
    3 stages, 128 weight rows, BLOCK_K 64). Fitted on the development shapes (Qwen3-30B-A3B, Mixtral-8x7B,
    DeepSeek-V2-Lite, M 1024/4096; their means reach 256-1024): the swapped 256-row tile took 0.71-0.86x the
    64-row tile's layer time on all 4 points, the plain 128-row tile 0.83-0.89x (ahead of the 256-row one at
    Qwen3-30B-A3B M=4096 by 2%), the swapped 128-row tile 1.06-1.15x (as in 332769e-bm, whose 128-row tiles
    were swapped: 1.08-1.27x). So 256 rows swapped from a mean of 256; from 128 the plain 128-row tile, the H200
    tuner's pick on these shapes (30 of its 72 tl.dot entries, prefill, tuned plain). Checked on the validation
    shapes at TP 4 (not fitted on): 0.73-0.93x the 64-row tile on all 7 points with a mean >= 128, within 7% of
    the fastest candidate at each.
    """
    pairs = max(1, M * top_k)
    mean = pairs / expected_experts_hit(pairs, E)
    if mean <= 16:
        return 16
    if mean <= 64 and expected_block_reads(M, E, top_k, 32) <= BLOCK_M_MAX_REREAD:
        return 32
    for from_mean, rows in BLOCK_M_PREFILL if prefill_tiles else ():
        if mean >= from_mean:
            return rows
    return 64


@dataclass(frozen=True)
class RegimeTile:
    """What default_config asks for in one regime before fitting it to the shape: the widest BLOCK_SIZE_N (it
    halves until the grid fills the SMs), the wished BLOCK_SIZE_K (_pick_block_k narrows it to the group size),
    GROUP_SIZE_M, warps and stages."""

    block_n: int
    block_k: int
    group_m: int
    warps: int
    stages: int


# default_config's regimes (by mean = routed pairs per hit expert; the docstring of default_config says why)
PER_PAIR_TILE = RegimeTile(block_n=64, block_k=256, group_m=1, warps=4, stages=4)
SMALL_TILE = RegimeTile(block_n=128, block_k=256, group_m=1, warps=4, stages=4)
# the H200 tuner's choice at 24-64 tokens per expert on the E >= 64 bench shapes (M=256 entries); the former
# 32x128x128 took 1.7-2.5x as long there (bench/results/h200/2026-12-03-15324db-*). Kept against three
# candidates (N 128 K 256, N 64 K 128, N 128 K 128) on all 16 catalog models at TP 4, M 64-512 (H200,
# 2026-12-06-3038a96-mid): within 10% of the fastest at 18 of 19 development and 15 of 16 validation points
MID_TILE = RegimeTile(block_n=64, block_k=64, group_m=8, warps=4, stages=4)
LARGE_TILE = RegimeTile(block_n=128, block_k=64, group_m=8, warps=8, stages=3)


@functools.lru_cache(maxsize=4096)
def default_config(
    M: int,
    E: int,
    N: int,
    K: int,
    top_k: int,
    group_size: int,
    bits: int,
    prefill_tiles: bool = False,
    mid: RegimeTile = MID_TILE,
    gemv_max: float | None = None,
) -> TritonMoEConfig:
    """GPU-blind heuristic for one GEMM where no tuned entry applies (bench/tune.py writes those).

    Decode is bound by the weight bytes, so every regime asks for wide, deep B loads:
    BLOCK_SIZE_K=256 where the group size allows it (int4 rows of 128 bytes: 16-byte
    vector / cp.async loads per thread) and 4 stages in flight. With mean = pairs / experts hit:
      per pair   while routed pairs rarely share an expert (mean <= gemv_max, default gemv_bound(bits):
                 1.56 int4, 2.8 int8; M=1 always, M <= 12 at E=128 top8) BLOCK_SIZE_M=1: one pair per
                 program, no alignment launch, a GEMV without tl.dot. Callers that know the layer pass
                 gemv_bound(bits, H, I) (triton_launch), which is higher for small int4 experts.
      small M    (mean <= 16) K 256, N 128 tiles, 4 warps, 4 stages.
      larger M   (mean <= 64) K 64, N 64 tiles, grouped ordering.
      prefill    K 64, N 128 tiles, 8 warps, 3 stages.
    (PER_PAIR_TILE, SMALL_TILE, MID_TILE, LARGE_TILE; `mid` replaces MID_TILE, and `gemv_max` the per-pair bound,
    for a candidate rule timed beside them: bench/heuristic_tables.py --mid / --gemv-max.) BLOCK_SIZE_M of the tl.dot regimes is block_m_rule's (64 rows at prefill; 128-256 with prefill_tiles, which
    callers take from prefill_tiles_apply for the device). BLOCK_SIZE_N shrinks from 128 (64 per pair) until
    the grid has >= 2 programs per SM; if it is still short and K has >= 8 tiles, SPLIT_K (2 or 4) fills it.
    Tiles of 128+ rows keep N 128 and no split, as they were timed (granite-3.1 at TP 4, M=1024: its gate/up
    GEMM had 160 programs of 128x128 and the layer still took 0.93x the 64-row tile's time).
    """
    pairs = max(1, M * top_k)
    hit = expected_experts_hit(pairs, E)
    tokens_per_expert = pairs / hit
    gs = K if group_size == -1 else group_size
    if tokens_per_expert <= (gemv_bound(bits) if gemv_max is None else gemv_max):
        bm, tile = 1, PER_PAIR_TILE
        m_blocks = pairs
    else:
        bm = block_m_rule(M, E, top_k, prefill_tiles)
        tile = SMALL_TILE if tokens_per_expert <= 16 else mid if tokens_per_expert <= 64 else LARGE_TILE
        m_blocks = hit * expected_block_reads(M, E, top_k, bm)
    bk_wish, group_m, warps, stages, bn = tile.block_k, tile.group_m, tile.warps, tile.stages, tile.block_n
    m_blocks = max(1, int(m_blocks))
    timed_as_is = bm >= 128  # the prefill tiles run as they were timed: 128 weight rows, no split (block_m_rule)
    while not timed_as_is and bn > 32 and m_blocks * -(-N // bn) < MIN_PROGRAMS:
        bn //= 2
    bk = _pick_block_k(K, gs, bk_wish)
    split = 1
    k_tiles = -(-K // bk)
    while (not timed_as_is and split < 4 and m_blocks * -(-N // bn) * split < MIN_PROGRAMS
           and k_tiles // (2 * split) >= 4):  # fmt: skip
        split *= 2
    return TritonMoEConfig(
        BLOCK_SIZE_M=bm,
        BLOCK_SIZE_N=bn,
        BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=group_m,
        num_warps=warps,
        num_stages=stages,
        SPLIT_K=split,
    )


def word_tile_fits(config: TritonMoEConfig) -> bool:
    """The words form's tile stays in registers: at most 32 elements of the A tile and 32 of the
    float32 accumulator per lane. Beyond that the eight K/8 dots spill (sm90 SASS, bench/sass_cost.py):
    32x128x256 on 4 warps (A 64 per lane) had 93 local loads per K step and took 1.5x the split form's
    time on Mixtral-8x7B at M=64 (bench/results/h200/2026-12-03-c5ff782-words-forms.md); 32x256x128
    (accumulator 64) spilled 34. Every tile within the bound compiled without a spill worth one load."""
    lanes = 32 * config.num_warps
    return (
        config.BLOCK_SIZE_M * config.BLOCK_SIZE_K <= 32 * lanes
        and config.BLOCK_SIZE_M * config.BLOCK_SIZE_N <= 32 * lanes
    )


def _use_word_nibbles(bits: int, config: TritonMoEConfig, K: int, rows_on_words: bool, use_td_b: bool) -> bool:
    """The tile can take the "words" form: int4, eight dots of BLOCK_K / 8 >= 16 each, whole words per row
    (K % 8 == 0) on word-aligned rows (rows_on_words: _rows_on_words of the tensor), B by pointer, and a
    tile that fits the registers (word_tile_fits)."""
    return (
        bits == 4
        and config.BLOCK_SIZE_K >= 128
        and K % 8 == 0
        and not use_td_b
        and rows_on_words
        and word_tile_fits(config)
    )


def dot_form(bits: int, config: TritonMoEConfig, K: int, rows_on_words: bool, use_td_b: bool, want: str) -> str:
    """The form a launch of the tl.dot kernel feeds B to the dot in (KernelOptions.dot_nibbles is `want`).

    "auto": the config's tuned `nibbles` when it has one, else "words" on K tiles of 128 and more,
    "interleave" on narrower ones; a forced form overrides both. A words form the tile cannot take
    (_use_word_nibbles) runs "split", which any int4 tile with BLOCK_K >= 32 takes. int8 has no
    nibbles ("interleave": plain tiles).
    """
    if bits != 4:
        return "interleave"
    if want == "auto" and config.nibbles:  # a form the tuner measured for this entry
        want = config.nibbles
    if want == "auto":
        want = "words" if config.BLOCK_SIZE_K >= 128 else "interleave"
    if want == "words":
        if _use_word_nibbles(bits, config, K, rows_on_words, use_td_b):
            return "words"
        want = "split"
    return "split" if want == "split" and config.BLOCK_SIZE_K >= 32 else "interleave"


def swap_takes_wgmma(config: TritonMoEConfig) -> bool:
    """The rule for the swapped tile: a tl.dot tile of 16-64 or 256 token rows (the MMA's N) and >= 64 weight
    rows (its M: sm90's wgmma takes 64 rows per warpgroup). Fitted on Qwen3-30B-A3B and Mixtral-8x7B, checked on
    Qwen3.5-35B-A3B, DeepSeek-V2-Lite, the channel-wise and K=1344 shapes (H100, vLLM 0.34, Triton 3.6,
    bench/results/h100/2026-12-05-adcda24-swapfused*.md): swapped tiles of 64-128 weight rows took 0.84-1.02x
    the plain tile's time at M 4-1024 (0.84-0.91x at M >= 256); 32-row ones 1.12-1.22x (K=1344, M 2-32). Those
    runs' tiles had 16-64 token rows. 128-row tiles stay plain: swapped (128x128x64, 8 warps) they took 1.06-1.26x
    the 64-row tile's time at prefill where plain ones took 0.78-0.93x (2026-12-05-23a2f37-pf: 152 registers,
    one program of 8 warps per SM); 256-row tiles (block_m_rule's prefill tile, 254 registers) run swapped, the
    only form they were timed in, there 0.71-0.93x the 64-row tile. The tuners time the other form of
    128-row tiles (candidates.swap_worth_timing)."""
    rows = config.BLOCK_SIZE_M
    return not config.per_pair and (16 <= rows <= 64 or rows == 256) and config.BLOCK_SIZE_N >= 64


def swap_form(config: TritonMoEConfig, options) -> TritonMoEConfig:
    """The config a launch runs under KernelOptions.swap_ab (`options`): None swaps where the config says
    so or the rule does (swap_takes_wgmma), True swaps every tl.dot tile of BLOCK_SIZE_M >= 16, False none.
    Per-pair configs have no tl.dot and never swap."""
    want = getattr(options, "swap_ab", None)
    if want is None:
        want = config.swap_ab or swap_takes_wgmma(config)
    if config.per_pair or want == config.swap_ab or (want and config.BLOCK_SIZE_M < 16):
        return config
    return replace(config, swap_ab=want)


def fuse_form(config: TritonMoEConfig, options) -> TritonMoEConfig:
    """GEMM1's config under KernelOptions.triton_fuse_act (`options`): None keeps the config's own fuse_act (False
    unless a tuner measured it), True fuses the activation into every GEMM1 that is not split along K (split
    partials are summed by the activation kernel), False none. GEMM2 never fuses: callers apply this to GEMM1."""
    want = getattr(options, "triton_fuse_act", None)
    if want is None or want == config.fuse_act or (want and config.SPLIT_K != 1):
        return config
    return replace(config, fuse_act=want)


# Act order (a non-trivial g_idx, the sorted layout of backends/base.sort_act_order): how GEMM1 reads x in an
# expert's K order. H100 2026-12-05-c8ee655-ao2 (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V2-Lite, random K
# orders, vLLM 0.34): gathering in every A load ("load") took 1.2-1.6x the rows form's time at M=4-64 and
# 3.0-7.7x at M=256 (Mixtral: 7174 against 933 us), where one gather of the M * top_k pair rows first ("rows",
# kernels/triton/act_order.py) came within 1-4% of the same layer without act order at M=64-256 on the
# shapes triton serves there; at M=1 "load" was 0.92-1.01x "rows" (the extra launch costs more than one
# row's gathered loads save). M=2-3 were not timed: "load" there, as at M=1.
ACT_ORDER_ROWS_FROM_M = 4


def act_order_form(num_tokens: int, want: str) -> str:
    """How GEMM1 of an act-order layer reads x under KernelOptions.triton_act_order (`want`): "load" or "rows"
    as asked; "auto" is "rows" from ACT_ORDER_ROWS_FROM_M tokens, else "load" (the measurements above)."""
    if want != "auto":
        return want
    return "rows" if num_tokens >= ACT_ORDER_ROWS_FROM_M else "load"


def pair_step(bits: int, rows_on_words: bool, want: str) -> str:
    """How the per-pair kernel multiplies a K step (KernelOptions.pair_step_math is `want`): "fold" needs
    int4 rows on 32-bit words (it reads B as words); otherwise "tile"."""
    return "fold" if want == "fold" and (bits == 8 or rows_on_words) else "tile"


TUNED_M_REACH = 2  # a tuned entry serves token counts up to this factor beyond the tuned range


def nearest_tuned_m(table: dict[int, TritonMoEConfig], M: int) -> int | None:
    """The key of `table` nearest to M, or None when M lies more than TUNED_M_REACH times
    outside [min key, max key]: a config tuned at M=256 was never measured at M=4096,
    where the tile regime differs, so the heuristic (measured there too) serves it."""
    lo, hi = min(table), max(table)
    if M > hi * TUNED_M_REACH or M * TUNED_M_REACH < lo:
        return None
    return min(table, key=lambda m: abs(m - M))


def _checked(table: dict[int, TritonMoEConfig] | None, K: int, group_size: int) -> dict[int, TritonMoEConfig] | None:
    """The table, after every entry passed check_shape for this K (ValueError naming the first that does not)."""
    for entry in (table or {}).values():
        entry.check_shape(K, group_size)
    return table


@dataclass(frozen=True)
class ConfigChoice:
    """A GEMM's config and where it came from: "tuned <file> at M=<key>" or "default_config (heuristic)"."""

    config: TritonMoEConfig
    source: str


@functools.lru_cache(maxsize=4096)
def choose_triton_moe_config(
    M: int,
    E: int,
    N: int,
    K: int,
    top_k: int,
    group_size: int,
    bits: int,
    device_name: str | None = None,
    config_dir: Path | None = None,
    user_dir: Path | None = None,
    prefill_tiles: bool = False,
    gemv_max: float | None = None,
) -> ConfigChoice:
    """The tuned config nearest to M for this GEMM shape on device_name, else `default_config`
    (no file for the shape and device, or M outside the tuned range; see nearest_tuned_m), with its source.
    user_dir: the user's own tuned configs (user_tables.configs_dir), tried before config_dir / the shipped.
    prefill_tiles, gemv_max: default_config's (prefill_tiles_apply of the device; gemv_bound of the layer).

    group_size: the GEMM's effective group (-1 or K = channel-wise). A tuned entry
    that is illegal for K/group_size raises (a bad file is a bug, not a fallback).
    """
    gs = K if group_size == -1 else group_size
    table = None
    if device_name and user_dir is not None:
        from vllm_wna16_plugin.user_tables import read_safely

        path = user_dir / config_file_name(E, N, K, gs, bits, device_name)
        mine = read_safely(
            lambda: _checked(load_tuned_configs(E, N, K, gs, bits, device_name, user_dir), K, gs), str(path)
        )
        m_key = nearest_tuned_m(mine, M) if mine else None
        if m_key is not None:
            choice = ConfigChoice(
                mine[m_key], f"your tuned {user_dir / config_file_name(E, N, K, gs, bits, device_name)} at M={m_key}"
            )
            choice.config.check_shape(K, gs)
            return choice
    if device_name:
        table = load_tuned_configs(E, N, K, gs, bits, device_name, config_dir)
    m_key = nearest_tuned_m(table, M) if table else None
    if m_key is not None:
        choice = ConfigChoice(table[m_key], f"tuned {config_file_name(E, N, K, gs, bits, device_name)} at M={m_key}")
    else:
        why = "no tuned file for this shape and device" if not table else f"M={M} outside the tuned range"
        choice = ConfigChoice(default_config(M, E, N, K, top_k, gs, bits, prefill_tiles, gemv_max=gemv_max),
                              f"default_config heuristic ({why})")  # fmt: skip
    choice.config.check_shape(K, gs)
    return choice


@dataclass(frozen=True)
class TritonLaunch:
    """The Triton layer's configs for one batch size (triton_launch): GEMM1 (N = 2I, K = H), GEMM2 (N = H, K = I)."""

    gemm1: ConfigChoice
    gemm2: ConfigChoice

    @property
    def configs(self) -> tuple[TritonMoEConfig, TritonMoEConfig]:
        return self.gemm1.config, self.gemm2.config


def triton_launch(
    M: int,
    E: int,
    H: int,
    I: int,  # noqa: E741 - the intermediate size, as everywhere in the plugin
    top_k: int,
    group_size_w13: int,
    group_size_w2: int,
    bits: int,
    device_name: str | None = None,
    config_dir: Path | None = None,
    user_dir: Path | None = None,
    prefill_tiles: bool = False,
) -> TritonLaunch:
    """Both GEMMs' configs for M tokens (group sizes are effective: K = channel-wise); user_dir: the user's
    own tuned configs, tried first; prefill_tiles: prefill_tiles_apply of the device (choose_triton_moe_config)."""
    bound = gemv_bound(bits, H, I)  # both GEMMs of the layer in the same regime, as they were timed
    return TritonLaunch(
        choose_triton_moe_config(
            M, E, 2 * I, H, top_k, group_size_w13, bits, device_name, config_dir, user_dir, prefill_tiles, bound
        ),  # fmt: skip
        choose_triton_moe_config(
            M, E, H, I, top_k, group_size_w2, bits, device_name, config_dir, user_dir, prefill_tiles, bound
        ),  # fmt: skip
    )


def get_triton_moe_config(
    M: int,
    E: int,
    N: int,
    K: int,
    top_k: int,
    group_size: int,
    bits: int,
    device_name: str | None = None,
    config_dir: Path | None = None,
    gemv_max: float | None = None,
) -> TritonMoEConfig:
    """choose_triton_moe_config's config alone. gemv_max: the layer's configs.gemv_bound(bits, H, I), which a GEMM's
    N and K alone do not give (default: a large expert's bound; triton_launch passes the layer's)."""
    return choose_triton_moe_config(
        M, E, N, K, top_k, group_size, bits, device_name, config_dir, gemv_max=gemv_max
    ).config


__all__ = [
    "ConfigChoice",
    "TritonLaunch",
    "TritonMoEConfig",
    "choose_triton_moe_config",
    "triton_launch",
    "config_file_name",
    "default_config",
    "expected_experts_hit",
    "get_triton_moe_config",
    "gemv_bound",
    "group_size_reason",
    "load_tuned_configs",
    "nearest_tuned_m",
]
