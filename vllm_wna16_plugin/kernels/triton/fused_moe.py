"""The plugin's Triton fused-MoE WNA16 kernel and its launcher.

    out[t] = sum_j w[t, j] * W2[e] @ act(W13[e] @ x[t]),  e = topk_ids[t, j],

with W13/W2 int4 or int8 in the kernel layout of packing.py (uint8, packed along K,
even k in the low nibble), dequantized in-kernel as w = (q - z) * s in float32 and
accumulated in float32. One kernel runs both GEMMs; it has two ways to load the B
tile, chosen per launch by td_gate.decide_td:

  pointer path  (BLOCK_N, BLOCK_K*bits/8) bytes, K-contiguous: wide row loads.
  TD path       the same bytes through a 3-D descriptor (E, N, K*bits/8), and
                optionally A through a descriptor gather of the sorted token rows.

Both share dequant.py's unpack/dequant; scales and zero points stay on pointers.
No vLLM import here: the GPU caller passes vLLM's moe_align_block_size as align_fn.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllm_wna16_plugin.kernels.align import moe_align_block_size_torch
from vllm_wna16_plugin.kernels.triton.configs import TritonMoEConfig, get_triton_moe_config
from vllm_wna16_plugin.kernels.triton.dequant import _dequant_b_tile, _round_to, _unpack_b_tile, _unpack_zero_points
from vllm_wna16_plugin.kernels.triton.td_gate import TDDecision, decide_td, td_request_from_env

ACTIVATIONS = ("silu", "gelu")
_COMPUTE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
AlignFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@triton.jit
def _load_a_tile_ptr(a_ptr, a_rows, row_mask, offs_k, k0, K: tl.constexpr, stride_am, stride_ak, EVEN_K: tl.constexpr):
    """(BLOCK_M, BLOCK_K) rows of A by pointer; masked rows and the K tail read 0."""
    ptrs = a_ptr + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak
    mask = row_mask[:, None]
    if not EVEN_K:
        mask = mask & ((k0 + offs_k)[None, :] < K)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _load_b_bytes_ptr(
    b_ptr, expert, offs_n, offs_kb, kb0, KB: tl.constexpr, stride_be, stride_bn, EVEN_K: tl.constexpr
):
    """(BLOCK_N, BLOCK_KB) packed bytes of B by pointer; each row is one contiguous run."""
    ptrs = b_ptr + expert * stride_be + offs_n[:, None] * stride_bn + (kb0 + offs_kb)[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(kb0 + offs_kb)[None, :] < KB, other=0)


@triton.jit
def _load_group_params(
    s_ptr,
    z_ptr,
    expert,
    offs_n,
    g0,
    stride_se,
    stride_sn,
    stride_sg,
    stride_ze,
    stride_zn,
    stride_zg,
    NUM_GROUPS: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """(scale, zero) as (BLOCK_N, GROUPS) float32 for groups g0 .. g0+GROUPS-1; groups past
    NUM_GROUPS (a K tail) get scale 0, so their B columns dequantize to exactly 0."""
    offs_g = g0 + tl.arange(0, GROUPS)
    g_mask = offs_g[None, :] < NUM_GROUPS
    s_ptrs = s_ptr + expert * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sg
    if EVEN_K:
        scale = tl.load(s_ptrs).to(tl.float32)
    else:
        scale = tl.load(s_ptrs, mask=g_mask, other=0.0).to(tl.float32)
    if HAS_ZP:
        if BITS == 4:
            z_rows = offs_n // 2
        else:
            z_rows = offs_n
        z_ptrs = z_ptr + expert * stride_ze + z_rows[:, None] * stride_zn + offs_g[None, :] * stride_zg
        if EVEN_K:
            zbytes = tl.load(z_ptrs)
        else:
            zbytes = tl.load(z_ptrs, mask=g_mask, other=0)
        zero = _unpack_zero_points(zbytes, offs_n, BITS).to(tl.float32)
    else:
        zero = tl.full((BLOCK_N, GROUPS), 1 << (BITS - 1), tl.float32)
    return scale, zero


@triton.jit
def _fused_moe_wna16_kernel(
    a_ptr,  # (num_a_rows, K) compute dtype
    b_ptr,  # (E, N, K*BITS//8) uint8
    c_ptr,  # (num_valid_tokens, N) compute dtype
    s_ptr,  # (E, N, NUM_GROUPS) compute dtype
    z_ptr,  # (E, N*BITS//8, NUM_GROUPS) uint8, unused unless HAS_ZP
    topk_weights_ptr,  # (num_valid_tokens,) float
    sorted_token_ids_ptr,  # (EM,) int32, sentinel num_valid_tokens
    expert_ids_ptr,  # (EM // BLOCK_SIZE_M,) int32, -1 = not on this rank
    num_tokens_post_padded_ptr,  # (1,) int32
    num_a_rows,
    num_valid_tokens,
    E,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_se,
    stride_sn,
    stride_sg,
    stride_ze,
    stride_zn,
    stride_zg,
    N: tl.constexpr,
    K: tl.constexpr,
    EM_GRID: tl.constexpr,
    group_size: tl.constexpr,  # K elements per scale; channel-wise passes a power of two >= K
    NUM_GROUPS: tl.constexpr,  # cdiv(K, group_size): the scales' last dim
    GROUPS: tl.constexpr,  # scale groups per K tile: max(1, BLOCK_SIZE_K // group_size)
    top_k: tl.constexpr,  # A row of routed pair p is p // top_k (GEMM2 passes 1)
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TD: tl.constexpr,
    USE_TD_GATHER: tl.constexpr,
    compute_type: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,  # Triton-interpreter bf16 work-arounds; see _interpret_bf16()
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
):
    """C[p, :] = (w_p if MUL_ROUTED_WEIGHT) * A[p // top_k] @ dequant(B[e_p]).T for routed pairs p.

    Grid: (cdiv(EM_GRID, BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N),). A block of sorted
    pairs whose expert is -1 writes zeros. Requires group_size % BLOCK_SIZE_K == 0 or
    BLOCK_SIZE_K % group_size == 0 (configs.TritonMoEConfig.check_shape).
    """
    KB: tl.constexpr = K * BITS // 8
    BLOCK_KB: tl.constexpr = BLOCK_SIZE_K * BITS // 8

    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(EM_GRID, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
        return
    offs_pair = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
    pairs = tl.load(sorted_token_ids_ptr + offs_pair).to(tl.int64)
    pair_mask = pairs < num_valid_tokens
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    c_mask = pair_mask[:, None] & (offs_cn[None, :] < N)

    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:
        tl.store(c_ptrs, tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=compute_type), mask=c_mask)
        return

    # Columns past N wrap (pointer loads stay in bounds); the store masks them.
    offs_n = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    offs_kb = tl.arange(0, BLOCK_KB)
    a_rows = pairs // top_k  # padding pairs land on row num_a_rows: masked / out of the descriptor
    if USE_TD:
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[E, N, KB], strides=[stride_be, stride_bn, 1], block_shape=[1, BLOCK_SIZE_N, BLOCK_KB]
        )
    if USE_TD_GATHER:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[num_a_rows, K], strides=[stride_am, 1], block_shape=[1, BLOCK_SIZE_K]
        )
        a_rows32 = a_rows.to(tl.int32)

    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k0 = k * BLOCK_SIZE_K
        if USE_TD_GATHER:
            a = a_desc.gather(a_rows32, k0)
        else:
            a = _load_a_tile_ptr(a_ptr, a_rows, pair_mask, offs_k, k0, K, stride_am, stride_ak, EVEN_K)
        if USE_TD:
            packed = tl.reshape(
                b_desc.load([expert.to(tl.int32), pid_n * BLOCK_SIZE_N, k0 * BITS // 8]), (BLOCK_SIZE_N, BLOCK_KB)
            )
        else:
            packed = _load_b_bytes_ptr(b_ptr, expert, offs_n, offs_kb, k0 * BITS // 8, KB, stride_be, stride_bn, EVEN_K)
        q = _unpack_b_tile(packed, BITS)
        scale, zero = _load_group_params(
            s_ptr,
            z_ptr,
            expert,
            offs_n,
            k0 // group_size,
            stride_se,
            stride_sn,
            stride_sg,
            stride_ze,
            stride_zn,
            stride_zg,
            NUM_GROUPS,
            GROUPS,
            BLOCK_SIZE_N,
            BITS,
            HAS_ZP,
            EVEN_K,
        )
        w = _dequant_b_tile(q, scale, zero, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUPS, compute_type, INTERPRET_BF16)
        if INTERPRET_BF16:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc=acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc=acc)

    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    tl.store(c_ptrs, _round_to(acc, compute_type, INTERPRET_BF16), mask=c_mask)


# ---------------------------------------------------------------- host side


@functools.cache
def _ensure_td_allocator() -> None:
    """Install a torch scratch allocator for Triton, once per process."""

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=torch.accelerator.current_accelerator())

    # tl.make_tensor_descriptor builds descriptors on the device, in global scratch memory.
    triton.set_allocator(alloc)


def _is_interpreter() -> bool:
    """Whether the kernel was defined under TRITON_INTERPRET=1 (triton.jit decides at definition)."""
    return not isinstance(_fused_moe_wna16_kernel, triton.runtime.JITFunction)


def _interpret_bf16(dtype: torch.dtype) -> bool:
    """Two Triton 3.6 interpreter bugs with bf16, worked around only there: tl.dot multiplies
    bf16 operands as their raw uint16 bits (InterpreterBuilder.create_dot has no bf16 case),
    so the kernel upcasts the already-rounded tiles to float32 (same values, float32
    accumulate as on GPU); and float32 -> bf16 casts truncate, so it rounds by hand."""
    return _is_interpreter() and dtype == torch.bfloat16


def _platform_of(device: torch.device) -> tuple[str, int | None]:
    """(platform, sm) for td_gate.decide_td; the only hardware query of the launcher."""
    if _is_interpreter():
        return "interpreter", None
    if device.type == "cuda":
        if torch.version.hip:
            return "rocm", None
        major, minor = torch.cuda.get_device_capability(device)
        return "cuda", major * 10 + minor
    if device.type == "xpu":
        return "xpu", None
    return "cpu", None


def _aligned(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _kernel_group_size(K: int, num_groups: int, block_size_k: int) -> int:
    """The kernel's group_size constexpr: the real group, or for channel-wise a power of
    two >= max(K, BLOCK_SIZE_K) so that every k maps to group 0 under any BLOCK_SIZE_K."""
    if num_groups == 1:
        return max(block_size_k, triton.next_power_of_2(K))
    return K // num_groups


def invoke_wna16_gemm(
    a: torch.Tensor,  # (num_a_rows, K) bf16/fp16, K-contiguous
    qweight: torch.Tensor,  # (E, N, K*bits/8) uint8
    scales: torch.Tensor,  # (E, N, G)
    qzeros: torch.Tensor | None,  # (E, N*bits/8, G) uint8
    c: torch.Tensor,  # (num_pairs, N) out, a.dtype
    topk_weights: torch.Tensor | None,  # (num_pairs,) float, read when mul_routed_weight
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    *,
    bits: int,
    top_k: int,  # A row of pair p is p // top_k
    mul_routed_weight: bool,
    config: TritonMoEConfig,
    td: TDDecision,
) -> torch.Tensor:
    """One grouped GEMM: c[p] = (w_p) * a[p // top_k] @ dequant(qweight[e_p]).T over the sorted pairs.

    Every row of c named by sorted_token_ids is written (zeros for expert -1). `td`
    is taken as given (callers get it from td_gate.decide_td); `config` must pass
    check_shape for this K.
    """
    E, N, _ = qweight.shape
    K = a.shape[1]
    num_groups = scales.shape[-1]
    config.check_shape(K, K // num_groups)
    group_size = _kernel_group_size(K, num_groups, config.BLOCK_SIZE_K)
    if td.use_td_b or td.use_gather:
        _ensure_td_allocator()
    num_pairs = c.shape[0]
    bm, bn = config.BLOCK_SIZE_M, config.BLOCK_SIZE_N
    # At most num_pairs non-empty M-blocks exist, so blocks past num_pairs * BLOCK_SIZE_M are never live.
    em_grid = min(sorted_token_ids.numel(), num_pairs * bm)
    grid = (triton.cdiv(em_grid, bm) * triton.cdiv(N, bn),)
    has_zp = qzeros is not None
    zp = qzeros if has_zp else qweight  # any uint8 tensor: never read when HAS_ZP is False
    _fused_moe_wna16_kernel[grid](
        a_ptr=a,
        b_ptr=qweight,
        c_ptr=c,
        s_ptr=scales,
        z_ptr=zp,
        topk_weights_ptr=topk_weights if topk_weights is not None else scales,
        sorted_token_ids_ptr=sorted_token_ids,
        expert_ids_ptr=expert_ids,
        num_tokens_post_padded_ptr=num_tokens_post_padded,
        num_a_rows=a.shape[0],
        num_valid_tokens=num_pairs,
        E=E,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_be=qweight.stride(0),
        stride_bn=qweight.stride(1),
        stride_cm=c.stride(0),
        stride_cn=c.stride(1),
        stride_se=scales.stride(0),
        stride_sn=scales.stride(1),
        stride_sg=scales.stride(2),
        stride_ze=zp.stride(0) if has_zp else 0,
        stride_zn=zp.stride(1) if has_zp else 0,
        stride_zg=zp.stride(2) if has_zp else 0,
        N=N,
        K=K,
        EM_GRID=em_grid,
        group_size=group_size,
        NUM_GROUPS=num_groups,
        GROUPS=max(1, config.BLOCK_SIZE_K // group_size),
        top_k=top_k,
        BITS=bits,
        HAS_ZP=has_zp,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        EVEN_K=K % config.BLOCK_SIZE_K == 0,
        USE_TD=td.use_td_b,
        USE_TD_GATHER=td.use_gather,
        compute_type=_COMPUTE_TYPES[a.dtype],
        INTERPRET_BF16=_interpret_bf16(a.dtype),
        BLOCK_SIZE_M=bm,
        BLOCK_SIZE_N=bn,
        BLOCK_SIZE_K=config.BLOCK_SIZE_K,
        GROUP_SIZE_M=config.GROUP_SIZE_M,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return c


def _check_weights(name: str, qweight, scales, qzeros, bits: int, K: int) -> None:
    if qweight.dtype != torch.uint8 or qweight.dim() != 3:
        raise ValueError(f"{name}_qweight must be (E, N, K*bits/8) uint8, got {tuple(qweight.shape)} {qweight.dtype}")
    E, N, KB = qweight.shape
    if KB * 8 != K * bits:
        raise ValueError(f"{name}_qweight has {KB} bytes per row but K={K} int{bits} needs {K * bits // 8}")
    if qweight.stride(-1) != 1:
        raise ValueError(f"{name}_qweight must be contiguous along K (stride(-1)={qweight.stride(-1)})")
    if scales.dim() != 3 or tuple(scales.shape[:2]) != (E, N):
        raise ValueError(f"{name}_scales must be (E={E}, N={N}, K/group_size), got {tuple(scales.shape)}")
    if K % scales.shape[-1]:
        raise ValueError(f"{name}_scales has {scales.shape[-1]} groups, which does not divide K={K}")
    if qzeros is not None:
        want = (E, N * bits // 8, scales.shape[-1])
        if qzeros.dtype != torch.uint8 or tuple(qzeros.shape) != want:
            raise ValueError(f"{name}_qzeros must be {want} uint8, got {tuple(qzeros.shape)} {qzeros.dtype}")


def _gated_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(h[:, :I]) * h[:, I:] in float32, returned in h.dtype."""
    gate, up = h.float().chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate)
    return (act * up).to(h.dtype)


def _as_pair(configs) -> tuple[TritonMoEConfig | None, TritonMoEConfig | None]:
    if configs is None:
        return None, None
    if isinstance(configs, TritonMoEConfig):
        return configs, configs
    if isinstance(configs, (tuple, list)) and len(configs) == 2:
        return configs[0], configs[1]
    raise ValueError("configs must be a TritonMoEConfig (both GEMMs) or a (gemm1, gemm2) pair of them")


def fused_moe_wna16_triton(
    x: torch.Tensor,  # (M, H) bf16/fp16
    w13_qweight: torch.Tensor,  # (E, 2I, H*bits/8) uint8
    w2_qweight: torch.Tensor,  # (E, H, I*bits/8) uint8
    w13_scales: torch.Tensor,  # (E, 2I, H/gs1) x.dtype
    w2_scales: torch.Tensor,  # (E, H, I/gs2) x.dtype
    topk_weights: torch.Tensor,  # (M, top_k) float
    topk_ids: torch.Tensor,  # (M, top_k) int, global expert ids
    *,
    bits: int,
    w13_qzeros: torch.Tensor | None = None,  # (E, 2I*bits/8, H/gs1) uint8
    w2_qzeros: torch.Tensor | None = None,  # (E, H*bits/8, I/gs2) uint8
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,  # (E_global,) int: local id or -1
    global_num_experts: int = -1,
    use_td: bool | None = None,
    configs: TritonMoEConfig | tuple[TritonMoEConfig, TritonMoEConfig] | None = None,
    align_fn: AlignFn | None = None,
    out: torch.Tensor | None = None,  # (M, H) x.dtype
) -> torch.Tensor:
    """out[t] = sum_j w[t,j] * W2[e] @ act(W13[e] @ x[t]), e = topk_ids[t,j]; (M, H) in x.dtype.

    Same contract as reference.fused_moe_wna16_ref. Pairs routed to an expert that
    expert_map marks -1 contribute 0. use_td: None = td_gate decides (VLLM_TRITON_USE_TD,
    tuned config), True = force where it can compile (incl. the interpreter), False =
    pointers. configs: one config for both GEMMs or a (gemm1, gemm2) pair; default
    configs.get_triton_moe_config. align_fn: moe_align_block_size(topk_ids, block_size,
    num_experts, expert_map) -> (sorted_token_ids, expert_ids, num_tokens_post_padded).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported; supported: [4, 8]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; supported: {list(ACTIVATIONS)}")
    if x.dim() != 2 or x.dtype not in _COMPUTE_TYPES:
        raise ValueError(f"x must be (M, H) bfloat16 or float16, got {tuple(x.shape)} {x.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be (M={x.shape[0]}, top_k)"
        )
    M, H = x.shape
    top_k = topk_ids.shape[1]
    E, two_i, _ = w13_qweight.shape
    inter = two_i // 2
    _check_weights("w13", w13_qweight, w13_scales, w13_qzeros, bits, H)
    _check_weights("w2", w2_qweight, w2_scales, w2_qzeros, bits, inter)
    if two_i % 2 or w2_qweight.shape[:2] != (E, H):
        raise ValueError(f"w2_qweight {tuple(w2_qweight.shape)} does not match w13 (E={E}, 2I={two_i}) and H={H}")
    if w13_scales.dtype != x.dtype or w2_scales.dtype != x.dtype:
        raise ValueError(f"scales must be in x.dtype={x.dtype}, got {w13_scales.dtype} / {w2_scales.dtype}")
    if out is None:
        out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, H) or out.dtype != x.dtype:
        raise ValueError(f"out must be (M={M}, H={H}) {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if M == 0:
        return out
    if global_num_experts == -1:
        global_num_experts = expert_map.numel() if expert_map is not None else E
    align_fn = align_fn or moe_align_block_size_torch
    requested = use_td if use_td is not None else td_request_from_env()
    platform, sm = _platform_of(x.device)
    if platform == "cpu":
        raise ValueError(
            f"x is on {x.device}: the Triton kernel needs a CUDA or XPU device (or TRITON_INTERPRET=1 "
            "set before triton is imported); on CPU use reference.fused_moe_wna16_ref"
        )
    device_name = torch.cuda.get_device_name(x.device) if platform == "cuda" else None

    cfg1, cfg2 = _as_pair(configs)
    cfg1 = cfg1 or get_triton_moe_config(M, E, two_i, H, top_k, H // w13_scales.shape[-1], bits, device_name)
    cfg2 = cfg2 or get_triton_moe_config(M, E, H, inter, top_k, inter // w2_scales.shape[-1], bits, device_name)

    x = x.contiguous()
    weights_flat = topk_weights.reshape(-1).contiguous()
    num_pairs = M * top_k

    def gemm(a, qweight, scales, qzeros, c, cfg, a_rows_div, mul_weight, aligned_by):
        K = a.shape[1]
        td = decide_td(
            requested=requested,
            platform=platform,
            sm=sm,
            block_size_m=cfg.BLOCK_SIZE_M,
            block_size_k=cfg.BLOCK_SIZE_K,
            M=a.shape[0],
            K=K,
            bits=bits,
            config_use_td=cfg.use_td,
            aligned=_aligned(a, qweight),
        )
        invoke_wna16_gemm(
            a,
            qweight,
            scales,
            qzeros,
            c,
            weights_flat,
            *aligned_by[cfg.BLOCK_SIZE_M],
            bits=bits,
            top_k=a_rows_div,
            mul_routed_weight=mul_weight,
            config=cfg,
            td=td,
        )

    alignments = {}
    for bm in {cfg1.BLOCK_SIZE_M, cfg2.BLOCK_SIZE_M}:
        alignments[bm] = align_fn(topk_ids, bm, global_num_experts, expert_map)

    h = torch.empty((num_pairs, two_i), dtype=x.dtype, device=x.device)
    gemm(x, w13_qweight, w13_scales, w13_qzeros, h, cfg1, top_k, apply_router_weight_on_input, alignments)
    act = _gated_activation(h, activation)
    y = torch.empty((num_pairs, H), dtype=x.dtype, device=x.device)
    gemm(act, w2_qweight, w2_scales, w2_qzeros, y, cfg2, 1, not apply_router_weight_on_input, alignments)
    torch.sum(y.view(M, top_k, H), dim=1, out=out)
    return out
