"""bench/heuristic_tables.py: a checkout's default_config heuristic as tuned tables (for plugin-triton-alt)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import heuristic_tables  # noqa: E402

from vllm_wna16_plugin.kernels.triton.configs import default_config, load_tuned_configs  # noqa: E402


def test_the_tables_hold_the_heuristic_and_the_lookup_serves_it_back(tmp_path):
    assert heuristic_tables.main([str(tmp_path), "--catalog", "validation", "--tp", "4", "--m", "1,64,4096",
                                  "--device-name", "NVIDIA H200"]) == 0  # fmt: skip
    shape = next(s for s in heuristic_tables.SHAPES if s.name == "mixtral-8x7b")  # the bench shapes come too
    for N, K in ((2 * shape.I, shape.H), (shape.H, shape.I)):
        table = load_tuned_configs(shape.E, N, K, 128, 4, "NVIDIA H200", tmp_path)
        assert sorted(table) == [1, 64, 4096]
        for m, cfg in table.items():
            assert cfg == default_config(m, shape.E, N, K, shape.top_k, 128, 4, prefill_tiles=True)  # sm90 devices
    # one file per GEMM shape and device name, for the catalog's models at --tp too (Mixtral-8x22B at TP 4)
    assert (tmp_path / "E=8,N=8192,K=6144,group_size=128,bits=4,device_name=NVIDIA_H200.json").is_file()


def test_a_candidate_tile_replaces_the_heuristic_from_its_mean_on(tmp_path):
    import argparse

    import pytest

    from vllm_wna16_plugin.kernels.triton.configs import expected_experts_hit

    argv = [str(tmp_path), "--catalog", "dev", "--tp", "1", "--m", "16,1024,4096", "--device-name", "GPU X",
            "--tile", "128:128x128x64:w8:s3:swap", "--tile", "256:256x128x128:w8:s4:swap"]  # fmt: skip
    assert heuristic_tables.main(argv) == 0
    shape = next(s for s in heuristic_tables.SHAPES if s.name == "mixtral-8x7b")  # E=8, top 2
    table = load_tuned_configs(shape.E, 2 * shape.I, shape.H, 128, 4, "GPU X", tmp_path)
    mean = {m: m * 2 / expected_experts_hit(m * 2, 8) for m in table}
    assert mean[16] < 128 and table[16] == default_config(16, 8, 2 * shape.I, shape.H, 2, 128, 4, True)
    assert mean[1024] >= 256 and table[1024].BLOCK_SIZE_M == 256 and table[1024].swap_ab
    assert table[4096].BLOCK_SIZE_K == 128 and table[4096].num_stages == 4
    # a tile's BLOCK_SIZE_K narrows as default_config's does (configs._pick_block_k: K=1344 wastes 14% of a
    # 256-wide K loop, so 128)
    tile = heuristic_tables.parse_tile("128:128x128x256:w8:s3:swap")
    assert tile.config.swap_ab and tile.config.num_warps == 8 and tile.from_mean == 128
    narrowed = heuristic_tables.entry(4096, shape, 2 * shape.I, 1344, 32, [tile])
    assert narrowed.BLOCK_SIZE_K == 128 and narrowed.swap_ab and narrowed.BLOCK_SIZE_M == 128
    assert not heuristic_tables.parse_tile("128:128x128x64:w8:s3:plain").config.swap_ab  # 128 rows stay plain
    # a plain tile the swap rule would swap anyway (16-64 and 256 token rows) cannot be a table's candidate
    for bad in ("128:128x128:w8:s3", "x:128x128x64:w8:s3", "128:96x128x64:w8:s3", "256:256x128x64:w8:s3:plain",
                "64:64x128x64:w8:s3"):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match="--tile"):
            heuristic_tables.parse_tile(bad)


def test_a_middle_regime_candidate_changes_only_that_regime(tmp_path):
    import argparse
    from dataclasses import replace

    import pytest

    from vllm_wna16_plugin.kernels.triton.configs import MID_TILE, expected_experts_hit

    argv = [str(tmp_path), "--catalog", "validation", "--tp", "4", "--m", "8,64,128,256,4096", "--device-name", "GPU X",
            "--mid", "128x256:w4:s3"]  # fmt: skip
    assert heuristic_tables.main(argv) == 0
    shape = next(s for s in heuristic_tables.SHAPES if s.name == "mixtral-8x7b")  # E=8, top 2, K 4096 / 14336
    wide = replace(MID_TILE, block_n=128, block_k=256, stages=3)
    for N, K in ((2 * shape.I, shape.H), (shape.H, shape.I)):
        table = load_tuned_configs(shape.E, N, K, 128, 4, "GPU X", tmp_path)
        for m, cfg in table.items():
            mean = m * 2 / expected_experts_hit(m * 2, 8)
            ours = default_config(m, 8, N, K, 2, 128, 4, prefill_tiles=True)
            if 16 < mean <= 64:  # M 64 (a mean just above 16), 128, 256: the candidate's tile, the heuristic's rows
                assert cfg == default_config(m, 8, N, K, 2, 128, 4, True, wide) != ours, m
                assert (cfg.BLOCK_SIZE_K, cfg.num_stages, cfg.BLOCK_SIZE_M) == (256, 3, ours.BLOCK_SIZE_M)
            else:  # M=8 and prefill: the heuristic's own entries
                assert cfg == ours, m
    for bad in ("128x256", "128x256:w3:s4", "128x100:w4:s4", "x:w4:s4"):
        with pytest.raises(argparse.ArgumentTypeError, match="--mid"):
            heuristic_tables.parse_mid(bad)


def test_a_per_pair_bound_candidate_moves_only_the_gemv_regime_and_writes_int8_too(tmp_path):
    from model_catalog import catalog_configs
    from model_shapes import model_moe_shape

    from vllm_wna16_plugin.kernels.triton.configs import expected_experts_hit, gemv_bound, triton_launch

    config = dict(catalog_configs("dev"))["Qwen3-30B-A3B"]  # E=128, top 8, at TP 4: I=192, down re-grouped to 64
    ms = [1, 4, 8, 16, 24, 32, 64]
    for name, extra in (("plain", []), ("cand", ["--gemv-max", "3.0"])):
        argv = [str(tmp_path / name), "--catalog", "dev", "--tp", "4", "--m", ",".join(map(str, ms)),
                "--device-name", "GPU X", "--bits", "4,8", *extra]  # fmt: skip
        assert heuristic_tables.main(argv) == 0
    for bits in (4, 8):
        s = model_moe_shape(config, 4, bits, 128)
        bound = gemv_bound(bits, s.H, s.I)  # 2.0 for these small int4 experts, 2.8 for int8
        for gemm, (N, K, gs) in enumerate(((2 * s.I, s.H, s.group_w13), (s.H, s.I, s.group_w2))):
            plain = load_tuned_configs(s.E, N, K, gs, bits, "GPU X", tmp_path / "plain")
            cand = load_tuned_configs(s.E, N, K, gs, bits, "GPU X", tmp_path / "cand")
            assert sorted(plain) == sorted(cand) == ms
            for m in ms:
                mean = m * 8 / expected_experts_hit(m * 8, 128)
                runs = triton_launch(m, s.E, s.H, s.I, s.top_k, s.group_w13, s.group_w2, bits).configs[gemm]
                assert plain[m] == runs, (bits, m)  # the tables hold what the plugin runs (the layer's bound)
                assert plain[m].per_pair == (mean <= bound) and cand[m].per_pair == (mean <= 3.0), (bits, m, mean)
                if mean <= bound or mean > 3.0:  # M 1-24 per pair in both (int8: 32 too), M=64 tiles: unchanged
                    assert cand[m] == plain[m], (bits, m)
                else:  # int4 at M=32: a mean of 2.31, above the bound and under the candidate's
                    assert not plain[m].per_pair and cand[m].per_pair
    assert not list(tmp_path.glob("*/*bits=8*E=8,*"))  # the bench's int4 shapes stay int4


def test_the_middle_tile_agrees_with_the_h200_run_that_kept_it():
    """configs.MID_TILE against bench/results/h200 run 3038a96-mid (every catalog model at TP 4, M 64-512; the
    heuristic's tables as plugin-triton-alt-base, three candidates for its middle regime beside it): at the points
    whose mean of pairs per hit expert is in (16, 64], the heuristic came within 10% of the fastest candidate at all
    but one point of each set (docs/perf/any-model.md), and no candidate was faster at most of them."""
    import csv

    from model_catalog import catalog_configs
    from model_shapes import model_moe_shape

    from vllm_wna16_plugin.kernels.triton.configs import MID_TILE, RegimeTile, expected_experts_hit

    assert MID_TILE == RegimeTile(block_n=64, block_k=64, group_m=8, warps=4, stages=4)  # what was timed as base
    dev = {name for name, _ in catalog_configs("dev")}
    configs = dict(catalog_configs("all"))
    times: dict[tuple[str, int], dict[str, float]] = {}
    with open(ROOT / "bench/results/h200/results.csv") as f:
        for r in csv.DictReader(f):
            if r["run"] == "3038a96-mid" and r["median_us"]:
                times.setdefault((r["shape"], int(r["M"])), {})[r["provider"]] = float(r["median_us"])
    misses = {"dev": 0, "validation": 0}
    points = {"dev": 0, "validation": 0}
    wins = {"n128k256": 0, "n64k128": 0, "n128k128": 0}
    for (label, m), t in times.items():
        name = label.split("@")[0]
        shape = model_moe_shape(configs[name], 4, 4, 32 if name.startswith("gpt-oss") else 128, name=name)
        pairs = m * shape.top_k
        if not 16 < pairs / expected_experts_hit(pairs, shape.E) <= 64:
            continue
        candidates = {k.removeprefix("plugin-triton-alt-"): v for k, v in t.items() if k.startswith("plugin-triton")}
        which = "dev" if name in dev else "validation"
        points[which] += 1
        misses[which] += candidates["base"] > 1.10 * min(candidates.values())
        for k in wins:
            wins[k] += candidates[k] < candidates["base"]
    assert points["dev"] >= 15 and points["validation"] >= 15, points
    assert misses["dev"] <= 1 and misses["validation"] <= 1, misses
    assert all(w <= 0.25 * sum(points.values()) for w in wins.values()), wins
