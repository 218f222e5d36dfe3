// The routed-experts layer on CUTLASS's Hopper grouped int4 (or int8) x bf16 (or fp16) GEMM (grouped_gemm.cuh), sm90a:
//
//   route(topk_ids) -> expert e's pairs at rows [off_e, off_e + count_e) of the expert-sorted pairs, both
//                      GEMMs' problems (N, count_e, K) and per-expert pointers, on the device (no host sync:
//                      CUDA-graph safe)
//   a1 = x[row_token]                           (M * top_k, H)   gather into expert order
//   h  = grouped GEMM1(a1, W13)                 (M * top_k, 2I)  x's type (bf16 or fp16) throughout
//   a2 = silu(h[:, :I]) * h[:, I:]              (M * top_k, I)
//   d2 = grouped GEMM2(a2, W2)                  (M * top_k, H)
//   out[t] = sum_j w[t, j] * d2[pair_row[t * top_k + j]]        float32 sum; pairs whose id is outside [0, E)
//                                                               (vLLM's padding, -1) skipped
//
// Weights: the plugin's kernel layout (E, N, K * bits / 8) uint8 (int4: even k in the low nibble), made signed
// (q' = q - 2**(bits-1): XOR 0x8 per nibble, 0x80 per byte; CUTLASS's int4b_t, int8_t) and reordered per expert at
// prepare (prepare_weights); scales (E, G, N), N contiguous (the plugin's (E, N, G) transposed by the caller).
// w = s * q'. Zero points: the caller gives int4 q with zero points z as int8 q - z (hopper_ops.prepare); zero
// tables (CUTLASS's ConvertAndScaleWithZero, z' = (2**(bits-1) - z) * s) are refused: no such build
// (grouped_gemm.h's tile_is_built says why).
// Issue 23's prototype: bench/hopper_probe.py builds it with torch's JIT (CUTLASS headers from the
// nvidia-cutlass wheel); setup.py builds it as vllm_wna16_plugin._hopper where CUTLASS is found, and the
// `hopper` backend runs it (kernels/hopper_ops.py; docs/perf/hopper-path.md).
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "grouped_gemm.cuh"

namespace wna16_hopper {

// built in grouped_tile_<N>[_fp16][_int8].cu (tile_is_built)
#define WNA16_HOPPER_EXTERN(TILE, ACT, ZERO, BITS)                                                    \
  extern template size_t grouped_workspace_bytes<TILE, Act::ACT, ZERO, BITS>(const GroupedArgs&); \
  extern template const char* run_grouped<TILE, Act::ACT, ZERO, BITS>(const GroupedArgs&);
WNA16_HOPPER_EXTERN(32, kBf16, false, 4)
WNA16_HOPPER_EXTERN(64, kBf16, false, 4)
WNA16_HOPPER_EXTERN(128, kBf16, false, 4)
WNA16_HOPPER_EXTERN(256, kBf16, false, 4)
WNA16_HOPPER_EXTERN(128, kFp16, false, 4)
WNA16_HOPPER_EXTERN(256, kFp16, false, 4)
WNA16_HOPPER_EXTERN(128, kBf16, false, 8)
WNA16_HOPPER_EXTERN(256, kBf16, false, 8)
WNA16_HOPPER_EXTERN(128, kFp16, false, 8)
WNA16_HOPPER_EXTERN(256, kFp16, false, 8)

// ------------------------------------------------------------------------------------------ preparation

// (E, N, Kp * Bits / 8) uint8 signed values (Kp = reorder_k(K)) -> each expert reordered for an (N, Kp) layout into
// `out` (E, N, Kp * Bits / 8)
template <int Bits>
static void reorder_experts(const torch::Tensor& signed_q, torch::Tensor& out, int64_t N, int64_t Kp) {
  TORCH_CHECK(Kp % kReorderK == 0, "reorder: K=", Kp, " is not a multiple of ", kReorderK);
  auto shape_B = cute::make_shape(int(N), int(Kp), Int<1>{});
  auto layout_B = make_layout(shape_B, cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(int(N), int(Kp), 1)));
  auto layout_R = tile_to_shape(LayoutAtomQuant<Bits>{}, shape_B);
  const int64_t expert_bytes = N * Kp * Bits / 8;
  for (int64_t e = 0; e < signed_q.size(0); ++e) {
    auto* src = reinterpret_cast<QuantType<Bits> const*>(signed_q.data_ptr<uint8_t>() + e * expert_bytes);
    auto* dst = reinterpret_cast<QuantType<Bits>*>(out.data_ptr<uint8_t>() + e * expert_bytes);
    cutlass::reorder_tensor(src, layout_B, dst, layout_R);  // synchronises: load time only
  }
}

