"""`vllm-wna16 tune MODEL_DIR`: time the launch plan's candidates for a checkpoint's MoE layers on this GPU,
and keep the winners in the user's own tables (user_tables.py), which every later plan on this GPU prefers.

For each distinct MoE scheme that loading resolves (doctor's resolution, one rank at --tp) and each batch
size M, on random weights of the layer's shape and random routing:

  1. GEMM1's Triton config: the shipped plan's, then candidates.stage_a's tiles and stage_b around the
     fastest (GEMM1 also with the activation fused), each timed as the whole layer with GEMM2 at the shipped
     plan's config; then GEMM2's the same way, with GEMM1's winner;
  2. the `cuda` backend's layer, where it can run the shape.

Every candidate's output is compared with the float32 reference on the same inputs first (relative RMS
below 1e-2); a wrong or failing one is dropped and listed. A time is the median of CUDA-graph replays
over rotating weight copies (L2 cold). Written: both GEMMs' Triton configs (configs.py's file format),
the batch sizes where cuda beat the best Triton by crossover.MIN_GAIN (crossover.py's format), and a
record of every time. --budget-s is shared out over the (scheme, M) slots still to come.

Opt-in and explicit: nothing is tuned at import or load. A later `LLM(...)` or `vllm serve` on this GPU,
driver and plugin version reads the tables once per layer shape (VLLM_WNA16_PLUS_TUNED=0 ignores them).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_wna16_plugin import _vllm, crossover
from vllm_wna16_plugin.backends import KernelTensors, MoEProblem, RunOptions, registry
from vllm_wna16_plugin.backends.cuda import layer_key
from vllm_wna16_plugin.kernels.options import DeviceSpec
from vllm_wna16_plugin.kernels.triton.candidates import stage_a, stage_b
from vllm_wna16_plugin.kernels.triton.configs import (
    TritonMoEConfig,
    choose_triton_moe_config,
    config_file_name,
    gemv_bound,
    prefill_tiles_apply,
    triton_launch,
)
from vllm_wna16_plugin.kernels.triton.configs import _load as _load_configs
from vllm_wna16_plugin.user_tables import ENV_DIR, tuned_dir, write_atomically

logger = _vllm.init_logger(__name__)

DEFAULT_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# the largest --m: beyond a serving step's size (vLLM's max_num_batched_tokens), and where the bench's own
# activations and float32 reference would no longer fit a GPU for large models (a bigger one was a traceback)
MAX_M = 65536
MAX_REL_RMS = 1e-2  # a candidate whose output is further from the float32 reference is wrong
L2_COLD_BYTES = 200e6  # rotating weight copies touch at least this much per replay (H200 L2: 50 MB)
MAX_COPIES = 8

Timer = Callable[[Sequence[Callable[[], object]]], float]


def graph_time_us(fns: Sequence[Callable[[], object]], reps: int = 10) -> float:
    """Median µs per call of a CUDA graph that calls every fn once (each on its own weight copy)."""
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return statistics.median(times)


class LayerBench:
    """One layer's random weights (and rotating copies), the routing of M tokens, its reference output, and
    the calls a tuner times: the Triton layer with a (gemm1, gemm2) config pair, or the cuda backend."""

    def __init__(self, problem: MoEProblem, device: torch.device, seed: int = 0) -> None:
        self.problem, self.device = problem, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        p, bits = problem, problem.scheme.bits
        self.tensors = self._random_tensors()
        hit_bytes = sum(t.numel() * t.element_size() for t in self.tensors.weights()) / p.num_experts
        self.bytes_per_expert = hit_bytes
        self.copies = [self.tensors]
        self.bits = bits
        self._inputs: dict[int, tuple] = {}

    def _random_tensors(self) -> KernelTensors:
        p, bits, dev, gen = self.problem, self.problem.scheme.bits, self.device, self.gen
        E, H, I = p.num_experts, p.hidden, p.intermediate  # noqa: N806, E741
        g1, g2 = H // p.group_size_w13, I // p.group_size_w2

        def q(*shape):
            return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=gen)

        def s(*shape, k):
            return ((0.5 + torch.rand(*shape, device=dev, generator=gen)) / (k**0.5 * 2 ** (bits - 1))).to(p.act_dtype)

        zp = p.scheme.has_zero_point
        return KernelTensors(
            q(E, 2 * I, H * bits // 8), q(E, H, I * bits // 8), s(E, 2 * I, g1, k=H), s(E, H, g2, k=I),
            q(E, 2 * I * bits // 8, g1) if zp else None, q(E, H * bits // 8, g2) if zp else None,
        )  # fmt: skip

    def use_copies(self, m: int) -> None:
        """Rotating copies of the weights so that one replay touches >= L2_COLD_BYTES (decode reads weights
        from DRAM in serving; one copy would be served from L2 after the first call)."""
        from vllm_wna16_plugin.kernels.triton.configs import expected_experts_hit

        hit = expected_experts_hit(m * self.problem.top_k, self.problem.num_experts)
        want = max(1, min(MAX_COPIES, math.ceil(L2_COLD_BYTES / max(1.0, hit * self.bytes_per_expert))))
        while len(self.copies) < want:
            self.copies.append(dataclasses.replace(
                self.tensors, **{f: getattr(self.tensors, f).clone() for f in
                                 ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales")}))  # fmt: skip
        del self.copies[want:]

    def inputs(self, m: int):
        if m not in self._inputs:
            p, gen, dev = self.problem, self.gen, self.device
            x = torch.randn(m, p.hidden, device=dev, generator=gen).to(p.act_dtype)
            logits = torch.randn(m, p.num_experts, device=dev, generator=gen)
            w, ids = torch.topk(logits.softmax(-1), p.top_k, dim=-1)
            from vllm_wna16_plugin.reference import fused_moe_wna16_ref

            t = self.tensors
            ref = fused_moe_wna16_ref(x, *t.weights(), w, ids.to(torch.int32), bits=self.bits, w13_qzeros=t.w13_qzeros,
                                      w2_qzeros=t.w2_qzeros, activation=p.activation).float()  # fmt: skip
            self._inputs[m] = (x, w, ids.to(torch.int32), ref)
        return self._inputs[m]

    def triton_calls(self, m: int, configs: tuple[TritonMoEConfig, TritonMoEConfig]) -> list[Callable[[], object]]:
        from vllm_wna16_plugin.kernels.triton.fused_moe import fused_moe_wna16_triton

        x, w, ids, _ = self.inputs(m)
        align = _vllm.moe_align_block_size_fn() if self.device.type == "cuda" else None
        p = self.problem
        return [
            lambda t=t: fused_moe_wna16_triton(
                x, *t.weights(), w, ids, bits=self.bits, w13_qzeros=t.w13_qzeros, w2_qzeros=t.w2_qzeros,
                activation=p.activation, configs=configs, align_fn=align, use_td=None,  # TD as serving decides
            )
            for t in self.copies
        ]  # fmt: skip

    def cuda_calls(self, m: int) -> list[Callable[[], object]] | None:
        """The cuda backend's layer on each copy, or None where it cannot run this shape."""
        from vllm_wna16_plugin.launch_plan import LayerRunner
        from vllm_wna16_plugin.oracle import select_backend

        problem = dataclasses.replace(self.problem, options=RunOptions(explicit=True))
        if registry()["cuda"].incompatibility_reason(problem) is not None:
            return None
        x, w, ids, _ = self.inputs(m)
        runners = [LayerRunner(select_backend(problem, "cuda", "tune"), t) for t in self.copies]
        return [lambda r=r: r.run(x, w, ids) for r in runners]

    def error(self, m: int, call: Callable[[], object]) -> float:
        """Relative RMS of a call's output against the float32 reference."""
        ref = self.inputs(m)[3]
        out = call().float()
        return float((out - ref).norm() / ref.norm())


