"""_vllm.py's version-dependent forms, on whichever vLLM this environment has (CI runs 0.26 and 0.34).

Each test pins one ledger row: the detection picks the form this vLLM has, and the forms of other
versions are driven through stand-ins with the exact signatures those versions have.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from vllm_wna16_plugin import _vllm


def test_a_moe_layer_class_is_found():
    import vllm.model_executor.layers.fused_moe as fm

    cls = _vllm.fused_moe_layer_cls()
    assert cls is (getattr(fm, "FusedMoEFactory", None) or fm.FusedMoE)
    assert {"num_experts", "top_k", "hidden_size", "intermediate_size", "quant_config", "prefix"} <= set(
        inspect.signature(cls).parameters
    )


# gptq_marlin_moe_repack as vLLM 0.26-0.29 and 0.30-0.34 define it (bodies record the call)
def _repack_026(b_q_weight, perm, size_k, size_n, num_bits, is_a_8bit=False):
    return ("0.26", tuple(perm.shape), size_k, size_n, num_bits)


def _repack_034(b_q_weight, size_k, size_n, num_bits):
    return ("0.34", size_k, size_n, num_bits)


@pytest.mark.parametrize(
    "repack,want", [(_repack_026, ("0.26", (3, 0), 256, 128, 4)), (_repack_034, ("0.34", 256, 128, 4))]
)
def test_marlin_repack_is_called_in_each_versions_form(monkeypatch, repack, want):
    class Ops:
        gptq_marlin_moe_repack = staticmethod(repack)

    monkeypatch.setattr(_vllm, "vllm_custom_ops", lambda: Ops)
    q = torch.zeros(3, 32, 128, dtype=torch.int32)
    assert _vllm.marlin_moe_repack(q, 256, 128, 4) == want


def test_marlin_repack_of_this_vllm_is_one_of_the_known_forms():
    try:
        fn = _vllm.vllm_custom_ops().gptq_marlin_moe_repack
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"vLLM's custom ops do not import here: {exc}")
    params = list(inspect.signature(fn).parameters)
    assert params[:4] in (["b_q_weight", "perm", "size_k", "size_n"], ["b_q_weight", "size_k", "size_n", "num_bits"])


def _marlin_026(hidden_states, w1, w2, *a, is_k_full: bool = True, g_idx1=None, **kw):
    return ("0.26", is_k_full)


def _marlin_034(hidden_states, w1, w2, *a, workspace=None, **kw):
    return ("0.34", sorted(kw))


@pytest.mark.parametrize("fn,want", [(_marlin_026, ("0.26", True)), (_marlin_034, ("0.34", ["quant_type_id"]))])
def test_fused_marlin_moe_gets_is_k_full_only_where_it_exists(monkeypatch, fn, want):
    real_get = _vllm._get
    monkeypatch.setattr(_vllm, "_get", lambda mod, name: fn if name == "fused_marlin_moe" else real_get(mod, name))
    assert _vllm.fused_marlin_moe_fn()(0, 1, 2, quant_type_id=7) == want


def test_fused_marlin_moe_of_this_vllm_takes_what_the_marlin_backend_passes():
    fn = _vllm.fused_marlin_moe_fn()
    target = getattr(fn, "__wrapped__", None) or _vllm._get(
        "vllm.model_executor.layers.fused_moe.experts.marlin_moe", "fused_marlin_moe"
    )
    params = set(inspect.signature(target).parameters)
    assert {
        "quant_type_id",
        "global_num_experts",
        "activation",
        "expert_map",
        "w1_zeros",
        "w2_zeros",
        "workspace",
    } <= params


# ------------------------------------------------------------------ act order's g_idx


def _names():
    return [
        "model.layers.0.mlp.experts.3.gate_proj.g_idx",
        "model.layers.0.mlp.experts.3.gate_proj.qweight",
        "model.layers.0.block_sparse_moe.experts.1.w2.g_idx",
        "model.layers.0.self_attn.q_proj.g_idx",
        "model.layers.0.mlp.shared_experts.up_proj.g_idx",
        "model.layers.0.self_attn.q_proj.qweight",
    ]


def test_checkpoint_mapper_keeps_only_the_experts_g_idx(vllm_cpu):
    from vllm.model_executor.layers.quantization import get_quantization_config

    cfg = get_quantization_config("moe_wna16_plus").from_config(
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}
    )
    mapper = cfg.get_checkpoint_weight_mapper()
    kept = [name for name, _ in mapper.apply((n, torch.zeros(1)) for n in _names())]
    assert kept == [
        "model.layers.0.mlp.experts.3.gate_proj.g_idx",
        "model.layers.0.mlp.experts.3.gate_proj.qweight",
        "model.layers.0.block_sparse_moe.experts.1.w2.g_idx",
        "model.layers.0.self_attn.q_proj.qweight",
    ]
    if _vllm.has_checkpoint_weight_mapper():  # 0.30+: vLLM's own default would have dropped the experts' too
        base = _vllm.quantization_config_base().get_checkpoint_weight_mapper()
        dropped = [n for n in _names() if n not in {k for k, _ in base.apply((n, torch.zeros(1)) for n in _names())}]
        assert "model.layers.0.mlp.experts.3.gate_proj.g_idx" in dropped


def test_act_order_linear_layers_are_refused_by_name_where_vllm_refuses_them(vllm_cpu, tmp_path):
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization import get_quantization_config

    raw = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}
    cfg = get_quantization_config("moe_wna16_plus").from_config(raw)
    try:
        _vllm.in_tree_linear_config("gptq", raw)
    except ValueError:
        vllm_refuses = True
    else:
        vllm_refuses = False
    prefix = "model.layers.0.self_attn.o_proj"
    if vllm_refuses:  # 0.30+: in-tree GPTQ has no act order with groups
        with pytest.raises(ValueError, match=r"linear layer 'model\.layers\.0\.self_attn\.o_proj' is stored quantized"):
            ReplicatedLinear(128, 128, bias=False, quant_config=cfg, prefix=prefix)
    else:  # 0.26-0.29: vLLM's GPTQ config takes it (which linear method it picks on CPU is vLLM's choice)
        ReplicatedLinear(128, 128, bias=False, quant_config=cfg, prefix=prefix)


# ------------------------------------------------------------------ --moe-backend names


def test_vllm_moe_backend_names_include_the_ones_we_honour():
    names = _vllm.vllm_moe_backend_names()
    assert {"auto", "triton", "marlin", "humming", "emulation"} <= set(names)


def test_other_vllm_moe_backends_are_refused_with_the_reason():
    from vllm_wna16_plugin.oracle import resolve_request

    with pytest.raises(
        ValueError, match=r"'flashinfer_trtllm' is one of vLLM's MoE backends, but not one for weight-only"
    ):
        resolve_request("flashinfer-trtllm", env={})
    with pytest.raises(ValueError, match=r"'warp_drive' is not a MoE backend of this vLLM; .*'humming'"):
        resolve_request("warp_drive", env={})
    assert resolve_request("humming", env={}) == ("humming", "--moe-backend")


# ------------------------------------------------------------------ logging


def test_plugin_info_reaches_vllms_handler_once_an_entry_point_configures_logging():
    """What LLM(...), the engine core and `vllm serve` do first (0.31+: lazily; 0.26-0.30: at import);
    then the backend explanation, logged while the model loads, is an INFO line in vLLM's format."""
    code = (
        "import vllm.logger as L\n"
        "if hasattr(L, 'configure_logging_if_needed'):\n"
        "    from vllm.config.logging import LoggingConfig\n"
        "    L.configure_logging_if_needed(LoggingConfig())\n"
        "from vllm_wna16_plugin import moe_method\n"
        "moe_method.logger.info('explained-by-the-method')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_CONFIGURE_LOGGING": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in (out.stdout + out.stderr).splitlines() if "explained-by-the-method" in ln)
    assert "INFO" in line and line != "explained-by-the-method", line


