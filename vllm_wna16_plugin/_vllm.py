"""The only module that touches vLLM internals. A vLLM bump is this one file.

Ledger (one entry per symbol outside vLLM's documented plugin API):

| symbol | why | checked in | remove when |
|---|---|---|---|
| model_executor.layers.quantization.register_quantization_config / get_quantization_config | registers `moe_wna16_plus`; looks it up for layers built without an engine | 0.26.0 | public API |
| ...quantization.base_config.QuantizationConfig / QuantizeMethodBase | base classes of our config/method | 0.26.0 | public API |
| ...fused_moe.FusedMoEMethodBase, RoutedExperts, UnquantizedFusedMoEMethod | the MoE method contract and the layer it owns | 0.26.0 | - |
| ...fused_moe.config.int4_w4a16_moe_quant_config / int8_w8a16_moe_quant_config | `get_fused_moe_quant_config` (read by vLLM's runner) | 0.26.0 | - |
| RoutedExperts._map_global_expert_id_to_local_expert_id | expert-parallel weight loading | 0.26.0 | vLLM exposes the map publicly |
| FusedMoEConfig.tp_rank / tp_size / moe_backend | TP sharding and `--moe-backend` | 0.26.0 | - |
| ...linear.LinearBase, UnquantizedLinearMethod | delegation of linear layers | 0.26.0 | - |
| ...quantization.auto_gptq.AutoGPTQConfig, auto_awq.AutoAWQConfig, compressed_tensors.CompressedTensorsConfig | linear layers run vLLM's in-tree method of the format | 0.26.0 | - |
| transformers_utils.config.get_safetensors_params_metadata | which linear modules are stored quantized (as AutoGPTQConfig.maybe_update_config does) | 0.26.0 | - |
| ...fused_moe.moe_align_block_size.moe_align_block_size | token alignment for our kernels on GPU | 0.26.0 | - |
| vllm._custom_ops.moe_wna16_gemm / moe_sum | the `vllm_cuda` backend (vLLM's CUDA GEMM with our legal configs) | 0.26.0 | our csrc kernel replaces it |
| ...fused_moe.experts.marlin_moe.fused_marlin_moe + marlin_utils repack helpers | the `marlin` backend | 0.26.0 | - |
| config.VllmConfig / DeviceConfig / set_current_vllm_config, distributed.init_distributed_environment / initialize_model_parallel, FusedMoE(...) | building our MoE layers on CPU without an engine (`vllm-wna16 demo` without a GPU, layer tests) | 0.26.0 | - |

Every import is lazy (inside a function) so `import vllm_wna16_plugin` stays cheap and
works without vLLM; callers get a clear error when vLLM is missing.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import tempfile
from collections.abc import Iterator
from typing import Any

SUPPORTED_VLLM = ((0, 26), (0, 27))  # [min, max) by (major, minor)


def vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # noqa: BLE001 - not installed, or broken metadata
        return None


def check_vllm_version(version: str | None = None) -> None:
    """Raise a clear error when the installed vLLM is not one this plugin supports."""
    version = version if version is not None else vllm_version()
    if version is None:
        raise RuntimeError("vllm-wna16-plugin needs vLLM installed (pip install 'vllm>=0.26,<0.27')")
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        raise RuntimeError(f"cannot parse the vLLM version {version!r}") from None
    lo, hi = SUPPORTED_VLLM
    if not (lo <= major_minor < hi):
        raise RuntimeError(
            f"vllm-wna16-plugin supports vLLM >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}; "
            f"found vLLM {version}. Install a matching vLLM or a plugin release for yours."
        )


def init_logger(name: str) -> logging.Logger:
    """vLLM's logger for a plugin module, named under `vllm.` so that vLLM's handler prints it.

    vLLM configures only the `vllm` logger (its handler, VLLM_LOGGING_LEVEL; no propagation). A
    logger named `vllm_wna16_plugin.x` would sit under the root logger, whose last-resort handler
    drops INFO: the backend explanation never reached `vllm serve`'s log (H200, 2026-12-03).
    Without vLLM (doctor on a laptop) a standard logger of the same name."""
    name = name if name.startswith("vllm.") else f"vllm.{name}"
    try:
        from vllm.logger import init_logger as _init

        return _init(name)
    except Exception:  # noqa: BLE001
        return logging.getLogger(name)


def _get(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------ config / method bases


def quantization_config_base():
    return _get("vllm.model_executor.layers.quantization.base_config", "QuantizationConfig")


def register_quantization_config(name: str, cls) -> None:
    _get("vllm.model_executor.layers.quantization", "register_quantization_config")(name)(cls)


def quantization_config_cls(name: str):
    """The QuantizationConfig class vLLM has registered under `name`."""
    return _get("vllm.model_executor.layers.quantization", "get_quantization_config")(name)


def fused_moe_method_base():
    return _get("vllm.model_executor.layers.fused_moe", "FusedMoEMethodBase")


def routed_experts_cls():
    return _get("vllm.model_executor.layers.fused_moe", "RoutedExperts")


def linear_base_cls():
    return _get("vllm.model_executor.layers.linear", "LinearBase")


def unquantized_linear_method():
    return _get("vllm.model_executor.layers.linear", "UnquantizedLinearMethod")()


def unquantized_moe_method(moe_config):
    return _get("vllm.model_executor.layers.fused_moe", "UnquantizedFusedMoEMethod")(moe_config)


def in_tree_linear_config(quant_method: str, raw: dict):
    """vLLM's own QuantizationConfig for the checkpoint's format (linear layers go there)."""
    if quant_method == "gptq":
        cls = _get("vllm.model_executor.layers.quantization.auto_gptq", "AutoGPTQConfig")
    elif quant_method == "awq":
        cls = _get("vllm.model_executor.layers.quantization.auto_awq", "AutoAWQConfig")
    elif quant_method == "compressed-tensors":
        cls = _get(
            "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
            "CompressedTensorsConfig",
        )
    else:
        raise ValueError(f"no in-tree linear method for quant_method={quant_method!r}")
    return cls.from_config(raw)


def safetensors_params_metadata(model_name: str, revision: str | None = None) -> dict:
    """{param name: {"dtype": "I32", ...}} of a checkpoint's safetensors files (local or hub)."""
    return _get("vllm.transformers_utils.config", "get_safetensors_params_metadata")(model_name, revision=revision)


