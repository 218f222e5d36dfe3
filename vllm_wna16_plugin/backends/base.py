"""The backend contract: every MoE backend states its own rules and never raises while checking them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from vllm_wna16_plugin.kernels.options import DEFAULT_OPTIONS, PLAN_DEVICES, DeviceSpec, KernelOptions
from vllm_wna16_plugin.packing import permute_k, permute_n, sort_groups
from vllm_wna16_plugin.scheme import WNA16Scheme


@dataclass(frozen=True)
class RunOptions:
    """How a layer's backend is asked for and judged: a typed, frozen value (the oracle hands back a new
    problem with `explicit` set instead of writing into the one it judged).

    explicit: the user named the backend; it may then run where auto would not take it (Triton's
    interpreter on CPU, `cuda` outside its measured crossover). plan_only: judge the device described
    (doctor, a test's sm90 problem), not this machine: no imports or extension checks. device_name: the
    GPU whose crossover table applies (a plan names one; else this machine's). kernel: the kernels'
    switches (kernels.options.KernelOptions: tensor descriptors, int4 dot forms, CUDA kernel forms)."""

    explicit: bool = False
    plan_only: bool = False
    device_name: str | None = None
    kernel: KernelOptions = DEFAULT_OPTIONS


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
    # act order whose K cannot be sorted into contiguous equal groups (act_order_issue; set at load): why
    act_order_issue: str | None = None
    use_ep: bool = False
    apply_router_weight_on_input: bool = False
    options: RunOptions = RunOptions()

    def describe(self) -> str:
        return (
            f"{self.scheme.describe()}, E={self.num_experts}, top_k={self.top_k}, "
            f"H={self.hidden}, I={self.intermediate}, {str(self.act_dtype).removeprefix('torch.')}, "
            f"{self.platform}{'' if self.sm is None else f' sm{self.sm}'}"
        )


def layer_device(problem: MoEProblem) -> DeviceSpec:
    """The device a layer's launch plans are for: this machine's GPU, named as options.device_name says when
    set; with options.plan_only the device the problem describes (an sm90 problem is planned as the H200
    whose tables ship, see kernels.options.PLAN_DEVICES); on CPU Triton's interpreter when TRITON_INTERPRET=1."""
    opts = problem.options
    if problem.platform == "cuda" and not opts.plan_only and torch.cuda.is_available():
        device = DeviceSpec.of(torch.device("cuda"))
    elif problem.platform == "cuda":
        known = next((d for d in PLAN_DEVICES.values() if d.platform == "cuda" and d.sm == problem.sm), None)
        device = known or DeviceSpec("cuda", problem.sm)
    elif problem.platform == "cpu":
        device = DeviceSpec.of(torch.device("cpu"))  # "interpreter" under TRITON_INTERPRET=1
    else:
        device = DeviceSpec(problem.platform, problem.sm)
    if opts.device_name is not None and opts.device_name != device.name:
        device = dataclasses.replace(device, name=opts.device_name)
    return device


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
    # Sorted act order (sort_act_order): GEMM1 reads x's column a_perm[e, k] as its K row k.
    a_perm: torch.Tensor | None = None  # (E, H) int32

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w13_qweight, w2_qweight, w13_scales, w2_scales): the positional weights of every fused-layer function."""
        return self.w13_qweight, self.w2_qweight, self.w13_scales, self.w2_scales


def _w13_w2_perms(
    w13_g_idx: torch.Tensor | None, w2_g_idx: torch.Tensor | None, g13: int, g2: int, h: int, i: int, e: int
) -> tuple[torch.Tensor, torch.Tensor, str | None]:
    """(perm1 (E, H), perm2 (E, I), issue): the sorted K orders of GEMM1 and GEMM2 (see sort_act_order);
    a missing g_idx is the trivial one."""
    dev = (w13_g_idx if w13_g_idx is not None else w2_g_idx).device
    if w13_g_idx is None:
        w13_g_idx = (torch.arange(h, device=dev) // (h // g13)).expand(e, 2, h)
    if w2_g_idx is None:
        w2_g_idx = (torch.arange(i, device=dev) // (i // g2)).expand(e, i)
    issue = None
    differ = (w13_g_idx[:, 0] != w13_g_idx[:, 1]).any(-1)
    if bool(differ.any()):
        issue = (
            f"local expert {int(differ.nonzero()[0])}: gate_proj and up_proj have different g_idx (act orders), "
            "and GEMM1 reads x in one column order for both"
        )
    perm1, issue1 = sort_groups(w13_g_idx[:, 0], g13)
    perm2, issue2 = sort_groups(w2_g_idx, g2)
    issue = issue or (issue1 and f"gate/up (K=hidden): {issue1}") or (issue2 and f"down (K=intermediate): {issue2}")
    return perm1, perm2, issue


def act_order_split_issue(scheme: WNA16Scheme, tp_size: int) -> str | None:
    """Why act order cannot run sorted on a tensor-parallel rank, known before any weight is read: a rank's
    slice of the down projection's K holds rows of any group (its g_idx names global groups), so its
    groups are not whole (sort_act_order needs whole groups). A trivial g_idx is dropped at load, and the
    layer is judged again then."""
    if scheme.desc_act and not scheme.is_channelwise and tp_size > 1:
        return (
            f"the down projection's K is split over tp_size={tp_size} ranks, and a rank's rows of an act-order "
            "g_idx do not form whole groups"
        )
    return None


def act_order_issue(
    w13_g_idx: torch.Tensor | None, w2_g_idx: torch.Tensor | None, w13_scales: torch.Tensor, w2_scales: torch.Tensor
) -> str | None:
    """Why this layer's act order cannot run sorted (sort_act_order), or None when it can."""
    if w13_g_idx is None and w2_g_idx is None:
        return None
    e, two_i, g13 = w13_scales.shape
    h, g2 = w2_scales.shape[1:]
    return _w13_w2_perms(w13_g_idx, w2_g_idx, g13, g2, h, two_i // 2, e)[2]


def sort_act_order(tensors: KernelTensors, bits: int) -> KernelTensors:
    """The act-order layout of kernels that take `a_perm`: new tensors, every group one contiguous K run.

    GEMM1 (K = hidden): each expert's K is sorted by its g_idx (perm1, gate's = up's); the kernel reads
    x's column perm1[e, k] as K row k (a_perm). GEMM2 (K = intermediate): K is sorted by w2's g_idx
    (perm2), and w13's gate rows and up rows are reordered by perm2 too, so GEMM1 and the activation
    already produce the intermediate in GEMM2's sorted order: no gather there. Sorted, K row k is in
    group k // group_size, so the scale and zero-point tables keep their group order. Raises ValueError
    with act_order_issue's reason when the g_idx cannot be sorted so.
    """
    if tensors.w13_g_idx is None and tensors.w2_g_idx is None:
        return tensors
    e, two_i, g13 = tensors.w13_scales.shape
    h, g2 = tensors.w2_scales.shape[1:]
    i = two_i // 2
    perm1, perm2, issue = _w13_w2_perms(tensors.w13_g_idx, tensors.w2_g_idx, g13, g2, h, i, e)
    if issue:
        raise ValueError(f"act order cannot be sorted into contiguous groups: {issue}")
    dev = tensors.w13_qweight.device
    perm1, perm2 = perm1.to(dev), perm2.to(dev)
    w13_q = permute_k(tensors.w13_qweight, perm1, bits)
    w13_q, w13_s, w13_z = permute_n(
        w13_q, tensors.w13_scales, tensors.w13_qzeros, torch.cat([perm2, perm2 + i], 1), bits
    )
    return KernelTensors(
        w13_qweight=w13_q,
        w2_qweight=permute_k(tensors.w2_qweight, perm2, bits),
        w13_scales=w13_s,
        w2_scales=tensors.w2_scales,
        w13_qzeros=w13_z,
        w2_qzeros=tensors.w2_qzeros,
        a_perm=perm1.to(torch.int32).contiguous(),
    )


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
    after loading); `run` computes the layer for one batch (launch_plan.LayerRunner picks the backend
    of each batch and hands it the batch's plan).
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
        plan: Any = None,
    ) -> torch.Tensor:
        """The layer for one batch; plan: the launch_plan.LaunchPlan of this batch size (what to launch),
        or None to derive it inside the kernel's launcher."""
        raise NotImplementedError
