"""The one place that decides, per launch, whether the Triton kernel loads through
tensor descriptors (TD) and whether A is fetched with a descriptor gather.

Pure and GPU-blind: the caller passes the platform and the SM version. Rules, in
the order `decide_td` applies them (each is pinned by tests/kernels/test_td_gate.py):

  capability  XPU: B-load and A-gather. CUDA: B-load from sm90 (TMA), A-gather from
              sm100 (tile::gather4). "interpreter": both (only when forced, for
              tests). ROCm, CPU, CUDA < sm90: none.
  auto        requested None: XPU on; CUDA on only where a tuned config says
              use_td=True (not yet measured on sm90/sm100); interpreter off.
  M == 1      no TD: one row cannot amortise the descriptor set-up (M is the row
              count of the GEMM's A: tokens for GEMM1, tokens*top_k for GEMM2).
  BLOCK_SIZE_K >= 32   int4 B's half-K descriptor needs >= 16 bytes per row.
  K % BLOCK_SIZE_K     a K tail miscompiles off XPU: no TD there.
  16-byte alignment    descriptor base pointers and row strides must be 16-byte
              aligned: K*bits/8 bytes for B (which implies K*2 bytes for a bf16/fp16 A).
  BLOCK_SIZE_M >= 8    descriptor gather needs >= 8 rows; below it B may still use TD.
  act order   A's columns are read in a per-expert order (a_perm): no A-gather (B may still use TD).

A forced request (True) that a rule refuses logs the reason once and falls back;
it never raises. `td_request_from_env` reads VLLM_TRITON_USE_TD.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ... import _vllm

logger = _vllm.init_logger(__name__)

PLATFORMS = ("cuda", "xpu", "rocm", "cpu", "interpreter")
ENV_VAR = "VLLM_TRITON_USE_TD"
MIN_GATHER_ROWS = 8  # tensor_descriptor.gather asserts at least 8 rows
MIN_TD_BLOCK_K = 32  # 32 int4 values = 16 bytes, the smallest descriptor row
TD_ALIGN_BYTES = 16

_logged: set[str] = set()


@dataclass(frozen=True)
class TDDecision:
    """use_td_b: load B through a descriptor; use_gather: gather A through one too."""

    use_td_b: bool
    use_gather: bool
    reason: str


def td_request_from_env(environ=None) -> bool | None:
    """VLLM_TRITON_USE_TD: unset or "" = None (auto), 1/true/yes/on = True (force), 0/false/no/off = False
    (off), any case; anything else is a ValueError naming the variable (moe_method checks it at load)."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "")
    value = raw.strip().lower()
    if value == "":
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_VAR}={raw!r} is not understood; use 1 (force), 0 (off) or leave it unset (auto)")


def _capability(platform: str, sm: int | None) -> tuple[bool, bool, str]:
    """(can B-load, can gather, why) for a platform."""
    if platform == "xpu":
        return True, True, "xpu"
    if platform == "interpreter":
        return True, True, "triton interpreter"
    if platform == "cuda":
        if sm is None:
            return False, False, "cuda without a known sm version"
        if sm >= 100:
            return True, True, f"sm{sm}"
        if sm >= 90:
            return True, False, f"sm{sm}: TMA load only, no tile::gather4 before sm100"
        return False, False, f"sm{sm} has no TMA (needs sm90+)"
    if platform in ("rocm", "cpu"):
        return False, False, f"{platform} has no tensor-descriptor path"
    raise ValueError(f"platform={platform!r} is not known; supported: {list(PLATFORMS)}")


def _off(reason: str, requested: bool | None) -> TDDecision:
    if requested:
        _log_once(f"TD requested but not used: {reason}; using the pointer path")
    return TDDecision(False, False, reason)


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def decide_td(
    *,
    requested: bool | None,
    platform: str,
    sm: int | None,
    block_size_m: int,
    block_size_k: int,
    M: int,
    K: int,
    bits: int = 4,
    config_use_td: bool | None = None,
    aligned: bool = True,
    a_permuted: bool = False,
) -> TDDecision:
    """Whether this launch uses TD for B and a gather for A; never raises for a forced request.

    requested: None = auto, True = force where it can compile, False = off.
    config_use_td: a tuned config's opinion (None = no opinion); it turns TD on in
    auto mode on CUDA. M: rows of the GEMM's A. K: the GEMM's reduction size.
    aligned: whether the A and B base pointers are 16-byte aligned. a_permuted: A is read through an
    act-order column table (the gather reads whole rows in order, so it is off).
    """
    if requested is False:
        return TDDecision(False, False, "TD disabled")
    can_b, can_gather, why = _capability(platform, sm)
    if not can_b:
        return _off(why, requested)
    if requested is None:
        if platform == "interpreter":
            return TDDecision(False, False, "auto: TD is only forced in the interpreter")
        if platform == "cuda" and config_use_td is not True:
            return TDDecision(False, False, f"auto on {why}: off unless a tuned config sets use_td=True")
    if M == 1:
        return _off("M == 1: a single row cannot amortise descriptor set-up", requested)
    if block_size_k < MIN_TD_BLOCK_K:
        return _off(f"BLOCK_SIZE_K={block_size_k} < {MIN_TD_BLOCK_K}", requested)
    if K % block_size_k and platform != "xpu":
        return _off(f"K={K} is not a multiple of BLOCK_SIZE_K={block_size_k} (a K tail miscompiles off XPU)", requested)
    if not aligned:
        return _off("a base pointer is not 16-byte aligned", requested)
    if (K * bits // 8) % TD_ALIGN_BYTES:
        return _off(f"B rows of K={K} int{bits} are {K * bits // 8} bytes, not 16-byte aligned", requested)
    use_gather = can_gather
    reason = f"TD B-load on {why}"
    if not can_gather:
        reason += "; A stays on pointers"
    elif a_permuted:
        use_gather = False
        reason += "; no A-gather: act order reads A's columns through a_perm"
        if requested:
            _log_once("TD A-gather requested but not used: act order reads A's columns through a_perm")
    elif block_size_m < MIN_GATHER_ROWS:
        use_gather = False
        reason += f"; no A-gather: BLOCK_SIZE_M={block_size_m} < {MIN_GATHER_ROWS} rows"
        if requested:
            _log_once(f"TD A-gather requested but not used: BLOCK_SIZE_M={block_size_m} < {MIN_GATHER_ROWS}")
    else:
        reason += " with A-gather"
    return TDDecision(True, use_gather, reason)
