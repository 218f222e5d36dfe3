"""moe_wna16_plus claims a checkpoint only when asked, and errors clearly when asked for a bad one."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}


@pytest.fixture(scope="module")
def config_cls():
    from vllm.model_executor.layers.quantization import get_quantization_config

    import vllm_wna16_plugin

    vllm_wna16_plugin.register()
    return get_quantization_config("moe_wna16_plus")


@pytest.mark.parametrize("user_quant", [None, "gptq", "gptq_marlin", "moe_wna16", "awq"])
def test_never_claims_a_checkpoint_the_user_did_not_ask_for(config_cls, user_quant):
    assert config_cls.override_quantization_method(GPTQ, user_quant) is None


def test_claims_when_asked(config_cls):
    assert config_cls.override_quantization_method(GPTQ, "moe_wna16_plus") == "moe_wna16_plus"


def test_asked_for_a_malformed_config_raises_at_config_time(config_cls):
    with pytest.raises(ValueError, match=r"bits=3"):
        config_cls.override_quantization_method(GPTQ | {"bits": 3}, "moe_wna16_plus")


def test_from_config_keeps_channelwise_none(config_cls):
    ct = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None},
            }
        },
        "ignore": ["lm_head"],
    }
    cfg = config_cls.from_config(ct)
    assert cfg.parsed.scheme.group_size == -1
    assert cfg.get_name() == "moe_wna16_plus"


def test_vllm_model_config_picks_moe_wna16_plus_only_when_asked(tmp_path):
    """vLLM's own ModelConfig: asked -> moe_wna16_plus; not asked -> the checkpoint's in-tree method."""
    import vllm_wna16_plugin
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    vllm_wna16_plugin.register()
    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=128, intermediate=64,
                           experts=4, top_k=2, layers=1)  # fmt: skip
    from vllm.config import ModelConfig

    asked = ModelConfig(model=str(path), quantization="moe_wna16_plus", tokenizer=str(path))
    assert asked.quantization == "moe_wna16_plus"
    plain = ModelConfig(model=str(path), tokenizer=str(path))
    assert plain.quantization != "moe_wna16_plus"


def test_bf16_router_gate_of_a_gptq_checkpoint_stays_unquantized(vllm_cpu, tmp_path):
    """GPTQ configs do not list the router gate; the safetensors dtypes show it is bf16."""
    import json

    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization import get_quantization_config

    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, sym=False, quantize_attention=False,
                           hidden=128, intermediate=64, experts=4, top_k=2, layers=1)  # fmt: skip
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    cfg = get_quantization_config("moe_wna16_plus").from_config(raw)
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    cfg.maybe_update_config(str(path))
    assert not cfg._stored_quantized("model.layers.0.mlp.gate")
    assert cfg._stored_quantized("model.layers.0.mlp.experts.0.gate_proj")
    gate = ReplicatedLinear(128, 4, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.gate")
    # Asymmetric GPTQ: vLLM's in-tree GPTQ linear method would refuse it; the gate never asks.
    assert isinstance(gate.quant_method, UnquantizedLinearMethod)


def _config_of(path, **changes):
    import json

    from vllm.model_executor.layers.quantization import get_quantization_config

    raw = {**json.loads((path / "config.json").read_text())["quantization_config"], **changes}
    cfg = get_quantization_config("moe_wna16_plus").from_config(raw)
    cfg.maybe_update_config(str(path))
    return cfg


def test_experts_the_config_leaves_unquantized_but_the_file_stores_quantized_are_refused(vllm_cpu, tmp_path):
    """AWQ modules_to_not_convert naming the experts while the file stores them quantized: vLLM would build an
    unquantized MoE layer and fail on the first qweight ("has no parameter"); the safetensors dtypes show it."""
    from vllm_wna16_plugin import _vllm
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "ck", fmt="awq", bits=4, group_size=32, sym=False, hidden=128,
                           intermediate=64, experts=4, top_k=2, layers=1)  # fmt: skip
    cfg = _config_of(path, modules_to_not_convert=["mlp.experts"])
    prefix = "model.layers.0.mlp.experts"
    assert cfg._stored_experts(prefix, cfg._quantized_modules)[0] == f"{prefix}.0.down_proj"
    with pytest.raises(ValueError, match=rf"{prefix}: quantization_config leaves its routed experts unquantized .* "
                                         rf"but the checkpoint stores them quantized \({prefix}\.0\.down_proj\)"):  # fmt: skip
        _vllm.build_routed_experts(vllm_cpu, cfg, num_experts=4, top_k=2, hidden=128, intermediate=64, prefix=prefix,
                                   ckpt_names=("gate_proj", "down_proj", "up_proj"))  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_gptq_experts_stored_quantized_load_whatever_modules_in_block_to_quantize_lists(vllm_cpu, tmp_path, arch):
    """vLLM 0.34 reads no modules_in_block_to_quantize for GPTQ MoE layers; writers list the experts by their own
    names (Mixtral's w1/w3/w2), which the gate_proj probe misses, or not at all. The stored tensors decide."""
    from vllm_wna16_plugin import _vllm
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=128, intermediate=64,
                           experts=4, top_k=2, layers=1, arch=arch)  # fmt: skip
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    names = ("w1", "w2", "w3") if arch == "mixtral" else ("gate_proj", "down_proj", "up_proj")
    listing = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]]
    if arch == "mixtral":  # the experts by their own names; on qwen3_moe by the names vLLM probes, but not all
        listing.append([f"{moe}.experts.0.{n}" for n in names])
    else:  # gate and up listed, down not: formerly refused as shards of "a fused module" that disagree
        listing.append([f"{moe}.experts.{e}.{n}" for e in range(4) for n in ("gate_proj", "up_proj")])
    cfg = _config_of(path, modules_in_block_to_quantize=listing)
    prefix = f"model.layers.0.{moe}.experts"
    assert cfg.parsed.scheme_for(prefix, moe=True) is None  # the probe (gate_proj) misses on both
    layer = _vllm.build_routed_experts(vllm_cpu, cfg, num_experts=4, top_k=2, hidden=128, intermediate=64,
                                       prefix=prefix, ckpt_names=names)  # fmt: skip
    assert layer.quant_method.scheme == cfg.parsed.scheme  # the plugin's method, the base scheme


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_a_layer_whose_file_holds_some_experts_unquantized_is_refused(vllm_cpu, tmp_path, fmt):
    """One expert stored as bf16 weights beside quantized ones (an `ignore` / `modules_to_not_convert` entry naming
    it, or a writer that skipped it): vLLM would fail on its first tensor with "has no parameter" (AttributeError).
    Read from the stored tensors, whatever the experts' names (w1/w2/w3 as well as gate_proj...)."""

    from safetensors.torch import load_file, save_file

    from vllm_wna16_plugin import _vllm
    from vllm_wna16_plugin.tools.make_checkpoint import MODEL_FILE, make_checkpoint

    path = make_checkpoint(tmp_path / "ck", fmt=fmt, bits=4, group_size=32, hidden=128, intermediate=64,
                           experts=4, top_k=2, layers=1)  # fmt: skip
    prefix = "model.layers.0.mlp.experts"
    tensors = load_file(str(path / MODEL_FILE))
    for proj, shape in (("gate_proj", (64, 128)), ("up_proj", (64, 128)), ("down_proj", (128, 64))):
        for name in [n for n in tensors if n.startswith(f"{prefix}.2.{proj}.")]:
            del tensors[name]
        tensors[f"{prefix}.2.{proj}.weight"] = torch.randn(shape).bfloat16()
    save_file(tensors, str(path / MODEL_FILE), metadata={"format": "pt"})
    cfg = _config_of(path)
    with pytest.raises(ValueError, match=rf"{prefix}: the checkpoint stores some routed experts unquantized "
                                         rf"\({prefix}\.2\.down_proj\.weight is a float tensor\) and others "
                                         rf"quantized \({prefix}\.0\.down_proj\)"):  # fmt: skip
        _vllm.build_routed_experts(vllm_cpu, cfg, num_experts=4, top_k=2, hidden=128, intermediate=64, prefix=prefix,
                                   ckpt_names=("gate_proj", "down_proj", "up_proj"))  # fmt: skip


