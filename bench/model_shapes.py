"""A model's routed-experts layer as one vLLM rank runs it, from the model's HF config.json (no GPU, no torch).

    shape = model_moe_shape(json.load(open("config.json")), tp=4)   # Shape("Qwen3-30B-A3B@tp4", 128, 8, 2048, 192, 128)

bench/bench_moe.py --model-config times that shape (--dry-run prints it). The fields are read as vLLM's model
files read them (LAYOUTS names the files), the intermediate size is split over the tensor-parallel ranks as
vLLM's FusedMoE splits it (intermediate_size_per_partition = I // tp, experts unchanged without expert
parallelism), and each GEMM's group size is the one the plugin's loader uses on that rank
(checkpoint_config.effective_group_size: re-grouped exactly where the group size does not divide I / tp, or
the TP size refused with the sizes that work).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_wna16_plugin.checkpoint_config import MAX_SUGGESTED_TP, effective_group_size, parse_quantization_config
from vllm_wna16_plugin.scheme import CHANNELWISE, SUPPORTED_BITS, PackFormat, WNA16Scheme

DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True)
class Shape:
    """One rank's routed-experts layer: E local experts, top_k, H, I on this rank, the scheme's group size
    (-1 channel-wise) and bits. gs_w13 / gs_w2: each GEMM's effective group size along its K (H, I) when it
    is not `gs` itself (a group size re-grouped for I / tp, or channel-wise); `note`: how it was derived."""

    name: str
    E: int
    top_k: int
    H: int
    I: int  # noqa: E741
    gs: int  # -1 channel-wise
    bits: int = 4
    gs_w13: int | None = None
    gs_w2: int | None = None
    note: str = ""

    @property
    def group_w13(self) -> int:
        """K elements per scale of GEMM1 (gate/up, K = H); H when channel-wise."""
        return self.gs_w13 or (self.H if self.gs == CHANNELWISE else self.gs)

    @property
    def group_w2(self) -> int:
        """K elements per scale of GEMM2 (down, K = I on this rank); I when channel-wise."""
        return self.gs_w2 or (self.I if self.gs == CHANNELWISE else self.gs)

    def describe(self) -> str:
        gs = "channel-wise" if self.gs == CHANNELWISE else f"group {self.gs}"
        groups = f"gate/up K={self.H} group {self.group_w13}, down K={self.I} group {self.group_w2}"
        return (f"{self.name}: E={self.E} top_k={self.top_k} H={self.H} I={self.I} int{self.bits} {gs} "
                f"({groups})")  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """One spelling of the routed-experts fields in HF configs, the models that use it and the vLLM model
    files (vllm/model_executor/models/) whose FusedMoE(num_experts=, top_k=, intermediate_size=) read them."""

    experts: str
    top_k: str
    intermediate: str
    models: str
    vllm_files: str


# First complete layout wins: Qwen's num_experts + moe_intermediate_size before OLMoE's num_experts +
# intermediate_size (Qwen MoE configs also carry intermediate_size: the dense / shared MLP's, not the experts').
LAYOUTS = (
    Layout("num_experts", "num_experts_per_tok", "moe_intermediate_size",
           "Qwen1.5/Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE and Qwen3-VL-MoE (text_config)",
           "qwen2_moe.py, qwen3_moe.py, qwen3_next.py (Qwen3.5-MoE: qwen3_5.py, qwen3_next's block), qwen3_vl_moe.py"),
    Layout("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
           "DeepSeek-V2/V2-Lite/V3/R1, Kimi-K2, GLM-4.5/4.6/4.5-Air (glm4_moe)", "deepseek_v2.py, glm4_moe.py"),
    Layout("num_local_experts", "num_experts_per_tok", "intermediate_size",
           "Mixtral, PhiMoE, GPT-OSS, Llama 4 (text_config), MiniMax-M2, GraniteMoE",
           "mixtral.py, phimoe.py, gpt_oss.py, llama4.py, minimax_m2.py, granitemoe.py"),
    Layout("num_experts", "num_experts_per_tok", "intermediate_size", "OLMoE", "olmoe.py"),
    Layout("moe_num_experts", "moe_k", "moe_intermediate_size", "ERNIE-4.5-MoE", "ernie45_moe.py"),
)  # fmt: skip

# model_type -> the vLLM model file (vllm/model_executor/models/) that builds its FusedMoE, for the notes.
MODEL_FILES = {
    "qwen2_moe": "qwen2_moe.py", "qwen3_moe": "qwen3_moe.py", "qwen3_next": "qwen3_next.py",
    "qwen3_5_moe": "qwen3_5.py", "qwen3_5_moe_text": "qwen3_5.py", "qwen3_vl_moe": "qwen3_vl_moe.py",
    "deepseek_v2": "deepseek_v2.py", "deepseek_v3": "deepseek_v2.py", "kimi_k2": "deepseek_v2.py",
    "glm4_moe": "glm4_moe.py", "mixtral": "mixtral.py", "phimoe": "phimoe.py", "gpt_oss": "gpt_oss.py",
    "llama4": "llama4.py", "llama4_text": "llama4.py", "minimax_m2": "minimax_m2.py", "granitemoe": "granitemoe.py",
    "olmoe": "olmoe.py", "ernie4_5_moe": "ernie45_moe.py",
}  # fmt: skip

# Where multimodal and wrapper configs keep the language model's config (vLLM's hf_text_config).
SUB_CONFIGS = ("text_config", "llm_config", "language_config", "thinker_config.text_config")

WNA16_METHODS = ("gptq", "awq", "compressed-tensors")


def _get(cfg: Mapping, dotted: str):
    for part in dotted.split("."):
        cfg = cfg.get(part) if isinstance(cfg, Mapping) else None
    return cfg


def _positive_int(where: str, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json {where}{key}={value!r} is not a positive int; supported: a positive int")
    return value


def understood_spellings() -> str:
    return "; ".join(f"{lt.experts} + {lt.top_k} + {lt.intermediate} ({lt.models})" for lt in LAYOUTS)


def find_moe_fields(config: Mapping) -> tuple[str, Mapping, Layout]:
    """(where, the (sub-)config, its layout) of the routed-experts fields; ValueError naming what is missing."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict (config.json), not {type(config).__name__}")
    tried = []
    for where in ("", *SUB_CONFIGS):
        c = config if where == "" else _get(config, where)
        if not isinstance(c, Mapping):
            continue
        prefix = f"{where}." if where else ""
        candidates = [lt for lt in LAYOUTS if c.get(lt.experts) is not None]
        if not candidates:
            tried.append(where or "top level")
            continue
        for lt in candidates:
            if all(c.get(k) is not None for k in (lt.top_k, lt.intermediate, "hidden_size")):
                return prefix, c, lt
        gaps = []
        for lt in candidates:
            missing = [k for k in (lt.top_k, lt.intermediate, "hidden_size") if c.get(k) is None]
            gaps.append(f"{' and '.join(prefix + k for k in missing)} (the {lt.models} spelling)")
        raise ValueError(
            f"config.json has {prefix}{candidates[0].experts} but is missing {' or '.join(gaps)}; "
            f"understood spellings: {understood_spellings()}"
        )
    experts = sorted({lt.experts for lt in LAYOUTS})
    raise ValueError(
        f"config.json has no routed-experts count: none of {', '.join(experts)} at {', '.join(tried)} (is it an MoE "
        f"model?); understood spellings: {understood_spellings()}; looked in the top level and "
        f"{', '.join(SUB_CONFIGS)}"
    )


