// The pieces both tensor-core WNA16 MoE kernels share (moe_wna16_mma.cu: a block per expert block and
// column block; moe_wna16_stream.cu: persistent warps that stream K across tiles): the cp.async ring's
// shape, the dequantization to exact (q - z) pairs, the mma of one K step, and the launch helpers.
// The header comment of moe_wna16_mma.cu says why the math is laid out this way.
#pragma once

#include <type_traits>

#include "wna16_common.cuh"

namespace wna16_plus {
namespace {  // device code and launch helpers of the including translation unit

// Where a group's scale multiplies (see the header). The host picks it from the group length.
enum ScaleMode : int {
  kScalePairs = 0,  // groups shorter than a step: each dequantized pair, before the mma
  kScaleSteps = 1,  // every step lies in one group: the step's float32 mma result
  kScaleRows = 2,   // channel-wise: the tile's float32 sums, once at the end
};

// The cp.async ring of a warp that streams RT row tiles (16 RT rows, 2 RT a lane): its depth in steps
// (an even number: pairs of steps are copied together), the 16-byte chunks of a warp's ring, and the
// shared memory per block: the warps' chunks, then the 4-byte scale / zero-point words of every row and
// stage, of each lane where a lane's chunk has its own group (kScalePairs), of each row's lane (g, 0)
// where a step lies in one group (kScaleSteps), none channel-wise. Two blocks of it fit a Hopper SM
// (the registers allow no more): the words of a step sized per lane took a third of the two-tile ring,
// and sized by what each mode reads they leave room for three pairs of steps per warp instead of two,
// 8 KB of weights in flight per warp while one pair is computed, except for kScalePairs' two-tile ring.
template <int RT, int SCALES, bool HAS_ZP>
struct RingShape {
  static constexpr int kWordLanes = SCALES == kScalePairs ? kThreads : SCALES == kScaleSteps ? kThreads / 4 : 0;
  static constexpr int kWordBytes = 4 + (HAS_ZP ? 4 : 0);  // a scale word, and a zero-point word
  static constexpr int kStages = RT == 2 && SCALES == kScalePairs ? 4 : 6;
  static constexpr int kPairStages = kStages / 2;
  static constexpr int kPairChunks = 16 * RT * 8;  // one pair stage: 16 RT rows x 8 chunks
  static constexpr int kWarpChunks = kPairStages * kPairChunks;
  static constexpr int kStageWords = 2 * RT * kWordLanes;  // the words of one stage (step): rows x lanes
  static constexpr int kBytes = kWarps * kWarpChunks * 16 + kStages * kStageWords * kWordBytes;
  static_assert(kStages % 2 == 0, "the ring holds whole pairs of steps");

  // The block's ring in shared memory: per warp [pair stage][16 RT rows][8 chunks], then the [stage][row]
  // [word lane] scale words and as many zero-point words (slot (stage d, row r) at (2 RT d + r) *
  // kWordLanes). The word lane of thread t: t where each lane copies its own words, else t / 4, the
  // row's lane (g, 0) of its warp. These return the calling thread's word-lane column.
  static __device__ __forceinline__ uint32_t* scale_words(uint4* ring) {
    return reinterpret_cast<uint32_t*>(ring + kWarps * kWarpChunks) +
           (SCALES == kScalePairs ? threadIdx.x : threadIdx.x >> 2);
  }
  static __device__ __forceinline__ uint32_t* zero_words(uint4* ring) {
    return scale_words(ring) + kStages * kStageWords;
  }
  static_assert(kBytes <= 110 * 1024, "two blocks of the ring fit a Hopper SM");
};

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// BYTES from global to shared memory, asynchronously; zeros when !valid (nothing is read then).
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(shared_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::); }
template <int PENDING>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

// (a & mask) | bits in one instruction (nvcc emits an and and an or for the C expression).
template <uint32_t MASK, uint32_t BITS>
__device__ __forceinline__ uint32_t and_or(uint32_t a) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "n"(BITS));
  return d;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// The arithmetic of the activation dtype on 32-bit pairs.
