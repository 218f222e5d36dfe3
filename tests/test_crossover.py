"""The measured cuda-over-triton crossover table, and how auto and the cuda backend use it (CPU)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vllm_wna16_plugin import crossover
from vllm_wna16_plugin.backends import RunOptions, registry
from vllm_wna16_plugin.backends.base import KernelTensors
from vllm_wna16_plugin.backends.cuda import layer_key
from vllm_wna16_plugin.launch_plan import plan
from vllm_wna16_plugin.ops import make_problem
from vllm_wna16_plugin.oracle import select_backend


def test_measured_crossover_is_the_contiguous_win_from_the_smallest_m():
    assert crossover.measured_crossover({1: (10.0, 20.0), 4: (30.0, 40.0), 16: (90.0, 80.0), 64: (1.0, 9.0)}) == 4
    assert crossover.measured_crossover({1: (25.0, 20.0), 4: (1.0, 40.0)}) == 0
    assert crossover.measured_crossover({2: (1.0, 2.0), 1: (1.0, 2.0)}) == 2  # order of the dict does not matter


def test_table_round_trip_and_bad_entries(tmp_path):
    key = crossover.layer_key(128, 2048, 768, 128, 4)
    assert key == "E=128,H=2048,I=768,group_size=128,bits=4"
    path = crossover.write_crossovers({key: {"cuda_max_m": 8, "source": "x.md"}}, "NVIDIA H200", tmp_path)
    assert path.name == "NVIDIA_H200.json"
    assert crossover.cuda_max_m(key, "NVIDIA H200", tmp_path) == 8
    assert crossover.cuda_max_m(key, "NVIDIA B200", tmp_path) == 0  # another device: no entry
    assert crossover.cuda_max_m(key, None, tmp_path) == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "X.json").write_text(json.dumps({key: {"cuda_max_m": "many"}}))
    with pytest.raises(ValueError, match="needs cuda_m_ranges or a non-negative integer cuda_max_m"):
        crossover.cuda_max_m(key, "X", bad)


def _sm90_problem(**options):
    E, H, I = 8, 256, 128  # noqa: E741
    p = make_problem(
        torch.zeros(1, H, dtype=torch.bfloat16), torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8),
        torch.zeros(E, H, I // 2, dtype=torch.uint8), torch.zeros(E, 2 * I, H // 32, dtype=torch.bfloat16),
        torch.zeros(E, H, I // 32, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32),
        bits=4, group_size=32, has_zero_point=False,
    )  # fmt: skip
    return dataclasses.replace(
        p, platform="cuda", sm=90, options=RunOptions(plan_only=True, device_name="GPU X", **options)
    )


def test_auto_takes_cuda_only_where_a_crossover_is_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(crossover, "CROSSOVER_DIR", tmp_path)
    problem = _sm90_problem()
    selection = select_backend(problem)
    assert selection.backend.name == "triton"
    assert "cuda: rejected: no measured crossover over triton" in selection.explain()
    crossover.write_crossovers({layer_key(problem): {"cuda_max_m": 4}}, "GPU X", tmp_path)
    problem = _sm90_problem()
    selection = select_backend(problem)
    assert selection.backend.name == "cuda" and selection.problem.options.explicit is False
    # auto's cuda layer keeps the crossover in its plans (larger batches go to triton); an explicit cuda runs
    # every batch (tests/test_launch_plan.py runs both through a layer's runner)
    assert [plan(problem, m, selection=selection).backend for m in (1, 4, 5)] == ["cuda", "cuda", "triton"]
    explicit = select_backend(_sm90_problem(), "cuda", "test")
    assert explicit.problem.options.explicit is True and not problem.options.explicit  # the given one unchanged
    assert [plan(problem, m, selection=explicit).backend for m in (1, 4, 5)] == ["cuda"] * 3


def _tensors(zp: bool = True) -> KernelTensors:
    gen = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)  # noqa: E731
    return KernelTensors(rand(4, 64, 32), rand(4, 64, 16), torch.randn(4, 64, 2, generator=gen),
                         torch.randn(4, 64, 1, generator=gen), rand(4, 32, 2) if zp else None,
                         rand(4, 32, 1) if zp else None)  # fmt: skip


@pytest.mark.parametrize("zp", [True, False])
def test_cuda_state_holds_group_major_tables_of_the_same_values(zp):
    # the CUDA kernel's copy: the same values, each group's rows adjacent in memory (cuda_ops.group_major);
    # the packed weights are shared (triton, for batches outside the crossover, keeps the layer's own tensors)
    tensors = _tensors(zp)
    state = registry()["cuda"].prepare(_sm90_problem(explicit=True), tensors)
    assert state.w13_qweight is tensors.w13_qweight and state.w2_qweight is tensors.w2_qweight
    for name in ("w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros"):
        ours, theirs = getattr(state, name), getattr(tensors, name)
        if theirs is None:
            assert ours is None
            continue
        assert torch.equal(ours, theirs)
        if theirs.shape[2] > 1:  # with one group (channel-wise) the two layouts are the same memory
            assert ours.stride() == (theirs.shape[1] * theirs.shape[2], 1, theirs.shape[1])


def test_bench_writes_the_crossover_it_measured(tmp_path, monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_moe", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    shape = next(s for s in bench.SHAPES if s.name == "qwen3-30b-a3b")
    timed = {1: (10.0, 20.0), 4: (30.0, 35.0), 16: (90.0, 80.0)}  # cuda wins at M=1 and 4
    rows = [(shape.name, m, prov, (us, us, us, 0.5)) for m, pair in timed.items()
            for prov, us in zip(("plugin-cuda", "plugin-triton"), pair, strict=True)]  # fmt: skip
    rows.append((shape.name, 64, "plugin-cuda", ("crash", "boom")))  # an untimed point is ignored
    report = bench.record_crossovers(rows, [shape], "GPU Y", tmp_path, tmp_path / "run.md")
    assert "cuda beats triton at M=1..4 of M=[1, 4, 16]" in report
    key = crossover.layer_key(128, 2048, 768, 128, 4)
    assert crossover.cuda_max_m(key, "GPU Y", tmp_path) == 4
    assert crossover.cuda_m_ranges(key, "GPU Y", tmp_path) == ((1, 4),)


def test_measured_ranges_are_the_runs_of_wins():
    times = {1: (25.0, 20.0), 2: (5.0, 9.0), 4: (8.0, 9.0), 8: (9.0, 9.0), 16: (1.0, 2.0), 32: (99.0, 100.0)}
    assert crossover.measured_ranges(times) == [[2, 4], [16, 16]]  # 1% at M=32 is not a win
    assert crossover.measured_ranges({1: (2.0, 1.0)}) == []


def test_the_shipped_h200_table_is_what_its_run_measured():
    import csv
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    table = json.loads((root / "vllm_wna16_plugin" / "crossover" / "NVIDIA_H200.json").read_text())
    assert table, "no H200 crossover shipped"
    for key, entry in table.items():
        rows = list(csv.DictReader(open(root / entry["source"].replace(".md", ".csv"))))
        fields = dict(kv.split("=") for kv in key.split(","))
        triton = entry.get("triton_provider", "plugin-triton")  # the column that timed auto's Triton form
        cuda = entry.get("cuda_provider", "plugin-cuda")  # and the CUDA kernel's launch geometry
        by_shape: dict[str, dict[int, dict[str, float]]] = {}
        for r in rows:
            if r["provider"] in (cuda, triton) and r["median_us"]:
                prov = "plugin-cuda" if r["provider"] == cuda else "plugin-triton"
                by_shape.setdefault(r["shape"], {}).setdefault(int(r["M"]), {})[prov] = float(r["median_us"])
        shape = SHAPE_OF_KEY[(int(fields["E"]), int(fields["H"]), int(fields["I"]), int(fields["group_size"]))]
        pairs = {m: (t["plugin-cuda"], t["plugin-triton"]) for m, t in by_shape[shape].items() if len(t) == 2}
        assert entry["cuda_m_ranges"] == crossover.measured_ranges(pairs), key


SHAPE_OF_KEY = {  # bench/bench_moe.py's SHAPES: (E, H, I, group size) -> name
    (128, 2048, 768, 128): "qwen3-30b-a3b",
    (256, 2048, 512, 32): "qwen3.5-35b-a3b",
    (8, 4096, 14336, 128): "mixtral-8x7b",
    (64, 2048, 1408, 128): "deepseek-v2-lite",
    (128, 2816, 704, -1): "ct-channelwise",
    (8, 1344, 1024, 32): "k1344-gs32",
}


def test_a_range_that_starts_above_one_routes_only_its_batches(tmp_path):
    key = crossover.layer_key(128, 2816, 704, -1, 4)
    crossover.write_crossovers({key: {"cuda_m_ranges": [[4, 32]], "source": "x.md"}}, "GPU Z", tmp_path)
    ranges = crossover.cuda_m_ranges(key, "GPU Z", tmp_path)
    assert ranges == ((4, 32),) and crossover.cuda_max_m(key, "GPU Z", tmp_path) == 0
    assert [m for m in (1, 2, 3, 4, 17, 32, 33, 64) if crossover.in_ranges(m, ranges)] == [4, 17, 32]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "Z.json").write_text(json.dumps({key: {"cuda_m_ranges": [[8, 4]]}}))
    with pytest.raises(ValueError, match=r"cuda_m_ranges as \[\[lo, hi\], ...\]"):
        crossover.cuda_m_ranges(key, "Z", bad)
