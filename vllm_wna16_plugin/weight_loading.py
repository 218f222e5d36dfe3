"""Checkpoint tensors of one expert -> this rank's slice of the kernel layout (no vLLM).

Each checkpoint tensor (GPTQ, AWQ or compressed-tensors, one expert, one of
gate/up/down) is unpacked to its logical form ((N, K) integers or (N, G) scales
and zero points, see packing.py), re-grouped when the TP shard boundary falls
inside a group (scales repeated: exact), narrowed to this rank's shard of the
intermediate dim, and repacked into the kernel layout. Wrong shapes or dtypes
are a ValueError naming the tensor, what was expected and what was found.
"""

from __future__ import annotations

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


def _check(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name}: expected shape {tuple(shape)}, found {tuple(tensor.shape)}")
    if dtypes and tensor.dtype not in dtypes:
        raise ValueError(
            f"checkpoint tensor {name}: expected dtype {' or '.join(map(str, dtypes))}, found {tensor.dtype}"
        )


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INT32 = (torch.int32,)


def unpack_checkpoint_tensor(
    scheme: WNA16Scheme, kind: str, tensor: torch.Tensor, n: int, k: int, name: str
) -> torch.Tensor:
    """One checkpoint tensor of an (N, K) matrix -> logical (N, K) ints, (N, G) scales/zeros, or (K,) g_idx."""
    bits, pf, fmt = scheme.bits, scheme.pack_factor, scheme.pack_format
    g = scheme.num_groups(k)
    if kind == "g_idx":
        _check(name, tensor, (k,), _INT32 + (torch.int64,))
        return tensor.to(torch.int32)
    if fmt is PackFormat.GPTQ:
        if kind == "qweight":
            _check(name, tensor, (k // pf, n), _INT32)
            return unpack_along(tensor, bits, dim=0, word_bits=32).T
        if kind == "qzeros":
            _check(name, tensor, (g, n // pf), _INT32)
            z = unpack_along(tensor, bits, dim=1, word_bits=32).T
            return (z + scheme.zero_point_offset) & ((1 << bits) - 1)
        if kind == "scales":
            _check(name, tensor, (g, n), _FLOATS)
            return tensor.T
    if fmt is PackFormat.AWQ:
        if kind == "qweight":
            _check(name, tensor, (k, n // pf), _INT32)
            return unpack_along(tensor, bits, dim=1, word_bits=32, order=AWQ_PACK_ORDER).T
        if kind == "qzeros":
            _check(name, tensor, (g, n // pf), _INT32)
            return unpack_along(tensor, bits, dim=1, word_bits=32, order=AWQ_PACK_ORDER).T
        if kind == "scales":
            _check(name, tensor, (g, n), _FLOATS)
            return tensor.T
    if fmt is PackFormat.CT_PACKED:
        if kind == "qweight":
            _check(name, tensor, (n, k // pf), _INT32)
            return unpack_along(tensor, bits, dim=1, word_bits=32)
        if kind == "qzeros":
            if tensor.dtype == torch.int32 and tuple(tensor.shape) == (n // pf, g):
                return unpack_along(tensor, bits, dim=0, word_bits=32)
            # Older compressed-tensors kept zero points unpacked and signed.
            _check(name, tensor, (n, g), (torch.int8, torch.int32))
            return tensor.to(torch.int32) + scheme.symmetric_zero
        if kind == "scales":
            _check(name, tensor, (n, g), _FLOATS)
            return tensor
        if kind == "shape":
            if tensor.numel() != 2 or [int(v) for v in tensor.flatten().tolist()] != [n, k]:
                raise ValueError(f"checkpoint tensor {name}: weight_shape {tensor.tolist()} != expected [{n}, {k}]")
            return tensor
    raise ValueError(f"checkpoint tensor {name}: kind {kind!r} is not part of the {fmt.value} format")


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
    scheme: WNA16Scheme, shapes: MoEShapes, kind: str, shard_id: str, tensor: torch.Tensor, name: str, dtype
) -> tuple[torch.Tensor, slice]:
    """(piece, rows): write `piece` into rows `rows` of this expert's kernel-layout tensor of `kind`."""
    if shard_id not in SHARDS:
        raise ValueError(f"shard_id must be one of {SHARDS}, got {shard_id!r}")
    n, k = shapes.full_nk(shard_id)
    logical = unpack_checkpoint_tensor(scheme, kind, tensor.cpu(), n, k, name)
    if kind == "shape":
        return logical, slice(None)
    local = shard_logical(shapes, scheme, kind, shard_id, logical)
    if kind == "g_idx" and shard_id != "w2":
        local = local.unsqueeze(0)
    return to_kernel_piece(kind, local.contiguous(), scheme.bits, dtype), kernel_rows(
        shapes, kind, shard_id, scheme.bits
    )
