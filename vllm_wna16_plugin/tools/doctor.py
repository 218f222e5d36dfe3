"""`vllm-wna16 doctor MODEL_DIR`: the plan for a checkpoint, from config.json alone (no GPU, no vLLM needed).

Resolves every routed-experts layer's scheme with the code loading uses (dynamic
rules, modules_to_not_convert, ignore, several config_groups) and, per distinct scheme
with its layers, prints each MoE GEMM's shape per TP rank and the group size it runs
with, the CUDA launch configs over batch sizes 1..4096 with their legality (and
vLLM's in-tree choice where vLLM is importable), which backend `auto` would
pick on the named device, with every rejection's reason, and the launch plan of
each batch size (launch_plan.plan: backend, kernels, tiles, forms, alignment and
where each number came from). Where loading would fail
(a bad config, a group size that cannot be re-grouped at --tp, a TP size that does not
divide) it raises ValueError naming the field or flag and what would work.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_wna16_plugin import _vllm, compose
from vllm_wna16_plugin.activation import check_expert_math
from vllm_wna16_plugin.backends import MoEProblem, RunOptions
from vllm_wna16_plugin.backends.base import act_order_split_issue, random_act_order_padding
from vllm_wna16_plugin.block_config import LEGAL_K_RATIOS, choose_cuda_block_config, cuda_group_size
from vllm_wna16_plugin.checkpoint_config import (
    EXPERT_NAMES,
    MAX_LAYERS,
    MAX_SUGGESTED_TP,
    SIDE_FILES,
    CheckpointQuantConfig,
    effective_group_size,
    parse_quantization_config,
)
from vllm_wna16_plugin.gptq_linear import LINEAR_METHOD, owns_linear
from vllm_wna16_plugin.kernels.options import PLAN_DEVICES
from vllm_wna16_plugin.launch_plan import plan as launch_plan
from vllm_wna16_plugin.oracle import collect_verdicts, select_backend
from vllm_wna16_plugin.packing import check_packable
from vllm_wna16_plugin.scheme import WNA16Scheme, not_an_int, type_name
from vllm_wna16_plugin.stored_tensors import (
    experts_left_unquantized,
    format_mismatch,
    scheme_tensors_absent,
    stored_quantized_experts,
)

# --device: what each name is planned as (sm90 is the H200 whose tuned configs and crossovers ship)
DEVICES = PLAN_DEVICES
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _field(where: str, key: str) -> str:
    return f"config.json {where}{key}"


def _positive_int(where: str, key: str, value, limit: int | None = None) -> int:
    """value when it is a positive int (at most `limit`); else ValueError naming the field and its type."""
    problem = not_an_int(value)
    if problem is None and value <= 0:
        problem = "is not positive"
    if problem is None and limit is not None and value > limit:
        problem = f"is larger than {limit}"
    if problem is not None:
        upto = f" up to {limit}" if limit is not None else ""
        raise ValueError(f"{_field(where, key)}={value!r} {problem}; supported: a positive int{upto}")
    return value


def _first_present(c: Mapping, keys: Sequence[str]) -> str | None:
    return next((k for k in keys if c.get(k) is not None), None)


@dataclass(frozen=True)
class MoEDims:
    """The routed-experts dimensions of an HF config (text_config honoured)."""

    hidden: int  # H
    intermediate: int  # I per expert, before TP
    experts: int  # E
    top_k: int
    num_layers: int
    num_heads: int | None  # attention heads (vLLM needs TP to divide them), when the config has them
    where: str  # "" or "text_config.": where the dimensions were found, for messages


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # last: ERNIE-4.5-MoE
_TOP_K_KEYS = ("num_experts_per_tok", "top_k", "moe_topk", "moe_k")
_INTER_KEYS = ("moe_intermediate_size", "intermediate_size")


def moe_dims(cfg: Mapping) -> MoEDims:
    """hidden, intermediate (per expert), experts, top_k, layers of an HF config; ValueError naming
    the field for a missing, mistyped or inconsistent one (top_k above the number of experts)."""
    text = cfg.get("text_config")
    for where, c in (("", cfg), ("text_config.", text if isinstance(text, Mapping) else {})):
        e_key = _first_present(c, _EXPERT_KEYS)
        if e_key is None:
            continue
        experts = _positive_int(where, e_key, c[e_key])
        missing = [" or ".join(keys) for keys in (("hidden_size",), _INTER_KEYS, _TOP_K_KEYS, ("num_hidden_layers",))
                   if _first_present(c, keys) is None]  # fmt: skip
        if missing:
            raise ValueError(f"config.json {where or ''}has {e_key}={experts} but no {', '.join(missing)}; "
                             "supported: an HF MoE config with all of them")  # fmt: skip
        i_key, k_key = _first_present(c, _INTER_KEYS), _first_present(c, _TOP_K_KEYS)
        top_k = _positive_int(where, k_key, c[k_key])
        if top_k > experts:
            raise ValueError(f"{_field(where, k_key)}={top_k} is larger than {_field(where, e_key)}={experts}: "
                             f"each token cannot be routed to more experts than exist; supported: 1..{experts}")  # fmt: skip
        heads = c.get("num_attention_heads")
        return MoEDims(
            hidden=_positive_int(where, "hidden_size", c["hidden_size"]),
            intermediate=_positive_int(where, i_key, c[i_key]),
            experts=experts,
            top_k=top_k,
            num_layers=_positive_int(where, "num_hidden_layers", c["num_hidden_layers"], MAX_LAYERS),
            num_heads=None if heads is None else _positive_int(where, "num_attention_heads", heads),
            where=where,
        )
    raise ValueError(f"config.json has no MoE dimensions: no {', '.join(_EXPERT_KEYS)} (top level or text_config); "
                     "supported: an HF MoE model config")  # fmt: skip


# ---------------------------------------------------------------- which layers are MoE, and their schemes


def _every_layer(c: Mapping, where: str, i: int) -> bool:
    return True


def _qwen_moe_layer(c: Mapping, where: str, i: int) -> bool:
    """vLLM's qwen2_moe/qwen3_moe: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    step = _positive_int(where, "decoder_sparse_step", c.get("decoder_sparse_step", 1))
    only = c.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not_an_int(x) for x in only):
        raise ValueError(f"{_field(where, 'mlp_only_layers')}={only!r} is not a list of ints; supported: "
                         "a list of layer indices")  # fmt: skip
    return i not in only and (i + 1) % step == 0


