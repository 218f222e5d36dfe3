"""A checkpoint's raw `quantization_config` dict -> one `CheckpointQuantConfig`.

`parse_quantization_config(cfg)` dispatches on `cfg["quant_method"]` to
`parse_gptq`, `parse_awq` or `parse_compressed_tensors`. The result holds the
experts' `WNA16Scheme`, the in-tree method linear layers are delegated to, the
raw dict, and the per-module rules (GPTQ `dynamic`, AWQ `modules_to_not_convert`,
compressed-tensors `config_groups`/`ignore`) behind `scheme_for(prefix)`, which
matches module prefixes the way vLLM 0.26's in-tree configs do.

Every bad input raises ValueError naming the key, the value and what is
supported: `quantization_config.bits=3 is not supported; supported: 4, 8`.
No vLLM and no compressed-tensors import: the raw dict is parsed directly.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from vllm_wna16_plugin.scheme import CHANNELWISE, SUPPORTED_BITS, PackFormat, WNA16Scheme, not_an_int, type_name

# checkpoint_format -> zero_point_offset (v1 stores zero - 1).
GPTQ_CHECKPOINT_FORMATS = MappingProxyType({"gptq": 1, "gptq_v2": 0})
AWQ_VERSIONS = ("gemm",)
AWQ_BITS = (4,)
# AWQ `backend`: transformers 4 writes AutoAWQ's "autoawq", transformers 5 the kernel it runs with (AwqBackend; "auto"
# by default), whose packing `version` names; "llm-awq" (GEMV_FAST packing) is refused.
# The GEMV kernels' names ("gemv", "gemv_fast") are refused: they run the GEMV packings.
AWQ_BACKENDS = ("autoawq", "auto", "auto_trainable", "machete", "marlin", "exllama_v1", "exllama_v2", "gemm",
                "gemm_triton", "torch_awq", "torch_fused_awq")  # fmt: skip
CT_FORMAT = "pack-quantized"
CT_STRATEGIES = ("group", "channel")
# compressed-tensors ActivationOrdering -> does the checkpoint carry a g_idx (desc_act)?
CT_ACTORDER = MappingProxyType({"group": True, "dynamic": True, "weight": False, "static": False})
# vLLM's usual packed_modules_mapping; callers pass the model's own when they have it.
DEFAULT_FUSED_MAPPING = MappingProxyType(
    {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
)
# vLLM probes a routed-experts prefix through expert 0's projections under the layer's checkpoint names
# (RoutedExperts.ckpt_gate/up/down_proj_name, in that order); these are the default, Mixtral's are w1, w3, w2.
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
# Every name an expert projection has on disk, for `dynamic` rules written per module (Mixtral: w1 gate, w3 up, w2 down).
EXPERT_PROJECTIONS = EXPERT_NAMES + ("w1", "w3", "w2")
# Effective group sizes below this are refused by effective_group_size().
MIN_REGROUPED_GROUP_SIZE = 16
MAX_SUGGESTED_TP = 16
MAX_LAYERS = 4096  # num_hidden_layers above this is refused (doctor resolves every layer's scheme)

_SUPPORTED_BITS_TEXT = ", ".join(str(b) for b in SUPPORTED_BITS)
_SUPPORTED_METHODS = ("gptq", "awq", "compressed-tensors")


def _error(key: str, value: Any, problem: str, supported: str) -> ValueError:
    name = f"quantization_config.{key}" if key else "quantization_config"
    return ValueError(f"{name}={value!r} {problem}; supported: {supported}")


def _missing(key: str, supported: str) -> ValueError:
    return ValueError(f"quantization_config.{key} is missing; supported: {supported}")


# ---------------------------------------------------------------- value checks


def _check_bits(key: str, value: Any, allowed: Sequence[int] = SUPPORTED_BITS) -> int:
    supported = ", ".join(str(b) for b in allowed)
    if (problem := not_an_int(value)) is not None:
        raise _error(key, value, problem, supported)
    if value not in allowed:
        raise _error(key, value, "is not supported", supported)
    return value


def _check_group_size(key: str, value: Any, *, none_is_channelwise: bool = False) -> int:
    supported = "a positive int (e.g. 32, 64, 128) or -1 (channel-wise)"
    if value is None and none_is_channelwise:
        return CHANNELWISE
    if (problem := not_an_int(value)) is not None:
        raise _error(key, value, problem, supported)
    if value == 0 or value < CHANNELWISE:
        raise _error(key, value, "is not supported", supported)
    return value


def _check_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _error(key, value, f"is {type_name(value)}, not a bool", "true, false")
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: 4 and 4.0 or 1 and true are different spellings, not one value."""
    return type(a) is type(b) and a == b


def _require(cfg: Mapping, keys: Sequence[str], supported: str, prefix: str = "") -> tuple[str, Any]:
    """The one value of `keys` (alternative spellings of one field) in cfg, as (key, value).

    ValueError naming them all if none is present, and naming both keys and values when two
    spellings disagree: vLLM's in-tree configs read them in their own order (0.26's AWQ reads
    w_bit before bits, q_group_size before group_size), so a conflict would make the experts
    and the linear layers disagree silently.
    """
    present = [key for key in keys if key in cfg]
    if not present:
        spelled = keys[0] + (f" (or {', '.join(keys[1:])})" if len(keys) > 1 else "")
        raise _missing(prefix + spelled, supported)
    first = present[0]
    for other in present[1:]:
        if not _same(cfg[first], cfg[other]):
            raise ValueError(
                f"quantization_config.{prefix}{first}={cfg[first]!r} and quantization_config.{prefix}{other}="
                f"{cfg[other]!r} disagree (two spellings of one field; vLLM's in-tree method may read either); "
                f"supported: only one of them, or the same value in both"
            )
    return first, cfg[first]


def _compile(key: str, pattern: Any) -> re.Pattern:
    if not isinstance(pattern, str):
        raise _error(key, pattern, "is not a string", "a regular expression string")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise _error(key, pattern, f"is not a valid regular expression ({exc})", "a Python regex") from None


def _check_mapping(key: str, value: Any) -> Mapping:
    if not isinstance(value, Mapping):
        raise _error(key, value, "is not a JSON object", "a dict")
    return value


def _check_str_list(key: str, value: Any, *, flatten: bool = False) -> tuple[str, ...]:
    """None -> (); a list of strings (or, with flatten, a list of lists of strings) -> tuple."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise _error(key, value, "is not a list", "a list of module names")
    out: list[str] = []
    for item in value:
        if flatten and isinstance(item, (list, tuple)):
            out.extend(_check_str_list(key, item))
        elif isinstance(item, str):
            out.append(item)
        else:
            raise _error(key, value, f"holds a non-string {item!r}", "a list of module names")
    return tuple(out)


# ---------------------------------------------------------------- the result


def _last(prefix: str) -> str:
    return prefix.rsplit(".", 1)[-1]


def _renamed_list(names: tuple[str, ...], map_name: Callable[[str], str | None]) -> tuple[str, ...]:
    """Each name through map_name, the ones it drops (None) left out (vLLM's WeightsMapper.apply_list)."""
    return tuple(new for name in names if (new := map_name(name)) is not None)


def _is_lm_head(prefix: str) -> bool:
    return _last(prefix) == "lm_head"


def _shards(prefix: str, fused_mapping: Mapping[str, Sequence[str]]) -> list[str] | None:
    """The unfused names of a fused prefix (qkv_proj -> q_proj, k_proj, v_proj), else None."""
    proj = _last(prefix)
    if proj not in fused_mapping:
        return None
    head = prefix[: len(prefix) - len(proj)]
    return [head + shard for shard in fused_mapping[proj]]


def _agree(prefix: str, names: Sequence[str], values: Sequence[Any], what: str) -> Any:
    """The one value all shards share; ValueError when the shards of one fused module differ."""
    if any(v != values[0] for v in values[1:]):
        detail = ", ".join(f"{n}: {_show(v)}" for n, v in zip(names, values, strict=True))
        raise ValueError(
            f"{prefix}: its shards have different {what} ({detail}); vLLM requires every shard "
            "of a fused module to use one quantization scheme"
        )
    return values[0]


def _expert_probes(prefix: str, experts: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """Expert 0's projections under a routed-experts prefix (`<prefix>.0.<name>`), as vLLM probes the layer."""
    return [f"{prefix}.0.{name}" for name in dict.fromkeys((*experts, *extra))]


def _show(value: Any) -> str:
    if isinstance(value, WNA16Scheme):
        return value.describe()
    return "unquantized" if value is None else str(value)


class _Rules:
    """Per-module lookup of one format; `resolve` mirrors the in-tree vLLM config."""

    def resolve(
        self, prefix: str, fused: Mapping, moe: bool, lm_head_quantized: bool, experts: Sequence[str] = EXPERT_NAMES
    ) -> WNA16Scheme | None:
        """experts: the layer's checkpoint names of an expert's gate, up and down projections (moe only)."""
        raise NotImplementedError

    def renamed(self, map_name: Callable[[str], str | None]) -> _Rules:
        """These rules with the module names they list renamed (CheckpointQuantConfig.renamed)."""
        return self


@dataclass(frozen=True)
class _Uniform(_Rules):
    """Every module uses `scheme` (the lm_head only when it is quantized)."""

    scheme: WNA16Scheme

    def resolve(self, prefix, fused, moe, lm_head_quantized, experts=EXPERT_NAMES):
        if _is_lm_head(prefix) and not lm_head_quantized:
            return None
        return self.scheme


@dataclass(frozen=True)
class _GPTQRules(_Rules):
    """GPTQModel `dynamic` rules (first re.match wins; "-:" skips, "+:" or bare overrides) and
    `modules_in_block_to_quantize` (substring match; empty means every module)."""

    base: WNA16Scheme
    dynamic: tuple[tuple[bool, re.Pattern, WNA16Scheme | None], ...]
    quantized_modules: tuple[str, ...]

    def _dynamic(self, name: str) -> WNA16Scheme | None:
        return self._dynamic_rule(name)[1]

    def _dynamic_rule(self, name: str) -> tuple[int | None, WNA16Scheme | None]:
        """(index of the first `dynamic` rule matching name, or None; the scheme it gives)."""
        for i, (negative, pattern, scheme) in enumerate(self.dynamic):
            if pattern.match(name):
                return i, None if negative else scheme
        return None, self.base

    def _check_experts_dynamic(self, prefix: str, names: Sequence[str]) -> None:
        """GPTQModel applies `dynamic` per module (an expert's down_proj may get its own bits or group), vLLM to a
        MoE layer by the layer's name: a rule matching an expert projection's name, but not the layer's, that
        gives the projection another scheme than the layer's would load it wrongly (a shape error, or zero points
        read as symmetric). Refused by name instead. A rule written for the layer's name alone (`-:.*experts$`)
        is vLLM's own form and is read as vLLM reads it."""
        rule, scheme = self._dynamic_rule(prefix)
        for name in names:
            own_rule, own = self._dynamic_rule(name)
            if own_rule is not None and own_rule != rule and own != scheme:
                pattern = self.dynamic[own_rule][1].pattern
                gives = "unquantized" if own is None else own.describe()
                layer = "unquantized" if scheme is None else scheme.describe()
                raise ValueError(
                    f"{prefix}: quantization_config.dynamic rule {pattern!r} makes the experts' "
                    f"{name.rsplit('.', 1)[-1]} {gives}, but does not match the MoE layer's own name, at which vLLM "
                    f"reads a MoE layer's `dynamic` rules ({layer} there); one MoE layer runs one scheme for all its "
                    f"projections. Supported: `dynamic` rules that match the MoE layer's name ('{prefix}') and give "
                    f"its experts one scheme"
                )

    def _listed(self, name: str) -> bool:
        return not self.quantized_modules or any(m in name for m in self.quantized_modules)

    def renamed(self, map_name):  # vLLM renames modules_in_block_to_quantize, not the `dynamic` regexes
        return replace(self, quantized_modules=_renamed_list(self.quantized_modules, map_name))

    def resolve(self, prefix, fused, moe, lm_head_quantized, experts=EXPERT_NAMES):
        if _is_lm_head(prefix) and not lm_head_quantized:
            return None
        names = _expert_probes(prefix, experts) if moe else _shards(prefix, fused)
        if names is None:
            listed = self._listed(prefix)
        elif moe:  # vLLM 0.34 does not read the list for MoE layers: one not naming every projection leaves
            # the layer to what the file stores (quant_config: stored_experts_scheme)
            listed = all(self._listed(n) for n in names)
        else:  # vLLM's is_layer_gptq_quantized: every shard listed, or none
            listed = _agree(prefix, names, [self._listed(n) for n in names], "quantization (listed or not)")
        if not listed:
            return None
        if moe:
            own = _expert_probes(prefix, experts)  # the layer's own projection names
            if all(self._dynamic_rule(n)[0] is not None and self._dynamic(n) is None for n in own):
                return None  # "-:" rules that skip every projection (GPTQModel's per-module form): experts left float
            self._check_experts_dynamic(prefix, _expert_probes(prefix, experts, EXPERT_PROJECTIONS))
        return self._dynamic(prefix)  # vLLM matches `dynamic` against the (fused) prefix itself


@dataclass(frozen=True)
class _AWQRules(_Rules):
    """AWQ `modules_to_not_convert`: substring match on the prefix (vLLM's skip_with_substr)."""

    base: WNA16Scheme
    not_convert: tuple[str, ...]

    def _skipped(self, name: str) -> bool:
        return any(m in name for m in self.not_convert)

    def renamed(self, map_name):
        return replace(self, not_convert=_renamed_list(self.not_convert, map_name))

    def resolve(self, prefix, fused, moe, lm_head_quantized, experts=EXPERT_NAMES):
        if _is_lm_head(prefix) and not lm_head_quantized:
            return None
        names = None if moe else _shards(prefix, fused)
        if self._skipped(prefix):
            return None
        if names is not None and _agree(prefix, names, [self._skipped(n) for n in names], "exclusion"):
            return None
        return self.base


@dataclass(frozen=True)
class ForeignScheme:
    """A compressed-tensors config group beside the WNA16 ones that is not weight-only int (FP8 attention, W8A8,
    ...): its linear modules run vLLM's own compressed-tensors method, as they would without the plugin; routed
    experts it names are refused (scheme_for). `why` is the refusal the group alone gets at parse time."""

    group: str
    why: str

    def describe(self) -> str:
        return f"config_groups.{self.group}, not WNA16 (run by vLLM's compressed-tensors method)"


@dataclass(frozen=True)
class _CTTarget:
    """One entry of a compressed-tensors target map: a target of `group` and that group's scheme."""

    target: str  # module name, "re:" regex or class name
    group: str  # the config_groups key, for messages
    scheme: WNA16Scheme | ForeignScheme


@dataclass(frozen=True)
class _CTRules(_Rules):
    """compressed-tensors `ignore` and `config_groups` targets, as vLLM's get_scheme_dict:
    ignore by exact name or "re:" regex (fused modules via their shards); targets by
    name/regex first, then by class name ("Linear" matches every linear and the experts),
    then a fused module whose every shard matches a name/regex target.

    Where vLLM takes the first of several matching targets (dict order), this refuses when
    the matching targets belong to groups with different schemes: which one the checkpoint's
    writer applied is not recorded, so either pick could be wrong."""

    targets: tuple[_CTTarget, ...]  # in first-seen order, as vLLM's target map
    ignore: tuple[str, ...]

    def renamed(self, map_name):
        """Module paths renamed; "re:" regexes and class names ("Linear") kept, as vLLM's compressed-tensors
        config does."""

        def one(target: str) -> str | None:
            return map_name(target) if "." in target and not target.startswith("re:") else target

        targets = tuple(replace(t, target=new) for t in self.targets if (new := one(t.target)) is not None)
        return replace(self, targets=targets, ignore=tuple(new for t in self.ignore if (new := one(t)) is not None))

    @staticmethod
    def _hit(value: str, target: str, contains: bool = False) -> bool:
        if target.startswith("re:"):
            return re.match(target[3:], value) is not None
        if contains:
            return target.lower() in value.lower()
        return target == value

    def _ignored(self, prefix: str, fused: Mapping) -> bool:
        names = _shards(prefix, fused)
        if names is None or prefix in self.ignore:
            return any(self._hit(prefix, t) for t in self.ignore)
        return _agree(prefix, names, [any(self._hit(n, t) for t in self.ignore) for n in names], "ignore status")

    def _unique(self, name: str, value: str, contains: bool = False) -> WNA16Scheme | ForeignScheme | None:
        """The scheme of the targets matching `value` at one precedence level; ValueError when
        targets of groups with different schemes match."""
        hits = [t for t in self.targets if self._hit(value, t.target, contains)]
        if any(h.scheme != hits[0].scheme for h in hits[1:]):
            detail = "; ".join(f"config_groups.{h.group} (target {h.target!r}): {h.scheme.describe()}" for h in hits)
            raise ValueError(
                f"{name}: quantization_config.config_groups give it different schemes ({detail}); "
                "supported: targets that give each module one scheme (narrow one group's targets, "
                "or list the module in `ignore`)"
            )
        return hits[0].scheme if hits else None

    def _match(self, name: str, fused: Mapping, module_class: str = "Linear") -> WNA16Scheme | ForeignScheme | None:
        scheme = self._unique(name, name)
        if scheme is None:
            scheme = self._unique(name, module_class, contains=True)
        names = _shards(name, fused) if scheme is None else None
        if names is not None:
            per_shard = [self._unique(n, n) for n in names]
            if all(s is not None for s in per_shard):
                return per_shard[0]
        return scheme

    def _one(self, name: str, fused: Mapping) -> WNA16Scheme | ForeignScheme | None:
        return None if self._ignored(name, fused) else self._match(name, fused)

    def resolve(self, prefix, fused, moe, lm_head_quantized, experts=EXPERT_NAMES):
        if not moe:
            return self._one(prefix, fused)
        names = _expert_probes(prefix, experts)  # vLLM 0.34's get_moe_method: the layer's own checkpoint names
        return _agree(prefix, names, [self._one(n, fused) for n in names], "schemes")


@dataclass(frozen=True)
class CheckpointQuantConfig:
    """A parsed WNA16 checkpoint: the experts' scheme, the in-tree method for linear layers,
    the raw dict (for delegation) and per-module rules behind `scheme_for`.

    `scheme` is the routed experts' scheme (for compressed-tensors with several groups: the
    group targeting experts by name, else the one targeting "Linear", else the first);
    `scheme_for(prefix)` is the authority per module. `rules=None` means every module uses
    `scheme` (the lm_head only when `lm_head_quantized`).
    """

    scheme: WNA16Scheme
    quant_method: str  # "gptq" | "awq" | "compressed-tensors"
    raw: dict = field(hash=False)
    lm_head_quantized: bool
    rules: _Rules | None = field(default=None, repr=False, compare=False)

    def scheme_for(
        self,
        prefix: str,
        *,
        fused_mapping: Mapping[str, Sequence[str]] | None = None,
        moe: bool | None = None,
        expert_names: Sequence[str] | None = None,
    ) -> WNA16Scheme | ForeignScheme | None:
        """The scheme of the module at this vLLM prefix; None when it stays unquantized; a ForeignScheme (linear
        modules only: routed experts in one raise) when a compressed-tensors group that is not WNA16 quantizes it.

        moe=None treats a prefix whose last part is "experts" as routed experts (probed, as
        vLLM does, through expert 0's projections under the layer's checkpoint names, `expert_names`
        (gate, up, down): `<prefix>.0.gate_proj/.0.up_proj/.0.down_proj` by default, Mixtral's
        `.0.w1/.0.w3/.0.w2`). fused_mapping is
        the model's packed_modules_mapping (default: qkv_proj and gate_up_proj). Raises
        ValueError when the shards of one fused module disagree, as vLLM does.
        """
        fused = DEFAULT_FUSED_MAPPING if fused_mapping is None else fused_mapping
        is_moe = _last(prefix) == "experts" if moe is None else moe
        rules = self.rules if self.rules is not None else _Uniform(self.scheme)
        experts = tuple(n for n in expert_names if n) if expert_names is not None else EXPERT_NAMES
        scheme = rules.resolve(prefix, fused, is_moe, self.lm_head_quantized, experts)
        if is_moe and isinstance(scheme, ForeignScheme):
            raise ValueError(
                f"{prefix}: the routed experts are quantized by {scheme.why}. moe_wna16_plus runs weight-only int4/int8 "
                f"experts only; run this checkpoint with vLLM's own compressed-tensors method"
            )
        return scheme

    def renamed(self, map_name: Callable[[str], str | None]) -> CheckpointQuantConfig:
        """This config with the module names its rules list (not regexes, not class names) renamed by a model's
        mapper from the checkpoint's names to vLLM's (QuantizationConfig.apply_vllm_mapper), as vLLM's own
        configs rename theirs; a name the mapper drops is dropped."""
        return self if self.rules is None else replace(self, rules=self.rules.renamed(map_name))

    def stored_experts_scheme(self, prefix: str) -> WNA16Scheme | None:
        """The scheme of a routed-experts layer whose experts the checkpoint stores quantized although
        `scheme_for` leaves it unquantized, where the format lets the file decide: GPTQ, whose
        `modules_in_block_to_quantize` vLLM 0.34 does not read for MoE layers (writers list the experts by their
        own names, w1/w3/w2 on Mixtral, which the gate_proj probe misses); its `dynamic` rules still apply.
        None for the other formats: an `ignore` / `modules_to_not_convert` entry naming the experts is the
        config's word against the file's (quant_config refuses the checkpoint)."""
        if isinstance(self.rules, _GPTQRules):
            return self.rules._dynamic(prefix)
        return None

    def is_excluded(
        self,
        prefix: str,
        *,
        fused_mapping: Mapping[str, Sequence[str]] | None = None,
        moe: bool | None = None,
    ) -> bool:
        """True when the module at this vLLM prefix stays unquantized (see scheme_for)."""
        return self.scheme_for(prefix, fused_mapping=fused_mapping, moe=moe) is None


# ---------------------------------------------------------------- GPTQ


def _gptq_checkpoint_format(cfg: Mapping) -> int:
    """zero_point_offset from checkpoint_format / format (GPTQModel writes either); v1 when absent."""
    allowed = ", ".join(repr(f) for f in GPTQ_CHECKPOINT_FORMATS)
    if cfg.get("is_marlin_format") is True:
        raise _error("is_marlin_format", True, "(Marlin-repacked GPTQ) is not supported", "false; re-export as gptq")
    seen = {}
    for key in ("checkpoint_format", "format"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or value.lower() not in GPTQ_CHECKPOINT_FORMATS:
            raise _error(key, value, "is not a supported GPTQ checkpoint format", allowed)
        seen[key] = value.lower()
    if len(set(seen.values())) > 1:
        raise ValueError(
            f"quantization_config.checkpoint_format={cfg['checkpoint_format']!r} and "
            f"quantization_config.format={cfg['format']!r} disagree; supported: one of {allowed}, "
            "the same in both"
        )
    fmt = next(iter(seen.values()), "gptq")
    return GPTQ_CHECKPOINT_FORMATS[fmt]


def _gptq_scheme(bits, group_size, sym, desc_act, offset) -> WNA16Scheme:
    return WNA16Scheme(
        bits=bits,
        group_size=group_size,
        has_zero_point=not sym,
        pack_format=PackFormat.GPTQ,
        desc_act=desc_act and group_size != CHANNELWISE,  # one group: act order is a no-op (as vLLM)
        zero_point_offset=offset,
        source="gptq",
    )


def parse_gptq(cfg: Mapping) -> CheckpointQuantConfig:
    """AutoGPTQ / GPTQModel quantize_config: bits, group_size, sym, desc_act, checkpoint_format
    ("gptq" v1: stored zero + 1; "gptq_v2"), lm_head, dynamic, modules_in_block_to_quantize."""
    cfg = _check_mapping("", cfg)
    _, bits = _require(cfg, ["bits"], _SUPPORTED_BITS_TEXT)
    bits = _check_bits("bits", bits)
    _, gs = _require(cfg, ["group_size"], "a positive int or -1 (channel-wise)")
    gs = _check_group_size("group_size", gs)
    _, sym = _require(cfg, ["sym"], "true (symmetric), false (zero points)")
    sym = _check_bool("sym", sym)
    desc_act = _check_bool("desc_act", cfg.get("desc_act", False))
    lm_head = _check_bool("lm_head", cfg.get("lm_head", False))
    pack_dtype = cfg.get("pack_dtype", "int32")
    if pack_dtype != "int32":
        raise _error("pack_dtype", pack_dtype, "is not supported", "'int32'")
    offset = _gptq_checkpoint_format(cfg)
    base = _gptq_scheme(bits, gs, sym, desc_act, offset)

    dynamic_cfg = cfg.get("dynamic") or {}
    dynamic_cfg = _check_mapping("dynamic", dynamic_cfg)
    rules = []
    for key, overrides in dynamic_cfg.items():
        where = f"dynamic[{key!r}]"
        if not isinstance(key, str):
            raise _error("dynamic", key, "has a non-string key", '"+:regex" or "-:regex" keys')
        negative = key.startswith("-:")
        pattern = _compile(where, key[2:] if key.startswith(("-:", "+:")) else key)
        if negative:
            rules.append((True, pattern, None))
            continue
        overrides = _check_mapping(where, overrides if overrides is not None else {})
        o_bits = _check_bits(f"{where}.bits", overrides.get("bits", bits))
        o_gs = _check_group_size(f"{where}.group_size", overrides.get("group_size", gs))
        o_sym = _check_bool(f"{where}.sym", overrides.get("sym", sym))
        o_act = _check_bool(f"{where}.desc_act", overrides.get("desc_act", desc_act))
        rules.append((False, pattern, _gptq_scheme(o_bits, o_gs, o_sym, o_act, offset)))
    modules = _check_str_list("modules_in_block_to_quantize", cfg.get("modules_in_block_to_quantize"), flatten=True)
    return CheckpointQuantConfig(
        scheme=base,
        quant_method="gptq",
        raw=copy.deepcopy(dict(cfg)),
        lm_head_quantized=lm_head,
        rules=_GPTQRules(base, tuple(rules), modules),
    )


# ---------------------------------------------------------------- AWQ


def _check_awq_dynamic(cfg: Mapping, top: Mapping[str, Any]) -> None:
    """GPTQModel writes its per-module `dynamic` rules into AWQ configs too; vLLM's AWQ method reads none of them,
    so every quantized module runs the top-level scheme. "-:" rules are not applied either (experts they leave float
    are refused at load by their stored dtypes); a positive rule giving modules another bits / group_size / sym (in
    GPTQ's or AWQ's spelling) than the top level is refused by name (else loading would blame the top-level field
    the other modules need)."""
    dynamic = _check_mapping("dynamic", cfg.get("dynamic") or {})
    for key, overrides in dynamic.items():
        if not isinstance(key, str):
            raise _error("dynamic", key, "has a non-string key", '"+:regex" or "-:regex" keys')
        if key.startswith("-:"):
            continue
        where = f"dynamic[{key!r}]"
        overrides = _check_mapping(where, overrides if overrides is not None else {})
        for name, value in top.items():
            if name in overrides and not _same(overrides[name], value):
                raise _error(
                    f"{where}.{name}",
                    overrides[name],
                    "is not supported (vLLM's AWQ method reads no `dynamic` rules: every quantized module runs the "
                    f"top-level scheme, {name}={value!r}; re-export the checkpoint with one AWQ scheme)",
                    f"{value!r} (the top level's), or only '-:' rules",
                )


def parse_awq(cfg: Mapping) -> CheckpointQuantConfig:
    """AutoAWQ / transformers AwqConfig: bits|w_bit (4 only), group_size|q_group_size,
    zero_point, version ("gemm" only), modules_to_not_convert (substring match), lm_head."""
    cfg = _check_mapping("", cfg)
    bits_key, bits = _require(cfg, ["bits", "w_bit"], "4")
    if bits == 8:
        raise _error(bits_key, bits, "is not supported (AWQ GEMM packing is 4-bit only)", "4")
    bits = _check_bits(bits_key, bits, AWQ_BITS)
    gs_key, gs = _require(cfg, ["group_size", "q_group_size"], "a positive int or -1 (channel-wise)")
    gs = _check_group_size(gs_key, gs)
    _, zero_point = _require(cfg, ["zero_point"], "true (zero points), false (symmetric)")
    zero_point = _check_bool("zero_point", zero_point)
    # the packing: `version` (AutoAWQ, and what transformers 5 writes), else transformers 5's `format`
    version_key = "version" if "version" in cfg or "format" not in cfg else "format"
    version = cfg.get(version_key, "gemm")
    if not isinstance(version, str) or version.lower() not in AWQ_VERSIONS:
        raise _error(
            version_key,
            version,
            "is not supported (only GEMM packing is read; re-export the checkpoint with version='gemm')",
            "'gemm'",
        )
    backend = cfg.get("backend")
    if backend is not None and (not isinstance(backend, str) or backend.lower() not in AWQ_BACKENDS):
        raise _error(
            "backend",
            backend,
            "is not supported (llm-awq's packing differs from AutoAWQ GEMM; re-export the checkpoint with AutoAWQ)"
            if str(backend).lower() == "llm-awq"
            else "is not a known AWQ backend",
            ", ".join(map(repr, AWQ_BACKENDS)),
        )
    _check_awq_dynamic(cfg, {"bits": bits, "w_bit": bits, "group_size": gs, "q_group_size": gs,
                             "sym": not zero_point, "zero_point": zero_point})  # fmt: skip
    lm_head = _check_bool("lm_head", cfg.get("lm_head", False))
    not_convert = _check_str_list("modules_to_not_convert", cfg.get("modules_to_not_convert"))
    scheme = WNA16Scheme(bits=bits, group_size=gs, has_zero_point=zero_point, pack_format=PackFormat.AWQ, source="awq")
    return CheckpointQuantConfig(
        scheme=scheme,
        quant_method="awq",
        raw=copy.deepcopy(dict(cfg)),
        lm_head_quantized=lm_head,
        rules=_AWQRules(scheme, not_convert),
    )


# ---------------------------------------------------------------- compressed-tensors


def _ct_weights_scheme(where: str, weights: Any) -> WNA16Scheme:
    weights = _check_mapping(where, weights)
    _, bits = _require(weights, ["num_bits"], _SUPPORTED_BITS_TEXT, prefix=f"{where}.")
    bits = _check_bits(f"{where}.num_bits", bits)
    wtype = weights.get("type", "int")
    if not isinstance(wtype, str) or wtype.lower() != "int":
        raise _error(f"{where}.type", wtype, "is not supported (float weights are not WNA16)", "'int'")
    gs_raw = weights.get("group_size")
    strategy = weights.get("strategy")
    if strategy is None:  # compressed-tensors infers it from group_size
        if isinstance(gs_raw, int) and not isinstance(gs_raw, bool) and gs_raw > 0:
            strategy = "group"
        elif gs_raw == -1:
            strategy = "channel"
        else:
            raise _missing(f"{where}.strategy", "'group' (with a positive group_size), 'channel'")
    if not isinstance(strategy, str) or strategy.lower() not in CT_STRATEGIES:
        raise _error(f"{where}.strategy", strategy, "is not supported", "'group', 'channel'")
    strategy = strategy.lower()
    if strategy == "channel":
        if gs_raw not in (None, CHANNELWISE) or isinstance(gs_raw, bool):
            raise _error(f"{where}.group_size", gs_raw, "contradicts strategy='channel'", "null or -1")
        gs = CHANNELWISE
    else:
        gs = _check_group_size(f"{where}.group_size", gs_raw)
        if gs == CHANNELWISE:
            raise _error(f"{where}.group_size", gs_raw, "is not supported with strategy='group'", "a positive int")
    symmetric = _check_bool(f"{where}.symmetric", weights.get("symmetric", True))
    dynamic = weights.get("dynamic", False)
    if dynamic is not False:
        raise _error(
            f"{where}.dynamic",
            dynamic,
            "is not supported (dynamic weights have no scales in the checkpoint; WNA16 needs static ones)",
            "false",
        )
    actorder = weights.get("actorder")
    if actorder is None or actorder is False:
        desc_act = False
    elif actorder is True:
        desc_act = True
    elif isinstance(actorder, str) and actorder.lower() in CT_ACTORDER:
        desc_act = CT_ACTORDER[actorder.lower()]
    else:
        raise _error(f"{where}.actorder", actorder, "is not supported", "null, " + ", ".join(map(repr, CT_ACTORDER)))
    if desc_act and strategy != "group":
        raise _error(f"{where}.actorder", actorder, "needs strategy='group'", "null, 'weight', 'static'")
    return WNA16Scheme(
        bits=bits,
        group_size=gs,
        has_zero_point=not symmetric,
        pack_format=PackFormat.CT_PACKED,
        desc_act=desc_act,
        source="compressed-tensors",
    )


def _ct_experts_scheme(groups: Sequence[tuple[str, Sequence[str], WNA16Scheme]]) -> WNA16Scheme:
    """The group naming experts in a target, else the one targeting "Linear", else the first."""
    for _, targets, scheme in groups:
        if any("expert" in t.lower() for t in targets):
            return scheme
    for _, targets, scheme in groups:
        if any(t.lower() == "linear" for t in targets):
            return scheme
    return groups[0][2]


def parse_compressed_tensors(cfg: Mapping) -> CheckpointQuantConfig:
    """compressed-tensors pack-quantized: config_groups (targets, int weights with strategy
    group|channel, no input_activations), format (per group overrides top level), ignore."""
    cfg = _check_mapping("", cfg)
    top_format = cfg.get("format")
    if cfg.get("transform_config"):
        raise _error(
            "transform_config",
            cfg["transform_config"],
            "is not supported (moe_wna16_plus does not apply compressed-tensors' weight transforms to the experts)",
            "null",
        )
    sparsity = cfg.get("sparsity_config")
    if sparsity:
        sparsity_format = _check_mapping("sparsity_config", sparsity).get("format")
        if sparsity_format not in (None, "dense"):
            raise _error(
                "sparsity_config.format", sparsity_format, "is not supported (sparse weights are not WNA16)", "'dense'"
            )
    groups_cfg = cfg.get("config_groups")
    if not groups_cfg:
        raise _missing("config_groups", "a non-empty dict of groups with targets and weights")
    groups_cfg = _check_mapping("config_groups", groups_cfg)
    groups: list[tuple[str, tuple[str, ...], WNA16Scheme]] = []
    foreign: list[tuple[str, tuple[str, ...], ValueError]] = []  # groups that are not WNA16, with why
    for name, group in groups_cfg.items():
        where = f"config_groups.{name}"
        group = _check_mapping(where, group)
        targets = _check_str_list(f"{where}.targets", group.get("targets"))
        if not targets:
            raise _missing(f"{where}.targets", 'a list of module class names ("Linear") or "re:" regexes')
        for t in targets:
            if t.startswith("re:"):
                _compile(f"{where}.targets", t[3:])
        if len(targets) == 1 and targets[0].endswith("Attention"):
            continue  # attention (KV-cache) quantization: vLLM skips these groups too
        fmt = group.get("format") or top_format
        if fmt is None:
            raise _missing("format", repr(CT_FORMAT))
        if fmt != CT_FORMAT:
            key = f"{where}.format" if group.get("format") else "format"
            foreign.append((name, targets, _error(key, fmt, "is not supported (only packed int weights are WNA16)",
                                                  repr(CT_FORMAT))))  # fmt: skip
            continue
        acts = [act for act in ("input_activations", "output_activations") if group.get(act) is not None]
        if acts:
            foreign.append((name, targets, _error(f"{where}.{acts[0]}", group[acts[0]],
                                                  "is not supported (activation quantization is not weight-only)",
                                                  "null (W4A16 / W8A16)")))  # fmt: skip
            continue
        if "weights" not in group or group["weights"] is None:
            raise _missing(f"{where}.weights", "int weights with num_bits 4 or 8")
        groups.append((name, targets, _ct_weights_scheme(f"{where}.weights", group["weights"])))
    if not groups and foreign:
        raise foreign[0][2]  # no WNA16 group at all: the checkpoint is not one moe_wna16_plus runs
    if not groups:
        raise ValueError(
            "quantization_config.config_groups has no weight-quantized group; supported: a group "
            "with int weights (pack-quantized)"
        )
    target_map: dict[str, _CTTarget] = {}
    # groups that are not WNA16 (FP8 attention beside int4 experts) keep vLLM's own method for their modules
    mapped = [*groups, *((name, targets, ForeignScheme(name, str(exc))) for name, targets, exc in foreign)]
    for group, targets, scheme in mapped:
        for t in targets:
            seen = target_map.get(t)
            if seen is not None and seen.scheme != scheme:  # vLLM's dict would keep the later group silently
                raise ValueError(
                    f"quantization_config.config_groups.{seen.group} and config_groups.{group} both target "
                    f"{t!r} with different schemes ({seen.scheme.describe()} vs {scheme.describe()}); "
                    "supported: each target in one group, or the same scheme in both"
                )
            target_map[t] = _CTTarget(t, group, scheme)
    ignore = _check_str_list("ignore", cfg.get("ignore"))
    for t in ignore:
        if t.startswith("re:"):
            _compile("ignore", t[3:])
    rules = _CTRules(tuple(target_map.values()), ignore)
    return CheckpointQuantConfig(
        scheme=_ct_experts_scheme(groups),
        quant_method="compressed-tensors",
        raw=copy.deepcopy(dict(cfg)),
        lm_head_quantized=rules.resolve("lm_head", DEFAULT_FUSED_MAPPING, False, True) is not None,
        rules=rules,
    )


# ---------------------------------------------------------------- dispatch

_PARSERS = {"gptq": parse_gptq, "awq": parse_awq, "compressed-tensors": parse_compressed_tensors}


# The side files older tools wrote beside config.json, without a `quant_method` (vLLM reads them for a checkpoint
# whose config.json has no quantization_config): AutoGPTQ's quantize_config.json, AutoAWQ's quant_config.json.
SIDE_FILES = ("quantize_config.json", "quant_config.json")
_AWQ_SIDE_KEYS = frozenset({"zero_point", "q_group_size", "w_bit", "version", "modules_to_not_convert"})
_GPTQ_SIDE_KEYS = frozenset({"desc_act", "sym", "damp_percent", "true_sequential", "static_groups",
                             "checkpoint_format", "model_name_or_path", "model_file_base_name"})  # fmt: skip


def side_file_method(cfg: Mapping) -> str | None:
    """The format of a side file written without `quant_method`, from its keys, or None: AutoAWQ's
    quant_config.json has `w_bit` and only AutoAWQ's keys besides; AutoGPTQ's quantize_config.json `bits` and
    `group_size` and at least one of AutoGPTQ's own keys (desc_act, sym, damp_percent, ...)."""
    keys = set(cfg)
    if "w_bit" in keys and keys <= _AWQ_SIDE_KEYS | {"w_bit"}:
        return "awq"
    if {"bits", "group_size"} <= keys and keys & _GPTQ_SIDE_KEYS and not keys & {"w_bit", "q_group_size"}:
        return "gptq"
    return None


def parse_quantization_config(cfg: Mapping) -> CheckpointQuantConfig:
    """Dispatch on cfg["quant_method"] (case-insensitive) to parse_gptq/parse_awq/parse_compressed_tensors; a side
    file without one is read as the format its keys name (side_file_method)."""
    cfg = _check_mapping("", cfg)
    supported = ", ".join(repr(m) for m in _SUPPORTED_METHODS)
    if "quant_method" not in cfg and (inferred := side_file_method(cfg)) is not None:
        cfg = {**cfg, "quant_method": inferred}
    if "quant_method" not in cfg:
        raise ValueError(
            f"quantization_config.quant_method is missing (config.json's quantization_config, or the "
            f"quantize_config.json / quant_config.json beside it); supported: {supported}"
        )
    method = cfg["quant_method"]
    key = method.lower().replace("_", "-") if isinstance(method, str) else None
    if key not in _PARSERS:
        raise _error("quant_method", method, "is not a WNA16 checkpoint format", supported)
    return _PARSERS[key](cfg)


def is_wna16_checkpoint(cfg: Mapping | None) -> bool:
    """True when parse_quantization_config(cfg) would accept it; never raises."""
    if not isinstance(cfg, Mapping):
        return False
    try:
        parse_quantization_config(cfg)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- shapes


def _regroup(group_size: int, size_k: int, full_size_k: int) -> int | None:
    """The exact group size for a shard of size_k out of full_size_k, or None (see effective_group_size)."""
    if size_k % group_size == 0:
        return group_size
    g = math.gcd(group_size, size_k)
    if g >= MIN_REGROUPED_GROUP_SIZE and full_size_k % group_size == 0:
        return g
    return None


def effective_group_size(
    scheme: WNA16Scheme, size_k: int, *, layer: str, tp_size: int = 1, full_size_k: int | None = None
) -> int:
    """The group size for a GEMM whose reduction dim on this rank is size_k.

    Channel-wise -> size_k. A group size dividing size_k -> itself. Otherwise
    g = gcd(group_size, size_k) when g >= 16 and the full K is a whole number of
    groups: each scale is repeated group_size // g times, which is exact because
    every shard starts on a multiple of g (vLLM's moe_wna16 halves the group size
    for the same reason). Act order (desc_act) keeps the checkpoint's groups (its g_idx
    names them; the triton backend pads a rank's partial groups, backends.base.sort_act_order):
    its effective group size is the plan before loading and the one a trivial g_idx,
    dropped at load, runs with. Else ValueError naming the layer, K, the group size, the
    TP size and the TP sizes that would work.
    """
    if isinstance(size_k, bool) or not isinstance(size_k, int) or size_k <= 0:
        raise ValueError(f"{layer}: K={size_k!r} must be a positive int")
    if scheme.is_channelwise:
        return size_k
    full = full_size_k if full_size_k is not None else size_k * tp_size
    g = _regroup(scheme.group_size, size_k, full)
    if g is not None:
        return g
    gs = scheme.group_size
    k_text = f"K={size_k}" if size_k == full else f"K={size_k} per rank (tp_size={tp_size}, full K={full})"
    if full % gs:  # no split helps: the checkpoint's K is not a whole number of its own groups
        raise ValueError(
            f"{layer}: quantization_config.group_size={gs} does not divide the full K={full}: the plugin's kernels "
            "need whole groups along K, at any tensor-parallel size (a partial last group is not supported). If "
            "config.json's group size is not the one the tensors were written with, fix it (the stored scales hold "
            "one row per group along K)"
        )
    working = [t for t in range(1, MAX_SUGGESTED_TP + 1) if full % t == 0 and _regroup(gs, full // t, full)]
    raise ValueError(
        f"{layer}: {k_text} cannot use quantization_config.group_size={gs}: it does not divide K, and "
        f"re-grouping to gcd(group_size, K)={math.gcd(gs, size_k)} needs at least {MIN_REGROUPED_GROUP_SIZE} "
        f"(the kernels' smallest group); tensor-parallel sizes that work: {', '.join(map(str, working)) or 'none'}"
    )
