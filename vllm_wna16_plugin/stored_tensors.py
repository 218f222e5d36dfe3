"""What a checkpoint's stored tensors say against its `quantization_config`, before any tensor is read.

Loading (quant_config.maybe_update_config, get_quant_method) and `vllm-wna16 doctor` both read the safetensors
headers (names, dtypes, shapes) and judge them here, so that a config that disagrees with its files is refused
by the field that is wrong, the value it has and the fix, instead of vLLM's "has no parameter" AttributeError on
the first tensor of another format, or "missing tensors" at the end of the load.

Each format's quantized module, by the last part of its tensor names (the writers': AutoGPTQ / GPTQModel, AutoAWQ,
llm-compressor):

    gptq                 qweight (K * bits / 32, N) int32, qzeros, scales (G, N), g_idx (K)
    awq                  qweight (K, N * bits / 32) int32, qzeros, scales (G, N); never a g_idx
    compressed-tensors   weight_packed, weight_scale, weight_shape, weight_zero_point?, weight_g_idx?
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence

from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme

FORMATS = ("gptq", "awq", "compressed-tensors")


def _json(key: str, value) -> str:
    return f"{json.dumps(key)}: {json.dumps(value)}"


def _modules(metadata: Mapping[str, Mapping], leaf: str) -> list[str]:
    return sorted(name[: -len(leaf) - 1] for name in metadata if name.endswith(f".{leaf}"))


def stored_format(metadata: Mapping[str, Mapping]) -> tuple[str, str] | None:
    """(format, the tensor that shows it) of a checkpoint's quantized modules, from its safetensors headers
    ({name: {"dtype", "shape"}}, shapes optional), or None when they show none (no quantized module, or a GPTQ /
    AWQ module without the shapes or g_idx that tell the two apart):

        weight_packed                                     -> compressed-tensors
        qweight beside g_idx                              -> gptq
        qweight with as many columns as its scales (N)    -> gptq  (packed along K)
        qweight with fewer columns than its scales        -> awq   (packed along N)"""
    if packed := _modules(metadata, "weight_packed"):
        return "compressed-tensors", f"{packed[0]}.weight_packed"
    qweights = _modules(metadata, "qweight")
    if not qweights:
        return None
    for module in qweights:
        if f"{module}.g_idx" in metadata:
            return "gptq", f"{module}.g_idx"
    for module in qweights:
        q, s = metadata[f"{module}.qweight"].get("shape"), (metadata.get(f"{module}.scales") or {}).get("shape")
        if not (q and s and len(q) == 2 and len(s) == 2):
            continue
        if q[1] == s[1]:
            return "gptq", f"{module}.qweight {list(q)} beside scales {list(s)}: packed along K"
        if q[1] < s[1]:
            return "awq", f"{module}.qweight {list(q)} beside scales {list(s)}: packed along N"
    return None


def format_mismatch(quant_method: str, metadata: Mapping[str, Mapping]) -> ValueError | None:
    """The error for a config whose quant_method is not the format its tensors are stored in (stored_format), or
    None. Without it vLLM builds the named format's parameters and fails on the first tensor of the other one
    ("Layer ... has no parameter 'w2_g_idx'"), or the shapes disagree with no word of why."""
    found = stored_format(metadata)
    if found is None or found[0] == quant_method:
        return None
    fmt, evidence = found
    return ValueError(
        f"quantization_config.quant_method={quant_method!r}, but the checkpoint's tensors are stored as {fmt} "
        f"writes them ({evidence}); set {_json('quant_method', fmt)} in its config.json with that format's fields "
        f"(supported: {', '.join(FORMATS)}), or re-export the checkpoint as {quant_method}"
    )


def experts_left_unquantized(prefix: str, experts: Sequence[str], stored_module: str) -> ValueError:
    """The error for a routed-experts layer the config's module rules leave unquantized while the checkpoint
    stores its experts quantized (`stored_module`, one of them): vLLM would build an unquantized layer and fail
    on the first packed tensor."""
    return ValueError(
        f"moe_wna16_plus: {prefix}: quantization_config leaves its routed experts unquantized (read, as vLLM reads "
        f"it, through expert 0's {'/'.join(experts)}), but the checkpoint stores them quantized ({stored_module}); "
        "the config's module rules (modules_in_block_to_quantize, dynamic, ignore, modules_to_not_convert) must "
        "name the experts as quantized"
    )


def stored_quantized_experts(prefix: str, metadata_names) -> list[str]:
    """The routed experts' modules (`<prefix>.<expert id>.<proj>`) stored quantized (a qweight or weight_packed
    tensor), from the stored tensor names."""
    head = f"{prefix}."
    return sorted(
        name.rsplit(".", 1)[0]
        for name in metadata_names
        if name.startswith(head)
        and name[len(head) : len(head) + 1].isdigit()
        and name.rsplit(".", 1)[-1] in ("qweight", "weight_packed")
    )


# What a scheme needs beside the packed weights, by format: (the tensor's last name part, the config field that
# asks for it as the config has it, the fix when the checkpoint stores none of them)
_ZERO_POINTS = {
    PackFormat.GPTQ: ("qzeros", _json("sym", False), f"set {_json('sym', True)} in its config.json"),
    PackFormat.AWQ: ("qzeros", _json("zero_point", True), f"set {_json('zero_point', False)} in its config.json"),
    PackFormat.CT_PACKED: (
        "weight_zero_point",
        _json("symmetric", False),
        f"set {_json('symmetric', True)} in its config_groups weights",
    ),
}
_ACT_ORDER = {
    PackFormat.GPTQ: ("g_idx", _json("desc_act", True), f"set {_json('desc_act', False)} in its config.json"),
    PackFormat.CT_PACKED: (
        "weight_g_idx",
        '"actorder": "group" (or another order that stores a g_idx)',
        f"set {_json('actorder', None)} in its config_groups weights",
    ),
}


def scheme_tensors_absent(scheme: WNA16Scheme, prefix: str, names: Collection[str]) -> ValueError | None:
    """The error for a routed-experts layer whose config asks for zero points or act order (`scheme`) while the
    checkpoint stores that tensor for none of the layer's quantized experts (`names`: the stored tensor names
    under vLLM's names), or None. A checkpoint that stores some of them is incomplete, not misconfigured: loading
    lists what is missing (moe_method)."""
    experts = stored_quantized_experts(prefix, names)
    if not experts:
        return None
    wants = []
    if scheme.has_zero_point and scheme.pack_format in _ZERO_POINTS:
        wants.append(("zero points", *_ZERO_POINTS[scheme.pack_format]))
    if scheme.desc_act and scheme.pack_format in _ACT_ORDER:
        wants.append(("act order", *_ACT_ORDER[scheme.pack_format]))
    for what, leaf, field, fix in wants:
        if not any(f"{module}.{leaf}" in names for module in experts):
            return ValueError(
                f"moe_wna16_plus: {prefix}: quantization_config says {field} ({what}), but the checkpoint stores "
                f"no {leaf} for any of the layer's {len(experts)} quantized expert projections ({experts[0]}.{leaf} "
                f"is not in its safetensors): it was written without {what}; {fix}"
            )
    return None
