"""What runs for one batch of one MoE layer, and why: the launch plan.

    plan(problem, num_tokens, device) -> LaunchPlan(backend, launch, gemms, align, programmatic, why)

A pure function of the layer (MoEProblem: scheme, shapes, options), the batch size and the device
(kernels.options.DeviceSpec): no tensors and no GPU, so `vllm-wna16 doctor` prints it for a model
on any machine and a CPU test sweeps it over real models' shapes. It composes the backends: the
layer's backend is the oracle's (oracle.select_backend); under `auto` a `cuda` layer runs the batch
sizes inside its measured crossover (crossover.py) on the CUDA kernel and the others on Triton, a
layer composed with a vLLM kernel (compose.py) hands that kernel the batches its rule takes, and one that
holds the hopper copy (compose.with_hopper) hands the hopper kernel the batches its rule takes. The
kernel-level launch (configs.TritonLaunch or cuda_ops.CudaLaunch) is what the launcher runs: the
same functions choose it whether a plan asks or the launcher does, so what doctor prints is what
runs. Each GEMM row says where its numbers came from (a tuned file and its M, or a heuristic).

LayerRunner holds a layer's selection, the prepared state of each backend its plans can name, and
one plan per batch size seen; moe_method.apply and ops.fused_moe_wna16 run through it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass
from typing import Any

import torch

from vllm_wna16_plugin import crossover
from vllm_wna16_plugin.backends import Backend, KernelTensors, MoEProblem, registry
from vllm_wna16_plugin.backends.base import layer_device, sort_act_order
from vllm_wna16_plugin.compose import COMPOSABLE, partner_named
from vllm_wna16_plugin.kernels.options import DeviceSpec
from vllm_wna16_plugin.oracle import Selection, select_backend
from vllm_wna16_plugin.user_tables import configs_dir


@dataclass(frozen=True)
class GemmPlan:
    """One GEMM of a plan, for people: kernel, tile (BLOCK_SIZE_M, N, K), split, warps, stages, form
    ("fold" / "tile" per pair, "words" / "split" / "interleave" dots, "silu fused"), tensor descriptors
    and the source of the numbers."""

    gemm: str  # "gate/up" | "down"
    kernel: str
    tile: tuple[int, int, int]
    split_k: int = 1
    num_warps: int | None = None
    num_stages: int | None = None
    form: str = ""
    tensor_descriptors: str = "off"
    source: str = ""

    def describe(self) -> str:
        m, n, k = self.tile
        parts = [f"{self.gemm:7s} {self.kernel:15s} tile {m}x{n}x{k}"]
        if self.split_k > 1:
            parts.append(f"split_k {self.split_k}")
        if self.num_warps is not None:
            parts.append(f"{self.num_warps} warps, {self.num_stages} stages")
        if self.form:
            parts.append(self.form)
        if self.tensor_descriptors != "off":
            parts.append(f"TD {self.tensor_descriptors}")
        return ", ".join(parts) + (f"  [{self.source}]" if self.source else "")


@dataclass(frozen=True)
class LaunchPlan:
    """What runs for `num_tokens` tokens: the backend (`layer_backend` is the layer's selection; a `cuda`
    layer under auto runs batches outside its crossover on `triton`), the kernel-level launch the launcher
    takes (None for backends that delegate to vLLM or the reference), the GEMMs as text, the token
    alignment, whether the launches are programmatic, and why each choice was made."""

    num_tokens: int
    backend: str
    layer_backend: str
    device: DeviceSpec
    launch: Any = None  # configs.TritonLaunch | cuda_ops.CudaLaunch | None
    gemms: tuple[GemmPlan, ...] = ()
    align: str = ""
    programmatic: bool = False
    why: tuple[str, ...] = ()

    def describe(self) -> str:
        head = f"M={self.num_tokens}: {self.backend}"
        if self.align:
            head += f"; align: {self.align}"
        if self.programmatic:
            head += "; programmatic launches"
        lines = [head] + [f"    {g.describe()}" for g in self.gemms] + [f"    why: {w}" for w in self.why]
        return "\n".join(lines)


def _triton_gemms(problem: MoEProblem, m: int, device: DeviceSpec, launch) -> tuple[GemmPlan, ...]:
    from vllm_wna16_plugin.kernels.triton.configs import act_order_form, dot_form, fuse_form, pair_step, swap_form
    from vllm_wna16_plugin.kernels.triton.td_gate import decide_td, td_request_from_env

    opts = problem.options.kernel
    requested = opts.use_td if opts.use_td is not None else td_request_from_env()
    bits = problem.scheme.bits
    rows = []
    # act order gathered into pair rows first (configs.act_order_form)
    rows_form = problem.has_g_idx and act_order_form(m, opts.triton_act_order) == "rows"
    for gemm, choice, rows_a, k, perm in (
        (
            "gate/up",
            launch.gemm1,
            m * problem.top_k if rows_form else m,
            problem.hidden,
            problem.has_g_idx and not rows_form,
        ),
        ("down", launch.gemm2, m * problem.top_k, problem.intermediate, False),
    ):
        cfg = swap_form(choice.config, opts)
        cfg = fuse_form(cfg, opts) if gemm == "gate/up" else cfg  # GEMM2 never fuses
        # the kernel layout's rows are K*bits/8 bytes from a 16-byte aligned base (packing.py)
        on_words = (k * bits // 8) % 4 == 0
        td = decide_td(requested=requested, platform=device.platform, sm=device.sm, block_size_m=cfg.BLOCK_SIZE_M,
                       block_size_k=cfg.BLOCK_SIZE_K, M=rows_a, K=k, bits=bits, config_use_td=cfg.use_td,
                       a_permuted=perm)  # fmt: skip
        if cfg.per_pair:
            kernel, form = "triton per-pair", f"{pair_step(bits, on_words, opts.pair_step_math)} step"
        else:
            kernel, form = "triton tl.dot", f"{dot_form(bits, cfg, k, on_words, td.use_td_b, opts.dot_nibbles)} dot"
            if cfg.swap_ab:
                form += ", swapped (weights as the MMA's M)"
        tds = "off" if not td.use_td_b else ("B + A-gather" if td.use_gather else "B")
        if gemm == "gate/up" and cfg.fuse_act:
            form += f", {problem.activation} fused"
        if gemm == "gate/up" and problem.has_g_idx:
            form += ", A gathered into pair rows first" if rows_form else ", A gathered in its loads (act order)"
        rows.append(GemmPlan(gemm, kernel, (cfg.BLOCK_SIZE_M, cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K), cfg.SPLIT_K,
                             cfg.num_warps, cfg.num_stages, form, tds, choice.source))  # fmt: skip
    return tuple(rows)


def _triton_plan(problem: MoEProblem, m: int, device: DeviceSpec, layer_backend: str, why: list[str]) -> LaunchPlan:
    from vllm_wna16_plugin.kernels.triton.configs import prefill_tiles_apply, triton_launch

    launch = triton_launch(m, problem.num_experts, problem.hidden, problem.intermediate, problem.top_k,
                           problem.group_size_w13, problem.group_size_w2, problem.scheme.bits, device.name,
                           problem.options.kernel.config_dir, configs_dir(device),
                           prefill_tiles_apply(device.platform, device.sm))  # fmt: skip
    gemms = _triton_gemms(problem, m, device, launch)
    per_pair = launch.gemm1.config.per_pair and launch.gemm2.config.per_pair
    align = "none (per-pair kernels)" if per_pair else "vLLM moe_align_block_size"
    if not per_pair and device.platform == "interpreter":
        align = "torch alignment (interpreter)"
    return LaunchPlan(m, "triton", layer_backend, device, launch, gemms, align, False, tuple(why))


def _cuda_plan(problem: MoEProblem, m: int, device: DeviceSpec, layer_backend: str, why: list[str]) -> LaunchPlan:
    from vllm_wna16_plugin.kernels.cuda_ops import cuda_launch

    opts = problem.options.kernel
    groups1 = problem.hidden // problem.group_size_w13
    groups2 = problem.intermediate // problem.group_size_w2
    launch = cuda_launch(m, problem.top_k, problem.num_experts, problem.hidden, problem.intermediate, groups1,
                         groups2, problem.scheme.bits, problem.global_num_experts, device, opts)  # fmt: skip
    source = "cuda_ops.gemm_config rule"
    names = {"auto": "cuda mma", "mma": "cuda mma", "gemv": "cuda gemv", "stream": "cuda stream"}
    rows = []
    for gemm, cfg, kernel, form in (
        ("gate/up", launch.gemm1, launch.kernel1, f"{problem.activation} fused" if launch.fuse_activation else ""),
        ("down", launch.gemm2, launch.kernel2, ""),
    ):
        rows.append(GemmPlan(gemm, names[kernel], (cfg.block_size_m, cfg.block_size_n, cfg.block_size_k),
                             form=form, source=source))  # fmt: skip
    if opts.cuda_kernel == "auto" and opts.cuda_stream and launch.gemm1.block_size_m <= 8:
        verdict = ">=" if launch.kernel1 == "stream" else "<"
        why.append(f"stream kernel: {launch.pairs_per_warp:.1f} pairs of K steps per warp {verdict} "
                   f"{opts.cuda_stream_min_pairs_per_warp:g} (KernelOptions.cuda_stream_min_pairs_per_warp)")  # fmt: skip
    if problem.has_g_idx:
        why.append("act order: GEMM1 reads x gathered per routed pair in its expert's K order (one gather of "
                   f"M*top_k={m * problem.top_k} rows; cuda_ops.act_order_rows)")  # fmt: skip
    align = "plugin one-block alignment (int32 ids)" if launch.own_align else "vLLM moe_align_block_size"
    return LaunchPlan(m, "cuda", layer_backend, device, launch, tuple(rows), align, launch.programmatic, tuple(why))


def _hopper_plan(problem: MoEProblem, m: int, device: DeviceSpec, layer_backend: str, why: list[str]) -> LaunchPlan:
    from vllm_wna16_plugin.backends.base import pairs_per_expert
    from vllm_wna16_plugin.backends.hopper import hopper_tile
    from vllm_wna16_plugin.kernels.hopper_ops import HopperLaunch

    rows = pairs_per_expert(problem, m)
    launch = HopperLaunch(hopper_tile(problem, rows))
    source = f"hopper_ops.token_tile over the built widths: {rows:.1f} rows per hit expert"
    gemms = tuple(
        GemmPlan(gemm, "cutlass grouped", (128, launch.tile, 64), form=form, tensor_descriptors="TMA", source=source)
        for gemm, form in (("gate/up", "weights as the MMA's M, warp-specialised"), ("down", "weights as the MMA's M"))
    )
    why.append(f"{problem.activation} and the weighted sum in the plugin's own kernels between the grouped GEMMs")
    return LaunchPlan(m, "hopper", layer_backend, device, launch, gemms, "plugin device routing (no host sync)",
                      False, tuple(why))  # fmt: skip


def _hopper_takes(problem: MoEProblem, m: int, device: DeviceSpec, why: list[str]) -> bool:
    """backends/hopper.hopper_takes, with the plan's line saying what it read."""
    from vllm_wna16_plugin.backends.base import pairs_per_expert
    from vllm_wna16_plugin.backends.hopper import HOPPER_MIN_ROWS, HOPPER_RULE_SOURCE, hopper_takes

    taken = hopper_takes(problem, m, device)
    rows = pairs_per_expert(problem, m)
    why.append(f"M={m}: {rows:.1f} rows per hit expert {'>=' if taken else '<'} {HOPPER_MIN_ROWS:g}: "
               f"{'hopper' if taken else 'not hopper'} ({HOPPER_RULE_SOURCE})")  # fmt: skip
    return taken


