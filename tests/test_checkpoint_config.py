"""checkpoint_config: real checkpoints' quantization_config blocks parse to the right scheme,
per-module rules match vLLM's, bad input fails with a message naming key, value and fix."""

from __future__ import annotations

import copy
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_wna16_plugin.checkpoint_config import (
    CheckpointQuantConfig,
    effective_group_size,
    is_wna16_checkpoint,
    parse_awq,
    parse_compressed_tensors,
    parse_gptq,
    parse_quantization_config,
)
from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme

# ---------------------------------------------------------------- real quantization_config blocks
# Mirrors of the blocks in the checkpoints' config.json / quantize_config.json. Module names
# in the tests below are vLLM prefixes (after the model's hf_to_vllm_mapper).

# btbtyler09/Qwen3.5-35B-A3B-GPTQ-4bit style: GPTQModel output, gs32 (the K=2048 crash shape).
QWEN35_GPTQ_GS32 = {
    "bits": 4,
    "group_size": 32,
    "desc_act": False,
    "sym": True,
    "lm_head": False,
    "quant_method": "gptq",
    "checkpoint_format": "gptq",
    "pack_dtype": "int32",
    "damp_percent": 0.01,
    "true_sequential": True,
    "static_groups": False,
    "meta": {
        "quantizer": ["gptqmodel:4.2.5"],
        "uri": "https://github.com/modelcloud/gptqmodel",
        "damp_percent": 0.01,
        "damp_auto_increment": 0.0025,
        "static_groups": False,
        "true_sequential": True,
        "mse": 0.0,
        "v2": False,
        "v2_alpha": 0.25,
    },
}

_CT_WEIGHTS_DEFAULTS = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "observer": "minmax",
    "observer_kwargs": {},
    "type": "int",
}

# RedHatAI/Mixtral-8x22B-v0.1-quantized.w4a16 (llm-compressor): one "Linear" group, every router ignored.
MIXTRAL_8X22B_CT_W4A16 = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 128,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "global_compression_ratio": 1.8917,
    "ignore": ["lm_head"] + [f"model.layers.{i}.block_sparse_moe.gate" for i in range(56)],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# gemma-4-26B-A4B channel-wise W4A16 (llm-compressor): group_size null + strategy channel.
