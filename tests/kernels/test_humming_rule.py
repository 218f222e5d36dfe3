"""The rule by which `auto` hands a batch to Humming on a layer composed with it (backends/humming.py), the
memory decision, and the plans of a layer composed with it (compose.py).

Checked against the H200 measurements of bench/model_catalog.py's development set (which it was fitted on)
and of its validation set (which it was not): for every (shape, M), the rule's choice between plugin-auto and
vllm-humming against the faster of the two, in the same run.
"""

from __future__ import annotations

import csv
import dataclasses
import re
import sys
from pathlib import Path

import pytest

from vllm_wna16_plugin.backends import MoEProblem, RunOptions
from vllm_wna16_plugin.backends.base import experts_read
from vllm_wna16_plugin.backends.humming import (
    ENV_COMPOSE,
    HUMMING_MIN_BYTES,
    humming_copy_bytes,
    humming_rule_applies,
    humming_takes,
)
from vllm_wna16_plugin.compose import COMPOSE_MAX_BUDGET_SHARE, compose_decision, compose_setting, compose_with
from vllm_wna16_plugin.compose import composable_with as _composable_with
from vllm_wna16_plugin.kernels.options import PLAN_DEVICES
from vllm_wna16_plugin.launch_plan import plan, plan_backends
from vllm_wna16_plugin.oracle import select_backend
from vllm_wna16_plugin.scheme import CHANNELWISE, PackFormat, WNA16Scheme

H200 = PLAN_DEVICES["sm90"]
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "h200"
DEV_RUN = "2026-12-05-c410069-dev.csv"
VALIDATION_RUNS = ("2026-12-05-c410069-val4.csv", "2026-12-05-c410069-val-mixtral8x22b.csv")


def problem_of(E, top_k, H, inter, gs=128, bits=4, zp=False, gs2=None, **options):  # noqa: N803
    scheme = WNA16Scheme(bits, gs, zp, PackFormat.GPTQ, source="test")
    g13, g2 = (H, inter) if gs == CHANNELWISE else (gs, gs2 or gs)
    return MoEProblem(scheme=scheme, hidden=H, intermediate=inter, num_experts=E, global_num_experts=E, top_k=top_k,
                      group_size_w13=g13, group_size_w2=g2, platform="cuda", sm=90,
                      options=RunOptions(plan_only=True, **options))  # fmt: skip


def catalog_shapes():
    """bench/rule_report.py's: shape name -> (its catalog set, its Shape), every catalog model at TP 1-8."""
    sys.path.insert(0, str(ROOT / "bench"))
    from rule_report import catalog_shapes as shapes

    return shapes()


def runs_what_was_timed(problem: MoEProblem, m: int, gemv_max_then: float = 1.15) -> bool:
    """False where this commit's plan runs triton's per-pair GEMV and a run made while the GEMV bound was
    `gemv_max_then` (configs.gemv_bound; 1.15 before 070a73f) timed the tiles there, or runs the cuda kernel on
    int8 (which its rule took from 070a73f on): such a run's plugin column is not what runs now."""
    from vllm_wna16_plugin.kernels.triton.configs import choose_triton_moe_config

    planned = plan(problem, m, H200)
    if planned.backend == "cuda" and problem.scheme.bits == 8:
        return False  # the cuda rule took no int8 before 070a73f either: the run timed the Triton tiles
    if planned.backend != "triton" or not planned.launch.gemm1.config.per_pair:
        return True
    then = choose_triton_moe_config(m, problem.num_experts, 2 * problem.intermediate, problem.hidden, problem.top_k,
                                    problem.group_size_w13, problem.scheme.bits, H200.name, gemv_max=gemv_max_then)  # fmt: skip
    return then.config.per_pair