// (E, N, K * bits / 8) uint8, unsigned with midpoint 2**(bits-1) -> signed int4 / int8, reordered per expert (a new
// tensor)
torch::Tensor prepare_weights(torch::Tensor qweight, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, not ", bits);
  TORCH_CHECK(qweight.is_cuda() && qweight.scalar_type() == torch::kUInt8 && qweight.dim() == 3 &&
                  qweight.is_contiguous(),
              "qweight must be a contiguous (E, N, K * bits / 8) uint8 CUDA tensor");
  const c10::cuda::CUDAGuard guard(qweight.device());
  const int64_t E = qweight.size(0), N = qweight.size(1), K = qweight.size(2) * 8 / bits;
  TORCH_CHECK(N % 128 == 0 && K % kTileK == 0, "N must be a multiple of 128 and K of ", kTileK, " (N=", N,
              ", K=", K, ")");
  const int64_t Kp = reorder_k(K);
  // q - 2**(bits-1) in each value, two's complement; K padded to Kp (the padding's values are never kept)
  auto signed_q = torch::bitwise_xor(qweight, bits == 4 ? 0x88 : 0x80);
  if (Kp != K) signed_q = torch::constant_pad_nd(signed_q, {0, (Kp - K) * bits / 8}, 0);
  auto out = torch::empty_like(signed_q);
  // CUTLASS's reorder_tensor launches on the legacy default stream and exits the process on any CUDA error,
  // a pending one included: finish this stream's work (the XOR above) and raise a pending error here instead
  C10_CUDA_CHECK(cudaStreamSynchronize(at::cuda::getCurrentCUDAStream()));
  C10_CUDA_CHECK(cudaGetLastError());
  if (E > 0) bits == 4 ? reorder_experts<4>(signed_q, out, N, Kp) : reorder_experts<8>(signed_q, out, N, Kp);
  if (Kp == K) return out;
  // each expert's (N, K) reorder: the first N * K * bits / 8 bytes of its (N, Kp) one
  return out.view({E, N * Kp * bits / 8}).narrow(1, 0, N * K * bits / 8).contiguous().view({E, N, K * bits / 8});
}

// Per-layer constants: every expert's strides and reordered-weight layout (the same for all experts of a
// GEMM; the layout's type by weight bits), both GEMMs' arrays one after the other in one byte buffer, each 256-byte
// aligned.
template <int Bits>
struct GemmConsts {
  StrideA* sa;
  StrideS* ss;
  StrideD* sd;
  StrideC* sc;
  LayoutB_Reordered<Bits>* lb;
};

template <class T>
static T* carve(uint8_t*& cursor, int64_t n) {
  auto* p = reinterpret_cast<T*>(cursor);
  cursor += (n * int64_t(sizeof(T)) + 255) / 256 * 256;
  return p;
}

template <int Bits>
static GemmConsts<Bits> carve_gemm(uint8_t*& cursor, int64_t E) {
  GemmConsts<Bits> c;
  c.sa = carve<StrideA>(cursor, E);
  c.ss = carve<StrideS>(cursor, E);
  c.sd = carve<StrideD>(cursor, E);
  c.sc = carve<StrideC>(cursor, E);
  c.lb = carve<LayoutB_Reordered<Bits>>(cursor, E);
  return c;
}

// a GEMM's arrays untyped, as GroupedArgs takes them
struct GemmArrays {
  void *sa, *ss, *sd, *sc, *lb;
};
template <int Bits>
static GemmArrays carve_arrays(uint8_t*& cursor, int64_t E) {
  const GemmConsts<Bits> c = carve_gemm<Bits>(cursor, E);
  return {c.sa, c.ss, c.sd, c.sc, c.lb};
}

