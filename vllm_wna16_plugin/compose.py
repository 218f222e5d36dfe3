"""auto's layer composed with one of vLLM's own MoE kernels: which one, for which batches, if its copy fits.

    partner(selection) -> (Partner | None, why)       the first of partners() that can take part
    Partner.takes(problem, m, device) -> bool         that kernel's measured rule (in its backend's module)

A layer that auto runs on the plugin's kernels (cuda / triton) can also hold a second copy of its experts in the
layout of vLLM's default kernel for the layer and hand that kernel the batch sizes it runs faster: Humming (vLLM
0.33-0.34's default on sm90, backends/humming.py's rule) where humming-kernels is installed, else Marlin (vLLM
0.26-0.32's default, backends/marlin.py's rule). One partner a layer, in that order: the first that can run the
layer and whose rule speaks for it decides, and a layer it leaves (its variable at 0, or memory) is not handed to
the next, so one copy at most is ever added. The copy counts against vLLM's memory budget: compose_decision.
launch_plan.plan then names the partner for the batches its rule takes.

The plugin's own sm90 grouped GEMM (backends/hopper.py) is composed the same way, beside any partner: its copy
of the layer is decided by its own variable (VLLM_WNA16_PLUS_HOPPER) and the same memory rule, counting the
partner's copy, and the plan gives it the batches its rule takes that the partner's does not.

    hopper_composable(selection) -> why not, or None     with_hopper(selection) -> the selection composed
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from vllm_wna16_plugin.backends.base import MoEProblem, experts_read, layer_device, pairs_per_expert
from vllm_wna16_plugin.oracle import Selection

# auto's layers that can hand batches to a partner: those the plugin's own kernels run
COMPOSABLE = ("cuda", "triton")
# auto composes a layer only while this process's memory, with the layer's second copy, stays within this
# share of what vLLM may use (gpu_memory_utilization x the device's memory): vLLM sizes its KV cache from
# the rest after loading, and the copies count as weights there
COMPOSE_MAX_BUDGET_SHARE = 0.5
# the batch sizes a partner must take one of to be worth a copy (vLLM's CUDA-graph sizes reach 512)
PROBE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Partner:
    """One vLLM kernel auto can compose with: its backend name, the variable that turns it off or on
    (compose_setting's values), its rule (applies: why it does not speak for a layer on a device, or None;
    takes: whether it runs m tokens) with the rule's source, and the bytes of its copy of a layer."""

    backend: str
    label: str
    env: str
    source: str
    applies: Callable[[MoEProblem, object], str | None]
    takes: Callable[[MoEProblem, int, object], bool]
    copy_bytes: Callable[[MoEProblem], int]

    def why(self, problem: MoEProblem, m: int, taken: bool) -> str:
        """The plan's line for m tokens: what the rule read and whose the batch is."""
        rows, read = pairs_per_expert(problem, m), experts_read(problem, m) / 1e6
        whose = f"{self.label}'s" if taken else "the plugin's"
        return f"M={m}: {rows:.1f} rows per hit expert, about {read:.0f} MB of expert weights read: {whose} ({self.source})"


def partners() -> tuple[Partner, ...]:
    """The partners in auto's order: Humming, then Marlin."""
    from vllm_wna16_plugin.backends import humming, marlin

    return (
        Partner("humming", "Humming", humming.ENV_COMPOSE, humming.HUMMING_RULE_SOURCE, humming.humming_rule_applies,
                humming.humming_takes, humming.humming_copy_bytes),
        Partner("marlin", "Marlin", marlin.ENV_COMPOSE, marlin.MARLIN_RULE_SOURCE, marlin.marlin_rule_applies,
                marlin.marlin_takes, marlin.marlin_copy_bytes),
    )  # fmt: skip


def partner_named(name: str) -> Partner:
    return next(p for p in partners() if p.backend == name)


def composable_with(selection: Selection, name: str) -> str | None:
    """Why auto cannot compose this layer with the partner `name`, or None when it can: an auto cuda / triton
    layer that the partner also runs (its verdict in the selection) and that the partner's rule speaks for on
    the layer's device, taking at least one batch size."""
    p = partner_named(name)
    problem = selection.problem
    if selection.requested != "auto":
        return f"the layer runs {selection.backend.name!r} as asked ({selection.source})"
    if selection.backend.name not in COMPOSABLE:
        return f"auto runs it on {selection.backend.name!r}, not on the plugin's kernels"
    verdict = next((v for v in selection.verdicts if v.backend == name), None)
    if verdict is None or not verdict.ok:
        return f"{p.label} cannot run it ({verdict.reason if verdict else 'not registered'})"
    device = layer_device(problem)
    if reason := p.applies(problem, device):
        return f"the {p.label} rule does not speak for it: {reason}"
    if not any(p.takes(problem, m, device) for m in PROBE_SIZES):
        return f"{p.label} would take none of its batch sizes"
    return None


def partner(selection: Selection) -> tuple[Partner | None, str]:
    """The partner auto composes this layer with (the first of partners() it can), or None and why none."""
    reasons = []
    for p in partners():
        if (reason := composable_with(selection, p.backend)) is None:
            return p, ""
        reasons.append(f"{p.label}: {reason}")
    return None, "; ".join(reasons)


