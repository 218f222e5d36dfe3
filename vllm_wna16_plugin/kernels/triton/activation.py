"""The gated activation between the two MoE GEMMs, one Triton launch:

    out[t, i] = act(h[t, i]) * h[t, I + i],  act = silu or gelu (erf), float32 math,

rounded once to out.dtype (GEMM1 computes the same in its epilogue where it fuses the activation:
TritonMoEConfig.fuse_act). `h` is either the GEMM1 output (T, 2I) in the activation
dtype, or split-K partials (SPLIT, T, 2I) float32 that are summed here and rounded to
the activation dtype first (the rounding point of an unsplit GEMM1). The torch form
for other callers is vllm_wna16_plugin.activation.gated_activation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_wna16_plugin.kernels.triton.dequant import _round_to

ACTIVATIONS = ("silu", "gelu")
_TL_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _gated(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up in float32 (gate, up float32): silu(g) = g / (1 + e^-g), gelu(g) = g/2 (1 + erf(g / sqrt 2)).
    The one home of the math: this kernel's, and GEMM1's epilogue when it fuses the activation."""
    if ACTIVATION == "silu":
        act = gate / (1.0 + tl.exp(-gate))
    else:
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    return act * up


@triton.jit
def _gated_activation_kernel(
    h_ptr,  # (SPLIT, T, 2I) float32 partials, or (T, 2I) in the compute type when SPLIT == 1
    out_ptr,  # (T, I) compute type
    stride_hs,
    stride_ht,
    stride_ot,
    I: tl.constexpr,
    SPLIT: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "silu" | "gelu"
    compute_type: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,  # bf16 under the interpreter; see dequant._round_to
    BLOCK: tl.constexpr,
):
    """Grid: (T, cdiv(I, BLOCK)). One row segment of BLOCK columns per program."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    base = h_ptr + row * stride_ht + offs
    if SPLIT == 1:
        gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + I, mask=mask, other=0.0).to(tl.float32)
    else:
        gate = tl.zeros((BLOCK,), tl.float32)
        up = tl.zeros((BLOCK,), tl.float32)
        for s in tl.static_range(SPLIT):
            gate += tl.load(base + s * stride_hs, mask=mask, other=0.0)
            up += tl.load(base + s * stride_hs + I, mask=mask, other=0.0)
        # the unsplit GEMM1 stores h in the compute type: round there too
        gate = _round_to(gate, compute_type, RNE_BY_HAND).to(tl.float32)
        up = _round_to(up, compute_type, RNE_BY_HAND).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + offs, _round_to(_gated(gate, up, ACTIVATION), compute_type, RNE_BY_HAND),
             mask=mask)  # fmt: skip


def _is_interpreter() -> bool:
    return not isinstance(_gated_activation_kernel, triton.runtime.JITFunction)


def gated_activation_triton(
    h: torch.Tensor,  # (T, 2I) bf16/fp16, or (SPLIT, T, 2I) float32 partials
    activation: str,
    out: torch.Tensor | None = None,  # (T, I) bf16/fp16
    *,
    dtype: torch.dtype | None = None,  # the output dtype when h is float32 partials and out is None
) -> torch.Tensor:
    """act(h[..., :I]) * h[..., I:] (partials summed over dim 0 first), float32 math, one launch."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; supported: {list(ACTIVATIONS)}")
    if h.dim() == 2:
        h3, split = h.unsqueeze(0), 1
        if h.dtype not in _TL_TYPES:
            raise ValueError(f"h (T, 2I) must be bfloat16 or float16, got {h.dtype}")
        out_dtype = h.dtype
    elif h.dim() == 3 and h.dtype == torch.float32:
        h3, split = h, h.shape[0]
        out_dtype = out.dtype if out is not None else dtype
        if out_dtype not in _TL_TYPES:
            raise ValueError("float32 partials (SPLIT, T, 2I) need out= or dtype= bfloat16/float16")
    else:
        raise ValueError(f"h must be (T, 2I) bf16/fp16 or (SPLIT, T, 2I) float32, got {tuple(h.shape)} {h.dtype}")
    T, two_i = h3.shape[1], h3.shape[2]
    if two_i % 2 or h3.stride(2) != 1:
        raise ValueError(f"h's last dim must be an even, contiguous 2I, got {two_i} (stride {h3.stride(2)})")
    inter = two_i // 2
    if out is None:
        out = torch.empty((T, inter), dtype=out_dtype, device=h.device)
    elif tuple(out.shape) != (T, inter) or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(
            f"out must be a row-contiguous (T={T}, I={inter}) {out_dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _gated_activation_kernel[(T, triton.cdiv(inter, block))](
        h_ptr=h3,
        out_ptr=out,
        stride_hs=h3.stride(0),
        stride_ht=h3.stride(1),
        stride_ot=out.stride(0),
        I=inter,
        SPLIT=split,
        ACTIVATION=activation,
        compute_type=_TL_TYPES[out_dtype],
        RNE_BY_HAND=_is_interpreter() and out_dtype == torch.bfloat16,
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )
    return out


