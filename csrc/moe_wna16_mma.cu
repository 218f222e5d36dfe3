// The tensor-core WNA16 MoE GEMM for decode and small batches (the main kernel behind
// wna16_plus::moe_wna16_gemm; the contract is in moe_wna16_gemm.cu).
//
// Why tensor cores at M = 1: the work is a stream of weights, and what caps the stream below the HBM
// bandwidth is the number of instructions issued per weight (an H200 SM issues 4 warp instructions a
// cycle, and needs about 16 weight bytes a cycle to keep up with HBM). Here the weights are the A
// operand of mma.sync.m16n8k16 (16 output columns by 16 k) and up to 8 tokens are the B operand (16 k
// by 8 tokens), so one instruction consumes 256 weights, and the dequantization is done on pairs
// (bf16x2 / f16x2) with the exponent trick: one lop3 makes (0x4300 | q), the bf16 128 + q, or
// (0x6400 | q), the fp16 1024 + q, for two weights at once, and one subtract of (128 + z) pairs gives
// q - z exactly. Accumulation is float32 in the tensor core.
//
// Where the scale goes (ScaleMode): a scale is a per-(row, group) factor of the k sum, so when the k of
// an mma all lie in one group, the mma can run on the exact integers q - z and its float32 result takes
// the scale: once per step (groups of >= 4 chunks, e.g. int4 gs128) or once per tile (channel-wise).
// Only shorter groups (int4 gs32/gs64, int8 gs32) multiply each pair by its scale before the mma.
//
// A reduction over k may visit k in any order, as long as A and B agree. Each lane loads one
// 16-byte chunk (32 int4 or 16 int8 values of k) of each of its two rows, and the k slots of the
// fragment are mapped to the order in which the exponent trick yields nibble pairs (k, k+4); the
// activations are loaded as 16-byte vectors and permuted to the same order with one byte_perm per
// pair. No relayout of the checkpoint's packing is needed. A chunk never straddles a scale group
// (launch_rules.h: mma_kernel_fits), so one scale and zero serve the chunk of a row.
//
// Work split: lane (g, q) = (lane / 4, lane % 4) owns rows g and g + 8 of a 16-row tile and chunk
// 4 * step + q of each step. The 8 warps of a block share its columns: each warp takes one 16-row
// tile; when the block has fewer than 8 tiles the warps split K (ksplit) and add their partial sums
// through shared memory.
//
// The weight stream is a cp.async pipeline of each warp, in pairs of steps: one copy instruction takes
// 128 bytes (8 chunks, the two steps of a pair) of each of 4 rows, so it reads 4 whole cache lines; the
// lanes then read back the chunks of their fragment, which other lanes copied (a __syncwarp per step
// makes them visible). Copying each lane's own chunk instead read 8 rows x 64 bytes per instruction,
// and ncu counted half of the kernel's shared-memory wavefronts as excess (Mixtral M=8). The 4-byte
// words holding a chunk's scale and zero point are copied by the lane that reads them where its chunk
// has its own group, else once per row (RingShape). kStages / 2 - 1 pairs per warp are in flight while
// one is computed.
//
// Gated activation (GEMM1 of a MoE layer, p.activation != 0): a tile is 8 output columns n, whose
// gate rows n are the fragment's rows g and whose up rows N/2 + n are its rows g + 8. Each lane then
// holds gate and up of the same (token, column) and writes act(gate) * up directly: no h1 round trip
// through memory and no activation launch.

#include "mma_common.cuh"

