// CUTLASS's weight reorder (cutlass::reorder_tensor, mixed_dtype_utils.hpp) run on the host, thread by thread as its
// kernel runs on the GPU, for the hopper kernel's layouts (grouped_gemm.cuh: LayoutAtomQuant, reorder_k), to check
// what prepare_weights relies on without a GPU (tests/kernels/test_hopper_reorder.py):
//
//   raw   K: the copy over an (N, K) expert: the bytes it writes past N * K * Bits / 8 (CUTLASS's over-reach)
//   padded K: the copy over (N, reorder_k(K)), kept to its first N * K * Bits / 8 bytes (prepare_weights): every value
//             at the (N, K) layout's offset, and nothing written past the padded expert
//
// Prints one line per case: "bits N K past_raw past_padded misplaced".
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "grouped_gemm.cuh"

using namespace cute;
using namespace wna16_hopper;

// reorder_tensor's kernel (one 16-row block per blockIdx.x, 128 threads), run block by block on the host
template <int Bits, class LayoutSrc, class LayoutDst>
static void host_reorder(const uint8_t* src, LayoutSrc layout_src, uint8_t* dst, LayoutDst layout_dst) {
  using T = QuantType<Bits>;
  auto S = make_tensor(make_gmem_ptr<T const>(reinterpret_cast<T const*>(src)), layout_src);
  auto D = make_tensor(make_gmem_ptr<T>(reinterpret_cast<T*>(dst)), layout_dst);
  auto has_major_mode = [](auto s) { return any_of(flatten(s), [](auto a) { return is_constant<1, decltype(a)>{}; }); };
  constexpr int NV = shape_div(Int<8>{}, Int<sizeof_bits_v<T>>{});
  auto val_layout = conditional_return<has_major_mode(stride<0>(LayoutDst{}))>(
      make_layout(make_shape(Int<NV>{}, Int<1>{}), GenColMajor{}),
      make_layout(make_shape(Int<1>{}, Int<NV>{}), GenRowMajor{}));
  auto tiled_copy = make_tiled_copy(Copy_Atom<DefaultCopy, T>{}, make_layout(make_shape(Int<1>{}, Int<128>{})), val_layout);
  using TileShape = Shape<_16>;
  auto tiled_D = group_modes<3, rank_v<LayoutDst>>(tiled_divide(D, TileShape{}));
  for (int bx = 0; bx < int(size<1>(tiled_D)); ++bx)
    for (int bz = 0; bz < int(size<3>(tiled_D)); ++bz) {
      Tensor gS = local_tile(S, TileShape{}, make_coord(bx, _, bz));
      Tensor gD = local_tile(D, TileShape{}, make_coord(bx, _, bz));
      for (int t = 0; t < 128; ++t) {
        auto thr = tiled_copy.get_slice(t);
        Tensor tS = thr.partition_S(gS);
        Tensor tD = thr.partition_D(gD);
        copy(tiled_copy, tS, tD);
      }
    }
}

template <int Bits>
static auto layouts(int N, int K) {
  auto shape = make_shape(N, K, Int<1>{});
  return std::make_pair(make_layout(shape, cutlass::make_cute_packed_stride(StrideB{}, make_shape(N, K, 1))),
                        tile_to_shape(LayoutAtomQuant<Bits>{}, shape));
}

// bytes of buf[from, to) that are no longer `canary`
static long changed(const std::vector<uint8_t>& buf, long from, long to, uint8_t canary) {
  long n = 0;
  for (long i = from; i < to; ++i) n += buf[i] != canary;
  return n;
}

template <int Bits>
static void run(int N, int K) {
  using T = QuantType<Bits>;
  const long bytes = long(N) * K * Bits / 8, Kp = reorder_k(K), padded = long(N) * Kp * Bits / 8;
  const long slack = padded - bytes + 4096;
  const uint8_t canary = 0xA5;
  std::vector<uint8_t> src(padded + slack, 0);
  uint64_t state = 0x9E3779B97F4A7C15ull ^ (uint64_t(N) << 20) ^ K;
  for (long i = 0; i < bytes; ++i) src[i] = uint8_t((state = state * 6364136223846793005ull + 1442695040888963407ull) >> 56);
  // raw K: CUTLASS's copy over the (N, K) expert
  auto [lb, lr] = layouts<Bits>(N, K);
  std::vector<uint8_t> raw(bytes + slack, canary);
  host_reorder<Bits>(src.data(), lb, raw.data(), lr);
  const long past_raw = changed(raw, bytes, bytes + slack, canary);
  // padded K (prepare_weights): each row's K values, then Kp - K zero values
  std::vector<uint8_t> src_p(padded + slack, 0), out_p(padded + slack, canary);
  for (int n = 0; n < N; ++n)
    std::copy(src.begin() + long(n) * K * Bits / 8, src.begin() + long(n + 1) * K * Bits / 8,
              src_p.begin() + long(n) * Kp * Bits / 8);
  auto [lbp, lrp] = layouts<Bits>(N, int(Kp));
  host_reorder<Bits>(src_p.data(), lbp, out_p.data(), lrp);
  const long past_padded = changed(out_p, padded, padded + slack, canary);
  // the kept bytes against the (N, K) layouts: every value where the kernel's layout (layout_b) reads it
  auto S = make_tensor(make_gmem_ptr<T const>(reinterpret_cast<T const*>(src.data())), lb);
  auto D = make_tensor(make_gmem_ptr<T const>(reinterpret_cast<T const*>(out_p.data())), lr);
  long misplaced = 0;
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) misplaced += !(T(D(n, k, 0)) == T(S(n, k, 0))) || long(lr(n, k, 0)) >= long(N) * K;
  printf("%d %d %d %ld %ld %ld\n", Bits, N, K, past_raw, past_padded, misplaced);
}

int main(int argc, char** argv) {
  for (int i = 1; i + 2 < argc; i += 3) {
    const int bits = atoi(argv[i]), N = atoi(argv[i + 1]), K = atoi(argv[i + 2]);
    bits == 4 ? run<4>(N, K) : run<8>(N, K);
  }
  return 0;
}
