// The tensor-core WNA16 MoE GEMM for decode and small batches (the main kernel behind
// wna16_plus::moe_wna16_gemm; the contract is in moe_wna16_gemm.cu).
//
// Why tensor cores at M = 1: the work is a stream of weights, but dequantizing int4 on CUDA cores
// in float32 costs about five instructions per weight, which caps the stream well below the HBM
// bandwidth. Here the weights are the A operand of mma.sync.m16n8k16 (16 output columns by 16 k)
// and up to 8 tokens are the B operand (16 k by 8 tokens), so one instruction consumes 256
// weights; the dequantization is done on pairs (bf16x2 / f16x2), with the exponent trick
// (0x4300 | q is the bf16 128 + q; 0x6400 | q the fp16 1024 + q) and one subtract and one multiply
// per pair. Accumulation is float32 in the tensor core.
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
// The weight stream is a cp.async pipeline kStages deep: each lane copies its own chunks (and the
// 4-byte words holding their scale and zero point) into its own slots of a shared-memory ring and
// reads back only what it copied itself, so no barrier is needed; kStages - 1 steps per warp are
// in flight while one is computed, which is what keeps HBM busy at M = 1.
//
// Gated activation (GEMM1 of a MoE layer, p.activation != 0): a tile is 8 output columns n, whose
// gate rows n are the fragment's rows g and whose up rows N/2 + n are its rows g + 8. Each lane then
// holds gate and up of the same (token, column) and writes act(gate) * up directly: no h1 round trip
// through memory and no activation launch.

#include <type_traits>

#include "wna16_common.cuh"

