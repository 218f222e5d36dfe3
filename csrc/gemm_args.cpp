// wna16_plus::moe_wna16_gemm's argument check (gemm_args.h). The op's contract is in moe_wna16_gemm.cu.

#include "gemm_args.h"

#include <algorithm>

#include "launch_rules.h"

namespace wna16_plus {

// Returns the reason from the enclosing function when cond is false.
#define WNA16_REQUIRE(cond, ...) \
  do {                           \
    if (!(cond)) return cat(__VA_ARGS__); \
  } while (0)

namespace {

// How a per-(row, group) table of an expert is laid out: (E, rows, G) contiguous (the checkpoint's order),
// or group-major, the (E, rows, G) view of a contiguous (E, G, rows) tensor: there the values of one
// group for consecutive rows are adjacent, which is what the mma kernel reads per step.
struct TableLayout {
  bool valid = false;
  int64_t stride_row = 0, stride_group = 0;
};

TableLayout table_layout(const at::Tensor& t) {
  const int64_t rows = t.size(1), groups = t.size(2);
  if (t.is_contiguous()) return {true, groups, 1};
  if (t.stride(0) == rows * groups && t.stride(1) == 1 && t.stride(2) == rows) return {true, 1, rows};
  return {};
}

}  // namespace

std::string gemm_args_error(const at::Tensor& a, const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& qzeros, const std::optional<at::Tensor>& topk_weights,
                            const at::Tensor& sorted_token_ids, const at::Tensor& expert_ids,
                            const at::Tensor& num_tokens_post_padded, const at::Tensor& c, int64_t bits,
                            int64_t top_k, int64_t block_size_m, int64_t block_size_n, int64_t block_size_k,
                            const std::string& kernel, const std::string& activation,
                            const std::optional<at::Tensor>& workspace, bool require_cuda, GemmShape* shape) {
  WNA16_REQUIRE(!require_cuda || a.is_cuda(), "a must be a CUDA tensor, got one on ", a.device());
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
  WNA16_REQUIRE(scales.dim() == 3 && scales.size(0) == E && scales.size(1) == N && scales.scalar_type() == a.scalar_type(),
                "scales must be an (E=", E, ", N=", N, ", G) tensor in a's dtype, got ", scales.sizes(), " ",
                scales.scalar_type());
  const int64_t G = scales.size(2);
  const TableLayout s_layout = table_layout(scales);
  WNA16_REQUIRE(s_layout.valid, "scales must be contiguous (E, N, G) or the (E, N, G) view of a contiguous (E, G, N) ",
                "tensor (group-major, see cuda_ops.group_major), got strides ", scales.strides());
  shape->s_stride_n = s_layout.stride_row;
  shape->s_stride_g = s_layout.stride_group;
  const std::string rule = launch_config_error(K, G, block_size_m, block_size_n, block_size_k, bits);
  WNA16_REQUIRE(rule.empty(), rule);
  WNA16_REQUIRE(a.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0,
                "a's rows must start on 16-byte boundaries (row stride ", a.stride(0), ")");
  const void* z = nullptr;
  if (qzeros.has_value()) {
    const auto& qz = *qzeros;
    WNA16_REQUIRE(qz.dim() == 3 && qz.size(0) == E && qz.size(1) == N * bits / 8 && qz.size(2) == G &&
                      qz.scalar_type() == at::kByte,
                  "qzeros must be an (E, N*bits/8, G) uint8 tensor, got ", qz.sizes());
    const TableLayout z_layout = table_layout(qz);
    WNA16_REQUIRE(z_layout.valid, "qzeros must be contiguous (E, N*bits/8, G) or the view of a contiguous ",
                  "(E, G, N*bits/8) tensor (group-major), got strides ", qz.strides());
    shape->z_stride_n = z_layout.stride_row;
    shape->z_stride_g = z_layout.stride_group;
    WNA16_REQUIRE(qz.device() == a.device(), "qzeros must be on ", a.device());
    z = qz.data_ptr();
  }
  WNA16_REQUIRE(activation == "none" || activation == "silu" || activation == "gelu",
                "activation must be none, silu or gelu, got ", activation);
  const bool gated = activation != "none";
  WNA16_REQUIRE(!gated || N % 2 == 0, "a gated activation needs gate and up rows (N even), got N=", N);
  const int64_t out_n = gated ? N / 2 : N;
  WNA16_REQUIRE(c.dim() == 2 && c.size(1) == out_n && c.is_contiguous() && c.scalar_type() == a.scalar_type(),
                "c must be a contiguous (num_pairs, ", out_n, ") tensor in a's dtype, got ", c.sizes());
  const int64_t num_pairs = c.size(0);
  WNA16_REQUIRE(top_k >= 1 && a.size(0) * top_k >= num_pairs, "a has ", a.size(0), " rows, too few for ",
                num_pairs, " pairs at top_k=", top_k);
  if (topk_weights.has_value()) {
    WNA16_REQUIRE(topk_weights->device() == a.device(), "topk_weights must be on ", a.device());
    WNA16_REQUIRE(topk_weights->scalar_type() == at::kFloat && topk_weights->is_contiguous() &&
                      topk_weights->numel() == num_pairs,
                  "topk_weights must be num_pairs=", num_pairs, " contiguous float32 values");
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
  WNA16_REQUIRE(expert_ids.numel() >= em / block_size_m, "the alignment does not match BLOCK_SIZE_M=",
                block_size_m, " (", em, " sorted ids, ", expert_ids.numel(), " expert ids)");
  const at::Tensor* same_device[] = {&qweight, &scales, &c, &sorted_token_ids, &expert_ids, &num_tokens_post_padded};
  for (const at::Tensor* t : same_device)
    WNA16_REQUIRE(t->device() == a.device(), "every tensor must be on ", a.device());
  shape->E = E, shape->N = N, shape->K = K, shape->G = G, shape->out_n = out_n, shape->num_pairs = num_pairs;
  shape->em = em, shape->gated = gated, shape->nothing_to_do = em < block_size_m || num_pairs == 0;
  if (shape->nothing_to_do) return "";

  WNA16_REQUIRE(kernel == "auto" || kernel == "mma" || kernel == "gemv" || kernel == "stream",
                "kernel must be auto, mma, stream or gemv, got ", kernel);
  const bool use_stream = kernel == "stream";
  const bool use_mma = kernel == "mma" || use_stream || (kernel == "auto" && mma_kernel_fits(K, G, bits));
  if (use_stream) {  // the persistent mma kernel: one 8-token column tile, and its float32 workspace
    WNA16_REQUIRE(block_size_m <= 8, "kernel=stream takes blocks of at most 8 pairs, got BLOCK_SIZE_M=", block_size_m);
    WNA16_REQUIRE(workspace.has_value(), "kernel=stream needs its workspace (cuda_ops.stream_workspace)");
    WNA16_REQUIRE(workspace->scalar_type() == at::kFloat && workspace->is_contiguous() &&
                      workspace->device() == a.device(),
                  "the stream workspace must be a contiguous float32 tensor on ", a.device(), ", got ",
                  workspace->scalar_type(), " on ", workspace->device());
    WNA16_REQUIRE(workspace->numel() >= 9 * kStreamSlotWords, "the stream workspace holds ", workspace->numel(),
                  " floats; one block of 8 warps needs ", 9 * kStreamSlotWords);
    shape->use_stream = true;
    shape->stream_slots = workspace->numel() / kStreamSlotWords;
  }
  WNA16_REQUIRE(!use_mma || mma_kernel_fits(K, G, bits), "the mma kernel needs 16-byte chunks of a weight row ",
                "inside one scale group, a power-of-two number of them per group; K=", K, ", G=", G, ", int", bits,
                " does not give them");
  WNA16_REQUIRE(!use_mma || N * K * bits / 8 <= (int64_t{1} << 32) - 1, "one expert's weights (N=", N, ", K=", K,
                ", int", bits, ") exceed the 4 GiB the mma kernel addresses with 32-bit row offsets");
  // the mma kernel copies the 4-byte words that hold a scale or zero point
  WNA16_REQUIRE(!use_mma || (reinterpret_cast<uintptr_t>(scales.data_ptr()) % 4 == 0 &&
                             reinterpret_cast<uintptr_t>(z) % 4 == 0),
                "scales and qzeros must start on 4-byte boundaries (views at odd offsets?)");
  WNA16_REQUIRE(!gated || use_mma, "activation=", activation, " is fused only in the mma kernel (K=", K, ", G=", G,
                ", int", bits, ", kernel=", kernel, "); run the GEMM and the activation apart");
  const int64_t vec_bytes = pick_vector_bytes(K, G, bits);
  WNA16_REQUIRE(reinterpret_cast<uintptr_t>(qweight.data_ptr()) % vec_bytes == 0, "qweight must start on a ",
                vec_bytes, "-byte boundary (it is a view at an odd offset?)");
  WNA16_REQUIRE((out_n + block_size_n - 1) / block_size_n <= 65535 && em / block_size_m <= 2147483647,
                "grid too large: N=", N, " with BLOCK_SIZE_N=", block_size_n);
  shape->vec_bytes = vec_bytes;
  shape->use_mma = use_mma;
  return "";
}

std::string align_args_error(const at::Tensor& topk_ids, int64_t block_size, int64_t num_experts,
                             const std::optional<at::Tensor>& expert_map, const at::Tensor& sorted_token_ids,
                             const at::Tensor& expert_ids, const at::Tensor& num_tokens_post_padded) {
  const at::Tensor* int32s[] = {&topk_ids, &sorted_token_ids, &expert_ids, &num_tokens_post_padded};
  for (const at::Tensor* t : int32s)
    WNA16_REQUIRE(t->scalar_type() == at::kInt && t->is_contiguous() && t->device() == topk_ids.device(),
                  "topk_ids, sorted_token_ids, expert_ids and num_tokens_post_padded must be contiguous int32 "
                  "tensors on one device, got ", t->scalar_type(), " on ", t->device());
  WNA16_REQUIRE(block_size >= 1 && block_size <= kMaxBlockM, "block_size=", block_size, " is outside [1, ",
                kMaxBlockM, "]");
  WNA16_REQUIRE(num_experts >= 1 && num_experts <= kMaxAlignExperts, "num_experts=", num_experts,
                " is outside [1, ", kMaxAlignExperts, "] (one block's shared memory)");
  const int64_t pairs = topk_ids.numel();
  WNA16_REQUIRE(pairs <= kMaxAlignPairs, "topk_ids has ", pairs, " pairs; the one-block alignment takes at most ",
                kMaxAlignPairs, " (vLLM's moe_align_block_size takes more)");
  if (expert_map.has_value())
    WNA16_REQUIRE(expert_map->scalar_type() == at::kInt && expert_map->is_contiguous() && expert_map->dim() == 1 &&
                      expert_map->numel() == num_experts && expert_map->device() == topk_ids.device(),
                  "expert_map must be a contiguous int32 (num_experts=", num_experts, ",) tensor on ",
                  topk_ids.device(), ", got ", expert_map->sizes(), " ", expert_map->scalar_type());
  // vLLM's bound on the padded list: every expert's last block may be padding, and no block holds fewer
  // than one pair
  const int64_t longest = std::min(pairs * block_size, pairs + num_experts * (block_size - 1));
  WNA16_REQUIRE(sorted_token_ids.numel() >= longest, "sorted_token_ids holds ", sorted_token_ids.numel(),
                " ids; ", pairs, " pairs over ", num_experts, " experts in blocks of ", block_size, " may need ", longest);
  WNA16_REQUIRE(expert_ids.numel() >= (sorted_token_ids.numel() + block_size - 1) / block_size &&
                    num_tokens_post_padded.numel() >= 1,
                "expert_ids must hold one id per block of sorted_token_ids (", (sorted_token_ids.numel() + block_size - 1) / block_size,
                "), num_tokens_post_padded one count");
  return "";
}

}  // namespace wna16_plus