GEMMA4_CT_CHANNELWISE = {
    "config_groups": {
        "group_0": {
            "format": "pack-quantized",
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": None,
                "num_bits": 4,
                "observer": "mse",
                "observer_kwargs": {},
                "strategy": "channel",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*vision_tower.*", "re:.*embed_vision.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "sparsity_config": {},
    "transform_config": {},
    "version": "0.12.2",
}

# TheBloke/Mixtral-8x7B-Instruct-v0.1-AWQ config.json block.
MIXTRAL_AWQ_THEBLOKE = {
    "quant_method": "awq",
    "zero_point": True,
    "group_size": 128,
    "bits": 4,
    "version": "gemm",
    "modules_to_not_convert": None,
}

# transformers 5's AwqConfig.to_dict (a checkpoint saved with save_pretrained): `backend` is the kernel it ran with
# ("auto" by default; transformers 4 wrote "autoawq"), `format` and `version` the packing, plus GPTQConfig's keys.
TRANSFORMERS5_AWQ = {
    "zero_point": True,
    "modules_to_not_convert": ["gate"],
    "quant_method": "awq",
    "bits": 4,
    "tokenizer": None,
    "dataset": None,
    "group_size": 128,
    "damp_percent": 0.1,
    "desc_act": False,
    "act_group_aware": True,
    "sym": True,
    "true_sequential": True,
    "format": "gemm",
    "meta": None,
    "backend": "auto",
    "model_seqlen": None,
    "block_name_to_quantize": None,
    "module_name_preceding_first_block": None,
    "batch_size": 1,
    "pad_token_id": None,
    "max_input_length": None,
    "cache_block_outputs": True,
    "modules_in_block_to_quantize": None,
    "version": "gemm",
}

# AutoAWQ's own quant_config.json spelling.
AUTOAWQ_SPELLING = {"quant_method": "awq", "zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}

# compressed-tensors group-128 asymmetric (symmetric false: zero points stored).
CT_GS128_ASYM = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                **_CT_WEIGHTS_DEFAULTS,
                "group_size": 128,
                "num_bits": 4,
                "strategy": "group",
                "symmetric": False,
                "zp_dtype": "torch.int8",
                "scale_dtype": None,
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

GPTQ_INT8 = {"bits": 8, "group_size": 128, "desc_act": False, "sym": True, "quant_method": "gptq", "lm_head": False}

GPTQ_V2_ASYM = {
    "bits": 4,
    "group_size": 64,
    "desc_act": False,
    "sym": False,
    "quant_method": "gptq",
    "format": "gptq_v2",
    "checkpoint_format": "gptq_v2",
    "pack_dtype": "int32",
    "meta": {"quantizer": ["gptqmodel:2.2.0"]},
}

# GPTQModel `dynamic`: skip the shared expert, 8-bit g64 for layer 0's routed experts.
GPTQ_DYNAMIC = {
    **QWEN35_GPTQ_GS32,
    "dynamic": {
        "-:.*shared_expert.*": {},
        r"+:model\.layers\.0\.mlp\.experts.*": {"bits": 8, "group_size": 64},
        r".*\.self_attn\..*": {"sym": False},  # a bare key is a positive override
    },
}

VALID_CONFIGS = {
    "qwen3.5-gptq-gs32": QWEN35_GPTQ_GS32,
    "mixtral-8x22b-ct": MIXTRAL_8X22B_CT_W4A16,
    "gemma4-ct-channel": GEMMA4_CT_CHANNELWISE,
    "mixtral-awq": MIXTRAL_AWQ_THEBLOKE,
    "autoawq-spelling": AUTOAWQ_SPELLING,
    "transformers5-awq": TRANSFORMERS5_AWQ,
    "ct-gs128-asym": CT_GS128_ASYM,
    "gptq-int8": GPTQ_INT8,
    "gptq-v2-asym": GPTQ_V2_ASYM,
    "gptq-dynamic": GPTQ_DYNAMIC,
}


def _scheme(bits, gs, zp, fmt, *, act=False, off=0, src):
    return WNA16Scheme(bits, gs, zp, fmt, desc_act=act, zero_point_offset=off, source=src)


# (config, expected experts scheme, expected in-tree method)
EXPECTED = {
    "qwen3.5-gptq-gs32": (_scheme(4, 32, False, PackFormat.GPTQ, off=1, src="gptq"), "gptq"),
    "mixtral-8x22b-ct": (_scheme(4, 128, False, PackFormat.CT_PACKED, src="compressed-tensors"), "compressed-tensors"),
    "gemma4-ct-channel": (_scheme(4, -1, False, PackFormat.CT_PACKED, src="compressed-tensors"), "compressed-tensors"),
    "mixtral-awq": (_scheme(4, 128, True, PackFormat.AWQ, src="awq"), "awq"),
    "autoawq-spelling": (_scheme(4, 64, True, PackFormat.AWQ, src="awq"), "awq"),
    "transformers5-awq": (_scheme(4, 128, True, PackFormat.AWQ, src="awq"), "awq"),
    "ct-gs128-asym": (_scheme(4, 128, True, PackFormat.CT_PACKED, src="compressed-tensors"), "compressed-tensors"),
    "gptq-int8": (_scheme(8, 128, False, PackFormat.GPTQ, off=1, src="gptq"), "gptq"),
    "gptq-v2-asym": (_scheme(4, 64, True, PackFormat.GPTQ, off=0, src="gptq"), "gptq"),
    "gptq-dynamic": (_scheme(4, 32, False, PackFormat.GPTQ, off=1, src="gptq"), "gptq"),
}


@pytest.mark.parametrize("name", list(VALID_CONFIGS))
def test_real_checkpoint_parses_to_expected_scheme(name):
    cfg = copy.deepcopy(VALID_CONFIGS[name])
    parsed = parse_quantization_config(cfg)
    scheme, method = EXPECTED[name]
    assert parsed.scheme == scheme
    assert parsed.quant_method == method
    assert parsed.raw == VALID_CONFIGS[name]
    assert parsed.raw is not cfg  # a copy: vLLM's in-tree from_config mutates what it is given
    assert is_wna16_checkpoint(cfg)


@pytest.mark.parametrize(
    "parser, name",
    [(parse_gptq, "qwen3.5-gptq-gs32"), (parse_awq, "mixtral-awq"), (parse_compressed_tensors, "gemma4-ct-channel")],
)
def test_format_parser_equals_dispatch(parser, name):
    assert parser(VALID_CONFIGS[name]) == parse_quantization_config(VALID_CONFIGS[name])


def test_quant_method_is_case_insensitive():
    cfg = {**QWEN35_GPTQ_GS32, "quant_method": "GPTQ"}
    assert parse_quantization_config(cfg).quant_method == "gptq"
    ct = {**CT_GS128_ASYM, "quant_method": "compressed_tensors"}
    assert parse_quantization_config(ct).quant_method == "compressed-tensors"


# ---------------------------------------------------------------- GPTQ details


def test_gptq_missing_checkpoint_format_is_v1():
    cfg = {k: v for k, v in QWEN35_GPTQ_GS32.items() if k != "checkpoint_format"}
    assert parse_gptq(cfg).scheme.zero_point_offset == 1


def test_gptq_desc_act_kept_for_groups_dropped_for_channelwise():
    assert parse_gptq({**GPTQ_INT8, "desc_act": True}).scheme.desc_act
    # one group per column: act order changes nothing (vLLM drops it too)
    assert not parse_gptq({**GPTQ_INT8, "desc_act": True, "group_size": -1}).scheme.desc_act


def test_gptq_lm_head_flag():
    base = parse_gptq(QWEN35_GPTQ_GS32)
    assert not base.lm_head_quantized and base.is_excluded("lm_head")
    quant = parse_gptq({**QWEN35_GPTQ_GS32, "lm_head": True})
    assert quant.lm_head_quantized and quant.scheme_for("lm_head") == quant.scheme


def test_gptq_dynamic_excludes_shared_expert_and_overrides():
    cfg = parse_gptq(GPTQ_DYNAMIC)
    assert cfg.is_excluded("model.layers.3.mlp.shared_expert.gate_up_proj")
    assert cfg.is_excluded("model.layers.3.mlp.shared_expert.down_proj")
    assert cfg.is_excluded("model.layers.3.mlp.shared_expert_gate")
    layer0 = cfg.scheme_for("model.layers.0.mlp.experts")
    assert (layer0.bits, layer0.group_size, layer0.has_zero_point) == (8, 64, False)
    assert layer0.zero_point_offset == 1  # the checkpoint format is not overridable
    assert cfg.scheme_for("model.layers.1.mlp.experts") == cfg.scheme
    assert cfg.scheme_for("model.layers.10.mlp.experts") == cfg.scheme  # "layers\.0\." is not a prefix of "10"
    attn = cfg.scheme_for("model.layers.1.self_attn.qkv_proj")
    assert attn.has_zero_point and attn.bits == 4 and attn.group_size == 32
    assert cfg.scheme == parse_gptq(QWEN35_GPTQ_GS32).scheme


def test_gptq_dynamic_first_matching_rule_wins():
    cfg = parse_gptq(
        {
            **GPTQ_INT8,
            "dynamic": {r"+:.*experts": {"group_size": 32}, r"-:.*layers\.0\..*": {}},
        }
    )
    assert cfg.scheme_for("model.layers.0.mlp.experts").group_size == 32  # positive rule listed first
    assert cfg.is_excluded("model.layers.0.self_attn.o_proj")


def test_gptq_modules_in_block_to_quantize_checks_every_shard():
    cfg = parse_gptq(
        {
            **GPTQ_INT8,
            "modules_in_block_to_quantize": [
                ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                ["mlp.experts.0.gate_proj", "mlp.experts.0.up_proj", "mlp.experts.0.down_proj"],
            ],
        }
    )
    assert cfg.scheme_for("model.layers.2.self_attn.qkv_proj") == cfg.scheme
    assert cfg.scheme_for("model.layers.2.mlp.experts") == cfg.scheme
    assert cfg.is_excluded("model.layers.2.self_attn.o_proj")
    partial = parse_gptq({**GPTQ_INT8, "modules_in_block_to_quantize": ["self_attn.q_proj", "self_attn.k_proj"]})
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.qkv_proj: its shards have different"):
        partial.scheme_for("model.layers.2.self_attn.qkv_proj")
    # a MoE layer is no fused module: a list naming some of its projections leaves it to the stored tensors
    # (quant_config: stored_experts_scheme), as vLLM 0.34 reads no list for MoE layers
    some = parse_gptq(
        {**GPTQ_INT8, "modules_in_block_to_quantize": ["mlp.experts.0.gate_proj", "mlp.experts.0.up_proj"]}
    )
    assert some.scheme_for("model.layers.2.mlp.experts", moe=True) is None
    assert some.stored_experts_scheme("model.layers.2.mlp.experts") == some.scheme


# ---------------------------------------------------------------- AWQ details


def test_awq_dynamic_rules_that_keep_the_top_level_scheme_parse():
    """GPTQModel's AWQ `dynamic`: "-:" rules (modules stored float, which the dtypes show) and overrides equal to the
    top level change nothing vLLM's AWQ method runs."""
    cfg = {**MIXTRAL_AWQ_THEBLOKE, "dynamic": {"-:.*shared_expert.*": {}, r"+:.*experts.*": {"bits": 4, "sym": False}}}
    assert parse_awq(cfg).scheme == parse_awq(MIXTRAL_AWQ_THEBLOKE).scheme


@pytest.mark.parametrize("backend", ["AUTO", "autoawq", "marlin"])
def test_awq_backend_names_the_kernel_in_any_case(backend):
    assert parse_awq({**TRANSFORMERS5_AWQ, "backend": backend}).scheme == parse_awq(TRANSFORMERS5_AWQ).scheme


def test_awq_modules_to_not_convert_is_a_substring_match():
    cfg = parse_awq({**MIXTRAL_AWQ_THEBLOKE, "modules_to_not_convert": ["gate"]})
    assert cfg.is_excluded("model.layers.0.block_sparse_moe.gate")
    assert not cfg.is_excluded("model.layers.0.block_sparse_moe.experts")
    assert cfg.is_excluded("model.layers.0.mlp.gate_up_proj")  # substring, exactly as vLLM
    assert parse_awq(MIXTRAL_AWQ_THEBLOKE).scheme_for("model.layers.0.block_sparse_moe.gate") is not None


def test_awq_fused_module_needs_all_shards_excluded_or_none():
    cfg = parse_awq({**MIXTRAL_AWQ_THEBLOKE, "modules_to_not_convert": ["self_attn.q_proj"]})
    with pytest.raises(ValueError, match=r"qkv_proj: its shards have different exclusion"):
        cfg.scheme_for("model.layers.0.self_attn.qkv_proj")
    fused_listed = parse_awq({**MIXTRAL_AWQ_THEBLOKE, "modules_to_not_convert": ["self_attn.qkv_proj"]})
    assert fused_listed.is_excluded("model.layers.0.self_attn.qkv_proj")


# ---------------------------------------------------------------- compressed-tensors details


def test_ct_mixtral_ignores_routers_and_lm_head():
    cfg = parse_compressed_tensors(MIXTRAL_8X22B_CT_W4A16)
    assert not cfg.lm_head_quantized and cfg.is_excluded("lm_head")
    assert cfg.is_excluded("model.layers.55.block_sparse_moe.gate")
    assert cfg.scheme_for("model.layers.55.block_sparse_moe.experts") == cfg.scheme
    assert cfg.scheme_for("model.layers.0.self_attn.qkv_proj") == cfg.scheme


def test_ct_gemma_regex_ignore_matches_router_only():
    cfg = parse_compressed_tensors(GEMMA4_CT_CHANNELWISE)
    assert cfg.scheme.is_channelwise
    assert cfg.is_excluded("model.language_model.layers.4.mlp.gate")
    assert not cfg.is_excluded("model.language_model.layers.4.mlp.gate_up_proj")  # "gate$" is anchored
    assert not cfg.is_excluded("model.language_model.layers.4.mlp.experts")
    assert cfg.is_excluded("model.vision_tower.encoder.layers.0.self_attn.qkv_proj")


def test_ct_groups_pick_scheme_per_prefix():
    experts = {**_CT_WEIGHTS_DEFAULTS, "num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True}
    dense = {**_CT_WEIGHTS_DEFAULTS, "num_bits": 8, "group_size": None, "strategy": "channel", "symmetric": True}
    cfg = parse_compressed_tensors(
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": dense, "input_activations": None},
                "group_1": {"targets": [r"re:.*mlp\.experts\..*"], "weights": experts, "input_activations": None},
            },
            "ignore": ["lm_head"],
        }
    )
    assert (cfg.scheme.bits, cfg.scheme.group_size) == (4, 32)  # the experts' group, though listed second
    assert cfg.scheme_for("model.layers.0.mlp.experts") == cfg.scheme
    attn = cfg.scheme_for("model.layers.0.self_attn.o_proj")
    assert (attn.bits, attn.group_size) == (8, -1)
    assert cfg.scheme_for("model.layers.0.mlp.shared_expert.gate_up_proj") == attn


def test_ct_linear_group_is_experts_scheme_when_no_experts_target():
    cfg = parse_compressed_tensors(CT_GS128_ASYM)
    assert cfg.scheme_for("model.layers.7.mlp.experts") == cfg.scheme
    assert cfg.scheme.has_zero_point


def test_ct_experts_with_mixed_projection_schemes_fail_like_vllm():
    int8 = {**_CT_WEIGHTS_DEFAULTS, "num_bits": 8, "group_size": 128, "strategy": "group"}
    cfg = copy.deepcopy(CT_GS128_ASYM)
    cfg["config_groups"]["group_1"] = {"targets": [r"re:.*down_proj$"], "weights": int8, "input_activations": None}
    parsed = parse_compressed_tensors(cfg)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: its shards have different schemes"):
        parsed.scheme_for("model.layers.0.mlp.experts")


def test_ct_experts_are_probed_under_the_layers_own_projection_names():
    """vLLM 0.34 probes a MoE layer's compressed-tensors rules through expert 0 under the layer's checkpoint names:
    Mixtral's w1/w3/w2. A group whose regex names them targets Mixtral's experts; the default names miss it."""
    int8 = {**_CT_WEIGHTS_DEFAULTS, "num_bits": 8, "group_size": 128, "strategy": "group"}
    cfg = copy.deepcopy(CT_GS128_ASYM)
    cfg["config_groups"]["group_0"]["targets"] = [r"re:.*self_attn\..*"]
    cfg["config_groups"]["group_1"] = {"targets": [r"re:.*experts\.\d+\.w[123]$"], "weights": int8,
                                       "input_activations": None}  # fmt: skip
    parsed = parse_compressed_tensors(cfg)
    prefix = "model.layers.0.block_sparse_moe.experts"
    scheme = parsed.scheme_for(prefix, moe=True, expert_names=("w1", "w3", "w2"))
    assert (scheme.bits, scheme.group_size) == (8, 128)
    assert parsed.scheme_for(prefix, moe=True) is None  # gate_proj/up_proj/down_proj: no target names them
    cfg["ignore"] = ["lm_head", r"re:.*experts\.\d+\.w2$"]
    with pytest.raises(ValueError, match=r"its shards have different schemes .*experts\.0\.w2: unquantized"):
        parse_compressed_tensors(cfg).scheme_for(prefix, moe=True, expert_names=("w1", "w3", "w2"))


def _ct_two_groups(targets_0, targets_1, bits_1=8):
    int4 = {**_CT_WEIGHTS_DEFAULTS, "num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True}
    other = {**int4, "num_bits": bits_1}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": targets_0, "weights": int4, "input_activations": None},
            "group_1": {"targets": targets_1, "weights": other, "input_activations": None},
        },
        "ignore": ["lm_head"],
    }


def test_ct_same_target_in_two_groups_with_different_schemes_is_refused():
    # vLLM's target map keeps the later group silently; the checkpoint does not say which was applied.
    with pytest.raises(
        ValueError,
        match=r"config_groups\.group_0 and config_groups\.group_1 both target 'Linear' with different schemes "
        r"\(compressed-tensors int4 group 32 symmetric vs compressed-tensors int8 group 32 symmetric\)",
    ):
        parse_compressed_tensors(_ct_two_groups(["Linear"], ["Linear"]))
    same = parse_compressed_tensors(_ct_two_groups(["Linear"], ["Linear"], bits_1=4))
    assert same.scheme_for("model.layers.0.mlp.experts").bits == 4


def test_ct_overlapping_regex_groups_with_different_schemes_are_refused():
    cfg = parse_compressed_tensors(_ct_two_groups([r"re:.*experts.*"], [r"re:.*mlp\..*"]))
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj: quantization_config\.config_groups give it "
        r"different schemes \(config_groups\.group_0 \(target 're:\.\*experts\.\*'\): compressed-tensors int4.*"
        r"config_groups\.group_1 \(target 're:\.\*mlp\\\\\.\.\*'\): compressed-tensors int8",
    ):
        cfg.scheme_for("model.layers.0.mlp.experts")
    # a module only one group reaches is unambiguous
    assert cfg.scheme_for("model.layers.0.mlp.gate_up_proj").bits == 8
    # overlapping targets of one scheme are not a conflict
    agree = parse_compressed_tensors(_ct_two_groups([r"re:.*experts.*"], [r"re:.*mlp\..*"], bits_1=4))
    assert agree.scheme_for("model.layers.0.mlp.experts").bits == 4