MIXTRAL_EXPERTS_RE = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"


@pytest.mark.parametrize(
    "targets, ignore, refused",
    [
        pytest.param([r"re:.*self_attn\.[qkvo]_proj$", MIXTRAL_EXPERTS_RE], [], None, id="targets-w1-w2-w3"),
        pytest.param(["Linear"], [r"re:.*experts\.\d+\.w2$"], r"experts\.0\.w2: unquantized", id="ignore-w2"),
    ],
)
def test_compressed_tensors_rules_naming_mixtral_experts_by_w1_w2_w3_are_read_as_vllm_reads_them(
    vllm_cpu, tmp_path, targets, ignore, refused
):
    """vLLM 0.34's compressed-tensors MoE method probes a layer's rules through expert 0's projections under the
    layer's checkpoint names (Mixtral's w1/w3/w2). The plugin probed gate_proj/up_proj/down_proj whatever the
    model: a Mixtral checkpoint whose config group targets its experts by a regex of w1/w2/w3 was refused ("leaves
    its routed experts unquantized ... but the checkpoint stores them quantized"), and an `ignore` of the w2s
    alone, which vLLM refuses (one MoE layer, one scheme), loaded."""
    from safetensors import safe_open

    from vllm_wna16_plugin import _vllm
    from vllm_wna16_plugin.reference import fused_moe_ref
    from vllm_wna16_plugin.tools.make_checkpoint import MODEL_FILE, load_reference, make_checkpoint

    E, H, I, top_k = 4, 128, 64, 2  # noqa: N806
    path = make_checkpoint(tmp_path / "ck", fmt="compressed-tensors", bits=4, group_size=32, hidden=H,
                           intermediate=I, experts=E, top_k=top_k, layers=1, arch="mixtral", seed=3)  # fmt: skip
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    (group,) = raw["config_groups"].values()
    group["targets"] = targets
    cfg = _config_of(path, config_groups=raw["config_groups"], ignore=["lm_head", *ignore])
    prefix = "model.layers.0.block_sparse_moe.experts"
    build = lambda: _vllm.build_routed_experts(vllm_cpu, cfg, num_experts=E, top_k=top_k, hidden=H,  # noqa: E731
                                                intermediate=I, prefix=prefix, ckpt_names=("w1", "w2", "w3"))  # fmt: skip
    if refused:
        with pytest.raises(ValueError, match=rf"{re.escape(prefix)}: its shards have different schemes .*{refused}"):
            build()
        return
    layer = build()
    assert layer.quant_method.scheme == cfg.parsed.scheme
    with safe_open(str(path / MODEL_FILE), "pt") as f:
        tensors = [(k.removeprefix(f"{prefix}."), f.get_tensor(k)) for k in f.keys() if k.startswith(f"{prefix}.")]
    list(layer.load_weights(tensors))
    layer.quant_method.process_weights_after_loading(layer)
    ref = load_reference(path)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(6)])
    w = torch.rand(6, top_k, generator=g)
    out = layer.quant_method.apply(layer, x, w, ids, None, None).float()
    exact = fused_moe_ref(x, ref["layers.0.w13"], ref["layers.0.w2"], w, ids).float()
    assert (out - exact).abs().max().item() <= exact.abs().max().item() * 2**-6


