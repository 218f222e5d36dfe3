// A Hopper (sm90a) grouped int4 x bf16 GEMM for the routed experts, on CUTLASS's mixed-input grouped kernel
// (TMA loads, wgmma, one producer and two consumer warp groups, a persistent scheduler over every expert's
// tiles; CUTLASS 4.2 example 69's kernel, rewritten for the MoE layer). Issue 23's prototype: built by
// bench/hopper_probe.py (torch's JIT build, CUTLASS headers from the nvidia-cutlass wheel), not yet by setup.py.
//
//   route(topk_ids) -> for each expert e: count_e pairs at rows [off_e, off_e + count_e) of the sorted pairs;
//                      problem (N, count_e, K) per GEMM (the weights are the MMA's M side: "swap AB"),
//                      pointers to expert e's weights, scales and its rows of the activations and outputs
//   grouped_mm(...)  -> D[off_e + j, n] = sum_k A[off_e + j, k] * s_e[k / g, n] * q_e[n, k]
//
// The weights: the plugin's kernel layout (E, N, K/2) uint8, even k in the low nibble, unsigned with the
// midpoint 8 (symmetric), made signed (q - 8, CUTLASS's int4b_t: XOR 0x8 per nibble) and reordered once per
// expert so that a thread's values feed the wgmma fragment without shuffles (prepare_weights). The scales:
// (E, G, N), N contiguous (CUTLASS's StrideScale), the plugin's (E, N, G) transposed at prepare.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/mixed_dtype_utils.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace wna16_hopper {

using namespace cute;

using MmaType = cutlass::bfloat16_t;
using QuantType = cutlass::int4b_t;
using ElementScale = MmaType;
using ElementD = MmaType;
using ElementAccumulator = float;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using UnderlyingProblemShape = ProblemShape::UnderlyingProblemShape;

constexpr int kTileK = 128 * 8 / cutlass::sizeof_bits<MmaType>::value;  // 64 bf16: one 128-byte row
#ifndef WNA16_HOPPER_TILE_N
#define WNA16_HOPPER_TILE_N 64
#endif
// 128 weight rows x TILE_N token rows x 64 of K a tile
using TileShape = Shape<_128, Int<WNA16_HOPPER_TILE_N>, Int<kTileK>>;
using ClusterShape = Shape<_1, _1, _1>;

// the activations (M, K) row-major and the weights (N, K) "column-major" (K contiguous per row n): the
// kernel is given them swapped and transposed, so the weights are the MMA's A (M side)
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
using LayoutA_T = typename cutlass::layout::LayoutTranspose<LayoutA>::type;
using LayoutB_T = typename cutlass::layout::LayoutTranspose<LayoutB>::type;
using LayoutD_T = typename cutlass::layout::LayoutTranspose<LayoutD>::type;
constexpr int kAlignA = 128 / cutlass::sizeof_bits<MmaType>::value;
constexpr int kAlignB = 128 / cutlass::sizeof_bits<QuantType>::value;
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

using StrideA = cute::remove_pointer_t<cutlass::detail::TagToStrideA_t<LayoutA*>>;
using StrideB = cute::remove_pointer_t<cutlass::detail::TagToStrideB_t<LayoutB*>>;

// a thread's 8 int4 values contiguous in memory, in the order the bf16 conversion wants them
using ValueShuffle = Layout<Shape<_2, _4>, Stride<_4, _1>>;
using MmaAtomShape = Layout<Shape<_1, _1>>;
using LayoutAtomQuant = decltype(cutlass::compute_memory_reordering_atom<MmaType, MmaAtomShape, ValueShuffle>());
using LayoutB_Reordered = decltype(cute::tile_to_shape(LayoutAtomQuant{}, Layout<Shape<int, int, Int<1>>, StrideB>{}));

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
    void, LayoutD_T*, kAlignD, ElementD, LayoutD_T*, kAlignD,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    cute::tuple<QuantType, ElementScale>, LayoutB_Reordered*, kAlignB,
    MmaType, LayoutA_T*, kAlignA, ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideD = typename GemmKernel::InternalStrideD;
using StrideC = typename GemmKernel::InternalStrideC;
using StrideS = typename CollectiveMainloop::StrideScale;

// ------------------------------------------------------------------------------------------ preparation

