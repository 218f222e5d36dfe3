// One grouped int4 x bf16 (or fp16) GEMM launch over the routed experts, by token-tile width, activation type and
// zero points (grouped_gemm.cuh defines it, one translation unit per built triple: tile_is_built). No CUTLASS types here: the arrays are the
// device-side per-expert arrays moe_w4a16_grouped.cu writes (problem shapes, pointers, strides, layouts).
#pragma once

#include <cstddef>
#include <cuda_runtime.h>

namespace wna16_hopper {

// the token-tile widths built (the MMA's N side; the weights take 128 rows a tile)
constexpr int kTileWidths[] = {32, 64, 128, 256};

// the activations' type, which the scales (and zero tables) and the outputs share
enum class Act { kBf16, kFp16 };

// The (width, type, zero points) triples built, one translation unit each (grouped_tile_<N>[_fp16][_zp].cu): every
// width for symmetric bf16, the widths auto's rule runs (128 and 256: 64+ rows per hit expert, token_tile) for fp16
// and for zero points, which keeps the build at ten units. kernels/hopper_ops.py's BUILT_TILES says the same and a
// CPU test checks both against the files.
constexpr bool tile_is_built(int tile, Act act, bool zero_points) {
  return tile == 128 || tile == 256 || (act == Act::kBf16 && !zero_points && (tile == 32 || tile == 64));
}

struct GroupedArgs {
  int num_groups = 0;
  void* problems = nullptr;  // UnderlyingProblemShape[E]: (N, rows of expert e, K)
  const void** b = nullptr;  // expert e's signed, reordered int4 weights
  void* layout_b = nullptr;  // LayoutB_Reordered[E]
  const void** a = nullptr;  // expert e's first activation row
  void* stride_a = nullptr;  // StrideA[E]
  const void** s = nullptr;  // expert e's (G, N) scales
  void* stride_s = nullptr;  // StrideS[E] (the zero tables' too)
  const void** z = nullptr;  // expert e's (G, N) zero table, (8 - z) * s (zero-point builds only)
  int group_size = 0;        // K elements per scale (K itself: channel-wise)
  void** d = nullptr;        // expert e's first output row
  void* stride_d = nullptr;  // StrideD[E]
  void* stride_c = nullptr;  // StrideC[E] (C is unused: beta = 0)
  int device = 0;
  int sm_count = 0;
  void* workspace = nullptr;
  cudaStream_t stream = nullptr;
};

// bytes of workspace one launch needs; then the launch (nullptr, or why CUTLASS refused it)
template <int TileN, Act A, bool Z>
size_t grouped_workspace_bytes(const GroupedArgs& args);
template <int TileN, Act A, bool Z>
const char* run_grouped(const GroupedArgs& args);

}  // namespace wna16_hopper
