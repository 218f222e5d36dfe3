"""The only module that touches vLLM internals. A vLLM bump is this one file.

The plugin runs on vLLM 0.26 through 0.34 from one codebase. Where vLLM changed, the form is chosen by
feature detection (does the attribute, keyword or class exist), never by comparing versions; the one
version comparison is `version_status`, which decides whether to register at all.

Ledger (one entry per symbol outside vLLM's documented plugin API; "0.26-0.34" = same form throughout;
checked in the unpacked wheels of every release 0.26.0 ... 0.34.0):

| symbol | why | forms by version (detected by) | remove when |
|---|---|---|---|
| model_executor.layers.quantization.register_quantization_config / get_quantization_config | registers `moe_wna16_plus`; looks it up for layers built without an engine | 0.26-0.34 | public API |
| ...quantization.base_config.QuantizationConfig / QuantizeMethodBase | base classes of our config/method | 0.26-0.34 (same six abstract methods) | public API |
| QuantizationConfig.get_checkpoint_weight_mapper | the base drops every `.g_idx` tensor; ours keeps the experts' (act order) | absent 0.26-0.29; 0.30-0.34 a WeightsMapper dropping suffix `.g_idx` (`has_checkpoint_weight_mapper`) | - |
| model_executor.models.utils.WeightsMapper | the mapper ours returns; the model's renames applied to the names our rules and the stored tensors use (`map_weight_name`) | 0.26-0.34; the name mapping is `_map_name` 0.26-0.34, also public as `map_name` from 0.31 | - |
| ...fused_moe.FusedMoEMethodBase, RoutedExperts, UnquantizedFusedMoEMethod | the MoE method contract and the layer it owns | 0.26-0.34 | - |
| ...fused_moe.FusedMoE / FusedMoEFactory | building a MoE layer without an engine (`fused_moe_layer_cls`) | `FusedMoE` 0.26; `FusedMoEFactory` 0.27-0.34, same keywords, returns the runner whose `.routed_experts` we own | - |
| ...fused_moe.config.int4_w4a16_moe_quant_config / int8_w8a16_moe_quant_config | `get_fused_moe_quant_config` (read by vLLM's runner) | 0.26-0.34 | - |
| RoutedExperts._map_global_expert_id_to_local_expert_id | expert-parallel weight loading | 0.26-0.34 | vLLM exposes the map publicly |
| RoutedExperts.global_num_experts / expert_map | every expert's scheme checked at config time (`layer_global_experts`); EP routing | 0.26-0.34 | - |
| RoutedExperts.ckpt_gate_proj_name / ckpt_up_proj_name / ckpt_down_proj_name | the names a layer's rules are probed with, as vLLM's compressed-tensors MoE method probes them (`layer_expert_names`: Mixtral's w1/w3/w2) | 0.26-0.34 (RoutedExperts' constructor arguments, default gate_proj/up_proj/down_proj; read with those defaults where absent) | - |
| FusedMoEConfig.tp_rank / tp_size / moe_backend | TP sharding and `--moe-backend` | 0.26-0.34 | - |
| config.kernel.MoEBackend (Literal) | vLLM's `--moe-backend` names, for a precise refusal (`vllm_moe_backend_names`) | 0.26-0.34, names added over time (batched_triton 0.27, b12x 0.29, rdna3 0.30, ...) | - |
| ...linear.LinearBase, UnquantizedLinearMethod | delegation of linear layers | 0.26-0.34 | - |
| ...layers.attention.Attention; ...compressed_tensors.CompressedTensorsKVCacheMethod | a compressed-tensors `kv_cache_scheme` (fp8 KV cache, the checkpoint's k/v scales) runs as vLLM's own config runs it: that method for Attention layers, built on our config (it reads only `kv_cache_scheme`; vLLM's whole config would refuse act-order experts from 0.30) | 0.26-0.34 (same paths) | - |
| ...vocab_parallel_embedding.ParallelLMHead | a GPTQ/AWQ `lm_head: true` head goes to the in-tree method (which takes it as a linear layer) | 0.26-0.34 | - |
| ...quantization.auto_gptq.AutoGPTQConfig, auto_awq.AutoAWQConfig, compressed_tensors.CompressedTensorsConfig | linear layers run vLLM's in-tree method of the format | 0.26-0.34 paths; from 0.30 GPTQ `desc_act` with groups and compressed-tensors `actorder: group` raise ValueError (we refuse per linear layer, naming it); AutoGPTQConfig takes `sym: true` only (its TYPE_MAP), so `sym: false` linears go to gptq_linear.py | - |
| transformers_utils.config.get_safetensors_params_metadata | which linear modules are stored quantized (as AutoGPTQConfig.maybe_update_config does) | 0.26-0.34 | - |
| ...fused_moe.moe_align_block_size.moe_align_block_size | token alignment for our kernels on GPU; the humming backend's (`ignore_invalid_experts=True`) | 0.26-0.34 (0.31 adds the optional `return_scatter_idx`) | - |
| envs.VLLM_MOE_SKIP_PADDING (a behaviour: not imported) | routers give CUDA-graph and DP padding rows expert id -1, a capture's dummy batch all of them: every kernel of ours skips id -1 (`kernels.align.PADDING_ID`, the Triton kernel's `expert == -1`, the hopper routing): the real rows come out exact, a padding row's output is left unspecified (vLLM discards it; the top-k sum adds its unwritten pairs), and a row mixing -1 with experts, which no router makes, is not supported (the functional API refuses -1) | 0.26 present, off by default; 0.34 on by default (releases between not checked) | - |
| ...fused_moe.moe_fused_mul_sum.moe_fused_mul_sum | the humming backend's top-k weighted sum (`align_and_weighted_sum_pieces`) | 0.26-0.34 (0.29 adds the optional `num_valid_tokens`) | - |
| vllm._custom_ops.moe_wna16_gemm / moe_sum | the `vllm_cuda` backend (vLLM's CUDA GEMM with our legal configs) | 0.26-0.34 (same op schemas) | our csrc kernel replaces it |
| vllm._custom_ops.gptq_marlin_moe_repack | the `marlin` backend's weight repack | `(q, perm, k, n, bits, is_a_8bit=False)` 0.26-0.29; `(q, k, n, bits, is_a_8bit=False)` 0.30-0.33; `(q, k, n, bits)` 0.34 (`marlin_moe_repack`: "perm" in its signature; `is_a_8bit` never passed) | - |
| ...fused_moe.experts.marlin_moe.fused_marlin_moe + marlin_utils helpers, fused_moe.activation.MoEActivation, scalar_type.scalar_types | the `marlin` backend | `is_k_full`/`g_idx`/`sort_indices` keywords 0.26-0.29, gone 0.30-0.34 (`fused_marlin_moe_fn`: "is_k_full" in its signature); its clamp/alpha/beta keywords (not passed) became `activation_config` in 0.28 | - |
| logger.configure_logging_if_needed, config.logging.LoggingConfig | our CLI tools' INFO lines in vLLM's format | absent 0.26-0.30 (vLLM configures at import); 0.31-0.34 configured lazily by entry points (`configure_logging`) | - |
| ...linear.LinearMethodBase, register_weight_loader_v2_supported_method | our asymmetric-GPTQ linear method (gptq_linear.py) loads through vLLM's parameter classes (weight_loader_v2 is chosen by class name) | 0.26-0.34, same form | - |
| model_executor.parameter.PackedvLLMParameter / PackedColumnParameter / GroupQuantScaleParameter / ChannelQuantScaleParameter / RowvLLMParameter, model_executor.utils.replace_parameter | GPTQ-layout linear parameters sharded and merged (qkv, gate_up) exactly as vLLM's AutoGPTQLinearMethod creates them | 0.26-0.34, same constructors; `replace_parameter` renames its third parameter in 0.28 and drops `prefer_copy` in 0.33 (we pass the three positionally) | - |
| kernels.linear.MPLinearLayerConfig + kernels.linear.mixed_precision.marlin.MarlinLinearKernel, scalar_type.scalar_types.uint4 | asymmetric GPTQ linears on vLLM's Marlin with integer (AWQ-style) zero points, as compressed-tensors' asymmetric W4A16 runs | 0.26-0.29: the config has a required `has_g_idx` and the kernel takes `w_gidx_param_name`; 0.30-0.34: neither (`marlin_zp_linear_kernel`: `dataclasses.fields`). Same zero-point input in both: the zp parameter's `.t()` is (G, N/pack) int32 packed along N, true zeros; `can_implement` takes uint4 only (no uint8 with zero points) | - |
| vllm._custom_ops.gptq_gemm / gptq_shuffle | asymmetric GPTQ linears Marlin cannot take (int8, act order, other group sizes), float16 only: vLLM's exllama kernel reads GPTQ v1 or v2 zero points natively | 0.26-0.29: `(a, q, qzeros, scales, g_idx, use_exllama, use_v2_format, bit)`, `gptq_shuffle(q, perm, bit)`; 0.30-0.34: no `g_idx` / `perm` (no act order) (`gptq_exllama_ops`: "b_g_idx" in its signature) | - |
| FusedMoEConfig.has_bias / swiglu_limit / swiglu_alpha / swiglu_beta / activation_situ_beta / activation_situ_linear_beta | experts with biases or a clamped/scaled gated activation (gpt-oss, EXAONE-MoE, Bailing-V3, Kimi SituGLU) are refused at load: our kernels compute neither (`layer_expert_math`) | `has_bias`, `swiglu_limit`, `swiglu_alpha`, `swiglu_beta` 0.26-0.34; `activation_situ_*` from 0.27 (read with a default) | - |
| config.get_current_vllm_config().cache_config.gpu_memory_utilization / resolved_gpu_memory_utilization() | how much memory composing a layer with Humming may take (`gpu_memory_utilization`) | a float, default 0.92, 0.26-0.33; 0.34 `None` by default, resolved by the method (1.0 with its extensible KV cache) | - |
| config.get_current_vllm_config().scheduler_config.max_num_batched_tokens | the largest batch a step runs: the hopper copy is kept only where its rule takes a batch up to it (`max_batched_tokens`) | an int 0.26-0.34 (read with getattr; None outside an engine) | - |
| config.VllmConfig / DeviceConfig / set_current_vllm_config, distributed.init_distributed_environment / initialize_model_parallel | building our MoE layers on CPU without an engine (`vllm-wna16 demo` without a GPU, layer tests) | 0.26-0.34 | - |
| ...fused_moe.fused_moe.get_moe_wna16_block_config (+ should_moe_wna16_use_cuda's rule, restated) | `doctor` shows the BLOCK_SIZE_K vLLM's in-tree moe_wna16 CUDA path would launch beside ours (`moe_wna16_in_tree_path`) | 0.26-0.34, same body | - |

Every import is lazy (inside a function) so `import vllm_wna16_plugin` stays cheap and
works without vLLM; callers get a clear error when vLLM is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import re
import tempfile
from collections.abc import Iterator
from typing import Any

# The version range is the one place a version string is compared; everything else is decided by
# feature detection (the ledger above). Lowest: the oldest vLLM the plugin was checked on (0.26.0);
# newest: the newest one CI tests (0.34.0). Newer vLLMs get a warning, not a refusal.
MIN_VLLM = (0, 26)
NEWEST_TESTED_VLLM = (0, 34)
VLLM_REQUIREMENT = "vllm>=0.26,<0.35"


@dataclasses.dataclass(frozen=True)
class VersionStatus:
    """Whether the plugin can register on a vLLM version: `ok`, or refuse/warn with `message`."""

    version: str | None
    register: bool  # False: moe_wna16_plus is not offered (too old, or no vLLM)
    message: str | None  # None: nothing to say; else an error (register=False) or a warning

    @property
    def ok(self) -> bool:
        return self.register and self.message is None


def vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # noqa: BLE001 - not installed, or broken metadata
        return None


def version_status(version: str | None = None) -> VersionStatus:
    """Judge a vLLM version against [MIN_VLLM, NEWEST_TESTED_VLLM]: refuse below, warn above, never raise.

    >>> version_status("0.34.0").ok, version_status("0.25.1").register, version_status("0.35.0").register
    (True, False, True)
    """
    version = version if version is not None else vllm_version()
    if version is None:
        return VersionStatus(None, False, f"vLLM is not installed; install it first ({VLLM_REQUIREMENT!r})")
    match = re.match(r"^\s*v?(\d+)\.(\d+)", version)
    if match is None:  # a source build without tags: let feature detection decide
        return VersionStatus(
            version, True, f"cannot read vLLM's version {version!r}; vllm-wna16-plugin is tested on {VLLM_REQUIREMENT}"
        )
    major_minor = (int(match.group(1)), int(match.group(2)))
    lo, hi = MIN_VLLM, NEWEST_TESTED_VLLM
    if major_minor < lo:
        return VersionStatus(
            version,
            False,
            f"vllm-wna16-plugin needs vLLM >= {lo[0]}.{lo[1]} and found vLLM {version}: quantization "
            f"'moe_wna16_plus' is not available. Upgrade vLLM (pip install '{VLLM_REQUIREMENT}') or "
            f"uninstall vllm-wna16-plugin",
        )
    if major_minor > hi:
        return VersionStatus(
            version,
            True,
            f"vllm-wna16-plugin is tested up to vLLM {hi[0]}.{hi[1]} and found vLLM {version}; carrying on. "
            f"Please report problems with the vLLM version in the issue",
        )
    return VersionStatus(version, True, None)


def init_logger(name: str) -> logging.Logger:
    """A logger for a plugin module, named under `vllm.` so that vLLM's handler prints it.

    vLLM configures only the `vllm` logger (its handler, VLLM_LOGGING_LEVEL; no propagation). A
    logger named `vllm_wna16_plugin.x` would sit under the root logger, whose last-resort handler
    drops INFO: the backend explanation never reached `vllm serve`'s log (H200, 2026-12-03).
    A plain `logging.getLogger`: vLLM's own init_logger only adds the *_once helpers, which the
    plugin does not use, and importing vLLM here cost the CLI tools 9 s before they did anything."""
    return logging.getLogger(name if name.startswith("vllm.") else f"vllm.{name}")


def configure_logging() -> None:
    """Give the `vllm` logger its handler as vLLM's own entry points do, for the plugin's CLI tools.

    vLLM 0.26-0.30 configure logging when `vllm.logger` is imported. From 0.31 only entry points do
    (`LLM(...)`, the engine core, `vllm serve`), through `configure_logging_if_needed`; a tool of ours
    that builds layers itself must call it, or its INFO lines (the backend explanation) are dropped.
    Never called from `register()`: a user's later `configure_logging=False` could not undo it."""
    try:
        from vllm import logger as vllm_logger

        configure = getattr(vllm_logger, "configure_logging_if_needed", None)
        if configure is None:
            return  # 0.26-0.30: configured at import
        configure(_get("vllm.config.logging", "LoggingConfig")())
    except Exception:  # noqa: BLE001 - logging set-up must never stop a tool
        pass


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


