// The persistent form of the tensor-core WNA16 MoE GEMM (wna16_plus::moe_wna16_gemm, kernel "stream"):
// the same math per K step as moe_wna16_mma.cu (mma_common.cuh), a different split of the work.
//
// Why: at decode sizes a block of moe_wna16_mma.cu streams 2-8 pairs of K steps per warp (H200,
// DeepSeek-V2-Lite at M=8: 4-6; the channel-wise shape's GEMM2: 2), so each block is mostly its
// pipeline's fill, its K-split sum and its epilogue, and the grid ends in a partial wave (272 blocks
// on 264 slots). Here every warp of a grid that just fills the GPU (two blocks per SM) streams one
// contiguous range of the flattened work, (expert block, unit of 2 row tiles, pair of K steps) in that
// order: the ranges differ by at most one pair, and a warp's cp.async ring stays full from its first
// pair to its last, across the units it crosses (stream-K).
//
// A unit that a warp covers whole is stored by it. A unit split between warps (at most one per range end)
// is summed through a workspace: each of its warps stores its float32 partial sums in its own slot, then
// adds the number of pairs it covered to the unit's counter, and the warp that brings the counter to the
// unit's pair count adds the partial sums up in warp order, stores the unit and zeroes the counter for
// the next launch. No warp waits for another, so any number of resident blocks is safe, and the sums do
// not depend on which warp finished last: the result is deterministic. A warp holds two partial slots:
// kind 0 for the unit its range starts in (when the unit began before), kind 1 for the unit it ends in.
// The counter of a split unit is at its first range boundary: distinct per unit, below W (the grid's warps).
//
// The workspace is one float32 tensor of W + 1 slots of 2 x 256 partial sums, then W + 1 int32 counters,
// all zero before the first launch; every launch leaves the counters zero. Launches that share it must not
// overlap (one stream).

#include "mma_common.cuh"

namespace wna16_plus {

namespace {

constexpr int kStreamRT = 2;                          // row tiles per unit: 32 weight rows
constexpr int kSlotFloats = kStreamRT * 4 * 32;       // the partial sums of one unit: RT x 4 per lane
static_assert(2 * kSlotFloats + 1 == kStreamSlotWords, "launch_rules.h sizes the workspace");

template <typename T, int BITS, int SCALES, bool HAS_ZP>
__global__ void __launch_bounds__(kThreads, 2) moe_wna16_stream_kernel(const GemmParams p, float* partials, int* counters) {
  constexpr int RT = kStreamRT, TT = 1, kRows = 2 * RT;
  using B = Bias<T, BITS>;
  using Ring = RingShape<RT, SCALES, HAS_ZP>;
  constexpr int kChunkVals = 128 / BITS;              // k per 16-byte chunk
  constexpr int kVecs = kChunkVals * sizeof(T) / 16;  // 16-byte activation vectors per chunk
  constexpr int kLead = Ring::kPairStages - 1;        // pairs in flight while one is computed
  constexpr int kCopies = 2 * kRows;                  // 16-byte copies per lane and pair
  extern __shared__ uint4 s_ring[];
  uint32_t* const ring_s = Ring::scale_words(s_ring);
  uint32_t* const ring_z = Ring::zero_words(s_ring);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  uint4* const warp_ring = s_ring + warp * Ring::kWarpChunks;

  const bool gated = p.activation != 0;
  const int tile_cols = gated ? 8 : 16;  // output columns per 16-row tile
  const int unit_cols = RT * tile_cols;
  const int nunits = (p.out_n + unit_cols - 1) / unit_cols;
  const int chunks = p.K * BITS / 128;  // 16-byte chunks per weight row
  const int pairs = (chunks + 7) / 8;   // pairs of steps per row (128 bytes)
  const int group_shift = p.num_groups == 1 ? 30 : __ffs(chunks / p.num_groups) - 1;  // see moe_wna16_mma.cu
  const int64_t row_bytes = static_cast<int64_t>(p.K) * BITS / 8;
  const int n_blocks = *p.num_tokens_post_padded / p.block_m;  // expert blocks of the sorted list
  const int64_t total = static_cast<int64_t>(n_blocks) * nunits * pairs;
  const int W = gridDim.x * kWarps, w = blockIdx.x * kWarps + warp;
  const int64_t begin = total * w / W, end = total * (w + 1) / W;
  if (begin >= end) return;  // no block-wide barrier below: a warp may leave alone
  const T* a = static_cast<const T*>(p.a);
  T* c = static_cast<T*>(p.c);
  auto expert_of = [&](int u) { return p.expert_ids[min(u / nunits, n_blocks - 1)]; };

  // The copies of a pair, as in moe_wna16_mma.cu: copy cp takes row 4 cp + lane / 8 of the unit's 16 RT
  // (tile cp / 4, its row j: lo rows g, then hi rows g + 8), chunk lane % 8 of the pair.
  const int copy_chunk = lane & 7, copy_row = lane >> 3;
  const int copy_slot = copy_row * 8 + (copy_chunk ^ ((copy_row & 1) << 2));
  // the rows of the lane's fragment in unit u's first column n0: tile r / 2, lo (row g) or hi (g + 8)
  auto fragment_rows = [&](int expert, int n0, Row<BITS> (&rows)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int col = n0 + (r / 2) * tile_cols + g + (r % 2 == 1 && !gated ? 8 : 0);
      const int n = r % 2 == 1 && gated ? col + p.out_n : col;  // gated: the hi rows are up rows
      rows[r] = Row<BITS>::make(p, max(expert, 0), n, expert >= 0 && col < p.out_n);
    }
  };

