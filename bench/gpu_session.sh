#!/usr/bin/env bash
# One GPU-machine session: bring vLLM (the bundle in $VB: .vb = 0.26.0 by default, VB=.vb34 for 0.34.0),
# install the plugin (entry point), then run the steps named on the command line. Logs and results go to $OUT (the device tool brings back at most
# 8 files, 2 folders deep).
#   BENCH_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_session.sh tests e2e   # run from here, in the command
#   bash bench/gpu_session.sh tune bench                  # tune Triton configs, then the layer benchmark
#   E2E_ARGS="-k 'gptq-gs32-k2048 or serve'" bash bench/gpu_session.sh e2e
#   E2E_JOBS=8 bash bench/gpu_session.sh e2e               # 8 LLM(...) runs share the GPU at a time
#   E2E_JOBS=12 bash bench/gpu_session.sh e2e-par          # the whole tier, two pytest processes side by side
#   E2E_GEN_ARGS="-k 'desc-act'" E2E_REST_PATHS=tests/e2e/test_serve.py bash bench/gpu_session.sh e2e-par  # a subset
#   E2E_PARTS="gen|12|tests/e2e/test_llm_generate.py|-k gptq;serve|1|tests/e2e/test_serve.py|" bash bench/gpu_session.sh e2e-par
#   bash bench/gpu_session.sh probe inspect               # CUDA op refusals; vLLM's inspection subprocess
#   VB=.vb34 bash bench/gpu_session.sh tests-par e2e-par   # on vLLM 0.34 (carry .vb34/part-1, .vb34/install.sh)
#   bash bench/gpu_session.sh e2e-bench                   # bench/e2e.py (offline throughput)
#   BREAKDOWN_ARGS='--m 2,8' bash bench/gpu_session.sh breakdown   # kernel times of a layer call
#   FLOOR_ARGS='--experts 2,8' bash bench/gpu_session.sh floor      # the read floor of a call's bytes
#   BENCH_ARGS='--catalog dev --tp 1,2,4,8 --m 1,4,16,64,256' bash bench/gpu_session.sh bench   # the rules' dev set
#   BENCH_ARGS='--catalog dev --tag=-a ;; --catalog validation --tag=-b' bash bench/gpu_session.sh bench  # two runs
#   USER_TUNE_MODEL=Mixtral-8x22B bash bench/gpu_session.sh user-tune   # vllm-wna16 tune on a catalog model
#   PY_SCRIPT="bench/hopper_group_diag.py --seeds 20" bash bench/gpu_session.sh py   # a script beside the bundle's vLLM
# The lent machine's copy of the tree has no .git: BENCH_COMMIT names the commit in result files.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export BENCH_COMMIT=${BENCH_COMMIT:-}  # names the commit in result files (else git HEAD)
VB=${VB:-.vb}
source "$VB/install.sh" >/dev/null 2>/tmp/install.log || { cat /tmp/install.log; exit 1; }
python3 -c "import vllm, torch; print('vLLM', vllm.__version__, 'on torch', torch.__version__, '(bundle $VB)')"
# humming-kernels for the plugin's humming backend beside the 0.26 bundle (the 0.34 bundle has it), as a wheel in .hw
if ls .hw/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-hw .hw/*.whl \
    && export PYTHONPATH=/tmp/site-hw${PYTHONPATH:+:$PYTHONPATH}
fi
# The bundle has no flash-attn kernels, and vllm/vllm_flash_attn raises ImportError at import when they
# are missing; vLLM 0.26's Qwen3-MoE module imports it (through mm_encoder_attention), so LLM(...) failed
# in model inspection. The runs here use TRITON_ATTN and never call flash-attn: let the import succeed.
# (bench/vllm_bundle/ bundles, e.g. 0.34.0's, come with this guard already turned off.)
fa=$(python3 -c "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])")/vllm_flash_attn/__init__.py
sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:  # gpu_session.sh: bundle without flash-attn kernels/' "$fa"
# vLLM 0.34's kernel warmup imports MiniMax-M3's MSA kernels on every CUDA run, and with them the CUTLASS
# DSL (nvidia-cutlass-dsl, 486 MB: not in the bundle, not on the machine). Those kernels only serve MiniMax-M3:
# without the DSL the warmup is skipped (2026-12-05: every LLM(...) run failed with "No module named 'cutlass'").
kw=$(dirname "$(dirname "$fa")")/model_executor/warmup/kernel_warmup.py
if [ -f "$kw" ] && ! python3 -c "import cutlass" 2>/dev/null; then
  python3 - "$kw" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
old = "        # The MSA kernels, and the CuTe DSL their modules import, are CUDA-only.\n"
if old in s and "gpu_session.sh" not in s:
    i = s.index(old)
    head = s.rfind("    if current_platform.is_cuda():\n", 0, i)
    s = s[:head] + "    if False:  # gpu_session.sh: no CUTLASS DSL on the machine (MiniMax-M3 MSA warmup only)\n" + s[head + len("    if current_platform.is_cuda():\n"):]
    open(p, "w").write(s)
PY
fi
# CUTLASS's headers for the hopper kernels (carry .cutlass, made here by bench/cutlass_headers.sh)
if [ -z "${CUTLASS_DIR:-}" ] && [ -f .cutlass/cutlass-headers.tar.xz ]; then
  mkdir -p /tmp/cutlass-h && tar xJf .cutlass/cutlass-headers.tar.xz -C /tmp/cutlass-h && export CUTLASS_DIR=/tmp/cutlass-h
fi
# builds csrc/ for sm90 on the machine's 16 cores (the `cuda` backend, and the `hopper` one where CUTLASS_DIR is
# set); the log says if it could not.
# A call chained within 30 s finds the machine warm: the editable install and the ignored _C*.so are still
# there, so the build is skipped when csrc/ and setup.py are unchanged (the stamp lives in /tmp).
stamp=$( (cat setup.py pyproject.toml csrc/* csrc/hopper/* 2>/dev/null; echo "cutlass=${CUTLASS_DIR:-none}") | sha256sum | cut -c1-16)
if [ "$(cat /tmp/wna16-build-stamp 2>/dev/null)" = "$stamp" ] && ls vllm_wna16_plugin/_C*.so >/dev/null 2>&1 \
   && python3 -c "import importlib.metadata as m; m.version('vllm-wna16-plugin')" 2>/dev/null; then
  echo "plugin: warm machine, csrc/ unchanged: build skipped"
else
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=16 python3 -m pip install -q --no-deps --no-build-isolation \
    --no-index -e . >/tmp/pip.log 2>&1 || cat /tmp/pip.log
  grep -h "vllm-wna16-plugin:" /tmp/pip.log 2>/dev/null | head -2
  echo "$stamp" >/tmp/wna16-build-stamp
fi
echo "[set-up done at ${SECONDS} s]"
python3 -c "from vllm_wna16_plugin.kernels.cuda_ops import extension_error as e; print('CUDA ops:', e() or 'built')"
python3 -c "from vllm_wna16_plugin.kernels.hopper_ops import extension_error as e; print('hopper kernels:', e() or 'built')"
# vllm serve's modules the bundle lacks (uvicorn, ...), carried as wheels in .whl (see docs/gpu-machine.md)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-extra .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site-extra
fi
# nor flashinfer: vLLM's sampler imports it unless told not to
export VLLM_USE_FLASHINFER_SAMPLER=0
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
rc=0
for step in "$@"; do
  t_step=$SECONDS
  case "$step" in
    # every GEMM launch of profile_kernels.py's providers (3 x --iters 3 x 2 GEMMs), matched on the base
    # function name: vLLM's Marlin MoE kernel is `Marlin`, its weight repack (not wanted) `gptq_marlin_repack_kernel`
    profile) ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null) || { echo "no ncu on this machine"; continue; }
             timeout ${PROFILE_TIMEOUT:-300} "$ncu" --kernel-name regex:'moe_wna16_mma|moe_wna16_stream|moe_wna16_gemv|_fused_moe_wna16|^Marlin' --launch-skip 0 --launch-count ${PROFILE_LAUNCHES:-18} \
               --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
               --section Occupancy --section LaunchStats ${PROFILE_SECTIONS:-} python3 bench/profile_kernels.py ${PROFILE_ARGS:-} 2>&1 \
               | grep --line-buffered -v "^INFO\|^WARNING" | tee "$OUT/profile.log" | tail -60 ;;
    toolchain) bash bench/probe_toolchain.sh 2>&1 | tee "$OUT/probe_toolchain.log" ;;
    serve-import) python3 -c "import vllm.entrypoints.openai.api_server; print('vllm serve imports: ok')" 2>&1 | tail -4 ;;
    abi) timeout 300 python3 bench/probe_abi.py 2>&1 | tee "$OUT/probe_abi.log" | tail -60 ;;
    probe) timeout 120 python3 bench/probe_refusals.py 2>&1 | tee "$OUT/probe.log" | tail -12 ;;
    # vLLM inspects lazily registered models in `python -m vllm.model_executor.models.registry`: its stderr
    inspect) timeout 120 python3 -c "import vllm.model_executor.models.registry as r; print('inspection subprocess:', r._run_in_subprocess(lambda: 'ok'))" 2>&1 | grep -v "^INFO\|^WARNING" | tail -30 ;;
    tests) eval "timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -m gpu tests/kernels -p no:cacheprovider -rs ${TESTS_ARGS:-}" 2>&1 | grep --line-buffered -v "^INFO\|^WARNING" | tee "$OUT/gpu_tests.log" | tail -25 || rc=1 ;;
    # the GPU kernel tests in four pytest processes side by side (the Triton compiles spread over the
    # 16 cores): the CUDA ops, the backend tests split into their Triton and other halves, and the
    # asymmetric GPTQ linear layers (vLLM's Marlin / exllama kernels)
    tests-par) pids=()
               shards=("cuda_ops|tests/kernels/test_cuda_ops_gpu.py|" "backends_triton|tests/kernels/test_backends_gpu.py|-k triton"
                       "backends_other|tests/kernels/test_backends_gpu.py|-k 'not triton'" "linear|tests/test_gptq_linear.py|")
               for shard in "${shards[@]}"; do
                 IFS='|' read -r n f sel <<<"$shard"
                 ( eval "timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -m gpu $f $sel -p no:cacheprovider -rs ${TESTS_ARGS:-}" 2>&1 \
                     | grep -v "^INFO\|^WARNING" >"$OUT/gpu_tests_$n.log"; exit "${PIPESTATUS[0]}" ) & pids+=($!)
               done
               for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
               for f in "$OUT"/gpu_tests_*.log; do echo "== $(basename "$f")"; grep -E "FAILED|Error|passed|failed" "$f" | tail -12; done ;;
    # the whole tier in one call: test_llm_generate.py (its runs E2E_JOBS at a time) beside the other
    # modules (serve, bad input, TP, asymmetric linears, Humming and Marlin composition), two pytest processes, each
    # with its own log and record. E2E_PARTS="name|jobs|paths|selection;..." runs other parts side by side.
    e2e-par) pids=(); parts=()
             rest=${E2E_REST_PATHS:-"tests/e2e/test_bad_input.py tests/e2e/test_serve.py tests/e2e/test_tensor_parallel.py tests/e2e/test_gptq_asym_linear.py tests/e2e/test_humming_compose.py tests/e2e/test_marlin_compose.py tests/e2e/test_hopper_compose.py"}
             if [ -n "${E2E_PARTS:-}" ]; then IFS=';' read -ra parts <<<"$E2E_PARTS"
             else parts=("gen|${E2E_JOBS:-12}|tests/e2e/test_llm_generate.py|${E2E_GEN_ARGS:-${E2E_ARGS:-}}" "rest|1|$rest|${E2E_ARGS:-}"); fi
             names=()
             for part in "${parts[@]}"; do
               IFS='|' read -r name jobs paths sel <<<"$part"; names+=("$name")
               ( export E2E_RECORD="$OUT/e2e-record-$name.jsonl" E2E_JOBS=$jobs
                 eval "timeout ${E2E_TIMEOUT:-540} python3 -m pytest -q -m gpu $paths -p no:cacheprovider -rsx $sel" 2>&1 \
                   | grep -v "^WARNING" >"$OUT/e2e-$name.log"; exit "${PIPESTATUS[0]}" ) & pids+=($!)
             done
             for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
             for name in "${names[@]}"; do echo "== e2e-$name"; grep -E "^(FAILED|ERROR)| in [0-9.]+s" "$OUT/e2e-$name.log" | tail -15; done ;;
    e2e-bench) timeout ${E2E_BENCH_TIMEOUT:-540} python3 bench/e2e.py --out "$OUT/res" ${E2E_BENCH_ARGS:-} 2>&1 | grep --line-buffered -v "^INFO\|^WARNING\|^DEBUG" | tee "$OUT/e2e-bench.log" | tail -30 ;;
    tune) timeout ${TUNE_TIMEOUT:-300} python3 bench/tune.py --out vllm_wna16_plugin/kernels/triton/configs ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | tail -30
          tar czf "$OUT/configs.tgz" -C vllm_wna16_plugin/kernels/triton configs ;;
    # each kernel's device time in a layer call, beside the call's graph time (bench/kernel_breakdown.py)
    breakdown) timeout ${BREAKDOWN_TIMEOUT:-240} python3 bench/kernel_breakdown.py --out "$OUT/res" ${BREAKDOWN_ARGS:-} 2>&1 \
                 | grep --line-buffered -v "^INFO\|^WARNING\|^DEBUG" | tee "$OUT/breakdown.log" | tail -40 ;;
    # how fast the device streams a layer call's weight bytes at all (bench/read_floor.py)
    floor) timeout ${FLOOR_TIMEOUT:-180} python3 bench/read_floor.py --out "$OUT/res" ${FLOOR_ARGS:-} 2>&1 \
             | grep --line-buffered -v "^INFO\|^WARNING\|^DEBUG" | tee "$OUT/floor.log" | tail -30 ;;
    # `vllm-wna16 tune` on a catalog model's config.json (bench/model_catalog.py): the user's tuner on this GPU,
    # its tables brought back as user-tuned.tgz
    user-tune) python3 bench/model_catalog.py "${USER_TUNE_MODEL:-Qwen3-30B-A3B}" /tmp/user-tune >/dev/null
               export VLLM_WNA16_PLUS_TUNED_DIR=/tmp/user-tuned
               eval "timeout ${USER_TUNE_TIMEOUT:-420} vllm-wna16 tune /tmp/user-tune ${USER_TUNE_ARGS:---m 1,8,64,256 --budget-s 300}" 2>&1 \
                 | grep --line-buffered -v "^INFO\|^WARNING\|^DEBUG" | tee "$OUT/user-tune.log" | tail -30 || rc=1
               tar czf "$OUT/user-tuned.tgz" -C /tmp user-tuned 2>/dev/null ;;
    # a second bench step in one call gets its own log (the first is not overwritten)
    # BENCH_ARGS may hold several runs' arguments separated by ' ;; ' (each run its own log and BENCH_TIMEOUT)
    bench) all_args=${BENCH_ARGS:-}; IFS='#' read -r -a runs <<< "${all_args// ;; /#}"
           for args in "${runs[@]:-}"; do
             [ -n "${all_args}" ] && [ -z "${args// /}" ] && continue  # an empty run between two ' ;; '
             log="$OUT/bench.log"; [ -e "$log" ] && log="$OUT/bench-at-${SECONDS}s.log"
             timeout ${BENCH_TIMEOUT:-480} python3 bench/bench_moe.py --reps 20 --out "$OUT/res" $args 2>&1 | grep --line-buffered -v "^INFO\|^WARNING\|^DEBUG" | tee "$log" | tail -70
           done
           cp vllm_wna16_plugin/crossover/*.json "$OUT/res/" 2>/dev/null ;;  # --write-crossover rewrites it
    # any script with the bundle's vLLM and the built plugin (the repository on its path): PY_SCRIPT (the script and
    # its arguments, split on spaces), PY_TIMEOUT
    py) PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout ${PY_TIMEOUT:-300} python3 ${PY_SCRIPT:?PY_SCRIPT names the script} 2>&1 \
          | grep --line-buffered -v "^INFO\|^WARNING\|^DEBUG" | tee "$OUT/py.log" | tail -40 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "[step $step: $((SECONDS - t_step)) s, ${SECONDS} s in all]"
done
exit $rc
