"""The hopper backend's rules on CPU: its scope (what the sm90 extension is built for), the token tile chosen by rows
per expert, when auto's plan hands it a batch, the copy it adds, and the plan and doctor lines that name it."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest
import torch

from vllm_wna16_plugin import compose
from vllm_wna16_plugin.backends import RunOptions
from vllm_wna16_plugin.backends.base import MoEProblem, expert_bytes, pairs_per_expert
from vllm_wna16_plugin.backends.hopper import (
    HOPPER_MIN_ROWS,
    HopperBackend,
    hopper_copy_bytes,
    hopper_rule_gap,
    hopper_scope,
    hopper_takes,
)
from vllm_wna16_plugin.kernels.hopper_ops import BUILT_TILES, TILE_WIDTHS, built_tiles, token_tile
from vllm_wna16_plugin.kernels.options import DeviceSpec
from vllm_wna16_plugin.launch_plan import plan, plan_backends
from vllm_wna16_plugin.oracle import select_backend
from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme

SM90 = DeviceSpec("cuda", 90)


def _problem(E=8, top_k=2, H=4096, I=3584, gs=128, **kw) -> MoEProblem:  # noqa: N803, E741
    scheme = kw.pop("scheme", None) or WNA16Scheme(
        bits=4, group_size=gs, has_zero_point=False, pack_format=PackFormat.GPTQ
    )
    glob = kw.pop("global_num_experts", E)
    return MoEProblem(scheme=scheme, hidden=H, intermediate=I, num_experts=E, global_num_experts=glob, top_k=top_k,
                      group_size_w13=gs if gs > 0 else H, group_size_w2=gs if gs > 0 else I, platform="cuda", sm=90,
                      options=RunOptions(plan_only=True), **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "tile"),
    [
        (0.5, 32),
        (4, 32),
        (16, 32),
        (17, 64),
        (32, 64),
        (33, 128),
        (64, 128),
        (256, 128),
        (511, 128),
        (512, 256),
        (1024, 256),
    ],  # fmt: skip
)
def test_token_tile_by_rows_per_expert(rows, tile):
    assert token_tile(rows) == tile
    assert tile in TILE_WIDTHS


def test_token_tile_matches_the_measured_best_tiles():
    # (rows per hit expert, the fastest tile in the layer) from 2026-12-06-49d5aac-hopper-breakdown.json (H100)
    measured = [(16, 32), (32, 64), (64, 128), (128, 128), (256, 128), (1024, 256)]
    assert [token_tile(r) for r, _ in measured] == [t for _, t in measured]


def test_scope_takes_a_real_models_layer():
    assert hopper_scope(_problem(), SM90) is None
    assert hopper_scope(_problem(gs=-1), SM90) is None  # channel-wise
    assert hopper_scope(_problem(act_dtype=torch.float16), SM90) is None  # the fp16 build
    awq = WNA16Scheme(bits=4, group_size=128, has_zero_point=True, pack_format=PackFormat.AWQ)
    assert hopper_scope(_problem(scheme=awq), SM90) is None  # zero points: the int8 builds on q - z
    assert hopper_scope(_problem(scheme=awq, act_dtype=torch.float16), SM90) is None
    assert hopper_scope(_problem(E=128, top_k=8, H=2048, I=768, gs=64), SM90) is None
    int8 = WNA16Scheme(bits=8, group_size=128, has_zero_point=False, pack_format=PackFormat.GPTQ)
    assert hopper_scope(_problem(scheme=int8), SM90) is None  # symmetric int8: the int8 build
    assert hopper_scope(_problem(scheme=int8, act_dtype=torch.float16), SM90) is None


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            dict(scheme=WNA16Scheme(bits=8, group_size=128, has_zero_point=True, pack_format=PackFormat.GPTQ)),
            "int8 with zero points is not",
        ),
        (dict(has_g_idx=True), "act order"),
        (dict(act_dtype=torch.float32), "bfloat16 or float16"),
        (dict(activation="gelu"), "silu"),
        (dict(use_ep=True), "expert parallelism"),
        (dict(global_num_experts=16), "8 local of 16 experts"),  # the functional API's expert_map sets no use_ep
        (dict(apply_router_weight_on_input=True), "apply_router_weight_on_input"),
        (dict(I=96), "N=192"),  # Qwen3-30B-A3B at TP 8: 2I = 192 rows, not whole weight tiles
        (dict(H=4032, gs=64), "N=4032"),  # K=4032 takes 64-wide K tiles; GEMM2's N=4032 is not whole 128-row tiles
        (dict(I=1344), "group size 128"),  # K=1344 = 10.5 groups of 128
        (dict(gs=32), "group size 32"),
    ],
)
def test_scope_refuses_what_the_kernel_is_not_built_for(change, needle):
    reason = hopper_scope(_problem(**change), SM90)
    assert reason and needle in reason, reason


@pytest.mark.parametrize("device", [DeviceSpec("cuda", 80), DeviceSpec("cuda", 100), DeviceSpec("cpu", None)])
def test_scope_is_sm90_only(device):
    assert "sm90" in hopper_scope(_problem(), device)


def test_rule_takes_batches_from_its_rows_per_expert():
    p = _problem()  # Mixtral-8x7B at TP 4
    for m in (1, 8, 64, 128, 256, 1024, 4096):
        assert hopper_takes(p, m, SM90) == (pairs_per_expert(p, m) >= HOPPER_MIN_ROWS)
    assert not hopper_takes(p, 1, SM90) and hopper_takes(p, 4096, SM90)
    assert not hopper_takes(_problem(gs=32), 4096, SM90)  # out of scope: never


def test_auto_hands_a_symmetric_int8_layer_no_batch_until_its_rule_is_timed():
    """Symmetric int8 is in the kernel's scope (an explicit request runs it) but not among the rule's timed forms
    (HOPPER_RULE_FORMS): auto takes none of its batches and so holds no hopper copy of it."""
    layer = _problem(scheme=WNA16Scheme(bits=8, group_size=128, has_zero_point=False, pack_format=PackFormat.GPTQ))
    assert hopper_scope(layer, SM90) is None
    assert not any(hopper_takes(layer, m, SM90) for m in (256, 1024, 4096, 16384))
    assert "not yet" in compose.hopper_composable(select_backend(layer))
    explicit = dataclasses.replace(layer, options=RunOptions(plan_only=True, explicit=True))
    assert HopperBackend().incompatibility_reason(explicit) is None


def test_auto_hands_an_int4_zero_point_layer_the_batches_of_the_same_rule():
    """int4 with zero points (AWQ; run as int8 q - z) takes the symmetric layers' rule, timed on it on the H200: 64
    rows per hit expert and up."""
    zp = WNA16Scheme(bits=4, group_size=128, has_zero_point=True, pack_format=PackFormat.AWQ)
    layer, sym = _problem(scheme=zp), _problem()
    assert hopper_rule_gap(layer) is None
    for m in (1, 16, 64, 256, 512, 1024, 4096):
        assert hopper_takes(layer, m, SM90) == hopper_takes(sym, m, SM90) == (pairs_per_expert(layer, m) >= 64), m
    assert compose.hopper_composable(select_backend(layer)) is None


def test_copy_is_one_more_set_of_the_experts_int4_weights_and_scales_in_the_kernels_groups():
    """Groups of 64 and of 128 are kept as they are (hopper_ops.kernel_group_size), groups of 192 repeated to 64."""
    p = _problem(gs=64)
    assert hopper_copy_bytes(p) == int(p.num_experts * expert_bytes(p))
    e, h, i = 8, 4096, 3584
    for gs, kernel_group in ((128, 128), (64, 64)):
        scales = 2 * (2 * i * h // kernel_group + h * i // kernel_group)
        assert hopper_copy_bytes(_problem(gs=gs)) == e * (3 * h * i // 2 + scales)
    g192 = _problem(H=3072, I=1536, gs=192)
    assert hopper_copy_bytes(g192) == e * (3 * 3072 * 1536 // 2 + 2 * 3 * 3072 * 1536 // 64)


def test_a_zero_point_copy_holds_int8_weights():
    """int4 with zero points runs as int8 q - z (hopper_ops.kernel_bits): a byte per weight, no zero tables."""
    zp = WNA16Scheme(bits=4, group_size=128, has_zero_point=True, pack_format=PackFormat.AWQ)
    int8 = WNA16Scheme(bits=8, group_size=128, has_zero_point=False, pack_format=PackFormat.GPTQ)
    e, h, i = 8, 4096, 3584
    assert hopper_copy_bytes(_problem(scheme=zp)) - hopper_copy_bytes(_problem()) == e * 3 * h * i // 2
    assert hopper_copy_bytes(_problem(scheme=zp)) == hopper_copy_bytes(_problem(scheme=int8))


def test_the_built_tile_table_is_the_translation_units_there_are():
    """BUILT_TILES (what the plan may launch) against csrc/hopper/grouped_tile_<N>[_fp16][_int8].cu (what setup.py
    builds) and the glue's extern declarations (moe_w4a16_grouped.cu): one unit per entry, none missing, none extra,
    no zero-point build (grouped_gemm.h's tile_is_built: CUTLASS 4.2's grouped zero mode faults)."""
    hopper = Path(__file__).resolve().parents[2] / "csrc" / "hopper"
    glue = (hopper / "moe_w4a16_grouped.cu").read_text()
    built = set()
    for f in sorted(hopper.glob("grouped_tile_*.cu")):
        parts = f.stem.removeprefix("grouped_tile_").split("_")
        assert set(parts[1:]) <= {"fp16", "int8"}, f"{f.name}: a build the table has no key for"
        dtype = torch.float16 if "fp16" in parts else torch.bfloat16
        bits = 8 if "int8" in parts else 4
        built.add((int(parts[0]), dtype, bits))
        args = f"{parts[0]}, {'kFp16' if 'fp16' in parts else 'kBf16'}, false, {bits}"
        assert f"WNA16_HOPPER_INSTANTIATE({args})" in f.read_text(), f"{f.name} does not instantiate what its name says"
        assert f"WNA16_HOPPER_EXTERN({args})" in glue, f"moe_w4a16_grouped.cu does not declare {f.name}'s build"
    table = {(t, dtype, bits) for (dtype, bits), tiles in BUILT_TILES.items() for t in tiles}
    assert built == table
    assert glue.count("WNA16_HOPPER_EXTERN(") == len(table) + 1  # the declarations and the macro's definition
    assert all(t in TILE_WIDTHS for t, *_ in table)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("zp", "bits"), [(False, 4), (True, 4), (False, 8)], ids=["sym", "zp", "int8"])
def test_every_tile_a_plan_picks_is_built(dtype, zp, bits):
    """Explicit hopper (every M) and auto with the copy, for each build: the plan's tile is one BUILT_TILES has."""
    scheme = WNA16Scheme(
        bits=bits, group_size=128, has_zero_point=zp, pack_format=PackFormat.AWQ if zp else PackFormat.GPTQ
    )
    for dims in ((8, 2, 4096, 3584), (128, 8, 2048, 768), (64, 6, 2560, 384)):
        E, top_k, H, I = dims  # noqa: N806, E741
        problem = _problem(E=E, top_k=top_k, H=H, I=I, scheme=scheme, act_dtype=dtype)
        selection = select_backend(problem, "hopper", "test")
        for m in (1, 2, 7, 16, 33, 64, 100, 256, 1000, 4096, 16384):
            p = plan(problem, m, SM90, selection=selection)
            assert p.launch.tile in built_tiles(dtype, zp, bits), (dims, m, p.launch.tile)