namespace wna16_plus {
namespace {

constexpr int kStages = 6;  // cp.async ring depth (steps per warp)

// Shared memory of the ring, per block: 16-byte weight chunks and 4-byte scale / zero-point words
// of 2 rows for every thread and stage.
constexpr int kRingBytes = kStages * 2 * kThreads * (16 + 4 + 4);
template <typename T>
struct Pair;
template <>
struct Pair<__half> {
  using type = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // f16 1024 + q (q < 1024)
  static constexpr float kBias = 1024.0f;
  static __device__ __forceinline__ __half2 splat(float v) { return __float2half2_rn(v); }
  static __device__ __forceinline__ __half2 make(float lo, float hi) { return __floats2half2_rn(lo, hi); }
};
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;  // bf16 128 + q (q < 128)
  static constexpr float kBias = 128.0f;
  static __device__ __forceinline__ __nv_bfloat162 splat(float v) { return __float2bfloat162_rn(v); }
  static __device__ __forceinline__ __nv_bfloat162 make(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
};

template <typename P>
__device__ __forceinline__ uint32_t as_u32(P v) {
  return *reinterpret_cast<uint32_t*>(&v);
}
template <typename P>
__device__ __forceinline__ P as_pair(uint32_t v) {
  return *reinterpret_cast<P*>(&v);
}

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

__device__ __forceinline__ uint32_t word(const uint4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

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

// One row's share of a step: its 16-byte chunk, scale, and zero point (scale 0 = no row / no chunk).
struct RowChunk {
  uint4 w;
  float scale;
  float zero;
};

// This lane's slots of the ring: stage d, row r (0: lo, 1: hi).
struct Ring {
  uint4* w;
  uint32_t* s;
  uint32_t* z;
  __device__ __forceinline__ int slot(int d, int r) const { return (d * 2 + r) * kThreads + threadIdx.x; }
};

// Where one of the lane's two rows lives; issue() starts the copies of a chunk, read() returns it.
template <typename T, int BITS>
struct RowStream {
  const uint8_t* w_row;
  int64_t s_index;  // element index of the row's first scale in the scales tensor
  int64_t z_index;  // byte index of the row's first zero-point byte, or -1 (symmetric)
  int z_shift;      // 4 for odd n of int4 (high nibble), else 0
  bool valid;

  __device__ __forceinline__ void issue(const GemmParams& p, const Ring& ring, int d, int r, int chunk, int chunks,
                                        int group_shift) const {
    const bool live = valid && chunk < chunks;
    const int g = live ? chunk >> group_shift : 0;
    const int slot = ring.slot(d, r);
    copy_async16(ring.w + slot, live ? w_row + static_cast<int64_t>(chunk) * 16 : p.qweight, live);
    const int64_t si = s_index + g;  // the aligned 4-byte word holding the scale
    copy_async4(ring.s + slot, static_cast<const uint8_t*>(p.scales) + ((si * 2) & ~int64_t{3}), live);
    if (z_index >= 0) copy_async4(ring.z + slot, p.qzeros + ((z_index + g) & ~int64_t{3}), live);
  }

  __device__ __forceinline__ RowChunk read(const Ring& ring, int d, int r, int chunk, int group_shift) const {
    const int g = chunk >> group_shift;
    const int slot = ring.slot(d, r);
    RowChunk out;
    out.w = ring.w[slot];
    const uint32_t sw = ring.s[slot];
    const uint16_t bits = static_cast<uint16_t>(((s_index + g) & 1) ? sw >> 16 : sw & 0xFFFFu);
    out.scale = to_float(*reinterpret_cast<const T*>(&bits));
    out.zero = static_cast<float>(1 << (BITS - 1));
    if (z_index >= 0) {
      const uint32_t zw = ring.z[slot];
      out.zero = static_cast<float>((zw >> (8 * ((z_index + g) & 3) + z_shift)) & ((1u << BITS) - 1));
    }
    return out;
  }
};

// The A fragment of word j of both rows, for the two mmas it feeds (int4: nibble pairs (s, s+4)).
template <typename T>
__device__ __forceinline__ void dequant_int4(const RowChunk& lo, const RowChunk& hi, int j, uint32_t (&frag)[2][4]) {
  using P = typename Pair<T>::type;
  const P bias_lo = Pair<T>::splat(Pair<T>::kBias + lo.zero), bias_hi = Pair<T>::splat(Pair<T>::kBias + hi.zero);
  const P scale_lo = Pair<T>::splat(lo.scale), scale_hi = Pair<T>::splat(hi.scale);
  const uint32_t wl = word(lo.w, j), wh = word(hi.w, j);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t ql = ((wl >> (4 * s)) & 0x000F000Fu) | Pair<T>::kMagic;
    const uint32_t qh = ((wh >> (4 * s)) & 0x000F000Fu) | Pair<T>::kMagic;
    // mma s/2 takes pairs s (k slots 2q, 2q+1) and s+1 (slots 2q+8, 2q+9): regs {lo, hi, lo, hi}
    frag[s / 2][(s % 2) * 2 + 0] = as_u32(__hmul2(__hsub2(as_pair<P>(ql), bias_lo), scale_lo));
    frag[s / 2][(s % 2) * 2 + 1] = as_u32(__hmul2(__hsub2(as_pair<P>(qh), bias_hi), scale_hi));
  }
}

// The A fragment of word j of both rows for its one mma (int8: byte pairs (0, 2) and (1, 3)), via
// float32: 2^23 + b is the float whose low mantissa bits are the byte.
template <typename T>
__device__ __forceinline__ void dequant_int8(const RowChunk& lo, const RowChunk& hi, int j, uint32_t (&frag)[4]) {
  float v[2][4];
  const RowChunk* rows[2] = {&lo, &hi};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t w = word(rows[r]->w, j);
    const float bias = 8388608.0f + rows[r]->zero;
#pragma unroll
    for (int b = 0; b < 4; ++b)
      v[r][b] = (__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + b)) - bias) * rows[r]->scale;
  }
  frag[0] = as_u32(Pair<T>::make(v[0][0], v[0][2]));
  frag[1] = as_u32(Pair<T>::make(v[1][0], v[1][2]));
  frag[2] = as_u32(Pair<T>::make(v[0][1], v[0][3]));
  frag[3] = as_u32(Pair<T>::make(v[1][1], v[1][3]));
}

// act(gate) * up in float32: 1 = silu, 2 = gelu (erf), as the plugin's Triton activation kernel.
__device__ __forceinline__ float gated_activation(float gate, float up, int activation) {
  const float act = activation == 1 ? gate / (1.0f + __expf(-gate)) : 0.5f * gate * (1.0f + erff(gate * 0.70710678118654752f));
  return act * up;
}

