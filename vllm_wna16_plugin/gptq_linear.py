"""Linear layers of asymmetric GPTQ checkpoints (`sym: false`), which vLLM's in-tree GPTQ method refuses.

vLLM's AutoGPTQConfig takes symmetric GPTQ only (`Unsupported quantization config: bits=4, sym=False`).
The routed experts of such checkpoints run on the plugin's MoE method; their attention and other
linear layers run here:

- parameters: GPTQ's own layout (qweight int32 packed along K, qzeros packed along N, scales (G, N),
  g_idx where vLLM still loads it), made with vLLM's parameter classes as its AutoGPTQLinearMethod
  makes them, so merged qkv / gate_up shards and tensor-parallel slices load as they do there;
- kernel, chosen per layer before any weight is read (`choose_kernel`): vLLM's Marlin with integer
  zero points, the route of compressed-tensors' asymmetric W4A16 (int4, no act order, the group sizes
  Marlin has); else vLLM's exllama `gptq_gemm`, which reads GPTQ v1 and v2 zero points itself, in
  float16; else a ValueError naming the layer, its fields and the fix;
- zero points: read through weight_loading.gptq_zero_points, the MoE loader's one rule for GPTQ's v1
  offset and the v1 zero it refuses, then packed for Marlin by `marlin_zero_point_input`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_wna16_plugin import _vllm
from vllm_wna16_plugin.packing import pack_along
from vllm_wna16_plugin.scheme import WNA16Scheme
from vllm_wna16_plugin.weight_loading import gptq_zero_points

logger = _vllm.init_logger(__name__)

MARLIN, EXLLAMA = "marlin", "exllama"
KERNELS = (MARLIN, EXLLAMA)  # preference order
KERNEL_NAMES = {
    MARLIN: "vLLM's Marlin kernel with integer zero points (MarlinLinearKernel, uint4)",
    EXLLAMA: "vLLM's exllama kernel (gptq_gemm, float16)",
}
KERNEL_LIMITS = (
    "Marlin runs bits=4, desc_act=false and group_size 32, 64, 128 or -1 on NVIDIA sm75+ in bfloat16 or "
    "float16; vLLM's exllama kernel runs bits 4 and 8 (desc_act=true on vLLM 0.26-0.29) in float16 only "
    "(--dtype float16). Otherwise re-export the checkpoint with sym=true (vLLM's own GPTQ method) or within "
    "Marlin's limits"
)
_QKV_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}  # QKVParallelLinear's shard ids, in qkv_proj's mapping order
_LOGGED: set[str] = set()


def owns_linear(quant_method: str, scheme: WNA16Scheme) -> bool:
    """Whether this module runs a stored-quantized linear layer of the checkpoint (else vLLM's in-tree
    method of the format does): GPTQ with zero points, which vLLM's GPTQ method refuses."""
    return quant_method == "gptq" and scheme.has_zero_point


LINEAR_METHOD = "the plugin's asymmetric GPTQ linear method (vLLM's Marlin with zero points, else exllama)"


@dataclass(frozen=True)
class LinearShape:
    """One linear layer's GEMM: K (input features) and N (output features), whole and on this rank."""

    k_full: int
    n_full: int
    k_part: int
    n_part: int

    @property
    def row_parallel(self) -> bool:
        return self.k_part != self.k_full


def _fields(scheme: WNA16Scheme) -> str:
    return (
        f"quantization_config.sym=false, bits={scheme.bits}, group_size={scheme.group_size}, "
        f"desc_act={str(scheme.desc_act).lower()}"
    )


def shape_issue(scheme: WNA16Scheme, shape: LinearShape) -> str | None:
    """Why GPTQ's layout cannot hold this layer's shard on this rank (None: it can), for any kernel."""
    pf = scheme.pack_factor
    if shape.k_part % pf or shape.n_part % pf:
        return (
            f"K={shape.k_part} and N={shape.n_part} per rank must be multiples of {pf} (GPTQ packs {pf} "
            f"int{scheme.bits} values in an int32); use a tensor-parallel size that keeps them so"
        )
    if not scheme.is_channelwise and shape.k_part % scheme.group_size:
        return (
            f"K={shape.k_part} per rank (K={shape.k_full} in all) is not a multiple of group_size="
            f"{scheme.group_size}: the tensor-parallel split cuts a group; use a tensor-parallel size that "
            f"divides K / group_size = {shape.k_full // scheme.group_size}"
        )
    return None


