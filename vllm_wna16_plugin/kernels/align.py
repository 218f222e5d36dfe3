"""moe_align_block_size in plain torch, with vLLM's semantics (the CPU/test stand-in).

Flatten topk_ids (M, top_k) to M*top_k pairs (those of id -1, vLLM's padding rows, skipped); group them by expert and
pad each expert's run to a multiple of block_size_m. The GPU caller passes vLLM's
`moe_align_block_size` instead; both return the same contract:

    sorted_token_ids  (max_padded,) int32: pair indices t*top_k+j, grouped by expert;
                      padded slots hold the sentinel M*top_k.
    expert_ids        (cdiv(max_padded, block_size_m),) int32: the expert of each
                      M-block (local id through expert_map; -1 for a non-local expert
                      and for the unused blocks past num_tokens_post_padded).
    num_tokens_post_padded  (1,) int32: sum over experts of the padded run lengths.

max_padded is vLLM's bound numel + num_experts*(block_size_m-1), capped at
numel*block_size_m when there are fewer pairs than experts. Within an expert the
pairs are in ascending order (vLLM's CUDA op does not promise an order; no caller
may rely on one). Experts with no pairs get no block.
"""

from __future__ import annotations

import torch

# vLLM 0.34's routers give CUDA-graph and DP padding rows this id (VLLM_MOE_SKIP_PADDING); its
# moe_align_block_size(..., ignore_invalid_experts=True), which the GPU path calls, skips them: so does this
PADDING_ID = -1


def moe_align_block_size_torch(
    topk_ids: torch.Tensor,  # (M, top_k) int, global expert ids in [0, num_experts), or PADDING_ID (skipped)
    block_size_m: int,
    num_experts: int,  # the global number of experts
    expert_map: torch.Tensor | None = None,  # (num_experts,) int: local id or -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded); see the module docstring."""
    if block_size_m <= 0:
        raise ValueError(f"block_size_m={block_size_m} must be positive")
    if num_experts <= 0:
        raise ValueError(f"num_experts={num_experts} must be positive")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    max_padded = numel + num_experts * (block_size_m - 1)
    if numel < num_experts:
        max_padded = min(numel * block_size_m, max_padded)
    max_blocks = -(-max_padded // block_size_m)

    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.int32, device=device)
    if numel == 0:
        return sorted_ids, expert_ids, torch.zeros(1, dtype=torch.int32, device=device)
    routed = flat != PADDING_ID
    if bool(routed.any()) and (int(flat[routed].min()) < 0 or int(flat[routed].max()) >= num_experts):
        raise ValueError(
            f"topk_ids must lie in [0, num_experts={num_experts}) (or be {PADDING_ID}, vLLM's padding); got "
            f"[{int(flat[routed].min())}, {int(flat[routed].max())}]: pass the global number of experts"
        )

    counts = torch.bincount(flat[routed], minlength=num_experts)
    padded = (counts + block_size_m - 1) // block_size_m * block_size_m
    run_start = torch.cumsum(padded, 0) - padded  # first slot of each expert's run
    first_pair = torch.cumsum(counts, 0) - counts  # rank offset of each expert in sorted order

    order = torch.argsort(flat, stable=True)[int((~routed).sum()) :]  # the padding pairs (-1) sort first: dropped
    expert_of = flat[order]
    rank = torch.arange(order.numel(), device=device) - first_pair[expert_of]
    sorted_ids[run_start[expert_of] + rank] = order.to(torch.int32)

    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), padded // block_size_m)
    if expert_map is not None:
        if expert_map.numel() != num_experts:
            raise ValueError(
                f"expert_map has {expert_map.numel()} entries but num_experts={num_experts}; "
                "it must map every global expert (local id or -1)"
            )
        block_expert = expert_map.to(device).long()[block_expert]
    expert_ids[: block_expert.numel()] = block_expert.to(torch.int32)
    total = padded.sum().to(torch.int32).reshape(1)
    return sorted_ids, expert_ids, total