// (E, N, K/2) uint8, unsigned with midpoint 8 -> signed nibbles, reordered per expert (a new tensor)
torch::Tensor prepare_weights(torch::Tensor qweight) {
  TORCH_CHECK(qweight.is_cuda() && qweight.scalar_type() == torch::kUInt8 && qweight.dim() == 3 &&
                  qweight.is_contiguous(),
              "qweight must be a contiguous (E, N, K/2) uint8 CUDA tensor");
  const c10::cuda::CUDAGuard guard(qweight.device());
  const int64_t E = qweight.size(0), N = qweight.size(1), K = qweight.size(2) * 2;
  TORCH_CHECK(N % 128 == 0 && K % kTileK == 0, "N must be a multiple of 128 and K of ", kTileK, " (N=", N,
              ", K=", K, ")");
  auto signed_q = torch::bitwise_xor(qweight, 0x88);  // q - 8 in each nibble, two's complement
  auto out = torch::empty_like(signed_q);
  auto shape_B = cute::make_shape(int(N), int(K), Int<1>{});
  auto stride_B = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(int(N), int(K), 1));
  auto layout_B = make_layout(shape_B, stride_B);
  auto layout_R = tile_to_shape(LayoutAtomQuant{}, shape_B);
  for (int64_t e = 0; e < E; ++e) {
    auto* src = reinterpret_cast<QuantType const*>(signed_q.data_ptr<uint8_t>() + e * N * K / 2);
    auto* dst = reinterpret_cast<QuantType*>(out.data_ptr<uint8_t>() + e * N * K / 2);
    cutlass::reorder_tensor(src, layout_B, dst, layout_R);  // synchronises: load time only
  }
  return out;
}

// ------------------------------------------------------------------------------------------ routing

struct GemmPointers {
  const QuantType** b;
  const MmaType** a;
  const ElementScale** s;
  ElementD** d;
  UnderlyingProblemShape* problem;
};

// One block: counts pairs per expert, their offsets, each pair's row in expert order (pair_row), the token
// of each row (row_token), and both GEMMs' problems and pointers. Routed ids outside [0, E) (another rank's
// experts under expert parallelism) are not supported here: the caller refuses them.
__global__ void route_kernel(const int32_t* __restrict__ topk_ids, int pairs, int top_k, int E, int N1, int K1,
                             int N2, int K2, int G1, int G2, int32_t* __restrict__ pair_row,
                             int32_t* __restrict__ row_token, const uint8_t* w13, const ElementScale* s13,
                             const uint8_t* w2, const ElementScale* s2, const MmaType* a1, ElementD* d1,
                             const MmaType* a2, ElementD* d2, GemmPointers g1, GemmPointers g2) {
  extern __shared__ int32_t smem[];
  int32_t* count = smem;       // E
  int32_t* offset = smem + E;  // E
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[topk_ids[p]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int e = 0; e < E; ++e) {
      offset[e] = run;
      run += count[e];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int64_t off = offset[e];
    g1.problem[e] = UnderlyingProblemShape{N1, count[e], K1};
    g1.b[e] = reinterpret_cast<const QuantType*>(w13 + int64_t(e) * N1 * K1 / 2);
    g1.s[e] = s13 + int64_t(e) * G1 * N1;
    g1.a[e] = a1 + off * K1;
    g1.d[e] = d1 + off * N1;
    g2.problem[e] = UnderlyingProblemShape{N2, count[e], K2};
    g2.b[e] = reinterpret_cast<const QuantType*>(w2 + int64_t(e) * N2 * K2 / 2);
    g2.s[e] = s2 + int64_t(e) * G2 * N2;
    g2.a[e] = a2 + off * K2;
    g2.d[e] = d2 + off * N2;
    count[e] = 0;  // reused as each expert's cursor below
  }
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = topk_ids[p];
    const int32_t row = offset[e] + atomicAdd(&count[e], 1);
    pair_row[p] = row;
    row_token[row] = p / top_k;
  }
}

// ------------------------------------------------------------------------------------------ one grouped GEMM

static void run_grouped(int E, UnderlyingProblemShape* problem, const QuantType** b, LayoutB_Reordered* layout_b,
                        const MmaType** a, StrideA* stride_a, const ElementScale** s, StrideS* stride_s,
                        int group_size, ElementD** d, StrideD* stride_d, StrideC* stride_c,
                        torch::Tensor& workspace_holder, const torch::Device& device, cudaStream_t stream) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device.index();
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
  fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
  args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {E, problem, nullptr},
                                  {b, layout_b, a, stride_a, s, stride_s, group_size},
                                  {fusion, nullptr, stride_c, d, stride_d},
                                  hw};
  Gemm gemm;
  const size_t ws = Gemm::get_workspace_size(args);
  workspace_holder = torch::empty({int64_t(ws) + 1}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  TORCH_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, "CUTLASS grouped GEMM cannot implement this problem");
  TORCH_CHECK(gemm.initialize(args, workspace_holder.data_ptr(), stream) == cutlass::Status::kSuccess,
              "CUTLASS grouped GEMM initialize failed");
  TORCH_CHECK(gemm.run(stream) == cutlass::Status::kSuccess, "CUTLASS grouped GEMM run failed");
}

