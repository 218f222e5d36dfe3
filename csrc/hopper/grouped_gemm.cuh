// CUTLASS's Hopper mixed-input grouped GEMM (TMA loads, wgmma, one producer and two consumer warp groups, a
// persistent scheduler over every expert's tiles: CUTLASS 4.2 example 69's kernel, in our own setting) for
// the routed experts, by token-tile width, activation type, zero points and weight bits:
//
//   D_e[j, n] = sum_k A_e[j, k] * s_e[k / g, n] * q_e[n, k]     for the rows j of expert e
//
// q_e: expert e's (N, K) weights as signed int4 or int8 (CUTLASS's int4b_t, int8_t: Weights<Bits>), reordered so
// that a thread's values feed the wgmma fragment without shuffles; s_e: (G, N) scales, N contiguous; A_e: (rows, K), row major; D_e:
// (rows, N): bf16 or fp16, one type per build (Act). The weights are the MMA's M side ("swap AB": 128 weight rows a tile), the tokens
// its N side (TileN a tile), so an expert with few rows fills its tiles with a narrow TileN.
#pragma once

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
#include "grouped_gemm.h"

namespace wna16_hopper {

using namespace cute;

// the activations', scales' and outputs' type of a build (Act); bf16 is the layout's reference type below
template <Act A>
struct ActType;
template <>
struct ActType<Act::kBf16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct ActType<Act::kFp16> {
  using type = cutlass::half_t;
};
using MmaType = cutlass::bfloat16_t;  // the shapes, alignments and the weights' reorder (the same for fp16)
using ElementAccumulator = float;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using UnderlyingProblemShape = ProblemShape::UnderlyingProblemShape;

constexpr int kTileK = 128 * 8 / cutlass::sizeof_bits<MmaType>::value;  // 64 bf16: one 128-byte row
using ClusterShape = Shape<_1, _1, _1>;

// the activations (rows, K) row-major, the weights (N, K) with K contiguous ("column-major" B): the kernel
// takes them swapped and transposed
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
using LayoutA_T = typename cutlass::layout::LayoutTranspose<LayoutA>::type;
using LayoutD_T = typename cutlass::layout::LayoutTranspose<LayoutD>::type;
constexpr int kAlignA = 128 / cutlass::sizeof_bits<MmaType>::value;
constexpr int kAlignD = 128 / cutlass::sizeof_bits<MmaType>::value;

using StrideA = cute::remove_pointer_t<cutlass::detail::TagToStrideA_t<LayoutA*>>;
using StrideB = cute::remove_pointer_t<cutlass::detail::TagToStrideB_t<LayoutB*>>;

// The weights of a build: their signed type, and the order of a thread's values in memory: contiguous, in the order
// CUTLASS's fast conversion to 16 bits takes them (mixed_input_utils.hpp's LayoutAwareConvertImpl: [0,2,4,6,1,3,5,7]
// for int4, [0,2,1,3] for int8)
template <int Bits>
struct Weights;
template <>
struct Weights<4> {
  using Quant = cutlass::int4b_t;
  using ValueShuffle = Layout<Shape<_2, _4>, Stride<_4, _1>>;
};
template <>
struct Weights<8> {
  using Quant = cutlass::int8_t;
  using ValueShuffle = Layout<Shape<_2, _2>, Stride<_2, _1>>;
};
template <int Bits>
using QuantType = typename Weights<Bits>::Quant;
using MmaAtomShape = Layout<Shape<_1, _1>>;
template <int Bits, class Mma = MmaType>
using LayoutAtomQuant =
    decltype(cutlass::compute_memory_reordering_atom<Mma, MmaAtomShape, typename Weights<Bits>::ValueShuffle>());
// CUTLASS's reorder_tensor (mixed_dtype_utils.hpp) copies each 16-row block of an expert with 128 threads along K,
// without a bound (a thread's one byte holds one int8 value, or two int4 values along N: the reordered layout's stride-1
// mode is N's): where K is not a multiple of that copy's width, kReorderK = 128 values for int4 and int8 alike, it
// writes past the expert, N * 64 * Bits / 8 bytes (a K tile a row) on every case run on the host
// (tests/kernels/hopper_reorder_host.cu, 2026-12-07; the last expert's land on whatever follows the copy). The values
// it places are right, and LayoutAtomQuant's offsets of k < K are the same for K and for K rounded up to kReorderK
// (reorder_k: its K tiles are ordered after all of N's, 16 * N values apart): prepare_weights reorders each expert
// padded to reorder_k(K) and keeps its first N * K * Bits / 8 bytes.
constexpr int64_t kReorderK = 128;

constexpr int64_t reorder_k(int64_t K) { return (K + kReorderK - 1) / kReorderK * kReorderK; }

template <int Bits>
using LayoutB_Reordered =
    decltype(cute::tile_to_shape(LayoutAtomQuant<Bits>{}, Layout<Shape<int, int, Int<1>>, StrideB>{}));
// one prepared copy of the weights serves both activation types: their wgmma fragments take the same reorder
static_assert(std::is_same_v<LayoutAtomQuant<4>, LayoutAtomQuant<4, cutlass::half_t>> &&
                  std::is_same_v<LayoutAtomQuant<8>, LayoutAtomQuant<8, cutlass::half_t>>,
              "fp16 and bf16 must share the weights' reorder");

template <int TileN, Act A, bool Z, int Bits>
struct GroupedKernel {
  static_assert(tile_is_built(TileN, A, Z, Bits), "a (width, type, zero points, bits) build outside tile_is_built");
  using Element = typename ActType<A>::type;  // activations, scales, zero tables and outputs
  using ElementScale = Element;
  using ElementD = Element;
  using Quant = QuantType<Bits>;
  using LayoutB = LayoutB_Reordered<Bits>;
  static constexpr int kAlignB = 128 / cutlass::sizeof_bits<Quant>::value;
  // the weights' operand: int4 / int8 with scales, and with zero tables where Z (CUTLASS's ConvertAndScaleWithZero:
  // w = s * q + z, per group)
  using QuantOperand = cute::conditional_t<Z, cute::tuple<Quant, ElementScale, Element>, cute::tuple<Quant, ElementScale>>;
  using TileShape = Shape<_128, Int<TileN>, Int<kTileK>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator, void, LayoutD_T*,
      kAlignD, ElementD, LayoutD_T*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, QuantOperand, LayoutB*,
      kAlignB, Element, LayoutA_T*, kAlignA, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideD = typename Kernel::InternalStrideD;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideS = typename CollectiveMainloop::StrideScale;

