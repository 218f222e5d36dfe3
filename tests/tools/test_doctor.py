"""vllm-wna16 doctor: the plan from config.json alone, and the same clear error loading would give."""

from __future__ import annotations

import json
import os
import re

import pytest

from vllm_wna16_plugin.tools.cli import main
from vllm_wna16_plugin.tools.doctor import plan
from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def gs32_k2048(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("doc") / "ck", fmt="gptq", bits=4, group_size=32, hidden=2048,
                           intermediate=256, experts=8, top_k=2, layers=1)  # fmt: skip


def test_doctor_shows_legal_configs_and_vllms_illegal_ones(gs32_k2048):
    text = plan(gs32_k2048, tp=1, device="sm90")
    assert "gptq int4 group 32 symmetric" in text
    assert "gate/up  K=  2048" in text
    # vLLM 0.26 picks BLOCK_SIZE_K=512 (ratio 16) for gs32, K=2048 at small batch; ours is legal.
    assert "ILLEGAL (ratio 16) -> crash" in text
    for line in text.splitlines():
        if " M=" in line and " ok" in line:
            bk = int(line.split(":")[1].split()[0].split("/")[2])
            assert bk % 32 == 0 and bk // 32 in (1, 2, 4, 8), line


@pytest.mark.parametrize(
    "device, chosen",
    [("sm90", "triton"), ("cpu", "reference"), ("sm70", "triton")],
)
def test_doctor_names_the_backend_and_every_rejection(gs32_k2048, device, chosen):
    text = plan(gs32_k2048, tp=2, device=device)
    assert f"backend on {device} (auto): {chosen}" in text
    if device == "cpu":
        assert "marlin: rejected: needs an NVIDIA GPU" in text


def test_doctor_tp_split_regroups_or_refuses(tmp_path):
    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=128, hidden=256, intermediate=768,
                           experts=4, top_k=2, layers=1)  # fmt: skip
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"num_attention_heads": 8}))  # vLLM needs TP | heads
    assert "K=    96" in plan(path, tp=8) and "re-grouped exactly" in plan(path, tp=8)
    with pytest.raises(ValueError, match="TP"):
        plan(path, tp=7)


def test_doctor_ep_plans_whole_experts_per_rank(tmp_path, capsys):
    """--ep (vLLM's --enable-expert-parallel over the --tp ranks): each rank holds whole experts, ceil(E/EP) on
    the largest rank, so TP sizes that cannot split the intermediate size (or regroup its groups) load."""
    from vllm_wna16_plugin.tools.doctor import layer_problem

    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=128, hidden=256, intermediate=128,
                           experts=20, top_k=2, layers=1)  # fmt: skip
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"num_attention_heads": 32}))
    with pytest.raises(ValueError, match=r"--tp=16 \(tensor-parallel size, TP\) cannot load"):
        plan(path, tp=16)  # 8 intermediate columns per rank: no exact re-grouping of group 128
    text = plan(path, tp=16, ep=True)
    assert "expert parallelism (EP=16): whole experts, 2 on the first 4 ranks, 1 on the others" in text
    assert "gate/up  K=   256 N=   256 group=128" in text and "down     K=   128" in text  # whole experts
    p = layer_problem(path, tp=16, ep=True)
    assert (p.num_experts, p.global_num_experts, p.intermediate, p.use_ep) == (2, 20, 128, True)
    assert not layer_problem(path, tp=2).use_ep
    with pytest.raises(ValueError, match=r"--tp=32 --ep .*20 experts cannot give each of 32 EP ranks one"):
        plan(path, tp=32, ep=True)
    assert main(["doctor", str(path), "--tp", "16", "--ep"]) == 0
    assert "EP=16" in capsys.readouterr().out


def test_doctor_ep_rank_is_the_layer_vllm_builds(vllm_cpu, monkeypatch, tmp_path):
    """The rank doctor --ep plans has the experts, sizes and expert map vLLM's own EP layer gives the plugin."""
    from tests.conftest import build_moe_layer, simulate_ep_rank
    from vllm_wna16_plugin.tools.doctor import layer_problem

    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=128, intermediate=128,
                           experts=5, top_k=2, layers=1)  # fmt: skip
    planned = layer_problem(path, tp=2, ep=True, device="cpu")
    simulate_ep_rank(monkeypatch, vllm_cpu, 0)  # the first rank: the largest
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    layer = build_moe_layer(vllm_cpu, raw, E=5, H=128, I=128, top_k=2, tp_size=2)
    built = layer.quant_method.problem
    fields = (
        "num_experts",
        "global_num_experts",
        "intermediate",
        "hidden",
        "group_size_w13",
        "group_size_w2",
        "use_ep",
    )
    assert {f: getattr(built, f) for f in fields} == {f: getattr(planned, f) for f in fields}