def compose_with(selection: Selection, name: str) -> Selection:
    """The selection with RunOptions.compose_with set to `name` (callers check composable_with first)."""
    problem = selection.problem
    composed = dataclasses.replace(problem, options=dataclasses.replace(problem.options, compose_with=name))
    return dataclasses.replace(selection, problem=composed)


# the batch sizes the hopper rule must take one of (prefill included: up to vLLM's default token budget)
HOPPER_PROBE_SIZES = (*PROBE_SIZES, 1024, 2048, 4096, 8192)


def hopper_composable(selection: Selection, max_tokens: int | None = None) -> str | None:
    """Why auto cannot hand some of this layer's batches to the hopper kernel, or None when it can: an auto cuda /
    triton layer in the kernel's scope (backends/hopper.hopper_scope) with the extension built, whose rule (fitted on
    the layer's bits: hopper_rule_gap) takes
    at least one batch size of HOPPER_PROBE_SIZES up to max_tokens (the engine's token budget per step) that the
    layer's partner, where its rule goes first (backends/hopper.HOPPER_BEFORE), leaves: a copy no batch can use is
    not kept."""
    from vllm_wna16_plugin.backends.hopper import HOPPER_BEFORE, hopper_rule_gap, hopper_scope, hopper_takes

    problem = selection.problem
    if selection.requested != "auto":
        return f"the layer runs {selection.backend.name!r} as asked ({selection.source})"
    if selection.backend.name not in COMPOSABLE:
        return f"auto runs it on {selection.backend.name!r}, not on the plugin's kernels"
    device = layer_device(problem)
    if reason := hopper_scope(problem, device) or hopper_rule_gap(problem):
        return reason
    if not problem.options.plan_only:
        from vllm_wna16_plugin.kernels.hopper_ops import extension_error

        if reason := extension_error():
            return reason
    sizes = [m for m in HOPPER_PROBE_SIZES if max_tokens is None or m <= max_tokens] or [max_tokens]
    name = problem.options.compose_with
    first = partner_named(name) if name not in HOPPER_BEFORE else None
    if not any(hopper_takes(problem, m, device) and not (first and first.takes(problem, m, device)) for m in sizes):
        budget = "" if max_tokens is None else f" up to the engine's {max_tokens} tokens a step"
        left = f" that {first.label}'s (composed, its rule first) does not" if first else ""
        return f"its rule takes none of the layer's batch sizes{budget}{left}"
    return None


def with_hopper(selection: Selection) -> Selection:
    """The selection with RunOptions.hopper set (callers check hopper_composable first)."""
    problem = selection.problem
    composed = dataclasses.replace(problem, options=dataclasses.replace(problem.options, hopper=True))
    return dataclasses.replace(selection, problem=composed)


def compose_setting(value: str | None, env: str) -> str:
    """A partner variable's value (env names it) as "auto", "on" or "off"; ValueError naming the variable
    for anything else."""
    v = (value or "auto").strip().lower()
    if v in ("0", "off", "false", "no"):
        return "off"
    if v in ("1", "on", "true", "yes"):
        return "on"
    if v != "auto":
        raise ValueError(f"{env}={value!r}: use auto (compose while memory allows), 1 (always) or 0 (never)")
    return "auto"


def check_settings(environ) -> None:
    """Every partner's variable (and hopper's) read as loading reads it: a bad value is refused before any weight
    is."""
    from vllm_wna16_plugin.backends.hopper import ENV_COMPOSE as HOPPER_ENV

    for env in (*(p.env for p in partners()), HOPPER_ENV):
        compose_setting(environ.get(env), env)


def compose_decision(
    setting: str | None,
    copy_bytes: int,
    used_bytes: int,
    free_bytes: int,
    total_bytes: int,
    utilization: float,
    env: str,
) -> tuple[bool, str]:
    """(compose, why) for one layer: the partner's variable (env) and its value (compose_setting), the bytes of
    its second copy (Partner.copy_bytes), this process's device memory now, the device's free and total memory,
    and the share vLLM may use (gpu_memory_utilization)."""
    mode = compose_setting(setting, env)
    if mode != "auto":
        return mode == "on", f"{env}={setting}"
    gib = 2**30
    cap = COMPOSE_MAX_BUDGET_SHARE * utilization * total_bytes
    if copy_bytes <= free_bytes and used_bytes + copy_bytes <= cap:
        return True, (f"this process's {(used_bytes + copy_bytes) / gib:.1f} GiB with it stay within half of vLLM's "
                      f"{utilization * total_bytes / gib:.1f} GiB")  # fmt: skip
    return False, (
        f"memory: this process's {(used_bytes + copy_bytes) / gib:.1f} GiB with the copy would pass half of vLLM's "
        f"{utilization * total_bytes / gib:.1f} GiB (gpu_memory_utilization {utilization:g}; {env}=1 composes "
        f"anyway)"
    )


__all__ = [
    "COMPOSABLE",
    "Partner",
    "compose_decision",
    "compose_setting",
    "compose_with",
    "composable_with",
    "hopper_composable",
    "partner",
    "partner_named",
    "partners",
    "with_hopper",
]
