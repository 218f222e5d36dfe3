"""The plugin's Triton fused-MoE WNA16 kernel and its launcher.

    out[t] = sum_j w[t, j] * W2[e] @ act(W13[e] @ x[t]),  e = topk_ids[t, j],

with W13/W2 int4 or int8 in the kernel layout of packing.py (uint8, packed along K,
even k in the low nibble), dequantized in-kernel as w = (q - z) * s in float32 and
accumulated in float32 (the dequant math runs in the activation dtype, bit-identical to
float32 math and one rounding; see dequant.py). Two kernels run either GEMM:

  _fused_moe_wna16_kernel       tl.dot tiles over token-aligned blocks (BLOCK_SIZE_M > 1), as
                                C = A @ B.T or, swapped (TritonMoEConfig.swap_ab), C.T = B @ A.T.
  _fused_moe_wna16_pair_kernel  decode (BLOCK_SIZE_M == 1): one routed pair per program,
                                no alignment, a GEMV without tl.dot.

Either may split K (SPLIT_K > 1: float32 partials, summed deterministically by the next
kernel: activation.py's gated activation after GEMM1, its top-k sum after GEMM2).
Both share the B-tile/dequant helpers and have two ways to load the B tile, chosen per
launch by td_gate.decide_td:

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
import triton
import triton.language as tl

from vllm_wna16_plugin.inputs import check_layer_tensors, routing_contiguous
from vllm_wna16_plugin.kernels.align import moe_align_block_size_torch
from vllm_wna16_plugin.kernels.options import DEFAULT_OPTIONS, DeviceSpec, KernelOptions
from vllm_wna16_plugin.kernels.triton.activation import _gated, gated_activation_triton, moe_sum_triton
from vllm_wna16_plugin.kernels.triton.configs import (
    TritonMoEConfig,
    act_order_form,
    dot_form,
    fuse_form,
    pair_step,
    prefill_tiles_apply,
    swap_form,
    triton_launch,
)
from vllm_wna16_plugin.kernels.triton.dequant import (
    _dequant_b_tile,
    _folded_dot_step,
    _round_to,
    _tile_dot,
    _unpack_b_tile,
    _unpack_zero_points,
    _word_nibble_dots,
)
from vllm_wna16_plugin.kernels.triton.td_gate import TDDecision, decide_td, td_request_from_env
from vllm_wna16_plugin.user_tables import configs_dir

ACTIVATIONS = ("silu", "gelu")


# The per-pair kernel's widest K tile that keeps a (BLOCK_N, BLOCK_K) accumulator; wider tiles reduce each step.
def _rows_on_words(qweight: torch.Tensor) -> bool:
    """Every packed row of B starts on a 32-bit word (the int4 word forms load B as uint32)."""
    return qweight.data_ptr() % 4 == 0 and all(x % 4 == 0 for x in qweight.stride()[:2])


PAIR_ACC_MAX_K = 256
_COMPUTE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
AlignFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@triton.jit
def _a_columns(a_perm_ptr, expert, offs_k, k0, K: tl.constexpr, EVEN_K: tl.constexpr, HAS_A_PERM: tl.constexpr):
    """The columns of A that K rows k0 + offs_k read: themselves, or under act order a_perm[expert, k]
    (a_perm is (E, K) int32, contiguous; the K tail reads column 0, masked by the caller)."""
    if HAS_A_PERM:
        perm_ptrs = a_perm_ptr + expert * K + k0 + offs_k
        if EVEN_K:
            return tl.load(perm_ptrs).to(tl.int64)
        else:
            return tl.load(perm_ptrs, mask=k0 + offs_k < K, other=0).to(tl.int64)
    else:
        return k0 + offs_k


@triton.jit
def _load_a_tile_ptr(
    a_ptr, a_rows, row_mask, offs_k, k0, K: tl.constexpr, stride_am, stride_ak, EVEN_K: tl.constexpr,
    a_perm_ptr, expert, HAS_A_PERM: tl.constexpr,
):  # fmt: skip
    """(BLOCK_M, BLOCK_K) rows of A by pointer; masked rows and the K tail read 0. Under act order
    (HAS_A_PERM) K row k reads column a_perm[expert, k] (_a_columns)."""
    cols = _a_columns(a_perm_ptr, expert, offs_k, k0, K, EVEN_K, HAS_A_PERM)
    ptrs = a_ptr + a_rows[:, None] * stride_am + cols[None, :] * stride_ak
    mask = row_mask[:, None]
    if not EVEN_K:
        mask = mask & ((k0 + offs_k)[None, :] < K)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _load_b_tile(
    b_ptr,
    b_desc,
    expert,
    offs_n,
    offs_kb,
    n0,
    k0,
    KB: tl.constexpr,
    stride_be,
    stride_bn,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TD: tl.constexpr,
    ELEM_BITS: tl.constexpr,  # 8: b_ptr / b_desc over bytes; 32: over 32-bit words (KB, BLOCK_KB, strides in words)
):
    """(BLOCK_N, BLOCK_KB) packed elements of B for K offset k0: each row one contiguous run of
    BLOCK_K*BITS/8 bytes (16-byte vectors / cp.async per thread), by pointer or through the
    3-D descriptor (whose reads past K are zero-filled)."""
    kb0 = k0 * BITS // ELEM_BITS
    if USE_TD:
        return tl.reshape(b_desc.load([expert.to(tl.int32), n0, kb0]), (BLOCK_N, BLOCK_KB))
    else:
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
def _load_k_step(
    b, b_desc, s_ptr, z_ptr, expert, offs_n, offs_b, n0, k0, stride_be, stride_bn,
    stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
    K: tl.constexpr, group_size: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS: tl.constexpr, BITS: tl.constexpr,
    HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr, USE_TD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ELEM_BITS: tl.constexpr,
):  # fmt: skip
    """One K step's packed B tile, rows offs_n and BLOCK_K values each as ELEM_BITS-bit elements (8: bytes; 32:
    words, with b, offs_b and the B strides in words), and the (BLOCK_N, GROUPS) scales and zeros of its groups."""
    packed = _load_b_tile(
        b, b_desc, expert, offs_n, offs_b, n0, k0, K * BITS // ELEM_BITS, stride_be, stride_bn,
        BITS, BLOCK_N, BLOCK_K * BITS // ELEM_BITS, EVEN_K, USE_TD, ELEM_BITS,
    )  # fmt: skip
    scale, zero = _load_group_params(
        s_ptr, z_ptr, expert, offs_n, k0 // group_size, stride_se, stride_sn, stride_sg,
        stride_ze, stride_zn, stride_zg, NUM_GROUPS, GROUPS, BLOCK_N, BITS, HAS_ZP, EVEN_K,
    )  # fmt: skip
    return packed, scale, zero


@triton.jit
def _dequant_k_step(
    b_ptr,
    b_desc,
    s_ptr,
    z_ptr,
    expert,
    offs_n,
    offs_kb,
    n0,
    k0,
    stride_be,
    stride_bn,
    stride_se,
    stride_sn,
    stride_sg,
    stride_ze,
    stride_zn,
    stride_zg,
    K: tl.constexpr,
    group_size: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TD: tl.constexpr,
    compute_type: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The dequantized (BLOCK_N, BLOCK_K) tile of B at K offset k0, in compute_type: one B
    load, one (BLOCK_N, GROUPS) scale (and zero) load for the groups it spans."""
    packed, scale, zero = _load_k_step(
        b_ptr, b_desc, s_ptr, z_ptr, expert, offs_n, offs_kb, n0, k0, stride_be, stride_bn,
        stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
        K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, BLOCK_N, BLOCK_K, 8,
    )  # fmt: skip
    q = _unpack_b_tile(packed, BITS)
    return _dequant_b_tile(q, scale, zero, BLOCK_N, BLOCK_K, GROUPS, BITS, compute_type, INTERPRET_BF16)


