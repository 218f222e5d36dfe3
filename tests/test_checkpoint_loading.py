"""Tiny on-disk checkpoints of every format, loaded through vLLM's FusedMoE weight loader on CPU.

The layer's forward (reference backend on CPU) must equal the float math on the
checkpoint's own dequantized experts (reference/ beside it), and stay close to
the original float weights.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from tests.conftest import build_moe_layer
from vllm_wna16_plugin.reference import fused_moe_ref
from vllm_wna16_plugin.tools.make_checkpoint import load_reference, make_checkpoint

H, I, E, TOP_K = 128, 64, 4, 2

CASES = [
    pytest.param(dict(fmt="gptq", bits=4, group_size=32), id="gptq-int4-gs32"),
    pytest.param(dict(fmt="gptq", bits=4, group_size=64, sym=False, checkpoint_format="gptq_v2"), id="gptq-asym-v2"),
    pytest.param(dict(fmt="gptq", bits=8, group_size=32), id="gptq-int8"),
    pytest.param(dict(fmt="gptq", bits=4, group_size=32, desc_act=True), id="gptq-desc-act"),
    pytest.param(dict(fmt="compressed-tensors", bits=4, group_size=32, desc_act=True), id="ct-actorder-group"),
    pytest.param(dict(fmt="awq", bits=4, group_size=32, sym=False), id="awq-gs32"),
    pytest.param(dict(fmt="compressed-tensors", bits=4, group_size=-1, group_size_null=True), id="ct-channel-null"),
    pytest.param(dict(fmt="compressed-tensors", bits=4, group_size=32, sym=False), id="ct-gs32-asym"),
    pytest.param(dict(fmt="gptq", bits=4, group_size=32, arch="mixtral"), id="mixtral-gptq"),
]


def _experts_of_layer0(path, arch):
    prefix = "model.layers.0.block_sparse_moe.experts." if arch == "mixtral" else "model.layers.0.mlp.experts."
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return [(k.removeprefix(prefix), f.get_tensor(k)) for k in f.keys() if k.startswith(prefix)]


def _forward_matches_truth(layer, path, *, m: int, seed: int):
    """The loaded layer's forward on m random tokens against the float math of the checkpoint's own dequantized
    experts (reference/); returns (out, x, topk_weights, topk_ids)."""
    ref = load_reference(path)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)])
    w = torch.rand(m, TOP_K, generator=g)
    out = layer.quant_method.apply(layer, x, w, ids, None, None).float()
    exact = fused_moe_ref(x, ref["layers.0.w13"], ref["layers.0.w2"], w, ids).float()
    err = (out - exact).abs().max().item()
    assert err <= exact.abs().max().item() * 2**-6, f"max error {err:.3g} vs dequantized truth"
    return out, x, w, ids


@pytest.mark.parametrize("kwargs", CASES)
def test_tiny_checkpoint_loads_and_matches(vllm_cpu, tmp_path, kwargs):
    arch = kwargs.get("arch", "qwen3_moe")
    path = make_checkpoint(tmp_path / "ck", hidden=H, intermediate=I, experts=E, top_k=TOP_K, layers=1, **kwargs)
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    names = ("w1", "w2", "w3") if arch == "mixtral" else ("gate_proj", "down_proj", "up_proj")
    layer = build_moe_layer(vllm_cpu, raw, E=E, H=H, I=I, top_k=TOP_K, ckpt_names=names)
    loaded = set(layer.load_weights(_experts_of_layer0(path, arch)))
    assert any("qweight" in n or "weight_packed" in n for n in loaded)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.quant_method.selection.backend.name == "reference"  # CPU

    out, x, w, ids = _forward_matches_truth(layer, path, m=5, seed=0)
    ref = load_reference(path)
    floats = fused_moe_ref(x, ref["layers.0.w13_float"], ref["layers.0.w2_float"], w, ids).float()
    rel = ((out - floats).norm() / floats.norm()).item()
    assert rel < (0.05 if kwargs["bits"] == 8 else 0.25), f"far from the float weights: rel {rel:.3g}"


# ---------------------------------------------------------------- corrupted checkpoints: refused at load
#
# Each case writes a real checkpoint, corrupts one tensor of a random expert at a random position with a
# random bad value (seeded), loads the layer and expects a ValueError naming the tensor, its expert and
# layer, the bad value and where it is. Before load-time validation each of these loaded, then crashed in
# the first forward (g_idx) or produced NaN or silently wrong output.

LAYER = "model.layers.0.mlp.experts"


def _stored(path) -> dict[str, torch.Tensor]:
    """Every tensor of layer 0's experts, by the name below the layer prefix (e.g. '2.up_proj.scales')."""
    return dict(_experts_of_layer0(path, "qwen3_moe"))


def _load(vllm_cpu, path, tensors: dict[str, torch.Tensor]):
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    layer = build_moe_layer(vllm_cpu, raw, E=E, H=H, I=I, top_k=TOP_K)
    list(layer.load_weights(list(tensors.items())))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _victim(gen: torch.Generator, suffix: str) -> tuple[int, str, str]:
    """(expert, projection, stored name) of a random expert and projection."""
    expert = int(torch.randint(E, (1,), generator=gen))
    proj = ("gate_proj", "up_proj", "down_proj")[int(torch.randint(3, (1,), generator=gen))]
    return expert, proj, f"{expert}.{proj}.{suffix}"


def _poke(tensor: torch.Tensor, value, gen: torch.Generator) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A copy of `tensor` with `value` at one random position, and that position."""
    flat = tensor.clone().flatten()
    i = int(torch.randint(flat.numel(), (1,), generator=gen))
    flat[i] = value
    return flat.view(tensor.shape), tuple(int(j) for j in torch.unravel_index(torch.tensor(i), tensor.shape))


def _expect(expert: int, proj: str, suffix: str, detail: str) -> str:
    return rf"checkpoint tensor {re.escape(LAYER)}\.{expert}\.{proj}\.{suffix} \(expert {expert} of {re.escape(LAYER)}\): {detail}"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("side", ["negative", "too-large", "beyond-int32"])
def test_g_idx_out_of_range_is_refused_at_load(vllm_cpu, tmp_path, seed, side):
    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, desc_act=True, hidden=H,
                           intermediate=I, experts=E, top_k=TOP_K, layers=1, seed=seed)  # fmt: skip
    gen = torch.Generator().manual_seed(100 + seed)
    tensors = _stored(path)
    expert, proj, name = _victim(gen, "g_idx")
    groups = (I if proj == "down_proj" else H) // 32
    g_idx = tensors[name].long()
    value = {
        "negative": -int(torch.randint(1, 1000, (1,), generator=gen)),
        "too-large": groups + int(torch.randint(0, 1000, (1,), generator=gen)),
        "beyond-int32": 2**32 + int(torch.randint(groups, (1,), generator=gen)),  # narrowing to int32 hid it
    }[side]
    tensors[name], (row,) = _poke(g_idx, value, gen)
    detail = rf"g_idx\[{row}\]={value} is outside \[0, {groups}\)"
    with pytest.raises(ValueError, match=_expect(expert, proj, "g_idx", detail)):
        _load(vllm_cpu, path, tensors)


def test_act_order_g_idx_without_desc_act_is_refused_at_load(vllm_cpu, tmp_path):
    # An act-order checkpoint whose config says desc_act false would silently run with the wrong groups.
    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=H, intermediate=I,
                           experts=E, top_k=TOP_K, layers=1, seed=4)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    tensors = _stored(path)
    expert, proj, name = _victim(gen, "g_idx")
    shuffled = tensors[name][torch.randperm(tensors[name].numel(), generator=gen)]
    row = int((shuffled != tensors[name]).nonzero()[0])
    tensors[name] = shuffled
    detail = rf"g_idx\[{row}\]={int(shuffled[row])}, but quantization_config.desc_act is false.*\"desc_act\": true"
    with pytest.raises(ValueError, match=_expect(expert, proj, "g_idx", detail)):
        _load(vllm_cpu, path, tensors)


@pytest.mark.parametrize(
    "kwargs, suffix, layout",
    [
        pytest.param(dict(fmt="gptq", bits=4, group_size=32), "scales", "GN", id="gptq"),
        pytest.param(
            dict(fmt="gptq", bits=8, group_size=-1, sym=False, checkpoint_format="gptq_v2"),
            "scales",
            "GN",
            id="gptq-int8-channel",
        ),  # fmt: skip
        pytest.param(dict(fmt="awq", bits=4, group_size=32, sym=False), "scales", "GN", id="awq"),
        pytest.param(dict(fmt="compressed-tensors", bits=4, group_size=32), "weight_scale", "NG", id="ct"),
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_scale_is_refused_at_load(vllm_cpu, tmp_path, kwargs, suffix, layout, bad):
    path = make_checkpoint(tmp_path / "ck", hidden=H, intermediate=I, experts=E, top_k=TOP_K, layers=1, seed=7,
                           **kwargs)  # fmt: skip
    gen = torch.Generator().manual_seed(hash((suffix, layout, str(bad))) % 1000)
    tensors = _stored(path)
    expert, proj, name = _victim(gen, suffix)
    tensors[name], pos = _poke(tensors[name], bad, gen)
    group, channel = pos if layout == "GN" else pos[::-1]
    detail = rf"scale {bad:g} at output channel {channel}, group {group} is not finite"
    with pytest.raises(ValueError, match=_expect(expert, proj, suffix, detail)):
        _load(vllm_cpu, path, tensors)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_zero_point_out_of_range_is_refused_at_load(vllm_cpu, tmp_path, bits):
    # v1 stores zero - 1: a stored all-ones field is zero 2**bits, which int`bits` cannot hold.
    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=bits, group_size=32, sym=False, hidden=H,
                           intermediate=I, experts=E, top_k=TOP_K, layers=1, seed=bits)  # fmt: skip
    gen = torch.Generator().manual_seed(bits)
    tensors = _stored(path)
    expert, proj, name = _victim(gen, "qzeros")
    top, fields = (1 << bits) - 1, 32 // bits
    groups, words = tensors[name].shape  # (G, N / fields)
    group, word, slot = (int(torch.randint(n, (1,), generator=gen)) for n in (groups, words, fields))
    qzeros = tensors[name].clone()
    qzeros[group, word] = qzeros[group, word] | torch.tensor(top << (slot * bits)).to(torch.int32)
    tensors[name] = qzeros
    channel = word * fields + slot  # the only all-ones field: random zero points - 1 stay below 2**bits - 1
    detail = rf"stored zero point {top} at output channel {channel}, group {group}: .*zero {top + 1}.*gptq_v2"
    with pytest.raises(ValueError, match=_expect(expert, proj, "qzeros", detail)):
        _load(vllm_cpu, path, tensors)


def _signed_unpacked_zeros(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Older compressed-tensors' zero points: (N, G) int8, zero - 2**(bits-1), from the packed (N/pf, G) form."""
    fields = 32 // bits
    words = packed.long() & 0xFFFFFFFF  # (N/pf, G)
    values = (words.unsqueeze(1) >> (torch.arange(fields) * bits).view(1, -1, 1)) & ((1 << bits) - 1)
    return (values.reshape(-1, packed.shape[-1]) - (1 << (bits - 1))).to(torch.int8)