def test_doctor_prints_the_config_error_and_exits_2(gs32_k2048, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((gs32_k2048 / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["doctor", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-wna16 doctor: error: ") and "bits=3" in err and "Traceback" not in err


def test_layer_problem_is_the_planned_rank(gs32_k2048):
    from vllm_wna16_plugin.tools.doctor import layer_problem

    p = layer_problem(gs32_k2048, tp=2, device="sm90")
    assert (p.hidden, p.intermediate, p.num_experts, p.top_k) == (2048, 128, 8, 2)
    assert (p.group_size_w13, p.group_size_w2, p.platform, p.sm) == (32, 32, "cuda", 90)


# ---------------------------------------------------------------- per-module schemes: what loading resolves

_INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False}
_INT8_CH = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
_GPTQ = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 32,
    "sym": True,
    "desc_act": False,
    "checkpoint_format": "gptq",
}
G4, G8 = "gptq int4 group 32 symmetric", "gptq int8 group 64 symmetric"
CT4, CT8 = "compressed-tensors int4 group 32 symmetric", "compressed-tensors int8 channel-wise symmetric"
AWQ4 = "awq int4 group 32 asymmetric"

# (quantization_config, expected description per MoE layer 0..3 written out by hand; None = unquantized)
PER_MODULE_CONFIGS = [
    pytest.param(
        _GPTQ | {"dynamic": {r"-:.*layers\.1\..*": {}, r"+:.*layers\.2\..*experts": {"bits": 8, "group_size": 64}}},
        [G4, None, G8, G4],
        id="gptq-dynamic",
    ),
    pytest.param(
        _GPTQ | {"modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]]},
        [None, None, None, None],
        id="gptq-modules_in_block_to_quantize",
    ),
    pytest.param(
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": ["layers.3.mlp.experts", "mlp.gate"]},
        [AWQ4, AWQ4, AWQ4, None],
        id="awq-modules_to_not_convert",
    ),
    pytest.param(
        {"quant_method": "compressed-tensors", "format": "pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": _INT4, "input_activations": None},
                           "group_1": {"targets": [r"re:.*layers\.[23]\.mlp\.experts\..*"], "weights": _INT8_CH,
                                       "input_activations": None}},
         "ignore": ["lm_head", r"re:.*layers\.0\.mlp\.experts\..*"]},
        [None, CT4, CT8, CT8],
        id="ct-ignore-and-two-groups",
    ),
]  # fmt: skip


def _with_config(base, tmp_path, **changes):
    """A copy of base's config.json with top-level keys replaced (doctor reads config.json alone)."""
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(changes)
    out = tmp_path / "ck"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("doc4") / "ck", fmt="gptq", bits=4, group_size=32, hidden=256,
                           intermediate=128, experts=4, top_k=2, layers=4)  # fmt: skip


@pytest.mark.parametrize("quant, expected", PER_MODULE_CONFIGS)
def test_doctor_reports_each_moe_scheme_loading_resolves(four_layers, tmp_path, quant, expected):
    from vllm_wna16_plugin.tools.doctor import resolve_checkpoint

    path = _with_config(four_layers, tmp_path, quantization_config=quant)
    plan_ = resolve_checkpoint(path)
    per_layer = {i: g.scheme.describe() if g.scheme else None for g in plan_.groups for i in g.layers}
    assert per_layer == dict(enumerate(expected))
    text = plan(path)
    for g in plan_.groups:
        layers = ", ".join(str(i) for i in g.layers) if len(g.layers) == 1 or g.layers[-1] - g.layers[0] != len(
            g.layers) - 1 else f"{g.layers[0]}-{g.layers[-1]}"  # fmt: skip
        assert f"  layers {layers}: {g.describe()}" in text
        if g.scheme is not None:
            assert f"scheme: {g.scheme.describe()} (MoE layers {layers};" in text
    if None in expected:
        assert "unquantized (vLLM's unquantized MoE method)" in text


@pytest.mark.parametrize("quant, expected", PER_MODULE_CONFIGS)
def test_doctor_schemes_equal_what_get_quant_method_loads(four_layers, tmp_path, monkeypatch, quant, expected):
    """The loading entry point (MoeWNA16PlusConfig.get_quant_method on a routed-experts layer) gives,
    layer by layer, the scheme doctor reports."""
    pytest.importorskip("vllm")
    import torch

    import vllm_wna16_plugin
    from vllm_wna16_plugin import _vllm, moe_method
    from vllm_wna16_plugin.quant_config import make_config_class
    from vllm_wna16_plugin.tools.doctor import resolve_checkpoint

    vllm_wna16_plugin.register()
    monkeypatch.setattr(_vllm, "unquantized_moe_method", lambda moe_config: "unquantized")
    monkeypatch.setattr(moe_method, "make_moe_method", lambda scheme, moe_config, prefix: scheme)

    class Experts(_vllm.routed_experts_cls()):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.moe_config = None

    loading = make_config_class().from_config(quant)
    path = _with_config(four_layers, tmp_path, quantization_config=quant)
    plan_ = resolve_checkpoint(path)
    for g in plan_.groups:
        for i in g.layers:
            loaded = loading.get_quant_method(Experts(), plan_.prefixes[i])
            assert loaded == ("unquantized" if g.scheme is None else g.scheme), (i, loaded)
    assert sorted(i for g in plan_.groups for i in g.layers) == list(range(len(expected)))


