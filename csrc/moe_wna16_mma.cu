// The tensor-core WNA16 MoE GEMM for decode and small batches (the main kernel behind
// wna16_plus::moe_wna16_gemm; the contract is in moe_wna16_gemm.cu).
//
// Why tensor cores at M = 1: the work is a stream of weights, and what caps the stream below the HBM
// bandwidth is the number of instructions issued per weight (an H200 SM issues 4 warp instructions a
// cycle, and needs about 16 weight bytes a cycle to keep up with HBM). Here the weights are the A
// operand of mma.sync.m16n8k16 (16 output columns by 16 k) and up to 8 tokens are the B operand (16 k
// by 8 tokens), so one instruction consumes 256 weights, and the dequantization is done on pairs
// (bf16x2 / f16x2) with the exponent trick: one lop3 makes (0x4300 | q), the bf16 128 + q, or
// (0x6400 | q), the fp16 1024 + q, for two weights at once, and one subtract of (128 + z) pairs gives
// q - z exactly. Accumulation is float32 in the tensor core.
//
// Where the scale goes (ScaleMode): a scale is a per-(row, group) factor of the k sum, so when the k of
// an mma all lie in one group, the mma can run on the exact integers q - z and its float32 result takes
// the scale: once per step (groups of >= 4 chunks, e.g. int4 gs128) or once per tile (channel-wise).
// Only shorter groups (int4 gs32/gs64, int8 gs32) multiply each pair by its scale before the mma.
//
// A reduction over k may visit k in any order, as long as A and B agree. Each lane loads one
// 16-byte chunk (32 int4 or 16 int8 values of k) of each of its two rows, and the k slots of the
// fragment are mapped to the order in which the exponent trick yields nibble pairs (k, k+4); the
// activations are loaded as 16-byte vectors and permuted to the same order with one byte_perm per
// pair. No relayout of the checkpoint's packing is needed. A chunk never straddles a scale group
// (launch_rules.h: mma_kernel_fits), so one scale and zero serve the chunk of a row.
//
// Work split: lane (g, q) = (lane / 4, lane % 4) owns rows g and g + 8 of a 16-row tile and chunk
// 4 * step + q of each step. The 8 warps of a block share its columns: each warp takes one 16-row
// tile; when the block has fewer than 8 tiles the warps split K (ksplit) and add their partial sums
// through shared memory.
//
// The weight stream is a cp.async pipeline of each warp, in pairs of steps: one copy instruction takes
// 128 bytes (8 chunks, the two steps of a pair) of each of 4 rows, so it reads 4 whole cache lines; the
// lanes then read back the chunks of their fragment, which other lanes copied (a __syncwarp per step
// makes them visible). Copying each lane's own chunk instead read 8 rows x 64 bytes per instruction,
// and ncu counted half of the kernel's shared-memory wavefronts as excess (Mixtral M=8). The 4-byte
// words holding a chunk's scale and zero point are still copied by the lane that reads them, into its
// own slots. kStages / 2 - 1 pairs per warp are in flight while one is computed.
//
// Gated activation (GEMM1 of a MoE layer, p.activation != 0): a tile is 8 output columns n, whose
// gate rows n are the fragment's rows g and whose up rows N/2 + n are its rows g + 8. Each lane then
// holds gate and up of the same (token, column) and writes act(gate) * up directly: no h1 round trip
// through memory and no activation launch.

#include <type_traits>

#include "wna16_common.cuh"