def plan(
    problem: MoEProblem,
    num_tokens: int,
    device: DeviceSpec | None = None,
    *,
    selection: Selection | None = None,
) -> LaunchPlan:
    """The launch plan of `num_tokens` tokens through the layer `problem` on `device` (default: the
    layer's, backends.base.layer_device). selection: the layer's (default: auto's, oracle.select_backend),
    whose problem is the one planned. Raises ValueError where selection does (no backend can run it)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r} must be a positive int")
    if selection is None:
        selection = select_backend(problem)
    asked = selection.source if selection.requested == "auto" else f"{selection.source}={selection.requested}"
    return _plan(
        selection.problem, num_tokens, device or layer_device(selection.problem), selection.backend.name, asked
    )


@functools.lru_cache(maxsize=8192)
def _plan(problem: MoEProblem, num_tokens: int, device: DeviceSpec, layer_backend: str, asked: str) -> LaunchPlan:
    """plan()'s answer, one object per (layer shape, batch size, device, backend) in the process: the layers
    of a model share their plans (a model has a few shapes; vLLM runs every batch size up to its token
    budget)."""
    why = [f"layer backend {layer_backend!r} ({asked})"]
    runs = layer_backend
    partner = problem.options.compose_with
    auto = layer_backend in COMPOSABLE and not problem.options.explicit
    with_hopper = problem.options.hopper and auto
    # the hopper rule goes before Marlin's (its tiles beat Marlin wherever it takes a batch), after Humming's
    # (backends/hopper.py: HOPPER_BEFORE)
    from vllm_wna16_plugin.backends.hopper import HOPPER_BEFORE

    if with_hopper and partner in HOPPER_BEFORE and _hopper_takes(problem, num_tokens, device, why):
        return _hopper_plan(problem, num_tokens, device, layer_backend, why)
    if partner and auto:
        p = partner_named(partner)
        taken = p.takes(problem, num_tokens, device)
        why.append(p.why(problem, num_tokens, taken))
        if taken:
            return LaunchPlan(num_tokens, partner, layer_backend, device, why=tuple(why))
    if with_hopper and partner not in HOPPER_BEFORE and _hopper_takes(problem, num_tokens, device, why):
        return _hopper_plan(problem, num_tokens, device, layer_backend, why)
    if layer_backend == "hopper":
        return _hopper_plan(problem, num_tokens, device, layer_backend, why)
    if layer_backend == "cuda" and not problem.options.explicit:
        from vllm_wna16_plugin.backends.cuda import layer_ranges

        ranges, source = layer_ranges(problem, device)
        shown = ", ".join(f"[{lo}, {hi}]" for lo, hi in ranges) or "none"
        inside = crossover.in_ranges(num_tokens, ranges)
        why.append(
            f"M={num_tokens} {'inside' if inside else 'outside'} cuda's ranges {shown} on {device.name} ({source})"
        )
        runs = "cuda" if inside else "triton"
    if runs == "triton":
        return _triton_plan(problem, num_tokens, device, layer_backend, why)
    if runs == "cuda":
        return _cuda_plan(problem, num_tokens, device, layer_backend, why)
    why.append(registry()[layer_backend].description)
    return LaunchPlan(num_tokens, runs, layer_backend, device, why=tuple(why))


def plan_backends(selection: Selection) -> tuple[str, ...]:
    """The backends a layer's plans can name: its own, triton for a `cuda` layer under auto, the vLLM
    kernel it is composed with and the hopper kernel where it holds that copy (compose.py)."""
    name, options = selection.backend.name, selection.problem.options
    names = ("cuda", "triton") if name == "cuda" and not options.explicit else (name,)
    if options.compose_with and name in COMPOSABLE and not options.explicit:
        names += (options.compose_with,)
    if options.hopper and name in COMPOSABLE and not options.explicit:
        names += ("hopper",)
    return names


class _OpaqueState(Exception):
    """A runner's state holds a tensor where _tensor_leaves cannot follow it (refresh_in_place then rebuilds)."""


