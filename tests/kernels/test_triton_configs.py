"""The tuned-config table: the shipped H200 files and the M range a tuned entry serves."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from vllm_wna16_plugin.kernels.triton.configs import (
    CONFIG_DIR,
    TUNED_M_REACH,
    TritonMoEConfig,
    block_m_rule,
    config_file_name,
    default_config,
    expected_block_reads,
    get_triton_moe_config,
    load_tuned_configs,
    nearest_tuned_m,
)

_NAME = re.compile(r"E=(\d+),N=(\d+),K=(\d+),group_size=(-?\d+),bits=(\d+),device_name=(.+)\.json")
SHIPPED = sorted(CONFIG_DIR.glob("*.json"))
# bench_moe.py's SHAPES, the shapes the shipped tables were tuned for: (E, top_k, H, I, group size; -1 channel-wise)
BENCH_SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, 128), "qwen3.5-35b-a3b": (256, 8, 2048, 512, 32),
    "k1344-gs32": (8, 2, 1344, 1024, 32), "mixtral-8x7b": (8, 2, 4096, 14336, 128),
    "deepseek-v2-lite": (64, 6, 2048, 1408, 128), "ct-channelwise": (128, 8, 2816, 704, -1),
}  # fmt: skip


def test_h200_configs_are_shipped():
    # the benchmark shapes tuned on the H200 (bench/results/h200/*-tune.log): both GEMMs of each
    names = {p.name for p in SHIPPED}
    for E, H, I, gs in [(128, 2048, 768, 128), (256, 2048, 512, 32), (8, 4096, 14336, 128)]:  # noqa: E741
        assert config_file_name(E, 2 * I, H, gs, 4, "NVIDIA H200") in names
        assert config_file_name(E, H, I, gs, 4, "NVIDIA H200") in names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_config_file_is_legal_and_served(path):
    E, N, K, gs, bits, device = _NAME.fullmatch(path.name).groups()
    E, N, K, gs, bits = int(E), int(N), int(K), int(gs), int(bits)
    device_name = device.replace("_", " ")
    table = load_tuned_configs(E, N, K, gs, bits, device_name)
    assert table and all(isinstance(c, TritonMoEConfig) for c in table.values())
    for m, cfg in table.items():
        cfg.check_shape(K, gs)  # legal for the group size by construction of the tuner
        # the lookup serves each tuned M its own entry (top_k does not enter a tuned lookup)
        assert get_triton_moe_config(m, E, N, K, 8, gs, bits, device_name) == cfg


def test_tuned_entry_serves_only_near_its_range(tmp_path):
    name = config_file_name(8, 256, 512, 32, 4, "NVIDIA H200")
    (tmp_path / name).write_text(
        '{"4": {"BLOCK_SIZE_M": 1, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128},'
        ' "256": {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64}}'
    )
    table = load_tuned_configs(8, 256, 512, 32, 4, "NVIDIA H200", tmp_path)
    assert [nearest_tuned_m(table, m) for m in (2, 3, 4, 100, 256, 512)] == [4, 4, 4, 4, 256, 256]
    assert nearest_tuned_m(table, 256 * TUNED_M_REACH + 1) is None
    assert nearest_tuned_m(table, 1) is None  # 4 > 1 * TUNED_M_REACH

    def lookup(m):
        return get_triton_moe_config(m, 8, 256, 512, 2, 32, 4, "NVIDIA H200", config_dir=tmp_path)

    assert lookup(512).BLOCK_SIZE_M == 32
    # past the tuned range the heuristic serves, as for an untuned shape
    assert lookup(4096) == default_config(4096, 8, 256, 512, 2, 32, 4)
    assert lookup(1) == default_config(1, 8, 256, 512, 2, 32, 4)


def test_the_swap_rule_agrees_with_the_h100_measurements():
    """configs.swap_takes_wgmma against the run it was fitted on and checked with (bench/results/h100/results.csv,
    runs adcda24-swapfused and -swapfused2: plugin-triton-swap, every tl.dot tile of >= 16 rows swapped, against
    plugin-triton-auto, none swapped, on the H100's default configs). Where the rule swaps both GEMMs' tiles the
    swapped layer was at most 3% slower than the plain one; where it swaps neither, at most 3% faster; points
    where it would swap one GEMM only were not measured as such and are skipped."""
    import csv
    from pathlib import Path

    from vllm_wna16_plugin.kernels.triton.configs import choose_triton_moe_config, swap_takes_wgmma

    shapes = BENCH_SHAPES
    times: dict[tuple[str, int], dict[str, float]] = {}
    root = Path(__file__).resolve().parents[2]
    with open(root / "bench/results/h100/results.csv") as f:
        for r in csv.DictReader(f):
            if r["run"].startswith("adcda24-swapfused") and r["provider"] in (
                "plugin-triton-auto",
                "plugin-triton-swap",
            ):
                times.setdefault((r["shape"], int(r["M"])), {})[r["provider"]] = float(r["median_us"])
    checked = 0
    for (shape, m), t in sorted(times.items()):
        E, top_k, H, inter, gs = shapes[shape]
        # the configs the run timed: its GEMV bound was 1.15 (configs.gemv_bound came after)
        cfgs = [choose_triton_moe_config(m, E, n, k, top_k, k if gs == -1 else gs, 4, "NVIDIA H100 80GB HBM3",
                                         gemv_max=1.15).config for n, k in ((2 * inter, H), (H, inter))]  # fmt: skip
        dots = [c for c in cfgs if c.BLOCK_SIZE_M >= 16]  # the tiles the forced swap swapped
        if not dots:
            continue  # per pair: nothing to swap
        rule = {swap_takes_wgmma(c) for c in dots}
        if len(rule) == 2:
            continue
        ratio = t["plugin-triton-swap"] / t["plugin-triton-auto"]
        if rule == {True}:
            assert ratio <= 1.03, f"{shape} M={m}: the rule swaps, the swapped layer took {ratio:.2f}x"
        else:
            assert ratio >= 0.97, f"{shape} M={m}: the rule keeps the plain tile, the swapped took {ratio:.2f}x"
        checked += 1
    assert checked >= 30, checked


def test_the_block_m_rule_agrees_with_the_h200_tuner():
    """configs.block_m_rule against the H200 tuner's tables (bench/tune.py's pick among tile heights 16-128 for
    the bench shapes, M 4-8192): the same height on every entry of up to 64 rows; on its 128-row prefill entries
    (tuned plain) 128 rows too, or 256 where the mean reaches 256 (a height the tuner did not have then)."""
    top_k_of = {}
    for E, top_k, H, inter, _ in BENCH_SHAPES.values():
        top_k_of[(E, 2 * inter, H)] = top_k_of[(E, H, inter)] = top_k
    checked = prefill = 0
    for path in SHIPPED:
        E, N, K, gs, bits, device = _NAME.fullmatch(path.name).groups()
        E, N, K = int(E), int(N), int(K)
        for m, cfg in load_tuned_configs(E, N, K, int(gs), int(bits), device.replace("_", " ")).items():
            if cfg.BLOCK_SIZE_M == 1:
                continue  # per pair: the GEMV regime, not a tile height
            rule = block_m_rule(m, E, top_k_of[(E, N, K)], prefill_tiles=True)  # the H200 is sm90
            if cfg.BLOCK_SIZE_M == 128:
                assert rule in (128, 256) and m >= 1024, f"{path.name} M={m}"
                prefill += 1
                continue
            assert rule == cfg.BLOCK_SIZE_M, f"{path.name} M={m}"
            checked += 1
    assert checked == 42 and prefill == 30, (checked, prefill)


def test_the_block_m_rule_takes_64_rows_where_the_validation_run_timed_them_faster():
    """The rule against the run that judged it (H100, validation shapes at TP 4 it was not fitted on): where it
    gives 64 rows and the former heuristic 32, plugin-triton-auto (64) was faster than plugin-triton-alt (32)."""
    import csv
    from pathlib import Path

    catalog = {"Mixtral-8x22B@tp4": (8, 2), "DeepSeek-V3@tp4": (256, 8), "Qwen2-57B-A14B@tp4": (64, 8),
               "Llama-4-Scout@tp4": (16, 1), "ERNIE-4.5-21B-A3B@tp4": (64, 6)}  # fmt: skip
    times: dict[tuple[str, int], dict[str, float]] = {}
    root = Path(__file__).resolve().parents[2]
    with open(root / "bench/results/h100/results.csv") as f:
        for r in csv.DictReader(f):
            if r["run"] == "332769e-bm" and r["shape"] in catalog:
                times.setdefault((r["shape"], int(r["M"])), {})[r["provider"]] = float(r["median_us"])
    checked = 0
    for (shape, m), t in sorted(times.items()):
        E, top_k = catalog[shape]
        mean = m * top_k / (E * (1 - (1 - 1 / E) ** (m * top_k)))
        if 16 < mean <= 64 and block_m_rule(m, E, top_k) == 64:
            assert t["plugin-triton-auto"] < 0.97 * t["plugin-triton-alt"], (shape, m, t)
            checked += 1
    assert checked >= 7, checked


@pytest.mark.parametrize("M,E,top_k,block_m", [(64, 8, 2, 16), (64, 8, 2, 32), (256, 128, 8, 16), (48, 40, 8, 16),
                                               (512, 64, 6, 64), (3, 4, 4, 16), (200, 16, 1, 32)])  # fmt: skip
def test_expected_block_reads_matches_sampled_routing(M, E, top_k, block_m):
    # routing sampled as a router does it (top_k distinct experts per token), counted per expert hit
    import torch

    gen = torch.Generator().manual_seed(M * 1000 + E)
    trials, reads, hit = 4000, 0, 0
    for _ in range(trials):
        ids = torch.rand(M, E, generator=gen).topk(top_k, dim=1).indices
        counts = torch.bincount(ids.flatten(), minlength=E)
        reads += int((-(-counts // block_m)).sum())
        hit += int((counts > 0).sum())
    sampled = reads / hit
    assert expected_block_reads(M, E, top_k, block_m) == pytest.approx(sampled, rel=0.01)


def test_default_config_tiles_follow_the_block_m_rule():
    # the rule's height in every tl.dot regime, on shapes the tables do not hold (validation-set sizes)
    for M, E, N, K, top_k in [(64, 8, 32768, 6144, 2), (256, 64, 5120, 3584, 8), (4096, 16, 16384, 5120, 1),
                              (64, 40, 1024, 1536, 8), (64, 512, 1024, 2048, 10), (128, 8, 8192, 6144, 2)]:  # fmt: skip
        cfg = default_config(M, E, N, K, top_k, 128, 4)
        assert cfg.BLOCK_SIZE_M == block_m_rule(M, E, top_k), (M, E, cfg)
    assert default_config(16, 512, 1024, 2048, 10, 128, 4).per_pair  # a mean of 1.16: the GEMV (configs.gemv_bound)
    assert block_m_rule(64, 40, 8) == 16  # a mean of 12.8: 32 rows lost 1.56x there (granite, M=64)
    assert block_m_rule(128, 8, 2) == 64  # a mean of 32: 64 rows, 0.89x the 32-row time (Mixtral-8x22B TP 4)
    assert block_m_rule(4096, 8, 2, True) == 256  # prefill, a mean of 1024: 256 rows swapped (0.71-0.86x the 64-row)
    assert block_m_rule(4096, 256, 8, True) == 128  # a mean of 128 (DeepSeek-V3 TP 4): 128 rows plain (0.90x)
    assert block_m_rule(2048, 256, 8, True) == 64  # a mean of 64
    assert block_m_rule(4096, 8, 2) == 64  # without prefill_tiles (a device they were not timed on): 64 rows


def test_prefill_tiles_only_where_they_were_timed_and_fit():
    """configs.prefill_tiles_apply: NVIDIA sm90 only (the 256-row tile needs 104 KB of shared memory there and
    80 KB on ROCm's gfx942, which has 64 KB); the launch plan and the Triton launcher pass it to default_config."""
    from vllm_wna16_plugin.kernels.options import DeviceSpec
    from vllm_wna16_plugin.kernels.triton.configs import prefill_tiles_apply, triton_launch
    from vllm_wna16_plugin.launch_plan import _triton_plan

    assert prefill_tiles_apply("cuda", 90)
    for platform, sm in (("cuda", 80), ("cuda", 89), ("cuda", 100), ("rocm", None), ("xpu", None),
                         ("interpreter", None), ("cpu", None)):  # fmt: skip
        assert not prefill_tiles_apply(platform, sm), (platform, sm)
    # Mixtral-8x7B's GEMMs at M=4096 (no tuned table under this device name): 256 rows on sm90, 64 elsewhere
    big = triton_launch(4096, 8, 4096, 14336, 2, 128, 128, 4, "GPU X", prefill_tiles=True).configs
    small = triton_launch(4096, 8, 4096, 14336, 2, 128, 128, 4, "GPU X").configs
    assert [c.BLOCK_SIZE_M for c in big] == [256, 256] and [c.BLOCK_SIZE_M for c in small] == [64, 64]
    from tests.test_launch_plan import layer_problem

    problem = layer_problem(8, 2, 4096, 14336, 1, 4, 128)  # Mixtral-8x7B, one rank
    for device, rows in ((DeviceSpec("cuda", 90, "GPU X", 132), 256), (DeviceSpec("rocm", None, "MI300X", 304), 64)):
        plan = _triton_plan(problem, 4096, device, "triton", [])
        assert plan.launch.gemm1.config.BLOCK_SIZE_M == rows, device


def test_the_prefill_tiles_agree_with_the_h100_run_that_set_them():
    """block_m_rule's prefill heights and swap_takes_wgmma against bench/results/h100 run 23a2f37-pf (Triton alone,
    64-row tiles as plugin-triton-auto, candidate tiles as plugin-triton-alt-NAME): wherever the rule gives 128 or
    256 rows the candidate it names beat the 64-row tile and came within 7% of the fastest candidate; the
    swapped 128-row tile (s128) lost to the 64-row tile at every point with a mean >= 128 and >= 256 rows' gain."""
    import csv
    from pathlib import Path

    from vllm_wna16_plugin.kernels.triton.configs import expected_experts_hit, swap_takes_wgmma

    routing = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336),
               "deepseek-v2-lite": (64, 6, 2048, 1408), "Mixtral-8x22B@tp4": (8, 2, 6144, 4096),
               "DeepSeek-V3@tp4": (256, 8, 7168, 512), "Qwen2-57B-A14B@tp4": (64, 8, 3584, 640),
               "Qwen3-Next-80B-A3B@tp4": (512, 10, 2048, 128), "granite-3.1-3b-a800m@tp4": (40, 8, 1536, 128),
               "Llama-4-Scout@tp4": (16, 1, 5120, 2048)}  # fmt: skip
    times: dict[tuple[str, int], dict[str, float]] = {}
    root = Path(__file__).resolve().parents[2]
    with open(root / "bench/results/h100/results.csv") as f:
        for r in csv.DictReader(f):
            if r["run"] == "23a2f37-pf" and r["median_us"]:
                times.setdefault((r["shape"], int(r["M"])), {})[r["provider"]] = float(r["median_us"])
    checked = 0
    for (shape, m), t in sorted(times.items()):
        E, top_k, H, inter = routing[shape]
        mean = m * top_k / expected_experts_hit(m * top_k, E)
        rows = block_m_rule(m, E, top_k, prefill_tiles=True)  # the H100 is sm90
        if rows < 128 or "plugin-triton-alt-p128" not in t:
            continue
        timed = TritonMoEConfig(rows, 128, 64, GROUP_SIZE_M=8, num_warps=8, num_stages=3, swap_ab=rows == 256)
        for N, K in ((2 * inter, H), (H, inter)):  # what ships is what was timed, both GEMMs
            assert default_config(m, E, N, K, top_k, 128, 4, prefill_tiles=True) == replace(timed, swap_ab=False)
        ours = t["plugin-triton-alt-s256" if rows == 256 else "plugin-triton-alt-p128"]
        assert swap_takes_wgmma(timed) == (rows == 256)
        best = min(v for k, v in t.items() if k.startswith("plugin-triton"))
        assert ours < 0.95 * t["plugin-triton-auto"] and ours <= 1.07 * best, (shape, m, mean, t)
        assert t["plugin-triton-alt-s128"] > t["plugin-triton-auto"], (shape, m)
        checked += 1
    assert checked >= 10, checked


