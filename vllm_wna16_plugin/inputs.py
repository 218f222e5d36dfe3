"""The one check of a fused-MoE call's tensors, shared by every backend and every M.

With b = bits, E local experts, G1 = H / group_size_w13 and G2 = I / group_size_w2 scale groups:

    x            (M, H)              float16 / bfloat16 / float32
    w13_qweight  (E, 2I, H*b/8)      uint8      w2_qweight  (E, H, I*b/8)   uint8
    w13_scales   (E, 2I, G1)         float      w2_scales   (E, H, G2)      float
    w13_qzeros   (E, 2I*b/8, G1)     uint8      w2_qzeros   (E, H*b/8, G2)  uint8   (both or neither)
    topk_weights (M, top_k)          float      topk_ids    (M, top_k)      int32 / int64
    expert_map   (global_experts,)   int32 / int64, entries in [-1, E)
    topk_ids     entries in [0, global_experts), global_experts = len(expert_map) or E

`check_layer_tensors` reads only metadata (shapes, dtypes, devices, strides): no host sync, so the
kernel launchers may call it too. `check_routing_values` reads the ids on the host (one sync): the
functional API (`ops.fused_moe_wna16`) calls it on every call, at every M; the layer inside
`vllm serve` does not, since vLLM's router produced the ids (validated once, at load, instead).

Contiguity, decided by cost: x and the routing tensors are O(M) and are made contiguous
(`routing_contiguous`, free when they already are); in the functional API a weight tensor that is not
contiguous is refused (`check_weights_contiguous`), because copying it would silently cost a pass over
the layer's weights on every call. The Triton launcher reads weights through their strides (K
contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_wna16_plugin.scheme import CHANNELWISE, SUPPORTED_BITS

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class LayerShape:
    """The sizes a checked call implies."""

    num_experts: int  # E, local
    hidden: int  # H
    intermediate: int  # I
    top_k: int
    group_size_w13: int  # K elements per scale group of GEMM1 (H when channel-wise)
    group_size_w2: int  # of GEMM2 (I when channel-wise)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {what}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; it must be {names} ({what})")
    if _shape(t) != shape:
        raise ValueError(f"{name} has shape {_shape(t)}; it must be {shape} ({what})")


def _group_size(name: str, size_k: int, groups: int, group_size: int | None) -> int:
    """K elements per group implied by `groups` scale columns over K=size_k, checked against group_size
    (None: any group count that divides K, for launchers that read the group size off the scales).

    A group size larger than K means one group over the whole of K (a TP rank's slice of I can be
    smaller than the checkpoint's group size); otherwise the scales must have exactly K / group_size
    groups."""
    if group_size is None:
        if groups < 1 or size_k % groups:
            raise ValueError(f"{name} has {groups} scale groups, which do not divide K={size_k}")
        return size_k // groups
    if group_size == CHANNELWISE or group_size >= size_k:
        if groups != 1:
            why = "channel-wise (group_size=-1)" if group_size == CHANNELWISE else f"group_size={group_size} >= K"
            raise ValueError(f"{name} has {groups} scale groups along K={size_k}; {why} needs exactly 1")
        return size_k
    if size_k % group_size:
        raise ValueError(f"group_size={group_size} does not divide {name}'s K={size_k}")
    if groups != size_k // group_size:
        raise ValueError(
            f"{name} has {groups} scale groups along K={size_k}; group_size={group_size} needs {size_k // group_size}"
        )
    return group_size


def check_layer_tensors(
    x, w13_qweight, w2_qweight, w13_scales, w2_scales, topk_weights, topk_ids, *, bits, group_size,
    w13_qzeros=None, w2_qzeros=None, expert_map=None,
) -> LayerShape:  # fmt: skip
    """Every shape, dtype and device of a call (module docstring); ValueError naming the argument.

    group_size: one for both GEMMs (-1: channel-wise), a (GEMM1, GEMM2) pair where a TP split regrouped
    GEMM2's K (checkpoint_config.effective_group_size), or None: whatever the scales imply."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise ValueError(f"bits={bits!r} must be an int, not {type(bits).__name__}; supported: {list(SUPPORTED_BITS)}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; supported: {list(SUPPORTED_BITS)}")
    pair = group_size if isinstance(group_size, tuple) and len(group_size) == 2 else (group_size, group_size)
    for gs in pair:
        if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int)):
            raise ValueError(
                f"group_size={group_size!r} must be an int, not {type(gs).__name__} "
                "(a positive group size, or -1 for channel-wise; or a (GEMM1, GEMM2) pair of them)"
            )
        if gs is not None and gs != CHANNELWISE and gs <= 0:
            raise ValueError(
                f"group_size={group_size!r} is not supported; use a positive group size or -1 (channel-wise)"
            )
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a (M, H) tensor, got {_shape(x) if isinstance(x, torch.Tensor) else type(x)}")
    m, hidden = _shape(x)
    _expect("x", x, (m, hidden), ACT_DTYPES, "(M, H) activations")
    if hidden == 0:
        raise ValueError("x has H=0 columns: the hidden size must be positive")
    if not isinstance(w13_qweight, torch.Tensor) or w13_qweight.dim() != 3:
        raise ValueError("w13_qweight must be a (E, 2I, H*bits/8) uint8 tensor")
    e, two_i, _ = _shape(w13_qweight)
    if e == 0:
        raise ValueError("w13_qweight holds 0 experts: a rank needs at least one local expert (E >= 1)")
    if two_i % 2:
        raise ValueError(f"w13_qweight has {two_i} rows; it must have 2I (gate rows, then up rows): an even number")
    inter = two_i // 2
    if inter == 0:
        raise ValueError("w13_qweight has 0 rows: the intermediate size I must be positive")
    if isinstance(w2_qweight, torch.Tensor) and w2_qweight.dim() == 3 and w2_qweight.shape[1] != hidden:
        # w2's rows are the layer's H whatever the bits: x, not the packing, disagrees with the weights
        raise ValueError(
            f"x has H={hidden} columns, but w2_qweight's {w2_qweight.shape[1]} rows (E, H, I*bits/8) say the "
            f"layer's hidden size is {w2_qweight.shape[1]}: pass x with the layer's hidden size"
        )
    if hidden * bits % 8 or inter * bits % 8:
        raise ValueError(f"H={hidden} and I={inter} int{bits} values must fill whole bytes")
    if w13_qweight.dtype != torch.uint8:  # before its bytes per row: an int32-packed tensor has 1/4 of the columns
        raise ValueError(
            f"w13_qweight has dtype {str(w13_qweight.dtype).removeprefix('torch.')}; it must be uint8 (E, 2I, "
            "H*bits/8): bytes of packed values, the kernel layout (a GPTQ / AWQ int32 qweight is another layout: "
            "packing.unpack_gptq / unpack_awq, then packing.to_kernel_layout)"
        )
    if w13_qweight.shape[-1] * 8 != hidden * bits:
        stored = w13_qweight.shape[-1] * 8 / hidden
        hint = f" (it holds int{int(stored)} values: bits={int(stored)}?)" if stored in SUPPORTED_BITS else ""
        raise ValueError(
            f"w13_qweight has {w13_qweight.shape[-1]} bytes per row but x's H={hidden} int{bits} values "
            f"need {hidden * bits // 8}{hint}"
        )
    _expect(
        "w13_qweight", w13_qweight, (e, two_i, hidden * bits // 8), (torch.uint8,), f"(E, 2I, H*bits/8), H={hidden}"
    )
    _expect("w2_qweight", w2_qweight, (e, hidden, inter * bits // 8), (torch.uint8,), f"(E, H, I*bits/8), I={inter}")
    for name, t, n in (("w13_scales", w13_scales, two_i), ("w2_scales", w2_scales, hidden)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a (E={e}, N={n}, groups) float tensor")
    g13 = _group_size("w13_scales", hidden, w13_scales.shape[-1], pair[0])
    g2 = _group_size("w2_scales", inter, w2_scales.shape[-1], pair[1])
    floats = (torch.float16, torch.bfloat16, torch.float32)
    # the kernels read scales in the activations' dtype (every backend gets the same rule)
    _expect("w13_scales", w13_scales, (e, two_i, hidden // g13), (x.dtype,), "(E, 2I, H/group_size) in x's dtype")
    _expect("w2_scales", w2_scales, (e, hidden, inter // g2), (x.dtype,), "(E, H, I/group_size) in x's dtype")
    if (w13_qzeros is None) != (w2_qzeros is None):
        given = "w13_qzeros" if w2_qzeros is None else "w2_qzeros"
        raise ValueError(f"only {given} was given: pass zero points for both GEMMs (asymmetric) or neither")
    if w13_qzeros is not None:
        _expect("w13_qzeros", w13_qzeros, (e, two_i * bits // 8, hidden // g13), (torch.uint8,), "(E, 2I*bits/8, G1)")
        _expect("w2_qzeros", w2_qzeros, (e, hidden * bits // 8, inter // g2), (torch.uint8,), "(E, H*bits/8, G2)")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a (M={m}, top_k) int tensor")
    top_k = topk_ids.shape[1]
    _expect("topk_ids", topk_ids, (m, top_k), ID_DTYPES, f"(M, top_k), M={m}")
    _expect("topk_weights", topk_weights, (m, top_k), floats, f"(M, top_k) like topk_ids, M={m}")
    if top_k < 1:
        raise ValueError("topk_ids has top_k=0 columns; every token needs at least one expert")
    if expert_map is not None:
        if not isinstance(expert_map, torch.Tensor) or expert_map.dim() != 1:
            raise ValueError("expert_map must be a 1-D int tensor: one entry per global expert (local id or -1)")
        _expect("expert_map", expert_map, (expert_map.numel(),), ID_DTYPES, "one entry per global expert")
    tensors = {
        "w13_qweight": w13_qweight, "w2_qweight": w2_qweight, "w13_scales": w13_scales, "w2_scales": w2_scales,
        "w13_qzeros": w13_qzeros, "w2_qzeros": w2_qzeros, "topk_weights": topk_weights, "topk_ids": topk_ids,
        "expert_map": expert_map,
    }  # fmt: skip
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}: move every tensor to one device")
    return LayerShape(e, hidden, inter, top_k, g13, g2)


def check_weights_contiguous(**weights: torch.Tensor | None) -> None:
    """Refuse a weight, scale or zero-point tensor that is not contiguous (the functional API's rule;
    the layer's own tensors are contiguous by construction)."""
    for name, t in weights.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(
                f"{name} is not contiguous (strides {tuple(t.stride())}); pass {name}.contiguous(): "
                "the kernels read the weights in place, and a silent copy would cost a pass over them per call"
            )


def global_expert_count(num_experts: int, expert_map: torch.Tensor | None, global_num_experts: int | None) -> int:
    """How many expert ids topk_ids may hold: len(expert_map) with a map, else the local E.

    global_num_experts, when given (not -1/None), must agree with that count."""
    count = expert_map.numel() if expert_map is not None else num_experts
    if global_num_experts not in (-1, None):
        if isinstance(global_num_experts, bool) or not isinstance(global_num_experts, int):
            raise ValueError(f"global_num_experts={global_num_experts!r} must be an int")
        if global_num_experts != count:
            why = (
                f"expert_map has {count} entries (one per global expert)"
                if expert_map is not None
                else f"there are E={count} experts and no expert_map (pass one to run a slice of the experts)"
            )
            raise ValueError(f"global_num_experts={global_num_experts} disagrees: {why}")
    return count


def check_routing_values(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, *, num_experts: int, global_experts: int
) -> None:
    """topk_ids in [0, global_experts) and expert_map entries in [-1, num_experts): one host sync."""
    if topk_ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(topk_ids.reshape(-1)))
        if lo < 0 or hi >= global_experts:
            bad = lo if lo < 0 else hi
            where = f"expert_map has {global_experts} entries" if expert_map is not None else f"E={global_experts}"
            raise ValueError(
                f"topk_ids holds expert id {bad}, outside [0, {global_experts}) ({where}): every id must name "
                "a global expert"
            )
    if expert_map is not None and expert_map.numel():
        lo, hi = (int(v) for v in torch.aminmax(expert_map))
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"expert_map holds {bad}, outside [-1, {num_experts}): each entry must be a local expert id "
                f"(0..{num_experts - 1}, E={num_experts}) or -1 for an expert on another rank"
            )


def routing_contiguous(x, topk_weights, topk_ids, expert_map):
    """x, topk_weights, topk_ids, expert_map made contiguous (no copy when they already are)."""
    return (
        x.contiguous(),
        topk_weights.contiguous(),
        topk_ids.contiguous(),
        None if expert_map is None else expert_map.contiguous(),
    )