template <int Bits>
static torch::Tensor layer_constants_of(int64_t E, int64_t N1, int64_t K1, int64_t N2, int64_t K2, int64_t G1,
                                        int64_t G2, torch::Device device) {
  const int64_t bytes = 2 * ((int64_t(sizeof(StrideA)) + sizeof(StrideS) + sizeof(StrideD) + sizeof(StrideC) +
                              sizeof(LayoutB_Reordered<Bits>)) * E + 5 * 256);
  std::vector<uint8_t> host(bytes, 0);
  uint8_t* cursor = host.data();
  for (int gemm = 0; gemm < 2; ++gemm) {
    const int N = int(gemm ? N2 : N1), K = int(gemm ? K2 : K1), G = int(gemm ? G2 : G1);
    GemmConsts<Bits> c = carve_gemm<Bits>(cursor, E);
    for (int64_t e = 0; e < E; ++e) {
      c.sa[e] = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(1, K, 1));
      c.ss[e] = cutlass::make_cute_packed_stride(StrideS{}, cute::make_shape(N, G, 1));
      c.sd[e] = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(N, 1, 1));
      c.sc[e] = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(N, 1, 1));
      c.lb[e] = tile_to_shape(LayoutAtomQuant<Bits>{}, cute::make_shape(N, K, Int<1>{}));
    }
  }
  TORCH_CHECK(cursor - host.data() <= bytes, "layer_constants: buffer too small");
  return torch::from_blob(host.data(), {bytes}, torch::kUInt8).clone().to(device);
}

// The layer's constant per-expert arrays for GEMM1 (N1, K1, G1 groups) and GEMM2 (N2, K2, G2) of `bits`-bit
// weights, on `device`.
torch::Tensor layer_constants(int64_t E, int64_t N1, int64_t K1, int64_t N2, int64_t K2, int64_t G1, int64_t G2,
                              int64_t bits, torch::Device device) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, not ", bits);
  return bits == 4 ? layer_constants_of<4>(E, N1, K1, N2, K2, G1, G2, device)
                   : layer_constants_of<8>(E, N1, K1, N2, K2, G1, G2, device);
}

// ------------------------------------------------------------------------------------------ routing and glue

// activations, scales and outputs are 16-bit elements of either type (bf16 or fp16): the routing only offsets them
using Elem16 = uint16_t;

struct GemmPointers {
  const void** b;  // the weights (int4 or int8)
  const Elem16** a;
  const Elem16** s;
  Elem16** d;
  const Elem16** z;  // zero tables (unused where the layer is symmetric)
  UnderlyingProblemShape* problem;
};