def attention_cls():
    return _get("vllm.model_executor.layers.attention", "Attention")


def ct_kv_cache_method(quant_config):
    """vLLM's compressed-tensors KV-cache method on `quant_config`, which needs only a `kv_cache_scheme`."""
    return _get(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
        "CompressedTensorsKVCacheMethod",
    )(quant_config)


def parallel_lm_head_cls():
    return _get("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead")


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


def has_checkpoint_weight_mapper() -> bool:
    """True where vLLM's QuantizationConfig maps checkpoint names (0.30+: its default drops every `.g_idx`)."""
    return hasattr(quantization_config_base(), "get_checkpoint_weight_mapper")


# A routed expert's tensors sit under `.experts.<id>.` in every MoE checkpoint vLLM loads (Qwen2/3-MoE
# `mlp.experts.3.gate_proj`, Mixtral `block_sparse_moe.experts.3.w1`, DeepSeek `mlp.experts.3.up_proj`);
# shared experts (`.shared_experts.`) are linear layers and do not match.
EXPERT_G_IDX = r"^(?!.*\.experts\.).*\.g_idx$"


def map_weight_name(mapper, name: str) -> str | None:
    """A checkpoint name through one of vLLM's WeightsMappers (None: the mapper drops it)."""
    fn = getattr(mapper, "map_name", None) or mapper._map_name
    return fn(name)