def decisions(run: str, bits: int = 4, zp: bool = False, *, now: bool = True) -> list[tuple[str, int, bool, float]]:
    """(shape, M, the rule takes Humming, the chosen time / the faster of plugin-auto and vllm-humming); a run of
    another form (bench_moe --bits / --zero-points) names it: its shapes' "-int8-g128" suffix is dropped. now:
    leave out the points whose plugin column is not what runs now (runs_what_was_timed: runs before 070a73f)."""
    shapes = {name: shape for name, (_, shape) in catalog_shapes().items()}
    times: dict[tuple[str, int], dict[str, float]] = {}
    with open(RESULTS / run, newline="") as f:
        for r in csv.DictReader(f):
            if r["median_us"] and r["provider"] in ("plugin-auto", "vllm-humming"):
                times.setdefault((r["shape"], int(r["M"])), {})[r["provider"]] = float(r["median_us"])
    out = []
    for (shape, m), t in sorted(times.items()):
        if len(t) < 2:
            continue
        s = shapes[shape] if shape in shapes else shapes[re.sub(r"-int\d+-g\d+$", "", shape)]
        problem = problem_of(s.E, s.top_k, s.H, s.I, s.gs, bits=bits, zp=zp, gs2=s.group_w2)
        if now and not runs_what_was_timed(problem, m):
            continue
        takes = humming_takes(problem, m, H200)
        out.append((shape, m, takes, t["vllm-humming" if takes else "plugin-auto"] / min(t.values())))
    return out


def test_the_rule_agrees_with_the_development_set_it_was_fitted_on():
    got = decisions(DEV_RUN)
    assert len(got) == 80 - 6  # 8 models x TP 1, 4 x M 1, 4, 16, 64, 256; 6 points now run triton's GEMV
    missed = [d for d in got if d[3] > 1.0]
    assert len(missed) <= 2, missed
    assert all(d[3] < 1.17 for d in got), max(got, key=lambda d: d[3])  # Qwen1.5-MoE-A2.7B@tp1 M=4: 1.16


def test_on_the_validation_set_no_choice_costs_more_than_10_percent():
    got = [d for run in VALIDATION_RUNS for d in decisions(run)]
    assert len(got) == 50 - 5  # 8 models at TP 4, Mixtral-8x22B at TP 1 too (DeepSeek-V3 at TP 1: out of memory);
    # 5 points now run triton's GEMV, which the run did not time
    assert all(d[3] < 1.10 for d in got), max(got, key=lambda d: d[3])
    assert any(d[2] for d in got) and any(not d[2] for d in got)


@pytest.mark.parametrize("run, bits, zp", [("2026-12-06-eda7a88-h200-int8.csv", 8, False),
                                           ("2026-12-06-eda7a88-h200-zp.csv", 4, True)])  # fmt: skip
def test_int8_and_zero_points_follow_the_rule_where_measured(run, bits, zp):
    """Three dev models at TP 4, M 16-4096 (the plugin's own kernels against Humming; the zero-point layers' hopper
    copy, which ran their 64+-row batches before, is not in these columns: backends/humming.py): the rule gives every
    point to Humming, which loses none by more than 2% (the points the run marked wrong have no time)."""
    got = decisions(run, bits=bits, zp=zp)
    # left out: points whose plugin column is not what runs now (int8 M 16-64 on the cuda kernel, one GEMV)
    assert len(got) == {8: 8 - 4, 4: 15 - 1}[bits], got
    assert all(d[2] for d in got), [d for d in got if not d[2]]
    assert all(d[3] < 1.02 for d in got), max(got, key=lambda d: d[3])


def test_zero_points_at_decode_follow_the_rule():
    """Three dev models at TP 4, M 1-8 (H100, the run cut short after three models): the bytes bars give the plugin
    M 1-4 on two and Humming Qwen3-235B-A22B's M=4; every choice is the faster side, or even (Qwen3-235B M=4, 49.8 /
    49.9 µs). M=8 now runs triton's GEMV, which this run did not time (test_the_35_mb_bar_... does)."""
    got = decisions("../h100/2026-12-07-d59df80-h100-zp-small.csv", bits=4, zp=True)
    assert len(got) == 12 - 3, got  # M=8 now runs triton's GEMV on all three: test_the_35_mb_bar_... below
    assert [(d[0], d[1]) for d in got if d[2]] == [("Qwen3-235B-A22B@tp4", 4)]
    assert all(d[3] < 1.01 for d in got), max(got, key=lambda d: d[3])


