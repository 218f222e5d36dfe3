#!/usr/bin/env bash
# CUTLASS's headers for the GPU machine (no network there): the nvidia-cutlass 4.2 wheel's include/ and
# tools/util/include/, xz-compressed to about 1 MB in .cutlass/ (gitignored). Carry ".cutlass" in a device call;
# bench/gpu_session.sh unpacks it and sets CUTLASS_DIR, so its build includes the hopper kernels.
#   bash bench/cutlass_headers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps nvidia-cutlass==4.2.0.0 -d "$tmp"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$tmp"/nvidia_cutlass-*.whl "$tmp/x"
mkdir -p .cutlass
tar cJf .cutlass/cutlass-headers.tar.xz -C "$tmp/x/cutlass_library/source" include/cute include/cutlass tools/util/include
ls -l .cutlass/cutlass-headers.tar.xz
