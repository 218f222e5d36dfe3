"""vllm-wna16 tune (tools/tune.py) and the user's own tables it writes (user_tables.py), on CPU.

The timing is a GPU's; here the tuner runs its real loop under the Triton interpreter (every candidate
checked against the float reference) with a stand-in timer, and the test checks that the winners it
picked are what it wrote, in the shipped tables' formats, and what the launch plan then runs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vllm_wna16_plugin import crossover, launch_plan, user_tables
from vllm_wna16_plugin.backends import MoEProblem, RunOptions
from vllm_wna16_plugin.kernels.options import DeviceSpec
from vllm_wna16_plugin.launch_plan import plan
from vllm_wna16_plugin.oracle import select_backend
from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme
from vllm_wna16_plugin.tools import tune
from vllm_wna16_plugin.tools.cli import main

GPU_X = DeviceSpec("interpreter", None, "GPU X", 4, driver="999.1")


def small_problem(zp: bool = False, platform: str = "cpu", sm=None, options: RunOptions | None = None) -> MoEProblem:
    scheme = WNA16Scheme(4, 32, zp, PackFormat.GPTQ, source="test")
    return MoEProblem(scheme=scheme, hidden=128, intermediate=64, num_experts=4, global_num_experts=4, top_k=2,
                      group_size_w13=32, group_size_w2=32, platform=platform, sm=sm,
                      options=options or RunOptions())  # fmt: skip


def triton_plan(problem: MoEProblem, m: int, device: DeviceSpec):
    """The plan of an explicit triton layer (on CPU auto would take the reference backend)."""
    return plan(problem, m, device, selection=select_backend(problem, "triton", "test"))


def test_tuned_dir_is_keyed_by_device_driver_and_plugin_version(tmp_path):
    env = {user_tables.ENV_DIR: str(tmp_path)}
    assert user_tables.tuned_dir(GPU_X, env) is None  # nothing tuned yet
    path = user_tables.tuned_dir(GPU_X, env, must_exist=False)
    assert path.parts[-3:] == ("GPU_X", "driver-999.1", f"plugin-{__import__('vllm_wna16_plugin').__version__}")
    path.mkdir(parents=True)
    assert user_tables.tuned_dir(GPU_X, env) == path
    assert user_tables.tuned_dir(dataclasses.replace(GPU_X, driver="1000.0"), env) is None  # another driver
    assert user_tables.tuned_dir(dataclasses.replace(GPU_X, driver=None), env) is None  # a described device
    assert user_tables.tuned_dir(GPU_X, {**env, user_tables.ENV_USE: "0"}) is None  # switched off
    assert user_tables.tuned_root({"XDG_CACHE_HOME": "/c"}).as_posix() == "/c/vllm-wna16-plugin/tuned"


@pytest.mark.interpreter
def test_tune_writes_the_winners_and_the_plan_prefers_them(tmp_path, monkeypatch):
    monkeypatch.setenv(user_tables.ENV_DIR, str(tmp_path))
    problem = small_problem(zp=True)
    timed = []

    def timer(fns):  # a stand-in for CUDA-graph timing: a different, recorded time for each candidate
        timed.append(len(timed))
        return 100.0 - (len(timed) * 7919 % 53)

    results = tune.tune_problem(problem, [1, 3], GPU_X, torch.device("cpu"), timer=timer, budget_s=600,
                                max_candidates=2, progress=lambda line: None)  # fmt: skip
    assert [r.m for r in results] == [1, 3] and len(timed) >= 6
    for r in results:
        assert not r.rejected, r.rejected  # every candidate matched the float reference
        assert r.best == (min(r.gemm1, key=r.gemm1.get), min(r.gemm2, key=r.gemm2.get))
        assert r.shipped_us == r.gemm1[r.shipped[0]]  # the shipped pair was timed first
    root = tune.write_tables(problem, results, GPU_X, tune._record(problem, GPU_X, results))
    assert root == user_tables.tuned_dir(GPU_X)
    record = json.loads(next((root / "runs").iterdir()).read_text())
    assert [s["M"] for s in record["slots"]] == [1, 3] and record["driver"] == "999.1"
    for r in results:
        p = triton_plan(problem, r.m, GPU_X)
        assert p.launch.configs == r.best
        assert all(g.source.startswith(f"your tuned {root}") for g in p.gemms), [g.source for g in p.gemms]
    # another driver (or VLLM_WNA16_PLUS_TUNED=0) plans from the shipped tables again
    other = triton_plan(problem, 1, dataclasses.replace(GPU_X, driver="1.0"))
    assert all(g.source.startswith("default_config") for g in other.gemms)
    monkeypatch.setenv(user_tables.ENV_USE, "0")
    launch_plan._plan.cache_clear()  # a process makes each (shape, M, device) plan once: a new process here
    assert triton_plan(problem, 1, GPU_X).launch.configs == other.launch.configs


@pytest.mark.interpreter
def test_tune_measures_cuda_against_the_best_triton_and_writes_the_crossover(tmp_path, monkeypatch):
    monkeypatch.setenv(user_tables.ENV_DIR, str(tmp_path))
    problem = small_problem()

    def cuda_calls(self, m):  # the CPU has no CUDA kernel: correct outputs from the Triton layer, marked
        calls = self.triton_calls(m, tune.triton_launch(m, 4, 128, 64, 2, 32, 32, 4).configs)
        for c in calls:
            c.cuda = True
        return calls

    monkeypatch.setattr(tune.LayerBench, "cuda_calls", cuda_calls)
    # cuda is faster at M=1 and 2, slower at 4
    timer = lambda fns: (10.0 if current[0] < 4 else 200.0) if getattr(fns[0], "cuda", False) else 50.0  # noqa: E731
    current = [0]
    results = []
    for m in (1, 2, 4):
        current[0] = m
        results += tune.tune_problem(problem, [m], GPU_X, torch.device("cpu"), timer=timer, budget_s=600,
                                     max_candidates=1, progress=lambda line: None)  # fmt: skip
    assert [r.cuda_us for r in results] == [10.0, 10.0, 200.0]
    root = tune.write_tables(problem, results, GPU_X, tune._record(problem, GPU_X, results))
    key = crossover.layer_key(4, 128, 64, 32, 4)
    ranges, source = crossover.device_ranges(key, GPU_X)
    assert ranges == ((1, 2),) and source.startswith(f"your tuned table {root}")
    # a cuda layer on this GPU: auto takes cuda where the user's table says, triton elsewhere
    monkeypatch.setattr("vllm_wna16_plugin.backends.cuda.layer_device", lambda p: GPU_X)
    on_gpu = small_problem(platform="cuda", sm=90, options=RunOptions(plan_only=True))
    assert [plan(on_gpu, m, GPU_X).backend for m in (1, 2, 4)] == ["cuda", "cuda", "triton"]
    assert "your tuned table" in plan(on_gpu, 4, GPU_X).describe()


def test_cli_tune_needs_a_gpu_and_says_so(tmp_path, capsys):
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=256, intermediate=128,
                           experts=4, top_k=2, layers=1)  # fmt: skip
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tune would run")
    assert main(["tune", str(ckpt)]) == 2
    assert "tune times kernels on this machine's NVIDIA GPU, and torch sees none" in capsys.readouterr().err
    assert main(["tune", str(ckpt), "--m", "1,x"]) == 2
    assert "--m='1,x' is not a comma-separated list" in capsys.readouterr().err
    # the model's own errors come before the missing GPU (a typo in the path is what to fix first)
    assert main(["tune", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "torch sees none" not in err, err
    assert main(["tune", str(ckpt), "--tp", "3"]) == 2  # 128 intermediate columns do not split over 3 ranks
    err = capsys.readouterr().err
    assert "torch sees none" not in err and "--tp=3 (tensor-parallel size, TP) cannot load" in err, err


def test_a_damaged_user_table_is_ignored_and_the_shipped_ones_serve(tmp_path, monkeypatch):
    # an interrupted tune (half a file) or an entry a newer plugin refuses must not stop a model from loading
    from vllm_wna16_plugin.kernels.triton import configs

    monkeypatch.setenv(user_tables.ENV_DIR, str(tmp_path))
    root = user_tables.tuned_dir(GPU_X, must_exist=False)
    (root / "crossover").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "crossover" / "GPU_X.json").write_text('{"E=4,H=128,I=64,group_size=32,bits=4": {"cuda_m_ran')
    bad = configs.config_file_name(4, 128, 128, 32, 4, "GPU X")
    (root / "configs" / bad).write_text(json.dumps({"1": {"BLOCK_SIZE_M": 1, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 48}}))
    key = crossover.layer_key(4, 128, 64, 32, 4)
    assert crossover.device_ranges(key, GPU_X) == ((), "crossover/GPU_X.json")  # the shipped (none for GPU X)
    problem = small_problem()
    p = triton_plan(problem, 1, GPU_X)
    assert all(g.source.startswith("default_config") for g in p.gemms)


@pytest.mark.parametrize(
    "crossover_text, configs_text",
    [
        pytest.param("[1]", "null", id="not-objects"),
        pytest.param('{"E=4,H=128,I=64,group_size=32,bits=4": [1, 2]}', '{"1": [16, 32]}', id="entries-not-objects"),
        pytest.param(
            '{"other-layer": null}',
            '{"0": {"BLOCK_SIZE_M": 1, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64}}',
            id="null-entry-and-m-0",
        ),  # fmt: skip
        pytest.param(
            "[" * 100000 + "]" * 100000,
            '{"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1.5}}',
            id="deep-and-float",
        ),  # fmt: skip
        pytest.param(
            "{}",
            '{"1": {"BLOCK_SIZE_M": true, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "num_warps": 4.0}}',
            id="bool-and-float-fields",
        ),  # fmt: skip
        pytest.param("{}", '{"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 4096, "BLOCK_SIZE_K": 64}}', id="huge-tile"),
    ],
)
def test_user_tables_of_any_shape_never_stop_serving(tmp_path, monkeypatch, crossover_text, configs_text):
    """Found by a bad-input sweep: JSON that parses but is not a table (a list, null, nested too deep, fields of
    the wrong type) raised AttributeError / TypeError / RecursionError at the first plan, i.e. the first forward."""
    from vllm_wna16_plugin.kernels.triton import configs

    monkeypatch.setenv(user_tables.ENV_DIR, str(tmp_path))
    root = user_tables.tuned_dir(GPU_X, must_exist=False)
    (root / "crossover").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "crossover" / "GPU_X.json").write_text(crossover_text)
    (root / "configs" / configs.config_file_name(4, 128, 128, 32, 4, "GPU X")).write_text(configs_text)
    (root / "configs" / configs.config_file_name(4, 64, 128, 32, 4, "GPU X")).write_text(configs_text)
    key = crossover.layer_key(4, 128, 64, 32, 4)
    assert crossover.device_ranges(key, GPU_X) == ((), "crossover/GPU_X.json")
    p = triton_plan(small_problem(), 1, GPU_X)
    assert all(g.source.startswith("default_config") for g in p.gemms)


def test_the_tuned_switch_reads_the_usual_spellings_and_refuses_others(monkeypatch):
    monkeypatch.setenv(user_tables.ENV_DIR, "/nonexistent")
    for value, want in (("0", False), ("false", False), ("OFF", False), ("no", False), ("1", True), ("yes", True)):
        assert user_tables.use_tuned({user_tables.ENV_USE: value}) is want, value
    with pytest.raises(ValueError, match=r"VLLM_WNA16_PLUS_TUNED='banana': use 1 .* or 0"):
        user_tables.use_tuned({user_tables.ENV_USE: "banana"})


def test_tables_are_written_in_one_rename(tmp_path):
    path = tmp_path / "t.json"
    user_tables.write_atomically(path, "{}\n")
    user_tables.write_atomically(path, '{"a": 1}\n')
    assert json.loads(path.read_text()) == {"a": 1} and [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_a_damaged_existing_table_is_replaced_by_the_runs_winners(tmp_path, monkeypatch):
    """A run's results are written even where the table it merges into is damaged (they used to be lost after
    the whole budget: TypeError / AttributeError / JSON errors in write_tables)."""
    from vllm_wna16_plugin.kernels.triton import configs

    monkeypatch.setenv(user_tables.ENV_DIR, str(tmp_path))
    root = user_tables.tuned_dir(GPU_X, must_exist=False)
    (root / "crossover").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "crossover" / "GPU_X.json").write_text("[1]")
    for n, k in ((128, 128), (128, 64)):
        (root / "configs" / configs.config_file_name(4, n, k, 32, 4, "GPU X")).write_text('{"abc": [1]}')
    problem = small_problem()

    def timer(fns):
        return 10.0

    results = tune.tune_problem(problem, [1], GPU_X, torch.device("cpu"), timer=timer, budget_s=600,
                                max_candidates=1, progress=lambda line: None)  # fmt: skip
    written = tune.write_tables(problem, results, GPU_X, tune._record(problem, GPU_X, results))
    table = json.loads((written / "configs" / configs.config_file_name(4, 128, 128, 32, 4, "GPU X")).read_text())
    assert list(table) == ["1"] and configs.TritonMoEConfig(**table["1"]) == results[0].best[0]
    # the crossover (written where cuda was timed, a GPU run): merged into a damaged table, it replaces it
    entry = {"cuda_m_ranges": [[1, 2]], "source": "test"}
    path = crossover.write_crossovers({"k": entry}, "GPU X", written / "crossover")
    assert json.loads(path.read_text()) == {"k": entry}


def test_cli_tune_refuses_reps_and_budget_that_cannot_time(tmp_path, capsys):
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=256, intermediate=128,
                           experts=4, top_k=2, layers=1)  # fmt: skip
    for flag, message in (("--reps=0", "--reps=0: the replays per time"), ("--budget-s=nan", "--budget-s=nan"),
                          ("--budget-s=-5", "--budget-s=-5.0: the exploration budget")):  # fmt: skip
        assert main(["tune", str(ckpt), flag]) == 2
        assert message in capsys.readouterr().err


def test_a_tuned_dir_variable_naming_a_file_is_refused_by_name(tmp_path, monkeypatch):
    """VLLM_WNA16_PLUS_TUNED_DIR pointing at a file silently read no tables (tuned_dir found no directory there), so a
    typo lost every tuned table without a word (a bad-input sweep). Refused where the plugin's variables are checked:
    when a layer is built (use_tuned) and by doctor; with the tables switched off it is not read."""
    from vllm_wna16_plugin.tools.doctor import plan as doctor_plan
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    a_file = tmp_path / "tables.json"
    a_file.write_text("{}")
    env = {user_tables.ENV_DIR: str(a_file)}
    message = rf"VLLM_WNA16_PLUS_TUNED_DIR='{a_file}' names a file, not a directory"
    with pytest.raises(ValueError, match=message):
        user_tables.use_tuned(env)
    with pytest.raises(ValueError, match=message):
        user_tables.tuned_dir(GPU_X, env)
    assert user_tables.use_tuned({**env, user_tables.ENV_USE: "0"}) is False
    assert user_tables.use_tuned({user_tables.ENV_DIR: str(tmp_path / "new")}) is True  # not there yet: tune makes it
    ckpt = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=128, intermediate=128,
                           experts=4, top_k=2, layers=1)  # fmt: skip
    monkeypatch.setenv(user_tables.ENV_DIR, str(a_file))
    with pytest.raises(ValueError, match=message):
        doctor_plan(ckpt, launch_configs=False)


def test_cli_tune_refuses_a_batch_size_it_cannot_allocate(tmp_path, capsys):
    """--m 100000000000000000000 passed the checks, so on a GPU torch.randn(M, H) would fail with a TypeError
    (overflow), and an M of 10**12 with a RuntimeError (allocation): a traceback, not one line (a bad-input sweep;
    seen with torch on CPU, no GPU run). Bounded, named as typed, before the GPU is looked for."""
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=128, intermediate=128,
                           experts=4, top_k=2, layers=1)  # fmt: skip
    for m in ("100000000000000000000", "1,65537"):
        assert main(["tune", str(ckpt), "--m", m]) == 2
        err = capsys.readouterr().err
        assert f"--m='{m}': batch size {m.split(',')[-1]} is larger than 65536 tokens; supported: 1..65536" in err
