"""The backend contract: every MoE backend states its own rules and never raises while checking them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_wna16_plugin.scheme import WNA16Scheme


@dataclass(frozen=True)
class MoEProblem:
    """What a backend needs to know to accept or refuse one MoE layer (on this rank)."""

    scheme: WNA16Scheme
    hidden: int  # H
    intermediate: int  # I on this rank
    num_experts: int  # local experts
    global_num_experts: int
    top_k: int
    group_size_w13: int  # effective group size along H (H when channel-wise)
    group_size_w2: int  # effective group size along I (I when channel-wise)
    act_dtype: torch.dtype = torch.bfloat16
    activation: str = "silu"
    platform: str = "cpu"  # "cuda" | "rocm" | "xpu" | "cpu"
    sm: int | None = None  # compute capability as major*10+minor on CUDA
    has_g_idx: bool = False  # act order with a non-trivial g_idx
    use_ep: bool = False
    apply_router_weight_on_input: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def describe(self) -> str:
        return (
            f"{self.scheme.describe()}, E={self.num_experts}, top_k={self.top_k}, "
            f"H={self.hidden}, I={self.intermediate}, {str(self.act_dtype).removeprefix('torch.')}, "
            f"{self.platform}{'' if self.sm is None else f' sm{self.sm}'}"
        )


@dataclass
class KernelTensors:
    """The plugin's one kernel layout of a layer's experts (see packing.KernelWeights)."""

    w13_qweight: torch.Tensor  # (E, 2I, H*bits/8) uint8
    w2_qweight: torch.Tensor  # (E, H, I*bits/8) uint8
    w13_scales: torch.Tensor  # (E, 2I, H/gs)
    w2_scales: torch.Tensor  # (E, H, I/gs)
    w13_qzeros: torch.Tensor | None = None  # (E, 2I*bits/8, H/gs) uint8
    w2_qzeros: torch.Tensor | None = None  # (E, H*bits/8, I/gs) uint8
    w13_g_idx: torch.Tensor | None = None  # (E, 2, H) int32, act order only (gate, up)
    w2_g_idx: torch.Tensor | None = None  # (E, I) int32

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w13_qweight, w2_qweight, w13_scales, w2_scales): the positional weights of every fused-layer function."""
        return self.w13_qweight, self.w2_qweight, self.w13_scales, self.w2_scales


def layer_kwargs(problem: MoEProblem, state: KernelTensors, expert_map: torch.Tensor | None) -> dict:
    """The keyword arguments every fused-layer function (reference, triton, cuda) takes alike."""
    return dict(
        bits=problem.scheme.bits,
        w13_qzeros=state.w13_qzeros,
        w2_qzeros=state.w2_qzeros,
        activation=problem.activation,
        apply_router_weight_on_input=problem.apply_router_weight_on_input,
        expert_map=expert_map,
    )


class Backend:
    """One way of running a WNA16 MoE layer.

    `incompatibility_reason` holds all of this backend's rules and returns None
    when it can run the problem, else a short reason; it must never raise.
    `prepare` turns the kernel layout into whatever the backend runs on (once,
    after loading); `run` computes the layer.
    """

    name: str = ""
    description: str = ""

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        raise NotImplementedError

    def prepare(self, problem: MoEProblem, tensors: KernelTensors) -> Any:
        return tensors

    def run(
        self,
        problem: MoEProblem,
        state: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError
