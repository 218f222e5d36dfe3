"""Launch configs for the CUDA WNA16 MoE GEMM, legal by construction.

vLLM's `moe_wna16_gemm` kernel is instantiated only for
BLOCK_SIZE_K // group_size in {1, 2, 4, 8}, and needs K % BLOCK_SIZE_K == 0 and
BLOCK_SIZE_K % group_size == 0. vLLM 0.26's heuristic
(`get_moe_wna16_block_config` -> `_ensure_block_size_k_divisible`) can return a
ratio of 16 (K=2048, gs=32) or 3 (K=1344, gs=32) and the kernel aborts. Here the
heuristic's wish is kept, and BLOCK_SIZE_K is the largest of {8, 4, 2, 1} *
group_size that divides K and does not exceed the wish: where vLLM's choice was
legal it is returned unchanged, everywhere else a legal one is.

Pure integers: no GPU query, so CI sweeps every real shape (tests/test_block_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_wna16_plugin.scheme import CHANNELWISE

LEGAL_K_RATIOS = (1, 2, 4, 8)
CUDA_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class BlockConfig:
    """One launch config of the CUDA WNA16 MoE GEMM; checks its own legality when built."""

    block_size_m: int
    block_size_n: int
    block_size_k: int
    size_k: int
    group_size: int

    def __post_init__(self) -> None:
        check_cuda_block_config(self.block_size_m, self.block_size_n, self.block_size_k, self.size_k, self.group_size)

    def as_dict(self) -> dict[str, int]:
        return {
            "BLOCK_SIZE_M": self.block_size_m,
            "BLOCK_SIZE_N": self.block_size_n,
            "BLOCK_SIZE_K": self.block_size_k,
        }


def check_cuda_block_config(
    block_size_m: int, block_size_n: int, block_size_k: int, size_k: int, group_size: int
) -> None:
    """Raise ValueError unless the config is one moe_wna16_gemm accepts. The one home of these rules."""
    if group_size <= 0:
        raise ValueError(f"group_size={group_size} must be positive here (channel-wise is resolved first)")
    if block_size_m <= 0 or block_size_n <= 0:
        raise ValueError(f"BLOCK_SIZE_M={block_size_m} and BLOCK_SIZE_N={block_size_n} must be positive")
    if block_size_k % group_size or block_size_k // group_size not in LEGAL_K_RATIOS:
        raise ValueError(
            f"BLOCK_SIZE_K={block_size_k} with group_size={group_size}: "
            f"BLOCK_SIZE_K // group_size must be one of {list(LEGAL_K_RATIOS)}"
        )
    if size_k % block_size_k:
        raise ValueError(f"BLOCK_SIZE_K={block_size_k} does not divide K={size_k}")


def cuda_group_size(size_k: int, group_size: int) -> int:
    """The group size the CUDA kernel sees for a GEMM with reduction dim size_k.

    Channel-wise scales are constant along K, so they are presented as the
    largest group of {128, 64, 32} dividing K (scales repeated; exact).
    """
    if group_size != CHANNELWISE:
        return group_size
    for g in sorted(CUDA_GROUP_SIZES, reverse=True):
        if size_k % g == 0:
            return g
    raise ValueError(f"channel-wise K={size_k} is not a multiple of 32; the CUDA kernel cannot take it")


def cuda_group_reason(gemm: str, group_size: int, size_k: int) -> str | None:
    """Why the CUDA launch configs cannot serve this GEMM's group (None: they can). group_size == size_k
    is channel-wise, presented as a CUDA group (cuda_group_size); otherwise it must be one of CUDA_GROUP_SIZES."""
    if group_size == size_k:
        if size_k % min(CUDA_GROUP_SIZES):
            return f"channel-wise {gemm} K={size_k} is not a multiple of {min(CUDA_GROUP_SIZES)}"
        return None
    if group_size not in CUDA_GROUP_SIZES:
        return f"{gemm} group size {group_size} is not one of {list(CUDA_GROUP_SIZES)}"
    return None


def legal_block_size_k(size_k: int, wished: int, group_size: int) -> int:
    """Largest r * group_size (r in {8, 4, 2, 1}) dividing size_k and not above `wished` (group_size at least)."""
    if size_k % group_size:
        raise ValueError(f"group_size={group_size} does not divide K={size_k}")
    for ratio in sorted(LEGAL_K_RATIOS, reverse=True):
        candidate = ratio * group_size
        if candidate <= max(wished, group_size) and size_k % candidate == 0:
            return candidate
    return group_size  # unreachable: ratio 1 always divides


def _heuristic_wish(
    num_valid_tokens: int, top_k: int, num_experts: int, size_k: int, size_n: int, group_size: int, block_size_m: int
) -> tuple[int, int]:
    """vLLM 0.26's (BLOCK_SIZE_N, BLOCK_SIZE_K) heuristic for the CUDA kernel, before the K fix-up.

    Rewritten from `get_moe_wna16_block_config` (vLLM 0.26.0 and 0.33.0, identical),
    kept operation for operation so the wish is the same as vLLM's.
    """
    block_size_n = 128
    block_size_k = 128
    if block_size_k <= group_size:
        block_size_k = group_size
    # vLLM names these the other way round; the products are what matter.
    num_n_blocks = size_k // block_size_k
    num_k_blocks = size_n // block_size_k
    num_m_blocks = (num_valid_tokens + block_size_m - 1) / block_size_m + num_experts
    if num_valid_tokens // top_k <= block_size_m:
        num_m_blocks = min(num_m_blocks, num_valid_tokens)
    num_blocks = num_m_blocks * num_n_blocks * num_k_blocks
    if size_k % 256 == 0 and num_blocks >= 256 and block_size_k < 256:
        block_size_k = 256
        num_blocks = num_blocks // (256 // block_size_k)
    if num_m_blocks <= 16 and size_k % (block_size_k * 2) == 0 and block_size_k <= 512 and num_blocks >= 512:
        block_size_k = block_size_k * 2
        num_blocks = num_blocks // 2
    if num_blocks > 1024:
        block_size_n = 256
        num_blocks = num_blocks // 2
    if size_n <= 1024 and num_blocks >= 1024:
        block_size_n = 1024
    return block_size_n, block_size_k


def cuda_block_size_m(num_tokens: int) -> int:
    """vLLM's BLOCK_SIZE_M for the CUDA path: min(16, M)."""
    return max(1, min(16, num_tokens))