@pytest.mark.parametrize("gs, K, ok", [(8, 96, True), (16, 96, True), (48, 96, True), (96, 96, True), (128, 256, True),
                                       (-1, 100, True), (24, 96, False), (40, 240, False), (12, 96, False)])  # fmt: skip
def test_group_size_reason_matches_the_tiles_check_shape_accepts(gs, K, ok):
    from vllm_wna16_plugin.kernels.triton.configs import TILE_BLOCK_K, group_size_reason

    legal = [bk for bk in TILE_BLOCK_K if _legal(TritonMoEConfig(16, 64, bk), K, gs)]
    assert (group_size_reason("w2", gs, K) is None) == ok == bool(legal)


@pytest.mark.parametrize("gs", [1, 2, 4])
def test_groups_below_eight_columns_are_refused_though_a_tile_holds_them(gs):
    # powers of two, so check_shape takes them; the GEMV's int4 group fold cannot shape them (interpreter /
    # compile error at the first decode, found by a CPU sweep)
    from vllm_wna16_plugin.kernels.triton.configs import group_size_reason

    assert _legal(TritonMoEConfig(16, 64, 16), 64, gs)
    assert "is below 8" in group_size_reason("w13", gs, 64)


def _legal(cfg: TritonMoEConfig, K: int, gs: int) -> bool:
    try:
        cfg.check_shape(K, gs)
    except ValueError:
        return False
    return True


