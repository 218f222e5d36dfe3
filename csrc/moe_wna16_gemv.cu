// The CUDA-core WNA16 MoE GEMV (the fallback of wna16_plus::moe_wna16_gemm for rows that do not
// split into 16-byte chunks inside one scale group, e.g. K=176 or K=200 channel-wise).
//
//   c[p, n] = (w_p if topk_weights) * sum_k a[p / top_k, k] * (q[e_p, n, k] - z[e_p, n, g]) * s[e_p, n, g]
//
// A column n of the output is one contiguous weight row, read by `lanes` lanes of a warp in
// VEC_BYTES vector loads (16, 8 or 4 bytes), dequantized in registers, and reused for up to
// kTokensPerPass tokens of the block at once; the partial dot products are reduced across the lanes
// with shuffles. Math: float32 throughout, one rounding to the activation dtype at the store.

#include "wna16_common.cuh"

namespace wna16_plus {
namespace {

constexpr int kTokensPerPass = 4;

// BYTES of global memory as one load (16, 8 or 4 bytes; the address is BYTES-aligned).
template <int BYTES>
struct Vec;
template <>
struct Vec<16> {
  using type = uint4;
};
template <>
struct Vec<8> {
  using type = uint2;
};
template <>
struct Vec<4> {
  using type = uint32_t;
};

template <int BYTES>
__device__ __forceinline__ void load_bytes(const void* src, uint8_t (&dst)[BYTES]) {
  using V = typename Vec<BYTES>::type;
  *reinterpret_cast<V*>(dst) = __ldg(reinterpret_cast<const V*>(src));
}

// VALS activations a[k0 .. k0+VALS) as float, in 16/8-byte loads (VALS*sizeof(T) is 8, 16, 32 or 64).
template <typename T, int VALS>
__device__ __forceinline__ void load_activations(const T* src, float (&dst)[VALS]) {
  constexpr int BYTES = VALS * sizeof(T);
  constexpr int CHUNK = BYTES >= 16 ? 16 : BYTES;
  alignas(16) T vals[VALS];
#pragma unroll
  for (int i = 0; i < BYTES / CHUNK; ++i) {
    using V = typename Vec<CHUNK>::type;
    reinterpret_cast<V*>(vals)[i] = __ldg(reinterpret_cast<const V*>(src) + i);
  }
#pragma unroll
  for (int j = 0; j < VALS; ++j) dst[j] = to_float(vals[j]);
}

template <typename T, int BITS, int VEC_BYTES>
__global__ void __launch_bounds__(kThreads) moe_wna16_gemv_kernel(const GemmParams p, int lanes) {
  const T* __restrict__ a = static_cast<const T*>(p.a);
  const T* __restrict__ scales = static_cast<const T*>(p.scales);
  const uint8_t* __restrict__ qweight = p.qweight;
  const uint8_t* __restrict__ qzeros = p.qzeros;
  const float* __restrict__ topk_weights = p.topk_weights;
  T* __restrict__ c = static_cast<T*>(p.c);
  const int64_t stride_am = p.stride_am;
  const int num_pairs = p.num_pairs, top_k = p.top_k, N = p.N, K = p.K, num_groups = p.num_groups;
  const int block_m = p.block_m;
  constexpr int VALS = VEC_BYTES * 8 / BITS;  // weights per vector
  __shared__ int s_pairs[kMaxBlockM];
  const int n_begin = blockIdx.y * p.block_n;
  const int n_end = min(N, n_begin + p.block_n);
  int expert;
  if (!stage_block_pairs<T>(p, s_pairs, n_begin, n_end, expert)) return;

  const int64_t row_bytes = static_cast<int64_t>(K) * BITS / 8;
  const int vecs_per_row = static_cast<int>(row_bytes / VEC_BYTES);
  const int group_size = K / num_groups;
  const int lane = threadIdx.x & 31;
  const int cols_per_warp = 32 / lanes;
  const int lane_in_col = lane % lanes;
  const int col_in_pass = (threadIdx.x >> 5) * cols_per_warp + lane / lanes;
  const int cols_per_pass = (kThreads / 32) * cols_per_warp;
  const uint8_t* w_expert = qweight + static_cast<int64_t>(expert) * N * row_bytes;
  const T* s_expert = scales + static_cast<int64_t>(expert) * N * num_groups;
  const uint8_t* z_expert =
      qzeros == nullptr ? nullptr : qzeros + static_cast<int64_t>(expert) * (static_cast<int64_t>(N) * BITS / 8) * num_groups;

  for (int t0 = 0; t0 < block_m; t0 += kTokensPerPass) {
    int pair[kTokensPerPass];
    const T* a_row[kTokensPerPass];
    bool any = false;
#pragma unroll
    for (int t = 0; t < kTokensPerPass; ++t) {
      pair[t] = t0 + t < block_m ? s_pairs[t0 + t] : num_pairs;
      const bool valid = pair[t] < num_pairs;
      any |= valid;
      a_row[t] = valid ? a + static_cast<int64_t>(pair[t] / top_k) * stride_am : nullptr;
    }
    if (!any) continue;  // padding rows (uniform over the block)

    for (int n_base = n_begin; n_base < n_end; n_base += cols_per_pass) {
      const int n = n_base + col_in_pass;
      float acc[kTokensPerPass];
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t) acc[t] = 0.0f;
      if (n < n_end) {
        const uint8_t* w_row = w_expert + static_cast<int64_t>(n) * row_bytes;
        const T* s_row = s_expert + static_cast<int64_t>(n) * p.s_stride_n;
        float zero_sym = static_cast<float>(1 << (BITS - 1));
#pragma unroll 2
        for (int v = lane_in_col; v < vecs_per_row; v += lanes) {
          alignas(16) uint8_t bytes[VEC_BYTES];
          load_bytes<VEC_BYTES>(w_row + static_cast<int64_t>(v) * VEC_BYTES, bytes);
          const int k0 = v * VALS;
          const int g = k0 / group_size;  // a vector never straddles two groups (launch_rules.h)
          const float scale = to_float(s_row[g * p.s_stride_g]);
          float zero = zero_sym;
          if (z_expert != nullptr) {
            const uint8_t zb = z_expert[static_cast<int64_t>(n) * BITS / 8 * p.z_stride_n + g * p.z_stride_g];
            zero = BITS == 4 ? static_cast<float>((n & 1) ? (zb >> 4) : (zb & 0xF)) : static_cast<float>(zb);
          }
          float w[VALS];
#pragma unroll
          for (int j = 0; j < VEC_BYTES; ++j) {
            if constexpr (BITS == 4) {
              w[2 * j] = static_cast<float>(bytes[j] & 0xF) - zero;
              w[2 * j + 1] = static_cast<float>(bytes[j] >> 4) - zero;
            } else {
              w[j] = static_cast<float>(bytes[j]) - zero;
            }
          }
#pragma unroll
          for (int t = 0; t < kTokensPerPass; ++t) {
            if (a_row[t] == nullptr) continue;
            float x[VALS];
            load_activations<T, VALS>(a_row[t] + k0, x);
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < VALS; ++j) dot = fmaf(w[j], x[j], dot);
            acc[t] = fmaf(scale, dot, acc[t]);
          }
        }
      }
      // reduce each column's partial sums over its `lanes` lanes (a power of two <= 32)
#pragma unroll
      for (int t = 0; t < kTokensPerPass; ++t)
        for (int offset = lanes / 2; offset > 0; offset >>= 1)
          acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], offset);
      if (n < n_end && lane_in_col == 0) {
#pragma unroll
        for (int t = 0; t < kTokensPerPass; ++t) {
          if (a_row[t] == nullptr) continue;
          const float out = topk_weights == nullptr ? acc[t] : acc[t] * topk_weights[pair[t]];
          c[static_cast<int64_t>(pair[t]) * N + n] = from_float<T>(out);
        }
      }
    }
  }
}