template <typename T>
struct Pairs;
template <>
struct Pairs<__half> {
  using P = __half2;
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) { return bits(__hsub2(pair(a), pair(b))); }
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) { return bits(__hmul2(pair(a), pair(b))); }
  static __device__ __forceinline__ uint32_t fma(uint32_t a, uint32_t b, uint32_t c) {
    return bits(__hfma2(pair(a), pair(b), pair(c)));
  }
  static __device__ __forceinline__ uint32_t from_floats(float lo, float hi) { return bits(__floats2half2_rn(lo, hi)); }
  static __device__ __forceinline__ float to_float(uint32_t half_bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(half_bits)));
  }
  static __device__ __forceinline__ P pair(uint32_t v) { return *reinterpret_cast<P*>(&v); }
  static __device__ __forceinline__ uint32_t bits(P v) { return *reinterpret_cast<uint32_t*>(&v); }
};
template <>
struct Pairs<__nv_bfloat16> {
  using P = __nv_bfloat162;
  static __device__ __forceinline__ uint32_t sub(uint32_t a, uint32_t b) { return bits(__hsub2(pair(a), pair(b))); }
  static __device__ __forceinline__ uint32_t mul(uint32_t a, uint32_t b) { return bits(__hmul2(pair(a), pair(b))); }
  static __device__ __forceinline__ uint32_t from_floats(float lo, float hi) {
    return bits(__floats2bfloat162_rn(lo, hi));
  }
  static __device__ __forceinline__ float to_float(uint32_t bf16_bits) { return __uint_as_float(bf16_bits << 16); }
  static __device__ __forceinline__ P pair(uint32_t v) { return *reinterpret_cast<P*>(&v); }
  static __device__ __forceinline__ uint32_t bits(P v) { return *reinterpret_cast<uint32_t*>(&v); }
};

// The zero point of one row and group as the pairs the dequantization subtracts (z: 0 .. 2^BITS - 1).
template <typename T, int BITS>
struct Bias {
  uint32_t sub;    // int4: (magic + z) twice; int8 fp16: (1024 + z) twice; int8 bf16: unused
  uint32_t sub16;  // int4 fp16: -(64 + z) twice, for the high nibble of a byte (1024 + 16 q) / 16
  float zero;      // int8 bf16: 2^23 + z, for the float32 path
  static __device__ __forceinline__ Bias make(uint32_t z) {
    Bias b;
    if constexpr (std::is_same_v<T, __half>) {
      b.sub = (0x6400u | z) * 0x10001u;  // 1024 + z: exact below 2048
      b.sub16 = (0xD400u + (z << 4)) * 0x10001u;  // -(64 + z): ulp 1/16 at 64
    } else {
      b.sub = (0x4300u | z) * 0x10001u;  // 128 + z (int4 only: z < 16)
      b.sub16 = 0;
    }
    b.zero = 8388608.0f + static_cast<float>(z);
    return b;
  }
};

// The four (q - z) pairs of an int4 word: nibbles (k, k + 4) for k = 0..3, in the order the mma
// fragment takes them (pairs 0 and 1 feed one mma, 2 and 3 the next). Exact in bf16 and fp16.
template <typename T>
__device__ __forceinline__ void centered_int4(uint32_t w, const Bias<T, 4>& b, uint32_t (&out)[4]) {
  using A = Pairs<T>;
  if constexpr (std::is_same_v<T, __half>) {
    // the high nibble of a byte fits the fp16 mantissa as 16 q: 1024 + 16 q, scaled back by the fma
    constexpr uint32_t kSixteenth = 0x2C002C00u;  // 1/16
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t v = h == 0 ? w : w >> 8;
      out[2 * h] = A::sub(and_or<0x000F000Fu, 0x64006400u>(v), b.sub);
      out[2 * h + 1] = A::fma(and_or<0x00F000F0u, 0x64006400u>(v), kSixteenth, b.sub16);
    }
  } else {
    // the bf16 mantissa has 7 bits: every nibble is shifted down to bits 0-3 first
#pragma unroll
    for (int s = 0; s < 4; ++s) out[s] = A::sub(and_or<0x000F000Fu, 0x43004300u>(w >> (4 * s)), b.sub);
  }
}

