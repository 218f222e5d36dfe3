"""bench/bench_moe.py's table (CPU): which plugin column the speed-up ratios are of."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture()
def bench(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_moe", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _row(shape, m, prov, us, frac=0.5):
    return (shape, m, prov, (us, us, us, frac))


def test_ratios_are_of_plugin_auto_when_it_ran_not_of_the_best_form(bench):
    providers = ["plugin-auto", "plugin-triton-td", "vllm-marlin"]
    rows = [_row("s", 8, "plugin-auto", 100.0, 0.3), _row("s", 8, "plugin-triton-td", 50.0, 0.6),
            _row("s", 8, "vllm-marlin", 80.0)]  # fmt: skip
    line = bench.render(rows, providers).splitlines()[2]
    # best column names the fastest form, but %bw and × vs marlin are auto's: 30%, 0.80 (not 60%, 1.60)
    assert line == "| s | 8 | 100.0 | 50.0 | 80.0 | triton-td | 30% | 0.80 |", line


def test_without_plugin_auto_the_ratios_are_of_the_best_plugin_provider(bench):
    rows = [_row("s", 8, "plugin-triton", 100.0, 0.3), _row("s", 8, "plugin-cuda", 50.0, 0.6),
            _row("s", 8, "vllm-marlin", 80.0), ("s", 8, "vllm-cuda", ("crash", "boom"))]  # fmt: skip
    head, _, line = bench.render(rows, ["plugin-triton", "plugin-cuda", "vllm-marlin", "vllm-cuda"]).splitlines()
    assert "%bw (best)" in head
    assert line == "| s | 8 | 100.0 | 50.0 | 80.0 | crash | cuda | 60% | 1.60 | - |", line


def test_the_alt_provider_reads_its_own_config_dir_only_while_it_runs(bench, tmp_path, monkeypatch):
    import json

    from vllm_wna16_plugin.kernels.triton import configs

    entry = configs.TritonMoEConfig(32, 64, 64, GROUP_SIZE_M=8, maxnreg=128)
    name = configs.config_file_name(4, 256, 512, 128, 4, "GPU X")
    (tmp_path / name).write_text(json.dumps({"64": entry.to_dict()}))
    monkeypatch.setattr(bench, "ALT_CONFIG_DIR", tmp_path)
    get = lambda: configs.get_triton_moe_config(64, 4, 256, 512, 2, 128, 4, "GPU X")  # noqa: E731
    shipped = get()  # no file in the package for "GPU X": the heuristic
    assert shipped == configs.default_config(64, 4, 256, 512, 2, 128, 4)
    with bench.triton_form("plugin-triton-alt"):
        assert get() == entry
    assert get() == shipped and configs.CONFIG_DIR.name == "configs"  # restored, cache cleared
    monkeypatch.setattr(bench, "ALT_CONFIG_DIR", None)
    with pytest.raises(bench.NotApplicable, match="--alt-config-dir"), bench.triton_form("plugin-triton-alt"):
        pass
