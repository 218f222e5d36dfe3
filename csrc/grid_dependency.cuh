// Programmatic dependent launch (Hopper and later): a kernel of the MoE layer may start while the
// kernel before it on the stream is still finishing.
//
// Why: at decode sizes a layer call is four short kernels (alignment, GEMM1, GEMM2, top-k sum), and each
// launch boundary costs the drain of one grid plus the launch and ramp of the next (about 5 us of
// Mixtral's 91 us layer call at M=1, H200, 2026-12-04-floor1 breakdown: graph time minus the kernels').
// Launched with the programmatic-stream-serialization attribute, a kernel's blocks are scheduled as soon
// as every block of the previous kernel has called start_next_grid() (or exited), and the launch work
// overlaps that kernel's tail.
//
// The contract of a kernel launched this way (launch_kernel with programmatic = true):
//   - wait_for_previous_grid() before it reads anything the previous kernel wrote and before it writes
//     any global memory (the previous kernel may still read a buffer the allocator handed on);
//   - it may read, before the wait, data that is constant during the layer (weights, scales) and data
//     written two or more kernels back: every kernel in between has waited for its own predecessor before
//     it could let its successor launch, so such data is complete and visible.
// Both device calls are no-ops where the launch was plain, and compile to nothing below sm90.
//
// Who calls start_next_grid() early: only the stream kernel (moe_wna16_stream.cu), right after its wait.
// The next kernel's blocks then take the slots that its blocks free, in the order they free them, and GEMM2
// (a stream grid of two blocks per SM, or the small top-k sum) streams its first weights during GEMM1's
// tail. The others let the next kernel launch as they exit: a grid of about one or two blocks per SM
// launched early is placed into whatever slots are free, two blocks on some SMs and none on others
// (H200, 2026-12-04-pdl1/pdl2: DeepSeek-V2-Lite's tiled GEMMs at M=1-2, 132-264 blocks, 4-5 us slower
// than plain launches while the alignment and the tiled kernel called it early).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace wna16_plus {

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void start_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the current device takes programmatic launches (compute capability 9.0 and later), cached.
inline bool programmatic_launch_supported() {
  constexpr int kMaxDevices = 64;
  static int known[kMaxDevices] = {};  // 0: not asked yet, 1: yes, 2: no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices && known[device] != 0) return known[device] == 1;
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (device < kMaxDevices) known[device] = major >= 9 ? 1 : 2;
  return major >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-stream-serialization attribute
// when `programmatic` and the device takes it. Returns the launch's error.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool programmatic, Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = programmatic && programmatic_launch_supported() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace wna16_plus