def weights_mapper_keeping_expert_g_idx():
    """vLLM's default mapper without its blanket `.g_idx` drop: act-order tensors of routed experts reach
    our layers; every other `.g_idx` is still dropped (vLLM's linear methods have no g_idx from 0.30)."""
    mapper_cls = _get("vllm.model_executor.models.utils", "WeightsMapper")
    return mapper_cls(orig_to_new_regex={re.compile(EXPERT_G_IDX): None})


def fused_moe_quant_config(bits: int, w13_scales, w2_scales, w13_zeros, w2_zeros, group_size: int):
    """The FusedMoEQuantConfig vLLM's runner reads (it does not pick our kernels)."""
    mod = "vllm.model_executor.layers.fused_moe.config"
    builder = _get(mod, "int4_w4a16_moe_quant_config" if bits == 4 else "int8_w8a16_moe_quant_config")
    return builder(
        w1_scale=w13_scales, w2_scale=w2_scales, w1_zp=w13_zeros, w2_zp=w2_zeros, block_shape=[0, group_size]
    )


# ------------------------------------------------------------------ asymmetric GPTQ linear layers (gptq_linear.py)


def linear_method_base():
    return _get("vllm.model_executor.layers.linear", "LinearMethodBase")


def register_weight_loader_v2(cls) -> None:
    """Let vLLM's linear layers load `cls`'s parameters with weight_loader_v2 (the parameter classes' own
    sharding); vLLM decides by class name, so registering twice is harmless but skipped."""
    linear = importlib.import_module("vllm.model_executor.layers.linear")
    if cls.__name__ not in linear.WEIGHT_LOADER_V2_SUPPORTED:
        linear.register_weight_loader_v2_supported_method(cls)


