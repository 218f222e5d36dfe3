"""The shape rule by which auto runs `cuda` on a layer without a measured crossover (backends/cuda.py).

Checked against the H200 measurements it was fitted on (bench/results/h200/results.csv: plugin-cuda against
plugin-triton-auto in the same run, for the six bench shapes at M 1-4096): where the rule takes cuda, cuda
was faster; where it does not, triton was at most 10% slower. The validation set (bench/model_catalog.py)
is for the GPU: these shapes are the development set.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from vllm_wna16_plugin.backends import MoEProblem, RunOptions
from vllm_wna16_plugin.backends.cuda import RULE_SOURCE, layer_ranges, rule_ranges, rule_takes
from vllm_wna16_plugin.kernels.options import PLAN_DEVICES
from vllm_wna16_plugin.scheme import CHANNELWISE, PackFormat, WNA16Scheme

H200 = PLAN_DEVICES["sm90"]
ROOT = Path(__file__).resolve().parents[2]
# bench_moe.py's SHAPES: (E, top_k, H, I, group size)
BENCH_SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, 128), "qwen3.5-35b-a3b": (256, 8, 2048, 512, 32),
    "k1344-gs32": (8, 2, 1344, 1024, 32), "mixtral-8x7b": (8, 2, 4096, 14336, 128),
    "deepseek-v2-lite": (64, 6, 2048, 1408, 128), "ct-channelwise": (128, 8, 2816, 704, CHANNELWISE),
}  # fmt: skip
RUNS = ("stream3", "12bbb3a-tuned-full")  # M <= 64, then M >= 128 (the latest runs with both providers)


def problem_of(E, top_k, H, inter, gs, bits=4):  # noqa: N803
    scheme = WNA16Scheme(bits, gs, False, PackFormat.GPTQ, source="test")
    g13, g2 = (H, inter) if gs == CHANNELWISE else (gs, gs)
    return MoEProblem(scheme=scheme, hidden=H, intermediate=inter, num_experts=E, global_num_experts=E, top_k=top_k,
                      group_size_w13=g13, group_size_w2=g2, platform="cuda", sm=90,
                      options=RunOptions(plan_only=True))  # fmt: skip


def measured() -> dict[tuple[str, int], float]:
    """(shape, M) -> cuda time / triton time, same run."""
    times: dict[tuple[str, str, int], dict[str, float]] = {}
    with open(ROOT / "bench/results/h200/results.csv") as f:
        for r in csv.DictReader(f):
            if r["run"] in RUNS and r["provider"] in ("plugin-cuda", "plugin-triton-auto") and r["median_us"]:
                times.setdefault((r["run"], r["shape"], int(r["M"])), {})[r["provider"]] = float(r["median_us"])
    out = {}
    for (run, shape, m), t in times.items():
        if len(t) == 2 and (run == RUNS[0]) == (m <= 64):
            out[(shape, m)] = t["plugin-cuda"] / t["plugin-triton-auto"]
    return out


def test_the_rule_agrees_with_the_measurements_it_was_fitted_on():
    ratios = measured()
    assert len(ratios) == 66  # six shapes x 11 batch sizes
    for (shape, m), ratio in sorted(ratios.items()):
        takes = rule_takes(problem_of(*BENCH_SHAPES[shape]), m, H200)
        if takes:
            assert ratio < 1.0, f"{shape} M={m}: the rule takes cuda, which took {ratio:.2f}x triton's time"
        else:
            assert ratio > 0.9 - 1e-9, f"{shape} M={m}: the rule keeps triton, cuda was {ratio:.2f}x"


def test_the_rule_needs_int4_sm90_the_tensor_core_kernel_and_a_decode_batch():
    qwen = problem_of(128, 8, 2048, 768, 128)
    assert rule_ranges(qwen, H200) == ((5, 64),)
    assert not rule_takes(qwen, 128, H200) and not rule_takes(qwen, 1, H200)
    assert rule_ranges(problem_of(128, 8, 2048, 768, 128, bits=8), H200) == ()  # not measured for int8
    assert rule_ranges(qwen, PLAN_DEVICES["sm80"]) == ()  # measured on Hopper only
    assert rule_ranges(problem_of(8, 2, 2304, 1024, 96), H200) == ()  # gs96: GEMM1 off the tensor-core kernel


@pytest.mark.parametrize("shape", sorted(BENCH_SHAPES))
def test_a_measured_crossover_comes_before_the_rule(shape):
    ranges, source = layer_ranges(problem_of(*BENCH_SHAPES[shape]), H200)
    assert source != RULE_SOURCE and source.startswith("crossover/NVIDIA_H200.json")
    untuned = layer_ranges(problem_of(64, 8, 3584, 2560, 128), H200)  # Qwen2-57B-A14B: no entry
    assert untuned[1] == RULE_SOURCE and untuned[0]


def test_act_order_moves_the_ranges_off_m1_only():
    import dataclasses

    from vllm_wna16_plugin.backends.cuda import ACT_ORDER_SOURCE, act_order_ranges

    assert act_order_ranges(((1, 32),)) == ((2, 32),)  # Mixtral-8x7B's crossover
    assert act_order_ranges(((8, 64),)) == ((8, 64),)  # Qwen3-30B-A3B's
    assert act_order_ranges(()) == ()  # cuda never won on the shape: triton
    assert act_order_ranges(((1, 1),)) == ()
    assert act_order_ranges(((1, 2), (100, 200))) == ((2, 2), (100, 200))
    mixtral = problem_of(*BENCH_SHAPES["mixtral-8x7b"])
    ranges, source = layer_ranges(dataclasses.replace(mixtral, has_g_idx=True), H200)
    plain, _ = layer_ranges(mixtral, H200)
    assert plain == ((1, 32),) and ranges == ((2, 32),) and ACT_ORDER_SOURCE in source
