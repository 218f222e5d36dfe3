#!/usr/bin/env bash
# Build CUTLASS's Hopper mixed-input grouped GEMM example (int4 x bf16, example 69 of the nvidia-cutlass wheel's
# sources) for sm90a, here, without a GPU: a probe of what a TMA + wgmma + warp-specialised grouped kernel does on
# MoE-shaped GEMMs before the plugin builds on it (issue 23). About 2 minutes on 2 cores.
#   bash bench/cutlass_probe/build.sh [OUT_DIR]     # default .cutlass-probe (ignored by git; carry it)
# then on the GPU machine: bash .cutlass-probe/run.sh  (run.sh is copied beside the binary)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=$(realpath -m "${1:-.cutlass-probe}")
version=${CUTLASS_WHEEL_VERSION:-4.2.0.0}
mkdir -p "$out/src"
python3 -m pip download -q --no-deps "nvidia-cutlass==$version" -d "$out/src" 2>/dev/null
python3 - "$out/src" <<'PY'
import glob, sys, zipfile
zipfile.ZipFile(glob.glob(sys.argv[1] + "/nvidia_cutlass-*.whl")[0]).extractall(sys.argv[1])
PY
src="$out/src/cutlass_library/source"
ex="$src/examples/69_hopper_mixed_dtype_grouped_gemm"
# the example's random fill includes curand_kernel.h: the CUDA toolkit's, else nvidia-curand's wheel (CUDA 13)
curand="$(dirname "$(command -v nvcc)")/../include"
if [ ! -f "$curand/curand_kernel.h" ]; then
  python3 -m pip download -q --no-deps "nvidia-curand==${CURAND_WHEEL_VERSION:-10.4.0.35}" -d "$out/src" 2>/dev/null
  python3 - "$out/src" <<'PY'
import glob, sys, zipfile
zipfile.ZipFile(glob.glob(sys.argv[1] + "/nvidia_curand-*.whl")[0]).extractall(sys.argv[1] + "/curand")
PY
  curand=$(dirname "$(find "$out/src/curand" -name curand_kernel.h | head -1)")
fi
# one binary per token tile (the MMA's N side: the example's 16, and wider tiles for 32-64 tokens per expert)
for n in ${CUTLASS_PROBE_TILE_N:-16 32 64}; do
  sed "s/using TileShape           = Shape<_128,_16,/using TileShape           = Shape<_128,_${n},/" \
    "$ex/69_hopper_int4_bf16_grouped_gemm.cu" > "$ex/probe_n$n.cu"
  grep -q "Shape<_128,_${n}," "$ex/probe_n$n.cu" || { echo "the example's TileShape line changed: edit build.sh"; exit 1; }
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -DNDEBUG \
    -I "$src/include" -I "$src/tools/util/include" -I "$src/examples/common" -I "$ex" -isystem "$curand" \
    -o "$out/ex69_n$n" "$ex/probe_n$n.cu" 2>"$out/build-warnings-n$n.log"
  echo "built $out/ex69_n$n ($(du -h "$out/ex69_n$n" | cut -f1))"
done
cp "$here/run.sh" "$out/run.sh"
rm -rf "$out/src"
echo "on the GPU: bash $(basename "$out")/run.sh"
