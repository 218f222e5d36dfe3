"""`moe_wna16_plus`: the vLLM QuantizationConfig of the plugin.

It claims a checkpoint only when the user asked for `moe_wna16_plus`, owns every
routed-experts layer (MoE method in moe_method.py) and delegates linear layers
to vLLM's in-tree method of the checkpoint's format, except asymmetric GPTQ
ones, which vLLM's GPTQ method refuses (gptq_linear.py runs those).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vllm_wna16_plugin import _vllm
from vllm_wna16_plugin.checkpoint_config import (
    DEFAULT_FUSED_MAPPING,
    SIDE_FILES,
    CheckpointQuantConfig,
    parse_quantization_config,
)
from vllm_wna16_plugin.stored_tensors import experts_left_unquantized, format_mismatch, scheme_tensors_absent

QUANTIZATION_NAME = "moe_wna16_plus"

logger = _vllm.init_logger(__name__)


@functools.cache
def make_config_class():
    """Build the config class on vLLM's base (imported lazily, so the package imports without vLLM).

    One class per process, reachable as `vllm_wna16_plugin.quant_config.MoeWNA16PlusConfig`
    (the module's __getattr__): vLLM pickles the config into the engine-core process when it
    spawns it (as it must once CUDA is initialized), and pickle finds a class by that name.
    """
    base = _vllm.quantization_config_base()

    class MoeWNA16PlusConfig(base):
        """Weight-only int4/int8 MoE (GPTQ, AWQ, compressed-tensors pack-quantized)."""

        def __init__(self, parsed: CheckpointQuantConfig) -> None:
            super().__init__()
            self.parsed = parsed
            self._linear_delegate = None
            self._quantized_modules: set[str] | None = None  # from the safetensors dtypes (maybe_update_config)
            self._float_modules: set[str] | None = None
            self._stored_dtypes: dict[str, str] = {}  # tensor name (the checkpoint's) -> safetensors dtype
            self._mappers: list = []  # vLLM's renames of checkpoint names (apply_vllm_mapper), in order
            # compressed-tensors' fp8 KV-cache scheme: vLLM's attention reads it from the layer's quant config
            # (an fp8 cache by default), and its KV-cache method loads the checkpoint's k/v scales
            raw = parsed.raw if parsed.quant_method == "compressed-tensors" else {}
            self.kv_cache_scheme = raw.get("kv_cache_scheme")

        def __repr__(self) -> str:
            return f"MoeWNA16PlusConfig({self.parsed.scheme.describe()}, linear={self.parsed.quant_method})"

        @classmethod
        def get_name(cls) -> str:
            return QUANTIZATION_NAME

        @classmethod
        def get_supported_act_dtypes(cls) -> list[torch.dtype]:
            return [torch.bfloat16, torch.float16, torch.float32]

        @classmethod
        def get_min_capability(cls) -> int:
            return 70

        @staticmethod
        def get_config_filenames() -> list[str]:
            """Side files vLLM reads when config.json has no quantization_config: AutoGPTQ's and AutoAWQ's (their
            keys say which, checkpoint_config.side_file_method)."""
            return list(SIDE_FILES)

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> MoeWNA16PlusConfig:
            return cls(parse_quantization_config(config))

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
            """Claim the checkpoint only when the user asked for moe_wna16_plus.

            vLLM probes plugin methods before its built-ins, so claiming anything
            else would hijack every GPTQ/AWQ model. When asked, a malformed
            config raises here, at config time, with the field and the fix.
            """
            if user_quant != QUANTIZATION_NAME:
                return None
            parse_quantization_config(hf_quant_cfg)
            return QUANTIZATION_NAME

        def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
            """Learn which linear modules the checkpoint stores quantized (non-float tensors).

            A GPTQ checkpoint without `modules_in_block_to_quantize` says nothing about
            its bf16 router gate; the safetensors dtypes do (vLLM's AutoGPTQ does the same).
            """
            try:
                metadata = _vllm.safetensors_params_metadata(model_name, revision)
            except Exception as exc:  # noqa: BLE001 - no metadata: every listed module is quantized
                logger.debug("moe_wna16_plus: no safetensors metadata for %s (%s)", model_name, exc)
                return
            if mismatch := format_mismatch(self.parsed.quant_method, metadata):
                raise mismatch
            self._stored_dtypes = {name: info.get("dtype") for name, info in metadata.items()}
            self._learn_stored_modules()
            if self.parsed.quant_method == "gptq":
                self._delegate_or_none(lambda d: d.maybe_update_config(model_name, hf_config, revision))

        def _learn_stored_modules(self) -> None:
            """_quantized_modules / _float_modules from the stored tensors' dtypes, under the names vLLM's layers
            have: the checkpoint's names through every rename mapper vLLM applied (apply_vllm_mapper)."""
            floats = {"F16", "BF16", "F32", "F64"}
            names = dict(self._stored_dtypes)
            for mapper in self._mappers:
                names = {new: dtype for name, dtype in names.items() if (new := _vllm.map_weight_name(mapper, name))}
            self._stored_names = set(names)
            self._quantized_modules = {name.rsplit(".", 1)[0] for name, dtype in names.items() if dtype not in floats}
            # modules stored as a float `.weight` (an expert left unquantized), the routed experts' check
            self._float_modules = {
                name.rsplit(".", 1)[0] for name, dtype in names.items() if name.endswith(".weight") and dtype in floats
            } - self._quantized_modules

        def _delegate_or_none(self, use):
            try:
                return use(self._delegate())
            except ValueError as exc:  # e.g. vLLM's in-tree GPTQ is symmetric-only: fail only if a linear needs it
                logger.debug("moe_wna16_plus: in-tree %s config unavailable: %s", self.parsed.quant_method, exc)
                return None

        def _stored_quantized(self, prefix: str) -> bool:
            quantized = getattr(self, "_quantized_modules", None)
            if quantized is None:
                return True
            parent, _, last = prefix.rpartition(".")
            shards = (getattr(self, "packed_modules_mapping", None) or {}).get(last, [last])
            return any((f"{parent}.{s}" if parent else s) in quantized for s in shards)

        def _stored_experts(self, prefix: str, modules) -> list[str]:
            """The routed experts' modules (`<prefix>.<expert>.<proj>`, the checkpoint's own names) in `modules`."""
            head = f"{prefix}."
            return sorted(m for m in modules or () if m.startswith(head) and m[len(head) : len(head) + 1].isdigit())

        def _block_stored_float(self, prefix: str) -> list[str]:
            """The float modules that show these routed experts stored unquantized, else []: the experts' own when
            the checkpoint stores them only as float weights (`<prefix>.<expert>.<proj>.weight`, nothing quantized
            among them: routed experts left bf16 beside quantized shared experts, which an AWQ file's GPTQModel
            `dynamic` rule, unread by vLLM's AWQ config and so by ours, may say), else those of the MoE block holding
            them (the prefix's parent: its experts, router, shared experts) when the checkpoint stores at least two
            there and nothing quantized. MTP layers of GPTQ/AWQ files (experts left bf16, no `dynamic` rule saying
            so) and GraniteMoE's fused bf16 `input_linear` are such blocks. vLLM would build a quantized layer and
            fail on the first float tensor ("has no parameter"). Unknown metadata, or names the file does not use,
            decide nothing. Experts stored partly quantized are refused before (_check_stored_experts)."""
            quantized, floats = self._quantized_modules, self._float_modules
            if not quantized or not floats or "." not in prefix:
                return []
            experts = self._stored_experts(prefix, floats)
            if experts and not self._stored_experts(prefix, quantized):
                return experts
            block = prefix.rpartition(".")[0] + "."
            if any(m.startswith(block) for m in quantized):
                return []
            found = sorted(m for m in floats if m.startswith(block))
            return found if len(found) >= 2 else []

        def _check_stored_experts(self, prefix: str, scheme, experts: tuple[str, ...]) -> None:
            """The layer's experts as the safetensors store them (maybe_update_config) against the scheme the config
            gives the layer, which vLLM reads through expert 0's modules: every expert quantized, or none of them,
            and quantized where the config says so. Else vLLM would fail on the first tensor of the other kind
            ("has no parameter", an AttributeError) or load experts with a scheme they were not written with."""
            quantized = self._stored_experts(prefix, getattr(self, "_quantized_modules", None))
            floats = self._stored_experts(prefix, getattr(self, "_float_modules", None))
            if quantized and floats:
                raise ValueError(
                    f"moe_wna16_plus: {prefix}: the checkpoint stores some routed experts unquantized ({floats[0]}.weight "
                    f"is a float tensor) and others quantized ({quantized[0]}); vLLM loads every expert of a layer "
                    "with one scheme: quantize them all, or none (the config's ignore / modules_to_not_convert / "
                    "dynamic rules then name the whole experts module)"
                )
            if scheme is None and quantized:
                raise experts_left_unquantized(prefix, experts, quantized[0])

        def _delegate(self):
            if self._linear_delegate is None:
                delegate = _vllm.in_tree_linear_config(self.parsed.quant_method, self.parsed.raw)
                delegate.packed_modules_mapping = getattr(self, "packed_modules_mapping", {})
                self._linear_delegate = delegate
            return self._linear_delegate

        def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
            """The model renames checkpoint modules (Qwen3.5-MoE, Qwen3-VL-MoE, GLM-4.5V: `model.language_model.`
            -> `language_model.model.`): the names the config's rules and the stored tensors use are renamed
            too, as vLLM's own configs rename theirs, so that a layer's vLLM prefix finds its rules and tensors.
            Before, such a checkpoint's quantized linear layers were judged unquantized and failed to load."""
            self._mappers.append(hf_to_vllm_mapper)
            self.parsed = self.parsed.renamed(lambda name: _vllm.map_weight_name(hf_to_vllm_mapper, name))
            if self._stored_dtypes:
                self._learn_stored_modules()
            # every format's delegate renames its own lists; one vLLM refuses (e.g. actorder) is only an error if a
            # linear layer needs it
            self._delegate_or_none(lambda d: d.apply_vllm_mapper(hf_to_vllm_mapper))

        def get_checkpoint_weight_mapper(self):
            """Keep the routed experts' `.g_idx` (act order), which vLLM's default mapper (0.30+) drops
            along with every other `.g_idx`; the others are still dropped (see _vllm.EXPERT_G_IDX)."""
            return _vllm.weights_mapper_keeping_expert_g_idx()

        def _linear_method(self, layer, prefix: str):
            """vLLM's in-tree linear method of the format, or a refusal that names the layer and why."""
            try:
                delegate = self._delegate()
                # the model's fused-module mapping as it is now: vLLM replaces the dict after apply_vllm_mapper
                # (which may have built the delegate) for models without SupportsQuant, updates it for the rest
                delegate.packed_modules_mapping = getattr(self, "packed_modules_mapping", None) or {}
                return delegate.get_quant_method(layer, prefix)
            except ValueError as exc:
                raise ValueError(
                    f"moe_wna16_plus: linear layer {prefix!r} is stored quantized ({self.parsed.quant_method}), "
                    f"and moe_wna16_plus runs linear layers with vLLM {_vllm.vllm_version()}'s in-tree "
                    f"{self.parsed.quant_method} method, which refuses this checkpoint: {exc}. The plugin runs "
                    f"the MoE experts itself (act order included); their linear layers need a checkpoint "
                    f"whose linear layers vLLM supports, or a vLLM that still does (0.26-0.29 take act order)"
                ) from exc

        def get_quant_method(self, layer: torch.nn.Module, prefix: str):
            fused = getattr(self, "packed_modules_mapping", None) or None
            if isinstance(layer, _vllm.routed_experts_cls()):
                experts = _vllm.layer_expert_names(layer)  # the names vLLM probes the layer's rules with
                scheme = self.parsed.scheme_for(prefix, fused_mapping=fused, moe=True, expert_names=experts)
                stored = self._stored_experts(prefix, getattr(self, "_quantized_modules", None))
                if scheme is None and stored and (found := self.parsed.stored_experts_scheme(prefix)) is not None:
                    logger.info(
                        "moe_wna16_plus: %s: modules_in_block_to_quantize does not name its experts by the names vLLM "
                        "probes (expert 0's %s), and the checkpoint stores them quantized (%s): loading them as %s, "
                        "as vLLM's GPTQ MoE method does", prefix, "/".join(experts), stored[0], found.describe(),
                    )  # fmt: skip
                    scheme = found
                self._check_stored_experts(prefix, scheme, experts)
                if scheme is not None and (floats := self._block_stored_float(prefix)):
                    logger.info(
                        "moe_wna16_plus: %s: the checkpoint stores its routed experts unquantized (%s, ... are float "
                        "tensors, none of them quantized), although the config's rules name them quantized: "
                        "loading them as unquantized MoE", prefix, ", ".join(floats[:2]),
                    )  # fmt: skip
                    scheme = None
                if scheme is None:
                    logger.info("moe_wna16_plus: %s is not quantized in the checkpoint; unquantized MoE", prefix)
                    return _vllm.unquantized_moe_method(layer.moe_config)
                if absent := scheme_tensors_absent(scheme, prefix, getattr(self, "_stored_names", ())):
                    raise absent
                from vllm_wna16_plugin.moe_method import make_moe_method

                return make_moe_method(scheme, layer.moe_config, prefix)
            if isinstance(layer, _vllm.linear_base_cls()):
                scheme = self.parsed.scheme_for(prefix, fused_mapping=fused, moe=False)
                if scheme is None or not self._stored_quantized(prefix):
                    return _vllm.unquantized_linear_method()
                from vllm_wna16_plugin.gptq_linear import make_gptq_asym_linear_method, owns_linear

                if owns_linear(self.parsed.quant_method, scheme):  # vLLM's GPTQ method is symmetric-only
                    return make_gptq_asym_linear_method(scheme, prefix, fused or DEFAULT_FUSED_MAPPING)
                return self._linear_method(layer, prefix)
            if self.parsed.lm_head_quantized and isinstance(layer, _vllm.parallel_lm_head_cls()):
                return self._lm_head_method(layer, prefix)
            if self.kv_cache_scheme is not None and isinstance(layer, _vllm.attention_cls()):
                # vLLM's compressed-tensors KV-cache method, on this config: it reads only kv_cache_scheme, and the
                # in-tree config (the linear delegate) refuses act-order experts from vLLM 0.30
                return _vllm.ct_kv_cache_method(self)
            return None

        def _lm_head_method(self, layer, prefix: str):
            """GPTQ / AWQ `lm_head: true`: a head stored quantized runs the in-tree method of the format, which
            takes a ParallelLMHead as a linear layer (vLLM's own gptq / awq do the same); a head stored as floats
            stays unquantized (None: vLLM's embedding method)."""
            scheme = self.parsed.scheme_for(prefix, fused_mapping=None, moe=False)
            if scheme is None or not self._stored_quantized(prefix):
                return None
            from vllm_wna16_plugin.gptq_linear import owns_linear

            if owns_linear(self.parsed.quant_method, scheme):
                raise ValueError(
                    f"moe_wna16_plus: {prefix!r} is stored quantized ({scheme.describe()}, config lm_head=true) with "
                    f"zero points (sym=false), and no lm_head kernel here takes GPTQ zero points (vLLM's GPTQ method "
                    f"is symmetric-only, the plugin's own asymmetric linear method serves Linear layers only): "
                    f"re-export the checkpoint with the lm_head unquantized or symmetric"
                )
            return self._linear_method(layer, prefix)

    MoeWNA16PlusConfig.__qualname__ = "MoeWNA16PlusConfig"  # not make_config_class.<locals>.…
    return MoeWNA16PlusConfig


def make_refusal_class(message: str):
    """A stand-in registered under `moe_wna16_plus` on a vLLM the plugin cannot run on.

    Without it, asking for `moe_wna16_plus` would end in vLLM's "unknown quantization method";
    with it, the user's request is refused with `message` (what was found and the fix). It never
    claims a checkpoint the user did not ask it for. Its methods take *args: older vLLMs call them
    with fewer arguments.
    """
    base = _vllm.quantization_config_base()

    class MoeWNA16PlusUnavailable(base):
        def __init__(self, *args, **kwargs) -> None:
            raise ValueError(message)

        @classmethod
        def get_name(cls) -> str:
            return QUANTIZATION_NAME

        @classmethod
        def get_supported_act_dtypes(cls) -> list[torch.dtype]:
            return [torch.bfloat16, torch.float16]

        @classmethod
        def get_min_capability(cls) -> int:
            return 70

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        @classmethod
        def from_config(cls, config: dict[str, Any]):
            raise ValueError(message)

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg, user_quant, *args, **kwargs) -> str | None:
            if user_quant == QUANTIZATION_NAME:
                raise ValueError(message)
            return None

        def get_quant_method(self, layer, prefix):
            raise ValueError(message)

    MoeWNA16PlusUnavailable.__qualname__ = "MoeWNA16PlusUnavailable"
    return MoeWNA16PlusUnavailable


def __getattr__(name: str):
    """`MoeWNA16PlusConfig` on first use, as pickle asks for it in a freshly spawned process."""
    if name == "MoeWNA16PlusConfig":
        return make_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