def vllm_parameter_classes() -> dict[str, Any]:
    mod = importlib.import_module("vllm.model_executor.parameter")
    names = ("PackedvLLMParameter", "PackedColumnParameter", "GroupQuantScaleParameter",
             "ChannelQuantScaleParameter", "RowvLLMParameter")  # fmt: skip
    return {name: getattr(mod, name) for name in names}


def replace_parameter(layer, name: str, tensor) -> None:
    _get("vllm.model_executor.utils", "replace_parameter")(layer, name, tensor)


def _marlin_linear_kernel_cls():
    return _get("vllm.model_executor.kernels.linear.mixed_precision.marlin", "MarlinLinearKernel")


def _mp_linear_config(k_full: int, n_full: int, k_part: int, n_part: int, bits: int, act_dtype, group_size: int):
    """vLLM's MPLinearLayerConfig for weights with integer zero points (uint4/uint8), no act order."""
    cfg_cls = _get("vllm.model_executor.kernels.linear", "MPLinearLayerConfig")
    scalar_types = _get("vllm.scalar_type", "scalar_types")
    kwargs = dict(
        full_weight_shape=(k_full, n_full),
        partition_weight_shape=(k_part, n_part),
        weight_type=scalar_types.uint4 if bits == 4 else scalar_types.uint8,
        act_type=act_dtype,
        group_size=group_size,
        zero_points=True,
    )
    if "has_g_idx" in {f.name for f in dataclasses.fields(cfg_cls)}:  # 0.26: a required field
        kwargs["has_g_idx"] = False
    return cfg_cls(**kwargs)


