// wna16_plus::moe_align_block_size: vLLM's token alignment (moe_align_block_size with
// ignore_invalid_experts=True) for decode batches, in one block of one launch.
//
// Why our own: at decode sizes the alignment is a fixed cost of every MoE layer, and vLLM 0.26's takes
// 9 us on the H200 for 64 experts (its single-block "small batch" kernel, which it runs up to 64 experts),
// 3 us for 8 experts, and two launches (about 4 us) from 128 experts: a tenth of DeepSeek-V2-Lite's
// layer at M=8 (bench/results/h200/2026-12-04-stream1-breakdown.md). This one counts the pairs of each
// expert with shared-memory atomics, scans the padded counts with warp shuffles, and places the pairs:
// a few microseconds whatever the expert count.
//
// The contract is vLLM's: sorted_token_ids lists, expert by expert, the pairs p = token * top_k + j routed
// to it, padded with num_pairs to a multiple of block_size (the rest of the list is num_pairs too);
// expert_ids names the (local) expert of each block, -1 past num_tokens_post_padded; pairs whose expert
// the expert_map sends to -1 (another rank's) are left out. Within an expert the order of the pairs is
// the order in which the atomics ran: no kernel of the plugin depends on it (a pair's result is its own
// column of the mma).

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/all.h>

#include <optional>
#include <string>

#include "gemm_args.h"
#include "grid_dependency.cuh"
#include "launch_rules.h"

namespace wna16_plus {

namespace {

constexpr int kAlignThreads = 1024;

// num_experts: the ids topk_ids may hold (global, with an expert_map); the local ids the map gives are below it
__global__ void __launch_bounds__(kAlignThreads) moe_wna16_align_kernel(const int32_t* __restrict__ topk_ids, int num_pairs,
                                                                   int num_experts, const int32_t* __restrict__ expert_map,
                                                                   int block_size, int32_t* __restrict__ sorted_ids,
                                                                   int sorted_len, int32_t* __restrict__ expert_ids,
                                                                   int num_blocks, int32_t* __restrict__ num_post_pad) {
  // counts[e]: the pairs of local expert e, then its cursor; starts[e]: its first slot (starts[E] = total)
  extern __shared__ int shared[];
  int* const counts = shared;
  int* const starts = shared + num_experts;
  __shared__ int warp_sums[kAlignThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  auto local_expert = [&](int p) {  // -1: not aligned (out of range, or another rank's expert)
    const int e = topk_ids[p];
    if (e < 0 || e >= num_experts) return -1;
    return expert_map == nullptr ? e : expert_map[e];
  };
  // a programmatic launch: topk_ids is the previous kernel's. No early start_next_grid() (grid_dependency.cuh)
  wait_for_previous_grid();
  for (int e = tid; e < num_experts; e += kAlignThreads) counts[e] = 0;
  for (int i = tid; i < sorted_len; i += kAlignThreads) sorted_ids[i] = num_pairs;  // padding everywhere first
  __syncthreads();
  for (int p = tid; p < num_pairs; p += kAlignThreads) {
    const int e = local_expert(p);
    if (e >= 0 && e < num_experts) atomicAdd(counts + e, 1);
  }
  __syncthreads();
  // exclusive scan of the padded counts, kAlignThreads experts at a time
  int carry = 0;
  for (int base = 0; base < num_experts; base += kAlignThreads) {
    const int e = base + tid;
    const int padded = e < num_experts ? (counts[e] + block_size - 1) / block_size * block_size : 0;
    int inclusive = padded;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
      int w = warp_sums[lane];
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, w, d);
        if (lane >= d) w += v;
      }
      warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int before = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + inclusive - padded;
    if (e < num_experts) starts[e] = before;
    carry += warp_sums[kAlignThreads / 32 - 1];
    __syncthreads();  // warp_sums is rewritten by the next round
  }
  if (tid == 0) {
    starts[num_experts] = carry;
    *num_post_pad = carry;
  }
  for (int e = tid; e < num_experts; e += kAlignThreads) counts[e] = 0;  // now the cursors
  __syncthreads();
  // the expert of each block: the last expert starting at or before it (empty experts start where the next does)
  for (int b = tid; b < num_blocks; b += kAlignThreads) {
    const int slot = b * block_size;
    int e = -1;
    if (slot < carry) {
      int lo = 0, hi = num_experts;  // starts[lo] <= slot < starts[hi]
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (starts[mid] <= slot) lo = mid; else hi = mid;
      }
      e = lo;
    }
    expert_ids[b] = e;
  }
  for (int p = tid; p < num_pairs; p += kAlignThreads) {
    const int e = local_expert(p);
    if (e >= 0 && e < num_experts) sorted_ids[starts[e] + atomicAdd(counts + e, 1)] = p;
  }
}

}  // namespace

std::string moe_align_block_size(const at::Tensor& topk_ids, int64_t block_size, int64_t num_experts,
                                 const std::optional<at::Tensor>& expert_map, at::Tensor& sorted_token_ids,
                                 at::Tensor& expert_ids, at::Tensor& num_tokens_post_padded, bool programmatic) {
  const std::string refusal = align_args_error(topk_ids, block_size, num_experts, expert_map, sorted_token_ids,
                                               expert_ids, num_tokens_post_padded);
  if (!refusal.empty()) return refusal;
  const c10::cuda::OptionalCUDAGuard guard(topk_ids.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const size_t smem = (2 * static_cast<size_t>(num_experts) + 1) * sizeof(int);
  const cudaError_t error = launch_kernel(
      moe_wna16_align_kernel, dim3(1), dim3(kAlignThreads), smem, stream, programmatic, topk_ids.data_ptr<int32_t>(),
      static_cast<int>(topk_ids.numel()), static_cast<int>(num_experts),
      expert_map.has_value() ? expert_map->data_ptr<int32_t>() : nullptr, static_cast<int>(block_size),
      sorted_token_ids.data_ptr<int32_t>(), static_cast<int>(sorted_token_ids.numel()), expert_ids.data_ptr<int32_t>(),
      static_cast<int>(expert_ids.numel()), num_tokens_post_padded.data_ptr<int32_t>());
  const cudaError_t last = cudaGetLastError();  // also clears the launch's error
  const cudaError_t launched = error != cudaSuccess ? error : last;
  return launched == cudaSuccess ? "" : std::string("align kernel launch failed: ") + cudaGetErrorString(launched);
}

}  // namespace wna16_plus
