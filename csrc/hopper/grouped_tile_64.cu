// The grouped GEMM with a 64-token tile, bf16 activations, symmetric (grouped_gemm.cuh).
#include "grouped_gemm.cuh"

WNA16_HOPPER_INSTANTIATE(64, kBf16, false)