// The two (q - z) pairs of an int8 word: bytes (0, 2) and (1, 3). Exact in both dtypes.
template <typename T>
__device__ __forceinline__ void centered_int8(uint32_t w, const Bias<T, 8>& b, uint32_t (&out)[2]) {
  using A = Pairs<T>;
  if constexpr (std::is_same_v<T, __half>) {
    out[0] = A::sub(__byte_perm(w, 0x64u, 0x4240), b.sub);  // (1024 + b0, 1024 + b2) - (1024 + z)
    out[1] = A::sub(__byte_perm(w, 0x64u, 0x4341), b.sub);
  } else {  // 2^23 + b is the float whose low mantissa bits are the byte; the difference is exact
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + i)) - b.zero;
    out[0] = A::from_floats(v[0], v[2]);
    out[1] = A::from_floats(v[1], v[3]);
  }
}

// The centered pairs of a word of both rows times their rows' scale pairs (kScalePairs).
template <typename T, int PAIRS>
__device__ __forceinline__ void scale_pairs(uint32_t (&lo)[PAIRS], uint32_t (&hi)[PAIRS], uint32_t scale_lo,
                                            uint32_t scale_hi) {
#pragma unroll
  for (int s = 0; s < PAIRS; ++s) {
    lo[s] = Pairs<T>::mul(lo[s], scale_lo);
    hi[s] = Pairs<T>::mul(hi[s], scale_hi);
  }
}

// d += A (16 x 16, row) * B (16 x 8, col), float32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// One of the lane's weight rows in a tile: the addresses of its bytes, scales and zero points.
template <int BITS>
struct Row {
  const uint8_t* s;   // the row's scale of group 0 (bytes)
  const uint8_t* z;   // the row's zero-point byte of group 0 (packed along N)
  int s_step, z_step;  // bytes from one group to the next (group-major tables: a row of the table apart)
  int z_shift;        // 4 for odd n of int4 (high nibble), else 0
  bool valid;         // a row of the block's columns (else its copies are zeros and its sums unused)

  // The 4-byte words holding the scale and zero point of group g (cp.async copies aligned words).
  __device__ __forceinline__ const void* scale_word(int g) const {
    return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(s + g * s_step) & ~uintptr_t{3});
  }
  __device__ __forceinline__ const void* zero_word(int g) const {
    return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(z + g * z_step) & ~uintptr_t{3});
  }
  __device__ __forceinline__ uint32_t scale_bits(uint32_t word, int g) const {
    return (reinterpret_cast<uintptr_t>(s + g * s_step) & 2) ? word >> 16 : word & 0xFFFFu;
  }
  __device__ __forceinline__ uint32_t zero(uint32_t word, int g) const {
    return (word >> (8 * (reinterpret_cast<uintptr_t>(z + g * z_step) & 3) + z_shift)) & ((1u << BITS) - 1);
  }
  // row n of EXPERT's tables (gated: the up rows are n >= N/2); valid: a row the warp computes
  static __device__ __forceinline__ Row make(const GemmParams& p, int expert, int n, bool valid) {
    Row r;
    r.valid = valid;
    r.s = static_cast<const uint8_t*>(p.scales) + (static_cast<int64_t>(expert) * p.N * p.num_groups + n * p.s_stride_n) * 2;
    r.z = p.qzeros + static_cast<int64_t>(expert) * (p.N * BITS / 8) * p.num_groups +
          static_cast<int64_t>(n * BITS / 8) * p.z_stride_n;
    r.s_step = static_cast<int>(p.s_stride_g) * 2;
    r.z_step = static_cast<int>(p.z_stride_g);
    r.z_shift = BITS == 4 && (n & 1) ? 4 : 0;
    return r;
  }
};

