// wna16_plus::moe_wna16_gemm: one grouped WNA16 GEMM of a MoE layer over vLLM's sorted token list.
//
//   c[p, n] = (w_p if topk_weights) * sum_k a[p / top_k, k] * (q[e_p, n, k] - z[e_p, n, g]) * s[e_p, n, g]
//
// over the routed pairs p of the sorted token list that vLLM's moe_align_block_size makes
// (BLOCK_SIZE_M pairs of one expert per block; expert -1 = not on this rank, written as 0).
// Weights are in the plugin's kernel layout (packing.py): uint8 (E, N, K*BITS/8), packed along
// K, even k in the low nibble; scales (E, N, G) in the activation dtype; zero points uint8
// (E, N*BITS/8, G) packed along N (even n in the low nibble), or none (symmetric: 2^(BITS-1)).
//
// Every argument is checked first (gemm_args.cpp), before any launch. A refusal is RETURNED as its
// reason ("" when the GEMM was launched) and raised by the Python wrapper
// (cuda_ops.invoke_moe_wna16_gemm), so no C++ exception has to cross into torch. Two kernels do the
// work: the tensor-core kernel (moe_wna16_mma.cu) wherever a weight row splits into 16-byte chunks inside one scale
// group (every real model shape), else the CUDA-core kernel (moe_wna16_gemv.cu). `kernel`
// ("auto", "mma", "gemv") forces one, for tests and benchmarks. `activation` ("silu", "gelu")
// fuses the gated activation of GEMM1 into the mma kernel: c[p, n] = act(h[p, n]) * h[p, N/2 + n]
// for n < N/2, h being the GEMM above; c is then (num_pairs, N/2). kernel "stream" runs the mma kernel's
// persistent form (moe_wna16_stream.cu; BLOCK_SIZE_N is then unused) with `workspace`, a float32 tensor
// created zero (cuda_ops.stream_workspace); on GPUs where its ring does not fit, the tiled one.
// `programmatic` launches the kernel so that it may start while the previous kernel on the stream finishes
// (grid_dependency.cuh; Hopper and later, else a plain launch). The stream kernel copies its first weights
// before it waits, reading the routing lists: it is launched so only with `weights_before_wait` too, which
// says that sorted_token_ids, expert_ids and num_tokens_post_padded were written two or more kernels back
// (the layer's GEMM2), and plainly otherwise.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/all.h>

#include <algorithm>
#include <optional>
#include <string>

#include "gemm_args.h"
#include "wna16_common.cuh"

namespace wna16_plus {

std::string moe_wna16_gemm(const at::Tensor& a, const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& qzeros, const std::optional<at::Tensor>& topk_weights,
                           const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                           const at::Tensor& num_tokens_post_padded, at::Tensor& c, int64_t bits, int64_t top_k,
                           int64_t block_size_m, int64_t block_size_n, int64_t block_size_k,
                           const std::string& kernel, const std::string& activation,
                           const std::optional<at::Tensor>& workspace, bool programmatic,
                           bool weights_before_wait) {
  GemmShape s;
  const std::string refusal =
      gemm_args_error(a, qweight, scales, qzeros, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
                      c, bits, top_k, block_size_m, block_size_n, block_size_k, kernel, activation, workspace, true, &s);
  if (!refusal.empty() || s.nothing_to_do) return refusal;
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const dim3 grid(static_cast<unsigned>(s.em / block_size_m),
                  static_cast<unsigned>((s.out_n + block_size_n - 1) / block_size_n));
  const uint8_t* z = qzeros.has_value() ? qzeros->data_ptr<uint8_t>() : nullptr;
  const float* tw = topk_weights.has_value() ? topk_weights->data_ptr<float>() : nullptr;
  GemmParams p{a.data_ptr(), a.stride(0), qweight.data_ptr<uint8_t>(), scales.data_ptr(), z, tw,
               sorted_token_ids.data_ptr<int32_t>(), expert_ids.data_ptr<int32_t>(),
               num_tokens_post_padded.data_ptr<int32_t>(), c.data_ptr(), static_cast<int>(s.num_pairs),
               static_cast<int>(top_k), static_cast<int>(s.N), static_cast<int>(s.K), static_cast<int>(s.G),
               static_cast<int>(block_size_m), static_cast<int>(block_size_n),
               activation == "silu" ? 1 : activation == "gelu" ? 2 : 0, static_cast<int>(s.out_n),
               s.s_stride_n, s.s_stride_g, s.z_stride_n, s.z_stride_g, programmatic, weights_before_wait};
  const bool fp16 = a.scalar_type() == at::kHalf;
  if (s.use_stream) {
    // two blocks per SM (what the registers allow), fewer when the work bound (every sorted block live) has
    // under two pairs per warp, or the workspace has fewer slots
    const int64_t unit_cols = s.gated ? 16 : 32, pairs = (s.K * bits / 128 + 7) / 8;
    const int64_t work = s.em / block_size_m * ((s.out_n + unit_cols - 1) / unit_cols) * pairs;
    int sms = 0;
    if (const cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, a.device().index());
        err != cudaSuccess)
      return std::string("stream kernel setup failed: ") + cudaGetErrorString(err);
    const int64_t blocks = std::max<int64_t>(1, std::min({int64_t{2} * sms, (work + 2 * kWarps - 1) / (2 * kWarps),
                                                         (s.stream_slots - 1) / kWarps}));
    float* partials = workspace->data_ptr<float>();
    int* counters = reinterpret_cast<int*>(partials + s.stream_slots * kStreamSlotSums);
    const cudaError_t setup = launch_moe_wna16_stream(p, fp16, static_cast<int>(bits), static_cast<int>(blocks),
                                                      partials, counters, stream);
    if (setup != cudaSuccess && setup != cudaErrorNotSupported) {
      cudaGetLastError();  // clears a launch error
      return std::string("stream kernel launch failed: ") + cudaGetErrorString(setup);
    }
    s.use_stream = setup == cudaSuccess;  // else its ring does not fit this GPU: the tiled kernel
  }
  if (s.use_stream) {
    // launched
  } else if (s.use_mma) {
    const cudaError_t setup = launch_moe_wna16_mma(p, fp16, static_cast<int>(bits), grid, stream);
    if (setup != cudaSuccess) {
      cudaGetLastError();  // clears a launch error
      return std::string("mma kernel launch failed: ") + cudaGetErrorString(setup);
    }
  } else {
    launch_moe_wna16_gemv(p, fp16, static_cast<int>(bits), static_cast<int>(s.vec_bytes), grid, stream);
  }
  const cudaError_t launched = cudaGetLastError();
  return launched == cudaSuccess ? "" : std::string("kernel launch failed: ") + cudaGetErrorString(launched);
}

}  // namespace wna16_plus
