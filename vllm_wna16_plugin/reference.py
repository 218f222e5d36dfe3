"""The float32 truth for every backend: dequantize, per-expert matmul, activation, weighted sum.

Independent of `kernels/`: it unpacks with `packing.py` (plain torch bit
operations) and loops over experts. It mirrors the kernels' observable rounding
points (the GEMM1 output and the activation are rounded to the activation dtype,
as vLLM's intermediate caches are) and nothing else. Runs on CPU and GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_wna16_plugin.packing import KernelWeights, dequantize, from_kernel_layout

ACTIVATIONS = ("silu", "gelu")


def gated_activation_ref(h: torch.Tensor, activation: str) -> torch.Tensor:
    """act(h[..., :I]) * h[..., I:] in float32 (vLLM's SiluAndMul / GeluAndMul)."""
    gate, up = h.float().chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"activation={activation!r} is not supported; supported: {list(ACTIVATIONS)}")


def fused_moe_ref(
    x: torch.Tensor,  # (M, H) bf16/fp16/fp32
    w13: torch.Tensor,  # (E_local, 2I, H) float: gate rows then up rows
    w2: torch.Tensor,  # (E_local, H, I) float
    topk_weights: torch.Tensor,  # (M, top_k) float
    topk_ids: torch.Tensor,  # (M, top_k) int, global expert ids
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,  # (E_global,) int: local id or -1
    capture_safe: bool | None = None,
) -> torch.Tensor:
    """out[t] = sum_j w[t,j] * W2[e] @ act(W13[e] @ x[t]), e = topk_ids[t,j]; (M, H) in x.dtype.

    Tokens routed to an expert that `expert_map` marks -1 (not on this rank), and pairs of id -1 (vLLM
    0.34's padding rows), contribute nothing. With apply_router_weight_on_input the weight scales x
    before GEMM1 instead of the GEMM2 output.

    Eager, it visits the experts the tokens picked (torch.unique: a host sync). While a CUDA graph
    is being captured (capture_safe None: detected; vLLM captures decode steps of
    `--moe-backend emulation` too), it runs every local expert on every token and masks: the
    same arithmetic per (token, expert), with no data-dependent shapes.
    """
    dtype = x.dtype
    m, _ = x.shape
    out = torch.zeros(m, w2.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    if expert_map is not None:
        local = expert_map.to(ids.device).long()[ids.clamp(min=0)]
        ids = torch.where(ids >= 0, local, -1)  # an id of -1 (vLLM's padding row) names no expert
    if capture_safe is None:
        capture_safe = x.is_cuda and torch.cuda.is_current_stream_capturing()

    def add_expert(e: int, tok, weight: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        a = x[tok].float()
        if apply_router_weight_on_input:
            a = (a * weight).to(dtype).float()
        h = (a @ w13[e].float().T).to(dtype)
        act = gated_activation_ref(h, activation).to(dtype)
        y = act.float() @ w2[e].float().T
        if not apply_router_weight_on_input:
            y = y * weight
        y = y.to(dtype).float()
        if keep is None:
            out.index_add_(0, tok, y)
        else:
            out.add_(torch.where(keep, y, 0.0))

    if capture_safe:
        everyone = torch.arange(m, device=x.device)
        for e in range(w13.shape[0]):
            picked = ids == e  # (M, top_k); a token picks an expert at most once
            add_expert(e, everyone, (topk_weights.float() * picked).sum(-1, keepdim=True), picked.any(-1, keepdim=True))
        return out.to(dtype)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        add_expert(e, tok, topk_weights[tok, slot].float().unsqueeze(-1))
    return out.to(dtype)


def dequantize_ref(
    qweight: torch.Tensor,  # (E, N, K*bits/8) uint8
    scales: torch.Tensor,  # (E, N, G)
    qzeros: torch.Tensor | None,  # (E, N*bits/8, G) uint8
    bits: int,
    g_idx: torch.Tensor | None = None,  # (E, K) or (E, S, K) int: group of each K row (act order)
) -> torch.Tensor:
    """float32 (E, N, K) weights from the kernel layout (see packing.py).

    Without g_idx, K row k belongs to group k // group_size; with it (GPTQ act
    order), to group g_idx[e, k]. A (E, S, K) g_idx gives each of S equal row
    blocks its own order (w13: gate rows, then up rows).
    """
    qw = from_kernel_layout(KernelWeights(qweight, scales, qzeros), bits)
    if g_idx is None:
        return dequantize(qw)
    n = qw.q.shape[1]
    if g_idx.dim() == 2:
        g_idx = g_idx.unsqueeze(1)
    idx = g_idx.long().repeat_interleave(n // g_idx.shape[1], dim=1)  # (E, N, K)
    s = torch.gather(qw.scales.float(), -1, idx)
    z = torch.gather(qw.zeros_or_midpoint().float(), -1, idx)
    return (qw.q.float() - z) * s


def fused_moe_wna16_ref(
    x: torch.Tensor,
    w13_qweight: torch.Tensor,  # (E, 2I, H*bits/8) uint8
    w2_qweight: torch.Tensor,  # (E, H, I*bits/8) uint8
    w13_scales: torch.Tensor,  # (E, 2I, H/gs)
    w2_scales: torch.Tensor,  # (E, H, I/gs)
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    bits: int,
    w13_qzeros: torch.Tensor | None = None,  # (E, 2I*bits/8, H/gs) uint8
    w2_qzeros: torch.Tensor | None = None,  # (E, H*bits/8, I/gs) uint8
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map: torch.Tensor | None = None,
    w13_g_idx: torch.Tensor | None = None,  # (E, 2, H) act order (gate, up)
    w2_g_idx: torch.Tensor | None = None,  # (E, I)
) -> torch.Tensor:
    """`fused_moe_ref` on weights dequantized from the kernel layout."""
    w13 = dequantize_ref(w13_qweight, w13_scales, w13_qzeros, bits, w13_g_idx)
    w2 = dequantize_ref(w2_qweight, w2_scales, w2_qzeros, bits, w2_g_idx)
    return fused_moe_ref(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map,
    )