def exllama_act_order() -> bool:
    """vLLM's gptq_gemm takes a g_idx, and vLLM still hands linear layers their g_idx (0.26-0.29)."""
    return _vllm.gptq_exllama_ops().takes_g_idx and not _vllm.has_checkpoint_weight_mapper()


def kernel_verdicts(
    scheme: WNA16Scheme, shape: LinearShape, act_dtype: torch.dtype, platform: tuple[str, int | None] | None = None
) -> dict[str, str | None]:
    """{kernel: why it cannot run this layer, or None} for each of KERNELS. platform: (name, sm) as
    _vllm.platform_summary() gives it (the default)."""
    name, sm = platform or _vllm.platform_summary()
    if name != "cuda":
        marlin = f"needs an NVIDIA GPU (platform is {name})"
    elif scheme.desc_act:
        marlin = "has no act-order kernel with zero points (desc_act=true)"
    else:
        marlin = _vllm.marlin_zp_linear_verdict(
            shape.k_full, shape.n_full, shape.k_part, shape.n_part, scheme.bits, act_dtype, scheme.group_size, sm
        )
    if name not in ("cuda", "rocm"):
        exllama = f"needs a CUDA or ROCm GPU (platform is {name})"
    elif act_dtype != torch.float16:
        exllama = f"runs float16 only (the model's dtype is {str(act_dtype).removeprefix('torch.')})"
    elif scheme.desc_act and not exllama_act_order():
        exllama = f"vLLM {_vllm.vllm_version()} runs no act order in linear layers (desc_act=true)"
    else:
        exllama = None
    return {MARLIN: marlin, EXLLAMA: exllama}


def choose_kernel(
    scheme: WNA16Scheme,
    shape: LinearShape,
    act_dtype: torch.dtype,
    prefix: str,
    platform: tuple[str, int | None] | None = None,
) -> str:
    """The first of KERNELS that runs this layer, logged once per kernel; else ValueError naming the layer."""
    issue = shape_issue(scheme, shape)
    if issue is not None:
        raise ValueError(f"moe_wna16_plus: linear layer {prefix!r} ({scheme.describe()}): {issue}")
    verdicts = kernel_verdicts(scheme, shape, act_dtype, platform)
    for kernel in KERNELS:
        if verdicts[kernel] is None:
            if kernel not in _LOGGED:
                _LOGGED.add(kernel)
                why = "" if kernel == MARLIN else f" (marlin: {verdicts[MARLIN]})"
                logger.info(
                    "moe_wna16_plus: asymmetric GPTQ linear layers run on %s, first %s%s",
                    KERNEL_NAMES[kernel], prefix, why,
                )  # fmt: skip
            return kernel
    rejections = "; ".join(f"{k}: {verdicts[k]}" for k in KERNELS)
    raise ValueError(
        f"moe_wna16_plus: linear layer {prefix!r} is stored as asymmetric GPTQ ({_fields(scheme)}) and no "
        f"kernel here runs it with zero points ({rejections}). {KERNEL_LIMITS}"
    )


# ---------------------------------------------------------------- zero points


def marlin_zero_point_input(scheme: WNA16Scheme, qzeros: torch.Tensor, name: str) -> torch.Tensor:
    """GPTQ qzeros (G, N/pack) int32 -> the zero points vLLM's MarlinLinearKernel reads: (N/pack, G) int32
    whose transpose is packed along N in GPTQ's bit order, holding the zero points themselves (v1's stored
    zero - 1 undone; see _vllm.marlin_zp_linear_kernel)."""
    zeros = gptq_zero_points(scheme, qzeros, name)  # (N, G)
    return pack_along(zeros.T, scheme.bits, dim=1, word_bits=32).T.contiguous()


