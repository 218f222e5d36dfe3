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
            assert cfg == default_config(m, shape.E, N, K, shape.top_k, 128, 4)
    # one file per GEMM shape and device name, for the catalog's models at --tp too (Mixtral-8x22B at TP 4)
    assert (tmp_path / "E=8,N=8192,K=6144,group_size=128,bits=4,device_name=NVIDIA_H200.json").is_file()