def test_doctor_skips_dense_layers_as_vllm_does(four_layers, tmp_path):
    from vllm_wna16_plugin.tools.doctor import resolve_checkpoint

    path = _with_config(four_layers, tmp_path, mlp_only_layers=[0], decoder_sparse_step=1)
    assert sorted(resolve_checkpoint(path).prefixes) == [1, 2, 3]
    path = _with_config(four_layers, tmp_path, mlp_only_layers=[], decoder_sparse_step=2)
    assert resolve_checkpoint(path).prefixes == {1: "model.layers.1.mlp.experts", 3: "model.layers.3.mlp.experts"}


def test_doctor_deepseek_layout_skips_the_first_dense_layers(four_layers, tmp_path):
    from vllm_wna16_plugin.tools.doctor import resolve_checkpoint

    path = _with_config(four_layers, tmp_path, architectures=["DeepseekV3ForCausalLM"], first_k_dense_replace=1,
                        moe_layer_freq=2)  # fmt: skip
    assert resolve_checkpoint(path).prefixes == {2: "model.layers.2.mlp.experts"}
    with pytest.raises(ValueError, match=r"config\.json first_k_dense_replace='1' is a string, not an int"):
        plan(_with_config(four_layers, tmp_path, architectures=["DeepseekV3ForCausalLM"], first_k_dense_replace="1"))
    mixtral = _with_config(four_layers, tmp_path, architectures=["MixtralForCausalLM"], first_k_dense_replace=0)
    assert resolve_checkpoint(mixtral).prefixes[3] == "model.layers.3.block_sparse_moe.experts"
    unknown = _with_config(four_layers, tmp_path, architectures=["SomeNewMoeForCausalLM"])
    assert "assumed: ['SomeNewMoeForCausalLM'] is not in doctor's table" in plan(unknown, launch_configs=False)


def test_doctor_probes_mixtral_experts_by_their_own_names(four_layers, tmp_path):
    """A Mixtral compressed-tensors config whose group targets the experts by a regex of w1/w2/w3: loading (as
    vLLM) probes expert 0's w1/w3/w2, so doctor does too, and plans the layers quantized."""
    from vllm_wna16_plugin.tools.doctor import resolve_checkpoint

    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": [r"re:.*experts\.\d+\.w[123]$"], "weights": _INT4,
                                        "input_activations": None}},
          "ignore": ["lm_head"]}  # fmt: skip
    path = _with_config(four_layers, tmp_path, architectures=["MixtralForCausalLM"], quantization_config=ct)
    assert [(g.describe(), g.layers) for g in resolve_checkpoint(path).groups] == [(CT4, (0, 1, 2, 3))]


def test_doctor_refuses_experts_whose_shards_disagree_as_loading_does(four_layers, tmp_path):
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": _INT4},
                            "group_1": {"targets": [r"re:.*down_proj$"], "weights": _INT8_CH}}}  # fmt: skip
    path = _with_config(four_layers, tmp_path, quantization_config=ct)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: its shards have different schemes"):
        plan(path)


def test_doctor_refuses_two_groups_giving_experts_different_schemes(four_layers, tmp_path):
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": [r"re:.*experts.*"], "weights": _INT4},
                            "group_1": {"targets": [r"re:.*layers\.1\..*"], "weights": _INT8_CH}}}  # fmt: skip
    path = _with_config(four_layers, tmp_path, quantization_config=ct)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.0\.gate_proj: .*config_groups\.group_0.*group_1"):
        plan(path)


def test_doctor_refuses_sizes_no_format_can_pack(four_layers, tmp_path):
    path = _with_config(four_layers, tmp_path, hidden_size=100)
    with pytest.raises(ValueError, match=r"the hidden size H is 100, not a positive multiple of 8: GPTQ, AWQ and "
                                         r"compressed-tensors checkpoints pack 8 int4 values per int32 word"):  # fmt: skip
        plan(path)


# ---------------------------------------------------------------- doctor fails where loading would


