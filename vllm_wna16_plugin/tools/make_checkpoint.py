"""Tiny real on-disk WNA16 MoE checkpoints (GPTQ, AWQ, compressed-tensors) with a float reference.

`make_checkpoint(out_dir, fmt=...)` writes a Hugging Face directory that vLLM and
transformers read as they read a real quantized checkpoint:

    config.json                 Qwen3MoeForCausalLM or MixtralForCausalLM, with the format's
                                own quantization_config block
    model.safetensors           experts (and, by default, attention) quantized in the format's
                                tensor names and dtypes; router gate, norms, embeddings and
                                lm_head in bf16
    generation_config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json
    reference/reference.safetensors
                                per MoE layer i: `layers.{i}.w13` (E, 2I, H) (gate rows then
                                up rows) and `layers.{i}.w2` (E, H, I), the float32 dequantized
                                experts; `layers.{i}.w13_float` / `w2_float`, the floats before
                                quantization. In a subfolder, because vLLM globs only
                                `<dir>/*.safetensors` (default_loader, non-recursive).
                                With float_reference=False (--no-float-reference: a large
                                checkpoint for throughput only) it holds no tensors, only the
                                spec in its metadata.

Integers come from `packing.quantize_rtn` and are packed by `packing.pack_gptq` /
`pack_awq`. compressed-tensors tensors are produced by the compressed-tensors library's
own `PackedQuantizationCompressor.compress`, fed our scales and (signed) zero points and
the weights `(q - zero) * scale`, which are exact in float32, so the library's
`round(w / scale + zero)` recovers our integers exactly.

On-disk conventions (what the maker writes; `packing.py` reads the same):
    GPTQ   qweight int32 (K/pf, N), qzeros int32 (G, N/pf) holding zero-1 (v1, "gptq") or
           zero ("gptq_v2"), scales fp16 (G, N), g_idx int32 (K,): group of input row k.
           Symmetric checkpoints still store qzeros (the midpoint 2**(bits-1), minus 1 for v1).
    AWQ    qweight int32 (K, N/8) in AWQ order, qzeros int32 (G, N/8) (midpoint 8 when
           zero_point is false), scales fp16 (G, N).
    CT     weight_packed int32 (N, K/pf), weight_scale bf16 (N, G), weight_shape int64 [N, K],
           weight_zero_point int32 (N/pf, G) when asymmetric. The library quantizes to signed
           int8 q - 2**(bits-1) (zero points too, zp_dtype int8) and packs value + 2**(bits-1):
           the stored bits are the unsigned q and zero, so no offset survives on disk.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import InitVar, asdict, dataclass
from pathlib import Path

import torch

from vllm_wna16_plugin.checkpoint_config import MAX_LAYERS
from vllm_wna16_plugin.packing import QuantizedWeight, dequantize, pack_awq, pack_gptq, quantize_rtn
from vllm_wna16_plugin.tools import tiny_tokenizer

logger = logging.getLogger(__name__)

FORMATS = ("gptq", "awq", "compressed-tensors")
ARCHS = ("qwen3_moe", "mixtral")
GPTQ_CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # -> zero_point_offset (stored = zero - offset)
REFERENCE_FILE = Path("reference") / "reference.safetensors"
MODEL_FILE = "model.safetensors"
SCALE_DTYPES = {"gptq": torch.float16, "awq": torch.float16, "compressed-tensors": torch.bfloat16}
FLOAT_DTYPE = torch.bfloat16  # router gate, norms, embeddings, lm_head, unquantized attention
DIM_MULTIPLE = 32  # hidden/intermediate: int32 packing along N and K, and whole attention heads


@dataclass(frozen=True)
class ArchSpec:
    """Names one architecture gives its MoE block (checked against vLLM 0.26's model files)."""

    architecture: str
    moe_block: str  # "mlp" (qwen3_moe) or "block_sparse_moe" (mixtral)
    gate_up_down: tuple[str, str, str]  # expert projection names: gate, up, down
    qk_norm: bool  # Qwen3 has per-head q_norm / k_norm


ARCH_SPECS = {
    "qwen3_moe": ArchSpec("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"), True),
    "mixtral": ArchSpec("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), False),
}


# The command-line flag of each CheckpointSpec field (make-checkpoint's, and the demo's for those it has).
CLI_FLAGS = {
    "fmt": "--format", "bits": "--bits", "group_size": "--group-size", "sym": "--sym/--asym", "arch": "--arch",
    "hidden": "--hidden", "intermediate": "--intermediate", "experts": "--experts", "top_k": "--top-k",
    "layers": "--layers", "vocab_size": "--vocab-size", "quantize_attention": "--no-quantize-attention",
    "seed": "--seed", "checkpoint_format": "--checkpoint-format", "desc_act": "--desc-act",
    "group_size_null": "--group-size-null", "float_reference": "--no-float-reference",
}  # fmt: skip
_UNSET = object()


@dataclass(frozen=True)
class CheckpointSpec:
    """The validated arguments of `make_checkpoint` (see its docstring).

    cli_flags=True (not a field): messages name the command-line flags (`--group-size 48`) instead
    of the Python arguments (`group_size=48`), as `spec_from_args` builds it.
    """

    fmt: str
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    arch: str = "qwen3_moe"
    hidden: int = 256
    intermediate: int = 128
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    vocab_size: int | None = None
    quantize_attention: bool = True
    seed: int = 0
    checkpoint_format: str = "gptq"
    desc_act: bool = False
    group_size_null: bool = False
    float_reference: bool = True
    cli_flags: InitVar[bool] = False

    def __post_init__(self, cli_flags: bool) -> None:
        def name(field: str) -> str:
            return CLI_FLAGS[field] if cli_flags else field

        def arg(field: str, value=_UNSET) -> str:
            """`field=value` (Python) or `--flag value` (command line); a set boolean is the bare flag."""
            value = getattr(self, field) if value is _UNSET else value
            if not cli_flags:
                return f"{field}={value!r}"
            return CLI_FLAGS[field] if isinstance(value, bool) else f"{CLI_FLAGS[field]} {value}"

        if self.fmt not in FORMATS:
            raise ValueError(f"{arg('fmt')} is not supported; supported: {list(FORMATS)}")
        if self.arch not in ARCHS:
            raise ValueError(f"{arg('arch')} is not supported; supported: {list(ARCHS)}")
        if self.bits not in (4, 8):
            raise ValueError(f"{arg('bits')} is not supported; supported: 4, 8")
        if self.fmt == "awq" and self.bits != 4:
            raise ValueError(
                f"{arg('fmt')} with {arg('bits')}: AWQ GEMM checkpoints are 4-bit only; "
                f"use {arg('fmt', 'gptq')} or {arg('fmt', 'compressed-tensors')} for 8-bit"
            )
        for field in ("hidden", "intermediate"):
            if getattr(self, field) <= 0 or getattr(self, field) % DIM_MULTIPLE:
                raise ValueError(f"{arg(field)} must be a positive multiple of {DIM_MULTIPLE}")
        if self.group_size != -1:
            if self.group_size <= 0:
                raise ValueError(
                    f"{arg('group_size')} is not supported; use a positive group size or "
                    f"{arg('group_size', -1)} (channel-wise)"
                )
            for field in ("hidden", "intermediate"):
                if getattr(self, field) % self.group_size:
                    raise ValueError(
                        f"{arg('group_size')} does not divide {arg(field)}; use a divisor of both "
                        f"{name('hidden')} and {name('intermediate')}, or {arg('group_size', -1)} (channel-wise)"
                    )
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"{arg('seed')} is out of range; use a seed in [0, 2**63)")
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"need {name('experts')} >= 1 and 1 <= {name('top_k')} <= {name('experts')}, "
                f"got {arg('experts')}, {arg('top_k')}"
            )
        if self.layers < 1:
            raise ValueError(f"{arg('layers')} must be >= 1")
        if self.checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
            raise ValueError(f"{arg('checkpoint_format')} is not supported; supported: {list(GPTQ_CHECKPOINT_FORMATS)}")
        if self.fmt != "gptq" and self.checkpoint_format != "gptq":
            raise ValueError(f"{arg('checkpoint_format')} applies to {arg('fmt', 'gptq')} only")
        if self.desc_act and self.fmt not in ("gptq", "compressed-tensors"):
            raise ValueError(
                f"{arg('desc_act')} applies to {arg('fmt', 'gptq')} (desc_act) and {arg('fmt', 'compressed-tensors')} "
                f"(actorder: group) only, not {arg('fmt')}"
            )
        if self.desc_act and self.group_size == -1 and self.fmt == "compressed-tensors":
            raise ValueError(f"{arg('desc_act')} (actorder: group) needs a group size, not {arg('group_size')}")
        if self.group_size_null and (self.fmt != "compressed-tensors" or self.group_size != -1):
            raise ValueError(
                f"{arg('group_size_null')} writes a channel-wise compressed-tensors config; it needs "
                f"{arg('fmt', 'compressed-tensors')} and {arg('group_size', -1)}, got {arg('fmt')}, "
                f"{arg('group_size')}"
            )
        tok_vocab = tiny_tokenizer.tiny_vocab_size()
        if self.vocab_size is not None and self.vocab_size < tok_vocab:
            raise ValueError(f"{arg('vocab_size')} is smaller than the tokenizer's {tok_vocab} tokens")
        if self.layers > MAX_LAYERS:
            raise ValueError(f"{arg('layers')}: at most {MAX_LAYERS} layers (doctor's bound)")
        if (size := self.written_bytes) > MAX_WRITTEN_BYTES:
            raise ValueError(
                f"{arg('experts')}, {arg('hidden')}, {arg('intermediate')}, {arg('layers')} and "
                f"{name('vocab_size')} {self.resolved_vocab_size} would write about {size / 2**30:.1f} GiB "
                f"({'the float32 reference of the experts included' if self.float_reference else 'packed'}), over "
                f"make-checkpoint's {MAX_WRITTEN_BYTES >> 30} GiB: it writes small test checkpoints; use smaller sizes"
                + (
                    f" (or {arg('float_reference', False)}: no float reference, for throughput runs)"
                    if self.float_reference
                    else ""
                )
            )

    @property
    def written_bytes(self) -> int:
        """About what writing holds and writes: the experts' float32 reference (their packed weights are a
        fraction of it) or, without it (float_reference), their packed weights, the attention's and the embedding /
        lm_head in bf16."""
        per_weight = 4 if self.float_reference else self.bits / 8
        experts = int(self.layers * self.experts * 3 * self.hidden * self.intermediate * per_weight)
        attention = self.layers * 4 * self.hidden * self.hidden * 2
        return experts + attention + 2 * self.resolved_vocab_size * self.hidden * 2

    @property
    def head_dim(self) -> int:
        return 64 if self.hidden % 64 == 0 else 32

    @property
    def num_heads(self) -> int:
        return self.hidden // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads // 2 if self.num_heads % 2 == 0 else self.num_heads

    @property
    def resolved_vocab_size(self) -> int:
        """vocab_size, or the tokenizer's size rounded up to a multiple of 64."""
        if self.vocab_size is not None:
            return self.vocab_size
        return -(-tiny_tokenizer.tiny_vocab_size() // 64) * 64

    @property
    def zero_point_offset(self) -> int:
        return GPTQ_CHECKPOINT_FORMATS[self.checkpoint_format] if self.fmt == "gptq" else 0


def make_checkpoint(
    out_dir: str | Path,
    *,
    fmt: str,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    arch: str = "qwen3_moe",
    hidden: int = 256,
    intermediate: int = 128,
    experts: int = 8,
    top_k: int = 2,
    layers: int = 2,
    vocab_size: int | None = None,
    quantize_attention: bool = True,
    seed: int = 0,
    checkpoint_format: str = "gptq",
    desc_act: bool = False,
    group_size_null: bool = False,
    float_reference: bool = True,
) -> Path:
    """Write a tiny quantized MoE checkpoint of format `fmt` into out_dir; returns its path.

    fmt: "gptq" | "awq" | "compressed-tensors". group_size -1 is channel-wise (written as
    -1, or as null with group_size_null for compressed-tensors). intermediate is the
    expert (moe) intermediate size. sym=False stores zero points. checkpoint_format
    "gptq" (v1: stored zero = zero - 1) or "gptq_v2" applies to GPTQ only; desc_act (a random
    act-order g_idx per module, gate and up of an expert sharing one) to GPTQ (desc_act) and
    compressed-tensors (actorder: group, weight_g_idx). quantize_attention=False leaves q/k/v/o_proj
    in bf16 and excludes them in the config. float_reference=False writes no float reference (only the spec:
    load_reference refuses it), for checkpoints too large for one (throughput runs: bench/e2e.py). Weights are
    seeded by `seed`.
    """
    spec = CheckpointSpec(
        fmt=fmt,
        bits=bits,
        group_size=group_size,
        sym=sym,
        arch=arch,
        hidden=hidden,
        intermediate=intermediate,
        experts=experts,
        top_k=top_k,
        layers=layers,
        vocab_size=vocab_size,
        quantize_attention=quantize_attention,
        seed=seed,
        checkpoint_format=checkpoint_format,
        desc_act=desc_act,
        group_size_null=group_size_null,
        float_reference=float_reference,
    )
    return write_checkpoint(out_dir, spec)


def spec_from_args(args: argparse.Namespace, **fixed) -> CheckpointSpec:
    """The CheckpointSpec of parsed command-line flags (make-checkpoint's or the demo's; `fixed` overrides).

    Its errors name the flags the user typed (CLI_FLAGS)."""
    fields = {f.name for f in dataclasses.fields(CheckpointSpec)}
    kwargs = {field: value for field, value in vars(args).items() if field in fields}
    return CheckpointSpec(**{**kwargs, **fixed}, cli_flags=True)


def write_checkpoint(out_dir: str | Path, spec: CheckpointSpec) -> Path:
    """make_checkpoint for an already validated CheckpointSpec."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logger.info("make-checkpoint: writing %s %s int%d to %s", spec.arch, spec.fmt, spec.bits, out)
    gen = torch.Generator().manual_seed(spec.seed)
    arch = ARCH_SPECS[spec.arch]
    h, i_size, e_num = spec.hidden, spec.intermediate, spec.experts
    q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    vocab = spec.resolved_vocab_size

    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}

    def add_linear(prefix: str, w: torch.Tensor, quantized: bool, perm: torch.Tensor | None = None) -> torch.Tensor:
        if not quantized:
            tensors[f"{prefix}.weight"] = w.to(FLOAT_DTYPE)
            return w
        stored, deq = quantize_module(w, spec, gen, perm)
        for suffix, t in stored.items():
            tensors[f"{prefix}.{suffix}"] = t
        return deq

    tensors["model.embed_tokens.weight"] = _randn(gen, vocab, h, std=0.02).to(FLOAT_DTYPE)
    for li in range(spec.layers):
        p = f"model.layers.{li}"
        attn = spec.quantize_attention
        add_linear(f"{p}.self_attn.q_proj", _linear_weight(gen, q_out, h), attn)
        add_linear(f"{p}.self_attn.k_proj", _linear_weight(gen, kv_out, h), attn)
        add_linear(f"{p}.self_attn.v_proj", _linear_weight(gen, kv_out, h), attn)
        add_linear(f"{p}.self_attn.o_proj", _linear_weight(gen, h, q_out), attn)
        if arch.qk_norm:
            tensors[f"{p}.self_attn.q_norm.weight"] = _norm_weight(gen, spec.head_dim)
            tensors[f"{p}.self_attn.k_norm.weight"] = _norm_weight(gen, spec.head_dim)
        tensors[f"{p}.input_layernorm.weight"] = _norm_weight(gen, h)
        tensors[f"{p}.post_attention_layernorm.weight"] = _norm_weight(gen, h)
        tensors[f"{p}.{arch.moe_block}.gate.weight"] = _randn(gen, e_num, h, std=0.05).to(FLOAT_DTYPE)

        w13_float = torch.stack([_linear_weight(gen, 2 * i_size, h) for _ in range(e_num)])
        w2_float = torch.stack([_linear_weight(gen, h, i_size) for _ in range(e_num)])
        w13, w2 = [], []
        gate_name, up_name, down_name = arch.gate_up_down
        for e in range(e_num):
            ep = f"{p}.{arch.moe_block}.experts.{e}"
            # act order follows the input's statistics (GPTQ sorts K by its Hessian): gate and up share one
            order = torch.randperm(h, generator=gen) if spec.desc_act else None
            gate = add_linear(f"{ep}.{gate_name}", w13_float[e, :i_size], True, order)
            up = add_linear(f"{ep}.{up_name}", w13_float[e, i_size:], True, order)
            w13.append(torch.cat([gate, up]))
            w2.append(add_linear(f"{ep}.{down_name}", w2_float[e], True))
        if spec.float_reference:
            reference[f"layers.{li}.w13"] = torch.stack(w13)
            reference[f"layers.{li}.w2"] = torch.stack(w2)
            reference[f"layers.{li}.w13_float"] = w13_float
            reference[f"layers.{li}.w2_float"] = w2_float
        del w13, w2, w13_float, w2_float
        logger.info("make-checkpoint: layer %d: %d experts quantized", li, e_num)
    tensors["model.norm.weight"] = _norm_weight(gen, h)
    tensors["lm_head.weight"] = _randn(gen, vocab, h, std=0.02).to(FLOAT_DTYPE)

    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, out / MODEL_FILE, metadata={"format": "pt"})
    (out / REFERENCE_FILE).parent.mkdir(exist_ok=True)
    save_safetensors(
        {k: v.to(torch.float32).contiguous() for k, v in reference.items()},
        out / REFERENCE_FILE,
        metadata={"format": "pt", "spec": json.dumps(asdict(spec))},
    )
    write_config(out, spec)
    tiny_tokenizer.save_tiny_tokenizer(out, model_max_length=_MAX_POSITIONS)
    ids = tiny_tokenizer.special_token_ids()
    generation = {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    logger.info("make-checkpoint: wrote %d tensors to %s", len(tensors), out / MODEL_FILE)
    return out


# ---------------------------------------------------------------- reading and writing files


@contextlib.contextmanager
def open_safetensors(path: str | Path) -> Iterator:
    """safe_open(path) (torch tensors) whose errors name the file.

    A truncated or garbled file (safetensors' SafetensorError, at open or at get_tensor) and a path
    that is not a readable file become a ValueError `PATH: not a readable safetensors file (...)`.
    """
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():  # safe_open's own error for a directory names no path
        raise FileNotFoundError(
            errno.ENOENT, "not a file" if Path(path).exists() else os.strerror(errno.ENOENT), str(path)
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}); is it truncated or corrupt?") from exc


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, whose errors name the file (an OSError for the CLI to report)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        raise OSError(f"cannot write {path}: {exc}") from exc


def load_config(model_dir: str | Path) -> dict:
    """A checkpoint's config.json; a missing file is FileNotFoundError, broken JSON a ValueError naming the file."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc


def load_reference(out_dir: str | Path) -> dict[str, torch.Tensor]:
    """The float32 reference tensors of a checkpoint made by make_checkpoint (see module doc); ValueError for one
    written without them (float_reference=False)."""
    if not load_spec(out_dir).float_reference:
        raise ValueError(
            f"{out_dir} was written without its float reference (make-checkpoint --no-float-reference): nothing to "
            "check against; write it again without that flag"
        )
    with open_safetensors(_reference_file(out_dir)) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def load_spec(out_dir: str | Path) -> CheckpointSpec:
    """The CheckpointSpec a checkpoint was made with (stored in the reference file's metadata)."""
    path = _reference_file(out_dir)
    with open_safetensors(path) as f:
        spec = (f.metadata() or {}).get("spec")
    if spec is None:
        raise ValueError(f"{path} has no 'spec' metadata: it was not written by make_checkpoint")
    return CheckpointSpec(**json.loads(spec))


def _reference_file(out_dir: str | Path) -> Path:
    path = Path(out_dir) / REFERENCE_FILE
    if not path.exists():
        raise ValueError(
            f"{out_dir} is not a make_checkpoint directory: {path} (the float weights the checks compare with) "
            "is missing; write one with `vllm-wna16 make-checkpoint`"
        )
    return path


# ---------------------------------------------------------------- quantization per format


def quantize_module(
    w: torch.Tensor,  # (N, K) float32
    spec: CheckpointSpec,
    gen: torch.Generator,
    perm: torch.Tensor | None = None,  # (K,) act order to quantize in; default: a random one (desc_act)
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({tensor suffix: stored tensor}, dequantized float32 (N, K)) of one linear in spec.fmt."""
    scale_dtype = SCALE_DTYPES[spec.fmt]
    k = w.shape[-1]
    gs = k if spec.group_size == -1 else spec.group_size
    if spec.desc_act and spec.fmt == "compressed-tensors":
        qw, g_idx, deq = _act_order_quantize(w, spec, gs, scale_dtype, gen, perm)
        return compress_with_library(qw, deq, spec, g_idx), deq
    if spec.fmt == "gptq":
        if spec.desc_act:
            qw, g_idx, deq = _act_order_quantize(w, spec, gs, scale_dtype, gen, perm)
        else:
            qw = _round_scales(quantize_rtn(w, spec.bits, gs, not spec.sym), scale_dtype)
            g_idx = (torch.arange(k) // gs).to(torch.int32)
            deq = dequantize(qw)
        stored = pack_gptq(qw, zero_point_offset=spec.zero_point_offset)
        stored["g_idx"] = g_idx
        return stored, deq
    qw = _round_scales(quantize_rtn(w, spec.bits, gs, not spec.sym), scale_dtype)
    deq = dequantize(qw)
    if spec.fmt == "awq":
        return pack_awq(qw), deq
    return compress_with_library(qw, deq, spec), deq


def _act_order_quantize(w, spec: CheckpointSpec, gs: int, scale_dtype, gen, perm):
    """(QuantizedWeight in the original column order, g_idx (K,) int32, dequantized (N, K)) of act order:
    the columns are quantized in the order perm (a random one by default), so column k lands in group
    position(k) // gs (GPTQ's desc_act, compressed-tensors' actorder: group)."""
    k = w.shape[-1]
    perm = torch.randperm(k, generator=gen) if perm is None else perm
    inv = torch.argsort(perm)
    qw_perm = _round_scales(quantize_rtn(w[:, perm], spec.bits, gs, not spec.sym), scale_dtype)
    qw = QuantizedWeight(qw_perm.q[:, inv], qw_perm.scales, qw_perm.zeros, spec.bits, gs)
    return qw, (inv // gs).to(torch.int32), dequantize(qw_perm)[:, inv]


def compress_with_library(
    qw: QuantizedWeight,
    deq: torch.Tensor,  # (N, K) float32: dequantize(qw), exact in float32
    spec: CheckpointSpec,
    g_idx: torch.Tensor | None = None,  # (K,) act order (actorder: group): column k's scale group
) -> dict[str, torch.Tensor]:
    """compressed-tensors' own PackedQuantizationCompressor output for one linear.

    Feeds the library `deq = (q - zero) * scale` with our scale and signed zero point
    (zero - 2**(bits-1), int8, the library's zp_dtype); its quantize step computes
    round(deq / scale + zp) = q - 2**(bits-1) exactly, so the packed integers are ours.
    """
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    state = {"weight": deq, "weight_scale": qw.scales}
    if g_idx is not None:
        state["weight_g_idx"] = g_idx
    if qw.zeros is not None:
        state["weight_zero_point"] = (qw.zeros - (1 << (qw.bits - 1))).to(torch.int8)
    out = PackedQuantizationCompressor.compress(state, _ct_scheme(spec))
    return {name: t.contiguous() for name, t in out.items()}


def _round_scales(qw: QuantizedWeight, dtype: torch.dtype) -> QuantizedWeight:
    """The same integers with scales in the checkpoint's storage dtype (the reference uses these)."""
    return QuantizedWeight(qw.q, qw.scales.to(dtype), qw.zeros, qw.bits, qw.group_size)


# ---------------------------------------------------------------- config.json

_MAX_POSITIONS = 4096
MAX_WRITTEN_BYTES = 8 << 30  # a test checkpoint; a typo'd size would otherwise fill the memory, then fail
_ROPE_THETA = 1_000_000.0


def _arch_config(spec: CheckpointSpec) -> dict:
    ids = tiny_tokenizer.special_token_ids()
    common = {
        "architectures": [ARCH_SPECS[spec.arch].architecture],
        "model_type": spec.arch,
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "max_position_embeddings": _MAX_POSITIONS,
        "num_attention_heads": spec.num_heads,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.num_kv_heads,
        "output_router_logits": False,
        "rope_scaling": None,
        "rope_theta": _ROPE_THETA,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": spec.resolved_vocab_size,
    }
    if spec.arch == "qwen3_moe":
        return {
            **common,
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "intermediate_size": 4 * spec.hidden,  # dense MLP size; unused (no mlp_only_layers)
            "max_window_layers": spec.layers,
            "mlp_only_layers": [],
            "moe_intermediate_size": spec.intermediate,
            "norm_topk_prob": True,
            "num_experts": spec.experts,
            "rms_norm_eps": 1e-6,
            "use_sliding_window": False,
        }
    return {
        **common,
        "intermediate_size": spec.intermediate,
        "num_local_experts": spec.experts,
        "rms_norm_eps": 1e-5,
        "router_jitter_noise": 0.0,
    }


def _router_name(spec: CheckpointSpec) -> str:
    return f"{ARCH_SPECS[spec.arch].moe_block}.gate"


def gptq_quantization_config(spec: CheckpointSpec) -> dict:
    """The block GPTQModel writes (with its `dynamic` negative match for unquantized attention)."""
    block = {
        "quant_method": "gptq",
        "bits": spec.bits,
        "group_size": spec.group_size,
        "sym": spec.sym,
        "desc_act": spec.desc_act,
        "checkpoint_format": spec.checkpoint_format,
        "lm_head": False,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "pack_dtype": "int32",
        "meta": {"quantizer": ["vllm-wna16-plugin:make-checkpoint"]},
    }
    if not spec.quantize_attention:
        block["dynamic"] = {"-:.*self_attn.*": {}}
    return block


def awq_quantization_config(spec: CheckpointSpec) -> dict:
    """The block AutoAWQ writes; vLLM matches modules_to_not_convert as substrings."""
    skip = [_router_name(spec)]
    if not spec.quantize_attention:
        skip.append("self_attn")
    return {
        "quant_method": "awq",
        "bits": spec.bits,
        "group_size": spec.group_size,
        "zero_point": not spec.sym,
        "version": "gemm",
        "modules_to_not_convert": skip,
    }


def _ct_scheme(spec: CheckpointSpec):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if spec.group_size == -1:
        strategy, group_size = "channel", (None if spec.group_size_null else -1)
    else:
        strategy, group_size = "group", spec.group_size
    weights = QuantizationArgs(
        num_bits=spec.bits,
        type="int",
        symmetric=spec.sym,
        strategy=strategy,
        group_size=group_size,
        dynamic=False,
        actorder="group" if spec.desc_act else None,
    )
    return QuantizationScheme(targets=["Linear"], weights=weights, format="pack-quantized")


def ct_ignore_list(spec: CheckpointSpec) -> list[str]:
    """compressed-tensors `ignore`: lm_head, the router gate, and attention when not quantized."""
    ignore = ["lm_head", f"re:.*{_router_name(spec)}$"]
    if not spec.quantize_attention:
        ignore.append("re:.*self_attn.*")
    return ignore


def write_config(out: Path, spec: CheckpointSpec) -> None:
    """out/config.json (and, for compressed-tensors, its recipe) of the checkpoint `spec` describes."""
    config = _arch_config(spec)
    if spec.fmt == "gptq":
        config["quantization_config"] = gptq_quantization_config(spec)
    elif spec.fmt == "awq":
        config["quantization_config"] = awq_quantization_config(spec)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if spec.fmt == "compressed-tensors":
        # The library writes its own block (version, format, config_groups, ...) into config.json.
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig

        qconfig = QuantizationConfig(
            config_groups={"group_0": _ct_scheme(spec)},
            format="pack-quantized",
            quantization_status="compressed",
            ignore=ct_ignore_list(spec),
        )
        ModelCompressor(quantization_config=qconfig).update_config(str(out))


# ---------------------------------------------------------------- random weights


def _randn(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _linear_weight(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """float32 (N, K) ~ N(0, 0.02) with a per-row magnitude in [0.5, 1.5) so scales differ by row."""
    return _randn(gen, n, k, std=0.02) * (0.5 + torch.rand(n, 1, generator=gen))


def _norm_weight(gen: torch.Generator, n: int) -> torch.Tensor:
    return (1.0 + _randn(gen, n, std=0.02)).to(FLOAT_DTYPE)


# ---------------------------------------------------------------- CLI


def add_make_checkpoint_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `vllm-wna16 make-checkpoint OUT ...` (defaults as make_checkpoint's)."""
    parser.add_argument("out", metavar="OUT", help="directory to write the checkpoint into (new, empty, or one "
                        "make-checkpoint wrote; --force for any other)")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="write into OUT even if it holds another model's files")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, required=True)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=128, help="-1 = channel-wise")
    sym = parser.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=True, help="symmetric (default)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="store zero points")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3_moe")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128, help="expert intermediate size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's, rounded up to 64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-format", choices=tuple(GPTQ_CHECKPOINT_FORMATS), default="gptq")
    parser.add_argument("--desc-act", action="store_true",
                        help="act order (a random g_idx per module): GPTQ desc_act, compressed-tensors actorder group")  # fmt: skip
    parser.add_argument("--no-quantize-attention", dest="quantize_attention", action="store_false")
    parser.add_argument("--no-float-reference", dest="float_reference", action="store_false",
                        help="write no float32 reference of the experts (a large checkpoint for throughput runs; "
                        "the demo's check cannot read it)")  # fmt: skip
    parser.add_argument(
        "--group-size-null",
        action="store_true",
        help='compressed-tensors channel-wise written as "group_size": null',
    )
    return parser


def run_make_checkpoint(args: argparse.Namespace) -> int:
    """The make-checkpoint command: write the checkpoint and print its path; 0.

    Invalid flags and I/O errors raise (ValueError naming the flag, OSError); cli.main reports them."""
    spec = spec_from_args(args)
    check_out_dir(args.out, args.force)
    created = not Path(args.out).exists()
    try:
        print(write_checkpoint(args.out, spec))
    except BaseException:
        if created:  # a failed write leaves no half-written directory behind
            shutil.rmtree(args.out, ignore_errors=True)
        raise
    return 0


def check_out_dir(out: str, force: bool) -> None:
    """OUT must name a directory that is new, empty, or a checkpoint this tool wrote (its reference/ float
    weights beside the safetensors); another model's directory is refused unless --force: writing into it
    would leave a mix of two models."""
    if not str(out).strip():
        raise ValueError("OUT is empty: name the directory to write the checkpoint into")
    path = Path(out)
    if force or not path.is_dir() or not any(path.iterdir()):
        return
    if not ((path / "reference").is_dir() and (path / MODEL_FILE).is_file()):
        raise ValueError(
            f"OUT={out!r} is a directory with files that vllm-wna16 make-checkpoint did not write; writing into it "
            "would mix two models: name a new or empty directory, or pass --force to overwrite"
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m vllm_wna16_plugin.tools.make_checkpoint ...` = `vllm-wna16 make-checkpoint ...`."""
    import sys

    from vllm_wna16_plugin.tools import cli

    return cli.main(["make-checkpoint", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
