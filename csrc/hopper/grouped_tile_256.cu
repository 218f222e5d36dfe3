// The grouped GEMM with a 256-token tile, bf16 activations, symmetric int4 (grouped_gemm.cuh).
#include "grouped_gemm.cuh"

WNA16_HOPPER_INSTANTIATE(256, kBf16, false, 4)