def _stop_on_a_device_error(device: torch.device, what) -> None:
    """A candidate that faulted the GPU leaves the context unusable: every later time would be a failure and
    the tables half a run. Stop the run (nothing is written) instead of carrying on."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except RuntimeError as exc:
        raise RuntimeError(f"tune: {what} left a CUDA error ({exc}); stopping without writing tables. Run tune "
                           "again with --m excluding this batch size, and report the config") from exc  # fmt: skip


@dataclass
class SlotResult:
    """One (scheme, M): the times of every candidate that passed, the winners, and the rejected ones."""

    m: int
    shipped: tuple[TritonMoEConfig, TritonMoEConfig]
    shipped_us: float | None = None
    gemm1: dict[TritonMoEConfig, float] = field(default_factory=dict)
    gemm2: dict[TritonMoEConfig, float] = field(default_factory=dict)
    best: tuple[TritonMoEConfig, TritonMoEConfig] | None = None
    best_us: float | None = None
    cuda_us: float | None = None
    rejected: list[str] = field(default_factory=list)


def tune_slot(
    bench: LayerBench, m: int, device: DeviceSpec, *, timer: Timer, deadline: float, max_candidates: int | None = None
) -> SlotResult:
    """Coordinate descent over the Triton configs of one batch size, then the cuda layer (module docstring)."""
    p = bench.problem
    prefill = prefill_tiles_apply(device.platform, device.sm)
    shipped = triton_launch(m, p.num_experts, p.hidden, p.intermediate, p.top_k, p.group_size_w13,
                            p.group_size_w2, p.scheme.bits, device.name, prefill_tiles=prefill).configs  # fmt: skip
    result = SlotResult(m, shipped)
    bench.use_copies(m)

    def measure(pair, timed: dict, key: TritonMoEConfig) -> None:
        if key in timed or (time.time() > deadline and timed):
            return  # past this slot's share: keep what is timed (at least the shipped config)
        try:
            calls = bench.triton_calls(m, pair)
            err = bench.error(m, calls[0])
            if not err < MAX_REL_RMS:
                result.rejected.append(f"{pair}: relative RMS {err:.3g}")
                return
            timed[key] = timer(calls)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is dropped
            result.rejected.append(f"{pair}: {type(exc).__name__}: {str(exc)[:100]}")
            _stop_on_a_device_error(bench.device, pair)

    def search(which: int, fixed: TritonMoEConfig, timed: dict) -> TritonMoEConfig:
        n, k, gs = ((2 * p.intermediate, p.hidden, p.group_size_w13) if which == 1
                    else (p.hidden, p.intermediate, p.group_size_w2))  # fmt: skip
        pair = (lambda c: (c, fixed)) if which == 1 else (lambda c: (fixed, c))
        first = shipped[which - 1]
        found = [first] + [
            c
            for c in stage_a(
                m,
                p.num_experts,
                n,
                k,
                p.top_k,
                gs,
                p.scheme.bits,
                prefill,
                gemv_bound(p.scheme.bits, p.hidden, p.intermediate),
            )
            if c != first
        ]
        for c in found[: None if max_candidates is None else max_candidates]:
            measure(pair(c), timed, c)
        if not timed:
            return first
        best = min(timed, key=timed.get)
        around = stage_b(best, m, p.num_experts, n, k, p.top_k, False, p.scheme.bits, fuse=which == 1)
        for c in around[: None if max_candidates is None else max_candidates]:
            measure(pair(c), timed, c)
        return min(timed, key=timed.get)

    best1 = search(1, shipped[1], result.gemm1)
    result.shipped_us = result.gemm1.get(shipped[0])
    best2 = search(2, best1, result.gemm2)
    if result.gemm2:
        result.best, result.best_us = (best1, best2), result.gemm2[best2]
    cuda = bench.cuda_calls(m)
    if cuda is not None:
        try:
            err = bench.error(m, cuda[0])
            if err < MAX_REL_RMS:
                result.cuda_us = timer(cuda)
            else:
                result.rejected.append(f"cuda: relative RMS {err:.3g}")
        except Exception as exc:  # noqa: BLE001
            result.rejected.append(f"cuda: {type(exc).__name__}: {str(exc)[:100]}")
    return result


def write_tables(problem: MoEProblem, results: Sequence[SlotResult], device: DeviceSpec, record: dict) -> Path:
    """Merge this run's winners into the device's tuned directory (user_tables.tuned_dir); returns it."""
    root = tuned_dir(device, must_exist=False)
    if root is None:
        raise ValueError(f"{device.describe()} has no device name or driver version: nothing can be keyed")
    p, bits = problem, problem.scheme.bits
    configs_dir = root / "configs"
    configs_dir.mkdir(parents=True, exist_ok=True)
    for which, (n, k, gs) in enumerate(((2 * p.intermediate, p.hidden, p.group_size_w13),
                                        (p.hidden, p.intermediate, p.group_size_w2))):  # fmt: skip
        entries = {str(r.m): r.best[which].to_dict() for r in results if r.best is not None}
        if not entries:
            continue
        path = configs_dir / config_file_name(p.num_experts, n, k, gs, bits, device.name)
        try:  # the existing table through its loader (validated): a damaged one is replaced, not this run lost
            kept = {str(m): c.to_dict() for m, c in (_load_configs(path) or {}).items()}
        except (ValueError, RecursionError) as exc:
            logger.warning("moe_wna16_plus: replacing the damaged tuned table %s (%s)", path, exc)
            kept = {}
        merged = {**kept, **entries}
        write_atomically(path, json.dumps({m: merged[m] for m in sorted(merged, key=int)}, indent=1) + "\n")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    runs = root / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_path = runs / f"{stamp}-{layer_key(p).replace(',', '_').replace('=', '')}.json"
    write_atomically(run_path, json.dumps(record, indent=1) + "\n")
    both = {r.m: (r.cuda_us, r.best_us) for r in results if r.cuda_us is not None and r.best_us is not None}
    if both:
        ranges = crossover.measured_ranges(both)
        crossover.write_crossovers({layer_key(p): {"cuda_m_ranges": ranges, "source": str(run_path)}},
                                   device.name, root / "crossover")  # fmt: skip
    _load_configs.cache_clear()  # this process plans with the new tables from now on
    choose_triton_moe_config.cache_clear()
    from vllm_wna16_plugin import launch_plan

    launch_plan._plan.cache_clear()
    return root


def _record(problem: MoEProblem, device: DeviceSpec, results: Sequence[SlotResult]) -> dict:
    return {
        "layer": layer_key(problem), "top_k": problem.top_k, "dtype": str(problem.act_dtype), "device": device.name,
        "driver": device.driver, "sms": device.sm_count, "torch": torch.__version__,
        "triton": _version("triton"), "vllm": _vllm.vllm_version(), "plugin": _version("vllm-wna16-plugin"),
        "slots": [{
            "M": r.m, "shipped": [c.to_dict() for c in r.shipped], "shipped_us": r.shipped_us,
            "best": [c.to_dict() for c in r.best] if r.best else None, "best_us": r.best_us, "cuda_us": r.cuda_us,
            "gemm1_us": {json.dumps(c.to_dict()): us for c, us in r.gemm1.items()},
            "gemm2_us": {json.dumps(c.to_dict()): us for c, us in r.gemm2.items()},
            "rejected": r.rejected,
        } for r in results],
    }  # fmt: skip


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def summary_line(r: SlotResult) -> str:
    """One row of the run's table: shipped vs tuned Triton, cuda, and what the plan will take."""
    fmt = lambda us: "-" if us is None else f"{us:.1f}"  # noqa: E731
    chosen = "triton"
    if r.cuda_us is not None and r.best_us is not None and r.cuda_us < (1 - crossover.MIN_GAIN) * r.best_us:
        chosen = "cuda"
    gain = ""
    fastest = min(u for u in (r.best_us, r.cuda_us) if u is not None) if (r.best_us or r.cuda_us) else None
    if r.shipped_us and fastest:
        gain = f"{r.shipped_us / fastest:.2f}x"
    return f"{r.m:>6} {fmt(r.shipped_us):>12} {fmt(r.best_us):>12} {fmt(r.cuda_us):>10} {chosen:>7} {gain:>8}"