// Lanes reading one weight row: enough to cover it in one or two vectors each, a power of two <= 32.
int lanes_for(int64_t vecs_per_row) {
  int lanes = 1;
  while (lanes < 32 && lanes * 2 <= vecs_per_row) lanes *= 2;
  return lanes;
}

// (a launch error is left to the caller's cudaGetLastError)
template <typename T, int BITS>
void launch_typed(const GemmParams& p, int vec_bytes, dim3 grid, cudaStream_t stream) {
  const int lanes = lanes_for(static_cast<int64_t>(p.K) * BITS / 8 / vec_bytes);
  if (vec_bytes == 16) {
    launch_kernel(moe_wna16_gemv_kernel<T, BITS, 16>, grid, kThreads, 0, stream, p.programmatic, p, lanes);
  } else if (vec_bytes == 8) {
    launch_kernel(moe_wna16_gemv_kernel<T, BITS, 8>, grid, kThreads, 0, stream, p.programmatic, p, lanes);
  } else {
    launch_kernel(moe_wna16_gemv_kernel<T, BITS, 4>, grid, kThreads, 0, stream, p.programmatic, p, lanes);
  }
}

}  // namespace

void launch_moe_wna16_gemv(const GemmParams& p, bool fp16, int bits, int vec_bytes, dim3 grid, cudaStream_t stream) {
  if (fp16) {
    bits == 4 ? launch_typed<__half, 4>(p, vec_bytes, grid, stream) : launch_typed<__half, 8>(p, vec_bytes, grid, stream);
  } else {
    bits == 4 ? launch_typed<__nv_bfloat16, 4>(p, vec_bytes, grid, stream)
              : launch_typed<__nv_bfloat16, 8>(p, vec_bytes, grid, stream);
  }
}

}  // namespace wna16_plus