def marlin_zp_linear_verdict(
    k_full: int, n_full: int, k_part: int, n_part: int, bits: int, act_dtype, group_size: int, sm: int | None
) -> str | None:
    """Why vLLM's MarlinLinearKernel cannot run this layer with integer zero points (None: it can).

    Its own rules: the capability, then `can_implement` (platform, weight type, group size, TP split)."""
    kernel = _marlin_linear_kernel_cls()
    if sm is not None and sm < kernel.get_min_capability():
        return f"needs compute capability {kernel.get_min_capability()}+ (this GPU is sm{sm})"
    cfg = _mp_linear_config(k_full, n_full, k_part, n_part, bits, act_dtype, group_size)
    ok, reason = kernel.can_implement(cfg)
    return None if ok else f"vLLM's MarlinLinearKernel: {reason}"


def marlin_zp_linear_kernel(
    k_full: int, n_full: int, k_part: int, n_part: int, bits: int, act_dtype, group_size: int, *, qweight: str,
    scales: str, qzeros: str,
):  # fmt: skip
    """A MarlinLinearKernel over the layer's parameters named qweight (GPTQ layout), scales (G, N) and qzeros
    (the parameter whose `.t()` is (G, N/pack) int32 packed along N, true zero points): the same object
    compressed-tensors' asymmetric W4A16 scheme builds. Its process_weights_after_loading repacks for
    Marlin; apply_weights(layer, x, bias) runs the GEMM."""
    cfg = _mp_linear_config(k_full, n_full, k_part, n_part, bits, act_dtype, group_size)
    return _marlin_linear_kernel_cls()(cfg, w_q_param_name=qweight, w_s_param_name=scales, w_zp_param_name=qzeros)