def test_ct_name_target_beats_class_target_as_in_vllm():
    # Different precedence levels are not ambiguous: vLLM matches names/regexes before class names.
    cfg = parse_compressed_tensors(_ct_two_groups(["Linear"], [r"re:.*experts.*"]))
    assert cfg.scheme_for("model.layers.0.mlp.experts").bits == 8
    assert cfg.scheme_for("model.layers.0.self_attn.o_proj").bits == 4


def test_ct_fused_ignore_needs_all_shards():
    cfg = parse_compressed_tensors({**CT_GS128_ASYM, "ignore": ["model.layers.0.self_attn.q_proj"]})
    with pytest.raises(ValueError, match="ignore status"):
        cfg.scheme_for("model.layers.0.self_attn.qkv_proj")
    whole = parse_compressed_tensors({**CT_GS128_ASYM, "ignore": [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]})
    assert whole.is_excluded("model.layers.0.self_attn.qkv_proj")
    assert not whole.is_excluded("model.layers.1.self_attn.qkv_proj")


def test_ct_custom_fused_mapping():
    cfg = parse_compressed_tensors({**CT_GS128_ASYM, "ignore": ["model.layers.0.attn.wq", "model.layers.0.attn.wk"]})
    assert cfg.is_excluded("model.layers.0.attn.wqk", fused_mapping={"wqk": ["wq", "wk"]})
    assert not cfg.is_excluded("model.layers.0.attn.wqk")  # default mapping: not a fused name


