"""inputs.py through the functional API: every backend that runs on CPU, at decode (M=1: Triton's
per-pair kernel, no alignment) and at M=5 (aligned blocks), gets the same checks and the same messages.

Strided views must give the contiguous result (checked against the float reference on fresh random
data); bad ids, bad maps and bad shapes must be refused with a ValueError naming the argument, before
any launch.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import assert_close_scaled, make_moe_problem
from vllm_wna16_plugin.inputs import check_layer_tensors
from vllm_wna16_plugin.ops import fused_moe_wna16
from vllm_wna16_plugin.reference import fused_moe_wna16_ref

BACKENDS = [pytest.param("triton", marks=pytest.mark.interpreter), "reference"]
MS = [1, 5]
GS = 32


def _problem(m: int, seed: int, *, zp: bool = True, num_global_experts=None):
    return make_moe_problem(
        M=m, H=64, I=32, E=4, top_k=2, bits=4, gs1=GS, zp=zp, num_global_experts=num_global_experts, seed=seed
    )


def _call(p, backend, **overrides):
    names = ("x", "w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "topk_weights", "topk_ids")
    args = dict(zip(names, p.args(), strict=True))
    kwargs = dict(p.kwargs(), group_size=GS, backend=backend)
    for k, v in overrides.items():
        (args if k in args else kwargs)[k] = v
    return fused_moe_wna16(*args.values(), **kwargs)


def _strided(t: torch.Tensor, seed: int) -> torch.Tensor:
    """A non-contiguous view holding t's values: every other column of a wider tensor of noise."""
    wide_shape = (*t.shape[:-1], 2 * t.shape[-1])
    gen = torch.Generator().manual_seed(seed)
    if t.dtype.is_floating_point:
        wide = torch.randn(wide_shape, generator=gen).to(t.dtype)
    else:
        wide = torch.randint(-(2**20), 2**20, wide_shape, generator=gen).to(t.dtype)  # far out of range
    view = wide[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", ["x", "topk_weights", "topk_ids", "expert_map"])
def test_strided_views_of_activations_and_routing_give_the_contiguous_result(backend, m, name):
    p = _problem(m, seed=100 + m, num_global_experts=6)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
    base = dict(x=p.x, topk_weights=p.topk_weights, topk_ids=p.topk_ids, expert_map=expert_map)
    want = fused_moe_wna16_ref(*p.args(), **p.kwargs(), expert_map=expert_map)
    out = _call(p, backend, **{**base, name: _strided(base[name], seed=m)})
    assert_close_scaled(out, want, torch.bfloat16, f"{backend} with a strided {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_qzeros", "w2_qzeros"])
