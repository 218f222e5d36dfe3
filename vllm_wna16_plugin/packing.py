"""Bit layouts of every WNA16 format, in plain torch (no vLLM, no kernels).

The logical form of a quantized weight is `QuantizedWeight`: unsigned integers
q in [0, 2**bits) of shape (..., N, K), float scales (..., N, G) and unsigned zero
points (..., N, G) (None when symmetric: the zero is 2**(bits-1)), so that

    w[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group].

Each on-disk format and the plugin's kernel layout are lossless views of it:

    format              weights                         zero points
    kernel (moe_wna16)  uint8 (..., N, K*bits/8), along K  uint8 (..., N*bits/8, G), along N
    GPTQ                int32 (..., K/pf, N), along K      int32 (..., G, N/pf), stored zero-1 (v1)
    AWQ                 int32 (..., K, N/pf), along N, AWQ order [0,2,4,6,1,3,5,7]
    compressed-tensors  int32 (..., N, K/pf), along K      int32 (..., N/pf, G), along N

Sub-byte values are little-endian: element i of a word sits at bits [i*b, (i+1)*b)
(so in the kernel layout even k is the low nibble). GPTQ and AWQ scales are
stored (G, N), the others (N, G). This module is used at load time, by the
reference and by the checkpoint maker; kernels never call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_wna16_plugin.scheme import SUPPORTED_BITS

# AWQ's GEMM kernels store the 8 nibbles of a word in this order of output columns.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class QuantizedWeight:
    """Unsigned integer weights with their per-group scales and zero points."""

    q: torch.Tensor  # (..., N, K) int32, values in [0, 2**bits)
    scales: torch.Tensor  # (..., N, G) float
    zeros: torch.Tensor | None  # (..., N, G) int32, or None when symmetric
    bits: int
    group_size: int  # positive; channel-wise is group_size == K

    def zeros_or_midpoint(self) -> torch.Tensor:
        if self.zeros is not None:
            return self.zeros
        return torch.full(self.scales.shape, 1 << (self.bits - 1), dtype=torch.int32, device=self.q.device)


def check_packable(bits: int, hidden: int, intermediate: int, where: str) -> None:
    """ValueError unless every on-disk format can hold a layer of these sizes: each packs 32 // bits values
    per int32 word along H and along the experts' I (GPTQ along K and its zero points along N, AWQ along N,
    compressed-tensors along K and its zero points along N; gate/up is (N=I, K=H), down (N=H, K=I))."""
    per_word = 32 // bits
    for what, size in (("hidden size H", hidden), ("experts' intermediate size I", intermediate)):
        if size <= 0 or size % per_word:
            raise ValueError(
                f"{where}: the {what} is {size}, not a positive multiple of {per_word}: GPTQ, AWQ and "
                f"compressed-tensors checkpoints pack {per_word} int{bits} values per int32 word along it, so none "
                f"holds this layer as written (its config.json's sizes and tensors disagree)"
            )


# ---------------------------------------------------------------- generic packers


def pack_along(values: torch.Tensor, bits: int, dim: int, word_bits: int, order=None) -> torch.Tensor:
    """Pack unsigned `bits`-wide values along `dim` into `word_bits`-wide words.

    Returns int32 for word_bits == 32 and uint8 for word_bits == 8. `order[i]` is
    the source position within a word's group of values stored at slot i
    (AWQ's interleave); None is the natural order.
    """
    pf = word_bits // bits
    dim = dim % values.dim()
    size = values.shape[dim]
    if size % pf:
        raise ValueError(f"cannot pack {size} values of {bits} bits into {word_bits}-bit words")
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], size // pf, pf)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(pf, device=v.device, dtype=torch.int64) * bits
    word = (v << shifts).sum(-1)
    if word_bits == 32:
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    else:
        word = word.to(torch.uint8)
    return word.movedim(-1, dim).contiguous()


def unpack_along(words: torch.Tensor, bits: int, dim: int, word_bits: int, order=None) -> torch.Tensor:
    """Inverse of `pack_along`: int32 values in [0, 2**bits), `dim` grown by the pack factor."""
    pf = word_bits // bits
    dim = dim % words.dim()
    w = words.to(torch.int64)
    if word_bits == 32:
        w = w & 0xFFFFFFFF
    w = w.movedim(dim, -1)
    shifts = torch.arange(pf, device=w.device, dtype=torch.int64) * bits
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        inverse = [0] * pf
        for slot, src in enumerate(order):
            inverse[src] = slot
        v = v[..., inverse]
    v = v.reshape(*v.shape[:-2], w.shape[-1] * pf)
    return v.to(torch.int32).movedim(-1, dim).contiguous()


# ---------------------------------------------------------------- quantization


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, has_zero_point: bool) -> QuantizedWeight:
    """Round-to-nearest quantization of float weights (..., N, K); group_size -1 = channel-wise."""
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; supported: {list(SUPPORTED_BITS)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"group_size={group_size!r} is not supported; use a positive int or -1 (channel-wise)")
    if w.dim() < 2 or not w.dtype.is_floating_point:
        raise ValueError(f"w must be float weights (..., N, K), got {tuple(w.shape)} {w.dtype}")
    if not torch.isfinite(w).all():
        raise ValueError("w holds NaN or Inf: there is no scale that quantizes it")
    *lead, n, k = w.shape
    gs = k if group_size == -1 else group_size
    if k % gs:
        raise ValueError(f"group_size={gs} does not divide K={k}")
    g = w.to(torch.float32).reshape(*lead, n, k // gs, gs)
    qmax = (1 << bits) - 1
    if has_zero_point:
        lo = g.amin(-1).clamp(max=0.0)
        hi = g.amax(-1).clamp(min=0.0)
        scales = ((hi - lo) / qmax).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, qmax)
        q = torch.round(g / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).clamp(0, qmax)
        zeros = zeros.to(torch.int32)
    else:
        mid = 1 << (bits - 1)
        scales = (g.abs().amax(-1) / (mid - 1)).clamp(min=1e-8)
        q = torch.round(g / scales.unsqueeze(-1) + mid).clamp(0, qmax)
        zeros = None
    return QuantizedWeight(
        q=q.reshape(*lead, n, k).to(torch.int32), scales=scales, zeros=zeros, bits=bits, group_size=gs
    )


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """float32 (..., N, K) weights of a QuantizedWeight."""
    z = qw.zeros_or_midpoint()
    s = qw.scales.to(torch.float32)
    zk = z.repeat_interleave(qw.group_size, dim=-1)
    sk = s.repeat_interleave(qw.group_size, dim=-1)
    return (qw.q.to(torch.float32) - zk.to(torch.float32)) * sk


# ---------------------------------------------------------------- kernel layout


@dataclass
class KernelWeights:
    """The plugin's one kernel layout (the layout of vLLM's in-tree moe_wna16)."""

    qweight: torch.Tensor  # (E, N, K*bits/8) uint8, packed along K, even k low nibble
    scales: torch.Tensor  # (E, N, G) compute dtype
    qzeros: torch.Tensor | None  # (E, N*bits/8, G) uint8, packed along N; None when symmetric


def to_kernel_layout(qw: QuantizedWeight, dtype: torch.dtype | None = None) -> KernelWeights:
    """The kernel layout of qw, scales in `dtype` (a float dtype; default: as they are)."""
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a float dtype (the scales' dtype, e.g. torch.bfloat16)")
    qweight = pack_along(qw.q, qw.bits, dim=-1, word_bits=8)
    qzeros = None
    if qw.zeros is not None:
        qzeros = pack_along(qw.zeros, qw.bits, dim=-2, word_bits=8)
    scales = qw.scales if dtype is None else qw.scales.to(dtype)
    return KernelWeights(qweight=qweight, scales=scales.contiguous(), qzeros=qzeros)


def from_kernel_layout(kw: KernelWeights, bits: int) -> QuantizedWeight:
    q = unpack_along(kw.qweight, bits, dim=-1, word_bits=8)
    k = q.shape[-1]
    zeros = None if kw.qzeros is None else unpack_along(kw.qzeros, bits, dim=-2, word_bits=8)
    return QuantizedWeight(q=q, scales=kw.scales, zeros=zeros, bits=bits, group_size=k // kw.scales.shape[-1])


# ---------------------------------------------------------------- GPTQ


def pack_gptq(qw: QuantizedWeight, zero_point_offset: int = 1) -> dict[str, torch.Tensor]:
    """GPTQ tensors of (..., N, K) weights: qweight, qzeros, scales (..., G, N).

    zero_point_offset=1 is the v1 convention (stored zero = true zero - 1), the
    format AutoGPTQ/GPTQModel write by default; 0 is gptq_v2.
    """
    zeros = qw.zeros_or_midpoint() - zero_point_offset
    if zero_point_offset and bool((zeros < 0).any()):
        # v1 would store zero 0 as 2**bits - 1, which readers take as 2**bits (AutoGPTQ, vLLM) or 0: the
        # loader refuses it, so never write it
        raise ValueError("a zero point of 0 cannot be stored in GPTQ v1 (stored zero - 1 wraps); write gptq_v2 instead")
    return {
        "qweight": pack_along(qw.q.transpose(-1, -2), qw.bits, dim=-2, word_bits=32),
        "qzeros": pack_along(zeros.transpose(-1, -2), qw.bits, dim=-1, word_bits=32),
        "scales": qw.scales.transpose(-1, -2).contiguous(),
    }


def unpack_gptq(
    qweight: torch.Tensor,  # (..., K/pf, N) int32
    qzeros: torch.Tensor | None,  # (..., G, N/pf) int32
    scales: torch.Tensor,  # (..., G, N)
    bits: int,
    zero_point_offset: int,
    has_zero_point: bool,
) -> QuantizedWeight:
    q = unpack_along(qweight, bits, dim=-2, word_bits=32).transpose(-1, -2)
    k = q.shape[-1]
    zeros = None
    if has_zero_point:
        if qzeros is None:
            raise ValueError("asymmetric GPTQ checkpoint has no qzeros")
        z = unpack_along(qzeros, bits, dim=-1, word_bits=32).transpose(-1, -2)
        zeros = ((z + zero_point_offset) & ((1 << bits) - 1)).contiguous()
    s = scales.transpose(-1, -2).contiguous()
    return QuantizedWeight(q=q.contiguous(), scales=s, zeros=zeros, bits=bits, group_size=k // s.shape[-1])


# ---------------------------------------------------------------- AWQ


def pack_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors of (..., N, K) weights: qweight (..., K, N/8), qzeros (..., G, N/8), scales (..., G, N)."""
    return {
        "qweight": pack_along(qw.q.transpose(-1, -2), qw.bits, dim=-1, word_bits=32, order=AWQ_PACK_ORDER),
        "qzeros": pack_along(
            qw.zeros_or_midpoint().transpose(-1, -2), qw.bits, dim=-1, word_bits=32, order=AWQ_PACK_ORDER
        ),
        "scales": qw.scales.transpose(-1, -2).contiguous(),
    }