namespace wna16_plus {

namespace {

// The cp.async ring of a warp that streams RT row tiles (16 RT rows, 2 RT a lane): its depth in steps
// (an even number: pairs of steps are copied together), the 16-byte chunks of a warp's ring, and the
// shared memory per block (the warps' chunks, then the 4-byte scale / zero-point words of every row,
// thread and stage). Both depths keep 4 KB of weights in flight per warp.
template <int RT>
struct RingShape {
  static constexpr int kStages = RT == 1 ? 6 : 4;
  static constexpr int kPairStages = kStages / 2;
  static constexpr int kPairChunks = 16 * RT * 8;  // one pair stage: 16 RT rows x 8 chunks
  static constexpr int kWarpChunks = kPairStages * kPairChunks;
  static constexpr int kBytes = kWarps * kWarpChunks * 16 + kStages * 2 * RT * kThreads * (4 + 4);
  static_assert(kStages % 2 == 0, "the ring holds whole pairs of steps");
};

// Where a group's scale multiplies (see the header). The host picks it from the group length.
enum ScaleMode : int {
  kScalePairs = 0,  // groups shorter than a step: each dequantized pair, before the mma
  kScaleSteps = 1,  // every step lies in one group: the step's float32 mma result
  kScaleRows = 2,   // channel-wise: the tile's float32 sums, once at the end
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
};

// act(gate) * up in float32: 1 = silu, 2 = gelu (erf), as the plugin's Triton activation kernel.
__device__ __forceinline__ float gated_activation(float gate, float up, int activation) {
  const float act = activation == 1 ? gate / (1.0f + __expf(-gate)) : 0.5f * gate * (1.0f + erff(gate * 0.70710678118654752f));
  return act * up;
}

template <typename T, int BITS, int TT, int SCALES, bool HAS_ZP, int RT>
__global__ void __launch_bounds__(kThreads, 2) moe_wna16_mma_kernel(const GemmParams p) {
  using A = Pairs<T>;
  using B = Bias<T, BITS>;
  using Ring = RingShape<RT>;
  constexpr int kRows = 2 * RT;                           // weight rows per lane: lo and hi of RT tiles
  constexpr int kStages = Ring::kStages;
  constexpr int kChunkVals = 128 / BITS;                 // k per 16-byte chunk
  constexpr int kVecs = kChunkVals * sizeof(T) / 16;     // 16-byte activation vectors per chunk
  constexpr bool kStepScales = SCALES != kScaleRows;     // scale words travel with the chunks
  constexpr bool kStepZeros = HAS_ZP && kStepScales;     // and so do zero-point words
  constexpr bool kWordCopier = SCALES == kScalePairs;      // each lane copies its words (its chunk's own group)
  constexpr int kLead = Ring::kPairStages - 1;             // pairs in flight while one is computed
  __shared__ int s_pairs[kMaxBlockM];
  // Ring::kBytes: per warp [pair stage][16 RT rows][8 chunks], then per lane [stage][row][thread] scale and
  // zero-point words (slot (stage d, row r) at (kRows d + r) * kThreads)
  extern __shared__ uint4 s_ring[];
  uint32_t* const ring_s = reinterpret_cast<uint32_t*>(s_ring + kWarps * Ring::kWarpChunks) + threadIdx.x;
  uint32_t* const ring_z = ring_s + kStages * kRows * kThreads;
  const int n_begin = blockIdx.y * p.block_n;
  const int n_end = min(p.out_n, n_begin + p.block_n);  // output columns
  int expert;
  if (!stage_block_pairs<T>(p, s_pairs, n_begin, n_end, expert)) return;

  const bool gated = p.activation != 0;
  const int tile_cols = gated ? 8 : 16;  // output columns per 16-row tile
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  uint4* const warp_ring = s_ring + warp * Ring::kWarpChunks;
  const int ntiles = (n_end - n_begin + tile_cols - 1) / tile_cols;
  const int nunits = (ntiles + RT - 1) / RT;  // a warp streams RT tiles at once (a unit)
  const int units_par = min(nunits, kWarps);
  const int ksplit = kWarps / units_par;
  const int unit_slot = warp % units_par, kslice = warp / units_par;
  const int chunks = p.K * BITS / 128;  // 16-byte chunks per weight row
  const int pairs = (chunks + 7) / 8;   // pairs of steps (128 bytes of a row); the K split deals them out
  // the scale group of chunk c is c >> group_shift: launch_rules.h admits this kernel only where a group
  // is a power-of-two number of chunks (32/64/128 values) or the whole row (channel-wise). An integer
  // division by the runtime group size cost about ten instructions, twice per step, in the K loop.
  const int group_shift = p.num_groups == 1 ? 30 : __ffs(chunks / p.num_groups) - 1;
  const int64_t row_bytes = static_cast<int64_t>(p.K) * BITS / 8;
  const T* a = static_cast<const T*>(p.a);
  T* c = static_cast<T*>(p.c);
  const B symmetric = B::make(1u << (BITS - 1));
  const B nothing = B::make(0);  // for chunks past K: q - 0 of a zero-filled chunk is 0

  for (int t0 = 0; t0 < p.block_m; t0 += 8 * TT) {
    bool any = false;  // uniform over the block: skip passes of padding only
    for (int i = t0; i < min(p.block_m, t0 + 8 * TT); ++i) any |= s_pairs[i] < p.num_pairs;
    if (!any) continue;
    // this lane's B column: token g of each 8-token tile. A column without a token reads row 0 of a:
    // column n of the mma result depends on column n of B alone, and that column is never stored.
    const T* a_row[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
      const int idx = t0 + tt * 8 + g;
      const int pair = idx < p.block_m ? s_pairs[idx] : p.num_pairs;
      a_row[tt] = a + (pair < p.num_pairs ? static_cast<int64_t>(pair / p.top_k) * p.stride_am : 0);
    }

    for (int unit_base = 0; unit_base < nunits; unit_base += units_par) {
      const int unit = unit_base + unit_slot;
      const bool active = kslice < ksplit && unit < nunits;
      float acc[RT][TT][4];
#pragma unroll
      for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[t][tt][e] = 0.0f;
      // the output columns of the fragment's rows g and g + 8 in each tile of the unit
      int n_lo[RT], n_hi[RT];
#pragma unroll
      for (int t = 0; t < RT; ++t) {
        n_lo[t] = n_begin + (unit * RT + t) * tile_cols + g;
        n_hi[t] = gated ? n_lo[t] : n_lo[t] + 8;
      }

      if (active) {
        __syncwarp();  // every lane has read the previous unit's last chunks before the ring is refilled
        Row<BITS> rows[kRows];  // rows 2t and 2t + 1: lo and hi of tile t
        B row_bias[kRows];      // kScaleRows: the rows' zero points
        float row_scale[kRows];  // kScaleRows: the rows' scales, applied at the end
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int t = r / 2;
          const int n = r % 2 == 0 ? n_lo[t] : gated ? n_lo[t] + p.out_n : n_hi[t];  // gated: the up row
          rows[r].valid = (r % 2 == 0 ? n_lo[t] : n_hi[t]) < n_end;
          rows[r].s = static_cast<const uint8_t*>(p.scales) +
                      (static_cast<int64_t>(expert) * p.N * p.num_groups + n * p.s_stride_n) * 2;
          rows[r].z = p.qzeros + static_cast<int64_t>(expert) * (p.N * BITS / 8) * p.num_groups +
                      static_cast<int64_t>(n * BITS / 8) * p.z_stride_n;
          rows[r].s_step = static_cast<int>(p.s_stride_g) * 2;
          rows[r].z_step = static_cast<int>(p.z_stride_g);
          rows[r].z_shift = BITS == 4 && (n & 1) ? 4 : 0;
          row_bias[r] = symmetric;
          row_scale[r] = 0.0f;
          if constexpr (SCALES == kScaleRows) {
            if (rows[r].valid) {
              row_scale[r] = A::to_float(*reinterpret_cast<const uint16_t*>(rows[r].s));
              if constexpr (HAS_ZP) row_bias[r] = B::make((*rows[r].z >> rows[r].z_shift) & ((1u << BITS) - 1));
            }
          }
        }
        // The copies of a pair: 2 kRows instructions, c taking rows 4c .. 4c + 3 of the warp's 16 RT (tile t's
        // rows 16t .. 16t + 15: its lo rows g, then its hi rows g + 8), lane l chunk l % 8 of row 4c + l / 8.
        // A row's 8 chunks sit in one 128-byte line of the ring with the step bit swizzled by the row's
        // parity, so the reads (rows g, g + 1 of one quarter warp) and the copies are free of bank conflicts.
        constexpr int kCopies = 2 * kRows;
        const int copy_chunk = lane & 7, copy_row = lane >> 3;
        const int copy_slot = copy_row * 8 + (copy_chunk ^ ((copy_row & 1) << 2));
        const uint8_t* const w_expert = p.qweight + static_cast<int64_t>(expert) * p.N * row_bytes + copy_chunk * 16;
        uint32_t copy_offset[kCopies];  // bytes from w_expert to the row of copy c (one expert is < 4 GiB)
        uint32_t copy_valid = 0;
#pragma unroll
        for (int cp = 0; cp < kCopies; ++cp) {
          const int lr = 4 * cp + copy_row, t = lr / 16, j = lr % 16;
          const int col = gated ? n_begin + (unit * RT + t) * 8 + (j & 7) : n_begin + (unit * RT + t) * 16 + j;
          const int n = gated && j >= 8 ? col + p.out_n : col;  // gated: rows 8..15 of a tile are up rows
          copy_offset[cp] = static_cast<uint32_t>(n * row_bytes);
          copy_valid |= (col < n_end ? 1u : 0u) << cp;
        }
        // this warp's pairs: kslice, kslice + ksplit, ...; its steps i are the pairs' two halves
        const int my_pairs = kslice < pairs ? (pairs - kslice + ksplit - 1) / ksplit : 0;
        const int my_steps = 2 * my_pairs;
        auto issue_pair = [&](int pi, int pstage) {
          if (pi < my_pairs) {
            const int gp = kslice + pi * ksplit;
            const bool in_k = gp * 8 + copy_chunk < chunks;
            const uint8_t* const src = w_expert + static_cast<int64_t>(gp) * 128;
#pragma unroll
            for (int cp = 0; cp < kCopies; ++cp)
              copy_async16(warp_ring + pstage * Ring::kPairChunks + cp * 32 + copy_slot, src + copy_offset[cp],
                           ((copy_valid >> cp) & 1) && in_k);
            // and, per row and step, the words of the scale and zero point of this lane's chunk. Where a step
            // lies in one group, lane (g, 0) copies them for the four lanes of its rows: 4-byte copies of all
            // 32 lanes cost 8 shared-memory wavefronts each (ncu, Mixtral M=8: 6.4M bank conflicts, all on
            // LDGSTS), as many as the weights' 16-byte copies
#pragma unroll
            for (int sp = 0; sp < 2; ++sp) {
              const int grp = min((2 * gp + sp) * 4 + q, chunks - 1) >> group_shift;
              if (kWordCopier || q == 0) {
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                  const int slot = (kRows * (2 * pstage + sp) + r) * kThreads;
                  if constexpr (kStepScales) copy_async4(ring_s + slot, rows[r].scale_word(grp), rows[r].valid);
                  if constexpr (kStepZeros) copy_async4(ring_z + slot, rows[r].zero_word(grp), rows[r].valid);
                }
              }
            }
          }
          commit_copies();
        };
        // two commit groups per pair (the pair, then an empty one), as the loop commits one per step: the
        // pair of step i is then complete once at most 2 kLead - 1 newer groups are pending
#pragma unroll
        for (int pi = 0; pi < kLead; ++pi) {
          issue_pair(pi, pi);
          commit_copies();
        }

        const int word_lane = kWordCopier ? 0 : q;  // the lane's scale and zero words are in lane (g, 0)'s slots
        int pstage = 0;  // the pair stage of step i
        for (int i = 0; i < my_steps; ++i) {
          const int sp = i & 1;
          const int chunk = (2 * (kslice + (i >> 1) * ksplit) + sp) * 4 + q;  // the lane's chunk of step i
          const bool in_k = chunk < chunks;
          const int grp = min(chunk, chunks - 1) >> group_shift;
          // B: this lane's token's 16-byte activation vectors of the chunk, shared by the unit's tiles
          // (past K: any finite values, the weights' centered values are zero there)
          uint4 x[TT][kVecs];
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int v = 0; v < kVecs; ++v)
              x[tt][v] = __ldg(reinterpret_cast<const uint4*>(a_row[tt] + min(chunk, chunks - 1) * kChunkVals) + v);
          wait_copies<2 * kLead - 1>();  // step i has landed (this lane's copies) ...
          __syncwarp();                  // ... and every lane's
          uint4 wv[kRows];
          B bias[kRows];
          uint32_t scale_bits[kRows];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const int lr = 16 * (r / 2) + 8 * (r % 2) + g;  // tile r / 2, lo or hi row
            wv[r] = warp_ring[pstage * Ring::kPairChunks + lr * 8 + ((sp * 4 + q) ^ ((g & 1) << 2))];
            const int slot = (kRows * (2 * pstage + sp) + r) * kThreads - word_lane;
            scale_bits[r] = 0;
            if constexpr (kStepScales) scale_bits[r] = rows[r].scale_bits(ring_s[slot], grp);
            if constexpr (kStepZeros)
              bias[r] = B::make(rows[r].zero(ring_z[slot], grp));
            else
              bias[r] = row_bias[r];
            if (!in_k) bias[r] = nothing;
          }
          // the next pair into the stage of the pair before this one (read by every lane: the __syncwarp)
          if (sp == 0)
            issue_pair((i >> 1) + kLead, pstage == 0 ? Ring::kPairStages - 1 : pstage - 1);
          else
            commit_copies();
          if (sp == 1) pstage = pstage == Ring::kPairStages - 1 ? 0 : pstage + 1;

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
        wait_copies<0>();  // the ring is idle now: the next unit may reuse it, the K-split sums pass through it
        if constexpr (SCALES == kScaleRows) {
#pragma unroll
          for (int t = 0; t < RT; ++t)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[t][tt][e] *= row_scale[2 * t + (e < 2 ? 0 : 1)];
        }
      }