def test_doctor_plans_act_order_at_tp_padded_and_refuses_where_no_group_fits(four_layers, tmp_path):
    quant = _GPTQ | {"group_size": 128, "desc_act": True}
    path = _with_config(four_layers, tmp_path, quantization_config=quant, moe_intermediate_size=768,
                        num_attention_heads=48)  # fmt: skip
    assert "act-order" in plan(path, tp=2)  # K=384 per rank: three whole groups' worth
    # K=192 per rank: formerly refused ("cannot use act order"); the rank's groups are padded on triton
    at_tp4 = plan(path, tp=4, launch_configs=False)
    assert "down     K=   192 N=   256 group=64 (re-grouped exactly)" in at_tp4
    assert re.search(r"act order: triton pads each group's rows on a rank to runs of 16: K=\d+ \(1\.\d\dx\)", at_tp4)
    assert "backend on sm90 (auto): triton" in at_tp4
    # K=24 per rank (I=384 at TP16): no exact group size, as without act order
    small = _with_config(four_layers, tmp_path, quantization_config=quant, moe_intermediate_size=384,
                         num_attention_heads=48)  # fmt: skip
    with pytest.raises(ValueError, match=r"--tp=16 .*K=24 per rank.*cannot use quantization_config\.group_size=128"):
        plan(small, tp=16)


def test_doctor_tp_that_does_not_divide_lists_the_tp_sizes_that_do(four_layers, tmp_path):
    # I=96 = 3 * 32 with group 32: K per rank 96, 48, 32, 16 at TP 1, 2, 3, 6 (gcd with 32 >= 16);
    # TP 4, 8, 12, 16 give K=24, 12, 8, 6 (gcd < 16); 48 heads divide by 1, 2, 3, 4, 6, 8, 12, 16.
    path = _with_config(four_layers, tmp_path, moe_intermediate_size=96, num_attention_heads=48)
    with pytest.raises(ValueError, match=r"--tp=5 .*intermediate size 96 is not divisible by it.*: 1, 2, 3, 6$"):
        plan(path, tp=5)
    with pytest.raises(ValueError, match=r"--tp=4 .*K=24 per rank.*group_size=32.*: 1, 2, 3, 6$"):
        plan(path, tp=4)
    with pytest.raises(ValueError, match=r"--tp=4 .*num_attention_heads=6 is not divisible.*: 1, 2, 3, 6$"):
        plan(_with_config(four_layers, tmp_path, moe_intermediate_size=96, num_attention_heads=6), tp=4)


def test_doctor_a_group_size_no_tp_size_can_load_is_not_blamed_on_the_flag(four_layers, tmp_path):
    # I=320 with group 128: the full K of the down projection is not a whole number of groups, at any TP size
    # and under --ep too (whole experts): one message that names the group size and the full K, not "--tp=N"
    quant = _GPTQ | {"group_size": 128}
    path = _with_config(four_layers, tmp_path, quantization_config=quant, moe_intermediate_size=320,
                        num_attention_heads=16)  # fmt: skip
    messages = set()
    for tp, ep in ((1, False), (2, False), (2, True)):
        with pytest.raises(ValueError, match=r"^no tensor-parallel size \(1-16(, with --ep)?\) can load this checkpoint: "
                                             r".*\(down, K=intermediate\): quantization_config.group_size=128 does not "
                                             r"divide the full K=320") as exc:  # fmt: skip
            plan(path, tp=tp, ep=ep)
        messages.add(str(exc.value).replace(", with --ep", ""))
        assert "--tp=" not in str(exc.value) and "sizes that work" not in str(exc.value)
    assert len(messages) == 1
    # the hidden size is never split: group 48 on H=256 names the gate/up K, whatever --tp says
    quant48 = _with_config(four_layers, tmp_path, quantization_config=_GPTQ | {"group_size": 48})
    for tp in (1, 2):
        with pytest.raises(ValueError, match=r"\(gate/up, K=hidden\): quantization_config.group_size=48 does not divide "
                                             r"the full K=256"):  # fmt: skip
            plan(quant48, tp=tp)


@pytest.mark.parametrize(
    "changes, named",
    [
        pytest.param({"model_type": "gpt_oss"}, r"a bias on each expert's GEMMs \(has_bias=True\)", id="gpt-oss"),
        pytest.param({"swiglu_limit": 7.0}, r"a clamp on the gated activation \(swiglu_limit=7\.0\)", id="clamp"),
        pytest.param({"swiglu_alpha": 1.702}, r"a scaled SwiGLU \(swiglu_alpha=1\.702\)", id="alpha"),
    ],
)
def test_doctor_refuses_experts_whose_math_loading_refuses(four_layers, tmp_path, changes, named):
    # loading refuses these layers (activation.check_expert_math on vLLM's FusedMoEConfig); doctor, reading
    # config.json alone, must not plan them as if they ran
    path = _with_config(four_layers, tmp_path, **changes)
    with pytest.raises(ValueError, match=rf"^config\.json, model_type .*: this model's experts compute .*{named}"):
        plan(path)
    assert "backend on sm90" in plan(_with_config(four_layers, tmp_path, swiglu_limit=None))  # null: plain SwiGLU