def unpack_awq(
    qweight: torch.Tensor,  # (..., K, N/8) int32
    qzeros: torch.Tensor | None,  # (..., G, N/8) int32
    scales: torch.Tensor,  # (..., G, N)
    bits: int,
    has_zero_point: bool,
) -> QuantizedWeight:
    q = unpack_along(qweight, bits, dim=-1, word_bits=32, order=AWQ_PACK_ORDER).transpose(-1, -2)
    k = q.shape[-1]
    zeros = None
    if has_zero_point:
        if qzeros is None:
            raise ValueError("AWQ checkpoint with zero_point=true has no qzeros")
        zeros = unpack_along(qzeros, bits, dim=-1, word_bits=32, order=AWQ_PACK_ORDER).transpose(-1, -2)
        zeros = zeros.contiguous()
    s = scales.transpose(-1, -2).contiguous()
    return QuantizedWeight(q=q.contiguous(), scales=s, zeros=zeros, bits=bits, group_size=k // s.shape[-1])


# ---------------------------------------------------------------- compressed-tensors


def pack_compressed_tensors(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors: weight_packed (..., N, K/pf), weight_scale (..., N, G),
    weight_zero_point (..., N/pf, G) when asymmetric, weight_shape [N, K].

    The library stores signed values offset by 2**(bits-1); that offset is the
    unsigned value here, so the words are the same bits.
    """
    out = {
        "weight_packed": pack_along(qw.q, qw.bits, dim=-1, word_bits=32),
        "weight_scale": qw.scales.contiguous(),
        "weight_shape": torch.tensor(list(qw.q.shape[-2:]), dtype=torch.int64),
    }
    if qw.zeros is not None:
        out["weight_zero_point"] = pack_along(qw.zeros, qw.bits, dim=-2, word_bits=32)
    return out


def unpack_compressed_tensors(
    weight_packed: torch.Tensor,  # (..., N, K/pf) int32
    weight_scale: torch.Tensor,  # (..., N, G)
    weight_zero_point: torch.Tensor | None,  # (..., N/pf, G) int32
    bits: int,
    has_zero_point: bool,
) -> QuantizedWeight:
    q = unpack_along(weight_packed, bits, dim=-1, word_bits=32)
    k = q.shape[-1]
    zeros = None
    if has_zero_point:
        if weight_zero_point is None:
            raise ValueError("asymmetric compressed-tensors checkpoint has no weight_zero_point")
        zeros = unpack_along(weight_zero_point, bits, dim=-2, word_bits=32)
    return QuantizedWeight(q=q, scales=weight_scale, zeros=zeros, bits=bits, group_size=k // weight_scale.shape[-1])


# ---------------------------------------------------------------- act order (sorted K)


def sort_groups(g_idx: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, str | None]:
    """(perm, issue) for act order: perm (E, K) int64 is each expert's stable sort of its g_idx (E, K),
    so that K row perm[e, k] belongs to group k // (K / num_groups): every group one contiguous run.

    issue is None when that holds, else why not (the sorted layout needs every group to hold exactly
    K / num_groups rows, as GPTQ's and compressed-tensors' act order write them on one rank)."""
    e, k = g_idx.shape
    sorted_g, perm = torch.sort(g_idx.long(), dim=-1, stable=True)
    if num_groups <= 0 or k % num_groups:
        return perm, f"K={k} rows cannot form {num_groups} equal groups"
    gs = k // num_groups
    expected = torch.arange(k, device=g_idx.device) // gs
    bad = (sorted_g != expected).any(-1)
    if not bool(bad.any()):
        return perm, None
    ex = int(bad.nonzero()[0])
    counts = torch.bincount(g_idx[ex].long().clamp(min=0), minlength=num_groups)
    group = int((counts != gs).nonzero()[0])
    return perm, (
        f"local expert {ex}: group {group} has {int(counts[group])} of K={k} rows, not group_size={gs} "
        "(sorting K by g_idx needs equal groups; under tensor parallelism a group's rows may be split "
        "across ranks)"
    )


def padded_group_runs(g_idx: torch.Tensor, num_groups: int, run: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, chunk_groups): act order whose groups are not whole (a tensor-parallel rank's slice of K) laid
    out in chunks of `run` rows, each chunk inside one group.

    Each expert's K rows are sorted by g_idx (E, K) (stably); group g's c_g rows are followed by padding up
    to a multiple of `run`, and every expert is padded at the end to the longest,
    K_pad = max_e sum_g ceil(c_eg / run) * run. rows (E, K_pad) int64: the source row of K row k, -1 for
    padding. chunk_groups (E, K_pad // run) int64: the group of chunk j (rows j*run ..); chunks of end
    padding take group num_groups - 1. g_idx values must lie in [0, num_groups)."""
    e, k = g_idx.shape
    g = g_idx.long()
    counts = torch.zeros(e, num_groups, dtype=torch.int64, device=g.device).scatter_add_(1, g, torch.ones_like(g))
    padded = (counts + run - 1) // run * run  # (E, G) rows each group takes
    k_pad = int(padded.sum(-1).max())
    sorted_g, perm = torch.sort(g, dim=-1, stable=True)
    first = (torch.cumsum(counts, -1) - counts).gather(1, sorted_g)  # sorted position of each row's group start
    dest = (torch.cumsum(padded, -1) - padded).gather(1, sorted_g) + torch.arange(k, device=g.device) - first
    rows = torch.full((e, k_pad), -1, dtype=torch.int64, device=g.device).scatter_(1, dest, perm)
    chunk_end = torch.cumsum(padded // run, -1)  # (E, G): chunks before the end of group g
    chunks = torch.arange(k_pad // run, device=g.device).expand(e, -1).contiguous()
    chunk_groups = torch.searchsorted(chunk_end, chunks, right=True).clamp(max=num_groups - 1)
    return rows, chunk_groups


def permute_k(
    qweight: torch.Tensor,  # (E, N, K*bits/8) uint8
    perm: torch.Tensor,  # (E, K_new) int: new k = old perm[e, k]; -1 = padding
    bits: int,
    pad_values: torch.Tensor | None = None,  # (E, N, C) int: the value of padding rows in chunk k // (K_new / C)
) -> torch.Tensor:
    """Kernel-layout qweight (E, N, K_new*bits/8) with each expert's K reordered (and padded: rows where
    perm is -1 take pad_values, default 0)."""
    e, n, _ = qweight.shape
    k_new = perm.shape[-1]
    out = torch.empty((e, n, k_new * bits // 8), dtype=qweight.dtype, device=qweight.device)
    for ex in range(e):  # one expert at a time: the unpacked int64 copy stays small
        q = unpack_along(qweight[ex], bits, dim=-1, word_bits=8)
        p = perm[ex].to(q.device)
        new = q[:, p.clamp(min=0)]
        pad = p < 0
        if bool(pad.any()):
            fill = torch.zeros_like(new)
            if pad_values is not None:
                fill = pad_values[ex].to(new).repeat_interleave(k_new // pad_values.shape[-1], dim=-1)
            new = torch.where(pad, fill, new)
        out[ex] = pack_along(new, bits, dim=-1, word_bits=8)
    return out


def permute_n(
    qweight: torch.Tensor,  # (E, N, K*bits/8) uint8
    scales: torch.Tensor,  # (E, N, G)
    qzeros: torch.Tensor | None,  # (E, N*bits/8, G) uint8
    rows: torch.Tensor,  # (E, N_new) int: new row n = old row rows[e, n]; -1 = a padding row
    bits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Kernel-layout weights with each expert's N rows (output channels) reordered; a padding row gets
    weights 0, scale 0 and zero point 0, so it dequantizes to exactly 0."""
    idx = rows.long().to(qweight.device)
    keep = (idx >= 0)[:, :, None]
    src = idx.clamp(min=0)[:, :, None]
    qw = torch.gather(qweight, 1, src.expand(-1, -1, qweight.shape[-1])).masked_fill_(~keep, 0)
    sc = torch.gather(scales, 1, src.expand(-1, -1, scales.shape[-1])).masked_fill_(~keep, 0)
    qz = None
    if qzeros is not None:
        qz = torch.empty((qzeros.shape[0], idx.shape[1] * bits // 8, qzeros.shape[-1]), dtype=qzeros.dtype,
                         device=qzeros.device)  # fmt: skip
        for e in range(qzeros.shape[0]):
            z = unpack_along(qzeros[e], bits, dim=-2, word_bits=8)[src[e, :, 0]].masked_fill_(~keep[e], 0)
            qz[e] = pack_along(z, bits, dim=-2, word_bits=8)
    return qw.contiguous(), sc.contiguous(), qz