def set_weight_attrs(param, attrs: dict) -> None:
    _get("vllm.model_executor.utils", "set_weight_attrs")(param, attrs)


def fused_moe_quant_config(bits: int, w13_scales, w2_scales, w13_zeros, w2_zeros, group_size: int):
    """The FusedMoEQuantConfig vLLM's runner reads (it does not pick our kernels)."""
    mod = "vllm.model_executor.layers.fused_moe.config"
    builder = _get(mod, "int4_w4a16_moe_quant_config" if bits == 4 else "int8_w8a16_moe_quant_config")
    return builder(
        w1_scale=w13_scales, w2_scale=w2_scales, w1_zp=w13_zeros, w2_zp=w2_zeros, block_shape=[0, group_size]
    )


# ------------------------------------------------------------------ layer facts


def layer_tp(layer) -> tuple[int, int]:
    """(tp_rank, tp_size) of a RoutedExperts layer."""
    cfg = layer.moe_config
    return int(cfg.tp_rank), int(cfg.tp_size)


def layer_local_expert_id(layer, global_expert_id: int) -> int:
    """Local expert index on this rank, or -1 when the expert lives elsewhere (EP)."""
    return int(layer._map_global_expert_id_to_local_expert_id(global_expert_id))


def layer_moe_backend(layer_or_moe_config) -> str:
    cfg = getattr(layer_or_moe_config, "moe_config", layer_or_moe_config)
    return str(getattr(cfg, "moe_backend", "auto") or "auto")