def _deepseek_moe_layer(c: Mapping, where: str, i: int) -> bool:
    """vLLM's deepseek_v2/glm4_moe: i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    first = c.get("first_k_dense_replace", 0)
    problem = not_an_int(first) or ("is negative" if first < 0 else None)
    if problem:
        raise ValueError(f"{_field(where, 'first_k_dense_replace')}={first!r} {problem}; "
                         "supported: 0 or a positive int")  # fmt: skip
    freq = _positive_int(where, "moe_layer_freq", c.get("moe_layer_freq", 1))
    return i >= first and i % freq == 0


def _ernie_moe_layer(c: Mapping, where: str, i: int) -> bool:
    """vLLM's ernie45_moe: use_moe and moe_layer_start_index <= i <= moe_layer_end_index and (i + 1) %
    moe_layer_interval == 0, read through transformers' Ernie4_5_MoeConfig (defaults: start 1, end -1 = the last
    layer, interval 1)."""
    layers = _positive_int(where, "num_hidden_layers", c["num_hidden_layers"], MAX_LAYERS)
    if c.get("use_moe", True) is False:
        return False
    bounds = []
    for key, default in (("moe_layer_start_index", 1), ("moe_layer_end_index", -1)):
        value = c.get(key, default)
        problem = not_an_int(value) or ("is negative" if value < -1 or (value == -1 and key.endswith("start_index"))
                                        else None)  # fmt: skip
        if problem:
            raise ValueError(f"{_field(where, key)}={value!r} {problem}; supported: 0 or a positive int"
                             f"{' (-1: the last layer)' if key.endswith('end_index') else ''}")  # fmt: skip
        bounds.append(layers - 1 if value == -1 else value)
    interval = _positive_int(where, "moe_layer_interval", c.get("moe_layer_interval", 1))
    return bounds[0] <= i <= bounds[1] and (i + 1) % interval == 0


def _lfm2_moe_layer(c: Mapping, where: str, i: int) -> bool:
    """vLLM's lfm2_moe: the first num_dense_layers layers are dense (transformers' default: 2)."""
    dense = c.get("num_dense_layers", 2)
    problem = not_an_int(dense) or ("is negative" if dense < 0 else None)
    if problem:
        raise ValueError(f"{_field(where, 'num_dense_layers')}={dense!r} {problem}; supported: 0 or a positive int")
    return i >= dense


@dataclass(frozen=True)
class MoELayout:
    """Where a model's routed-experts layers sit, as vLLM's model file names them."""

    block: str  # the decoder layer's MoE block: "mlp", "block_sparse_moe" or "feed_forward"
    is_moe_layer: Callable[[Mapping, str, int], bool]
    experts: tuple[str, ...] = EXPERT_NAMES  # an expert's gate, up, down projections as the model's file names them
    # the checkpoint's block where vLLM names the layer otherwise (MiniMax-M2: tensors under block_sparse_moe, the
    # FusedMoE prefix the quantization config sees under mlp); None: the same
    stored_block: str | None = None

    def prefix(self, i: int) -> str:
        return f"model.layers.{i}.{self.block}.experts"

    def as_vllm_names(self, stored: set[str]) -> set[str]:
        """The safetensors' tensor names under the prefixes vLLM's quantization config sees (prefix())."""
        if self.stored_block is None:
            return stored
        old, new = f".{self.stored_block}.experts.", f".{self.block}.experts."
        return {n.replace(old, new, 1) for n in stored}


# Checked against vLLM 0.26's model files (qwen2_moe, qwen3_moe, mixtral, phimoe, olmoe, deepseek_v2, glm4_moe) and
# 0.34's (qwen3_next, ernie45_moe, minimax_m2, lfm2_moe: ckpt_names ("w1", "w2", "w3") = gate, down, up).
MOE_LAYOUTS = {
    "Qwen2MoeForCausalLM": MoELayout("mlp", _qwen_moe_layer),
    "Qwen3MoeForCausalLM": MoELayout("mlp", _qwen_moe_layer),
    "MixtralForCausalLM": MoELayout("block_sparse_moe", _every_layer, ("w1", "w3", "w2")),
    "PhiMoEForCausalLM": MoELayout("block_sparse_moe", _every_layer, ("w1", "w3", "w2")),
    "OlmoeForCausalLM": MoELayout("mlp", _every_layer),
    "DeepseekV2ForCausalLM": MoELayout("mlp", _deepseek_moe_layer),
    "DeepseekV3ForCausalLM": MoELayout("mlp", _deepseek_moe_layer),
    "Glm4MoeForCausalLM": MoELayout("mlp", _deepseek_moe_layer),
    "Qwen3NextForCausalLM": MoELayout("mlp", _qwen_moe_layer),
    "Ernie4_5_MoeForCausalLM": MoELayout("mlp", _ernie_moe_layer),
    "MiniMaxM2ForCausalLM": MoELayout("mlp", _every_layer, ("w1", "w3", "w2"), stored_block="block_sparse_moe"),
    "Lfm2MoeForCausalLM": MoELayout("feed_forward", _lfm2_moe_layer, ("w1", "w3", "w2")),
}


def _assumed_moe_layer(c: Mapping, where: str, i: int) -> bool:
    """An architecture doctor does not know: the interleaving fields that config.json has, as the model families
    that use them read them (Llama-4's interleave_moe_layer_step: (i + 1) % step == 0, 0 none; Jamba's
    expert_layer_period / expert_layer_offset: i % period == offset; DeepSeek's first_k_dense_replace /
    moe_layer_freq; Qwen-MoE's decoder_sparse_step / mlp_only_layers), else every layer."""
    if "interleave_moe_layer_step" in c:
        step = c["interleave_moe_layer_step"]
        problem = not_an_int(step) or ("is negative" if step < 0 else None)
        if problem:
            raise ValueError(f"{_field(where, 'interleave_moe_layer_step')}={step!r} {problem}; supported: 0 or a "
                             "positive int")  # fmt: skip
        return step > 0 and (i + 1) % step == 0
    if "expert_layer_period" in c:
        period = _positive_int(where, "expert_layer_period", c["expert_layer_period"])
        offset = c.get("expert_layer_offset", 0)
        problem = not_an_int(offset) or ("is negative" if offset < 0 else None)
        if problem:
            raise ValueError(f"{_field(where, 'expert_layer_offset')}={offset!r} {problem}; supported: 0 or a "
                             "positive int")  # fmt: skip
        return i % period == offset
    if "first_k_dense_replace" in c or "moe_layer_freq" in c:
        return _deepseek_moe_layer(c, where, i)
    if "decoder_sparse_step" in c or "mlp_only_layers" in c:
        return _qwen_moe_layer(c, where, i)
    return True


DEFAULT_LAYOUT = MoELayout("mlp", _assumed_moe_layer)


@dataclass(frozen=True)
class MoESchemeLayers:
    """One distinct scheme the checkpoint's routed experts load with, and the layers using it."""

    scheme: WNA16Scheme | None  # None: the experts load unquantized (vLLM's unquantized MoE method)
    layers: tuple[int, ...]

    def describe(self) -> str:
        return "unquantized (vLLM's unquantized MoE method)" if self.scheme is None else self.scheme.describe()


def moe_layout(cfg: Mapping) -> tuple[str | None, MoELayout]:
    """The model's architecture in doctor's table (None if none is) and its MoE layout."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in MOE_LAYOUTS), None) if isinstance(archs, list) else None
    return arch, MOE_LAYOUTS.get(arch, DEFAULT_LAYOUT)


# config.json fields from which vLLM's model code sets a FusedMoEConfig field that adds to the experts' math, and
# model types whose experts carry biases: loading refuses those layers (activation.check_expert_math), so doctor does
_EXPERT_MATH_KEYS = ("swiglu_limit", "swiglu_alpha", "swiglu_beta")
_BIASED_EXPERTS = ("gpt_oss",)  # vLLM builds their FusedMoE with has_bias=True


def check_expert_math_of(cfg: Mapping, dims: MoEDims) -> None:
    """Refuse (ValueError, as loading would) a config whose experts compute more than act(gate) * up."""
    c = cfg if dims.where == "" else cfg["text_config"]
    extras = {k: c[k] for k in _EXPERT_MATH_KEYS if c.get(k) is not None}
    model_type = c.get("model_type") or cfg.get("model_type")
    if model_type in _BIASED_EXPERTS:
        extras = {"has_bias": True, **extras}
    if extras:
        where = f"config.json{f' ({dims.where[:-1]})' if dims.where else ''}, model_type {model_type!r}"
        check_expert_math("silu", extras, where)


def moe_layer_prefixes(cfg: Mapping, dims: MoEDims) -> tuple[dict[int, str], str]:
    """{decoder layer index: vLLM prefix of its routed experts}, and a line saying which naming was used."""
    archs = cfg.get("architectures") or []
    arch, layout = moe_layout(cfg)
    c = cfg if dims.where == "" else cfg["text_config"]
    prefixes = {i: layout.prefix(i) for i in range(dims.num_layers) if layout.is_moe_layer(c, dims.where, i)}
    if not prefixes:
        raise ValueError(f"config.json: none of the {dims.num_layers} layers is an MoE layer (see "
                         "decoder_sparse_step, mlp_only_layers, first_k_dense_replace); nothing to plan")  # fmt: skip
    naming = f"as vLLM's {arch}" if arch else f"assumed: {archs!r} is not in doctor's table, names may differ"
    return prefixes, f"{layout.prefix(0).replace('.0.', '.{i}.')} ({naming})"


def stored_tensors(model_dir: str | Path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape"}} of the checkpoint's safetensors files, from their headers (as vLLM's
    get_safetensors_params_metadata reads them at load; none when there are no files). A file whose header cannot
    be read is skipped: the readers that need it report it by name."""
    import struct

    out: dict[str, dict] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
        except Exception:  # noqa: BLE001 - a damaged file is reported by the readers that need it, with its name
            continue
        out.update({k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)})
    return out