// Per-layer constants: every expert's strides and reordered-weight layout (the same for all experts of a
// GEMM), both GEMMs' arrays one after the other in one byte buffer (layer_constants), each 256-byte aligned.
struct GemmConsts {
  StrideA* sa;
  StrideS* ss;
  StrideD* sd;
  StrideC* sc;
  LayoutB_Reordered* lb;
};

template <class T>
static T* carve(uint8_t*& cursor, int64_t n) {
  auto* p = reinterpret_cast<T*>(cursor);
  cursor += (n * int64_t(sizeof(T)) + 255) / 256 * 256;
  return p;
}

static GemmConsts carve_gemm(uint8_t*& cursor, int64_t E) {
  GemmConsts c;
  c.sa = carve<StrideA>(cursor, E);
  c.ss = carve<StrideS>(cursor, E);
  c.sd = carve<StrideD>(cursor, E);
  c.sc = carve<StrideC>(cursor, E);
  c.lb = carve<LayoutB_Reordered>(cursor, E);
  return c;
}

// The layer's constant per-expert arrays for GEMM1 (N1, K1, G1 groups) and GEMM2 (N2, K2, G2), on `device`.
torch::Tensor layer_constants(int64_t E, int64_t N1, int64_t K1, int64_t N2, int64_t K2, int64_t G1, int64_t G2,
                              torch::Device device) {
  const int64_t bytes = 2 * ((int64_t(sizeof(StrideA)) + sizeof(StrideS) + sizeof(StrideD) + sizeof(StrideC) +
                              sizeof(LayoutB_Reordered)) * E + 5 * 256);
  std::vector<uint8_t> host(bytes, 0);
  uint8_t* cursor = host.data();
  for (int gemm = 0; gemm < 2; ++gemm) {
    const int N = int(gemm ? N2 : N1), K = int(gemm ? K2 : K1), G = int(gemm ? G2 : G1);
    GemmConsts c = carve_gemm(cursor, E);
    for (int64_t e = 0; e < E; ++e) {
      c.sa[e] = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(1, K, 1));
      c.ss[e] = cutlass::make_cute_packed_stride(StrideS{}, cute::make_shape(N, G, 1));
      c.sd[e] = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(N, 1, 1));
      c.sc[e] = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(N, 1, 1));
      c.lb[e] = tile_to_shape(LayoutAtomQuant{}, cute::make_shape(N, K, Int<1>{}));
    }
  }
  TORCH_CHECK(cursor - host.data() <= bytes, "layer_constants: buffer too small");
  return torch::from_blob(host.data(), {bytes}, torch::kUInt8).clone().to(device);
}

// ------------------------------------------------------------------------------------------ the layer's GEMMs