def _tensor_leaves(obj: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    """Every tensor reachable from a runner's state through dataclass fields, dicts, lists and tuples, with its
    path, in a fixed order. Other objects (vLLM's functions, modules, scalar types, Humming's configs) must hold
    no tensor among their own attributes or a partial's arguments: else _OpaqueState."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        items = sorted(obj.items(), key=lambda kv: str(kv[0]))
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    else:
        if isinstance(obj, functools.partial):
            held = [*obj.args, *obj.keywords.values()]
        elif isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
            held = []
        else:
            held = list(getattr(obj, "__dict__", {}).values())
        if any(isinstance(v, torch.Tensor) for v in held):
            raise _OpaqueState(f"{'.'.join(map(str, path)) or 'state'}: a {type(obj).__name__} holds tensors")
        return []
    return [leaf for key, value in items for leaf in _tensor_leaves(value, (*path, key))]


MAX_LAYER_PLANS = 1024  # a layer's index of plans by batch size (the plans themselves are shared: _plan)


class LayerRunner:
    """One layer's selection, the prepared state of each backend its plans name, and its plan per batch size.

    `run` looks the batch size's plan up (made once per size: the hot path is a dict lookup) and hands
    the batch to that plan's backend with the plan."""

    def __init__(self, selection: Selection, tensors: KernelTensors) -> None:
        self.selection = selection
        self.problem = selection.problem
        self.device = layer_device(self.problem)
        backends = registry()
        self.backends: dict[str, Backend] = {n: backends[n] for n in plan_backends(selection)}
        has_act_order = tensors.w13_g_idx is not None or tensors.w2_g_idx is not None
        if has_act_order and tensors.a_perm is None and all(b.sorted_act_order for b in self.backends.values()):
            tensors = sort_act_order(tensors, self.problem.scheme.bits)  # once, shared by cuda and triton
        self.tensors = tensors  # the layer's weights as its backends read them (sorted act order included)
        self.states: dict[str, Any] = {n: b.prepare(self.problem, tensors) for n, b in self.backends.items()}
        for n, b in self.backends.items():  # plan the shape that runs (triton pads act order on a TP rank)
            prepared = b.prepared_problem(self.problem, self.states[n])
            if prepared is not self.problem:
                self.problem = prepared
                self.selection = dataclasses.replace(selection, problem=prepared)
        self._plans: dict[int, LaunchPlan] = {}

    def plan(self, num_tokens: int) -> LaunchPlan:
        found = self._plans.get(num_tokens)
        if found is None:
            if len(self._plans) >= MAX_LAYER_PLANS:  # eager batches of every size: keep the index bounded
                self._plans.clear()
            found = self._plans[num_tokens] = plan(self.problem, num_tokens, self.device, selection=self.selection)
        return found

    def refresh_in_place(self, new: LayerRunner) -> bool:
        """Take `new`'s weights (a runner built on reloaded weights of the same layer) into this runner's own
        tensors, copying each into the one in the same place: the packed weights, the sorted act-order layout and
        every backend's prepared copy (group-major scales, Marlin's and Humming's layouts). Kernels, and CUDA
        graphs captured on them, keep reading these tensors, and `new`'s copies can be dropped. False (nothing
        copied) where the two differ in problem, backends or the shape, dtype or device of any tensor, or where a
        state holds tensors the walk cannot follow (_tensor_leaves)."""
        if new.problem != self.problem or new.backends.keys() != self.backends.keys():
            return False
        try:
            mine, theirs = _tensor_leaves((self.tensors, self.states)), _tensor_leaves((new.tensors, new.states))
        except _OpaqueState:
            return False
        if [path for path, _ in mine] != [path for path, _ in theirs] or any(
            (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device)
            for (_, a), (_, b) in zip(mine, theirs, strict=True)
        ):
            return False
        with torch.no_grad():
            for (_, a), (_, b) in zip(mine, theirs, strict=True):
                if a.data_ptr() != b.data_ptr() or a.stride() != b.stride():
                    a.copy_(b)
        return True

    def run(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        p = self._plans.get(x.shape[0]) or self.plan(max(1, x.shape[0]))
        return self.backends[p.backend].run(
            self.problem, self.states[p.backend], x, topk_weights, topk_ids, expert_map=expert_map, plan=p
        )


__all__ = [
    "GemmPlan",
    "LaunchPlan",
    "LayerRunner",
    "plan",
    "plan_backends",
]