def h100_pairs(plugin_run: str, humming_run: str, zp: bool) -> list[tuple[str, int, bool, float, float, float]]:
    """(shape, M, the rule takes Humming, the plugin's time, Humming's, bytes read) where two H100 runs meet: the fastest plugin
    kernel of `plugin_run` (the GEMV-bound runs, what runs now) and Humming's time in `humming_run`."""
    shapes = {name: shape for name, (_, shape) in catalog_shapes().items()}
    plugin: dict[tuple[str, int], float] = {}
    humming: dict[tuple[str, int], float] = {}
    for run, into, keep in ((plugin_run, plugin, lambda p: p.startswith("plugin-")),
                            (humming_run, humming, lambda p: p == "vllm-humming")):  # fmt: skip
        with open(RESULTS.parent / "h100" / run, newline="") as f:
            for r in csv.DictReader(f):
                if r["median_us"] and keep(r["provider"]):
                    key = (r["shape"], int(r["M"]))
                    into[key] = min(into.get(key, float("inf")), float(r["median_us"]))
    out = []
    for shape, m in sorted(plugin.keys() & humming.keys()):
        s = shapes[shape]
        problem = problem_of(s.E, s.top_k, s.H, s.I, s.gs, zp=zp, gs2=s.group_w2)
        takes = humming_takes(problem, m, H200)
        out.append((shape, m, takes, plugin[(shape, m)], humming[(shape, m)], experts_read(problem, m)))
    return out


@pytest.mark.parametrize(
    "plugin_run, humming_run, zp, count",
    [("2026-12-07-d3ec747-h100-gemv-dev.csv", "2026-12-07-21a66c2-h100-dev-composed.csv", False, 16),
     ("2026-12-07-d3ec747-h100-gemv-zp.csv", "2026-12-07-d59df80-h100-zp-small.csv", True, 9)],
)  # fmt: skip
def test_the_35_mb_bar_against_the_gemv_bound_kernels(plugin_run, humming_run, zp, count):
    """The bar raised from 20 to 35 MB (backends/humming.py), from two H100 runs: the plugin's kernels with the GEMV
    bound (M 2-24) and Humming's (M 1-4096; zero points M 1-8). At the points both timed (M 4 and 16; zero points M
    2-8), every choice is the faster side but one near-even (zero points Qwen3-235B-A22B M=4: Humming, 1.01x); the
    former 20 MB bar gave DeepSeek-V2-Lite and OLMoE-1B-7B at M=4 (21-23 MB) and the zero-point M=8 batches of 29-31 MB
    to Humming, 1.27-1.51x slower."""
    got = h100_pairs(plugin_run, humming_run, zp)
    assert len(got) == count, got
    chosen = [(h if takes else p) / min(p, h) for _, _, takes, p, h, _ in got]
    assert all(c < 1.03 for c in chosen), list(zip(got, chosen, strict=True))
    assert any(d[2] for d in got) and any(not d[2] for d in got)
    # what the former bar cost: the points reading 20-35 MB beyond M=2, which it gave to Humming
    moved = [(s, m, h / p) for s, m, takes, p, h, read in got if not takes and m > 2 and read > 20e6]
    assert len(moved) == 2 and all(1.27 < r < 1.52 for _, _, r in moved), moved


def test_the_35_mb_bar_on_the_h100_validation_run():
    """Never fitted on (the validation models at TP 4, the plugin's former kernels): the points reading 20-35 MB
    beyond M=2, which the former bar gave Humming, were the plugin's (ERNIE-4.5 M=4, Qwen3-Next-80B M=8); the bar now
    gives them the plugin. Every choice of the run stays within 11% of the faster side (Llama-4-Scout M=4: 59 MB,
    Humming's, 1.11x)."""
    got = [d for run in ("2026-12-05-c8ee655-composed.csv", "2026-12-05-c8ee655-composed2.csv")
           for d in decisions(f"../h100/{run}", now=False)]  # fmt: skip
    shapes = {name: shape for name, (_, shape) in catalog_shapes().items()}
    middle = []
    for shape, m, takes, chosen in got:
        s = shapes[shape]
        read = experts_read(problem_of(s.E, s.top_k, s.H, s.I, s.gs, gs2=s.group_w2), m)
        if m > 2 and 20e6 < read <= HUMMING_MIN_BYTES:
            middle.append((shape, m, takes, chosen))
    assert [(s, m) for s, m, _, _ in middle] == [("ERNIE-4.5-21B-A3B@tp4", 4), ("Qwen3-Next-80B-A3B@tp4", 8)]
    assert all(not takes and chosen == 1.0 for _, _, takes, chosen in middle), middle
    assert all(d[3] < 1.12 for d in got if d[1] > 2), max(got, key=lambda d: d[3])


