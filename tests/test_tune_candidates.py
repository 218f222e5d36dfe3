"""bench/tune.py's candidate space (CPU): which tiles the H200 tuner times, and that each is legal."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from vllm_wna16_plugin.kernels.triton.configs import expected_experts_hit


@pytest.fixture(scope="module")
def tune():
    path = Path(__file__).resolve().parents[1] / "bench" / "tune.py"
    spec = importlib.util.spec_from_file_location("wna16_tune", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["wna16_tune"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("wna16_tune", None)


@pytest.mark.parametrize(
    "M,E,top_k,want,never",
    [
        pytest.param(1, 128, 8, {1}, {16, 32, 64, 128}, id="decode-per-pair-only"),
        pytest.param(8, 8, 2, {1, 16}, {128}, id="mixtral-M8-per-pair-and-16"),
        pytest.param(1024, 128, 8, {32, 64}, {1, 128}, id="M1024-64-tokens-per-expert"),
        # from 256 tokens per expert 128 and 256 rows (default_config's 256-row tile: configs.block_m_rule)
        pytest.param(4096, 128, 8, {128, 256}, {1, 16, 64}, id="M4096-prefill-256-rows"),
        pytest.param(8192, 8, 2, {128, 256}, {1}, id="mixtral-prefill-256-rows"),
        pytest.param(2048, 128, 8, {64, 128}, {1, 16, 256}, id="M2048-prefill-128-rows"),
    ],
)
def test_row_tiles_follow_tokens_per_expert(tune, M, E, top_k, want, never):
    got = set(tune.block_m_choices(M, E, top_k))
    assert want <= got and not (never & got), (got, M * top_k / expected_experts_hit(M * top_k, E))


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "qwen3.5-35b-a3b", "mixtral-8x7b", "ct-channelwise"])
@pytest.mark.parametrize("M", [1, 16, 4096])
def test_stage_a_candidates_are_legal_launch_configs(tune, shape, M):
    s = tune.NAMED[shape]
    for N, K in ((2 * s.I, s.H), (s.H, s.I)):
        gs = K if s.gs == -1 else s.gs
        cands = tune.stage_a(M, s.E, N, K, s.top_k, gs, s.bits)
        assert cands, (shape, M)
        for cfg in cands:
            cfg.check_shape(K, gs)  # raises on a K tile the group size does not divide
            if cfg.BLOCK_SIZE_M * cfg.BLOCK_SIZE_N >= 128 * 128:
                assert cfg.BLOCK_SIZE_K <= 64, cfg  # big row tiles spend shared memory on stages
        if M == 4096:
            assert any(c.BLOCK_SIZE_M == 128 and c.BLOCK_SIZE_N == 256 for c in cands), cands


def test_a_run_keeps_the_entries_of_the_m_it_did_not_tune(tune):
    """A prefill-only run (M 1024-8192) must not drop the decode entries already shipped."""
    kept = {"1": {"BLOCK_SIZE_M": 1}, "256": {"BLOCK_SIZE_M": 32}, "1024": {"BLOCK_SIZE_M": 32}}
    tuned = {"8192": {"BLOCK_SIZE_M": 128}, "1024": {"BLOCK_SIZE_M": 64}}
    merged = tune.merge_entries(kept, tuned)
    assert list(merged) == ["1", "256", "1024", "8192"]  # M order, not string order
    assert merged["1024"] == {"BLOCK_SIZE_M": 64} and merged["1"] == {"BLOCK_SIZE_M": 1}


def test_stage_b_times_the_split_form_and_register_caps_on_dot_tiles_only(tune):
    from vllm_wna16_plugin.kernels.triton.configs import TritonMoEConfig

    dot = TritonMoEConfig(16, 128, 256, num_warps=4, num_stages=4)
    got = tune.stage_b(dot, 16, 128, 1536, 2048, 8, td_ok=False, bits=4)
    assert {c.maxnreg for c in got} >= {None, *tune.REGISTER_CAPS}
    assert any(c.nibbles == "split" and c.maxnreg is None for c in got)
    assert not any(c.nibbles for c in tune.stage_b(dot, 16, 128, 1536, 2048, 8, td_ok=False, bits=8))  # int8
    per_pair = TritonMoEConfig(1, 64, 256, num_warps=4, num_stages=4)
    assert not any(
        c.nibbles or c.maxnreg or c.swap_ab for c in tune.stage_b(per_pair, 1, 128, 1536, 2048, 8, td_ok=False)
    )
    # the swapped tile: the rule (configs.swap_takes_wgmma) already swaps every tile wgmma can take (16-64
    # token rows, >= 64 weight rows), and 32-row weight tiles lost to the plain one: no candidate adds it
    assert not any(c.swap_ab for c in got)
    narrow = TritonMoEConfig(16, 32, 128, num_warps=4, num_stages=4)
    assert not any(c.swap_ab for c in tune.stage_b(narrow, 16, 128, 1536, 2048, 8, td_ok=False))
    # a tuned entry round-trips through its JSON, the optional fields only when set
    for cfg in got:
        entry = cfg.to_dict()
        assert TritonMoEConfig(**entry) == cfg
        assert ("maxnreg" in entry) == (cfg.maxnreg is not None)
        assert ("swap_ab" in entry) == cfg.swap_ab


def test_stage_b_times_the_fused_activation_on_unsplit_gemm1_tiles_only(tune):
    from vllm_wna16_plugin.kernels.triton.configs import TritonMoEConfig

    for base in (TritonMoEConfig(16, 128, 256), TritonMoEConfig(1, 64, 256)):  # tl.dot and per pair
        fused = [c for c in tune.stage_b(base, 16, 128, 1536, 2048, 8, td_ok=False, fuse=True) if c.fuse_act]
        # at the tile's BLOCK_SIZE_N (twice the weight rows a program reads) and at half of it (as many)
        assert {c.BLOCK_SIZE_N for c in fused} == {base.BLOCK_SIZE_N, base.BLOCK_SIZE_N // 2}
        assert all(c.SPLIT_K == 1 for c in fused)
        assert not any(c.fuse_act for c in tune.stage_b(base, 16, 128, 1536, 2048, 8, td_ok=False))  # GEMM2
    split = TritonMoEConfig(1, 64, 256, SPLIT_K=2)  # partials: the activation kernel sums them
    assert not any(c.fuse_act for c in tune.stage_b(split, 1, 8, 28672, 4096, 2, td_ok=False, fuse=True))
    # the unfused GEMM1 pays the activation kernel when the pair is picked; the fused one does not
    plain, fused = TritonMoEConfig(16, 64, 128), TritonMoEConfig(16, 32, 128, fuse_act=True)
    g2 = {TritonMoEConfig(16, 64, 64): 10.0}
    costs = {(8, 16): 2.0, (8, "act"): 3.0}
    assert tune.pick_joint({plain: 20.0, fused: 22.0}, g2, costs, 8)[0] == fused  # 22 < 20 + 3
    assert tune.pick_joint({plain: 20.0, fused: 24.0}, g2, costs, 8)[0] == plain
