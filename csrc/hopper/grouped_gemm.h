// One grouped int4 (or int8) x bf16 (or fp16) GEMM launch over the routed experts, by token-tile width, activation
// type, zero points and weight bits (grouped_gemm.cuh defines it, one translation unit per build: tile_is_built).
// No CUTLASS types here: the arrays are the device-side per-expert arrays moe_w4a16_grouped.cu writes (problem
// shapes, pointers, strides, layouts).
#pragma once

#include <cstddef>
#include <cuda_runtime.h>

namespace wna16_hopper {

// the token-tile widths built (the MMA's N side; the weights take 128 rows a tile)
constexpr int kTileWidths[] = {32, 64, 128, 256};

// the activations' type, which the scales (and zero tables) and the outputs share
enum class Act { kBf16, kFp16 };

// The (width, type, zero points, weight bits) builds, one translation unit each (grouped_tile_<N>[_fp16][_int8].cu):
// every width for symmetric int4 bf16, the widths auto's rule runs (128 and 256: 64+ rows per hit expert,
// token_tile) for fp16 and for int8, ten units. No zero-point build: CUTLASS 4.2's grouped mixed-input mainloop in
// its scale-and-zero mode sets up, updates and fences only the zero table's TMA descriptor, never the scales' one,
// whose loads then fault (an illegal instruction on the H100, 2026-12-06); kernels/hopper_ops.py gives an int4
// zero-point layer to the int8 builds as q - z instead. hopper_ops.BUILT_TILES says the same and a CPU test checks
// both against the files.
constexpr bool tile_is_built(int tile, Act act, bool zero_points, int bits = 4) {
  if (zero_points) return false;
  if (bits == 8) return tile == 128 || tile == 256;
  return bits == 4 && (tile == 128 || tile == 256 || (act == Act::kBf16 && (tile == 32 || tile == 64)));
}

struct GroupedArgs {
  int num_groups = 0;
  void* problems = nullptr;  // UnderlyingProblemShape[E]: (N, rows of expert e, K)
  const void** b = nullptr;  // expert e's signed, reordered int4 (int8) weights
  void* layout_b = nullptr;  // LayoutB_Reordered[E]
  const void** a = nullptr;  // expert e's first activation row
  void* stride_a = nullptr;  // StrideA[E]
  const void** s = nullptr;  // expert e's (G, N) scales
  void* stride_s = nullptr;  // StrideS[E] (the zero tables' too)
  const void** z = nullptr;  // expert e's (G, N) zero table (a zero-point build: none is built, tile_is_built)
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
template <int TileN, Act A, bool Z, int Bits>
size_t grouped_workspace_bytes(const GroupedArgs& args);
template <int TileN, Act A, bool Z, int Bits>
const char* run_grouped(const GroupedArgs& args);

}  // namespace wna16_hopper