@triton.jit
def _fused_epilogue(gate, up, ACTIVATION: tl.constexpr, compute_type: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """GEMM1's fused activation: both halves rounded to compute_type first (where the unfused GEMM1 stores h),
    then act(gate) * up in float32 (activation._gated)."""
    gate = _round_to(gate, compute_type, INTERPRET_BF16).to(tl.float32)
    up = _round_to(up, compute_type, INTERPRET_BF16).to(tl.float32)
    return _gated(gate, up, ACTIVATION)


@triton.jit
def _store_c(c_ptrs, acc, c_mask, SPLIT_K: tl.constexpr, compute_type: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """SPLIT_K == 1: the finished tile in compute_type; else this slice's float32 partial."""
    if SPLIT_K == 1:
        tl.store(c_ptrs, _round_to(acc, compute_type, INTERPRET_BF16), mask=c_mask)
    else:
        tl.store(c_ptrs, acc, mask=c_mask)


@triton.jit
def _dot_k_step(
    acc, a, b_ptr, b_desc, b_words, s_ptr, z_ptr, expert, offs_n, offs_kb, offs_kw, n0, k0,
    stride_be, stride_bn, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
    K: tl.constexpr, group_size: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS: tl.constexpr, BITS: tl.constexpr,
    HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr, USE_TD: tl.constexpr, compute_type: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    SPLIT_NIBBLES: tl.constexpr, WORD_NIBBLES: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """acc + A_tile @ dequant(B[expert, offs_n, K step k0]).T in the launch's dot form (dot_form): B rows
    offs_n (n0 their first, for the descriptor), one K step; acc is (BLOCK_M, BLOCK_N), or swapped its transpose."""
    BLOCK_KB: tl.constexpr = BLOCK_SIZE_K * BITS // 8
    if WORD_NIBBLES:
        words, scale, zero = _load_k_step(
            b_words, b_desc, s_ptr, z_ptr, expert, offs_n, offs_kw, n0, k0, stride_be // 4, stride_bn // 4,
            stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
            K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, False, BLOCK_SIZE_N, BLOCK_SIZE_K, 32,
        )  # fmt: skip
        acc = _word_nibble_dots(acc, a, words, scale, zero, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUPS,
                                compute_type, INTERPRET_BF16, SWAP_AB)  # fmt: skip
    elif SPLIT_NIBBLES:
        # int4 without the interleave: low nibbles (even k) and high nibbles (odd k) each
        # dequantize to a (BLOCK_N, BLOCK_K / 2) tile, and meet the even and odd columns of A in
        # two dots of half the K. Both halves of a byte share its scale group.
        packed, scale, zero = _load_k_step(
            b_ptr, b_desc, s_ptr, z_ptr, expert, offs_n, offs_kb, n0, k0, stride_be, stride_bn,
            stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
            K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, BLOCK_SIZE_N, BLOCK_SIZE_K, 8,
        )  # fmt: skip
        w_even = _dequant_b_tile(packed & 0xF, scale, zero, BLOCK_SIZE_N, BLOCK_KB, GROUPS, BITS, compute_type,
                                 INTERPRET_BF16)  # fmt: skip
        w_odd = _dequant_b_tile(packed >> 4, scale, zero, BLOCK_SIZE_N, BLOCK_KB, GROUPS, BITS, compute_type,
                                INTERPRET_BF16)  # fmt: skip
        a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_SIZE_M, BLOCK_KB, 2)))
        acc = _tile_dot(acc, a_even, w_even, SWAP_AB, INTERPRET_BF16)
        acc = _tile_dot(acc, a_odd, w_odd, SWAP_AB, INTERPRET_BF16)
    else:
        w = _dequant_k_step(
            b_ptr, b_desc, s_ptr, z_ptr, expert, offs_n, offs_kb, n0, k0,
            stride_be, stride_bn, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
            K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, compute_type, INTERPRET_BF16,
            BLOCK_SIZE_N, BLOCK_SIZE_K,
        )  # fmt: skip
        acc = _tile_dot(acc, a, w, SWAP_AB, INTERPRET_BF16)
    return acc