// One block: counts pairs per expert, their offsets, each pair's row in expert order (pair_row), the token
// of each row (row_token), and both GEMMs' problems and pointers. A pair whose id is outside [0, E) takes no
// row (pair_row -1) and adds nothing to its token: vLLM 0.34's routers mark CUDA-graph and DP padding rows
// with id -1 (VLLM_MOE_SKIP_PADDING), and a graph capture's dummy batch is all padding. (Expert parallelism's
// foreign ids are refused by the caller, not skipped here.)
__global__ void route_kernel(const int32_t* __restrict__ topk_ids, int pairs, int top_k, int E, int N1, int K1,
                             int N2, int K2, int G1, int G2, int bits, int32_t* __restrict__ pair_row,
                             int32_t* __restrict__ row_token, const uint8_t* w13, const Elem16* s13,
                             const uint8_t* w2, const Elem16* s2, const Elem16* z13, const Elem16* z2,
                             const Elem16* a1, Elem16* d1, const Elem16* a2, Elem16* d2, GemmPointers g1,
                             GemmPointers g2) {
  extern __shared__ int32_t smem[];
  int32_t* count = smem;       // E
  int32_t* offset = smem + E;  // E
  int32_t* routed = smem + 2 * E;  // 1: the pairs with an id in [0, E)
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = topk_ids[p];
    if (e >= 0 && e < E) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int e = 0; e < E; ++e) {
      offset[e] = run;
      run += count[e];
    }
    *routed = run;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int64_t off = offset[e];
    g1.problem[e] = UnderlyingProblemShape{N1, count[e], K1};
    g1.b[e] = w13 + int64_t(e) * N1 * K1 * bits / 8;
    g1.s[e] = s13 + int64_t(e) * G1 * N1;
    g1.z[e] = z13 == nullptr ? nullptr : z13 + int64_t(e) * G1 * N1;
    g1.a[e] = a1 + off * K1;
    g1.d[e] = d1 + off * N1;
    g2.problem[e] = UnderlyingProblemShape{N2, count[e], K2};
    g2.b[e] = w2 + int64_t(e) * N2 * K2 * bits / 8;
    g2.s[e] = s2 + int64_t(e) * G2 * N2;
    g2.z[e] = z2 == nullptr ? nullptr : z2 + int64_t(e) * G2 * N2;
    g2.a[e] = a2 + off * K2;
    g2.d[e] = d2 + off * N2;
    count[e] = 0;  // reused as each expert's cursor below
  }
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = topk_ids[p];
    if (e < 0 || e >= E) {
      pair_row[p] = -1;
      continue;
    }
    const int32_t row = offset[e] + atomicAdd(&count[e], 1);
    pair_row[p] = row;
    row_token[row] = p / top_k;
  }
  // the rows past the routed ones (as many as padding pairs) are gathered from token 0 and never read by a GEMM
  for (int row = *routed + threadIdx.x; row < pairs; row += blockDim.x) row_token[row] = 0;
}

// a1[row] = x[row_token[row]]: one block per row, 16-byte copies (H % 8 == 0)
__global__ void gather_rows_kernel(const int4* __restrict__ x, const int32_t* __restrict__ row_token,
                                   int4* __restrict__ a1, int vecs_per_row) {
  const int64_t row = blockIdx.x;
  const int4* src = x + int64_t(row_token[row]) * vecs_per_row;
  int4* dst = a1 + row * vecs_per_row;
  for (int v = threadIdx.x; v < vecs_per_row; v += blockDim.x) dst[v] = src[v];
}

// a pair of 16-bit values (__nv_bfloat162 or __half2) to and from float
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
template <class T2>
__device__ __forceinline__ T2 from_floats(float a, float b);
template <>
__device__ __forceinline__ __nv_bfloat162 from_floats<__nv_bfloat162>(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ __half2 from_floats<__half2>(float a, float b) {
  return __floats2half2_rn(a, b);
}

// eight 16-bit values, one 16-byte load or store
template <class T2>
union Vec8 {
  int4 vec;
  T2 pair[4];
};

// a2[r, i] = silu(h[r, i]) * h[r, I + i], in float, rounded once: one block per row, eight values a thread
// (I % 8 == 0); T2 the pair type of the activations
template <class T2>
__global__ void silu_mul_kernel(const int4* __restrict__ h, int4* __restrict__ a2, int vecs_per_half) {
  const int64_t row = blockIdx.x;
  const int4* gate = h + row * 2 * vecs_per_half;
  for (int v = threadIdx.x; v < vecs_per_half; v += blockDim.x) {
    Vec8<T2> g, u, o;
    g.vec = gate[v];
    u.vec = gate[vecs_per_half + v];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 gf = to_float2(g.pair[j]), uf = to_float2(u.pair[j]);
      o.pair[j] = from_floats<T2>(gf.x / (1.0f + __expf(-gf.x)) * uf.x, gf.y / (1.0f + __expf(-gf.y)) * uf.y);
    }
    a2[row * vecs_per_half + v] = o.vec;
  }
}