@pytest.mark.parametrize(
    "fields, moe_layers",
    [
        pytest.param({"interleave_moe_layer_step": 2}, "1, 3", id="llama4-interleaved"),
        pytest.param({"interleave_moe_layer_step": 1}, "0-3", id="llama4-every-layer"),
        pytest.param({"expert_layer_period": 2, "expert_layer_offset": 1}, "1, 3", id="jamba"),
        pytest.param({"first_k_dense_replace": 1}, "1-3", id="deepseek-fields"),
        pytest.param({}, "0-3", id="none"),
    ],
)
def test_doctor_reads_the_interleaving_fields_of_an_architecture_it_does_not_know(four_layers, tmp_path, fields,
                                                                                   moe_layers):  # fmt: skip
    # the layer list of an unknown architecture follows the MoE-interleaving fields its config.json has (names
    # stay "assumed"); formerly every layer was listed as MoE whatever they said
    path = _with_config(four_layers, tmp_path, architectures=["SomeNewMoeForCausalLM"], **fields)
    text = plan(path, launch_configs=False)
    assert re.search(rf"layers {moe_layers}: gptq int4 group 32", text), text[:600]
    assert "assumed" in text


@pytest.mark.parametrize("tp", [0, -2, True, "2", 2.0])
def test_doctor_refuses_a_tp_that_is_not_a_positive_int(gs32_k2048, tp):
    with pytest.raises(ValueError, match=rf"--tp={re.escape(repr(tp))} is not a positive int"):
        plan(gs32_k2048, tp=tp)


def test_cli_doctor_tp_zero_names_the_flag(gs32_k2048, capsys):
    assert main(["doctor", str(gs32_k2048), "--tp", "0"]) == 2
    assert "--tp=0 is not a positive int" in capsys.readouterr().err


def test_doctor_refuses_an_unknown_device(gs32_k2048):
    with pytest.raises(ValueError, match=r"--device='sm75' is not supported; supported: cpu, sm100"):
        plan(gs32_k2048, device="sm75")