def test_config_pickles_by_name_into_a_fresh_process(config_cls, tmp_path):
    """vLLM pickles the config into the engine core it spawns (the demo crashed on the H200 with
    "Can't pickle local object 'make_config_class.<locals>.MoeWNA16PlusConfig'"); a fresh
    interpreter that never called register() must unpickle it."""
    import pickle
    import subprocess
    import sys

    cfg = config_cls.from_config(GPTQ | {"sym": False, "group_size": 64})
    blob = pickle.dumps(cfg)
    again = pickle.loads(blob)
    assert type(again) is type(cfg) and again.parsed == cfg.parsed
    (tmp_path / "cfg.pkl").write_bytes(blob)
    code = (
        "import pickle, sys; cfg = pickle.load(open(sys.argv[1], 'rb')); "
        "print(type(cfg).__module__, type(cfg).__qualname__, cfg.get_name(), cfg.parsed.scheme.group_size)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cfg.pkl")], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-4:] == ["vllm_wna16_plugin.quant_config", "MoeWNA16PlusConfig", "moe_wna16_plus", "64"]


AWQ = {"quant_method": "awq", "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize(
    "spelling",
    [
        pytest.param({"bits": 4, "group_size": 64}, id="transformers"),
        pytest.param({"w_bit": 4, "q_group_size": 64}, id="autoawq"),
        pytest.param({"bits": 4, "w_bit": 4, "group_size": 64, "q_group_size": 64}, id="both-agreeing"),
        pytest.param({"w_bit": 4, "group_size": 64}, id="mixed"),
    ],
)
def test_awq_spellings_read_as_vllms_awq_linear_method_reads_them(config_cls, spelling):
    from vllm_wna16_plugin import _vllm

    ours = config_cls.from_config(AWQ | spelling).parsed.scheme
    theirs = _vllm.in_tree_linear_config("awq", AWQ | spelling)
    assert (ours.bits, ours.group_size) == (theirs.weight_bits, theirs.group_size) == (4, 64)