COMPOSE_RUN = "../h100/2026-12-07-b542b3f-h100-compose-{}.csv"  # plugin-auto beside Humming, M 2-64, one run each


def test_the_int8_bar_on_the_gemv_bound_kernels():
    """The int8 development run its bar was fitted on (8 models at TP 4, M 4-64): the former bars (35 MB, as int4)
    gave Humming 54 of 56 points and the plugin was faster on 27 of them, by up to 1.61x; the 170 MB bar keeps every
    choice within 13% of the faster side (OLMoE-1B-7B M=64, 102 MB: the plugin's, Humming faster by 1.12x)."""
    got = decisions(COMPOSE_RUN.format("int8"), bits=8, now=False)
    assert len(got) == 56
    assert all(d[3] < 1.13 for d in got), max(got, key=lambda d: d[3])
    assert sum(d[3] > 1.05 for d in got) <= 2, [d for d in got if d[3] > 1.05]
    takes = {(shape.split("@")[0], m): t for shape, m, t, _ in got}
    assert not takes["DeepSeek-V2-Lite", 4] and not takes["Qwen3-30B-A3B", 48]  # 45 / 147 MB: the plugin's
    assert takes["Qwen3-235B-A22B", 8] and takes["Mixtral-8x7B", 64]  # 242 / 358 MB: Humming by 1.04 / 1.79x
    s = {name: shape for name, (_, shape) in catalog_shapes().items()}["Qwen3-30B-A3B@tp4"]
    qwen = problem_of(s.E, s.top_k, s.H, s.I, s.gs, bits=8, gs2=s.group_w2)
    assert HUMMING_MIN_BYTES < experts_read(qwen, 65) < 170e6  # ~151 MB
    assert not humming_takes(qwen, 64, H200) and humming_takes(qwen, 65, H200)  # above 64 tokens: the 35 MB bar


@pytest.mark.parametrize("form, zp", [("dev", False), ("zp", True)])
def test_the_int4_bars_on_the_composed_development_run(form, zp):
    """The 35 MB bar re-timed in one run beside the GEMV-bound kernels (4 of the 8 dev models, the call's limit cut
    the rest; M 2-32): every choice within 13% of the faster side (zero points: Qwen1.5-MoE-A2.7B M=12, 38 MB, 1.12x
    and Qwen3-30B-A3B M=16, 50 MB, 1.08x, Humming's)."""
    got = decisions(COMPOSE_RUN.format(form), zp=zp, now=False)
    assert len(got) == 32
    assert all(d[3] < (1.13 if zp else 1.05) for d in got), max(got, key=lambda d: d[3])
    assert sum(d[3] > 1.05 for d in got) <= (2 if zp else 0), [d for d in got if d[3] > 1.05]


@pytest.mark.parametrize("form, zp", [("val", False), ("zpval", True)])
def test_the_int4_bars_on_the_composed_validation_run(form, zp):
    """Never fitted on (7 of the 8 validation models at TP 4, M 2-32): the bars miss at 1.1-1.3 rows per hit expert
    on 42-83 MB, where the plugin's GEMV led (Qwen3-Next-80B-A3B M=16, 56 MB: 1.13x, zero points 1.26x; Llama-4-Scout
    M 4-6; ERNIE-4.5-21B-A3B M=6) while, at the same rows and bytes, Humming led on Qwen3-235B-A22B (dev): recorded
    as the limit of a bytes bar (docs/perf/any-model.md), not refitted on the validation run. granite-3.1-3b-a800m
    with zero points at M 12-32 (11-12 MB, under every bar) is the plugin's own kernel choice: its zero-point tl.dot
    tiles ran 1.17-1.32x Humming's time (the cuda kernel 1.07x)."""
    got = decisions(COMPOSE_RUN.format(form), zp=zp, now=False)
    assert len(got) == 56
    bar_decided = [d for d in got if not (zp and d[0].startswith("granite"))]
    assert all(d[3] < (1.27 if zp else 1.16) for d in bar_decided), max(bar_decided, key=lambda d: d[3])
    assert sum(d[3] > 1.05 for d in bar_decided) <= (6 if zp else 5), [d for d in bar_decided if d[3] > 1.05]
    assert all(d[3] < 1.33 for d in got), max(got, key=lambda d: d[3])