def test_ct_unpacked_signed_zero_points_load_and_out_of_range_is_refused(vllm_cpu, tmp_path):
    path = make_checkpoint(tmp_path / "ck", fmt="compressed-tensors", bits=4, group_size=32, sym=False, hidden=H,
                           intermediate=I, experts=E, top_k=TOP_K, layers=1, seed=9)  # fmt: skip
    tensors = _stored(path)
    unpacked = {n: _signed_unpacked_zeros(t, 4) if n.endswith("weight_zero_point") else t for n, t in tensors.items()}
    # the unpacked form is read right: same output as the packed one
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(5)])
    w = torch.rand(5, TOP_K, generator=g)
    ref = load_reference(path)
    exact = fused_moe_ref(x, ref["layers.0.w13"], ref["layers.0.w2"], w, ids).float()
    for form in (tensors, unpacked):
        layer = _load(vllm_cpu, path, form)
        out = layer.quant_method.apply(layer, x, w, ids, None, None).float()
        assert (out - exact).abs().max() <= exact.abs().max() * 2**-6
    expert, proj, name = _victim(g, "weight_zero_point")
    value = int(torch.randint(8, 128, (1,), generator=g)) * (1 if torch.rand(1, generator=g) < 0.5 else -1)
    value = -9 if value == -8 else value  # -8 is in range
    unpacked[name], (channel, group) = _poke(unpacked[name], value, g)
    detail = rf"zero point {value} at output channel {channel}, group {group} is outside int4's signed range -8\.\.7"
    with pytest.raises(ValueError, match=_expect(expert, proj, "weight_zero_point", detail)):
        _load(vllm_cpu, path, unpacked)