@dataclasses.dataclass(frozen=True)
class ExllamaOps:
    """vLLM's exllama GPTQ ops with one signature across versions; takes_g_idx: act order is possible."""

    takes_g_idx: bool
    gemm: Any  # (x, qweight, qzeros, scales, g_idx | None, use_exllama, use_v2_format, bits) -> out
    shuffle: Any  # (qweight, perm | None, bits) -> None, in place


def gptq_exllama_ops() -> ExllamaOps:
    ops = vllm_custom_ops()
    takes_g_idx = "b_g_idx" in inspect.signature(ops.gptq_gemm).parameters
    if takes_g_idx:  # 0.26: act order through g_idx (an empty tensor: none)
        return ExllamaOps(True, ops.gptq_gemm, ops.gptq_shuffle)

    def gemm(x, qweight, qzeros, scales, g_idx, use_exllama, use_v2_format, bits):
        return ops.gptq_gemm(x, qweight, qzeros, scales, use_exllama, use_v2_format, bits)

    return ExllamaOps(False, gemm, lambda qweight, perm, bits: ops.gptq_shuffle(qweight, bits))


# ------------------------------------------------------------------ layer facts


def layer_tp(layer) -> tuple[int, int]:
    """(tp_rank, tp_size) of a RoutedExperts layer."""
    cfg = layer.moe_config
    return int(cfg.tp_rank), int(cfg.tp_size)


def layer_global_experts(layer) -> int | None:
    """The routed experts of a RoutedExperts layer over all ranks (its `global_num_experts`; None on a layer
    that does not have it yet)."""
    n = getattr(layer, "global_num_experts", None)
    return None if n is None else int(n)


def layer_local_expert_id(layer, global_expert_id: int) -> int:
    """Local expert index on this rank, or -1 when the expert lives elsewhere (EP)."""
    return int(layer._map_global_expert_id_to_local_expert_id(global_expert_id))


def layer_moe_backend(layer_or_moe_config) -> str:
    cfg = getattr(layer_or_moe_config, "moe_config", layer_or_moe_config)
    return str(getattr(cfg, "moe_backend", "auto") or "auto")


# The share assumed outside an engine's config (a layer built by hand): a little under what an engine's CacheConfig
# gives by default in 0.26-0.33 (0.92), so a composed layer's second copy is judged on the safe side.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def gpu_memory_utilization() -> float:
    """The share of the device vLLM may use (the current config's gpu_memory_utilization, or the default it
    resolves to: 0.34's `resolved_gpu_memory_utilization()`), DEFAULT_GPU_MEMORY_UTILIZATION outside an
    engine's config context."""
    try:
        from vllm.config import get_current_vllm_config

        cache = getattr(get_current_vllm_config(), "cache_config", None)
    except Exception:  # noqa: BLE001 - no config set (a layer built outside an engine)
        return DEFAULT_GPU_MEMORY_UTILIZATION
    resolved = getattr(cache, "resolved_gpu_memory_utilization", None)
    try:
        value = resolved() if callable(resolved) else resolved
    except Exception:  # noqa: BLE001
        value = None
    value = value if value is not None else getattr(cache, "gpu_memory_utilization", None)
    return float(value) if isinstance(value, (int, float)) and 0 < value <= 1 else DEFAULT_GPU_MEMORY_UTILIZATION


