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
// Every argument is checked here, before any launch. A refusal is RETURNED as its reason ("" when
// the GEMM was launched) and raised by the Python wrapper (cuda_ops.invoke_moe_wna16_gemm): a C++
// exception thrown from this library segfaulted the process on the H200 machine (bench/
// probe_refusals.py, 2026-12-03), so nothing here throws. Two kernels do the work: the tensor-core
// kernel (moe_wna16_mma.cu) wherever a weight row splits into 16-byte chunks inside one scale
// group (every real model shape), else the CUDA-core kernel (moe_wna16_gemv.cu). `kernel`
// ("auto", "mma", "gemv") forces one, for tests and benchmarks. `activation` ("silu", "gelu")
// fuses the gated activation of GEMM1 into the mma kernel: c[p, n] = act(h[p, n]) * h[p, N/2 + n]
// for n < N/2, h being the GEMM above; c is then (num_pairs, N/2).

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/all.h>

#include <optional>
#include <string>

#include "wna16_common.cuh"

namespace wna16_plus {

// Returns the reason (c10::str of the rest) from the enclosing function when cond is false.
#define WNA16_REQUIRE(cond, ...) \
  do {                           \
    if (!(cond)) return c10::str(__VA_ARGS__); \
  } while (0)

std::string moe_wna16_gemm(const at::Tensor& a, const at::Tensor& qweight, const at::Tensor& scales,
                    const std::optional<at::Tensor>& qzeros, const std::optional<at::Tensor>& topk_weights,
                    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                    const at::Tensor& num_tokens_post_padded, at::Tensor& c, int64_t bits, int64_t top_k,
                    int64_t block_size_m, int64_t block_size_n, int64_t block_size_k, const std::string& kernel, const std::string& activation) {
  WNA16_REQUIRE(a.is_cuda(), "wna16_plus::moe_wna16_gemm: a must be a CUDA tensor");
  WNA16_REQUIRE(a.dim() == 2 && a.stride(1) == 1, "a must be (rows, K) with K contiguous, got ", a.sizes());
  WNA16_REQUIRE(a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16,
              "a must be float16 or bfloat16, got ", a.scalar_type());
  WNA16_REQUIRE(bits == 4 || bits == 8, "bits=", bits, " is not supported (4 or 8)");
  WNA16_REQUIRE(qweight.dim() == 3 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "qweight must be a contiguous (E, N, K*bits/8) uint8 tensor, got ", qweight.sizes(), " ",
              qweight.scalar_type());
  const int64_t E = qweight.size(0), N = qweight.size(1), K = a.size(1);
  WNA16_REQUIRE(N * bits % 8 == 0, "N=", N, " int", bits, " does not fill whole bytes of zero points");
  WNA16_REQUIRE(qweight.size(2) * 8 == K * bits, "qweight has ", qweight.size(2), " bytes per row but K=", K,
              " int", bits, " needs ", K * bits / 8);
  WNA16_REQUIRE(scales.dim() == 3 && scales.size(0) == E && scales.size(1) == N && scales.is_contiguous() &&
                  scales.scalar_type() == a.scalar_type(),
              "scales must be a contiguous (E=", E, ", N=", N, ", G) tensor in a's dtype, got ", scales.sizes(), " ",
              scales.scalar_type());
  const int64_t G = scales.size(2);
  const std::string rule = launch_config_error(K, G, block_size_m, block_size_n, block_size_k, bits);
  WNA16_REQUIRE(rule.empty(), "wna16_plus::moe_wna16_gemm: ", rule);
  WNA16_REQUIRE(a.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0,
              "a's rows must start on 16-byte boundaries (row stride ", a.stride(0), ")");
  const uint8_t* z = nullptr;
  if (qzeros.has_value()) {
    const auto& qz = *qzeros;
    WNA16_REQUIRE(qz.dim() == 3 && qz.size(0) == E && qz.size(1) == N * bits / 8 && qz.size(2) == G &&
                    qz.scalar_type() == at::kByte && qz.is_contiguous(),
                "qzeros must be a contiguous (E, N*bits/8, G) uint8 tensor, got ", qz.sizes());
    WNA16_REQUIRE(qz.device() == a.device(), "qzeros must be on ", a.device());
    z = qz.data_ptr<uint8_t>();
  }
  WNA16_REQUIRE(activation == "none" || activation == "silu" || activation == "gelu",
              "activation must be none, silu or gelu, got ", activation);
  const bool gated = activation != "none";
  WNA16_REQUIRE(!gated || N % 2 == 0, "a gated activation needs gate and up rows (N even), got N=", N);
  const int64_t out_n = gated ? N / 2 : N;
  WNA16_REQUIRE(c.dim() == 2 && c.size(1) == out_n && c.is_contiguous() && c.scalar_type() == a.scalar_type(),
              "c must be a contiguous (num_pairs, ", out_n, ") tensor in a's dtype, got ", c.sizes());
  const int64_t num_pairs = c.size(0);
  WNA16_REQUIRE(top_k >= 1 && a.size(0) * top_k >= num_pairs, "a has ", a.size(0), " rows, too few for ", num_pairs,
              " pairs at top_k=", top_k);
  const float* tw = nullptr;
  if (topk_weights.has_value()) {
    WNA16_REQUIRE(topk_weights->device() == a.device(), "topk_weights must be on ", a.device());
    WNA16_REQUIRE(topk_weights->scalar_type() == at::kFloat && topk_weights->is_contiguous() &&
                    topk_weights->numel() == num_pairs,
                "topk_weights must be num_pairs=", num_pairs, " contiguous float32 values");
    tw = topk_weights->data_ptr<float>();
  }
  WNA16_REQUIRE(sorted_token_ids.scalar_type() == at::kInt && expert_ids.scalar_type() == at::kInt &&
                  num_tokens_post_padded.scalar_type() == at::kInt,
              "sorted_token_ids, expert_ids and num_tokens_post_padded must be int32 (moe_align_block_size's)");
  WNA16_REQUIRE(sorted_token_ids.dim() == 1 && sorted_token_ids.is_contiguous() && expert_ids.dim() == 1 &&
                  expert_ids.is_contiguous() && num_tokens_post_padded.numel() >= 1,
              "sorted_token_ids and expert_ids must be contiguous 1-D tensors, num_tokens_post_padded non-empty");
  // vLLM's list is numel + E*(BM-1) long (not a whole number of blocks); num_tokens_post_padded is a
  // multiple of BM no larger than it, so the whole blocks cover every live one.
  const int64_t em = sorted_token_ids.numel();
  WNA16_REQUIRE(expert_ids.numel() >= em / block_size_m, "the alignment does not match BLOCK_SIZE_M=", block_size_m,
              " (", em, " sorted ids, ", expert_ids.numel(), " expert ids)");
  const at::Tensor* on_device[] = {&qweight, &scales, &c, &sorted_token_ids, &expert_ids, &num_tokens_post_padded};
  for (const at::Tensor* t : on_device)
    WNA16_REQUIRE(t->device() == a.device(), "every tensor must be on ", a.device());
  if (em < block_size_m || num_pairs == 0) return "";

  const int64_t vec_bytes = pick_vector_bytes(K, G, bits);
  WNA16_REQUIRE(kernel == "auto" || kernel == "mma" || kernel == "gemv", "kernel must be auto, mma or gemv, got ", kernel);
  const bool use_mma = kernel == "mma" || (kernel == "auto" && mma_kernel_fits(K, G, bits));
  WNA16_REQUIRE(!use_mma || mma_kernel_fits(K, G, bits), "the mma kernel needs 16-byte chunks of a weight row inside ",
              "one scale group; K=", K, ", G=", G, ", int", bits, " does not give them");
  // the mma kernel copies the 4-byte words that hold a scale or zero point
  WNA16_REQUIRE(!use_mma || (reinterpret_cast<uintptr_t>(scales.data_ptr()) % 4 == 0 &&
                           (z == nullptr || reinterpret_cast<uintptr_t>(z) % 4 == 0)),
              "scales and qzeros must start on 4-byte boundaries (views at odd offsets?)");
  WNA16_REQUIRE(!gated || use_mma, "activation=", activation, " is fused only in the mma kernel (K=", K, ", G=", G,
              ", int", bits, ", kernel=", kernel, "); run the GEMM and the activation apart");
  WNA16_REQUIRE(reinterpret_cast<uintptr_t>(qweight.data_ptr()) % vec_bytes == 0,
              "qweight must start on a ", vec_bytes, "-byte boundary (it is a view at an odd offset?)");
  WNA16_REQUIRE((out_n + block_size_n - 1) / block_size_n <= 65535 && em / block_size_m <= 2147483647,
              "grid too large: N=", N, " with BLOCK_SIZE_N=", block_size_n);
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const dim3 grid(static_cast<unsigned>(em / block_size_m), static_cast<unsigned>((out_n + block_size_n - 1) / block_size_n));
  GemmParams p{a.data_ptr(), a.stride(0), qweight.data_ptr<uint8_t>(), scales.data_ptr(), z, tw,
               sorted_token_ids.data_ptr<int32_t>(), expert_ids.data_ptr<int32_t>(),
               num_tokens_post_padded.data_ptr<int32_t>(), c.data_ptr(), static_cast<int>(num_pairs),
               static_cast<int>(top_k), static_cast<int>(N), static_cast<int>(K), static_cast<int>(G),
               static_cast<int>(block_size_m), static_cast<int>(block_size_n),
               activation == "silu" ? 1 : activation == "gelu" ? 2 : 0, static_cast<int>(out_n)};
  const bool fp16 = a.scalar_type() == at::kHalf;
  if (use_mma) {
    const cudaError_t setup = launch_moe_wna16_mma(p, fp16, static_cast<int>(bits), grid, stream);
    if (setup != cudaSuccess) return std::string("mma kernel setup failed: ") + cudaGetErrorString(setup);
  } else {
    launch_moe_wna16_gemv(p, fp16, static_cast<int>(bits), static_cast<int>(vec_bytes), grid, stream);
  }
  const cudaError_t launched = cudaGetLastError();
  return launched == cudaSuccess ? "" : std::string("kernel launch failed: ") + cudaGetErrorString(launched);
}

}  // namespace wna16_plus