@pytest.mark.parametrize(
    "spelling, keys",
    [
        pytest.param({"bits": 8, "w_bit": 4, "group_size": 64}, ("bits=8", "w_bit=4"), id="bits"),
        pytest.param({"bits": 4, "group_size": 128, "q_group_size": 64}, ("group_size=128", "q_group_size=64"),
                     id="group_size"),
    ],
)  # fmt: skip
def test_claiming_refuses_awq_spellings_that_disagree(config_cls, spelling, keys):
    """vLLM 0.26's AWQ reads w_bit / q_group_size first; the experts and linears would silently differ."""
    from vllm_wna16_plugin import _vllm

    theirs = _vllm.in_tree_linear_config("awq", AWQ | spelling)
    ours_first = spelling.get("bits", spelling.get("group_size"))
    assert ours_first != (theirs.weight_bits if "w_bit" in spelling else theirs.group_size)  # they do disagree
    message = rf"quantization_config\.{keys[0]} and quantization_config\.{keys[1]} disagree"
    with pytest.raises(ValueError, match=message):
        config_cls.override_quantization_method(AWQ | spelling, "moe_wna16_plus")
    assert config_cls.override_quantization_method(AWQ | spelling, "awq") is None  # not asked: not ours to judge


@pytest.mark.parametrize("dynamic", [False, True])  # "local": refused too (BAD_CONFIGS), pydantic refuses it here
def test_ct_dynamic_weights_refused_exactly_where_vllm_sees_no_static_wna16(config_cls, dynamic):
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
               "dynamic": dynamic}  # fmt: skip
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}  # fmt: skip
    static_wna16 = CompressedTensorsConfig._is_wNa16_group_channel(QuantizationArgs.model_validate(weights), None)
    if static_wna16:
        assert config_cls.override_quantization_method(ct, "moe_wna16_plus") == "moe_wna16_plus"
    else:
        with pytest.raises(ValueError, match=r"config_groups\.group_0\.weights\.dynamic=.* is not supported"):
            config_cls.override_quantization_method(ct, "moe_wna16_plus")
    assert static_wna16 is (dynamic is False)