def tune_problem(
    problem: MoEProblem,
    ms: Sequence[int],
    device: DeviceSpec,
    torch_device: torch.device,
    *,
    timer: Timer,
    budget_s: float,
    slots_after: int = 0,
    max_candidates: int | None = None,
    progress: Callable[[str], None] = print,
) -> list[SlotResult]:
    """Every batch size of one scheme (tune_slot), each slot an equal share of the budget left."""
    problem = dataclasses.replace(problem, has_g_idx=False, act_order_issue=None, options=RunOptions())
    bench = LayerBench(problem, torch_device)
    results = []
    deadline = time.time() + budget_s
    for i, m in enumerate(ms):
        slot_end = time.time() + (deadline - time.time()) / (len(ms) - i + slots_after)
        r = tune_slot(bench, m, device, timer=timer, deadline=slot_end, max_candidates=max_candidates)
        results.append(r)
        fmt = lambda us: "-" if us is None else f"{us:.1f} us"  # noqa: E731
        progress(f"[{i + 1}/{len(ms)}] {layer_key(problem)} M={m}: {len(r.gemm1)}+{len(r.gemm2)} Triton configs "
                 f"timed, {len(r.rejected)} rejected; shipped {fmt(r.shipped_us)}, tuned {fmt(r.best_us)}, "
                 f"cuda {fmt(r.cuda_us)}")  # fmt: skip
    return results


