"""A checkpoint's stored tensors against its quantization_config (stored_tensors.py), as `vllm-wna16 doctor` and
loading judge them: the format the tensors are written in, experts the config leaves unquantized, zero points and
act order the config asks for and the file lacks. Each on checkpoints written by make_checkpoint, whose config is
then changed the way a user's hand edit or a writer's bug would."""

from __future__ import annotations

import json
import re

import pytest

from vllm_wna16_plugin.stored_tensors import format_mismatch, scheme_tensors_absent, stored_format
from vllm_wna16_plugin.tools.doctor import resolve_checkpoint, stored_tensors
from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

SMALL = dict(hidden=128, intermediate=64, experts=4, top_k=2, layers=1)
LAYER = "model.layers.0.mlp.experts"
# a config for each format, as its writers emit it (bits 4, group 32)
CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
            }
        },
        "ignore": ["lm_head"],
    },
}


def _write(tmp_path, fmt, **kw):
    return make_checkpoint(tmp_path / f"ck-{fmt}", fmt=fmt, group_size=32, sym=fmt != "awq", **SMALL, **kw)


def _set_quant(path, quant: dict) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_quant(path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def _load_config(path):
    """The plugin's config as vLLM makes it for this checkpoint (from_config, then maybe_update_config)."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    import vllm_wna16_plugin

    vllm_wna16_plugin.register()
    cfg = get_quantization_config("moe_wna16_plus").from_config(
        json.loads((path / "config.json").read_text())["quantization_config"]
    )
    cfg.maybe_update_config(str(path))
    return cfg


def _build_layer(vllm_cpu, cfg):
    from vllm_wna16_plugin import _vllm

    return _vllm.build_routed_experts(vllm_cpu, cfg, num_experts=4, top_k=2, hidden=128, intermediate=64,
                                      prefix=LAYER, ckpt_names=("gate_proj", "down_proj", "up_proj"))  # fmt: skip


@pytest.mark.parametrize(
    "fmt, kw",
    [("gptq", {}), ("gptq", dict(bits=8)), ("gptq", dict(desc_act=True)), ("gptq", dict(group_size=-1)),
     ("gptq", dict(sym=False, checkpoint_format="gptq_v2")), ("awq", {}), ("compressed-tensors", {}),
     ("compressed-tensors", dict(sym=False)), ("compressed-tensors", dict(desc_act=True))],
)  # fmt: skip
def test_every_format_is_told_by_its_tensors(tmp_path, fmt, kw):
    path = make_checkpoint(tmp_path / "ck", fmt=fmt, **{"group_size": 32, "sym": fmt != "awq", **SMALL, **kw})
    stored = stored_tensors(path)
    assert stored_format(stored)[0] == fmt
    assert format_mismatch(fmt, stored) is None
    resolve_checkpoint(path)  # and doctor passes it


def test_gptq_and_awq_without_g_idx_are_told_by_the_packed_axis(tmp_path):
    for fmt in ("gptq", "awq"):
        stored = {k: v for k, v in stored_tensors(_write(tmp_path, fmt)).items() if not k.endswith(".g_idx")}
        found, evidence = stored_format(stored)
        assert found == fmt and ("packed along K" if fmt == "gptq" else "packed along N") in evidence
    assert stored_format({"a.qweight": {"dtype": "I32"}}) is None  # no shapes, no g_idx: nothing to tell
    assert stored_format({"a.weight": {"dtype": "BF16", "shape": [4, 4]}}) is None


@pytest.mark.parametrize("written, labelled", [(w, lab) for w in CONFIGS for lab in CONFIGS if w != lab])
def test_a_config_naming_another_format_is_refused_by_doctor_and_at_load(tmp_path, written, labelled):
    """Before, loading GPTQ tensors under quant_method "awq" failed in vLLM with "Layer ... has no parameter
    'w2_g_idx'" (an AttributeError) and doctor passed it."""
    path = _write(tmp_path, written)
    _set_quant(path, CONFIGS[labelled])
    want = (
        rf"quantization_config\.quant_method='{labelled}', but the checkpoint's tensors are stored as {written} .*"
        + re.escape(f'set "quant_method": "{written}"')
    )
    with pytest.raises(ValueError, match=want):
        resolve_checkpoint(path)
    with pytest.raises(ValueError, match=want):
        _load_config(path)


@pytest.mark.parametrize(
    "fmt, edit",
    [("awq", lambda q: q.update(modules_to_not_convert=["mlp.gate", "mlp.experts"])),
     ("compressed-tensors", lambda q: q["ignore"].append("re:.*mlp.experts.*"))],
    ids=["awq-modules_to_not_convert", "ct-ignore"],
)  # fmt: skip
def test_doctor_refuses_experts_the_config_leaves_unquantized_but_the_file_stores_quantized(tmp_path, fmt, edit):
    """Loading refused these (test_quant_config); doctor said "unquantized (vLLM's unquantized MoE method)"."""
    path = _write(tmp_path, fmt)
    _edit_quant(path, edit)
    with pytest.raises(ValueError, match=rf"{LAYER}: quantization_config leaves its routed experts unquantized .* "
                                         rf"stores them quantized \({LAYER}\.0\.down_proj\)"):  # fmt: skip
        resolve_checkpoint(path)


@pytest.mark.parametrize(
    "change, field, leaf, fix",
    [({"symmetric": False}, '"symmetric": false', "weight_zero_point", '"symmetric": true'),
     ({"actorder": "group"}, '"actorder": "group"', "weight_g_idx", '"actorder": null')],
    ids=["zero-points", "act-order"],
)  # fmt: skip
def test_zero_points_or_act_order_the_file_never_stored_are_named_by_the_config_field(
    vllm_cpu, tmp_path, change, field, leaf, fix
):
    """Before, loading listed every expert's tensor as missing ("is the checkpoint complete?") and doctor passed."""
    path = _write(tmp_path, "compressed-tensors")
    _edit_quant(path, lambda q: q["config_groups"]["group_0"]["weights"].update(change))
    want = (rf"{LAYER}: quantization_config says {re.escape(field)}.* stores no {leaf} for any of the layer's 12 "
            rf"quantized expert projections .* set {re.escape(fix)}")  # fmt: skip
    with pytest.raises(ValueError, match=want):
        resolve_checkpoint(path)
    with pytest.raises(ValueError, match=want):
        _build_layer(vllm_cpu, _load_config(path))


def test_a_file_holding_some_of_them_is_left_to_the_load_s_missing_list(tmp_path):
    """One expert's zero points present: incomplete, not misconfigured; the check speaks only for none stored."""
    path = make_checkpoint(tmp_path / "ck", fmt="compressed-tensors", group_size=32, sym=False, **SMALL)
    stored = set(stored_tensors(path))
    cfg = resolve_checkpoint(path)
    scheme = cfg.groups[0].scheme
    assert scheme_tensors_absent(scheme, LAYER, stored) is None
    some = {n for n in stored if not (n.endswith("weight_zero_point") and ".experts.0." not in n)}
    assert scheme_tensors_absent(scheme, LAYER, some) is None
    none = {n for n in stored if not n.endswith("weight_zero_point")}
    assert "weight_zero_point" in str(scheme_tensors_absent(scheme, LAYER, none))