@pytest.mark.parametrize(
    "hf_quant_cfg, message",
    [
        pytest.param("gptq", r"quantization_config='gptq' is not a JSON object", id="str"),
        pytest.param([GPTQ], r"quantization_config=\[.*\] is not a JSON object", id="list"),
        pytest.param({}, r"quantization_config\.quant_method is missing .*; supported: 'gptq', 'awq'", id="empty"),
        pytest.param(GPTQ | {"group_size": "32"}, r"group_size='32' is a string, not an int", id="gs-str"),
        pytest.param(GPTQ | {"desc_act": 1}, r"desc_act=1 is an int, not a bool", id="desc_act-int"),
    ],
)
def test_claiming_when_asked_gives_one_value_error_naming_the_field(config_cls, hf_quant_cfg, message):
    with pytest.raises(ValueError, match=message):
        config_cls.override_quantization_method(hf_quant_cfg, "moe_wna16_plus")
    assert config_cls.override_quantization_method(hf_quant_cfg, None) is None  # not asked: never parsed


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors", "awq"])
def test_a_model_that_renames_checkpoint_modules_finds_their_rules_and_stored_tensors(vllm_cpu, tmp_path, fmt):
    """Qwen3.5-MoE, Qwen3-VL-MoE and GLM-4.5V checkpoints store `model.language_model.layers.*`, which vLLM's model
    renames to `language_model.model.layers.*` (apply_vllm_mapper). Quantized attention must still be judged
    quantized under the vLLM name (before: unquantized, then "no parameter ... qweight" at load), the float
    router gate unquantized, the experts owned by the plugin, and the config's module lists renamed too."""
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, UnquantizedLinearMethod
    from vllm.model_executor.models.utils import WeightsMapper

    from vllm_wna16_plugin import _vllm
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    sym = fmt != "awq"
    path = make_checkpoint(tmp_path / "ck", fmt=fmt, bits=4, group_size=32, sym=sym, hidden=128, intermediate=64,
                           experts=4, top_k=2, layers=1)  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    save_file({k.replace("model.layers.", "model.language_model.layers."): v for k, v in tensors.items()},
              path / "model.safetensors")  # fmt: skip
    hf = "model.language_model.layers.0"
    lists = {
        "gptq": dict(modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                    "self_attn.o_proj", "mlp.experts"]]),
        "awq": dict(modules_to_not_convert=[f"{hf}.mlp.gate"]),
        "compressed-tensors": dict(ignore=["lm_head", f"{hf}.mlp.gate"]),
    }[fmt]  # fmt: skip
    cfg = _config_of(path, **lists)
    cfg.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix={"model.language_model.": "language_model.model."}))
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    vllm_layer = "language_model.model.layers.0"
    assert cfg._stored_quantized(f"{vllm_layer}.self_attn.qkv_proj")
    assert not cfg._stored_quantized(f"{vllm_layer}.mlp.gate")
    if fmt == "awq":  # the renamed modules_to_not_convert names the vLLM gate
        assert cfg.parsed.scheme_for(f"{vllm_layer}.mlp.gate", moe=False) is None
    if fmt == "compressed-tensors":  # the renamed ignore entry; the old name no longer matches anything
        assert cfg.parsed.scheme_for(f"{vllm_layer}.mlp.gate", moe=False) is None
        assert cfg.parsed.scheme_for(f"{hf}.mlp.gate", moe=False) is not None
    gate = ReplicatedLinear(128, 4, bias=False, quant_config=cfg, prefix=f"{vllm_layer}.mlp.gate")
    assert isinstance(gate.quant_method, UnquantizedLinearMethod)
    # the method the config gives the fused qkv layer (its weights need a GPU kernel: not created here)
    qkv_prefix = f"{vllm_layer}.self_attn.qkv_proj"
    qkv = QKVParallelLinear(128, 32, 4, 4, bias=False, quant_config=None, prefix=qkv_prefix)
    try:
        assert not isinstance(cfg.get_quant_method(qkv, qkv_prefix), UnquantizedLinearMethod)
    except ValueError as exc:  # a delegate that refuses on CPU has judged the layer quantized too
        assert "is stored quantized" in str(exc), exc
    experts = _vllm.build_routed_experts(vllm_cpu, cfg, num_experts=4, top_k=2, hidden=128, intermediate=64,
                                         prefix=f"{vllm_layer}.mlp.experts", ckpt_names=("gate_proj", "down_proj",
                                                                                       "up_proj"))  # fmt: skip
    assert type(experts.quant_method).__name__ == "MoeWNA16PlusMethod"


