// The plugin's CUDA WNA16 MoE GEMM for decode and small batches (wna16_plus::moe_wna16_gemm).
//
//   c[p, n] = (w_p if topk_weights) * sum_k a[p / top_k, k] * (q[e_p, n, k] - z[e_p, n, g]) * s[e_p, n, g]
//
// over the routed pairs p of the sorted token list that vLLM's moe_align_block_size makes
// (BLOCK_SIZE_M pairs of one expert per block; expert -1 = not on this rank, written as 0).
// Weights are in the plugin's kernel layout (packing.py): uint8 (E, N, K*BITS/8), packed along
// K, even k in the low nibble; scales (E, N, G) in the activation dtype; zero points uint8
// (E, N*BITS/8, G) packed along N (even n in the low nibble), or none (symmetric: 2^(BITS-1)).
//
// The work is memory bound at small M, so it is organised around the weight stream: a column n
// of the output is one contiguous weight row, read by `lanes` lanes of a warp in VEC_BYTES vector
// loads (16 bytes where the shape allows), dequantized in registers, and reused for up to
// kTokensPerPass tokens of the block at once. The partial dot products are reduced across the
// lanes with shuffles. Math: float32 throughout (products and accumulation), one rounding to
// the activation dtype at the store.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/all.h>

#include <optional>

#include "launch_rules.h"