def test_strided_weights_are_refused_with_the_fix(backend, name):
    p = _problem(2, seed=7)
    t = dict(zip(("w13_qweight", "w2_qweight", "w13_scales", "w2_scales"), p.args()[1:5], strict=True))
    t.update(w13_qzeros=p.w13.qzeros, w2_qzeros=p.w2.qzeros)
    with pytest.raises(ValueError, match=rf"{name} is not contiguous .*pass {name}\.contiguous\(\)"):
        _call(p, backend, **{name: _strided(t[name], seed=3)})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(
    ("bad_id", "message"),
    [
        (4, r"topk_ids holds expert id 4, outside \[0, 4\) \(E=4\)"),
        (-1, r"topk_ids holds expert id -1, outside \[0, 4\) \(E=4\)"),
        (2**31 - 1, r"topk_ids holds expert id 2147483647, outside \[0, 4\)"),
    ],
    ids=["E", "negative", "huge"],
)
def test_out_of_range_ids_get_one_message_at_every_m(backend, m, bad_id, message):
    p = _problem(m, seed=200 + m)
    ids = p.topk_ids.clone()
    ids[m - 1, 1] = bad_id
    with pytest.raises(ValueError, match=message):
        _call(p, backend, topk_ids=ids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", MS)
def test_expert_map_checks_at_every_m(backend, m):
    p = _problem(m, seed=300 + m, num_global_experts=6)
    good = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
    ids = p.topk_ids.clone()
    ids[0, 0] = 5
    short = good[:5]  # one global expert missing: id 5 has no entry
    with pytest.raises(ValueError, match=r"topk_ids holds expert id 5, outside \[0, 5\) \(expert_map has 5 entries\)"):
        _call(p, backend, topk_ids=ids, expert_map=short)
    for bad, shown in ((4, 4), (-2, -2)):  # a local id past E=4; below -1
        wrong = good.clone()
        wrong[2] = bad
        with pytest.raises(ValueError, match=rf"expert_map holds {shown}, outside \[-1, 4\)"):
            _call(p, backend, topk_ids=ids, expert_map=wrong)
    with pytest.raises(ValueError, match=r"global_num_experts=8 disagrees: expert_map has 6 entries"):
        _call(p, backend, expert_map=good, global_num_experts=8)
    with pytest.raises(ValueError, match=r"expert_map has dtype float32; it must be int32, int64"):
        _call(p, backend, expert_map=good.float())


def _bad_shapes(p):
    """(argument, bad value, expected message): each breaks one rule of inputs.check_layer_tensors."""
    w13s, w2s, z13, z2 = p.w13.scales, p.w2.scales, p.w13.qzeros, p.w2.qzeros
    return [
        ("w13_scales", w13s[:3], r"w13_scales has shape \(3, 64, 2\); it must be \(4, 64, 2\)"),
        ("w2_scales", w2s[:, :32], r"w2_scales has shape \(4, 32, 1\); it must be \(4, 64, 1\)"),
        ("w13_scales", torch.cat([w13s, w13s], -1), r"w13_scales has 4 scale groups along K=64; group_size=32 needs 2"),
        (
            "w13_qzeros",
            torch.cat([z13, z13[..., :1]], -1),
            r"w13_qzeros has shape \(4, 32, 3\); it must be \(4, 32, 2\)",
        ),
        ("w2_qzeros", z2[:, :8], r"w2_qzeros has shape \(4, 8, 1\); it must be \(4, 32, 1\)"),
        ("w13_qweight", p.w13.qweight.view(torch.int8), r"w13_qweight has dtype int8; it must be uint8"),
        # GPTQ's int32 packing (a quarter of the columns): the dtype is named, not the bytes per row
        (
            "w13_qweight",
            p.w13.qweight.view(torch.int32),
            r"w13_qweight has dtype int32; it must be uint8 .*unpack_gptq",
        ),
        ("w2_scales", w2s.to(torch.int32), r"w2_scales has dtype int32; it must be bfloat16"),
        (
            "w13_scales",
            w13s.float(),
            r"w13_scales has dtype float32; it must be bfloat16 \(\(E, 2I, H/group_size\) in x's dtype\)",
        ),
        ("topk_weights", p.topk_weights[:, :1], r"topk_weights has shape \(2, 1\); it must be \(2, 2\)"),
        ("topk_ids", p.topk_ids.float(), r"topk_ids has dtype float32; it must be int32, int64"),
        ("x", p.x[:, :32], r"x has H=32 columns, but w2_qweight's 64 rows .* say the layer's hidden size is 64"),
        ("w2_qzeros", None, r"only w13_qzeros was given"),
        ("x", p.x.to("meta"), r"w13_qweight is on cpu but x is on meta"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_shape_dtype_and_device_mismatches_name_the_argument(backend):
    p = _problem(2, seed=11)
    for name, value, message in _bad_shapes(p):
        with pytest.raises(ValueError, match=message):
            _call(p, backend, **{name: value})


def test_int8_weights_called_as_int4_name_bits_and_an_x_of_another_size_names_x():
    # the weights' own shapes agree with x's H (w2's rows): only the packing disagrees, so the hint is bits
    p = make_moe_problem(M=2, H=64, I=32, E=4, top_k=2, bits=8, gs1=GS, seed=12)
    names = ("x", "w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "topk_weights", "topk_ids")
    args = dict(zip(names, p.args(), strict=True))
    kwargs = dict(p.kwargs(), group_size=GS, backend="reference", bits=4)
    with pytest.raises(ValueError, match=r"w13_qweight has 64 bytes per row but x's H=64 int4 values need 32 "
                                         r"\(it holds int8 values: bits=8\?\)"):  # fmt: skip
        fused_moe_wna16(*args.values(), **kwargs)
    # x narrower than the layer: x is named, whatever the bits
    for bits in (4, 8):
        args["x"] = p.x[:, :32]
        with pytest.raises(ValueError, match=r"x has H=32 columns, but w2_qweight's 64 rows"):
            fused_moe_wna16(*args.values(), **dict(kwargs, bits=bits))


@pytest.mark.parametrize(
    ("bits", "message"),
    [
        (3, r"bits=3 is not supported; supported: \[4, 8\]"),
        (16, r"bits=16 is not supported"),
        (True, r"bits=True must be an int, not bool"),
        ("4", r"bits='4' must be an int, not str"),
    ],
)
def test_unsupported_bits_are_named_before_any_shape(bits, message):
    p = _problem(2, seed=12)
    with pytest.raises(ValueError, match=message):
        _call(p, "reference", bits=bits)


@pytest.mark.parametrize(
    ("group_size", "message"),
    [
        (0, r"group_size=0 is not supported; use a positive group size or -1"),
        (-2, r"group_size=-2 is not supported"),
        ("32", r"group_size='32' must be an int, not str"),
        (64, r"w13_scales has 2 scale groups along K=64; group_size=64 >= K needs exactly 1"),
        (16, r"w13_scales has 2 scale groups along K=64; group_size=16 needs 4"),
        (-1, r"w13_scales has 2 scale groups along K=64; channel-wise \(group_size=-1\) needs exactly 1"),
    ],
)
def test_group_size_must_match_the_scales(group_size, message):
    p = _problem(2, seed=13)
    with pytest.raises(ValueError, match=message):
        _call(p, "reference", group_size=group_size)


def test_a_group_size_larger_than_k_means_one_group():
    """GEMM2's K (a TP rank's I=32) below the checkpoint's group size 64: one group over K, accepted."""
    p = make_moe_problem(M=3, H=128, I=32, E=4, top_k=2, bits=8, gs1=64, gs2=-1, seed=14)
    shape = check_layer_tensors(*p.args(), **p.kwargs(), group_size=64)
    assert (shape.group_size_w13, shape.group_size_w2) == (64, 32)
    out = fused_moe_wna16(*p.args(), **p.kwargs(), group_size=64, backend="reference")
    assert_close_scaled(out, fused_moe_wna16_ref(*p.args(), **p.kwargs()), torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_give_an_empty_output(backend):
    p = _problem(1, seed=15)
    out = _call(p, backend, x=p.x[:0], topk_weights=p.topk_weights[:0], topk_ids=p.topk_ids[:0])
    assert out.shape == (0, 64) and out.dtype == p.x.dtype


def test_a_regrouped_gemm2_is_described_by_a_group_size_pair():
    """A TP rank's I=96 of a gs128 checkpoint runs GEMM2 regrouped to 32: (128, 32), checked per GEMM."""
    p = make_moe_problem(M=3, H=256, I=96, E=4, top_k=2, bits=4, gs1=128, gs2=32, seed=16)
    shape = check_layer_tensors(*p.args(), **p.kwargs(), group_size=(128, 32))
    assert (shape.group_size_w13, shape.group_size_w2) == (128, 32)
    out = fused_moe_wna16(*p.args(), **p.kwargs(), group_size=(128, 32), backend="reference")
    assert_close_scaled(out, fused_moe_wna16_ref(*p.args(), **p.kwargs()), torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"w2_scales has 3 scale groups along K=96; group_size=128 >= K needs exactly 1"
    ):
        check_layer_tensors(*p.args(), **p.kwargs(), group_size=128)
    with pytest.raises(ValueError, match=r"w2_scales has 3 scale groups along K=96; group_size=48 needs 2"):
        check_layer_tensors(*p.args(), **p.kwargs(), group_size=(128, 48))


def test_routing_values_are_not_read_back_while_a_graph_is_captured_or_compiled(monkeypatch):
    """Reading ids back is a host sync: CUDA-graph capture forbids it (tests/kernels/test_backends_gpu.py
    captures fused_moe_wna16), so the value check steps aside there; shapes are still checked."""
    from vllm_wna16_plugin import ops

    def must_not_run(*args, **kwargs):
        raise AssertionError("check_routing_values ran while compiling")

    p = _problem(2, seed=17)
    monkeypatch.setattr(ops, "check_routing_values", must_not_run)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = _call(p, "reference")
    assert_close_scaled(out, fused_moe_wna16_ref(*p.args(), **p.kwargs()), torch.bfloat16)
    with pytest.raises(ValueError, match=r"topk_ids has dtype float32"):
        _call(p, "reference", topk_ids=p.topk_ids.float())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    with pytest.raises(AssertionError, match="ran while compiling"):
        _call(p, "reference")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(options="fast"), r"options='fast' must be a KernelOptions .* or None, not str"),
        (dict(apply_router_weight_on_input="no"), r"apply_router_weight_on_input='no' must be True or False"),
    ],
)
def test_functional_api_options_are_typed(kwargs, message):
    p = _problem(2, seed=13)
    with pytest.raises(ValueError, match=message):
        _call(p, "reference", **kwargs)


def test_zero_sized_hidden_and_intermediate_are_named():
    p = _problem(2, seed=14)
    with pytest.raises(ValueError, match=r"x has H=0 columns"):
        _call(p, "reference", x=p.x[:, :0])
    with pytest.raises(ValueError, match=r"w13_qweight has 0 rows: the intermediate size I must be positive"):
        _call(p, "reference", w13_qweight=p.w13.qweight[:, :0])


def test_zero_local_experts_are_named_on_every_backend():
    # triton died in its config math (ZeroDivisionError), reference returned zeros: now one clear error
    p = _problem(2, seed=15)
    cut = {k: getattr(p.w13, k)[:0] for k in ("qweight", "scales")}
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match=r"w13_qweight holds 0 experts: a rank needs at least one local expert"):
            _call(p, backend, w13_qweight=cut["qweight"], w13_scales=cut["scales"])