@pytest.mark.parametrize("group", [64, 128, 512])
def test_zero_point_weights_give_the_zero_point_layer_as_int8(group):
    """zero_point_weights' int8 u = q - z + 128, read by the kernel as s * (u - 128), is the zero-point weight
    (q - z) * s of packing.dequantize exactly, on random zero points."""
    from vllm_wna16_plugin import packing
    from vllm_wna16_plugin.kernels.hopper_ops import zero_point_weights

    gen = torch.Generator().manual_seed(group)
    w = torch.randn(3, 256, 512, generator=gen)
    qw = packing.quantize_rtn(w, 4, group, has_zero_point=True)
    assert int(qw.zeros.min()) < 8 - 1 and int(qw.zeros.max()) > 8  # zero points away from the midpoint
    kw = packing.to_kernel_layout(qw, torch.float32)
    u = zero_point_weights(kw.qweight, kw.qzeros, group)
    assert u.shape == (3, 256, 512) and u.dtype == torch.uint8
    s = kw.scales.float().repeat_interleave(group, dim=-1)
    want = packing.dequantize(packing.from_kernel_layout(kw, 4))
    assert torch.equal((u.float() - 128) * s, want)


@pytest.mark.parametrize(("group", "kernel_group"), [(64, 64), (128, 128), (192, 64), (256, 128), (4096, 128)])
def test_kernel_scales_repeat_each_group_over_its_scale_rows(group, kernel_group):
    from vllm_wna16_plugin.kernels.hopper_ops import kernel_group_size, kernel_scales

    assert kernel_group_size(group) == kernel_group
    k, n = 4096 if group != 192 else 3072, 256
    scales = torch.randn(3, n, k // group)
    table = kernel_scales(scales, group, kernel_group)
    assert table.shape == (3, k // kernel_group, n) and table.is_contiguous()
    row = torch.arange(k // kernel_group)
    assert torch.equal(table, scales[:, :, row * kernel_group // group].transpose(1, 2))


@pytest.mark.parametrize("group", [64, 128, 192, 320, 384, 1024])
def test_the_kernel_group_is_the_largest_built_one_dividing_the_checkpoints(group):
    """Every legal group size (hopper_scope: a multiple of K_TILE; channel-wise: K) gets a kernel group that divides it,
    the larger of KERNEL_GROUPS where both do."""
    from vllm_wna16_plugin.kernels.hopper_ops import K_TILE, KERNEL_GROUPS, kernel_group_size

    g = kernel_group_size(group)
    assert g in KERNEL_GROUPS and group % g == 0
    assert all(group % larger for larger in KERNEL_GROUPS if larger > g)
    assert K_TILE in KERNEL_GROUPS and min(KERNEL_GROUPS) == K_TILE
    assert kernel_group_size(32) == 32  # out of scope (hopper_scope refuses it), counted as it is


def test_auto_never_picks_hopper_alone_but_an_explicit_request_does():
    p = _problem()
    assert "beside" in HopperBackend().incompatibility_reason(p)
    explicit = dataclasses.replace(p, options=RunOptions(plan_only=True, explicit=True))
    assert HopperBackend().incompatibility_reason(explicit) is None
    assert select_backend(p).backend.name in ("cuda", "triton")
    sel = select_backend(p, "hopper", "test")
    assert sel.backend.name == "hopper"
    assert {plan(sel.problem, m, SM90, selection=sel).backend for m in (1, 64, 4096)} == {"hopper"}


def test_auto_with_the_hopper_copy_plans_it_where_its_rule_takes():
    sel = select_backend(_problem())
    assert compose.hopper_composable(sel) is None
    composed = compose.with_hopper(sel)
    assert "hopper" in plan_backends(composed) and "hopper" not in plan_backends(sel)
    for m in (1, 4, 16, 64, 256, 1024, 4096):
        p = plan(composed.problem, m, SM90, selection=composed)
        want = hopper_takes(composed.problem, m, SM90)
        assert (p.backend == "hopper") == want, (m, p.backend)
        if want:
            assert p.launch.tile == token_tile(pairs_per_expert(composed.problem, m))
            assert any("hopper rule" in w for w in p.why)
            assert p.gemms[0].tile == (128, p.launch.tile, 64)
        else:
            assert p.backend in ("cuda", "triton")


@pytest.mark.parametrize("partner", ["marlin", "humming"])
def test_hopper_goes_before_marlin_and_after_humming(partner):
    from vllm_wna16_plugin.compose import partner_named

    sel = select_backend(_problem())
    composed = compose.with_hopper(compose.compose_with(sel, partner))
    takes = partner_named(partner).takes
    both = 0
    for m in (16, 64, 128, 256, 512, 1024, 4096):
        backend = plan(composed.problem, m, SM90, selection=composed).backend
        theirs, ours = takes(composed.problem, m, SM90), hopper_takes(composed.problem, m, SM90)
        both += theirs and ours
        first, second = (partner, "hopper") if partner == "humming" else ("hopper", partner)
        want = first if (theirs, ours)[first == "hopper"] else second if (theirs, ours)[second == "hopper"] else None
        assert backend == (want or backend) and (want is not None or backend in ("cuda", "triton")), (m, backend)
    assert both  # the order mattered on this layer


def test_no_hopper_copy_where_the_partner_whose_rule_goes_first_takes_all_its_batches():
    """Humming's rule goes first and takes every batch of 64+ rows per hit expert (its prefill clause), so a layer
    composed with Humming keeps no hopper copy; composed with Marlin (hopper first) or with no partner it does."""
    sel = select_backend(_problem())
    with_humming = compose.compose_with(sel, "humming")
    assert "that Humming's (composed, its rule first) does not" in compose.hopper_composable(with_humming)
    assert compose.hopper_composable(compose.compose_with(sel, "marlin")) is None
    assert compose.hopper_composable(sel) is None


def test_hopper_is_not_composed_where_out_of_scope_or_asked_for_another_backend():
    int8 = WNA16Scheme(bits=8, group_size=128, has_zero_point=False, pack_format=PackFormat.GPTQ)
    assert "not yet" in compose.hopper_composable(select_backend(_problem(scheme=int8)))
    int8_zp = dataclasses.replace(int8, has_zero_point=True)
    assert "not built" in compose.hopper_composable(select_backend(_problem(scheme=int8_zp)))
    assert "as asked" in compose.hopper_composable(select_backend(_problem(), "triton", "test"))


def test_the_hopper_variable_is_checked_as_loading_checks_it():
    compose.check_settings({"VLLM_WNA16_PLUS_HOPPER": "0"})
    with pytest.raises(ValueError, match="VLLM_WNA16_PLUS_HOPPER='maybe'"):
        compose.check_settings({"VLLM_WNA16_PLUS_HOPPER": "maybe"})


# ---------------------------------------------------------------- the rule against what it was fitted on and checked on

H100_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "h100"


def hopper_decisions(run: str, plugin: str, hopper: str) -> list[tuple[str, int, bool, float]]:
    """(shape, M, the rule takes hopper, the chosen time / the faster of the plugin's column and hopper's) for the
    points of an H100 run where both were timed (a WRONG point has no time and is left out)."""
    from .test_humming_rule import catalog_shapes, problem_of

    shapes = {name: shape for name, (_, shape) in catalog_shapes().items()}
    times: dict[tuple[str, int], dict[str, float]] = {}
    with open(H100_RESULTS / run, newline="") as f:
        for r in csv.DictReader(f):
            if r["median_us"] and r["provider"] in (plugin, hopper) and r["shape"] in shapes:
                times.setdefault((r["shape"], int(r["M"])), {})[r["provider"]] = float(r["median_us"])
    out = []
    for (shape, m), t in sorted(times.items()):
        if len(t) < 2:
            continue
        s = shapes[shape]
        taken = hopper_takes(problem_of(s.E, s.top_k, s.H, s.I, s.gs, gs2=s.group_w2), m, SM90)
        out.append((shape, m, taken, t[hopper if taken else plugin] / min(t.values())))
    return out


def test_the_rule_on_the_development_set_it_was_fitted_on():
    """H100, the plugin's layer alone against plugin-hopper (2026-12-06-d23a13c-hopper-dev): every point the rule
    hands to hopper is hopper's, and the points it leaves cost at most 8% (Mixtral-8x7B at M=64, 16 rows per
    expert: the plugin 160 against hopper 149 µs, where Marlin's 123 run on a vLLM without Humming)."""
    got = hopper_decisions("2026-12-06-d23a13c-hopper-dev.csv", "plugin-auto", "plugin-hopper")
    assert len(got) >= 23  # 5 models in scope x 5 M, less the two WRONG points (groups of 128, since fixed)
    assert all(cost == 1.0 for _, _, taken, cost in got if taken)
    assert max(cost for *_, cost in got) < 1.08, [g for g in got if g[3] >= 1.08]
    assert sum(taken for _, _, taken, _ in got) >= 10


def test_the_rule_on_the_validation_set_it_was_not_fitted_on():
    """H100, auto beside Marlin with and without the hopper copy (2026-12-06-28c26e7-hopper-val): where the rule
    took hopper the composed layer was 1.31-1.66x faster; where it did not, the two columns ran the same kernels."""
    got = hopper_decisions("2026-12-06-28c26e7-hopper-val.csv", "plugin-auto-marlin", "plugin-auto-marlin-hopper")
    assert len(got) >= 9
    assert sum(taken for _, _, taken, _ in got) >= 5
    assert all(cost <= 1.01 for *_, cost in got), got


def test_no_copy_where_the_engines_token_budget_stays_below_the_rule():
    """DeepSeek-V3 at TP 4 (E=256, top_k=8): 64 rows per hit expert from M=2048; a budget of 1024 tokens a step never
    reaches a batch the rule takes, so the layer keeps no hopper copy."""
    sel = select_backend(_problem(E=256, top_k=8, H=7168, I=512))
    assert not hopper_takes(sel.problem, 1024, SM90) and hopper_takes(sel.problem, 2048, SM90)
    assert compose.hopper_composable(sel) is None
    assert compose.hopper_composable(sel, max_tokens=8192) is None
    assert "up to the engine's 1024 tokens a step" in compose.hopper_composable(sel, max_tokens=1024)


def test_the_token_budget_is_read_from_the_engines_scheduler_config(monkeypatch):
    """_vllm.max_batched_tokens: the current config's scheduler_config.max_num_batched_tokens where it is a positive
    int, else None (outside an engine vLLM hands back a default config: 2048 tokens on 0.26)."""
    from types import SimpleNamespace

    vllm_config = pytest.importorskip("vllm.config")
    from vllm_wna16_plugin import _vllm

    for value, want in ((4096, 4096), (None, None), (0, None), (True, None), ("2048", None)):
        config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=value))
        monkeypatch.setattr(vllm_config, "get_current_vllm_config", lambda config=config: config)
        assert _vllm.max_batched_tokens() == want, value
    monkeypatch.setattr(vllm_config, "get_current_vllm_config", lambda: SimpleNamespace())
    assert _vllm.max_batched_tokens() is None

    def no_config():
        raise RuntimeError("no current config")

    monkeypatch.setattr(vllm_config, "get_current_vllm_config", no_config)
    assert _vllm.max_batched_tokens() is None


def test_prepare_refuses_a_scheme_and_tensors_that_disagree_on_zero_points():
    """The plan picks its tiles by the scheme's zero points, prepare its form by the tensors': they must agree."""
    from vllm_wna16_plugin.backends.base import KernelTensors

    awq = _problem(scheme=WNA16Scheme(bits=4, group_size=128, has_zero_point=True, pack_format=PackFormat.AWQ))
    e, h, i = 8, 4096, 3584
    tensors = KernelTensors(
        torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8), torch.zeros(e, h, i // 2, dtype=torch.uint8),
        torch.ones(e, 2 * i, h // 128), torch.ones(e, h, i // 128),
    )  # fmt: skip
    with pytest.raises(ValueError, match="disagree on zero points"):
        HopperBackend().prepare(awq, tensors)