def _vllm_file(config: Mapping, c: Mapping, lt: Layout) -> str:
    for cfg in (config, c):
        if cfg.get("model_type") in MODEL_FILES:
            return MODEL_FILES[cfg["model_type"]]
    return lt.vllm_files


def model_name(config: Mapping, path: str | Path | None = None) -> str:
    """The model's name for shape names: the config's directory, else _name_or_path, else its model_type."""
    if path is not None:
        p = Path(path)
        p = p.parent if p.name == "config.json" or p.is_file() else p
        if p.resolve().name:
            return p.resolve().name
    if isinstance(config.get("_name_or_path"), str) and config["_name_or_path"].strip("/"):
        return config["_name_or_path"].rstrip("/").rsplit("/", 1)[-1]
    return str(config.get("model_type") or "model")


def _scheme(config: Mapping, where: str, bits: int | None, group_size: int | None) -> tuple[WNA16Scheme, str]:
    """The experts' scheme: --bits/--group-size where given, the rest from a WNA16 quantization_config, else
    int4 group 128. A quantization_config that is not WNA16 (fp8, mxfp4, ...) is not read (noted)."""
    for name, value, allowed in (("bits", bits, SUPPORTED_BITS), ("group_size", group_size, None)):
        if value is None:
            continue
        bad = isinstance(value, bool) or not isinstance(value, int)
        bad = bad or (value not in allowed if allowed else value != CHANNELWISE and value <= 0)
        if bad:
            ok = ", ".join(map(str, allowed)) if allowed else "a positive int or -1 (channel-wise)"
            raise ValueError(f"--{name.replace('_', '-')}={value!r} is not supported; supported: {ok}")
    quant = config.get("quantization_config") or _get(config, f"{where}quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    method = method.lower().replace("_", "-") if isinstance(method, str) else method
    if bits is not None and group_size is not None:
        scheme, source = None, "--bits/--group-size"
    elif isinstance(quant, Mapping) and method in WNA16_METHODS:
        scheme = parse_quantization_config(quant).scheme  # the plugin's own parse: its errors as they are
        source = f"quantization_config ({method})"
        if bits is not None or group_size is not None:
            source += ", " + ("--bits" if bits is not None else "--group-size")
    else:
        scheme = None
        source = "defaults (--bits/--group-size)" if bits is None and group_size is None else "--bits/--group-size"
        if isinstance(quant, Mapping):
            source += f"; quantization_config quant_method={quant.get('quant_method')!r} is not WNA16, not read"
    if scheme is None:
        scheme = WNA16Scheme(DEFAULT_BITS, DEFAULT_GROUP_SIZE, False, PackFormat.GPTQ, source="bench's")
    over = {k: v for k, v in (("bits", bits), ("group_size", group_size)) if v is not None}
    return (dataclasses.replace(scheme, **over) if over else scheme), source


def _tp_refusal(scheme: WNA16Scheme, hidden: int, inter: int, tp: int, heads: int | None, where: str, i_key: str):
    """Why vLLM / the plugin cannot load the experts at this TP size, or None."""
    if inter % tp:
        return f"config.json {where}{i_key}={inter} is not divisible by tp={tp} (vLLM splits it evenly)"
    if heads is not None and heads % tp:
        return f"config.json {where}num_attention_heads={heads} is not divisible by tp={tp} (vLLM needs that)"
    try:
        effective_group_size(scheme, inter // tp, layer="experts (down)", tp_size=tp, full_size_k=inter)
    except ValueError as exc:  # its list of TP sizes ignores the heads: the caller's list replaces it
        return str(exc).split("; tensor-parallel sizes that work")[0]
    return None


def model_moe_shape(
    config: Mapping,
    tp: int = 1,
    bits: int | None = None,
    group_size: int | None = None,
    *,
    ep: bool = False,
    name: str | None = None,
) -> Shape:
    """The routed-experts layer one rank of `config`'s model runs at tensor-parallel size `tp`.

    Fields (LAYOUTS; top level or a SUB_CONFIGS language config, vLLM's hf_text_config), as the vLLM model
    files in vllm/model_executor/models/ pass them to FusedMoE(num_experts=, top_k=, intermediate_size=):
    - Qwen2/Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE (qwen2_moe.py, qwen3_moe.py, qwen3_next.py): num_experts,
      num_experts_per_tok, moe_intermediate_size (their intermediate_size is the dense/shared MLP's);
    - DeepSeek-V2/V3, Kimi-K2 (deepseek_v2.py), GLM-4.5 (glm4_moe.py): n_routed_experts, num_experts_per_tok,
      moe_intermediate_size (shared experts are a separate dense MLP, not timed here);
    - Mixtral (mixtral.py), PhiMoE (phimoe.py), GPT-OSS (gpt_oss.py), Llama 4 (llama4.py: its text_config's
      intermediate_size; intermediate_size_mlp is the dense layers'), MiniMax-M2, GraniteMoE:
      num_local_experts, num_experts_per_tok, intermediate_size;
    - OLMoE (olmoe.py): num_experts, num_experts_per_tok, intermediate_size;
    - ERNIE-4.5-MoE (ernie45_moe.py): moe_num_experts, moe_k, moe_intermediate_size.
    H is hidden_size throughout.

    Sharding (vllm/model_executor/layers/fused_moe/layer.py): without expert parallelism every rank keeps all
    E experts and I // tp of each expert's intermediate size (tp must divide I, and vLLM needs it to divide
    num_attention_heads); with ep=True (--enable-expert-parallel, data parallel 1) the experts are split over
    the tp ranks instead (expert_map_manager.determine_expert_map: rank 0 holds ceil(E / tp)) and I is whole.
    Bits and group size: `bits` / `group_size` where given, the rest from a WNA16 quantization_config (the
    plugin's parse_quantization_config), else int4 group 128. Each GEMM's group size is
    checkpoint_config.effective_group_size's, the plugin loader's. ValueError names the missing fields and
    the understood spellings, or why the TP size cannot load and the sizes that can.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tp={tp!r} is not a positive int; supported: a positive int")
    where, c, lt = find_moe_fields(config)
    experts = _positive_int(where, lt.experts, c[lt.experts])
    top_k = _positive_int(where, lt.top_k, c[lt.top_k])
    hidden = _positive_int(where, "hidden_size", c["hidden_size"])
    inter = _positive_int(where, lt.intermediate, c[lt.intermediate])
    if top_k > experts:
        raise ValueError(f"config.json {where}{lt.top_k}={top_k} is larger than {where}{lt.experts}={experts}")
    heads = c.get("num_attention_heads")
    heads = heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else None
    scheme, source = _scheme(config, where, bits, group_size)
    try:
        gs13 = effective_group_size(scheme, hidden, layer="experts (gate/up, K=hidden)")
    except ValueError as exc:  # H is never split: no TP size helps
        why = str(exc).split("; tensor-parallel sizes that work")[0]
        raise ValueError(f"{scheme.describe()} cannot quantize this model's experts at any TP size: {why}") from None
    moe_tp = 1 if ep else tp
    refusal = _tp_refusal(scheme, hidden, inter, moe_tp, heads if not ep else None, where, lt.intermediate)
    if refusal is None and ep and heads is not None and heads % tp:
        refusal = f"config.json {where}num_attention_heads={heads} is not divisible by tp={tp} (vLLM needs that)"
    if refusal is not None:
        working = [t for t in range(1, MAX_SUGGESTED_TP + 1)
                   if _tp_refusal(scheme, hidden, inter, 1 if ep else t, heads, where, lt.intermediate) is None
                   and (not ep or heads is None or heads % t == 0)]  # fmt: skip
        raise ValueError(
            f"tp={tp}{' with expert parallelism' if ep else ''} cannot load this model's experts "
            f"({scheme.describe()}): {refusal}; TP sizes that work: {', '.join(map(str, working)) or 'none'}"
        )
    i_loc = inter // moe_tp
    e_loc = -(-experts // tp) if ep else experts
    gs2 = effective_group_size(scheme, i_loc, layer="experts (down)", tp_size=moe_tp, full_size_k=inter)
    gs = CHANNELWISE if scheme.is_channelwise else scheme.group_size
    suffix = "" if (scheme.bits, gs) == (DEFAULT_BITS, DEFAULT_GROUP_SIZE) else \
        f"-int{scheme.bits}-{'ch' if gs == CHANNELWISE else f'g{gs}'}"  # fmt: skip
    base = name or model_name(config)
    split = f"{where}{lt.intermediate}={inter}" + (f" / tp {tp} = {i_loc}" if moe_tp > 1 else "")
    if ep:
        split += f", {where}{lt.experts}={experts} over {tp} EP ranks: {e_loc} on rank 0"
    regroup = [f"{what} re-grouped {gs} -> {g}" for what, g, k in (("gate/up", gs13, hidden), ("down", gs2, i_loc))
               if gs != CHANNELWISE and g != gs]  # fmt: skip
    note = (f"{config.get('model_type') or '?'}: {where}{lt.experts}={experts}, {where}{lt.top_k}={top_k}, "
            f"{where}hidden_size={hidden}, {split} (vLLM {_vllm_file(config, c, lt)}); "
            f"int{scheme.bits} {'channel-wise' if gs == CHANNELWISE else f'group {gs}'} from {source}"
            + "".join(f"; {r}" for r in regroup)
            + ("; timed symmetric, without the checkpoint's zero points" if scheme.has_zero_point else "")
            + ("; timed without act order (no g_idx)" if scheme.desc_act else "")
            + ("; timed with silu and no expert biases (GPT-OSS runs swigluoai with biases)"
               if "gpt_oss" in (config.get("model_type"), c.get("model_type")) else ""))  # fmt: skip
    return Shape(
        name=f"{base}@tp{tp}{'-ep' if ep else ''}{suffix}",
        E=e_loc,
        top_k=top_k,
        H=hidden,
        I=i_loc,
        gs=gs,
        bits=scheme.bits,
        gs_w13=None if gs13 == (hidden if gs == CHANNELWISE else gs) else gs13,
        gs_w2=None if gs2 == (i_loc if gs == CHANNELWISE else gs) else gs2,
        note=note,
    )


def load_config(path: str | Path) -> dict:
    """config.json at `path` (a file, or a directory holding config.json)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"--model-config {path}: no such file (a config.json, or a directory holding one)")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model-config {p}: not JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model-config {p}: a JSON object expected, got {type(cfg).__name__}")
    return cfg


def shapes_from_configs(
    paths, tps, bits: int | None = None, group_size: int | None = None, *, ep: bool = False, name: str | None = None
) -> list[Shape]:
    """model_moe_shape of each config at each TP size; ValueError prefixed with the config's path."""
    out = []
    for path in paths:
        cfg = load_config(path)
        for tp in tps:
            try:
                out.append(model_moe_shape(cfg, tp, bits, group_size, ep=ep, name=name or model_name(cfg, path)))
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
    return out
