// Registers the plugin's CUDA ops under torch.ops.wna16_plus and makes the library importable as
// vllm_wna16_plugin._C (importing it runs the registration).
#include <Python.h>
#include <torch/all.h>
#include <torch/library.h>

#include <optional>

#include "gemm_args.h"
#include "launch_rules.h"

namespace wna16_plus {
std::string moe_wna16_gemm(const at::Tensor& a, const at::Tensor& qweight, const at::Tensor& scales,
                    const std::optional<at::Tensor>& qzeros, const std::optional<at::Tensor>& topk_weights,
                    const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                    const at::Tensor& num_tokens_post_padded, at::Tensor& c, int64_t bits, int64_t top_k,
                    int64_t block_size_m, int64_t block_size_n, int64_t block_size_k, const std::string& kernel,
                    const std::string& activation, const std::optional<at::Tensor>& workspace,
                    bool programmatic, bool weights_before_wait);

std::string moe_align_block_size(const at::Tensor& topk_ids, int64_t block_size, int64_t num_experts,
                                 const std::optional<at::Tensor>& expert_map, at::Tensor& sorted_token_ids,
                                 at::Tensor& expert_ids, at::Tensor& num_tokens_post_padded, bool programmatic);

// The alignment's argument check on tensors of any device (CPU in CI).
std::string check_align_args(const at::Tensor& topk_ids, int64_t block_size, int64_t num_experts,
                             const std::optional<at::Tensor>& expert_map, const at::Tensor& sorted_token_ids,
                             const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded) {
  return align_args_error(topk_ids, block_size, num_experts, expert_map, sorted_token_ids, expert_ids,
                          num_tokens_post_padded);
}

std::string check_launch_config(int64_t size_k, int64_t num_groups, int64_t block_size_m, int64_t block_size_n,
                                int64_t block_size_k, int64_t bits) {
  return launch_config_error(size_k, num_groups, block_size_m, block_size_n, block_size_k, bits);
}

// The op's argument check on tensors of any device (CPU in CI): "" when moe_wna16_gemm would launch.
std::string check_gemm_args(const at::Tensor& a, const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& qzeros, const std::optional<at::Tensor>& topk_weights,
                            const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                            const at::Tensor& num_tokens_post_padded, const at::Tensor& c, int64_t bits,
                            int64_t top_k, int64_t block_size_m, int64_t block_size_n, int64_t block_size_k,
                            const std::string& kernel, const std::string& activation,
                            const std::optional<at::Tensor>& workspace) {
  GemmShape shape;
  return gemm_args_error(a, qweight, scales, qzeros, topk_weights, sorted_token_ids, expert_ids,
                         num_tokens_post_padded, c, bits, top_k, block_size_m, block_size_n, block_size_k, kernel,
                         activation, workspace, false, &shape);
}

bool check_mma_kernel_fits(int64_t size_k, int64_t num_groups, int64_t bits) {
  return mma_kernel_fits(size_k, num_groups, bits);
}
}  // namespace wna16_plus

TORCH_LIBRARY(wna16_plus, m) {
  m.def(
      "moe_wna16_gemm(Tensor a, Tensor qweight, Tensor scales, Tensor? qzeros, Tensor? topk_weights, "
      "Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, Tensor(c!) c, int bits, "
      "int top_k, int block_size_m, int block_size_n, int block_size_k, str kernel=\"auto\", str activation=\"none\", "
      "Tensor(w!)? workspace=None, bool programmatic=False, bool weights_before_wait=False) -> str");
  // no tensors: a catch-all kernel, callable on any machine (the CPU test enumerates configs with it)
  m.def("check_launch_config(int size_k, int num_groups, int block_size_m, int block_size_n, int block_size_k, "
        "int bits) -> str",
        &wna16_plus::check_launch_config);
  m.def(
      "check_gemm_args(Tensor a, Tensor qweight, Tensor scales, Tensor? qzeros, Tensor? topk_weights, "
      "Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, Tensor c, int bits, "
      "int top_k, int block_size_m, int block_size_n, int block_size_k, str kernel=\"auto\", str activation=\"none\", "
      "Tensor? workspace=None) -> str",
      &wna16_plus::check_gemm_args);
  m.def("mma_kernel_fits(int size_k, int num_groups, int bits) -> bool", &wna16_plus::check_mma_kernel_fits);
  m.def(
      "moe_align_block_size(Tensor topk_ids, int block_size, int num_experts, Tensor? expert_map, "
      "Tensor(a!) sorted_token_ids, Tensor(b!) expert_ids, Tensor(c!) num_tokens_post_padded, "
      "bool programmatic=False) -> str");
  m.def(
      "check_align_args(Tensor topk_ids, int block_size, int num_experts, Tensor? expert_map, Tensor sorted_token_ids, "
      "Tensor expert_ids, Tensor num_tokens_post_padded) -> str",
      &wna16_plus::check_align_args);
}

TORCH_LIBRARY_IMPL(wna16_plus, CUDA, m) {
  m.impl("moe_wna16_gemm", &wna16_plus::moe_wna16_gemm);
  m.impl("moe_align_block_size", &wna16_plus::moe_align_block_size);
}

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "vllm-wna16-plugin CUDA ops (torch.ops.wna16_plus)",
                                      -1, nullptr};
  return PyModule_Create(&module);
}