@triton.jit
def _moe_sum_kernel(
    y_ptr,  # (SPLIT, T*top_k, H) float32 partials, or (T*top_k, H) in the compute type when SPLIT == 1
    out_ptr,  # (T, H) compute type
    stride_ys,
    stride_yp,
    stride_ot,
    H: tl.constexpr,
    top_k: tl.constexpr,
    SPLIT: tl.constexpr,
    compute_type: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    BLOCK: tl.constexpr,
    PROGRAMMATIC: tl.constexpr = False,
):
    """out[t] = sum_j round(sum_s y[s, t*top_k + j]), float32 sum, one rounding at the end.

    Grid: (T, cdiv(H, BLOCK)). Each pair's value is rounded to the compute type first,
    the rounding point of the unsplit GEMM2 output. PROGRAMMATIC: launched to start while the kernel
    before it finishes (csrc/grid_dependency.cuh's contract): it waits for that kernel first.
    """
    if PROGRAMMATIC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(top_k):
        base = y_ptr + (t * top_k + j) * stride_yp + offs
        if SPLIT == 1:
            acc += tl.load(base, mask=mask, other=0.0).to(tl.float32)
        else:
            part = tl.zeros((BLOCK,), tl.float32)
            for s in tl.static_range(SPLIT):
                part += tl.load(base + s * stride_ys, mask=mask, other=0.0)
            acc += _round_to(part, compute_type, RNE_BY_HAND).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, _round_to(acc, compute_type, RNE_BY_HAND), mask=mask)


def moe_sum_triton(
    y: torch.Tensor,  # (T*top_k, H) bf16/fp16, or (SPLIT, T*top_k, H) float32 partials
    out: torch.Tensor,  # (T, H) bf16/fp16
    top_k: int,
    *,
    programmatic: bool = False,
) -> torch.Tensor:
    """out[t] = sum_j y[t*top_k + j] (partials summed over dim 0 first), float32 accumulate, one launch.

    programmatic: a programmatic dependent launch (Hopper and later; the caller checks): the kernel may start
    while the one before it finishes, and waits for it before it reads y."""
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    split = y3.shape[0] if y.dim() == 3 else 1
    T, H = out.shape
    if y.dim() == 3 and y.dtype != torch.float32:
        raise ValueError(f"3-D y holds split-K partials and must be float32, got {y.dtype}")
    if y.dim() == 2 and y.dtype != out.dtype:
        raise ValueError(f"y dtype {y.dtype} must match out dtype {out.dtype}")
    if out.dtype not in _TL_TYPES or tuple(y3.shape[1:]) != (T * top_k, H) or y3.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError(
            f"y {tuple(y.shape)} / out {tuple(out.shape)} {out.dtype} do not match (T*top_k={T * top_k}, H={H})"
        )
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _moe_sum_kernel[(T, triton.cdiv(H, block))](
        y_ptr=y3,
        out_ptr=out,
        stride_ys=y3.stride(0),
        stride_yp=y3.stride(1),
        stride_ot=out.stride(0),
        H=H,
        top_k=top_k,
        SPLIT=split,
        compute_type=_TL_TYPES[out.dtype],
        RNE_BY_HAND=_is_interpreter() and out.dtype == torch.bfloat16,
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
        **({"PROGRAMMATIC": True, "launch_pdl": True} if programmatic else {}),
    )
    return out


__all__ = ["ACTIVATIONS", "gated_activation_triton", "moe_sum_triton"]
