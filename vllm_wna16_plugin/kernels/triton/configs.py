"""Launch configs of the Triton WNA16 MoE kernel: the value object, a JSON loader
for tuned entries, and a GPU-blind fallback heuristic.

`get_triton_moe_config(M, E, N, K, top_k, group_size, bits, device_name)` returns
the config for one GEMM of shape (N, K) (GEMM1: N = 2I, K = H; GEMM2: N = H, K = I).
It reads configs/<config_file_name(...)>, whose keys are token counts M (as in
vLLM's fused_moe config files; the nearest key wins), and falls back to
`default_config`. Tuned entries are measured on the GPU and committed with the
script that made them; none exist yet, so every shape uses the heuristic.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("configs")
_WARPS = (1, 2, 4, 8, 16)


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class TritonMoEConfig:
    """One GEMM's launch config; self-checking when built, `check_shape` for K/group rules."""

    BLOCK_SIZE_M: int
    BLOCK_SIZE_N: int
    BLOCK_SIZE_K: int
    GROUP_SIZE_M: int = 1
    num_warps: int = 4
    num_stages: int = 2
    use_td: bool | None = None  # a tuned opinion on tensor descriptors; None = let td_gate decide

    def __post_init__(self) -> None:
        if not _is_pow2(self.BLOCK_SIZE_M):
            raise ValueError(f"BLOCK_SIZE_M={self.BLOCK_SIZE_M} must be a power of two")
        if not _is_pow2(self.BLOCK_SIZE_N) or self.BLOCK_SIZE_N < 16:
            raise ValueError(f"BLOCK_SIZE_N={self.BLOCK_SIZE_N} must be a power of two >= 16")
        if not _is_pow2(self.BLOCK_SIZE_K) or self.BLOCK_SIZE_K < 16:
            raise ValueError(f"BLOCK_SIZE_K={self.BLOCK_SIZE_K} must be a power of two >= 16")
        if self.GROUP_SIZE_M < 1:
            raise ValueError(f"GROUP_SIZE_M={self.GROUP_SIZE_M} must be >= 1")
        if self.num_warps not in _WARPS:
            raise ValueError(f"num_warps={self.num_warps} must be one of {list(_WARPS)}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")
        if self.use_td not in (None, True, False):
            raise ValueError(f"use_td={self.use_td!r} must be None, True or False")

    def check_shape(self, K: int, group_size: int) -> None:
        """Raise ValueError unless this config is legal for a GEMM with reduction size K.

        group_size is the GEMM's effective group (K // scales.shape[-1]); channel-wise
        (group_size == K or -1) has one group and accepts any BLOCK_SIZE_K.
        """
        if group_size == -1 or group_size == K:
            return
        bk = self.BLOCK_SIZE_K
        if bk % group_size and group_size % bk:
            raise ValueError(
                f"BLOCK_SIZE_K={bk} and group_size={group_size} (K={K}): need BLOCK_SIZE_K % group_size == 0 "
                f"or group_size % BLOCK_SIZE_K == 0; use a power of two that divides or is a multiple of {group_size}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


def config_file_name(E: int, N: int, K: int, group_size: int, bits: int, device_name: str) -> str:
    """Tuned-config file of one GEMM shape: E=128,N=1536,K=2048,group_size=128,bits=4,device_name=NVIDIA_H200.json."""
    device = device_name.replace(" ", "_")
    return f"E={E},N={N},K={K},group_size={group_size},bits={bits},device_name={device}.json"


@functools.cache
def _load(path: Path) -> dict[int, TritonMoEConfig] | None:
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    try:
        return {int(m): TritonMoEConfig(**entry) for m, entry in raw.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{path.name}: bad tuned config ({exc}); each key is a token count M, each value the "
            f"fields of TritonMoEConfig"
        ) from exc


def load_tuned_configs(
    E: int, N: int, K: int, group_size: int, bits: int, device_name: str, config_dir: Path | None = None
) -> dict[int, TritonMoEConfig] | None:
    """The tuned {M: config} table for a GEMM shape, or None when there is no file."""
    return _load((config_dir or CONFIG_DIR) / config_file_name(E, N, K, group_size, bits, device_name))


def _pick_block_k(K: int, group_size: int, wish: int) -> int:
    """Largest power of two <= wish (>= 16) that is legal for the group size, preferring one that divides K."""
    legal = [
        bk
        for bk in (256, 128, 64, 32, 16)
        if bk <= wish and (group_size in (-1, K) or bk % group_size == 0 or group_size % bk == 0)
    ]
    if not legal:
        return 16  # only reachable for group sizes that are not multiples of 16: check_shape reports it
    for bk in legal:
        if K % bk == 0:
            return bk
    return legal[0]


def default_config(M: int, E: int, N: int, K: int, top_k: int, group_size: int, bits: int) -> TritonMoEConfig:
    """GPU-blind heuristic (not yet measured): small tiles over M, wide parallelism over N for decode.

    Decode (few tokens per expert) is bound by the weight bytes: BLOCK_SIZE_M=16 (the
    smallest tl.dot tile), BLOCK_SIZE_K=128 so each B row is one 64-byte (int4) or
    128-byte (int8) contiguous load, and BLOCK_SIZE_N shrunk from 128 until the grid
    has >= 256 programs (about two waves of an H100/H200's 132 SMs). Prefill uses
    64x128x64 tiles with grouped ordering.
    """
    tokens_per_expert = M * top_k / max(E, 1)
    active_experts = min(E, M * top_k)
    if tokens_per_expert <= 16:
        bm, bk_wish, group_m, stages = 16, 128, 1, 3
    elif tokens_per_expert <= 64:
        bm, bk_wish, group_m, stages = 32, 128, 8, 3
    else:
        bm, bk_wish, group_m, stages = 64, 64, 8, 3
    m_blocks = max(1, active_experts) * max(1, -(-int(tokens_per_expert) // bm))
    bn = 128
    while bn > 32 and m_blocks * -(-N // bn) < 256:
        bn //= 2
    bk = _pick_block_k(K, group_size, bk_wish)
    return TritonMoEConfig(
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=group_m, num_warps=4, num_stages=stages
    )


def get_triton_moe_config(
    M: int,
    E: int,
    N: int,
    K: int,
    top_k: int,
    group_size: int,
    bits: int,
    device_name: str | None = None,
    config_dir: Path | None = None,
) -> TritonMoEConfig:
    """The tuned config nearest to M for this GEMM shape on device_name, else `default_config`.

    group_size: the GEMM's effective group (-1 or K = channel-wise). A tuned entry
    that is illegal for K/group_size raises (a bad file is a bug, not a fallback).
    """
    gs = K if group_size == -1 else group_size
    table = None
    if device_name:
        table = load_tuned_configs(E, N, K, gs, bits, device_name, config_dir)
    if table:
        cfg = table[min(table, key=lambda m: abs(m - M))]
    else:
        cfg = default_config(M, E, N, K, top_k, gs, bits)
    cfg.check_shape(K, gs)
    return cfg


__all__ = ["TritonMoEConfig", "config_file_name", "default_config", "get_triton_moe_config", "load_tuned_configs"]