// out[t, :] = sum_j w[t, j] * d2[pair_row[t * top_k + j], :] in float over the routed pairs (pair_row >= 0):
// one block per token, eight values a thread (H % 8 == 0); a token with no routed pair gets zeros
template <class T2>
__global__ void combine_kernel(const int4* __restrict__ d2, const int32_t* __restrict__ pair_row,
                               const float* __restrict__ topk_w, int4* __restrict__ out, int top_k, int vecs_per_row) {
  const int64_t t = blockIdx.x;
  for (int v = threadIdx.x; v < vecs_per_row; v += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < top_k; ++j) {
      const int32_t row = pair_row[t * top_k + j];
      if (row < 0) continue;  // a padding pair (id outside [0, E)): adds nothing
      const float w = topk_w[t * top_k + j];
      Vec8<T2> d;
      d.vec = d2[int64_t(row) * vecs_per_row + v];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = to_float2(d.pair[q]);
        acc[2 * q] += w * f.x;
        acc[2 * q + 1] += w * f.y;
      }
    }
    Vec8<T2> o;
#pragma unroll
    for (int q = 0; q < 4; ++q) o.pair[q] = from_floats<T2>(acc[2 * q], acc[2 * q + 1]);
    out[t * vecs_per_row + v] = o.vec;
  }
}

// ------------------------------------------------------------------------------------------ the layer

static int sm_count(int device) {
  static int counts[64] = {0};
  if (counts[device] == 0) cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device);
  return counts[device];
}