// Routes the pairs and runs GEMM1 on the gathered activations: returns (h1 (pairs, N1) bf16, pair_row,
// scratch) where scratch keeps GEMM2's pointers for gemm2 below. x: (M, K1) bf16; topk_ids (M, top_k) int32;
// w13 prepared (prepare_weights), s13 (E, G1, N1) bf16; w2, s2 likewise for GEMM2 (N2 = hidden, K2 = I).
std::vector<torch::Tensor> moe_gemm1(torch::Tensor x, torch::Tensor topk_ids, torch::Tensor w13, torch::Tensor s13,
                                     torch::Tensor w2, torch::Tensor s2, torch::Tensor consts, int64_t group1,
                                     int64_t group2) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "x must be contiguous bf16");
  TORCH_CHECK(topk_ids.scalar_type() == torch::kInt32 && topk_ids.is_contiguous(), "topk_ids must be contiguous int32");
  const int64_t M = x.size(0), K1 = x.size(1), top_k = topk_ids.size(1), pairs = M * top_k;
  const int64_t E = w13.size(0), N1 = w13.size(1), N2 = w2.size(1), K2 = w2.size(2) * 2;
  const int64_t G1 = s13.size(1), G2 = s2.size(1);
  auto opts = x.options();
  auto i32 = opts.dtype(torch::kInt32);
  auto pair_row = torch::empty({pairs}, i32);
  auto row_token = torch::empty({pairs}, i32);
  auto a1 = torch::empty({pairs, K1}, opts);
  auto d1 = torch::empty({pairs, N1}, opts);
  // GEMM2's input (the activation's output) and output rows: allocated here so the pointers are known
  auto a2 = torch::empty({pairs, K2}, opts);
  auto d2 = torch::empty({pairs, N2}, opts);
  // pointer and problem arrays of both GEMMs: 5 pointers + a 3-int problem per expert each
  auto ptrs = torch::empty({2, 5, E}, opts.dtype(torch::kInt64));
  auto problems = torch::empty({2, E, 3}, i32);
  auto p64 = reinterpret_cast<int64_t*>(ptrs.data_ptr<int64_t>());
  auto pr = reinterpret_cast<UnderlyingProblemShape*>(problems.data_ptr<int32_t>());
  GemmPointers g[2];
  for (int i = 0; i < 2; ++i) {
    g[i].b = reinterpret_cast<const QuantType**>(p64 + (i * 5 + 0) * E);
    g[i].a = reinterpret_cast<const MmaType**>(p64 + (i * 5 + 1) * E);
    g[i].s = reinterpret_cast<const ElementScale**>(p64 + (i * 5 + 2) * E);
    g[i].d = reinterpret_cast<ElementD**>(p64 + (i * 5 + 3) * E);
    g[i].problem = pr + i * E;
  }
  const int threads = 1024;
  route_kernel<<<1, threads, 2 * E * sizeof(int32_t), stream>>>(
      topk_ids.data_ptr<int32_t>(), int(pairs), int(top_k), int(E), int(N1), int(K1), int(N2), int(K2), int(G1),
      int(G2), pair_row.data_ptr<int32_t>(), row_token.data_ptr<int32_t>(), w13.data_ptr<uint8_t>(),
      reinterpret_cast<const ElementScale*>(s13.data_ptr()), w2.data_ptr<uint8_t>(),
      reinterpret_cast<const ElementScale*>(s2.data_ptr()), reinterpret_cast<const MmaType*>(a1.data_ptr()),
      reinterpret_cast<ElementD*>(d1.data_ptr()), reinterpret_cast<const MmaType*>(a2.data_ptr()),
      reinterpret_cast<ElementD*>(d2.data_ptr()), g[0], g[1]);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::index_select_out(a1, x, 0, row_token);
  uint8_t* cursor = consts.data_ptr<uint8_t>();
  GemmConsts c = carve_gemm(cursor, E);
  torch::Tensor ws;
  run_grouped(int(E), g[0].problem, g[0].b, c.lb, g[0].a, c.sa, g[0].s, c.ss, int(group1), g[0].d, c.sd, c.sc, ws,
              x.device(), stream);
  return {d1, pair_row, a2, d2, ptrs, problems};
}

// GEMM2 on a2 (the activation's output, written by the caller into moe_gemm1's a2) into d2, through the
// pointers and problems moe_gemm1 wrote.
void moe_gemm2(torch::Tensor ptrs, torch::Tensor problems, torch::Tensor consts, int64_t E, int64_t group2) {
  const c10::cuda::CUDAGuard guard(ptrs.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  auto p64 = ptrs.data_ptr<int64_t>() + 5 * E;  // GEMM2's five arrays
  auto pr = reinterpret_cast<UnderlyingProblemShape*>(problems.data_ptr<int32_t>()) + E;
  uint8_t* cursor = consts.data_ptr<uint8_t>();
  carve_gemm(cursor, E);  // GEMM1's
  GemmConsts c = carve_gemm(cursor, E);
  torch::Tensor ws;
  run_grouped(int(E), pr, reinterpret_cast<const QuantType**>(p64), c.lb, reinterpret_cast<const MmaType**>(p64 + E),
              c.sa, reinterpret_cast<const ElementScale**>(p64 + 2 * E), c.ss, int(group2),
              reinterpret_cast<ElementD**>(p64 + 3 * E), c.sd, c.sc, ws, ptrs.device(), stream);
}

}  // namespace wna16_hopper

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prepare_weights", &wna16_hopper::prepare_weights, "signed, reordered int4 weights (E, N, K/2)");
  m.def("layer_constants", &wna16_hopper::layer_constants, "per-expert strides and layouts of both GEMMs");
  m.def("moe_gemm1", &wna16_hopper::moe_gemm1, "route + gather + grouped GEMM1");
  m.def("moe_gemm2", &wna16_hopper::moe_gemm2, "grouped GEMM2");
}