// What reading a step back needs of a Row: where in its 4-byte words a group's scale and zero point lie
// (the low bits of their addresses), without the addresses (fewer registers for kernels that keep it).
template <int BITS>
struct RowBits {
  uint32_t s_lo, z_lo;  // the low 32 bits of Row::s and Row::z
  int s_step, z_step, z_shift;
  static __device__ __forceinline__ RowBits of(const Row<BITS>& r) {
    return {static_cast<uint32_t>(reinterpret_cast<uintptr_t>(r.s)), static_cast<uint32_t>(reinterpret_cast<uintptr_t>(r.z)),
            r.s_step, r.z_step, r.z_shift};
  }
  __device__ __forceinline__ uint32_t scale_bits(uint32_t word, int g) const {
    return ((s_lo + g * s_step) & 2) ? word >> 16 : word & 0xFFFFu;
  }
  __device__ __forceinline__ uint32_t zero(uint32_t word, int g) const {
    return (word >> (8 * ((z_lo + g * z_step) & 3) + z_shift)) & ((1u << BITS) - 1);
  }
};

// The copies of the scale and zero-point words of step STAGE of the ring, group grp of each of the lane's
// rows: by every lane where its chunk has its own group (kScalePairs), else by lane (g, 0) for the four
// lanes of its rows (4-byte copies of all 32 lanes cost 8 shared-memory wavefronts each: ncu, Mixtral
// M=8, 6.4M bank conflicts, all on LDGSTS, as many as the weights' 16-byte copies); none channel-wise.
template <int SCALES, bool HAS_ZP, int RT, int BITS>
__device__ __forceinline__ void copy_step_words(uint32_t* ring_s, uint32_t* ring_z, int stage, int q,
                                                const Row<BITS> (&rows)[2 * RT], int grp) {
  constexpr int kRows = 2 * RT, kWordLanes = RingShape<RT, SCALES, HAS_ZP>::kWordLanes;
  if constexpr (SCALES != kScaleRows) {
    if (SCALES == kScalePairs || q == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int slot = (kRows * stage + r) * kWordLanes;
        copy_async4(ring_s + slot, rows[r].scale_word(grp), rows[r].valid);
        if constexpr (HAS_ZP) copy_async4(ring_z + slot, rows[r].zero_word(grp), rows[r].valid);
      }
    }
  }
}

// Reads step sp of pair stage pstage back from the warp's ring: the lane's chunk q of each of its rows
// (tile r / 2, lo row g or hi row g + 8), and the scale bits and zero-point bias of its group grp.
// row_bias: the rows' bias where zero points do not travel with the steps. Past K (!in_k) the bias is
// 0: q - 0 of a zero-filled chunk is 0. ROW: Row or RowBits.
template <typename T, int BITS, int SCALES, bool HAS_ZP, int RT, typename ROW>
__device__ __forceinline__ void read_step(const uint4* warp_ring, const uint32_t* ring_s, const uint32_t* ring_z,
                                          int pstage, int sp, int g, int q, int grp, bool in_k,
                                          const ROW (&rows)[2 * RT], const Bias<T, BITS> (&row_bias)[2 * RT],
                                          uint4 (&wv)[2 * RT], Bias<T, BITS> (&bias)[2 * RT],
                                          uint32_t (&scale_bits)[2 * RT]) {
  using Ring = RingShape<RT, SCALES, HAS_ZP>;
  constexpr int kRows = 2 * RT;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int lr = 16 * (r / 2) + 8 * (r % 2) + g;  // tile r / 2, lo or hi row
    wv[r] = warp_ring[pstage * Ring::kPairChunks + lr * 8 + ((sp * 4 + q) ^ ((g & 1) << 2))];
    const int slot = (kRows * (2 * pstage + sp) + r) * Ring::kWordLanes;
    scale_bits[r] = 0;
    if constexpr (SCALES != kScaleRows) scale_bits[r] = rows[r].scale_bits(ring_s[slot], grp);
    if constexpr (HAS_ZP && SCALES != kScaleRows)
      bias[r] = Bias<T, BITS>::make(rows[r].zero(ring_z[slot], grp));
    else
      bias[r] = row_bias[r];
    if (!in_k) bias[r] = Bias<T, BITS>::make(0);
  }
}

