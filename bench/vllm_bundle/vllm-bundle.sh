#!/bin/bash
# vllm-bundle.sh: carry vLLM to the lent GPU machines (no network there).
# Project copy of ../shared/device/vllm-bundle.sh (see its README.md), kept in
# bench/vllm_bundle/ with its templates and requirements-V.txt files beside it.
# Example (vLLM 0.34 for the H200, from the project root):
#   bash bench/vllm_bundle/vllm-bundle.sh build .vb34 --vllm-version 0.34.0 \
#        --vllm-wheel /path/to/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl
#
#   vllm-bundle.sh build OUTDIR [options]   build parts + stage.sh + install.sh
#   vllm-bundle.sh verify OUTDIR            re-check part sizes and sha256 here
#   vllm-bundle.sh plan OUTDIR [CARRYDIR]   print the run calls to make
#
# build options:
#   --vllm-version V      default 0.26.0 (needs requirements-V.txt beside this)
#   --vllm-wheel PATH     use this vllm wheel instead of downloading it
#   --requirements FILE   pinned extra wheels (default: the file for V)
#   --strip-file FILE     more site-relative paths to drop, one a line
#                         (default: strip-V.txt beside this, if it exists)
#   --extra-wheel PATH    add one more wheel (repeatable)
#   --python-version X.Y  device python, default 3.12
#   --sm N                keep SASS for compute capability N only (default 90,
#                         the H100/H200); 'all' keeps every fatbin entry
#   --drop-redundant-ptx  also zero PTX where the same fatbin container has
#                         sm_N SASS (smaller; see README for the reasoning)
#   --part-mib M          largest part in MiB (default 60, must be <= 60)
#   --keep-flash-attn     keep vllm_flash_attn's .so files (+436 MiB raw)
#   --xz-level L          default 9e
set -u -o pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LIB="$HERE/vllm_bundle_lib.py"
PY_HOST=${PYTHON:-python3}
die() { echo "vllm-bundle: $*" >&2; exit 1; }
log() { echo "vllm-bundle: $*" >&2; }

pip_download() {  # pip_download DEST ARGS...  (cp312-style wheels for the device)
  local dest=$1; shift
  local plat=() n
  for n in $(seq 35 -1 17); do plat+=(--platform "manylinux_2_${n}_x86_64"); done
  plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  "$PY_HOST" -m pip download -q --no-deps --only-binary=:all: \
      --python-version "$PYVER" --implementation cp "${plat[@]}" -d "$dest" "$@"
}