def test_ct_lm_head_quantized_when_not_ignored():
    cfg = parse_compressed_tensors({**CT_GS128_ASYM, "ignore": []})
    assert cfg.lm_head_quantized


def test_ct_attention_only_group_is_skipped_like_vllm():
    cfg = copy.deepcopy(GEMMA4_CT_CHANNELWISE)
    attn_group = {"targets": ["Gemma4Attention"], "weights": None, "input_activations": {"num_bits": 8}}
    cfg["config_groups"]["attn"] = attn_group
    assert parse_compressed_tensors(cfg).scheme.is_channelwise


@pytest.mark.parametrize(
    "actorder, desc_act",
    [(None, False), ("group", True), ("dynamic", True), ("weight", False), ("static", False), (True, True)],
)
def test_ct_actorder_maps_to_desc_act(actorder, desc_act):
    cfg = copy.deepcopy(CT_GS128_ASYM)
    cfg["config_groups"]["group_0"]["weights"]["actorder"] = actorder
    assert parse_compressed_tensors(cfg).scheme.desc_act is desc_act


def test_ct_strategy_inferred_from_group_size():
    cfg = copy.deepcopy(CT_GS128_ASYM)
    cfg["config_groups"]["group_0"]["weights"]["strategy"] = None
    assert parse_compressed_tensors(cfg).scheme.group_size == 128
    cfg["config_groups"]["group_0"]["weights"]["group_size"] = -1
    assert parse_compressed_tensors(cfg).scheme.is_channelwise


def test_ct_per_group_format_overrides_top_level():
    cfg = copy.deepcopy(GEMMA4_CT_CHANNELWISE)
    cfg["format"] = "mixed-precision"
    assert parse_compressed_tensors(cfg).scheme.is_channelwise
    cfg["config_groups"]["group_0"]["format"] = "naive-quantized"
    cfg["format"] = "pack-quantized"
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.format='naive-quantized' is not supported"):
        parse_compressed_tensors(cfg)


FP8_ATTENTION = {  # llm-compressor's FP8 W8A8 group, as a mixed recipe writes it beside W4A16 experts
    "targets": [r"re:.*self_attn\.(q|k|v|o)_proj$"], "format": "float-quantized",
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
}  # fmt: skip


def test_ct_a_group_that_is_not_wna16_beside_wna16_experts_keeps_vllms_method_for_its_modules():
    # refused outright before (format='float-quantized' is not supported), while vLLM's own method loads it
    from vllm_wna16_plugin.checkpoint_config import ForeignScheme

    cfg = copy.deepcopy(CT_GS128_ASYM)
    cfg["config_groups"]["attn"] = copy.deepcopy(FP8_ATTENTION)
    parsed = parse_compressed_tensors(cfg)
    # (a fused qkv_proj: vLLM 0.26 tries the "Linear" class before the shards, 0.34 the shards first; either way
    # the layer is quantized and runs vLLM's own compressed-tensors method, which resolves it by its own order)
    o = parsed.scheme_for("model.layers.0.self_attn.o_proj", moe=False)
    assert isinstance(o, ForeignScheme) and o.group == "attn" and "float-quantized" in o.why
    assert parsed.scheme_for("model.layers.0.mlp.experts", moe=True) == parsed.scheme  # the int4 experts
    assert parsed.scheme.bits == 4
    # the same FP8 group naming the experts: refused by name, with the group's reason
    cfg["config_groups"]["attn"]["targets"] = [r"re:.*mlp\.experts\..*"]
    bad = parse_compressed_tensors(cfg)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: the routed experts are quantized by "
                                         r"quantization_config\.config_groups\.attn\.format='float-quantized'.*vLLM's own"):  # fmt: skip
        bad.scheme_for("model.layers.0.mlp.experts", moe=True)
    # no WNA16 group at all: the checkpoint is not one moe_wna16_plus runs (the group's own refusal)
    only = {**cfg, "config_groups": {"attn": {**FP8_ATTENTION, "targets": ["Linear"]}}}
    with pytest.raises(ValueError, match=r"config_groups\.attn\.format='float-quantized' is not supported"):
        parse_compressed_tensors(only)