def moe_schemes(
    parsed: CheckpointQuantConfig,
    prefixes: Mapping[int, str],
    stored: set[str] | None = None,
    experts: Sequence[str] = EXPERT_NAMES,
) -> tuple[MoESchemeLayers, ...]:
    """Each distinct scheme the routed-experts layers resolve to, in layer order.

    The same resolution loading uses (MoeWNA16PlusConfig.get_quant_method -> scheme_for(prefix,
    moe=True)), so dynamic rules, modules_in_block_to_quantize, modules_to_not_convert, ignore and
    several config_groups give the plan loading will run; a layer loading refuses raises here too. stored (the
    safetensors' tensor names): GPTQ experts stored quantized load so whatever modules_in_block_to_quantize lists
    (CheckpointQuantConfig.stored_experts_scheme), as in MoeWNA16PlusConfig.get_quant_method; other formats' experts
    stored quantized where the rules leave them unquantized are refused, as loading refuses them
    (stored_tensors.experts_left_unquantized). experts: the model's names of an expert's gate, up and down
    projections, which the rules are probed with (MoELayout).
    """
    by_scheme: dict[WNA16Scheme | None, list[int]] = {}
    for i, prefix in prefixes.items():
        scheme = parsed.scheme_for(prefix, moe=True, expert_names=experts)
        if scheme is None and (quantized := stored_quantized_experts(prefix, stored or ())):
            scheme = parsed.stored_experts_scheme(prefix)
            if scheme is None:
                raise experts_left_unquantized(prefix, experts, quantized[0])
        if scheme is not None and stored and (absent := scheme_tensors_absent(scheme, prefix, stored)):
            raise absent
        by_scheme.setdefault(scheme, []).append(i)
    return tuple(MoESchemeLayers(scheme, tuple(layers)) for scheme, layers in by_scheme.items())