namespace wna16_plus {

namespace {

template <typename T, int BITS, int TT, int SCALES, bool HAS_ZP, int RT>
__global__ void __launch_bounds__(kThreads, 2) moe_wna16_mma_kernel(const GemmParams p) {
  using A = Pairs<T>;
  using B = Bias<T, BITS>;
  using Ring = RingShape<RT, SCALES, HAS_ZP>;
  constexpr int kRows = 2 * RT;                           // weight rows per lane: lo and hi of RT tiles
  constexpr int kChunkVals = 128 / BITS;                 // k per 16-byte chunk
  constexpr int kVecs = kChunkVals * sizeof(T) / 16;     // 16-byte activation vectors per chunk
  constexpr int kLead = Ring::kPairStages - 1;             // pairs in flight while one is computed
  __shared__ int s_pairs[kMaxBlockM];
  extern __shared__ uint4 s_ring[];
  uint32_t* const ring_s = Ring::scale_words(s_ring);
  uint32_t* const ring_z = Ring::zero_words(s_ring);
  const int n_begin = blockIdx.y * p.block_n;
  const int n_end = min(p.out_n, n_begin + p.block_n);  // output columns
  int expert;
  if (!stage_block_pairs<T>(p, s_pairs, n_begin, n_end, expert)) return;

  const bool gated = p.activation != 0;
  const int tile_cols = gated ? 8 : 16;  // output columns per 16-row tile
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  uint4* const warp_ring = s_ring + warp * Ring::kWarpChunks;
  const int ntiles = (n_end - n_begin + tile_cols - 1) / tile_cols;
  const int nunits = (ntiles + RT - 1) / RT;  // a warp streams RT tiles at once (a unit)
  const int units_par = min(nunits, kWarps);
  const int ksplit = kWarps / units_par;
  const int unit_slot = warp % units_par, kslice = warp / units_par;
  const int chunks = p.K * BITS / 128;  // 16-byte chunks per weight row
  const int pairs = (chunks + 7) / 8;   // pairs of steps (128 bytes of a row); the K split deals them out
  // the scale group of chunk c is c >> group_shift: launch_rules.h admits this kernel only where a group
  // is a power-of-two number of chunks (32/64/128 values) or the whole row (channel-wise). An integer
  // division by the runtime group size cost about ten instructions, twice per step, in the K loop.
  const int group_shift = p.num_groups == 1 ? 30 : __ffs(chunks / p.num_groups) - 1;
  const int64_t row_bytes = static_cast<int64_t>(p.K) * BITS / 8;
  const T* a = static_cast<const T*>(p.a);
  T* c = static_cast<T*>(p.c);
  const B symmetric = B::make(1u << (BITS - 1));

  for (int t0 = 0; t0 < p.block_m; t0 += 8 * TT) {
    bool any = false;  // uniform over the block: skip passes of padding only
    for (int i = t0; i < min(p.block_m, t0 + 8 * TT); ++i) any |= s_pairs[i] < p.num_pairs;
    if (!any) continue;
    // this lane's B column: token g of each 8-token tile. A column without a token reads row 0 of a:
    // column n of the mma result depends on column n of B alone, and that column is never stored.
    const T* a_row[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
      const int idx = t0 + tt * 8 + g;
      const int pair = idx < p.block_m ? s_pairs[idx] : p.num_pairs;
      a_row[tt] = a + (pair < p.num_pairs ? static_cast<int64_t>(pair / p.top_k) * p.stride_am : 0);
    }

    for (int unit_base = 0; unit_base < nunits; unit_base += units_par) {
      const int unit = unit_base + unit_slot;
      const bool active = kslice < ksplit && unit < nunits;
      float acc[RT][TT][4];
#pragma unroll
      for (int t = 0; t < RT; ++t)
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[t][tt][e] = 0.0f;
      // the output columns of the fragment's rows g and g + 8 in each tile of the unit
      int n_lo[RT], n_hi[RT];
#pragma unroll
      for (int t = 0; t < RT; ++t) {
        n_lo[t] = n_begin + (unit * RT + t) * tile_cols + g;
        n_hi[t] = gated ? n_lo[t] : n_lo[t] + 8;
      }

      if (active) {
        __syncwarp();  // every lane has read the previous unit's last chunks before the ring is refilled
        Row<BITS> rows[kRows];  // rows 2t and 2t + 1: lo and hi of tile t
        B row_bias[kRows];      // kScaleRows: the rows' zero points
        float row_scale[kRows];  // kScaleRows: the rows' scales, applied at the end
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int t = r / 2;
          const int n = r % 2 == 0 ? n_lo[t] : gated ? n_lo[t] + p.out_n : n_hi[t];  // gated: the up row
          rows[r] = Row<BITS>::make(p, expert, n, (r % 2 == 0 ? n_lo[t] : n_hi[t]) < n_end);
          row_bias[r] = symmetric;
        }
        if constexpr (SCALES == kScaleRows) row_constants<T, BITS, HAS_ZP, RT>(rows, row_scale, row_bias);
        // The copies of a pair: 2 kRows instructions, c taking rows 4c .. 4c + 3 of the warp's 16 RT (tile t's
        // rows 16t .. 16t + 15: its lo rows g, then its hi rows g + 8), lane l chunk l % 8 of row 4c + l / 8.
        // A row's 8 chunks sit in one 128-byte line of the ring with the step bit swizzled by the row's
        // parity, so the reads (rows g, g + 1 of one quarter warp) and the copies are free of bank conflicts.
        constexpr int kCopies = 2 * kRows;
        const int copy_chunk = lane & 7, copy_row = lane >> 3;
        const int copy_slot = copy_row * 8 + (copy_chunk ^ ((copy_row & 1) << 2));
        const uint8_t* const w_expert = p.qweight + static_cast<int64_t>(expert) * p.N * row_bytes + copy_chunk * 16;
        uint32_t copy_offset[kCopies];  // bytes from w_expert to the row of copy c (one expert is < 4 GiB)
        uint32_t copy_valid = 0;
#pragma unroll
        for (int cp = 0; cp < kCopies; ++cp) {
          const int lr = 4 * cp + copy_row, t = lr / 16, j = lr % 16;
          const int col = gated ? n_begin + (unit * RT + t) * 8 + (j & 7) : n_begin + (unit * RT + t) * 16 + j;
          const int n = gated && j >= 8 ? col + p.out_n : col;  // gated: rows 8..15 of a tile are up rows
          copy_offset[cp] = static_cast<uint32_t>(n * row_bytes);
          copy_valid |= (col < n_end ? 1u : 0u) << cp;
        }
        // this warp's pairs: kslice, kslice + ksplit, ...; its steps i are the pairs' two halves
        const int my_pairs = kslice < pairs ? (pairs - kslice + ksplit - 1) / ksplit : 0;
        const int my_steps = 2 * my_pairs;
        auto issue_pair = [&](int pi, int pstage) {
          if (pi < my_pairs) {
            const int gp = kslice + pi * ksplit;
            const bool in_k = gp * 8 + copy_chunk < chunks;
            const uint8_t* const src = w_expert + static_cast<int64_t>(gp) * 128;
#pragma unroll
            for (int cp = 0; cp < kCopies; ++cp)
              copy_async16(warp_ring + pstage * Ring::kPairChunks + cp * 32 + copy_slot, src + copy_offset[cp],
                           ((copy_valid >> cp) & 1) && in_k);
            // and, per row and step, the words of the scale and zero point of this lane's chunk
#pragma unroll
            for (int sp = 0; sp < 2; ++sp)
              copy_step_words<SCALES, HAS_ZP, RT>(ring_s, ring_z, 2 * pstage + sp, q, rows,
                                                  min((2 * gp + sp) * 4 + q, chunks - 1) >> group_shift);
          }
          commit_copies();
        };
        // two commit groups per pair (the pair, then an empty one), as the loop commits one per step: the
        // pair of step i is then complete once at most 2 kLead - 1 newer groups are pending
#pragma unroll
        for (int pi = 0; pi < kLead; ++pi) {
          issue_pair(pi, pi);
          commit_copies();
        }

        int pstage = 0;  // the pair stage of step i
        for (int i = 0; i < my_steps; ++i) {
          const int sp = i & 1;
          const int chunk = (2 * (kslice + (i >> 1) * ksplit) + sp) * 4 + q;  // the lane's chunk of step i
          const bool in_k = chunk < chunks;
          const int grp = min(chunk, chunks - 1) >> group_shift;
          // B: this lane's token's 16-byte activation vectors of the chunk, shared by the unit's tiles
          // (past K: any finite values, the weights' centered values are zero there)
          uint4 x[TT][kVecs];
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int v = 0; v < kVecs; ++v)
              x[tt][v] = __ldg(reinterpret_cast<const uint4*>(a_row[tt] + min(chunk, chunks - 1) * kChunkVals) + v);
          wait_copies<2 * kLead - 1>();  // step i has landed (this lane's copies) ...
          __syncwarp();                  // ... and every lane's
          uint4 wv[kRows];
          B bias[kRows];
          uint32_t scale_bits[kRows];
          read_step<T, BITS, SCALES, HAS_ZP, RT>(warp_ring, ring_s, ring_z, pstage, sp, g, q, grp, in_k, rows, row_bias,
                                                 wv, bias, scale_bits);
          // the next pair into the stage of the pair before this one (read by every lane: the __syncwarp)
          if (sp == 0)
            issue_pair((i >> 1) + kLead, pstage == 0 ? Ring::kPairStages - 1 : pstage - 1);
          else
            commit_copies();
          if (sp == 1) pstage = pstage == Ring::kPairStages - 1 ? 0 : pstage + 1;

          mma_step<T, BITS, TT, SCALES, RT>(acc, wv, bias, scale_bits, x);
        }
        wait_copies<0>();  // the ring is idle now: the next unit may reuse it, the K-split sums pass through it
        if constexpr (SCALES == kScaleRows) {
#pragma unroll
          for (int t = 0; t < RT; ++t)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[t][tt][e] *= row_scale[2 * t + (e < 2 ? 0 : 1)];
        }
      }

      if (ksplit > 1) {  // add the K slices' partial sums (uniform branch: every warp syncs)
        // through the ring slots of the lane that computed them (RT * TT float4 of its own slots, idle
        // since its wait_copies<0> above)
        if (active && kslice > 0) {
          __syncwarp();  // every lane of the warp has read its last chunks
#pragma unroll
          for (int t = 0; t < RT; ++t)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
              warp_ring[(t * TT + tt) * 32 + lane] = make_uint4(__float_as_uint(acc[t][tt][0]), __float_as_uint(acc[t][tt][1]),
                                                            __float_as_uint(acc[t][tt][2]), __float_as_uint(acc[t][tt][3]));
        }
        __syncthreads();
        if (active && kslice == 0) {
          for (int ks = 1; ks < ksplit; ++ks) {
            const uint4* other = s_ring + (warp + ks * units_par) * Ring::kWarpChunks + lane;
#pragma unroll
            for (int t = 0; t < RT; ++t)
#pragma unroll
              for (int tt = 0; tt < TT; ++tt) {
                const uint4 v = other[(t * TT + tt) * 32];
                acc[t][tt][0] += __uint_as_float(v.x);
                acc[t][tt][1] += __uint_as_float(v.y);
                acc[t][tt][2] += __uint_as_float(v.z);
                acc[t][tt][3] += __uint_as_float(v.w);
              }
          }
        }
        __syncthreads();  // the sums are read before the next unit's copies land in the ring
      }

      if (active && kslice == 0) {
        // C fragment: e = 0, 1 -> row g, tokens 2q, 2q+1; e = 2, 3 -> row g + 8 (gated: the up rows)
#pragma unroll
        for (int t = 0; t < RT; ++t)
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (gated && e >= 2) break;
              const int n = e < 2 ? n_lo[t] : n_hi[t];
              const int idx = t0 + tt * 8 + 2 * q + (e & 1);
              if (n >= n_end || idx >= p.block_m) continue;
              const int pair = s_pairs[idx];
              if (pair >= p.num_pairs) continue;
              float out = acc[t][tt][e];
              if (gated) out = gated_activation(out, acc[t][tt][e + 2], p.activation);
              if (p.topk_weights != nullptr) out *= p.topk_weights[pair];
              c[static_cast<int64_t>(pair) * p.out_n + n] = from_float<T>(out);
            }
      }
    }
  }
}