def test_the_gemv_bound_by_width_and_expert_size_and_both_gemms_share_it():
    """configs.gemv_bound (fitted on the H100 development set, bench/results/h100/2026-12-07-d3ec747-h100-gemv-*):
    int8 2.8; int4 1.56, or 2.0 where one expert's gate/up weights are under 1 MiB; triton_launch gives both GEMMs
    of a layer the layer's bound, so they switch to the GEMV together."""
    from vllm_wna16_plugin.kernels.triton.configs import expected_experts_hit, gemv_bound, triton_launch

    assert gemv_bound(8) == gemv_bound(8, 2048, 192) == 2.8
    assert gemv_bound(4) == gemv_bound(4, 4096, 384) == 1.56  # Qwen3-235B-A22B at TP 4: 1.5 MiB of gate/up
    assert gemv_bound(4, 2048, 192) == 2.0  # Qwen3-30B-A3B at TP 4: 0.375 MiB
    assert gemv_bound(4, 2048, 511) == 2.0 and gemv_bound(4, 2048, 512) == 1.56  # the 1 MiB edge (2*I*H/2 bytes)
    for H, inter in ((2048, 192), (4096, 384)):  # E=128, top 8: means 1.27 (M=8), 1.58 (M=16), 1.93 (M=24), 2.31
        bound = gemv_bound(4, H, inter)
        for m in (8, 16, 24, 32):
            mean = m * 8 / expected_experts_hit(m * 8, 128)
            gemm1, gemm2 = triton_launch(m, 128, H, inter, 8, 128, 64, 4).configs
            assert gemm1.per_pair == gemm2.per_pair == (mean <= bound), (H, inter, m, mean)