# ---------------------------------------------------------------- CLI


def add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="checkpoint directory with config.json (only config.json is read)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size the model is served at (default 1)")
    p.add_argument("--ep", action="store_true",
                   help="the model is served with --enable-expert-parallel: tune one EP rank's whole experts")  # fmt: skip
    p.add_argument("--m", default=",".join(map(str, DEFAULT_M)),
                   help="batch sizes (tokens per step, 1..65536) to tune, comma-separated (default %(default)s)")  # fmt: skip
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="activation dtype")
    p.add_argument("--budget-s", type=float, default=600.0, help="seconds of exploration in all (default 600)")
    p.add_argument("--reps", type=int, default=10, help="CUDA-graph replays per time (median; default 10)")


def run_tune(args) -> int:
    """Errors propagate: cli.main turns them into one line on stderr and exit status 2."""
    from vllm_wna16_plugin.tools.doctor import moe_problems, resolve_checkpoint

    try:
        ms = [int(v) for v in str(args.m).split(",")]
    except ValueError:
        raise ValueError(f"--m={args.m!r} is not a comma-separated list of token counts, e.g. 1,8,64") from None
    if not ms or any(m < 1 for m in ms):
        raise ValueError(f"--m={args.m!r}: every batch size must be a positive int")
    if max(ms) > MAX_M:
        raise ValueError(f"--m={args.m!r}: batch size {max(ms)} is larger than {MAX_M} tokens; supported: 1..{MAX_M}")
    if args.reps < 1:
        raise ValueError(f"--reps={args.reps}: the replays per time (a median) must be at least 1")
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        raise ValueError(f"--budget-s={args.budget_s}: the exploration budget must be a positive number of seconds")
    resolve_checkpoint(
        args.model_dir, args.tp, ep=args.ep
    )  # the model's own errors first (path, config, --tp): GPU-blind
    if not torch.cuda.is_available():
        raise ValueError("tune times kernels on this machine's NVIDIA GPU, and torch sees none "
                         "(torch.cuda.is_available() is False); `vllm-wna16 doctor` plans without one")  # fmt: skip
    device = DeviceSpec.of(torch.device("cuda"))
    if device.platform != "cuda" or not device.driver:
        raise ValueError(f"tune needs an NVIDIA GPU with a known driver version; found {device.describe()}")
    dtype = getattr(torch, args.dtype)
    problems = moe_problems(args.model_dir, args.tp, device.platform, device.sm, dtype, ep=args.ep)
    root = tuned_dir(device, must_exist=False)
    print(f"tune: {len(problems)} MoE scheme(s) x {len(ms)} batch sizes on {device.describe()}, driver "
          f"{device.driver}; budget {args.budget_s:.0f} s; tables -> {root} (${ENV_DIR} moves them)", flush=True)  # fmt: skip
    deadline = time.time() + args.budget_s
    for i, (group, problem) in enumerate(problems):
        print(f"\n{group.describe()} (layers {group.layers[0]}..{group.layers[-1]}): {problem.describe()}", flush=True)
        results = tune_problem(problem, ms, device, torch.device("cuda"), timer=lambda fns: graph_time_us(fns, args.reps),
                               budget_s=max(0.0, deadline - time.time()), slots_after=(len(problems) - i - 1) * len(ms),
                               progress=lambda line: print(line, flush=True))  # fmt: skip
        where = write_tables(problem, results, device, _record(problem, device, results))
        print(f"{'M':>6} {'shipped us':>12} {'tuned us':>12} {'cuda us':>10} {'runs':>7} {'gain':>8}")
        for r in results:
            print(summary_line(r))
        print(f"written: {where}")
    print("\nLater runs on this GPU, driver and plugin version use these tables (doctor on this machine shows "
          "the plan; VLLM_WNA16_PLUS_TUNED=0 ignores them).")  # fmt: skip
    return 0


__all__ = ["LayerBench", "SlotResult", "add_tune_args", "graph_time_us", "run_tune", "tune_problem", "tune_slot",
           "write_tables"]  # fmt: skip