def max_batched_tokens() -> int | None:
    """The current engine's token budget per step (scheduler_config.max_num_batched_tokens), None outside an
    engine's config context or where it is not an int."""
    try:
        from vllm.config import get_current_vllm_config

        value = getattr(getattr(get_current_vllm_config(), "scheduler_config", None), "max_num_batched_tokens", None)
    except Exception:  # noqa: BLE001 - no config set (a layer built outside an engine)
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def layer_expert_names(layer) -> tuple[str, ...]:
    """The checkpoint's names of an expert's gate, up and down projections in a RoutedExperts layer
    (`ckpt_gate_proj_name`, `ckpt_up_proj_name`, `ckpt_down_proj_name`: gate_proj/up_proj/down_proj, Mixtral's
    w1/w3/w2), the names vLLM probes the layer's quantization rules with; an absent one (a non-gated layer's up)
    is left out."""
    names = (getattr(layer, f"ckpt_{p}_proj_name", p + "_proj") for p in ("gate", "up", "down"))
    return tuple(str(n) for n in names if n)


def layer_activation(layer) -> str:
    act = getattr(layer, "activation", "silu")
    return str(getattr(act, "value", act))


# FusedMoEConfig fields that change the experts' math beyond act(x @ W1.T) * (x @ W3.T) @ W2.T, with their plain
# values. A vLLM without a field never sets it (getattr's default).
EXPERT_MATH_FIELDS = {
    "has_bias": False,
    "swiglu_limit": None,
    "swiglu_alpha": None,
    "swiglu_beta": None,
    "activation_situ_beta": None,
    "activation_situ_linear_beta": None,
}


def layer_expert_math(layer) -> dict[str, object]:
    """The layer's EXPERT_MATH_FIELDS that differ from their plain values, {field: value} (empty: plain experts)."""
    cfg = getattr(layer, "moe_config", None)
    return {
        name: getattr(cfg, name)
        for name, plain in EXPERT_MATH_FIELDS.items()
        if getattr(cfg, name, plain) not in (plain, None)
    }


def vllm_moe_backend_names() -> tuple[str, ...]:
    """Every `--moe-backend` name this vLLM accepts (empty when it cannot say)."""
    import typing

    try:
        return tuple(str(n) for n in typing.get_args(_get("vllm.config.kernel", "MoEBackend")))
    except Exception:  # noqa: BLE001
        return ()


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


def marlin_moe_repack(qweight, size_k: int, size_n: int, num_bits: int):
    """vLLM's Marlin MoE repack of GPTQ-packed (E, K/pack, N) int32 weights, with or without act order's `perm`."""
    import torch

    repack = vllm_custom_ops().gptq_marlin_moe_repack
    if "perm" in inspect.signature(repack).parameters:  # 0.26-0.29: an empty perm means no act order
        perm = torch.empty((qweight.shape[0], 0), dtype=torch.int32, device=qweight.device)
        return repack(qweight, perm, size_k, size_n, num_bits)
    return repack(qweight, size_k, size_n, num_bits)


def fused_marlin_moe_fn():
    """vLLM's fused_marlin_moe, called with the keywords this vLLM takes (0.26-0.29 also want is_k_full)."""
    fn = _get("vllm.model_executor.layers.fused_moe.experts.marlin_moe", "fused_marlin_moe")
    if "is_k_full" not in inspect.signature(fn).parameters:
        return fn
    return lambda *args, **kwargs: fn(*args, is_k_full=True, **kwargs)