def test_custom_config_without_rules_uses_scheme_everywhere():
    scheme = _scheme(4, 128, False, PackFormat.GPTQ, src="gptq")
    cfg = CheckpointQuantConfig(scheme=scheme, quant_method="gptq", raw={}, lm_head_quantized=False)
    assert cfg.scheme_for("model.layers.0.mlp.experts") == scheme
    assert cfg.is_excluded("lm_head")


# ---------------------------------------------------------------- bad input


def _ct_with_weights(**weights):
    cfg = copy.deepcopy(CT_GS128_ASYM)
    cfg["config_groups"]["group_0"]["weights"].update(weights)
    return cfg


def _without(cfg, key):
    return {k: v for k, v in cfg.items() if k != key}


W = r"quantization_config\.config_groups\.group_0\.weights\."
BAD_CONFIGS = [
    pytest.param(
        {**GPTQ_INT8, "bits": 3},
        re.escape("quantization_config.bits=3 is not supported; supported: 4, 8"),
        id="gptq-bits3",
    ),
    pytest.param({**GPTQ_INT8, "bits": 2}, r"bits=2 is not supported; supported: 4, 8", id="gptq-bits2"),
    pytest.param(
        {**GPTQ_INT8, "bits": "4"},
        re.escape("quantization_config.bits='4' is a string, not an int; supported: 4, 8"),
        id="gptq-bits-str",
    ),
    pytest.param({**GPTQ_INT8, "bits": True}, r"bits=True is a bool, not an int; supported: 4, 8", id="gptq-bits-bool"),
    pytest.param({**GPTQ_INT8, "bits": [4]}, r"bits=\[4\] is a list, not an int", id="gptq-bits-list"),
    pytest.param({**GPTQ_INT8, "bits": 2**70}, rf"bits={2**70} is not supported; supported: 4, 8", id="gptq-bits-huge"),
    pytest.param({**GPTQ_INT8, "group_size": "128"}, r"group_size='128' is a string, not an int", id="gptq-gs-str"),
    pytest.param({**GPTQ_INT8, "sym": 1}, r"sym=1 is an int, not a bool; supported: true, false", id="gptq-sym-int"),
    pytest.param(
        {**GPTQ_INT8, "group_size": 0},
        r"group_size=0 is not supported; supported: a positive int",
        id="gptq-gs0",
    ),
    pytest.param(
        {**GPTQ_INT8, "group_size": -2},
        r"group_size=-2 is not supported.*-1 \(channel-wise\)",
        id="gptq-gs-neg",
    ),
    pytest.param({**GPTQ_INT8, "group_size": 128.0}, r"group_size=128\.0 is a float, not an int", id="gptq-gs-float"),
    pytest.param({**GPTQ_INT8, "group_size": None}, r"group_size=None is null, not an int", id="gptq-gs-none"),
    pytest.param(
        _without(GPTQ_INT8, "bits"),
        r"quantization_config\.bits is missing; supported: 4, 8",
        id="gptq-no-bits",
    ),
    pytest.param(_without(GPTQ_INT8, "group_size"), r"quantization_config\.group_size is missing", id="gptq-no-gs"),
    pytest.param(_without(GPTQ_INT8, "sym"), r"quantization_config\.sym is missing", id="gptq-no-sym"),
    pytest.param({**GPTQ_INT8, "sym": "yes"}, r"sym='yes' is a string, not a bool", id="gptq-sym-str"),
    pytest.param(
        {**GPTQ_INT8, "checkpoint_format": "marlin"},
        r"checkpoint_format='marlin' is not a supported GPTQ checkpoint format; supported: 'gptq', 'gptq_v2'",
        id="gptq-marlin-format",
    ),
    pytest.param({**GPTQ_INT8, "format": "bitblas"}, r"format='bitblas' is not a supported GPTQ", id="gptq-bitblas"),
    pytest.param(
        {**GPTQ_INT8, "checkpoint_format": "gptq", "format": "gptq_v2"}, r"disagree", id="gptq-format-conflict"
    ),
    pytest.param({**GPTQ_INT8, "is_marlin_format": True}, r"is_marlin_format=True", id="gptq-is-marlin"),
    pytest.param(
        {**GPTQ_INT8, "pack_dtype": "int16"},
        r"pack_dtype='int16' is not supported; supported: 'int32'",
        id="gptq-int16-pack",
    ),
    pytest.param(
        {**GPTQ_INT8, "dynamic": {"+:.*experts": {"bits": 3}}},
        re.escape("quantization_config.dynamic['+:.*experts'].bits=3 is not supported; supported: 4, 8"),
        id="gptq-dynamic-bits3",
    ),
    pytest.param(
        {**GPTQ_INT8, "dynamic": {"-:(": {}}},
        r"dynamic\['-:\('\]='\(' is not a valid regular",
        id="gptq-dynamic-bad-regex",
    ),
    pytest.param({**GPTQ_INT8, "dynamic": ["x"]}, r"dynamic=\['x'\] is not a JSON object", id="gptq-dynamic-list"),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "bits": 8},
        re.escape("quantization_config.bits=8 is not supported (AWQ GEMM packing is 4-bit only); supported: 4"),
        id="awq-int8",
    ),
    pytest.param({**AUTOAWQ_SPELLING, "w_bit": 3}, r"w_bit=3 is not supported; supported: 4", id="awq-wbit3"),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "w_bit": 8},
        re.escape("quantization_config.bits=4 and quantization_config.w_bit=8 disagree")
        + r".*supported: only one of them, or the same value in both",
        id="awq-bits-vs-w_bit",
    ),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "q_group_size": 64},
        re.escape("quantization_config.group_size=128 and quantization_config.q_group_size=64 disagree"),
        id="awq-group_size-vs-q_group_size",
    ),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "w_bit": 4.0},
        re.escape("quantization_config.bits=4 and quantization_config.w_bit=4.0 disagree"),
        id="awq-w_bit-float-spelling",
    ),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "version": "gemv"},
        r"version='gemv' is not supported \(only GEMM packing.*re-export the checkpoint with version='gemm'\)",
        id="awq-gemv",
    ),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "version": "GEMV_FAST"},
        r"version='GEMV_FAST'.*version='gemm'",
        id="awq-gemv-fast",
    ),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "version": "marlin"},
        r"version='marlin'.*supported: 'gemm'",
        id="awq-marlin",
    ),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "backend": "llm-awq"},
        r"backend='llm-awq' is not supported \(llm-awq's packing differs from AutoAWQ GEMM",
        id="awq-llm-awq",
    ),
    pytest.param(
        {**TRANSFORMERS5_AWQ, "backend": "tensorrt"},
        r"backend='tensorrt' is not a known AWQ backend; supported: 'autoawq', 'auto', ",
        id="awq-unknown-backend",
    ),
    pytest.param(  # transformers 5 reads `format` as the packing when `version` is absent
        {k: v for k, v in {**TRANSFORMERS5_AWQ, "format": "gemv_fast"}.items() if k != "version"},
        r"format='gemv_fast' is not supported \(only GEMM packing",
        id="awq-format-gemv-fast",
    ),
    pytest.param(
        {**TRANSFORMERS5_AWQ, "backend": "gemv_fast"},
        r"backend='gemv_fast' is not a known AWQ backend",
        id="awq-gemv-kernel-backend",
    ),
    pytest.param(
        {**TRANSFORMERS5_AWQ, "dynamic": {"+:.*mlp.experts.*": {"zero_point": False}}},
        re.escape("quantization_config.dynamic['+:.*mlp.experts.*'].zero_point=False is not supported"),
        id="awq-dynamic-zero-point",
    ),
    pytest.param(  # GPTQModel writes `dynamic` into AWQ configs; vLLM's AWQ method reads none of it
        {**TRANSFORMERS5_AWQ, "dynamic": {"+:.*mlp.experts.*": {"group_size": 32}}},
        re.escape("quantization_config.dynamic['+:.*mlp.experts.*'].group_size=32 is not supported (vLLM's AWQ ")
        + r"method reads no `dynamic` rules.*group_size=128.*; supported: 128 \(the top level's\), or only '-:' rules",
        id="awq-dynamic-group-size",
    ),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "dynamic": {r".*down_proj": {"sym": True}}},
        r"dynamic\['\.\*down_proj'\]\.sym=True is not supported .*; supported: False \(the top level's\)",
        id="awq-dynamic-sym",
    ),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "dynamic": [".*"]}, r"dynamic=\['\.\*'\] is not a JSON object", id="awq-dyn-list"
    ),
    pytest.param({**MIXTRAL_AWQ_THEBLOKE, "group_size": 0}, r"group_size=0 is not supported", id="awq-gs0"),
    pytest.param(
        _without(MIXTRAL_AWQ_THEBLOKE, "bits"),
        r"quantization_config\.bits \(or w_bit\) is missing",
        id="awq-no-bits",
    ),
    pytest.param(_without(MIXTRAL_AWQ_THEBLOKE, "zero_point"), r"zero_point is missing", id="awq-no-zp"),
    pytest.param(
        {**MIXTRAL_AWQ_THEBLOKE, "modules_to_not_convert": "gate"},
        r"modules_to_not_convert='gate' is not a list",
        id="awq-ntc-str",
    ),
    pytest.param(_ct_with_weights(num_bits=3), W + r"num_bits=3 is not supported; supported: 4, 8", id="ct-bits3"),
    pytest.param(
        _ct_with_weights(type="float", num_bits=8, strategy="channel", group_size=None),
        W + r"type='float' is not supported \(float weights are not WNA16\); supported: 'int'",
        id="ct-fp8-weights",
    ),
    pytest.param(
        _ct_with_weights(strategy="tensor", group_size=None),
        W + r"strategy='tensor' is not supported; supported: 'group', 'channel'",
        id="ct-tensor",
    ),
    pytest.param(_ct_with_weights(strategy="block", group_size=None), W + r"strategy='block'", id="ct-block"),
    pytest.param(_ct_with_weights(strategy="token", group_size=None), W + r"strategy='token'", id="ct-token"),
    pytest.param(_ct_with_weights(group_size=0), W + r"group_size=0 is not supported", id="ct-gs0"),
    pytest.param(
        _ct_with_weights(group_size=-1),
        W + r"group_size=-1 is not supported with strategy='group'",
        id="ct-group-minus1",
    ),
    pytest.param(_ct_with_weights(group_size=None), W + r"group_size=None is null, not an int", id="ct-group-none"),
    pytest.param(
        _ct_with_weights(strategy="channel", group_size=128),
        W + r"group_size=128 contradicts strategy='channel'",
        id="ct-channel-gs",
    ),
    pytest.param(_ct_with_weights(strategy=None, group_size=None), W + r"strategy is missing", id="ct-no-strategy"),
    pytest.param(_ct_with_weights(symmetric="no"), W + r"symmetric='no' is a string, not a bool", id="ct-sym-str"),
    pytest.param(
        _ct_with_weights(dynamic=True),
        W + r"dynamic=True is not supported \(dynamic weights have no scales.*static.*\); supported: false",
        id="ct-dynamic-weights",
    ),
    pytest.param(_ct_with_weights(dynamic="local"), W + r"dynamic='local' is not supported", id="ct-dynamic-local"),
    pytest.param(_ct_with_weights(dynamic=None), W + r"dynamic=None is not supported", id="ct-dynamic-null"),
    pytest.param(_ct_with_weights(num_bits="4"), W + r"num_bits='4' is a string, not an int", id="ct-bits-str"),
    pytest.param(
        {**CT_GS128_ASYM, "transform_config": {"config_groups": {"u": {"type": "hadamard"}}}},
        r"quantization_config\.transform_config=.* is not supported \(moe_wna16_plus does not apply .*transforms",
        id="ct-transform",
    ),
    pytest.param(
        {**CT_GS128_ASYM, "sparsity_config": {"format": "sparse-24-bitmask", "targets": ["Linear"]}},
        r"sparsity_config\.format='sparse-24-bitmask' is not supported \(sparse weights are not WNA16\); "
        r"supported: 'dense'",
        id="ct-sparse24",
    ),
    pytest.param(_ct_with_weights(actorder="random"), W + r"actorder='random' is not supported", id="ct-actorder"),
    pytest.param(
        _ct_with_weights(actorder="group", strategy="channel", group_size=None),
        W + r"actorder='group' needs strategy='group'",
        id="ct-actorder-channel",
    ),
    pytest.param(
        {**CT_GS128_ASYM, "format": "float-quantized"},
        r"quantization_config\.format='float-quantized' is not supported.*supported: 'pack-quantized'",
        id="ct-float-quantized",
    ),
    pytest.param({**CT_GS128_ASYM, "format": "naive-quantized"}, r"format='naive-quantized'", id="ct-naive"),
    pytest.param({**CT_GS128_ASYM, "format": "marlin-24"}, r"format='marlin-24'", id="ct-marlin24"),
    pytest.param({**CT_GS128_ASYM, "format": "nvfp4-pack-quantized"}, r"format='nvfp4-pack-quantized'", id="ct-nvfp4"),
    pytest.param(_without(CT_GS128_ASYM, "format"), r"quantization_config\.format is missing", id="ct-no-format"),
    pytest.param({**CT_GS128_ASYM, "config_groups": {}}, r"config_groups is missing", id="ct-no-groups"),
    pytest.param(
        _without(CT_GS128_ASYM, "ignore") | {"ignore": "lm_head"},
        r"ignore='lm_head' is not a list",
        id="ct-ignore-str",
    ),
    pytest.param(
        {**CT_GS128_ASYM, "ignore": ["re:("]},
        r"ignore='\(' is not a valid regular expression",
        id="ct-ignore-bad-regex",
    ),
    pytest.param(
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        r"quant_method='fp8' is not a WNA16 checkpoint format; supported: 'gptq', 'awq', 'compressed-tensors'",
        id="fp8",
    ),
    pytest.param(
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
        r"quant_method='bitsandbytes' is not a WNA16",
        id="bnb",
    ),
    pytest.param(  # no tool's side-file keys either (a GPTQ one without quant_method is read as GPTQ)
        {"bits": 8, "group_size": 64},
        r"quantization_config\.quant_method is missing .*; supported: 'gptq'",
        id="no-method",
    ),
    pytest.param({"quant_method": None}, r"quant_method=None is not a WNA16", id="method-none"),
    pytest.param(["gptq"], r"quantization_config=\['gptq'\] is not a JSON object", id="not-a-dict"),
]


