"""The backend contract: every MoE backend states its own rules and never raises while checking them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from vllm_wna16_plugin.kernels.options import DEFAULT_OPTIONS, PLAN_DEVICES, DeviceSpec, KernelOptions
from vllm_wna16_plugin.packing import padded_group_runs, permute_k, permute_n, sort_groups, unpack_along
from vllm_wna16_plugin.scheme import WNA16Scheme


@dataclass(frozen=True)
class RunOptions:
    """How a layer's backend is asked for and judged: a typed, frozen value (the oracle hands back a new
    problem with `explicit` set instead of writing into the one it judged).

    explicit: the user named the backend; it may then run where auto would not take it (Triton's
    interpreter on CPU, `cuda` outside its measured crossover). plan_only: judge the device described
    (doctor, a test's sm90 problem), not this machine: no imports or extension checks. device_name: the
    GPU whose crossover table applies (a plan names one; else this machine's). kernel: the kernels'
    switches (kernels.options.KernelOptions: tensor descriptors, int4 dot forms, CUDA kernel forms).
    compose_with: the vLLM backend ("humming" or "marlin") that auto's cuda / triton layer also holds a copy of
    its weights for and hands the batches that backend's rule gives it (compose.py; compose.compose_with sets it).
    None: the plugin's kernels run every batch. hopper: auto's cuda / triton layer also holds the hopper kernel's
    copy and hands it the batches backends/hopper.py's rule gives it (compose.with_hopper sets it)."""

    explicit: bool = False
    plan_only: bool = False
    device_name: str | None = None
    kernel: KernelOptions = DEFAULT_OPTIONS
    compose_with: str | None = None
    hopper: bool = False


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
    # act order that cannot take the sorted layout (act_order_issue; set at load): why
    act_order_issue: str | None = None
    # act order whose down-projection groups this rank holds unevenly (a tensor-parallel split): the sorted
    # layout pads them to runs of 16 rows (ActOrderLayout.padded), which only the Triton kernel takes.
    # Predicted at create_weights (TP > 1), measured at load (act_order_padded)
    act_order_padded: bool = False
    use_ep: bool = False
    apply_router_weight_on_input: bool = False
    options: RunOptions = RunOptions()

    def describe(self) -> str:
        return (
            f"{self.scheme.describe()}, E={self.num_experts}, top_k={self.top_k}, "
            f"H={self.hidden}, I={self.intermediate}, {str(self.act_dtype).removeprefix('torch.')}, "
            f"{self.platform}{'' if self.sm is None else f' sm{self.sm}'}"
        )


HALF_DTYPES = (torch.bfloat16, torch.float16)


def half_precision_reason(problem: MoEProblem) -> str | None:
    """Why a GPU kernel cannot take this layer's activations: every one but `reference` computes in bfloat16
    or float16 (a float32 model runs its experts on `reference`, or loads with --dtype bfloat16)."""
    if problem.act_dtype in HALF_DTYPES:
        return None
    return (
        f"activations are {str(problem.act_dtype).removeprefix('torch.')}; this kernel takes bfloat16 or float16 "
        "(--dtype bfloat16)"
    )


def expert_bytes(problem: MoEProblem) -> float:
    """Bytes of one expert's weights and bf16 scales (both GEMMs) on this rank."""
    h, i, bits = problem.hidden, problem.intermediate, problem.scheme.bits
    return 3 * h * i * bits / 8 + (2 * i * (h // problem.group_size_w13) + h * (i // problem.group_size_w2)) * 2


def experts_hit(problem: MoEProblem, m: int) -> float:
    """Local experts that m * top_k pairs routed uniformly over the global experts hit (expected value):

        hit = E_loc * (1 - (1 - 1/E_glob) ** (m * top_k))

    (expert parallelism: the global experts not on this rank are another rank's)."""
    e_loc, e_glob = problem.num_experts, max(problem.global_num_experts, problem.num_experts)
    return e_loc * (1.0 - (1.0 - 1.0 / e_glob) ** (m * problem.top_k)) if e_glob > 1 else 1.0


def experts_read(problem: MoEProblem, m: int) -> float:
    """Bytes of expert weights a call of m tokens reads on this rank: experts_hit * expert_bytes."""
    return experts_hit(problem, m) * expert_bytes(problem)


def pairs_per_expert(problem: MoEProblem, m: int) -> float:
    """Routed (token, expert) pairs per local expert hit: the rows each hit expert's GEMMs take, on average
    (m * top_k * E_loc / E_glob of the pairs land on this rank)."""
    e_loc, e_glob = problem.num_experts, max(problem.global_num_experts, problem.num_experts)
    return m * problem.top_k * e_loc / e_glob / max(experts_hit(problem, m), 1e-9)


# (bits, zero points) forms: symmetric int4, the forms every composition rule was fitted on
SYMMETRIC_INT4 = ((4, False),)


def composition_scope(problem: MoEProblem, device, forms: tuple[tuple[int, bool], ...] = SYMMETRIC_INT4) -> str | None:
    """Why the rules that compose auto's layer with a vLLM kernel (backends/humming.py, backends/marlin.py;
    compose.py) do not speak for this layer on `device`, or None where they do: what their H200 development set
    measured, sm90 with one of a rule's (bits, zero points) `forms` in groups of 32-128 (16-128 for the down
    projection) and no act order."""
    if device.platform != "cuda" or device.sm != 90:
        return f"measured on sm90 only (device is {device.platform} sm{device.sm})"
    scheme = problem.scheme
    if (scheme.bits, scheme.has_zero_point) not in forms or scheme.is_channelwise or problem.has_g_idx:
        named = ", ".join(f"int{bits}{' with zero points' if zp else ' symmetric'}" for bits, zp in forms)
        return f"measured for {named} with groups only"
    if not (32 <= problem.group_size_w13 <= 128 and 16 <= problem.group_size_w2 <= 128):
        return f"group sizes {problem.group_size_w13}/{problem.group_size_w2} not measured"
    return None


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


# ---------------------------------------------------------------- act order

# The smallest scale group of the padded layout: tl.dot's K step. The Triton kernel takes any power-of-two
# group with BLOCK_SIZE_K % group == 0 or group % BLOCK_SIZE_K == 0 (configs.TritonMoEConfig.check_shape).
MIN_RUN = 16


@dataclass(frozen=True)
class ActOrderLayout:
    """Where each K row of a layer's act order goes in the sorted layout (sort_act_order).

    perm1 (E, H): GEMM1's K order; the kernel reads x's column perm1[e, k] as K row k (a_perm).
    rows2 (E, I_out): the intermediate row at position k of GEMM2's K, and of GEMM1's gate and up rows;
    -1 is padding. GEMM2's scale groups are chunks of `run` rows; chunk j uses column chunk_groups[e, j]
    of w2's scale table. Whole groups (one rank) need no padding: I_out = I, run = I / G, chunk j is
    group j. Otherwise (a tensor-parallel rank's slice of I holds c_g rows of each group g, 0..group_size)
    each group's rows are padded to a multiple of `run` and every expert to the longest:
    I_out = I_pad = max_e sum_g ceil(c_eg / run) * run (packing.padded_group_runs; run: choose_run)."""

    perm1: torch.Tensor  # (E, H) int64
    rows2: torch.Tensor  # (E, I_out) int64, -1 = padding
    chunk_groups: torch.Tensor  # (E, I_out / run) int64
    run: int

    @property
    def padded(self) -> bool:
        return bool((self.rows2 < 0).any())


def padded_layer_bytes(i_pad: int, run: int, *, hidden: int, bits: int, w13_groups: int, scale_bytes: int,
                       has_zero_point: bool) -> float:  # fmt: skip
    """Bytes the two GEMMs read per expert when GEMM2's K holds i_pad rows in scale groups of `run`: GEMM1's
    2 * i_pad rows of H weights with their w13_groups scales (and zero points), GEMM2's H rows of i_pad
    weights and i_pad / run scales (and zero points)."""
    zero_bytes = bits / 8 if has_zero_point else 0.0
    gemm1 = 2 * i_pad * (hidden * bits / 8 + w13_groups * (scale_bytes + zero_bytes))
    gemm2 = hidden * (i_pad * bits / 8 + i_pad / run * (scale_bytes + zero_bytes))
    return gemm1 + gemm2


def choose_run(counts: torch.Tensor, **layer) -> tuple[int, int]:
    """(run, I_pad) for act order whose groups hold counts (E, G) rows per expert on this rank: of the powers
    of two from MIN_RUN to the largest count (rounded up), the run whose padded K makes the layer read the
    fewest bytes (padded_layer_bytes with `layer`'s sizes; ties go to the larger run). A smaller run pads
    less (each group wastes under `run` rows) but reads a scale per `run` rows of GEMM2."""
    top = max(MIN_RUN, 1 << (max(int(counts.max()), 1) - 1).bit_length())
    best = None
    run = top
    while run >= MIN_RUN:
        i_pad = int(((counts + run - 1) // run * run).sum(-1).max())
        cost = padded_layer_bytes(i_pad, run, **layer)
        if best is None or cost < best[0]:
            best = (cost, run, i_pad)
        run //= 2
    return best[1], best[2]


def random_act_order_padding(
    intermediate: int, group_size: int, tp_size: int, num_experts: int, *, rank: int = 0, seed: int = 0, **layer
) -> tuple[int, int]:
    """(run, I_pad) that sort_act_order gives rank `rank` of a layer whose experts have random act orders
    (each expert's intermediate rows dealt into groups of group_size in a random order, as GPTQ's desc_act
    writes them); `layer`: choose_run's sizes. What doctor plans before any weight is read.

    The padding's cost (mean over 8 draws and every rank; int4, group 128, bf16 scales; run 16 is chosen in
    every case). I_pad / I_loc, and in brackets the bytes both GEMMs read against the same rank without act
    order (GEMM2's scales per 16 rows add the rest):

        model                            I_loc at TP2/4/8    TP2           TP4           TP8
        Qwen3-30B-A3B  I=768,   E=128    384 / 192 / 96      1.19 (1.27)   1.35 (1.45)   1.71 (1.83)
        Mixtral-8x7B   I=14336, E=8      7168 / 3584 / 1792  1.13 (1.21)   1.25 (1.34)   1.48 (1.58)

    Each of a rank's G groups wastes run / 2 rows on average, so I_pad / I_loc ~ 1 + TP * run / (2 * group
    size), a little more with many experts (I_pad is the longest expert's).
    """
    gen = torch.Generator().manual_seed(seed)
    i_loc = intermediate // tp_size
    own = slice(rank * i_loc, (rank + 1) * i_loc)
    g_idx = torch.stack([torch.randperm(intermediate, generator=gen)[own] // group_size for _ in range(num_experts)])
    counts = torch.zeros(num_experts, -(-intermediate // group_size), dtype=torch.int64)
    counts.scatter_add_(1, g_idx, torch.ones_like(g_idx))
    return choose_run(counts, **layer)


def act_order_split_issue(scheme: WNA16Scheme, tp_size: int) -> str | None:
    """Why act order cannot run sorted on a tensor-parallel rank, known before any weight is read, or None.

    None remains: a rank's slice of the down projection's K holds a partial share of each act-order group
    (its g_idx names global groups), and sort_act_order pads each group's rows to whole scale groups
    (ActOrderLayout); a K per rank that no exact group size fits is refused before this, by
    checkpoint_config.effective_group_size. Kept for the callers that judge a layer before loading
    (moe_method.create_weights, doctor); the weights are judged at load (act_order_issue)."""
    del scheme, tp_size
    return None


def act_order_issue(
    w13_g_idx: torch.Tensor | None, w2_g_idx: torch.Tensor | None, w13_scales: torch.Tensor, w2_scales: torch.Tensor
) -> str | None:
    """Why this layer's act order cannot take the sorted layout (sort_act_order), or None when it can.

    GEMM1 (K = hidden, never split) needs gate's g_idx = up's (it reads x in one column order for both)
    and whole groups of H / G1 rows. GEMM2 (K = intermediate) takes any g_idx in [0, G2): groups a
    tensor-parallel split leaves partial are padded (ActOrderLayout)."""
    if w13_g_idx is None and w2_g_idx is None:
        return None
    if w13_g_idx is not None:
        differ = (w13_g_idx[:, 0] != w13_g_idx[:, 1]).any(-1)
        if bool(differ.any()):
            return (
                f"local expert {int(differ.nonzero()[0])}: gate_proj and up_proj have different g_idx (act "
                "orders), and GEMM1 reads x in one column order for both"
            )
        issue = sort_groups(w13_g_idx[:, 0], w13_scales.shape[-1])[1]
        if issue:
            return f"gate/up (K=hidden): {issue}"
    if w2_g_idx is not None:
        g2 = w2_scales.shape[-1]
        bad = ((w2_g_idx < 0) | (w2_g_idx >= g2)).any(-1)
        if bool(bad.any()):
            ex = int(bad.nonzero()[0])
            return f"down (K=intermediate): local expert {ex}: g_idx names a group outside the {g2} of the scale table"
    return None


def act_order_padded(w2_g_idx: torch.Tensor | None, w2_scales: torch.Tensor) -> bool:
    """Whether the sorted layout pads this layer's down projection: some group of its g_idx does not hold
    exactly I / G rows on this rank (a tensor-parallel split of act order)."""
    if w2_g_idx is None:
        return False
    g2 = w2_scales.shape[-1]
    return sort_groups(w2_g_idx, g2)[1] is not None


def act_order_layout(tensors: KernelTensors, bits: int) -> ActOrderLayout:
    """The sorted layout of a layer with act order (ActOrderLayout); ValueError with act_order_issue's
    reason when there is none. A missing g_idx is the trivial one."""
    e, two_i, g13 = tensors.w13_scales.shape
    h, g2 = tensors.w2_scales.shape[1:]
    i = two_i // 2
    issue = act_order_issue(tensors.w13_g_idx, tensors.w2_g_idx, tensors.w13_scales, tensors.w2_scales)
    if issue:
        raise ValueError(f"act order cannot be sorted into contiguous groups: {issue}")
    dev = tensors.w13_qweight.device
    g_h = tensors.w13_g_idx[:, 0] if tensors.w13_g_idx is not None else torch.arange(h) // (h // g13)
    g_i = tensors.w2_g_idx if tensors.w2_g_idx is not None else torch.arange(i) // (i // g2)
    g_h, g_i = g_h.to(dev).expand(e, h), g_i.to(dev).expand(e, i)
    perm1 = sort_groups(g_h, g13)[0]
    perm2, unequal = sort_groups(g_i, g2)
    if not unequal and (i // g2) % MIN_RUN == 0:
        return ActOrderLayout(perm1, perm2, torch.arange(g2, device=dev).expand(e, g2), i // g2)
    counts = torch.zeros(e, g2, dtype=torch.int64, device=dev).scatter_add_(1, g_i.long(), torch.ones_like(g_i.long()))
    run, _ = choose_run(counts, hidden=h, bits=bits, w13_groups=g13, scale_bytes=tensors.w2_scales.element_size(),
                        has_zero_point=tensors.w2_qzeros is not None)  # fmt: skip
    rows, chunk_groups = padded_group_runs(g_i, g2, run)
    return ActOrderLayout(perm1, rows, chunk_groups, run)


def sort_act_order(tensors: KernelTensors, bits: int) -> KernelTensors:
    """The act-order layout of kernels that take `a_perm`: new tensors, every scale group one contiguous K run.

    GEMM1 (K = hidden): each expert's K is sorted by its g_idx (perm1, gate's = up's); the kernel reads
    x's column perm1[e, k] as K row k (a_perm). GEMM2 (K = intermediate): K is laid out as
    act_order_layout's rows2 (sorted by w2's g_idx; on a tensor-parallel rank each group padded to a
    multiple of the run, I becomes I_pad), and w13's gate rows and up rows are laid out the same way, so
    GEMM1 and the activation already produce the intermediate in GEMM2's order: no gather there.

    Padding is exact: a padded gate or up row has scale 0, so it dequantizes to 0 whatever its weights and
    zero point, GEMM1 gives 0 there and the activation act(0) * 0 = 0 (silu, gelu); a padded K row of
    w2 holds its chunk's zero point (it dequantizes to 0 too, and its input is 0). w2's scale and zero-point
    tables become (E, H, I_pad / run): column j is the checkpoint group of chunk j (chunk_groups), gathered
    from the rank's table of every group. Raises ValueError with act_order_issue's reason.
    """
    if tensors.w13_g_idx is None and tensors.w2_g_idx is None:
        return tensors
    layout = act_order_layout(tensors, bits)
    e, two_i, _ = tensors.w13_scales.shape
    i, h = two_i // 2, tensors.w2_scales.shape[1]
    rows2 = layout.rows2.to(tensors.w13_qweight.device)
    w13_q = permute_k(tensors.w13_qweight, layout.perm1, bits)
    up_rows = torch.where(rows2 >= 0, rows2 + i, rows2)
    w13_q, w13_s, w13_z = permute_n(w13_q, tensors.w13_scales, tensors.w13_qzeros, torch.cat([rows2, up_rows], 1), bits)
    w2_s, w2_z, pad = tensors.w2_scales, tensors.w2_qzeros, None
    if layout.padded or layout.chunk_groups.shape[-1] != w2_s.shape[-1]:
        chunks = layout.chunk_groups.to(w2_s.device)[:, None, :]
        w2_s = torch.gather(w2_s, -1, chunks.expand(-1, h, -1)).contiguous()
        if w2_z is not None:  # packed along N (H): a group's column is gathered whole
            w2_z = torch.gather(w2_z, -1, chunks.expand(-1, w2_z.shape[1], -1)).contiguous()
        pad = torch.full(w2_s.shape, 1 << (bits - 1), dtype=torch.int32, device=w2_s.device)
        if w2_z is not None:
            pad = unpack_along(w2_z, bits, dim=-2, word_bits=8)
    return KernelTensors(
        w13_qweight=w13_q,
        w2_qweight=permute_k(tensors.w2_qweight, rows2, bits, pad_values=pad),
        w13_scales=w13_s,
        w2_scales=w2_s,
        w13_qzeros=w13_z,
        w2_qzeros=w2_z,
        a_perm=layout.perm1.to(torch.int32).contiguous(),
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
    after loading; `prepared_problem` says which shape that state runs); `run`
    computes the layer for one batch (launch_plan.LayerRunner picks the backend
    of each batch and hands it the batch's plan).
    """

    name: str = ""
    description: str = ""
    # whether the backend runs act order in the sorted layout (sort_act_order: weights sorted, a_perm); the
    # layer's runner then sorts once for every backend of its plans (launch_plan.LayerRunner)
    sorted_act_order: bool = False

    def incompatibility_reason(self, problem: MoEProblem) -> str | None:
        raise NotImplementedError

    def prepare(self, problem: MoEProblem, tensors: KernelTensors) -> Any:
        return tensors

    def prepared_problem(self, problem: MoEProblem, state: Any) -> MoEProblem:
        """The problem `state` (from prepare) runs: `problem` unless prepare changed the layer's shape
        (triton's act order padded on a tensor-parallel rank); launch plans are made for it."""
        return problem

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