@pytest.mark.parametrize(
    "changes, message",
    [
        pytest.param({"num_experts_per_tok": 9}, r"config\.json num_experts_per_tok=9 is larger than config\.json "
                     r"num_experts=4.*supported: 1\.\.4", id="top_k-above-experts"),
        pytest.param({"hidden_size": "256"}, r"config\.json hidden_size='256' is a string, not an int; supported: a "
                     r"positive int", id="hidden-str"),
        pytest.param({"num_experts": True}, r"num_experts=True is a bool, not an int", id="experts-bool"),
        pytest.param({"moe_intermediate_size": [128]}, r"moe_intermediate_size=\[128\] is a list", id="inter-list"),
        pytest.param({"num_experts_per_tok": 0}, r"num_experts_per_tok=0 is not positive", id="top_k-0"),
        pytest.param({"num_hidden_layers": 10**12}, r"num_hidden_layers=1000000000000 is larger than 4096",
                     id="layers-huge"),
        pytest.param({"num_hidden_layers": None}, r"has num_experts=4 but no num_hidden_layers", id="no-layers"),
        pytest.param({"decoder_sparse_step": "1"}, r"decoder_sparse_step='1' is a string", id="sparse-step-str"),
        pytest.param({"mlp_only_layers": "0"}, r"mlp_only_layers='0' is not a list of ints", id="mlp-only-str"),
        pytest.param({"mlp_only_layers": [0, 1, 2, 3]}, r"none of the 4 layers is an MoE layer", id="no-moe"),
        pytest.param({"num_experts": None}, r"config\.json has no MoE dimensions", id="not-moe"),
        pytest.param({"quantization_config": None}, r"has no quantization_config", id="not-quantized"),
        pytest.param({"quantization_config": _GPTQ | {"bits": "4"}},
                     r"quantization_config\.bits='4' is a string, not an int; supported: 4, 8", id="bits-str"),
    ],
)  # fmt: skip
def test_doctor_bad_config_json_names_the_field(four_layers, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        plan(_with_config(four_layers, tmp_path, **changes))


@pytest.mark.parametrize(
    "content, message",
    [("{not json", r"config\.json is not valid JSON"), ("[1, 2]", r"config\.json holds a list, not a JSON object"),
     (None, r"config\.json: cannot read it")],
)  # fmt: skip
def test_doctor_unreadable_config_json_is_one_value_error(tmp_path, content, message):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        plan(tmp_path)


@pytest.mark.parametrize(
    ("device", "archs", "error", "want"),
    [
        ("sm90", ["sm_90"], None, "built for sm_90; covers sm90"),
        ("sm90", ["sm_80"], None, "built for sm_80; has no code for sm90"),  # SASS runs on its major only
        ("sm90", ["compute_80", "sm_80"], None, "covers sm90"),  # PTX is compiled for newer GPUs
        ("sm80", ["sm_90"], None, "has no code for sm80"),
        ("sm100", ["sm_80", "sm_90", "sm_100"], None, "covers sm100"),
        ("cpu", ["sm_90"], None, "the cuda backend does not run on cpu"),
        ("sm90", None, None, "not usable: not built"),
        ("sm90", ["sm_90"], "linked with a static libstdc++", "not usable: linked with a static libstdc++"),
    ],
)
def test_doctor_says_whether_the_cuda_ops_serve_the_device(device, archs, error, want):
    from vllm_wna16_plugin.tools.doctor import cuda_ops_line

    assert want in cuda_ops_line(device, archs, error)


def test_doctor_report_has_the_cuda_ops_line(gs32_k2048):
    assert "CUDA ops (this install): " in plan(gs32_k2048)


def test_doctor_keeps_import_noise_off_stderr_on_a_machine_without_a_gpu(gs32_k2048):
    """vLLM's and torch's no-GPU notes at import are not the user's concern: stderr stays empty."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("the notes appear only without a GPU")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-m", "vllm_wna16_plugin.tools.cli", "doctor", str(gs32_k2048)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "scheme: gptq int4 group 32" in done.stdout
    assert done.stderr.strip() == "", done.stderr


def test_doctor_plans_act_order_on_triton_at_any_tp_with_the_padded_down_projection(tmp_path):
    """A rank's slice of an act-order down projection holds partial groups: triton pads them (formerly
    auto planned reference at TP>1). The plan is made for the padded K of a random act order."""
    from vllm_wna16_plugin.tools.doctor import layer_problem

    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, desc_act=True, hidden=256,
                           intermediate=128, experts=4, top_k=2, layers=1)  # fmt: skip
    assert "backend on sm90 (auto): triton" in plan(path, tp=1, device="sm90")
    at_tp2 = plan(path, tp=2, device="sm90")
    assert "backend on sm90 (auto): triton" in at_tp2 and "  - triton: ok" in at_tp2
    assert "cuda: rejected: act order" in at_tp2
    k_pad = int(re.search(r"runs of 16: K=(\d+)", at_tp2).group(1))
    assert k_pad > 64 and k_pad % 16 == 0
    p = layer_problem(path, tp=2, device="sm90")
    assert (p.intermediate, p.group_size_w2, p.act_order_issue) == (k_pad, 16, None)


def test_doctor_prints_the_launch_plan_of_every_batch_size(gs32_k2048, tmp_path):
    # doctor reads config.json alone: the small checkpoint's config with Qwen3-30B-A3B's MoE dimensions, a
    # shape whose crossover ships for the H200 (crossover/NVIDIA_H200.json: cuda at M 8-64)
    cfg = json.loads((gs32_k2048 / "config.json").read_text())
    cfg.update(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    cfg["quantization_config"]["group_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    text = plan(tmp_path, tp=1, device="sm90")
    assert "launch plan on NVIDIA H200 (sm90, 132 SMs) (auto), per batch size M (tokens):" in text
    runs = dict(re.findall(r"^  M=(\d+): (\w+)", text, re.M))
    assert set(map(int, runs)) == {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}
    assert {m for m, b in runs.items() if b == "cuda"} == {"8", "16", "32", "64"}
    assert "why: M=128 outside cuda's ranges [8, 64] on NVIDIA H200 (crossover/NVIDIA_H200.json)" in text
    assert "gate/up cuda stream" in text and "tuned E=128,N=1536,K=2048,group_size=128" in text
    # the demo's short plan leaves it out
    assert "launch plan on" not in plan(tmp_path, tp=1, device="sm90", launch_configs=False)


def test_doctor_names_the_linear_method_of_each_format(gs32_k2048, tmp_path):
    # asymmetric GPTQ linear layers run on the plugin's method (vLLM's GPTQ refuses them); symmetric on vLLM's
    assert "linear layers: vLLM's in-tree gptq)" in plan(gs32_k2048, tp=1, device="sm90")
    cfg = json.loads((gs32_k2048 / "config.json").read_text())
    cfg["quantization_config"]["sym"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert "linear layers: the plugin's asymmetric GPTQ linear method" in plan(tmp_path, tp=1, device="sm90")


def test_doctor_says_which_batch_sizes_humming_takes_where_installed(gs32_k2048, tmp_path):
    """Qwen3-30B-A3B's config.json (doctor reads nothing else): from M=4 a call reads > 35 MB of experts."""
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
              "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "num_attention_heads": 32,
              "num_hidden_layers": 1, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                              "sym": True, "desc_act": False}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = next(x for x in plan(tmp_path, tp=1, device="sm90").splitlines() if x.startswith("composed with Humming"))
    assert "VLLM_WNA16_PLUS_HUMMING" in line and "M=4, 8, 16" in line and "M=2," not in line
    assert "no (the Humming rule does not speak for it: measured on sm90 only" in plan(tmp_path, tp=1, device="sm80")
    # E=8 experts of about 0.9 MB: no batch reads 35 MB; from M=256 each hit expert takes 64 rows (prefill)
    line = next(x for x in plan(gs32_k2048, device="sm90").splitlines() if x.startswith("composed with Humming"))
    assert ": M=256, 512, 1024, 2048, 4096 run on Humming" in line, line
    # where Humming is not installed: Marlin, from 8 rows per expert hit with 300 MB read (M=128: 1024 pairs over
    # 128 experts) up to its 256-token cap
    line = next(x for x in plan(tmp_path, tp=1, device="sm90").splitlines() if x.startswith("composed with Marlin"))
    assert "VLLM_WNA16_PLUS_MARLIN" in line and ": M=128, 256 run on Marlin" in line, line