@pytest.mark.parametrize(
    "stored, unquantized",
    [
        # MTP layer of a GPTQ file, its experts left bf16 with no `dynamic` rule saying so
        ({**{f"mtp.layers.0.mlp.experts.{e}.{p}.weight": "BF16" for e in range(4) for p in ("gate_proj", "up_proj")},
          "mtp.layers.0.mlp.gate.weight": "BF16"}, True),
        # GraniteMoE: fused bf16 experts (input_linear / output_linear), which GPTQ tools never quantize
        ({"mtp.layers.0.mlp.input_linear.weight": "BF16", "mtp.layers.0.mlp.output_linear.weight": "BF16",
          "mtp.layers.0.mlp.router.layer.weight": "BF16"}, True),
        # the usual block: quantized experts beside a float router
        ({"mtp.layers.0.mlp.experts.0.gate_proj.qweight": "I32", "mtp.layers.0.mlp.gate.weight": "BF16"}, False),
        # only a float router under the block (the experts stored under names the file does not share): no verdict
        ({"mtp.layers.0.mlp.gate.weight": "BF16"}, False),
        # routed experts stored as floats beside a quantized shared expert: the experts' own dtypes decide
        ({"mtp.layers.0.mlp.experts.0.gate_proj.weight": "BF16", "mtp.layers.0.mlp.experts.0.down_proj.weight": "BF16",
          "mtp.layers.0.mlp.shared_expert.down_proj.qweight": "I32"}, True),
    ],
    ids=["float-experts", "granite-fused-float", "quantized-experts", "router-only", "float-experts-quantized-shared"],
)  # fmt: skip
def test_a_moe_block_the_file_stores_unquantized_loads_unquantized(vllm_cpu, monkeypatch, stored, unquantized):
    """The config's rules say quantized, the safetensors say float: vLLM would build the quantized layer and fail
    on the first float tensor ("has no parameter"); the stored dtypes decide, as they do for linear layers."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    from vllm_wna16_plugin import _vllm

    prefix = "mtp.layers.0.mlp.experts"
    cfg = get_quantization_config("moe_wna16_plus").from_config(
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    )
    layer = _vllm.build_routed_experts(vllm_cpu, cfg, num_experts=4, top_k=2, hidden=128, intermediate=64,
                                       prefix=prefix, ckpt_names=("gate_proj", "down_proj", "up_proj"))  # fmt: skip
    cfg._stored_dtypes = {**stored, "model.layers.0.self_attn.q_proj.qweight": "I32"}
    cfg._learn_stored_modules()
    monkeypatch.setattr(_vllm, "unquantized_moe_method", lambda moe_config: "unquantized MoE")
    method = cfg.get_quant_method(layer, prefix)
    assert (method == "unquantized MoE") == unquantized, method


def test_routed_experts_the_file_stores_as_floats_beside_quantized_shared_experts_load_unquantized(
    vllm_cpu, tmp_path, monkeypatch
):
    """An AWQ file written by GPTQModel whose `dynamic` rule left the routed experts bf16 (vLLM's AWQ config, and so
    ours, does not read `dynamic`) while the shared expert beside them is quantized: the block is not all float, so
    the block rule did not apply, and vLLM's loader failed on the first float expert tensor with an AttributeError
    ("has no parameter 'w13_weight'"). The experts' stored dtypes decide, as they do for linear layers."""
    from safetensors.torch import load_file, save_file

    from vllm_wna16_plugin import _vllm
    from vllm_wna16_plugin.tools.make_checkpoint import MODEL_FILE, make_checkpoint

    E, H, I = 4, 128, 64  # noqa: N806
    path = make_checkpoint(tmp_path / "ck", fmt="awq", bits=4, group_size=32, sym=False, hidden=H, intermediate=I,
                           experts=E, top_k=2, layers=1)  # fmt: skip
    prefix = "model.layers.0.mlp.experts"
    tensors = load_file(str(path / MODEL_FILE))
    for name in [n for n in tensors if n.startswith(f"{prefix}.")]:
        del tensors[name]
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors[f"{prefix}.{e}.{proj}.weight"] = torch.randn(shape).bfloat16()
    tensors["model.layers.0.mlp.shared_expert.down_proj.qweight"] = torch.zeros(I, H // 8, dtype=torch.int32)
    save_file(tensors, str(path / MODEL_FILE), metadata={"format": "pt"})
    gptqmodel_awq = {"dynamic": {r"-:.*mlp\.experts\..*": {}}, "checkpoint_format": "gemm", "format": "gemm",
                     "pack_dtype": "int32", "desc_act": False}  # fmt: skip
    cfg = _config_of(path, **gptqmodel_awq)
    assert cfg.parsed.scheme_for(prefix, moe=True) is not None  # the rules alone say quantized
    plain = type(cfg).from_config(cfg.parsed.raw)  # a layer to ask about (no stored dtypes: the plugin's method)
    layer = _vllm.build_routed_experts(vllm_cpu, plain, num_experts=E, top_k=2, hidden=H, intermediate=I,
                                       prefix=prefix, ckpt_names=("gate_proj", "down_proj", "up_proj"))  # fmt: skip
    monkeypatch.setattr(_vllm, "unquantized_moe_method", lambda moe_config: "unquantized MoE")
    assert cfg.get_quant_method(layer, prefix) == "unquantized MoE"


LM_HEAD_CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_a_quantized_lm_head_gets_the_in_tree_method_as_vllms_own_config_gives_it(vllm_cpu, fmt):
    # GPTQModel / AutoAWQ `lm_head: true`: the head's qweight must have a parameter to load into (before, the
    # head was built unquantized and vLLM's loader failed on "lm_head.qweight")
    from vllm.model_executor.layers.quantization import get_quantization_config

    from vllm_wna16_plugin import _vllm

    head_cls = _vllm.parallel_lm_head_cls()
    plus = get_quantization_config("moe_wna16_plus").from_config({**LM_HEAD_CONFIGS[fmt], "lm_head": True})
    bare = head_cls(1024, 256, prefix="lm_head")  # no quant_config: the method is asked for below
    asked = []
    delegate = plus._delegate()
    in_tree = delegate.get_quant_method
    # GPTQ's in-tree method checks the device's Marlin support as it is made (no GPU here): record the ask
    delegate.get_quant_method = lambda layer, prefix: asked.append((layer, prefix)) or "in-tree method"
    assert plus.get_quant_method(bare, "lm_head") == "in-tree method" and asked == [(bare, "lm_head")]
    delegate.get_quant_method = in_tree
    if fmt == "awq":
        assert "Linear" in type(plus.get_quant_method(bare, "lm_head")).__name__
    plain = get_quantization_config("moe_wna16_plus").from_config(LM_HEAD_CONFIGS[fmt])
    assert plain.get_quant_method(bare, "lm_head") is None  # vLLM's float embedding method
    if fmt == "awq":  # GPTQ's in-tree method needs a GPU's capability to create its weights (Marlin's check)
        head = head_cls(1024, 256, quant_config=plus, prefix="lm_head")
        params = {n for n, _ in head.named_parameters()}
        assert {"qweight", "scales", "qzeros"} <= params and "weight" not in params, params


def test_an_asymmetric_gptq_lm_head_is_refused_by_name(vllm_cpu):
    from vllm.model_executor.layers.quantization import get_quantization_config

    from vllm_wna16_plugin import _vllm

    raw = {**LM_HEAD_CONFIGS["gptq"], "sym": False, "lm_head": True}
    plus = get_quantization_config("moe_wna16_plus").from_config(raw)
    with pytest.raises(ValueError, match=r"'lm_head' is stored quantized .*lm_head=true.*sym=false.*re-export"):
        _vllm.parallel_lm_head_cls()(1024, 256, quant_config=plus, prefix="lm_head")


SIDE_FILES = {  # as the tools wrote them, without quant_method, beside a config.json without quantization_config
    "awq": ("quant_config.json", {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}),
    "gptq": ("quantize_config.json", {"bits": 4, "group_size": 32, "damp_percent": 0.01, "desc_act": False,
                                      "static_groups": False, "sym": True, "true_sequential": True,
                                      "model_name_or_path": None, "model_file_base_name": "model"}),
}  # fmt: skip


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_a_side_file_without_quant_method_is_read_as_its_tool_wrote_it(tmp_path, fmt):
    # AutoAWQ's quant_config.json was not looked for, AutoGPTQ's quantize_config.json (no quant_method) refused
    import json

    import vllm_wna16_plugin
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    vllm_wna16_plugin.register()
    path = make_checkpoint(tmp_path / "ck", fmt=fmt, bits=4, group_size=32, sym=fmt != "awq", hidden=128,
                           intermediate=64, experts=4, top_k=2, layers=1)  # fmt: skip
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(cfg))
    name, side = SIDE_FILES[fmt]
    (path / name).write_text(json.dumps(side))
    from vllm.config import LoadConfig, ModelConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    qc = get_quant_config(ModelConfig(model=str(path), tokenizer=str(path), quantization="moe_wna16_plus"),
                          LoadConfig())  # fmt: skip
    assert (
        qc.parsed.quant_method == fmt and qc.parsed.scheme_for("model.layers.0.mlp.experts", moe=True).group_size == 32
    )


