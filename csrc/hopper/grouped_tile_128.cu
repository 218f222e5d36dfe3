// The grouped GEMM with a 128-token tile (grouped_gemm.cuh): one translation unit per width, built in parallel.
#include "grouped_gemm.cuh"

namespace wna16_hopper {
template size_t grouped_workspace_bytes<128>(const GroupedArgs&);
template const char* run_grouped<128>(const GroupedArgs&);
}  // namespace wna16_hopper