def _layers_text(layers: Sequence[int]) -> str:
    """0, 2-5, 7: consecutive runs collapsed."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _launch_config_table(gemms, k: int, e: int, bits: int) -> list[str]:
    """CUDA launch configs over BATCH_SIZES per GEMM, with vLLM's in-tree BLOCK_SIZE_K and its legality."""
    out = [
        "",
        "CUDA WNA16 launch configs (BLOCK_SIZE_M/N/K), legal by construction; vLLM's in-tree BLOCK_SIZE_K beside:",
    ]
    for name, size_k, size_n, gs in gemms:
        try:
            cgs = cuda_group_size(size_k, -1 if gs == size_k else gs)
        except ValueError as exc:
            out.append(f"  {name}: CUDA kernel cannot take it: {exc}")
            continue
        for m in BATCH_SIZES:
            c = choose_cuda_block_config(m, k, e, size_k, size_n, cgs, bits)
            theirs = _vllm.moe_wna16_in_tree_path(m, k, e, size_k, size_n, cgs, bits)
            verdict = ""
            if theirs is not None and theirs[0] == "triton":
                verdict = "  vLLM: Triton path"
            elif theirs is not None:
                theirs = theirs[1]
                legal = size_k % theirs == 0 and theirs % cgs == 0 and theirs // cgs in LEGAL_K_RATIOS
                verdict = f"  vLLM: BK={theirs}" + ("" if legal else f" ILLEGAL (ratio {theirs / cgs:g}) -> crash")
            out.append(f"  {name:8s} M={m:5d}: {c.block_size_m}/{c.block_size_n}/{c.block_size_k} ok{verdict}")
    return out