def test_doctor_says_which_batch_sizes_the_hopper_kernel_takes(tmp_path, monkeypatch):
    """Mixtral-8x7B's config.json at TP 4: from M=256 (64 rows per hit expert) the hopper rule's; and why not on
    an sm80 plan, or with VLLM_WNA16_PLUS_HOPPER=0."""
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
              "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_hidden_layers": 1,
              "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                      "desc_act": False}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = next(x for x in plan(tmp_path, tp=4, device="sm90").splitlines() if x.startswith("with the hopper kernel"))
    assert "VLLM_WNA16_PLUS_HOPPER" in line and "M=256, 512, 1024, 2048, 4096 run on hopper" in line, line
    assert "built in this install" in line or "this install: the plugin's hopper extension" in line, line
    assert "with the hopper kernel: no (built for sm90 only" in plan(tmp_path, tp=4, device="sm80")
    monkeypatch.setenv("VLLM_WNA16_PLUS_HOPPER", "0")
    assert "with the hopper kernel: no (VLLM_WNA16_PLUS_HOPPER=0)" in plan(tmp_path, tp=4, device="sm90")
    monkeypatch.setenv("VLLM_WNA16_PLUS_HOPPER", "sometimes")
    with pytest.raises(ValueError, match=re.escape("VLLM_WNA16_PLUS_HOPPER='sometimes'")):
        plan(tmp_path, tp=4, device="sm90")


def test_doctor_reads_the_plugins_variables_as_loading_does(gs32_k2048, monkeypatch):
    """Found by a bad-input sweep: doctor printed auto's choice and exit 0 under a backend or setting that
    loading refuses. It now checks each variable and plans the backend asked for."""
    monkeypatch.setenv("VLLM_WNA16_PLUS_BACKEND", "garbage")
    with pytest.raises(ValueError, match=r"VLLM_WNA16_PLUS_BACKEND='garbage' is not a backend"):
        plan(gs32_k2048)
    monkeypatch.setenv("VLLM_WNA16_PLUS_BACKEND", "reference")
    text = plan(gs32_k2048)
    assert "backend on sm90 (VLLM_WNA16_PLUS_BACKEND=reference): reference" in text, text
    monkeypatch.delenv("VLLM_WNA16_PLUS_BACKEND")
    for name, value, message in (("VLLM_WNA16_PLUS_HUMMING", "maybe", "VLLM_WNA16_PLUS_HUMMING='maybe'"),
                                 ("VLLM_WNA16_PLUS_MARLIN", "sometimes", "VLLM_WNA16_PLUS_MARLIN='sometimes'"),
                                 ("VLLM_TRITON_USE_TD", "perhaps", "VLLM_TRITON_USE_TD='perhaps' is not understood"),
                                 ("VLLM_WNA16_PLUS_TUNED", "banana", "VLLM_WNA16_PLUS_TUNED='banana'")):  # fmt: skip
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=re.escape(message)):
            plan(gs32_k2048)
        monkeypatch.delenv(name)
    assert "backend on sm90 (auto): " in plan(gs32_k2048)


