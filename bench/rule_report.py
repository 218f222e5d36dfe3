"""The launch plan against issue 22's targets, from a `bench_moe.py --catalog` run's CSV (no GPU).

    python bench/rule_report.py bench/results/h200/2026-12-05-<commit>-dev.csv [more CSVs] [--md OUT.md]

For every catalog shape of the CSVs (names like "Qwen3-30B-A3B@tp4", bench/model_catalog.py), each batch size:

- speed-up of `plugin-auto` over vLLM's Marlin MoE and over Humming (peer time / auto time; > 1: faster), and
  of auto composed with Humming (vLLM 0.33-0.34) or with Marlin (0.26-0.32; compose.py), each from the run's
  columns as its rule picks them;
- auto against the plugin's best fixed kernel of the same run (min of plugin-triton-auto and plugin-cuda):
  auto / best, the target being at most 1.10;
- the cuda shape rule's decision (backends/cuda.rule_takes) against the faster of triton and cuda, and
  the plan's (launch_plan.plan: a measured crossover first, then the rule), so a rule can be judged on
  shapes it was never fitted on.

Targets (issue 22, H200): auto >= 1.0x Marlin at every M <= 64, >= 0.9x at M = 256, geomean >= 1.2x at
M <= 16, never more than 10% slower than the plugin's best fixed kernel. The development and validation
sets are reported side by side; the rules are fitted on the first only.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_catalog import CATALOG  # noqa: E402
from model_shapes import Shape, model_moe_shape  # noqa: E402

TRITON, CUDA, AUTO, HUMMING = "plugin-triton-auto", "plugin-cuda", "plugin-auto", "vllm-humming"
COMPOSED = "auto+humming"
WITH_MARLIN = "auto+marlin"
PEERS = ("vllm-marlin", "vllm-humming")
TP_SIZES = (1, 2, 4, 8)


def catalog_shapes() -> dict[str, tuple[str, Shape]]:
    """shape name -> (the model's set, its Shape), for every catalog model at every TP size it splits at."""
    out = {}
    for name, (split, cfg) in CATALOG.items():
        for tp in TP_SIZES:
            try:
                s = model_moe_shape(cfg, tp, None, None, name=name)
            except ValueError:
                continue
            out[s.name] = (split, s)
    return out


def problem_of(s: Shape, zero_points: bool = False):
    """The MoEProblem the plugin plans for this shape (GPTQ layout, sm90, plan only; zero points as the run's
    --zero-points)."""
    from vllm_wna16_plugin.backends import MoEProblem, RunOptions
    from vllm_wna16_plugin.scheme import PackFormat, WNA16Scheme

    scheme = WNA16Scheme(s.bits, s.gs, zero_points, PackFormat.GPTQ, source="rule_report")
    return MoEProblem(scheme=scheme, hidden=s.H, intermediate=s.I, num_experts=s.E, global_num_experts=s.E,
                      top_k=s.top_k, group_size_w13=s.group_w13, group_size_w2=s.group_w2, platform="cuda", sm=90,
                      options=RunOptions(plan_only=True))  # fmt: skip


def read_times(paths: list[Path]) -> dict[tuple[str, int], dict[str, float]]:
    """(shape, M) -> provider -> median µs (a later file's value replaces an earlier one's)."""
    times: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r.get("median_us"):
                    times[(r["shape"], int(r["M"]))][r["provider"]] = float(r["median_us"])
    return times


@dataclass
class Point:
    split: str
    shape: str
    m: int
    times: dict[str, float]
    rule_cuda: bool | None  # the shape rule's decision (None: the rule does not decide this M)
    plan_backend: str | None
    humming: bool = False  # the Humming rule's decision (backends/humming.humming_takes)
    marlin: bool = False  # the Marlin rule's decision (backends/marlin.marlin_takes)

    @property
    def best_fixed(self) -> float | None:
        t = [self.times[p] for p in (TRITON, CUDA) if p in self.times]
        return min(t) if t else None

    @property
    def composed(self) -> float | None:
        """auto composed with Humming (compose.py), from the run's columns: Humming's time where the rule
        takes it, else plugin-auto's."""
        return self.times.get(HUMMING) if self.humming else self.times.get(AUTO)

    @property
    def with_marlin(self) -> float | None:
        """auto composed with Marlin (compose.py, a vLLM without Humming), from the run's columns: Marlin's
        time where its rule takes it, else plugin-auto's."""
        return self.times.get("vllm-marlin") if self.marlin else self.times.get(AUTO)

    def speedup(self, peer: str, of: str = AUTO) -> float | None:
        mine = {COMPOSED: self.composed, WITH_MARLIN: self.with_marlin}.get(of) or self.times.get(of)
        if peer in self.times and mine:
            return self.times[peer] / mine
        return None

    @property
    def rule_time(self) -> float | None:
        """The time of the kernel the plan picks (from the run's fixed-kernel columns)."""
        if self.plan_backend == "cuda" and CUDA in self.times:
            return self.times[CUDA]
        if self.plan_backend == "triton" and TRITON in self.times:
            return self.times[TRITON]
        return None


# bench_moe.py names a shape of another width or group than the model's "<model>@tp<N>-int8-g128"
FORM_SUFFIX = re.compile(r"-int(\d+)-g(-?\d+)$")


def shape_of(name: str, shapes) -> tuple[str, Shape] | None:
    """(set, Shape) of a run's shape name, its width and group taken from the name's suffix (FORM_SUFFIX), or
    None when the model is not a catalog shape."""
    if name in shapes:  # a catalog name that carries a suffix itself (gpt-oss-20b@tp4-int4-g32)
        return shapes[name]
    base = FORM_SUFFIX.sub("", name)
    if base not in shapes:
        return None
    split, s = shapes[base]
    if form := FORM_SUFFIX.search(name):
        bits, gs = int(form.group(1)), int(form.group(2))
        s = dataclasses.replace(s, name=name, bits=bits)
        if gs != s.gs:
            return None  # a re-grouped shape: its GEMMs' groups are bench_moe's to derive, not this report's
    return split, s


def points(times, shapes, zero_points: bool = False) -> list[Point]:
    from vllm_wna16_plugin import launch_plan
    from vllm_wna16_plugin.backends.cuda import RULE_MAX_M, RULE_MIN_M, rule_takes
    from vllm_wna16_plugin.backends.humming import humming_takes
    from vllm_wna16_plugin.backends.marlin import marlin_takes
    from vllm_wna16_plugin.kernels.options import PLAN_DEVICES

    h200 = PLAN_DEVICES["sm90"]
    out = []
    for (shape, m), t in sorted(times.items()):
        if (found := shape_of(shape, shapes)) is None:
            continue
        split, s = found
        problem = problem_of(s, zero_points)
        rule = rule_takes(problem, m, h200) if RULE_MIN_M <= m <= RULE_MAX_M else None
        try:
            backend = launch_plan.plan(problem, m, h200).backend
        except ValueError:
            backend = None
        out.append(Point(split, shape, m, t, rule, backend, humming_takes(problem, m, h200),
                         marlin_takes(problem, m, h200)))  # fmt: skip
    return sorted(out, key=lambda p: (p.split != "dev", p.shape, p.m))


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def report(pts: list[Point]) -> str:
    lines = ["| set | shape | M | auto µs | triton | cuda | plan | × Marlin | × Humming | auto / best "
             "| composed: runs | × Marlin | × Humming | with Marlin: runs | × Marlin |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in pts:
        best = p.best_fixed
        lines.append(
            f"| {p.split} | {p.shape} | {p.m} | {fmt(p.times.get(AUTO), '.1f')} | {fmt(p.times.get(TRITON), '.1f')} "
            f"| {fmt(p.times.get(CUDA), '.1f')} | {p.plan_backend or '-'} | {fmt(p.speedup('vllm-marlin'))} "
            f"| {fmt(p.speedup('vllm-humming'))} | {fmt(p.times[AUTO] / best if best and AUTO in p.times else None)} "
            f"| {'humming' if p.humming else 'plugin'} | {fmt(p.speedup('vllm-marlin', COMPOSED))} "
            f"| {fmt(p.speedup('vllm-humming', COMPOSED))} | {'marlin' if p.marlin else 'plugin'} "
            f"| {fmt(p.speedup('vllm-marlin', WITH_MARLIN))} |"
        )
    lines += ["", "| set | check | result |", "|---|---|---|"]
    for split in sorted({p.split for p in pts}):
        sp = [p for p in pts if p.split == split]
        for of in (AUTO, COMPOSED, WITH_MARLIN):
            for peer in PEERS if of != WITH_MARLIN else ("vllm-marlin",):
                low = [p for p in sp if p.m <= 16]
                lines.append(f"| {split} | {of}: geomean × {peer}, M <= 16 (target >= 1.2) "
                             f"| {fmt(geomean(p.speedup(peer, of) for p in low))} |")  # fmt: skip
                for cap, m_set, target in ((1.0, lambda m: m <= 64, "M <= 64"), (0.9, lambda m: m == 256, "M = 256")):
                    pick = [p for p in sp if m_set(p.m) and p.speedup(peer, of) is not None]
                    worst = min(pick, key=lambda p: p.speedup(peer, of), default=None)
                    below = sum(p.speedup(peer, of) < cap for p in pick)
                    lines.append(
                        f"| {split} | {of}: × {peer} at {target} (target >= {cap}) | {below} of {len(pick)} below; "
                        f"worst {fmt(worst.speedup(peer, of) if worst else None)} ({worst.shape if worst else '-'} "
                        f"M={worst.m if worst else '-'}) |"
                    )
        regret = [(p.times[AUTO] / p.best_fixed, p) for p in sp if AUTO in p.times and p.best_fixed]
        over = [r for r in regret if r[0] > 1.10]
        worst = max(regret, key=lambda r: r[0], default=None)
        lines.append(f"| {split} | auto > 1.10 × the best fixed kernel | {len(over)} of {len(regret)}; worst "
                     f"{fmt(worst[0] if worst else None)} ({worst[1].shape if worst else '-'} "
                     f"M={worst[1].m if worst else '-'}) |")  # fmt: skip
        planned = [(p.rule_time / p.best_fixed, p) for p in sp if p.rule_time and p.best_fixed]
        over = [r for r in planned if r[0] > 1.10]
        worst = max(planned, key=lambda r: r[0], default=None)
        lines.append(f"| {split} | this commit's plan (its kernel's column) > 1.10 × the best fixed kernel | {len(over)} of "
                     f"{len(planned)}; worst {fmt(worst[0] if worst else None)} ({worst[1].shape if worst else '-'} "
                     f"M={worst[1].m if worst else '-'}) |")  # fmt: skip
        decided = [p for p in sp if p.rule_cuda is not None and TRITON in p.times and CUDA in p.times]
        wrong = [p for p in decided if p.rule_cuda != (p.times[CUDA] < p.times[TRITON])]
        costly = [p for p in wrong if max(p.times[CUDA], p.times[TRITON]) / min(p.times[CUDA], p.times[TRITON]) > 1.1]
        lines.append(f"| {split} | the cuda rule's decisions against the faster kernel | {len(wrong)} of "
                     f"{len(decided)} wrong, {len(costly)} by more than 10% |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+", type=Path, help="bench_moe.py run CSVs of --catalog shapes")
    ap.add_argument("--md", type=Path, default=None, help="also write the report here")
    ap.add_argument("--zero-points", action="store_true", help="the runs timed zero-point layers (bench_moe.py "
                    "--zero-points: their shape names do not say so)")  # fmt: skip
    args = ap.parse_args(argv)
    text = report(points(read_times(args.csv), catalog_shapes(), args.zero_points))
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
