// The argument check of wna16_plus::moe_wna16_gemm, host code only: the CUDA op runs it before any
// launch, and the catch-all op wna16_plus::check_gemm_args runs it on any tensors (CPU included), so
// CI exercises every refusal without a GPU.
//
// Messages are built with std::to_string and string concatenation, never std::ostream: on the GPU
// machine's image (2026-12-03) an extension's own std::ostream number formatting crashed the process
// (bench/probe_abi.py), and a refusal must always reach Python as text.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

namespace wna16_plus {

// What the launcher needs once the arguments are accepted.
struct GemmShape {
  int64_t E = 0, N = 0, K = 0, G = 0, out_n = 0, num_pairs = 0, em = 0, vec_bytes = 0;
  // element strides of a row and of a group in scales and qzeros (see TableLayout in gemm_args.cpp)
  int64_t s_stride_n = 0, s_stride_g = 1, z_stride_n = 0, z_stride_g = 1;
  bool use_mma = false, gated = false;
  bool use_stream = false;  // kernel "stream": the persistent form of the mma kernel (moe_wna16_stream.cu)
  int64_t stream_slots = 0;  // the split-unit slots its workspace holds
  bool nothing_to_do = false;  // no whole block of sorted ids, or no pairs: accepted, nothing launched
};

// "" when the GEMM may launch (and *shape filled), else the reason. require_cuda: a must be a CUDA
// tensor (the op); the check op passes false so that CPU tensors run every other check.
std::string gemm_args_error(const at::Tensor& a, const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& qzeros, const std::optional<at::Tensor>& topk_weights,
                            const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                            const at::Tensor& num_tokens_post_padded, const at::Tensor& c, int64_t bits,
                            int64_t top_k, int64_t block_size_m, int64_t block_size_n, int64_t block_size_k,
                            const std::string& kernel, const std::string& activation,
                            const std::optional<at::Tensor>& workspace, bool require_cuda, GemmShape* shape);

// "" when wna16_plus::moe_align_block_size may launch (moe_align.cu), else the reason.
std::string align_args_error(const at::Tensor& topk_ids, int64_t block_size, int64_t num_experts,
                             const std::optional<at::Tensor>& expert_map, const at::Tensor& sorted_token_ids,
                             const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded);

// Message pieces without std::ostream.
inline std::string piece(const char* s) { return s; }
inline std::string piece(const std::string& s) { return s; }
template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
inline std::string piece(I v) { return std::to_string(v); }
inline std::string piece(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
inline std::string piece(c10::ScalarType t) { return c10::toString(t); }
inline std::string piece(const c10::Device& d) { return d.str(); }  // formatted inside libc10

template <class... Parts>
std::string cat(const Parts&... parts) {
  std::string s;
  ((s += piece(parts)), ...);
  return s;
}

}  // namespace wna16_plus
