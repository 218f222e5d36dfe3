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
            return _scale_offset_tile((q.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True), scale, zero + 1024.0,
                                      BLOCK_N, BLOCK_K, GROUPS, compute_type)  # fmt: skip
        elif BITS == 4:
            return _scale_offset_tile((q.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True), scale, zero + 128.0,
                                      BLOCK_N, BLOCK_K, GROUPS, compute_type)  # fmt: skip
        else:
            return _scale_offset_tile(q.to(compute_type), scale, zero, BLOCK_N, BLOCK_K, GROUPS, compute_type)


@triton.jit
def _scale_offset_tile(
    qc,  # (BLOCK_N, BLOCK_K) compute dtype: the integers, plus any magic offset they carry (exact)
    scale,  # (BLOCK_N, GROUPS) float32
    offset,  # (BLOCK_N, GROUPS) float32: zero point plus that offset
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    compute_type: tl.constexpr,
):
    """(qc - offset) * scale in compute_type, per group of BLOCK_K // GROUPS columns: qc - offset is a
    small exact integer, so the one multiply rounds once, as float32 math then a cast would."""
    zc = offset.to(compute_type)
    sc = scale.to(compute_type)
    q3 = tl.reshape(qc, (BLOCK_N, GROUPS, BLOCK_K // GROUPS))
    w3 = (q3 - zc[:, :, None]) * sc[:, :, None]
    return tl.reshape(w3, (BLOCK_N, BLOCK_K))


@triton.jit
def _group_fold(dot, a_sum, scale, zero, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, WIDTH: tl.constexpr):
    """sum_g scale[n, g] * (dot[n, g] - zero[n, g] * a_sum[g]) as (BLOCK_N,) float32.

    dot: (BLOCK_N, WIDTH) products, WIDTH // GROUPS consecutive columns per scale group; a_sum:
    (WIDTH,) the matching sums of A. `zero` here includes any offset the integers carry."""
    if GROUPS == 1:
        d = tl.sum(dot, axis=1)
        return tl.reshape(scale, (BLOCK_N,)) * (d - tl.reshape(zero, (BLOCK_N,)) * tl.sum(a_sum, axis=0))
    d = tl.sum(tl.reshape(dot, (BLOCK_N, GROUPS, WIDTH // GROUPS)), axis=2)
    group_a = tl.sum(tl.reshape(a_sum, (GROUPS, WIDTH // GROUPS)), axis=1)
    return tl.sum(scale * (d - zero * group_a[None, :]), axis=1)


@triton.jit
def _bf16_halves_to_f32(t):
    """uint32 holding two bf16 (low half, high half) -> the two values as float32 (one shift, one and)."""
    return (t << 16).to(tl.float32, bitcast=True), (t & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _folded_dot_step(
    b,  # int4: (BLOCK_N, BLOCK_K // 8) uint32 words, 8 values each; int8: (BLOCK_N, BLOCK_K) uint8
    a,  # (BLOCK_K,) float32: the A row over the same K step (0 past K)
    scale,  # (BLOCK_N, GROUPS) float32 (0 for groups past K)
    zero,  # (BLOCK_N, GROUPS) float32
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    BITS: tl.constexpr,
):
    """sum_k a[k] * (q[n, k] - zero[n, g(k)]) * scale[n, g(k)] over one K step, as (BLOCK_N,) float32.

    The GEMV form of a step (the per-pair kernel), built to issue few instructions per weight: a decode
    GEMV that dequantizes tile by tile issues about 7.5 per weight and lane (bench/sass_cost.py), which
    can cost more time than the weight bytes. Scale and zero leave the K sum, per group:
    scale * (sum_k a*q' - zero' * sum_k a).
    int4: a 32-bit word holds k = 8i .. 8i+7, value k = 8i + j in bits 4j .. 4j+3 (packing.py: low
    nibble first). `((w >> 4s) & 0x000F000F) | 0x43004300` is two bf16 at once, 128 + q for k = 8i + s
    (low half) and k = 8i + 4 + s (high half), s = 0..3; a shift or an and widens each to float32; then
    one multiply-add per weight. q' = 128 + q, so zero' = 128 + zero.
    int8: bytes to float32 through the magic 2**23 + q, then subtracted (exact); zero' = zero.
    The sums are float32 throughout; no weight is rounded to bf16. The correction is applied per K
    step, so the cancellation in q' * a stays within BLOCK_K terms."""
    if BITS == 4:
        WORDS: tl.constexpr = BLOCK_K // 8
        # a[8i + 4h + 2*s1 + s0] as a[i, h, s1, s0], split into the 8 vectors a_{h,s} over i
        a_s0 = tl.reshape(a, (WORDS, 2, 2, 2))
        a_even_s0, a_odd_s0 = tl.split(a_s0)  # s0 = 0, 1: (WORDS, 2, 2) over (i, h, s1)
        a_s0s1_00, a_s0s1_01 = tl.split(a_even_s0)  # (s0=0, s1=0), (s0=0, s1=1): (WORDS, 2) over (i, h)
        a_s0s1_10, a_s0s1_11 = tl.split(a_odd_s0)
        a_lo0, a_hi0 = tl.split(a_s0s1_00)  # s = 0: k = 8i, 8i + 4
        a_lo2, a_hi2 = tl.split(a_s0s1_01)  # s = 2: k = 8i + 2, 8i + 6
        a_lo1, a_hi1 = tl.split(a_s0s1_10)  # s = 1
        a_lo3, a_hi3 = tl.split(a_s0s1_11)  # s = 3
        lo0, hi0 = _bf16_halves_to_f32((b & 0x000F000F) | 0x43004300)
        lo1, hi1 = _bf16_halves_to_f32(((b >> 4) & 0x000F000F) | 0x43004300)
        lo2, hi2 = _bf16_halves_to_f32(((b >> 8) & 0x000F000F) | 0x43004300)
        lo3, hi3 = _bf16_halves_to_f32(((b >> 12) & 0x000F000F) | 0x43004300)
        # one chain, so that each weight is one fused multiply-add
        dot = lo0 * a_lo0[None, :]
        dot += hi0 * a_hi0[None, :]
        dot += lo1 * a_lo1[None, :]
        dot += hi1 * a_hi1[None, :]
        dot += lo2 * a_lo2[None, :]
        dot += hi2 * a_hi2[None, :]
        dot += lo3 * a_lo3[None, :]
        dot += hi3 * a_hi3[None, :]
        a_sum = tl.sum(tl.reshape(a, (WORDS, 8)), axis=1)
        return _group_fold(dot, a_sum, scale, zero + 128.0, BLOCK_N, GROUPS, WORDS)
    else:
        q = (b.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return _group_fold(q * a[None, :], a, scale, zero, BLOCK_N, GROUPS, BLOCK_K)


@triton.jit
def _tile_dot(acc, a, w, SWAP_AB: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """One dot of the tl.dot kernel: acc + a @ w.T, acc (BLOCK_M, BLOCK_N); under SWAP_AB the same product
    transposed, acc + w @ a.T with acc (BLOCK_N, BLOCK_M). The bf16 interpreter multiplies in float32 (its
    dot reads bf16 operands as raw bits).

    SWAP_AB puts the dequantized weight tile (BLOCK_N rows, in registers) in the MMA's M operand and the few
    routed token rows in its N: sm90's wgmma needs 64 rows of M per warpgroup but takes N from 8, so a
    16-token tile runs on wgmma with B's 64-128 rows instead of mma.sync (TritonMoEConfig.swap_ab)."""
    if INTERPRET_BF16:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if SWAP_AB:
        return tl.dot(w, tl.trans(a), acc=acc)
    else:
        return tl.dot(a, tl.trans(w), acc=acc)


@triton.jit
def _word_shift_dots(
    acc, a_s, words, SHIFT: tl.constexpr, scale, zero, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
    GROUPS: tl.constexpr, compute_type: tl.constexpr, INTERPRET_BF16: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """The two dots of nibble s = SHIFT / 4 of every word: k = 8i + s (low half) and 8i + 4 + s (high).

    On the GPU one and-or makes both halves the compute dtype's magic + q (bf16 0x4300 = 128, fp16
    0x6400 = 1024), so each half is a bitcast away from the dequant multiply."""
    a_lo, a_hi = tl.split(a_s)  # h = 0, 1: (BLOCK_M, WORDS) each
    if INTERPRET_BF16:  # no bf16 bitcast in the interpreter: float32 values
        t = (words >> SHIFT) & 0x000F000F
        w_lo = _dequant_b_tile(t & 0xFFFF, scale, zero, BLOCK_N, WORDS, GROUPS, 4, compute_type, INTERPRET_BF16)
        w_hi = _dequant_b_tile(t >> 16, scale, zero, BLOCK_N, WORDS, GROUPS, 4, compute_type, INTERPRET_BF16)
    else:
        t = ((words >> SHIFT) & 0x000F000F) | _word_magic(compute_type)
        w_lo = t.to(tl.uint16).to(compute_type, bitcast=True)
        w_hi = (t >> 16).to(tl.uint16).to(compute_type, bitcast=True)
        offset = zero + _magic_value(compute_type)
        w_lo = _scale_offset_tile(w_lo, scale, offset, BLOCK_N, WORDS, GROUPS, compute_type)
        w_hi = _scale_offset_tile(w_hi, scale, offset, BLOCK_N, WORDS, GROUPS, compute_type)
    acc = _tile_dot(acc, a_lo, w_lo, SWAP_AB, INTERPRET_BF16)
    return _tile_dot(acc, a_hi, w_hi, SWAP_AB, INTERPRET_BF16)


@triton.jit
def _word_magic(compute_type: tl.constexpr):
    """Both 16-bit halves of a word: the exponent bits that make a nibble q read as magic + q."""
    if compute_type == tl.float16:
        return 0x64006400
    return 0x43004300


@triton.jit
def _magic_value(compute_type: tl.constexpr):
    """The value of _word_magic's half alone: fp16 0x6400 = 1024.0, bf16 0x4300 = 128.0 (the
    interpreter's bf16 float32 form adds 128 too)."""
    if compute_type == tl.float16:
        return 1024.0
    return 128.0


@triton.jit
def _word_nibble_dots(
    acc,  # (BLOCK_M, BLOCK_N) float32; (BLOCK_N, BLOCK_M) under SWAP_AB
    a,  # (BLOCK_M, BLOCK_K) compute dtype, 0 past K
    words,  # (BLOCK_N, BLOCK_K // 8) uint32: int4 B as 32-bit words of 8 values
    scale,  # (BLOCK_N, GROUPS) float32
    zero,  # (BLOCK_N, GROUPS) float32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    compute_type: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    SWAP_AB: tl.constexpr,  # the swapped tile (_tile_dot)
):
    """acc + a @ dequant(B).T over one K tile, int4 B unpacked from whole words (KernelOptions.dot_nibbles = "words");
    under SWAP_AB its transpose (_tile_dot).

    Word i holds k = 8i + t in bits 4t .. 4t+3 (packing.py: low nibble first). One shift and one and
    per word give the nibbles s and 4 + s of it in the two 16-bit halves, so B splits into eight
    (BLOCK_N, BLOCK_K / 8) tiles, k = 8i + 4h + s, with no byte widening or interleave; A splits its
    columns the same way and the tile is eight dots of BLOCK_K / 8. A scale group (>= 32 values) is
    whole words, so each small tile keeps GROUPS groups of consecutive columns. (A variant that applied
    scale and zero to the tile's float32 sum where one group spans it was no faster on the H200, and
    slower at M 16-64: bench/results/h200/2026-12-03-c5ff782-words-forms.md; it was removed.)"""
    WORDS: tl.constexpr = BLOCK_K // 8
    a5 = tl.reshape(a, (BLOCK_M, WORDS, 2, 2, 2))  # k = 8i + 4h + 2*s1 + s0 as (m, i, h, s1, s0)
    a_s0_0, a_s0_1 = tl.split(a5)  # (m, i, h, s1)
    a_s0, a_s2 = tl.split(a_s0_0)  # s = 0, 2: (m, i, h)
    a_s1, a_s3 = tl.split(a_s0_1)  # s = 1, 3
    acc = _word_shift_dots(
        acc, a_s0, words, 0, scale, zero, BLOCK_N, WORDS, GROUPS, compute_type, INTERPRET_BF16, SWAP_AB
    )
    acc = _word_shift_dots(
        acc, a_s1, words, 4, scale, zero, BLOCK_N, WORDS, GROUPS, compute_type, INTERPRET_BF16, SWAP_AB
    )
    acc = _word_shift_dots(
        acc, a_s2, words, 8, scale, zero, BLOCK_N, WORDS, GROUPS, compute_type, INTERPRET_BF16, SWAP_AB
    )
    return _word_shift_dots(
        acc, a_s3, words, 12, scale, zero, BLOCK_N, WORDS, GROUPS, compute_type, INTERPRET_BF16, SWAP_AB
    )