      if (ksplit > 1) {  // add the K slices' partial sums (uniform branch: every warp syncs)
        // through the ring slots of the lane that computed them (RT * TT float4 of its own slots, idle
        // since its wait_copies<0> above)
        if (active && kslice > 0) {
          __syncwarp();  // every lane of the warp has read its last chunks
#pragma unroll
          for (int t = 0; t < RT; ++t)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
              warp_ring[(t * TT + tt) * 32 + lane] = make_uint4(__float_as_uint(acc[t][tt][0]), __float_as_uint(acc[t][tt][1]),
                                                            __float_as_uint(acc[t][tt][2]), __float_as_uint(acc[t][tt][3]));
        }
        __syncthreads();
        if (active && kslice == 0) {
          for (int ks = 1; ks < ksplit; ++ks) {
            const uint4* other = s_ring + (warp + ks * units_par) * Ring::kWarpChunks + lane;
#pragma unroll
            for (int t = 0; t < RT; ++t)
#pragma unroll
              for (int tt = 0; tt < TT; ++tt) {
                const uint4 v = other[(t * TT + tt) * 32];
                acc[t][tt][0] += __uint_as_float(v.x);
                acc[t][tt][1] += __uint_as_float(v.y);
                acc[t][tt][2] += __uint_as_float(v.z);
                acc[t][tt][3] += __uint_as_float(v.w);
              }
          }
        }
        __syncthreads();  // the sums are read before the next unit's copies land in the ring
      }

