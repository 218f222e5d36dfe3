"""The `hopper` backend's launcher: the routed-experts layer on CUTLASS's sm90 grouped int4 / int8 x bf16 / fp16 GEMM
(csrc/hopper/, built by setup.py as vllm_wna16_plugin._hopper where CUTLASS's headers are found):

    route -> gather x into expert order -> grouped GEMM1 -> silu(gate) * up -> grouped GEMM2 -> weighted sum

    D_e[j, n] = sum_k A_e[j, k] * s_e[k // g, n] * (q_e[n, k] - z)      per expert e, for its rows j

(z = 2**(bits-1) where symmetric; an int4 layer with zero points runs the int8 builds on q - z: zero_point_weights)

TMA loads, wgmma, one producer and two consumer warp groups, a persistent schedule over every expert's tiles
(docs/perf/hopper-path.md). The weights are the MMA's M side (128 rows a tile), the routed rows its N side: the
token tile's width (32, 64, 128 or 256; the builds: BUILT_TILES) is chosen by the rows an expert takes (token_tile).
The layer's copy (HopperState) holds the weights made signed and reordered for the wgmma fragment, and the
scales group-major; everything the launch needs per batch is written on the device (CUDA-graph safe).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# the token-tile widths there are (csrc/hopper/grouped_gemm.h)
TILE_WIDTHS = (32, 64, 128, 256)
# the widths built for each (activation dtype, the kernel's weight bits: kernel_bits): one translation unit each
# (grouped_tile_<N>[_fp16][_int8].cu; grouped_gemm.h's tile_is_built says the same): every width for int4 bf16, the
# two auto's rule runs (64+ rows per hit expert: 128 and 256, token_tile) for fp16 and for int8; ten units
BUILT_TILES = {
    (torch.bfloat16, 4): TILE_WIDTHS,
    (torch.float16, 4): (128, 256),
    (torch.bfloat16, 8): (128, 256),
    (torch.float16, 8): (128, 256),
}
# every K (H for GEMM1, I for GEMM2) and group size is a multiple of the K tile (64 bf16: one 128-byte row), and
# every N (2I, H) of the weight tile's 128 rows
K_TILE = 64
N_TILE = 128


def token_tile(rows_per_expert: float, widths: tuple[int, ...] = TILE_WIDTHS) -> int:
    """The token-tile width for experts taking `rows_per_expert` routed rows on average, of the built `widths`
    (BUILT_TILES: a layer's dtype, zero points and bits):

        tile = the narrowest of the widths below 256 holding 2 * rows (an expert's rows vary around the mean; the
               widest of them when none does), and 256 from 512 rows (a whole 128 x 256 tile of wgmma per weight
               tile: the bf16 matmul rate)

    Measured (H100, the layer with every tile at each M, 2026-12-06-49d5aac-hopper-breakdown.json: Mixtral-8x7B
    and 8x22B at TP 4, Qwen3-30B-A3B, DeepSeek-V3 at TP 8): the best tile at 16 rows was 32 (Mixtral 142 against
    172 µs with 16), at 32 rows 64, at 64-256 rows 128 (Mixtral M=256: 203 against 216 with 64; M=1024: 408
    against 463 with 256), at 1024 rows 256 (1405 against 1455 with 128)."""
    if rows_per_expert >= 512 and 256 in widths:
        return 256
    narrow = [t for t in widths if t < 256] or [256]
    return next((t for t in narrow if t >= 2 * rows_per_expert), narrow[-1])


def kernel_bits(bits: int, zero_points: bool) -> int | None:
    """The weight bits the kernel runs a layer's `bits`-bit weights in: symmetric int4 and int8 as they are, int4 with
    zero points as int8 q - z (in [-15, 15]: zero_point_weights), since no zero-point build runs (CUTLASS 4.2's grouped
    scale-and-zero mode never sets up the scales' TMA descriptor: grouped_gemm.h); None for int8 with zero points
    (q - z spans [-255, 255])."""
    if not zero_points:
        return bits
    return 8 if bits == 4 else None


def built_tiles(dtype: torch.dtype, zero_points: bool, bits: int = 4) -> tuple[int, ...]:
    """The token-tile widths built for a layer of this activation dtype (bf16, fp16), zero points and weight bits
    (kernel_bits); () where none is."""
    return BUILT_TILES.get((dtype, kernel_bits(int(bits), bool(zero_points))), ())


@dataclass(frozen=True)
class HopperLaunch:
    """What the launcher runs for one batch: both GEMMs' token-tile width (token_tile)."""

    tile: int


@dataclass
class HopperState:
    """A layer's copy for the hopper kernel: w13 (E, 2I, H * bits / 8) and w2 (E, H, I * bits / 8) signed and
    reordered (prepare_weights; bits: the kernel's, kernel_bits), scales (E, K / group, N) contiguous in the
    activation dtype (kernel_scales), the per-expert strides and layouts of both GEMMs (consts), and the kernel's
    group sizes (kernel_group_size)."""

    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor
    s2: torch.Tensor
    consts: torch.Tensor
    group_w13: int
    group_w2: int
    bits: int = 4


@functools.lru_cache(maxsize=1)
def _extension():
    import vllm_wna16_plugin._hopper as ext

    return ext


def extension_error() -> str | None:
    """None when vllm_wna16_plugin._hopper loads, else why not (and how to build it)."""
    try:
        _extension()
    except ImportError as exc:
        if "undefined symbol" in str(exc):
            return (
                f"the plugin's hopper extension was built against another torch than {torch.__version__} ({exc}); "
                "rebuild it here: pip install --no-build-isolation -e ."
            )
        return (
            f"the plugin's hopper extension is not built ({exc}): it needs an sm90 build with CUTLASS's headers "
            "(pip install --no-deps nvidia-cutlass==4.2.0.0, then pip install --no-build-isolation -e .)"
        )
    from vllm_wna16_plugin.kernels.cuda_ops import static_libstdcxx_error

    return static_libstdcxx_error(_extension().__file__)


# The scales' group sizes the kernel takes: one scale row per K tile (64) or per two (128, CUTLASS's scale "reload
# factor" 2). Groups of 128 were once repeated to 64 everywhere after one wrong token row of 32 on the H100 (GEMM1
# of a Qwen3-30B-A3B-shaped layer at TP 4, 2026-12-06, docs/perf/hopper-path.md); that layer's I=192 was the
# reorder's write past the last expert (grouped_gemm.cuh kReorderK), fixed since. After the fix (H100, 21a66c2,
# tests/kernels/test_hopper_gpu.py) groups of 128 in the kernel were right on 80 routings of that layer (M 16-64)
# and on 72 cases of every form (int4, zero points, int8) and dtype at M 1-1100, as on 36 checks of
# bench/hopper_layer_diag.py before: half the scale bytes of groups of 64.
KERNEL_GROUPS = (2 * K_TILE, K_TILE)


def kernel_group_size(group_size: int) -> int:
    """The group size of a GEMM's scales in the kernel for the checkpoint's `group_size` along K (a multiple of
    K_TILE dividing K, or K: channel-wise):

        kernel group = the largest of KERNEL_GROUPS (128, 64) dividing group_size

    each checkpoint group's scale is repeated over its group_size / kernel group scale rows (kernel_scales). A
    group size none divides (out of the kernel's scope: backends/hopper.hopper_scope) is its own."""
    return next((g for g in KERNEL_GROUPS if group_size % g == 0), group_size)


def kernel_scales(scales: torch.Tensor, group_size: int, kernel_group: int) -> torch.Tensor:
    """(E, N, K / group_size) scales -> the kernel's (E, K / kernel_group, N), N contiguous: each group's scale
    repeated over its group_size / kernel_group scale rows (group_size: a multiple of kernel_group)."""
    repeat = group_size // kernel_group
    table = scales.repeat_interleave(repeat, dim=-1) if repeat > 1 else scales
    return table.transpose(1, 2).contiguous()


def zero_point_weights(qweight: torch.Tensor, qzeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """An int4 zero-point layer's weights in the kernel layout of int8 (E, N, K) uint8 with midpoint 128:

        u = q - z + 128      so that   s * (u - 128) = s * (q - z)   exactly (q - z in [-15, 15])

    from the plugin's int4 kernel layout: qweight (E, N, K/2) uint8, zero points qzeros (E, N/2, G) uint8 (packed
    along N, even n in the low nibble), z of k's group k // group_size. In uint8 throughout (q + (128 - z) never
    wraps), one expert at a time: about two bytes of temporaries per weight of one expert."""
    e, n, half_k = qweight.shape
    out = torch.empty(e, n, 2 * half_k, dtype=torch.uint8, device=qweight.device)
    for i in range(e):
        offset = 128 - torch.stack((qzeros[i] & 15, qzeros[i] >> 4), dim=1).reshape(n, -1)  # (N, G): 128 - z
        row = out[i].view(n, half_k, 2)
        row[..., 0] = qweight[i] & 15  # even k: the low nibble
        row[..., 1] = qweight[i] >> 4
        out[i] += offset.repeat_interleave(group_size, dim=-1)
    return out


def prepare(
    w13_qweight,
    w2_qweight,
    w13_scales,
    w2_scales,
    group_w13: int,
    group_w2: int,
    *,
    w13_qzeros: torch.Tensor | None = None,
    w2_qzeros: torch.Tensor | None = None,
    kernel_group: int | None = None,
    dtype: torch.dtype | None = None,
    bits: int = 4,
) -> HopperState:
    """The hopper copy of a layer in the plugin's kernel layout (`bits`-bit weights: uint8 (E, N, K * bits / 8),
    scales (E, N, G) with groups of group_w13 / group_w2 along K; zero points (E, N * bits / 8, G) or None:
    symmetric). A new copy of the weights (their signed, reordered form; int4 with zero points as int8 q - z:
    zero_point_weights) and of the scales (kernel_scales).
    kernel_group: the scales' group size in the kernel for both GEMMs (at most each GEMM's own; tests and
    bench/hopper_layer_diag.py), default kernel_group_size of each. dtype: the layer's activation dtype (bf16 or
    fp16), which the kernel reads the scales in (default: the scales' own)."""
    if (w13_qzeros is None) != (w2_qzeros is None):
        raise ValueError("zero points: give both GEMMs' (w13_qzeros and w2_qzeros) or neither")
    run_bits = kernel_bits(bits, w13_qzeros is not None)
    if run_bits is None:
        raise ValueError(f"int{bits} with zero points: the hopper kernel has no build for it (kernel_bits)")
    ext = _extension()
    e, n1, _ = w13_qweight.shape
    h, inter = w2_qweight.shape[1], n1 // 2
    if kernel_group is None:
        g13, g2 = kernel_group_size(group_w13), kernel_group_size(group_w2)
    else:
        g13, g2 = min(kernel_group, group_w13), min(kernel_group, group_w2)
    s13 = kernel_scales(w13_scales, group_w13, g13).to(dtype or w13_scales.dtype)
    s2 = kernel_scales(w2_scales, group_w2, g2).to(dtype or w2_scales.dtype)
    consts = ext.layer_constants(e, n1, h, h, inter, s13.shape[1], s2.shape[1], run_bits, w13_qweight.device)
    if w13_qzeros is None:
        w13 = ext.prepare_weights(w13_qweight.contiguous(), run_bits)
        w2 = ext.prepare_weights(w2_qweight.contiguous(), run_bits)
    else:  # int4 with zero points: the int8 builds on q - z, one GEMM's int8 temporary at a time
        w13 = ext.prepare_weights(zero_point_weights(w13_qweight, w13_qzeros, group_w13), run_bits)
        w2 = ext.prepare_weights(zero_point_weights(w2_qweight, w2_qzeros, group_w2), run_bits)
    return HopperState(w13, w2, s13, s2, consts, g13, g2, run_bits)


def fused_moe_hopper(
    x: torch.Tensor,
    state: HopperState,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    launch: HopperLaunch,
) -> torch.Tensor:
    """The layer for one batch: sum_j topk_weights[t, j] * down(silu(gate) * up)(x[t]) over expert topk_ids[t, j].
    x (M, H) bf16 or fp16 (the scales' dtype: the layer's); the router's ids name this layer's experts (the backend
    refuses expert parallelism), or are -1: vLLM 0.34's padding rows (CUDA-graph / DP padding), which add nothing (a
    row of padding only is zero). launch.tile must be one of BUILT_TILES[(x.dtype, state.bits)]."""
    ids = topk_ids if topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() else topk_ids.to(torch.int32)
    weights = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
    return _extension().moe_forward(
        x.contiguous(), ids.contiguous(), weights.contiguous(), state.w13, state.s13, state.w2, state.s2,
        None, None, state.consts, state.bits, state.group_w13, state.group_w2, launch.tile, launch.tile, 6,
    )  # fmt: skip


__all__ = [
    "BUILT_TILES",
    "HopperLaunch",
    "HopperState",
    "KERNEL_GROUPS",
    "K_TILE",
    "N_TILE",
    "TILE_WIDTHS",
    "extension_error",
    "built_tiles",
    "fused_moe_hopper",
    "kernel_bits",
    "kernel_group_size",
    "kernel_scales",
    "prepare",
    "token_tile",
    "zero_point_weights",
]
