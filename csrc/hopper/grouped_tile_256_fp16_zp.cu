// The grouped GEMM with a 256-token tile, fp16 activations, int4 with zero points (grouped_gemm.cuh).
#include "grouped_gemm.cuh"

WNA16_HOPPER_INSTANTIATE(256, kFp16, true, 4)