def checkpoint_tensor_name(prefix: str, shard_names: Sequence[str], shard_id, suffix: str) -> str:
    """The checkpoint tensor a shard of a (merged) layer comes from: `...self_attn.k_proj.qzeros` for shard "k"
    of `...self_attn.qkv_proj` whose mapping is (q_proj, k_proj, v_proj); else `{prefix}.{suffix}`."""
    index = _QKV_SHARD_INDEX.get(shard_id, shard_id) if isinstance(shard_id, str) else shard_id
    if isinstance(index, int) and 0 <= index < len(shard_names):
        parent = prefix.rpartition(".")[0]
        return f"{parent}.{shard_names[index]}.{suffix}" if parent else f"{shard_names[index]}.{suffix}"
    return f"{prefix}.{suffix}" + ("" if shard_id is None else f" (shard {shard_id!r})")


def _checked_qzeros_loader(weight_loader, scheme: WNA16Scheme, prefix: str, shard_names: Sequence[str]):
    """weight_loader that reads each qzeros checkpoint tensor through gptq_zero_points first, so that a v1 zero
    it refuses names the checkpoint tensor (the shard of a merged layer), before any slicing."""

    def load(param, loaded_weight, *args, **kwargs):
        shard_id = args[0] if args else kwargs.get("loaded_shard_id")
        gptq_zero_points(scheme, loaded_weight, checkpoint_tensor_name(prefix, shard_names, shard_id, "qzeros"))
        return weight_loader(param, loaded_weight, *args, **kwargs)

    return load


# ---------------------------------------------------------------- parameters