      if (active && kslice == 0) {
        // C fragment: e = 0, 1 -> row g, tokens 2q, 2q+1; e = 2, 3 -> row g + 8 (gated: the up rows)
#pragma unroll
        for (int t = 0; t < RT; ++t)
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (gated && e >= 2) break;
              const int n = e < 2 ? n_lo[t] : n_hi[t];
              const int idx = t0 + tt * 8 + 2 * q + (e & 1);
              if (n >= n_end || idx >= p.block_m) continue;
              const int pair = s_pairs[idx];
              if (pair >= p.num_pairs) continue;
              float out = acc[t][tt][e];
              if (gated) out = gated_activation(out, acc[t][tt][e + 2], p.activation);
              if (p.topk_weights != nullptr) out *= p.topk_weights[pair];
              c[static_cast<int64_t>(pair) * p.out_n + n] = from_float<T>(out);
            }
      }
    }
  }
}

template <typename T, int BITS, int TT, int SCALES, bool HAS_ZP, int RT>
cudaError_t launch_tiles(const GemmParams& p, dim3 grid, cudaStream_t stream) {
  auto* kernel = moe_wna16_mma_kernel<T, BITS, TT, SCALES, HAS_ZP, RT>;
  constexpr int kBytes = RingShape<RT>::kBytes;
  // the ring is above the 48 KB a launch gets without asking: opt in once per device
  constexpr int kMaxDevices = 64;
  static bool opted_in[kMaxDevices] = {};
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (device >= kMaxDevices || !opted_in[device]) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    if (err != cudaSuccess) return err;
    if (device < kMaxDevices) opted_in[device] = true;
  }
  kernel<<<grid, kThreads, kBytes, stream>>>(p);
  return cudaSuccess;
}