def choose_cuda_block_config(
    num_tokens: int, top_k: int, num_experts: int, size_k: int, size_n: int, group_size: int, bits: int
) -> BlockConfig:
    """A legal BlockConfig for one GEMM; see `cuda_block_config`."""
    given = dict(num_tokens=num_tokens, top_k=top_k, num_experts=num_experts, size_k=size_k, size_n=size_n)
    for name, value in {**given, "group_size": group_size, "bits": bits}.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be an int, not {type(value).__name__}")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group_size={group_size} is not supported; use a positive group size or -1 (channel-wise)")
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported; supported: 4, 8")
    if num_tokens <= 0 or top_k <= 0 or num_experts <= 0 or size_k <= 0 or size_n <= 0:
        raise ValueError(
            f"num_tokens={num_tokens}, top_k={top_k}, num_experts={num_experts}, "
            f"size_k={size_k}, size_n={size_n} must all be positive"
        )
    gs = cuda_group_size(size_k, group_size)
    block_size_m = cuda_block_size_m(num_tokens)
    block_size_n, wished_k = _heuristic_wish(num_tokens * top_k, top_k, num_experts, size_k, size_n, gs, block_size_m)
    return BlockConfig(
        block_size_m=block_size_m,
        block_size_n=block_size_n,
        block_size_k=legal_block_size_k(size_k, wished_k, gs),
        size_k=size_k,
        group_size=gs,
    )


def cuda_block_config(
    num_tokens: int, top_k: int, num_experts: int, size_k: int, size_n: int, group_size: int, bits: int
) -> dict[str, int]:
    """{BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K} for the CUDA WNA16 MoE GEMM, legal by construction.

    num_tokens: rows of the activation (M, before top_k); size_k / size_n: the
    GEMM's reduction and output dims on this rank; group_size: -1 for
    channel-wise (then the group is `cuda_group_size(size_k, -1)`). The result
    satisfies K % BLOCK_SIZE_K == 0 and BLOCK_SIZE_K // group_size in {1, 2, 4, 8},
    so vLLM's own `moe_wna16_gemm` accepts it too, and BLOCK_SIZE_K equals
    vLLM 0.26's wherever vLLM's was already legal. Raises ValueError when
    group_size does not divide size_k (a load-time error, never a launch).
    """
    return choose_cuda_block_config(num_tokens, top_k, num_experts, size_k, size_n, group_size, bits).as_dict()
