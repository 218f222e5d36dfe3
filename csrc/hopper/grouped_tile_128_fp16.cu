// The grouped GEMM with a 128-token tile, fp16 activations, symmetric int4 (grouped_gemm.cuh).
#include "grouped_gemm.cuh"

WNA16_HOPPER_INSTANTIATE(128, kFp16, false, 4)