namespace wna16_plus {
namespace {

constexpr int kThreads = 256;
constexpr int kTokensPerPass = 4;

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

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
__global__ void __launch_bounds__(kThreads) moe_wna16_gemv_kernel(
    const T* __restrict__ a, int64_t stride_am, const uint8_t* __restrict__ qweight,
    const T* __restrict__ scales, const uint8_t* __restrict__ qzeros, const float* __restrict__ topk_weights,
    const int32_t* __restrict__ sorted_token_ids, const int32_t* __restrict__ expert_ids,
    const int32_t* __restrict__ num_tokens_post_padded, T* __restrict__ c, int num_pairs, int top_k, int N, int K,
    int num_groups, int block_m, int block_n, int lanes) {
  constexpr int VALS = VEC_BYTES * 8 / BITS;  // weights per vector
  const int row0 = blockIdx.x * block_m;
  if (row0 >= *num_tokens_post_padded) return;

  __shared__ int s_pairs[kMaxBlockM];
  for (int i = threadIdx.x; i < block_m; i += kThreads) s_pairs[i] = sorted_token_ids[row0 + i];
  __syncthreads();

  const int n_begin = blockIdx.y * block_n;
  const int n_end = min(N, n_begin + block_n);
  const int expert = expert_ids[blockIdx.x];
  if (expert < 0) {  // not on this rank: its pairs contribute 0
    const int width = n_end - n_begin;
    for (int idx = threadIdx.x; idx < block_m * width; idx += kThreads) {
      const int p = s_pairs[idx / width];
      if (p < num_pairs) c[static_cast<int64_t>(p) * N + n_begin + idx % width] = from_float<T>(0.0f);
    }
    return;
  }

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
        const T* s_row = s_expert + static_cast<int64_t>(n) * num_groups;
        float zero_sym = static_cast<float>(1 << (BITS - 1));
#pragma unroll 2
        for (int v = lane_in_col; v < vecs_per_row; v += lanes) {
          alignas(16) uint8_t bytes[VEC_BYTES];
          load_bytes<VEC_BYTES>(w_row + static_cast<int64_t>(v) * VEC_BYTES, bytes);
          const int k0 = v * VALS;
          const int g = k0 / group_size;  // a vector never straddles two groups (launch_rules.h)
          const float scale = to_float(s_row[g]);
          float zero = zero_sym;
          if (z_expert != nullptr) {
            const uint8_t zb = z_expert[static_cast<int64_t>(n) * BITS / 8 * num_groups + g];
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

template <typename T, int BITS>
void launch_for_vec(int64_t vec_bytes, dim3 grid, cudaStream_t stream, const T* a, int64_t stride_am,
                    const uint8_t* qw, const T* s, const uint8_t* z, const float* tw, const int32_t* sorted,
                    const int32_t* experts, const int32_t* npp, T* c, int num_pairs, int top_k, int N, int K,
                    int num_groups, int block_m, int block_n) {
  const int lanes = lanes_for(static_cast<int64_t>(K) * BITS / 8 / vec_bytes);
#define WNA16_LAUNCH(VB)                                                                                   \
  moe_wna16_gemv_kernel<T, BITS, VB><<<grid, kThreads, 0, stream>>>(a, stride_am, qw, s, z, tw, sorted,   \
                                                                     experts, npp, c, num_pairs, top_k, N, \
                                                                     K, num_groups, block_m, block_n, lanes)
  if (vec_bytes == 16) {
    WNA16_LAUNCH(16);
  } else if (vec_bytes == 8) {
    WNA16_LAUNCH(8);
  } else {
    WNA16_LAUNCH(4);
  }
#undef WNA16_LAUNCH
}

template <typename T>
void launch_typed(int64_t bits, int64_t vec_bytes, dim3 grid, cudaStream_t stream, const at::Tensor& a,
                  const at::Tensor& qweight, const at::Tensor& scales, const uint8_t* z, const float* tw,
                  const at::Tensor& sorted, const at::Tensor& experts, const at::Tensor& npp, at::Tensor& c,
                  int num_pairs, int top_k, int N, int K, int num_groups, int block_m, int block_n) {
  const T* a_ptr = reinterpret_cast<const T*>(a.data_ptr());
  const T* s_ptr = reinterpret_cast<const T*>(scales.data_ptr());
  T* c_ptr = reinterpret_cast<T*>(c.data_ptr());
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  const int32_t* sorted_ptr = sorted.data_ptr<int32_t>();
  const int32_t* experts_ptr = experts.data_ptr<int32_t>();
  const int32_t* npp_ptr = npp.data_ptr<int32_t>();
  if (bits == 4) {
    launch_for_vec<T, 4>(vec_bytes, grid, stream, a_ptr, a.stride(0), qw, s_ptr, z, tw, sorted_ptr, experts_ptr,
                         npp_ptr, c_ptr, num_pairs, top_k, N, K, num_groups, block_m, block_n);
  } else {
    launch_for_vec<T, 8>(vec_bytes, grid, stream, a_ptr, a.stride(0), qw, s_ptr, z, tw, sorted_ptr, experts_ptr,
                         npp_ptr, c_ptr, num_pairs, top_k, N, K, num_groups, block_m, block_n);
  }
}

}  // namespace

void moe_wna16_gemm(const at::Tensor& a, const at::Tensor& qweight, const at::Tensor& scales,
                    const std::optional<at::Tensor>& qzeros, const std::optional<at::Tensor>& topk_weights,
                    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                    const at::Tensor& num_tokens_post_padded, at::Tensor& c, int64_t bits, int64_t top_k,
                    int64_t block_size_m, int64_t block_size_n, int64_t block_size_k) {
  TORCH_CHECK(a.is_cuda(), "wna16_plus::moe_wna16_gemm: a must be a CUDA tensor");
  TORCH_CHECK(a.dim() == 2 && a.stride(1) == 1, "a must be (rows, K) with K contiguous, got ", a.sizes());
  TORCH_CHECK(a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16,
              "a must be float16 or bfloat16, got ", a.scalar_type());
  TORCH_CHECK(bits == 4 || bits == 8, "bits=", bits, " is not supported (4 or 8)");
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "qweight must be a contiguous (E, N, K*bits/8) uint8 tensor, got ", qweight.sizes(), " ",
              qweight.scalar_type());
  const int64_t E = qweight.size(0), N = qweight.size(1), K = a.size(1);
  TORCH_CHECK(N * bits % 8 == 0, "N=", N, " int", bits, " does not fill whole bytes of zero points");
  TORCH_CHECK(qweight.size(2) * 8 == K * bits, "qweight has ", qweight.size(2), " bytes per row but K=", K,
              " int", bits, " needs ", K * bits / 8);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == E && scales.size(1) == N && scales.is_contiguous() &&
                  scales.scalar_type() == a.scalar_type(),
              "scales must be a contiguous (E=", E, ", N=", N, ", G) tensor in a's dtype, got ", scales.sizes(), " ",
              scales.scalar_type());
  const int64_t G = scales.size(2);
  const std::string rule = launch_config_error(K, G, block_size_m, block_size_n, block_size_k, bits);
  TORCH_CHECK(rule.empty(), "wna16_plus::moe_wna16_gemm: ", rule);
  TORCH_CHECK(a.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0,
              "a's rows must start on 16-byte boundaries (row stride ", a.stride(0), ")");
  const uint8_t* z = nullptr;
  if (qzeros.has_value()) {
    const auto& qz = *qzeros;
    TORCH_CHECK(qz.dim() == 3 && qz.size(0) == E && qz.size(1) == N * bits / 8 && qz.size(2) == G &&
                    qz.scalar_type() == at::kByte && qz.is_contiguous(),
                "qzeros must be a contiguous (E, N*bits/8, G) uint8 tensor, got ", qz.sizes());
    TORCH_CHECK(qz.device() == a.device(), "qzeros must be on ", a.device());
    z = qz.data_ptr<uint8_t>();
  }
  TORCH_CHECK(c.dim() == 2 && c.size(1) == N && c.is_contiguous() && c.scalar_type() == a.scalar_type(),
              "c must be a contiguous (num_pairs, N=", N, ") tensor in a's dtype, got ", c.sizes());
  const int64_t num_pairs = c.size(0);
  TORCH_CHECK(top_k >= 1 && a.size(0) * top_k >= num_pairs, "a has ", a.size(0), " rows, too few for ", num_pairs,
              " pairs at top_k=", top_k);
  const float* tw = nullptr;
  if (topk_weights.has_value()) {
    TORCH_CHECK(topk_weights->device() == a.device(), "topk_weights must be on ", a.device());
    TORCH_CHECK(topk_weights->scalar_type() == at::kFloat && topk_weights->is_contiguous() &&
                    topk_weights->numel() == num_pairs,
                "topk_weights must be num_pairs=", num_pairs, " contiguous float32 values");
    tw = topk_weights->data_ptr<float>();
  }
  TORCH_CHECK(sorted_token_ids.scalar_type() == at::kInt && expert_ids.scalar_type() == at::kInt &&
                  num_tokens_post_padded.scalar_type() == at::kInt,
              "sorted_token_ids, expert_ids and num_tokens_post_padded must be int32 (moe_align_block_size's)");
  TORCH_CHECK(sorted_token_ids.dim() == 1 && sorted_token_ids.is_contiguous() && expert_ids.dim() == 1 &&
                  expert_ids.is_contiguous() && num_tokens_post_padded.numel() >= 1,
              "sorted_token_ids and expert_ids must be contiguous 1-D tensors, num_tokens_post_padded non-empty");
  // vLLM's list is numel + E*(BM-1) long (not a whole number of blocks); num_tokens_post_padded is a
  // multiple of BM no larger than it, so the whole blocks cover every live one.
  const int64_t em = sorted_token_ids.numel();
  TORCH_CHECK(expert_ids.numel() >= em / block_size_m, "the alignment does not match BLOCK_SIZE_M=", block_size_m,
              " (", em, " sorted ids, ", expert_ids.numel(), " expert ids)");
  const at::Tensor* on_device[] = {&qweight, &scales, &c, &sorted_token_ids, &expert_ids, &num_tokens_post_padded};
  for (const at::Tensor* t : on_device)
    TORCH_CHECK(t->device() == a.device(), "every tensor must be on ", a.device());
  if (em < block_size_m || num_pairs == 0) return;

  const c10::cuda::OptionalCUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t vec_bytes = pick_vector_bytes(K, G, bits);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qweight.data_ptr()) % vec_bytes == 0,
              "qweight must start on a ", vec_bytes, "-byte boundary (it is a view at an odd offset?)");
  TORCH_CHECK((N + block_size_n - 1) / block_size_n <= 65535 && em / block_size_m <= 2147483647,
              "grid too large: N=", N, " with BLOCK_SIZE_N=", block_size_n);
  const dim3 grid(static_cast<unsigned>(em / block_size_m), static_cast<unsigned>((N + block_size_n - 1) / block_size_n));
  if (a.scalar_type() == at::kHalf) {
    launch_typed<__half>(bits, vec_bytes, grid, stream, a, qweight, scales, z, tw, sorted_token_ids, expert_ids,
                         num_tokens_post_padded, c, num_pairs, top_k, N, K, G, block_size_m, block_size_n);
  } else {
    launch_typed<__nv_bfloat16>(bits, vec_bytes, grid, stream, a, qweight, scales, z, tw, sorted_token_ids,
                                expert_ids, num_tokens_post_padded, c, num_pairs, top_k, N, K, G, block_size_m,
                                block_size_n);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace wna16_plus
