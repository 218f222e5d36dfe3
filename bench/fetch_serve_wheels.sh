#!/usr/bin/env bash
# Downloads (here, with PyPI) the wheels `vllm serve` needs on the GPU machine that neither its image
# nor the vLLM bundle (.vb) holds, into .whl/ (git-ignored; carry it with .vb). gpu_session.sh
# installs them. Found on 2026-12-03: `vllm serve` failed there with "No module named 'uvicorn'";
# the others are imported on the same server path (vllm/entrypoints/**).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  uvicorn==0.55.0 prometheus-fastapi-instrumentator==8.1.0 model-hosting-container-standards==0.1.16 \
  watchfiles==1.3.0 jmespath==1.1.0 supervisor==4.3.0
ls .whl