@pytest.mark.parametrize("cfg, message", BAD_CONFIGS)
def test_bad_config_raises_value_error_naming_key(cfg, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(cfg)
    assert not is_wna16_checkpoint(cfg)


def _w4a8(cfg):
    cfg = copy.deepcopy(cfg)
    cfg["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8,
        "type": "int",
        "strategy": "token",
        "dynamic": True,
        "symmetric": True,
    }
    return cfg


def test_ct_activation_quantization_is_not_weight_only():
    with pytest.raises(
        ValueError,
        match=r"config_groups\.group_0\.input_activations=.* is not supported \(activation quantization is not "
        r"weight-only\); supported: null \(W4A16 / W8A16\)",
    ):
        parse_compressed_tensors(_w4a8(MIXTRAL_8X22B_CT_W4A16))


def test_ct_output_activation_quantization_is_not_weight_only():
    cfg = copy.deepcopy(CT_GS128_ASYM)
    cfg["config_groups"]["group_0"]["output_activations"] = {"num_bits": 8, "type": "int", "strategy": "tensor"}
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.output_activations=.* is not supported"):
        parse_compressed_tensors(cfg)
    dense = {**CT_GS128_ASYM, "sparsity_config": {"format": "dense", "targets": []}}
    assert parse_compressed_tensors(dense).scheme == parse_compressed_tensors(CT_GS128_ASYM).scheme


def test_is_wna16_checkpoint_never_raises_on_odd_input():
    for cfg in (None, {}, [], "gptq", 3, {"quant_method": 5}, {"quant_method": "gptq"}):
        assert not is_wna16_checkpoint(cfg)


# Any JSON-ish value replacing any key of a valid config either parses or raises ValueError.
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-200, 200) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(obj, path=()):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield path + (key,)
            yield from _paths(value, path + (key,))


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(VALID_CONFIGS)), data=st.data(), value=_json, delete=st.booleans())
def test_fuzzed_config_raises_only_value_error(name, data, value, delete):
    cfg = copy.deepcopy(VALID_CONFIGS[name])
    path = data.draw(st.sampled_from(list(_paths(cfg))))
    parent = cfg
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    try:
        parsed = parse_quantization_config(cfg)
    except ValueError:
        assert not is_wna16_checkpoint(cfg)
        return
    assert isinstance(parsed.scheme, WNA16Scheme)
    for prefix in ("model.layers.0.mlp.experts", "model.layers.0.self_attn.qkv_proj", "lm_head"):
        try:
            parsed.scheme_for(prefix)
        except ValueError:
            pass


