// The launch rules of the plugin's CUDA WNA16 MoE GEMM, in one place: the host launcher checks
// every launch against them, and the `wna16_plus::check_launch_config` op exposes them to Python so
// a CPU test can enumerate every config vllm_wna16_plugin.block_config can produce.
#pragma once

#include <cstdint>
#include <string>

namespace wna16_plus {

constexpr int64_t kMaxBlockM = 64;  // sorted pair ids of one block live in shared memory

// The stream kernel's workspace per warp: two float32 partial sums of a unit (2 row tiles x 32 lanes x 4
// each), and one int32 arrival counter. A launch uses at most numel / kStreamSlotWords - 1 warps.
constexpr int64_t kStreamSlotSums = 2 * 256;
constexpr int64_t kStreamSlotWords = kStreamSlotSums + 1;

// The one-block token alignment (moe_align.cu): its shared memory holds 2 counts per expert; it is for
// decode batches (vLLM's takes larger ones).
constexpr int64_t kMaxAlignExperts = 4096;
constexpr int64_t kMaxAlignPairs = 1 << 16;

// Bytes per B vector load: the widest of 16/8/4 that divides a weight row and keeps each
// vector inside one scale group (so one scale/zero serves the whole vector). 0 = none fits.
inline int64_t pick_vector_bytes(int64_t size_k, int64_t num_groups, int64_t bits) {
  const int64_t row_bytes = size_k * bits / 8;
  const int64_t group_size = num_groups > 0 ? size_k / num_groups : 0;
  for (int64_t vec : {16, 8, 4}) {
    const int64_t vals = vec * 8 / bits;
    if (row_bytes % vec == 0 && (num_groups == 1 || group_size % vals == 0)) return vec;
  }
  return 0;
}

// "" when the kernel accepts the launch, else the reason. BLOCK_SIZE_K is the K step of the
// config module (vLLM's moe_wna16_gemm rules): the kernel streams whole rows, but a config
// the module could never produce is refused, so the two cannot drift apart.
inline std::string launch_config_error(int64_t size_k, int64_t num_groups, int64_t block_size_m,
                                       int64_t block_size_n, int64_t block_size_k, int64_t bits) {
  auto str = [](int64_t v) { return std::to_string(v); };
  if (bits != 4 && bits != 8) return "bits=" + str(bits) + " is not supported (4 or 8)";
  if (size_k <= 0 || num_groups <= 0 || size_k % num_groups != 0)
    return "K=" + str(size_k) + " is not a whole number of " + str(num_groups) + " scale groups";
  if (size_k % 8 != 0) return "K=" + str(size_k) + " is not a multiple of 8 (vector loads of A)";
  if (block_size_m < 1 || block_size_m > kMaxBlockM)
    return "BLOCK_SIZE_M=" + str(block_size_m) + " is outside [1, " + str(kMaxBlockM) + "]";
  if (block_size_n < 1) return "BLOCK_SIZE_N=" + str(block_size_n) + " must be positive";
  if (block_size_k < 1 || size_k % block_size_k != 0)
    return "BLOCK_SIZE_K=" + str(block_size_k) + " does not divide K=" + str(size_k);
  const int64_t group_size = size_k / num_groups;
  if (num_groups > 1) {  // grouped: the module's BLOCK_SIZE_K is 1, 2, 4 or 8 groups
    const int64_t ratio = block_size_k / group_size;
    if (block_size_k % group_size != 0 || !(ratio == 1 || ratio == 2 || ratio == 4 || ratio == 8))
      return "BLOCK_SIZE_K=" + str(block_size_k) + " with group_size=" + str(group_size) +
             ": BLOCK_SIZE_K // group_size must be one of [1, 2, 4, 8]";
  }  // channel-wise: any BLOCK_SIZE_K that divides K (the module presents K as one group, or as 32/64/128)
  if (pick_vector_bytes(size_k, num_groups, bits) == 0)
    return "no vector width fits K=" + str(size_k) + ", group_size=" + str(group_size) + ", int" + str(bits);
  return "";
}

// The tensor-core kernel (moe_wna16_mma.cu) reads each weight row in whole 16-byte chunks that never
// straddle a scale group, and finds a chunk's group with a shift: a group is a power-of-two number of
// chunks (groups of 32/64/128 values) or the whole row (channel-wise). Other legal shapes run on the
// CUDA-core kernel (moe_wna16_gemv.cu).
inline bool mma_kernel_fits(int64_t size_k, int64_t num_groups, int64_t bits) {
  if (pick_vector_bytes(size_k, num_groups, bits) != 16) return false;
  const int64_t chunks_per_group = size_k * bits / 128 / num_groups;
  return num_groups == 1 || (chunks_per_group & (chunks_per_group - 1)) == 0;
}

}  // namespace wna16_plus