template <typename T, int BITS, int TT>
__global__ void __launch_bounds__(kThreads, 2) moe_wna16_mma_kernel(const GemmParams p) {
  constexpr int kChunkVals = 128 / BITS;  // k per 16-byte chunk
  __shared__ int s_pairs[kMaxBlockM];
  __shared__ float s_partial[kWarps][TT][4][32];
  extern __shared__ uint4 s_ring[];  // kRingBytes
  const Ring ring{s_ring, reinterpret_cast<uint32_t*>(s_ring + kStages * 2 * kThreads),
                  reinterpret_cast<uint32_t*>(s_ring + kStages * 2 * kThreads) + kStages * 2 * kThreads};
  const int n_begin = blockIdx.y * p.block_n;
  const int n_end = min(p.out_n, n_begin + p.block_n);  // output columns
  int expert;
  if (!stage_block_pairs<T>(p, s_pairs, n_begin, n_end, expert)) return;

  const bool gated = p.activation != 0;
  const int tile_cols = gated ? 8 : 16;  // output columns per 16-row tile
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int ntiles = (n_end - n_begin + tile_cols - 1) / tile_cols;
  const int tiles_par = min(ntiles, kWarps);
  const int ksplit = kWarps / tiles_par;
  const int tile_slot = warp % tiles_par, kslice = warp / tiles_par;
  const int chunks = p.K * BITS / 128;  // 16-byte chunks per weight row
  const int steps = (chunks + 3) / 4;
  // the scale group of chunk c is c >> group_shift: launch_rules.h admits this kernel only where a group
  // is a power-of-two number of chunks (32/64/128 values) or the whole row (channel-wise). An integer
  // division by the runtime group size cost about ten instructions, twice per step, in the K loop.
  const int group_shift = p.num_groups == 1 ? 30 : __ffs(chunks / p.num_groups) - 1;
  const int64_t row_bytes = static_cast<int64_t>(p.K) * BITS / 8;
  const T* a = static_cast<const T*>(p.a);
  T* c = static_cast<T*>(p.c);

  for (int t0 = 0; t0 < p.block_m; t0 += 8 * TT) {
    bool any = false;  // uniform over the block: skip passes of padding only
    for (int i = t0; i < min(p.block_m, t0 + 8 * TT); ++i) any |= s_pairs[i] < p.num_pairs;
    if (!any) continue;
    const T* a_row[TT];  // this lane's B column (token g of each 8-token tile)
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
      const int idx = t0 + tt * 8 + g;
      const int pair = idx < p.block_m ? s_pairs[idx] : p.num_pairs;
      a_row[tt] = pair < p.num_pairs ? a + static_cast<int64_t>(pair / p.top_k) * p.stride_am : nullptr;
    }

    for (int tile_base = 0; tile_base < ntiles; tile_base += tiles_par) {
      const int tile = tile_base + tile_slot;
      const bool active = kslice < ksplit && tile < ntiles;
      float acc[TT][4];
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[tt][e] = 0.0f;
      // the output columns of the fragment's rows g and g + 8, and their weight rows
      const int n_lo = n_begin + tile * tile_cols + g, n_hi = gated ? n_lo : n_lo + 8;

      if (active) {
        RowStream<T, BITS> rows[2];
        const int ns[2] = {n_lo, gated ? n_lo + p.out_n : n_hi};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int n = ns[r];
          const int64_t row = static_cast<int64_t>(expert) * p.N + n;
          rows[r].valid = (r == 0 ? n_lo : n_hi) < n_end;
          rows[r].w_row = p.qweight + row * row_bytes;
          rows[r].s_index = row * p.num_groups;
          rows[r].z_index =
              p.qzeros == nullptr ? -1 : (static_cast<int64_t>(expert) * p.N * BITS / 8 + n * BITS / 8) * p.num_groups;
          rows[r].z_shift = BITS == 4 && (n & 1) ? 4 : 0;
        }
        // this warp's steps: kslice, kslice + ksplit, ...; kStages - 1 of them in flight
        const int my_steps = kslice < steps ? (steps - kslice + ksplit - 1) / ksplit : 0;
        auto issue_step = [&](int i, int stage) {
          if (i < my_steps) {
            const int chunk = (kslice + i * ksplit) * 4 + q;
#pragma unroll
            for (int r = 0; r < 2; ++r) rows[r].issue(p, ring, stage, r, chunk, chunks, group_shift);
          }
          commit_copies();  // one group per step, empty past the end: the wait count stays exact
        };
#pragma unroll
        for (int i = 0; i < kStages - 1; ++i) issue_step(i, i);

        // ring stages of step i (read) and of step i + kStages - 1 (issued): i % kStages, kept as
        // running counters (kStages = 6 made each % a multiply-high sequence in the loop)
        int read_stage = 0, issue_stage = kStages - 1;
        for (int i = 0; i < my_steps; ++i) {
          const int chunk = (kslice + i * ksplit) * 4 + q;
          // B: this lane's token's 16-byte activation vectors of the chunk (zeros past K or for no token)
          constexpr int kVecs = kChunkVals * sizeof(T) / 16;
          uint4 x[TT][kVecs];
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int v = 0; v < kVecs; ++v)
              x[tt][v] = a_row[tt] != nullptr && chunk < chunks
                             ? __ldg(reinterpret_cast<const uint4*>(a_row[tt] + chunk * kChunkVals) + v)
                             : make_uint4(0, 0, 0, 0);
          wait_copies<kStages - 2>();  // step i has landed
          const RowChunk lo = rows[0].read(ring, read_stage, 0, chunk, group_shift);
          const RowChunk hi = rows[1].read(ring, read_stage, 1, chunk, group_shift);
          issue_step(i + kStages - 1, issue_stage);  // into the slot read one step ago
          read_stage = read_stage == kStages - 1 ? 0 : read_stage + 1;
          issue_stage = issue_stage == kStages - 1 ? 0 : issue_stage + 1;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if constexpr (BITS == 4) {
              uint32_t frag[2][4];
              dequant_int4<T>(lo, hi, j, frag);
#pragma unroll
              for (int tt = 0; tt < TT; ++tt) {
                const uint4& xv = x[tt][j];  // k 8j .. 8j+7 of the chunk
                mma_16816<T>(acc[tt], frag[0][0], frag[0][1], frag[0][2], frag[0][3],
                             __byte_perm(xv.x, xv.z, 0x5410), __byte_perm(xv.x, xv.z, 0x7632));
                mma_16816<T>(acc[tt], frag[1][0], frag[1][1], frag[1][2], frag[1][3],
                             __byte_perm(xv.y, xv.w, 0x5410), __byte_perm(xv.y, xv.w, 0x7632));
              }
            } else {
              uint32_t frag[4];
              dequant_int8<T>(lo, hi, j, frag);
#pragma unroll
              for (int tt = 0; tt < TT; ++tt) {
                const uint4& xv = x[tt][j / 2];  // k 4j .. 4j+3 of the chunk
                const uint32_t x_lo = j % 2 ? xv.z : xv.x, x_hi = j % 2 ? xv.w : xv.y;
                mma_16816<T>(acc[tt], frag[0], frag[1], frag[2], frag[3], __byte_perm(x_lo, x_hi, 0x5410),
                             __byte_perm(x_lo, x_hi, 0x7632));
              }
            }
          }
        }
        wait_copies<0>();  // nothing of this tile may land in the next tile's ring
      }

      if (ksplit > 1) {  // add the K slices' partial sums (uniform branch: every warp syncs)
        if (active && kslice > 0) {
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s_partial[warp][tt][e][lane] = acc[tt][e];
        }
        __syncthreads();
        if (active && kslice == 0) {
          for (int ks = 1; ks < ksplit; ++ks)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[tt][e] += s_partial[warp + ks * tiles_par][tt][e][lane];
        }
        __syncthreads();
      }

      if (active && kslice == 0) {
        // C fragment: e = 0, 1 -> row g, tokens 2q, 2q+1; e = 2, 3 -> row g + 8 (gated: the up rows)
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (gated && e >= 2) break;
            const int n = e < 2 ? n_lo : n_hi;
            const int idx = t0 + tt * 8 + 2 * q + (e & 1);
            if (n >= n_end || idx >= p.block_m) continue;
            const int pair = s_pairs[idx];
            if (pair >= p.num_pairs) continue;
            float out = acc[tt][e];
            if (gated) out = gated_activation(out, acc[tt][e + 2], p.activation);
            if (p.topk_weights != nullptr) out *= p.topk_weights[pair];
            c[static_cast<int64_t>(pair) * p.out_n + n] = from_float<T>(out);
          }
      }
    }
  }
}