def _act_order_padding(scheme: WNA16Scheme, dims: MoEDims, tp: int) -> tuple[int, int] | None:
    """(run, I_pad): act order on a TP rank runs its down projection padded (backends.base.sort_act_order),
    here for a random act order (random_act_order_padding; the weights fix it at load); None without."""
    if not scheme.desc_act or scheme.is_channelwise or tp == 1:
        return None
    return random_act_order_padding(dims.intermediate, scheme.group_size, tp, dims.experts, hidden=dims.hidden,
                                    bits=scheme.bits, w13_groups=max(1, dims.hidden // scheme.group_size),
                                    scale_bytes=2, has_zero_point=scheme.has_zero_point)  # fmt: skip


PLAN_ONLY = RunOptions(plan_only=True)


def ep_local_experts(experts: int, ep: int) -> int:
    """Experts on the first (largest) rank of vLLM's expert parallelism: ceil(E / EP) (linear placement, the
    first E % EP ranks one more than E // EP; vLLM's determine_expert_map)."""
    return -(-experts // ep)


def _problem(
    scheme, dims: MoEDims, i_loc: int, gs13: int, gs2: int, platform: str, sm: int | None, tp: int,
    act_dtype: torch.dtype = torch.bfloat16, options: RunOptions = PLAN_ONLY, ep: int = 1,
) -> MoEProblem:  # fmt: skip
    """One rank's MoEProblem as the layer builds it; act order at TP > 1 with the padded down projection of
    a random act order (_act_order_padding; the weights fix it at load). ep > 1: one rank of vLLM's expert
    parallelism (whole experts, ep_local_experts of them; tp is then 1 for the experts)."""
    padded = _act_order_padding(scheme, dims, tp)
    if padded is not None:
        gs2, i_loc = padded
    local = ep_local_experts(dims.experts, ep)
    return MoEProblem(scheme=scheme, hidden=dims.hidden, intermediate=i_loc, num_experts=local,
                      global_num_experts=dims.experts, top_k=dims.top_k, group_size_w13=gs13,
                      group_size_w2=gs2, act_dtype=act_dtype, platform=platform, sm=sm,
                      has_g_idx=scheme.desc_act, act_order_issue=act_order_split_issue(scheme, tp),
                      act_order_padded=padded is not None, use_ep=ep > 1, options=options)  # fmt: skip


def _platform(device: str) -> tuple[str, int | None]:
    return DEVICES[device].platform, DEVICES[device].sm


def _check_args(tp, device, ep: bool = False) -> None:
    if not_an_int(tp) or tp <= 0:
        raise ValueError(f"--tp={tp!r} is not a positive int; supported: a tensor-parallel size of 1 or more")
    if not isinstance(ep, bool):
        raise ValueError(f"--ep={ep!r} is not a flag (True/False)")
    if device not in DEVICES:
        raise ValueError(f"--device={device!r} is not supported; supported: {', '.join(sorted(DEVICES))}")


def _read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc}); supported: a checkpoint directory "
                         "with a config.json") from None  # fmt: skip
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); supported: a Hugging Face config.json") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds {type_name(cfg)}, not a JSON object; supported: a Hugging Face config.json")
    return cfg


def quantization_config_of(model_dir: str | Path, cfg: dict | None = None) -> dict:
    """The checkpoint's quantization config as vLLM finds it: config.json's quantization_config (or
    compression_config; a multimodal model's may sit in its text_config), else a side file beside it
    (checkpoint_config.SIDE_FILES: AutoGPTQ's, AutoAWQ's)."""
    cfg = _read_config(model_dir) if cfg is None else cfg
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    quant = cfg.get("quantization_config") or cfg.get("compression_config") or text.get("quantization_config")
    if quant is not None:
        return quant
    for name in SIDE_FILES:
        side = Path(model_dir) / name
        if side.is_file():
            try:
                return json.loads(side.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{side} is not valid JSON ({exc}); supported: the quantization config as "
                                 "the tool wrote it") from None  # fmt: skip
    raise ValueError(f"{model_dir}/config.json has no quantization_config and no {' or '.join(SIDE_FILES)} lies "
                     "beside it: not a quantized checkpoint; supported: GPTQ, AWQ or compressed-tensors "
                     "pack-quantized checkpoints")  # fmt: skip


def _group_sizes(scheme: WNA16Scheme, dims: MoEDims, tp: int, layer: str) -> tuple[int, int]:
    """(w13, w2) effective group sizes on one rank: the same calls loading makes (moe_method.create_weights)."""
    gs13 = effective_group_size(scheme, dims.hidden, layer=f"{layer} (gate/up, K=hidden)")
    gs2 = effective_group_size(scheme, dims.intermediate // tp, layer=f"{layer} (down, K=intermediate)",
                               tp_size=tp, full_size_k=dims.intermediate)  # fmt: skip
    return gs13, gs2


def _tp_problem(
    dims: MoEDims, groups: Sequence[MoESchemeLayers], prefixes: Mapping[int, str], tp: int, ep: bool = False
) -> str | None:
    """Why TP=tp cannot load this checkpoint (the first reason), or None. With ep (vLLM's
    --enable-expert-parallel) the experts stay whole: only the attention heads split."""
    if not ep and dims.intermediate % tp:
        return f"the experts' intermediate size {dims.intermediate} is not divisible by it"
    if dims.num_heads is not None and dims.num_heads % tp:
        return f"{_field(dims.where, 'num_attention_heads')}={dims.num_heads} is not divisible by it (vLLM needs that)"
    if ep and dims.experts < tp:
        return f"{dims.experts} experts cannot give each of {tp} EP ranks one"
    for g in groups:
        if g.scheme is not None:
            try:  # under expert parallelism a rank's experts are whole: their K as at TP 1
                _group_sizes(g.scheme, dims, 1 if ep else tp, prefixes[g.layers[0]])
            except ValueError as exc:
                return str(exc)
    return None


