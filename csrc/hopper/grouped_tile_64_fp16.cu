// The grouped GEMM with a 64-token tile, fp16 activations (grouped_gemm.cuh).
#include "grouped_gemm.cuh"

WNA16_HOPPER_INSTANTIATE(64, kFp16)