// Channel-wise (kScaleRows): the scale and zero-point bias of each of the lane's rows, read once per tile.
template <typename T, int BITS, bool HAS_ZP, int RT>
__device__ __forceinline__ void row_constants(const Row<BITS> (&rows)[2 * RT], float (&row_scale)[2 * RT],
                                              Bias<T, BITS> (&row_bias)[2 * RT]) {
#pragma unroll
  for (int r = 0; r < 2 * RT; ++r) {
    row_scale[r] = 0.0f;
    row_bias[r] = Bias<T, BITS>::make(1u << (BITS - 1));
    if (rows[r].valid) {
      row_scale[r] = Pairs<T>::to_float(*reinterpret_cast<const uint16_t*>(rows[r].s));
      if constexpr (HAS_ZP) row_bias[r] = Bias<T, BITS>::make((*rows[r].z >> rows[r].z_shift) & ((1u << BITS) - 1));
    }
  }
}

// act(gate) * up in float32: 1 = silu, 2 = gelu (erf), as the plugin's Triton activation kernel.
__device__ __forceinline__ float gated_activation(float gate, float up, int activation) {
  const float act = activation == 1 ? gate / (1.0f + __expf(-gate)) : 0.5f * gate * (1.0f + erff(gate * 0.70710678118654752f));
  return act * up;
}

// One K step of a warp: its RT row tiles (the words wv of rows lo and hi of each, their zero-point biases
// and scale bits) against TT 8-token column tiles x (the lane's token's 16-byte activation vectors of
// its chunk), accumulated in float32 (kScaleSteps: the step's exact sums times the step's scales).
template <typename T, int BITS, int TT, int SCALES, int RT>
__device__ __forceinline__ void mma_step(float (&acc)[RT][TT][4], const uint4 (&wv)[2 * RT],
                                         const Bias<T, BITS> (&bias)[2 * RT], const uint32_t (&scale_bits)[2 * RT],
                                         const uint4 (&x)[TT][128 / BITS * sizeof(T) / 16]) {
  using A = Pairs<T>;
#pragma unroll
  for (int t = 0; t < RT; ++t) {
    const int lo_r = 2 * t, hi_r = 2 * t + 1;
    // kScaleSteps: the step's exact sums, scaled once; otherwise straight into acc
    float part[TT][4];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[tt][e] = SCALES == kScaleSteps ? 0.0f : acc[t][tt][e];
    const uint32_t scale_lo = scale_bits[lo_r] * 0x10001u, scale_hi = scale_bits[hi_r] * 0x10001u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (BITS == 4) {
        uint32_t lo[4], hi[4];
        centered_int4<T>(word(wv[lo_r], j), bias[lo_r], lo);
        centered_int4<T>(word(wv[hi_r], j), bias[hi_r], hi);
        // groups shorter than a step: the pairs take the scale
        if constexpr (SCALES == kScalePairs) scale_pairs<T>(lo, hi, scale_lo, scale_hi);
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
          const uint4& xv = x[tt][j];  // k 8j .. 8j+7 of the chunk
          // mma m takes pairs 2m (k slots 2q, 2q+1) and 2m + 1 (slots 2q+8, 2q+9): {lo, hi, lo, hi}
          mma_16816<T>(part[tt], lo[0], hi[0], lo[1], hi[1], __byte_perm(xv.x, xv.z, 0x5410),
                       __byte_perm(xv.x, xv.z, 0x7632));
          mma_16816<T>(part[tt], lo[2], hi[2], lo[3], hi[3], __byte_perm(xv.y, xv.w, 0x5410),
                       __byte_perm(xv.y, xv.w, 0x7632));
        }
      } else {
        uint32_t lo[2], hi[2];
        centered_int8<T>(word(wv[lo_r], j), bias[lo_r], lo);
        centered_int8<T>(word(wv[hi_r], j), bias[hi_r], hi);
        if constexpr (SCALES == kScalePairs) scale_pairs<T>(lo, hi, scale_lo, scale_hi);
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
          const uint4& xv = x[tt][j / 2];  // k 4j .. 4j+3 of the chunk
          const uint32_t x_lo = j % 2 ? xv.z : xv.x, x_hi = j % 2 ? xv.w : xv.y;
          mma_16816<T>(part[tt], lo[0], hi[0], lo[1], hi[1], __byte_perm(x_lo, x_hi, 0x5410),
                       __byte_perm(x_lo, x_hi, 0x7632));
        }
      }
    }
    // C fragment: e = 0, 1 -> row g (lo), e = 2, 3 -> row g + 8 (hi)
    if constexpr (SCALES == kScaleSteps) {
      const float s_lo = A::to_float(scale_bits[lo_r]), s_hi = A::to_float(scale_bits[hi_r]);
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][tt][e] = fmaf(part[tt][e], e < 2 ? s_lo : s_hi, acc[t][tt][e]);
    } else {
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][tt][e] = part[tt][e];
    }
  }
}

