"""Backend selection that explains itself.

`auto` walks the registry in order and takes the first backend whose
`incompatibility_reason` is None; the choice and every rejection are logged
once per layer type. An explicit choice that cannot work raises at load time
with the reason and the backends that would. The user's choice comes from
`VLLM_WNA16_PLUS_BACKEND` (plugin names) or else vLLM's `--moe-backend`
(`auto`, `triton`, `marlin`, `humming`, `emulation`); vLLM's other `--moe-backend` names run
other quantization formats, and asking for one with `moe_wna16_plus` is an error that says so.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from vllm_wna16_plugin.backends import Backend, MoEProblem, registry

ENV_BACKEND = "VLLM_WNA16_PLUS_BACKEND"
# vLLM's --moe-backend names that mean something for this plugin's layers.
VLLM_BACKEND_NAMES = {
    "auto": "auto",
    "triton": "triton",
    "marlin": "marlin",
    "humming": "humming",
    "emulation": "reference",
}


@dataclass(frozen=True)
class Verdict:
    backend: str
    reason: str | None  # None: compatible

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class Selection:
    backend: Backend
    requested: str  # plugin name or "auto"
    source: str  # where the request came from, for messages
    verdicts: tuple[Verdict, ...]
    problem: MoEProblem  # the problem as judged (options.explicit set): what prepare and run take

    def explain(self) -> str:
        lines = [f"moe_wna16_plus: using backend '{self.backend.name}' ({self.source}: {self.requested})"]
        for v in self.verdicts:
            mark = "ok" if v.ok else f"rejected: {v.reason}"
            lines.append(f"  - {v.backend}: {mark}")
        return "\n".join(lines)


def resolve_request(moe_backend: str | None, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(plugin backend name or 'auto', source) from the env var, else vLLM's --moe-backend."""
    env = os.environ if env is None else env
    names = list(registry())
    plugin_choice = env.get(ENV_BACKEND, "").strip().lower()
    if plugin_choice and plugin_choice != "auto" and plugin_choice not in names:
        raise ValueError(f"{ENV_BACKEND}={plugin_choice!r} is not a backend; supported: {['auto'] + names}")
    choice = (moe_backend or "auto").strip().lower().replace("-", "_")
    if plugin_choice and plugin_choice != "auto":  # the plugin's variable wins; the selection log says over what
        overridden = choice != "auto" and VLLM_BACKEND_NAMES.get(choice) != plugin_choice
        return plugin_choice, ENV_BACKEND + (f" (over --moe-backend={choice})" if overridden else "")
    if choice not in VLLM_BACKEND_NAMES:
        from vllm_wna16_plugin import _vllm

        what = (
            "is one of vLLM's MoE backends, but not one for weight-only int4/int8 experts"
            if choice in _vllm.vllm_moe_backend_names()
            else "is not a MoE backend of this vLLM"
        )
        raise ValueError(
            f"--moe-backend={choice!r} {what}; with --quantization moe_wna16_plus use one of "
            f"{list(VLLM_BACKEND_NAMES)} (or set {ENV_BACKEND} to one of {names})"
        )
    return VLLM_BACKEND_NAMES[choice], "--moe-backend"


def collect_verdicts(problem: MoEProblem) -> tuple[Verdict, ...]:
    out = []
    for name, backend in registry().items():
        try:
            reason = backend.incompatibility_reason(problem)
        except Exception as exc:  # noqa: BLE001 - a check must never abort selection
            reason = f"check failed: {type(exc).__name__}: {exc}"
        out.append(Verdict(name, reason))
    return tuple(out)


def select_backend(problem: MoEProblem, requested: str = "auto", source: str = "auto") -> Selection:
    """The backend to run `problem` with; raises ValueError if an explicit request cannot work.

    The Selection's problem is `problem` with options.explicit saying whether the user named the
    backend (the one given is not changed), which a backend's prepare and run read: an explicit `cuda`
    always runs the CUDA kernel, while auto's `cuda` hands batches outside the measured crossover to
    triton.
    """
    backends = registry()
    as_auto = dataclasses.replace(problem, options=dataclasses.replace(problem.options, explicit=False))
    verdicts = collect_verdicts(as_auto)
    working = [v.backend for v in verdicts if v.ok]
    if requested != "auto":
        if requested not in backends:
            raise ValueError(f"backend {requested!r} is unknown; supported: {['auto'] + list(backends)}")
        # An explicit request may unlock test-only paths (Triton's interpreter on CPU).
        explicit = dataclasses.replace(problem, options=dataclasses.replace(problem.options, explicit=True))
        verdict = Verdict(requested, backends[requested].incompatibility_reason(explicit))
        verdicts = tuple(verdict if v.backend == requested else v for v in verdicts)
        if not verdict.ok:
            raise ValueError(
                f"moe_wna16_plus: backend '{requested}' ({source}) cannot run {problem.describe()}: "
                f"{verdict.reason}. Backends that would work: {working or 'none'}"
            )
        return Selection(backends[requested], requested, source, verdicts, explicit)
    if not working:
        raise ValueError(
            f"moe_wna16_plus: no backend can run {problem.describe()}: "
            + "; ".join(f"{v.backend}: {v.reason}" for v in verdicts)
        )
    return Selection(backends[working[0]], "auto", source, verdicts, as_auto)