def test_side_file_keys_name_the_format_only_when_they_are_a_tools():
    from vllm_wna16_plugin.checkpoint_config import parse_quantization_config, side_file_method

    assert [side_file_method(v[1]) for v in SIDE_FILES.values()] == ["awq", "gptq"]
    assert side_file_method({"bits": 4, "group_size": 128}) is None  # nothing says which tool
    assert side_file_method({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}) is None
    assert side_file_method({"w_bit": 4, "bits": 4, "group_size": 128, "sym": True}) is None  # both: ambiguous
    with pytest.raises(ValueError, match=r"quant_method is missing \(config.json's .*quantize_config.json"):
        parse_quantization_config({"bits": 4, "group_size": 128})


def test_a_compressed_tensors_kv_cache_scheme_runs_as_vllms_own_config_runs_it(vllm_cpu):
    # before, the scheme was dropped: a bf16 KV cache instead of fp8, and with --kv-cache-dtype fp8 the
    # checkpoint's k/v scales unread (1.0)
    from vllm.model_executor.layers.quantization import get_quantization_config

    from vllm_wna16_plugin import _vllm

    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"], "input_activations": None, "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "strategy": "group",
              "group_size": 128, "actorder": None}}}}  # fmt: skip
    scheme = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
    attention = object.__new__(_vllm.attention_cls())  # what the method is asked for; its fields are not read
    plus = get_quantization_config("moe_wna16_plus").from_config({**ct, "kv_cache_scheme": scheme})
    assert plus.kv_cache_scheme == scheme  # vLLM's attention reads it from the layer's quant config
    in_tree = get_quantization_config("compressed-tensors").from_config({**ct, "kv_cache_scheme": scheme})
    method = plus.get_quant_method(attention, "model.layers.0.self_attn.attn")
    assert type(method) is type(in_tree.get_quant_method(attention, "model.layers.0.self_attn.attn"))
    assert method.quant_config.kv_cache_scheme == scheme
    plain = get_quantization_config("moe_wna16_plus").from_config(ct)
    assert plain.kv_cache_scheme is None and plain.get_quant_method(attention, "model.layers.0.self_attn.attn") is None
    # act-order experts (which vLLM's own compressed-tensors config refuses from 0.30, while the plugin runs
    # them): the KV-cache method still comes, built on the plugin's config
    ao = copy.deepcopy(ct)
    ao["config_groups"]["g"]["weights"]["actorder"] = "group"
    ao_plus = get_quantization_config("moe_wna16_plus").from_config({**ao, "kv_cache_scheme": scheme})
    ao_method = ao_plus.get_quant_method(attention, "model.layers.0.self_attn.attn")
    assert type(ao_method) is type(method) and ao_method.quant_config.kv_cache_scheme == scheme


