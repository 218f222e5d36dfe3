"""Checkpoint tensors of one expert -> this rank's slice of the kernel layout (no vLLM).

Each checkpoint tensor (GPTQ, AWQ or compressed-tensors, one expert, one of
gate/up/down) is unpacked to its logical form ((N, K) integers or (N, G) scales
and zero points, see packing.py), re-grouped when the TP shard boundary falls
inside a group (scales repeated: exact), narrowed to this rank's shard of the
intermediate dim, and repacked into the kernel layout. Wrong shapes or dtypes
are a ValueError naming the tensor, what was expected and what was found.

Values are validated here too, once per checkpoint tensor as it is loaded (a
reduction over a tensor already on the CPU, small next to reading it from disk;
the failing element is located only after a check fails), because some of them
cannot be checked after conversion: GPTQ v1 zero points are shifted by one (and
2**bits would not fit the kernel layout), an int64 g_idx is narrowed to int32,
signed zero points are packed.

    tensor        refused at load                                   trusted (every value is legal)
    g_idx         an entry outside [0, G); with desc_act false,     -
                  any entry other than k // group_size; with it,
                  a group of other than group_size rows
    scales        NaN or Inf, also after the cast to the layer's    zero and negative scales
                  dtype (a float32 scale above float16's max)       (legal math: w = (q - z) * s)
    zero points   GPTQ v1 stored 2**bits - 1 (zero 2**bits, out of  packed GPTQ v2 / AWQ / CT words: each
                  range); unpacked signed CT values outside         field holds 0..2**bits - 1 by construction
                  [-2**(bits-1), 2**(bits-1)); a symmetric
                  checkpoint's qzeros whose fields differ
                  (real zero points: check_symmetric_zeros)
    qweight       -                                                 every packed word
    weight_shape  a non-integer dtype or a value other than [N, K]  -

Each message names the checkpoint tensor, its expert and layer (`TensorName`),
the bad value and its position, and what would work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_wna16_plugin.packing import AWQ_PACK_ORDER, pack_along, unpack_along
from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme

# Checkpoint tensor suffix -> kind, per format.
CHECKPOINT_NAMES = {
    PackFormat.GPTQ: {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros", "g_idx": "g_idx"},
    PackFormat.AWQ: {"qweight": "qweight", "scales": "scales", "qzeros": "qzeros"},
    PackFormat.CT_PACKED: {
        "qweight": "weight_packed",
        "scales": "weight_scale",
        "qzeros": "weight_zero_point",
        "g_idx": "weight_g_idx",
        "shape": "weight_shape",
    },
}
SHARDS = ("w1", "w3", "w2")  # gate, up, down (vLLM's names)


@dataclass(frozen=True)
class MoEShapes:
    """Sizes of one MoE layer on this rank, and the group size each GEMM runs with."""

    hidden: int  # H: K of GEMM1, N of GEMM2
    intermediate: int  # I of the checkpoint (all ranks)
    tp_rank: int
    tp_size: int
    group_size_w13: int  # effective group size along H (H when channel-wise)
    group_size_w2: int  # effective group size along this rank's I (I_local when channel-wise)

    @property
    def intermediate_local(self) -> int:
        return self.intermediate // self.tp_size

    def full_nk(self, shard_id: str) -> tuple[int, int]:
        """(N, K) of the checkpoint matrix of this shard (all ranks)."""
        return (self.hidden, self.intermediate) if shard_id == "w2" else (self.intermediate, self.hidden)


@dataclass(frozen=True)
class TensorName:
    """One checkpoint tensor of one expert, for messages: str() is `{layer}.{expert}.{proj}.{suffix}`."""

    layer: str  # module prefix of the routed experts, e.g. "model.layers.3.mlp.experts"
    expert: int  # global expert id, as in the checkpoint
    proj: str  # the checkpoint's projection name: gate_proj / up_proj / down_proj, w1 / w3 / w2, ...
    suffix: str  # qweight, scales, qzeros, g_idx, weight_packed, ...

    def __str__(self) -> str:
        return f"{self.layer}.{self.expert}.{self.proj}.{self.suffix}"

    def where(self) -> str:
        return f"expert {self.expert} of {self.layer}"


def _describe(name: str | TensorName) -> str:
    """`checkpoint tensor NAME (expert E of LAYER)`; a plain string name is used as is."""
    where = f" ({name.where()})" if isinstance(name, TensorName) else ""
    return f"checkpoint tensor {name}{where}"


def _first(bad: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True of a boolean mask (only called once a check has failed)."""
    return tuple(int(i) for i in bad.nonzero()[0])


