"""block_config: every config is legal, and equals vLLM's wherever vLLM's was legal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_wna16_plugin.block_config import (
    LEGAL_K_RATIOS,
    BlockConfig,
    cuda_block_config,
    cuda_group_size,
    legal_block_size_k,
)

# (K, N) of one GEMM from real MoE models, full and after TP splits of the intermediate dim.
# gate/up: K = hidden, N = 2 * I / tp; down: K = I / tp, N = hidden.
REAL_MODELS = {
    "qwen3-30b-a3b": (2048, 768),
    "qwen3.5-35b-a3b": (2048, 512),
    "mixtral-8x7b": (4096, 14336),
    "mixtral-8x22b": (6144, 16384),
    "deepseek-v2-lite": (2048, 1408),
    "deepseek-v3": (7168, 2048),
    "kimi-k2": (7168, 2048),
    "gemma-4-26b-a4b": (2816, 704),
    "k1344": (1344, 1024),
}
TP_SIZES = (1, 2, 4, 8)


def _real_gemm_shapes():
    shapes = set()
    for hidden, inter in REAL_MODELS.values():
        for tp in TP_SIZES:
            if inter % tp:
                continue
            i_local = inter // tp
            shapes.add((hidden, 2 * i_local))  # gate/up
            shapes.add((i_local, hidden))  # down
    return sorted(shapes)


REAL_SHAPES = _real_gemm_shapes()


def _vllm_block_size_k(num_tokens, top_k, num_experts, size_k, size_n, group_size):
    """vLLM 0.26's own choice (the function we replace), for comparison."""
    from vllm.model_executor.layers.fused_moe.fused_moe import get_moe_wna16_block_config

    cfg = get_moe_wna16_block_config(
        config={},
        use_moe_wna16_cuda=True,
        num_valid_tokens=num_tokens * top_k,
        size_k=size_k,
        size_n=size_n,
        num_experts=num_experts,
        group_size=group_size,
        real_top_k=top_k,
        block_size_m=min(16, num_tokens),
    )
    return cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]


def _is_legal(bk: int, size_k: int, gs: int) -> bool:
    return size_k % bk == 0 and bk % gs == 0 and bk // gs in LEGAL_K_RATIOS


@pytest.mark.parametrize(
    "size_k, gs, vllm_bk, ours",
    [
        pytest.param(2048, 32, 512, 256, id="k2048-gs32-ratio16"),  # Qwen3.5-35B-A3B: vLLM crashes
        pytest.param(1344, 32, 96, 64, id="k1344-gs32-ratio3"),  # TP-split shape: vLLM crashes
    ],
)
def test_block_k_fixes_the_known_crash_shapes(size_k, gs, vllm_bk, ours):
    # M=1 decode, top_k 8, 256 experts (Qwen3.5) / 8 experts: the configs of the bug reports.
    num_experts = 256 if size_k == 2048 else 8
    top_k = 8 if size_k == 2048 else 2
    size_n = 1024
    _, theirs = _vllm_block_size_k(1, top_k, num_experts, size_k, size_n, gs)
    assert theirs == vllm_bk and not _is_legal(theirs, size_k, gs), "the crash no longer reproduces upstream"
    cfg = cuda_block_config(1, top_k, num_experts, size_k, size_n, gs, 4)
    assert cfg["BLOCK_SIZE_K"] == ours


@settings(max_examples=400, deadline=None)
@given(
    shape=st.sampled_from(REAL_SHAPES),
    gs=st.sampled_from([32, 64, 128, -1]),
    num_tokens=st.integers(1, 4096),
    top_k=st.sampled_from([1, 2, 4, 6, 8]),
    num_experts=st.sampled_from([8, 16, 60, 64, 128, 256, 384, 512]),
    bits=st.sampled_from([4, 8]),
)
def test_block_k_is_legal_for_every_real_shape(shape, gs, num_tokens, top_k, num_experts, bits):
    size_k, size_n = shape
    if gs != -1 and size_k % gs:
        with pytest.raises(ValueError, match="does not divide"):
            cuda_block_config(num_tokens, top_k, num_experts, size_k, size_n, gs, bits)
        return
    if gs == -1 and size_k % 32:  # e.g. gemma's 704 / TP8 = 88: no CUDA group fits, refused
        with pytest.raises(ValueError, match="multiple of 32"):
            cuda_block_config(num_tokens, top_k, num_experts, size_k, size_n, gs, bits)
        return
    cfg = cuda_block_config(num_tokens, top_k, num_experts, size_k, size_n, gs, bits)
    eff_gs = cuda_group_size(size_k, gs)
    assert _is_legal(cfg["BLOCK_SIZE_K"], size_k, eff_gs), cfg
    assert cfg["BLOCK_SIZE_M"] == min(16, num_tokens)
    # Where vLLM's choice was legal, ours is the same (N and K).
    their_n, their_k = _vllm_block_size_k(num_tokens, top_k, num_experts, size_k, size_n, eff_gs)
    assert cfg["BLOCK_SIZE_N"] == their_n
    if _is_legal(their_k, size_k, eff_gs):
        assert cfg["BLOCK_SIZE_K"] == their_k
    else:
        assert cfg["BLOCK_SIZE_K"] < their_k or their_k % eff_gs