# ---------------------------------------------------------------- effective_group_size

GS128 = _scheme(4, 128, False, PackFormat.GPTQ, src="gptq")
GS32 = _scheme(4, 32, False, PackFormat.GPTQ, src="gptq")
CHANNEL = _scheme(4, -1, False, PackFormat.CT_PACKED, src="compressed-tensors")


@pytest.mark.parametrize(
    "scheme, full_k, tp, expected",
    [
        pytest.param(GS128, 768, 1, 128, id="qwen3-30b-I768-tp1"),
        pytest.param(GS128, 768, 2, 128, id="qwen3-30b-I768-tp2"),  # K=384
        pytest.param(GS128, 768, 4, 64, id="qwen3-30b-I768-tp4"),  # K=192: scales repeated twice
        pytest.param(GS128, 768, 8, 32, id="qwen3-30b-I768-tp8"),  # K=96: the TP8 crash shape
        pytest.param(GS32, 1344, 1, 32, id="k1344-gs32"),
        pytest.param(GS128, 2688, 2, 64, id="k1344-gs128-tp2"),  # K=1344 = 64 * 21
        pytest.param(CHANNEL, 704, 1, 704, id="gemma4-704-channel-tp1"),
        pytest.param(CHANNEL, 704, 2, 352, id="gemma4-704-channel-tp2"),
        pytest.param(CHANNEL, 704, 4, 176, id="gemma4-704-channel-tp4"),
        pytest.param(GS128, 2048, 1, 128, id="hidden-2048"),
    ],
)
def test_effective_group_size_real_shapes(scheme, full_k, tp, expected):
    size_k = full_k // tp
    g = effective_group_size(scheme, size_k, layer="model.layers.0.mlp.experts", tp_size=tp)
    assert g == expected
    assert size_k % g == 0 and (scheme.is_channelwise or scheme.group_size % g == 0)
    assert effective_group_size(scheme, size_k, layer="x", full_size_k=full_k) == expected