  // The issue side walks the range kLead pairs ahead of the compute side. Copy cp's row in a unit is
  // 4 k + lane / 8 for k = cp, or gated 4 k + lane / 8 (+ N/2 for the up rows of cp % 4 >= 2) for
  // k = 2 (cp / 4) + cp % 2: its offset from the unit's first row is a few registers' sum.
  const uint32_t lane_offset = static_cast<uint32_t>(copy_row * row_bytes);
  const uint32_t four_rows = static_cast<uint32_t>(4 * row_bytes);
  const uint32_t up_rows = static_cast<uint32_t>(p.out_n * row_bytes);  // gated: gate row n to up row n
  auto copy_k = [&](int cp) { return gated ? 2 * (cp / 4) + cp % 2 : cp; };
  auto copy_offset = [&](int cp) {
    return lane_offset + copy_k(cp) * four_rows + (gated && cp % 4 >= 2 ? up_rows : 0u);
  };
  int64_t issue_f = begin;
  int issue_u = static_cast<int>(begin / pairs), issue_kp = static_cast<int>(begin % pairs);
  int issue_expert = 0, next_expert = expert_of(issue_u);
  const uint8_t* unit_src = nullptr;  // the lane's chunk of the unit's first row, pair 0
  uint32_t copy_valid = 0;             // bit cp: copy cp is a row of an expert of this rank
  auto next_issue_unit = [&]() {  // its expert was loaded a unit ago
    issue_expert = next_expert;
    next_expert = expert_of(issue_u + 1);
    const int n0 = (issue_u % nunits) * unit_cols;
    unit_src = p.qweight + (static_cast<int64_t>(max(issue_expert, 0)) * p.N + n0) * row_bytes + copy_chunk * 16;
    copy_valid = 0;
#pragma unroll
    for (int cp = 0; cp < kCopies; ++cp) {
      const int j = 4 * (cp % 4) + copy_row;
      copy_valid |= (issue_expert >= 0 && n0 + (cp / 4) * tile_cols + (gated ? (j & 7) : j) < p.out_n ? 1u : 0u) << cp;
    }
  };
  next_issue_unit();
  auto issue_pair = [&](int pstage) {
    if (issue_f < end) {
      const bool in_k = issue_kp * 8 + copy_chunk < chunks;
      const uint8_t* const src = unit_src + issue_kp * 128;
#pragma unroll
      for (int cp = 0; cp < kCopies; ++cp)
        copy_async16(warp_ring + pstage * Ring::kPairChunks + cp * 32 + copy_slot, src + copy_offset(cp),
                     ((copy_valid >> cp) & 1) && in_k);
      if constexpr (SCALES != kScaleRows) {
        Row<BITS> rows[kRows];
        fragment_rows(issue_expert, (issue_u % nunits) * unit_cols, rows);
#pragma unroll
        for (int sp = 0; sp < 2; ++sp)
          copy_step_words<SCALES, HAS_ZP, RT>(ring_s, ring_z, 2 * pstage + sp, q, rows,
                                              min((2 * issue_kp + sp) * 4 + q, chunks - 1) >> group_shift);
      }
      ++issue_f;
      if (++issue_kp == pairs) {
        issue_kp = 0;
        ++issue_u;
        next_issue_unit();
      }
    }
    commit_copies();
  };
  // two commit groups per pair in the prologue, one per step after it (see moe_wna16_mma.cu)
#pragma unroll
  for (int pi = 0; pi < kLead; ++pi) {
    issue_pair(pi);
    commit_copies();
  }
  // A programmatic launch (grid_dependency.cuh) waits for the previous kernel only here: the copies above
  // read weights, scales and the routing lists, nothing the previous kernel wrote (LaunchStream launches it
  // programmatically only where the routing lists are older, p.weights_before_wait), so GEMM2's first
  // weights stream in while GEMM1's last blocks finish. One place for the wait: a second, chosen at run
  // time, cost the kernel 2-7% at M >= 8 (H200, pdl2: 128 registers, channel-wise and Mixtral).
  wait_for_previous_grid();
  start_next_grid();  // GEMM2 (or the top-k sum) takes the slots of this kernel's blocks as they exit