template <typename T, int BITS, int TT, int SCALES, bool HAS_ZP, int RT>
cudaError_t launch_tiles(const GemmParams& p, dim3 grid, cudaStream_t stream) {
  constexpr auto kernel = moe_wna16_mma_kernel<T, BITS, TT, SCALES, HAS_ZP, RT>;
  constexpr int kBytes = RingShape<RT, SCALES, HAS_ZP>::kBytes;
  if (const cudaError_t err = allow_ring<kernel, kBytes>(); err != cudaSuccess) return err;
  return launch_kernel(kernel, grid, kThreads, kBytes, stream, p.programmatic, p);
}

// One 8-token column tile per pass (block_m <= 8, decode) streams two row tiles per warp when the block
// has them: the activation loads and their permutes then serve twice the weights. 16 tokens per pass
// stream one (registers).
template <typename T, int BITS, int SCALES, bool HAS_ZP>
struct LaunchTiles {
  static cudaError_t run(const GemmParams& p, dim3 grid, cudaStream_t stream) {
    const int tile_cols = p.activation != 0 ? 8 : 16;
    const int ntiles = (min(p.block_n, p.out_n) + tile_cols - 1) / tile_cols;
    if (p.block_m > 8) return launch_tiles<T, BITS, 2, SCALES, HAS_ZP, 1>(p, grid, stream);
    if (ntiles >= 2 && two_tile_blocks_fit<RingShape<2, SCALES, HAS_ZP>::kBytes>())
      return launch_tiles<T, BITS, 1, SCALES, HAS_ZP, 2>(p, grid, stream);
    return launch_tiles<T, BITS, 1, SCALES, HAS_ZP, 1>(p, grid, stream);
  }
};

}  // namespace

cudaError_t launch_moe_wna16_mma(const GemmParams& p, bool fp16, int bits, dim3 grid, cudaStream_t stream) {
  return dispatch_mma<LaunchTiles>(p, fp16, bits, grid, stream);
}

}  // namespace wna16_plus