def test_effective_group_size_regrouping_is_exact():
    # Every new group of g columns on every rank lies inside exactly one checkpoint group.
    for full_k, tp in ((768, 8), (768, 4), (2688, 2)):
        size_k = full_k // tp
        g = effective_group_size(GS128, size_k, layer="x", tp_size=tp)
        for rank in range(tp):
            for start in range(rank * size_k, (rank + 1) * size_k, g):
                assert start // 128 == (start + g - 1) // 128


def test_effective_group_size_impossible_names_working_tp_sizes():
    # Full K=384 (3 groups of 128) at TP16 -> K=24 per rank: gcd(128, 24)=8 < 16.
    with pytest.raises(
        ValueError,
        match=re.escape(
            "model.layers.3.mlp.experts: K=24 per rank (tp_size=16, full K=384) cannot use "
            "quantization_config.group_size=128"
        )
        + r".*re-grouping to gcd\(group_size, K\)=8 needs at least 16.*tensor-parallel sizes that work: 1, 2, 3, 4, "
        r"6, 8, 12$",
    ):
        effective_group_size(GS128, 24, layer="model.layers.3.mlp.experts", tp_size=16)


def test_effective_group_size_checkpoint_groups_must_tile_full_k():
    # K=1344 unsplit with group 128: the checkpoint's last group would be partial.
    # No split helps, so no TP sizes are listed: the group size is named as the likely config error.
    with pytest.raises(ValueError, match=r"^layer: quantization_config.group_size=128 does not divide the full K=1344: "
                                         r".*whole groups along K, at any tensor-parallel size"):  # fmt: skip
        effective_group_size(GS128, 1344, layer="layer")
    # the same at TP 2 (672 per rank): the full K decides, not the rank's
    with pytest.raises(ValueError, match=r"does not divide the full K=1344"):
        effective_group_size(GS128, 672, layer="layer", tp_size=2)


def test_effective_group_size_act_order_regroups_like_plain_groups():
    # Full K=768, group 128, act order: TP4 gives K=192 per rank. The triton backend pads a rank's partial
    # act-order groups (backends.base.sort_act_order); the effective group size is the plan before loading
    # and what a trivial g_idx runs with. Formerly refused ("act order is never re-grouped").
    act = WNA16Scheme(bits=4, group_size=128, has_zero_point=False, pack_format=PackFormat.GPTQ, desc_act=True)
    assert effective_group_size(GS128, 192, layer="x", tp_size=4) == 64
    assert effective_group_size(act, 192, layer="x", tp_size=4) == 64
    assert effective_group_size(act, 384, layer="x", tp_size=2) == 128
    ct_act = WNA16Scheme(bits=4, group_size=128, has_zero_point=False, pack_format=PackFormat.CT_PACKED, desc_act=True)
    assert effective_group_size(ct_act, 96, layer="x", tp_size=8) == 32
    # where no exact group size fits K per rank, act order is refused as plain groups are
    with pytest.raises(ValueError, match=r"K=24 per rank \(tp_size=16, full K=384\) cannot use quantization_config"):
        effective_group_size(act, 24, layer="model.layers.3.mlp.experts", tp_size=16)


def test_effective_group_size_rejects_bad_k():
    with pytest.raises(ValueError, match=r"layer: K=0 must be a positive int"):
        effective_group_size(GS128, 0, layer="layer")


@pytest.mark.parametrize(
    "rule, shard",
    [
        pytest.param({r"+:.*down_proj": {"bits": 8}}, "down_proj", id="down-int8"),
        pytest.param({r"+:.*down_proj": {"group_size": 64}}, "down_proj", id="down-gs64"),
        pytest.param({r"+:.*gate_proj": {"sym": False}}, "gate_proj", id="gate-asym"),
        pytest.param({r"-:.*experts\.\d+\.up_proj": {}}, "up_proj", id="up-unquantized"),
        pytest.param({r"+:.*experts\.\d+\.w2": {"bits": 8}}, "w2", id="mixtral-w2-int8"),
    ],
)
def test_gptq_dynamic_rules_giving_one_expert_projection_its_own_scheme_are_refused(rule, shard):
    # GPTQModel quantized the projection so; vLLM (and the plugin, as vLLM) read the layer at its own name and
    # loaded it wrongly: a shape error deep in the loader, or zero points read as symmetric
    cfg = parse_gptq({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
                      "dynamic": rule})  # fmt: skip
    with pytest.raises(ValueError, match=rf"model\.layers\.3\.mlp\.experts: quantization_config\.dynamic rule .* makes "
                                         rf"the experts' {shard} .*does not match the MoE layer's own name"):  # fmt: skip
        cfg.scheme_for("model.layers.3.mlp.experts", moe=True)
    assert cfg.scheme_for("model.layers.3.mlp.down_proj", moe=False) is not None  # a dense MLP's: its own rule


@pytest.mark.parametrize("rules", [{r"-:.*mlp\.experts\..*": {}}, {r"-:.*experts\.\d+\.(gate|up|down)_proj": {}},
                                   {r"-:.*gate_proj": {}, r"-:.*up_proj": {}, r"-:.*down_proj": {}}])  # fmt: skip
def test_gptq_dynamic_rules_skipping_every_expert_projection_leave_the_layer_unquantized(rules):
    # GPTQModel's per-module form of "the experts were left float": every projection skipped by a rule matching it,
    # none matching the layer's own name. One verdict for all projections: the layer is unquantized (not refused)
    cfg = parse_gptq({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
                      "dynamic": rules})  # fmt: skip
    assert cfg.scheme_for("model.layers.3.mlp.experts", moe=True) is None
    assert cfg.scheme_for("model.layers.3.self_attn.o_proj", moe=False) is not None


def test_gptq_dynamic_rules_matching_the_moe_layer_still_apply():
    cfg = parse_gptq({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
                      "dynamic": {r"-:.*layers\.0\..*": {}, r"+:.*mlp\.experts.*": {"bits": 8}}})  # fmt: skip
    assert cfg.scheme_for("model.layers.3.mlp.experts", moe=True).bits == 8  # prefix and shards: one rule
    assert cfg.scheme_for("model.layers.0.mlp.experts", moe=True) is None  # skipped whole
    # rules for the layer's name alone, as vLLM reads them (its get_dynamic_override at the layer prefix)
    for rules, want in (({r"-:.*mlp\.experts$": {}}, None), ({r"+:.*mlp\.experts$": {"bits": 8}}, 8)):
        cfg = parse_gptq({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
                          "dynamic": rules})  # fmt: skip
        got = cfg.scheme_for("model.layers.3.mlp.experts", moe=True)
        assert (got if got is None else got.bits) == want, rules