def layer_activation(layer) -> str:
    act = getattr(layer, "activation", "silu")
    return str(getattr(act, "value", act))


# ------------------------------------------------------------------ platform


def platform_summary() -> tuple[str, int | None]:
    """("cuda"|"rocm"|"xpu"|"cpu", sm as major*10+minor or None) of the current process."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_xpu():
            return "xpu", None
        if current_platform.is_rocm():
            return "rocm", None
        if current_platform.is_cuda():
            cap = current_platform.get_device_capability()
            return "cuda", None if cap is None else cap.to_int()
    except Exception:  # noqa: BLE001
        pass
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return "cuda", major * 10 + minor
    return "cpu", None


# ------------------------------------------------------------------ kernels we call


def moe_align_block_size_fn():
    """vLLM's CUDA token alignment, or None when it cannot be imported."""
    try:
        return _get("vllm.model_executor.layers.fused_moe.moe_align_block_size", "moe_align_block_size")
    except Exception:  # noqa: BLE001
        return None


def vllm_custom_ops():
    return importlib.import_module("vllm._custom_ops")


def has_vllm_cuda_ops() -> bool:
    import torch

    try:
        ops = vllm_custom_ops()  # noqa: F841 - importing loads the extension
        return hasattr(torch.ops, "_moe_C") and hasattr(torch.ops._moe_C, "moe_wna16_gemm")
    except Exception:  # noqa: BLE001
        return False


def marlin_pieces() -> dict[str, Any]:
    """The vLLM pieces the marlin backend needs (GPU only)."""
    mu = "vllm.model_executor.layers.quantization.utils.marlin_utils"
    return {
        "ops": vllm_custom_ops(),
        "fused_marlin_moe": _get("vllm.model_executor.layers.fused_moe.experts.marlin_moe", "fused_marlin_moe"),
        "marlin_moe_permute_scales": _get(mu, "marlin_moe_permute_scales"),
        "moe_packed_to_marlin_zero_points": _get(mu, "moe_packed_to_marlin_zero_points"),
        "marlin_make_workspace_new": _get(mu, "marlin_make_workspace_new"),
        "marlin_moe_padded_intermediate": _get(mu, "marlin_moe_padded_intermediate"),
        "scalar_types": _get("vllm.scalar_type", "scalar_types"),
        "MoEActivation": _get("vllm.model_executor.layers.fused_moe.activation", "MoEActivation"),
    }


# ------------------------------------------------------------------ MoE layers without an engine


@contextlib.contextmanager
def cpu_layer_context() -> Iterator[Any]:
    """A VllmConfig on CPU plus a one-process gloo group, so FusedMoE layers can be built and
    run without a GPU or an engine (`vllm-wna16 demo` on CPU, the layer tests). Yields the
    VllmConfig. vLLM's distributed state is per process: enter this once per process."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mktemp(prefix='wna16-dist-')}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        yield cfg


def build_routed_experts(
    vllm_cfg,
    quant_config,
    *,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    prefix: str,
    ckpt_names: tuple[str, str, str],
    tp_size: int = 1,
    params_dtype=None,
):
    """vLLM's FusedMoE layer under `vllm_cfg` with `quant_config`; returns its RoutedExperts
    (the module our method owns: load_weights, quant_method, apply). ckpt_names are the
    checkpoint's (gate, down, up) projection names. A layer of the same prefix built
    earlier is forgotten first, so callers may rebuild layers."""
    import torch

    fused_moe_cls = _get("vllm.model_executor.layers.fused_moe", "FusedMoE")
    vllm_cfg.compilation_config.static_forward_context.pop(prefix, None)
    runner = fused_moe_cls(
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=intermediate,
        params_dtype=params_dtype or torch.bfloat16,
        quant_config=quant_config,
        tp_size=tp_size,
        prefix=prefix,
        ckpt_names=ckpt_names,
    )
    return runner.routed_experts