template <typename T, int BITS, int TT>
cudaError_t launch_tiles(const GemmParams& p, dim3 grid, cudaStream_t stream) {
  auto* kernel = moe_wna16_mma_kernel<T, BITS, TT>;
  // the ring is above the 48 KB a launch gets without asking: opt in once per device
  constexpr int kMaxDevices = 64;
  static bool opted_in[kMaxDevices] = {};
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (device >= kMaxDevices || !opted_in[device]) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingBytes);
    if (err != cudaSuccess) return err;
    if (device < kMaxDevices) opted_in[device] = true;
  }
  kernel<<<grid, kThreads, kRingBytes, stream>>>(p);
  return cudaSuccess;
}

template <typename T, int BITS>
cudaError_t launch_typed(const GemmParams& p, dim3 grid, cudaStream_t stream) {
  return p.block_m <= 8 ? launch_tiles<T, BITS, 1>(p, grid, stream) : launch_tiles<T, BITS, 2>(p, grid, stream);
}

}  // namespace

cudaError_t launch_moe_wna16_mma(const GemmParams& p, bool fp16, int bits, dim3 grid, cudaStream_t stream) {
  if (fp16) return bits == 4 ? launch_typed<__half, 4>(p, grid, stream) : launch_typed<__half, 8>(p, grid, stream);
  return bits == 4 ? launch_typed<__nv_bfloat16, 4>(p, grid, stream) : launch_typed<__nv_bfloat16, 8>(p, grid, stream);
}

}  // namespace wna16_plus