def test_a_mixed_compressed_tensors_checkpoint_runs_its_fp8_linears_on_vllms_method(vllm_cpu):
    # FP8 W8A8 attention beside W4A16 experts (a mixed llm-compressor recipe): was refused at parse
    from vllm.model_executor.layers.quantization import get_quantization_config

    from tests.test_checkpoint_config import FP8_ATTENTION
    from vllm_wna16_plugin import _vllm

    raw = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
           "config_groups": {"experts": {"targets": ["Linear"], "input_activations": None, "weights": {
               "num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "strategy": "group",
               "group_size": 128, "actorder": None}}, "attn": FP8_ATTENTION}}  # fmt: skip
    plus = get_quantization_config("moe_wna16_plus").from_config(raw)
    asked = []
    delegate = plus._delegate()
    delegate.get_quant_method = lambda layer, prefix: asked.append(prefix) or "in-tree method"
    linear = object.__new__(_vllm.linear_base_cls())  # what the method is asked for; its fields are not read
    assert plus.get_quant_method(linear, "model.layers.0.self_attn.o_proj") == "in-tree method"
    assert asked == ["model.layers.0.self_attn.o_proj"]
    assert plus.parsed.scheme_for("model.layers.0.mlp.experts", moe=True).bits == 4  # the plugin's experts