def test_the_rule_speaks_only_for_what_was_measured():
    qwen = problem_of(128, 8, 2048, 768)
    assert humming_rule_applies(qwen, H200) is None
    assert not humming_takes(qwen, 1, H200) and humming_takes(qwen, 16, H200) and humming_takes(qwen, 256, H200)
    for measured in (problem_of(128, 8, 2048, 768, bits=8), problem_of(128, 8, 2048, 768, zp=True)):
        assert humming_rule_applies(measured, H200) is None  # int8 and zero points: the eda7a88 runs
        assert not humming_takes(measured, 1, H200) and humming_takes(measured, 256, H200)
    for other in (problem_of(128, 8, 2048, 768, gs=CHANNELWISE), problem_of(128, 8, 2048, 768, gs=256),
                  problem_of(128, 8, 2048, 768, bits=8, zp=True)):  # fmt: skip  # int8 with zero points: never timed
        assert humming_rule_applies(other, H200) and not humming_takes(other, 256, H200)
    assert humming_rule_applies(qwen, PLAN_DEVICES["sm80"]) and not humming_takes(qwen, 256, PLAN_DEVICES["sm80"])
    act_order = dataclasses.replace(qwen, has_g_idx=True)
    assert not humming_takes(act_order, 256, H200)


GIB = 2**30


@pytest.mark.parametrize(
    "setting, copy, used, free, util, compose",
    [
        ("auto", 1 * GIB, 20 * GIB, 100 * GIB, 0.9, True),  # 21 of half of 125 GiB
        (None, 1 * GIB, 20 * GIB, 100 * GIB, 0.9, True),  # unset: auto
        ("auto", 1 * GIB, 61 * GIB, 70 * GIB, 0.9, True),  # 62 <= 62.55
        ("auto", 1 * GIB, 62 * GIB, 70 * GIB, 0.9, False),  # 63: past half of vLLM's share
        ("auto", 1 * GIB, 20 * GIB, 110 * GIB, 0.3, False),  # --gpu-memory-utilization 0.3: 21 > 20.85
        ("auto", 8 * GIB, 1 * GIB, 4 * GIB, 0.9, False),  # not even free
        ("0", 1 * GIB, 1 * GIB, 100 * GIB, 0.9, False),
        ("off", 1 * GIB, 1 * GIB, 100 * GIB, 0.9, False),
        ("1", 1 * GIB, 100 * GIB, 2 * GIB, 0.9, True),  # asked for: whatever the memory
    ],
)
def test_compose_decision(setting, copy, used, free, util, compose):
    got, why = compose_decision(setting, copy, used, free, 139 * GIB, util, ENV_COMPOSE)
    assert COMPOSE_MAX_BUDGET_SHARE == 0.5
    assert got == compose and why
    if setting in ("auto", None) and not got:
        assert "GiB" in why and ENV_COMPOSE in why and f"{util:g}" in why


def test_a_bad_setting_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match=f"{ENV_COMPOSE}='maybe'.*auto.*1.*0"):
        compose_decision("maybe", 1, 1, 2, 3, 0.9, ENV_COMPOSE)
    assert compose_setting(" ON ", ENV_COMPOSE) == "on" and compose_setting(None, ENV_COMPOSE) == "auto"


def test_expert_parallel_ranks_read_their_share_of_the_routed_pairs():
    """Qwen3-30B-A3B at EP 8 (16 of 128 experts per rank): M=4's 32 pairs hit about 3.7 local experts,
    9 MB, the plugin's; at TP 1 the same M reads 28.5 experts, 67 MB, Humming's. The rank's 16 experts are 39 MB:
    over the 35 MB bar only once nearly all are hit (M=32: 34 MB, the plugin's; M=64: 38 MB, Humming's)."""
    whole = problem_of(128, 8, 2048, 768)
    rank = dataclasses.replace(problem_of(16, 8, 2048, 768), global_num_experts=128)
    assert experts_read(rank, 4) == pytest.approx(experts_read(whole, 4) / 8)
    assert humming_takes(whole, 4, H200) and not humming_takes(rank, 4, H200)
    assert not humming_takes(rank, 32, H200) and humming_takes(rank, 64, H200)