@dataclass(frozen=True)
class CheckpointPlan:
    """What doctor resolved from config.json: the parsed config, the MoE dims, each MoE scheme and its layers."""

    model_dir: str
    parsed: CheckpointQuantConfig
    dims: MoEDims
    naming: str
    prefixes: Mapping[int, str]
    groups: tuple[MoESchemeLayers, ...]
    tp: int
    ep: bool = False  # vLLM's --enable-expert-parallel: the tp ranks hold whole experts

    @property
    def moe_tp(self) -> int:
        """How many ways each expert's intermediate size is split: 1 under expert parallelism."""
        return 1 if self.ep else self.tp

    @property
    def ep_size(self) -> int:
        return self.tp if self.ep else 1


def resolve_checkpoint(model_dir: str | Path, tp: int = 1, device: str = "sm90", ep: bool = False) -> CheckpointPlan:
    """Parse config.json as loading does and refuse what loading would refuse at this --tp (and --ep: vLLM's
    expert parallelism over the tp ranks) (ValueError naming the field or flag, its value and what works)."""
    _check_args(tp, device, ep)
    cfg = _read_config(model_dir)
    parsed = parse_quantization_config(quantization_config_of(model_dir, cfg))
    dims = moe_dims(cfg)
    check_expert_math_of(cfg, dims)
    prefixes, naming = moe_layer_prefixes(cfg, dims)
    layout = moe_layout(cfg)[1]
    stored = stored_tensors(model_dir)
    if mismatch := format_mismatch(parsed.quant_method, stored):
        raise mismatch
    groups = moe_schemes(parsed, prefixes, layout.as_vllm_names(set(stored)), layout.experts)
    for g in groups:  # TP-independent: the sizes against each scheme's packing and group size
        if g.scheme is not None:
            check_packable(g.scheme.bits, dims.hidden, dims.intermediate, prefixes[g.layers[0]])
            effective_group_size(g.scheme, dims.hidden, layer=f"{prefixes[g.layers[0]]} (gate/up, K=hidden)")
    problem = _tp_problem(dims, groups, prefixes, tp, ep)
    if problem is not None:
        working = [t for t in range(1, MAX_SUGGESTED_TP + 1) if _tp_problem(dims, groups, prefixes, t, ep) is None]
        if not working:  # not the flag's fault: no size loads it
            raise ValueError(f"no tensor-parallel size (1-{MAX_SUGGESTED_TP}{', with --ep' if ep else ''}) can load "
                             f"this checkpoint: {_tp_problem(dims, groups, prefixes, 1, ep) or problem}")  # fmt: skip
        flag = f"--tp={tp} --ep" if ep else f"--tp={tp}"
        raise ValueError(f"{flag} (tensor-parallel size, TP{', with expert parallelism' if ep else ''}) cannot load "
                         f"this checkpoint: {problem}; TP sizes that pass every check (up to {MAX_SUGGESTED_TP}"
                         f"{', with --ep' if ep else ''}): {', '.join(map(str, working)) or 'none'}")  # fmt: skip
    return CheckpointPlan(str(model_dir), parsed, dims, naming, prefixes, groups, tp, ep)


def layer_problem(model_dir: str | Path, tp: int = 1, device: str = "sm90", ep: bool = False) -> MoEProblem:
    """The MoEProblem of the checkpoint's first quantized MoE layer on one TP (or, with ep, EP) rank of
    `device`, from config.json alone (plan_only: backends judge the device named, not this machine)."""
    cp = resolve_checkpoint(model_dir, tp, device, ep)
    g = next((g for g in cp.groups if g.scheme is not None), None)
    if g is None:
        raise ValueError(f"{model_dir}: every MoE layer loads unquantized; the plugin runs none of them")
    return _rank_problem(cp, g, *_platform(device))


def _rank_problem(
    cp: CheckpointPlan, g: MoESchemeLayers, platform: str, sm: int | None, act_dtype: torch.dtype = torch.bfloat16,
    options: RunOptions = PLAN_ONLY,
) -> MoEProblem:  # fmt: skip
    """One rank's MoEProblem of scheme group g: the experts split by cp.moe_tp (TP) or held whole (EP)."""
    gs13, gs2 = _group_sizes(g.scheme, cp.dims, cp.moe_tp, cp.prefixes[g.layers[0]])
    return _problem(g.scheme, cp.dims, cp.dims.intermediate // cp.moe_tp, gs13, gs2, platform, sm, cp.moe_tp,
                    act_dtype, options, ep=cp.ep_size)  # fmt: skip


