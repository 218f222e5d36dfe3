"""bench/rule_report.py (CPU): issue 22's targets read from a catalog run's CSV."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROWS = """shape,M,provider,median_us,p20_us,p80_us,frac_copy_bw,note
Qwen3-30B-A3B@tp1,16,plugin-auto,100,1,1,0.5,
Qwen3-30B-A3B@tp1,16,plugin-triton-auto,120,1,1,0.5,
Qwen3-30B-A3B@tp1,16,plugin-cuda,80,1,1,0.5,
Qwen3-30B-A3B@tp1,16,vllm-marlin,110,1,1,0.5,
Qwen3-30B-A3B@tp1,16,vllm-humming,90,1,1,0.5,
Mixtral-8x22B@tp4,256,plugin-auto,300,1,1,0.5,
Mixtral-8x22B@tp4,256,plugin-triton-auto,300,1,1,0.5,
Mixtral-8x22B@tp4,256,vllm-marlin,250,1,1,0.5,
Mixtral-8x22B@tp4,256,vllm-humming,,,,,crash: boom
not-a-catalog-shape,4,plugin-auto,1,1,1,0.5,
"""


@pytest.fixture()
def report(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "bench" / "rule_report.py"
    spec = importlib.util.spec_from_file_location("rule_report", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "rule_report", module)
    spec.loader.exec_module(module)
    return module


def test_targets_are_read_per_set_from_the_run(report, tmp_path):
    path = tmp_path / "run.csv"
    path.write_text(ROWS)
    pts = report.points(report.read_times([path]), report.catalog_shapes())
    assert [(p.split, p.shape, p.m) for p in pts] == [("dev", "Qwen3-30B-A3B@tp1", 16),
                                                      ("validation", "Mixtral-8x22B@tp4", 256)]  # fmt: skip
    qwen, mixtral = pts
    assert qwen.speedup("vllm-marlin") == pytest.approx(1.1) and qwen.speedup("vllm-humming") == pytest.approx(0.9)
    assert qwen.best_fixed == 80 and mixtral.speedup("vllm-humming") is None  # a crash is no time
    assert mixtral.rule_cuda is None  # M=256 is outside what the rule decides
    text = report.report(pts)
    assert "| dev | plugin-auto: × vllm-marlin at M <= 64 (target >= 1.0) | 0 of 1 below; worst 1.10" in text
    assert "| validation | plugin-auto: × vllm-marlin at M = 256 (target >= 0.9) | 1 of 1 below; worst 0.83" in text
    # composed with Humming: Qwen3-30B-A3B at M=16 reads ~190 MB, which the rule gives Humming (90 µs)
    assert (
        qwen.humming and qwen.composed == 90 and qwen.speedup("vllm-marlin", report.COMPOSED) == pytest.approx(110 / 90)
    )
    assert mixtral.composed is None  # Humming crashed there: no composed time
    assert "| dev | auto+humming: × vllm-humming at M <= 64 (target >= 1.0) | 0 of 1 below; worst 1.00" in text
    assert "| dev | auto > 1.10 × the best fixed kernel | 1 of 1; worst 1.25" in text


def test_every_catalog_model_has_a_shape_at_tp1(report):
    shapes = report.catalog_shapes()
    from model_catalog import CATALOG

    assert {s.name.split("@")[0] for _, s in shapes.values()} == set(CATALOG)


def test_a_runs_form_is_read_from_its_shape_names_and_flag(report, tmp_path):
    """bench_moe --bits 8 names its shapes "<model>@tp4-int8-g128": the report plans them as int8; --zero-points
    (which the names do not show) plans them with zero points. A suffix naming another group than the model's
    (a re-grouped shape) is left out rather than planned on the wrong groups."""
    path = tmp_path / "run.csv"
    path.write_text(
        "shape,M,provider,median_us,p20_us,p80_us,frac_copy_bw,note\n"
        "Mixtral-8x7B@tp4-int8-g128,4,plugin-auto,90,1,1,0.5,\n"
        "Mixtral-8x7B@tp4-int8-g128,4,vllm-humming,80,1,1,0.5,\n"
        "Mixtral-8x7B@tp4-int8-g64,4,plugin-auto,90,1,1,0.5,\n"
        "Mixtral-8x7B@tp4,4,plugin-auto,60,1,1,0.5,\n"
    )
    times = report.read_times([path])
    assert [p.shape for p in report.points(times, report.catalog_shapes())] == [
        "Mixtral-8x7B@tp4",
        "Mixtral-8x7B@tp4-int8-g128",
    ]
    found = report.shape_of("Mixtral-8x7B@tp4-int8-g128", report.catalog_shapes())
    assert found[1].bits == 8 and report.problem_of(found[1]).scheme.bits == 8
    assert report.problem_of(found[1], zero_points=True).scheme.has_zero_point
    assert report.shape_of("Mixtral-8x7B@tp4-int8-g64", report.catalog_shapes()) is None
    # a catalog model whose own shape names carry the suffix (gpt-oss: groups of 32) is found by its name
    split, gpt_oss = report.shape_of("gpt-oss-20b@tp4-int4-g32", report.catalog_shapes())
    assert split == "validation" and gpt_oss.name == "gpt-oss-20b@tp4-int4-g32" and gpt_oss.gs == 32
    zp = report.points(times, report.catalog_shapes(), zero_points=True)
    assert len(zp) == 2