@triton.jit
def _fused_moe_wna16_kernel(
    a_ptr,  # (num_a_rows, K) compute dtype
    b_ptr,  # (E, N, K*BITS//8) uint8
    c_ptr,  # (num_valid_tokens, N) compute dtype, or (SPLIT_K, num_valid_tokens, N) float32
    s_ptr,  # (E, N, NUM_GROUPS) compute dtype
    z_ptr,  # (E, N*BITS//8, NUM_GROUPS) uint8, unused unless HAS_ZP
    a_perm_ptr,  # (E, K) int32 act-order column order of A, read when HAS_A_PERM
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
    stride_cs,
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
    EM_GRID,  # runtime: live M-blocks bound (a constexpr would recompile per batch size)
    group_size: tl.constexpr,  # K elements per scale; channel-wise passes a power of two >= K
    NUM_GROUPS: tl.constexpr,  # cdiv(K, group_size): the scales' last dim
    GROUPS: tl.constexpr,  # scale groups per K tile: max(1, BLOCK_SIZE_K // group_size)
    top_k: tl.constexpr,  # A row of routed pair p is p // top_k (GEMM2 passes 1)
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_SIZE_K == 0 and the K tiles split evenly over SPLIT_K
    USE_TD: tl.constexpr,
    USE_TD_GATHER: tl.constexpr,
    SPLIT_K: tl.constexpr,
    compute_type: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,  # Triton-interpreter bf16 work-arounds; see _interpret_bf16()
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    SPLIT_NIBBLES: tl.constexpr,  # int4: two half-K dots instead of interleaving the nibbles (KernelOptions.dot_nibbles)
    WORD_NIBBLES: tl.constexpr,  # int4: B as 32-bit words, eight dots of K/8 (dot_nibbles "words"; pointer path)
    HAS_A_PERM: tl.constexpr,  # act order: K row k of A is column a_perm[e, k] (never with USE_TD_GATHER)
    SWAP_AB: tl.constexpr,  # accumulate C.T = dequant(B) @ A.T (dequant._tile_dot), in every dot form
    FUSE_ACT: tl.constexpr = False,  # GEMM1 with the gated activation in its epilogue: B has 2N rows, C is N wide
    ACTIVATION: tl.constexpr = "silu",  # read when FUSE_ACT
):
    """C[p, :] = (w_p if MUL_ROUTED_WEIGHT) * A[p // top_k] @ dequant(B[e_p]).T for routed pairs p; fused
    (FUSE_ACT, SPLIT_K == 1): C[p, n] = act(round(G[p, n])) * round(G[p, N + n]) for that product G, B of 2N rows,
    the gate and up tiles of one program sharing its A loads (activation._gated, rounded as the unfused path).

    Grid: (cdiv(EM_GRID, BLOCK_SIZE_M) * cdiv(N, BLOCK_SIZE_N), SPLIT_K). A block of sorted
    pairs whose expert is -1 writes zeros. Slice s of SPLIT_K covers K tiles
    [s*T, (s+1)*T), T = cdiv(cdiv(K, BLOCK_SIZE_K), SPLIT_K), and writes C[s] in float32.
    Requires group_size % BLOCK_SIZE_K == 0 or BLOCK_SIZE_K % group_size == 0
    (configs.TritonMoEConfig.check_shape).
    """
    KB: tl.constexpr = K * BITS // 8
    BLOCK_KB: tl.constexpr = BLOCK_SIZE_K * BITS // 8
    TILES_PER_SPLIT: tl.constexpr = (K + BLOCK_SIZE_K * SPLIT_K - 1) // (BLOCK_SIZE_K * SPLIT_K)

    pid = tl.program_id(axis=0)
    split = tl.program_id(axis=1)
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
    c_ptrs = c_ptr + split.to(tl.int64) * stride_cs + pairs[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    c_mask = pair_mask[:, None] & (offs_cn[None, :] < N)

    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:
        _store_c(c_ptrs, tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32), c_mask, SPLIT_K, compute_type,
                 INTERPRET_BF16)  # fmt: skip
        return

    # Columns past N wrap (pointer loads stay in bounds); the store masks them.
    offs_n = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    offs_kb = tl.arange(0, BLOCK_KB)
    a_rows = pairs // top_k  # padding pairs land on row num_a_rows: masked / out of the descriptor
    B_ROWS: tl.constexpr = 2 * N if FUSE_ACT else N
    n0 = pid_n * BLOCK_SIZE_N
    b_desc = None
    if USE_TD:
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[E, B_ROWS, KB], strides=[stride_be, stride_bn, 1], block_shape=[1, BLOCK_SIZE_N, BLOCK_KB]
        )
    if USE_TD_GATHER:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[num_a_rows, K], strides=[stride_am, 1], block_shape=[1, BLOCK_SIZE_K]
        )
        a_rows32 = a_rows.to(tl.int32)

    b_words = b_ptr.to(tl.pointer_type(tl.uint32))  # WORD_NIBBLES: rows are 4-byte aligned (the launcher checks)
    offs_kw = tl.arange(0, BLOCK_KB // 4)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    if FUSE_ACT:
        acc_up = tl.zeros_like(acc)
    for k in range(0, TILES_PER_SPLIT):
        k0 = (split * TILES_PER_SPLIT + k) * BLOCK_SIZE_K
        if USE_TD_GATHER:
            a = a_desc.gather(a_rows32, k0)
        else:
            a = _load_a_tile_ptr(a_ptr, a_rows, pair_mask, offs_k, k0, K, stride_am, stride_ak, EVEN_K,
                                 a_perm_ptr, expert, HAS_A_PERM)  # fmt: skip
        acc = _dot_k_step(
            acc, a, b_ptr, b_desc, b_words, s_ptr, z_ptr, expert, offs_n, offs_kb, offs_kw, n0, k0,
            stride_be, stride_bn, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
            K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, compute_type, INTERPRET_BF16,
            BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, SPLIT_NIBBLES, WORD_NIBBLES, SWAP_AB,
        )  # fmt: skip
        if FUSE_ACT:  # the up rows I + n of the same expert, against the same A tile
            acc_up = _dot_k_step(
                acc_up, a, b_ptr, b_desc, b_words, s_ptr, z_ptr, expert, offs_n + N, offs_kb, offs_kw, n0 + N, k0,
                stride_be, stride_bn, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
                K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, compute_type, INTERPRET_BF16,
                BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, SPLIT_NIBBLES, WORD_NIBBLES, SWAP_AB,
            )  # fmt: skip

    if SWAP_AB:
        acc = tl.trans(acc)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    if FUSE_ACT:
        if SWAP_AB:
            acc_up = tl.trans(acc_up)
        if MUL_ROUTED_WEIGHT:
            acc_up = acc_up * weight.to(tl.float32)[:, None]
        acc = _fused_epilogue(acc, acc_up, ACTIVATION, compute_type, INTERPRET_BF16)
    _store_c(c_ptrs, acc, c_mask, SPLIT_K, compute_type, INTERPRET_BF16)


@triton.jit
def _pair_k_step(
    acc, a, b_ptr, b_desc, b_words, s_ptr, z_ptr, expert, offs_n, offs_kb, offs_kw, n0, k0,
    stride_be, stride_bn, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
    K: tl.constexpr, group_size: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS: tl.constexpr, BITS: tl.constexpr,
    HAS_ZP: tl.constexpr, EVEN_K: tl.constexpr, USE_TD: tl.constexpr, compute_type: tl.constexpr,
    INTERPRET_BF16: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, FOLD_SCALES: tl.constexpr,
    REDUCE_EACH_STEP: tl.constexpr,
):  # fmt: skip
    """acc + the A row's products with dequant(B[expert, offs_n, K step k0]) (the per-pair kernel's step): a
    (BLOCK_N,) sum when REDUCE_EACH_STEP, else the (BLOCK_N, BLOCK_K) elementwise products."""
    if FOLD_SCALES:
        if BITS == 4:  # 32-bit words of 8 values (the folded step's unpack works on words)
            packed, scale, zero = _load_k_step(
                b_words, b_desc, s_ptr, z_ptr, expert, offs_n, offs_kw, n0, k0, stride_be // 4, stride_bn // 4,
                stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
                K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, BLOCK_SIZE_N, BLOCK_SIZE_K, 32,
            )  # fmt: skip
        else:
            packed, scale, zero = _load_k_step(
                b_ptr, b_desc, s_ptr, z_ptr, expert, offs_n, offs_kb, n0, k0, stride_be, stride_bn,
                stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
                K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, BLOCK_SIZE_N, BLOCK_SIZE_K, 8,
            )  # fmt: skip
        acc += _folded_dot_step(packed, a.to(tl.float32), scale, zero, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUPS, BITS)
    else:
        w = _dequant_k_step(
            b_ptr, b_desc, s_ptr, z_ptr, expert, offs_n, offs_kb, n0, k0,
            stride_be, stride_bn, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
            K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, compute_type, INTERPRET_BF16,
            BLOCK_SIZE_N, BLOCK_SIZE_K,
        )  # fmt: skip
        if REDUCE_EACH_STEP:
            acc += tl.sum(a.to(tl.float32)[None, :] * w.to(tl.float32), axis=1)
        else:
            acc += a.to(tl.float32)[None, :] * w.to(tl.float32)
    return acc


@triton.jit
def _fused_moe_wna16_pair_kernel(
    a_ptr,  # (num_a_rows, K) compute dtype
    b_ptr,  # (E, N, K*BITS//8) uint8
    c_ptr,  # (num_pairs, N) compute dtype, or (SPLIT_K, num_pairs, N) float32
    s_ptr,  # (E, N, NUM_GROUPS) compute dtype
    z_ptr,  # (E, N*BITS//8, NUM_GROUPS) uint8, unused unless HAS_ZP
    a_perm_ptr,  # (E, K) int32 act-order column order of A, read when HAS_A_PERM
    topk_weights_ptr,  # (num_pairs,) float
    topk_ids_ptr,  # (num_pairs,) int, global expert ids
    expert_map_ptr,  # (E_global,) int: local id or -1, read when HAS_EXPERT_MAP
    E,
    stride_am,
    stride_be,
    stride_bn,
    stride_cs,
    stride_cm,
    stride_se,
    stride_sn,
    stride_sg,
    stride_ze,
    stride_zn,
    stride_zg,
    N: tl.constexpr,
    K: tl.constexpr,
    group_size: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS: tl.constexpr,
    top_k: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_EXPERT_MAP: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    compute_type: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # the loop's software pipeline depth (Triton pipelines non-dot loads only when asked)
    FOLD_SCALES: tl.constexpr,  # dequant.py's _folded_dot_step; else dequantize the tile (KernelOptions.pair_step_math)
    # The tile form accumulates (BLOCK_N, BLOCK_K) float32 products elementwise and reduces along K once,
    # after the loop, up to BLOCK_SIZE_K = PAIR_ACC_MAX_K. Wider K tiles (longer contiguous runs of each
    # weight row per step) would not fit that accumulator in registers: they, and the folded form, reduce
    # every step.
    REDUCE_EACH_STEP: tl.constexpr,
    HAS_A_PERM: tl.constexpr,  # act order: K row k of A is column a_perm[e, k]
    FUSE_ACT: tl.constexpr = False,  # GEMM1 with the gated activation fused, as in _fused_moe_wna16_kernel
    ACTIVATION: tl.constexpr = "silu",
):
    """The decode form (BLOCK_SIZE_M == 1): C[p] as in _fused_moe_wna16_kernel, one routed pair p per program
    (fused activation included).

    Grid: (num_pairs, cdiv(N, BLOCK_SIZE_N), SPLIT_K). No token alignment (the expert is
    topk_ids[p], through expert_map) and no tl.dot: a GEMV that multiplies the A row into
    the dequantized tile elementwise in float32 and reduces along K once, after the loop.
    """
    KB: tl.constexpr = K * BITS // 8
    BLOCK_KB: tl.constexpr = BLOCK_SIZE_K * BITS // 8
    TILES_PER_SPLIT: tl.constexpr = (K + BLOCK_SIZE_K * SPLIT_K - 1) // (BLOCK_SIZE_K * SPLIT_K)
    pair = tl.program_id(axis=0).to(tl.int64)
    pid_n = tl.program_id(axis=1)
    split = tl.program_id(axis=2)
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + split.to(tl.int64) * stride_cs + pair * stride_cm + offs_cn
    c_mask = offs_cn < N
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    if HAS_EXPERT_MAP:  # an id of -1 (vLLM's padding row) never indexes the map
        mapped = tl.load(expert_map_ptr + tl.maximum(expert, 0)).to(tl.int64)
        expert = tl.where(expert >= 0, mapped, -1)
    if expert == -1:
        _store_c(c_ptrs, tl.zeros((BLOCK_SIZE_N,), dtype=tl.float32), c_mask, SPLIT_K, compute_type, INTERPRET_BF16)
        return

    offs_n = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    n0 = pid_n * BLOCK_SIZE_N
    B_ROWS: tl.constexpr = 2 * N if FUSE_ACT else N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    offs_kb = tl.arange(0, BLOCK_KB)
    a_row_ptr = a_ptr + (pair // top_k) * stride_am
    b_desc = None
    b_words = b_ptr.to(tl.pointer_type(tl.uint32))  # int4 B as 32-bit words (folded step; rows are 4-byte aligned)
    offs_kw = tl.arange(0, BLOCK_KB // 4)
    if USE_TD:
        if FOLD_SCALES and BITS == 4:
            b_desc = tl.make_tensor_descriptor(
                b_words, shape=[E, B_ROWS, KB // 4], strides=[stride_be // 4, stride_bn // 4, 1],
                block_shape=[1, BLOCK_SIZE_N, BLOCK_KB // 4],
            )  # fmt: skip
        else:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, shape=[E, B_ROWS, KB], strides=[stride_be, stride_bn, 1], block_shape=[1, BLOCK_SIZE_N, BLOCK_KB]
            )
    if REDUCE_EACH_STEP:
        acc = tl.zeros((BLOCK_SIZE_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_K), dtype=tl.float32)
    if FUSE_ACT:
        acc_up = tl.zeros_like(acc)
    for k in tl.range(0, TILES_PER_SPLIT, num_stages=NUM_STAGES):  # B by cp.async, NUM_STAGES deep
        k0 = (split * TILES_PER_SPLIT + k) * BLOCK_SIZE_K
        if HAS_A_PERM:
            cols = _a_columns(a_perm_ptr, expert, offs_k, k0, K, EVEN_K, HAS_A_PERM)
            if EVEN_K:
                a = tl.load(a_row_ptr + cols)
            else:
                a = tl.load(a_row_ptr + cols, mask=k0 + offs_k < K, other=0.0)
        elif EVEN_K:
            a = tl.load(a_row_ptr + k0 + offs_k)
        else:
            a = tl.load(a_row_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0)
        acc = _pair_k_step(
            acc, a, b_ptr, b_desc, b_words, s_ptr, z_ptr, expert, offs_n, offs_kb, offs_kw, n0, k0,
            stride_be, stride_bn, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
            K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, compute_type, INTERPRET_BF16,
            BLOCK_SIZE_N, BLOCK_SIZE_K, FOLD_SCALES, REDUCE_EACH_STEP,
        )  # fmt: skip
        if FUSE_ACT:  # the up rows I + n, against the same A row
            acc_up = _pair_k_step(
                acc_up, a, b_ptr, b_desc, b_words, s_ptr, z_ptr, expert, offs_n + N, offs_kb, offs_kw, n0 + N, k0,
                stride_be, stride_bn, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg,
                K, group_size, NUM_GROUPS, GROUPS, BITS, HAS_ZP, EVEN_K, USE_TD, compute_type, INTERPRET_BF16,
                BLOCK_SIZE_N, BLOCK_SIZE_K, FOLD_SCALES, REDUCE_EACH_STEP,
            )  # fmt: skip
    if REDUCE_EACH_STEP:
        out = acc
    else:
        out = tl.sum(acc, axis=1)
    if MUL_ROUTED_WEIGHT:
        out = out * tl.load(topk_weights_ptr + pair).to(tl.float32)
    if FUSE_ACT:
        if REDUCE_EACH_STEP:
            up = acc_up
        else:
            up = tl.sum(acc_up, axis=1)
        if MUL_ROUTED_WEIGHT:
            up = up * tl.load(topk_weights_ptr + pair).to(tl.float32)
        out = _fused_epilogue(out, up, ACTIVATION, compute_type, INTERPRET_BF16)
    _store_c(c_ptrs, out, c_mask, SPLIT_K, compute_type, INTERPRET_BF16)


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


def device_spec(device: torch.device) -> DeviceSpec:
    """The launch's device for td_gate.decide_td and the tuned-config lookup: the "interpreter" platform
    when the kernels were defined under TRITON_INTERPRET=1, else DeviceSpec.of (read once per device)."""
    return DeviceSpec("interpreter") if _is_interpreter() else DeviceSpec.of(device)


def _aligned(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _kernel_group_size(K: int, num_groups: int, block_size_k: int) -> int:
    """The kernel's group_size constexpr: the real group, or for channel-wise a power of
    two >= max(K, BLOCK_SIZE_K) so that every k maps to group 0 under any BLOCK_SIZE_K."""
    if num_groups == 1:
        return max(block_size_k, triton.next_power_of_2(K))
    return K // num_groups


def _even_k(K: int, config: TritonMoEConfig) -> bool:
    """No K tail: K % BLOCK_SIZE_K == 0 and the K tiles split evenly over SPLIT_K."""
    tiles, rem = divmod(K, config.BLOCK_SIZE_K)
    return rem == 0 and tiles % config.SPLIT_K == 0


def _register_cap(config: TritonMoEConfig, a: torch.Tensor) -> dict:
    """The launch option for a tuned register cap: ptxas's .maxnreg exists on NVIDIA only (and the
    interpreter ignores it), so elsewhere the config runs uncapped."""
    if config.maxnreg is None or torch.version.hip is not None or a.device.type not in ("cuda", "cpu"):
        return {}
    return {"maxnreg": config.maxnreg}


def split_k_buffer_shape(num_pairs: int, N: int, config: TritonMoEConfig) -> tuple[int, ...]:
    """The shape of a GEMM's output c: (num_pairs, N), or (SPLIT_K, num_pairs, N) float32 partials."""
    return (num_pairs, N) if config.SPLIT_K == 1 else (config.SPLIT_K, num_pairs, N)


def invoke_wna16_gemm(
    a: torch.Tensor,  # (num_a_rows, K) bf16/fp16, K-contiguous
    qweight: torch.Tensor,  # (E, N, K*bits/8) uint8
    scales: torch.Tensor,  # (E, N, G)
    qzeros: torch.Tensor | None,  # (E, N*bits/8, G) uint8
    c: torch.Tensor,  # (num_pairs, N) a.dtype, or (SPLIT_K, num_pairs, N) float32 when config.SPLIT_K > 1
    topk_weights: torch.Tensor | None,  # (num_pairs,) float, read when mul_routed_weight
    sorted_token_ids: torch.Tensor | None,  # the alignment; unused (None) when config.BLOCK_SIZE_M == 1
    expert_ids: torch.Tensor | None,
    num_tokens_post_padded: torch.Tensor | None,
    *,
    bits: int,
    top_k: int,  # A row of pair p is p // top_k
    mul_routed_weight: bool,
    config: TritonMoEConfig,
    td: TDDecision,
    topk_ids: torch.Tensor | None = None,  # (num_pairs,) int global ids: the routing when BLOCK_SIZE_M == 1
    expert_map: torch.Tensor | None = None,  # (E_global,) int, applied to topk_ids when BLOCK_SIZE_M == 1
    a_perm: torch.Tensor | None = None,  # (E, K) int32 contiguous: act order, K row k of A is a[:, a_perm[e, k]]
    options: KernelOptions = DEFAULT_OPTIONS,  # dot_nibbles, pair_step_math
    activation: str | None = None,  # GEMM1 fused: c[p] = act(g[:N/2]) * g[N/2:] of that product g (fuse_form)
) -> torch.Tensor:
    """One grouped GEMM: c[p] = (w_p) * a[p // top_k] @ dequant(qweight[e_p]).T over the routed pairs; with
    `activation` (GEMM1 only, SPLIT_K == 1), the gated activation of that row instead, c of N/2 columns.

    Every row of c named by sorted_token_ids (or every pair, per-pair form) is written
    (zeros for expert -1); with SPLIT_K > 1, c[s] holds K slice s in float32. `td` is
    taken as given (callers get it from td_gate.decide_td; the per-pair form never
    gathers A, nor does an A read through a_perm); `config` must pass check_shape for this K.
    """
    E, N, _ = qweight.shape
    K = a.shape[1]
    num_groups = scales.shape[-1]
    config = swap_form(config, options)
    if activation is not None:
        if activation not in ACTIVATIONS or N % 2 or config.SPLIT_K != 1:
            raise ValueError(
                f"a fused activation needs one of {list(ACTIVATIONS)} (got {activation!r}), an even N=2I (got {N}) "
                f"and SPLIT_K=1 (got {config.SPLIT_K})"
            )
        N //= 2  # the output's columns; the kernel reads rows n and N + n
    config.check_shape(K, K // num_groups)
    group_size = _kernel_group_size(K, num_groups, config.BLOCK_SIZE_K)
    if td.use_td_b or td.use_gather:
        _ensure_td_allocator()
    split = config.SPLIT_K
    num_pairs = c.shape[-2]
    if c.shape[-1] != N:
        raise ValueError(f"c has {c.shape[-1]} columns, the GEMM writes N={N}" + (" (fused: I)" if activation else ""))
    if split > 1 and (c.dim() != 3 or c.shape[0] != split or c.dtype != torch.float32):
        raise ValueError(f"SPLIT_K={split} needs c of shape (SPLIT_K, num_pairs, N) float32, got {tuple(c.shape)}")
    c3 = c if c.dim() == 3 else c.unsqueeze(0)
    if a_perm is not None:
        if tuple(a_perm.shape) != (E, K) or a_perm.dtype != torch.int32 or not a_perm.is_contiguous():
            raise ValueError(
                f"a_perm must be a contiguous (E={E}, K={K}) int32 tensor, got {tuple(a_perm.shape)} {a_perm.dtype}"
            )
        if td.use_gather:
            raise ValueError("a_perm (act order) reads A by pointer: td.use_gather must be False")
    has_zp = qzeros is not None
    zp = qzeros if has_zp else qweight  # any uint8 tensor: never read when HAS_ZP is False
    common = dict(
        a_ptr=a,
        b_ptr=qweight,
        c_ptr=c3,
        s_ptr=scales,
        z_ptr=zp,
        a_perm_ptr=a_perm if a_perm is not None else scales,  # never read when HAS_A_PERM is False
        HAS_A_PERM=a_perm is not None,
        topk_weights_ptr=topk_weights if topk_weights is not None else scales,
        E=E,
        stride_am=a.stride(0),
        stride_be=qweight.stride(0),
        stride_bn=qweight.stride(1),
        stride_cs=c3.stride(0),
        stride_cm=c3.stride(1),
        stride_se=scales.stride(0),
        stride_sn=scales.stride(1),
        stride_sg=scales.stride(2),
        stride_ze=zp.stride(0) if has_zp else 0,
        stride_zn=zp.stride(1) if has_zp else 0,
        stride_zg=zp.stride(2) if has_zp else 0,
        N=N,
        K=K,
        FUSE_ACT=activation is not None,
        ACTIVATION=activation or "silu",
        group_size=group_size,
        NUM_GROUPS=num_groups,
        GROUPS=max(1, config.BLOCK_SIZE_K // group_size),
        top_k=top_k,
        BITS=bits,
        HAS_ZP=has_zp,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        EVEN_K=_even_k(K, config),
        USE_TD=td.use_td_b,
        SPLIT_K=split,
        compute_type=_COMPUTE_TYPES[a.dtype],
        INTERPRET_BF16=_interpret_bf16(a.dtype),
        BLOCK_SIZE_N=config.BLOCK_SIZE_N,
        BLOCK_SIZE_K=config.BLOCK_SIZE_K,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **_register_cap(config, a),
    )
    if config.per_pair:
        if topk_ids is None or c3.stride(2) != 1:
            raise ValueError("BLOCK_SIZE_M=1 (per pair) needs topk_ids and a row-contiguous c")
        grid = (num_pairs, triton.cdiv(N, config.BLOCK_SIZE_N), split)
        fold = pair_step(bits, _rows_on_words(qweight), options.pair_step_math) == "fold"
        _fused_moe_wna16_pair_kernel[grid](
            topk_ids_ptr=topk_ids,
            expert_map_ptr=expert_map if expert_map is not None else topk_ids,
            HAS_EXPERT_MAP=expert_map is not None,
            NUM_STAGES=config.num_stages,
            FOLD_SCALES=fold,
            REDUCE_EACH_STEP=fold or config.BLOCK_SIZE_K > PAIR_ACC_MAX_K,
            **common,
        )
        return c
    bm, bn = config.BLOCK_SIZE_M, config.BLOCK_SIZE_N
    # At most num_pairs non-empty M-blocks exist, so blocks past num_pairs * BLOCK_SIZE_M are never live.
    em_grid = min(sorted_token_ids.numel(), num_pairs * bm)
    grid = (triton.cdiv(em_grid, bm) * triton.cdiv(N, bn), split)
    form = dot_form(bits, config, K, _rows_on_words(qweight), td.use_td_b, options.dot_nibbles)
    _fused_moe_wna16_kernel[grid](
        sorted_token_ids_ptr=sorted_token_ids,
        expert_ids_ptr=expert_ids,
        num_tokens_post_padded_ptr=num_tokens_post_padded,
        num_a_rows=a.shape[0],
        num_valid_tokens=num_pairs,
        stride_ak=a.stride(1),
        stride_cn=c3.stride(2),
        EM_GRID=em_grid,
        SPLIT_NIBBLES=form == "split",
        WORD_NIBBLES=form == "words",
        SWAP_AB=config.swap_ab,
        USE_TD_GATHER=td.use_gather,
        BLOCK_SIZE_M=bm,
        GROUP_SIZE_M=config.GROUP_SIZE_M,
        **common,
    )
    return c


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
    a_perm: torch.Tensor | None = None,  # (E, H) int32: act order (backends.base.sort_act_order)
    options: KernelOptions = DEFAULT_OPTIONS,
) -> torch.Tensor:
    """out[t] = sum_j w[t,j] * W2[e] @ act(W13[e] @ x[t]), e = topk_ids[t,j]; (M, H) in x.dtype.

    Same contract as reference.fused_moe_wna16_ref. Pairs routed to an expert that
    expert_map marks -1 contribute 0. use_td: None = td_gate decides (VLLM_TRITON_USE_TD,
    tuned config), True = force where it can compile (incl. the interpreter), False =
    pointers (default: options.use_td). configs: one config for both GEMMs or a (gemm1, gemm2) pair; default
    configs.triton_launch (tuned entries of options.config_dir or the shipped ones, else the heuristic).
    options: the kernels' forms (KernelOptions.dot_nibbles, pair_step_math). align_fn: moe_align_block_size(topk_ids, block_size,
    num_experts, expert_map) -> (sorted_token_ids, expert_ids, num_tokens_post_padded).

    GPU work per call, no host sync (CUDA-graph capturable): one align launch per distinct
    BLOCK_SIZE_M > 1 (none when both GEMMs run per pair), GEMM1, the gated activation
    (which also sums GEMM1's split-K partials; none when GEMM1 fuses it: configs.fuse_form), GEMM2, and the top-k sum (which sums
    GEMM2's partials; skipped when top_k == 1 and GEMM2 is unsplit: GEMM2 writes `out`).

    a_perm: act order in the sorted layout (backends.base.sort_act_order): GEMM1 reads x's column
    a_perm[e, k] as K row k of expert e; the weights are already sorted (GEMM2's K order included).
    """
    shape = check_layer_tensors(
        x, w13_qweight, w2_qweight, w13_scales, w2_scales, topk_weights, topk_ids, bits=bits,
        group_size=None, w13_qzeros=w13_qzeros, w2_qzeros=w2_qzeros, expert_map=expert_map,
    )  # fmt: skip
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; supported: {list(ACTIVATIONS)}")
    if x.dtype not in _COMPUTE_TYPES:
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    for name, t in (("w13_qweight", w13_qweight), ("w2_qweight", w2_qweight)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along K (stride(-1)={t.stride(-1)})")
    M, H = x.shape
    top_k, E, two_i, inter = shape.top_k, shape.num_experts, 2 * shape.intermediate, shape.intermediate
    if w13_scales.dtype != x.dtype or w2_scales.dtype != x.dtype:
        raise ValueError(f"scales must be in x.dtype={x.dtype}, got {w13_scales.dtype} / {w2_scales.dtype}")
    if out is None:
        out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, H) or out.dtype != x.dtype:
        raise ValueError(f"out must be (M={M}, H={H}) {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if a_perm is not None:
        if tuple(a_perm.shape) != (E, H) or a_perm.dtype != torch.int32 or a_perm.device != x.device:
            raise ValueError(
                f"a_perm must be (E={E}, H={H}) int32 on {x.device}, got {tuple(a_perm.shape)} {a_perm.dtype} "
                f"on {a_perm.device}"
            )
        a_perm = a_perm.contiguous()
    if M == 0:
        return out
    if global_num_experts == -1:
        global_num_experts = expert_map.numel() if expert_map is not None else E
    align_fn = align_fn or moe_align_block_size_torch
    if use_td is None:
        use_td = options.use_td
    requested = use_td if use_td is not None else td_request_from_env()
    device = device_spec(x.device)
    platform, sm = device.platform, device.sm
    if platform == "cpu":
        raise ValueError(
            f"x is on {x.device}: the Triton kernel needs a CUDA or XPU device (or TRITON_INTERPRET=1 "
            "set before triton is imported); on CPU use reference.fused_moe_wna16_ref"
        )

    cfg1, cfg2 = _as_pair(configs)
    if cfg1 is None or cfg2 is None:
        chosen = triton_launch(M, E, H, inter, top_k, H // w13_scales.shape[-1], inter // w2_scales.shape[-1],
                               bits, device.name, options.config_dir, configs_dir(device),
                               prefill_tiles_apply(platform, sm)).configs  # fmt: skip
        cfg1, cfg2 = cfg1 or chosen[0], cfg2 or chosen[1]
    cfg1 = fuse_form(cfg1, options)  # GEMM2 never fuses: its fuse_act is not read
    fused = activation if cfg1.fuse_act else None

    x, topk_weights, topk_ids, expert_map = routing_contiguous(x, topk_weights, topk_ids, expert_map)
    weights_flat = topk_weights.view(-1)  # the kernels index pairs as ptr + pair: contiguous only
    ids_flat = topk_ids.view(-1)
    num_pairs = M * top_k

    def gemm(a, qweight, scales, qzeros, c, cfg, a_rows_div, mul_weight, aligned_by, perm=None, act=None):
        td = decide_td(
            requested=requested,
            platform=platform,
            sm=sm,
            block_size_m=cfg.BLOCK_SIZE_M,
            block_size_k=cfg.BLOCK_SIZE_K,
            M=a.shape[0],
            K=a.shape[1],
            bits=bits,
            config_use_td=cfg.use_td,
            aligned=_aligned(a, qweight),
            a_permuted=perm is not None,
        )
        invoke_wna16_gemm(
            a,
            qweight,
            scales,
            qzeros,
            c,
            weights_flat,
            *aligned_by.get(cfg.BLOCK_SIZE_M, (None, None, None)),
            bits=bits,
            top_k=a_rows_div,
            mul_routed_weight=mul_weight,
            config=cfg,
            td=td,
            topk_ids=ids_flat,
            expert_map=expert_map,
            a_perm=perm,
            options=options,
            activation=act,
        )
        return c

    alignments = {}
    for bm in {cfg1.BLOCK_SIZE_M, cfg2.BLOCK_SIZE_M} - {1}:
        alignments[bm] = align_fn(topk_ids, bm, global_num_experts, expert_map)

    def gemm_out(N, cfg):
        dtype = x.dtype if cfg.SPLIT_K == 1 else torch.float32
        return torch.empty(split_k_buffer_shape(num_pairs, N, cfg), dtype=dtype, device=x.device)

    n1 = inter if fused else two_i  # GEMM1's output: the activation itself when fused
    if a_perm is not None and act_order_form(x.shape[0], options.triton_act_order) == "rows":
        # act order, one gather of the routed pairs' rows first: GEMM1 reads row p for pair p, no perm
        from vllm_wna16_plugin.kernels.triton.act_order import act_order_rows_triton

        a1 = act_order_rows_triton(x, a_perm, topk_ids, expert_map)
        h = gemm(a1, w13_qweight, w13_scales, w13_qzeros, gemm_out(n1, cfg1), cfg1, 1,
                 apply_router_weight_on_input, alignments, act=fused)  # fmt: skip
    else:
        h = gemm(x, w13_qweight, w13_scales, w13_qzeros, gemm_out(n1, cfg1), cfg1, top_k,
                 apply_router_weight_on_input, alignments, a_perm, act=fused)  # fmt: skip
    act = h if fused else gated_activation_triton(h, activation, dtype=x.dtype)
    if top_k == 1 and cfg2.SPLIT_K == 1 and out.stride(1) == 1:
        # one pair per token: GEMM2's rows are the output rows
        gemm(act, w2_qweight, w2_scales, w2_qzeros, out, cfg2, 1, not apply_router_weight_on_input, alignments)
        return out
    y = gemm(act, w2_qweight, w2_scales, w2_qzeros, gemm_out(H, cfg2), cfg2, 1,
             not apply_router_weight_on_input, alignments)  # fmt: skip
    return moe_sum_triton(y, out, top_k)
