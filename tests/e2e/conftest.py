"""Shared pieces of the end-to-end tests (GPU only): tiny checkpoints, one LLM run per process, agreement.

The checkpoints are written by make_checkpoint, as a user's would be by
`vllm-wna16 make-checkpoint`. Each LLM(...) run is a subprocess through
llm_runner.py, with the plugin backend in VLLM_WNA16_PLUS_BACKEND.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

RUNNER = Path(__file__).with_name("llm_runner.py")
PROMPTS = ["The capital of France is", "Water is made of hydrogen and", "1 2 3 4 5"]
# Greedy decoding of random weights: bf16 accumulation order may flip a near-tie. A run generates
# like the reference when, at every step up to and including its first divergence, the top
# log-probs both runs list differ by at most FIRST_STEP_LOGPROB_ATOL at step 0 (the prefill: both
# runs saw the same prompt) and LOGPROB_ATOL after it (differences compound through the KV cache),
# and, at the divergence, each run's token is among the other's top log-probs (a near-tie).
# Measured on the H200 (ae0b66c): step 0 differed by at most 0.118 (GPTQ int8, vLLM's own Marlin
# included), later steps by at most 0.18; the expert-rotation control differed by 0.65 at step 0.
FIRST_STEP_LOGPROB_ATOL = 0.25
LOGPROB_ATOL = 0.5
# vllm serve's memory flags, as llm_runner's: a fixed 256 MiB KV cache skips vLLM's memory profiling,
# which other processes on the GPU would upset (gpu_session.sh e2e-par runs serve beside LLM runs)
SHARED_GPU_MEMORY = ["--gpu-memory-utilization", "0.04", "--kv-cache-memory-bytes", str(256 << 20)]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (servers in these tests listen on loopback only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass
class Run:
    """One LLM(...) run: the runner's JSON result and the process's whole log."""

    result: dict
    log: str

    @property
    def ok(self) -> bool:
        return bool(self.result.get("ok"))

    def require_ok(self, what: str) -> Run:
        if not self.ok:
            raise AssertionError(f"{what}: LLM run failed: {self.result.get('error_type')}: "
                                 f"{self.result.get('error')}\n{first_errors(self.log)}\n--- error tail ---\n"
                                 f"{self.result.get('detail', '')[-2500:]}")  # fmt: skip
        return self


def first_errors(log: str, context: int = 12) -> str:
    """The lines around the first errors of a log: they tell more than a traceback's tail."""
    lines = log.splitlines()
    hits = [i for i, ln in enumerate(lines) if "Error" in ln or "error:" in ln][:3]
    out = "\n...\n".join("\n".join(lines[max(0, i - context) : i + 4]) for i in hits) or log[-3000:]
    sub = [i for i, ln in enumerate(lines) if "Error raised in subprocess" in ln][:1]  # vLLM's inspection
    return out + "".join("\n--- subprocess stderr ---\n" + "\n".join(lines[i : i + 60]) for i in sub)


_PROGRESS_LOCK = threading.Lock()
_CONFIG = None  # pytest's config: its terminal reporter prints progress while the tier runs


def pytest_configure(config):
    global _CONFIG
    _CONFIG = config


def progress(line: str) -> None:
    """One line on the terminal now: a GPU call's time limit may cut the run before pytest's summary."""
    if _CONFIG is None or (reporter := _CONFIG.pluginmanager.get_plugin("terminalreporter")) is None:
        return
    capture = _CONFIG.pluginmanager.get_plugin("capturemanager")  # a run ends in a worker thread, mid-test
    with _PROGRESS_LOCK, capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        reporter.write_line(f"[e2e] {line}")
        reporter._tw.flush()


def pytest_runtest_logreport(report):
    """Each test's outcome and time as it ends, with the failure's tail (pytest prints failures last)."""
    if report.when == "call" or report.outcome == "failed":
        progress(f"{report.outcome.upper()} {report.nodeid} ({report.duration:.0f} s)")
        if report.failed:
            progress(report.longreprtext[-2500:])


def e2e_jobs() -> int:
    """How many LLM(...) runs may share the GPU at once (E2E_JOBS, default 1: one at a time)."""
    return max(1, int(os.environ.get("E2E_JOBS", "1")))