// Whether two blocks of the two-tile ring (96 KB each) fit an SM of the current device: Hopper's 228 KB
// hold them, an A100's 164 KB or the 100 KB of sm86/89 do not, and there one-tile warps keep the
// occupancy the kernel was measured with. (Only the H200 has run the two-tile path.)
bool two_tile_blocks_fit() {
  constexpr int kMaxDevices = 64;
  static int known[kMaxDevices] = {};  // 0: not asked yet, 1: fits, 2: does not
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices && known[device] != 0) return known[device] == 1;
  int smem = 0;
  cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  const bool fits = smem >= 2 * (RingShape<2>::kBytes + 4096);  // + static shared memory and the driver's 1 KB
  if (device < kMaxDevices) known[device] = fits ? 1 : 2;
  return fits;
}

// One 8-token column tile per pass (block_m <= 8, decode) streams two row tiles per warp when the block
// has them: the activation loads and their permutes then serve twice the weights. 16 tokens per pass
// stream one (registers).
template <typename T, int BITS, int SCALES, bool HAS_ZP>
cudaError_t launch_zp(const GemmParams& p, dim3 grid, cudaStream_t stream) {
  const int tile_cols = p.activation != 0 ? 8 : 16;
  const int ntiles = (min(p.block_n, p.out_n) + tile_cols - 1) / tile_cols;
  if (p.block_m > 8) return launch_tiles<T, BITS, 2, SCALES, HAS_ZP, 1>(p, grid, stream);
  if (ntiles >= 2 && two_tile_blocks_fit()) return launch_tiles<T, BITS, 1, SCALES, HAS_ZP, 2>(p, grid, stream);
  return launch_tiles<T, BITS, 1, SCALES, HAS_ZP, 1>(p, grid, stream);
}

