// CUTLASS's Hopper mixed-input grouped GEMM (TMA loads, wgmma, one producer and two consumer warp groups, a
// persistent scheduler over every expert's tiles: CUTLASS 4.2 example 69's kernel, in our own setting) for
// the routed experts, by token-tile width:
//
//   D_e[j, n] = sum_k A_e[j, k] * s_e[k / g, n] * q_e[n, k]     for the rows j of expert e
//
// q_e: expert e's (N, K) weights as signed int4 (CUTLASS's int4b_t), reordered so that a thread's 8 values
// feed the wgmma fragment without shuffles; s_e: (G, N) bf16 scales, N contiguous; A_e: (rows, K) bf16, row
// major; D_e: (rows, N) bf16. The weights are the MMA's M side ("swap AB": 128 weight rows a tile), the tokens
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

using MmaType = cutlass::bfloat16_t;
using QuantType = cutlass::int4b_t;
using ElementScale = MmaType;
using ElementD = MmaType;
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
constexpr int kAlignB = 128 / cutlass::sizeof_bits<QuantType>::value;
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

using StrideA = cute::remove_pointer_t<cutlass::detail::TagToStrideA_t<LayoutA*>>;
using StrideB = cute::remove_pointer_t<cutlass::detail::TagToStrideB_t<LayoutB*>>;

// a thread's 8 int4 values contiguous in memory, in the order the bf16 conversion wants them
using ValueShuffle = Layout<Shape<_2, _4>, Stride<_4, _1>>;
using MmaAtomShape = Layout<Shape<_1, _1>>;
using LayoutAtomQuant = decltype(cutlass::compute_memory_reordering_atom<MmaType, MmaAtomShape, ValueShuffle>());
using LayoutB_Reordered = decltype(cute::tile_to_shape(LayoutAtomQuant{}, Layout<Shape<int, int, Int<1>>, StrideB>{}));

template <int TileN>
struct GroupedKernel {
  using TileShape = Shape<_128, Int<TileN>, Int<kTileK>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator, void, LayoutD_T*,
      kAlignD, ElementD, LayoutD_T*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<QuantType, ElementScale>, LayoutB_Reordered*,
      kAlignB, MmaType, LayoutA_T*, kAlignA, ElementAccumulator, TileShape, ClusterShape,
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
    return typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {g.num_groups, static_cast<UnderlyingProblemShape*>(g.problems), nullptr},
        {reinterpret_cast<const QuantType**>(g.b), static_cast<LayoutB_Reordered*>(g.layout_b),
         reinterpret_cast<const MmaType**>(g.a), static_cast<StrideA*>(g.stride_a),
         reinterpret_cast<const ElementScale**>(g.s), static_cast<StrideS*>(g.stride_s), g.group_size},
        {fusion, nullptr, static_cast<StrideC*>(g.stride_c), reinterpret_cast<ElementD**>(g.d),
         static_cast<StrideD*>(g.stride_d)},
        hw};
  }
};

// every width shares the per-expert arrays moe_w4a16_grouped.cu writes once per layer
using StrideS = typename GroupedKernel<64>::StrideS;
using StrideD = typename GroupedKernel<64>::StrideD;
using StrideC = typename GroupedKernel<64>::StrideC;

template <int TileN>
size_t grouped_workspace_bytes(const GroupedArgs& g) {
  return GroupedKernel<TileN>::Gemm::get_workspace_size(GroupedKernel<TileN>::arguments(g));
}

template <int TileN>
const char* run_grouped(const GroupedArgs& g) {
  using K = GroupedKernel<TileN>;
  static_assert(std::is_same_v<typename K::StrideS, StrideS> && std::is_same_v<typename K::StrideD, StrideD> &&
                    std::is_same_v<typename K::StrideC, StrideC>,
                "every tile width must take the layer's one set of strides");
  auto args = K::arguments(g);
  typename K::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return "CUTLASS cannot implement this grouped GEMM";
  if (gemm.initialize(args, g.workspace, g.stream) != cutlass::Status::kSuccess) return "CUTLASS initialize failed";
  if (gemm.run(g.stream) != cutlass::Status::kSuccess) return "CUTLASS run failed";
  return nullptr;
}

}  // namespace wna16_hopper