def _llm_spec(model: Path, *, backend: str | None = None, quantization: str | None = "moe_wna16_plus",
              eager: bool = False, tp: int = 1, ep: bool = False, moe_backend: str = "auto", prompts=None,
              max_tokens: int = 16, dtype: str | None = None, env: dict[str, str] | None = None,
              reload_from: Path | None = None) -> tuple[str, dict, str | None]:  # fmt: skip
    tag = f"{backend or moe_backend}-{quantization}-tp{tp}{'-ep' if ep else ''}-{'eager' if eager else 'graphs'}"
    spec = dict(model=str(model), quantization=quantization, prompts=prompts or PROMPTS, eager=eager, tp=tp,
                moe_backend=moe_backend, max_tokens=max_tokens)  # fmt: skip
    if ep:  # vLLM's --enable-expert-parallel: each rank holds whole experts (needs tp > 1 to split them)
        spec["ep"] = True
    if dtype is not None:  # vLLM's --dtype; the checkpoint's own (bfloat16) when None
        tag, spec["dtype"] = f"{tag}-{dtype}", dtype
    if env:  # variables the run sets before it imports vLLM
        tag, spec["env"] = tag + "".join(f"-{k}={v}" for k, v in sorted(env.items())), dict(env)
    if reload_from is not None:  # generate, reload this checkpoint's weights in place, generate again (llm_runner)
        tag, spec["reload_from"] = f"{tag}-reload-{Path(reload_from).name}", str(reload_from)
    return tag, spec, backend


def _run_llm_now(model: Path, tmp_path: Path, timeout: int = 900, **kwargs) -> Run:
    tag, spec, backend = _llm_spec(model, **kwargs)
    spec_path, out_path = tmp_path / f"{tag}.spec.json", tmp_path / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, TRITON_INTERPRET="0")
    for name in ("VLLM_WNA16_PLUS_BACKEND", "VLLM_WNA16_PLUS_HUMMING", "VLLM_WNA16_PLUS_MARLIN"):  # the run's own
        env.pop(name, None)
    if backend:
        env["VLLM_WNA16_PLUS_BACKEND"] = backend
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    log = proc.stdout + proc.stderr
    if not out_path.exists():
        raise AssertionError(f"{tag}: the runner died (rc {proc.returncode}) before writing a result\n"
                             f"{first_errors(log)}")  # fmt: skip
    run = Run(json.loads(out_path.read_text()), log)
    progress(f"run {model.name} {tag}: {'ok' if run.ok else run.result.get('error_type')} "
             f"in {run.result.get('seconds', 0):.0f} s {run.result.get('phases', {})}")  # fmt: skip
    return run


_POOL: ThreadPoolExecutor | None = None
_STARTED: dict[str, Future] = {}


def _key(model: Path, **kwargs) -> str:
    kwargs.pop("timeout", None)
    _, spec, backend = _llm_spec(model, **kwargs)
    return json.dumps([spec, backend], sort_keys=True)


def start_llm(model: Path, tmp_path: Path, **kwargs) -> None:
    """Start this run in the background when E2E_JOBS > 1; run_llm with the same arguments waits for it.

    Each run is its own process with a small, fixed KV cache (llm_runner), so E2E_JOBS of them fit
    on one GPU; the tests stay one run each, only the waiting overlaps."""
    global _POOL
    if e2e_jobs() == 1:
        return
    key = _key(model, **kwargs)
    if key not in _STARTED:
        _POOL = _POOL or ThreadPoolExecutor(max_workers=e2e_jobs(), thread_name_prefix="llm-run")
        _STARTED[key] = _POOL.submit(_run_llm_now, model, tmp_path, **kwargs)


def run_llm(model: Path, tmp_path: Path, **kwargs) -> Run:
    """LLM(model, quantization=...) greedy on `prompts` in a fresh process; backend sets VLLM_WNA16_PLUS_BACKEND.

    Keywords: backend, quantization, eager, tp, ep, moe_backend, prompts, max_tokens, dtype, env, reload_from, timeout. A run
    started earlier by start_llm with the same arguments is waited for instead of run again."""
    started = _STARTED.get(_key(model, **kwargs))
    return started.result() if started is not None else _run_llm_now(model, tmp_path, **kwargs)