template <typename T, int BITS, int SCALES>
cudaError_t launch_scaled(const GemmParams& p, dim3 grid, cudaStream_t stream) {
  return p.qzeros != nullptr ? launch_zp<T, BITS, SCALES, true>(p, grid, stream)
                             : launch_zp<T, BITS, SCALES, false>(p, grid, stream);
}

template <typename T, int BITS>
cudaError_t launch_typed(const GemmParams& p, dim3 grid, cudaStream_t stream) {
  // a step is 4 chunks of a row: it lies in one group when a group holds at least 4 chunks
  const int chunks_per_group = p.K * BITS / 128 / p.num_groups;
  if (p.num_groups == 1) return launch_scaled<T, BITS, kScaleRows>(p, grid, stream);
  if (chunks_per_group >= 4) return launch_scaled<T, BITS, kScaleSteps>(p, grid, stream);
  return launch_scaled<T, BITS, kScalePairs>(p, grid, stream);
}

}  // namespace

cudaError_t launch_moe_wna16_mma(const GemmParams& p, bool fp16, int bits, dim3 grid, cudaStream_t stream) {
  if (fp16) return bits == 4 ? launch_typed<__half, 4>(p, grid, stream) : launch_typed<__half, 8>(p, grid, stream);
  return bits == 4 ? launch_typed<__nv_bfloat16, 4>(p, grid, stream) : launch_typed<__nv_bfloat16, 8>(p, grid, stream);
}

}  // namespace wna16_plus