@pytest.mark.parametrize(
    "suffix, bad, detail",
    [
        pytest.param("weight_scale", lambda t: t.double(), r"expected dtype .*found torch.float64", id="scale-fp64"),
        pytest.param("weight_scale", lambda t: t.T.contiguous(), r"expected shape", id="scale-transposed"),
        pytest.param("weight_packed", lambda t: t.view(torch.float32), r"expected dtype torch.int32", id="packed-f32"),
        pytest.param("weight_packed", lambda t: t[:, :-1], r"expected shape", id="packed-short"),
        pytest.param("weight_shape", lambda t: t.float(), r"expected dtype torch.int32 or torch.int64", id="shape-f32"),
        pytest.param("weight_shape", lambda t: t.flip(0), r"weight_shape \[\d+, \d+\] != expected", id="shape-swapped"),
        pytest.param(
            "weight_zero_point",
            lambda t: t.long(),
            r"expected int32 \(\d+, \d+\) \(packed\) or int8/int32",
            id="zp-int64",
        ),  # fmt: skip
    ],
)
def test_wrong_dtype_or_shape_is_named_at_load(vllm_cpu, tmp_path, suffix, bad, detail):
    path = make_checkpoint(tmp_path / "ck", fmt="compressed-tensors", bits=4, group_size=32, sym=False, hidden=H,
                           intermediate=I, experts=E, top_k=TOP_K, layers=1, seed=11)  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    tensors = _stored(path)
    expert, proj, name = _victim(gen, suffix)
    tensors[name] = bad(tensors[name])
    with pytest.raises(ValueError, match=_expect(expert, proj, suffix, detail)):
        _load(vllm_cpu, path, tensors)


# ---------------------------------------------------------------- configs that misdescribe the tensors


def _with_quant(path, **changes):
    """The checkpoint's config.json with quantization_config fields changed (CT: its group_0 weights)."""
    cfg = json.loads((path / "config.json").read_text())
    quant = cfg["quantization_config"]
    target = quant["config_groups"]["group_0"]["weights"] if "config_groups" in quant else quant
    target.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "kwargs, field, suffix, fix",
    [
        pytest.param(
            dict(fmt="gptq", checkpoint_format="gptq_v2"), {"sym": True}, "qzeros", '"sym": false', id="gptq-v2"
        ),
        pytest.param(dict(fmt="gptq"), {"sym": True}, "qzeros", '"sym": false', id="gptq-v1"),
        pytest.param(dict(fmt="awq"), {"zero_point": False}, "qzeros", '"zero_point": true', id="awq"),
        pytest.param(
            dict(fmt="compressed-tensors"), {"symmetric": True}, "weight_zero_point", '"symmetric": false', id="ct"
        ),  # fmt: skip
    ],
)
def test_real_zero_points_under_a_symmetric_config_are_refused(vllm_cpu, tmp_path, kwargs, field, suffix, fix):
    """Ignoring stored zero points the config calls symmetric would be a silently wrong layer (0.72 relative
    error on these): the tensor, the field and the fix are named."""
    path = make_checkpoint(tmp_path / "ck", bits=4, group_size=32, sym=False, hidden=H, intermediate=I, experts=E,
                           top_k=TOP_K, layers=1, seed=7, **kwargs)  # fmt: skip
    _with_quant(path, **field)
    with pytest.raises(ValueError, match=rf"{re.escape(LAYER)}\.\d\.\w+_proj\.{suffix} .*: its zero points differ "
                                         rf"between groups .* but quantization_config says .* set {fix}"):  # fmt: skip
        _load(vllm_cpu, path, _stored(path))