def marlin_pieces() -> dict[str, Any]:
    """The vLLM pieces the marlin backend needs (GPU only)."""
    mu = "vllm.model_executor.layers.quantization.utils.marlin_utils"
    return {
        "ops": vllm_custom_ops(),
        "repack": marlin_moe_repack,
        "fused_marlin_moe": fused_marlin_moe_fn(),
        "marlin_moe_permute_scales": _get(mu, "marlin_moe_permute_scales"),
        "moe_packed_to_marlin_zero_points": _get(mu, "moe_packed_to_marlin_zero_points"),
        "marlin_make_workspace_new": _get(mu, "marlin_make_workspace_new"),
        "marlin_moe_padded_intermediate": _get(mu, "marlin_moe_padded_intermediate"),
        "scalar_types": _get("vllm.scalar_type", "scalar_types"),
        "MoEActivation": _get("vllm.model_executor.layers.fused_moe.activation", "MoEActivation"),
    }


def align_and_weighted_sum_pieces() -> dict[str, Any]:
    """vLLM's token alignment and top-k weighted sum for the humming backend, each None when it cannot be imported.

    moe_align_block_size(topk_ids, block_size, num_experts, expert_map, pad_sorted_ids,
    ignore_invalid_experts) and moe_fused_mul_sum(inputs, topk_weights, outputs, topk_ids,
    expert_map) have these parameters in vLLM 0.26.0 and 0.34.0."""
    pieces: dict[str, Any] = {}
    for key, module in (
        ("moe_align_block_size", "vllm.model_executor.layers.fused_moe.moe_align_block_size"),
        ("moe_fused_mul_sum", "vllm.model_executor.layers.fused_moe.moe_fused_mul_sum"),
    ):
        try:
            pieces[key] = _get(module, key)
        except Exception:  # noqa: BLE001
            pieces[key] = None
    return pieces


# vLLM's should_moe_wna16_use_cuda (0.26-0.34) without its platform check: int4, these groups, few pairs per expert
VLLM_MOE_WNA16_CUDA_GROUPS = (32, 64, 128)
VLLM_MOE_WNA16_CUDA_MAX_PAIRS_PER_EXPERT = 6


def moe_wna16_in_tree_path(
    num_tokens: int, top_k: int, experts: int, size_k: int, size_n: int, group_size: int, bits: int
) -> tuple[str, int | None] | None:
    """What vLLM's in-tree moe_wna16 method launches for one GEMM on a GPU, for `doctor` to show beside the
    plugin's legal config: ("cuda", BLOCK_SIZE_K of its get_moe_wna16_block_config, the heuristic the plugin
    exists to replace) where its should_moe_wna16_use_cuda takes the CUDA kernel (bits == 4, group_size in
    VLLM_MOE_WNA16_CUDA_GROUPS, num_tokens * top_k / experts <= 6), else ("triton", None); None where vLLM is
    not importable (doctor runs without it)."""
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import get_moe_wna16_block_config
    except Exception:  # noqa: BLE001 - doctor runs without vLLM
        return None
    pairs = num_tokens * top_k
    if not (bits == 4 and group_size in VLLM_MOE_WNA16_CUDA_GROUPS
            and pairs / experts <= VLLM_MOE_WNA16_CUDA_MAX_PAIRS_PER_EXPERT):  # fmt: skip
        return ("triton", None)
    cfg = get_moe_wna16_block_config(config={}, use_moe_wna16_cuda=True, num_valid_tokens=pairs, size_k=size_k,
                                     size_n=size_n, num_experts=experts, group_size=group_size, real_top_k=top_k,
                                     block_size_m=min(16, num_tokens))  # fmt: skip
    return ("cuda", int(cfg["BLOCK_SIZE_K"]))


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


def fused_moe_layer_cls():
    """The class that builds a MoE layer: `FusedMoE` (0.26), renamed `FusedMoEFactory` (0.27+), same keywords."""
    mod = importlib.import_module("vllm.model_executor.layers.fused_moe")
    cls = getattr(mod, "FusedMoEFactory", None) or getattr(mod, "FusedMoE", None)
    if cls is None:
        raise ImportError("vllm.model_executor.layers.fused_moe has neither FusedMoEFactory nor FusedMoE")
    return cls


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

    fused_moe_cls = fused_moe_layer_cls()
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