def test_our_cli_configures_vllms_logging_itself():
    """`vllm-wna16` builds layers without a vLLM entry point: it must configure vLLM's logger (0.31+)."""
    code = (
        "import logging\n"
        "from vllm_wna16_plugin import _vllm\n"
        "_vllm.configure_logging()\n"
        "from vllm_wna16_plugin.kernels.triton import td_gate\n"
        "td_gate.logger.info('explained-by-the-gate')\n"
        "print('HANDLERS', len(logging.getLogger('vllm').handlers))\n"
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_CONFIGURE_LOGGING": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HANDLERS 0" not in out.stdout
    line = next(ln for ln in (out.stdout + out.stderr).splitlines() if "explained-by-the-gate" in ln)
    assert "INFO" in line, line


def test_ledger_names_every_vllm_symbol_module():
    """Every `vllm.` module _vllm.py imports appears in its ledger (one row per touch)."""
    import re

    src = inspect.getsource(_vllm)
    ledger = _vllm.__doc__
    modules = set(re.findall(r'"(vllm(?:\.\w+)+)"', src)) - {"vllm.config.logging"}
    missing = [m for m in modules if m.split(".")[-1] not in ledger and m.removeprefix("vllm.") not in ledger]
    assert not missing, missing
    json.dumps(sorted(modules))  # the list stays printable in the failure above


def test_the_plugins_variable_wins_over_moe_backend_and_says_so():
    from vllm_wna16_plugin.oracle import ENV_BACKEND, resolve_request

    env = {ENV_BACKEND: "reference"}
    assert resolve_request("auto", env=env) == ("reference", ENV_BACKEND)
    assert resolve_request("emulation", env=env) == ("reference", ENV_BACKEND)  # the same backend: nothing to say
    assert resolve_request("deep_gemm", env=env) == ("reference", f"{ENV_BACKEND} (over --moe-backend=deep_gemm)")
    assert resolve_request("Triton", env=env) == ("reference", f"{ENV_BACKEND} (over --moe-backend=triton)")


def test_vllms_in_tree_path_is_read_for_doctor():
    """doctor's column of what vLLM's in-tree moe_wna16 launches (the heuristic the plugin replaces), through
    _vllm only: its CUDA kernel's BLOCK_SIZE_K for int4 gs32-128 at <= 6 pairs per expert (Qwen3-30B-A3B's
    gate/up GEMM at M=16: 128 pairs over 128 experts), its Triton path otherwise (int8, more pairs)."""
    path, k = _vllm.moe_wna16_in_tree_path(16, 8, 128, 2048, 1536, 128, 4)
    assert path == "cuda" and isinstance(k, int) and k > 0 and 2048 % k == 0, k
    assert _vllm.moe_wna16_in_tree_path(16, 8, 128, 2048, 1536, 128, 8) == ("triton", None)
    assert _vllm.moe_wna16_in_tree_path(128, 8, 128, 2048, 1536, 128, 4) == ("triton", None)
