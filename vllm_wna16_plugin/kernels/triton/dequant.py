"""@triton.jit helpers shared by the pointer and tensor-descriptor paths: unpack a
B tile stored K-contiguous (BLOCK_N, BLOCK_K*bits/8) bytes, and dequantize it,
w = (q - z) * s, in float32 before the cast to the compute dtype.

Layout (packing.py): int4 holds even k in the low nibble and odd k in the high
nibble of a byte; int8 is one byte per value. Zero points are packed along N the
same way (even n low nibble).
"""

import triton
import triton.language as tl


@triton.jit
def _unpack_b_tile(packed, BITS: tl.constexpr):
    """(BLOCK_N, BLOCK_K*BITS//8) uint8 -> (BLOCK_N, BLOCK_K) uint8 values in [0, 2**BITS)."""
    if BITS == 4:
        lo = packed & 0xF
        hi = packed >> 4
        # interleave along the last (K) axis: k = 2j from lo[j], k = 2j + 1 from hi[j]
        return tl.interleave(lo, hi)
    else:
        return packed


@triton.jit
def _unpack_zero_points(zbytes, offs_n, BITS: tl.constexpr):
    """Zero-point bytes loaded at row n*BITS//8 -> values for column n (int4: nibble n % 2)."""
    if BITS == 4:
        shift = ((offs_n % 2) * 4).to(tl.uint8)
        return (zbytes >> shift[:, None]) & 0xF
    else:
        return zbytes


@triton.jit
def _round_to(x, compute_type: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """float32 -> compute_type, round to nearest even. RNE_BY_HAND rounds the bf16 bits by
    hand first: Triton 3.6's interpreter truncates float32 -> bf16 casts (GPUs round)."""
    if RNE_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(compute_type)


@triton.jit
def _dequant_b_tile(
    q,  # (BLOCK_N, BLOCK_K) unsigned values
    scale,  # (BLOCK_N, GROUPS) float32
    zero,  # (BLOCK_N, GROUPS) float32
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,  # scale groups inside one K tile (1 when group_size >= BLOCK_K)
    BITS: tl.constexpr,
    compute_type: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,  # see _round_to
):
    """w = (q - zero) * scale per group of BLOCK_K // GROUPS columns, rounded to compute_type.

    The scale and zero of a group are loaded once per (group, n-tile) and broadcast along
    K. On the GPU the math runs in compute_type and is bit-identical to float32 math then
    one rounding: q - z is a small integer (exact), and one multiply rounds the exact
    product once. int4 (and fp16 int8) skip the int->float convert: (MAGIC | q) bitcast is
    MAGIC_VALUE + q exactly (bf16 0x4300 = 128 for q < 128; fp16 0x6400 = 1024 for q < 1024).
    RNE_BY_HAND (the bf16 interpreter, which has neither bf16 bitcasts nor bf16 rounding)
    runs the float32 form.
    """
    if RNE_BY_HAND:
        qf = q.to(tl.float32)
        if GROUPS == 1:
            w = (qf - zero) * scale
        else:
            q3 = tl.reshape(qf, (BLOCK_N, GROUPS, BLOCK_K // GROUPS))
            w3 = (q3 - zero[:, :, None]) * scale[:, :, None]
            w = tl.reshape(w3, (BLOCK_N, BLOCK_K))
        return _round_to(w, compute_type, RNE_BY_HAND)
    else:
        if compute_type == tl.float16:
            qc = (q.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
            zc = (zero + 1024.0).to(tl.float16)
        elif BITS == 4:
            qc = (q.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
            zc = (zero + 128.0).to(tl.bfloat16)
        else:
            qc = q.to(compute_type)
            zc = zero.to(compute_type)
        sc = scale.to(compute_type)
        if GROUPS == 1:
            w = (qc - zc) * sc
        else:
            q3 = tl.reshape(qc, (BLOCK_N, GROUPS, BLOCK_K // GROUPS))
            w3 = (q3 - zc[:, :, None]) * sc[:, :, None]
            w = tl.reshape(w3, (BLOCK_N, BLOCK_K))
        return w