def moe_problems(
    model_dir: str | Path,
    tp: int,
    platform: str,
    sm: int | None,
    act_dtype: torch.dtype = torch.bfloat16,
    ep: bool = False,
) -> list[tuple[MoESchemeLayers, MoEProblem]]:
    """Each distinct quantized MoE scheme of the checkpoint with the MoEProblem of one TP (or, with ep, EP)
    rank on a device of `platform` / `sm` (`vllm-wna16 tune` times them on this machine's GPU). Raises where
    loading would."""
    cp = resolve_checkpoint(model_dir, tp, ep=ep)
    out = []
    for g in cp.groups:
        if g.scheme is None:
            continue
        out.append((g, _rank_problem(cp, g, platform, sm, act_dtype, RunOptions())))
    if not out:
        raise ValueError(f"{model_dir}: every MoE layer loads unquantized; the plugin runs none of them")
    return out


def _scheme_plan(cp: CheckpointPlan, g: MoESchemeLayers, device: str, launch_configs: bool) -> list[str]:
    scheme, dims, tp = g.scheme, cp.dims, cp.moe_tp
    i_loc = dims.intermediate // tp
    gs13, gs2 = _group_sizes(scheme, dims, tp, cp.prefixes[g.layers[0]])
    linear = (LINEAR_METHOD if owns_linear(cp.parsed.quant_method, scheme)
              else f"vLLM's in-tree {cp.parsed.quant_method}")  # fmt: skip
    out = [f"scheme: {scheme.describe()} (MoE layers {_layers_text(g.layers)}; linear layers: {linear})",
           "GEMMs per rank:"]  # fmt: skip
    gemms = [("gate/up", dims.hidden, 2 * i_loc, gs13), ("down", i_loc, dims.hidden, gs2)]
    for name, size_k, size_n, gs in gemms:
        regroup = "" if gs == scheme.group_size_for(size_k) or scheme.is_channelwise else " (re-grouped exactly)"
        out.append(f"  {name:8s} K={size_k:6d} N={size_n:6d} group={gs if gs != size_k else 'channel'}{regroup}")
    if (padded := _act_order_padding(scheme, dims, tp)) is not None:
        out.append(f"  down     act order: triton pads each group's rows on a rank to runs of {padded[0]}: K={padded[1]} "
                   f"({padded[1] / i_loc:.2f}x) for a random act order, fixed at load")  # fmt: skip
    problem = _rank_problem(cp, g, *_platform(device))
    if launch_configs:
        out += _launch_config_table(gemms, dims.top_k, problem.num_experts, scheme.bits)
    verdicts = collect_verdicts(problem)
    requested, source = _requested()
    if requested == "auto":
        chosen = next((v.backend for v in verdicts if v.ok), None)
    else:  # as loading does: an explicit backend that cannot run this layer is refused (ValueError, exit 2)
        chosen = select_backend(problem, requested, source).backend.name
    label = "auto" if requested == "auto" else f"{source}={requested}"
    out += ["", f"backend on {device} ({label}): {chosen}"]
    for v in verdicts:
        out.append(f"  - {v.backend}: {'ok' if v.ok else 'rejected: ' + v.reason}")
    if launch_configs and chosen is not None:
        selection = select_backend(problem, requested, source)
        out += ["", f"launch plan on {DEVICES[device].describe()} ({label}), per batch size M (tokens):"]
        out += [
            "  " + line
            for m in BATCH_SIZES
            for line in launch_plan(problem, m, DEVICES[device], selection=selection).describe().split("\n")
        ]
        out += ["", *_composition(DEVICES[device], selection)]
    return out


def _requested() -> tuple[str, str]:
    """The backend loading would be asked for (VLLM_WNA16_PLUS_BACKEND; doctor has no --moe-backend), after the
    plugin's other variables are checked as loading checks them (a bad value: ValueError, exit 2)."""
    import os

    from vllm_wna16_plugin.kernels.triton.td_gate import td_request_from_env
    from vllm_wna16_plugin.oracle import resolve_request
    from vllm_wna16_plugin.user_tables import use_tuned

    compose.check_settings(os.environ)
    td_request_from_env()
    use_tuned()
    requested, source = resolve_request(None)
    return requested, "auto" if source == "--moe-backend" else source


# where each partner is what vLLM would run (compose.partners' order: Humming where installed, else Marlin)
_PARTNER_WHERE = {"humming": "where humming-kernels is installed (vLLM 0.33-0.34)",
                  "marlin": "where Humming is not (vLLM 0.26-0.32)"}  # fmt: skip


def _composition(device, selection) -> list[str]:
    """One line per compose.partners() entry: which batch sizes auto hands that vLLM kernel where it is the
    layer's partner and its second copy fits (compose.compose_decision), or why it never does."""
    import os

    lines = []
    for p in compose.partners():
        if why_not := compose.composable_with(selection, p.backend):
            lines.append(f"composed with {p.label}: no ({why_not})")
            continue
        if compose.compose_setting(os.environ.get(p.env), p.env) == "off":
            lines.append(f"composed with {p.label}: no ({p.env}={os.environ.get(p.env)})")
            continue
        composed = compose.compose_with(selection, p.backend)
        takes = [m for m in BATCH_SIZES
                 if launch_plan(composed.problem, m, device, selection=composed).backend == p.backend]  # fmt: skip
        lines.append(f"composed with {p.label} {_PARTNER_WHERE[p.backend]} and memory allows ({p.env}): "
                     f"M={', '.join(map(str, takes))} run on {p.label}, the others as above")  # fmt: skip
    return lines + [_hopper_line(device, selection)]


