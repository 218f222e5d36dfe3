"""moe_align_block_size_torch: vLLM's contract, checked by known answers and invariants."""

import pytest
import torch

from vllm_wna16_plugin.kernels.align import moe_align_block_size_torch


def test_known_answer():
    # 4 tokens x top_k 2 over 4 experts, block 2: pairs p = t*2 + j
    topk_ids = torch.tensor([[2, 0], [0, 3], [2, 0], [3, 2]])
    sorted_ids, expert_ids, total = moe_align_block_size_torch(topk_ids, 2, 4)
    s = 8  # sentinel M*top_k
    # expert 0: pairs 1,2,5 (pad 1); expert 1: none; expert 2: pairs 0,4,7 (pad 1); expert 3: 3,6
    want_prefix = [1, 2, 5, s, 0, 4, 7, s, 3, 6]
    assert total.tolist() == [10]
    assert sorted_ids[:10].tolist() == want_prefix
    assert (sorted_ids[10:] == s).all()
    assert sorted_ids.numel() == 8 + 4 * (2 - 1)  # vLLM's max_num_tokens_padded
    assert expert_ids[:5].tolist() == [0, 0, 2, 2, 3]
    assert (expert_ids[5:] == -1).all()
    assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32


def test_expert_map_marks_non_local_blocks_minus_one():
    topk_ids = torch.tensor([[2, 0], [0, 3], [2, 0], [3, 2]])
    expert_map = torch.tensor([-1, -1, 0, 1])  # experts 2, 3 local
    sorted_ids, expert_ids, total = moe_align_block_size_torch(topk_ids, 2, 4, expert_map)
    assert expert_ids[:5].tolist() == [-1, -1, 0, 0, 1]
    assert total.tolist() == [10]  # non-local pairs are still aligned (vLLM's default)


def test_fewer_pairs_than_experts_caps_the_buffer():
    topk_ids = torch.tensor([[5, 7]])
    sorted_ids, expert_ids, total = moe_align_block_size_torch(topk_ids, 16, 512)
    assert sorted_ids.numel() == 2 * 16  # min(numel * block, numel + E * (block - 1))
    assert total.tolist() == [32]
    assert expert_ids[:2].tolist() == [5, 7]


@pytest.mark.parametrize(
    "M,top_k,E,block",
    [
        pytest.param(1, 1, 1, 16, id="single-pair"),
        pytest.param(7, 3, 5, 4, id="prime-E-M-not-multiple"),
        pytest.param(64, 8, 128, 16, id="decode-batch"),
        pytest.param(33, 2, 8, 64, id="big-block"),
    ],
)
def test_invariants_on_random_routing(M, top_k, E, block):
    gen = torch.Generator().manual_seed(M * 1000 + E)
    topk_ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(M)])
    sorted_ids, expert_ids, total = moe_align_block_size_torch(topk_ids, block, E)
    n, t = M * top_k, int(total)
    assert t % block == 0
    live = sorted_ids[:t]
    real = live[live < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair exactly once
    assert (sorted_ids[t:] == n).all() and (live >= n).sum() == t - n  # padding is the sentinel
    flat = topk_ids.reshape(-1)
    for b in range(t // block):
        blk = sorted_ids[b * block : (b + 1) * block]
        pairs = blk[blk < n].long()
        assert pairs.numel() > 0  # no empty live block
        assert (flat[pairs] == expert_ids[b]).all()  # one expert per block
    assert (expert_ids[t // block :] == -1).all()


def test_vllm_padding_ids_are_skipped_like_the_rest_were_alone():
    """-1 (vLLM 0.34's padding rows) takes no slot: the same runs as the routed pairs alone, pair indices kept."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 6, (9, 2), generator=gen, dtype=torch.int32)
    padded = ids.clone()
    padded[6:] = -1  # the last three rows: padding
    s_pad, e_pad, t_pad = moe_align_block_size_torch(padded, 4, 6)
    s_real, e_real, t_real = moe_align_block_size_torch(ids[:6], 4, 6)
    assert t_pad.item() == t_real.item()
    live = s_pad[: t_pad.item()]
    assert sorted(live[live < 18].tolist()) == list(range(12))  # the 12 routed pairs once, none of the padding
    assert e_pad[: t_pad.item() // 4].tolist() == e_real[: t_real.item() // 4].tolist()
    s_all, _, t_all = moe_align_block_size_torch(padded.fill_(-1), 4, 6)  # all padding: nothing to align
    assert t_all.item() == 0 and (s_all == 18).all()


def test_bad_ids_raise():
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, num_experts=4\)"):
        moe_align_block_size_torch(torch.tensor([[4]]), 16, 4)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, num_experts=4\)"):
        moe_align_block_size_torch(torch.tensor([[-2]]), 16, 4)
    with pytest.raises(ValueError, match=r"expert_map has 3 entries but num_experts=4"):
        moe_align_block_size_torch(torch.tensor([[1]]), 16, 4, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"block_size_m=0"):
        moe_align_block_size_torch(torch.tensor([[1]]), 0, 4)


def test_empty():
    sorted_ids, expert_ids, total = moe_align_block_size_torch(torch.empty(0, 2, dtype=torch.int64), 16, 4)
    assert total.tolist() == [0] and sorted_ids.numel() == 0