  // The compute side: unit u from pair kp, its rows and the lane's token g of the expert block.
  int u = static_cast<int>(begin / pairs), kp = static_cast<int>(begin % pairs);
  int64_t unit_first = begin;  // the first pair of u this warp computes
  RowBits<BITS> rows[kRows];  // where the scale and zero point of a group lie in the words the issue side copied
  B row_bias[kRows];
  float row_scale[kRows];
  // what the units of one expert block share, loaded when the warp enters the block: its expert, the lane's
  // token row of a (a column without a token reads row 0 of a: its results are never stored), and the pairs
  // of the two tokens 2q, 2q + 1 whose results the lane stores
  int block = -1, expert = -1;
  const T* a_row = a;
  int out_pair[2];
  float acc[RT][TT][4];
  auto start_unit = [&]() {
    if (u / nunits != block) {
      block = u / nunits;
      expert = expert_of(u);
      const int* const block_pairs = p.sorted_token_ids + block * p.block_m;
      const int pair = g < p.block_m ? block_pairs[g] : p.num_pairs;
      a_row = a + (pair < p.num_pairs ? static_cast<int64_t>(pair / p.top_k) * p.stride_am : 0);
#pragma unroll
      for (int i = 0; i < 2; ++i) out_pair[i] = 2 * q + i < p.block_m ? block_pairs[2 * q + i] : p.num_pairs;
    }
    Row<BITS> full[kRows];
    fragment_rows(expert, (u % nunits) * unit_cols, full);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      rows[r] = RowBits<BITS>::of(full[r]);
      row_bias[r] = B::make(1u << (BITS - 1));
    }
    if constexpr (SCALES == kScaleRows) row_constants<T, BITS, HAS_ZP, RT>(full, row_scale, row_bias);
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][0][e] = 0.0f;
  };
  // Stores unit u's sums once this warp's part of it [unit_first, f] is computed: directly when it is the
  // whole unit, else through the unit's workspace slot by whichever warp completes it.
  auto finish_unit = [&](int64_t f) {
    if constexpr (SCALES == kScaleRows) {
#pragma unroll
      for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][0][e] *= row_scale[2 * t + (e < 2 ? 0 : 1)];
    }
    const int covered = static_cast<int>(f + 1 - unit_first);
    if (covered < pairs) {
      // warp v's range starts at range_start(v); unit u's pairs are [x, x + pairs)
      auto range_start = [&](int v) { return total * v / W; };
      auto partial = [&](int v, int kind) { return partials + (2 * static_cast<int64_t>(v) + kind) * kSlotFloats + lane; };
      const int64_t x = static_cast<int64_t>(u) * pairs;
      const int64_t boundary = ((x + 1) * W + total - 1) / total;  // the first warp starting inside u
      float* const mine = partial(w, begin >= x ? 0 : 1);
#pragma unroll
      for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) mine[(t * 4 + e) * 32] = acc[t][0][e];
      __threadfence();  // the sums are visible before the count that announces them
      __syncwarp();
      int before = 0;
      if (lane == 0) before = atomicAdd(counters + boundary, covered);
      before = __shfl_sync(0xFFFFFFFFu, before, 0);
      if (before + covered < pairs) return;  // another warp completes the unit
      __threadfence();
      // the warps of u in order: the one whose range holds pair x (it starts at or before x), then the next
      // ones up to the one whose range holds pair x + pairs - 1
      const int first = static_cast<int>(boundary) - 1;
      const int last = static_cast<int>(((x + pairs) * W + total - 1) / total) - 1;
      for (int v = first; v <= last; ++v) {
        const int64_t start = range_start(v);
        if (v > first && start == range_start(v + 1)) continue;  // an empty range (fewer pairs than warps)
        const float* const theirs = partial(v, start >= x ? 0 : 1);
#pragma unroll
        for (int t = 0; t < RT; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float value = __ldcg(theirs + (t * 4 + e) * 32);  // from L2: written by other SMs
            acc[t][0][e] = v == first ? value : acc[t][0][e] + value;
          }
      }
      if (lane == 0) atomicExch(counters + boundary, 0);
    }
    // C fragment: e = 0, 1 -> row g, tokens 2q, 2q+1; e = 2, 3 -> row g + 8 (gated: the up rows)
    const int n0 = (u % nunits) * unit_cols;
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (gated && e >= 2) break;
        const int n = n0 + t * tile_cols + g + (e >= 2 ? 8 : 0);
        const int pair = out_pair[e & 1];
        if (n >= p.out_n || pair >= p.num_pairs) continue;
        float out = acc[t][0][e];
        if (gated) out = gated_activation(out, acc[t][0][e + 2], p.activation);
        if (p.topk_weights != nullptr) out *= p.topk_weights[pair];
        c[static_cast<int64_t>(pair) * p.out_n + n] = from_float<T>(out);
      }
  };

  start_unit();
  int pstage = 0;  // the pair stage of the pair computed
  for (int64_t f = begin; f < end; ++f) {
#pragma unroll
    for (int sp = 0; sp < 2; ++sp) {
      const int chunk = (2 * kp + sp) * 4 + q;  // the lane's chunk of this step
      const bool in_k = chunk < chunks;
      const int grp = min(chunk, chunks - 1) >> group_shift;
      uint4 x[TT][kVecs];  // past K: any finite values, the weights' centered values are zero there
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
        x[0][v] = __ldg(reinterpret_cast<const uint4*>(a_row + min(chunk, chunks - 1) * kChunkVals) + v);
      wait_copies<2 * kLead - 1>();  // the step has landed (this lane's copies) ...
      __syncwarp();                  // ... and every lane's
      uint4 wv[kRows];
      B bias[kRows];
      uint32_t scale_bits[kRows];
      read_step<T, BITS, SCALES, HAS_ZP, RT>(warp_ring, ring_s, ring_z, pstage, sp, g, q, grp, in_k, rows, row_bias, wv,
                                             bias, scale_bits);
      // the next pair into the stage of the pair before this one (read by every lane: the __syncwarp)
      if (sp == 0)
        issue_pair(pstage == 0 ? Ring::kPairStages - 1 : pstage - 1);
      else
        commit_copies();
      mma_step<T, BITS, TT, SCALES, RT>(acc, wv, bias, scale_bits, x);
    }
    pstage = pstage == Ring::kPairStages - 1 ? 0 : pstage + 1;
    if (++kp == pairs || f + 1 == end) {
      finish_unit(f);
      if (kp == pairs && f + 1 < end) {
        kp = 0;
        ++u;
        unit_first = f + 1;
        start_unit();
      }
    }
  }
  wait_copies<0>();
}

template <typename T, int BITS, int SCALES, bool HAS_ZP>
struct LaunchStream {
  static cudaError_t run(const GemmParams& p, int blocks, float* partials, int* counters, cudaStream_t stream) {
    constexpr auto kernel = moe_wna16_stream_kernel<T, BITS, SCALES, HAS_ZP>;
    constexpr int kBytes = RingShape<kStreamRT, SCALES, HAS_ZP>::kBytes;
    if (!two_tile_blocks_fit<kBytes>()) return cudaErrorNotSupported;  // the caller runs the tiled kernel
    if (const cudaError_t err = allow_ring<kernel, kBytes>(); err != cudaSuccess) return err;
    return launch_kernel(kernel, dim3(blocks), kThreads, kBytes, stream, p.programmatic && p.weights_before_wait, p,
                         partials, counters);
  }
};

}  // namespace

cudaError_t launch_moe_wna16_stream(const GemmParams& p, bool fp16, int bits, int blocks, float* partials,
                                    int* counters, cudaStream_t stream) {
  return dispatch_mma<LaunchStream>(p, fp16, bits, blocks, partials, counters, stream);
}

}  // namespace wna16_plus