def create_gptq_parameters(
    layer: torch.nn.Module,
    scheme: WNA16Scheme,
    shape: LinearShape,
    params_dtype: torch.dtype,
    weight_loader,
    *,
    prefix: str,
    shard_names: Sequence[str] = (),
    with_g_idx: bool,
) -> None:
    """qweight, scales, qzeros (and g_idx) in GPTQ's layout on `layer`, as vLLM's AutoGPTQLinearMethod makes
    them: scales and zero points repeat on every rank under act order, or channel-wise along a split K."""
    p = _vllm.vllm_parameter_classes()
    pf = scheme.pack_factor
    group_size = scheme.group_size_for(shape.k_full)
    whole = scheme.desc_act or (scheme.is_channelwise and shape.row_parallel)
    groups = (shape.k_full if whole else shape.k_part) // group_size
    qzeros_loader = weight_loader
    if scheme.zero_point_offset:
        qzeros_loader = _checked_qzeros_loader(weight_loader, scheme, prefix, shard_names)
    qweight = p["PackedvLLMParameter"](
        data=torch.empty(shape.k_part // pf, shape.n_part, dtype=torch.int32),
        input_dim=0, output_dim=1, packed_dim=0, packed_factor=pf, weight_loader=weight_loader,
    )  # fmt: skip
    scales_data = torch.empty(groups, shape.n_part, dtype=params_dtype)
    qzeros_data = torch.empty(groups, shape.n_part // pf, dtype=torch.int32)
    if whole:
        scales = p["ChannelQuantScaleParameter"](data=scales_data, output_dim=1, weight_loader=weight_loader)
        qzeros = p["PackedColumnParameter"](
            data=qzeros_data, output_dim=1, packed_dim=1, packed_factor=pf, weight_loader=qzeros_loader
        )
    else:
        scales = p["GroupQuantScaleParameter"](data=scales_data, output_dim=1, input_dim=0, weight_loader=weight_loader)
        qzeros = p["PackedvLLMParameter"](
            data=qzeros_data, input_dim=0, output_dim=1, packed_dim=1, packed_factor=pf, weight_loader=qzeros_loader
        )
    layer.register_parameter("qweight", qweight)
    layer.register_parameter("scales", scales)
    layer.register_parameter("qzeros", qzeros)
    if with_g_idx:
        g_idx = p["RowvLLMParameter"](
            data=torch.empty(shape.k_part, dtype=torch.int32), input_dim=0, weight_loader=weight_loader
        )
        layer.register_parameter("g_idx", g_idx)


# ---------------------------------------------------------------- the method


@functools.cache
def linear_method_class():
    """GPTQAsymLinearMethod on vLLM's LinearMethodBase (built lazily: the package imports without vLLM)."""
    base = _vllm.linear_method_base()

    class GPTQAsymLinearMethod(base):
        """One asymmetric GPTQ linear layer (see the module docstring); the kernel is picked in create_weights."""

        def __init__(self, scheme: WNA16Scheme, prefix: str, shard_names: Sequence[str] = ()) -> None:
            self.scheme = scheme
            self.prefix = prefix
            self.shard_names = tuple(shard_names)
            self.kernel: str | None = None
            self.shape: LinearShape | None = None
            self.act_dtype: torch.dtype | None = None
            self.marlin = None  # vLLM's MarlinLinearKernel, after loading
            self.exllama: _vllm.ExllamaOps | None = None  # after loading
            self.use_exllama = True

        def create_weights(
            self,
            layer: torch.nn.Module,
            input_size_per_partition: int,
            output_partition_sizes: list[int],
            input_size: int,
            output_size: int,
            params_dtype: torch.dtype,
            **extra_weight_attrs,
        ) -> None:
            self.shape = LinearShape(input_size, output_size, input_size_per_partition, sum(output_partition_sizes))
            self.act_dtype = params_dtype
            self.kernel = choose_kernel(self.scheme, self.shape, params_dtype, self.prefix)
            create_gptq_parameters(
                layer, self.scheme, self.shape, params_dtype, extra_weight_attrs.get("weight_loader"),
                prefix=self.prefix, shard_names=self.shard_names,
                # from 0.30 vLLM drops linear layers' g_idx before they reach a layer (get_checkpoint_weight_mapper)
                with_g_idx=not _vllm.has_checkpoint_weight_mapper(),
            )  # fmt: skip

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            if self.kernel == MARLIN:
                self._prepare_marlin(layer)
            else:
                self._prepare_exllama(layer)

        def _prepare_marlin(self, layer: torch.nn.Module) -> None:
            zeros = marlin_zero_point_input(self.scheme, layer.qzeros.data, f"{self.prefix}.qzeros")
            _vllm.replace_parameter(layer, "qzeros", zeros)
            s = self.shape
            self.marlin = _vllm.marlin_zp_linear_kernel(
                s.k_full, s.n_full, s.k_part, s.n_part, self.scheme.bits, self.act_dtype, self.scheme.group_size,
                qweight="qweight", scales="scales", qzeros="qzeros",
            )  # fmt: skip
            self.marlin.process_weights_after_loading(layer)

        def _prepare_exllama(self, layer: torch.nn.Module) -> None:
            """As vLLM's GPTQ (exllama) method did: act order across split K runs exllama's other path."""
            ops = self.exllama = _vllm.gptq_exllama_ops()
            device = layer.qweight.device
            self.use_exllama = not (self.scheme.desc_act and self.shape.row_parallel)
            if not self.scheme.desc_act:
                g_idx = torch.empty((0,), dtype=torch.int32, device=device)
            elif self.use_exllama:
                g_idx = torch.argsort(layer.g_idx.data).to(torch.int32)
            else:
                g_idx = layer.g_idx.data
            if self.use_exllama:
                ops.shuffle(layer.qweight.data, g_idx, self.scheme.bits)
            _vllm.replace_parameter(layer, "g_idx", g_idx)

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            if self.marlin is not None:
                return self.marlin.apply_weights(layer, x, bias)
            out = self.exllama.gemm(
                x.reshape(-1, x.shape[-1]), layer.qweight, layer.qzeros, layer.scales, layer.g_idx,
                self.use_exllama, self.scheme.zero_point_offset == 0, self.scheme.bits,
            )  # fmt: skip
            if bias is not None:
                out.add_(bias)
            return out.reshape(*x.shape[:-1], self.shape.n_part)

    GPTQAsymLinearMethod.__qualname__ = "GPTQAsymLinearMethod"
    _vllm.register_weight_loader_v2(GPTQAsymLinearMethod)
    return GPTQAsymLinearMethod


def make_gptq_asym_linear_method(scheme: WNA16Scheme, prefix: str, fused_mapping: Mapping[str, Sequence[str]]):
    """The linear method of an asymmetric GPTQ layer at `prefix`; fused_mapping is the model's
    packed_modules_mapping (names the checkpoint tensors of a merged layer's shards in messages)."""
    return linear_method_class()(scheme, prefix, fused_mapping.get(prefix.rpartition(".")[2], ()))
