"""The tuned-config table: the shipped H200 files and the M range a tuned entry serves."""

from __future__ import annotations

import re

import pytest

from vllm_wna16_plugin.kernels.triton.configs import (
    CONFIG_DIR,
    TUNED_M_REACH,
    TritonMoEConfig,
    config_file_name,
    default_config,
    get_triton_moe_config,
    load_tuned_configs,
    nearest_tuned_m,
)

_NAME = re.compile(r"E=(\d+),N=(\d+),K=(\d+),group_size=(-?\d+),bits=(\d+),device_name=(.+)\.json")
SHIPPED = sorted(CONFIG_DIR.glob("*.json"))


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