  static typename Gemm::Arguments arguments(const GroupedArgs& g) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = g.device;
    hw.sm_count = g.sm_count;
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
    // the mainloop's operands swapped: its A is the weights (b), its B the activations (a); the zero tables share
    // the scales' strides
    typename CollectiveMainloop::Arguments mainloop{
        reinterpret_cast<const Quant**>(g.b), static_cast<LayoutB*>(g.layout_b),
        reinterpret_cast<const Element**>(g.a),   static_cast<StrideA*>(g.stride_a),
        reinterpret_cast<const ElementScale**>(g.s), static_cast<StrideS*>(g.stride_s), g.group_size};
    if constexpr (Z) mainloop.ptr_Z = reinterpret_cast<const Element**>(g.z);
    return typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {g.num_groups, static_cast<UnderlyingProblemShape*>(g.problems), nullptr},
        mainloop,
        {fusion, nullptr, static_cast<StrideC*>(g.stride_c), reinterpret_cast<ElementD**>(g.d),
         static_cast<StrideD*>(g.stride_d)},
        hw};
  }
};

// every build shares the per-expert arrays moe_w4a16_grouped.cu writes once per layer (the weights' layouts differ
// by bits: LayoutB_Reordered<Bits>)
using StrideS = typename GroupedKernel<64, Act::kBf16, false, 4>::StrideS;
using StrideD = typename GroupedKernel<64, Act::kBf16, false, 4>::StrideD;
using StrideC = typename GroupedKernel<64, Act::kBf16, false, 4>::StrideC;

template <int TileN, Act A, bool Z, int Bits>
size_t grouped_workspace_bytes(const GroupedArgs& g) {
  using K = GroupedKernel<TileN, A, Z, Bits>;
  return K::Gemm::get_workspace_size(K::arguments(g));
}

template <int TileN, Act A, bool Z, int Bits>
const char* run_grouped(const GroupedArgs& g) {
  using K = GroupedKernel<TileN, A, Z, Bits>;
  static_assert(std::is_same_v<typename K::StrideS, StrideS> && std::is_same_v<typename K::StrideD, StrideD> &&
                    std::is_same_v<typename K::StrideC, StrideC>,
                "every build must take the layer's one set of strides");
  auto args = K::arguments(g);
  typename K::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS cannot implement this grouped GEMM";
  if (gemm.initialize(args, g.workspace, g.stream) != cutlass::Status::kSuccess) return "CUTLASS initialize failed";
  if (gemm.run(g.stream) != cutlass::Status::kSuccess) return "CUTLASS run failed";
  return nullptr;
}

}  // namespace wna16_hopper

// One build's instantiation (tile_is_built): the body of each grouped_tile_<N>[_fp16][_int8].cu, built in
// parallel
#define WNA16_HOPPER_INSTANTIATE(TILE, ACT, ZERO, BITS)                                    \
  namespace wna16_hopper {                                                                 \
  template size_t grouped_workspace_bytes<TILE, Act::ACT, ZERO, BITS>(const GroupedArgs&); \
  template const char* run_grouped<TILE, Act::ACT, ZERO, BITS>(const GroupedArgs&);        \
  }