def _hopper_line(device, selection) -> str:
    """Which batch sizes auto hands the plugin's hopper kernel (backends/hopper.py) where its copy fits, beside a
    partner (whose batches come first), or why it never does; and whether this install built the kernel."""
    import os

    from vllm_wna16_plugin.backends.hopper import ENV_COMPOSE
    from vllm_wna16_plugin.kernels.hopper_ops import extension_error

    built = extension_error()
    here = "built in this install" if built is None else f"this install: {built}"
    if why_not := compose.hopper_composable(selection):
        return f"with the hopper kernel: no ({why_not})"
    if compose.compose_setting(os.environ.get(ENV_COMPOSE), ENV_COMPOSE) == "off":
        return f"with the hopper kernel: no ({ENV_COMPOSE}={os.environ.get(ENV_COMPOSE)})"
    composed = compose.with_hopper(selection)
    takes = [m for m in BATCH_SIZES
             if launch_plan(composed.problem, m, device, selection=composed).backend == "hopper"]  # fmt: skip
    line = (f"with the hopper kernel where memory allows ({ENV_COMPOSE}; {here}): M={', '.join(map(str, takes))} "
            "run on hopper, alone or before Marlin's batches")  # fmt: skip
    if compose.composable_with(selection, "humming") is None:  # Humming's rule goes first (backends/hopper.py)
        beside = compose.hopper_composable(compose.compose_with(selection, "humming"))
        line += f"; composed with Humming: {'no hopper copy (' + beside + ')' if beside else 'after its batches'}"
    return line


def plan(model_dir: str | Path, tp: int = 1, device: str = "sm90", launch_configs: bool = True,
         ep: bool = False) -> str:  # fmt: skip
    """The doctor's report as text: one section per distinct MoE scheme loading resolves (unquantized
    layers listed). Raises ValueError where loading would (the same message, or the flag's).

    launch_configs=False leaves out the CUDA launch-config table (the demo's short plan). ep: plan the
    tp ranks as vLLM's --enable-expert-parallel builds them (whole experts per rank)."""
    cp = resolve_checkpoint(model_dir, tp, device, ep)
    d = cp.dims
    if ep and tp > 1:
        lo, extra = divmod(d.experts, tp)
        per_rank = f"{lo} per rank" if not extra else f"{lo + 1} on the first {extra} ranks, {lo} on the others"
        split = f"TP={tp} with expert parallelism (EP={tp}): whole experts, {per_rank}"
    else:
        split = f"TP={tp} -> I per rank {d.intermediate // tp}"
    out = [f"checkpoint: {model_dir}",
           f"MoE: E={d.experts}, top_k={d.top_k}, H={d.hidden}, I={d.intermediate}; {split}",
           f"MoE layers: {len(cp.prefixes)} of {d.num_layers}, {cp.naming}; schemes as loading resolves them:"]  # fmt: skip
    out += [f"  layers {_layers_text(g.layers)}: {g.describe()}" for g in cp.groups]
    from vllm_wna16_plugin.kernels.cuda_ops import extension_archs, extension_error

    out.append(cuda_ops_line(device, extension_archs(), extension_error()))
    for g in cp.groups:
        if g.scheme is not None:
            out += [""] + _scheme_plan(cp, g, device, launch_configs)
    return "\n".join(out)


def cuda_ops_line(device: str, archs: list[str] | None, error: str | None) -> str:
    """Whether this machine's build of the plugin's CUDA ops can serve `device` (the cuda backend)."""
    if archs is None or error:
        return f"CUDA ops (this install): not usable: {error or 'not built'}"
    built = ", ".join(archs) or "no GPU code found"
    platform, sm = DEVICES[device].platform, DEVICES[device].sm
    if platform != "cuda":
        return f"CUDA ops (this install): built for {built}; the cuda backend does not run on {device}"
    # SASS runs on its own major version at an equal or higher minor; PTX is compiled for any newer GPU
    runs = any(
        (a.startswith("sm_") and int(a[3:]) // 10 == sm // 10 and int(a[3:]) <= sm)
        or (a.startswith("compute_") and int(a[8:]) <= sm)
        for a in archs
    )
    verdict = "covers" if runs else "has no code for"
    return f"CUDA ops (this install): built for {built}; {verdict} {device}"


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory with config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--ep", action="store_true",
                   help="plan as `vllm serve --enable-expert-parallel`: the --tp ranks hold whole experts (EP=TP)")  # fmt: skip
    p.add_argument("--device", choices=sorted(DEVICES), default="sm90",
                   help="device to plan for (default sm90, planned as the H200 whose tuned tables ship)")  # fmt: skip


def run_doctor(args) -> int:
    """Errors propagate: cli.main turns them into one line on stderr and exit status 2."""
    print(plan(args.model_dir, tp=args.tp, device=args.device, ep=args.ep))
    return 0