def agreed_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def generation_disagreement(got: dict, ref: dict) -> tuple[str | None, float]:
    """Why `got` (an llm_runner result) does not generate like `ref`, or None; and the largest log-prob
    difference seen on the compared steps (the tolerances' contract above)."""
    worst = 0.0
    for i, (r, g) in enumerate(zip(ref["tokens"], got["tokens"], strict=True)):
        rl, gl = ref["step_logprobs"][i], got["step_logprobs"][i]
        d = agreed_prefix(r, g)
        if d == min(len(r), len(g)) and len(r) != len(g):
            return f"prompt {i}: one run stopped at step {d}: {g} vs reference {r}", worst
        for step in range(min(d + 1, len(r))):  # the agreed steps share a prefix; so does the divergence
            common = set(rl[step]) & set(gl[step])
            if not common:
                return f"prompt {i} step {step}: no common top token", worst
            diff = max(abs(rl[step][t] - gl[step][t]) for t in common)
            worst = max(worst, diff)
            atol = FIRST_STEP_LOGPROB_ATOL if step == 0 else LOGPROB_ATOL
            if diff > atol:
                return f"prompt {i} step {step}: top log-probs differ by {diff:.3g} > {atol}", worst
        if d < len(r):
            mine, theirs = str(g[d]), str(r[d])
            if mine not in rl[d] or theirs not in gl[d]:
                return (f"prompt {i} diverges at step {d} ({g} vs reference {r}) and not on a near-tie: "
                        f"each run's token is not among the other's top log-probs"), worst  # fmt: skip
    return None, worst


def assert_generates_like(got: Run, ref: Run, what: str) -> float:
    """generation_disagreement is None; returns the largest log-prob difference (for the record)."""
    why, worst = generation_disagreement(got.result, ref.result)
    assert why is None, f"{what}: {why}"
    return worst


def rotate_experts(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` whose expert e holds expert e+1's tensors (mod E), in every layer:
    a loader bug of the kind that swaps experts, which the agreement check must catch."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        pattern = re.compile(r"^(.*\.experts\.)(\d+)(\..*)$")
        ids = {int(m.group(2)) for k in tensors if (m := pattern.match(k))}
        if ids:
            rotated = {}
            for k, v in tensors.items():
                m = pattern.match(k)
                rotated[f"{m.group(1)}{(int(m.group(2)) - 1) % len(ids)}{m.group(3)}" if m else k] = v
            save_file(rotated, f, metadata={"format": "pt"})
    return dst


def dequantize_attention(src: Path, dst: Path) -> Path:
    """A copy of GPTQ checkpoint `src` whose attention projections hold the float weights their GPTQ tensors
    dequantize to (bfloat16, under `.weight`), excluded from quantization by GPTQModel's negative `dynamic`
    rule: the same model with float attention, the reference for the asymmetric GPTQ linear layers."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from vllm_wna16_plugin.checkpoint_config import GPTQ_CHECKPOINT_FORMATS
    from vllm_wna16_plugin.packing import dequantize, unpack_gptq

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    if qc.get("quant_method") != "gptq" or qc.get("desc_act"):
        raise ValueError(f"{src}: dequantize_attention reads GPTQ checkpoints without desc_act")
    offset = GPTQ_CHECKPOINT_FORMATS[qc.get("checkpoint_format", "gptq")]
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        for name in [k for k in tensors if re.search(r"\.self_attn\.[qkvo]_proj\.qweight$", k)]:
            p = name.removesuffix(".qweight")
            qw = unpack_gptq(tensors.pop(f"{p}.qweight"), tensors.pop(f"{p}.qzeros"), tensors.pop(f"{p}.scales"),
                             qc["bits"], offset, has_zero_point=not qc["sym"])  # fmt: skip
            tensors.pop(f"{p}.g_idx", None)
            tensors[f"{p}.weight"] = dequantize(qw).to(torch.bfloat16).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    qc["dynamic"] = {**(qc.get("dynamic") or {}), "-:.*self_attn.*": {}}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


requires_gpu = pytest.mark.skipif(gpus() == 0, reason="needs a CUDA GPU")

# what a run under `auto` logs when its layers composed with Humming or Marlin, and when told not to (compose.py)
HUMMING_COMPOSED = "run on Humming (vLLM's default here); the layer keeps a second copy"
HUMMING_NOT_COMPOSED = "not composed with Humming (VLLM_WNA16_PLUS_HUMMING=0)"
MARLIN_COMPOSED = "run on Marlin (vLLM's default here); the layer keeps a second copy"
MARLIN_NOT_COMPOSED = "not composed with Marlin (VLLM_WNA16_PLUS_MARLIN=0)"
HOPPER_COMPOSED = "run on the hopper kernel; the layer keeps another copy"
HOPPER_RAN = "the hopper kernel ran its first batch"  # backends/hopper.py's FIRST_RUN
HOPPER_NOT_COMPOSED = "not composed with the hopper kernel (VLLM_WNA16_PLUS_HOPPER=0)"


def humming_missing() -> str | None:
    """Why auto cannot compose with Humming on this machine, or None where it can."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "the Humming rule speaks for sm90 only"
    from vllm_wna16_plugin.backends.humming import humming_api_error

    return humming_api_error()
