// Device helpers and the launch contract shared by the plugin's CUDA WNA16 MoE kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "grid_dependency.cuh"
#include "launch_rules.h"

namespace wna16_plus {

constexpr int kThreads = 256;  // every kernel: 8 warps per block
constexpr int kWarps = kThreads / 32;

// One launch of a grouped WNA16 GEMM over moe_align_block_size's sorted pairs (see moe_wna16_gemm.cu):
// a block of block_m pairs of one expert (blockIdx.x) times block_n output columns (blockIdx.y).
struct GemmParams {
  const void* a;  // (rows, K) T, row stride stride_am
  int64_t stride_am;
  const uint8_t* qweight;  // (E, N, K*BITS/8), packed along K, even k in the low nibble
  const void* scales;      // (E, N, G) T, strides below
  const uint8_t* qzeros;   // (E, N*BITS/8, G), packed along N, strides below; nullptr = symmetric (2^(BITS-1))
  const float* topk_weights;  // (num_pairs,) or nullptr
  const int32_t* sorted_token_ids;
  const int32_t* expert_ids;
  const int32_t* num_tokens_post_padded;
  void* c;  // (num_pairs, out_n) T
  int num_pairs, top_k, N, K, num_groups, block_m, block_n;
  // Gated activation fused into the GEMM (mma kernel only): 0 none (out_n = N), 1 silu, 2 gelu (erf);
  // then rows n and n + N/2 are the gate and up rows of output column n, and out_n = N/2.
  int activation;
  int out_n;  // output columns (c's row stride); block_n and blockIdx.y tile these
  // element strides of a row and of a group in scales (E, N, G) and qzeros (E, N*BITS/8, G): (G, 1) for the
  // checkpoint's order, (1, rows) for group-major tables (the expert stride is rows * G either way)
  int64_t s_stride_n, s_stride_g, z_stride_n, z_stride_g;
  // Launch (grid_dependency.cuh): programmatic lets the kernel start while the previous one finishes. The
  // stream kernel reads the routing lists before it waits: it is launched so only with weights_before_wait,
  // which says that they are two or more kernels old (GEMM2 of a layer); else plainly.
  bool programmatic, weights_before_wait;
};

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

// Stages the block's sorted pair ids in shared memory; false when the block lies past the padded
// end (nothing to do). Writes zeros for the block's pairs and output columns [n_begin, n_end) when
// its expert is -1 (not on this rank) and returns false then too. Every thread must call it, first:
// it waits for the previous kernel (a programmatic launch). No early start_next_grid(): the next kernel
// launches as this grid's blocks exit (grid_dependency.cuh says why).
template <typename T>
__device__ __forceinline__ bool stage_block_pairs(const GemmParams& p, int* s_pairs, int n_begin, int n_end,
                                                  int& expert) {
  wait_for_previous_grid();
  const int row0 = blockIdx.x * p.block_m;
  if (row0 >= *p.num_tokens_post_padded) return false;
  for (int i = threadIdx.x; i < p.block_m; i += kThreads) s_pairs[i] = p.sorted_token_ids[row0 + i];
  __syncthreads();
  expert = p.expert_ids[blockIdx.x];
  if (expert >= 0) return true;
  T* c = static_cast<T*>(p.c);
  const int width = n_end - n_begin;
  for (int idx = threadIdx.x; idx < p.block_m * width; idx += kThreads) {
    const int pair = s_pairs[idx / width];
    if (pair < p.num_pairs) c[static_cast<int64_t>(pair) * p.out_n + n_begin + idx % width] = from_float<T>(0.0f);
  }
  return false;
}

// Host launchers (one per kernel file). vec_bytes: pick_vector_bytes(K, G, BITS).
void launch_moe_wna16_gemv(const GemmParams& p, bool fp16, int bits, int vec_bytes, dim3 grid, cudaStream_t stream);
// launch_moe_wna16_mma returns the error of its one-time setup (the shared-memory opt-in), if any.
cudaError_t launch_moe_wna16_mma(const GemmParams& p, bool fp16, int bits, dim3 grid, cudaStream_t stream);
// The persistent form (moe_wna16_stream.cu) on `blocks` blocks; partials / counters: its workspace of at
// least blocks * kWarps + 1 slots (kStreamSlotWords), counters zero. cudaErrorNotSupported: its ring does
// not fit this GPU (nothing launched).
cudaError_t launch_moe_wna16_stream(const GemmParams& p, bool fp16, int bits, int blocks, float* partials,
                                    int* counters, cudaStream_t stream);

}  // namespace wna16_plus