def test_the_copy_is_counted_with_humming_padding():
    """Qwen3-30B-A3B at TP 4: I=192, so GEMM1's N 384 -> 512, GEMM2's K 192 -> 256 (groups of 64)."""
    p = problem_of(128, 8, 2048, 192, gs=128, gs2=64)
    w13 = 512 * 2048 // 2 + 512 * 16 * 2
    w2 = 2048 * 256 // 2 + 2048 * 4 * 2
    assert humming_copy_bytes(p) == 128 * (w13 + w2)


def test_a_composed_layer_plans_humming_where_the_rule_takes_it_and_its_own_kernels_elsewhere():
    selection = select_backend(problem_of(128, 8, 2048, 768))  # Qwen3-30B-A3B
    assert selection.backend.name == "cuda" and composable_with_humming(selection) is None
    composed = compose_with(selection, "humming")
    assert plan_backends(composed) == ("cuda", "triton", "humming")
    assert plan_backends(selection) == ("cuda", "triton")  # not composed: one copy, the plugin's kernels
    small, large = (
        plan(composed.problem, 1, H200, selection=composed),
        plan(composed.problem, 64, H200, selection=composed),
    )
    assert small.backend in ("cuda", "triton") and small.launch is not None
    assert large.backend == "humming" and large.launch is None
    assert any("MB of expert weights" in w and "Humming's (Humming rule" in w for w in large.why)
    assert plan(selection.problem, 64, H200, selection=selection).backend == "cuda"


def test_humming_takes_the_prefill_of_a_layer_reading_little():
    """granite-3.1-3b-a800m at TP 4 (E=40, top 8, H=1536, I=128; 12 MB): under the bytes bar at every M, Humming's from
    64 rows per hit expert (HUMMING_PREFILL_ROWS: M >= 320), so the layer is composed with it for prefill."""
    granite = problem_of(40, 8, 1536, 128)
    assert experts_read(granite, 4096) < 20e6
    assert [m for m in (1, 16, 256, 319, 320, 1024, 4096) if humming_takes(granite, m, H200)] == [320, 1024, 4096]
    selection = select_backend(granite)
    assert composable_with_humming(selection) is None
    composed = compose_with(selection, "humming")
    assert plan(composed.problem, 1024, H200, selection=composed).backend == "humming"
    assert plan(composed.problem, 256, H200, selection=composed).backend in ("cuda", "triton")


def test_humming_was_the_faster_at_prefill_on_every_development_model():
    """The prefill clause's evidence (H100 dev run, every dev model at TP 4): at M=1024 and 4096, where the rule takes
    Humming, Humming's time was below the plugin's own (plugin-auto) on every point."""
    shapes = {name: shape for name, (_, shape) in catalog_shapes().items()}
    times: dict[tuple[str, int], dict[str, float]] = {}
    with open(ROOT / "bench" / "results" / "h100" / "2026-12-07-21a66c2-h100-dev-composed.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["median_us"] and int(r["M"]) >= 1024:
                times.setdefault((r["shape"], int(r["M"])), {})[r["provider"]] = float(r["median_us"])
    assert len(times) == 16
    for (name, m), t in times.items():
        s = shapes[name]
        assert humming_takes(problem_of(s.E, s.top_k, s.H, s.I, s.gs, gs2=s.group_w2), m, H200), (name, m)
        assert t["vllm-humming"] < t["plugin-auto"], (name, m, t)


def composable_with_humming(selection):
    return _composable_with(selection, "humming")


def test_what_is_never_composed_says_why():
    explicit = select_backend(problem_of(128, 8, 2048, 768), "triton", "--moe-backend")
    assert "as asked" in composable_with_humming(explicit)
    channelwise = select_backend(problem_of(128, 8, 2048, 768, gs=CHANNELWISE))
    assert "does not speak" in composable_with_humming(channelwise)
    # 256 experts of 49 KB, top 2: under 20 MB and 64 rows per hit expert at every probed batch size (M <= 512)
    tiny = select_backend(problem_of(256, 2, 512, 64, gs=64))
    assert "none of its batch sizes" in composable_with_humming(tiny)
    cpu = select_backend(dataclasses.replace(problem_of(128, 8, 2048, 768), platform="cpu", sm=None))
    assert composable_with_humming(cpu)