_CORRUPT = "the checkpoint file is corrupt or was written wrongly: re-download or re-export it"


def _group_size_text(gs: int) -> str:
    return "-1 (channel-wise)" if gs == -1 else str(gs)


def group_size_mismatch(scheme: WNA16Scheme, k: int, groups_found: int, name: str | TensorName, what: str) -> str:
    """The error when a tensor holds `groups_found` scale groups along K where the config's group size gives
    another count: the config, not the file, is wrong (the group size the tensor was written with, and where to
    set it). One group along K is channel-wise or any group size >= K (K=64 with groups of 128). what: how the
    tensor shows its groups, e.g. "its shape (4, 64) holds 4 groups"."""
    ct = scheme.pack_format is PackFormat.CT_PACKED
    if groups_found == 1:
        found = f"one group over all of K: group_size {k} or more, or -1 (channel-wise)"
        fix = ('"strategy": "channel" in its config_groups weights (or "group" with the group size the tensors were '
               "written with)" if ct else '"group_size" to the group size the tensors were written with (-1: '
               "channel-wise) in its config.json")  # fmt: skip
    else:
        gs = -(-k // groups_found)
        found = f"group_size {gs}"
        fix = f'"strategy": "group", "group_size": {gs} in its config_groups weights' if ct else (
            f'"group_size": {gs} in its config.json')  # fmt: skip
    field = "config_groups weights' group_size" if ct else "quantization_config.group_size"
    groups = scheme.num_groups(k)
    return (
        f"{_describe(name)}: {what} along K={k}, which is {found}, but the checkpoint's {field} is "
        f"{_group_size_text(scheme.group_size)} ({groups} group{'s' * (groups != 1)}): the tensors were quantized "
        f"with another group size than config.json says; set {fix}"
    )


def bits_mismatch(scheme: WNA16Scheme, found_bits: int, name: str | TensorName, what: str) -> str:
    """The error when a packed tensor's width says int`found_bits` values where the config says scheme.bits."""
    field = {
        PackFormat.GPTQ: "bits",
        PackFormat.AWQ: "bits (w_bit)",
        PackFormat.CT_PACKED: "config_groups weights' num_bits",
    }
    key = "num_bits" if scheme.pack_format is PackFormat.CT_PACKED else "bits"
    return (
        f"{_describe(name)}: {what}, which is int{found_bits} packing, but the checkpoint's "
        f'{field[scheme.pack_format]} is {scheme.bits}: set "{key}": {found_bits} in its config.json'
    )


def _contiguous_group_size(g_idx: torch.Tensor, k: int) -> int | None:
    """The group size gs' for which g_idx == arange(k) // gs' (groups in K order), else None."""
    if k == 0 or int(g_idx[0]) != 0:
        return None
    gs = int((g_idx == 0).sum())
    return gs if torch.equal(g_idx.to(torch.int64), torch.arange(k) // gs) else None


def check_g_idx(scheme: WNA16Scheme, g_idx: torch.Tensor, k: int, name: str | TensorName) -> None:
    """g_idx[k] = the scale group of input row k: in [0, G); without act order, exactly k // group_size."""
    g, gs = scheme.num_groups(k), scheme.group_size_for(k)
    lo, hi = torch.aminmax(g_idx)
    # groups in K order but of another size than the config's: the config's group size is wrong, not the file
    # (nor act order). With act order, groups of one size gs' other than the config's say the same.
    contiguous = _contiguous_group_size(g_idx, k)
    if contiguous is not None and contiguous != gs:
        raise ValueError(group_size_mismatch(scheme, k, -(-k // contiguous), name, f"g_idx[k] = k // {contiguous}"))
    groups_found = int(hi) + 1
    if scheme.desc_act and int(lo) == 0 and groups_found != g and groups_found <= k:  # (bincount: bounded by K)
        counts = torch.bincount(g_idx.to(torch.int64))
        size = int(counts[0])
        same_size = bool((counts[:-1] == size).all()) and 0 < int(counts[-1]) <= size
        if size != gs and same_size and -(-k // size) == groups_found:
            what = f"g_idx deals K's rows into {groups_found} groups of {size}"
            raise ValueError(group_size_mismatch(scheme, k, groups_found, name, what))
    if lo < 0 or hi >= g:
        (row,) = _first((g_idx < 0) | (g_idx >= g))
        raise ValueError(
            f"{_describe(name)}: g_idx[{row}]={int(g_idx[row])} is outside [0, {g}): each entry is the scale "
            f"group of an input row, and K={k} in groups of {gs} has groups 0..{g - 1}; {_CORRUPT}"
        )
    if not scheme.desc_act:
        expected = torch.arange(k, dtype=g_idx.dtype) // gs
        if not torch.equal(g_idx, expected):
            (row,) = _first(g_idx != expected)
            if scheme.pack_format is PackFormat.CT_PACKED:
                field, fix = "weights.actorder is not group", 'set "actorder": "group" in its config_groups weights'
            else:
                field, fix = "desc_act is false", 'set "desc_act": true in its config.json'
            raise ValueError(
                f"{_describe(name)}: g_idx[{row}]={int(g_idx[row])}, but quantization_config.{field}, "
                f"which means g_idx[k] = k // group_size ({int(expected[row])} here): this checkpoint was "
                f"quantized with act order; {fix}"
            )
        return
    # act order deals K's rows into the groups in another order, each group still group_size rows (the last
    # one the rest of K): any other count is a corrupt g_idx that would read rows with another row's scale
    counts = torch.bincount(g_idx.to(torch.int64), minlength=g)
    expected = torch.full((g,), gs, dtype=counts.dtype)
    expected[-1] = k - (g - 1) * gs
    if not torch.equal(counts, expected):
        (group,) = _first(counts != expected)
        raise ValueError(
            f"{_describe(name)}: g_idx puts {int(counts[group])} of K={k} rows into group {group}, but act order "
            f"keeps {int(expected[group])} (group_size {gs}) in each group; {_CORRUPT}"
        )


def check_scales(scales: torch.Tensor, dtype: torch.dtype | None, layout: str, name: str | TensorName) -> None:
    """Every scale finite, in the checkpoint's dtype and after the cast to the layer's `dtype`.

    layout: "GN" (GPTQ, AWQ: (G, N)) or "NG" (compressed-tensors: (N, G)), for the position in messages.
    """
    cast = scales if dtype is None else scales.to(dtype)
    if bool(torch.isfinite(cast).all()):
        return
    idx = _first(~torch.isfinite(cast))
    group, channel = idx if layout == "GN" else idx[::-1]
    value = scales[idx].item()
    at = f"scale {value:g} at output channel {channel}, group {group}"
    if math.isfinite(value):
        wider = "bfloat16 or float32" if dtype == torch.float16 else "float32"
        raise ValueError(
            f"{_describe(name)}: {at} overflows {dtype} (the layer's dtype, largest finite "
            f"{torch.finfo(dtype).max:g}); load the model with dtype {wider} (vLLM's --dtype)"
        )
    raise ValueError(f"{_describe(name)}: {at} is not finite (it would make the expert's output NaN); {_CORRUPT}")


def check_gptq_v1_zeros(
    stored: torch.Tensor,  # (N, G) int32: the unpacked stored values, zero - 1
    bits: int,
    name: str | TensorName,
) -> None:
    """GPTQ v1 stores zero - 1, so a stored 2**bits - 1 is zero 2**bits: outside int`bits`, and read differently
    by different tools (AutoGPTQ and vLLM's GPTQ linear kernels use 2**bits, a per-field wrap gives 0, GPTQModel's
    v1 -> v2 conversion carries into the neighbouring field); refused rather than guessed."""
    top = (1 << bits) - 1
    if int(stored.max()) < top:
        return
    channel, group = _first(stored == top)
    raise ValueError(
        f"{_describe(name)}: stored zero point {top} at output channel {channel}, group {group}: a GPTQ v1 "
        f'checkpoint ("checkpoint_format": "gptq") stores zero - 1, so this is zero {top + 1}, outside int{bits}\'s '
        f"0..{top}, and tools disagree on what it means; re-export the checkpoint as gptq_v2 "
        '("checkpoint_format": "gptq_v2", zero points stored as they are)'
    )


def gptq_zero_points(scheme: WNA16Scheme, qzeros: torch.Tensor, name: str | TensorName) -> torch.Tensor:
    """GPTQ qzeros (G, N/pack) int32 -> the zero points (N, G) int32: unpacked along N, and v1's stored
    zero - 1 undone (`scheme.zero_point_offset`), a v1 zero of 2**bits refused (check_gptq_v1_zeros). The MoE
    loader and the asymmetric GPTQ linear layers (gptq_linear.py) both read GPTQ zero points through here."""
    z = unpack_along(qzeros, scheme.bits, dim=1, word_bits=32).T
    if scheme.zero_point_offset:
        check_gptq_v1_zeros(z, scheme.bits, name)
    return z + scheme.zero_point_offset


def check_symmetric_zeros(scheme: WNA16Scheme, qzeros: torch.Tensor, name: str | TensorName) -> None:
    """A symmetric GPTQ or AWQ checkpoint still stores qzeros (some compressed-tensors writers a zero point),
    which no kernel reads: the zero 2**(bits-1) is implied. Writers store one value in every field, and not
    always the same one (GPTQModel 5+ writes v2's midpoint under a v1 label, AWQ and CT writers leave 0, older
    CT files hold unpacked int8 zeros): any single value passes. Fields that differ are real zero points under a
    config that says symmetric, and ignoring them would be a silently wrong layer: refused with the fix."""
    if qzeros.numel() == 0:
        return
    bits = scheme.bits
    if qzeros.dtype == torch.int32:  # packed: every bits-wide field of every word
        words = qzeros.to(torch.int64) & 0xFFFFFFFF
        fields = torch.stack([(words >> (i * bits)) & ((1 << bits) - 1) for i in range(32 // bits)], dim=-1)
    else:  # unpacked values (compressed-tensors int8 zero points)
        fields = qzeros.to(torch.int64).unsqueeze(-1)
    lo, hi = torch.aminmax(fields)
    if lo == hi:
        return
    idx = _first(fields != fields.flatten()[0])
    field, fix = {
        PackFormat.GPTQ: ('"sym": true', '"sym": false in its config.json'),
        PackFormat.AWQ: ('"zero_point": false', '"zero_point": true in its config.json'),
        PackFormat.CT_PACKED: ('"symmetric": true', '"symmetric": false in its config_groups weights'),
    }[scheme.pack_format]
    raise ValueError(
        f"{_describe(name)}: its zero points differ between groups ({int(fields.flatten()[0])} first, "
        f"{int(fields[idx])} at {'packed word' if qzeros.dtype == torch.int32 else 'position'} {list(idx[:-1])}), but "
        f"quantization_config says {field}, which implies one zero, {1 << (bits - 1)}, everywhere: this checkpoint "
        f"stores real zero points; set {fix}"
    )


def check_signed_zeros(zeros: torch.Tensor, bits: int, name: str | TensorName) -> None:
    """Unpacked compressed-tensors zero points are signed: in [-2**(bits-1), 2**(bits-1))."""
    lo_ok, hi_ok = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    lo, hi = torch.aminmax(zeros)
    if lo >= lo_ok and hi <= hi_ok:
        return
    channel, group = _first((zeros < lo_ok) | (zeros > hi_ok))
    raise ValueError(
        f"{_describe(name)}: zero point {int(zeros[channel, group])} at output channel {channel}, group {group} "
        f"is outside int{bits}'s signed range {lo_ok}..{hi_ok} (unpacked compressed-tensors zero points are "
        f"q - {1 << (bits - 1)}); {_CORRUPT}"
    )


def _check(
    name: str | TensorName, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{_describe(name)}: expected shape {tuple(shape)}, found {tuple(tensor.shape)}")
    if dtypes and tensor.dtype not in dtypes:
        raise ValueError(f"{_describe(name)}: expected dtype {' or '.join(map(str, dtypes))}, found {tensor.dtype}")


def _check_groups(
    scheme: WNA16Scheme, name: str | TensorName, tensor: torch.Tensor, shape: tuple[int, ...], dim: int, k: int
) -> None:
    """A scales / zero-points tensor whose group dimension `dim` alone differs from `shape`: another group size
    than the config's (group_size_mismatch). Any other shape error is left to _check."""
    if tensor.dim() != len(shape) or tuple(tensor.shape) == tuple(shape):
        return
    others = [i for i in range(len(shape)) if i != dim % len(shape)]
    found = tensor.shape[dim]
    if all(tensor.shape[i] == shape[i] for i in others) and 0 < found <= k:
        what = f"its shape {tuple(tensor.shape)} holds {found} group{'s' * (found != 1)}"
        raise ValueError(group_size_mismatch(scheme, k, found, name, what))


def _check_packing(
    scheme: WNA16Scheme, name: str | TensorName, tensor: torch.Tensor, shape: tuple[int, ...], dim: int, size: int
) -> None:
    """A packed tensor whose packed dimension `dim` (holding `size` values) alone differs from `shape` by what
    another bit width would pack: the config's bits are wrong (bits_mismatch)."""
    if tensor.dim() != len(shape) or tuple(tensor.shape) == tuple(shape):
        return
    others = [i for i in range(len(shape)) if i != dim]
    found = tensor.shape[dim]
    if not all(tensor.shape[i] == shape[i] for i in others) or found == 0 or (32 * found) % size:
        return
    found_bits = 32 * found // size
    if found_bits in (4, 8) and found_bits != scheme.bits:
        what = f"its shape {tuple(tensor.shape)} packs {size} values into {found} 32-bit words"
        raise ValueError(bits_mismatch(scheme, found_bits, name, what))


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INT32 = (torch.int32,)


def unpack_checkpoint_tensor(
    scheme: WNA16Scheme,
    kind: str,
    tensor: torch.Tensor,
    n: int,
    k: int,
    name: str | TensorName,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One checkpoint tensor of an (N, K) matrix -> logical (N, K) ints, (N, G) scales/zeros, or (K,) g_idx.

    Checks the shape, the dtype and the values (module docstring); `dtype` is the layer's, which scales must
    stay finite in (None: the checkpoint's own).
    """
    bits, pf, fmt = scheme.bits, scheme.pack_factor, scheme.pack_format
    g = scheme.num_groups(k)
    if kind == "g_idx":
        _check(name, tensor, (k,), _INT32 + (torch.int64,))
        check_g_idx(scheme, tensor, k, name)
        return tensor.to(torch.int32)
    if kind == "scales":
        layout = "NG" if fmt is PackFormat.CT_PACKED else "GN"
        _check_groups(scheme, name, tensor, (n, g) if layout == "NG" else (g, n), -1 if layout == "NG" else 0, k)
        _check(name, tensor, (n, g) if layout == "NG" else (g, n), _FLOATS)
        check_scales(tensor, dtype, layout, name)
        return tensor if layout == "NG" else tensor.T
    if fmt is PackFormat.GPTQ:
        if kind == "qweight":
            _check_packing(scheme, name, tensor, (k // pf, n), 0, k)
            _check(name, tensor, (k // pf, n), _INT32)
            return unpack_along(tensor, bits, dim=0, word_bits=32).T
        if kind == "qzeros":
            _check_groups(scheme, name, tensor, (g, n // pf), 0, k)
            _check_packing(scheme, name, tensor, (g, n // pf), 1, n)
            _check(name, tensor, (g, n // pf), _INT32)
            return gptq_zero_points(scheme, tensor, name)
    if fmt is PackFormat.AWQ:
        if kind == "qweight":
            _check_packing(scheme, name, tensor, (k, n // pf), 1, n)
            _check(name, tensor, (k, n // pf), _INT32)
            return unpack_along(tensor, bits, dim=1, word_bits=32, order=AWQ_PACK_ORDER).T
        if kind == "qzeros":
            _check_groups(scheme, name, tensor, (g, n // pf), 0, k)
            _check_packing(scheme, name, tensor, (g, n // pf), 1, n)
            _check(name, tensor, (g, n // pf), _INT32)
            return unpack_along(tensor, bits, dim=1, word_bits=32, order=AWQ_PACK_ORDER).T
    if fmt is PackFormat.CT_PACKED:
        if kind == "qweight":
            _check_packing(scheme, name, tensor, (n, k // pf), 1, k)
            _check(name, tensor, (n, k // pf), _INT32)
            return unpack_along(tensor, bits, dim=1, word_bits=32)
        if kind == "qzeros":
            if tensor.dtype == torch.int32 and tensor.dim() == 2 and tensor.shape[0] == n // pf:
                _check_groups(scheme, name, tensor, (n // pf, g), 1, k)
            if tensor.dtype == torch.int32 and tuple(tensor.shape) == (n // pf, g):
                return unpack_along(tensor, bits, dim=0, word_bits=32)
            # Older compressed-tensors kept zero points unpacked and signed.
            if tuple(tensor.shape) != (n, g) or tensor.dtype not in (torch.int8, torch.int32):
                raise ValueError(
                    f"{_describe(name)}: expected int32 {(n // pf, g)} (packed) or int8/int32 {(n, g)} "
                    f"(unpacked, signed), found {tensor.dtype} {tuple(tensor.shape)}"
                )
            check_signed_zeros(tensor, bits, name)
            return tensor.to(torch.int32) + scheme.symmetric_zero
        if kind == "shape":
            if tensor.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{_describe(name)}: expected dtype torch.int32 or torch.int64, found {tensor.dtype}")
            if tensor.numel() != 2 or [int(v) for v in tensor.flatten().tolist()] != [n, k]:
                raise ValueError(f"{_describe(name)}: weight_shape {tensor.tolist()} != expected [{n}, {k}]")
            return tensor
    raise ValueError(f"{_describe(name)}: kind {kind!r} is not part of the {fmt.value} format")


def shard_logical(
    shapes: MoEShapes, scheme: WNA16Scheme, kind: str, shard_id: str, value: torch.Tensor
) -> torch.Tensor:
    """Narrow a logical full tensor to this rank's part, re-grouping along K first when needed."""
    i_loc, r = shapes.intermediate_local, shapes.tp_rank
    n_full, k_full = shapes.full_nk(shard_id)
    if shard_id in ("w1", "w3"):  # intermediate is N: rows
        if kind in ("qweight", "scales", "qzeros"):
            value = value[r * i_loc : (r + 1) * i_loc]
        if kind in ("scales", "qzeros"):
            value = _regroup(value, k_full, scheme.group_size_for(k_full), shapes.group_size_w13)
        return value
    # w2: intermediate is K: columns (and groups)
    if kind == "qweight":
        return value[:, r * i_loc : (r + 1) * i_loc]
    if kind == "g_idx":
        return value[r * i_loc : (r + 1) * i_loc]
    if kind in ("scales", "qzeros"):
        if scheme.is_channelwise:
            return value  # one group spanning K: every rank keeps it
        if scheme.desc_act:
            return value  # act order: any K row may use any group, keep them all
        value = _regroup(value, k_full, scheme.group_size, shapes.group_size_w2)
        g_loc = i_loc // shapes.group_size_w2
        return value[:, r * g_loc : (r + 1) * g_loc]
    return value


def _regroup(value: torch.Tensor, size_k: int, group_size: int, new_group_size: int) -> torch.Tensor:
    """Repeat per-group values so groups of `new_group_size` (dividing group_size) cover K. Exact."""
    if group_size == new_group_size:
        return value
    if group_size % new_group_size:
        raise ValueError(f"cannot re-group group_size={group_size} into {new_group_size}")
    return value.repeat_interleave(group_size // new_group_size, dim=-1)


def kernel_rows(shapes: MoEShapes, kind: str, shard_id: str, bits: int) -> slice:
    """Rows of the kernel-layout tensor (per expert) that this shard fills."""
    i_loc = shapes.intermediate_local
    if kind == "g_idx" and shard_id != "w2":  # w13's g_idx is (2, H): one row per shard
        return slice(0, 1) if shard_id == "w1" else slice(1, 2)
    if shard_id == "w2" or kind in ("g_idx", "shape"):
        return slice(None)
    rows = i_loc * bits // 8 if kind == "qzeros" else i_loc
    start = 0 if shard_id == "w1" else rows
    return slice(start, start + rows)


def to_kernel_piece(kind: str, value: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Logical shard -> the kernel layout's bytes (see packing.KernelWeights)."""
    if kind == "qweight":
        return pack_along(value, bits, dim=-1, word_bits=8)
    if kind == "qzeros":
        return pack_along(value, bits, dim=-2, word_bits=8)
    if kind == "scales":
        return value.to(dtype)
    return value


def convert_checkpoint_tensor(
    scheme: WNA16Scheme,
    shapes: MoEShapes,
    kind: str,
    shard_id: str,
    tensor: torch.Tensor,
    name: str | TensorName,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, slice]:
    """(piece, rows): write `piece` into rows `rows` of this expert's kernel-layout tensor of `kind`."""
    if shard_id not in SHARDS:
        raise ValueError(f"shard_id must be one of {SHARDS}, got {shard_id!r}")
    n, k = shapes.full_nk(shard_id)
    logical = unpack_checkpoint_tensor(scheme, kind, tensor.cpu(), n, k, name, dtype)
    if kind == "shape":
        return logical, slice(None)
    local = shard_logical(shapes, scheme, kind, shard_id, logical)
    if kind == "g_idx" and shard_id != "w2":
        local = local.unsqueeze(0)
    return to_kernel_piece(kind, local.contiguous(), scheme.bits, dtype), kernel_rows(
        shapes, kind, shard_id, scheme.bits
    )