// Opts KERNEL in to BYTES of dynamic shared memory (above the 48 KB a launch gets without asking) and the
// largest shared-memory carve-out of the L1, so that two blocks are resident wherever they fit; once per
// device and kernel (a template argument: kernels of one signature must not share the flags).
template <auto KERNEL, int BYTES>
cudaError_t allow_ring() {
  const auto kernel = KERNEL;
  constexpr int kMaxDevices = 64;
  static bool opted_in[kMaxDevices] = {};
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (device < kMaxDevices && opted_in[device]) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, BYTES);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (err == cudaSuccess && device < kMaxDevices) opted_in[device] = true;
  return err;
}

// Whether two blocks of a two-tile ring (96-108 KB each) fit an SM of the current device: Hopper's 228 KB
// hold them, an A100's 164 KB or the 100 KB of sm86/89 do not, and there one-tile warps keep the
// occupancy the kernel was measured with. (Only the H200 has run the two-tile path.)
template <int BYTES>
bool two_tile_blocks_fit() {
  constexpr int kMaxDevices = 64;
  static int known[kMaxDevices] = {};  // 0: not asked yet, 1: fits, 2: does not
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices && known[device] != 0) return known[device] == 1;
  int smem = 0;
  cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  const bool fits = smem >= 2 * (BYTES + 4096);  // + static shared memory and the driver's 1 KB
  if (device < kMaxDevices) known[device] = fits ? 1 : 2;
  return fits;
}

// The template arguments of a GEMM: LAUNCH<T, BITS, SCALES, HAS_ZP>::run(p, args...) for the activation
// dtype, the bit width, where the scale multiplies (from the group length) and the zero points.
template <typename T>
struct TypeTag {
  using Type = T;
};
template <template <typename, int, int, bool> class LAUNCH, typename... Args>
cudaError_t dispatch_mma(const GemmParams& p, bool fp16, int bits, Args... args) {
  auto scaled = [&](auto t, auto b) -> cudaError_t {
    using T = typename decltype(t)::Type;
    constexpr int kBits = decltype(b)::value;
    // a step is 4 chunks of a row: it lies in one group when a group holds at least 4 chunks
    const int chunks_per_group = p.K * kBits / 128 / p.num_groups;
    const bool zp = p.qzeros != nullptr;
    if (p.num_groups == 1)
      return zp ? LAUNCH<T, kBits, kScaleRows, true>::run(p, args...) : LAUNCH<T, kBits, kScaleRows, false>::run(p, args...);
    if (chunks_per_group >= 4)
      return zp ? LAUNCH<T, kBits, kScaleSteps, true>::run(p, args...) : LAUNCH<T, kBits, kScaleSteps, false>::run(p, args...);
    return zp ? LAUNCH<T, kBits, kScalePairs, true>::run(p, args...) : LAUNCH<T, kBits, kScalePairs, false>::run(p, args...);
  };
  using Four = std::integral_constant<int, 4>;
  using Eight = std::integral_constant<int, 8>;
  if (fp16) return bits == 4 ? scaled(TypeTag<__half>{}, Four{}) : scaled(TypeTag<__half>{}, Eight{});
  return bits == 4 ? scaled(TypeTag<__nv_bfloat16>{}, Four{}) : scaled(TypeTag<__nv_bfloat16>{}, Eight{});
}

}  // namespace
}  // namespace wna16_plus