def test_doctor_plans_gptq_experts_the_file_stores_quantized_whatever_the_listing(four_layers, tmp_path):
    """As loading does (MoeWNA16PlusConfig.get_quant_method): vLLM reads no modules_in_block_to_quantize for GPTQ
    MoE layers, and the safetensors hold the experts' qweight."""
    import shutil

    quant = {**json.loads((four_layers / "config.json").read_text())["quantization_config"],
             "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]]}  # fmt: skip
    path = _with_config(four_layers, tmp_path, quantization_config=quant)
    if not (path / "model.safetensors").exists():
        shutil.copy(four_layers / "model.safetensors", path / "model.safetensors")
    text = plan(path, launch_configs=False)
    assert "layers 0-3: gptq int4 group 32 symmetric" in text, text


@pytest.mark.parametrize(
    "fmt, side_name, side",
    [
        ("awq", "quant_config.json", {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}),
        ("gptq", "quantize_config.json", {"bits": 4, "group_size": 32, "desc_act": False, "sym": True}),
    ],
)
def test_doctor_reads_the_side_file_loading_reads(tmp_path, fmt, side_name, side):
    # loading takes a checkpoint whose config lives beside config.json (quant_config.get_config_filenames);
    # doctor (and demo --checkpoint, tune) said "not a quantized checkpoint"
    from vllm_wna16_plugin.tools.doctor import resolve_checkpoint

    path = make_checkpoint(tmp_path / "ck", fmt=fmt, bits=4, group_size=32, sym=fmt == "gptq", hidden=128,
                           intermediate=64, experts=4, top_k=2, layers=1)  # fmt: skip
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"has no quantization_config and no quantize_config.json or quant_config"):
        resolve_checkpoint(path)
    (path / side_name).write_text(json.dumps(side))
    resolved = resolve_checkpoint(path)
    assert resolved.parsed.quant_method == fmt and resolved.groups[0].scheme.group_size == 32
    assert main(["doctor", str(path)]) == 0


def test_doctor_knows_the_layouts_of_newer_moe_models(four_layers, tmp_path):
    """Qwen3-Next (Qwen's sparse step), ERNIE-4.5-MoE (its start / end index and interval, with transformers'
    defaults), MiniMax-M2 (Mixtral's names; vLLM 0.34 builds its experts under the prefix mlp while the tensors
    stay under block_sparse_moe) and LFM2-MoE (feed_forward, dense first layers), as vLLM 0.34's model files
    build them."""
    from vllm_wna16_plugin.tools.doctor import moe_layout, resolve_checkpoint

    def prefixes(arch, **fields):
        return resolve_checkpoint(_with_config(four_layers, tmp_path, architectures=[arch], **fields)).prefixes

    assert sorted(prefixes("Qwen3NextForCausalLM", mlp_only_layers=[0], decoder_sparse_step=1)) == [1, 2, 3]
    assert prefixes("Ernie4_5_MoeForCausalLM", moe_layer_start_index=1, moe_layer_end_index=2) == {
        1: "model.layers.1.mlp.experts", 2: "model.layers.2.mlp.experts"}  # fmt: skip
    assert sorted(prefixes("Ernie4_5_MoeForCausalLM", moe_layer_start_index=0, moe_layer_interval=2)) == [1, 3]
    assert sorted(prefixes("Ernie4_5_MoeForCausalLM")) == [1, 2, 3]  # transformers: start 1, end -1 (the last)
    assert sorted(prefixes("Ernie4_5_MoeForCausalLM", moe_layer_end_index=-1, moe_layer_start_index=2)) == [2, 3]
    assert prefixes("MiniMaxM2ForCausalLM")[0] == "model.layers.0.mlp.experts"
    minimax = moe_layout({"architectures": ["MiniMaxM2ForCausalLM"]})[1]
    assert minimax.as_vllm_names({"model.layers.3.block_sparse_moe.experts.0.w1.qweight", "lm_head.weight"}) == {
        "model.layers.3.mlp.experts.0.w1.qweight", "lm_head.weight"}  # fmt: skip
    assert prefixes("Lfm2MoeForCausalLM", num_dense_layers=1) == {i: f"model.layers.{i}.feed_forward.experts"
                                                                  for i in (1, 2, 3)}  # fmt: skip
    assert sorted(prefixes("Lfm2MoeForCausalLM")) == [2, 3]  # transformers' default: two dense layers
    for arch in ("MiniMaxM2ForCausalLM", "Lfm2MoeForCausalLM"):
        assert moe_layout({"architectures": [arch]})[1].experts == ("w1", "w3", "w2")  # gate, up, down
    with pytest.raises(ValueError, match=r"config\.json moe_layer_end_index=-2 is negative"):
        plan(_with_config(four_layers, tmp_path, architectures=["Ernie4_5_MoeForCausalLM"], moe_layer_end_index=-2))
    with pytest.raises(ValueError, match=r"none of the 4 layers is an MoE layer"):
        plan(_with_config(four_layers, tmp_path, architectures=["Ernie4_5_MoeForCausalLM"], use_moe=False))
    with pytest.raises(ValueError, match=r"config\.json moe_layer_start_index=-1 is negative"):
        plan(_with_config(four_layers, tmp_path, architectures=["Ernie4_5_MoeForCausalLM"], moe_layer_start_index=-1))
    with pytest.raises(ValueError, match=r"config\.json num_dense_layers='2' is a string, not an int"):
        plan(_with_config(four_layers, tmp_path, architectures=["Lfm2MoeForCausalLM"], num_dense_layers="2"))