template <int TileN, Act A, bool Z, int Bits>
static void launch_tile(GroupedArgs& g, const torch::Device& device) {
  if constexpr (tile_is_built(TileN, A, Z, Bits)) {
    const size_t bytes = grouped_workspace_bytes<TileN, A, Z, Bits>(g);
    auto ws = torch::empty({int64_t(bytes) + 1}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
    g.workspace = ws.data_ptr();
    const char* why = run_grouped<TileN, A, Z, Bits>(g);
    TORCH_CHECK(why == nullptr, "grouped GEMM with a ", TileN, "-token tile: ", why);
  } else {
    TORCH_CHECK(false, "the ", TileN, "-token tile is not built for int", Bits, " x ",
                A == Act::kFp16 ? "fp16" : "bf16", Z ? " with zero points" : "", " (hopper_ops.BUILT_TILES)");
  }
}

template <Act A, bool Z, int Bits>
static void launch(GroupedArgs& g, int tile, const torch::Device& device) {
  switch (tile) {
    case 32: return launch_tile<32, A, Z, Bits>(g, device);
    case 64: return launch_tile<64, A, Z, Bits>(g, device);
    case 128: return launch_tile<128, A, Z, Bits>(g, device);
    case 256: return launch_tile<256, A, Z, Bits>(g, device);
    default: TORCH_CHECK(false, "tile ", tile, " is not one of 32, 64, 128, 256");
  }
}

template <Act A>
static void launch(GroupedArgs& g, bool zero, int bits, int tile, const torch::Device& device) {
  if (bits == 8) {
    zero ? launch<A, true, 8>(g, tile, device) : launch<A, false, 8>(g, tile, device);
  } else {
    zero ? launch<A, true, 4>(g, tile, device) : launch<A, false, 4>(g, tile, device);
  }
}

// The layer: x (M, H) bf16 or fp16, topk_ids (M, top_k) int32, topk_w (M, top_k) float32; w13 / w2 prepared
// (prepare_weights, `bits`-bit), s13 (E, G1, 2I) / s2 (E, G2, H) in x's type (bf16 or fp16), z13 / z2 zero tables
// (refused: no zero-point build is made; the routing and launch keep their plumbing for a CUTLASS whose grouped zero
// mode sets up the scales' descriptor), consts (layer_constants). tile1 / tile2: each
// GEMM's token-tile width. stages < 6 stops after that many of route (1), gather (2), GEMM1 (3), activation
// (4), GEMM2 (5) and returns an empty output: a time breakdown by differences.
torch::Tensor moe_forward(torch::Tensor x, torch::Tensor topk_ids, torch::Tensor topk_w, torch::Tensor w13,
                          torch::Tensor s13, torch::Tensor w2, torch::Tensor s2, std::optional<torch::Tensor> z13,
                          std::optional<torch::Tensor> z2, torch::Tensor consts, int64_t bits, int64_t group1,
                          int64_t group2, int64_t tile1, int64_t tile2, int64_t stages) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kBFloat16 || dtype == torch::kHalf) && x.is_contiguous() && x.size(1) % 8 == 0,
              "x must be contiguous bf16 or fp16 with H % 8 == 0");
  const bool fp16 = dtype == torch::kHalf;
  TORCH_CHECK(topk_ids.scalar_type() == torch::kInt32 && topk_ids.is_contiguous(), "topk_ids must be contiguous int32");
  TORCH_CHECK(topk_w.scalar_type() == torch::kFloat32 && topk_w.is_contiguous(), "topk_w must be contiguous float32");
  const int64_t M = x.size(0), H = x.size(1), top_k = topk_ids.size(1), pairs = M * top_k;
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, not ", bits);
  const int64_t E = w13.size(0), N1 = w13.size(1), I = N1 / 2, N2 = w2.size(1), K2 = w2.size(2) * 8 / bits;
  TORCH_CHECK(w13.size(2) * 8 / bits == H && N2 == H && K2 == I && w2.size(0) == E,
              "w13 must be (E, 2I, H * bits / 8) and w2 (E, H, I * bits / 8) for x (M, H) and ", bits, "-bit weights");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == M && topk_w.sizes() == topk_ids.sizes(),
              "topk_ids and topk_w must be (M, top_k)");
  TORCH_CHECK(s13.scalar_type() == dtype && s2.scalar_type() == dtype && s13.dim() == 3 && s2.dim() == 3 &&
                  s13.size(0) == E && s2.size(0) == E && s13.size(2) == N1 && s2.size(2) == H,
              "scales must be (E, G1, 2I) and (E, G2, H) in x's dtype");
  const int64_t G1 = s13.size(1), G2 = s2.size(1);
  TORCH_CHECK(G1 * group1 == H && G2 * group2 == I, "group sizes ", group1, "/", group2, " do not tile K=", H, "/", I);
  const bool zero = z13.has_value() || z2.has_value();
  TORCH_CHECK(!zero, "zero tables: no zero-point build (tile_is_built); give int4 zero points as int8 q - z");
  TORCH_CHECK(E <= 4096, "at most 4096 experts (the routing block's shared memory)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "x must be 16-byte aligned");
  auto opts = x.options();
  auto i32 = opts.dtype(torch::kInt32);
  auto out = torch::empty({stages >= 6 ? M : 0, H}, opts);
  if (M == 0) return out;
  auto pair_row = torch::empty({pairs}, i32);
  auto row_token = torch::empty({pairs}, i32);
  auto a1 = torch::empty({pairs, H}, opts);
  auto d1 = torch::empty({pairs, N1}, opts);
  auto a2 = torch::empty({pairs, I}, opts);
  auto d2 = torch::empty({pairs, H}, opts);
  auto ptrs = torch::empty({2, 5, E}, opts.dtype(torch::kInt64));  // b, a, s, d, z of each GEMM
  auto problems = torch::empty({2, E, 3}, i32);
  auto* p64 = ptrs.data_ptr<int64_t>();
  auto* pr = reinterpret_cast<UnderlyingProblemShape*>(problems.data_ptr<int32_t>());
  GemmPointers g[2];
  for (int i = 0; i < 2; ++i) {
    g[i].b = reinterpret_cast<const void**>(p64 + (i * 5 + 0) * E);
    g[i].a = reinterpret_cast<const Elem16**>(p64 + (i * 5 + 1) * E);
    g[i].s = reinterpret_cast<const Elem16**>(p64 + (i * 5 + 2) * E);
    g[i].d = reinterpret_cast<Elem16**>(p64 + (i * 5 + 3) * E);
    g[i].z = reinterpret_cast<const Elem16**>(p64 + (i * 5 + 4) * E);
    g[i].problem = pr + i * E;
  }
  route_kernel<<<1, 1024, (2 * E + 1) * sizeof(int32_t), stream>>>(
      topk_ids.data_ptr<int32_t>(), int(pairs), int(top_k), int(E), int(N1), int(H), int(N2), int(K2), int(G1),
      int(G2), int(bits), pair_row.data_ptr<int32_t>(), row_token.data_ptr<int32_t>(), w13.data_ptr<uint8_t>(),
      reinterpret_cast<const Elem16*>(s13.data_ptr()), w2.data_ptr<uint8_t>(),
      reinterpret_cast<const Elem16*>(s2.data_ptr()),
      zero ? reinterpret_cast<const Elem16*>(z13->data_ptr()) : nullptr,
      zero ? reinterpret_cast<const Elem16*>(z2->data_ptr()) : nullptr, reinterpret_cast<const Elem16*>(a1.data_ptr()),
      reinterpret_cast<Elem16*>(d1.data_ptr()), reinterpret_cast<const Elem16*>(a2.data_ptr()),
      reinterpret_cast<Elem16*>(d2.data_ptr()), g[0], g[1]);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (stages < 2) return out;
  gather_rows_kernel<<<int(pairs), 128, 0, stream>>>(reinterpret_cast<const int4*>(x.data_ptr()),
                                                     row_token.data_ptr<int32_t>(),
                                                     reinterpret_cast<int4*>(a1.data_ptr()), int(H / 8));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (stages < 3) return out;
  uint8_t* cursor = consts.data_ptr<uint8_t>();
  GemmArrays c[2];  // the layouts' type (and so the arrays' offsets) depends on the bits
  for (auto& gemm : c) gemm = bits == 8 ? carve_arrays<8>(cursor, E) : carve_arrays<4>(cursor, E);
  const int group_size[2] = {int(group1), int(group2)};
  const int64_t tiles[2] = {tile1, tile2};
  for (int i = 0; i < 2; ++i) {
    if (i == 1) {
      if (stages < 4) return out;
      auto* h = reinterpret_cast<const int4*>(d1.data_ptr());
      auto* a = reinterpret_cast<int4*>(a2.data_ptr());
      if (fp16) {
        silu_mul_kernel<__half2><<<int(pairs), 128, 0, stream>>>(h, a, int(I / 8));
      } else {
        silu_mul_kernel<__nv_bfloat162><<<int(pairs), 128, 0, stream>>>(h, a, int(I / 8));
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (stages < 5) return out;
    }
    GroupedArgs args;
    args.num_groups = int(E);
    args.problems = g[i].problem;
    args.b = reinterpret_cast<const void**>(g[i].b);
    args.layout_b = c[i].lb;
    args.a = reinterpret_cast<const void**>(g[i].a);
    args.stride_a = c[i].sa;
    args.s = reinterpret_cast<const void**>(g[i].s);
    args.stride_s = c[i].ss;
    args.group_size = group_size[i];
    args.d = reinterpret_cast<void**>(g[i].d);
    args.stride_d = c[i].sd;
    args.stride_c = c[i].sc;
    args.device = x.device().index();
    args.sm_count = sm_count(args.device);
    args.stream = stream;
    args.z = reinterpret_cast<const void**>(g[i].z);
    const int tile = int(tiles[i]);
    if (fp16) {
      launch<Act::kFp16>(args, zero, int(bits), tile, x.device());
    } else {
      launch<Act::kBf16>(args, zero, int(bits), tile, x.device());
    }
  }
  if (stages < 6) return out;
  auto* d = reinterpret_cast<const int4*>(d2.data_ptr());
  auto* o = reinterpret_cast<int4*>(out.data_ptr());
  if (fp16) {
    combine_kernel<__half2><<<int(M), 128, 0, stream>>>(d, pair_row.data_ptr<int32_t>(), topk_w.data_ptr<float>(),
                                                        o, int(top_k), int(H / 8));
  } else {
    combine_kernel<__nv_bfloat162><<<int(M), 128, 0, stream>>>(d, pair_row.data_ptr<int32_t>(),
                                                               topk_w.data_ptr<float>(), o, int(top_k), int(H / 8));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace wna16_hopper

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prepare_weights", &wna16_hopper::prepare_weights, "signed, reordered int4 / int8 weights (E, N, K * bits / 8)");
  m.def("layer_constants", &wna16_hopper::layer_constants, "per-expert strides and layouts of both GEMMs");
  m.def("moe_forward", &wna16_hopper::moe_forward, "the routed-experts layer (stages < 6: a prefix of it)");
}