cmd_build() {
  local OUT="" VV=0.26.0 VWHL="" REQ="" STRIPF="" SM=90 DROPPTX=0 PARTMIB=60 KEEPFA=0 XZL=9e
  local -a EXTRA=()
  PYVER=3.12
  while [ $# -gt 0 ]; do
    case $1 in
      --vllm-version) VV=$2; shift 2;;
      --vllm-wheel) VWHL=$2; shift 2;;
      --requirements) REQ=$2; shift 2;;
      --strip-file) STRIPF=$2; shift 2;;
      --extra-wheel) EXTRA+=("$2"); shift 2;;
      --python-version) PYVER=$2; shift 2;;
      --sm) SM=$2; shift 2;;
      --drop-redundant-ptx) DROPPTX=1; shift;;
      --part-mib) PARTMIB=$2; shift 2;;
      --keep-flash-attn) KEEPFA=1; shift;;
      --xz-level) XZL=$2; shift 2;;
      -*) die "unknown option $1";;
      *) [ -z "$OUT" ] || die "one OUTDIR only"; OUT=$1; shift;;
    esac
  done
  [ -n "$OUT" ] || die "usage: vllm-bundle.sh build OUTDIR [options]"
  [ "$PARTMIB" -le 60 ] 2>/dev/null || die "--part-mib must be a number <= 60 (a run call carries 64 MiB in all)"
  for t in xz tar sha256sum split "$PY_HOST"; do command -v "$t" >/dev/null || die "$t not found"; done
  "$PY_HOST" -m pip --version >/dev/null 2>&1 || die "$PY_HOST has no pip"
  [ -n "$REQ" ] || REQ="$HERE/requirements-$VV.txt"
  [ -f "$REQ" ] || die "no requirements file $REQ (work one out by importing, as requirements-0.26.0.txt says, or pass --requirements)"
  if [ -z "$STRIPF" ] && [ -f "$HERE/strip-$VV.txt" ]; then STRIPF="$HERE/strip-$VV.txt"; fi
  [ -z "$STRIPF" ] || [ -f "$STRIPF" ] || die "no strip file $STRIPF"
  [ -z "$STRIPF" ] || STRIPF=$(cd "$(dirname "$STRIPF")" && pwd)/$(basename "$STRIPF")
  local PYTAG="cp${PYVER/./}"
  mkdir -p "$OUT" || die "cannot create $OUT"
  OUT=$(cd "$OUT" && pwd)
  if ls "$OUT"/part-* >/dev/null 2>&1; then log "removing old parts in $OUT"; rm -f "$OUT"/part-*; fi
  W=$(mktemp -d "${TMPDIR:-/tmp}/vllm-bundle.XXXXXX") || die "mktemp failed"
  trap 'rm -rf "${W:-/nonexistent}"' EXIT
  mkdir -p "$W/whl" "$W/site"

  # 1. wheels
  if [ -n "$VWHL" ]; then
    [ -f "$VWHL" ] || die "no such wheel $VWHL"
    cp "$VWHL" "$W/whl/" || die "copy failed"
  else
    log "downloading vllm==$VV"
    pip_download "$W/whl" "vllm==$VV" || die "pip download vllm==$VV failed"
  fi
  ls "$W"/whl/vllm-"$VV"-*.whl >/dev/null 2>&1 || die "no vllm-$VV wheel (is --vllm-wheel the right version?)"
  log "downloading the wheels in $(basename "$REQ")"
  pip_download "$W/whl" -r "$REQ" || die "pip download -r $REQ failed"
  for e in "${EXTRA[@]+"${EXTRA[@]}"}"; do cp "$e" "$W/whl/" || die "cannot copy $e"; done
  # one version of each distribution
  local dups
  dups=$(ls "$W/whl" | sed -E 's/^([^-]+)-.*/\1/' | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
  [ -z "$dups" ] || die "several wheels of: $dups"

  # 2. unpack + strip
  local f
  for f in "$W"/whl/*.whl; do "$PY_HOST" "$LIB" unpack-wheel "$f" "$W/site" || die "unpack $f failed"; done
  local sargs=()
  [ "$KEEPFA" = 1 ] && sargs+=(--keep-flash-attn)
  [ -n "$STRIPF" ] && sargs+=(--strip-file "$STRIPF")
  "$PY_HOST" "$LIB" strip-vllm "$W/site" "$PYTAG" "${sargs[@]+"${sargs[@]}"}" >&2 || die "strip failed"
  find "$W/site" -name __pycache__ -type d -prune -exec rm -rf {} +
  if [ "$SM" != all ]; then
    local zargs=(--keep-sm "$SM" --report "$OUT/fatbin-report.txt")
    [ "$DROPPTX" = 1 ] && zargs+=(--drop-redundant-ptx)
    "$PY_HOST" "$LIB" zero-cubins "$W/site" "${zargs[@]}" >/dev/null || die "zero-cubins failed"
    tail -1 "$OUT/fatbin-report.txt" >&2
  fi
  "$PY_HOST" "$LIB" xgrammar-stub "$W/site" >&2 || die "stub failed"

  # 3. archive, split, manifest
  log "compressing (xz -$XZL) ..."
  (cd "$W/site" && tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - .) \
      | xz -"$XZL" -T0 -c > "$W/bundle.tar.xz" || die "tar/xz failed"
  local total; total=$(stat -c %s "$W/bundle.tar.xz")
  local TOTAL_SHA; TOTAL_SHA=$(sha256sum "$W/bundle.tar.xz" | cut -d' ' -f1)
  (cd "$OUT" && split -d -a 3 -b "$((PARTMIB * 1048576 - 4096))" "$W/bundle.tar.xz" part-tmp-) || die "split failed"
  local n=0 shas="" sizes="" pf
  for pf in $(ls "$OUT"/part-tmp-* | sort); do
    n=$((n + 1)); mv "$pf" "$OUT/part-$n"
    shas="$shas $(sha256sum "$OUT/part-$n" | cut -d' ' -f1)"
    sizes="$sizes $(stat -c %s "$OUT/part-$n")"
  done
  "$PY_HOST" "$LIB" check-sizes "$OUT" $((60 * 1048576)) || die "a part is too large"
  local BID; BID="v${VV}-${TOTAL_SHA:0:12}"
  local kv=(BUNDLE_ID="$BID" NPARTS="$n" TOTAL_SHA="$TOTAL_SHA" VLLM_VERSION="$VV" PYTAG="$PYTAG"
            KEEP_SM="$SM" PART_SHA="${shas# }" PART_SIZE="${sizes# }")
  "$PY_HOST" "$LIB" render "$HERE/stage.sh.in" "$OUT/stage.sh" "${kv[@]}" || die "render stage.sh"
  "$PY_HOST" "$LIB" render "$HERE/install.sh.in" "$OUT/install.sh" "${kv[@]}" || die "render install.sh"
  # what the call that runs install.sh carries from the bundle: the last part + install.sh
  local carry=$(( $(stat -c %s "$OUT/part-$n") + $(stat -c %s "$OUT/install.sh") ))
  if [ "$carry" -gt $((58 * 1048576)) ]; then
    log "WARNING: part-$n + install.sh = $carry bytes > 58 MiB: little room is left for the rest of a 64 MiB call"
  fi
  {
    echo "bundle $BID"
    echo "vllm $VV for $PYTAG, keep sm_$SM, drop_redundant_ptx=$DROPPTX, xz -$XZL"
    echo "requirements $(basename "$REQ"), strip file $([ -n "$STRIPF" ] && basename "$STRIPF" || echo none)"
    echo "archive $total bytes, sha256 $TOTAL_SHA, unpacked $(du -sm "$W/site" | cut -f1) MiB"
    echo "carried with install.sh: part-$n + install.sh = $carry bytes ($((carry / 1048576)) MiB)"
    local i=0 s
    for s in $sizes; do i=$((i + 1)); echo "part-$i $s $(echo $shas | cut -d' ' -f$i)"; done
    echo "wheels:"; ls "$W/whl" | sed 's/^/  /'
  } > "$OUT/MANIFEST.txt"
  cat "$OUT/MANIFEST.txt" >&2
  log "done: $n part(s) in $OUT; next: vllm-bundle.sh plan $OUT"
}

cmd_verify() {
  local OUT=${1:?usage: vllm-bundle.sh verify OUTDIR}
  [ -f "$OUT/stage.sh" ] || die "$OUT/stage.sh missing"
  local t; t=$(mktemp -d)
  VB_STAGE=$t bash "$OUT/stage.sh" "$OUT"/part-* ; local rc=$?
  rm -rf "$t"
  return $rc
}

cmd_plan() {
  local OUT=${1:?usage: vllm-bundle.sh plan OUTDIR}
  local n; n=$(ls "$OUT"/part-* 2>/dev/null | wc -l)
  [ "$n" -ge 1 ] || die "no parts in $OUT"
  local rel=${OUT%/}
  echo "Make these run calls back to back (the machine stays warm 30 s after each):"
  local k
  for k in $(seq 1 $((n - 1))); do
    echo "  run(command='bash $rel/stage.sh $rel/part-$k', carry=['$rel/part-$k', '$rel/stage.sh'], timeout_s=120)"
  done
  echo "  run(command='eval \"\$(bash $rel/install.sh)\" || exit 1; YOUR COMMAND', carry=['$rel/part-$n', '$rel/install.sh', ...])"
  echo "(paths relative to the repository root; $rel must be ignored through .git/info/exclude)"
}

case ${1:-} in
  build) shift; cmd_build "$@";;
  verify) shift; cmd_verify "$@";;
  plan) shift; cmd_plan "$@";;
  *) sed -n '2,/^set -u/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 2;;
esac