@settings(max_examples=300, deadline=None)
@given(
    gs=st.sampled_from([16, 32, 64, 128, 256]),
    groups=st.integers(1, 512),
    wished=st.sampled_from([16, 32, 64, 96, 128, 256, 512, 1024, 2048]),
)
def test_legal_block_size_k_is_largest_legal_not_above_wish(gs, groups, wished):
    size_k = gs * groups
    bk = legal_block_size_k(size_k, wished, gs)
    assert _is_legal(bk, size_k, gs)
    better = [r * gs for r in LEGAL_K_RATIOS if bk < r * gs <= max(wished, gs) and size_k % (r * gs) == 0]
    assert not better, f"{better} would have been legal and larger than {bk}"


def test_channelwise_uses_largest_cuda_group_dividing_k():
    assert cuda_group_size(2048, -1) == 128
    assert cuda_group_size(352, -1) == 32  # gemma 704 / TP2
    assert cuda_group_size(2816, -1) == 128
    with pytest.raises(ValueError, match="multiple of 32"):
        cuda_group_size(100, -1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(dict(block_size_k=512, group_size=32), "must be one of", id="ratio-16"),
        pytest.param(dict(block_size_k=96, group_size=32), "must be one of", id="ratio-3"),
        pytest.param(dict(block_size_k=48, group_size=32), "must be one of", id="not-a-multiple"),
        pytest.param(dict(block_size_k=256, group_size=64, size_k=1344), "does not divide", id="k-tail"),
    ],
)
def test_block_config_refuses_illegal_values(kwargs, match):
    args = dict(block_size_m=16, block_size_n=128, size_k=2048) | kwargs
    with pytest.raises(ValueError, match=match):
        BlockConfig(**args)


def test_bad_bits_and_sizes_are_value_errors():
    with pytest.raises(ValueError, match="bits=3"):
        cuda_block_config(1, 1, 8, 2048, 1024, 128, 3)
    with pytest.raises(ValueError, match="must all be positive"):
        cuda_block_config(0, 1, 8, 2048, 1024, 128, 4)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((1, 8, 32, 2048, 1024, 0, 4), r"group_size=0 is not supported; use a positive group size or -1"),
        (("1", 8, 32, 2048, 1024, 32, 4), r"num_tokens='1' must be an int, not str"),
        ((1.5, 8, 32, 2048, 1024, 32, 4), r"num_tokens=1.5 must be an int, not float"),
        ((1, 8, 32, 2048, 1024, None, 4), r"group_size=None must be an int, not NoneType"),
        ((1, 8, 32, 2048, 1024, 32, True), r"bits=True must be an int, not bool"),
    ],
)
def test_wrong_types_and_a_zero_group_are_value_errors(args, match):
    """Found by fuzzing: these were a ZeroDivisionError, TypeErrors, and a float BLOCK_SIZE_M of 1.5."""
    with pytest.raises(ValueError, match=match):
        cuda_block_config(*args)


def test_cuda_group_reason_names_what_the_cuda_configs_cannot_take():
    from vllm_wna16_plugin.block_config import cuda_group_reason

    assert cuda_group_reason("w13", 32, 2048) is None
    assert cuda_group_reason("w2", 704, 704) is None  # channel-wise, presented as group 64
    assert cuda_group_reason("w2", 176, 176) == "channel-wise w2 K=176 is not a multiple of 32"
    assert cuda_group_reason("w13", 16, 2048) == "w13 group size 16 is not one of [32, 64, 128]"
