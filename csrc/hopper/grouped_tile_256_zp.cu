// The grouped GEMM with a 256-token tile, bf16 activations, int4 with zero points (grouped_gemm.cuh).
#include "grouped_gemm.cuh"

WNA16_HOPPER_INSTANTIATE(256, kBf16, true, 4)