@pytest.mark.parametrize(
    "kwargs", [pytest.param(dict(fmt="gptq"), id="gptq-v1"), pytest.param(dict(fmt="awq"), id="awq")]
)
@pytest.mark.parametrize("word", [0x77777777, 0x88888888 - 2**32, 0], ids=["v1-midpoint", "v2-midpoint", "zeros"])
def test_symmetric_files_load_whatever_single_zero_their_writer_stored(vllm_cpu, tmp_path, kwargs, word):
    """The check's other side: no kernel reads a symmetric file's qzeros, and writers store one value in them,
    not always the midpoint of the label (GPTQModel 5+ writes v2's 0x88888888 under checkpoint_format gptq, as in
    Qwen/Qwen3.5-27B-GPTQ-Int4; AWQ writers may leave 0): each loads and gives the checkpoint's layer."""
    path = make_checkpoint(tmp_path / "ck", bits=4, group_size=32, hidden=H, intermediate=I, experts=E, top_k=TOP_K,
                           layers=1, seed=8, **kwargs)  # fmt: skip
    tensors = {n: t for n, t in _stored(path).items() if not n.endswith("qzeros")}
    tensors |= {n.replace("qweight", "qzeros"): torch.full((H // 32 if "down" not in n else I // 32,
                (I if "down" not in n else H) // 8), word, dtype=torch.int32)
                for n in list(tensors) if n.endswith("qweight")}  # fmt: skip
    _forward_matches_truth(_load(vllm_cpu, path, tensors), path, m=3, seed=1)


def test_ct_act_order_tensors_the_config_does_not_announce_are_refused_by_name(vllm_cpu, tmp_path):
    """vLLM would end in "has no parameter 'w2_weight_g_idx'" (AttributeError); the plugin names the field."""
    path = make_checkpoint(tmp_path / "ck", fmt="compressed-tensors", bits=4, group_size=32, desc_act=True, hidden=H,
                           intermediate=I, experts=E, top_k=TOP_K, layers=1, seed=9)  # fmt: skip
    _with_quant(path, actorder=None)
    with pytest.raises(ValueError, match=r"weight_g_idx .*: g_idx\[\d+\]=\d+, but quantization_config\.weights\."
                                         r'actorder is not group.*set "actorder": "group"'):  # fmt: skip
        _load(vllm_cpu, path, _stored(path))


def test_act_order_g_idx_with_groups_of_the_wrong_size_is_refused(vllm_cpu, tmp_path):
    """In range but impossible: act order keeps group_size rows in every group."""
    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, desc_act=True, hidden=H,
                           intermediate=I, experts=E, top_k=TOP_K, layers=1, seed=10)  # fmt: skip
    gen = torch.Generator().manual_seed(10)
    tensors = _stored(path)
    expert, proj, name = _victim(gen, "g_idx")
    g_idx = tensors[name].clone()
    row = int((g_idx == 1).nonzero()[0])
    g_idx[row] = 0  # group 0 gets 33 rows, group 1 31
    tensors[name] = g_idx
    detail = r"g_idx puts 33 of K=\d+ rows into group 0, but act order keeps 32 \(group_size 32\) in each group"
    with pytest.raises(ValueError, match=_expect(expert, proj, "g_idx", detail)):
        _load(vllm_cpu, path, tensors)


# ---------------------------------------------------------------- config.json disagrees with the tensors
#
# A config.json whose group_size or bits is not what the tensors were written with is a config error, not a
# corrupt file nor act order: the message says what the tensors hold and what to set.


_GPTQ_FIX, _GROUPS = r'"group_size": 32 in its config\.json', r"its shape \(\d+, \d+\) holds \d+ groups"
# (id, checkpoint, config's group size, what the message says the tensors hold, the fix it gives)
_CONFIG_GROUP_CASES = [
    # GPTQ stores a trivial g_idx: the first tensor checked, whatever the config says
    ("gptq-g_idx-16", dict(fmt="gptq", group_size=32), 16, r"g_idx\[k\] = k // 32", _GPTQ_FIX),
    ("gptq-g_idx-64", dict(fmt="gptq", group_size=32), 64, r"g_idx\[k\] = k // 32", _GPTQ_FIX),
    ("gptq-g_idx-channelwise", dict(fmt="gptq", group_size=32), -1, r"g_idx\[k\] = k // 32", _GPTQ_FIX),
    # act order with groups of 32 under a config of 64: still the config's group size, not a corrupt g_idx
    ("gptq-act-order-64", dict(fmt="gptq", group_size=32, desc_act=True), 64,
     r"g_idx deals K's rows into \d+ groups of 32", _GPTQ_FIX),
    ("awq-64", dict(fmt="awq", group_size=32, sym=False), 64, _GROUPS, _GPTQ_FIX),
    # K=64 in one group of 64: group size 64 or more, or channel-wise
    ("awq-32", dict(fmt="awq", group_size=64, sym=False), 32, r"its shape \(1, \d+\) holds 1 group",
     r'"group_size" to the group size the tensors were written with \(-1: channel-wise\)'),
    ("ct-64", dict(fmt="compressed-tensors", group_size=32), 64, _GROUPS,
     r'"strategy": "group", "group_size": 32 in its config_groups weights'),
    ("ct-channelwise-as-32", dict(fmt="compressed-tensors", group_size=-1, group_size_null=True), 32,
     r"its shape \(\d+, 1\) holds 1 group", r'"strategy": "channel" in its config_groups weights'),
]  # fmt: skip


@pytest.mark.parametrize("kwargs, config_gs, detail, fix", [pytest.param(*c[1:], id=c[0]) for c in _CONFIG_GROUP_CASES])
def test_a_config_group_size_other_than_the_tensors_is_named_as_the_config(vllm_cpu, tmp_path, kwargs, config_gs,
                                                                           detail, fix):  # fmt: skip
    path = make_checkpoint(tmp_path / "ck", bits=4, hidden=H, intermediate=I, experts=E, top_k=TOP_K, layers=1,
                           seed=21, **kwargs)  # fmt: skip
    if kwargs["fmt"] == "compressed-tensors":
        _with_quant(
            path, strategy="channel" if config_gs == -1 else "group", group_size=None if config_gs == -1 else config_gs
        )
    else:
        _with_quant(path, group_size=config_gs)
    msg = rf"{re.escape(LAYER)}\.\d+\.\w+\.\w+ .*: {detail} along K=\d+, which is .*, but the checkpoint's .* is "
    with pytest.raises(
        ValueError, match=msg + rf".*quantized with another group size than config\.json says; set {fix}"
    ):
        _load(vllm_cpu, path, _stored(path))


@pytest.mark.parametrize(
    "kwargs, field, key",
    [
        pytest.param(dict(fmt="gptq", group_size=32), "bits", "bits", id="gptq"),
        pytest.param(
            dict(fmt="gptq", group_size=32, sym=False, checkpoint_format="gptq_v2"), "bits", "bits", id="gptq-asym"
        ),  # fmt: skip
        pytest.param(
            dict(fmt="compressed-tensors", group_size=32), "config_groups weights' num_bits", "num_bits", id="ct"
        ),  # fmt: skip
    ],
)
def test_int4_tensors_under_a_config_of_8_bits_are_named_as_the_config(vllm_cpu, tmp_path, kwargs, field, key):
    path = make_checkpoint(tmp_path / "ck", bits=4, hidden=H, intermediate=I, experts=E, top_k=TOP_K, layers=1,
                           seed=22, **kwargs)  # fmt: skip
    _with_quant(path, **{key: 8})
    msg = (rf"packs \d+ values into \d+ 32-bit words, which is int4 packing, but the checkpoint's {re.escape(field)} is 8: "
           rf'set "{key}": 4 in its config\.json')  # fmt: skip
    with pytest.raises(ValueError, match=msg):
        _load(vllm_cpu, path, _stored(path))
